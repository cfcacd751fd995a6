"""Tensor, expert and data parallelism on torch.distributed (see config.py for the layouts)."""
from .config import ParallelConfig
from .state import DEFAULT_TIMEOUT_S, ParallelState, init_parallel, shutdown

__all__ = ["ParallelConfig", "ParallelState", "init_parallel", "shutdown", "DEFAULT_TIMEOUT_S"]
