"""CED decoder bounded replay (MODEL.md §9) as the default prefill of long prompts in the Engine
(prefill_mode="auto"; "full" by option) and as Session's "auto" mode (Session's default stays
"full": the reference and conformance tests compare its prefill with DeepSeek's full one).

Where the spec says replay and full are identical (prompts within the window, and the encoder /
global KV of any prompt) the tests ask for bit equality; where the engine's chunked replay is
compared with one-call replay, greedy tokens and ~1e-5 logits (different chunk shapes).
"""
from __future__ import annotations

import pytest
import torch

import v41graph
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams
from v41graph.model.dspark import DSparkHead
from v41graph.runtime.speculative import SpecConfig, init_random_dspark_

pytestmark = pytest.mark.usefixtures("single_thread")

BLOCK = 16
MAX_SEQ = 96
W = v41graph.V41Config.tiny().sliding_window        # 8


def _prompts(lengths, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


class Spy:
    """Wraps a model; records each call's decoder_replay argument."""

    def __init__(self, model):
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kw):
        r = kw.get("decoder_replay")
        self.calls.append(None if r is None else r.tolist() if isinstance(r, torch.Tensor) else r)
        return self.model(*args, **kw)


def _engine(model, **kw):
    kw.setdefault("max_num_batched_tokens", 24)
    kw.setdefault("prefill_chunk_size", 16)
    return Engine(model, kw.pop("max_batch_size", 4), MAX_SEQ, block_size=BLOCK, **kw)


def _session_loop(model, prompt, n, mode):
    s = v41graph.Session(model, 1, MAX_SEQ, block_size=BLOCK)
    logits = s.prefill([prompt], mode=mode)
    first, out = logits, []
    for _ in range(n):
        out.append(int(logits[0].argmax()))
        logits = s.decode([[out[-1]]])
    return first, out, s


# =============================================================================== Session
def test_session_auto_is_replay_for_long_full_for_short(tiny_model):
    long, short = _prompts([3 * W + 5, W])
    s = v41graph.Session(tiny_model, 1, 64, block_size=BLOCK, prefill_mode="auto")
    r, f = (v41graph.Session(tiny_model, 1, 64, block_size=BLOCK) for _ in range(2))
    got = s.prefill([long])
    assert s.last_prefill_mode == "replay"
    assert torch.equal(got, r.prefill([long], mode="replay"))
    assert not torch.equal(got, f.prefill([long]))                     # Session's default: full
    assert f.last_prefill_mode == "full"
    assert torch.equal(got, f.prefill([long], mode="auto"))             # or per call
    got = s.prefill([short])
    assert s.last_prefill_mode == "full"
    assert torch.equal(got, f.prefill([short], mode="full"))
    assert torch.equal(got, r.prefill([short], mode="replay"))          # identical within the window


def test_session_mixed_lengths_replay_leaves_short_prompts_exact(tiny_model):
    """One call with a long and a short prompt replays; the short one equals its full prefill."""
    long, short = _prompts([30, 6], seed=8)
    s = v41graph.Session(tiny_model, 2, 64, block_size=BLOCK)
    got = s.prefill([long, short], mode="auto")
    assert s.last_prefill_mode == "replay"
    one = v41graph.Session(tiny_model, 1, 64, block_size=BLOCK)
    torch.testing.assert_close(got[1:], one.prefill([short], mode="full"), atol=1e-5, rtol=1e-5)


# =============================================================================== Engine
def test_engine_default_selects_replay_for_long_prompts_only(tiny_model):
    spy = Spy(tiny_model)
    long, short = _prompts([40, W])
    eng = _engine(spy, max_num_batched_tokens=64, prefill_chunk_size=64)
    eng.generate([short], SamplingParams(max_tokens=3))
    assert spy.calls and all(c is None for c in spy.calls)
    spy.calls.clear()
    eng.generate([long], SamplingParams(max_tokens=3))
    assert spy.calls[0] == [40 - W]                    # one 40-token chunk: floor 32
    assert all(c is None for c in spy.calls[1:])       # decodes never replay
    assert eng.stats["replay_steps"] == 1 and eng.stats["replay_dropped_tokens"] == 40 - W
    spy.calls.clear()
    full = _engine(spy, max_num_batched_tokens=64, prefill_chunk_size=64, prefill_mode="full")
    full.generate([long], SamplingParams(max_tokens=3))
    assert all(c is None for c in spy.calls) and full.stats["replay_steps"] == 0
    with pytest.raises(ValueError, match="prefill_mode"):
        _engine(tiny_model, prefill_mode="fast")
    with pytest.raises(ValueError, match="prefill mode"):
        v41graph.Session(tiny_model, 1, 16, block_size=BLOCK, prefill_mode="fast")


@pytest.mark.parametrize("chunk", [5, 16, 64])
def test_engine_chunked_replay_equals_session_replay(tiny_model, chunk):
    """Chunk schedules that split the replay segment (5), skip whole chunks before it (16: two
    chunks keep no token and run full) or hold the prompt in one chunk (64); with a second
    request decoding alongside."""
    long, other = _prompts([40, 13], seed=11)
    eng = _engine(tiny_model, max_num_batched_tokens=max(24, chunk + 2), prefill_chunk_size=chunk)
    firsts = {}
    fwd = eng._forward

    def log(batch):
        out = fwd(batch)
        for i, (req, c) in enumerate(batch):
            if not req.output and req.num_cached + len(c) == len(req.prompt):
                firsts[tuple(req.prompt)] = out[i].clone()
        return out
    eng._forward = log
    outs = eng.generate([other, long], SamplingParams(max_tokens=8))
    for p, o in zip([other, long], outs):
        first, toks, _ = _session_loop(tiny_model, p, 8, "auto")
        assert o.token_ids == toks
        torch.testing.assert_close(firsts[tuple(p)], first[0], atol=2e-5, rtol=2e-5)
    assert eng.stats["replay_steps"] >= 1


def test_engine_chunks_wholly_before_the_segment_run_full(tiny_model):
    """Alone, the first two 16-token chunks of a 40-token prompt keep no decoder token: they run
    as full steps (the decoder window rows they write are never read), the last replays."""
    long = _prompts([40], seed=11)[0]
    spy = Spy(tiny_model)
    eng = _engine(spy, max_batch_size=1, prefill_chunk_size=16)
    out = eng.generate([long], SamplingParams(max_tokens=8))[0]
    assert spy.calls[:3] == [None, None, [40 - W]]
    assert eng.stats["replay_full_steps"] == 2 and eng.stats["replay_steps"] == 1
    assert out.token_ids == _session_loop(tiny_model, long, 8, "auto")[1]


def test_engine_replay_equals_full_within_the_window(tiny_model):
    """prefill_mode="replay" takes the replay path for every prompt chunk; for prompts within
    the window (alongside decodes) it is bit-identical to full prefill."""
    prompts = _prompts([W, 5, 1, 7], seed=2)
    res = {}
    for mode in ("replay", "full"):
        spy = Spy(tiny_model)
        eng = _engine(spy, max_batch_size=2, prefill_chunk_size=4, prefill_mode=mode)
        logged = []
        fwd = eng._forward
        eng._forward = lambda b, fwd=fwd: logged.append(fwd(b).clone()) or logged[-1]
        outs = eng.generate(prompts, SamplingParams(max_tokens=6))
        res[mode] = ([o.token_ids for o in outs], logged, spy.calls)
    (ta, la, ca), (tb, lb, cb) = res["replay"], res["full"]
    assert ta == tb and len(la) == len(lb)
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert any(c is not None and 0 in c for c in ca)     # replay path taken, decode rows floor 0
    assert all(c is None for c in cb)


def test_engine_replay_builds_the_same_encoder_and_global_kv(tiny_model):
    """A long prompt: the encoder windows and every global KV / index key cache (encoder and
    the decoder's source) are bit-identical to full prefill; only decoder windows differ."""
    long = _prompts([45], seed=4)[0]
    caches = {}
    for mode in ("auto", "full"):
        eng = _engine(tiny_model, max_batch_size=1, prefill_chunk_size=10, prefill_mode=mode)
        rid = eng.add_request(long, SamplingParams(max_tokens=1))
        req = eng.requests[rid]
        while not req.output:
            eng.step()
        caches[mode] = eng.caches
    a, b = caches["auto"], caches["full"]
    for layer in a.global_kv:
        assert torch.equal(a.global_kv[layer], b.global_kv[layer]), layer
        assert torch.equal(a.index_k[layer], b.index_k[layer]), layer
    for layer in range(tiny_model.decoder_start):
        assert torch.equal(a.window_kv[layer], b.window_kv[layer]), layer
    assert any(not torch.equal(a.window_kv[layer], b.window_kv[layer])
               for layer in range(tiny_model.decoder_start, len(a.window_kv)))


def test_speculative_engine_replays_too(tiny_model):
    """With DSpark speculation the engine's prefill is the same replay, so greedy output equals
    the plain engine's (DSpark's context holds the replayed segment: its window)."""
    prompts = _prompts([40, 13, 5], seed=6)
    plain = _engine(tiny_model, max_num_batched_tokens=40).generate(prompts, SamplingParams(max_tokens=12))
    head = init_random_dspark_(DSparkHead(tiny_model.config), seed=1).eval()
    eng = _engine(tiny_model, max_num_batched_tokens=40, speculative=SpecConfig(num_draft=3),
                  draft_head=head)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert eng.stats["replay_steps"] >= 1
