"""Graph dump inspection (issue 6): the dump writer, the Python API, the CLI and the pictures.

One tiny compile for the whole module (~45 s on CPU): the `dumps` fixture runs the real CLI
(`v41graph dump --config tiny --out A`, in process) with PassManager patched so every graph it
compiles is also passed and dumped a second time, from a copy of the same input graph, into B.
Everything else reads those two dumps.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import v41graph
from v41graph.tools import cli
from v41graph.compiler.backend import copy_graph_module
from v41graph.tools.graph_dump import DumpError, MissingDependency, draw_timeline, load_dump, to_dot
from v41graph.compiler.dump import ARTIFACT
from v41graph.passes.pass_manager import PASS_CLASSES, PassManager, resolve_passes


def _stage(name: str) -> str:
    """A pass's dump file stem under the default pass list: its position, then its name."""
    return f"{resolve_passes().index(name):02d}_{name}"


REPO = Path(__file__).resolve().parents[1]
GATHER, INDEXER = "v41graph.engram_gather.default", "v41graph.indexer_topk.default"
REINDEXER = "v41graph.indexer_topk_candidates.default"     # Reindex layers' indexer
WINDOW, INDEX_K = "v41graph.window_kv_write.default", "v41graph.index_k_write.default"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dumps")
    a, b = root / "a", root / "b"
    original = PassManager.__call__

    def and_twin(self, gm):
        if self.dump_dir == a:     # the same input graph, passed and dumped again into b
            twin = PassManager(self.names, dump_dir=b)
            twin.graph_index = self.graph_index
            twin(copy_graph_module(gm))
        return original(self, gm)

    mp = pytest.MonkeyPatch()
    mp.setattr(PassManager, "__call__", and_twin)
    try:
        assert cli.main(["dump", "--config", "tiny", "--out", str(a)]) == 0
    finally:
        mp.undo()
    return a, b


@pytest.fixture(scope="module")
def dump(dumps):
    return load_dump(dumps[0])


def _expected_linear_rmsnorm_pairs(cfg) -> int:
    """From the layer plan: wkv->kv_norm and wq_a->q_norm in every layer, the indexer's
    wk->k_norm in every Full layer, and the ratio-1 compressor's wkv->norm (ratio 2 pools first)."""
    n = 0
    for role in v41graph.build_layer_plan(cfg):
        n += 2
        if role.mode == "full":
            n += 1 + (1 if role.ratio == 1 else 0)
    return n


# ---------------------------------------------------------------------------- the dump
def test_dump_lists_every_pass(dump, dumps):
    expected = resolve_passes()
    assert dump.graphs == [0, 1]                       # prefill and decode
    assert dump.manifest["passes"] == expected
    for g in dump.graphs:
        records = dump.passes(g)
        assert [r["pass"] for r in records] == expected
        assert [r["uuid"] for r in records] == [PASS_CLASSES[n]().uuid() for n in expected]
        assert dump.stages(g) == ["input"] + expected
        for i, name in enumerate(expected):
            for when in ("before", "after"):
                assert (dumps[0] / f"graph{g}" / f"{i:02d}_{name}.{when}.txt").is_file()
        # node counts by op add up to the node totals, and the added/removed lists explain the change
        for r in records:
            assert sum(r["nodes_before"].values()) == r["num_nodes_before"]
            assert sum(r["nodes_after"].values()) == r["num_nodes_after"]
            assert r["num_nodes_after"] - r["num_nodes_before"] == len(r["added"]) - len(r["removed"])
            assert len(dump.stage_nodes(f"{r['pass']}.before", g)) == r["num_nodes_before"]
            assert len(dump.stage_nodes(r["pass"], g)) == r["num_nodes_after"]


def test_p1_record_matches_linear_rmsnorm_pairs_and_names_what_each_fused_op_replaced(dump):
    expected = _expected_linear_rmsnorm_pairs(v41graph.V41Config.tiny())
    assert expected == 24
    for g in dump.graphs:
        r = dump.pass_record("P1", g)
        assert r["matched_count"] == expected
        fused = [f for f in dump.fused_ops(g) if f.pass_name == "fuse_wkv_rmsnorm"]
        assert len(fused) == expected
        # the other half of P1: one projections+pooling+RMSNorm per ratio-2 Full layer (tiny: 2, 4)
        pooled = [f for f in dump.fused_ops(g) if f.pass_name == "fuse_pool_rmsnorm"]
        assert len(pooled) == 2 and all(f.target == "v41graph.fused_ratio2_compressor.default" for f in pooled)
        # each replaced its mm pair and RMSNorm; together exactly what the pass removed, once
        r2 = dump.pass_record("fuse_pool_rmsnorm", g)
        replaced2 = [n for f in pooled for n in f.replaced]
        assert set(replaced2) == set(r2["removed"]) and len(replaced2) == len(r2["removed"])
        before2 = {n.name: n for n in dump.stage_nodes("fuse_pool_rmsnorm.before", g)}
        for f in pooled:
            targets = [before2[n].target for n in f.replaced]
            assert targets.count("aten.mm.default") == 2 and targets.count("aten.rsqrt.default") == 1
        before = {n.name: n for n in dump.stage_nodes("P1.before", g)}
        after = {n.name: n for n in dump.stage_nodes("P1", g)}
        assert sum(1 for n in after.values() if n.target == "v41graph.fused_wkv_rmsnorm.default") == expected
        replaced_all = []
        for f in fused:
            assert f.node in after and f.node not in before
            assert after[f.node].target == "v41graph.fused_wkv_rmsnorm.default"
            targets = [before[n].target for n in f.replaced]
            # one Linear (mm) and one RMSNorm (rsqrt) each, nothing of them left after the pass
            assert targets.count("aten.mm.default") == 1 and targets.count("aten.rsqrt.default") == 1
            assert not set(f.replaced) & set(after)
            replaced_all += f.replaced
        assert len(replaced_all) == len(set(replaced_all)) == len(r["removed"])
        assert set(replaced_all) == set(r["removed"])
        # the diff of the pass shows the replaced nodes going and the fused ones coming
        diff = dump.diff("P1.before", "P1", g)
        removed_lines = {m.group(1) for m in re.finditer(r"^-\[[^\]]*\] (\S+) ", diff, re.M)}
        added_lines = {m.group(1) for m in re.finditer(r"^\+\[[^\]]*\] (\S+) ", diff, re.M)}
        assert set(replaced_all) <= removed_lines
        assert {f.node for f in fused} <= added_lines


def test_p6_stream_map_puts_every_indexer_and_window_write_on_an_aux_stream(dump):
    for g in dump.graphs:
        nodes = dump.nodes(g)
        by_target = {}
        for n in nodes:
            by_target.setdefault(n.target, []).append(n)
        # 3 Full layers (indexer_topk) + 1 Reindex layer (indexer_topk_candidates) have an
        # indexer; all 10 layers write the window cache
        plan = v41graph.build_layer_plan(v41graph.V41Config.tiny())
        assert len(by_target[INDEXER]) == sum(r.mode == "full" for r in plan) == 3
        assert len(by_target[REINDEXER]) == sum(r.mode == "reindex" for r in plan) == 1
        assert len(by_target[WINDOW]) == 10
        indexers = by_target[INDEXER] + by_target[REINDEXER]
        assert {n.stream for n in indexers} == {"aux:select"}
        assert {n.stream for n in by_target[INDEX_K]} == {"aux:select"}
        assert {n.stream for n in by_target[WINDOW]} == {"aux:window"}
        assert set(dump.nodes_on_stream("aux:select", g)) >= {n.name for n in indexers}
        # ... already so right after P6 (the stage text carries the same labels)
        after_p6 = {n.name: n.stream for n in dump.stage_nodes("P6", g)}
        assert all(after_p6[n.name] == "aux:select" for n in indexers)
        assert all(after_p6[n.name] == "aux:window" for n in by_target[WINDOW])
        # each one sits in a fork/join region whose join the main stream waits for
        chains = {c.tag: c for c in dump.event_chains(g)}
        for n in indexers + by_target[WINDOW]:
            c = chains[n.side_tag]
            assert n.name in c.nodes and c.stream == n.stream
            assert c.fork_record and c.join_record and any(s == "main" for _, s in c.join_waits)
        # every wait follows a record of its tag; forks go main -> aux, joins come back aux -> main
        order = {n.name: i for i, n in enumerate(nodes)}
        for e in dump.events(g):
            assert e["record"] is not None and order[e["record"]] < order[e["wait"]]
            if e["tag"].startswith("fork:"):
                assert e["record_stream"] == "main" and e["wait_stream"].startswith("aux:")
            else:
                assert e["record_stream"].startswith("aux:")
        assert len([e for e in dump.events(g) if e["tag"].startswith("join:") and e["wait_stream"] == "main"]) == 15


def test_p4_puts_every_engram_gather_before_block0s_first_mm(dump):
    for g in dump.graphs:
        for stage_nodes in (dump.stage_nodes("P4", g), dump.nodes(g)):   # right after P4 and final
            gathers = [i for i, n in enumerate(stage_nodes) if n.target == GATHER]
            first_mm = min(i for i, n in enumerate(stage_nodes) if n.target == "aten.mm.default"
                           and n.module.startswith("layers.0."))
            assert len(gathers) == 2 and max(gathers) < first_mm
            assert {stage_nodes[i].stream for i in gathers} == {"aux:engram"}
        # before P4 they came later than block 0's first mm
        before = dump.stage_nodes("P4.before", g)
        first_mm = min(i for i, n in enumerate(before) if n.target == "aten.mm.default"
                       and n.module.startswith("layers.0."))
        assert min(i for i, n in enumerate(before) if n.target == GATHER) > first_mm


def test_two_dumps_of_the_same_graph_are_byte_identical(dumps):
    a, b = dumps
    # model.json: what `v41graph dump` built (for --profile); the twin is no CLI run
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file() and p.name != "model.json")
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    n_passes = len(resolve_passes())
    assert files_a == files_b and len(files_a) == 1 + 2 * (2 * n_passes + 3)
    compared = 0
    for rel in files_a:
        if rel.name == "timings.json":      # the only file with times in it
            continue
        data = (a / rel).read_bytes()
        assert data == (b / rel).read_bytes(), f"{rel} differs"
        assert not re.search(rb"0x[0-9a-f]{6,}", data), f"{rel} holds an object address"
        compared += 1
    assert compared == 1 + 2 * (2 * n_passes + 2)      # everything but the two timings.json
    assert all("seconds" not in r for r in json.loads((a / "graph1" / "passes.json").read_text()))


# ---------------------------------------------------------------------------- CLI and pictures
def test_cli_inspect_end_to_end(dumps, capsys):
    a = str(dumps[0])
    assert cli.main(["inspect", a, "--summary"]) == 0
    out = capsys.readouterr().out
    for g in (0, 1):
        assert f"## graph {g}" in out
    for name in resolve_passes():
        assert re.search(rf"^\| \d \| {name} \| \d+ \|", out, re.M), name
    assert re.search(r"^\| 1 \| fuse_wkv_rmsnorm \| 24 \|", out, re.M)

    assert cli.main(["inspect", a, "--graph", "1", "--diff", "P4.before", "P4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- graph1/hoist_engram.before\n+++ graph1/hoist_engram\n")
    assert re.search(r"^\+\[\s*aux:engram\] engram_gather ", out, re.M)

    assert cli.main(["inspect", a, "--graph", "1", "--streams", "--fused", "--pass", "P1"]) == 0
    out = capsys.readouterr().out
    for s in ("main", "aux:engram", "aux:select", "aux:window"):
        assert re.search(rf"^  {s}\s+\d+ nodes", out, re.M), s
    assert "fork:select.6" in out and "join:window.9" in out
    assert len(re.findall(r"^  fused fused_wkv_rmsnorm_default\S* = ", out, re.M)) == 24

    assert cli.main(["inspect", a, "--graph", "1", "--stage", "final"]) == 0
    assert capsys.readouterr().out == (dumps[0] / "graph1" / f"{_stage('stream_check')}.after.txt").read_text()
    assert cli.main(["inspect", a]) == 0                     # no option: the summary
    assert capsys.readouterr().out.startswith("# v41graph dump")


def test_cli_timeline_writes_a_png_with_one_lane_per_stream(dumps, tmp_path, capsys):
    mpl_image = pytest.importorskip("matplotlib.image")
    png = tmp_path / "timeline.png"
    assert cli.main(["inspect", str(dumps[0]), "--graph", "1", "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "4 lanes: main, aux:engram, aux:select, aux:window" in out
    img = mpl_image.imread(str(png))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > img.shape[0] and img.std() > 0
    one = tmp_path / "layer6.png"
    assert cli.main(["inspect", str(dumps[0]), "--graph", "1", "--timeline", str(one), "--layer", "6"]) == 0
    assert "3 lanes: main, aux:select, aux:window" in capsys.readouterr().out
    assert mpl_image.imread(str(one)).shape[0] < img.shape[0]      # fewer lanes, a lower picture


def test_timeline_lanes_whole_graph_and_one_layer(dump, tmp_path):
    mpl_image = pytest.importorskip("matplotlib.image")
    plan = v41graph.build_layer_plan(v41graph.V41Config.tiny())
    # independent of the stream map: the labels on the final stage's text lines
    final_streams = {n.stream for n in dump.stage_nodes("final", 1) if n.op == "call_function"}
    whole = draw_timeline(dump, tmp_path / "all.png", graph=1)
    assert set(whole["lanes"]) == final_streams == {"main", "aux:engram", "aux:select", "aux:window"}
    assert whole["lanes"][0] == "main" and whole["arrows"] == len(dump.events(1)) == 31
    for layer in (0, 6):
        info = draw_timeline(dump, tmp_path / f"layer{layer}.png", graph=1, layer=layer)
        # a layer with an indexer (Full ratio-1 layer 6) uses the select stream; a window-only
        # layer only the window stream; both write the window cache on the side
        expected = {"main", "aux:window"} | ({"aux:select"} if plan[layer].mode == "full" else set())
        assert set(info["lanes"]) == expected and len(info["lanes"]) == (3 if layer == 6 else 2)
        assert 0 < info["nodes"] < whole["nodes"] and info["arrows"] >= 2
        img = mpl_image.imread(info["path"])
        assert img.ndim == 3 and img.std() > 0
    dot = to_dot(dump, graph=1, layer=0)
    assert dot.startswith("digraph") and 'label="aux:window"' in dot and "style=dashed" in dot


def test_svg_needs_pydot(dump, tmp_path):
    try:
        import pydot  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependency, match="pydot"):
            from v41graph.tools.graph_dump import write_svg
            write_svg(dump, tmp_path / "g.svg", graph=1, layer=0)
        return
    from v41graph.tools.graph_dump import _dot_program, write_svg
    if _dot_program() is None:
        pytest.skip("no Graphviz dot and no graphviz-pure (pip install 'v41graph[viz]')")
    assert Path(write_svg(dump, tmp_path / "g.svg", graph=1, layer=0)).read_text().lstrip().startswith("<")


def test_missing_matplotlib_is_a_clear_error(dump, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency, match=r"needs matplotlib.*pip install"):
        draw_timeline(dump, tmp_path / "x.png", graph=1)


def test_cli_help_explains_every_option(capsys):
    expected = {"dump": {"--config", "--out", "--disable", "--seed", "--prompt-len", "--quiet"},
                "inspect": {"--graph", "--pass", "--diff", "--stage", "--streams", "--summary", "--fused",
                            "--timeline", "--layer", "--dot", "--svg", "--profile", "--device",
                            "--profile-steps", "--quiet"}}
    sub = next(a for a in cli._parser()._actions if a.dest == "command")
    for command, options in expected.items():
        actions = {o: a for a in sub.choices[command]._actions for o in a.option_strings}
        assert options <= set(actions)
        for opt in options:
            assert actions[opt].help and len(actions[opt].help) > 15, opt
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        for opt in options:
            assert opt in out
            # argparse puts the explanation right after the option (same or next line)
            first_words = actions[opt].help.split()[:2]
            assert " ".join(first_words) in " ".join(out.split()), opt


def test_console_script_runs_inspect(dumps):
    """The `v41graph` console script (or `python -m v41graph.tools.cli` where it is not installed)."""
    script = shutil.which("v41graph")
    cmd = [script] if script else [sys.executable, "-m", "v41graph.tools.cli"]
    r = subprocess.run(cmd + ["inspect", str(dumps[0]), "--graph", "1", "--fused"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert len(re.findall(r"^  fused_wkv_rmsnorm_default\S* = ", r.stdout, re.M)) == 24


def test_cli_dump_rejects_an_unknown_pass(tmp_path, capsys):
    assert cli.main(["dump", "--out", str(tmp_path / "d"), "--disable", "P99"]) == 1
    assert "unknown pass 'P99'" in capsys.readouterr().err
    assert cli.main(["dump", "--out", str(tmp_path / "e"), "--enable", "P99"]) == 1
    assert "unknown pass 'P99'" in capsys.readouterr().err


def test_cli_dump_enable_adds_an_opt_in_pass_to_the_defaults():
    from v41graph.passes.pass_manager import DEFAULT_PASSES, resolve_passes
    assert cli._pass_list(()) is None
    assert resolve_passes(cli._pass_list(["P9"])) == resolve_passes()[:-2] + ["mhc_side_stream", *DEFAULT_PASSES[-2:]]


# ---------------------------------------------------------------------------- bad dumps
def test_missing_or_corrupt_dump_is_a_clear_error(dumps, tmp_path, capsys):
    with pytest.raises(DumpError, match="no such dump directory"):
        load_dump(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DumpError, match="not a v41graph dump"):
        load_dump(tmp_path / "empty")

    def copy(name):
        dst = tmp_path / name
        shutil.copytree(dumps[0], dst)
        return dst

    d = copy("bad_json")
    p = d / "graph1" / "passes.json"
    p.write_text(p.read_text()[:200])
    with pytest.raises(DumpError, match=re.escape(str(p)) + r": not valid JSON"):
        load_dump(d)
    assert cli.main(["inspect", str(d)]) == 1
    err = capsys.readouterr().err
    assert str(p) in err and "not valid JSON" in err

    d = copy("no_stage")
    f = d / "graph0" / f"{_stage('hoist_engram')}.after.txt"
    f.unlink()
    with pytest.raises(DumpError, match=re.escape(str(f)) + ": missing"):
        load_dump(d)

    d = copy("no_passes")
    (d / "graph0" / "passes.json").unlink()
    with pytest.raises(DumpError, match=r"passes.json: missing; the last stage written is"):
        load_dump(d)

    d = copy("bad_streams")
    (d / "graph1" / "streams.json").write_text(json.dumps({"nodes": []}))
    with pytest.raises(DumpError, match=r"graph1/streams.json: lacks 'streams' \(expected an object with keys"):
        load_dump(d)

    d = copy("bad_record")
    p = d / "graph0" / "passes.json"
    records = json.loads(p.read_text())
    del records[2]["matched_count"]
    p.write_text(json.dumps(records))
    with pytest.raises(DumpError, match=rf"record 2 \({resolve_passes()[2]}\): lacks 'matched_count'"):
        load_dump(d)

    d = copy("bad_stage_line")
    f = d / "graph0" / "01_fuse_wkv_rmsnorm.after.txt"
    text = f.read_text()
    f.write_text(text + "garbage\n")           # one line more than the record counts
    with pytest.raises(DumpError, match=re.escape(str(f)) + r": truncated or damaged: \d+ complete node lines"):
        load_dump(d).stage_nodes("P1", 0)
    lines = text.splitlines(keepends=True)
    f.write_text("".join(lines[:4] + ["garbage\n"] + lines[5:]))
    dd = load_dump(d)
    with pytest.raises(DumpError, match=re.escape(str(f)) + r":5: cannot parse"):
        dd.stage_nodes("P1", 0)
    with pytest.raises(ValueError, match="unknown stage 'P7'"):
        dd.stage("P7", 0)
    with pytest.raises(ValueError, match="no graph 5"):
        dd.passes(5)


# ---------------------------------------------------------------------------- writer details, torch tools
def _small_graph():
    def f(x, w):
        return torch.relu(x @ w) + 1
    return fx.symbolic_trace(f)


def test_redump_with_fewer_passes_leaves_no_stale_stage_files(tmp_path):
    PassManager(dump_dir=tmp_path)(_small_graph())
    assert (tmp_path / "graph0" / f"{_stage('fuse_wkv_rmsnorm')}.after.txt").exists()
    PassManager(disable=["P1", "P4", "P6", "P8"], dump_dir=tmp_path)(_small_graph())
    names = sorted(p.name for p in (tmp_path / "graph0").glob("*.txt"))
    assert not any("fuse_wkv_rmsnorm" in n or "dual_stream" in n or "overlap_collectives" in n for n in names)
    d = load_dump(tmp_path)
    assert d.stages(0) == ["input", "cleanup", "fuse_rmsnorm", "defunctionalize", "stream_check"]
    assert d.streams(0) == ["main"] and d.event_chains(0) == []


def test_refusals_reach_the_record_and_an_alias_names_its_first_pass_that_ran(tmp_path, monkeypatch):
    from v41graph.passes.defunctionalize import Defunctionalize

    def refuse_two(self, gm):
        self.refused = 2
        return 0
    monkeypatch.setattr(Defunctionalize, "run", refuse_two)
    pm = PassManager(disable=["fuse_wkv_rmsnorm"], dump_dir=tmp_path)
    pm(_small_graph())
    pm(_small_graph())
    d = load_dump(tmp_path)
    for g in (0, 1):
        assert d.pass_record("defunctionalize", g)["refused"] == 2
        assert all("refused" not in r for r in d.passes(g) if r["pass"] != "defunctionalize")
        assert d.pass_record("P1", g)["pass"] == "fuse_pool_rmsnorm"      # P1's first pass is off
        assert d.stage("P1.before", g) == d.stage("fuse_pool_rmsnorm.before", g)
    assert pm.records[1][resolve_passes(disable=["fuse_wkv_rmsnorm"]).index("defunctionalize")]["refused"] == 2


def test_passes_reach_torch_logging_and_structured_trace():
    import logging

    import torch._logging._internal as internal

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__()
            self.records = []

        def emit(self, record):
            self.records.append(record)

    logged, traced = Keep(), Keep()
    torch._logging.set_logs(modules={ARTIFACT: True})
    artifact_log = logging.getLogger(f"v41graph.passes.pass_manager.__{ARTIFACT}")
    artifact_log.addHandler(logged)
    internal.trace_log.handlers.insert(0, traced)   # first: the lazy handler may remove itself
    try:
        PassManager()(_small_graph())
    finally:
        internal.trace_log.removeHandler(traced)
        artifact_log.removeHandler(logged)
        torch._logging.set_logs()
    text = [r.getMessage() for r in logged.records]
    n = len(resolve_passes())
    assert len(text) == 2 * n
    assert "===== v41graph graph0 00_cleanup before =====" in text[0] and "def forward" in text[0]
    meta = [r.metadata for r in traced.records]
    dumps_ = [m["graph_dump"]["name"] for m in meta if "graph_dump" in m]
    artifacts = [m["artifact"]["name"] for m in meta if "artifact" in m]
    assert len(dumps_) == 2 * n and dumps_[0] == "v41graph_graph0_00_cleanup_before"
    assert artifacts[-1] == "v41graph_graph0_streams" and len(artifacts) == n + 1
    cleanup = next(r for r in traced.records if r.metadata.get("artifact", {}).get("name") == "v41graph_graph0_00_cleanup")
    record = json.loads(cleanup.payload)
    assert record["pass"] == "cleanup" and record["num_nodes_before"] == 6   # x, w, matmul, relu, add, output


# ---------------------------------------------------------------------------- issue 22/23: names, summary, diff
def test_graphs_are_named_prefill_and_decode_in_the_manifest_and_the_summary(dumps, capsys):
    a = dumps[0]
    manifest = json.loads((a / "manifest.json").read_text())
    assert manifest["names"] == {"graph0": "prefill", "graph1": "decode"}
    d = load_dump(a)
    assert [d.graph_name(g) for g in d.graphs] == ["prefill", "decode"]
    assert cli.main(["inspect", str(a), "--summary"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^## graph .*$", out, re.M) == ["## graph 0 (prefill)", "## graph 1 (decode)"]
    # --summary respects --graph: only that graph's table
    assert cli.main(["inspect", str(a), "--summary", "--graph", "1"]) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^## graph .*$", out, re.M) == ["## graph 1 (decode)"]
    assert len(re.findall(r"^\| \d+ \| ", out, re.M)) == len(resolve_passes())
    assert cli.main(["inspect", str(a), "--summary", "--graph", "7"]) == 1
    assert "no graph 7" in capsys.readouterr().err


def _diff_names(diff: str, sign: str) -> set:
    return {m.group(1) for m in re.finditer(rf"^\{sign}\[[^\]]*\] (\S+) ", diff, re.M)}


def test_diff_input_final_shows_what_changed_not_every_stream_label(dump, capsys, dumps):
    g = 1
    before = {n.name: n for n in dump.stage_nodes("input", g)}
    after = {n.name: n for n in dump.stage_nodes("final", g)}
    # the reference, from the parsed stages: a node is unchanged when its call, shape and module
    # are the same and its stream is main in the final graph (input nodes are all unlabelled)
    assert {n.stream for n in before.values()} == {"-"}
    same = {k for k in before.keys() & after.keys()
            if (before[k].target, before[k].args, before[k].shape, before[k].module)
            == (after[k].target, after[k].args, after[k].shape, after[k].module) and after[k].stream == "main"}
    moved = {k for k in before.keys() & after.keys() if after[k].stream != "main"}
    assert len(same) > 1000 and moved
    assert cli.main(["inspect", str(dumps[0]), "--graph", "1", "--diff", "input", "final"]) == 0
    diff = capsys.readouterr().out
    removed, added = _diff_names(diff, "-"), _diff_names(diff, "+")
    context = {m.group(1) for m in re.finditer(r"^ \[[^\]]*\] (\S+) ", diff, re.M)}
    assert context, "no unchanged line at all"
    assert removed >= before.keys() - after.keys() and added >= after.keys() - before.keys()
    assert removed >= moved and added >= moved          # a move to a side stream is a change
    # an unchanged node never shows as changed, unless difflib had to realign around it
    realigned = (removed | added) & same
    assert len(realigned) < 0.05 * len(same), sorted(realigned)[:10]
    # the lines print as the stage files have them (labels included)
    assert re.search(r"^\+\[\s*aux:select\] ", diff, re.M) and re.search(r"^ \[\s*-\] ", diff, re.M)


# ---------------------------------------------------------------------------- issue 23: damaged dumps
_INSPECT_RUNS = (["--summary"], ["--graph", "1", "--pass", "P1"], ["--graph", "1", "--streams", "--fused"],
                 ["--graph", "1", "--diff", "input", "final"], ["--graph", "1", "--stage", "P4"])


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _set(obj, keys, value):
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value


def _delete(obj, keys):
    for k in keys[:-1]:
        obj = obj[k]
    del obj[keys[-1]]


def _wrong(value):
    """A value of another JSON type than `value`."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return "7"
    if isinstance(value, str):
        return 5
    if isinstance(value, list):
        return {"a": 1}
    return [1]


def test_damaged_dumps_fail_with_one_line_naming_file_and_entry(dumps, tmp_path, capsys):
    """Every key the reader relies on, missing or of the wrong type, in passes.json records and
    streams.json entries; bad JSON, missing files, truncated stage files: `v41graph inspect`
    exits 1 with one line naming the file and the entry, and never a traceback."""
    d = tmp_path / "d"
    shutil.copytree(dumps[0], d)
    passes, streams = d / "graph1" / "passes.json", d / "graph1" / "streams.json"
    records, smap = json.loads(passes.read_text()), json.loads(streams.read_text())
    r2 = records[2]["pass"]
    first_fused = next(i for i, r in enumerate(records) if r["fused"])
    cases = []       # (file, edit, words the error must contain)
    for key in ("pass", "matched_count", "nodes_before", "nodes_after"):
        cases.append((passes, lambda x, k=key: _delete(x, [2, k]), ["record 2", repr(key)]))
    for key in ("pass", "matched_count", "nodes_before", "nodes_after", "index", "uuid", "num_nodes_before",
                "num_nodes_after", "added", "removed", "moved_to_stream", "fused"):
        where = "record 2" if key == "pass" else f"record 2 ({r2})"
        cases.append((passes, lambda x, k=key: _set(x, [2, k], _wrong(x[2][k])), [where, repr(key)]))
    cases += [
        (passes, lambda x: _set(x, [2, "nodes_before", "aten.mm.default"], "3"), [f"record 2 ({r2})", "'nodes_before'"]),
        (passes, lambda x: _set(x, [first_fused, "fused", 0, "replaced"], "mm_1"), [f"record {first_fused}", "'replaced'"]),
        (passes, lambda x: _delete(x, [first_fused, "fused", 0, "node"]), [f"record {first_fused}", "'fused'[0]", "'node'"]),
        (passes, lambda x: _set(x, [3], "cleanup"), ["record 3", "expected an object"]),
        (passes, lambda x: _set(x, [2, "matched_count"], True), [f"record 2 ({r2})", "'matched_count'", "integer"]),
    ]
    node7, ev0 = smap["nodes"][7]["name"], smap["events"][0]["tag"]
    for key in ("name", "stream"):
        cases.append((streams, lambda x, k=key: _delete(x["nodes"][7], [k]), ["nodes[7]", repr(key)]))
        cases.append((streams, lambda x, k=key: _set(x["nodes"][7], [k], 3), ["nodes[7]", repr(key)]))
    for key in ("tag", "record", "record_stream", "wait", "wait_stream"):
        cases.append((streams, lambda x, k=key: _delete(x["events"][0], [k]), ["events[0]", repr(key)]))
    cases += [
        (streams, lambda x: _set(x["nodes"][7], ["stream"], "aux:nowhere"), ["nodes[7]", repr(node7), "'aux:nowhere'"]),
        (streams, lambda x: _set(x["events"][0], ["wait"], "no_such_node"), ["events[0]", repr(ev0), "'no_such_node'"]),
        (streams, lambda x: _set(x["regions"][1], ["nodes"], "abc"), ["regions[1]", "'nodes'"]),
        (streams, lambda x: _set(x["regions"][1], ["join_waits", 0, "stream"], 1), ["regions[1]", "'join_waits'[0]"]),
        (streams, lambda x: _set(x, ["streams"], "main"), ["'streams'", "must be a list"]),
        (streams, lambda x: _delete(x, ["regions"]), ["lacks 'regions'"]),
        (d / "graph1" / "timings.json", lambda x: _set(x, ["cleanup"], "fast"), ["timings.json", "'cleanup'"]),
        (d / "manifest.json", lambda x: _set(x, ["names"], ["prefill"]), ["manifest.json", "'names'"]),
        (d / "manifest.json", lambda x: _set(x, ["graphs"], ["graph0", "graph9"]), ["graph9", "missing"]),
    ]
    checked = 0

    def expect_error(path, words, runs=_INSPECT_RUNS):
        nonlocal checked
        for run in runs:
            assert cli.main(["inspect", str(d), *run]) == 1, (path, words, run)
            captured = capsys.readouterr()
            err = captured.err.strip()
            assert "\n" not in err and "Traceback" not in err, err
            assert err.startswith("v41graph inspect: error: ") and str(path) in err, err
            for w in words:
                assert w in err, (w, err)
            checked += 1

    for path, edit, words in cases:
        original = path.read_bytes()
        _edit_json(path, edit)
        expect_error(path, words)
        path.write_bytes(original)
    # bad JSON, a missing file, a truncated stage file (cut mid-line, and cut at a line end)
    for path, damage, words in [
            (passes, lambda p: p.write_text(p.read_text()[:300]), ["not valid JSON"]),
            (streams, lambda p: p.unlink(), ["missing"]),
            (d / "graph1" / f"{_stage('hoist_engram')}.after.txt", lambda p: p.unlink(), ["missing"])]:
        original = path.read_bytes()
        damage(path)
        expect_error(path, words)
        path.write_bytes(original)
    stage = d / "graph1" / f"{_stage('hoist_engram')}.after.txt"
    original = stage.read_bytes()
    n_lines = original.count(b"\n")
    for cut in (len(original) // 2, original.rindex(b"\n", 0, len(original) // 2) + 1):
        stage.write_bytes(original[:cut])
        expect_error(stage, ["truncated", f"record {_stage('hoist_engram')[:2].lstrip('0') or '0'}",
                             "hoist_engram"], runs=(["--graph", "1", "--stage", "P4"],
                                                    ["--graph", "1", "--diff", "P4", "final"]))
        assert cli.main(["inspect", str(d), "--graph", "1", "--stage", "P6"]) == 0   # other stages still read
        capsys.readouterr()
    stage.write_bytes(original)
    assert n_lines == load_dump(d).pass_record("P4", 1)["num_nodes_after"]
    assert checked >= 5 * len(cases)
    # after all that the copy is whole again
    for run in _INSPECT_RUNS:
        assert cli.main(["inspect", str(d), *run]) == 0
    capsys.readouterr()


def test_optional_record_keys_may_be_missing(dumps, tmp_path, capsys):
    """What the writer adds beyond the required keys (counts, added/removed lists, fused ops,
    module paths...) may be absent, as in an older dump: every inspect option still works."""
    from v41graph.compiler.dump import EVENT_PAIR, PASS_RECORD, REGION, STREAM_NODE
    d = tmp_path / "d"
    shutil.copytree(dumps[0], d)
    for g in (0, 1):
        _edit_json(d / f"graph{g}" / "passes.json",
                   lambda rs: [r.pop(k, None) for r in rs for k in PASS_RECORD.optional])
        _edit_json(d / f"graph{g}" / "streams.json",
                   lambda m: [[e.pop(k, None) for e in m[key] for k in spec.optional]
                              for key, spec in (("nodes", STREAM_NODE), ("events", EVENT_PAIR), ("regions", REGION))])
    assert not EVENT_PAIR.optional and PASS_RECORD.optional and REGION.optional
    for run in (*_INSPECT_RUNS, ["--graph", "1", "--dot", str(tmp_path / "x.dot")], ["--graph", "0", "--fused"]):
        assert cli.main(["inspect", str(d), *run]) == 0, run
        assert capsys.readouterr().err == ""


def test_damaged_dump_in_a_subprocess_prints_no_traceback(dumps, tmp_path):
    d = tmp_path / "d"
    shutil.copytree(dumps[0], d)
    _edit_json(d / "graph1" / "streams.json", lambda m: _delete(m["nodes"][3], ["stream"]))
    r = subprocess.run([sys.executable, "-m", "v41graph.tools.cli", "inspect", str(d), "--graph", "1", "--streams"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert str(d / "graph1" / "streams.json") in r.stderr and "nodes[3]" in r.stderr and "'stream'" in r.stderr


# ---------------------------------------------------------------------------- issue 22: pictures and profile
def test_timeline_title_fits_and_every_bar_carries_its_node_name(dump):
    pytest.importorskip("matplotlib")
    from v41graph.tools.graph_dump import timeline_figure
    fig, info = timeline_figure(dump, graph=1, layer=6)
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    box, title = fig.bbox, ax.title.get_window_extent(renderer)
    assert ax.title.get_text().startswith(f"{dump.path.name}: graph 1 (decode), layer 6\n")
    assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, (title, box)
    # the names written in the bars: exactly the drawn nodes, in the final graph's order
    final = [n for n in dump.stage_nodes("final", 1) if n.op not in ("placeholder", "output", "get_attr")]
    in_layer = [n.name for n in final if n.module == "layers.6" or n.module.startswith("layers.6.")]
    order = {n.name: i for i, n in enumerate(final)}
    assert set(in_layer) <= set(info["labels"]) and len(info["labels"]) == info["nodes"]
    assert [order[n] for n in info["labels"]] == sorted(order[n] for n in info["labels"])
    from matplotlib.text import Annotation
    names = [t for t in ax.texts if not isinstance(t, Annotation)]      # not the event arrows
    texts = [t.get_text() for t in names]
    shown = [n if len(n) <= 26 else n[:25] + "\u2026" for n in info["labels"]]
    assert texts == shown
    # the names do not overlap: the rotated names are narrower than one node's width
    widths = [t.get_window_extent(renderer).width for t in names]
    x0, x1 = ax.transData.transform([(0, 0), (1, 0)])[:, 0]
    assert max(widths) < (x1 - x0)
    # the whole graph names its custom and stream/event ops (all nodes: --layer)
    _, whole = timeline_figure(dump, graph=1)
    wanted = [n.name for n in final if n.target.startswith("v41graph.")]
    assert whole["labels"] == wanted and len(wanted) > 100


def test_svg_with_the_viz_extra(dump, tmp_path):
    """[viz] lists what --svg needs (pydot, and graphviz-pure's `dot` when Graphviz is not
    installed); with them installed the SVG is drawn."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")
    viz = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["viz"]
    assert {"matplotlib", "pydot", "graphviz-pure"} <= set(viz)
    pytest.importorskip("pydot", reason="pip install 'v41graph[viz]' for --svg")
    from v41graph.tools.graph_dump import _dot_program, write_svg
    if _dot_program() is None:
        pytest.skip("no Graphviz dot and no graphviz-pure")
    svg = Path(write_svg(dump, tmp_path / "g.svg", graph=1, layer=0)).read_text()
    assert "<svg" in svg and svg.count("<g id=\"node") == len(dump.layer_nodes(0, 1))


def test_inspect_profile_writes_a_chrome_trace_of_decode_steps(dumps, dump, tmp_path, capsys, caplog):
    """On CPU: the dumped model built again, its decode graph uncaptured, 2 steps profiled. The
    trace holds as many fused_wkv_rmsnorm calls per step as the dump's decode graph has. The
    tracing is logged (how long, which graph)."""
    import logging
    out = tmp_path / "trace.json"
    with caplog.at_level(logging.INFO, logger="v41graph"):
        assert cli.main(["inspect", str(dumps[0]), "--profile", str(out), "--profile-steps", "2",
                         "--device", "cpu"]) == 0
    assert f"profile: {out} (2 decode steps on cpu, uncaptured" in capsys.readouterr().out
    logged = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("traced the decode graph in ") for m in logged) == 1, logged
    assert not any(m.startswith("traced the prefill graph") for m in logged)     # compile_prefill=False
    assert any(m.startswith("profiling 2 decode steps of the tiny model on cpu") for m in logged)
    events = json.loads(out.read_text())["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    assert names.count("v41graph.step0") == names.count("v41graph.step1") == 1
    fused = sum(1 for n in dump.nodes(1) if n.target == "v41graph.fused_wkv_rmsnorm.default")
    assert fused == 24 and names.count("v41graph::fused_wkv_rmsnorm") == 2 * fused
    # a dump without model.json (written by compile(dump_dir=...)) says why it cannot
    d = tmp_path / "d"
    shutil.copytree(dumps[0], d)
    (d / "model.json").unlink()
    assert cli.main(["inspect", str(d), "--profile", str(tmp_path / "t2.json")]) == 1
    err = capsys.readouterr().err
    assert str(d / "model.json") in err and "missing" in err and err.count("\n") == 1
