"""Loading checkpoints in the official layout (see names.py) into V41Model.

`from_pretrained` validates every header and the index first (`validate_checkpoint`: one
CheckpointError listing every problem), then builds the model with its large parameters
unallocated (meta) and streams tensor by tensor with `pread` straight into each freshly
allocated parameter, so peak host memory is the model plus one tensor (plus one dequantized
tensor with dequantize=True), never the checkpoint twice. Options: dequantize=True (dense model
with the exact dequantized FP8/FP4 values), Engram table storage ("memory", "pinned" when CUDA
is available, "mmap" = copy-on-write mapping of the file), and device placement that leaves the
Engram tables on the host (`place_model`). DSpark stages (`mtp.*`) are validated but not loaded
into V41Model (the serving runtime owns them: dspark.py). `load_official_state_dict` copies an
in-memory dict of official-name tensors instead.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from v41graph.custom_ops import codecs
from v41graph.model.config import V41Config
from v41graph.model.engram_hash import build_compressed_token_map, tokenizer_token_texts
from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model

from v41graph.progress import bar

from .checkpoint import ST_DTYPES, TORCH_TO_ST, Checkpoint, CheckpointError
from .names import TensorSpec, compute_dtype, official_tensor_specs, official_to_module_name

if TYPE_CHECKING:
    from .sharding import ShardSpec

_log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "validate_checkpoint", "open_validated", "from_pretrained",
           "load_official_state_dict", "place_model"]


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


def open_validated(path: Path, overrides: dict | None = None):
    """(checkpoint, file config, specs of the file layout) for a directory or a file."""
    ckpt = Checkpoint.open(path)
    config = V41Config.from_json(ckpt.config_path)
    file_format = config.weight_format
    fields = {f.name for f in dataclasses.fields(config)} - {"extra"}
    for k in overrides or {}:
        if k not in fields:
            raise TypeError(f"unknown config override {k!r}")
    config = dataclasses.replace(config, **(overrides or {}))      # validated like any config
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


def _build_empty_model(config: V41Config, parallel=None) -> V41Model:
    """V41Model (a rank's share with `parallel`) with its large parameters on the meta device
    (allocated when loaded)."""
    with default_dtype(compute_dtype(config)):
        with _LargeTensorsOnMeta(4096):
            model = V41Model(config, parallel)
        if any(b.is_meta for b in model.buffers()):      # a buffer we cannot rebuild: eager
            model = V41Model(config, parallel)
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


def _allocate(model: nn.Module, param_name: str, pin: bool = False, device=None) -> nn.Parameter:
    """The parameter's storage to load into: a new one (pinned host memory, or on `device`)
    for the large parameters the model was built without; small ones stay where they are."""
    module, attr = _owner(model, param_name)
    old = module._parameters[attr]
    if not old.is_meta and not pin and old.is_contiguous():
        return old
    return _set_param(model, param_name, torch.empty(old.shape, dtype=old.dtype, pin_memory=pin,
                                                     device=None if pin else device))


def _model_targets(model: V41Model, specs: Mapping[str, TensorSpec], dequantize: bool, keep=None):
    """official name -> our parameter name for every backbone tensor that is loaded; checks
    that the model's parameters are exactly those, with matching shapes. keep(name) False: a
    tensor this worker's role does not hold (ShardSpec.role); its parameter goes to the meta
    device (no memory, and any use of it fails loudly)."""
    params = dict(model.named_parameters())
    targets, problems = {}, []
    for name, spec in specs.items():
        if name.startswith("mtp."):
            continue
        if keep is not None and not keep(name):
            target = official_to_module_name(name, model)
            if target in params:
                _set_param(model, target, torch.empty_like(params.pop(target), device="meta"))
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


def _read_into(ckpt: Checkpoint, name: str, p: torch.Tensor) -> None:
    """Tensor `name`'s bytes into p: straight from the file on the CPU; through a host buffer of
    this one tensor elsewhere (a GPU parameter: the checkpoint's bytes go to the device as they
    are, and the host never holds more than the tensor being copied)."""
    if p.device.type == "cpu":
        ckpt.read_into(name, p.data)
    else:
        p.data.copy_(ckpt.read_into(name, torch.empty(p.shape, dtype=p.dtype)))


def _load_into_model(model: V41Model, ckpt: Checkpoint, specs: Mapping[str, TensorSpec],
                     dequantize: bool = False, engram_storage: str = "memory", progress=None,
                     device=None, keep=None) -> None:
    if engram_storage not in ("memory", "pinned", "mmap"):
        raise ValueError(f"engram_storage must be 'memory', 'pinned' or 'mmap', got {engram_storage!r}")
    pin = engram_storage == "pinned"
    if pin and not torch.cuda.is_available():
        warnings.warn("engram_storage='pinned' needs CUDA; Engram tables stay in ordinary host memory")
        pin = False
    targets = _model_targets(model, specs, dequantize, keep)
    total = sum(ckpt.info(n).nbytes for n in targets)
    model.loaded_bytes = total
    callback = progress if callable(progress) else None
    _log.info("loading %s: %d tensors, %.2f GiB", ckpt.root, len(targets), total / 2 ** 30)
    t0, done = time.perf_counter(), 0
    pbar = bar(desc="Loading checkpoint", total=total, unit="B", unit_scale=True, unit_divisor=1024,
               show=progress if isinstance(progress, bool) else (False if callback else None))
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
                p = _allocate(model, target, device=device)
                p.copy_(_dequantize(ckpt, spec, specs))
            else:
                p = _allocate(model, target, pin=pin and table, device=None if table else device)
                if info.torch_dtype == p.dtype or (p.dtype == torch.uint8 and ST_DTYPES[info.dtype][1] == 1):
                    _read_into(ckpt, name, p)
                else:                                   # e.g. BF16 norm -> fp32 parameter
                    p.copy_(ckpt.read(name).to(p.dtype))
        done += info.nbytes
        pbar.update(info.nbytes)
        if callback is not None:
            callback(done, total, name)
    pbar.close()
    seconds = time.perf_counter() - t0
    _log.info("loaded %.2f GiB in %.1f s (%.2f GiB/s)", total / 2 ** 30, seconds, total / 2 ** 30 / max(seconds, 1e-9))
    wanted = set(targets.values())
    left = [n for n, p in model.named_parameters() if p.is_meta and n in wanted]
    if left:
        raise RuntimeError(f"parameters not loaded: {left}")


def place_model(model: V41Model, device, engram_device=None) -> V41Model:
    """Move the model to `device`, leaving the Engram tables (embed_weight / embed_scale) where
    they are unless engram_device is given."""
    tables = {id(t) for e in model.engram for t in (e.embed_weight, e.embed_scale)}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.is_meta:       # meta: another worker role's tensor (not loaded)
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
                    shard: ShardSpec | None = None, parallel=None, role: str = "both", progress=None,
                    **overrides) -> V41Model:
    """Build a model from a checkpoint in the official layout (directory with config.json and
    `model.safetensors.index.json` + shards or `model.safetensors`; or one .safetensors file).

    numerics="reference" keeps DeepSeek's arithmetic (bf16 activations, blockwise FP8 GEMMs);
    "released" the same arithmetic on the checkpoint's bytes through the fp8_linear / mxfp4_moe
    ops (Triton kernels on CUDA; the weights stay FP8 / MXFP4 on the device, no dense copy);
    "fast" dequantizes weights to the compute dtype once.
    dequantize=True builds the model with weight_format="dense" and fills every FP8/FP4
    projection with its exact dequantized values (Engram tables stay FP8).
    engram_storage: "memory" | "pinned" (page-locked, when CUDA is available) | "mmap"
    (copy-on-write mapping of the shard; pages are read on first use).
    device: where everything but the Engram tables goes (default: stay on the CPU); the large
    tensors are allocated there and filled tensor by tensor (no host copy of the model);
    engram_device: move the tables too.
    parallel: a v41graph.parallel.ParallelState: this rank's share of the model, reading only
    its parts of the checkpoint (v41graph.parallel.build.load_parallel_model; Engram tables in
    memory).
    shard: a ShardSpec; only world_size=1 (the identity) builds a V41Model (for more ranks use
    `parallel`, or load_sharded_state_dict for the raw tensors).
    role: "both" (the whole model), "prefill" or "decode" (v41graph/weights/roles.py): only that
    worker's tensors are read (= shard=ShardSpec(role=role)); the parameters of the others stay
    on the meta device. `model.role` and `model.loaded_bytes` (checkpoint bytes read) tell.
    progress: None (a tqdm bar on a terminal, none under `--quiet`: v41graph/progress.py),
    True/False (always / never a bar), or callback(done_bytes, total_bytes, name); the start
    and the end are logged (logger v41graph.weights.load, INFO) in every case.
    overrides: config fields to change (e.g. fake_quant=False).
    Raises CheckpointError (a ValueError) naming the file for any layout problem.
    """
    from .sharding import ShardSpec
    if shard is None:
        shard = ShardSpec(role=role)
    elif role != "both" and shard.role != role:
        raise ValueError(f"from_pretrained: role={role!r} and shard.role={shard.role!r} disagree")
    if parallel is not None and shard.role != "both":
        raise NotImplementedError("from_pretrained: a prefill/decode role of a parallel rank is not built yet "
                                  "(role= works with parallel=None)")
    if parallel is not None:
        if dequantize or engram_storage != "memory" or engram_device is not None or shard.world_size != 1:
            raise ValueError("from_pretrained(parallel=...) loads the checkpoint's formats with Engram in memory: "
                             "dequantize, engram_storage, engram_device and shard are not supported with it")
        from v41graph.parallel.build import load_parallel_model
        return load_parallel_model(path, parallel, numerics, device=device, progress=progress, **overrides)
    if shard.world_size != 1:
        raise NotImplementedError(
            f"from_pretrained(shard={shard}): a rank's model is built from its ParallelState: "
            f"from_pretrained(path, parallel=init_parallel(ParallelConfig(...))); "
            f"load_sharded_state_dict(path, shard) reads the raw tensors")
    path = Path(path)
    if overrides.get("weight_format") == "dense":
        dequantize = True
    ckpt, config, specs = open_validated(path, {k: v for k, v in overrides.items()
                                                 if k != "weight_format"})
    try:
        model_config = dataclasses.replace(config, weight_format="dense") if dequantize else config
        model = _build_empty_model(model_config)
        keep = None if shard.role == "both" else (lambda name: shard.partition(name, specs, config) is not None)
        _load_into_model(model, ckpt, specs, dequantize, engram_storage, progress, device, keep)
    finally:
        ckpt.close()
    _load_engram_token_map(model, ckpt.root, config)
    model.checkpoint_dir, model.role = ckpt.root, shard.role
    if device is not None or engram_device is not None:
        place_model(model, device, engram_device)
    return model.set_numerics(numerics).eval()


def _load_engram_token_map(model: V41Model, root: Path, config: V41Config) -> None:
    """Engram's compressed-id map comes from the tokenizer: tokenizer_stub.json (the texts and raw
    strings of every token, as DeepSeek's golden vectors ship them) or the real tokenizer.json
    (read with `tokenizers`). Without either the model keeps its placeholder map."""
    stub, tok_file = root / "tokenizer_stub.json", root / "tokenizer.json"
    if stub.is_file():
        vocab = json.loads(stub.read_text())
        texts, raw, source = vocab["texts"], vocab.get("raw"), stub
    elif tok_file.is_file():
        from tokenizers import Tokenizer

        texts, raw = tokenizer_token_texts(Tokenizer.from_file(str(tok_file)), config.vocab_size)
        source = tok_file
    else:
        return
    token_map, size = build_compressed_token_map(texts, raw)
    if size != config.engram_compressed_vocab_size:
        raise ValueError(f"{source}: tokenizer gives {size} compressed ids, config says "
                         f"engram_compressed_vocab_size = {config.engram_compressed_vocab_size}")
    model.engram_token_map.copy_(token_map)


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

