"""Serving engine (v41graph.runtime.engine) and sampling (v41graph.runtime.sampling) on tiny() (fp32, dense, CPU).

Greedy token equality between schedules (engine vs Session loop, batched vs alone, chunked vs
whole prefill) relies on the schedules' logits agreeing to ~1e-5 (see test_model_consistency.py
for why they are not bit-identical); an argmax flip would need two logits within that of each
other. The prompts below were checked to have no such near-tie.
"""
from __future__ import annotations

import math

import pytest
import torch

import v41graph
from compile_harness import four_layer_config
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.batch import CacheCapacityError
from v41graph.runtime.engine import Engine, RequestError
from v41graph.runtime.sampling import (SamplingParams, accept_rejection, probs_from_logits, sample, verify_greedy)

from stats import chi2_pvalue

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16
MAX_SEQ = 96
N_NEW = 10


def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 13, 40, 3, 21])


def _session_greedy(model, prompt, n, mode="auto"):
    s = v41graph.Session(model, 1, MAX_SEQ, block_size=BLOCK)
    logits, out = s.prefill([prompt], mode=mode), []
    for _ in range(n):
        tok = int(logits[0].argmax())
        out.append(tok)
        logits = s.decode([[tok]])
    return out


def _engine(model, **kw):
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("prefill_chunk_size", 16)
    return Engine(model, kw.pop("max_batch_size", 4), MAX_SEQ, block_size=BLOCK, **kw)


@pytest.fixture(scope="module")
def reference_greedy(tiny_model):
    return [_session_greedy(tiny_model, p, N_NEW) for p in PROMPTS]


def _all_free(eng):
    return eng.num_free_blocks == eng.num_blocks and len(eng.free_slots) == eng.max_batch_size


# =============================================================================== greedy equality
def test_engine_greedy_matches_session_loop(tiny_model, reference_greedy):
    # 5 requests, 4 slots: continuous batching admits the fifth when the first finishes;
    # chunked prefill (16-token chunks, 24-token budget) mixed with decodes.
    eng = _engine(tiny_model)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference_greedy
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.stats["steps"] > 0 and _all_free(eng)


def test_engine_full_prefill_matches_session_full_loop(tiny_model):
    # The engine's default prefill replays the decoder over the last window of long prompts
    # (chunk by chunk; the reference loop above uses Session's mode="auto", the same replay in
    # one call); prefill_mode="full" is the explicit option and matches Session's full prefill.
    ref = [_session_greedy(tiny_model, p, N_NEW, mode="full") for p in PROMPTS]
    eng = _engine(tiny_model, prefill_mode="full")
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == ref
    assert eng.stats["replay_steps"] == 0 and _all_free(eng)


def test_batched_equals_each_alone(tiny_model):
    params = SamplingParams(max_tokens=N_NEW)
    batched = [o.token_ids for o in _engine(tiny_model, max_num_batched_tokens=256,
                                            prefill_chunk_size=256).generate(PROMPTS, params)]
    alone = [_engine(tiny_model, max_batch_size=1).generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_stop_ids_and_streaming(tiny_model, reference_greedy):
    ref = reference_greedy[2]
    stop = ref[4]
    first = ref.index(stop)
    eng = _engine(tiny_model)
    seen = []
    rid = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=N_NEW, stop_ids=[stop]),
                          callback=lambda r, toks, fin: seen.append((r, toks, fin)))
    while eng.has_unfinished():
        eng.step()
    out = eng.output(rid)
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop"
    assert [t for _, toks, _ in seen for t in toks] == out.token_ids
    assert [fin for *_, fin in seen] == [False] * first + [True]
    # the iterator front end
    streamed = [t for toks in eng.stream(PROMPTS[0], SamplingParams(max_tokens=N_NEW)) for t in toks]
    assert streamed == _session_greedy(tiny_model, PROMPTS[0], N_NEW)
    assert _all_free(eng)


# =============================================================================== sampling
def test_sampling_seed_reproducible(tiny_model):
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=N_NEW, seed=100 + i)
              for i in range(len(PROMPTS))]
    a = [o.token_ids for o in _engine(tiny_model).generate(PROMPTS, params)]
    b = [o.token_ids for o in _engine(tiny_model).generate(PROMPTS, params)]
    assert a == b
    # A request's samples depend on its own seed only, not on the rest of the batch.
    alone = _engine(tiny_model, max_batch_size=1).generate([PROMPTS[1]], params[1])[0].token_ids
    assert alone == a[1]
    other = _engine(tiny_model).generate([PROMPTS[1]], SamplingParams(
        temperature=0.9, top_p=0.9, max_tokens=N_NEW, seed=7))[0].token_ids
    assert other != a[1]


def test_top_p_and_greedy_units():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, -3.0])
    p = probs_from_logits(logits, 1.0, top_p=0.8)
    full = torch.softmax(logits, -1)
    keep = (full.sort(descending=True).values.cumsum(0) - full.sort(descending=True).values) < 0.8
    assert int((p > 0).sum()) == int(keep.sum()) and abs(float(p.sum()) - 1) < 1e-6
    assert torch.allclose(p[p > 0], full[p > 0] / full[p > 0].sum())
    assert sample(logits, SamplingParams()) == 0
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g) for _ in range(300)}
    assert draws == set(torch.nonzero(p).flatten().tolist())
    tl = torch.zeros(4, 6)
    tl[0, 3] = tl[1, 1] = tl[2, 5] = tl[3, 2] = 1
    assert verify_greedy([3, 1, 5], tl) == [3, 1, 5, 2]       # all accepted + bonus
    assert verify_greedy([3, 0, 5], tl) == [3, 1]             # correction at the first mismatch
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def _resample_from_target(draft_ids, draft_probs, target_probs, generator):
    """A deliberately wrong verifier: on rejection it resamples from p instead of the residual."""
    out = []
    for i, d in enumerate(draft_ids):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(draft_probs[i, d]) < float(target_probs[i, d]):
            out.append(int(d))
            continue
        out.append(int(torch.multinomial(target_probs[i], 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return out


def verify_rejection(draft_ids, draft_probs, target_probs, generator):
    """accept_rejection (the engine's rows-at-once verifier) on one row, its noise key drawn
    from `generator`: the interface of the verifiers below."""
    k = len(draft_ids)
    key = torch.randint(0, 2 ** 32, (1,), generator=generator)
    out, count = accept_rejection(torch.tensor([draft_ids]).view(1, k), draft_probs[None, :k], target_probs[None],
                                  key, torch.tensor([k]))
    return out[0, :int(count)].tolist()


def _joint_counts(verifier, p, q, n, seed):
    """Speculate k = 2 tokens from q, verify against p; the first two committed tokens (the
    second drawn from p when verification committed only one, as the next step would) must be
    distributed as p0 x p1."""
    v = p.shape[1]
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(v, v, dtype=torch.int64)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(2)], 1)
    for j in range(n):
        out = verifier(drafts[j].tolist(), q, p, g)
        if len(out) == 1:
            out.append(int(torch.multinomial(p[1], 1, generator=g)))
        counts[out[0], out[1]] += 1
    return counts


def test_rejection_sampling_preserves_target_distribution():
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
                      [0.05, 0.10, 0.45, 0.05, 0.25, 0.10],
                      [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]], dtype=torch.float64)
    q = torch.tensor([[0.10, 0.30, 0.30, 0.05, 0.05, 0.20],
                      [0.30, 0.05, 0.20, 0.25, 0.10, 0.10]], dtype=torch.float64)
    joint = torch.outer(p[0], p[1])
    n = 12000
    good = chi2_pvalue(_joint_counts(verify_rejection, p, q, n, seed=1234), joint)
    bad = chi2_pvalue(_joint_counts(_resample_from_target, p, q, n, seed=1234), joint)
    accept_all = chi2_pvalue(_joint_counts(lambda d, qq, pp, g: list(d), p, q, n, seed=1234), joint)
    assert good > 1e-3, f"rejection sampling changed the distribution (p = {good:.3g})"
    assert bad < 1e-3 and accept_all < 1e-3, f"the test cannot tell wrong verifiers apart ({bad:.3g}, {accept_all:.3g})"


def test_rejection_sampling_identical_distributions_accepts_everything():
    p = torch.softmax(torch.randn(4, 8, generator=torch.Generator().manual_seed(3)), -1)
    g = torch.Generator().manual_seed(0)
    drafts = [int(torch.multinomial(p[i], 1, generator=g)) for i in range(3)]
    out = verify_rejection(drafts, p[:3], p, g)
    assert out[:3] == drafts and len(out) == 4


# =============================================================================== memory + errors
def test_blocks_free_after_finish_and_abort(tiny_model):
    eng = _engine(tiny_model, max_batch_size=2, prefill_chunk_size=8, max_num_batched_tokens=10)
    ids = [eng.add_request(p, SamplingParams(max_tokens=6)) for p in PROMPTS]
    eng.step()                                   # 0 and 1 admitted, prefilling
    assert eng.num_free_blocks < eng.num_blocks
    assert eng.abort(ids[2])                     # still waiting
    assert eng.abort(ids[1])                     # mid-prefill (13 tokens, 8-token chunks)
    for _ in range(3):
        eng.step()
    assert eng.requests[ids[0]].output           # decoding
    assert eng.abort(ids[0])                     # mid-decode
    assert not eng.abort(ids[0])                 # already finished
    while eng.has_unfinished():
        eng.step()
    assert _all_free(eng)
    assert [eng.output(i).finish_reason for i in ids] == ["abort", "abort", "abort", "length", "length"]
    with pytest.raises(KeyError):
        eng.abort(12345)


def test_bad_requests_rejected_others_unchanged(tiny_model, reference_greedy):
    eng = _engine(tiny_model, num_blocks=12)     # 12 blocks of 16: 192 tokens for 4 slots
    good = [eng.add_request(PROMPTS[0], SamplingParams(max_tokens=N_NEW))]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([1, 2, 256], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        eng.add_request([-1], SamplingParams(max_tokens=4))
    eng.step()
    good.append(eng.add_request(PROMPTS[1], SamplingParams(max_tokens=N_NEW)))
    with pytest.raises(RequestError, match="too long"):
        eng.add_request(list(range(90)), SamplingParams(max_tokens=8))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="integers"):
        eng.add_request(["a"], SamplingParams(max_tokens=4))
    small = _engine(tiny_model, num_blocks=2)
    with pytest.raises(CacheCapacityError, match="cache blocks"):
        small.add_request(list(range(40)), SamplingParams(max_tokens=N_NEW))
    # generate validates every prompt before queueing any
    with pytest.raises(RequestError):
        eng.generate([PROMPTS[3], [999]], SamplingParams(max_tokens=4))
    eng.step()
    # an aborted neighbour does not disturb the others
    victim = eng.add_request(PROMPTS[4], SamplingParams(max_tokens=N_NEW))
    eng.step()
    eng.abort(victim)
    good.append(eng.add_request(PROMPTS[2], SamplingParams(max_tokens=N_NEW)))
    while eng.has_unfinished():
        eng.step()
    assert [eng.output(r).token_ids for r in good] == [reference_greedy[0], reference_greedy[1],
                                                       reference_greedy[2]]
    assert len(eng.requests) == 4 and _all_free(eng)


def test_waits_for_memory_instead_of_failing(tiny_model, reference_greedy):
    # Pool of 4 blocks: the 40-token prompt (+9) needs all 4, so requests run one after another.
    eng = _engine(tiny_model, num_blocks=4)
    outs = eng.generate(PROMPTS[:3], SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference_greedy[:3]
    assert _all_free(eng)


def test_decode_width_buckets_same_tokens_fewer_blocks():
    """decode_width_buckets=True cuts a decode step's block tables to its longest context
    (rounded up to a power of two of blocks): the same greedy tokens as full-width tables, with
    widths that grow with the contexts; on a compiled model, every width runs the one shared
    decode trace. (The four-layer plan: the widths do not depend on the layers, and its trace
    takes well under half of tiny()'s.)"""
    model = init_random_(V41Model(four_layer_config()), seed=0).eval()
    prompts = _prompts([5, 9, 12], seed=4)        # contexts up to 42: 2 then 4 of 6 blocks
    params = SamplingParams(max_tokens=30)
    want = [o.token_ids for o in _engine(model).generate(prompts, params)]
    widths = []

    class Recording:   # the model contract: a call for any step, decode() for decode steps
        def __init__(self, model):
            self.model = model

        def __call__(self, *args, **kw):
            return self.model(*args, **kw)

        def decode(self, ids, positions, caches, meta):
            widths.append(meta.block_table.shape[1])
            return self.model.decode(ids, positions, caches, meta)

    eng = _engine(model, decode_width_buckets=True)
    eng.model = Recording(model)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    full = math.ceil(MAX_SEQ / BLOCK)
    assert min(widths) == 2 and max(widths) < full and widths == sorted(widths)
    assert all(w & (w - 1) == 0 for w in widths)           # powers of two
    compiled = v41graph.compile(model, backend="cpu", batch_sizes=(4,))
    eng = _engine(compiled, decode_width_buckets=True)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert {key[2] for key in compiled._decode} == set(widths)
    assert len(compiled.traced) <= 3        # prefill (+ its dynamic recompile) and one decode trace


def test_compiled_decode_with_eager_prefill(tiny_model, reference_greedy):
    """compile(compile_prefill=False): prefill and mixed steps run the eager model, decode steps
    the compiled bucket graph; the greedy tokens are the plain model loop's, and the only trace
    is the decode graph's (a compiled prefill would add one or two)."""
    compiled = v41graph.compile(tiny_model, backend="cpu", batch_sizes=(2, 4), share_decode_graph="all",
                                compile_prefill=False)
    eng = _engine(compiled)
    outs = eng.generate(PROMPTS, SamplingParams(max_tokens=N_NEW))
    assert [o.token_ids for o in outs] == reference_greedy
    assert _all_free(eng)
    assert len(compiled.traced) == 1 and compiled._decode


# =============================================================================== failures stay local
def test_a_failing_callback_fails_its_request_only(tiny_model):
    """A stream callback that raises finishes its own request with reason "error" (blocks and
    slot freed, the error kept); every other request continues and gives exactly what a clean
    twin engine gives (sampled too, with per-request generators); generate() does not spin."""
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=N_NEW, seed=3)
    greedy = SamplingParams(max_tokens=N_NEW)
    calls = []

    def failing(rid, new, finished):
        calls.append(new)
        if len(calls) == 3:
            raise RuntimeError("client went away")

    outs = {}
    for twin in ("clean", "failing"):
        eng = _engine(tiny_model)
        ids = [eng.add_request(PROMPTS[0], greedy),
               eng.add_request(PROMPTS[1], greedy, callback=failing if twin == "failing" else None),
               eng.add_request(PROMPTS[2], sampled)]
        steps = 0
        while eng.has_unfinished():
            eng.step()
            steps += 1
            assert steps < 200, "the engine did not finish"
        outs[twin] = [eng.output(r) for r in ids]
        assert _all_free(eng)
    clean, bad = outs["clean"], outs["failing"]
    assert [o.token_ids for o in (bad[0], bad[2])] == [o.token_ids for o in (clean[0], clean[2])]
    assert bad[1].finish_reason == "error" and "RuntimeError: client went away" in bad[1].error
    assert bad[1].token_ids == clean[1].token_ids[:3] and len(calls) == 3
    assert clean[1].finish_reason == "length" and clean[1].error is None


@pytest.mark.parametrize("ids, what", [([1.5, 2.5], r"token_ids must hold integers.*1\.5"),
                                       ("2024", "token_ids must be a sequence of integer token ids"),
                                       ([1, True], r"token_ids must hold integers.*True"),
                                       (7, "token_ids must be a sequence")])
def test_add_request_rejects_non_integer_ids(tiny_model, ids, what):
    eng = _engine(tiny_model)
    with pytest.raises(RequestError, match=what):
        eng.add_request(ids, SamplingParams(max_tokens=2))
    assert not eng.requests and not eng.has_unfinished()


def test_unknown_request_ids_and_bad_sizes_are_clear_errors(tiny_model):
    eng = _engine(tiny_model)
    for call in (eng.output, eng.release, eng.abort):
        with pytest.raises(KeyError, match="unknown request id 999"):
            call(999)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        Engine(tiny_model, 2, MAX_SEQ, block_size=0)


@pytest.mark.parametrize("kw, error, what", [
    (dict(temperature="0.7"), TypeError, "temperature must be a number"),
    (dict(max_tokens=None), ValueError, "max_tokens must be a positive integer"),
    (dict(max_tokens=2.0), ValueError, "max_tokens must be a positive integer"),
    (dict(stop_ids=5), TypeError, "stop_ids must be a sequence"),
    (dict(stop_ids=[1.5]), TypeError, "stop_ids must hold integers"),
    (dict(seed="abc"), TypeError, "seed must be an integer or None")])
def test_sampling_params_check_their_types(kw, error, what):
    with pytest.raises(error, match=what):
        SamplingParams(**kw)
