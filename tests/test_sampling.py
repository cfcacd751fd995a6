"""Sampling parameters and the batched on-device sampler (v41graph.runtime.sampling).

Every transform is checked against a per-row reference written here in plain Python (lists,
loops over the vocabulary, vLLM's documented rules), the draws against counted expectations
(chi-square on a tiny vocabulary, the draws made deterministic by seeds), and the engine-level
behaviour through Engine.generate on the tiny config against Session loops.
"""
from __future__ import annotations

import collections
import dataclasses
import math

import pytest
import torch

import v41graph
from v41graph.model.dspark import DSparkHead
from v41graph.runtime.engine import Engine, RequestError
from v41graph.runtime.sampling import (BatchSampler, SamplingParams, apply_penalties, filter_logits,
                                       params_probs, sample_logits, uniform_noise)
from v41graph.runtime.speculative import SpecConfig, init_random_dspark_

from stats import chi2_pvalue

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16
MAX_SEQ = 64


# =============================================================================== references
def ref_penalize(logits, prompt, output, rep, pres, freq):
    """vLLM's penalties, token by token: repetition over prompt + output, then frequency and
    presence over the output."""
    counts = collections.Counter(output)
    seen = set(prompt) | set(output)
    out = []
    for t, x in enumerate(logits):
        if t in seen:
            x = x / rep if x > 0 else x * rep
        out.append(x - freq * counts[t] - pres * (counts[t] > 0))
    return out


def ref_probs(logits, temperature, top_p=1.0, top_k=0, min_p=0.0):
    """The distribution sampled from, by the rules: temperature, min_p, top_k (ties with the
    k-th kept), top_p on the renormalized top-k mass (keep while the mass before < top_p)."""
    x = [v / temperature for v in logits]
    m = max(x)
    e = [math.exp(v - m) for v in x]
    p = [v / sum(e) for v in e]
    keep = [pi >= min_p * max(p) for pi in p]
    if top_k > 0:
        kth = sorted((x[i] for i in range(len(x)) if keep[i]), reverse=True)[:top_k][-1]
        keep = [k and x[i] >= kth for i, k in enumerate(keep)]
    mass = sum(p[i] for i in range(len(p)) if keep[i])
    if top_p < 1.0:
        before, kept = 0.0, [False] * len(p)
        for i in sorted(range(len(p)), key=lambda i: -x[i]):
            if keep[i]:
                kept[i] = before < top_p
                before += p[i] / mass
        keep = kept
    mass = sum(p[i] for i in range(len(p)) if keep[i])
    return [p[i] / mass if keep[i] else 0.0 for i in range(len(p))]


def _sampler(vocab, slots=8, mode="raw_logprobs"):
    return BatchSampler(vocab, slots, "cpu", mode, generator=torch.Generator().manual_seed(0))


# =============================================================================== validation
@pytest.mark.parametrize("kw, error, what", [
    (dict(temperature=-0.1), ValueError, "temperature must be >= 0"),
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(top_k=2.0), TypeError, "top_k must be an integer"),
    (dict(top_k=-2), ValueError, "top_k must be >= 1, or 0 / -1"),
    (dict(min_p=1.2), ValueError, r"min_p must be in \[0, 1\]"),
    (dict(min_p="0.1"), TypeError, "min_p must be a number"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be > 0"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), ValueError, r"frequency_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=True), TypeError, "frequency_penalty must be a number"),
    (dict(n=0), ValueError, "n must be a positive integer"),
    (dict(n=2.0), ValueError, "n must be a positive integer"),
    (dict(logprobs=-1), ValueError, "logprobs must be None or an integer >= 0"),
    (dict(logprobs=True), ValueError, "logprobs must be None or an integer >= 0"),
    (dict(stop_token_ids=[1, -4]), ValueError, "stop_token_ids must hold token ids >= 0"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids must be a sequence"),
    (dict(stop_ids=[1], stop_token_ids=[2]), ValueError, "stop_ids is an alias of stop_token_ids"),
    (dict(seed=1.5), TypeError, "seed must be an integer or None")])
def test_params_validated_at_construction(kw, error, what):
    with pytest.raises(error, match=what):
        SamplingParams(**kw)


def test_stop_ids_alias_and_samples():
    assert SamplingParams(stop_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_ids == (3, 4)
    assert SamplingParams(stop_ids=(3,), stop_token_ids=[3]).stop_token_ids == (3,)
    assert SamplingParams().stop_token_ids == ()
    kids = SamplingParams(n=3, seed=10, temperature=1.0).samples()
    assert [(k.n, k.seed) for k in kids] == [(1, 10), (1, 11), (1, 12)]
    assert [k.seed for k in SamplingParams(n=2, temperature=1.0).samples()] == [None, None]


# =============================================================================== transforms
def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    prompt, output = [0, 3], [1, 4, 4]
    mask = torch.zeros(1, 6, dtype=torch.bool)
    mask[0, prompt] = True
    counts = torch.zeros(1, 6, dtype=torch.int32)
    for t in output:
        counts[0, t] += 1
    got = apply_penalties(logits, mask, counts, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    # token 0: prompt, 2 > 0 -> 2 / 2; 1: output once, -1 * 2 - 0.25 - 0.5; 2: unseen;
    # 3: prompt, -3 * 2; 4: output twice, 1 / 2 - 2 * 0.25 - 0.5; 5: unseen
    assert got.tolist() == [[1.0, -2.75, 0.5, -6.0, -0.5, 0.0]]
    assert got[0].tolist() == ref_penalize(logits[0].tolist(), prompt, output, 2.0, 0.5, 0.25)


ROWS = [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.6),
        dict(temperature=1.0, min_p=0.2), dict(temperature=0.5, top_k=5, top_p=0.8, min_p=0.05),
        dict(temperature=2.0, top_k=1), dict(temperature=1.0, top_k=-1, top_p=0.3)]


def test_filter_matches_reference_per_row():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(ROWS), 40, generator=g) * 2
    params = [SamplingParams(**r) for r in ROWS]

    def col(name, dtype=torch.float32):
        return torch.tensor([max(getattr(p, name), 0) if name == "top_k" else getattr(p, name)
                             for p in params], dtype=dtype)
    x = filter_logits(logits, col("temperature"), col("top_p"), col("top_k", torch.int64), col("min_p"))
    probs = torch.softmax(x, -1)
    for i, p in enumerate(params):
        ref = torch.tensor(ref_probs(logits[i].tolist(), p.temperature, p.top_p, p.top_k, p.min_p), dtype=torch.float64)
        assert ((probs[i] > 0) == (ref > 0)).all(), (i, ROWS[i])          # the same kept set
        assert torch.allclose(probs[i].double(), ref, atol=1e-6), ROWS[i]
        assert torch.allclose(params_probs(logits[i], p).double(), ref, atol=1e-6)   # speculation's
    # min_p keeps exactly the tokens with probability >= min_p * max_prob
    p3 = torch.softmax(logits[3], -1)
    assert set(torch.nonzero(probs[3]).flatten().tolist()) == set(torch.nonzero(p3 >= 0.2 * p3.max()).flatten().tolist())
    assert int((probs[1] > 0).sum()) == 3 and int((probs[5] > 0).sum()) == 1


def test_top_k_keeps_ties_with_the_kth():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    x = filter_logits(logits, torch.ones(1), torch.ones(1), torch.tensor([2]), torch.zeros(1))
    assert torch.isfinite(x[0]).tolist() == [True, False, True, True, False]


def _tensors(sampler, params, steps=None, slots=None, prompts=None):
    b = len(params)
    return sampler.tensors(params, slots or list(range(b)), prompts or [[0]] * b, steps or [0] * b)


def test_greedy_and_top_k_1_are_the_argmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 300, generator=g)
    s = _sampler(300, slots=64)
    params = [SamplingParams() if i % 2 else SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(64)]
    for step in range(3):
        out = sample_logits(logits, _tensors(s, params, steps=[step] * 64))
        assert out.ids.tolist() == logits.argmax(-1).tolist()


# =============================================================================== the draws
def test_distribution_chi_square():
    """6000 seeded rows (seeds 0..5999) over a 6-token vocabulary in one call: the counts follow
    the reference distribution; the untransformed softmax is rejected (the test can tell)."""
    logits = torch.tensor([1.5, 1.0, 0.2, -0.3, 0.8, -2.0])
    n = 6000
    cases = [SamplingParams(temperature=0.8, seed=0), SamplingParams(temperature=1.0, top_k=4, seed=0),
             SamplingParams(temperature=1.2, top_p=0.7, seed=0), SamplingParams(temperature=1.0, min_p=0.3, seed=0)]
    s = _sampler(6, slots=n)
    for base in cases:
        params = [dataclasses.replace(base, seed=i) for i in range(n)]
        ids = sample_logits(logits.expand(n, 6), _tensors(s, params, slots=[0] * n, prompts=[[]] * n)).ids
        counts = torch.bincount(ids, minlength=6)
        ref = ref_probs(logits.tolist(), base.temperature, base.top_p, base.top_k, base.min_p)
        assert chi2_pvalue(counts, ref) > 1e-3, (base, counts.tolist(), ref)
        assert chi2_pvalue(counts, torch.softmax(logits, -1)) < 1e-3, base    # the test can tell
    # one seed over many steps (the position is part of the key), and unseeded rows
    params = [SamplingParams(temperature=1.0, seed=42)] * n
    ids = sample_logits(logits.expand(n, 6), _tensors(s, params, steps=list(range(n)), slots=[0] * n,
                                                      prompts=[[]] * n)).ids
    assert chi2_pvalue(torch.bincount(ids, minlength=6), torch.softmax(logits, -1)) > 1e-3
    params = [SamplingParams(temperature=1.0)] * n
    ids = sample_logits(logits.expand(n, 6), _tensors(s, params, slots=[0] * n, prompts=[[]] * n)).ids
    assert chi2_pvalue(torch.bincount(ids, minlength=6), torch.softmax(logits, -1)) > 1e-3


def test_neighbouring_seeds_draw_independently():
    """n samples run with seeds seed + i: two neighbouring seeds at the same positions must draw
    independently (joint counts follow p x p); the same seed twice gives the diagonal only."""
    logits = torch.tensor([0.9, 0.1, -0.4, 0.5])
    p = torch.softmax(logits, -1)
    n = 4000
    s = _sampler(4, slots=2)
    for seeds, independent in (((7, 8), True), ((7, 7), False)):
        params = [SamplingParams(temperature=1.0, seed=sd) for sd in seeds]
        joint = torch.zeros(4, 4)
        ids = torch.stack([sample_logits(logits.expand(n, 4), _tensors(s, [pr] * n, steps=list(range(n)),
                                                                       slots=[0] * n, prompts=[[]] * n)).ids
                           for pr in params], 1)
        joint.index_put_((ids[:, 0], ids[:, 1]), torch.ones(n), accumulate=True)
        if independent:
            assert chi2_pvalue(joint, torch.outer(p, p)) > 1e-3
        else:
            assert torch.equal(ids[:, 0], ids[:, 1])
    # nor is seed + 1 the same stream shifted by a position: agreement at the chance rate
    a = sample_logits(logits.expand(n, 4), _tensors(s, [SamplingParams(temperature=1.0, seed=7)] * n,
                                                    steps=list(range(1, n + 1)), slots=[0] * n, prompts=[[]] * n)).ids
    b = sample_logits(logits.expand(n, 4), _tensors(s, [SamplingParams(temperature=1.0, seed=8)] * n,
                                                    steps=list(range(n)), slots=[0] * n, prompts=[[]] * n)).ids
    chance = float((p * p).sum())
    assert abs(float((a == b).double().mean()) - chance) < 5 * math.sqrt(chance * (1 - chance) / n)


def test_noise_uniform_and_row_local():
    keys = torch.tensor([1, 3, 1, 5])
    u = uniform_noise(keys, 5000)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert torch.equal(uniform_noise(keys[[3, 1]], 5000), u[[3, 1]])
    counts = torch.histc(u[:2].flatten(), bins=10, min=0, max=1)
    assert chi2_pvalue(counts, torch.full((10,), 0.1)) > 1e-3


def test_seeded_row_independent_of_its_batch():
    """A seeded row gives the same token at any row index, next to any other rows (seeded,
    unseeded, greedy, other parameters), for each of its positions."""
    g = torch.Generator().manual_seed(2)
    v = 64
    mine = torch.randn(v, generator=g)
    p = SamplingParams(temperature=1.0, top_k=20, min_p=0.01, seed=1234)
    s = _sampler(v, slots=8)
    alone = [sample_logits(mine[None], _tensors(s, [p], steps=[k])).ids.item() for k in range(20)]
    assert len(set(alone)) > 3        # the position moves the noise
    others = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, seed=9, top_p=0.5)]
    for k in range(20):
        logits = torch.randn(4, v, generator=g)
        row = k % 4
        logits[row] = mine
        params = others[:row] + [p] + others[row:]
        steps = [7, 3, 1, 0][:row] + [k] + [7, 3, 1, 0][row:3]
        assert sample_logits(logits, _tensors(s, params, steps=steps)).ids[row].item() == alone[k]


def test_logprobs_raw_and_processed():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 30, generator=g)
    params = [SamplingParams(temperature=0.9, top_k=5, seed=1, logprobs=4), SamplingParams(logprobs=0),
              SamplingParams(temperature=1.0, min_p=0.1, seed=2)]
    for mode in ("raw_logprobs", "processed_logprobs"):
        s = _sampler(30, mode=mode)
        out = s.sample(logits, params, [0, 1, 2], [[0]] * 3, [0, 0, 0])
        assert out[2].logprobs is None and out[1].token_id == int(logits[1].argmax())
        for i in (0, 1):
            p = params[i]
            if mode == "raw_logprobs":
                ref = torch.log_softmax(logits[i].double(), -1)
            else:    # the reference-transformed distribution (greedy: temperature 1)
                ref = torch.tensor(ref_probs(logits[i].tolist(), p.temperature or 1.0, p.top_p, p.top_k, p.min_p)).log()
            lp = out[i].logprobs
            assert next(iter(lp)) == out[i].token_id
            top = ref.topk(p.logprobs).indices.tolist() if p.logprobs else []
            assert set(lp) == set(top) | {out[i].token_id}
            for t, v in lp.items():
                assert v == pytest.approx(float(ref[t]), abs=1e-5)


def test_one_host_copy_per_batch(monkeypatch):
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0, seed=i, logprobs=2, repetition_penalty=1.2, top_k=10)
              for i in range(4)]
    s = _sampler(50)
    s.sample(logits, params, [0, 1, 2, 3], [[1, 2]] * 4, [0] * 4)       # penalty state started
    calls = collections.Counter()
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        fn = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda *a, _n=name, _f=fn, **k: (calls.update([_n]), _f(*a, **k))[1])
    s.sample(logits, params, [0, 1, 2, 3], [[1, 2]] * 4, [1] * 4)
    assert dict(calls) == {"tolist": 1}, calls


def test_all_greedy_batch_skips_the_upload_and_picks_the_argmax(monkeypatch):
    """A batch of greedy rows only (no logprobs, no penalties) takes BatchSampler's short path:
    the same ids as sample_logits on the rows' tensors, without building (uploading) them."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    logits[2, 17] = logits[2, 40] = logits[2].max() + 1          # a tie: the first index wins
    s = _sampler(300)
    params = [SamplingParams()] * 6
    full = sample_logits(logits, _tensors(s, params)).ids.tolist()
    uploads = collections.Counter()
    monkeypatch.setattr(s, "tensors", lambda *a, **k: uploads.update(["tensors"]))
    got = [t.token_id for t in s.sample(logits, params, list(range(6)), [[0]] * 6, [0] * 6)]
    assert got == full == logits.argmax(-1).tolist() and got[2] == 17
    assert not uploads

# =============================================================================== through the engine
def _prompts(lengths, seed=1, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 11, 3])


def _engine(model, **kw):
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("prefill_chunk_size", 16)
    return Engine(model, kw.pop("max_batch_size", 4), MAX_SEQ, block_size=BLOCK, **kw)


def _session_loop(model, prompt, n, choose):
    """Reference: a Session loop (prefilled as the engine does: decoder replay past the window);
    choose(logits_row, output_so_far) picks each token."""
    s = v41graph.Session(model, 1, MAX_SEQ, block_size=BLOCK)
    logits, out, rows = s.prefill([prompt], mode="auto"), [], []
    for _ in range(n):
        rows.append(logits[0].double())
        out.append(choose(logits[0], out))
        logits = s.decode([[out[-1]]])
    return out, rows


def test_engine_penalties_and_logprobs_match_session_reference(tiny_model):
    """Greedy with all three penalties (repetition < 1 and presence < 0 favour seen tokens, so
    they change choices of a random model, which rarely repeats): every token is the argmax of the reference-penalized
    logits of a Session loop; logprobs=3 (raw) are log_softmax of that loop's logits. Run next
    to an unpenalized request in the same batch (the penalty state is per slot)."""
    pen = SamplingParams(max_tokens=8, repetition_penalty=0.5, presence_penalty=-0.8, frequency_penalty=0.4,
                         logprobs=3)
    refs = []
    for prompt in PROMPTS[:2]:
        def choose(row, out, prompt=prompt):
            x = ref_penalize(row.tolist(), prompt, out, 0.5, -0.8, 0.4)
            return max(range(len(x)), key=lambda i: (x[i], -i))
        refs.append(_session_loop(tiny_model, prompt, 8, choose))
    plain = _session_loop(tiny_model, PROMPTS[2], 8, lambda row, out: int(row.argmax()))[0]
    outs = _engine(tiny_model).generate(PROMPTS, [pen, pen, SamplingParams(max_tokens=8)])
    assert [o.token_ids for o in outs] == [r[0] for r in refs] + [plain]
    assert any(int(row.argmax()) != tok for toks, rows in refs for tok, row in zip(toks, rows)), \
        "the penalties change no choice: the test cannot tell"
    for o, (toks, rows) in zip(outs, refs):
        assert len(o.logprobs) == 8 and o.outputs[0].logprobs == o.logprobs
        for tok, lp, row in zip(toks, o.logprobs, rows):
            ref = torch.log_softmax(row, -1)
            assert next(iter(lp)) == tok
            assert set(lp) == set(ref.topk(3).indices.tolist()) | {tok}
            assert all(v == pytest.approx(float(ref[t]), abs=1e-4) for t, v in lp.items())
    assert outs[2].logprobs is None


def test_engine_seeded_alone_equals_batched_and_n(tiny_model):
    """A seeded request with top_k / min_p / a penalty gives the same tokens alone and in a batch
    with other (seeded, unseeded, greedy) requests; n=3 gives 3 completions, sample i equal to
    the request with seed + i, and the same again in another engine."""
    mine = SamplingParams(temperature=1.0, top_k=40, min_p=0.02, repetition_penalty=1.3, max_tokens=8, seed=77)
    alone = _engine(tiny_model, max_batch_size=1).generate([PROMPTS[1]], mine)[0].token_ids
    crowd = [SamplingParams(temperature=0.9, max_tokens=8), SamplingParams(max_tokens=8),
             SamplingParams(temperature=1.2, top_p=0.8, seed=3, max_tokens=8)]
    outs = _engine(tiny_model).generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]],
                                        [crowd[0], mine, crowd[1], crowd[2]])
    assert outs[1].token_ids == alone
    many = SamplingParams(temperature=1.0, max_tokens=6, seed=5, n=3)
    a = _engine(tiny_model).generate([PROMPTS[0]], many)[0]
    b = _engine(tiny_model).generate([PROMPTS[0]], many)[0]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.token_ids == a.outputs[0].token_ids
    single = [_engine(tiny_model).generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=6, seed=5 + i))[0]
              .token_ids for i in range(3)]
    assert [c.token_ids for c in a.outputs] == single and len({tuple(s) for s in single}) == 3
    unseeded = _engine(tiny_model).generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_tokens=4, n=3))[0]
    assert len(unseeded.outputs) == 3 and all(len(c.token_ids) == 4 for c in unseeded.outputs)


def test_engine_refusals(tiny_model):
    eng = _engine(tiny_model)
    with pytest.raises(RequestError, match="n = 2: add_request queues one sample"):
        eng.add_request(PROMPTS[0], SamplingParams(n=2))
    with pytest.raises(RequestError, match="logprobs 300 > the vocabulary size 256"):
        eng.add_request(PROMPTS[0], SamplingParams(logprobs=300))
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        _engine(tiny_model, logprobs_mode="processed")
    head = init_random_dspark_(DSparkHead(tiny_model.config), seed=1).eval()
    spec = _engine(tiny_model, speculative=SpecConfig(num_draft=3), draft_head=head)
    with pytest.raises(RequestError, match="penalties are not supported with speculative decoding"):
        spec.add_request(PROMPTS[0], SamplingParams(presence_penalty=0.5))
    assert not eng.requests and not spec.requests
    # top_k / min_p with speculation: drafts and verification share the transform; reproducible
    p = SamplingParams(temperature=1.0, top_k=8, min_p=0.05, max_tokens=6, seed=11)
    runs = [[o.token_ids for o in _engine(tiny_model, speculative=SpecConfig(num_draft=3), draft_head=head)
             .generate(PROMPTS[:2], p)] for _ in range(2)]
    assert runs[0] == runs[1] and all(len(t) == 6 for t in runs[0])


def test_speculative_logprobs_equal_plain_engine(tiny_model):
    """With speculation the committed tokens' logprobs come from the verify rows that scored
    them: an oracle drafting the plain engine's own continuation (every draft accepted, so
    steps commit several tokens) gives the plain engine's tokens and logprobs."""
    params = SamplingParams(max_tokens=8, logprobs=2)
    plain = _engine(tiny_model).generate(PROMPTS[:2], params)
    head = init_random_dspark_(DSparkHead(tiny_model.config), seed=1).eval()
    eng = _engine(tiny_model, speculative=SpecConfig(num_draft=3), draft_head=head)
    full = {tuple(o.prompt_token_ids): o.prompt_token_ids + o.token_ids for o in plain}

    def oracle(req, anchor, pos):
        d = list(full[tuple(req.prompt)][pos + 1: pos + 4])
        return d + [0] * (3 - len(d)), None, torch.zeros(3)
    eng.spec._draft = oracle
    outs = eng.generate(PROMPTS[:2], params)
    assert eng.stats["spec_accepted"] > 0
    for o, ref in zip(outs, plain):
        assert o.token_ids == ref.token_ids and len(o.logprobs) == len(ref.logprobs) == 8
        for lp, rlp in zip(o.logprobs, ref.logprobs):
            assert list(lp)[0] == list(rlp)[0] and set(lp) == set(rlp)
            assert all(lp[t] == pytest.approx(rlp[t], abs=1e-4) for t in lp)


# =============================================================================== on the GPU
@pytest.mark.cuda
def test_batch_sampler_on_cuda_matches_cpu():
    """The batch sampler on CUDA (pinned uploads, device noise, penalties, logprobs): the noise
    is bit-identical to the CPU's (exact int64 arithmetic), greedy and seeded rows pick the CPU's
    tokens (the softmax may differ by an ulp, so a near tie could flip: allowed in 2 % of draws),
    and the penalty counts and logprobs agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from v41graph.runtime.sampling import row_keys, uniform_noise
    keys = row_keys(torch.arange(8), torch.arange(8) * 3, torch.arange(8) + 11)
    assert torch.equal(uniform_noise(keys.cuda(), 1000).cpu(), uniform_noise(keys, 1000))
    g = torch.Generator().manual_seed(5)
    v, b = 512, 16
    params = [SamplingParams() if i % 4 == 0 else
              SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=100 + i,
                             repetition_penalty=1.3 if i % 3 == 0 else 1.0, logprobs=2)
              for i in range(b)]
    prompts = [torch.randint(0, v, (7,), generator=g).tolist() for _ in range(b)]
    cpu, gpu = (BatchSampler(v, b, dev, generator=torch.Generator(dev).manual_seed(0)) for dev in ("cpu", "cuda"))
    agree = total = 0
    for step in range(25):
        logits = torch.randn(b, v, generator=g) * 3
        a = cpu.sample(logits, params, list(range(b)), prompts, [step] * b)
        c = gpu.sample(logits.cuda(), params, list(range(b)), prompts, [step] * b)
        for p, x, y in zip(params, a, c):
            if p.greedy:
                assert x.token_id == y.token_id
            total += 1
            agree += x.token_id == y.token_id
            if p.logprobs is not None and x.token_id == y.token_id:
                assert abs(x.logprobs[x.token_id] - y.logprobs[y.token_id]) < 1e-4
    assert agree >= 0.98 * total, (agree, total)
    assert torch.equal(cpu.penalties.output_counts, gpu.penalties.output_counts.cpu()) or agree < total
