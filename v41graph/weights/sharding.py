"""Tensor- and expert-parallel sharding of the official checkpoint: `ShardSpec` (which part of
each tensor one rank keeps, DeepSeek's convert.py conventions), `load_sharded_state_dict` (one
rank's tensors read straight from disk, only its rows or columns) and `merge_shards` (the
inverse, for checks).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch

from v41graph.model.config import V41Config

from .checkpoint import Progress, progress_default
from .load import open_validated
from .names import EXPERT_WEIGHT, TensorSpec, official_tensor_specs, split_name

__all__ = ["ShardSpec", "load_sharded_state_dict", "merge_shards"]

_COLUMN_PARALLEL = {"attn.wq_b.weight", "attn.wo_a.weight", "attn.attn_sink",
                    "ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"}
_ROW_PARALLEL = {"attn.wo_b.weight", "ffn.shared_experts.w2.weight"}


@dataclass(frozen=True)
class ShardSpec:
    """Which part of each tensor one rank keeps (DeepSeek's convert.py conventions):

      column-parallel (split `out`, dim 0): embed, head (vocab), attn.wq_b, attn_sink (heads),
                      attn.wo_a (o_groups), shared_experts.w1/w3, routed experts' w1/w3
      row-parallel    (split `in`, dim 1): attn.wo_b, shared_experts.w2, routed experts' w2
      expert_parallel=True: routed experts are not split but distributed by index (rank r keeps
                      experts [r*E/ws, (r+1)*E/ws)); everything else as above
      replicated:     norms, wq_a, wkv, compressor, indexer, gate, hc_*, Engram, DSpark extras
    Scales follow their weight (an FP8 split must fall on 32-row/column block boundaries).
    world_size=1 is the identity.
    """
    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardSpec: need 0 <= rank < world_size, got rank={self.rank}, "
                             f"world_size={self.world_size}")

    def split_dim(self, name: str) -> int | None:
        """The dimension a (weight) tensor is split along, None if replicated/whole."""
        _, _, rest = split_name(name)
        if name in ("embed.weight", "head.weight") or rest in _COLUMN_PARALLEL:
            return 0
        if rest in _ROW_PARALLEL:
            return 1
        m = EXPERT_WEIGHT.match(rest)
        if m and not self.expert_parallel:
            return 1 if m.group(2) == "w2" else 0
        return None

    def partition(self, name: str, specs: Mapping[str, TensorSpec], config: V41Config):
        """None if this rank does not hold `name`; else (dim, start, stop) in the tensor's
        logical elements along dim, or (None, 0, 0) for the whole tensor."""
        whole = (None, 0, 0)
        spec = specs[name]
        wname = spec.weight if spec.kind == "scale" else name
        wspec = specs[wname]
        prefix, _, rest = split_name(wname)
        ws, r = self.world_size, self.rank
        m = EXPERT_WEIGHT.match(rest)
        if m and self.expert_parallel:
            n_exp = config.dspark_n_routed_experts if prefix == "mtp" else config.n_routed_experts
            if n_exp % ws:
                raise ValueError(f"cannot distribute {n_exp} experts over {ws} ranks ({name})")
            per = n_exp // ws
            return whole if r * per <= int(m.group(1)) < (r + 1) * per else None
        if ws == 1 or wspec.kind == "table":
            return whole
        dim = self.split_dim(wname)
        if dim is None:
            return whole
        size = wspec.shape[dim]
        units = {"attn.wq_b.weight": ("heads", config.num_attention_heads),
                 "attn.attn_sink": ("heads", config.num_attention_heads),
                 "attn.wo_a.weight": ("o_groups", config.o_groups),
                 "attn.wo_b.weight": ("o_groups", config.o_groups)}.get(rest)
        if units and units[1] % ws:
            raise ValueError(f"cannot split {wname} over {ws} ranks: {units[1]} {units[0]}")
        if size % ws:
            raise ValueError(f"cannot split {wname} {list(wspec.shape)} over {ws} ranks along dim {dim}")
        local = size // ws
        blocked = wspec.kind == "fp8" or (wspec.kind == "fp4" and dim == 1)
        if blocked and local % 32:
            raise ValueError(f"cannot split {wname} {list(wspec.shape)} over {ws} ranks along dim "
                             f"{dim}: {local} per rank is not a multiple of the 32-wide scale block")
        start, stop = r * local, (r + 1) * local
        if spec.kind == "scale" and blocked:
            return dim, start // 32, stop // 32
        return dim, start, stop


def load_sharded_state_dict(path: str | Path, shard: ShardSpec, include_mtp: bool = True,
                            progress=None) -> dict[str, torch.Tensor]:
    """One rank's tensors, official names, read straight from disk (only the rank's rows or
    columns are read). Tensors have the official torch dtypes (float8_e4m3fn, float8_e8m0fnu,
    float4_e2m1fn_x2 [.., in/2], bfloat16, float32)."""
    ckpt, config, specs = open_validated(Path(path))
    out = {}
    try:
        names = [n for n in specs if n in ckpt.tensors and (include_mtp or not n.startswith("mtp."))]
        parts = {n: shard.partition(n, specs, config) for n in names}
        total = sum(ckpt.info(n).nbytes for n, p in parts.items() if p is not None)
        bar = Progress(f"loading rank {shard.rank}/{shard.world_size}", total,
                       progress_default(progress, total))
        for n in sorted(parts, key=lambda n: (ckpt.weight_map[n], ckpt.info(n).start)):
            part = parts[n]
            if part is None:
                continue
            dim, a, b = part
            out[n] = ckpt.read(n) if dim is None else ckpt.read(n, dim, a, b)
            bar.update(out[n].numel() * out[n].element_size(), n)
        bar.close()
    finally:
        ckpt.close()
    return {n: out[n] for n in names if n in out}


def merge_shards(states: Sequence[Mapping[str, torch.Tensor]], shards: Sequence[ShardSpec],
                 config: V41Config) -> dict[str, torch.Tensor]:
    """Reassemble whole tensors from every rank's load_sharded_state_dict (inverse of the
    split: concatenation along the split dim, experts from their owner, replicas from rank 0)."""
    specs = official_tensor_specs(config)
    merged = {}
    for name in specs:
        held = [(s, st[name]) for s, st in zip(shards, states) if name in st]
        if not held:
            continue
        dim = held[0][0].partition(name, specs, config)[0]
        if dim is None:
            merged[name] = held[0][1]
        else:
            held.sort(key=lambda x: x[0].rank)
            merged[name] = torch.cat([t.view(torch.uint8) if t.element_size() == 1 and
                                      t.dtype != torch.uint8 else t for _, t in held], dim)
            merged[name] = merged[name].view(held[0][1].dtype)
    return merged

