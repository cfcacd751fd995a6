"""Triton precompile (compiler/triton_precompile.py): the stand-in calls must reproduce the
graph's real op calls (sizes, strides, offsets, dtypes) for every set of sizes it runs with,
a worker's compile must be the cache entry the first run's JIT looks for, and the hook must
note each graph's kernels once per set of sizes.

On CPU the graph's ops run their CPU kernels: the test checks the stand-ins against the
arguments the graph really passes (an FX interpreter re-running the graph on the recorded
arguments), which is what decides the Triton specializations on CUDA.
"""
from __future__ import annotations

import inspect
import os
import time

import pytest
import torch
import torch.fx as fx

import v41graph
from compile_harness import four_layer_config
from v41graph.compiler import compile_workers as cw
from v41graph.compiler import triton_precompile as tp
from v41graph.custom_ops.cuda_impls import CUDA_IMPLS
from v41graph.model.config import V41Config
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session


def describe(value):
    """What of an argument decides a Triton specialization (tensors by size, stride, storage
    offset, dtype, device; lists item by item; the rest by repr)."""
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.stride(), value.storage_offset(), str(value.dtype), str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(describe(v) for v in value)
    return repr(value)


def recording_impls(calls: set, graph_inputs: list) -> dict:
    """CUDA_IMPLS' op names, each recording the description of its call in `calls` once the
    call binds to the real impl's signature (a call the real impl would refuse fails here),
    every index tensor it gets is zeros and nothing it writes is one of `graph_inputs` (a
    failure here is a skipped call, which the test counts)."""
    import inspect

    def make(name):
        signature = inspect.signature(CUDA_IMPLS[name])
        schema = getattr(torch.ops.v41graph, name).default._schema
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]

        def impl(*args, **kwargs):
            signature.bind(*args, **kwargs)
            for a in args:
                if isinstance(a, torch.Tensor) and a.dtype in (torch.int32, torch.int64):
                    assert int(a.count_nonzero()) == 0, f"{name}: an index tensor that is not zeros"
            owned = {t.untyped_storage().data_ptr() for t in graph_inputs[-1] if isinstance(t, torch.Tensor)}
            assert not any(args[i].untyped_storage().data_ptr() in owned for i in written), \
                f"{name}: writes a graph input"
            calls.add((name, describe(args) + describe(tuple(kwargs.items()))))
        return impl
    return {name: make(name) for name in CUDA_IMPLS}


class _RealCalls(fx.Interpreter):
    """Runs a graph and records the calls of CUDA_IMPLS' ops as they really are."""

    def __init__(self, gm, calls: set):
        super().__init__(gm)
        self.calls = calls

    def call_function(self, target, args, kwargs):
        if isinstance(target, torch._ops.OpOverload):
            name = target._schema.name
            if name.startswith("v41graph::") and name.split("::", 1)[1] in CUDA_IMPLS:
                # by the schema's order, as the CUDA impls take them (the graph passes some by keyword)
                self.calls.add((name.split("::", 1)[1], describe(tp.positional_args(target, args, kwargs))))
        return super().call_function(target, args, kwargs)


class FakePool:
    n = 2

    def __init__(self):
        self.batches = []

    def compile(self, jobs):
        self.batches.append(jobs)
        return [{"ok": True, "s": 0.0} for _ in jobs]


def test_stand_in_calls_reproduce_the_graphs_real_calls(monkeypatch):
    noted, runs, graph_inputs = set(), [], []

    class Hook(tp.TritonPrecompile):
        def __call__(self, gm, args):
            graph_inputs.append(list(args))
            super().__call__(gm, args)

        def _note(self, gm, args):     # this set of sizes is new (noted before the lowering, or at a run)
            graph_inputs.append(list(args))
            runs.append((gm, [a.clone() if isinstance(a, torch.Tensor) else a for a in args]))
            return super()._note(gm, args)
    hook = Hook(FakePool(), impls=recording_impls(noted, graph_inputs))
    monkeypatch.setattr("v41graph.compiler.compiled_model.make_precompile", lambda platform, timings=None: hook)
    model = init_random_(V41Model(V41Config.tiny()), seed=0).eval()
    compiled = v41graph.compile(model, backend="cpu", batch_sizes=(1, 4), compile_cache=False)
    session = Session(compiled, 3, 48, block_size=16)
    logits = session.prefill(torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(1)))
    for _ in range(2):                             # bucket 4, twice: noted once
        logits = session.decode(logits.argmax(-1))
    session.release(1)
    session.release(2)
    session.decode(logits[:1].argmax(-1))           # sequence 0 alone: bucket 1
    # the prefill, bucket 4 and bucket 1: three sets of sizes, one graph (shared decode)
    assert len(runs) == 3 and len({id(gm) for gm, _ in runs}) == 1, [r["op_calls"] for r in hook.reports]
    assert all(r["skipped"] == 0 and r["op_calls"] > 0 for r in hook.reports), [r["skips"] for r in hook.reports]
    real: set = set()
    for gm, args in runs:
        _RealCalls(gm, real).run(*args)
    assert real and noted == real
    # each stand-in call was one distinct real call
    assert sum(r["stand_in_calls"] for r in hook.reports) == len(noted)


def test_allocations_come_out_zero_filled():
    with tp._ZeroFilledAllocations():
        tensors = [torch.empty(7, 5), torch.empty_strided((3, 4), (1, 3), dtype=torch.int64),
                   torch.empty_like(torch.ones(6, dtype=torch.bfloat16)),
                   torch.empty(9, dtype=torch.float8_e8m0fnu), torch.ones(2).new_empty((4,))]
    for t in tensors:
        bits = t.view(tp._INT_OF_SIZE[t.element_size()]) if t.dtype.is_floating_point else t
        assert int(bits.count_nonzero()) == 0, t.dtype


def test_a_stand_in_has_the_sizes_strides_and_offset_of_its_value():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        base = torch.empty(10, 12, dtype=torch.bfloat16)
        val = base.t()[2:, 3:]               # strided view with an offset
    stand_in = tp._stand_in(val, tp._Sizes([], []))
    assert (tuple(stand_in.shape), stand_in.stride(), stand_in.storage_offset(), stand_in.dtype) == \
        (tuple(val.shape), val.stride(), val.storage_offset(), val.dtype)
    assert int(stand_in.count_nonzero()) == 0


def test_a_call_reads_the_graphs_data_but_never_its_indices_or_what_it_writes():
    """A cache write whose every argument is a graph input: the values read (kv) are the
    graph's own tensor, the caches it writes and the slot mapping are zero stand-ins (a kernel
    already compiled launches on them: zeros address row 0), and an oversized written cache is
    shrunk along its outer dimension."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    real = [torch.zeros(64, 16), torch.ones(64, 1), torch.randn(3, 16), torch.tensor([5, 9, 40])]
    graph = fx.Graph()
    nodes = [graph.placeholder(n) for n in ("cache", "scale", "kv", "slot_mapping")]
    call = graph.call_function(torch.ops.v41graph.window_kv_write.default, tuple(nodes))
    graph.output(None)
    with FakeTensorMode() as mode:
        for n, t in zip(nodes, real):
            n.meta["val"] = mode.from_tensor(t)
    c = tp._Call(call, tp._Sizes(nodes, real), dict(zip(nodes, real)), {})
    cache, scale, kv, slots = c.value(call.args)
    assert kv is real[2]
    for got, given in ((cache, real[0]), (scale, real[1]), (slots, real[3])):
        assert got is not given and got.untyped_storage().data_ptr() != given.untyped_storage().data_ptr()
        assert got.shape == given.shape and int(got.count_nonzero()) == 0
    small = tp._stand_in(nodes[0].meta["val"], tp._Sizes([], []), shrink=True)
    assert tuple(small.shape) == (16, 16) and small.stride() == (16, 1)    # 64 rows: a multiple of 16


def test_worker_count_reads_the_environment(monkeypatch):
    monkeypatch.setenv(cw.ENV_VAR, "3")
    assert cw.worker_count() == 3
    monkeypatch.setenv(cw.ENV_VAR, "0")
    assert cw.worker_count() == 0 and tp.make_precompile("cuda") is None
    monkeypatch.setenv(cw.ENV_VAR, "many")
    with pytest.raises(ValueError, match="V41GRAPH_COMPILE_WORKERS must be a whole number"):
        cw.worker_count()
    assert tp.make_precompile("cpu") is None


def _specialization(block_n: int) -> dict:
    """A worker job for norms._rmsnorm_rows_kernel as Triton's jit_cache_hook describes it
    (made by hand: this machine may have no GPU to launch it)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    from v41graph.custom_ops.triton import norms
    kernel = norms._rmsnorm_rows_kernel
    names = [p.name for p in kernel.params]
    signature = dict.fromkeys(names, "constexpr")
    signature.update(y_ptr="*bf16", nw_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32", eps="fp32")
    constants = {(names.index("BR"),): 4, (names.index("NP2"),): block_n,
                 (names.index("CAST_BEFORE_WEIGHT"),): False}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("y_ptr", "nw_ptr", "out_ptr")}
    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})
    extra = {"target": target} if "target" in inspect.signature(serialize_specialization_data).parameters else {}
    spec = serialize_specialization_data(kernel.fn.__qualname__, signature, constants, attrs, options,
                                         f"test-{block_n}", **extra)     # Triton >= 3.7 adds the target
    return {"call": tp.WORKER_CALL, "module": kernel.fn.__module__, "name": kernel.fn.__qualname__, "spec": spec,
            "target": [target.backend, target.arch, target.warp_size], "env": cw.compile_env()}


def test_a_workers_compile_is_found_by_the_same_compile_in_process(tmp_path, monkeypatch):
    pytest.importorskip("triton", reason="Triton is not installed: nothing to compile")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    pool = cw.CompileWorkers(2)
    try:
        jobs = [_specialization(64), _specialization(128),
                {**_specialization(64), "module": "v41graph.no_such_module"}]
        results = pool.compile(jobs, timeout=240)
    finally:
        pool.stop()
    assert [r["ok"] for r in results] == [True, True, False], results
    assert "ModuleNotFoundError" in results[2]["error"]
    entries = sorted(os.listdir(tmp_path / "triton"))
    assert len(entries) == 2
    # the same specialization compiled here is a hit in the workers' entries (nothing added)
    from triton import knobs
    hits = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda **kw: hits.append(kw["cache_hit"]))
    t0 = time.perf_counter()
    tp.compile_specialization(jobs[0])
    assert hits == [True] and sorted(os.listdir(tmp_path / "triton")) == entries, time.perf_counter() - t0


def _graph_with_symbolic_rows() -> fx.GraphModule:
    """x + 1 with x's dim 0 symbolic (its fake value in the placeholder's meta), dim 1 static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    graph = fx.symbolic_trace(lambda x: x + 1)
    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        fake = torch.empty(env.create_unbacked_symint(), 3)
    next(n for n in graph.graph.nodes if n.op == "placeholder").meta["val"] = fake
    return graph


def test_a_graph_is_noted_once_per_set_of_sizes(monkeypatch):
    graph = _graph_with_symbolic_rows()
    noted = []

    def note(gm, args, impls):
        noted.append(tuple(args[0].shape))
        return [], {"op_calls": 0, "stand_in_calls": 0, "skipped": 0}
    monkeypatch.setattr(tp, "note_specializations", note)
    hook = tp.TritonPrecompile(FakePool(), impls={})
    for rows in (4, 4, 5, 4, 5, 2):
        hook(graph, [torch.ones(rows, 3)])
    assert noted == [(4, 3), (5, 3), (2, 3)] and len(hook.reports) == 3


def test_a_precompile_started_before_the_lowering_is_waited_for_by_the_first_run(monkeypatch):
    """start() (the compiled model calls it before the lowering) notes and compiles in the
    background; the first run with those sizes waits for that compile and notes nothing again."""
    import threading
    graph = fx.symbolic_trace(lambda x: x + 1)
    release, finished = threading.Event(), []

    class SlowPool(FakePool):
        def compile(self, jobs):
            release.wait(10)
            finished.append(len(jobs))
            return super().compile(jobs)
    noted = []

    def note(gm, args, impls):
        noted.append(tuple(args[0].shape))
        return [{"kernel": 1}], {"op_calls": 1, "stand_in_calls": 1, "skipped": 0}
    monkeypatch.setattr(tp, "note_specializations", note)
    monkeypatch.setattr(tp.TritonPrecompile, "_target", staticmethod(lambda: ["cuda", 90, 32]))
    hook = tp.TritonPrecompile(SlowPool(), impls={})
    hook.start(graph, [torch.ones(4, 3)])
    assert noted == [(4, 3)] and finished == [] and hook.reports == []   # compiling in the background
    threading.Timer(0.2, release.set).start()
    hook(graph, [torch.ones(4, 3)])                                      # the first run: waits
    assert finished == [1] and len(hook.reports) == 1 and noted == [(4, 3)]
    assert hook.timings["precompile_wait_s"] > 0.1
    hook(graph, [torch.ones(4, 3)])
    assert noted == [(4, 3)] and len(hook.reports) == 1


_CUDA_RUN = """
import json, os, sys
import torch
from triton import knobs
import v41graph
from v41graph.model.config import V41Config
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.session import Session
compiles = []
knobs.compilation.listener = lambda **kw: compiles.append(bool(kw["cache_hit"]))
import triton.runtime.build as build
launchers_built, c_build = [], build._build
def counting_build(name, *args, **kwargs):    # the host C compiler run for a module of Triton's
    if name == "__triton_launcher":
        launchers_built.append(name)
    return c_build(name, *args, **kwargs)
build._build = counting_build
model = init_random_(V41Model(V41Config.tiny()), seed=0).cuda().eval()
compiled = v41graph.compile(model, batch_sizes=(1, 4), compile_cache=False)
session = Session(compiled, 3, 48, block_size=16)
out = [session.prefill(torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(1)))]
for _ in range(3):
    out.append(session.decode(out[-1].argmax(-1)))
torch.save([o.cpu() for o in out], sys.argv[1])
print(json.dumps({"reports": compiled.precompile.reports if compiled.precompile else None,
                  "compiled_here": compiles.count(False), "loaded": compiles.count(True),
                  "launchers_built_here": len(launchers_built)}))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_first_runs_compile_no_kernel_after_the_precompile(tmp_path):
    """In a fresh process on an empty Triton cache, the workers compile the graph's kernels and
    their launchers; the prefill's and the decode buckets' first runs then only load them
    (Triton's listener sees no compile in the process, the C compiler builds no launcher), and
    the outputs equal a run without workers bit for bit."""
    import json
    import subprocess
    import sys
    pytest.importorskip("triton", reason="Triton is not installed")

    def run(workers: str, name: str) -> tuple[dict, list]:
        env = {**os.environ, cw.ENV_VAR: workers, "TRITON_CACHE_DIR": str(tmp_path / f"triton-{name}")}
        proc = subprocess.run([sys.executable, "-c", _CUDA_RUN, str(tmp_path / f"{name}.pt")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1]), torch.load(tmp_path / f"{name}.pt")
    got, out = run("4", "workers")
    assert got["reports"] and sum(r["kernels"] for r in got["reports"]) > 0, got
    assert all(r["failed"] == 0 for r in got["reports"]), got["reports"]
    assert got["compiled_here"] == 0 and got["loaded"] > 0, got
    # the kernels' launchers (C stubs) were built by the workers too
    assert sum(r["launchers"] for r in got["reports"]) > 0 and got["launchers_built_here"] == 0, got
    serial, serial_out = run("0", "serial")
    assert serial["reports"] is None and serial["compiled_here"] > 0 and serial["launchers_built_here"] > 0, serial
    for a, b in zip(out, serial_out):
        assert torch.equal(a, b)


def test_warmup_precompiles_every_buckets_sizes_when_the_first_one_traces():
    """warmup(): the graph that bucket 1 traces (stamped) is shared by buckets 2 and 4; their
    sizes are noted and compiled right then, before the lowering (start), not at their own first
    runs, and each bucket's first run finds its sizes among those started (so it only waits)."""
    class Recording:
        def __init__(self):
            self.events = []

        @staticmethod
        def sizes(args):
            return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))

        def start(self, gm, args):
            self.events.append(("start", self.sizes(args)))

        def __call__(self, gm, args):
            self.events.append(("run", self.sizes(args)))
    model = init_random_(V41Model(four_layer_config()), seed=0).eval()    # a stamped plan, quick to trace
    compiled = v41graph.compile(model, backend="cpu", batch_sizes=(1, 2, 4), compile_cache=False)
    compiled.precompile = hook = Recording()
    session = Session(compiled, 3, 48, block_size=16)
    compiled.warmup(session.caches, session.max_blocks)
    assert len(compiled.traced) == 1 and "stamp" in compiled.notes
    kinds = [kind for kind, _ in hook.events]
    started = [sizes for kind, sizes in hook.events if kind == "start"]
    runs = [sizes for kind, sizes in hook.events if kind == "run"]
    assert kinds[:3] == ["start"] * 3 and "start" not in kinds[3:], kinds     # all before any run
    assert len(set(started)) == 3                # three buckets' sizes, each once
    assert set(runs) == set(started), (runs, started)


def test_batches_of_two_sizes_compile_a_shared_kernel_once_and_both_runs_wait_for_it(monkeypatch):
    """start() for two sets of sizes before either runs (warmup's buckets): a specialization
    both note goes to the workers once; the run of the second sizes still waits for it."""
    import threading
    graph = _graph_with_symbolic_rows()
    release = threading.Event()
    submitted = []

    class SlowPool(FakePool):
        def compile(self, jobs):
            submitted.append(sorted(j["kernel"] for j in jobs))
            if any(j["kernel"] == "shared" for j in jobs):
                release.wait(10)
            return super().compile(jobs)

    def note(gm, args, impls):
        own = f"rows{args[0].shape[0]}"
        return [{"kernel": "shared"}, {"kernel": own}], {"op_calls": 2, "stand_in_calls": 2, "skipped": 0}
    monkeypatch.setattr(tp, "note_specializations", note)
    monkeypatch.setattr(tp.TritonPrecompile, "_target", staticmethod(lambda: ["cuda", 90, 32]))
    hook = tp.TritonPrecompile(SlowPool(), impls={})
    hook.start(graph, [torch.ones(4, 3)])
    hook.start(graph, [torch.ones(8, 3)])
    second_ran = threading.Event()
    runner = threading.Thread(target=lambda: (hook(graph, [torch.ones(8, 3)]), second_ran.set()))
    runner.start()
    time.sleep(0.3)
    assert not second_ran.is_set()       # its own batch is done, the shared kernel is not
    release.set()
    runner.join(10)
    assert second_ran.is_set()
    hook(graph, [torch.ones(4, 3)])
    assert sorted(submitted) == [["rows4", "shared"], ["rows8"]], submitted
