"""One rank's place in a layout: `ParallelState` (rank, world size, the process group and the
collectives the model calls), `init_parallel` (join or start the torch.distributed job that
`torchrun` describes) and `shutdown`.

The collectives are torch's functional ones (`torch.distributed._functional_collectives`):
they return new tensors instead of mutating, so Dynamo and AOT autograd trace them into the
graph as `_c10d_functional.*` + `wait_tensor` nodes, our passes see them, and a CUDA-graph
capture records the NCCL kernels. On CPU (gloo) the executor runs them eagerly.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .config import ParallelConfig

__all__ = ["ParallelState", "init_parallel", "shutdown", "DEFAULT_TIMEOUT_S"]

# torch 2.13 renamed all_gather_tensor (deprecated there) to all_gather_single; 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

# A rank that does not join, or dies mid-step, ends the job after this long instead of hanging
# it (process-group timeout; gloo and NCCL both honour it).
DEFAULT_TIMEOUT_S = 120.0


class ParallelState:
    """This rank of a ParallelConfig. Modules built with one hold it as a plain attribute."""

    def __init__(self, config: ParallelConfig, rank: int, group: dist.ProcessGroup | None = None):
        if not 0 <= rank < config.world_size:
            raise ValueError(f"rank {rank} outside 0..{config.world_size - 1} of {config.describe()}")
        self.config, self.rank, self.world_size = config, rank, config.world_size
        self.group = group
        # Collectives name their group by string: Dynamo and the AOT graph keep a string constant.
        self.group_name = group.group_name if group is not None else None

    def __repr__(self) -> str:
        return f"ParallelState(rank {self.rank} of {self.config.describe()})"

    # ------------------------------------------------------------------ layout
    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def attention(self) -> str:
        return self.config.attention

    @property
    def expert_parallel(self) -> bool:
        return self.config.ep > 1

    def expert_range(self, n_experts: int) -> range:
        """The routed experts this rank holds (all of them without expert parallelism)."""
        if not self.expert_parallel:
            return range(n_experts)
        per = n_experts // self.world_size
        return range(self.rank * per, (self.rank + 1) * per)

    # ------------------------------------------------------------------ collectives
    def _group(self):
        if self.group_name is None:
            raise RuntimeError(f"{self!r} has no process group: build it with init_parallel")
        return self.group_name

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over all ranks (a new tensor)."""
        return funcol.all_reduce(x, "sum", self._group())

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along `dim`, in rank order."""
        # a non-negative dim: torch 2.13's all_gather_single fails for a negative one when
        # x.shape[0] == 1 (a [1, V] logits row: a step of one sequence)
        return _all_gather(x.contiguous(), dim % x.dim(), self._group())

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [world_size * n, ...]: block j goes to rank j; returns the blocks received, block j
        from rank j (equal splits: static shapes)."""
        return funcol.all_to_all_single(x.contiguous(), None, None, self._group())


def init_parallel(config: ParallelConfig, backend: str | None = None, device: torch.device | str | None = None,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> ParallelState:
    """Join the job `torchrun` started (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR/PORT)
    or use the process group already initialized, and check it matches `config`. backend:
    "nccl" for CUDA devices, "gloo" otherwise (default by device). A world size of 1 without
    torchrun needs no process group: the state then has none, and the model calls no
    collective."""
    if not isinstance(config, ParallelConfig):
        raise TypeError(f"init_parallel: config must be a ParallelConfig, got {type(config).__name__}")
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        if env_world != config.world_size:
            raise ValueError(f"{config.describe()} needs {config.world_size} processes but WORLD_SIZE is "
                             f"{env_world} (start it with torchrun --nproc-per-node {config.world_size})")
        if config.world_size == 1:
            return ParallelState(config, 0)
        device = torch.device(device) if device is not None else torch.device("cpu")
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != config.world_size:
        raise ValueError(f"{config.describe()} needs {config.world_size} processes but the process group "
                         f"has {world}")
    return ParallelState(config, dist.get_rank(), dist.group.WORLD)


def shutdown() -> None:
    """Leave the job explicitly (a barrier, then destroy the process group): exit without it
    can hang in NCCL's teardown."""
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
