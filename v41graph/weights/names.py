"""The official DeepSeek-V4.1-Flash checkpoint layout: its tensor names, shapes and dtypes, and
how those names map onto V41Model's parameter names.

Layout (the released checkpoint: `config.json` + `model.safetensors.index.json` + shards; a single
`model.safetensors` works too). Names are the reference `state_dict()` names listed by
`accounting.checkpoint_shapes` plus one `.scale` per quantized weight; dtypes as released:

  F8_E4M3   dense projections (wq_a, wq_b, wkv, wo_b, indexer.wq_b), shared experts, Engram wkv,
            Engram tables, DSpark main_proj; `X.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]
            (table: [rows, head_dim/32])
  F4        routed experts, logical [out, in] in the header, stored [out, in/2] (element 2j in
            the low nibble); `X.scale` F8_E8M0 [out, in/32]
  F32       head, hc_*, attn_sink, gate.bias, ratio>1 compressor wkv/wgate, DSpark markov head
            and confidence proj
  compute   (config.torch_dtype, BF16 as released) everything else: embed, norms, gate.weight,
            wo_a, indexer weights_proj / wk, ratio-1 compressor wkv, Engram q/k weights, ...
A config with weight_format="dense" (v41graph's own switch) stores the FP8/FP4 projections dense
in the compute dtype without scales; Engram tables stay FP8.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from v41graph.model.config import V41Config
from v41graph.model.model import V41Model

from .accounting import checkpoint_shapes
from .checkpoint import physical_shape

__all__ = ["TensorSpec", "official_to_module_name", "module_to_official_name", "official_kind",
           "official_tensor_specs", "split_name", "hc_module_name", "compute_dtype",
           "EXPERT_WEIGHT"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_ST_OF = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def compute_dtype(config: V41Config) -> torch.dtype:
    """The torch dtype named by config.torch_dtype (bfloat16, as released, for other names)."""
    return _TORCH_DTYPES.get(config.torch_dtype, torch.bfloat16)


# ============================================================================ names
def _engram_slot(layer: int, model_or_config) -> int | None:
    if isinstance(model_or_config, V41Model):
        return model_or_config.plan[layer].engram_slot
    ids = list(model_or_config.engram_layer_ids)
    return ids.index(layer) if layer in ids else None


def hc_module_name(rest: str) -> str:
    """'hc_attn_fn' -> 'hc_attn.fn': the checkpoint flattens each HyperConnection's fields."""
    sub, field = rest.rsplit("_", 1)
    return f"{sub}.{field}"


def official_to_module_name(name: str, model) -> str | None:
    """Official checkpoint name -> our parameter name (None for tensors we do not hold).
    `model` is a V41Model or a V41Config."""
    if name.startswith("mtp."):
        return None
    if name == "head.weight":
        return "head"
    parts = name.split(".")
    if parts[0] == "layers":
        layer = int(parts[1])
        rest = ".".join(parts[2:])
        if rest.startswith("hc_"):
            return f"layers.{layer}.{hc_module_name(rest)}"
        if rest.startswith("engram."):
            slot = _engram_slot(layer, model)
            if slot is None:
                raise KeyError(f"{name}: layer {layer} has no Engram in this config")
            tail = rest[len("engram."):]
            tail = {"embed.weight": "embed_weight", "embed.scale": "embed_scale"}.get(tail, tail)
            return f"engram.{slot}.{tail}"
        return f"layers.{layer}.{rest}"
    return name


def module_to_official_name(name: str, config: V41Config) -> str:
    """Our parameter name -> official checkpoint name (inverse of official_to_module_name)."""
    if name == "head":
        return "head.weight"
    parts = name.split(".")
    if parts[0] == "engram":
        tail = ".".join(parts[2:])
        tail = {"embed_weight": "embed.weight", "embed_scale": "embed.scale"}.get(tail, tail)
        return f"layers.{config.engram_layer_ids[int(parts[1])]}.engram.{tail}"
    if parts[0] == "layers" and len(parts) == 4 and parts[2].startswith("hc_"):
        return f"layers.{parts[1]}.{parts[2]}_{parts[3]}"
    return name


# ============================================================================ specs
@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the official layout: logical shape, safetensors dtype and role.
    kind: "fp8" | "fp4" | "table" (Engram FP8 table) | "scale" (E8M0 of `weight`) | "float"."""
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    weight: str | None = None

    @property
    def physical_shape(self) -> tuple[int, ...]:
        return physical_shape(self.dtype, self.shape)


_FP8_SUFFIXES = {"attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
                 "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight",
                 "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight",
                 "engram.wkv.weight", "main_proj.weight"}
_F32_SUFFIXES = {"attn.attn_sink", "ffn.gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                 "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "markov_head.head.weight",
                 "confidence_head.proj.weight"}
EXPERT_WEIGHT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")   # of split_name's rest


def split_name(name: str) -> tuple[str, int | None, str]:
    """'layers.3.attn.wq_a.weight' -> ('layers', 3, 'attn.wq_a.weight'); top-level -> ('', None, name)."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 2 and parts[1].isdigit():
        return parts[0], int(parts[1]), ".".join(parts[2:])
    return "", None, name


def official_kind(name: str, config: V41Config) -> str:
    """"fp8" | "fp4" | "table" | "f32" | "compute": the released format of a weight tensor."""
    prefix, idx, rest = split_name(name)
    if name == "head.weight" or rest in _F32_SUFFIXES:
        return "f32"
    if rest == "engram.embed.weight":
        return "table"
    if EXPERT_WEIGHT.match(rest):
        return "fp4"
    if rest in _FP8_SUFFIXES:
        return "fp8"
    if prefix == "layers" and rest in ("attn.compressor.wkv.weight", "attn.compressor.wgate.weight") \
            and config.compress_ratios[idx] > 1:
        return "f32"
    return "compute"


def official_tensor_specs(config: V41Config, include_mtp: bool = True) -> dict[str, TensorSpec]:
    """Every tensor of the official checkpoint for `config` (scales included), in
    checkpoint_shapes order, each weight followed by its scale."""
    if config.torch_dtype not in _ST_OF:
        raise ValueError(f"torch_dtype {config.torch_dtype!r} not supported "
                         f"(one of {sorted(_ST_OF)})")
    compute = _ST_OF[config.torch_dtype]
    quantized = config.weight_format == "checkpoint"
    if config.weight_format not in ("checkpoint", "dense"):
        raise ValueError(f"weight_format must be 'checkpoint' or 'dense', got {config.weight_format!r}")
    specs: dict[str, TensorSpec] = {}
    for name, shape in checkpoint_shapes(config):
        if not include_mtp and name.startswith("mtp."):
            continue
        shape = tuple(int(s) for s in shape)
        kind = official_kind(name, config)
        scale_name = name[: -len("weight")] + "scale"
        if kind == "table":
            specs[name] = TensorSpec(name, shape, "F8_E4M3", "table")
            specs[scale_name] = TensorSpec(scale_name, (shape[0], shape[1] // 32), "F8_E8M0",
                                           "scale", name)
        elif kind == "fp8" and quantized:
            specs[name] = TensorSpec(name, shape, "F8_E4M3", "fp8")
            specs[scale_name] = TensorSpec(scale_name, (math.ceil(shape[0] / 32),
                                                        math.ceil(shape[1] / 32)),
                                           "F8_E8M0", "scale", name)
        elif kind == "fp4" and quantized:
            specs[name] = TensorSpec(name, shape, "F4", "fp4")
            specs[scale_name] = TensorSpec(scale_name, (shape[0], shape[1] // 32), "F8_E8M0",
                                           "scale", name)
        else:
            specs[name] = TensorSpec(name, shape, "F32" if kind == "f32" else compute, "float")
    return specs
