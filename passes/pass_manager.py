"""The pass manager: owns the order of the passes, runs them, records and dumps what each did.

Order: cleanup -> fusions (P1, then the remaining RMSNorms) -> defunctionalize -> P1's state-write
fold (it needs the in-place write) -> stream passes (P4, P6) -> stream check.
Fusions run before the stream passes so that no fusion can straddle a stream boundary; the
stream check runs last and rejects a graph with unjoined side work.

Every pass can be switched off by name (except the stream check, which only validates). With a
dump directory (`v41graph.tools.graph_dump.load_dump` reads it back), each compiled graph gets a folder:

    manifest.json                  format version, pass list, uuid, the graph folders written
    graph<i>/NN_<pass>.before.txt  readable graph before / after the pass: one line per node with
    graph<i>/NN_<pass>.after.txt     its stream label, dtype/shape, call and `# module.path`
    graph<i>/passes.json           one record per pass: name, uuid, matched_count, node counts by
                                   op before/after, nodes added / removed / moved to a stream,
                                   fused ops and the nodes each one replaced
    graph<i>/streams.json          final graph: node -> stream map in execution order, event
                                   record/wait pairs, fork/join regions
    graph<i>/timings.json          seconds per pass (the only file that differs between runs)

Everything but timings.json is deterministic: the same model and config give byte-identical
files. Each stage is also logged for PyTorch's tools: through
`torch._dynamo.utils.lazy_format_graph_code` on the `v41graph_passes` logging artifact (enable with
`TORCH_LOGS="+v41graph.passes"` or `torch._logging.set_logs(modules={"v41graph_passes": True})`;
depyf picks these graphs up too) and as `graph_dump` / `artifact` entries of `TORCH_TRACE`
structured traces for tlparse.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections import Counter
from pathlib import Path

import torch.fx as fx

try:   # private torch names: fall back if a torch version lacks them
    from torch._ops import HigherOrderOperator
except ImportError:  # pragma: no cover
    HigherOrderOperator = ()
try:
    from torch.fx.node import _get_qualified_name
except ImportError:  # pragma: no cover
    def _get_qualified_name(t) -> str:
        return f"{t.__module__}.{t.__qualname__}"

from .base import STREAM_KEY, GraphPass, module_path
from .cleanup import Cleanup
from .defunctionalize import Defunctionalize
from .dual_stream import DualStream
from .fuse_pool_rmsnorm import FusePoolRMSNorm
from .fuse_ratio2_state_write import FuseRatio2StateWrite
from .fuse_rmsnorm import FuseRMSNorm
from .fuse_wkv_rmsnorm import FuseWkvRMSNorm
from .hoist_engram import HoistEngram
from .stream_check import StreamCheck

PASS_CLASSES = {cls.name: cls for cls in
                (Cleanup, FuseWkvRMSNorm, FusePoolRMSNorm, FuseRMSNorm, Defunctionalize,
                 FuseRatio2StateWrite, HoistEngram, DualStream, StreamCheck)}
DEFAULT_PASSES = ("cleanup", "fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_rmsnorm", "defunctionalize",
                  "fuse_ratio2_state_write", "hoist_engram", "dual_stream", "stream_check")
# Short names from the seed's opportunity points.
ALIASES = {"P1": ("fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_ratio2_state_write"), "P4": ("hoist_engram",),
           "P6": ("dual_stream",)}

DUMP_FORMAT = "v41graph-dump"
DUMP_VERSION = 1
# Targets of the stream / event ops (as the dumps spell them).
STREAM_OP_TARGETS = {f"v41graph.{op}.default": op for op in
                     ("stream_enter", "stream_exit", "event_record", "event_wait", "mark_stream_use")}
_STAGE_FILE = re.compile(r"^\d\d_.+\.(before|after)\.txt$")


def _alias_text() -> str:
    return ", ".join(k + "=" + "+".join(v) for k, v in ALIASES.items())


def _expand(names) -> list[str]:
    """Pass names with the P-number aliases expanded (P1 is both fusions)."""
    out = []
    for n in names:
        out.extend(ALIASES.get(n, (n,)))
    return out


def resolve_passes(passes=None, disable=()) -> list[str]:
    """The ordered pass names to run, after validating every name the user gave."""
    names = _expand(DEFAULT_PASSES if passes is None else passes)
    disable = _expand(disable)
    for n in names + disable:
        if n not in PASS_CLASSES:
            raise ValueError(f"unknown pass {n!r}; available: {', '.join(PASS_CLASSES)} "
                             f"(aliases {_alias_text()})")
    if "stream_check" in disable:
        raise ValueError("stream_check only validates the graph and cannot be switched off")
    ordered = [n for n in DEFAULT_PASSES if n in names and n not in disable]
    if "stream_check" not in ordered:
        ordered.append("stream_check")
    return ordered


def _op_key(n: fx.Node) -> str:
    """Deterministic name of what a node does: `aten.mm.default`, `_operator.getitem`, `placeholder`."""
    if n.op != "call_function":
        return n.op
    t = n.target
    if hasattr(t, "_schema") or isinstance(t, HigherOrderOperator):
        return str(t)
    try:
        return _get_qualified_name(t)
    except Exception:
        return getattr(t, "__name__", type(t).__name__)


def op_counts(gm: fx.GraphModule) -> dict:
    """Node counts by op (call_function target, else the node kind), sorted by name."""
    return dict(sorted(Counter(_op_key(n) for n in gm.graph.nodes).items()))


def target_name(n: fx.Node) -> str:
    """The node's target as the dumps spell it (`v41graph.event_record.default`, `mm.default`...)."""
    if n.op != "call_function":
        return str(n.target)
    if hasattr(n.target, "_schema"):
        return str(n.target)
    return getattr(n.target, "__name__", str(n.target))


def _shape(val) -> str:
    if hasattr(val, "shape") and hasattr(val, "dtype"):
        return f"{str(val.dtype).replace('torch.', '')}{list(val.shape)}"
    if isinstance(val, (tuple, list)) and val and all(hasattr(v, "shape") for v in val):
        return "(" + ",".join(_shape(v) for v in val) + ")"
    return ""


def readable(gm: fx.GraphModule) -> str:
    """Graph code with each node's stream label, deterministic (no object ids).

    One line per node: `[stream] name dtype[shape] = op:target(args)  # module.path`."""
    lines = []
    for n in gm.graph.nodes:
        stream = n.meta.get(STREAM_KEY, "-")
        shape = _shape(n.meta.get("val"))
        args = ", ".join(str(a) for a in n.args)
        kwargs = ", ".join(f"{k}={v}" for k, v in n.kwargs.items())
        mod = module_path(n)
        lines.append(f"[{stream:>16}] {n.name} {shape} = {n.op}:{target_name(n)}"
                     f"({args}{', ' if args and kwargs else ''}{kwargs})" + (f"  # {mod}" if mod else ""))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- what a pass did
def _snapshot(gm: fx.GraphModule) -> dict:
    """name -> (position, input names, stream label, meta["val"]) of every node (the values are
    kept alive so identity comparisons after the pass are sound)."""
    return {n.name: (i, [a.name for a in n.all_input_nodes], n.meta.get(STREAM_KEY), n.meta.get("val"))
            for i, n in enumerate(gm.graph.nodes)}


def _roots(new_nodes: list, before: dict, removed: set) -> dict:
    """For each new node, the removed node it stands in for: the one whose value object (or, for
    a multi-output op, one of whose value objects) it took over (passes copy `meta["val"]` from
    the node they replace), else the removed input (before
    the pass) of one of its users."""
    by_val = {id(before[nm][3]): nm for nm in removed if before[nm][3] is not None}
    roots = {}
    for n in new_nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, tuple) else (val,)      # a multi-output op: any of its values
        root = next((by_val[id(v)] for v in vals if v is not None and id(v) in by_val), None)
        if root is None:
            root = next((i for u in n.users if u.name in before for i in before[u.name][1] if i in removed), None)
        if root is not None:
            roots[n.name] = root
    return roots


def _replaced_by(root: str, before: dict, removed: set, stop: set) -> list[str]:
    """The removed nodes that only computed `root`: `root` and its removed producers, up to
    (not into) the roots of other new nodes, in original order."""
    seen, stack = set(), [root]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(i for i in before[name][1] if i in removed and i not in seen and i not in stop)
    return sorted(seen, key=lambda nm: before[nm][0])


def _explicit_replaced(p: GraphPass, node: fx.Node):
    """What the pass itself recorded, if it did: `node.meta["fused_from"]` as a list of node
    names, or a `replaced` dict {fused node name: [names]} on the pass object."""
    tagged = node.meta.get("fused_from")
    if isinstance(tagged, (list, tuple)):
        return [str(x) for x in tagged]
    table = getattr(p, "replaced", None)
    if isinstance(table, dict) and node.name in table:
        return [getattr(x, "name", str(x)) for x in table[node.name]]
    return None


def change_record(p: GraphPass, before: dict, gm: fx.GraphModule) -> dict:
    """Nodes a pass added / removed / moved to a side stream, and the fused ops it made."""
    after_names = [n.name for n in gm.graph.nodes]
    after_set = set(after_names)
    removed = [nm for nm in sorted(before, key=lambda k: before[k][0]) if nm not in after_set]
    removed_set = set(removed)
    added = [nm for nm in after_names if nm not in before]
    added_set = set(added)
    moved: dict[str, list] = {}
    fused_nodes = [n for n in gm.graph.nodes if n.name in added_set and
                   (n.meta.get("fused_from") is not None or "fused" in target_name(n))]
    roots = _roots(fused_nodes, before, removed_set)
    for n in gm.graph.nodes:
        label = n.meta.get(STREAM_KEY)
        if n.name in before and label not in (None, "main") and label != before[n.name][2]:
            moved.setdefault(label, []).append(n.name)
    fused = []
    for n in fused_nodes:
        replaced = _explicit_replaced(p, n)
        if replaced is None:
            root = roots.get(n.name)
            replaced = _replaced_by(root, before, removed_set, set(roots.values()) - {root}) if root else []
        kind = n.meta.get("fused_from")
        fused.append({"node": n.name, "target": target_name(n),
                      "kind": kind if isinstance(kind, str) else "", "replaced": replaced})
    return {"num_nodes_before": len(before), "num_nodes_after": len(after_names),
            "added": added, "removed": removed, "moved_to_stream": dict(sorted(moved.items())),
            "fused": fused}


# ---------------------------------------------------------------------------- stream map
def stream_map(gm: fx.GraphModule) -> dict:
    """The final graph's streams: every node in execution order with its stream, the event
    record -> wait pairs, and the fork/join regions (side work between `fork:T` and `join:T`)."""
    nodes, events, regions = [], [], {}
    last_record: dict[str, dict] = {}
    current = None           # the region whose stream_enter ... stream_exit we are inside
    pending_fork = None
    for n in gm.graph.nodes:
        target = target_name(n)
        kind = STREAM_OP_TARGETS.get(target)
        stream = n.meta.get(STREAM_KEY, "main")
        entry = {"name": n.name, "op": n.op, "target": target, "stream": stream}
        mod = module_path(n)
        if mod:
            entry["module"] = mod
        if n.meta.get("side_tag"):
            entry["side_tag"] = n.meta["side_tag"]
        if kind in ("event_record", "event_wait", "stream_enter"):
            entry["event" if kind != "stream_enter" else "enter"] = str(n.args[0])
        nodes.append(entry)
        if kind == "event_record":
            tag = str(n.args[0])
            last_record[tag] = entry
            if tag.startswith("fork:") and current is None:
                pending_fork = tag[len("fork:"):]
                regions[pending_fork] = {"tag": pending_fork, "stream": None, "fork_record": n.name,
                                         "nodes": [], "join_record": None, "join_waits": [],
                                         "overlap_count": 0}
        elif kind == "event_wait":
            tag = str(n.args[0])
            rec = last_record.get(tag)
            events.append({"tag": tag, "record": rec["name"] if rec else None,
                           "record_stream": rec["stream"] if rec else None,
                           "wait": n.name, "wait_stream": stream})
            if tag.startswith("join:") and tag[5:] in regions and current is None:
                regions[tag[5:]]["join_waits"].append({"node": n.name, "stream": stream})
        if kind == "stream_enter" and pending_fork is not None:
            current = regions[pending_fork]
            current["stream"] = str(n.args[0])
            pending_fork = None
        if current is not None:
            current["nodes"].append(n.name)
            if kind == "event_record" and str(n.args[0]) == f"join:{current['tag']}":
                current["join_record"] = n.name
            if kind == "stream_exit":
                current = None
        elif kind is None and stream == "main" and n.op == "call_function":
            # main-stream work that runs while a region's side work is in flight
            for r in regions.values():
                if r["join_record"] and not r["join_waits"]:
                    r["overlap_count"] += 1
    streams = sorted({e["stream"] for e in nodes}, key=lambda s: (s != "main", s))
    return {"streams": streams, "nodes": nodes, "events": events, "regions": list(regions.values())}


# ---------------------------------------------------------------------------- writing
def dump_json(obj) -> str:
    """Deterministic JSON: sorted keys; a top-level list of dicts (or a dict's list values)
    is written one element per line, so dumps grep and diff well."""
    def block(items, indent):
        if not items:
            return "[]"
        pad = " " * indent
        return "[\n" + ",\n".join(pad + json.dumps(x, sort_keys=True) for x in items) + "\n" + pad[:-1] + "]"
    if isinstance(obj, list):
        return block(obj, 1) + "\n"
    parts = [f' {json.dumps(k)}: ' + (block(v, 2) if isinstance(v, list) else json.dumps(v, sort_keys=True))
             for k, v in sorted(obj.items())]
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _prepare_graph_dir(out: Path) -> None:
    """Create graph<i>/ and drop stage files an earlier dump with other passes left there."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and (_STAGE_FILE.match(f.name) or f.name in ("passes.json", "streams.json", "timings.json")):
            f.unlink()


# ---------------------------------------------------------------------------- torch logging
_PASS_LOG = logging.getLogger(__name__)
ARTIFACT = "v41graph_passes"


def _graph_logger() -> logging.Logger:
    """Our per-pass graphs as a torch logging artifact (falls back to a plain logger)."""
    try:
        from torch._logging._internal import register_artifact
        import torch._logging
        register_artifact(ARTIFACT, "v41graph: the FX graph before/after each v41graph pass",
                          off_by_default=False)
        return torch._logging.getArtifactLogger(__name__, ARTIFACT)
    except Exception:   # a torch without these private APIs
        return logging.getLogger(__name__ + ".graphs")


_GRAPH_LOG = _graph_logger()


def _log_stage(gm: fx.GraphModule, title: str) -> None:
    """Hand one stage to torch's tools: lazy_format_graph_code (TORCH_LOGS, depyf) and a
    structured-trace graph_dump (TORCH_TRACE + tlparse). Never fails the compile."""
    try:
        import torch._dynamo.utils as dynamo_utils   # looked up per call: depyf patches it
        _GRAPH_LOG.debug("%s", dynamo_utils.lazy_format_graph_code(title, gm, colored=False))
    except Exception:
        if _GRAPH_LOG.isEnabledFor(logging.DEBUG):
            _GRAPH_LOG.debug("===== %s =====\n%s", title, readable(gm))
    try:
        from torch._logging import trace_structured
        trace_structured("graph_dump", metadata_fn=lambda: {"name": title.replace(" ", "_")},
                         payload_fn=lambda: gm.print_readable(print_output=False),
                         expect_trace_id=False)
    except Exception:
        pass


def _trace_json(name: str, payload) -> None:
    try:
        from torch._logging import trace_structured
        trace_structured("artifact", metadata_fn=lambda: {"name": name, "encoding": "json"},
                         payload_fn=lambda: payload, expect_trace_id=False)
    except Exception:
        pass


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
        out = None
        gi = self.graph_index
        if self.dump_dir:
            out = self.dump_dir / f"graph{gi}"
            _prepare_graph_dir(out)
        self.graph_index += 1
        records = []
        for i, p in enumerate(self.passes):
            before = op_counts(gm)
            snap = _snapshot(gm)
            stage = f"{i:02d}_{p.name}"
            if out:
                (out / f"{stage}.before.txt").write_text(readable(gm))
            _log_stage(gm, f"v41graph graph{gi} {stage} before")
            t0 = time.perf_counter()
            matched = p(gm)
            elapsed = time.perf_counter() - t0
            if out:
                (out / f"{stage}.after.txt").write_text(readable(gm))
            _log_stage(gm, f"v41graph graph{gi} {stage} after")
            record = {"index": i, "pass": p.name, "uuid": p.uuid(), "matched_count": matched,
                      "nodes_before": before, "nodes_after": op_counts(gm),
                      **change_record(p, snap, gm), "seconds": round(elapsed, 4)}
            records.append(record)
            _PASS_LOG.info("graph%d %s: matched %s, %d -> %d nodes (%.3f s)", gi, p.name, matched,
                           record["num_nodes_before"], record["num_nodes_after"], elapsed)
            _trace_json(f"v41graph_graph{gi}_{stage}", {k: v for k, v in record.items() if k != "seconds"})
        self.records.append(records)
        streams = stream_map(gm)
        self.stream_maps.append(streams)
        _trace_json(f"v41graph_graph{gi}_streams", streams)
        if out:
            timeless = [{k: v for k, v in r.items() if k != "seconds"} for r in records]
            (out / "passes.json").write_text(json.dumps(timeless, indent=1, sort_keys=True) + "\n")
            (out / "streams.json").write_text(dump_json({"graph": gi, **streams}))
            (out / "timings.json").write_text(json.dumps({r["pass"]: r["seconds"] for r in records}, indent=1) + "\n")
            self._write_manifest(gi)
        return gm

    def _write_manifest(self, gi: int) -> None:
        manifest = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "passes": self.names,
                    "uuid": self.uuid(), "graphs": [f"graph{i}" for i in range(gi + 1)]}
        (self.dump_dir / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
