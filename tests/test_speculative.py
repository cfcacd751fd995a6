"""DSpark speculative decoding in the engine (v41graph.runtime.speculative) on tiny() (fp32, dense, CPU).

Greedy equality with the plain engine relies on the verify chunks' logits agreeing with the
one-token decodes' to ~1e-5 (see test_engine.py / test_model_consistency.py); the prompts
below have no near-tie. Drafts come from
  * a random-weight DSpark head (almost every draft rejected: rollback on nearly every step),
  * a zero-weight head (forced rejection),
  * an "oracle" that proposes the plain engine's own continuation with some drafts corrupted
    (partial acceptance: accepted prefixes, rejected suffixes, full acceptance + bonus).
The last section runs the verify steps through a v41graph.compile()d model (one trace for the
module, ~30-40 s on a 2-core CPU), with SpecConfig(step="eager"): this module tests the
per-request reference decoder; the static step (the default with a compiled model) has
tests/test_speculative_graph.py.
"""
from __future__ import annotations

import pytest
import torch

import v41graph
from v41graph.model.metadata import build_metadata, positions_of
from v41graph.compiler.backend import TracedGraph
from v41graph.model.dspark import DSparkHead
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams
from v41graph.runtime.speculative import SpecConfig, init_random_dspark_
from v41graph.runtime.speculative_graph import ReferenceDrafts

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16
MAX_SEQ = 96
N_NEW = 20


def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# lengths cross the window (8) and ratio-2 group boundaries (odd and even), incl. a 1-token prompt
PROMPTS = _prompts([5, 13, 40, 3, 21, 1])


def _engine(model, **kw):
    kw.setdefault("max_num_batched_tokens", 40)
    kw.setdefault("prefill_chunk_size", 16)
    return Engine(model, kw.pop("max_batch_size", 4), MAX_SEQ, block_size=BLOCK, **kw)


@pytest.fixture(scope="module")
def head(tiny_model):
    return init_random_dspark_(DSparkHead(tiny_model.config), seed=1).eval()


@pytest.fixture(scope="module")
def reference(tiny_model):
    outs = _engine(tiny_model).generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    return [o.token_ids for o in outs]


def _all_free(eng):
    return eng.num_free_blocks == eng.num_blocks and len(eng.free_slots) == eng.max_batch_size


def _oracle(eng, prompts, refs, k=5):
    """Draft function proposing the reference continuation, corrupting one draft on 2 of 3
    calls (so accepted prefixes of every length and full acceptance all occur)."""
    full = {tuple(p): p + r for p, r in zip(prompts, refs)}
    calls = [0]

    def draft(req, anchor, pos):
        seq = full[tuple(req.prompt)]
        d = list(seq[pos + 1: pos + 1 + k])
        d += [0] * (k - len(d))
        calls[0] += 1
        if calls[0] % 3:
            j = calls[0] % k
            d[j] = (d[j] + 1) % eng.config.vocab_size
        return d, None, torch.zeros(k)
    return draft


# =============================================================================== greedy equality
def test_greedy_identical_random_head(tiny_model, head, reference):
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=5), draft_head=head)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference
    assert eng.stats["spec_rejections"] > 0 and eng.stats["spec_verifies"] > 0
    assert _all_free(eng)


def test_greedy_identical_zero_head_forced_rejection(tiny_model, reference):
    zero = DSparkHead(tiny_model.config).eval()
    with torch.no_grad():
        for p in zero.parameters():
            p.zero_()
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=4), draft_head=zero)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference
    assert eng.stats["spec_rejections"] > 0
    assert _all_free(eng)


def test_greedy_identical_partial_acceptance(tiny_model, head, reference):
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=5), draft_head=head)
    eng.spec._draft = _oracle(eng, PROMPTS, reference)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference
    s = eng.stats
    assert s["spec_rejections"] > 0 and s["spec_accepted"] > s["spec_verifies"]
    assert s["spec_rejections"] < s["spec_verifies"]            # some fully accepted (+ bonus)
    assert eng.spec.acceptance_length > 2.0
    assert _all_free(eng)


def test_rollback_is_needed(tiny_model, head, reference):
    """Sanity check of the tests above: without the rollback, outputs change."""
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=5), draft_head=head)
    eng.spec._draft = _oracle(eng, PROMPTS, reference)
    eng.spec._roll_back_rings = eng.spec._roll_back_history = lambda *a: None   # no rollback
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] != reference


def test_confidence_schedule_and_budget(tiny_model, head, reference):
    # a tight budget: 4 decodes x (1 + 5) > 12, so verify lengths are cut by the scheduler
    eng = _engine(tiny_model, max_num_batched_tokens=12, prefill_chunk_size=8,
                  speculative=SpecConfig(num_draft=5, schedule="confidence", token_cost=0.0),
                  draft_head=head)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference
    assert _all_free(eng)


def test_stop_ids_with_speculation(tiny_model, head, reference):
    ref = reference[2]
    stop = ref[6]
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=5), draft_head=head)
    eng.spec._draft = _oracle(eng, PROMPTS, reference)
    out = eng.generate([PROMPTS[2]], SamplingParams(max_tokens=N_NEW, stop_ids=(stop,)))[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    assert _all_free(eng)


# =============================================================================== cache state
def _slot_state(eng, slot):
    c = eng.caches
    return ([t[slot].clone() for t in c.window_kv], [t[slot].clone() for t in c.window_scale],
            {l: t[slot].clone() for l, t in c.compressor_state.items()},
            c.engram_history[slot].clone())


@pytest.mark.parametrize("step", ["eager", "static"])
def test_caches_match_plain_engine_after_every_step(tiny_model, head, step):
    """For one request, after every speculative step the window rings, compressor rings and
    Engram history of its slot equal the plain engine's at the same cached length; for the
    reference decoder (eager, oracle drafts) and the static step (speculative_graph.py,
    ReferenceDrafts at 60 %): the rollback, checked directly.
    (Full prefill: the prefill mode is beside the point here, and this prompt's continuation
    after a replay prefill hits an FP8 rounding flip that moves a compressor ring row of the
    one-token decodes by ~1e-3 against the 6-token verify chunks, without speculation too.)"""
    prompt = PROMPTS[4]
    ref = _engine(tiny_model, max_batch_size=1, prefill_mode="full").generate(
        [prompt], SamplingParams(max_tokens=N_NEW))[0].token_ids
    plain = _engine(tiny_model, max_batch_size=1, prefill_mode="full")
    rid = plain.add_request(prompt, SamplingParams(max_tokens=N_NEW))
    states = {}
    while plain.has_unfinished():
        req = plain.requests[rid]
        plain.step()
        if req.status == "running":
            states[req.num_cached] = _slot_state(plain, req.slot)
    spec = _engine(tiny_model, max_batch_size=1, speculative=SpecConfig(num_draft=5, step=step),
                   draft_head=head, prefill_mode="full")
    if step == "eager":
        spec.spec._draft = _oracle(spec, [prompt], [ref])
    else:
        spec.spec.static.draft_override = ReferenceDrafts(spec, {tuple(prompt): prompt + ref}, 0.6)
    rid = spec.add_request(prompt, SamplingParams(max_tokens=N_NEW))
    compared = 0
    while spec.has_unfinished():
        req = spec.requests[rid]
        spec.step()
        if req.status != "running" or req.num_cached not in states:
            continue
        wkv, wsc, comp, hist = _slot_state(spec, req.slot)
        rkv, rsc, rcomp, rhist = states[req.num_cached]
        assert torch.equal(hist, rhist)
        for a, b in zip(wkv + wsc, rkv + rsc):
            assert (a != b).float().mean() < 0.01          # fp8 bytes: rounding flips only
        for l in comp:
            torch.testing.assert_close(comp[l], rcomp[l], atol=1e-4, rtol=1e-4)
        compared += 1
    assert spec.output(rid).token_ids == ref
    assert compared >= 3 and spec.stats["spec_rejections"] > 0
    assert (spec.stats["spec_static_steps"] > 0) == (step == "static")


# =============================================================================== sampling
def test_sampling_reproducible(tiny_model, head):
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=N_NEW, seed=s) for s in range(4)]

    def run():
        eng = _engine(tiny_model, speculative=SpecConfig(num_draft=5), draft_head=head)
        outs = [o.token_ids for o in eng.generate(PROMPTS[:4], params)]
        assert _all_free(eng)
        return outs
    a, b = run(), run()
    assert a == b and all(len(o) == N_NEW for o in a)


def test_sampling_batched_equals_alone(tiny_model, head):
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=10 + s) for s in range(3)]
    kw = dict(speculative=SpecConfig(num_draft=3), draft_head=head)
    batched = [o.token_ids for o in _engine(tiny_model, **kw).generate(PROMPTS[:3], params)]
    alone = [_engine(tiny_model, max_batch_size=1, **kw).generate([p], [sp])[0].token_ids
             for p, sp in zip(PROMPTS[:3], params)]
    assert batched == alone


def test_bad_config(tiny_model, head):
    with pytest.raises(ValueError):
        _engine(tiny_model, speculative=SpecConfig(num_draft=8), draft_head=head)   # > W - 1, > block
    with pytest.raises(ValueError):
        _engine(tiny_model, speculative=SpecConfig(num_draft=2))                     # no head


# =============================================================================== return_streams
def _prefill_call(model, prompts, **kw):
    """One all-logits prefill call of these prompts (slots 0.., fresh caches shaped as the
    engine's, so a compiled model sees the shapes of its engine steps)."""
    eng = _engine(model)
    lens = [len(p) for p in prompts]
    blocks = [list(range(i * eng.max_blocks, (i + 1) * eng.max_blocks)) for i in range(len(prompts))]
    meta = build_metadata(list(range(len(prompts))), [0] * len(prompts), lens, blocks, eng.max_blocks)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.int64)
    with torch.no_grad():
        return model(ids, positions_of(meta), eng.caches, meta, all_logits=True, **kw)


@pytest.mark.parametrize("replay", [False, True])
def test_return_streams_equal_debug(tiny_model, replay):
    """return_streams gives the tensors model.debug records (block_out.layer{i}), in the order
    asked for; without it the call returns the logits alone, as before."""
    prompts = [PROMPTS[2], PROMPTS[1]]               # 40 tokens (> window 8) and 13
    kw = {}
    if replay:   # the engine's floors: the decoder runs over each prompt's last window only
        w = tiny_model.config.sliding_window
        kw["decoder_replay"] = torch.tensor([max(0, len(p) - w) for p in prompts])
    layers = (8, 0, tiny_model.decoder_start, tiny_model.decoder_start - 1)
    tiny_model.debug = {}
    try:
        logits = _prefill_call(tiny_model, prompts, **kw)
        debug = tiny_model.debug
    finally:
        tiny_model.debug = None
    assert isinstance(logits, torch.Tensor)
    logits2, streams = _prefill_call(tiny_model, prompts, return_streams=layers, **kw)
    assert torch.equal(logits2, logits)
    assert len(streams) == len(layers)
    for i, s in zip(layers, streams):
        assert torch.equal(s, debug[f"block_out.layer{i}"]), i
    # replay: a layer before the decoder keeps every token, a decoder layer the replayed ones
    n = sum(len(p) for p in prompts)
    assert streams[1].shape[0] == n and (streams[2].shape[0] < n) == replay
    with pytest.raises(ValueError):
        _prefill_call(tiny_model, prompts, return_streams=(len(tiny_model.layers),))


# =============================================================================== compiled target
@pytest.fixture(scope="module")
def compiled(tiny_model):
    """One compiled model for these tests: its verify graph (all logits + DSpark's streams) is
    traced once, at its first call, and reused by every later test."""
    return v41graph.compile(tiny_model, backend="cpu", batch_sizes=(4,))


@pytest.fixture
def graph_calls(monkeypatch):
    """Outputs per call of every compiled graph our executor runs during the test."""
    calls = []
    run = TracedGraph.__call__

    def counting(self, *args):
        out = run(self, *args)
        calls.append(len(out))
        return out
    monkeypatch.setattr(TracedGraph, "__call__", counting)
    return calls


def _recording(fn, log):
    def draft(req, anchor, pos):
        d, q, c = fn(req, anchor, pos)
        log.append((req.request_id, pos, list(d)))
        return d, q, c
    return draft


def test_compiled_verify_streams_match_eager(tiny_model, compiled, graph_calls):
    targets = tuple(t - 1 for t in tiny_model.config.dspark_target_layer_ids)
    prompts = [PROMPTS[1], PROMPTS[4], PROMPTS[0]]
    ref_logits, ref_streams = _prefill_call(tiny_model, prompts, return_streams=targets)
    logits, streams = _prefill_call(compiled, prompts, return_streams=targets)
    assert graph_calls == [1 + len(targets)]          # ran our graph, streams as outputs
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for s, r in zip(streams, ref_streams):
        torch.testing.assert_close(s, r, atol=1e-5, rtol=1e-5)


def test_compiled_verify_greedy_identical_with_acceptance(tiny_model, compiled, head, reference,
                                                          graph_calls):
    """Oracle drafts (accepted prefixes, rejections, full acceptance): speculation through the
    compiled model commits the plain engine's tokens and accepts what eager speculation does;
    every step without a decoder-replay chunk ran the compiled graph."""
    stats, outs = [], []
    for model in (tiny_model, compiled):
        eng = _engine(model, speculative=SpecConfig(num_draft=5, step="eager"), draft_head=head)
        eng.spec._draft = _oracle(eng, PROMPTS, reference)
        outs.append([o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))])
        stats.append(eng.stats)
        assert _all_free(eng)
    eager, comp = stats
    assert outs[1] == reference and outs[0] == reference
    assert comp["spec_accepted"] > 0 and comp["spec_accepted"] == eager["spec_accepted"]
    assert comp["spec_verifies"] == eager["spec_verifies"]
    assert 0 < comp["replay_steps"] < comp["steps"]
    assert len(graph_calls) == comp["steps"] - comp["replay_steps"]


def test_compiled_verify_random_head_full_prefill(tiny_model, compiled, head, graph_calls):
    """The DSpark head drafting from the compiled model's streams: the same drafts as from the
    eager model's, the plain engine's tokens, and every step through the compiled graph."""
    ref = [o.token_ids for o in _engine(tiny_model, prefill_mode="full").generate(
        PROMPTS, SamplingParams(max_tokens=N_NEW))]
    drafts, outs = [], []
    for model in (tiny_model, compiled):
        eng = _engine(model, speculative=SpecConfig(num_draft=5, step="eager"), draft_head=head,
                      prefill_mode="full")
        log = []
        eng.spec._draft = _recording(eng.spec._draft, log)
        del graph_calls[:]
        outs.append([o.token_ids for o in eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))])
        drafts.append(log)
    assert outs[1] == ref and outs[0] == ref
    assert drafts[1] == drafts[0] and len(drafts[1]) > 20
    assert len(graph_calls) == eng.stats["steps"] > 0


def test_compiled_static_step(tiny_model, compiled, head, reference, graph_calls):
    """SpecConfig's default step ("auto") takes the static step (speculative_graph.py) with a
    compiled model: the plain engine's tokens with reference drafts at 70 %, and every step that
    is not a decoder-replay prefill ran our compiled graph (the static steps' verify too)."""
    eng = _engine(compiled, speculative=SpecConfig(num_draft=5), draft_head=head)
    eng.spec.static.draft_override = ReferenceDrafts(
        eng, {tuple(p): p + r for p, r in zip(PROMPTS, reference)}, 0.7)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference
    s = eng.stats
    assert s["spec_static_steps"] > 0 and s["spec_accepted"] > 0 and _all_free(eng)
    assert len(graph_calls) == s["steps"] - s["replay_steps"]
