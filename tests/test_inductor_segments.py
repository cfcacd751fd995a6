"""Inductor segments (passes/inductor_segments.py) on a toy graph, compiled by Inductor on CPU.

Inductor's CPU codegen costs seconds per segment on this machine, so this is one small graph;
the partitioner on the tiny V4.1 graph (no Inductor, run bit-identical) is in test_compiler.py,
which has that graph traced already.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.fx as fx

import v41graph  # noqa: F401  (registers torch.ops.v41graph)
from compile_harness import PassHarness
from v41graph.custom_ops.streams import STREAM_OPS
from v41graph.passes.base import STREAM_KEY
from v41graph.compiler.inductor_segments import InductorSegment, lower_inductor_segments
from v41graph.passes.side_stream import exclusive_ancestors, move_to_side_stream
from v41graph.passes.stream_check import StreamCheck

ops = torch.ops.v41graph
MIN_COMPUTE = 3
# fp32 on CPU, the same ops: Inductor's fused loops may differ from eager in the last bit
# (vectorized tanh / exp / sigmoid), nothing more. fake_quant reads an exact input (|x| * 2), so no
# FP8 rounding step can flip.
ATOL = 1e-5


class Toy(torch.nn.Module):
    """A state write (an in-place custom op after defunctionalize) and a read of a view of the
    written state in the middle; the test moves the fake_quant chain onto a side stream."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x, state, rows):
        h = torch.sigmoid(torch.relu(x @ self.w) * 2 + 1) - 0.5
        g = ops.fake_quant(x.abs() * 2, "fp8_ue8m0", 32)        # -> side stream (with its producers)
        g = torch.tanh(g) * 3 + h
        ops.state_write(state, rows, h[:2])
        late = (h * h + state.view(-1)[:32]).exp() - 1           # reads the state after the write
        return late + g * 0.5


def _is_view(node) -> bool:
    return getattr(node.target, "is_view", False)


def _expected_runs(gm: fx.GraphModule, written: fx.Node) -> list[int]:
    """Compute-node counts (views not counted) of the runs between barriers, spelled from the
    graph: a barrier is a stream op, an op with a written argument, or a view chain of the
    written state; placeholders and the output do not split runs (there are none in between)."""
    runs, current, state_views = [], None, {written}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        barrier = (n.target in STREAM_OPS
                   or any(a.alias_info is not None and a.alias_info.is_write
                          for a in getattr(n.target, "_schema", None).arguments or ())
                   or (_is_view(n) and n.args[0] in state_views))
        if barrier:
            if _is_view(n):
                state_views.add(n)
            current = None
            continue
        if current is None:
            current = [0]
            runs.append(current)
        current[0] += 0 if _is_view(n) else 1
    return [r[0] for r in runs]


def test_toy_graph_segments_between_stream_ops_and_writes_match_eager():
    torch.manual_seed(0)
    model = Toy().eval().requires_grad_(False)
    x, rows = torch.randn(4, 32), torch.tensor([0, 2])
    seen = {}

    def lower(gm):      # after the passes: the toy's side stream (as P6 does), then the segments
        quant = [n for n in gm.graph.nodes if n.target == ops.fake_quant.default]
        move_to_side_stream(gm, exclusive_ancestors(quant), "toy", "toy")
        StreamCheck()(gm)
        state = next(n for n in gm.graph.nodes if n.target == ops.state_write.default).kwargs["dst"]
        seen["runs"] = _expected_runs(gm, state)
        seen["stream_ops"] = sum(n.target in STREAM_OPS for n in gm.graph.nodes)
        seen["report"] = lower_inductor_segments(gm, min_compute_nodes=MIN_COMPUTE)

    harness = PassHarness(["cleanup", "defunctionalize"], lower=lower)
    eager_state, compiled_state = torch.zeros(3, 32), torch.zeros(3, 32)
    expected = model(x, eager_state, rows)
    got = harness.compile(model)(x, compiled_state, rows)

    runs, report, gm = seen["runs"], seen["report"], harness.after()
    large = sum(r >= MIN_COMPUTE for r in runs)
    # the side-stream region, the join's wait, the write and the view of the written state cut
    # the graph into runs; the one between the write and the view is too small
    assert len(runs) >= 4 and 0 < large < len(runs)
    assert report["found"] == len(runs)
    assert report["compiled"] == large and report["refused"] == 0
    assert report["too_small"] == report["left"] == len(runs) - large
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert len(calls) == large
    assert all(isinstance(gm.get_submodule(n.target), InductorSegment) for n in calls)
    # one segment runs on the side stream; every stream op and the write stayed outside
    assert [n.meta[STREAM_KEY] for n in calls].count("aux:toy") == 1
    assert sum(n.target in STREAM_OPS for n in gm.graph.nodes) == seen["stream_ops"]
    assert sum(n.target == ops.state_write.default for n in gm.graph.nodes) == 1
    assert torch.allclose(got, expected, atol=ATOL, rtol=0), (got - expected).abs().max()
    assert torch.allclose(compiled_state, eager_state, atol=ATOL, rtol=0)
    assert compiled_state.abs().sum() > 0          # the write happened


def test_triton_environment_is_pinned_as_inductor_sets_it(monkeypatch):
    # Inductor's helpers put TRITON_PTXAS_PATH / TRITON_LIBDEVICE_PATH into the environment
    # (part of Triton's kernel cache key); ours must call them with compile_segment's settings
    # in force (libdevice is gated on emulate_precision_casts) and report what they set
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime import compile_tasks
    from v41graph.compiler.inductor_segments import pin_inductor_triton_env
    seen, setting_before = [], inductor_config.emulate_precision_casts

    def fake_libdevice():
        seen.append(inductor_config.emulate_precision_casts)
        os.environ["TRITON_LIBDEVICE_PATH"] = "/cuda/nvvm/libdevice/libdevice.10.bc"
    monkeypatch.delenv("TRITON_LIBDEVICE_PATH", raising=False)
    monkeypatch.setattr(compile_tasks, "_set_triton_libdevice_path", fake_libdevice, raising=False)
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: None, raising=False)
    try:
        assert pin_inductor_triton_env() == {"TRITON_LIBDEVICE_PATH": "/cuda/nvvm/libdevice/libdevice.10.bc"}
    finally:
        os.environ.pop("TRITON_LIBDEVICE_PATH", None)
    assert seen == [True] and inductor_config.emulate_precision_casts == setting_before   # restored


class TwoSegments(torch.nn.Module):
    """A state write between two chains: two distinct segments, with an unbacked row count."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x, state, rows):
        h = torch.sigmoid(torch.relu(x @ self.w) * 2 + 1) - 0.5
        ops.state_write(state, rows, h[:2])
        return torch.tanh(h @ self.w) * 3 + h.exp() - 1


def _lower_two_segments(store, device: str = "cpu", unbacked: bool = True) -> tuple:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = TwoSegments().eval().requires_grad_(False).to(device)
    x, rows, state = (torch.randn(6, 32).to(device), torch.tensor([0, 2], device=device),
                      torch.zeros(3, 32, device=device))
    if unbacked:
        torch._dynamo.decorators.mark_unbacked(x, 0)     # as the decode graph's batch (its hardest case)
    reports = []
    harness = PassHarness(["cleanup", "defunctionalize"],
                          lower=lambda gm: reports.append(lower_inductor_segments(gm, MIN_COMPUTE, store=store)))
    out = harness.compile(model)(x, state, rows)
    expected_state = torch.zeros(3, 32, device=device)
    expected = model(x, expected_state, rows)
    assert torch.allclose(out, expected, atol=ATOL, rtol=0) and torch.allclose(state, expected_state, atol=ATOL, rtol=0)
    torch._dynamo.reset()
    return out, reports[0]


def _workers_against_here(tmp_path, monkeypatch, device: str, mode: str, unbacked: bool = True) -> dict:
    """Lower TwoSegments with the segments in the compile workers ($V41GRAPH_SEGMENT_WORKERS
    `mode`) and in this process: the same outputs, the same generated code. Returns the
    workers' report."""
    from v41graph.compiler import compile_cache as cc
    from v41graph.compiler.compile_workers import ENV_VAR
    from v41graph.compiler.inductor_segments import SEGMENT_WORKERS_VAR
    env = {"env": "test"}
    monkeypatch.setenv(ENV_VAR, "2")
    monkeypatch.setenv(SEGMENT_WORKERS_VAR, mode)
    in_workers, report = _lower_two_segments(cc.SegmentStore(tmp_path / "workers", env), device, unbacked)
    assert report["distinct_compiled"] == report["in_workers"] == report["stored"] == 2, report["refusals"]
    monkeypatch.setenv(ENV_VAR, "0")
    here, report_here = _lower_two_segments(cc.SegmentStore(tmp_path / "here", env), device, unbacked)
    assert report_here["distinct_compiled"] == report_here["stored"] == 2 and report_here["in_workers"] == 0
    assert torch.equal(in_workers, here)
    sources = {}
    for where in ("workers", "here"):
        files = sorted((tmp_path / where).rglob("*.pt"))
        sources[where] = {f.name: torch.load(f, weights_only=True)["source"] for f in files}
    assert len(sources["here"]) == 2 and sources["workers"] == sources["here"]
    return report


def test_distinct_segments_compile_in_the_workers_to_the_code_compiled_here(tmp_path, monkeypatch):
    """Two distinct segments with an unbacked size compile in the compile workers (pickled with
    their ShapeEnv: its facts about the size too); the code a worker generates is the code this
    process generates, and runs to the same outputs. (C++ kernels on the CPU: no kernel jobs.)"""
    report = _workers_against_here(tmp_path, monkeypatch, "cpu", "1")
    assert report["kernel_jobs"] == 0


def test_a_segment_workers_triton_kernels_are_noted_not_compiled():
    """In a segment job with kernels apart, Inductor's AsyncCompile.triton only notes the kernel
    (name and source, for a job of its own) and hands back a stand-in; outside, nothing changed."""
    from torch._inductor.async_compile import AsyncCompile
    from v41graph.compiler.inductor_segments import _kernels_noted
    original, kernels = AsyncCompile.triton, []
    with _kernels_noted(kernels):
        stand_in = AsyncCompile().triton("triton_poi_fused_0", "# the kernel's module source", device_str="cuda")
    assert kernels == [{"name": "triton_poi_fused_0", "source": "# the kernel's module source"}]
    assert not hasattr(stand_in, "run")         # never launched in the worker
    assert AsyncCompile.triton is original


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["1", "whole"])
def test_segment_kernels_compile_as_jobs_of_their_own_on_cuda(tmp_path, monkeypatch, mode):
    """On CUDA the segments' Triton kernels are jobs of their own (mode 1), or compiled by the
    segment's worker (whole): either way the code and outputs are those of an in-process compile.
    (Backed sizes: with the unbacked row count Inductor refused one of the two on an H100.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))       # kernels really compiled
    report = _workers_against_here(tmp_path, monkeypatch, "cuda", mode, unbacked=False)
    if mode == "1":
        # at least one fused kernel per segment, each compiled by its job
        assert report["kernel_jobs"] >= 2 and report["kernel_jobs_failed"] == 0, report
    else:
        assert report["kernel_jobs"] == 0, report


def test_segment_workers_switch_reads_the_environment(monkeypatch):
    from v41graph.compiler.inductor_segments import SEGMENT_WORKERS_VAR, segment_workers_on
    monkeypatch.delenv(SEGMENT_WORKERS_VAR, raising=False)
    assert segment_workers_on()
    monkeypatch.setenv(SEGMENT_WORKERS_VAR, "0")
    assert not segment_workers_on()
    monkeypatch.setenv(SEGMENT_WORKERS_VAR, "whole")
    assert segment_workers_on()
    monkeypatch.setenv(SEGMENT_WORKERS_VAR, "yes")
    with pytest.raises(ValueError, match="V41GRAPH_SEGMENT_WORKERS must be 0"):
        segment_workers_on()
    # refused when the model is compiled, before anything is traced (with no workers too)
    monkeypatch.setenv("V41GRAPH_COMPILE_WORKERS", "0")
    from v41graph.model.config import V41Config
    from v41graph.model.model import V41Model
    with pytest.raises(ValueError, match="V41GRAPH_SEGMENT_WORKERS must be 0"):
        v41graph.compile(V41Model(V41Config.tiny()).eval(), batch_sizes=(1,), compile_cache=False,
                         inductor_segments=True)
