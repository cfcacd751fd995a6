"""The static layer plan (MODEL.md §2): what each backbone layer does with KV and indices.

  window   layers with ratio 0: sliding-window attention only
  full     kv sources: compress, write global KV + index keys, score, top-k, attend
  reindex  index sources that are not kv sources: own indexer query, scored only inside the
           candidate source's candidate blocks, own top-k
  reuse    everything else: attend with the latest index source's top-k unchanged

The plan is fixed when the model is built; a config that breaks a rule raises ValueError
naming the layer and the rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import V41Config

MODES = ("window", "full", "reindex", "reuse")


@dataclass(frozen=True)
class LayerRole:
    layer_id: int
    mode: str                          # one of MODES
    ratio: int                         # compression ratio (0 = window only)
    kv_source: Optional[int]           # layer whose global KV this layer reads
    index_source: Optional[int]        # layer whose top-k this layer uses (itself if it scores)
    candidate_source: Optional[int]    # layer whose candidate blocks a reindex layer filters by
    is_candidate_source: bool          # this layer emits candidate blocks
    engram_slot: Optional[int]         # index into engram_layer_ids if Engram runs before it

    @property
    def scores(self) -> bool:
        """True if this layer runs an indexer (full or reindex)."""
        return self.mode in ("full", "reindex")


def _check_ids(name: str, ids: list, n_layers: int) -> None:
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{name} {list(ids)}: ids must be sorted and unique")
    for i in ids:
        if not 0 <= i < n_layers:
            raise ValueError(f"{name}: layer {i} is out of range 0..{n_layers - 1}")


def build_layer_plan(config: V41Config) -> list[LayerRole]:
    """One LayerRole per backbone layer; raises ValueError on any rule violation."""
    n = config.num_hidden_layers
    ratios = list(config.compress_ratios)
    expected = n + config.num_nextn_predict_layers
    if len(ratios) != expected:
        raise ValueError(f"compress_ratios has {len(ratios)} entries; expected {expected} "
                         f"(num_hidden_layers + num_nextn_predict_layers)")
    for i, r in enumerate(ratios):
        if r < 0:
            raise ValueError(f"layer {i}: compress ratio {r} must be >= 0")
    for i in range(n, expected):
        if ratios[i] != 0:
            raise ValueError(f"DSpark stage layer {i}: ratio must be 0 (window-only), got {ratios[i]}")

    kv_ids = list(config.kv_source_layer_ids)
    index_ids = list(config.index_source_layer_ids)
    _check_ids("kv_source_layer_ids", kv_ids, n)
    _check_ids("index_source_layer_ids", index_ids, n)
    _check_ids("engram_layer_ids", list(config.engram_layer_ids), n)
    for i in kv_ids + index_ids:
        if ratios[i] == 0:
            raise ValueError(f"layer {i}: a kv/index source must have ratio > 0 (has ratio 0)")
    for i in kv_ids:
        if i not in index_ids:
            raise ValueError(f"layer {i}: every kv source must also be an index source")
    cand = config.candidate_source_layer_id
    reindex_ids = [i for i in index_ids if i not in kv_ids]
    if reindex_ids:
        if cand is None or cand not in kv_ids:
            raise ValueError(f"candidate_source_layer_id {cand}: the candidate source must be a kv source")
        for i in reindex_ids:
            if i < cand:
                raise ValueError(f"layer {i}: reindex layer before the candidate source layer {cand}")
            if ratios[i] != ratios[cand]:
                raise ValueError(f"layer {i}: reindex ratio {ratios[i]} != candidate source "
                                 f"layer {cand} ratio {ratios[cand]}")
    elif cand is not None and cand not in kv_ids:
        raise ValueError(f"candidate_source_layer_id {cand}: the candidate source must be a kv source")
    if len(config.engram_num_embeddings) != len(config.engram_layer_ids):
        raise ValueError("engram_num_embeddings must have one entry per engram_layer_ids entry")

    plan = []
    engram_slots = {lid: s for s, lid in enumerate(config.engram_layer_ids)}
    for i in range(n):
        r = ratios[i]
        if r == 0:
            mode, kv_src, idx_src = "window", None, None
        else:
            kv_before = [k for k in kv_ids if k <= i]
            idx_before = [k for k in index_ids if k <= i]
            if not kv_before:
                raise ValueError(f"layer {i}: ratio {r} but no kv source at or before it")
            kv_src, idx_src = kv_before[-1], idx_before[-1]
            if ratios[kv_src] != r:
                raise ValueError(f"layer {i}: ratio {r} does not match its kv source layer "
                                 f"{kv_src} ratio {ratios[kv_src]}")
            if ratios[idx_src] != r:
                raise ValueError(f"layer {i}: ratio {r} does not match its index source layer "
                                 f"{idx_src} ratio {ratios[idx_src]}")
            if i in kv_ids:
                mode = "full"
            elif i in index_ids:
                mode = "reindex"
            else:
                mode = "reuse"
        plan.append(LayerRole(
            layer_id=i, mode=mode, ratio=r, kv_source=kv_src, index_source=idx_src,
            candidate_source=cand if mode == "reindex" else None,
            is_candidate_source=(i == cand and bool(reindex_ids)) or (i == cand and mode == "full"),
            engram_slot=engram_slots.get(i),
        ))
    return plan


def format_layer_plan(plan: list[LayerRole]) -> str:
    """A one-line-per-layer table for the demo and logs."""
    lines = ["layer  mode     ratio  kv_src  idx_src  notes"]
    for r in plan:
        notes = []
        if r.is_candidate_source:
            notes.append("candidate source")
        if r.mode == "reindex":
            notes.append(f"filters by layer {r.candidate_source}")
        if r.engram_slot is not None:
            notes.append("Engram before")
        lines.append(f"{r.layer_id:>5}  {r.mode:<7}  {r.ratio:>5}  {str(r.kv_source):>6}  "
                     f"{str(r.index_source):>7}  {', '.join(notes)}")
    return "\n".join(lines)
