"""The pass manager: owns the order of the passes and runs them; `v41graph.compiler.dump` records,
logs and dumps what each did.

Order: cleanup -> fusions (P1, then the remaining RMSNorms) -> defunctionalize -> P1's
state-write fold (it needs the in-place write) -> stream passes (P4, P6, and P9 when asked for)
-> P8 collective overlap -> stream check. P9 (`mhc_side_stream`) is opt-in (OPT_IN): it runs
only when named in `passes`, e.g. `passes=(*DEFAULT_PASSES, "P9")`, until a GPU run has timed
it. Fusions run before the stream passes so that no fusion can straddle a stream boundary; P8
only reorders inside the stretches between cache writes and stream / event ops, so it runs after
P4 / P6 and sees their final regions; the stream check runs last and rejects a graph with
unjoined side work.

Every pass can be switched off by name or by its P-number alias (`dump.ALIASES`), except the
stream check, which only validates. With a dump directory each compiled graph gets a folder
(the layout is described in `v41graph/compiler/dump.py`; `v41graph.tools.graph_dump.load_dump`
reads it back).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch.fx as fx

from v41graph.compiler.dump import GraphDump, alias_text, expand_aliases
from .base import GraphPass
from .cleanup import Cleanup
from .defunctionalize import Defunctionalize
from .dual_stream import DualStream
from .fuse_pool_rmsnorm import FusePoolRMSNorm
from .fuse_ratio2_state_write import FuseRatio2StateWrite
from .fuse_rmsnorm import FuseRMSNorm
from .fuse_wkv_rmsnorm import FuseWkvRMSNorm
from .hoist_engram import HoistEngram
from .mhc_side_stream import MhcSideStream
from .overlap_collectives import OverlapCollectives
from .stream_check import StreamCheck

PASS_CLASSES = {cls.name: cls for cls in
                (Cleanup, FuseWkvRMSNorm, FusePoolRMSNorm, FuseRMSNorm, Defunctionalize,
                 FuseRatio2StateWrite, HoistEngram, DualStream, MhcSideStream, OverlapCollectives, StreamCheck)}
PASS_ORDER = ("cleanup", "fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_rmsnorm", "defunctionalize",
              "fuse_ratio2_state_write", "hoist_engram", "dual_stream", "mhc_side_stream", "overlap_collectives",
              "stream_check")
OPT_IN = ("mhc_side_stream",)
DEFAULT_PASSES = tuple(n for n in PASS_ORDER if n not in OPT_IN)


def resolve_passes(passes=None, disable=()) -> list[str]:
    """The ordered pass names to run, after validating every name the user gave: `passes` (the
    defaults when None; `(*DEFAULT_PASSES, "P9")` adds the opt-in P9) minus `disable`."""
    names = expand_aliases(DEFAULT_PASSES if passes is None else passes)
    disable = expand_aliases(disable)
    for n in names + disable:
        if n not in PASS_CLASSES:
            raise ValueError(f"unknown pass {n!r}; available: {', '.join(PASS_CLASSES)} "
                             f"(aliases {alias_text()})")
    if "stream_check" in disable:
        raise ValueError("stream_check only validates the graph and cannot be switched off")
    ordered = [n for n in PASS_ORDER if n in names and n not in disable]
    if "stream_check" not in ordered:
        ordered.append("stream_check")
    return ordered


class PassManager:
    def __init__(self, passes=None, disable=(), dump_dir: str | Path | None = None):
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.configure(passes, disable)

    def configure(self, passes=None, disable=()) -> None:
        """Select the pass list (same arguments as the constructor) and forget earlier graphs'
        records: the graphs are numbered from 0 again."""
        self.names = resolve_passes(passes, disable)
        self.passes: list[GraphPass] = [PASS_CLASSES[n]() for n in self.names]
        self.records: list[list[dict]] = []
        self.stream_maps: list[dict] = []
        self.graph_index = 0

    def uuid(self) -> str:
        return "-".join(p.uuid() for p in self.passes)

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        dump = GraphDump(self.graph_index, self.dump_dir)
        self.graph_index += 1
        for i, p in enumerate(self.passes):
            dump.before(i, p.name, gm)
            t0 = time.perf_counter()
            matched = p(gm)
            dump.after(i, p, gm, matched, time.perf_counter() - t0)
        self.records.append(dump.records)
        self.stream_maps.append(dump.finish(gm, self.names, self.uuid()))
        return gm
