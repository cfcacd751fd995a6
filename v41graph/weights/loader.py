"""Load and save checkpoints in the official DeepSeek-V4.1-Flash layout.

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

Loading (`from_pretrained`) validates every header and the index first, then builds the model
with its large parameters unallocated (meta) and streams tensor by tensor with `pread`
straight into each freshly allocated parameter, so peak host memory is the model plus one
tensor (plus one dequantized tensor with dequantize=True), never the checkpoint twice.
Options: dequantize=True (dense model with the exact dequantized FP8/FP4 values), Engram table
storage ("memory", "pinned" when CUDA is available, "mmap" = copy-on-write mapping of the file),
device placement that leaves the Engram tables on the host, and tensor-/expert-parallel sharding
(`ShardSpec`, `load_sharded_state_dict`). DSpark stages (`mtp.*`) are validated but not loaded
into V41Model (the serving runtime owns them); `save_pretrained` carries them over from the
source checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from v41graph.custom_ops import codecs

from .accounting import checkpoint_shapes
from .checkpoint import (DEFAULT_MAX_SHARD_BYTES, ST_DTYPES, TORCH_TO_ST, Checkpoint, CheckpointError, CheckpointWriter, Progress, logical_shape_of, physical_shape, progress_default, torch_dtype_of)
from v41graph.model.config import V41Config
from v41graph.model.engram_hash import build_compressed_token_map
from v41graph.model.layer_plan import build_layer_plan
from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model

__all__ = ["CheckpointError", "ShardSpec", "TensorSpec", "official_to_module_name",
           "module_to_official_name", "official_tensor_specs", "validate_checkpoint",
           "from_pretrained", "load_official_state_dict", "load_sharded_state_dict",
           "merge_shards", "save_pretrained", "write_random_checkpoint", "place_model"]

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_ST_OF = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}
TOKENIZER_FILES = ("tokenizer_stub.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


# ============================================================================ names
def _engram_slot(layer: int, model_or_config) -> int | None:
    if isinstance(model_or_config, V41Model):
        return model_or_config.plan[layer].engram_slot
    ids = list(model_or_config.engram_layer_ids)
    return ids.index(layer) if layer in ids else None


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
        if rest.startswith("hc_"):                      # hc_attn_fn -> hc_attn.fn
            sub, field = rest.rsplit("_", 1)
            return f"layers.{layer}.{sub}.{field}"
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
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def _split_name(name: str) -> tuple[str, int | None, str]:
    """'layers.3.attn.wq_a.weight' -> ('layers', 3, 'attn.wq_a.weight'); top-level -> ('', None, name)."""
    parts = name.split(".")
    if parts[0] in ("layers", "mtp") and len(parts) > 2 and parts[1].isdigit():
        return parts[0], int(parts[1]), ".".join(parts[2:])
    return "", None, name


def official_kind(name: str, config: V41Config) -> str:
    """"fp8" | "fp4" | "table" | "f32" | "compute": the released format of a weight tensor."""
    prefix, idx, rest = _split_name(name)
    if name == "head.weight" or rest in _F32_SUFFIXES:
        return "f32"
    if rest == "engram.embed.weight":
        return "table"
    if _EXPERT.match(rest):
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


# ============================================================================ validation
_MAX_LISTED = 2000


def _problem_error(header: str, problems: list[str], path) -> CheckpointError:
    shown = problems[:_MAX_LISTED]
    more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    return CheckpointError(f"{header} ({len(problems)} problems):\n  " + "\n  ".join(shown) + more,
                           path, problems)


def validate_checkpoint(ckpt: Checkpoint, specs: Mapping[str, TensorSpec],
                        config_path: str | Path | None = None) -> None:
    """Raise one CheckpointError listing every missing, unexpected, wrong-shape and wrong-dtype
    tensor (each with the shard file it is in). DSpark tensors (`mtp.*`) may be absent as a
    whole (backbone-only checkpoint); if any is present they must all be."""
    problems = []
    present = ckpt.tensors
    has_mtp = any(n.startswith("mtp.") for n in present)
    for name, spec in specs.items():
        info = present.get(name)
        if info is None:
            if not (name.startswith("mtp.") and not has_mtp):
                problems.append(f"missing: {name} ({spec.dtype} {list(spec.shape)})")
            continue
        where = ckpt.weight_map[name]
        if info.dtype != spec.dtype:
            problems.append(f"wrong dtype: {name} in {where} is {info.dtype}, expected {spec.dtype}")
        if info.shape != spec.shape:
            problems.append(f"wrong shape: {name} in {where} is {list(info.shape)}, "
                            f"expected {list(spec.shape)}")
    for name, info in present.items():
        if name not in specs:
            problems.append(f"unexpected: {name} in {ckpt.weight_map[name]} "
                            f"({info.dtype} {list(info.shape)})")
    if problems:
        against = f"its config {config_path}" if config_path else "the config"
        raise _problem_error(f"{ckpt.root}: checkpoint does not match {against}", problems,
                             config_path or ckpt.root)


def _open_validated(path: Path, overrides: dict | None = None):
    """(checkpoint, file config, specs of the file layout) for a directory or a file."""
    ckpt = Checkpoint.open(path)
    config = V41Config.from_json(ckpt.config_path)
    file_format = config.weight_format
    for k, v in (overrides or {}).items():
        if not hasattr(config, k):
            raise TypeError(f"unknown config override {k!r}")
        setattr(config, k, v)
    layout = dataclasses.replace(config, weight_format=file_format)
    specs = official_tensor_specs(layout, include_mtp=True)
    validate_checkpoint(ckpt, specs, ckpt.config_path)
    return ckpt, config, specs


# ============================================================================ model building
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn}


class _LargeTensorsOnMeta(TorchFunctionMode):
    """While building a model, factory calls for tensors of >= min_numel elements go to the
    meta device (no memory, no init); buffers computed from arange/tensor stay real."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None and args:
            size = args[0] if isinstance(args[0], (tuple, list, torch.Size)) else \
                [a for a in args if isinstance(a, int)]
            try:
                numel = math.prod(int(s) for s in size)
            except (TypeError, ValueError):
                numel = 0
            if numel >= self.min_numel:
                kwargs["device"] = "meta"
        return func(*args, **kwargs)


def _build_empty_model(config: V41Config) -> V41Model:
    """V41Model with its large parameters on the meta device (allocated when loaded)."""
    with default_dtype(_DTYPES.get(config.torch_dtype, torch.bfloat16)):
        with _LargeTensorsOnMeta(4096):
            model = V41Model(config)
        if any(b.is_meta for b in model.buffers()):      # a buffer we cannot rebuild: eager
            model = V41Model(config)
    return model


def _owner(model: nn.Module, param_name: str) -> tuple[nn.Module, str]:
    mod, _, attr = param_name.rpartition(".")
    return (model.get_submodule(mod) if mod else model), attr


def _set_param(model: nn.Module, param_name: str, data: torch.Tensor) -> nn.Parameter:
    module, attr = _owner(model, param_name)
    old = module._parameters[attr]
    p = nn.Parameter(data, requires_grad=old.requires_grad if old is not None else False)
    module._parameters[attr] = p
    return p


def _allocate(model: nn.Module, param_name: str, pin: bool = False) -> nn.Parameter:
    module, attr = _owner(model, param_name)
    old = module._parameters[attr]
    if not old.is_meta and not pin and old.is_contiguous():
        return old
    return _set_param(model, param_name, torch.empty(old.shape, dtype=old.dtype, pin_memory=pin))


def _model_targets(model: V41Model, specs: Mapping[str, TensorSpec], dequantize: bool):
    """official name -> our parameter name for every backbone tensor that is loaded; checks
    that the model's parameters are exactly those, with matching shapes."""
    params = dict(model.named_parameters())
    targets, problems = {}, []
    for name, spec in specs.items():
        if name.startswith("mtp."):
            continue
        if dequantize and spec.kind == "scale" and specs[spec.weight].kind in ("fp8", "fp4"):
            continue
        target = official_to_module_name(name, model)
        p = params.get(target)
        if p is None:
            problems.append(f"{name}: the model has no parameter {target}")
            continue
        want = spec.shape if dequantize and spec.kind in ("fp8", "fp4") else spec.physical_shape
        if tuple(p.shape) != tuple(want):
            problems.append(f"{name}: model parameter {target} is {list(p.shape)}, layout says {list(want)}")
        targets[name] = target
    extra = sorted(set(params) - set(targets.values()))
    problems += [f"model parameter {n} has no checkpoint tensor" for n in extra]
    if problems:
        raise RuntimeError("V41Model and the checkpoint layout (accounting.checkpoint_shapes) "
                           "disagree:\n  " + "\n  ".join(problems))
    return targets


_FP4_BYTE_TABLE: torch.Tensor | None = None


def _dequant_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """codecs.dequant_fp8_weight with one broadcast multiply (bit-identical, faster)."""
    out_f, in_f = w.shape
    if out_f % 32 or in_f % 32:
        return codecs.dequant_fp8_weight(w.view(torch.float8_e4m3fn), s)
    x = w.view(torch.float8_e4m3fn).float().view(out_f // 32, 32, in_f // 32, 32)
    return (x * codecs.e8m0_to_float(s)[:, None, :, None]).view(out_f, in_f)


def _dequant_fp4(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """codecs.dequant_fp4_weight through a 256-entry byte -> (low, high) value table
    (bit-identical, faster)."""
    global _FP4_BYTE_TABLE
    if _FP4_BYTE_TABLE is None:
        byte = torch.arange(256)
        _FP4_BYTE_TABLE = torch.stack([codecs.e2m1_decode(byte & 15), codecs.e2m1_decode(byte >> 4)], -1)
    out_f = w.shape[0]
    x = _FP4_BYTE_TABLE[w.long()].view(out_f, -1, 32)
    return (x * codecs.e8m0_to_float(s).unsqueeze(-1)).view(out_f, -1)


def _dequantize(ckpt: Checkpoint, spec: TensorSpec, specs) -> torch.Tensor:
    scale_name = spec.name[: -len("weight")] + "scale"
    w = ckpt.read(spec.name).view(torch.uint8)
    s = ckpt.read(scale_name).view(torch.uint8)
    return _dequant_fp8(w, s) if spec.kind == "fp8" else _dequant_fp4(w, s)


def _load_into_model(model: V41Model, ckpt: Checkpoint, specs: Mapping[str, TensorSpec],
                     dequantize: bool = False, engram_storage: str = "memory", progress=None) -> None:
    if engram_storage not in ("memory", "pinned", "mmap"):
        raise ValueError(f"engram_storage must be 'memory', 'pinned' or 'mmap', got {engram_storage!r}")
    pin = engram_storage == "pinned"
    if pin and not torch.cuda.is_available():
        warnings.warn("engram_storage='pinned' needs CUDA; Engram tables stay in ordinary host memory")
        pin = False
    targets = _model_targets(model, specs, dequantize)
    total = sum(ckpt.info(n).nbytes for n in targets)
    bar = Progress("loading", total, progress_default(progress, total))
    for name in ckpt.names_in_file_order():
        target = targets.get(name)
        if target is None:
            continue
        spec, info = specs[name], ckpt.info(name)
        table = spec.kind == "table" or (spec.kind == "scale" and specs[spec.weight].kind == "table")
        with torch.no_grad():
            if table and engram_storage == "mmap":
                _set_param(model, target, ckpt.memmap(name).view(torch.uint8))
            elif dequantize and spec.kind in ("fp8", "fp4"):
                p = _allocate(model, target)
                p.copy_(_dequantize(ckpt, spec, specs))
            else:
                p = _allocate(model, target, pin=pin and table)
                if info.torch_dtype == p.dtype or (p.dtype == torch.uint8 and ST_DTYPES[info.dtype][1] == 1):
                    ckpt.read_into(name, p.data)
                else:                                   # e.g. BF16 norm -> fp32 parameter
                    p.copy_(ckpt.read(name).to(p.dtype))
        bar.update(info.nbytes, name)
    bar.close()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"parameters not loaded: {left}")


def place_model(model: V41Model, device, engram_device=None) -> V41Model:
    """Move the model to `device`, leaving the Engram tables (embed_weight / embed_scale) where
    they are unless engram_device is given."""
    tables = {id(t) for e in model.engram for t in (e.embed_weight, e.embed_scale)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            dev = engram_device if id(p) in tables else device
            if dev is not None and p.device != torch.device(dev):
                module._parameters[name] = nn.Parameter(p.data.to(dev), requires_grad=p.requires_grad)
        for name, b in list(module._buffers.items()):
            if b is not None and device is not None:
                module._buffers[name] = b.to(device)
        if hasattr(module, "_dense_cache"):
            module._dense_cache = None
    return model


# ============================================================================ from_pretrained
def from_pretrained(path: str | Path, numerics: str = "reference", *, dequantize: bool = False,
                    engram_storage: str = "memory", device=None, engram_device=None,
                    shard: "ShardSpec | None" = None, progress=None, **overrides) -> V41Model:
    """Build a model from a checkpoint in the official layout (directory with config.json and
    `model.safetensors.index.json` + shards or `model.safetensors`; or one .safetensors file).

    numerics="reference" keeps DeepSeek's arithmetic (bf16 activations, blockwise FP8 GEMMs);
    "fast" dequantizes weights to the compute dtype once.
    dequantize=True builds the model with weight_format="dense" and fills every FP8/FP4
    projection with its exact dequantized values (Engram tables stay FP8).
    engram_storage: "memory" | "pinned" (page-locked, when CUDA is available) | "mmap"
    (copy-on-write mapping of the shard; pages are read on first use).
    device: where everything but the Engram tables goes (default: stay on the CPU);
    engram_device: move the tables too.
    shard: a ShardSpec; only world_size=1 (the identity) builds a V41Model — for more ranks use
    load_sharded_state_dict until the distributed runtime exists.
    progress: None (a stderr line for >= 1 GiB on a terminal), True/False, or
    callback(done_bytes, total_bytes, name).
    overrides: config fields to change (e.g. fake_quant=False).
    Raises CheckpointError (a ValueError) naming the file for any layout problem.
    """
    if shard is not None and shard.world_size != 1:
        raise NotImplementedError(
            f"from_pretrained(shard={shard}): V41Model holds whole tensors; until the distributed "
            f"runtime exists, read one rank's tensors with load_sharded_state_dict(path, shard)")
    path = Path(path)
    if overrides.get("weight_format") == "dense":
        dequantize = True
    ckpt, config, specs = _open_validated(path, {k: v for k, v in overrides.items()
                                                 if k != "weight_format"})
    try:
        model_config = dataclasses.replace(config, weight_format="dense") if dequantize else config
        model = _build_empty_model(model_config)
        _load_into_model(model, ckpt, specs, dequantize, engram_storage, progress)
    finally:
        ckpt.close()
    stub = ckpt.root / "tokenizer_stub.json"
    if stub.is_file():   # the compressed-id map of Engram comes from the tokenizer's texts
        vocab = json.loads(stub.read_text())
        token_map, size = build_compressed_token_map(vocab["texts"], vocab.get("raw"))
        if size != config.engram_compressed_vocab_size:
            raise ValueError(f"{stub}: tokenizer gives {size} compressed ids, config says "
                             f"{config.engram_compressed_vocab_size}")
        model.engram_token_map.copy_(token_map)
    model.checkpoint_dir = ckpt.root
    if device is not None or engram_device is not None:
        place_model(model, device, engram_device)
    return model.set_numerics(numerics).eval()


def load_official_state_dict(model: V41Model, tensors: dict) -> list[str]:
    """Copy official-name tensors (an in-memory dict, e.g. safetensors.torch.load_file) into
    the model. Raises one ValueError listing every missing, unexpected or mismatched tensor.
    Returns the names that were skipped on purpose (mtp.*)."""
    params = dict(model.named_parameters())
    problems, skipped, loaded = [], [], set()
    for name, t in tensors.items():
        try:
            target = official_to_module_name(name, model)
        except KeyError as exc:
            problems.append(f"unexpected: {exc.args[0]}")
            continue
        if target is None:
            skipped.append(name)
            continue
        p = params.get(target)
        if p is None:
            problems.append(f"unexpected: {name}")
            continue
        if p.dtype == torch.uint8:                       # FP8 / FP4 / E8M0 raw bytes
            if t.element_size() != 1 or t.is_floating_point() and t.dtype not in TORCH_TO_ST:
                problems.append(f"dtype: {name} is {t.dtype}, expected a 1-byte format")
                continue
            t = t.view(torch.uint8)
        elif not t.is_floating_point():
            problems.append(f"dtype: {name} is {t.dtype}, expected a floating-point tensor")
            continue
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"shape: {name} is {list(t.shape)}, expected {list(p.shape)}")
            continue
        with torch.no_grad():
            if p.is_meta:
                p = _allocate(model, target)
            p.copy_(t.to(p.dtype))
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    problems += [f"missing: {m}" for m in missing]
    if problems:
        raise ValueError("checkpoint does not match the model:\n  " + "\n  ".join(problems))
    return skipped


def _load_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint in memory (small checkpoints and tests only)."""
    with Checkpoint.open(path) as ckpt:
        return {n: ckpt.read(n) for n in ckpt.names_in_file_order()}


# ============================================================================ sharding hooks
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
        _, _, rest = _split_name(name)
        if name in ("embed.weight", "head.weight") or rest in _COLUMN_PARALLEL:
            return 0
        if rest in _ROW_PARALLEL:
            return 1
        m = _EXPERT.match(rest)
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
        prefix, _, rest = _split_name(wname)
        ws, r = self.world_size, self.rank
        m = _EXPERT.match(rest)
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
    ckpt, config, specs = _open_validated(Path(path))
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


# ============================================================================ saving
def _official_tensor(spec: TensorSpec, p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor in the official dtype and physical shape, whether the cast rounded values)."""
    p = p.detach()
    want = torch_dtype_of(spec.dtype)
    if p.dtype == torch.uint8 and ST_DTYPES[spec.dtype][1] == 1:
        return (p if want == torch.uint8 else p.view(want)), False
    if not p.is_floating_point() or ST_DTYPES[spec.dtype][1] == 1:
        raise ValueError(f"{spec.name}: a {p.dtype} parameter cannot be saved as {spec.dtype}")
    if p.dtype == want:
        return p, False
    t = p.to(want)
    return t, not torch.equal(t.to(p.dtype), p)


def save_pretrained(model: V41Model, path: str | Path, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, single_file: bool | None = None,
                    extra_tensors: Mapping[str, torch.Tensor] | None = None, mtp="auto",
                    copy_files: Sequence[str] = TOKENIZER_FILES, progress=None) -> list[Path]:
    """Write the model in the official layout: config.json, shards of at most max_shard_bytes
    (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, or one
    `model.safetensors` when it all fits / single_file=True), official names and dtypes.

    mtp: "auto" copies the DSpark tensors (`mtp.*`, which V41Model does not hold) from the
    checkpoint the model was loaded from, if it had them; a path copies them from that
    checkpoint; None writes none. extra_tensors: more official-name tensors to write as they are
    (official torch dtypes; F4 as float4_e2m1fn_x2 [.., n/2]).
    copy_files: tokenizer files copied from the source checkpoint directory (the Engram
    compressed-id map is rebuilt from tokenizer_stub.json when loading).
    Values that the official dtype cannot hold exactly (e.g. fp32 norm weights of a random
    bf16 model) are rounded, with a warning. Returns the shard files.
    """
    path = Path(path)
    config = model.config
    specs = official_tensor_specs(config, include_mtp=False)
    params = dict(model.named_parameters())
    extra = dict(extra_tensors or {})
    source = getattr(model, "checkpoint_dir", None)
    mtp_ckpt = None
    if mtp == "auto":
        mtp = source
    if mtp is not None and not any(n.startswith("mtp.") for n in extra):
        try:
            mtp_ckpt = Checkpoint.open(mtp)
        except CheckpointError:
            if mtp is not source:
                raise
        if mtp_ckpt is not None and Path(mtp_ckpt.root).resolve() == path.resolve():
            raise ValueError(f"save_pretrained: cannot overwrite the checkpoint {path} the DSpark "
                             f"tensors are read from; save elsewhere or pass mtp=None")
    mtp_names = [n for n in (mtp_ckpt.names_in_file_order() if mtp_ckpt else []) if n.startswith("mtp.")]

    entries, problems = [], []
    for name, spec in specs.items():
        p = params.get(official_to_module_name(name, model))
        if p is None:
            problems.append(f"{name}: no model parameter")
            continue
        if tuple(p.shape) != spec.physical_shape:
            problems.append(f"{name}: parameter is {list(p.shape)}, layout says {list(spec.physical_shape)}")
        entries.append((name, spec.dtype, spec.shape))
    if problems:
        raise RuntimeError("V41Model and the checkpoint layout disagree:\n  " + "\n  ".join(problems))
    for name, t in extra.items():
        if name in specs:
            raise ValueError(f"extra_tensors: {name} is a model tensor")
        st = TORCH_TO_ST.get(t.dtype)
        if st is None:
            raise ValueError(f"extra_tensors: {name} has dtype {t.dtype} with no safetensors name")
        entries.append((name, st, logical_shape_of(t, st)))
    for name in mtp_names:
        info = mtp_ckpt.info(name)
        entries.append((name, info.dtype, info.shape))

    lossy = []
    try:
        with CheckpointWriter(path, entries, max_shard_bytes, single_file,
                              metadata={"producer": "v41graph.save_pretrained"},
                              progress=progress_default(progress, sum(
                                  p.numel() * p.element_size() for p in params.values()))) as w:
            for name, spec in specs.items():
                t, rounded = _official_tensor(spec, params[official_to_module_name(name, model)])
                if rounded:
                    lossy.append(name)
                w.write(name, t)
            for name, t in extra.items():
                w.write(name, t)
            for name in mtp_names:
                w.write(name, mtp_ckpt.read(name))
            files = [w.dir / f for f in w.file_names]
    finally:
        if mtp_ckpt is not None:
            mtp_ckpt.close()
    config.save_json(path / "config.json")
    if source is not None and Path(source).resolve() != path.resolve():
        for fname in copy_files:
            if (Path(source) / fname).is_file():
                shutil.copyfile(Path(source) / fname, path / fname)
    if lossy:
        warnings.warn(f"save_pretrained: {len(lossy)} tensors were rounded to their official dtype "
                      f"(e.g. {', '.join(lossy[:5])})")
    return files


# ============================================================================ random checkpoints
def _unit_generator(seed: int, unit: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + unit) % (2 ** 63))


def _random_official(spec: TensorSpec, specs, g: torch.Generator) -> torch.Tensor:
    """Random data for one official tensor by name, with init_random_'s rules (used for the
    DSpark stages, which V41Model does not hold)."""
    name = spec.name
    if spec.kind in ("fp8", "table"):
        return torch.randint(0, 256, spec.physical_shape, generator=g, dtype=torch.uint8) & 0xB7
    if spec.kind == "fp4":
        return torch.randint(0, 256, spec.physical_shape, generator=g, dtype=torch.uint8)
    if spec.kind == "scale":
        w = specs[spec.weight]
        if w.kind == "table":
            return torch.full(spec.shape, 127, dtype=torch.uint8)
        exponent = round(math.log2(w.shape[1] ** -0.5))
        return torch.full(spec.shape, 127 + exponent + (1 if w.kind == "fp8" else -1), dtype=torch.uint8)
    shape = spec.shape
    if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
        t = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("attn_sink"):
        t = torch.randn(shape, generator=g)
    elif name.endswith("_fn"):
        t = 0.02 * torch.randn(shape, generator=g)
    elif name.endswith(("_base", "gate.bias")):
        t = 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("_scale"):
        t = torch.ones(shape)
    else:
        t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    return t.to(torch_dtype_of(spec.dtype))


def _unit_groups(module: nn.Module, path: str):
    """(path, submodule) pieces of a layer small enough to initialise one at a time: every
    child, with MoE and ModuleLists (the experts) split into their children."""
    from v41graph.model.moe import MoE
    for name, child in module.named_children():
        sub = f"{path}.{name}"
        if isinstance(child, (nn.ModuleList, MoE)):
            yield from _unit_groups(child, sub)
        else:
            yield sub, child


def write_random_checkpoint(config: V41Config, out: str | Path, seed: int = 0, *,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            single_file: bool | None = None, include_mtp: bool = True,
                            progress=None, chunk_bytes: int = 64 << 20) -> list[Path]:
    """A random checkpoint of `config` in the official layout, streamed.

    Each layer (and each Engram module) is built with unallocated storage (torch.empty), then
    one piece at a time (attention, each expert, the gate, norms, hc_*) is filled by
    `init_random_`, written at its final offset in its shard and freed; the embedding and head
    go through init_random_ in blocks of rows, the Engram tables are generated in blocks of rows
    with init_random_'s rule, the DSpark tensors (`mtp.*`, not part of V41Model) one by one with
    the same rules. Peak memory is about one attention module or chunk_bytes, whatever the
    config. Deterministic in `seed`; not the values of init_random_(V41Model(config), seed)
    (each piece has its own generator)."""
    from v41graph.model.engram import Engram
    from v41graph.model.layers import RMSNorm
    from v41graph.model.model import Block, init_random_

    out = Path(out)
    specs = official_tensor_specs(config, include_mtp)
    entries = [(s.name, s.dtype, s.shape) for s in specs.values()]
    total = sum(math.prod(s.physical_shape) * ST_DTYPES[s.dtype][1] for s in specs.values())
    compute = _DTYPES[config.torch_dtype]
    counter = iter(range(1 << 62))

    def next_seed() -> int:
        return (seed * 1_000_003 + next(counter)) % (2 ** 63)

    def init_and_write(w, path: str, module: nn.Module) -> None:
        """init_random_ on `module` (named as at `path` in V41Model), write, free."""
        attr = path.rsplit(".", 1)[-1]
        holder = nn.Module()
        if isinstance(module, nn.Parameter):
            holder.register_parameter(attr, module)
        else:
            setattr(holder, attr if not attr.isdigit() else "unit", module)
        holder.engram = nn.ModuleList()          # tables are generated separately, in blocks
        init_random_(holder, seed=next_seed())
        named = [("", module)] if isinstance(module, nn.Parameter) else list(module.named_parameters())
        for n, p in named:
            if p.numel():
                name = module_to_official_name(f"{path}.{n}" if n else path, config)
                w.write(name, _official_tensor(specs[name], p)[0])
        if not isinstance(module, nn.Parameter):
            for m in module.modules():           # drop the storage (shapes stay, on meta)
                for pn, p in list(m._parameters.items()):
                    if p is not None:
                        m._parameters[pn] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                                                     device="meta"),
                                                         requires_grad=p.requires_grad)

    def rows_in_blocks(w, name: str, rows: int, row_bytes: int, make) -> None:
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            w.write(name, make(n), byte_offset=r0 * row_bytes)

    with CheckpointWriter(out, entries, max_shard_bytes, single_file,
                          metadata={"producer": "v41graph.write_random_checkpoint", "seed": seed},
                          progress=progress_default(progress, total)) as w, default_dtype(compute):
        d, vocab = config.hidden_size, config.vocab_size
        for name, dtype in (("embed.weight", compute), ("head.weight", torch.float32)):
            spec = specs[name]

            def block_of_rows(n, name=name, dtype=dtype, spec=spec):
                holder = nn.Module()
                holder.engram = nn.ModuleList()
                holder.weight = nn.Parameter(torch.empty(n, d, dtype=dtype))
                init_random_(holder, seed=next_seed())     # randn * d^-0.5, as for the model
                return _official_tensor(spec, holder.weight)[0]
            row_bytes = d * ST_DTYPES[spec.dtype][1]
            rows_in_blocks(w, name, vocab, row_bytes, block_of_rows)
        init_and_write(w, "norm", RMSNorm(d, config.rms_norm_eps))
        for role in build_layer_plan(config):
            if role.engram_slot is not None:
                slot = role.engram_slot
                engram = Engram(config, 0)                      # tables: below, in blocks
                for path, piece in _unit_groups(engram, f"engram.{slot}"):
                    init_and_write(w, path, piece)
                for pn in ("q_weight", "k_weight"):
                    init_and_write(w, f"engram.{slot}.{pn}", getattr(engram, pn))
                table = f"layers.{role.layer_id}.engram.embed.weight"
                rows, hd = specs[table].shape
                g = _unit_generator(seed, next(counter))
                rows_in_blocks(w, table, rows, hd, lambda n: torch.randint(
                    0, 256, (n, hd), generator=g, dtype=torch.uint8) & 0xB7)
                rows_in_blocks(w, table[: -len("weight")] + "scale", rows, hd // 32,
                               lambda n: torch.full((n, hd // 32), 127, dtype=torch.uint8))
                del engram
            block = Block(config, role)     # Linear weights: torch.empty, untouched until init
            covered = set()
            for path, piece in _unit_groups(block, f"layers.{role.layer_id}"):
                covered.update(f"{path}.{n}" for n, _ in piece.named_parameters())
                init_and_write(w, path, piece)
            assert len(covered) == sum(1 for _ in block.parameters()), "layer pieces missed a parameter"
            del block
        if include_mtp:
            for name, spec in specs.items():
                if name.startswith("mtp."):
                    w.write(name, _random_official(spec, specs, _unit_generator(seed, next(counter))))
        files = [w.dir / f for f in w.file_names]
    config.save_json(out / "config.json")
    return files
