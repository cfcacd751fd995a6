"""The model's caches, allocated once, up front, and the scratch-slot rule.

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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import V41Config
from .layer_plan import build_layer_plan

COMPRESSOR_RING = 32


def slots_with_scratch(max_batch_size: int) -> int:
    """Cache slots for a runtime of `max_batch_size` sequences: one more, the scratch slot.
    Padding rows of a compiled model's decode buckets belong to it (and own no cache blocks),
    so they write nothing a real sequence reads; a runtime never hands it out."""
    return max_batch_size + 1


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

    @property
    def scratch_slot(self) -> int:
        """The slot padding rows write into (see slots_with_scratch): the last one."""
        return self.num_slots - 1

    def tensors(self) -> list:
        out = list(self.window_kv) + list(self.window_scale) + [self.engram_history]
        for d in (self.compressor_state, self.global_kv, self.global_scale, self.index_k, self.index_scale):
            out += list(d.values())
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
