"""What one request moves from a prefill worker to a decode worker, and how it is laid out.

After P's half of a bounded-replay prefill (V41Model.encode) a request's state is:

  kv       every kv source's global KV + index keys, the rows of its compressed positions
           0..floor(n/r)-1, packed as the cache stores them (FP4 + E4M3 scales, FP4 + UE8M0
           scales): sum over the sources of floor(n/r) * (288 + 68) bytes on the released
           config = accounting's global_kv_bytes_per_token (890 B) per token when n is a
           multiple of every ratio
  ring     each ratio > 1 source's compressor state rows of the group still open at n
           (n mod r rows of [kv | score], fp32: what the next tokens pool with)
  window   each encoder layer's window ring rows of the last min(n, W) positions (FP8 +
           UE8M0), which the encoder half of every decode token reads
  history  the Engram history row (the last n-gram's compressed ids)
  replay   the decoder's replay input: the residual streams entering the decoder start and
           the last encoder FFN's `pre`, for the last min(n, W) prompt tokens

kv grows with the prompt; the rest is a fixed per-request bundle (bounded by W). D writes the
first four into its own caches (its own slot and blocks) and runs the decoder layers over the
replay input (V41Model.decode_replay), which fills the decoder's window caches and gives the
first token's logits: the same numbers as a single process's `Session.prefill(mode="replay")`.

The hand-over travels in parts, one per encoder layer (its window rows, and its KV when it is a
kv source), one for the decoder start (its KV) and one last part (history + replay), in the
order P's encoder produces them. `layout(config, n)` is the one description of every part's
tensors, which both sides derive from their own config, so a part of the wrong size (a
truncated transfer, another config) is caught before anything is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from v41graph.model.config import V41Config
from v41graph.model.kv_cache import ModelCaches
from v41graph.model.layer_plan import build_layer_plan
from v41graph.model.metadata import upload

from .roles import decoder_start, fingerprint_mismatch


class HandoverError(ValueError):
    """A hand-over that cannot be admitted: names the request, the part or tensor and the rule."""


@dataclass(frozen=True)
class Field:
    """One tensor of a part: what (kind), of which layer, its shape and dtype."""
    kind: str            # "global_kv" | "global_scale" | "index_k" | "index_scale" | "ring" |
    #                      "window_kv" | "window_scale" | "history" | "streams" | "pre"
    layer: int | None
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def group(self) -> str:
        """Which byte count it belongs to: kv, ring, window, history or replay."""
        return {"global_kv": "kv", "global_scale": "kv", "index_k": "kv", "index_scale": "kv",
                "window_kv": "window", "window_scale": "window", "streams": "replay",
                "pre": "replay"}.get(self.kind, self.kind)


@dataclass(frozen=True)
class Part:
    name: str            # "layer{i}" or "replay"
    fields: tuple

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.fields)


_KV_KINDS = ("global_kv", "global_scale", "index_k", "index_scale")


def layout(config: V41Config, n: int, dtype: torch.dtype) -> list[Part]:
    """The parts of a request of n prompt tokens, in sending order. dtype: the model's compute
    dtype (the replay streams')."""
    if n < 1:
        raise HandoverError(f"prompt length {n} must be >= 1")
    plan = build_layer_plan(config)
    dec = decoder_start(config)
    d, w, di = config.head_dim, config.sliding_window, config.index_head_dim
    rows_kv = {"global_kv": d // 2, "global_scale": d // 16, "index_k": di // 2, "index_scale": di // 32}
    m = min(n, w)
    parts = []
    for role in plan[:dec + 1]:
        fields = []
        if role.layer_id < dec:      # the decoder start's window is D's (replay fills it)
            fields += [Field("window_kv", role.layer_id, (m, d), torch.uint8),
                       Field("window_scale", role.layer_id, (m, d // 32), torch.uint8)]
        if role.mode == "full":
            c = n // role.ratio
            fields += [Field(k, role.layer_id, (c, rows_kv[k]), torch.uint8) for k in _KV_KINDS]
            if role.ratio > 1 and n % role.ratio:
                fields.append(Field("ring", role.layer_id, (n % role.ratio, 2 * d), torch.float32))
        parts.append(Part(f"layer{role.layer_id}", tuple(fields)))
    lags = max(config.engram_max_ngram_size - 1, 1)
    parts.append(Part("replay", (Field("history", None, (lags,), torch.int64),
                                 Field("streams", None, (m, config.hc_mult, config.hidden_size), dtype),
                                 Field("pre", None, (m, config.hc_mult), torch.float32))))
    return parts


def byte_counts(parts: list[Part]) -> dict:
    """Bytes per group (kv / ring / window / history / replay) and in all."""
    out = {"kv": 0, "ring": 0, "window": 0, "history": 0, "replay": 0}
    for p in parts:
        for f in p.fields:
            out[f.group] += f.nbytes
    out["total"] = sum(out.values())
    return out


def check_fingerprint(mine: bytes, theirs: bytes, what: str) -> None:
    """P's fingerprint (Handover.fingerprint) against this worker's: a HandoverError naming
    which half differs (roles.fingerprint_mismatch)."""
    if not isinstance(theirs, (bytes, bytearray)) or len(theirs) != len(mine):
        raise HandoverError(f"{what}: fingerprint must be {len(mine)} bytes, got {theirs!r}")
    why = fingerprint_mismatch(mine, bytes(theirs))
    if why is not None:
        raise HandoverError(f"{what}: P and D do not hold the same model ({why}: hand-over fingerprint "
                            f"{bytes(theirs).hex()} vs this worker's {mine.hex()})")


# ----------------------------------------------------------------------------- cache rows
def _compressed_rows(caches: ModelCaches, blocks: list[int], ratio: int, count: int) -> torch.Tensor:
    """Flat row indices (into a [num_blocks * block_size/ratio, X] view) of compressed
    positions 0..count-1 of a sequence with these blocks."""
    per = caches.block_size // ratio
    j = torch.arange(count)
    table = torch.tensor(blocks, dtype=torch.int64)
    return table[j // per] * per + j % per


def _ring_positions(n: int, size: int, count: int) -> torch.Tensor:
    """Ring rows (pos % size) of the last `count` positions before n, oldest first."""
    return torch.arange(n - count, n) % size


_CACHE_FIELDS = {"global_kv": "global_kv", "global_scale": "global_scale", "index_k": "index_k",
                 "index_scale": "index_scale", "ring": "compressor_state", "window_kv": "window_kv",
                 "window_scale": "window_scale"}     # Field.kind -> ModelCaches attribute


def _cache_tensor(caches: ModelCaches, kind: str, layer: int) -> torch.Tensor:
    return getattr(caches, _CACHE_FIELDS[kind])[layer]   # a dict by layer, or a list (window)


def _rows_of(caches: ModelCaches, f: Field, slot: int, blocks: list[int], n: int, plan):
    """(cache tensor viewed 2-D, row indices) where field f of this sequence lives."""
    t = _cache_tensor(caches, f.kind, f.layer)
    dev = t.device
    if f.kind in _KV_KINDS:
        rows = _compressed_rows(caches, blocks, plan[f.layer].ratio, f.shape[0])
        return t.view(-1, t.shape[-1]), upload(rows, dev)
    size = t.shape[1]                                  # W (window) or COMPRESSOR_RING
    rows = slot * size + _ring_positions(n, size, f.shape[0])
    return t.view(-1, t.shape[-1]), upload(rows, dev)


def pack_part(caches: ModelCaches, part: Part, slot: int, blocks: list[int], n: int, plan,
              replay: dict | None = None) -> torch.Tensor:
    """One part of a request as one flat uint8 tensor (its fields' bytes back to back) on the
    caches' device, read from P's caches (slot, blocks) and, for the replay part, from `replay`
    (history / streams / pre tensors). The transport moves it where it must be (Sender)."""
    pieces = []
    for f in part.fields:
        if f.kind in ("history", "streams", "pre"):
            t = replay[f.kind]
        else:
            flat, rows = _rows_of(caches, f, slot, blocks, n, plan)
            t = flat.index_select(0, rows)
        if tuple(t.shape) != f.shape or t.dtype != f.dtype:
            raise HandoverError(f"{part.name}.{f.kind}: packed {list(t.shape)} {t.dtype}, layout says "
                                f"{list(f.shape)} {f.dtype}")
        pieces.append(t.contiguous().view(-1).view(torch.uint8))   # on the caches' device
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)


def unpack_part(part: Part, data: torch.Tensor, what: str) -> dict:
    """A part's bytes back to its fields {(kind, layer): tensor}; a clear error for a part of
    the wrong size or dtype (a truncated transfer, another config)."""
    if not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.dim() != 1:
        raise HandoverError(f"{what} part {part.name}: expected a flat uint8 tensor")
    if data.numel() != part.nbytes:
        raise HandoverError(f"{what} part {part.name}: {data.numel()} bytes, the layout needs {part.nbytes} "
                            "(truncated transfer, or P and D disagree on the config)")
    out, off = {}, 0
    for f in part.fields:
        piece = data[off:off + f.nbytes]
        if f.dtype != torch.uint8:     # a wider dtype needs an aligned start: its own copy
            piece = piece.clone()
        out[(f.kind, f.layer)] = piece.view(f.dtype).view(f.shape)
        off += f.nbytes
    return out


@dataclass
class Handover:
    """One request's hand-over as D receives it: its id, prompt (D's Engine keeps the ids),
    P's fingerprint and every part's bytes by name."""
    request_id: int
    prompt_ids: list
    fingerprint: bytes
    parts: dict = field(default_factory=dict)      # part name -> flat uint8 tensor

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    def nbytes(self) -> int:
        return sum(int(t.numel()) for t in self.parts.values())


def check(config: V41Config, handover: Handover, dtype: torch.dtype, what: str):
    """Every part of `handover` against this worker's layout: (parts, {(kind, layer): tensor}),
    or a HandoverError naming the missing / unexpected / wrong-size part."""
    parts = layout(config, handover.prompt_len, dtype)
    names = [p.name for p in parts]
    missing = [p for p in names if p not in handover.parts]
    if missing:
        raise HandoverError(f"{what}: truncated transfer, parts {missing} did not arrive "
                            f"({len(handover.parts)} of {len(names)})")
    extra = sorted(set(handover.parts) - set(names))
    if extra:
        raise HandoverError(f"{what}: unexpected parts {extra} (P and D disagree on the layer plan)")
    fields = {}
    for p in parts:
        fields.update(unpack_part(p, handover.parts[p.name], what))
    return parts, fields


def write_into(caches: ModelCaches, config: V41Config, parts: list[Part], fields: dict, slot: int,
               blocks: list[int], n: int) -> dict:
    """Write a checked hand-over (`check`) into D's caches (this slot and blocks). Returns the
    replay tensors (history, streams, pre) on the caches' device."""
    plan = build_layer_plan(config)
    dev = caches.engram_history.device
    for p in parts:
        for f in p.fields:
            if f.kind in ("history", "streams", "pre"):
                continue
            flat, rows = _rows_of(caches, f, slot, blocks, n, plan)
            flat.index_copy_(0, rows, fields[(f.kind, f.layer)].to(dev))
    caches.engram_history[slot].copy_(fields[("history", None)].to(dev))
    return {k: fields[(k, None)].to(dev) for k in ("history", "streams", "pre")}
