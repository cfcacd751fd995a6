"""torch.compile(backend="v41graph") parity (issue 22): options and mode, the entry point that
resolves the name without `import v41graph`, per-process dump numbering across a graph break,
v41graph.compile's type check, progress bars and logs, and the packaging bits (py.typed,
dumps/ ignored)."""
from __future__ import annotations

import logging
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import v41graph
from v41graph.compiler.compiled_model import CompiledModel
from v41graph.passes.pass_manager import resolve_passes
from v41graph.tools.graph_dump import load_dump

REPO = Path(__file__).resolve().parents[1]


def _with_a_break(x, w):
    y = torch.relu(x @ w)
    torch._dynamo.graph_break()
    return torch.sigmoid(y) * 2


def test_options_disable_and_dump_dir_and_a_graph_break_numbers_each_graph(tmp_path):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    fn = torch.compile(_with_a_break, backend="v41graph",
                       options={"disable": ["P6", "hoist_engram"], "dump_dir": str(tmp_path)})
    torch.testing.assert_close(fn(x, w), _with_a_break(x, w), rtol=0, atol=0)
    d = load_dump(tmp_path)
    assert d.graphs == [0, 1]                       # the break's second graph did not overwrite graph0
    expected = resolve_passes(disable=["P6", "hoist_engram"])
    assert "dual_stream" not in expected and d.manifest["passes"] == expected
    assert [r["pass"] for r in d.passes(1)] == expected
    first = {n.target for n in d.stage_nodes("input", 0)}
    second = {n.target for n in d.stage_nodes("input", 1)}
    assert "aten.relu.default" in first and "aten.sigmoid.default" not in first
    assert "aten.sigmoid.default" in second and "aten.relu.default" not in second
    # another torch.compile into the same directory, same process: graphs 2 and 3
    torch._dynamo.reset()
    fn2 = torch.compile(_with_a_break, backend="v41graph", options={"dump_dir": str(tmp_path)})
    fn2(x, w)
    assert load_dump(tmp_path).graphs == [0, 1, 2, 3]


def test_mode_default_works_and_the_others_are_refused_clearly():
    x = torch.randn(5)
    f = lambda t: torch.relu(t) + 1   # noqa: E731
    torch.testing.assert_close(torch.compile(f, backend="v41graph", mode="default")(x), f(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"reduce-overhead.*v41graph\.compile\(model, capture=True\)"):
        torch.compile(f, backend="v41graph", mode="reduce-overhead")(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"max-autotune.*inductor_segments"):
        torch.compile(f, backend="v41graph", mode="max-autotune")(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"unknown option\(s\) 'disabled'.*options are passes, disable"):
        torch.compile(f, backend="v41graph", options={"disabled": ["P6"]})(x)
    torch._dynamo.reset()


def test_the_backend_resolves_without_importing_v41graph(tmp_path):
    """Through the torch_dynamo_backends entry point of the installed package (pip install -e .)."""
    code = f"""
import sys, torch
assert "v41graph" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
assert "v41graph" not in sys.modules
f = torch.compile(lambda t: torch.relu(t) * 3, backend="v41graph", options={{"dump_dir": {str(tmp_path)!r}}})
x = torch.randn(6)
assert torch.equal(f(x), torch.relu(x) * 3)
assert "v41graph" in sys.modules
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
    assert (tmp_path / "graph0" / "passes.json").is_file()
    # and after `import v41graph` first, the name is registered once (no duplicate-name error)
    code2 = "import torch, v41graph; torch._dynamo.list_backends(); " \
            "print(torch.compile(lambda t: t + 1, backend='v41graph')(torch.zeros(2)).tolist())"
    r = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "[1.0, 1.0]", r.stderr[-3000:]


def test_compile_expects_a_v41model():
    with pytest.raises(TypeError, match=r"expects a V41Model, got Linear.*torch\.compile\(module, backend=\"v41graph\"\)"):
        v41graph.compile(torch.nn.Linear(4, 4))


# ---------------------------------------------------------------------------- progress
@pytest.fixture
def stubbed_buckets(monkeypatch):
    """A CompiledModel whose buckets are not really compiled (prepare is recorded): the bar and
    the log lines without a trace. Its own model: compiling changes a model (stacked experts)."""
    compiled = CompiledModel(v41graph.V41Model(v41graph.V41Config.tiny()), backend="cpu", batch_sizes=(1, 2, 4, 8))
    prepared = []

    class Bucket:
        stepped = False

        def __init__(self, b):
            self.b = b

        def prepare(self):
            prepared.append((self.b, True))
    monkeypatch.setattr(compiled, "_graph_for", lambda b, caches, width, prepare=False: (
        prepared.append((b, True)) if prepare else Bucket(b)))
    return compiled, prepared


def test_warmup_draws_a_capture_bar_and_logs_each_bucket(stubbed_buckets, capsys, caplog, monkeypatch):
    from v41graph import progress
    compiled, prepared = stubbed_buckets
    compiled.platform, compiled.capture = "cuda", True      # what a GPU run says
    with caplog.at_level(logging.INFO, logger="v41graph"):
        compiled.warmup(caches=None, max_blocks=4, show_progress=True)
    err = capsys.readouterr().err
    assert prepared == [(1, True), (2, True), (4, True), (8, True)]
    assert "Capturing CUDA graphs" in err and "100%" in err and "4/4" in err
    logged = [r.getMessage() for r in caplog.records if r.name == "v41graph.compiler.compiled_model"]
    assert [m for m in logged if m.startswith("decode bucket")] == [
        f"decode bucket {b}: compile + capture" for b in (1, 2, 4, 8)]
    # show_progress=None: a bar on a terminal only, and never when quiet
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    compiled.platform = "cpu"
    compiled.warmup(caches=None, max_blocks=4)
    assert "Compiling decode buckets" in capsys.readouterr().err
    progress.set_quiet(True)
    try:
        compiled.warmup(caches=None, max_blocks=4)
        assert capsys.readouterr().err == ""
    finally:
        progress.set_quiet(False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    compiled.warmup(caches=None, max_blocks=4)
    assert capsys.readouterr().err == ""


def test_cli_quiet_silences_the_log(capsys, tmp_path):
    from v41graph.progress import configure_logging, is_quiet
    try:
        configure_logging(quiet=True)
        assert is_quiet() and not logging.getLogger("v41graph").isEnabledFor(logging.INFO)
        configure_logging(quiet=False)
        assert not is_quiet() and logging.getLogger("v41graph.compiler").isEnabledFor(logging.INFO)
    finally:
        configure_logging(quiet=False)


# ---------------------------------------------------------------------------- packaging
def test_wheel_ships_py_typed_and_the_entry_point(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel needs setuptools")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "No module named pip" in r.stderr:
        pytest.skip("no pip in this environment")
    assert r.returncode == 0, r.stderr[-3000:]
    wheel, = tmp_path.glob("v41graph-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "v41graph/py.typed" in names
    assert "[torch_dynamo_backends]\nv41graph = v41graph.compiler.backend:v41graph_backend" in entry_points


def test_dumps_folder_is_ignored_by_git():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    r = subprocess.run(["git", "check-ignore", "-q", "dumps/graph0/passes.json"], cwd=REPO)
    assert r.returncode == 0
    r = subprocess.run(["git", "check-ignore", "-q", "v41graph/tools/cli.py"], cwd=REPO)
    assert r.returncode == 1
