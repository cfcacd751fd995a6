"""P8 overlap_collectives: functional collectives issued early, waited for late, independent work
in between; values, the collectives' order and everything across a cache write or a stream op
unchanged.

The collectives run on an in-process gloo group of world size 1 (all-reduce, all-gather and
all-to-all are then identities, but the graph has the real `_c10d_functional` + `wait_tensor`
nodes). A V41Model with a one-rank ParallelState calls no collective, so the traced tests use
the real MoE (and mHC's expand) with a ParallelState that describes a 2-rank layout over that
one-rank group: the model code then takes its multi-rank paths (dispatch/combine under DP + EP,
the all-reduce under TP). The refusal cases are small hand-built graphs.
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

import v41graph
import v41graph.passes.overlap_collectives as overlap_module
from compile_harness import PassHarness
from v41graph.compiler.backend import copy_graph_module
from v41graph.compiler.dump import expand_aliases
from v41graph.model.mhc import expand
from v41graph.model.moe import MoE
from v41graph.parallel import ParallelConfig
from v41graph.parallel.state import ParallelState
from v41graph.passes.base import STREAM_KEY, module_path
from v41graph.passes.overlap_collectives import OverlapCollectives
from v41graph.passes.pass_manager import DEFAULT_PASSES, PASS_CLASSES, PassManager, resolve_passes
from v41graph.tools.graph_dump import load_dump

c10d = torch.ops._c10d_functional
ops = torch.ops.v41graph
COLLECTIVE_OPS = (c10d.all_reduce.default, c10d.all_gather_into_tensor.default, c10d.all_to_all_single.default)
WAIT = c10d.wait_tensor.default
WITHOUT_P8 = tuple(n for n in DEFAULT_PASSES if n != "overlap_collectives")


@pytest.fixture(scope="module")
def group():
    """A gloo process group of world size 1 (the one already initialized, if it is one)."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of more than one rank is already initialized")
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


def _state(group, **layout) -> ParallelState:
    """Rank 0 of a 2-rank layout whose collectives run over `group` (1 rank)."""
    return ParallelState(ParallelConfig(**layout), 0, group)


def _random_(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return module.eval().requires_grad_(False)


def _names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes]


def _collectives(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS]


def _wait_of(gm: fx.GraphModule, collective: str) -> fx.Node:
    node = next(n for n in gm.graph.nodes if n.name == collective)
    (wait,) = node.users
    assert wait.target is WAIT
    return wait


def _check_waits_just_before_first_use(gm: fx.GraphModule) -> None:
    """Every wait is followed by one of its users or by another wait (waits are placed only when
    nothing else can run, the one needed first first)."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is WAIT:
            assert n.next in n.users or (n.next.op == "call_function" and n.next.target is WAIT), \
                f"{n.name} is followed by {n.next.name}, which does not need it"


# ---------------------------------------------------------------------------- DP attention + EP: the MoE
@pytest.fixture(scope="module")
def dispatch(group):
    """The real MoE under DP2 + EP2 (`_dispatch_combine`), traced once."""
    cfg = v41graph.V41Config.tiny(moe_intermediate_size=64)
    moe = _random_(MoE(cfg, parallel=_state(group, dp=2, ep=2)), seed=1)
    harness = PassHarness()
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        fn = harness.compile(moe)
        out = fn(x)
    return harness, fn, moe, x, out


def test_the_shared_expert_runs_between_the_dispatch_all_to_alls_and_their_waits(dispatch):
    harness, *_ = dispatch
    before, after = harness.before(0), harness.after(0)
    assert len(_collectives(before)) == 2                         # dispatch (tokens + routing), combine
    assert _collectives(after) == _collectives(before)            # same collectives, same order
    nodes = list(after.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    shared = [n for n in nodes if module_path(n).startswith("shared_experts")
              and n.target is torch.ops.aten.mm.default]
    assert len(shared) == 3                                       # w1, w3, w2
    dispatch, combine = (next(n for n in nodes if n.name == c) for c in _collectives(after))
    assert pos[dispatch] < min(pos[s] for s in shared)
    assert pos[_wait_of(after, dispatch.name)] > max(pos[s] for s in shared)
    # before the pass every wait came right after its collective and the shared expert last
    b_nodes = {n.name: i for i, n in enumerate(before.graph.nodes)}
    for c in _collectives(before):
        assert b_nodes[_wait_of(before, c).name] == b_nodes[c] + 1
    assert min(b_nodes[s.name] for s in shared) > b_nodes[_wait_of(before, combine.name).name]
    _check_waits_just_before_first_use(after)
    manager = PassManager()
    manager(copy_graph_module(before))
    rec = next(r for r in manager.records[0] if r["pass"] == "overlap_collectives")
    assert rec["matched_count"] == 1 and rec.get("refused", 0) == 0  # the dispatch window filled
    assert rec["added"] == [] and rec["removed"] == [] and rec["moved_to_stream"] == {}


def test_the_moe_is_bit_identical_with_and_without_the_pass_and_to_eager(dispatch):
    harness, fn, moe, x, out = dispatch
    with torch.no_grad():
        with harness.using(WITHOUT_P8):
            plain = fn(x)
        eager = moe(x)
    assert torch.equal(out[0], plain[0]) and torch.equal(out[1], plain[1])
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


# ---------------------------------------------------------------------------- TP: the all-reduce and mHC's expand
class TPTail(nn.Module):
    """The end of a tensor-parallel attention and the residual mix after it: wo_b's fp32
    partial sums all-reduced, then mHC's expand (its comb x streams part does not read the
    all-reduce; a tensor-parallel Block keeps these torch ops, as_op=False)."""

    def __init__(self, state: ParallelState, d: int = 16):
        super().__init__()
        self.state = state
        self.wo_b = nn.Linear(d, d, bias=False)

    def forward(self, o, streams, post, comb):
        out = self.state.all_reduce(self.wo_b(o))
        return expand(out, streams, post, comb, as_op=False)


def test_the_tp_all_reduce_overlaps_the_residual_mixing_that_does_not_need_it(group):
    module = _random_(TPTail(_state(group, tp=2)), seed=3)
    g = torch.Generator().manual_seed(4)
    args = (torch.randn(3, 16, generator=g), torch.randn(3, 4, 16, generator=g),
            torch.randn(3, 4, generator=g), torch.randn(3, 4, 4, generator=g))
    harness = PassHarness()
    with torch.no_grad():
        fn = harness.compile(module)
        out = fn(*args)
        with harness.using(WITHOUT_P8):
            plain = fn(*args)
        eager = module(*args)
    assert torch.equal(out, plain) and torch.equal(out, eager)
    after = harness.after(0)
    (reduce,) = _collectives(after)
    wait = _wait_of(after, reduce)
    nodes = list(after.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    mixing = [n for n in nodes if n.target is torch.ops.aten.sum.dim_IntList]     # sum_c' comb X_c'
    assert len(mixing) == 1
    assert pos[next(n for n in nodes if n.name == reduce)] < pos[mixing[0]] < pos[wait]
    # ...and everything that needs the result after the wait
    needs = {wait}
    for n in nodes:
        if any(i in needs for i in n.all_input_nodes):
            needs.add(n)
            assert pos[n] > pos[wait]
    _check_waits_just_before_first_use(after)


# ---------------------------------------------------------------------------- hand-built graphs
def _build(group, body) -> fx.GraphModule:
    """A graph over placeholders x [4, 8] and cache [4, 8]; `body(graph, x, cache, call)` adds
    nodes (`call(name, target, *args)`) and returns the output node(s)."""
    graph = fx.Graph()
    x, cache = graph.placeholder("x"), graph.placeholder("cache")
    name = group.group_name

    def call(node_name, target, *args):
        if target in COLLECTIVE_OPS:
            args = args + (name,)
        return graph.create_node("call_function", target, args, name=node_name)
    graph.output(body(graph, x, cache, call))
    return fx.GraphModule(nn.Module(), graph)


def _run_pass(gm: fx.GraphModule):
    """(graph after P8, the pass) on a copy, `gm` unchanged."""
    out = copy_graph_module(gm)
    p = OverlapCollectives()
    p(out)
    return out, p


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def _same_values(a: fx.GraphModule, b: fx.GraphModule) -> None:
    xa, ca = _inputs()
    xb, cb = _inputs()
    ra, rb = a(xa, ca), b(xb, cb)
    ra, rb = (ra if isinstance(ra, tuple) else (ra,)), (rb if isinstance(rb, tuple) else (rb,))
    assert all(torch.equal(u, v) for u, v in zip(ra, rb)) and torch.equal(ca, cb)


aten = torch.ops.aten


def test_independent_work_moves_between_issue_and_wait(group):
    def body(g, x, cache, call):
        r = call("r", c10d.all_reduce.default, call("m", aten.mul.Tensor, x, 2.0), "sum")
        y = call("y", aten.add.Tensor, call("w", WAIT, r), 1.0)   # needs the result
        z = call("z", aten.exp.default, cache)                    # does not
        return call("out", aten.add.Tensor, y, z)
    gm = _build(group, body)
    after, p = _run_pass(gm)
    assert _names(gm) == ["x", "cache", "m", "r", "w", "y", "z", "out", "output"]
    assert _names(after) == ["x", "cache", "m", "r", "z", "w", "y", "out", "output"]
    assert p.matched_count == 1 and p.refused == 0
    _same_values(gm, after)


def test_the_collectives_keep_their_order_even_when_a_later_one_is_ready_first(group):
    def body(g, x, cache, call):
        a = x
        for i in range(3):                                        # a chain before the first collective
            a = call(f"sin{i}", aten.sin.default, a)
        first = call("w1", WAIT, call("r1", c10d.all_reduce.default, a, "sum"))
        second = call("w2", WAIT, call("r2", c10d.all_reduce.default, cache, "sum"))   # ready at once
        return call("out", aten.add.Tensor, first, second)
    gm = _build(group, body)
    after, _ = _run_pass(gm)
    assert _names(after) == ["x", "cache", "sin0", "sin1", "sin2", "r1", "r2", "w1", "w2", "out", "output"]
    _same_values(gm, after)


def test_nothing_crosses_a_cache_write(group):
    def body(g, x, cache, call):
        w = call("w", WAIT, call("r", c10d.all_reduce.default, x, "sum"))
        call("write", aten.add_.Tensor, cache, 1.0)               # an in-place cache write
        z = call("z", aten.exp.default, cache)                    # independent of r, reads the cache
        return call("out", aten.add.Tensor, w, z)
    gm = _build(group, body)
    after, p = _run_pass(gm)
    assert _names(after) == _names(gm)          # z stays after the write, the wait before it
    assert p.matched_count == 0
    _same_values(gm, after)


def test_a_collective_whose_wait_lies_across_a_cache_write_is_refused(group):
    def body(g, x, cache, call):
        r = call("r", c10d.all_gather_into_tensor.default, cache, 1)
        call("write", aten.add_.Tensor, cache, 1.0)               # writes the gather's input in flight
        z = call("z", aten.exp.default, x)
        return call("out", aten.add.Tensor, call("w", WAIT, r), z)
    gm = _build(group, body)
    after, p = _run_pass(gm)
    assert _names(after) == _names(gm) and p.refused == 1 and p.matched_count == 0


def test_a_collective_with_another_user_than_its_wait_or_on_a_side_stream_is_refused(group):
    def body(g, x, cache, call):
        r = call("r", c10d.all_reduce.default, x, "sum")
        w = call("w", WAIT, r)
        extra = call("extra", aten.neg.default, r)                # reads r without waiting
        ws = call("ws", WAIT, call("s", c10d.all_reduce.default, cache, "sum"))
        z = call("z", aten.exp.default, x)
        return call("out", aten.add.Tensor, call("a", aten.add.Tensor, w, extra),
                    call("b", aten.add.Tensor, ws, z))
    gm = _build(group, body)
    for n in gm.graph.nodes:
        if n.name in ("s", "ws"):
            n.meta[STREAM_KEY] = "aux:test"
    after, p = _run_pass(gm)
    assert _names(after) == _names(gm) and p.refused == 2 and p.matched_count == 0


@pytest.mark.parametrize("barrier", ["stream op", "random op"])
def test_stream_and_random_ops_are_barriers(group, barrier):
    """Nothing moves across an event wait, nor across a random op (moving it would change the
    draws): the collective's window stays empty."""
    def body(g, x, cache, call):
        w = call("w", WAIT, call("r", c10d.all_reduce.default, x, "sum"))
        if barrier == "stream op":
            call("join", ops.event_wait.default, "join:t")
            z = call("z", aten.exp.default, cache)
        else:
            z = call("z", aten.rand.default, [4, 8])
        return call("out", aten.add.Tensor, w, z)
    gm = _build(group, body)
    after, p = _run_pass(gm)
    assert _names(after) == _names(gm) and p.matched_count == 0


def test_a_graph_without_collectives_is_untouched(group):
    def body(g, x, cache, call):
        z = call("z", aten.exp.default, cache)
        return call("out", aten.add.Tensor, z, call("s", aten.sin.default, x))
    gm = _build(group, body)
    after, p = _run_pass(gm)
    assert _names(after) == _names(gm) and p.matched_count == 0 and p.refused == 0


# ---------------------------------------------------------------------------- registration, uuid, dumps
def test_the_pass_is_on_by_default_after_the_stream_passes_and_switches_off_by_name():
    names = resolve_passes()
    assert names[-2:] == ["overlap_collectives", "stream_check"]
    assert names.index("dual_stream") < names.index("overlap_collectives")
    assert expand_aliases(["P8"]) == ["overlap_collectives"]
    for off in ("P8", "overlap_collectives"):
        assert "overlap_collectives" not in resolve_passes(disable=[off])
    assert "overlap_collectives" in PASS_CLASSES and PASS_CLASSES["overlap_collectives"] is OverlapCollectives


def test_v41graph_compile_takes_disable_p8(tiny_model):
    on = v41graph.compile(tiny_model, backend="cpu")
    off = v41graph.compile(tiny_model, backend="cpu", disable=["P8"])
    assert "overlap_collectives" in on.pass_manager.names
    assert "overlap_collectives" not in off.pass_manager.names
    assert off.pass_manager.names == list(resolve_passes(disable=["overlap_collectives"]))


def test_editing_the_pass_changes_its_uuid_only(monkeypatch):
    before = {n: cls().uuid() for n, cls in PASS_CLASSES.items()}
    real = inspect.getsource

    def edited(obj):
        src = real(obj)
        return src + "\n# an edit\n" if obj is overlap_module else src
    monkeypatch.setattr(inspect, "getsource", edited)
    after = {n: cls().uuid() for n, cls in PASS_CLASSES.items()}
    assert {n for n in before if before[n] != after[n]} == {"overlap_collectives"}


def test_the_dump_records_the_pass(dispatch, tmp_path):
    harness, *_ = dispatch
    gm = copy_graph_module(harness.before(0))
    manager = PassManager(dump_dir=tmp_path)
    manager(gm)
    dump = load_dump(tmp_path)
    rec = dump.pass_record("P8", 0)
    assert rec["pass"] == "overlap_collectives" and rec["matched_count"] == 1
    assert rec["nodes_before"] == rec["nodes_after"]        # a reorder: the same nodes
    before, after = dump.stage("overlap_collectives.before", 0), dump.stage("overlap_collectives.after", 0)
    assert sorted(before.splitlines()) == sorted(after.splitlines()) and before != after
    assert "overlap_collectives" in dump.summary_markdown()


def test_the_dump_counts_refusals(group, tmp_path):
    def body(g, x, cache, call):
        r = call("r", c10d.all_gather_into_tensor.default, cache, 1)
        call("write", aten.add_.Tensor, cache, 1.0)
        return call("w", WAIT, r)
    PassManager(["overlap_collectives"], dump_dir=tmp_path)(_build(group, body))
    rec = load_dump(tmp_path).pass_record("overlap_collectives", 0)
    assert rec["refused"] == 1 and rec["matched_count"] == 0
