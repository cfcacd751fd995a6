"""The v41graph backend: pass counts, stream placement, and compiled vs eager numerics.

Dynamo + AOT autograd of the tiny model costs tens of seconds on CPU, so the tests trace it
once per shape and apply pass combinations to copies of the post-AOT graph (PassHarness in
tests/compile_harness.py); the real `v41graph.compile` path is exercised end to end in a few
tests as well.
"""
from __future__ import annotations

import pytest
import torch

import v41graph
from compile_harness import CompiledSession, PassHarness, count_ops, three_layer_config
from script_loader import load_script
from v41graph.compiler.backend import copy_graph_module
from v41graph.model.layers import RMSNorm
from v41graph.model.model import V41Model, init_random_
from v41graph.passes.base import STREAM_KEY, module_path
from v41graph.passes.pass_manager import resolve_passes
from v41graph.runtime.session import Session

ops = torch.ops.v41graph
ALL = ("cleanup", "fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_rmsnorm", "defunctionalize",
       "fuse_ratio2_state_write", "hoist_engram", "dual_stream", "overlap_collectives",
       "stream_check")
# fp32 CPU: the fused op and the unfused pair compute the same expression; only BLAS
# blocking may differ, so logits (|logit| ~ 1-5) agree to ~1e-5.
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return init_random_(V41Model(v41graph.V41Config.tiny()), seed=11).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def small():
    """The three-layer model, for tests of the compile API (buckets, shared traces, set_passes,
    timings) that each trace the whole model."""
    torch.manual_seed(0)
    return init_random_(V41Model(three_layer_config()), seed=11).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def traced(tiny):
    vb = PassHarness(ALL)
    fn = vb.compile(tiny, dynamic=False)
    prompt = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(5))
    s = CompiledSession(tiny, fn, 2, 64, block_size=16)
    s.prefill(prompt)                                   # graph 0: prefill of 2 x 21 tokens
    s.decode(torch.tensor([[3], [4]]))                  # graph 1: decode of 2 tokens
    assert len(vb.traced) == 2
    return vb, fn, prompt


def _run(model, fn, prompt, steps=16):
    """Prefill + `steps` greedy decode steps: logits of every step, eager and compiled."""
    eager = Session(model, 2, 64, block_size=16)
    comp = CompiledSession(model, fn, 2, 64, block_size=16)
    a, b = eager.prefill(prompt), comp.prefill(prompt)
    out = [(a, b)]
    for _ in range(steps):
        nxt = a.argmax(-1, keepdim=True)
        a, b = eager.decode(nxt), comp.decode(nxt)
        out.append((a, b))
    return out


# ---------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("disabled", [(), ("fuse_wkv_rmsnorm", "fuse_pool_rmsnorm"), ("fuse_rmsnorm",),
                                      ("fuse_ratio2_state_write",),
                                      ("hoist_engram",), ("dual_stream",),
                                      ("defunctionalize", "hoist_engram", "dual_stream"),
                                      ("fuse_wkv_rmsnorm", "fuse_pool_rmsnorm", "fuse_rmsnorm", "defunctionalize",
                                       "hoist_engram", "dual_stream")])
def test_compiled_matches_eager_prefill_and_16_decode_steps(tiny, traced, disabled):
    vb, fn, prompt = traced
    with vb.using(tuple(p for p in ALL if p not in disabled)):
        for step, (a, b) in enumerate(_run(tiny, fn, prompt)):
            assert torch.allclose(a, b, atol=ATOL, rtol=0), f"step {step}: {(a - b).abs().max()}"


# ---------------------------------------------------------------------------- pass counts
def _expected_linear_rmsnorm_pairs(model) -> int:
    """Counted from the module structure: every dense Linear whose output goes straight into
    an RMSNorm (tiny() is all-dense): wkv->kv_norm and wq_a->q_norm in every layer, the ratio-1
    compressor's wkv->norm, and the indexer's wk->k_norm in every Full layer."""
    n = 0
    for block in model.layers:
        n += 2
        role = block.role
        if role.mode == "full":
            n += 1                                 # indexer wk -> k_norm
            n += 1 if role.ratio == 1 else 0       # ratio-1 compressor (ratio 2 pools first)
    return n


def test_p1_fuses_every_linear_rmsnorm_pair(tiny, traced):
    vb, *_ = traced
    p1_only = tuple(p for p in ALL if p != "fuse_rmsnorm")         # P1's own share
    for idx in (0, 1):
        before, after = vb.before(idx), vb.passed(idx, p1_only)
        vb.check_after_ops([ops.fused_wkv_rmsnorm.default], index=idx, passes=p1_only)
        vb.check_before_ops([torch.ops.aten.rsqrt.default], fully_replaced=False, index=idx, passes=p1_only)
        expected = _expected_linear_rmsnorm_pairs(tiny)
        assert count_ops(after, ops.fused_wkv_rmsnorm.default) == expected == 24
        # every rsqrt left belongs to an RMSNorm that is not fed by a Linear (mHC, attn/ffn norms...)
        # every rsqrt removed belongs to a fused RMSNorm: the 24 pairs plus the 2 ratio-2 pools
        assert count_ops(before, torch.ops.aten.rsqrt.default) - count_ops(after, torch.ops.aten.rsqrt.default) == expected + 2


def _expected_plain_rmsnorms(model) -> int:
    """Counted from the module structure: the RMSNorms no Linear feeds (P1 takes the others):
    every layer's attention and FFN norms, and the final norm."""
    return sum(isinstance(b.attn_norm, RMSNorm) + isinstance(b.ffn_norm, RMSNorm) for b in model.layers) \
        + isinstance(model.norm, RMSNorm)


def test_fuse_rmsnorm_takes_every_norm_p1_left(tiny, traced):
    vb, *_ = traced
    p1_only = tuple(p for p in ALL if p != "fuse_rmsnorm")
    for idx in (0, 1):
        g, without = vb.passed(idx), vb.passed(idx, p1_only)
        n = count_ops(g, ops.rms_norm.default)
        assert n == _expected_plain_rmsnorms(tiny) == 21
        # each fused norm took exactly one rsqrt; what is left are the mHC predictors' and the
        # Engram gates' weightless norms (no [D] weight parameter)
        assert count_ops(without, torch.ops.aten.rsqrt.default) - count_ops(g, torch.ops.aten.rsqrt.default) == n
        left = [module_path(x) for x in g.graph.nodes if x.op == "call_function"
                and x.target == torch.ops.aten.rsqrt.default]
        assert left and all(p.endswith((".hc_attn", ".hc_ffn")) or p.startswith("engram.") for p in left), left
        # P1 off: the Linear + RMSNorm pairs' norms become plain rms_norm ops instead
        no_p1 = vb.passed(idx, tuple(resolve_passes(disable=("P1",))))
        assert count_ops(no_p1, ops.rms_norm.default) == n + _expected_linear_rmsnorm_pairs(tiny) + 2


def _logits_with_lowering(tiny, traced, lower, steps=3):
    """Logits of prefill + `steps` greedy decode steps through the traced graphs with all passes
    and `lower` (a lowering run after them, or None)."""
    vb, fn, prompt = traced
    with vb.using(ALL, lower):
        session = CompiledSession(tiny, fn, 2, 64, block_size=16)
        out = [session.prefill(prompt)]
        for _ in range(steps):
            out.append(session.decode(out[-1].argmax(-1, keepdim=True)))
    return out


def test_inductor_segments_compile_each_distinct_segment_once(tiny, traced, monkeypatch):
    """The layers repeat segment shapes: lowering compiles each distinct segment (segment_key)
    once and hands the same compiled callable to its repeats. Inductor replaced by a stub that
    runs the FIRST segment of each key, so reuse across layers must still give the unsplit
    graph's logits bit for bit (prefill + 3 decode steps)."""
    import v41graph.compiler.inductor_segments as seg_mod

    compiled_subs = []

    def stub(sub):
        compiled_subs.append(sub)
        return lambda args: sub(*args)
    monkeypatch.setattr(seg_mod, "compile_segment", stub)
    monkeypatch.setenv(seg_mod.SEGMENT_WORKERS_VAR, "0")     # the stub runs here, not in the workers
    vb, *_ = traced
    g = copy_graph_module(vb.passed(1))
    report = seg_mod.lower_inductor_segments(g)
    calls = [g.get_submodule(n.target) for n in g.graph.nodes if n.op == "call_module"]
    keys = [seg_mod.segment_key(c.graph_module) for c in calls]
    assert report["compiled"] == len(calls) and report["refused"] == 0
    assert report["distinct_compiled"] == len(compiled_subs) == len(set(keys)) < len(calls)
    for c, k in zip(calls, keys):        # one callable per key, shared by every repeat
        assert c.compiled is next(x.compiled for x, kk in zip(calls, keys) if kk == k)

    plain = _logits_with_lowering(tiny, traced, None)
    lowered = _logits_with_lowering(tiny, traced, seg_mod.lower_inductor_segments)
    assert all(torch.equal(a, b) for a, b in zip(plain, lowered))


def test_mhc_one_op_per_side(tiny, traced):
    """Two mHC sub-layers per layer (attention, FFN), each one mhc_pre node (the collapse and the
    predictor, Sinkhorn included) and one mhc_post node (the expand): the Sinkhorn rounds (2 fp32
    divisions each) and the predictor's RMS scale and projection no longer appear as graph
    arithmetic: the whole graph has fewer divisions than the rounds alone would add (the codecs
    and norms account for the rest), and no fp32 mm as wide as the flattened streams."""
    vb, *_ = traced
    sides = 2 * len(tiny.layers)
    width = tiny.config.hc_mult * tiny.config.hidden_size
    for idx in (0, 1):
        g = vb.passed(idx)
        assert count_ops(g, ops.mhc_pre.default) == count_ops(g, ops.mhc_post.default) == sides == 20
        assert count_ops(g, ops.mhc_sinkhorn.default) == 0
        assert count_ops(g, torch.ops.aten.div.Tensor) < 2 * (tiny.config.hc_sinkhorn_iters - 1) * sides
        assert not [n for n in g.graph.nodes if n.target is torch.ops.aten.mm.default
                    and n.args[0].meta["val"].shape[-1] == width]


def test_p9_puts_every_mhc_predictor_on_the_mhc_side_stream(tiny, traced):
    """The opt-in P9 splits each of the 20 mhc_pre nodes into mhc_collapse on the main stream and
    mhc_predict on side stream "mhc", one fork/join per sub-layer, joined before the sub-layer's
    mhc_post (the first reader of post and comb); the stream check accepts the graph."""
    vb, *_ = traced
    with_p9 = (*ALL, "mhc_side_stream")
    assert resolve_passes(with_p9) == [*ALL[:-2], "mhc_side_stream", *ALL[-2:]]
    assert "mhc_side_stream" not in resolve_passes() and resolve_passes((*ALL, "P9")) == resolve_passes(with_p9)
    sides = 2 * len(tiny.layers)
    for idx in (0, 1):
        g = vb.passed(idx, with_p9)
        assert count_ops(g, ops.mhc_pre.default) == 0
        assert count_ops(g, ops.mhc_collapse.default) == count_ops(g, ops.mhc_predict.default) == sides == 20
        nodes = list(g.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        for n in nodes:
            if n.target is ops.mhc_collapse.default:
                assert n.meta[STREAM_KEY] == "main"
            elif n.target is ops.mhc_predict.default:
                assert n.meta[STREAM_KEY] == "aux:mhc"
                tag = n.meta["side_tag"]
                readers = [u for item in n.users for u in item.users]
                assert readers and all(r.meta.get(STREAM_KEY, "main") == "main" for r in readers)
                join = next(w for w in nodes if w.target is ops.event_wait.default and w.args[0] == f"join:{tag}")
                post = next(r for r in readers if r.target is ops.mhc_post.default)
                assert order[join] < min(order[r] for r in readers) and order[join] < order[post]
        forks = [n for n in nodes if n.target is ops.event_record.default and str(n.args[0]).startswith("fork:mhc.")]
        assert len(forks) == sides


def test_p9_changes_no_value(tiny, traced):
    """P9 moves work between streams and changes no arithmetic: prefill + 16 decode steps give
    the same logits bit for bit with and without it (on the CPU the stream ops are no-ops, so
    this checks the rewiring: a swapped pre / post / comb or collapse input would show)."""
    vb, fn, prompt = traced
    with vb.using(ALL):
        plain = [b for _, b in _run(tiny, fn, prompt, steps=8)]
    with vb.using((*ALL, "mhc_side_stream")):
        split = [b for _, b in _run(tiny, fn, prompt, steps=8)]
    assert {k[0] for k in vb.variants if "mhc_side_stream" in k[1]} == {0, 1}     # both graphs ran split
    assert all(torch.equal(a, b) for a, b in zip(plain, split))


def test_p9_leaves_a_whole_tuple_use_alone():
    """A near miss is refused, not rewritten: an mhc_pre whose tuple is used whole (here, the
    graph's output) has nothing to rewire its users to, so P9 counts it as refused and leaves it."""
    import torch.fx as fx
    from v41graph.passes.mhc_side_stream import MhcSideStream
    graph = fx.Graph()
    streams, pre_prev, fn, scale, base = (graph.placeholder(n) for n in ("streams", "pre_prev", "fn", "scale", "base"))
    node = graph.call_function(ops.mhc_pre.default, (streams, pre_prev, fn, scale, base, 4, 20, 1e-6, 1e-6))
    graph.output((node,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    p9 = MhcSideStream()
    assert p9(gm) == 0 and p9.refused == 1
    assert count_ops(gm, ops.mhc_pre.default) == 1 and count_ops(gm, ops.mhc_predict.default) == 0


def test_shared_expert_activation_is_one_op(tiny, traced):
    """Each layer's shared expert runs its clamped SwiGLU as one swiglu node (not its seven
    casts, clamps, silu and product); the routed experts on this CPU path (the loop, each
    expert scaled by its routing weight) keep the reference's silu, one per expert per layer."""
    vb, *_ = traced
    layers, experts = len(tiny.layers), tiny.config.n_routed_experts
    for idx in (0, 1):
        g = vb.passed(idx)
        assert count_ops(g, ops.swiglu.default) == layers == 10
        assert count_ops(g, torch.ops.aten.silu.default) == layers * experts


def test_p1_fuses_each_ratio2_compressor(tiny, traced):
    """Per ratio-2 Full layer of the plan: the projection pair, the gather from the state ring
    and the pooling + RMSNorm become one fused_ratio2_compressor, and after defunctionalize
    fuse_ratio2_state_write folds the (separate, later) state write into it:
    fused_ratio2_compressor_update, placed where the write was."""
    vb, *_ = traced
    plan = v41graph.build_layer_plan(tiny.config)
    ratio2_full = sum(1 for r in plan if r.mode == "full" and r.ratio == 2)
    assert ratio2_full == sum(1 for b in tiny.layers if b.role.mode == "full" and b.role.ratio == 2) == 2
    aten = torch.ops.aten
    no_fold = tuple(p for p in ALL if p != "fuse_ratio2_state_write")
    for idx in (0, 1):
        g = vb.passed(idx)
        assert count_ops(g, ops.fused_ratio2_compressor_update.default) == ratio2_full
        assert count_ops(g, ops.fused_ratio2_compressor.default, ops.fused_pool_rmsnorm.default) == 0
        read = vb.passed(idx, no_fold)
        assert count_ops(read, ops.fused_ratio2_compressor.default) == ratio2_full
        assert count_ops(read, ops.fused_pool_rmsnorm.default) == 0        # every pool took its projections
        # the fold removes exactly one state write per ratio-2 compressor (Engram's history
        # writes stay)
        assert count_ops(read, ops.state_write.default) - count_ops(g, ops.state_write.default) == ratio2_full
        # without the pool fusion (or without P1) nothing of it: softmax and the mm pair still there
        for passes in (tuple(p for p in ALL if p != "fuse_pool_rmsnorm"), tuple(resolve_passes(disable=("P1",)))):
            plain = vb.passed(idx, passes)
            assert count_ops(plain, ops.fused_ratio2_compressor.default, ops.fused_pool_rmsnorm.default,
                          ops.fused_ratio2_compressor_update.default) == 0
            assert count_ops(plain, aten._softmax.default) - count_ops(g, aten._softmax.default) == ratio2_full
        plain = vb.passed(idx, tuple(p for p in ALL if p != "fuse_pool_rmsnorm"))
        assert count_ops(plain, aten.mm.default) - count_ops(g, aten.mm.default) == 2 * ratio2_full
        gathers = (aten.index.Tensor, aten.index_select.default)
        assert count_ops(plain, *gathers) - count_ops(g, *gathers) == ratio2_full
        assert count_ops(plain, ops.state_write.default) == count_ops(read, ops.state_write.default)
        order = {n: i for i, n in enumerate(read.graph.nodes)}
        for n in read.graph.nodes:
            if n.op == "call_function" and n.target == ops.fused_ratio2_compressor.default:
                (rows,) = [u for u in n.users if u.args[1] == 1]
                (write,) = rows.users
                call = dict(zip(("dst", "rows", "values"), write.args), **write.kwargs)
                assert write.target == ops.state_write.default and call["values"] is rows
                assert call["dst"] is n.args[3] and order[write] > order[n]   # reads the old ring


def test_p1_count_matches_ratio1_compressors_in_checkpoint_format():
    """With the released formats in reference numerics (FP8 wkv / wq_a run as blockwise FP8
    GEMMs, not Linear), the pairs left are the dense ones: the ratio-1 compressor and the
    indexer's wk -> k_norm in each Full layer. Three layers (window, Full ratio 2, Full ratio 1)
    hold the cases that add fusions (Reuse and Reindex layers, which add none, are left out:
    the blockwise GEMMs make the whole tiny model's trace cost ~3 CPU minutes)."""
    cfg = three_layer_config(weight_format="checkpoint")
    model = init_random_(V41Model(cfg), seed=2).set_numerics("reference").eval().requires_grad_(False)
    vb = PassHarness(ALL)
    fn = vb.compile(model, dynamic=False)
    s = CompiledSession(model, fn, 1, 32, block_size=16)
    s.prefill(torch.randint(0, 256, (1, 5)))
    g = vb.passed(0, ("cleanup", "fuse_wkv_rmsnorm", "stream_check"))
    plan = v41graph.build_layer_plan(cfg)
    ratio1 = sum(1 for r in plan if r.mode == "full" and r.ratio == 1)
    full = sum(1 for r in plan if r.mode == "full")
    assert (ratio1, full) == (1, 2)
    assert count_ops(g, ops.fused_wkv_rmsnorm.default) == ratio1 + full


def test_defunctionalize_leaves_no_cache_copies(tiny, traced):
    vb, *_ = traced
    for idx in (0, 1):
        g = vb.passed(idx)
        assert count_ops(g, torch.ops.higher_order.auto_functionalized_v2) == 0
        writes = count_ops(g, ops.window_kv_write.default, ops.global_kv_write.default,
                        ops.index_k_write.default, ops.state_write.default,
                        ops.fused_ratio2_compressor_update.default)
        # window x10, global x3, index x3, r2 state x2 (folded into the fused op), Engram history
        assert writes == 10 + 3 + 3 + 2 + 1
        caches = {n for n in g.graph.nodes if n.op == "placeholder" and n.meta["val"].dtype == torch.uint8
                  and n.meta["val"].dim() == 3}
        for n in g.graph.nodes:
            if n.op == "call_function" and n.target in (torch.ops.aten.copy_.default, torch.ops.aten.clone.default):
                assert not set(n.all_input_nodes) & caches, f"{n.name} copies a cache"


def test_p4_gathers_before_block0_on_aux_stream(traced):
    vb, *_ = traced
    g = vb.passed(1)
    nodes = list(g.graph.nodes)
    gathers = [i for i, n in enumerate(nodes) if n.target == ops.engram_gather.default]
    assert len(gathers) == 2
    first_block0 = min(i for i, n in enumerate(nodes)
                       if n.op == "call_function" and module_path(n).startswith("layers.0.")
                       and n.target == torch.ops.aten.mm.default)
    assert max(gathers) < first_block0
    assert all(nodes[i].meta[STREAM_KEY] == "aux:engram" for i in gathers)


def test_p6_indexer_and_window_writes_on_aux_stream(tiny, traced):
    vb, *_ = traced
    g = vb.passed(1)
    labelled = {n.target: [] for n in g.graph.nodes if n.op == "call_function"}
    for n in g.graph.nodes:
        if n.op == "call_function":
            labelled[n.target].append(n.meta[STREAM_KEY])
    # Full layers score with indexer_topk, Reindex layers with indexer_topk_candidates
    plan = v41graph.build_layer_plan(tiny.config)
    n_full = sum(r.mode == "full" for r in plan)
    n_reindex = sum(r.mode == "reindex" for r in plan)
    assert (n_full, n_reindex) == (3, 1)               # tiny: Full 2, 4, 6; Reindex 8
    assert len(labelled[ops.indexer_topk.default]) == n_full
    assert len(labelled[ops.indexer_topk_candidates.default]) == n_reindex
    assert set(labelled[ops.indexer_topk.default]) == {"aux:select"}
    assert set(labelled[ops.indexer_topk_candidates.default]) == {"aux:select"}
    assert set(labelled[ops.index_k_write.default]) == {"aux:select"}
    assert len(labelled[ops.window_kv_write.default]) == 10
    assert set(labelled[ops.window_kv_write.default]) == {"aux:window"}
    assert set(labelled[ops.sparse_attention.default]) == {"main"}
    assert set(labelled[ops.global_kv_write.default]) == {"main"}
    # the indexer's own query projection moved with it: some mm runs on the side stream
    assert "aux:select" in labelled[torch.ops.aten.mm.default]
    # every join is waited on by the main stream
    records = [n.args[0] for n in g.graph.nodes if n.target == ops.event_record.default]
    waits = [n.args[0] for n in g.graph.nodes if n.target == ops.event_wait.default]
    joins = [t for t in records if t.startswith("join:")]
    assert len(joins) == n_full + n_reindex + 10 + 1     # select per scoring layer, window x10, Engram
    assert set(joins) <= set(waits)


def test_p6_window_write_forks_after_the_ring_is_read(traced):
    """sparse_attention reads the FP8 window ring in place and the window write (side stream)
    overwrites it: every write's fork comes after each read of that ring, and nothing else
    reads a ring (no dequantized pool)."""
    from v41graph.custom_ops.streams import STREAM_OPS
    vb, *_ = traced
    for idx in (0, 1):
        g = vb.passed(idx)
        nodes = list(g.graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        writes = [n for n in nodes if n.target == ops.window_kv_write.default]
        assert len(writes) == 10
        for w in writes:
            fork = next(n for n in nodes if n.target == ops.event_record.default
                        and n.args[0] == f"fork:{w.meta['side_tag']}")
            for ring in (w.kwargs["cache"], w.kwargs["scale"]):
                assert ring.op == "placeholder"
                readers = [u for u in ring.users if u is not w and u.target not in STREAM_OPS]
                assert readers and all(u.target == ops.sparse_attention.default for u in readers), \
                    [u.target for u in readers]
                assert all(order[u] < order[fork] < order[w] for u in readers), w.name


def test_stream_check_rejects_unjoined_work(traced):
    from v41graph.passes.stream_check import StreamCheck
    vb, *_ = traced
    g = copy_graph_module(vb.passed(1))
    wait = next(n for n in g.graph.nodes if n.target == ops.event_wait.default and n.args[0].startswith("join:"))
    g.graph.erase_node(wait)
    with pytest.raises(ValueError, match="never joined"):
        StreamCheck()(g)


def test_inductor_segment_partition_of_the_tiny_graph(tiny, traced):
    """compiler/inductor_segments.py without Inductor (CPU codegen would cost minutes here): on the
    final prefill and decode graphs no segment holds a stream op, a write or a view of a written
    cache, each runs on one stream, every node lands in exactly one place, and the split graph
    (segments run as plain GraphModules by our executor) gives bit-identical logits over a
    prefill + 3 decode steps."""
    import functools
    from v41graph.custom_ops.streams import STREAM_OPS
    from v41graph.compiler.inductor_segments import (MIN_COMPUTE_NODES, find_segments, lower_inductor_segments)

    def written_args(n):   # by name or by position, as the graph passes them
        schema = getattr(n.target, "_schema", None)
        return [n.kwargs[a.name] if a.name in n.kwargs else n.args[i]
                for i, a in enumerate(schema.arguments if schema else ())
                if a.alias_info is not None and a.alias_info.is_write]

    vb, *_ = traced
    for idx in (0, 1):
        g = copy_graph_module(vb.passed(idx))
        originals = list(g.graph.nodes)
        written = {w for n in originals for w in written_args(n)}
        assert len(written) >= 10 and all(w.op == "placeholder" for w in written)   # the caches
        segments = find_segments(g)
        members = [n for seg in segments for n in seg.nodes]
        assert len(members) == len(set(members))                     # no node in two segments
        for seg in segments:
            for n in seg.nodes:
                assert n.op == "call_function" and n.target not in STREAM_OPS and not written_args(n), n.name
                # a getitem read after a join joins its producer's segment (it launches nothing)
                assert n.meta[STREAM_KEY] == seg.stream or n.args[0] in seg.nodes, n.name
                if getattr(n.target, "is_view", False):
                    assert not set(n.all_input_nodes) & written, f"{n.name} views a written cache"
        assert {seg.stream for seg in segments} > {"main"}            # side-stream segments too
        split = [seg for seg in segments if seg.compute_nodes() >= MIN_COMPUTE_NODES]
        report = lower_inductor_segments(g, compile_segments=False)
        assert (report["found"], report["split"], report["compiled"]) == (len(segments), len(split), 0)
        calls = [n for n in g.graph.nodes if n.op == "call_module"]
        assert len(calls) == len(split) > 0
        remaining = set(g.graph.nodes)
        moved = {n for seg in split for n in seg.nodes}
        kept = [n for n in originals if n in remaining]
        assert moved.isdisjoint(kept) and len(kept) + len(moved) == len(originals)
        for call, seg in zip(calls, split):
            sub = g.get_submodule(call.target)
            assert [n.target for n in sub.graph.nodes if n.op == "call_function"] == [n.target for n in seg.nodes]
            assert call.meta[STREAM_KEY] == seg.stream

    split_graphs = functools.partial(lower_inductor_segments, compile_segments=False)
    plain, split = _logits_with_lowering(tiny, traced, None), _logits_with_lowering(tiny, traced, split_graphs)
    ran = [g for (_, _, lower), g in vb.variants.items() if lower is split_graphs]   # made by a call
    assert len(ran) == 2 and all(any(n.op == "call_module" for n in g.graph.nodes) for g in ran)
    for step, (a, b) in enumerate(zip(plain, split)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


# ---------------------------------------------------------------------------- API
def test_unknown_pass_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'"):
        resolve_passes(disable=["fuse_everything"])
    with pytest.raises(ValueError, match="cannot be switched off"):
        resolve_passes(disable=["stream_check"])
    assert resolve_passes(disable=["P1", "P6"]) == ["cleanup", "fuse_rmsnorm", "defunctionalize", "hoist_engram",
                                                    "overlap_collectives", "stream_check"]


def _eager_vs_compiled_decodes(tiny, compiled, n_seqs: int, seed: int, steps: int):
    """A fresh eager and compiled Session (3 slots, same shapes), the same prompts, then
    `steps` greedy decode steps; logits must agree at every step. Returns the compiled session
    and how many graphs its decode steps compiled."""
    eager, comp = Session(tiny, 3, 48, block_size=16), Session(compiled, 3, 48, block_size=16)
    prompt = torch.randint(0, 256, (n_seqs, 9), generator=torch.Generator().manual_seed(seed))
    a, b = eager.prefill(prompt), comp.prefill(prompt)
    assert torch.allclose(a, b, atol=ATOL, rtol=0)
    graphs = compiled.pass_manager.graph_index
    for _ in range(steps):
        nxt = a.argmax(-1, keepdim=True)
        a, b = eager.decode(nxt), comp.decode(nxt)
        assert torch.allclose(a, b, atol=ATOL, rtol=0)
    return comp, compiled.pass_manager.graph_index - graphs


def test_set_passes_switches_without_tracing_again(small):
    """set_passes re-runs the kept post-AOT graphs through another pass list: no new trace,
    the switched-off fusions are gone from the running graph, and results still match eager;
    switching back brings them back."""
    # share_decode_graph=True: the prefill and the decode bucket trace a graph each, so the
    # switch is seen on two graphs
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(4,), share_decode_graph=True)
    _eager_vs_compiled_decodes(small, compiled, 3, 12, 2)
    traced = len(compiled.traced)
    assert traced == 2                                           # prefill + decode
    fused = [count_ops(g.current, ops.fused_wkv_rmsnorm.default) for g in compiled.traced]
    assert fused == [_expected_linear_rmsnorm_pairs(small)] * 2
    compiled.set_passes(disable=("P1", "P6"))
    _, new_graphs = _eager_vs_compiled_decodes(small, compiled, 3, 13, 2)
    assert new_graphs == 0 and len(compiled.traced) == traced
    assert [count_ops(g.current, ops.fused_wkv_rmsnorm.default) for g in compiled.traced] == [0, 0]
    assert all(count_ops(g.current, ops.stream_enter.default) > 0 for g in compiled.traced)   # P4 stays
    assert compiled.pass_manager.names == resolve_passes(disable=("P1", "P6"))
    compiled.set_passes()
    assert [count_ops(g.current, ops.fused_wkv_rmsnorm.default) for g in compiled.traced] == fused


def test_compile_api_end_to_end_with_padding_and_errors(small):
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(2, 4))
    comp, _ = _eager_vs_compiled_decodes(small, compiled, 3, 9, 3)   # 3 sequences padded into bucket 4
    # A second session (other caches) on the same compiled model gets its own decode graph.
    _eager_vs_compiled_decodes(small, compiled, 3, 10, 2)
    # Buckets >= 2 share one symbolic-batch graph: two sequences (bucket 2) on a third session
    # of the same shapes compile no new decode graph and still match eager.
    comp3, decode_graphs = _eager_vs_compiled_decodes(small, compiled, 2, 11, 2)
    assert (2, id(comp3.caches), comp3.max_blocks) in compiled._decode
    assert decode_graphs == 0
    records = compiled.pass_manager.records[-1]
    assert [r["pass"] for r in records] == list(ALL)
    with pytest.raises(ValueError, match="larger than the largest captured bucket 4"):
        compiled.bucket_for(5)
    with pytest.raises(ValueError, match="backend must be one of"):
        v41graph.compile(small, backend="tpu")
    with pytest.raises(ValueError, match="is on meta"):
        compiled(torch.zeros(1, dtype=torch.long, device="meta"), torch.zeros(1, dtype=torch.long),
                 comp.caches, None)


def test_npu_backend_missing_stack_is_a_clear_error(tiny):
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="npu backend needs the Ascend stack"):
        v41graph.compile(tiny, backend="npu")


# The RMSNorm fusions on norms that are not V4.1's (generality, near misses): test_norm_fusion.py


def test_captured_decode_hands_out_copies(tiny, monkeypatch):
    """A replay overwrites a captured graph's output buffer, so a captured decode step must
    return a copy (what an eager call gives): a caller's step-t logits must survive step t+1.
    Simulated on CPU: DecodeGraph.run returns one persistent buffer and claims a CUDA graph."""
    from v41graph.model.kv_cache import ModelCaches
    from v41graph.model.metadata import build_metadata
    from v41graph.compiler.compiled_model import DecodeGraph
    buffer = torch.zeros(4, tiny.config.vocab_size)

    def fake_run(self, input_ids, positions, meta):
        self.cuda_graph = object()
        buffer.fill_(float(input_ids[0]))       # "replay": new contents, same storage
        return buffer

    monkeypatch.setattr(DecodeGraph, "run", fake_run)
    compiled = v41graph.compile(tiny, backend="cpu", batch_sizes=(4,))
    caches = ModelCaches.allocate(tiny.config, 5, 8, 16)
    meta = build_metadata([0, 1], [5, 5], [1, 1], [[0], [1]], 1, "cpu")
    first = compiled.decode(torch.tensor([1, 1]), torch.tensor([5, 5]), caches, meta)
    second = compiled.decode(torch.tensor([2, 2]), torch.tensor([5, 5]), caches, meta)
    assert first.shape == (2, tiny.config.vocab_size)
    assert first.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()
    assert torch.all(first == 1) and torch.all(second == 2)


def test_compile_raises_dynamo_recompile_limit(tiny):
    """Each CompiledModel adds several Dynamo entries for V41Model.forward; with the default
    limit (8) a second compile of the model in one process failed hard (seen on the H200 in the
    third compiled-model test of a module). Patched with the config's own context manager:
    pytest >= 9's monkeypatch.undo deletes a config key it did not find in the module's
    __dict__, which hides the key for every later test."""
    before = torch._dynamo.config.recompile_limit
    with torch._dynamo.config.patch(recompile_limit=8):
        v41graph.compile(tiny, backend="cpu", batch_sizes=(1,))
        assert torch._dynamo.config.recompile_limit >= 64
    assert torch._dynamo.config.recompile_limit == before   # restored, and still readable


def test_recompile_limit_raised_even_when_the_key_is_hidden():
    """A key hidden by a `del` (what monkeypatch.undo does) reads as missing; compiling must still
    raise the limit instead of failing with AttributeError (the fresh-clone failure of 33 tests)."""
    from v41graph.compiler.backend import raise_dynamo_recompile_limit
    config = torch._dynamo.config
    before = config.recompile_limit
    try:
        delattr(config, "recompile_limit")
        assert not hasattr(config, "recompile_limit")
        raise_dynamo_recompile_limit(before + 1)
        assert config.recompile_limit == before + 1
        raise_dynamo_recompile_limit(1)           # never lowers it
        assert config.recompile_limit == before + 1
    finally:
        config.recompile_limit = before


def test_share_decode_graph_switch(tiny):
    """Buckets >= 2 mark their persistent buffers' batch dimension dynamic (one shared trace);
    bucket 1 and share_decode_graph=False keep fully static buffers; "all" marks every bucket,
    bucket 1 included, with an unbacked size."""
    from v41graph.model.kv_cache import ModelCaches
    from v41graph.compiler.compiled_model import DecodeGraph
    caches = ModelCaches.allocate(tiny.config, 5, 8, 16)
    for share, bucket, want in ((True, 4, True), (True, 1, False), (False, 4, False), ("all", 1, True)):
        compiled = v41graph.compile(tiny, backend="cpu", batch_sizes=(1, 4), share_decode_graph=share)
        graph = DecodeGraph(compiled, bucket, caches, 3)
        assert graph.shared is want
        marked = [0 in getattr(t, "_dynamo_dynamic_indices", set()) or 0 in getattr(t, "_dynamo_unbacked_indices", set())
                  for t in (graph.input_ids, graph.positions, graph.meta.block_table)]
        assert marked == [want] * 3
    with pytest.raises(ValueError, match="share_decode_graph must be True, False or"):
        v41graph.compile(tiny, backend="cpu", share_decode_graph="yes")


def test_shared_decode_graph_block_table_width_is_symbolic(small):
    """Sessions whose block tables have another width (max_seq_len 48 vs 96: 3 vs 6 blocks) over
    caches of one size reuse the shared decode trace (a new capture, no new trace) and match
    eager. (Caches of another size would retrace: their shapes are static.) share_decode_graph
    =True, so that the first decode step traces the shared graph (with the default "all" the
    first prefill traces it: test_share_all_prefill_first_traces_the_one_graph)."""
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(4,), share_decode_graph=True)
    decode_graphs = []
    for max_len, seed in ((48, 30), (96, 31)):
        eager, comp = (Session(m, 3, max_len, block_size=16, num_blocks=24) for m in (small, compiled))
        prompt = torch.randint(0, 256, (3, 9), generator=torch.Generator().manual_seed(seed))
        a, b = eager.prefill(prompt), comp.prefill(prompt)
        before = compiled.pass_manager.graph_index
        for _ in range(2):
            nxt = a.argmax(-1, keepdim=True)
            a, b = eager.decode(nxt), comp.decode(nxt)
            assert torch.allclose(a, b, atol=ATOL, rtol=0)
        decode_graphs.append(compiled.pass_manager.graph_index - before)
    assert decode_graphs == [1, 0]
    assert sorted(key[2] for key in compiled._decode) == [3, 6]


def test_share_all_buckets_one_decode_trace(small):
    """share_decode_graph="all": buckets 1, 2 and 4 run one traced decode graph, and each
    matches eager (1, 2 and 3 sequences)."""
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(1, 2, 4), share_decode_graph="all")
    first = Session(compiled, 3, 48, block_size=16)     # the caches' shapes of the sessions below
    compiled.warmup(first.caches, first.max_blocks)      # decode before any prefill
    assert len(compiled.traced) == 1
    decode_graphs = 0
    for n_seqs in (1, 2, 3):
        _, new = _eager_vs_compiled_decodes(small, compiled, n_seqs, 20 + n_seqs, 2)
        decode_graphs += new
    assert decode_graphs == 0 and len(compiled.traced) == 1      # the prefills ran it too
    assert {key[0] for key in compiled._decode} >= {1, 2, 4}


def test_share_all_prefill_first_traces_the_one_graph(small):
    """The default share_decode_graph="all" when a prefill comes before any decode step (a
    serving engine's order): the prefill traces the graph, and decode steps of buckets 1 and 4
    (1 and 3 sequences) and the second prefill run it without tracing again; every logit
    matches eager. (share_decode_graph=True would trace four graphs in this order: the
    one-sequence prefill's, bucket 1's static one, the three-sequence prefill's and the shared
    one of buckets >= 2; not run here, it is most of this test's time.)"""
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(1, 4))
    for n_seqs in (1, 3):
        _eager_vs_compiled_decodes(small, compiled, n_seqs, 40 + n_seqs, 2)
    assert len(compiled.traced) == 1
    assert compiled.notes["prefill"] == "traced its own graph (no decode graph had been traced before it)"


# ---------------------------------------------------------------------------- P1, ratio 2
class _Ratio2(torch.nn.Module):
    """The ratio-2 compressor's read side as attention.Compressor spells it, with switches for
    near misses: a projection output with one more user ("extra_user", refused by the pool
    fusion) and a read of the state ring between the fused read and the ring write
    ("peek_state", refused by the state-write fold only)."""

    def __init__(self, extra_user: bool, peek_state: bool = False):
        super().__init__()
        from v41graph.model.layers import Linear, RMSNorm
        self.extra_user, self.peek_state = extra_user, peek_state
        self.wkv = Linear(24, 8, dtype=torch.float32)
        self.wgate = Linear(24, 8, dtype=torch.float32)
        self.norm = RMSNorm(8, 1e-6)
        for p in (self.wkv.weight, self.wgate.weight, self.norm.weight):
            torch.nn.init.normal_(p)

    def forward(self, x, state, member_rows, state_rows):
        xf = x.float()
        a = self.wkv(xf)
        rows = torch.cat([a, self.wgate(xf)], dim=-1)
        pool = torch.cat([state.view(-1, state.shape[-1]), rows], dim=0)
        member = pool.index_select(0, member_rows).view(x.shape[0], 2, -1)
        kv, score = member.chunk(2, dim=-1)
        latent = (kv * score.softmax(dim=1)).sum(dim=1)
        peek = state[0, 0, :1].clone() if self.peek_state else None
        ops.state_write(state, state_rows, rows)
        out = self.norm(latent.to(x.dtype))
        if peek is not None:
            out = out + peek.to(x.dtype)
        return out + a.sum(-1, keepdim=True).to(x.dtype) if self.extra_user else out


@pytest.mark.parametrize("extra_user,peek_state,dynamic", [(False, False, False), (True, False, False),
                                                          (False, True, False), (False, False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_p1_ratio2_compressor_fusion_and_near_miss(extra_user, peek_state, dynamic, dtype):
    """Fused, the state write folded in (also with a symbolic token count, as in the shared
    decode graph), and refused."""
    torch.manual_seed(0)
    m = _Ratio2(extra_user, peek_state).eval().requires_grad_(False)
    x = torch.randn(5, 24).to(dtype)
    state = torch.randn(3, 4, 16)
    member_rows = torch.randint(0, 3 * 4 + 5, (10,))
    state_rows = torch.tensor([0, -1, 5, 7, -1])
    h = PassHarness(["cleanup", "fuse_pool_rmsnorm", "defunctionalize", "fuse_ratio2_state_write"])
    s_eager, s_comp = state.clone(), state.clone()
    want = m(x, s_eager, member_rows, state_rows)
    if dynamic:   # the token count symbolic, as in the shared decode graph (batch dims marked)
        for t in (x, member_rows, state_rows):
            torch._dynamo.mark_dynamic(t, 0)
    got = h.compile(m, dynamic=False)(x, s_comp, member_rows, state_rows)
    assert torch.equal(got, want) and torch.equal(s_comp, s_eager)
    g = h.after(0)
    fused = 0 if extra_user else 1
    folded = fused if not peek_state else 0
    assert count_ops(g, ops.fused_ratio2_compressor_update.default) == folded
    assert count_ops(g, ops.fused_ratio2_compressor.default) == fused - folded
    assert count_ops(g, ops.fused_pool_rmsnorm.default) == 1 - fused      # refused: plain pool fusion
    assert count_ops(g, torch.ops.aten.mm.default) == 2 * (1 - fused)
    # the state write still happens in place after the fused read (defunctionalized), unless folded
    assert count_ops(g, torch.ops.higher_order.auto_functionalized_v2) == 0
    h.check_before_ops([torch.ops.higher_order.auto_functionalized_v2])
    assert count_ops(g, ops.state_write.default) == 1 - folded


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_ratio2_compressor_reference_equals_model_code(dtype):
    """The op's reference (what every backend falls back to) is bit-identical to the model's
    Compressor.forward: latent and the rows it writes to the state ring, at every call of
    every ratio-2 compressor over a prefill and 4 decode steps; the op leaves the state alone."""
    from v41graph.model.attention import COMPRESSOR_RING, Compressor
    cfg = v41graph.V41Config.tiny(torch_dtype=dtype)
    model = init_random_(V41Model(cfg), seed=3).eval().requires_grad_(False)
    checked = []

    def pre(mod, args):
        x, ctx, lid = args
        pos = ctx.positions
        member_pos = pos.unsqueeze(-1) - torch.arange(mod.ratio - 1, -1, -1, device=pos.device)
        member_rows = ctx.fresh_or_ring_rows(member_pos.clamp_min(0), COMPRESSOR_RING).flatten()
        state = ctx.caches.compressor_state[lid]
        before = state.clone()
        mod._fused = ops.fused_ratio2_compressor(x, mod.wkv.weight, mod.wgate.weight, state, member_rows,
                                                 mod.norm.weight, mod.norm.eps, x.dtype)
        assert torch.equal(state, before)
        xf = x.float()
        mod._rows = torch.cat([mod.wkv(xf), mod.wgate(xf)], dim=-1)

    def post(mod, args, out):
        latent, rows = mod._fused
        assert latent.dtype == out[0].dtype == args[0].dtype
        assert torch.equal(latent, out[0]) and torch.equal(rows, mod._rows)
        checked.append(mod)

    mods = [m for m in model.modules() if isinstance(m, Compressor) and m.ratio == 2]
    assert len(mods) == 2
    for m in mods:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    s = Session(model, 2, 64, block_size=16)
    logits = s.prefill(torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1)))
    for _ in range(4):
        logits = s.decode(logits.argmax(-1, keepdim=True))
    assert len(checked) == 2 * 5


def test_timings_say_where_compile_time_went(small):
    """CompiledModel.timings over buckets that share one trace: the first bucket traced
    (trace_s > 0, our passes part of it), a second prepared bucket did not trace again (trace_s
    unchanged, first_run_s grew by its own step), and a bucket first used by a plain decode step
    (after a prefill) is timed too and does not trace again either. (That last part also
    checks that warm-up traces under no_grad: a trace made with grad mode on fails Dynamo's
    grad-mode guard at every later step, which then traces the model again.)"""
    compiled = v41graph.compile(small, backend="cpu", batch_sizes=(2, 4, 8), share_decode_graph="all")
    s = Session(compiled, 8, 64, block_size=16)
    compiled._graph_for(2, s.caches, s.max_blocks, prepare=True)
    first = dict(compiled.timings)
    assert set(first) == {"passes_s", "lower_s", "trace_s", "first_run_s"}
    assert 0 < first["passes_s"] < first["trace_s"] and first["first_run_s"] > 0
    compiled._graph_for(4, s.caches, s.max_blocks, prepare=True)
    second = dict(compiled.timings)
    assert second["trace_s"] == first["trace_s"] and second["passes_s"] == first["passes_s"]
    assert second["first_run_s"] > first["first_run_s"]
    graphs = len(compiled.traced)
    logits = s.prefill(torch.randint(0, 256, (5, 6), generator=torch.Generator().manual_seed(2)))
    after_prefill = dict(compiled.timings)
    # a prefill graph, if one was traced, counts in passes_s but not in the decode times
    assert (after_prefill["passes_s"] > second["passes_s"]) == (len(compiled.traced) > graphs)
    assert after_prefill["first_run_s"] == second["first_run_s"]
    graphs = len(compiled.traced)
    s.decode(logits.argmax(-1, keepdim=True))                         # 5 sequences: bucket 8
    third = compiled.timings
    assert len(compiled.traced) == graphs and (8, id(s.caches), s.max_blocks) in compiled._decode
    assert set(third) == set(first) and third["trace_s"] == first["trace_s"]
    assert third["first_run_s"] > after_prefill["first_run_s"]


def test_bench_trace_counts_exact_repeats_only():
    """scripts/bench_trace.py --duplicates on a hand-made aten graph: the repeated add and the
    view of it count (the view's input is a repeat too), the random op, the in-place op and an
    add of another constant do not."""
    from torch.fx.experimental.proxy_tensor import make_fx
    bench_trace = load_script("bench_trace")

    def f(x):
        a, b = x + 1, x + 1                              # b repeats a
        av, bv = a.view(-1), b.view(-1)                  # bv repeats av (b counts as a)
        r1, r2 = torch.rand_like(x), torch.rand_like(x)  # random: never the same
        c = x + 2                                        # another constant
        y = x.clone()
        y.add_(1)                                        # in place
        y.add_(1)
        return av, bv, r1, r2, c, y

    gm = make_fx(f)(torch.randn(2, 3))
    found = bench_trace.duplicate_computations(gm)
    assert found == {("aten.add.Tensor", False): 1, ("aten.view.default", True): 1}, found


def test_bench_trace_groups_the_reuse_layers_as_one_op_sequence(traced):
    """scripts/bench_trace.py --roles on the tiny prefill graph: the Reuse layers (3, 5, 7, 9 in
    tiny()'s plan) trace one op sequence; every other layer has its own (window 0 and 1, Full 2
    and 4, the candidate source 6, Reindex 8); only the source layers feed later, non-adjacent
    layers."""
    bench_trace = load_script("bench_trace")
    vb, _, _ = traced
    roles, cross, outside = bench_trace.layer_roles(vb.traced[0].untouched)
    assert sorted(roles.values()) == [[0], [1], [2], [3, 5, 7, 9], [4], [6], [8]]
    assert outside > 0 and {a for a, _ in cross} <= {0, 2, 4, 6}
