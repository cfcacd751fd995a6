"""Layer stamping (compiler/stamp.py): the whole model's graph built from a trace of the first
layer of each kind must be the graph a full trace gives, and compute the same bits.

The model is tiny() widths with a 16-layer plan in which every kind the stamper copies occurs
more than once: a ratio-2 KV source (layer 5 copied from 2), its Reuse layers (6, 7 from 3,
reading layer 5's top-k and KV where 3 read layer 2's), a Reindex layer (13 from 10) and the
Reuse layers of the Reindex sources (11, 12, 14, 15 from 9, the candidate source's Reuse layer:
their top-k is the Reindex layer's, their KV the candidate source's).
"""
from __future__ import annotations

import builtins
import collections

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import v41graph
from compile_harness import four_layer_config
from v41graph.compiler import stamp as st
from v41graph.compiler.backend import DECOMPOSITIONS
from v41graph.model.config import V41Config
from v41graph.model.layer_plan import build_layer_plan
from v41graph.model.model import V41Model, init_random_
from v41graph.model.moe import pack_moe_experts_
from v41graph.runtime.session import Session

PROMPT = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(5))
DECODE_STEPS = 3


def sixteen_layer_config() -> V41Config:
    return V41Config.tiny(num_hidden_layers=16, compress_ratios=[0, 0] + [2] * 6 + [1] * 8 + [0, 0, 0],
                          kv_source_layer_ids=[2, 5, 8], index_source_layer_ids=[2, 5, 8, 10, 13],
                          candidate_source_layer_id=8, dspark_target_layer_ids=[13, 14, 15])


def released_plan():
    full = V41Config()
    return build_layer_plan(V41Config.tiny(
        num_hidden_layers=full.num_hidden_layers, compress_ratios=full.compress_ratios,
        kv_source_layer_ids=full.kv_source_layer_ids, index_source_layer_ids=full.index_source_layer_ids,
        candidate_source_layer_id=full.candidate_source_layer_id, engram_layer_ids=full.engram_layer_ids,
        dspark_target_layer_ids=full.dspark_target_layer_ids))


def new_model() -> V41Model:
    return init_random_(V41Model(sixteen_layer_config()), seed=0).eval().requires_grad_(False)


# ----------------------------------------------------------------------------- the plan
def test_the_released_plan_traces_nine_of_forty_layers():
    plan = st.plan_stamping(released_plan())
    # by hand from the released layer plan: window (0), window + Engram (1), the first
    # ratio-2 KV source (2) and its Reuse layer (3), the ratio-2 source with Engram (14; its
    # Reuse layers are copies of 3), the ratio-1 candidate source (20) and its Reuse layer
    # (21; the Reuse layers of the Reindex layers are copies of it too, reading their top-k
    # where 21 reads 20's), the first Reindex layer (24)
    assert plan.traced == (0, 1, 2, 3, 14, 20, 21, 24)
    assert plan.copied_from[9] == 3 and plan.layer_maps[9] == {"self": {3: 9}, "kv": {2: 8}, "index": {2: 8}}
    assert plan.copied_from[37] == 21 and plan.layer_maps[37] == {"self": {21: 37}, "kv": {20: 20},
                                                                  "index": {20: 36}}
    assert plan.copied_from[28] == 24 and plan.layer_maps[28]["candidate"] == {20: 20}
    assert plan.copied_from[8] == 2 and plan.copied_from[15] == 3


def test_guard_checks_are_repeated_for_copies_with_their_layer_ids():
    plan = st.plan_stamping(released_plan())
    checks = [("value", "self._modules['layers']._modules['3'].role.kv_source", ("value", 2)),
              ("value", "self._modules['layers']._modules['3'].role.ratio", ("value", 2)),
              ("value", "self.stamp_layers", ("value", list(plan.traced)))]
    mapped = st.map_checks(checks, plan)
    assert not any("stamp_layers" in c[1] for c in mapped)
    assert ("value", "self._modules['layers']._modules['9'].role.kv_source", ("value", 8)) in mapped
    assert ("value", "self._modules['layers']._modules['9'].role.ratio", ("value", 2)) in mapped
    # 3 traced + its 26 copies (every ratio-2 Reuse layer), two checks each
    assert len(mapped) == 2 * sum(1 for v in plan.copied_from.values() if v == 3)


# ----------------------------------------------------------------------------- the graph
def _capture(model, call, stamp_layers):
    """(post-AOT graph, its inputs' Dynamo sources) of one trace of model(*call)."""
    from functorch.compile import make_boxed_func
    got = {}

    def fw(gm, example_inputs):
        got["gm"] = gm
        return make_boxed_func(gm.forward)
    inner = aot_autograd(fw_compiler=fw, decompositions=DECOMPOSITIONS, keep_inference_input_mutations=True)

    def backend(gm, example_inputs):
        got["sources"] = [n.meta["grapharg"].source.name for n in gm.graph.nodes if n.op == "placeholder"]
        return inner(gm, example_inputs)
    torch._dynamo.reset()
    model.stamp_layers = stamp_layers
    try:
        with torch.no_grad():
            torch.compile(model, backend=backend, fullgraph=True, dynamic=None)(*call)
    finally:
        model.stamp_layers = None
        torch._dynamo.reset()
    return got["gm"], got["sources"]


def _named_nodes(gm, sources) -> collections.Counter:
    """Each node as (op, target, args, kwargs) with graph inputs named by their source and
    other nodes by target and rank among that target's nodes: two graphs that compute the same
    thing from the same inputs give the same counter (node order and names aside)."""
    name = dict(zip([n for n in gm.graph.nodes if n.op == "placeholder"], sources))
    seen = collections.Counter()
    out = collections.Counter()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        key = (n.op, str(n.target), str(torch.fx.node.map_aggregate(n.args, lambda a: name.get(a, a))),
               str(torch.fx.node.map_aggregate(n.kwargs, lambda a: name.get(a, a))))
        name[n] = f"{n.target}#{seen[str(n.target)]}"
        seen[str(n.target)] += 1
        out[key] += 1
    return out


@pytest.fixture(scope="module")
def prefill_call():
    """A prefill step's arguments (a Session on the eager model builds them) and the caches
    as they were before it."""
    model = new_model()
    pack_moe_experts_(model)
    session = Session(model, 3, 48, block_size=16)
    got = {}
    call_model = session.call_model

    def grab(ids, positions, meta, **kwargs):
        got["call"] = (ids, positions, session.caches, meta)
        got["before"] = [t.clone() for t in session.caches.tensors()]
        return call_model(ids, positions, meta, **kwargs)
    session.call_model = grab
    session.prefill(PROMPT)
    return model, got["call"], got["before"]


def test_the_stamped_graph_is_the_full_trace_node_for_node(prefill_call):
    model, call, before = prefill_call
    for t, old in zip(call[2].tensors(), before):
        t.copy_(old)
    plan = st.plan_stamping(model.plan)
    assert plan.traced == (0, 1, 2, 3, 4, 8, 9, 10)
    traced, traced_sources = _capture(model, call, plan.traced)
    full, full_sources = _capture(model, call, None)
    scope = dict(zip(("self", "input_ids", "positions", "caches", "metadata"), (model, *call)))
    stamped, sources = st.stamp_graph(traced, traced_sources, plan,
                                      lambda s: eval(s, {"__builtins__": builtins}, {"L": scope}))
    full.graph.eliminate_dead_code()
    assert _named_nodes(stamped, sources) == _named_nodes(full, full_sources)
    assert sorted(sources) == sorted(full_sources)
    assert not any(n.target is st.STAMP_TAG for n in stamped.graph.nodes)


def test_a_layer_read_the_stamper_cannot_name_refuses(prefill_call):
    model, call, _ = prefill_call
    plan = st.plan_stamping(model.plan)
    traced, sources = _capture(model, call, plan.traced)
    # untag the global rows of layer 2's top-k: layer 3 (a Reuse layer of 2) then reads an
    # unnamed value of another layer
    tag = next(n for n in traced.graph.nodes if st._tag(n) == repr(("shared", "global_rows", "layer2", 2)))
    tag.replace_all_uses_with(tag.args[0])
    traced.graph.erase_node(tag)
    scope = dict(zip(("self", "input_ids", "positions", "caches", "metadata"), (model, *call)))
    with pytest.raises(st.StampRefused, match="of another layer"):
        st.stamp_graph(traced, sources, plan, lambda s: eval(s, {"__builtins__": builtins}, {"L": scope}))


# ----------------------------------------------------------------------------- compiled
def _run(compiled_or_model, steps=DECODE_STEPS, verify=False):
    """Logits of a prefill and `steps` decode steps (and with `verify`, the outputs of two
    speculative verify steps after them), and the caches after the decode steps."""
    session = Session(compiled_or_model, 3, 48, block_size=16)
    out = [session.prefill(PROMPT)]
    for _ in range(steps):
        out.append(session.decode(out[-1].argmax(-1)))
    caches = [t.clone() for t in session.caches.tensors()]
    if verify:
        out += _verify(compiled_or_model, session)
    return out, caches


def _verify(compiled, session, streams_of=(13, 14, 15)):
    """Two verify steps as speculative decoding calls them (every token's logits, the streams
    leaving three layers; two tokens per sequence, then 1, 3 and 2: the second must run the
    first one's graph): [logits, *streams] of each."""
    got = []

    def verify(ids, positions, meta, **kwargs):
        logits, streams = compiled(ids, positions, session.caches, meta, all_logits=True,
                                   return_streams=streams_of)
        got.extend([logits, *streams])
        return logits
    session.call_model = verify
    session.extend([0, 1, 2], [[5, 6], [7, 8], [9, 10]])
    session.extend([0, 1, 2], [[11], [12, 13, 14], [15, 16]])
    return got


def test_compile_stamps_and_matches_a_full_trace_bit_for_bit(tmp_path):
    full = v41graph.compile(new_model(), backend="cpu", batch_sizes=(4,), compile_cache=False, stamp_layers=False)
    traced, traced_caches = _run(full)                  # the whole-model trace
    assert full.traced_by["prefill"] == 1 and "stamp" not in full.notes
    compiled = v41graph.compile(new_model(), backend="cpu", batch_sizes=(4,), compile_cache=tmp_path)
    out, caches = _run(compiled, verify=True)
    assert len(out) == len(traced) + 2 * 4 == 1 + DECODE_STEPS + 2 * 4
    # one graph for prefill and decode, one for both verify steps: both stamped (the second
    # verify step runs the first one's stamped graph, no trace of the whole model)
    assert compiled.traced_by["prefill"] == 1 and compiled.traced_by["verify"] == 1
    assert not any("whole model" in e for e in compiled.compile_events), compiled.compile_events
    assert compiled.traced_by["decode"] == 0
    assert "traced layers [0, 1, 2, 3, 4, 8, 9, 10] of 16" in compiled.notes["stamp"]
    assert compiled.timings["stamp_s"] > 0
    for a, b in zip(out, traced):
        assert torch.equal(a, b)
    for a, b in zip(caches, traced_caches):
        assert torch.equal(a, b)
    # The verify steps against the eager model (test_compiler.py's bound, compiled vs eager):
    # a whole-model verify trace to compare bits with would double this test's time, and the
    # stamped verify graph is the stamped prefill graph's construction (shown node for node
    # above) on another trace.
    eager, _ = _run(new_model(), verify=True)
    for a, b in zip(out[len(traced):], eager[len(traced):]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    # a second process loads the stamped graph like a traced one
    warm = v41graph.compile(new_model(), backend="cpu", batch_sizes=(4,), compile_cache=tmp_path)
    warm_out, _ = _run(warm)
    assert warm.timings["cache_hits"] >= 1 and sum(warm.traced_by.values()) == 0   # (prefill and decode count each)
    for a, b in zip(warm_out, traced):
        assert torch.equal(a, b)


def test_a_refused_stamp_traces_the_whole_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise st.StampRefused("refused by the test")
    monkeypatch.setattr("v41graph.compiler.compiled_model.stamp_graph", refuse)
    model = init_random_(V41Model(four_layer_config()), seed=0).eval()
    compiled = v41graph.compile(model, backend="cpu", batch_sizes=(4,), compile_cache=False)
    out, _ = _run(compiled, steps=1)
    eager, _ = _run(init_random_(V41Model(four_layer_config()), seed=0).eval(), steps=1)
    assert any("refused by the test" in e for e in compiled.compile_events)
    assert "stamp" not in compiled.notes and compiled.traced_by["prefill"] == 1
    for a, b in zip(out, eager):      # test_compiler.py's bound, compiled vs eager
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_stamp_layers_false_traces_as_before():
    compiled = v41graph.compile(init_random_(V41Model(V41Config.tiny()), seed=0).eval(), backend="cpu",
                                compile_cache=False, stamp_layers=False)
    assert compiled.stamp is None and compiled._graphs is None
