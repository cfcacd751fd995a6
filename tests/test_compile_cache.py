"""The persistent compile cache (compiler/compile_cache.py) on a three-layer tiny model, CPU, our executor.

One cold compile (prefill + decode traced and stored) is shared by the module; the warm
CompiledModels load from its directory. Inductor segments' persistence runs on a toy graph
(Inductor's CPU codegen costs seconds per segment).
"""
from __future__ import annotations

import importlib
import inspect
import os
import shutil

import pytest
import torch

import v41graph
from compile_harness import PassHarness, three_layer_config
from script_loader import load_script
from v41graph.compiler import compile_cache as cc
from v41graph.compiler.inductor_segments import InductorSegment, lower_inductor_segments
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session

STEPS = 4
# share_decode_graph=True: the prefill and the decode bucket trace a graph each, so that storing,
# looking up and refusing is seen on two kinds; the default ("all": one graph) has its own test
SHARE = True
ATOL = 1e-4      # compiled vs eager (test_compiler.py's); warm vs cold is compared bit for bit
PROMPT = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(5))


def fresh_tiny(**overrides) -> V41Model:
    """The same weights as every other call (a new process would build the model again): the
    three-layer cut of tiny() (every cache kind and compressor; the cache's logic does not
    depend on the layer count)."""
    torch.manual_seed(0)
    return init_random_(V41Model(three_layer_config(**overrides)), seed=0).eval()


def run_session(compiled, steps: int = STEPS) -> list[torch.Tensor]:
    """Prefill a 9-token prompt for 3 sequences, then `steps` greedy decode steps (bucket 4,
    the shared decode graph): the logits of each call."""
    session = Session(compiled, 3, 48, block_size=16)
    outs = [session.prefill(PROMPT)]
    for _ in range(steps):
        outs.append(session.decode(outs[-1].argmax(-1, keepdim=True)))
    return outs


@pytest.fixture(scope="module", autouse=True)
def tool_cache_variables():
    """A compile cache points TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR under itself when they
    are unset: give them back as they were, for the test modules after this one."""
    names = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", cc.ENV_VAR)
    saved = {n: os.environ.get(n) for n in names}
    yield
    for n, v in saved.items():
        if v is None:
            os.environ.pop(n, None)
        else:
            os.environ[n] = v


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    """A cold compile into an empty cache directory: (directory, logits, compiled model)."""
    root = tmp_path_factory.mktemp("compile_cache")
    compiled = v41graph.compile(fresh_tiny(), backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=root)
    outs = run_session(compiled)
    return root, outs, compiled


def stored(root, kind=None) -> list:
    return sorted(p.name for p in root.glob("*/*.pt") if kind is None or p.name.startswith(kind + "-"))


def test_cold_compile_traces_and_stores_every_graph(cold):
    root, outs, compiled = cold
    assert compiled.timings["cache_misses"] == 2 and compiled.timings["cache_hits"] == 0
    assert compiled.timings["trace_s"] > 0 and compiled.pass_manager.graph_index == 2
    assert len(stored(root, "prefill")) == 1 and len(stored(root, "decode_shared")) == 1
    assert compiled.compile_cache.saved == 2
    assert compiled.notes["prefill"].startswith("traced its own graph (no decode graph")
    # the compiled model computes what the eager one does (test_compiler.py's tolerance)
    eager = run_session(fresh_tiny())
    assert all(torch.allclose(a, b, atol=ATOL, rtol=0) for a, b in zip(outs, eager))


def test_warm_compile_loads_without_tracing_and_is_bit_identical(cold):
    root, cold_outs, _ = cold
    warm = v41graph.compile(fresh_tiny(), backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=str(root))
    outs = run_session(warm)
    assert len(outs) == STEPS + 1
    assert all(torch.equal(a, b) for a, b in zip(outs, cold_outs))
    # nothing traced: the backend never ran (no graph through the pass manager), no trace time
    assert warm.pass_manager.graph_index == 0 and warm.traced == []
    assert warm.timings["trace_s"] == 0 and warm.timings.get("cache_misses", 0) == 0
    assert warm.timings["cache_hits"] == 2
    assert warm.compile_cache.saved == 0
    assert warm.notes["prefill"] == "runs the stored prefill graph (compile cache)"


def test_the_default_one_graph_serves_prefill_and_decode_warm(tmp_path):
    """share_decode_graph="all" (the default): the cold prefill traces the one graph (stored as
    a prefill entry), the decode steps run it, and a warm process runs both the prefill and the
    decode bucket on that stored graph (a lookup across kinds) without tracing, bit for bit."""
    cold = v41graph.compile(fresh_tiny(), backend="cpu", batch_sizes=(4,), compile_cache=tmp_path)
    cold_outs = run_session(cold)
    assert cold.pass_manager.graph_index == 1 and stored(tmp_path) == stored(tmp_path, "prefill")
    assert len(stored(tmp_path)) == 1
    warm = v41graph.compile(fresh_tiny(), backend="cpu", batch_sizes=(4,), compile_cache=tmp_path)
    outs = run_session(warm)
    assert all(torch.equal(a, b) for a, b in zip(outs, cold_outs))
    assert warm.pass_manager.graph_index == 0 and warm.timings.get("cache_misses", 0) == 0
    assert warm.timings["cache_hits"] == 2          # the one entry, by the prefill and the decode function
    assert warm.notes["prefill"] == "runs the stored prefill graph (compile cache)"


def test_tool_caches_point_under_the_cache_only_when_unset(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cc.point_tool_caches(tmp_path) == {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")     # the user's stays


def test_inductor_cache_moves_under_the_cache_from_its_own_default(tmp_path, monkeypatch):
    # Inductor puts its default into the environment when first asked (importing v41graph
    # does): that is not the user's choice, so the cache directory takes its place
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert cc.point_tool_caches(tmp_path) == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_inductor_segments_auto_follows_the_platform_and_the_cache(cold, monkeypatch):
    # "auto" (the default): on only for CUDA with a compile cache; on the CPU never, cache or not
    root, _, _ = cold
    monkeypatch.delenv(cc.ENV_VAR, raising=False)
    for cache in (root, False):
        compiled = v41graph.compile(fresh_tiny(), backend="cpu", batch_sizes=(4,), compile_cache=cache)
        assert compiled.inductor_segments is False
    assert v41graph.compile(fresh_tiny(), backend="cpu", inductor_segments=True).inductor_segments is True
    from v41graph.compiler.compiled_model import resolve_inductor_segments as resolve
    assert resolve("auto", "cuda", cache_on=True, parallel=False) is True
    assert not any(resolve("auto", platform, cache_on, parallel) for platform, cache_on, parallel in
                   (("cuda", False, False), ("cuda", True, True), ("npu", True, False), ("cpu", True, False)))
    with pytest.raises(ValueError, match=r"inductor_segments must be True, False or \"auto\", got 'yes'"):
        v41graph.compile(fresh_tiny(), backend="cpu", inductor_segments="yes")


def test_env_variable_turns_the_cache_on_and_false_turns_it_off(cold, monkeypatch):
    root, _, _ = cold
    monkeypatch.setenv(cc.ENV_VAR, str(root))
    model = fresh_tiny()
    assert v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,)).compile_cache.root == root
    assert v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=False).compile_cache is None
    # a dump is written while tracing: with a dump directory the cache is off
    assert v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), dump_dir=root / "dumps").compile_cache is None
    monkeypatch.delenv(cc.ENV_VAR)
    assert v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,)).compile_cache is None
    with pytest.raises(TypeError, match="compile_cache must be a directory path"):
        v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, compile_cache=3)
    not_a_dir = root / "key-file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, compile_cache=not_a_dir)
    with pytest.raises(ValueError, match="compile_cache is an empty path"):
        v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, compile_cache="")


def _folder(compiled) -> str:
    return compiled.compile_cache.dir.name


def test_a_pass_edit_the_config_and_the_buckets_each_miss(cold, monkeypatch):
    root, _, compiled = cold
    model = fresh_tiny()
    same = v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=root)
    assert _folder(same) == _folder(compiled) and len(same.compile_cache.entries("prefill")) == 1

    # An edit of a helper a pass imports (patterns.py) changes that pass's uuid, so the key
    # (what test_pass_uuid.py does: inspect.getsource, which uuid() reads, sees one more line).
    before = compiled.pass_manager.uuid()
    real, patterns = inspect.getsource, importlib.import_module("v41graph.passes.patterns")
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + ("\n# edited\n" if obj is patterns else ""))
    after_edit = v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=root)
    assert after_edit.pass_manager.uuid() != before
    assert _folder(after_edit) != _folder(compiled)
    assert after_edit.compile_cache.entries("prefill") == []
    monkeypatch.undo()

    other_config = v41graph.compile(fresh_tiny(index_topk=8), backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=root)
    assert _folder(other_config) != _folder(compiled) and other_config.compile_cache.entries("prefill") == []
    other_buckets = v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(2, 4), compile_cache=root)
    assert _folder(other_buckets) != _folder(compiled)
    other_passes = v41graph.compile(model, backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), disable=("P1",), compile_cache=root)
    assert _folder(other_passes) != _folder(compiled)
    # set_passes moves to the new pass list's folder
    same.set_passes(disable=("P1",))
    assert _folder(same) == _folder(other_passes)


def _prefill_scope(compiled, **changes):
    """The arguments of a prefill call as CachedFunction binds them, with `changes`."""
    session = Session(compiled, changes.pop("slots", 3), 48, block_size=16)
    captured = {}
    fn = compiled._prefill_fn

    def spy(*args, **kwargs):
        bound = fn._signature.bind(compiled.model, *args, **kwargs)
        bound.apply_defaults()
        captured.update(bound.arguments)
        raise StopIteration
    compiled._prefill_fn = spy
    try:
        with pytest.raises(StopIteration):
            session.prefill(PROMPT)
    finally:
        compiled._prefill_fn = fn
    captured.update(changes)
    signature = repr(sorted((k, v) for k, v in captured.items() if k not in fn.TENSOR_ARGS))
    return compiled.compile_cache, signature, captured


@torch.no_grad()     # as CompiledModel calls its graphs
def test_a_stored_graph_is_refused_where_dynamo_would_have_traced_again(cold):
    root, _, _ = cold
    warm = v41graph.compile(fresh_tiny(), backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=root)
    cache, signature, scope = _prefill_scope(warm)
    entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is not None, reasons               # the same call fits
    with torch.enable_grad():                       # Dynamo guards grad mode too
        entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is None and "'grad': True" in reasons[0]
    # another cache set size (a constant of the trace)
    cache, signature, scope = _prefill_scope(warm, slots=4)
    entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is None and "caches.num_slots is 5, the trace had 4" in reasons[0]
    # an input of another dtype
    cache, signature, scope = _prefill_scope(warm)
    scope["positions"] = scope["positions"].to(torch.int32)
    entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is None and "L['positions']: dtype torch.int32, the trace had torch.int64" in reasons[0]
    # another argument value
    cache, signature, scope = _prefill_scope(warm, all_logits=True)
    entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is None and "call [('all_logits', True)" in reasons[0] and "stored [('all_logits', False)" in reasons[0]
    # a model whose weights have another shape (checked once per model object)
    cache, signature, scope = _prefill_scope(warm)
    scope["self"] = fresh_tiny(vocab_size=320)
    entry, reasons = cache.lookup("prefill", signature, scope)
    assert entry is None and "320" in reasons[0] and "256" in reasons[0]


def test_a_corrupted_entry_is_reported_and_traced_again(cold, tmp_path):
    root, cold_outs, _ = cold
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    [decode] = [p for p in copy.glob("*/decode_shared-*.pt")]
    decode.write_bytes(decode.read_bytes()[:1000])
    warm = v41graph.compile(fresh_tiny(), backend="cpu", share_decode_graph=SHARE, batch_sizes=(4,), compile_cache=copy)
    outs = run_session(warm, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(outs, cold_outs))
    events = "\n".join(warm.compile_cache.events)
    assert f"entry {decode.name} unreadable" in events
    assert warm.timings["cache_hits"] == 1 and warm.timings["cache_misses"] == 1   # prefill loaded
    assert warm.pass_manager.graph_index == 1                                      # decode traced
    assert warm.compile_cache.saved == 1 and decode.stat().st_size > 1000          # and stored again


# ----------------------------------------------------------------------------- Inductor segments
class Chains(torch.nn.Module):
    """Two elementwise chains around a GEMM: segments Inductor compiles."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = torch.sigmoid(torch.relu(x @ self.w) * 2 + 1) - 0.5
        return torch.tanh(h @ self.w) * 3 + h


def _compile_chains(model, x, store):
    reports = []

    def lower(gm):
        reports.append(lower_inductor_segments(gm, min_compute_nodes=3, store=store))
    harness = PassHarness(["cleanup"], lower=lower)
    out = harness.compile(model)(x)
    torch._dynamo.reset()
    return out, reports[0], harness.after()


def test_inductor_segments_are_stored_and_loaded_by_their_own_key(tmp_path):
    torch.manual_seed(0)
    model, x = Chains().eval().requires_grad_(False), torch.randn(4, 16)
    env = {"env": cc.environment(x.device), "source": "test"}
    first, report, gm = _compile_chains(model, x, cc.SegmentStore(tmp_path, env))
    assert report["compiled"] >= 1 and report["distinct_compiled"] == report["stored"] >= 1
    assert report["loaded"] == 0
    digests = {m.artifact_digest for m in gm.modules() if isinstance(m, InductorSegment)}
    assert len(digests) == report["distinct_compiled"]
    again, report2, gm2 = _compile_chains(model, x, cc.SegmentStore(tmp_path, env))
    assert report2["loaded"] == report["stored"] and report2["distinct_compiled"] == 0
    assert torch.equal(again, first)
    # the lowered graph, with its loaded segments, serializes and loads back
    loaded = cc.LoadedGraph(cc.serialize_module(gm2), cc.SegmentStore(tmp_path, env))
    args = [model.w if tuple(p.meta["val"].shape) == (16, 16) else x
            for p in gm2.graph.nodes if p.op == "placeholder"]
    assert torch.equal(loaded(*args)[0], gm2(*args)[0])
    # another environment (torch version, device...) is another folder: compiled again
    other = dict(env, source="edited")
    _, report3, _ = _compile_chains(model, x, cc.SegmentStore(tmp_path, other))
    assert report3["loaded"] == 0 and report3["distinct_compiled"] == report["distinct_compiled"]


# ----------------------------------------------------------------------------- scripts/bench_compile.py
def test_bench_compile_compares_runs_step_by_step():
    """The script's cold-vs-warm verdict (its end-to-end run costs two traces: run by hand,
    `--config tiny --device cpu`, see its docstring)."""
    bench = load_script("bench_compile")
    cold = {"step_hashes": ["a", "b", "c"], "hash": "x", "prefill_hash": "p"}
    assert bench.compare(cold, dict(cold)) == {"equal": True, "prefill_equal": True,
                                              "first_differing_step": None, "differing_steps": 0}
    warm = {"step_hashes": ["a", "B", "C"], "hash": "y", "prefill_hash": "p"}
    assert bench.compare(cold, warm)["first_differing_step"] == 1
    assert bench.compare(cold, warm)["differing_steps"] == 2 and not bench.compare(cold, warm)["equal"]
    assert bench.compare(cold, {})["equal"] is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x", "--variants", "executor,turbo"])
    args = bench.parse_args(["--out", "x", "--buckets", "8,1,32"])
    assert args.bucket_list == [1, 8, 32] and args.variant_list == ["executor", "inductor"]
