"""Tensor- and expert-parallel sharding of the official checkpoint: `ShardSpec` (which part of
each tensor one rank keeps), `load_sharded_state_dict` (one rank's tensors read straight from
disk, only its rows or columns), `merge_shards` (the inverse, for checks), `shard_tensors` (the
same split of tensors already in memory) and `load_parallel_model` (a rank's V41Model, built
with its v41graph.parallel.ParallelState, filled from disk without reading other ranks' parts).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import torch

from .roles import check_role, role_holds
from v41graph.model.config import V41Config

from .checkpoint import Progress, progress_default
from .load import open_validated
from .names import EXPERT_WEIGHT, TensorSpec, official_tensor_specs, split_name

__all__ = ["ShardSpec", "Part", "load_sharded_state_dict", "merge_shards", "shard_tensors",
           "local_expert_name"]

_COLUMN_PARALLEL = {"attn.wq_b.weight", "attn.wo_a.weight", "attn.attn_sink",
                    "ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"}
_ROW_PARALLEL = {"attn.wo_b.weight", "ffn.shared_experts.w2.weight"}
# Indexer heads under tensor parallelism: rank r keeps heads r, r + ws, ... (Attention._head_partials)
_INDEXER_HEADS = {"attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"}


class Part(NamedTuple):
    """The part of a tensor one rank keeps: `ranges` [start, stop) along `dim` in logical
    elements (scale blocks for a blocked scale), concatenated in order; dim None: all of it."""
    dim: int | None
    ranges: tuple = ()


WHOLE = Part(None)


@dataclass(frozen=True)
class ShardSpec:
    """Which part of each tensor one rank keeps (DeepSeek's convert.py conventions, plus the
    indexer heads):

      column-parallel (split `out`, dim 0): embed, head (vocab), attn.wq_b, attn_sink (heads),
                      attn.wo_a (o_groups), shared_experts.w1/w3, routed experts' w1/w3
      row-parallel    (split `in`, dim 1): attn.wo_b, shared_experts.w2, routed experts' w2
      indexer heads   (dim 0, every world_size-th head): attn.indexer.wq_b, weights_proj
      expert_parallel=True: routed experts are not split but distributed by index (rank r keeps
                      experts [r*E/ws, (r+1)*E/ws)); everything else as above
      attention="dp"  (data-parallel attention): nothing is split but the routed experts
                      (distributed with expert_parallel, else every rank has them all)
      replicated:     norms, wq_a, wkv, compressor, indexer wk/k_norm, gate, hc_*, Engram,
                      DSpark extras
      role            "both" (default), "prefill" or "decode": a prefill/decode worker's
                      tensors only (v41graph/weights/roles.py says which); the others are None
    Scales follow their weight (an FP8 split must fall on 32-row/column block boundaries).
    world_size=1 is the identity. `ShardSpec.of(parallel_state)` is a v41graph.parallel rank's.
    """
    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    attention: str = "tp"
    role: str = "both"

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ShardSpec: need 0 <= rank < world_size, got rank={self.rank}, "
                             f"world_size={self.world_size}")
        if self.attention not in ("tp", "dp"):
            raise ValueError(f"ShardSpec.attention must be 'tp' or 'dp', got {self.attention!r}")
        check_role(self.role)

    @classmethod
    def of(cls, parallel) -> "ShardSpec":
        """The shard of a v41graph.parallel.ParallelState's rank."""
        return cls(parallel.rank, parallel.world_size, parallel.expert_parallel,
                   "dp" if parallel.attention == "dp" else "tp")

    def split_dim(self, name: str) -> int | None:
        """The dimension a (weight) tensor is split along, None if replicated/whole."""
        _, _, rest = split_name(name)
        m = EXPERT_WEIGHT.match(rest)
        if self.attention == "dp" or (m and self.expert_parallel):
            return None
        if m:
            return 1 if m.group(2) == "w2" else 0
        if name in ("embed.weight", "head.weight") or rest in _COLUMN_PARALLEL or rest in _INDEXER_HEADS:
            return 0
        if rest in _ROW_PARALLEL:
            return 1
        return None

    def partition(self, name: str, specs: Mapping[str, TensorSpec], config: V41Config) -> Part | None:
        """None if this rank does not hold `name`; else the Part it keeps (WHOLE: all of it)."""
        if not role_holds(name, self.role, config):
            return None
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
            return WHOLE if r * per <= int(m.group(1)) < (r + 1) * per else None
        if ws == 1 or wspec.kind == "table":
            return WHOLE
        dim = self.split_dim(wname)
        if dim is None:
            return WHOLE
        size = wspec.shape[dim]
        blocked = wspec.kind == "fp8" or (wspec.kind == "fp4" and dim == 1)
        block = 32 if spec.kind == "scale" and blocked else 1       # a scale's ranges in blocks
        if rest in _INDEXER_HEADS:
            heads = config.index_n_heads
            if heads % ws:
                raise ValueError(f"cannot split {wname} over {ws} ranks: {heads} indexer heads")
            unit = size // heads
            if blocked and unit % 32:
                raise ValueError(f"cannot split {wname} by heads: {unit} rows per head is not a multiple "
                                 "of the 32-wide scale block")
            return Part(dim, tuple((h * unit // block, (h + 1) * unit // block) for h in range(r, heads, ws)))
        units = {"attn.wq_b.weight": ("heads", config.num_attention_heads),
                 "attn.attn_sink": ("heads", config.num_attention_heads),
                 "attn.wo_a.weight": ("o_groups", config.o_groups),
                 "attn.wo_b.weight": ("o_groups", config.o_groups)}.get(rest)
        if units and units[1] % ws:
            raise ValueError(f"cannot split {wname} over {ws} ranks: {units[1]} {units[0]}")
        if size % ws:
            raise ValueError(f"cannot split {wname} {list(wspec.shape)} over {ws} ranks along dim {dim}")
        local = size // ws
        if blocked and local % 32:
            raise ValueError(f"cannot split {wname} {list(wspec.shape)} over {ws} ranks along dim "
                             f"{dim}: {local} per rank is not a multiple of the 32-wide scale block")
        return Part(dim, ((r * local // block, (r + 1) * local // block),))


def read_part(ckpt, name: str, part: Part) -> torch.Tensor:
    """A tensor's part read from the checkpoint (only those bytes)."""
    if part.dim is None:
        return ckpt.read(name)
    pieces = [ckpt.read(name, part.dim, a, b) for a, b in part.ranges]
    return pieces[0] if len(pieces) == 1 else _cat(pieces, part.dim)


def _cat(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat for any dtype (1-byte float8/fp4 dtypes through uint8 views)."""
    dtype = pieces[0].dtype
    if pieces[0].element_size() == 1 and dtype != torch.uint8:
        return torch.cat([p.view(torch.uint8) for p in pieces], dim).view(dtype)
    return torch.cat(list(pieces), dim)


def _slice_part(t: torch.Tensor, part: Part, packed_fp4: bool) -> torch.Tensor:
    """The part of a whole tensor already in memory (an F4 tensor's last dim is packed: /2)."""
    if part.dim is None:
        return t
    dim = part.dim % t.dim()
    half = 2 if packed_fp4 and dim == t.dim() - 1 else 1
    return _cat([t.narrow(dim, a // half, (b - a) // half) for a, b in part.ranges], dim)   # a copy


_EXPERT_INDEX = re.compile(r"^(layers\.\d+\.ffn\.experts\.)(\d+)(\..*)$")


def local_expert_name(name: str, first_expert: int) -> str:
    """An official routed-expert name with its global index -> the index among this rank's
    experts (V41Model under expert parallelism numbers its experts from 0)."""
    m = _EXPERT_INDEX.match(name)
    return name if m is None else f"{m.group(1)}{int(m.group(2)) - first_expert}{m.group(3)}"


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
            out[n] = read_part(ckpt, n, part)
            bar.update(out[n].numel() * out[n].element_size(), n)
        bar.close()
    finally:
        ckpt.close()
    return {n: out[n] for n in names if n in out}


def merge_shards(states: Sequence[Mapping[str, torch.Tensor]], shards: Sequence[ShardSpec],
                 config: V41Config) -> dict[str, torch.Tensor]:
    """Reassemble whole tensors from every rank's load_sharded_state_dict (inverse of the
    split: each rank's ranges put back in place, experts from their owner, replicas from rank 0)."""
    specs = official_tensor_specs(config)
    merged = {}
    for name in specs:
        held = [(s, st[name]) for s, st in zip(shards, states) if name in st]
        if not held:
            continue
        dim = held[0][0].partition(name, specs, config).dim
        if dim is None:
            merged[name] = held[0][1]
            continue
        pieces = []       # (logical start, piece) along dim, from every rank's ranges
        for shard, t in held:
            ranges = shard.partition(name, specs, config).ranges
            # a rank's tensor is its ranges back to back (an F4 tensor's last dim packed: half)
            packing = sum(b - a for a, b in ranges) // t.shape[dim]
            offset = 0
            for a, b in ranges:
                pieces.append((a, t.narrow(dim, offset, (b - a) // packing)))
                offset += (b - a) // packing
        merged[name] = _cat([p for _, p in sorted(pieces, key=lambda x: x[0])], dim)
    return merged


def shard_tensors(tensors: Mapping[str, torch.Tensor], shard: ShardSpec, config: V41Config,
                  include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """The rank's part of whole official tensors in memory (what load_sharded_state_dict reads
    from disk): for tests and for sharding a model built in one process."""
    specs = official_tensor_specs(config)
    out = {}
    for name, t in tensors.items():
        if not include_mtp and name.startswith("mtp."):
            continue
        part = shard.partition(name, specs, config)
        if part is not None:
            out[name] = _slice_part(t, part, specs[name].dtype == "F4")
    return out
