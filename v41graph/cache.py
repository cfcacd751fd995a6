"""Caches and attention metadata.

Cache memory is allocated once, up front:
  window ring    every backbone layer: [slots, W, D] FP8 E4M3 bytes + [slots, W, D/32] UE8M0
  compressor     ratio>1 kv sources: [slots, 32, 2D] fp32 ring of (kv | score) rows, row = pos % 32
                 (holds the partial group between calls; bounds speculation to <= 31 tokens)
  global KV      every kv source: paged [blocks, block_size/r, D/2] FP4 + [.., D/16] E4M3
                 (or, with global_kv_dtype=torch.bfloat16, plain bf16 rows [.., D] and an empty
                 scale [.., 0]: the comparison variant for the seed's P2 -- the native format
                 is FP4, a BF16 cache is what kernels that only compile BF16 would need)
  index keys     every kv source: paged [blocks, block_size/r, Di/2] FP4 + [.., Di/32] UE8M0
  Engram history [slots, n-1] compressed ids of each sequence's last tokens
One block id covers `block_size` tokens in all four kv sources at once (the seed's "four-slot
page packing"): a ratio-2 source stores block_size/2 rows per block, the ratio-1 source
block_size rows.

`AttentionMetadata` describes a flat batch of tokens from several sequences with tensors only,
so a captured graph can be replayed with new contents.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .config import V41Config
from .layer_plan import build_layer_plan

COMPRESSOR_RING = 32


class CacheCapacityError(RuntimeError):
    """Raised when a request needs more cache blocks or slots than are free."""


@dataclass
class ModelCaches:
    window_kv: list
    window_scale: list
    compressor_state: dict
    global_kv: dict
    global_scale: dict
    index_k: dict
    index_scale: dict
    engram_history: torch.Tensor
    block_size: int
    num_blocks: int
    num_slots: int

    @classmethod
    def allocate(cls, config: V41Config, num_slots: int, num_blocks: int, block_size: int = 128,
                 device: torch.device | str = "cpu",
                 global_kv_dtype: torch.dtype = torch.uint8) -> "ModelCaches":
        if global_kv_dtype not in (torch.uint8, torch.bfloat16):
            raise ValueError(f"global_kv_dtype must be torch.uint8 (FP4, the model's format) or "
                             f"torch.bfloat16 (comparison variant), got {global_kv_dtype}")
        plan = build_layer_plan(config)
        d, w, di = config.head_dim, config.sliding_window, config.index_head_dim
        for r in {role.ratio for role in plan if role.ratio}:
            if block_size % r:
                raise ValueError(f"block_size {block_size} must be a multiple of every ratio ({r})")
        u8 = dict(dtype=torch.uint8, device=device)
        window_kv = [torch.zeros(num_slots, w, d, **u8) for _ in plan]
        window_scale = [torch.zeros(num_slots, w, d // 32, **u8) for _ in plan]
        comp, gkv, gsc, ik, isc = {}, {}, {}, {}, {}
        for role in plan:
            if role.mode != "full":
                continue
            rows = block_size // role.ratio
            if role.ratio > 1:
                comp[role.layer_id] = torch.zeros(num_slots, COMPRESSOR_RING, 2 * d,
                                                  dtype=torch.float32, device=device)
            if global_kv_dtype == torch.uint8:
                gkv[role.layer_id] = torch.zeros(num_blocks, rows, d // 2, **u8)
                gsc[role.layer_id] = torch.zeros(num_blocks, rows, d // 16, **u8)
            else:
                gkv[role.layer_id] = torch.zeros(num_blocks, rows, d, dtype=global_kv_dtype, device=device)
                gsc[role.layer_id] = torch.zeros(num_blocks, rows, 0, **u8)
            ik[role.layer_id] = torch.zeros(num_blocks, rows, di // 2, **u8)
            isc[role.layer_id] = torch.zeros(num_blocks, rows, di // 32, **u8)
        hist = torch.zeros(num_slots, max(config.engram_max_ngram_size - 1, 1),
                           dtype=torch.int64, device=device)
        return cls(window_kv, window_scale, comp, gkv, gsc, ik, isc, hist,
                   block_size, num_blocks, num_slots)

    def tensors(self) -> list:
        out = list(self.window_kv) + list(self.window_scale) + [self.engram_history]
        for d in (self.compressor_state, self.global_kv, self.global_scale, self.index_k, self.index_scale):
            out += list(d.values())
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class BlockAllocator:
    """A free list of cache block ids shared by all kv sources."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheCapacityError(f"need {n} cache blocks but only {len(self._free)} of "
                                     f"{self.num_blocks} are free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in self._free:
                raise ValueError(f"block {b} is not an allocated block id")
            self._free.append(b)


@dataclass
class AttentionMetadata:
    """A flat batch: N tokens from B sequences, sequence b owning tokens
    query_start[b]:query_start[b+1] at positions chunk_start[b]..seq_len[b]-1."""
    token_seq: torch.Tensor     # [N] batch index of each token
    seq_slot: torch.Tensor      # [B] cache slot (window ring / state row) of each sequence
    chunk_start: torch.Tensor   # [B] position of the first new token
    seq_len: torch.Tensor       # [B] context length after this call
    query_start: torch.Tensor   # [B+1] offsets into the token batch
    block_table: torch.Tensor   # [B, max_blocks] cache block ids, -1 = none
    logits_index: torch.Tensor  # [B] token whose logits are returned (the last of each seq)
    window_floor: torch.Tensor | None = None  # [B] first position the window may see (replay)
    # Names the contents of seq_slot and block_table: two metadata with the same non-None key
    # hold equal seq_slot / block_table (a DecodeBatch hands out a fresh key whenever either
    # changes), so a decode graph that already holds them can skip reloading them.
    static_key: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_slot.shape[0]


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
    na, ta = a.num_seqs, a.token_seq.shape[0]
    cat = torch.cat
    return AttentionMetadata(
        token_seq=cat([a.token_seq, b.token_seq + na]), seq_slot=cat([a.seq_slot, b.seq_slot]),
        chunk_start=cat([a.chunk_start, b.chunk_start]), seq_len=cat([a.seq_len, b.seq_len]),
        query_start=cat([a.query_start[:-1], b.query_start + ta]),
        block_table=cat([a.block_table, b.block_table]),
        logits_index=cat([a.logits_index, b.logits_index + ta]))


_STATIC_KEYS = itertools.count(1)


class DecodeBatch:
    """Persistent device metadata of decode rows (one new token per sequence), kept across
    steps (the seed's P5: metadata cached instead of rebuilt every step).

    Rows 0..n-1 are sequences in the caller's order; `keys[i]` names row i's owner (a request
    or sequence id). What does not change between decode steps -- slot ids and block tables --
    is written only when a row is inserted or removed or a sequence gets a new block
    (`insert`, `remove`, `set_block`, `sync`). What does -- positions, chunk starts, sequence
    lengths -- lives in one [3, capacity] counter tensor that `advance()` moves on by one token
    with a single in-place add on the device. A steady-state step therefore reads nothing from
    the device and builds no tensor from host data: `metadata()` returns cached views, the
    scheduler counts lengths in Python ints itself, and the only host-to-device transfer is the
    new tokens (`load_ids`: a non-blocking copy from a pinned staging buffer on CUDA).

    Row order is kept stable (inserts and removes shift the rows behind them on the device), so
    a batch lists its sequences in the same order a freshly built one would.
    """

    def __init__(self, capacity: int, max_blocks: int, device: torch.device | str = "cpu"):
        self.capacity, self.max_blocks = capacity, max_blocks
        self.device = torch.device(device)
        i64 = dict(dtype=torch.int64, device=self.device)
        self.keys: list = []
        self.slot = torch.zeros(capacity, **i64)
        self.block_table = torch.full((capacity, max_blocks), -1, **i64)
        # counters[0] = chunk_start (tokens already cached), [1] = seq_len, [2] = positions
        self.counters = torch.zeros(3, capacity, **i64)
        self.ids = torch.zeros(capacity, **i64)
        self._token_seq = torch.arange(capacity, **i64)
        self._query_start = torch.arange(capacity + 1, **i64)
        self._logits_index = torch.arange(capacity, **i64)
        # New tokens come from the host sampler: stage them in pinned memory and copy without a
        # sync (on CPU the staging buffer is the ids buffer itself).
        self._ids_host = self._ids_copied = None
        if self.device.type == "cuda":
            self._ids_host = torch.zeros(capacity, dtype=torch.int64).pin_memory()
            self._ids_copied = torch.cuda.Event()
        self.static_key = next(_STATIC_KEYS)
        self._views = None

    # ------------------------------------------------------------------ reading
    @property
    def n(self) -> int:
        return len(self.keys)

    def _live(self):
        """(positions, metadata, live counters [3, n]): views of the persistent buffers, made
        once per change of the rows."""
        if self._views is None:
            n = self.n
            live = self.counters[:, :n]
            meta = AttentionMetadata(
                token_seq=self._token_seq[:n], seq_slot=self.slot[:n],
                chunk_start=live[0], seq_len=live[1],
                query_start=self._query_start[:n + 1], block_table=self.block_table[:n],
                logits_index=self._logits_index[:n], static_key=self.static_key)
            self._views = (live[2], meta, live)
        return self._views

    def metadata(self):
        """(positions [n], AttentionMetadata of the n rows): cached views, nothing built."""
        return self._live()[:2]

    def load_ids(self, tokens) -> torch.Tensor:
        """This step's input ids (one host int per row) -> the persistent ids view [n]."""
        n = len(tokens)
        if n != self.n:
            raise ValueError(f"{n} tokens for {self.n} decode rows")
        if self._ids_host is None:
            self.ids.numpy()[:n] = tokens
        else:
            # The previous step's copy out of the staging buffer has long finished when a
            # caller read that step's logits; wait for it only if it has not (query: no sync).
            if not self._ids_copied.query():
                self._ids_copied.synchronize()
            self._ids_host.numpy()[:n] = tokens
            self.ids[:n].copy_(self._ids_host[:n], non_blocking=True)
            self._ids_copied.record()
        return self.ids[:n]

    # ------------------------------------------------------------------ per step
    def advance(self) -> None:
        """Every row's sequence took one token: chunk_start, seq_len and positions += 1 (one
        in-place add on the device, no host involvement)."""
        if self.keys:
            self._live()[2].add_(1)

    # ------------------------------------------------------------------ row changes
    def _changed(self) -> None:
        self.static_key = next(_STATIC_KEYS)
        self._views = None

    def insert(self, row: int, key, slot: int, length: int, blocks) -> None:
        """A new row at `row` (the rows behind it move back by one): sequence in cache slot
        `slot` with `length` tokens already cached and these blocks."""
        n = self.n
        if n >= self.capacity:
            raise ValueError(f"decode batch full ({self.capacity} rows)")
        if not 0 <= row <= n:
            raise ValueError(f"row {row} outside 0..{n}")
        if len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks > max_blocks {self.max_blocks}")
        if row < n:
            for t in (self.slot, self.block_table):
                t[row + 1:n + 1] = t[row:n].clone()
            self.counters[:, row + 1:n + 1] = self.counters[:, row:n].clone()
        self.slot[row] = slot
        self.block_table[row] = -1
        if blocks:
            self.block_table[row, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int64)
        self.counters[0, row] = length
        self.counters[1, row] = length + 1
        self.counters[2, row] = length
        self.keys.insert(row, key)
        self._changed()

    def remove(self, row: int) -> None:
        """Drop a row (the rows behind it move up by one)."""
        n = self.n
        if not 0 <= row < n:
            raise ValueError(f"row {row} outside 0..{n - 1}")
        if row < n - 1:
            for t in (self.slot, self.block_table):
                t[row:n - 1] = t[row + 1:n].clone()
            self.counters[:, row:n - 1] = self.counters[:, row + 1:n].clone()
        self.block_table[n - 1] = -1
        del self.keys[row]
        self._changed()

    def discard(self, keys) -> None:
        """Remove the rows of these keys, if present."""
        for k in keys:
            if k in self.keys:
                self.remove(self.keys.index(k))

    def clear(self) -> None:
        if self.keys:
            self.block_table[:self.n] = -1
            self.keys = []
            self._changed()

    def set_block(self, row: int, index: int, block: int) -> None:
        """Row `row`'s sequence got block `block` as its `index`-th block."""
        self.block_table[row, index] = block
        self._changed()

    def sync(self, keys, describe) -> list:
        """Make the rows exactly `keys`, in this order. describe(key) -> (slot, cached length,
        blocks) for a key that needs a new row. Rows kept keep their device state. Returns the
        keys that got a new row (none in a steady state: one list comparison, nothing else)."""
        keys = list(keys)
        if keys == self.keys:
            return []
        want = set(keys)
        for i in range(self.n - 1, -1, -1):
            if self.keys[i] not in want:
                self.remove(i)
        have = set(self.keys)
        if [k for k in keys if k in have] != self.keys:     # reordered: rebuild
            self.clear()
            have = set()
        inserted = []
        for i, k in enumerate(keys):
            if k not in have:
                self.insert(i, k, *describe(k))
                inserted.append(k)
        return inserted

    def host_view(self) -> dict:
        """The rows' state read back to the host (tests and debugging only: syncs)."""
        n = self.n
        return dict(keys=list(self.keys), slot=self.slot[:n].tolist(),
                    block_table=self.block_table[:n].tolist(),
                    chunk_start=self.counters[0, :n].tolist(), seq_len=self.counters[1, :n].tolist(),
                    positions=self.counters[2, :n].tolist())
