"""Attention metadata: what a step's flat batch of tokens is, in tensors only (so a captured
graph replays with new contents), its builders, and the per-step context the layers share.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Sequence

import torch

from .kv_cache import ModelCaches


INDEX_DTYPES = (torch.int32, torch.int64)     # token ids, positions and every metadata tensor


def check_index_tensor(t, what: str) -> None:
    """`what` must be a tensor of integers (int32 / int64): a TypeError naming it otherwise. The
    one rule for the step's index tensors, at the model contract and the runtime's boundary."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{what} must be an integer tensor (int32 or int64), got {t.dtype}")


def _meta_field(rows: str, decode, *, static: bool = False, offset: str | None = None,
                optional: bool = False):
    """One field of AttentionMetadata and how it behaves, in one place:
      rows    its dim 0: "tokens" [N], "seqs" [B] or "seqs+1" [B+1]
      decode  in a padded decode bucket (one token per sequence): "arange" (the same for every
              decode step of that many rows: never copied), the value padding rows hold
              ("scratch" = the caches' scratch slot), or None (not part of a decode step)
      static  changes only when a persistent decode batch's rows do (see static_key)
      offset  when two batches are concatenated, the second's values move by the first's
              "seqs" or "tokens" count."""
    info = dict(rows=rows, decode=decode, static=static, offset=offset)
    return field(default=None, metadata=info) if optional else field(metadata=info)


@dataclass
class AttentionMetadata:
    """A flat batch: N tokens from B sequences, sequence b owning tokens
    query_start[b]:query_start[b+1] at positions chunk_start[b]..seq_len[b]-1."""
    # [N] batch index of each token
    token_seq: torch.Tensor = _meta_field("tokens", "arange", offset="seqs")
    # [B] cache slot (window ring / state row) of each sequence
    seq_slot: torch.Tensor = _meta_field("seqs", "scratch", static=True)
    # [B] position of the first new token
    chunk_start: torch.Tensor = _meta_field("seqs", 0)
    # [B] context length after this call
    seq_len: torch.Tensor = _meta_field("seqs", 1)
    # [B+1] offsets into the token batch
    query_start: torch.Tensor = _meta_field("seqs+1", "arange", offset="tokens")
    # [B, max_blocks] cache block ids, -1 = none
    block_table: torch.Tensor = _meta_field("seqs", -1, static=True)
    # [B] token whose logits are returned (the last of each seq)
    logits_index: torch.Tensor = _meta_field("seqs", "arange", offset="tokens")
    # [B] first position the window may see (decoder replay only)
    window_floor: torch.Tensor | None = _meta_field("seqs", None, optional=True)
    # Names the contents of the static fields (seq_slot, block_table): two metadata with the
    # same non-None key hold equal ones (a DecodeBatch hands out a fresh key whenever either
    # changes), so a decode graph that already holds them can skip reloading them.
    static_key: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_slot.shape[0]

    @classmethod
    def tensor_fields(cls) -> tuple:
        """The dataclass fields that hold tensors, in order (static_key is not one); read once,
        since a decode step walks them (load_decode_rows_)."""
        return _TENSOR_FIELDS

    def batch_tensors(self) -> tuple:
        """Every tensor of the batch, in field order; dim 0 of each is its token or sequence
        count (what a symbolic-batch graph marks dynamic)."""
        return tuple(t for t in (getattr(self, f.name) for f in self.tensor_fields()) if t is not None)

    @classmethod
    def decode_buffers(cls, rows: int, max_blocks: int, device, scratch_slot: int,
                       use: dict | None = None) -> "AttentionMetadata":
        """Persistent metadata of `rows` decode rows, every row padding (scratch slot, no
        blocks, one cached token). `use` maps field names to tensors to hold instead of new
        ones (a DecodeBatch keeps its counters in one tensor so a step moves them in one add)."""
        use = use or {}
        i64 = dict(dtype=torch.int64, device=device)
        made = {}
        for f in cls.tensor_fields():
            kind = f.metadata["decode"]
            if kind is None:
                continue
            n = rows + 1 if f.metadata["rows"] == "seqs+1" else rows
            shape = (n, max_blocks) if f.name == "block_table" else (n,)
            if f.name in use:
                made[f.name] = use[f.name]
            elif kind == "arange":
                made[f.name] = torch.arange(n, **i64)
            else:
                made[f.name] = torch.full(shape, scratch_slot if kind == "scratch" else kind, **i64)
        return cls(**made)

    def check_batch(self, num_tokens: int, what: str = "metadata", sizes: bool = True) -> None:
        """Every tensor field is an integer tensor whose dim 0 is its rows kind's count for a
        batch of `num_tokens` tokens and this metadata's sequences (a clear error naming the
        field, not an index error deep inside a layer). Shapes and dtypes only: no host sync;
        sizes=False checks types and ranks only (see model.check_step_inputs)."""
        b = self.num_seqs
        counts = {"tokens": num_tokens, "seqs": b, "seqs+1": b + 1}
        for f in self.tensor_fields():
            t = getattr(self, f.name)
            if t is None:
                continue
            check_index_tensor(t, f"{what}.{f.name}")
            want = counts[f.metadata["rows"]]
            if t.dim() == 0 or (sizes and t.shape[0] != want):
                raise ValueError(f"{what}.{f.name} has shape {list(t.shape)}; dim 0 must be its "
                                 f"{f.metadata['rows']} count {want} ({num_tokens} tokens of {b} sequences)")

    def first_rows(self, n: int, static_key: int | None = None) -> "AttentionMetadata":
        """Views of the first n rows of decode metadata (n tokens of n sequences), named by
        `static_key`."""
        out = {}
        for f in self.tensor_fields():
            t = getattr(self, f.name)
            out[f.name] = None if t is None else t[:n + 1 if f.metadata["rows"] == "seqs+1" else n]
        return AttentionMetadata(**out, static_key=static_key)

    def load_decode_rows_(self, src: "AttentionMetadata", scratch_slot: int, static: bool = True) -> None:
        """Copy a decode step's metadata (n <= rows sequences, one token each) into these
        persistent buffers, padding the rows after n; the fields fixed for a decode step are
        not copied, the static ones only if `static`."""
        n = src.num_seqs
        for f in self.tensor_fields():
            kind = f.metadata["decode"]
            if kind in (None, "arange") or (f.metadata["static"] and not static):
                continue
            pad = scratch_slot if kind == "scratch" else kind
            getattr(self, f.name).fill_(pad)[:n].copy_(getattr(src, f.name))


_TENSOR_FIELDS = tuple(f for f in fields(AttentionMetadata) if f.metadata)


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device`; on CUDA through pinned memory, asynchronously (no wait for the
    kernels already queued: a blocking host-to-device copy would stall the host until they end)."""
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def build_metadata(seq_slots: Sequence[int], chunk_starts: Sequence[int], query_lens: Sequence[int],
                   block_tables: Sequence[Sequence[int]], max_blocks: int,
                   device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata for a batch (host-side lists -> device tensors, built once per step)."""
    b = len(seq_slots)
    if not (len(chunk_starts) == len(query_lens) == len(block_tables) == b):
        raise ValueError(f"metadata lengths differ: {b} slots, {len(chunk_starts)} chunk starts, "
                         f"{len(query_lens)} query lengths, {len(block_tables)} block tables")
    for i, n in enumerate(query_lens):
        if n <= 0:
            raise ValueError(f"sequence {i}: query length {n} must be >= 1")
    table = torch.full((b, max_blocks), -1, dtype=torch.int64)
    for i, blocks in enumerate(block_tables):
        if len(blocks) > max_blocks:
            raise ValueError(f"sequence {i}: {len(blocks)} blocks > max_blocks {max_blocks}")
        table[i, : len(blocks)] = torch.tensor(list(blocks), dtype=torch.int64)
    qlens = torch.tensor(list(query_lens), dtype=torch.int64)
    qstart = torch.zeros(b + 1, dtype=torch.int64)
    qstart[1:] = qlens.cumsum(0)
    starts = torch.tensor(list(chunk_starts), dtype=torch.int64)
    to = dict(device=device)
    return AttentionMetadata(
        token_seq=torch.repeat_interleave(torch.arange(b), qlens).to(**to),
        seq_slot=torch.tensor(list(seq_slots), dtype=torch.int64, **to),
        chunk_start=starts.to(**to), seq_len=(starts + qlens).to(**to),
        query_start=qstart.to(**to), block_table=table.to(**to),
        logits_index=(qstart[1:] - 1).to(**to),
    )


def positions_of(meta: AttentionMetadata) -> torch.Tensor:
    """Token positions implied by the metadata (chunk_start + offset within the chunk)."""
    tok = torch.arange(meta.token_seq.shape[0], device=meta.token_seq.device)
    return meta.chunk_start[meta.token_seq] + tok - meta.query_start[meta.token_seq]


def replay_metadata(meta: AttentionMetadata, replay):
    """Metadata for decoder bounded replay (MODEL.md §9): the decoder layers see only the tokens
    at or after each sequence's replay floor, with their window truncated at that floor.

    replay: an int R (the last R tokens of each sequence's context: floor = seq_len - R, the
    one-call prefill of Session) or a [B] tensor of per-sequence floor positions (0 = nothing
    dropped and the window untruncated, e.g. decode rows; a floor at or past seq_len drops the
    whole chunk, e.g. an early chunk of a chunked prefill). Returns (metadata, token indices of
    the kept tokens in the full batch). A sequence that keeps no token gets an empty query
    range (its logits row is meaningless). Used for prefill only (data-dependent shapes)."""
    if isinstance(replay, torch.Tensor):
        floor = replay.to(device=meta.seq_len.device, dtype=meta.seq_len.dtype)
    else:
        floor = (meta.seq_len - int(replay)).clamp_min(0)
    start = torch.minimum(torch.maximum(meta.chunk_start, floor), meta.seq_len)
    pos = positions_of(meta)
    keep = torch.nonzero(pos >= floor[meta.token_seq]).flatten()
    qlens = meta.seq_len - start
    qstart = torch.zeros_like(meta.query_start)
    qstart[1:] = qlens.cumsum(0)
    sub = replace(meta, token_seq=meta.token_seq[keep], chunk_start=start, query_start=qstart,
                  logits_index=qstart[1:] - 1, window_floor=floor)
    return sub, keep


def concat_metadata(a: AttentionMetadata, b: AttentionMetadata) -> AttentionMetadata:
    """One flat batch of a's sequences followed by b's (same block-table width and device):
    a step's persistent decode rows (DecodeBatch) + its freshly built prefill chunks."""
    if a.block_table.shape[1] != b.block_table.shape[1]:
        raise ValueError(f"block table widths differ: {a.block_table.shape[1]} vs {b.block_table.shape[1]}")
    counts = {"seqs": a.num_seqs, "tokens": a.token_seq.shape[0]}
    out = {}
    for f in AttentionMetadata.tensor_fields():
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is None or y is None:
            if x is not None or y is not None:
                raise ValueError(f"concat_metadata: {f.name} is set in only one of the two batches")
            out[f.name] = None
            continue
        if f.metadata["offset"]:
            y = y + counts[f.metadata["offset"]]
        out[f.name] = torch.cat([x[:-1] if f.metadata["rows"] == "seqs+1" else x, y])
    return AttentionMetadata(**out)


def layer_ref(layer_id: int) -> str:
    """A layer id inside a StepContext key: how the stamper (compiler/stamp.py) finds it."""
    return f"layer{layer_id}"


@dataclass
class StepContext:
    """Per-forward tensors derived once from the metadata and shared by all layers."""
    meta: AttentionMetadata
    caches: ModelCaches
    positions: torch.Tensor      # [N]
    tok_seq: torch.Tensor        # [N] batch index
    tok_slot: torch.Tensor       # [N] cache slot
    tok_chunk_start: torch.Tensor
    tok_seq_len: torch.Tensor
    tok_qstart: torch.Tensor     # [N] first token of this token's sequence in the batch
    topk: dict = field(default_factory=dict)        # index source layer -> [N, K] positions
    # candidate source -> [N, P] int64 compressed positions (ascending, -1 padded at the end),
    # P = min(candidate_topk_blocks * candidate_block_size, C): see ops.indexer_topk
    candidates: dict = field(default_factory=dict)
    precompressed: set = field(default_factory=set)  # full layers whose KV this step already wrote
    debug: dict | None = None
    # Index tensors and RoPE rotations that many layers would build identically (window rows,
    # ring rows, rotations per RoPE kind, compressed rows and the indexer's visible rows per
    # ratio, global rows per index source, candidate rows per candidate source): built once per
    # step by the first layer that needs them. In the graph that is one node shared by all those
    # layers instead of ~20 small kernels repeated in each of 40 layers.
    _shared: dict = field(default_factory=dict)
    # Tracing for layer stamping (compiler/stamp.py): values that cross layers are tagged.
    stamp: bool = False

    @classmethod
    def build(cls, meta: AttentionMetadata, caches: ModelCaches, positions: torch.Tensor,
              debug: dict | None = None, stamp: bool = False) -> "StepContext":
        s = meta.token_seq
        return cls(meta, caches, positions, s, meta.seq_slot[s], meta.chunk_start[s],
                   meta.seq_len[s], meta.query_start[s], debug=debug, stamp=stamp)

    def shared(self, key: tuple, build):
        """`build()` the first time `key` is asked for in this step, the same tensor after.
        A layer id in `key` is written layer_ref(i), so that the stamper can map it."""
        if key not in self._shared:
            self._shared[key] = self.tag(("shared",) + key, build())
        return self._shared[key]

    def tag(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        """`value`, named `key` in a graph traced for layer stamping (custom_ops/stamp_tag.py);
        the value itself otherwise."""
        return torch.ops.v41graph.stamp_tag(value, repr(key)) if self.stamp else value

    def fresh_or_ring_rows(self, pos: torch.Tensor, ring: int) -> torch.Tensor:
        """Rows of a (ring state ++ this call's tokens) pool for positions `pos` [N, M] of each
        token's own sequence: this call's tokens after the slot*ring ring rows."""
        return state_or_fresh_rows(
            pos, self.tok_chunk_start.unsqueeze(-1), self.tok_qstart.unsqueeze(-1),
            self.caches.num_slots * ring,
            lambda: self.tok_slot.unsqueeze(-1) * ring + pos.remainder(ring))

    def compressed_rows(self, ratio: int, capacity: int) -> torch.Tensor:
        """Paged cache rows [N, capacity] of compressed positions 0..capacity-1 (-1 = no block)."""
        j = torch.arange(capacity, device=self.positions.device)
        return self.compressed_rows_at(ratio, j.expand(self.tok_seq.shape[0], capacity))

    def compressed_rows_at(self, ratio: int, pos: torch.Tensor) -> torch.Tensor:
        """Paged cache rows of the compressed positions `pos` [N, M] (0 <= pos < capacity) of
        each token's own sequence (-1 = no block): `compressed_rows(...)` gathered at `pos`,
        computed in O(M) instead of O(capacity)."""
        rows_per_block = self.caches.block_size // ratio
        block = self.meta.block_table[self.tok_seq.unsqueeze(-1), pos // rows_per_block]
        return torch.where(block >= 0, block * rows_per_block + pos.remainder(rows_per_block), -1)

    def compressed_rows_padded(self, ratio: int, pos: torch.Tensor) -> torch.Tensor:
        """`compressed_rows_at` for a -1 padded position list (a top-k or candidate list): -1
        stays -1."""
        return torch.where(pos >= 0, self.compressed_rows_at(ratio, pos.clamp_min(0)), -1)


def state_or_fresh_rows(pos: torch.Tensor, chunk_start: torch.Tensor, query_start: torch.Tensor,
                        n_state_rows: int, state_row) -> torch.Tensor:
    """Rows of a pool that holds every slot's state rows, then this call's tokens, for
    positions `pos` of some sequences (chunk_start, query_start: those sequences' values,
    broadcast to pos): a position this call computes is its token's row after the state rows;
    an earlier one is `state_row()`, the caller's layout of the state (a ring by position, or
    the Engram history's most-recent-first row)."""
    in_chunk = pos >= chunk_start
    fresh = n_state_rows + query_start + (pos - chunk_start)
    return torch.where(in_chunk, fresh, state_row())
