"""A rank's V41Model: cut from a whole model in memory (`shard_model`: tests, random models) or
read from a checkpoint (`load_parallel_model`: only this rank's parts leave the disk). Which part
of each tensor a rank keeps is ShardSpec's (v41graph/weights/sharding.py), in both cases."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model
from v41graph.weights.checkpoint import Progress, progress_default
from v41graph.weights.names import compute_dtype, module_to_official_name, official_to_module_name
from v41graph.weights.sharding import ShardSpec, local_expert_name, shard_tensors

from .state import ParallelState

__all__ = ["shard_model", "load_parallel_model"]


def _first_expert(parallel: ParallelState, config) -> int:
    return parallel.expert_range(config.n_routed_experts).start


def _check_state(parallel) -> None:
    if not isinstance(parallel, ParallelState):
        raise TypeError(f"parallel must be a v41graph.parallel.ParallelState (init_parallel(...)), "
                        f"got {type(parallel).__name__}")


def shard_model(model: V41Model, parallel: ParallelState) -> V41Model:
    """This rank's model with its parts of `model`'s weights (same dtype, device and numerics)."""
    _check_state(parallel)
    config = model.config
    parallel.config.check(config)
    with default_dtype(model.compute_dtype):
        local = V41Model(config, parallel).to(model.embed.weight.device)
    whole = {module_to_official_name(n, config): p.detach() for n, p in model.named_parameters()}
    parts = shard_tensors(whole, ShardSpec.of(parallel), config, include_mtp=False)
    first = _first_expert(parallel, config)
    state = {official_to_module_name(local_expert_name(n, first), config): t for n, t in parts.items()}
    local.load_state_dict(state, strict=True)
    local.engram_token_map.copy_(model.engram_token_map)
    return local.set_numerics(model.numerics).eval().requires_grad_(False)


def load_parallel_model(path: str | Path, parallel: ParallelState, numerics: str = "reference",
                        device=None, progress=None, **overrides) -> V41Model:
    """This rank's model read from a checkpoint in the official layout: every tensor's part is
    read straight into the rank's parameter (nothing else of the checkpoint is read or held).
    Every rank checks the layout against the checkpoint before reading anything."""
    from v41graph.weights.load import _build_empty_model, _load_engram_token_map, open_validated
    _check_state(parallel)
    ckpt, config, specs = open_validated(Path(path), overrides)
    try:
        parallel.config.check(config)
        shard, first = ShardSpec.of(parallel), _first_expert(parallel, config)
        model = _build_empty_model(config, parallel)
        params = dict(model.named_parameters())
        todo = {}
        for name in specs:
            if name.startswith("mtp.") or name not in ckpt.tensors:
                continue
            part = shard.partition(name, specs, config)
            if part is None:
                continue
            target = official_to_module_name(local_expert_name(name, first), config)
            if target not in params:
                raise RuntimeError(f"{name}: rank {parallel.rank}'s model has no parameter {target}")
            todo[name] = (target, part)
        missing = sorted(set(params) - {t for t, _ in todo.values()})
        if missing:
            raise RuntimeError(f"{ckpt.root}: rank {parallel.rank} of {parallel.config.describe()} finds no "
                               f"checkpoint tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        from v41graph.weights.sharding import _read_part
        total = sum(ckpt.info(n).nbytes for n in todo)
        bar = Progress(f"loading rank {parallel.rank}/{parallel.world_size}", total, progress_default(progress, total))
        for name in ckpt.names_in_file_order():
            if name not in todo:
                continue
            target, part = todo[name]
            data = _read_part(ckpt, name, part)
            p = params[target]
            if tuple(data.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: rank {parallel.rank}'s part is {list(data.shape)} but parameter "
                                   f"{target} is {list(p.shape)}")
            module_name, _, attr = target.rpartition(".")
            module = model.get_submodule(module_name) if module_name else model
            value = data if data.dtype == p.dtype or p.dtype != torch.uint8 else data.view(torch.uint8)
            module._parameters[attr] = torch.nn.Parameter(value.to(p.dtype) if value.dtype != p.dtype else value,
                                                          requires_grad=False)
            bar.update(data.numel() * data.element_size(), name)
        bar.close()
    finally:
        ckpt.close()
    _load_engram_token_map(model, ckpt.root, config)
    model.checkpoint_dir = ckpt.root
    if device is not None:
        from v41graph.weights.load import place_model
        place_model(model, device)
    return model.set_numerics(numerics).eval()
