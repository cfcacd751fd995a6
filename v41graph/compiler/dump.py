"""The v41graph dump format, in one place: the writer the pass manager calls and every name and
key the reader (`v41graph.tools.graph_dump`, behind `v41graph inspect`) relies on.

With a dump directory, each graph the pass manager passes gets a folder:

    manifest.json                  format version, pass list, uuid, the graph folders written and
                                   what each graph is ("names": graph0 -> "prefill", ...)
    graph<i>/NN_<pass>.before.txt  readable graph before / after the pass: one line per node with
    graph<i>/NN_<pass>.after.txt     its stream label, dtype/shape, call and `# module.path`
    graph<i>/passes.json           one record per pass: name, uuid, matched_count, node counts by
                                   op before/after, nodes added / removed / moved to a stream,
                                   fused ops and the nodes each one replaced (and `refused`, the
                                   places it left alone as unsafe, where it counts them and
                                   there are any)
    graph<i>/streams.json          final graph: node -> stream map in execution order, event
                                   record/wait pairs, fork/join regions
    graph<i>/timings.json          seconds per pass (the only file that differs between runs)

Graphs are numbered per process and dump directory: each graph compiled into a directory in
this process gets the next number (a graph break or a recompile adds graph<i+1>, never
overwrites graph0); one `v41graph.compile` numbers its own graphs from 0 (its first graph is
the first prefill or decode step traced) and `set_passes` writes them again under the same
numbers.

Everything but timings.json is deterministic: the same model and config give byte-identical
files. Each stage is also logged for PyTorch's tools: through
`torch._dynamo.utils.lazy_format_graph_code` on the `v41graph_passes` logging artifact (enable with
`TORCH_LOGS="+v41graph.passes"` or `torch._logging.set_logs(modules={"v41graph_passes": True})`;
depyf picks these graphs up too) and as `graph_dump` / `artifact` entries of `TORCH_TRACE`
structured traces for tlparse. Without a dump directory only the logging happens (and the
records are still built: the pass manager keeps them).
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
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

from v41graph.custom_ops.streams import STREAM_OPS
from v41graph.passes.base import STREAM_KEY, module_path

# ---------------------------------------------------------------------------- the format
DUMP_FORMAT = "v41graph-dump"
DUMP_VERSION = 1
MANIFEST_FILE = "manifest.json"
PASSES_FILE = "passes.json"
STREAMS_FILE = "streams.json"
TIMINGS_FILE = "timings.json"
GRAPH_DIR = re.compile(r"^graph(\d+)$")
STAGE_FILE = re.compile(r"^\d\d_.+\.(before|after)\.txt$")
# A stage as a user names it: a pass, `<pass>.before` / `.after`, or a stage file's name.
STAGE_NAME = re.compile(r"(?:\d\d_)?(.+?)(?:\.(before|after))?(?:\.txt)?")

# Short names from the seed's opportunity points, for `disable=` / `--disable` and the reader
# (which shows the first of an alias's passes that ran where it needs one stage).
ALIASES = {"P1": ("fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_ratio2_state_write"), "P4": ("hoist_engram",),
           "P6": ("dual_stream",), "P8": ("overlap_collectives",), "P9": ("mhc_side_stream",)}

# SECONDS_KEY is kept in memory and in timings.json, never in passes.json.
SECONDS_KEY = "seconds"


# ---------------------------------------------------------------------------- the files' schemas
# The keys and types the reader relies on, checked when a dump is opened (graph_dump.check_entry),
# so a damaged file is one error naming the file, the entry and the key. A spec is a type, a
# tuple of types (`None` for JSON null), `[spec]` (a list of those), `{str: spec}` (an object
# with any keys) or an `Entry` (an object with these keys).
@dataclass(frozen=True)
class Entry:
    required: dict
    optional: dict = field(default_factory=dict)


NUMBER = (int, float)
FUSED_ENTRY = Entry({"node": str}, {"target": str, "kind": str, "replaced": [str]})
PASS_RECORD = Entry(
    {"pass": str, "matched_count": int, "nodes_before": {str: int}, "nodes_after": {str: int}},
    {"index": int, "uuid": str, "num_nodes_before": int, "num_nodes_after": int, "added": [str],
     "removed": [str], "moved_to_stream": {str: [str]}, "fused": [FUSED_ENTRY], "refused": int})
REQUIRED_RECORD_KEYS = tuple(PASS_RECORD.required)
STREAM_NODE = Entry({"name": str, "stream": str},
                    {"op": str, "target": str, "module": str, "side_tag": str, "event": str, "enter": str})
EVENT_PAIR = Entry({"tag": str, "record": (str, None), "record_stream": (str, None), "wait": str,
                    "wait_stream": str})
REGION = Entry({"tag": str}, {"stream": (str, None), "fork_record": (str, None), "join_record": (str, None),
                              "nodes": [str], "join_waits": [Entry({"node": str, "stream": str})],
                              "overlap_count": int})
STREAMS_SCHEMA = Entry({"streams": [str], "nodes": [STREAM_NODE], "events": [EVENT_PAIR], "regions": [REGION]},
                       {"graph": int})
STREAM_MAP_KEYS = tuple(STREAMS_SCHEMA.required)
TIMINGS_SCHEMA = {str: NUMBER}
MANIFEST_SCHEMA = Entry({"graphs": [str]}, {"format": str, "version": int, "passes": [str], "uuid": str,
                                            "names": {str: str}})

# The stream / event ops as the dumps spell their targets -> their short names.
# (`v41graph.event_record.default` -> `event_record`)
STREAM_OP_TARGETS = {str(op): str(op).split(".")[-2] for op in STREAM_OPS}

# One line of a stage file (see `readable`).
READABLE_LINE = re.compile(r"^\[\s*(?P<stream>[^\]]*)\] (?P<name>\S+) (?P<shape>.*?) = "
                           r"(?P<op>placeholder|call_function|call_method|call_module|get_attr|output):"
                           r"(?P<call>.*?)(?:  # (?P<module>\S+))?$")

# Logged under the pass manager's name, so TORCH_LOGS="+v41graph.passes" catches the stages.
LOG_NAME = "v41graph.passes.pass_manager"
ARTIFACT = "v41graph_passes"


def graph_dir_name(index: int) -> str:
    return f"graph{index}"


def stage_file_name(index: int, pass_name: str, when: str) -> str:
    """`NN_<pass>.before.txt` / `.after.txt` of the pass at position `index`."""
    return f"{index:02d}_{pass_name}.{when}.txt"


def expand_aliases(names) -> list[str]:
    """Pass names with the P-number aliases expanded (P1 is its three passes)."""
    out = []
    for n in names:
        out.extend(ALIASES.get(n, (n,)))
    return out


def alias_text() -> str:
    return ", ".join(k + "=" + "+".join(v) for k, v in ALIASES.items())


# ---------------------------------------------------------------------------- graph text
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


def change_record(before: dict, gm: fx.GraphModule) -> dict:
    """Nodes a pass added / removed / moved to a side stream, and the fused ops it made
    (`before` is the `_snapshot` taken before the pass)."""
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


# ---------------------------------------------------------------------------- JSON
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


def _timeless(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != SECONDS_KEY}


def _prepare_graph_dir(out: Path) -> None:
    """Create graph<i>/ and drop stage files an earlier dump with other passes left there."""
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and (STAGE_FILE.match(f.name) or f.name in (PASSES_FILE, STREAMS_FILE, TIMINGS_FILE)):
            f.unlink()


def write_manifest(dump_dir: Path, passes: list, uuid: str, num_graphs: int) -> None:
    graphs = [graph_dir_name(i) for i in range(num_graphs)]
    named = _written(dump_dir)
    manifest = {"format": DUMP_FORMAT, "version": DUMP_VERSION, "passes": passes, "uuid": uuid,
                "graphs": graphs, "names": {g: named[i] for i, g in enumerate(graphs) if named.get(i)}}
    (dump_dir / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------- numbering and names
# What this process wrote into each dump directory: graph index -> its name (or None).
_WRITTEN: dict[Path, dict[int, str | None]] = {}
_GRAPH_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("v41graph_graph_name", default=None)


def _written(dump_dir: Path) -> dict:
    return _WRITTEN.setdefault(Path(dump_dir).resolve(), {})


def next_graph_index(dump_dir) -> int:
    """The number the next graph dumped into `dump_dir` gets in this process: one past the
    highest written so far (0 for a directory this process has not written)."""
    return max(_written(dump_dir), default=-1) + 1


@contextlib.contextmanager
def graph_name(name: str | None):
    """Graphs the pass manager dumps inside this block are named `name` in the manifest and
    the reader's summary ("prefill", "decode"...): the compiled model says which step it traces."""
    token = _GRAPH_NAME.set(name)
    try:
        yield
    finally:
        _GRAPH_NAME.reset(token)


# ---------------------------------------------------------------------------- torch logging
_PASS_LOG = logging.getLogger(LOG_NAME)


def _graph_logger() -> logging.Logger:
    """Our per-pass graphs as a torch logging artifact (falls back to a plain logger)."""
    try:
        from torch._logging._internal import register_artifact
        import torch._logging
        register_artifact(ARTIFACT, "v41graph: the FX graph before/after each v41graph pass",
                          off_by_default=False)
        return torch._logging.getArtifactLogger(LOG_NAME, ARTIFACT)
    except Exception:   # a torch without these private APIs
        return logging.getLogger(LOG_NAME + ".graphs")


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


# ---------------------------------------------------------------------------- the writer
class GraphDump:
    """Records, logs and (with a dump directory) writes one graph's stages as the pass manager
    runs its passes: `before(...)` and `after(...)` around each pass, `finish(...)` at the end.
    `records` holds the pass records (with their seconds) as they are made."""

    def __init__(self, index: int, dump_dir: str | Path | None = None):
        self.index = index
        self.dump_dir = Path(dump_dir) if dump_dir else None
        self.out = self.dump_dir / graph_dir_name(index) if self.dump_dir else None
        self.name = _GRAPH_NAME.get()
        if self.out:
            _prepare_graph_dir(self.out)
            _written(self.dump_dir)[index] = self.name
        self.records: list[dict] = []
        self._pending = None

    def _stage(self, gm: fx.GraphModule, position: int, pass_name: str, when: str) -> str:
        stage = f"{position:02d}_{pass_name}"
        if self.out:
            (self.out / stage_file_name(position, pass_name, when)).write_text(readable(gm))
        _log_stage(gm, f"v41graph graph{self.index} {stage} {when}")
        return stage

    def before(self, position: int, pass_name: str, gm: fx.GraphModule) -> None:
        """The graph as pass number `position` gets it."""
        self._pending = (op_counts(gm), _snapshot(gm))
        self._stage(gm, position, pass_name, "before")

    def after(self, position: int, p, gm: fx.GraphModule, matched: int, seconds: float) -> dict:
        """The graph pass `p` (a GraphPass, which counted `matched` places) left after `seconds`;
        returns its record."""
        counts, snap = self._pending
        stage = self._stage(gm, position, p.name, "after")
        record = {"index": position, "pass": p.name, "uuid": p.uuid(), "matched_count": matched,
                  "nodes_before": counts, "nodes_after": op_counts(gm), **change_record(snap, gm)}
        if getattr(p, "refused", 0):
            record["refused"] = p.refused
        record[SECONDS_KEY] = round(seconds, 4)
        self.records.append(record)
        _PASS_LOG.info("graph%d %s: matched %s, %d -> %d nodes (%.3f s)", self.index, p.name, matched,
                       record["num_nodes_before"], record["num_nodes_after"], seconds)
        _trace_json(f"v41graph_graph{self.index}_{stage}", _timeless(record))
        return record

    def finish(self, gm: fx.GraphModule, passes: list, uuid: str) -> dict:
        """The final graph: returns its stream map; writes passes.json, streams.json,
        timings.json and the manifest (which lists graphs 0 .. this one)."""
        streams = stream_map(gm)
        _trace_json(f"v41graph_graph{self.index}_streams", streams)
        if self.out:
            (self.out / PASSES_FILE).write_text(
                json.dumps([_timeless(r) for r in self.records], indent=1, sort_keys=True) + "\n")
            (self.out / STREAMS_FILE).write_text(dump_json({"graph": self.index, **streams}))
            (self.out / TIMINGS_FILE).write_text(
                json.dumps({r["pass"]: r[SECONDS_KEY] for r in self.records}, indent=1) + "\n")
            write_manifest(self.dump_dir, passes, uuid, self.index + 1)
        return streams
