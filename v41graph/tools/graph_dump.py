"""Read a v41graph dump directory back and ask it questions (reads files only; runs no model).

    from .graph_dump import load_dump
    d = load_dump("dump/")                  # written by v41graph.compile(model, dump_dir="dump/")
    d.graphs                                # [0, 1]: prefill and decode graph
    d.passes(graph=1)                       # one record per pass (matched_count, node counts...)
    d.stages(graph=1)                       # ["input", "cleanup", "fuse_wkv_rmsnorm", ...]
    print(d.stage("P1", graph=1))           # the graph after P1, one line per node
    print(d.diff("input", "final", graph=1))
    d.nodes_on_stream("aux:select", graph=1)
    d.event_chains(graph=1)                 # fork -> join regions with the nodes in between
    d.fused_ops(graph=1)                    # each fused node and the nodes it replaced
    print(d.summary_markdown())             # per-pass table of every graph
    d.timeline("t.png", graph=1, layer=6)   # stream timeline (needs matplotlib)

The dump format (layout, file names, record keys, the P-number aliases) is defined in
`v41graph/compiler/dump.py`, the writer the pass manager calls. A missing or damaged dump raises
`DumpError` naming the file and what is wrong with it.
"""
from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from v41graph.compiler.dump import (ALIASES, GRAPH_DIR, MANIFEST_FILE, MANIFEST_SCHEMA, PASS_RECORD,
                                    PASSES_FILE, READABLE_LINE, STAGE_FILE, STAGE_NAME, STREAM_OP_TARGETS,
                                    STREAMS_FILE, STREAMS_SCHEMA, TIMINGS_FILE, TIMINGS_SCHEMA, Entry,
                                    expand_aliases, graph_dir_name, stage_file_name)

__all__ = ["DumpError", "MissingDependency", "Dump", "NodeInfo", "EventChain", "FusedOp",
           "load_dump", "check_entry", "draw_timeline", "timeline_figure", "to_dot", "write_svg"]


class DumpError(Exception):
    """A dump directory is missing, incomplete or damaged; the message names the file."""


class MissingDependency(ImportError):
    """An optional package (matplotlib, pydot) is needed for a picture."""


@dataclass(frozen=True)
class NodeInfo:
    name: str
    op: str
    target: str
    stream: str
    module: str = ""
    side_tag: str = ""
    event: str = ""        # the tag of an event_record / event_wait
    shape: str = ""
    args: str = ""

    @property
    def stream_op(self) -> str:
        """"event_record", "stream_enter"... for a stream / event op, else ""."""
        return STREAM_OP_TARGETS.get(self.target, "")

    @property
    def is_stream_op(self) -> bool:
        return bool(self.stream_op)


@dataclass(frozen=True)
class EventChain:
    """One fork/join region: side work on `stream` between event `fork:<tag>` and `join:<tag>`."""
    tag: str
    stream: str
    fork_record: str                 # event_record("fork:T") on the main stream
    join_record: str                 # event_record("join:T") at the end of the side work
    join_waits: tuple                # ((node, stream), ...): who waits for the side work
    nodes: tuple                     # the side work itself (no stream / event ops)
    ops: tuple                       # every node of the region, stream and event ops included
    overlap_count: int               # main-stream compute nodes between the region and its join


@dataclass(frozen=True)
class FusedOp:
    graph: int
    pass_name: str
    node: str
    target: str
    kind: str
    replaced: tuple = field(default_factory=tuple)


def _read_json(path: Path):
    if not path.is_file():
        raise DumpError(f"{path}: missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DumpError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                        f"the dump is damaged, write it again") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DumpError(f"{path}: cannot be read ({e})") from None


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", type(None): "null", bool: "true/false"}


def _type_name(spec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(dict.fromkeys(_type_name(s) for s in spec))
    if isinstance(spec, list):
        return "a list"
    if isinstance(spec, (dict, Entry)):
        return "an object"
    return _TYPE_NAMES.get(spec, spec.__name__)


def _is(value, t) -> bool:
    t = type(None) if t is None else t
    if t in (int, float) and isinstance(value, bool):     # JSON true is no count
        return False
    return isinstance(value, t)


def check_entry(value, spec, where: str) -> None:
    """Raise DumpError("<where>: <what is wrong>") unless `value` (read from JSON) has the shape
    `spec` describes (see the schemas in v41graph/compiler/dump.py). `where` names the file and
    the entry, e.g. "graph1/passes.json: record 2 (fuse_pool_rmsnorm)"."""
    if isinstance(spec, Entry):
        if not isinstance(value, dict):
            raise DumpError(f"{where}: expected an object, got {_show(value)}")
        missing = [k for k in spec.required if k not in value]
        if missing:
            raise DumpError(f"{where}: lacks {', '.join(repr(k) for k in missing)}")
        for k, sub in (*spec.required.items(), *spec.optional.items()):
            if k in value:
                check_entry(value[k], sub, f"{where}: {k!r}")
    elif isinstance(spec, list):
        if not isinstance(value, list):
            raise DumpError(f"{where} must be a list, got {_show(value)}")
        for i, v in enumerate(value):
            check_entry(v, spec[0], f"{where}[{i}]")
    elif isinstance(spec, dict):
        if not isinstance(value, dict):
            raise DumpError(f"{where} must be an object, got {_show(value)}")
        (_, sub), = spec.items()
        for k, v in value.items():
            check_entry(v, sub, f"{where}[{k!r}]")
    elif not any(_is(value, t) for t in (spec if isinstance(spec, tuple) else (spec,))):
        raise DumpError(f"{where} must be {_type_name(spec)}, got {_show(value)}")


def _show(value) -> str:
    text = json.dumps(value)
    return f"{_type_name(type(value)) if type(value) in _TYPE_NAMES else type(value).__name__} " \
           f"{text if len(text) <= 40 else text[:37] + '...'}"


_LABEL = re.compile(r"^\[\s*([^\]]*)\]")


def _stream_key(line: str) -> str:
    """A stage line as diff compares it: the label `-` (unlabelled) read as `main`."""
    m = _LABEL.match(line)
    if not m:
        return line
    return ("main" if m.group(1) == "-" else m.group(1)) + line[m.end():]


def _unified_diff(a: list[str], b: list[str], key, fromfile: str, tofile: str, n: int) -> str:
    """difflib.unified_diff's output for `a` and `b` compared by `key(line)` (difflib compares
    whole lines only), printing the lines themselves."""
    def span(start, stop):       # unified-diff hunk range, as difflib writes it
        length = stop - start
        return f"{start + 1}" if length == 1 else f"{start if not length else start + 1},{length}"
    out = []
    matcher = difflib.SequenceMatcher(None, [key(x) for x in a], [key(x) for x in b])
    for group in matcher.get_grouped_opcodes(n):
        if not out:
            out += [f"--- {fromfile}\n", f"+++ {tofile}\n"]
        out.append(f"@@ -{span(group[0][1], group[-1][2])} +{span(group[0][3], group[-1][4])} @@\n")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + x for x in a[i1:i2]]
                continue
            out += ["-" + x for x in a[i1:i2]] + ["+" + x for x in b[j1:j2]]
    return "".join(out)


def load_dump(path) -> "Dump":
    """Open a dump directory; raises DumpError if it is missing or damaged."""
    return Dump(path)


class Dump:
    def __init__(self, path):
        self.path = Path(path)
        if not self.path.exists():
            raise DumpError(f"{self.path}: no such dump directory (write one with "
                            f"v41graph.compile(model, dump_dir=...) or `v41graph dump --out DIR`)")
        if not self.path.is_dir():
            raise DumpError(f"{self.path}: not a directory; a dump is a directory of graph<N>/ folders")
        self.manifest = None
        manifest = self.path / MANIFEST_FILE
        if manifest.exists():
            self.manifest = _read_json(manifest)
            check_entry(self.manifest, MANIFEST_SCHEMA, str(manifest))
            names = self.manifest["graphs"]
        else:
            names = sorted((p.name for p in self.path.iterdir() if p.is_dir() and GRAPH_DIR.match(p.name)),
                           key=lambda s: int(GRAPH_DIR.match(s).group(1)))
        if not names:
            raise DumpError(f"{self.path}: no graph<N>/ folders and no {MANIFEST_FILE}: not a v41graph dump")
        self._dirs: dict[int, Path] = {}
        for name in names:
            m = GRAPH_DIR.match(str(name))
            if not m:
                raise DumpError(f"{manifest}: bad graph folder name {name!r}")
            d = self.path / name
            if not d.is_dir():
                raise DumpError(f"{d}: missing (listed in {manifest})")
            self._dirs[int(m.group(1))] = d
        self.graphs: list[int] = sorted(self._dirs)
        self._records = {g: self._load_records(g) for g in self.graphs}
        self._streams = {g: self._load_streams(g) for g in self.graphs}
        self._timings = {g: self._load_timings(g) for g in self.graphs}
        self._texts: dict = {}
        self._nodes: dict = {}

    # ------------------------------------------------------------------ loading
    def _graph(self, graph: int) -> int:
        if graph not in self._dirs:
            raise ValueError(f"no graph {graph} in {self.path}; graphs: {self.graphs}")
        return graph

    def _load_records(self, g: int) -> list[dict]:
        d = self._dirs[g]
        path = d / PASSES_FILE
        if not path.is_file():
            stages = sorted(p.name for p in d.iterdir() if STAGE_FILE.match(p.name))
            hint = f"; the last stage written is {stages[-1]} (did the compile fail in that pass?)" if stages else ""
            raise DumpError(f"{path}: missing{hint}")
        records = _read_json(path)
        if not isinstance(records, list) or not records:
            raise DumpError(f"{path}: expected a non-empty list of pass records")
        for i, r in enumerate(records):
            name = r.get("pass") if isinstance(r, dict) else None
            check_entry(r, PASS_RECORD, f"{path}: record {i}" + (f" ({name})" if isinstance(name, str) else ""))
            r.setdefault("index", i)
            for when in ("before", "after"):
                f = d / stage_file_name(r["index"], r["pass"], when)
                if not f.is_file():
                    raise DumpError(f"{f}: missing ({PASSES_FILE} lists pass {r['pass']!r} at index {r['index']})")
        return records

    def _load_streams(self, g: int) -> dict:
        path = self._dirs[g] / STREAMS_FILE
        data = _read_json(path)
        if not isinstance(data, dict):
            raise DumpError(f"{path}: expected an object with keys {', '.join(STREAMS_SCHEMA.required)}")
        for key, spec in STREAMS_SCHEMA.required.items():     # an entry's error names the entry
            if key not in data:
                raise DumpError(f"{path}: lacks {key!r} (expected an object with keys "
                                f"{', '.join(STREAMS_SCHEMA.required)})")
            if not isinstance(data[key], list):
                raise DumpError(f"{path}: {key!r} must be a list, got {_show(data[key])}")
            for i, entry in enumerate(data[key]):
                label = entry.get("name", entry.get("tag")) if isinstance(entry, dict) else None
                check_entry(entry, spec[0], f"{path}: {key}[{i}]" + (f" ({label!r})" if isinstance(label, str) else ""))
        check_entry(data, STREAMS_SCHEMA, str(path))
        # every name an entry refers to is a node of the map, every stream one of its streams
        names, streams = {n["name"] for n in data["nodes"]}, set(data["streams"])

        def refer(i, key, entry, field, known, what):
            value = entry.get(field)
            if value is not None and value not in known:
                label = entry.get("name", entry.get("tag"))
                label = f" ({label!r})" if isinstance(label, str) else ""
                raise DumpError(f"{path}: {key}[{i}]{label}: {field!r} names {value!r}, which is not "
                                f"{what} of this map")
        for i, n in enumerate(data["nodes"]):
            refer(i, "nodes", n, "stream", streams, "a stream")
        for i, e in enumerate(data["events"]):
            for f in ("record", "wait"):
                refer(i, "events", e, f, names, "a node")
            for f in ("record_stream", "wait_stream"):
                refer(i, "events", e, f, streams, "a stream")
        for i, r in enumerate(data["regions"]):
            for f in ("fork_record", "join_record"):
                refer(i, "regions", r, f, names, "a node")
            refer(i, "regions", r, "stream", streams, "a stream")
            for j, n in enumerate(r.get("nodes", ())):
                if n not in names:
                    raise DumpError(f"{path}: regions[{i}] ({r['tag']!r}): 'nodes'[{j}] names {n!r}, "
                                    f"which is not a node of this map")
            for j, w in enumerate(r.get("join_waits", ())):
                refer(j, f"regions[{i}] ({r['tag']!r}): 'join_waits'", w, "node", names, "a node")
        return data

    # ------------------------------------------------------------------ passes and stages
    def passes(self, graph: int = 0) -> list[dict]:
        """The pass records of one graph, in order (see v41graph/compiler/dump.py for the keys)."""
        return self._records[self._graph(graph)]

    def _pass_name(self, name: str, graph: int) -> str:
        """`name`, or for an alias (P1) the first of its passes that ran in this graph."""
        ran = [r["pass"] for r in self.passes(graph)]
        return next((n for n in expand_aliases([name]) if n in ran), name)

    def pass_record(self, name: str, graph: int = 0) -> dict:
        """The record of pass `name` (for an alias: of its first pass that ran)."""
        name = self._pass_name(name, graph)
        for r in self.passes(graph):
            if r["pass"] == name:
                return r
        raise ValueError(f"no pass {name!r} in graph {graph}; passes: "
                         f"{', '.join(r['pass'] for r in self.passes(graph))}")

    def stages(self, graph: int = 0) -> list[str]:
        """Stage names: "input" (before the first pass), then each pass's name (its result)."""
        return ["input"] + [r["pass"] for r in self.passes(graph)]

    def _stage_file(self, stage, graph: int) -> tuple[str, Path]:
        label, path, _ = self._stage_entry(stage, graph)
        return label, path

    def _stage_entry(self, stage, graph: int) -> tuple[str, Path, dict | None]:
        """(label, file, (record, "before"|"after")) of a stage."""
        g = self._graph(graph)
        records, names = self._records[g], self.stages(g)

        def file(idx: int):
            if idx == 0:
                r = records[0]
                return "input", self._dirs[g] / stage_file_name(r["index"], r["pass"], "before"), (r, "before")
            r = records[idx - 1]
            return r["pass"], self._dirs[g] / stage_file_name(r["index"], r["pass"], "after"), (r, "after")

        if isinstance(stage, str) and re.fullmatch(r"-?\d+", stage):
            stage = int(stage)
        if isinstance(stage, int):
            if not -len(names) <= stage < len(names):
                raise ValueError(f"stage index {stage} out of range; stages: {self._stage_help(g)}")
            return file(stage % len(names))
        s = str(stage)
        if s in ("input", "before"):
            return file(0)
        if s in ("final", "output", "after"):
            return file(len(names) - 1)
        m = STAGE_NAME.fullmatch(s)
        base, when = self._pass_name(m.group(1), g), m.group(2) or "after"
        for r in records:
            if r["pass"] == base:
                return (f"{base}.{when}" if when == "before" else base,
                        self._dirs[g] / stage_file_name(r["index"], r["pass"], when), (r, when))
        raise ValueError(f"unknown stage {stage!r}; stages: {self._stage_help(g)}")

    def _stage_help(self, g: int) -> str:
        return ", ".join(f"{i}={n}" for i, n in enumerate(self.stages(g))) + \
            f" (also final, <pass>.before, {'/'.join(ALIASES)})"

    def stage(self, name_or_index, graph: int = 0) -> str:
        """The readable text of a stage: an index into `stages()`, "input", "final", a pass
        name or alias (the graph after it) or "<pass>.before"."""
        _, path, (record, when) = self._stage_entry(name_or_index, graph)
        if path not in self._texts:
            try:
                text = path.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise DumpError(f"{path}: cannot be read ({e})") from None
            # the writer ends every node line with a newline and records the node count: a
            # file cut short (a full disk, a killed copy) shows as fewer or unfinished lines
            expected = record.get(f"num_nodes_{when}", sum(record[f"nodes_{when}"].values()))
            lines = text.count("\n")
            if lines != expected or (text and not text.endswith("\n")):
                raise DumpError(f"{path}: truncated or damaged: {lines} complete node lines"
                                f"{' and an unfinished last line' if text and not text.endswith(chr(10)) else ''}, "
                                f"but {PASSES_FILE} record {record['index']} ({record['pass']}) counts "
                                f"{expected} nodes {when} the pass")
            self._texts[path] = text
        return self._texts[path]

    def stage_nodes(self, name_or_index, graph: int = 0) -> list[NodeInfo]:
        """A stage's nodes parsed from its text (stream label, shape, call, module path)."""
        label, path = self._stage_file(name_or_index, graph)
        if path in self._nodes:
            return self._nodes[path]
        out = []
        for lineno, line in enumerate(self.stage(name_or_index, graph).splitlines(), 1):
            m = READABLE_LINE.match(line)
            if not m:
                raise DumpError(f"{path}:{lineno}: cannot parse this line: {line[:120]!r}")
            call = m.group("call")
            target, _, args = call.partition("(")
            event = args[:-1] if STREAM_OP_TARGETS.get(target) in ("event_record", "event_wait") else ""
            out.append(NodeInfo(name=m.group("name"), op=m.group("op"), target=target,
                                stream=m.group("stream").strip(), module=m.group("module") or "",
                                event=event, shape=m.group("shape"), args=args[:-1]))
        self._nodes[path] = out
        return out

    def diff(self, a, b, graph: int = 0, context: int = 3) -> str:
        """Unified diff between two stages (names or indices as in `stage`). Lines are compared
        with an unlabelled node (`[-]`: no pass has given it a stream yet) counted as on the
        main stream, where it runs: the stream-label column then differs only for nodes moved
        to a side stream, and `diff("input", "final")` shows what the passes changed, not the
        labels stream_check wrote on every line. The lines print as the stage files have them."""
        la, _ = self._stage_file(a, graph)
        lb, _ = self._stage_file(b, graph)
        return _unified_diff(self.stage(a, graph).splitlines(keepends=True),
                             self.stage(b, graph).splitlines(keepends=True), _stream_key,
                             f"{graph_dir_name(graph)}/{la}", f"{graph_dir_name(graph)}/{lb}", context)

    # ------------------------------------------------------------------ streams
    def streams(self, graph: int = 0) -> list[str]:
        """Stream labels of the final graph, main first."""
        return list(self._streams[self._graph(graph)]["streams"])

    def nodes(self, graph: int = 0) -> list[NodeInfo]:
        """The final graph's nodes in execution order with their streams (from streams.json)."""
        g = self._graph(graph)
        key = ("streams", g)
        if key not in self._nodes:
            self._nodes[key] = [NodeInfo(name=n["name"], op=n.get("op", ""), target=n.get("target", ""),
                                         stream=n["stream"], module=n.get("module", ""),
                                         side_tag=n.get("side_tag", ""), event=n.get("event", ""))
                                for n in self._streams[g]["nodes"]]
        return self._nodes[key]

    def nodes_on_stream(self, stream: str, graph: int = 0) -> list[str]:
        """Names of the final graph's nodes on `stream`, in execution order."""
        streams = self.streams(graph)
        if stream not in streams:
            raise ValueError(f"no stream {stream!r} in graph {graph}; streams: {', '.join(streams)}")
        return [n.name for n in self.nodes(graph) if n.stream == stream]

    def events(self, graph: int = 0) -> list[dict]:
        """Event pairs: {tag, record, record_stream, wait, wait_stream}, one per wait."""
        return list(self._streams[self._graph(graph)]["events"])

    def event_chains(self, graph: int = 0) -> list[EventChain]:
        """Fork/join regions in graph order, each with the side work between fork and join."""
        by_name = {n.name: n for n in self.nodes(graph)}
        out = []
        for r in self._streams[self._graph(graph)]["regions"]:
            ops = tuple(r.get("nodes", ()))
            out.append(EventChain(
                tag=r["tag"], stream=r.get("stream") or "", fork_record=r.get("fork_record") or "",
                join_record=r.get("join_record") or "",
                join_waits=tuple((w["node"], w["stream"]) for w in r.get("join_waits", ())),
                nodes=tuple(n for n in ops if n in by_name and not by_name[n].is_stream_op),
                ops=ops, overlap_count=int(r.get("overlap_count", 0))))
        return out

    def fused_ops(self, graph: int = 0) -> list[FusedOp]:
        """Every fused node the passes made in this graph and the node names it replaced."""
        return [FusedOp(graph=graph, pass_name=r["pass"], node=f["node"], target=f.get("target", ""),
                        kind=f.get("kind", ""), replaced=tuple(f.get("replaced", ())))
                for r in self.passes(graph) for f in r.get("fused", ())]

    # ------------------------------------------------------------------ reports
    def _load_timings(self, g: int) -> dict:
        path = self._dirs[g] / TIMINGS_FILE
        if not path.exists():
            return {}
        data = _read_json(path)
        check_entry(data, TIMINGS_SCHEMA, str(path))
        return data

    def timings(self, graph: int = 0) -> dict:
        """Seconds per pass ({} when the dump has no timings.json)."""
        return self._timings[self._graph(graph)]

    def graph_name(self, graph: int) -> str:
        """What the graph is ("prefill", "decode", ...: the manifest's name for it), or ""."""
        names = (self.manifest or {}).get("names", {})
        return names.get(graph_dir_name(self._graph(graph)), "")

    def summary_markdown(self, graphs=None) -> str:
        """Per-pass Markdown table for every graph (or for the graphs listed)."""
        out = [f"# v41graph dump `{self.path}`", ""]
        if self.manifest:
            out += [f"passes: {', '.join(self.manifest.get('passes', []))}  ", f"uuid: `{self.manifest.get('uuid', '')}`", ""]
        for g in (self.graphs if graphs is None else [self._graph(g) for g in graphs]):
            t = self.timings(g)
            streams = self._streams[g]
            name = self.graph_name(g)
            out += [f"## graph {g}" + (f" ({name})" if name else ""), "",
                    "| # | pass | matched | nodes before | nodes after | added | removed | moved to side streams | fused | ms |",
                    "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
            for r in self.passes(g):
                nb = r.get("num_nodes_before", sum(r["nodes_before"].values()))
                na = r.get("num_nodes_after", sum(r["nodes_after"].values()))
                moved = ", ".join(f"{k}: {len(v)}" for k, v in r.get("moved_to_stream", {}).items()) or "-"
                ms = f"{1000 * t[r['pass']]:.0f}" if r["pass"] in t else "-"
                out.append(f"| {r['index']} | {r['pass']} | {r['matched_count']} | {nb} | {na} | "
                           f"{len(r.get('added', []))} | {len(r.get('removed', []))} | {moved} | "
                           f"{len(r.get('fused', []))} | {ms} |")
            per_stream = {s: sum(1 for n in streams["nodes"] if n["stream"] == s) for s in streams["streams"]}
            out += ["", "streams: " + ", ".join(f"{s} ({c} nodes)" for s, c in per_stream.items()) +
                    f"; {len(streams['events'])} event waits, {len(streams['regions'])} fork/join regions", ""]
        return "\n".join(out)

    def streams_report(self, graph: int = 0) -> str:
        """Text report: nodes per stream, the fork/join regions and every event pair."""
        lines = [f"graph {graph}: streams"]
        nodes = self.nodes(graph)
        for s in self.streams(graph):
            on = [n for n in nodes if n.stream == s]
            work = sum(1 for n in on if n.op == "call_function" and not n.is_stream_op)
            lines.append(f"  {s:<12} {len(on):5d} nodes ({work} compute)")
        lines.append("fork/join regions:")
        for c in self.event_chains(graph):
            waits = ", ".join(f"{n}@{s}" for n, s in c.join_waits)
            lines.append(f"  {c.tag:<12} {c.stream:<11} fork {c.fork_record} -> {len(c.nodes)} nodes "
                         f"({c.nodes[0] if c.nodes else '-'} .. {c.nodes[-1] if c.nodes else '-'}) -> join "
                         f"{c.join_record} -> waits {waits}; overlaps {c.overlap_count} main nodes")
        lines.append("events (record -> wait):")
        for e in self.events(graph):
            lines.append(f"  {e['tag']:<16} {e['record']}@{e['record_stream']} -> {e['wait']}@{e['wait_stream']}")
        return "\n".join(lines) + "\n"

    def fused_report(self, graph: int = 0) -> str:
        lines = [f"graph {graph}: fused ops"]
        for f in self.fused_ops(graph):
            lines.append(f"  {f.node} = {f.target} [{f.pass_name}{', ' + f.kind if f.kind else ''}] "
                         f"replaced {len(f.replaced)}: {', '.join(f.replaced)}")
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ pictures
    def layer_nodes(self, layer: int, graph: int = 0) -> list[NodeInfo]:
        """The final graph's nodes of block `layer` (module path layers.<layer>.*) plus the
        stream and event ops of the side regions that carry its work."""
        nodes = self.nodes(graph)
        prefix = f"layers.{layer}"
        in_layer = {n.name for n in nodes if n.module == prefix or n.module.startswith(prefix + ".")}
        keep = set(in_layer)
        by_name = {n.name: n for n in nodes}
        for c in self.event_chains(graph):
            if c.tag.endswith(f".{layer}") or any(n in in_layer for n in c.nodes):
                keep.update(n for n in c.ops if by_name[n].is_stream_op)
                keep.add(c.fork_record)
                keep.update(n for n, _ in c.join_waits)
                if c.tag.endswith(f".{layer}"):
                    keep.update(c.nodes)
        order = [n for n in nodes if n.name in keep]
        if not in_layer:
            raise ValueError(f"no node of layer {layer} in graph {graph} (module paths layers.<N>.*)")
        return order

    def timeline(self, out, graph: int = 0, layer: int | None = None) -> dict:
        return draw_timeline(self, out, graph=graph, layer=layer)


# ---------------------------------------------------------------------------- pictures
def _require(module: str, what: str):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingDependency(f"{what} needs {module.split('.')[0]}, which is not installed: "
                                f"pip install 'v41graph[viz]' (or pip install {module.split('.')[0]})") from None


_KIND_COLORS = {"compute": "#4C72B0", "other": "#B0BEC5", "record": "#2CA02C", "wait": "#D62728",
                "stream": "#8C564B", "custom": "#9467BD"}


def _kind(n: NodeInfo) -> str:
    if n.stream_op in ("event_record", "event_wait"):
        return n.stream_op[len("event_"):]
    if n.is_stream_op:
        return "stream"
    if n.target.startswith("v41graph."):
        return "custom"
    if any(k in n.target for k in ("mm.", "bmm.", "addmm.", "_grouped_mm")):
        return "compute"
    return "other"


# Node names are written into their bars (rotated): each node gets this much width, so the
# names do not overlap; the figure grows with the node count up to what a PNG can hold.
_INCH_PER_NODE = 0.1
_MAX_WIDTH_IN = 600.0          # 60 000 px at 100 dpi (Agg draws at most 2^16 px a side)
_NAME_CHARS = 26
_ALL_NAMES_UP_TO = 600


def timeline_figure(dump: Dump, graph: int = 0, layer: int | None = None):
    """The stream timeline as a matplotlib Figure: the final graph's nodes in execution order,
    one lane per stream (main on top), each node a bar with its name written in it, an arrow
    from each event record to its wait. Returns (figure, info) with info {"lanes" (the lane
    labels as drawn on the y axis), "nodes", "arrows", "labels" (the names written in the bars,
    in order: every node's for a layer or a graph of up to 600 nodes, else the custom and
    stream/event ops')}."""
    _require("matplotlib", "the stream timeline")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    nodes = dump.layer_nodes(layer, graph) if layer is not None else dump.nodes(graph)
    nodes = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    present = {n.stream for n in nodes}
    lanes = [s for s in dump.streams(graph) if s in present]
    lane_y = {s: len(lanes) - 1 - i for i, s in enumerate(lanes)}        # main on top
    x_of = {n.name: i for i, n in enumerate(nodes)}
    width = min(_MAX_WIDTH_IN, max(10.0, 1.5 + _INCH_PER_NODE * len(nodes)))
    fig = Figure(figsize=(width, 2.2 + 2.0 * len(lanes)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for s in lanes:
        for kind, color in _KIND_COLORS.items():
            bars = [(x_of[n.name], 0.9) for n in nodes if n.stream == s and _kind(n) == kind]
            if bars:
                h = 0.7 if kind in ("compute", "custom", "other") else 0.9
                ax.broken_barh(bars, (lane_y[s] - h / 2, h), facecolors=color, linewidth=0)
    # each bar's name, bottom to top inside its lane (the lane is ~1.7 in high: 26 characters);
    # a whole graph of more than _ALL_NAMES_UP_TO nodes names its custom ops and stream/event
    # ops only (thousands of texts take long to draw): --layer names every node
    labels = []
    font = max(3.0, min(6.0, 72 * width / max(len(nodes), 1) * 0.8))
    named = nodes if len(nodes) <= _ALL_NAMES_UP_TO else [n for n in nodes if _kind(n) not in ("compute", "other")]
    for n in named:
        text = n.name if len(n.name) <= _NAME_CHARS else n.name[:_NAME_CHARS - 1] + "\u2026"
        ax.text(x_of[n.name] + 0.45, lane_y[n.stream] - 0.33, text, rotation=90, ha="center", va="bottom",
                fontsize=font, color="black", clip_on=True)
        labels.append(n.name)
    arrows = 0
    for e in dump.events(graph):
        if e["record"] in x_of and e["wait"] in x_of:
            x0, x1 = x_of[e["record"]] + 0.45, x_of[e["wait"]] + 0.45
            y0, y1 = lane_y[e["record_stream"]], lane_y[e["wait_stream"]]
            color = _KIND_COLORS["record"] if e["tag"].startswith("fork:") else "#FF7F0E"
            ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                        arrowprops=dict(arrowstyle="->", color=color, lw=1.0, shrinkA=0, shrinkB=0))
            arrows += 1
    ax.set_yticks([lane_y[s] for s in lanes], labels=lanes)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(-1, max(len(nodes), 1) + 1)
    ax.set_xlabel("execution order (node index)")
    name = dump.graph_name(graph)
    scope = f"layer {layer}" if layer is not None else "whole graph"
    ax.set_title(f"{dump.path.name or dump.path}: graph {graph}{f' ({name})' if name else ''}, {scope}\n"
                 f"{len(nodes)} nodes on {len(lanes)} streams, {arrows} event arrows (green: fork, orange: join)",
                 fontsize=11)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in _KIND_COLORS.items()], loc="upper left",
              bbox_to_anchor=(0.0, -0.12), fontsize="small", ncol=len(_KIND_COLORS), frameon=False)
    fig.tight_layout()
    drawn = [t.get_text() for t in ax.get_yticklabels()]
    drawn_lanes = [lab for _, lab in sorted(zip(ax.get_yticks(), drawn), reverse=True)]
    return fig, {"lanes": drawn_lanes, "nodes": len(nodes), "arrows": arrows, "labels": labels}


def draw_timeline(dump: Dump, out, graph: int = 0, layer: int | None = None) -> dict:
    """Stream timeline PNG (see `timeline_figure`). Returns {"path", "lanes", "nodes",
    "arrows", "labels"}; "lanes" are the lane labels as drawn on the figure's y axis."""
    fig, info = timeline_figure(dump, graph, layer)
    fig.savefig(str(out), bbox_inches="tight")       # title, legend and names inside the picture
    return {"path": str(out), **info}


def to_dot(dump: Dump, graph: int = 0, layer: int | None = None) -> str:
    """Graphviz DOT text of the final graph (or one layer): a cluster per stream, data edges
    from the final stage's arguments, dashed event edges from record to wait."""
    nodes = dump.layer_nodes(layer, graph) if layer is not None else dump.nodes(graph)
    keep = {n.name for n in nodes}
    parsed = {n.name: n for n in dump.stage_nodes("final", graph)}
    ident = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    lines = ["digraph v41graph {", "  rankdir=TB; node [shape=box, fontsize=9];"]
    for i, s in enumerate(dump.streams(graph)):
        members = [n for n in nodes if n.stream == s]
        if not members:
            continue
        lines.append(f'  subgraph cluster_{i} {{ label="{s}";')
        lines += [f'    "{n.name}" [label="{n.name}\\n{n.target}"];' for n in members]
        lines.append("  }")
    for n in nodes:
        p = parsed.get(n.name)
        if p is None:
            continue
        for src in dict.fromkeys(ident.findall(p.args)):
            if src in keep and src != n.name:
                lines.append(f'  "{src}" -> "{n.name}";')
    for e in dump.events(graph):
        if e["record"] in keep and e["wait"] in keep:
            lines.append(f'  "{e["record"]}" -> "{e["wait"]}" [style=dashed, color=red, label="{e["tag"]}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_program() -> str | None:
    """Graphviz's `dot`: a system Graphviz on PATH first, else the `graphviz-pure` program the
    [viz] extra installs (beside this interpreter when its environment is not activated)."""
    import shutil
    import sysconfig
    for name in ("dot", "graphviz-pure"):
        found = shutil.which(name) or shutil.which(name, path=sysconfig.get_path("scripts"))
        if found:
            return found
    return None


def write_svg(dump: Dump, out, graph: int = 0, layer: int | None = None) -> str:
    """Graphviz SVG through pydot and a `dot` program (see _dot_program)."""
    pydot = _require("pydot", "the Graphviz picture")
    prog = _dot_program()
    if prog is None:
        raise MissingDependency("the Graphviz picture needs a Graphviz `dot` program: pip install "
                                "'v41graph[viz]' (brings graphviz-pure) or install Graphviz")
    graphs = pydot.graph_from_dot_data(to_dot(dump, graph, layer))
    try:
        graphs[0].write_svg(str(out), prog=prog)
    except (FileNotFoundError, OSError) as e:
        raise MissingDependency(f"the Graphviz picture: {prog} failed ({e})") from None
    return str(out)
