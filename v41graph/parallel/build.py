"""A rank's V41Model: cut from a whole model in memory (`shard_model`: tests, random models) or
read from a checkpoint (`load_parallel_model`: only this rank's parts leave the disk). Which part
of each tensor a rank keeps is ShardSpec's (v41graph/weights/sharding.py), in both cases."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model
from v41graph.weights.checkpoint import Progress, progress_default
from v41graph.weights.names import module_to_official_name, official_to_module_name
from v41graph.weights.load import (_build_empty_model, _load_engram_token_map, _set_param, open_validated,
                                   place_model)
from v41graph.weights.sharding import ShardSpec, local_expert_name, read_part, shard_tensors

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
    """This rank's model read from a checkpoint in the official layout: each tensor's part is
    read straight from its shard (nothing else of the checkpoint is read or held; the rank's
    bytes read are in `model.loaded_bytes`). Every rank checks the layout and the checkpoint
    before reading, and the ranks agree on the outcome: if any rank cannot load (a missing
    tensor, a layout that does not divide the model), every rank raises, naming that rank and
    its problem, before the model's first collective."""
    _check_state(parallel)
    problem, model = None, None
    try:
        model = _load_rank(Path(path), parallel, progress, overrides)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        problem = f"{type(e).__name__}: {e}"
    problems = _agree(parallel, problem)
    if problems:
        if problem is not None and len(problems) == 1:
            raise RuntimeError(f"rank {parallel.rank} could not load {path}: {problem}")
        raise RuntimeError(f"loading {path} failed on " + "; ".join(f"rank {r}: {p}" for r, p in problems))
    if device is not None:
        place_model(model, device)
    return model.set_numerics(numerics).eval()


def _agree(parallel: ParallelState, problem: str | None) -> list:
    """[(rank, problem)] of every rank that failed (this rank's alone without a process group)."""
    if parallel.group is None:
        return [] if problem is None else [(parallel.rank, problem)]
    gathered = [None] * parallel.world_size
    dist.all_gather_object(gathered, problem, group=parallel.group)
    return [(r, p) for r, p in enumerate(gathered) if p is not None]


def _load_rank(path: Path, parallel: ParallelState, progress, overrides) -> V41Model:
    ckpt, config, specs = open_validated(path, overrides)
    try:
        parallel.config.check(config)
        shard, first = ShardSpec.of(parallel), _first_expert(parallel, config)
        model = _build_empty_model(config, parallel)
        params = dict(model.named_parameters())
        todo = {}
        for name in specs:
            if name.startswith("mtp."):
                continue
            part = shard.partition(name, specs, config)
            if part is not None:
                todo[name] = (official_to_module_name(local_expert_name(name, first), config), part)
        missing = sorted(n for n in todo if n not in ckpt.tensors)
        unknown = sorted(t for t, _ in todo.values() if t not in params)
        unfilled = sorted(set(params) - {t for t, _ in todo.values()})
        for what, names in (("the checkpoint has no tensor", missing), ("the model has no parameter", unknown),
                            ("no checkpoint tensor fills parameter", unfilled)):
            if names:
                raise RuntimeError(f"{ckpt.root}: {what} {names[:4]}{' ...' if len(names) > 4 else ''} "
                                   f"(rank {parallel.rank} of {parallel.config.describe()})")
        total = sum(ckpt.info(n).nbytes for n in todo)
        bar = Progress(f"loading rank {parallel.rank}/{parallel.world_size}", total,
                       progress_default(progress, total))
        loaded = 0
        for name in ckpt.names_in_file_order():
            if name not in todo:
                continue
            target, part = todo[name]
            data = read_part(ckpt, name, part)
            p = params[target]
            if tuple(data.shape) != tuple(p.shape):
                raise RuntimeError(f"{name}: rank {parallel.rank}'s part is {list(data.shape)} but parameter "
                                   f"{target} is {list(p.shape)}")
            if data.element_size() == 1 and p.dtype == torch.uint8:
                data = data.view(torch.uint8)             # FP8 / FP4 / E8M0 codes as stored
            _set_param(model, target, data.to(p.dtype))
            loaded += data.numel() * data.element_size()
            bar.update(data.numel() * data.element_size(), name)
        bar.close()
    finally:
        ckpt.close()
    _load_engram_token_map(model, ckpt.root, config)
    model.checkpoint_dir, model.loaded_bytes = ckpt.root, loaded
    return model
