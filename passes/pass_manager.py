"""The pass manager: owns the order of the passes, runs them, records and dumps what each did.

Order: cleanup -> fusions (P1) -> defunctionalize -> stream passes (P4, P6) -> stream check.
Fusions run before the stream passes so that no fusion can straddle a stream boundary; the
stream check runs last and rejects a graph with unjoined side work.

Every pass can be switched off by name (except the stream check, which only validates). With a
dump directory, each pass writes `NN_<name>.before.txt` / `.after.txt` (readable code with a
stream label on every line) and `passes.json` gathers one record per pass.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import torch.fx as fx

from .base import STREAM_KEY, GraphPass
from .cleanup import Cleanup
from .defunctionalize import Defunctionalize
from .dual_stream import DualStream
from .fuse_wkv_rmsnorm import FuseWkvRMSNorm
from .hoist_engram import HoistEngram
from .stream_check import StreamCheck

PASS_CLASSES = {cls.name: cls for cls in
                (Cleanup, FuseWkvRMSNorm, Defunctionalize, HoistEngram, DualStream, StreamCheck)}
DEFAULT_PASSES = ("cleanup", "fuse_wkv_rmsnorm", "defunctionalize", "hoist_engram", "dual_stream",
                  "stream_check")
# Short names from the seed's opportunity points.
ALIASES = {"P1": "fuse_wkv_rmsnorm", "P4": "hoist_engram", "P6": "dual_stream"}


def resolve_passes(passes=None, disable=()) -> list[str]:
    """The ordered pass names to run, after validating every name the user gave."""
    names = list(DEFAULT_PASSES if passes is None else passes)
    disable = [ALIASES.get(d, d) for d in disable]
    for n in [ALIASES.get(x, x) for x in names] + disable:
        if n not in PASS_CLASSES:
            raise ValueError(f"unknown pass {n!r}; available: {', '.join(PASS_CLASSES)} "
                             f"(aliases {', '.join(f'{k}={v}' for k, v in ALIASES.items())})")
    names = [ALIASES.get(n, n) for n in names]
    if "stream_check" in disable:
        raise ValueError("stream_check only validates the graph and cannot be switched off")
    ordered = [n for n in DEFAULT_PASSES if n in names and n not in disable]
    if "stream_check" not in ordered:
        ordered.append("stream_check")
    return ordered


def op_counts(gm: fx.GraphModule) -> dict:
    return dict(sorted(Counter(
        str(n.target) if n.op == "call_function" else n.op for n in gm.graph.nodes).items()))


def readable(gm: fx.GraphModule) -> str:
    """Graph code with each node's stream label, deterministic (no object ids)."""
    lines = []
    for n in gm.graph.nodes:
        stream = n.meta.get(STREAM_KEY, "-")
        val = n.meta.get("val")
        shape = f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}" if hasattr(val, "shape") else ""
        args = ", ".join(str(a) for a in n.args)
        kwargs = ", ".join(f"{k}={v}" for k, v in n.kwargs.items())
        target = n.target if n.op != "call_function" else getattr(n.target, "__name__", str(n.target))
        if n.op == "call_function" and hasattr(n.target, "_schema"):
            target = str(n.target)
        lines.append(f"[{stream:>16}] {n.name} {shape} = {n.op}:{target}({args}{', ' if args and kwargs else ''}{kwargs})")
    return "\n".join(lines) + "\n"


class PassManager:
    def __init__(self, passes=None, disable=(), dump_dir: str | Path | None = None):
        self.names = resolve_passes(passes, disable)
        self.passes: list[GraphPass] = [PASS_CLASSES[n]() for n in self.names]
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.records: list[dict] = []
        self.graph_index = 0

    def uuid(self) -> str:
        return "-".join(p.uuid() for p in self.passes)

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        out = None
        if self.dump_dir:
            out = self.dump_dir / f"graph{self.graph_index}"
            out.mkdir(parents=True, exist_ok=True)
        self.graph_index += 1
        records = []
        for i, p in enumerate(self.passes):
            before = op_counts(gm)
            if out:
                (out / f"{i:02d}_{p.name}.before.txt").write_text(readable(gm))
            t0 = time.perf_counter()
            matched = p(gm)
            elapsed = time.perf_counter() - t0
            if out:
                (out / f"{i:02d}_{p.name}.after.txt").write_text(readable(gm))
            records.append({"pass": p.name, "uuid": p.uuid(), "matched_count": matched,
                            "nodes_before": before, "nodes_after": op_counts(gm),
                            "seconds": round(elapsed, 4)})
        self.records.append(records)
        if out:
            timeless = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
            (out / "passes.json").write_text(json.dumps(timeless, indent=1, sort_keys=True) + "\n")
            (out / "timings.json").write_text(json.dumps({r["pass"]: r["seconds"] for r in records}, indent=1) + "\n")
        return gm
