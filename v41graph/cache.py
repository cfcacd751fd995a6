"""Caches and attention metadata.

Cache memory is allocated once, up front:
  window ring    every backbone layer: [slots, W, D] FP8 E4M3 bytes + [slots, W, D/32] UE8M0
  compressor     ratio>1 kv sources: [slots, 32, 2D] fp32 ring of (kv | score) rows, row = pos % 32
                 (holds the partial group between calls; bounds speculation to <= 31 tokens)
  global KV      every kv source: paged [blocks, block_size/r, D/2] FP4 + [.., D/16] E4M3
  index keys     every kv source: paged [blocks, block_size/r, Di/2] FP4 + [.., Di/32] UE8M0
  Engram history [slots, n-1] compressed ids of each sequence's last tokens
One block id covers `block_size` tokens in all four kv sources at once (the seed's "four-slot
page packing"): a ratio-2 source stores block_size/2 rows per block, the ratio-1 source
block_size rows.

`AttentionMetadata` describes a flat batch of tokens from several sequences with tensors only,
so a captured graph can be replayed with new contents.
"""
from __future__ import annotations

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
                 device: torch.device | str = "cpu") -> "ModelCaches":
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
            gkv[role.layer_id] = torch.zeros(num_blocks, rows, d // 2, **u8)
            gsc[role.layer_id] = torch.zeros(num_blocks, rows, d // 16, **u8)
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


def replay_metadata(meta: AttentionMetadata, replay: int):
    """Metadata for decoder bounded replay (MODEL.md §9): only the last `replay` tokens of each
    sequence, with the window truncated to that segment. Returns (metadata, token indices of
    the kept tokens in the full batch). Used for prefill only (data-dependent shapes)."""
    start = torch.maximum(meta.chunk_start, meta.seq_len - replay)
    pos = positions_of(meta)
    keep = torch.nonzero(pos >= start[meta.token_seq]).flatten()
    qlens = meta.seq_len - start
    qstart = torch.zeros_like(meta.query_start)
    qstart[1:] = qlens.cumsum(0)
    sub = replace(meta, token_seq=meta.token_seq[keep], chunk_start=start, query_start=qstart,
                  logits_index=qstart[1:] - 1, window_floor=start)
    return sub, keep
