"""Chrome / Perfetto traces of model steps through torch.profiler (`export_chrome_trace`), for
`v41graph inspect --profile` and `scripts/bench.py`.

    prof = profile_steps(step, device="cuda", steps=3, trace="trace.json")   # open in ui.perfetto.dev

On CUDA the trace holds the CPU side (the launches; a captured step is one cudaGraphLaunch) and
every kernel on its stream, so the side streams of P4/P6 show as their own rows; on the CPU it is
the op-by-op run of an uncaptured step (each aten / v41graph op a slice).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

_log = logging.getLogger(__name__)

# `v41graph dump` records how it built its model here, so `v41graph inspect --profile` can build
# the same one again (a dump written by compile(dump_dir=...) in a program has no such file).
MODEL_FILE = "model.json"


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def profile_steps(step, device: str, steps: int = 3, trace: str | Path | None = None):
    """Run `step()` once to warm up, then `steps` times under torch.profiler (CPU activity, and
    CUDA on a GPU), each call inside a `v41graph.step<i>` range. Writes the Chrome trace to
    `trace` if given. Returns the profiler (its events() / key_averages())."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if torch.device(device).type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    step()
    _sync(device)
    with torch.no_grad(), profile(activities=activities) as prof:
        for i in range(steps):
            with record_function(f"v41graph.step{i}"):
                step()
        _sync(device)
    if trace is not None:
        Path(trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
        _log.info("chrome trace of %d steps: %s (open in ui.perfetto.dev)", steps, trace)
    return prof


__all__ = ["profile_steps", "MODEL_FILE"]
