"""The attention pieces against the deliberately naive loops of tests/naive.py:

1. custom_ops.reference.{sparse_attention, indexer_scores, topk_ascending,
   candidate_block_mask} on random inputs with -1 / invisible entries, ties and empty rows;
2. a real tiny() model (prefill of two sequences + one decode step), with forward hooks:
   - the ratio-2 compressor's pooled latents (layer 2), incl. a group split between prefill and
     decode, and the global-KV / index-key rows the cache holds for them;
   - every query's top-k at Full layers 2 and 6 and at Reindex layer 8 (candidate blocks of
     layer 6), recomputed from the index keys dequantized from the cache;
   - the whole attention output of layers 0 (window), 3 (Reuse, ratio 2) and 8 (Reindex) for
     the last prompt token and the decode token, from the captured layer input, the window
     ring and the global cache.
"""
from __future__ import annotations

import math

import pytest
import torch

import naive
from v41graph.custom_ops import reference as ref
from v41graph.runtime.session import Session

pytestmark = pytest.mark.usefixtures("single_thread")

# =============================================================================== 1. reference ops


def _nested(t: torch.Tensor):
    return t.double().tolist()


def test_sparse_attention_matches_naive():
    g = torch.Generator().manual_seed(0)
    n, h, d, s = 6, 3, 16, 150               # 150 rows: three online-softmax blocks of 64
    q = torch.randn(n, h, d, generator=g)
    kv = torch.randn(n, s, d, generator=g)
    valid = torch.rand(n, s, generator=g) < 0.6
    valid[3] = False                          # no row at all: output 0 (only the sink)
    valid[4] = False
    valid[4, 100] = True                      # a single row in the last block
    kv[5, 10] = kv[5, 11] = kv[5, 140]        # tied scores
    q[1] *= 6.0                               # peaked softmax
    sink = torch.randn(h, generator=g)
    scale = d ** -0.5
    got = ref.sparse_attention(q, kv, valid, sink, scale)
    want = torch.tensor(naive.sparse_attention(_nested(q), _nested(kv), valid.tolist(),
                                               sink.double().tolist(), scale), dtype=torch.float64)
    assert got.shape == (n, h, d) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros(h, d))
    # one row: o = k * e^s / (e^s + e^sink)
    s1 = scale * (q[4] @ kv[4, 100])
    w1 = torch.exp(s1) / (torch.exp(s1) + torch.exp(sink))
    torch.testing.assert_close(got[4], w1.unsqueeze(-1) * kv[4, 100], atol=1e-6, rtol=1e-5)


def test_sparse_attention_sink_only_in_denominator():
    """A very negative sink is plain softmax attention; a huge sink drives the output to 0."""
    g = torch.Generator().manual_seed(1)
    q, kv = torch.randn(2, 2, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    valid = torch.ones(2, 5, dtype=torch.bool)
    plain = torch.softmax(torch.einsum("nhd,nsd->nhs", q, kv) * 0.5, -1) @ kv
    got = ref.sparse_attention(q, kv, valid, torch.full((2,), -1e4), 0.5)
    torch.testing.assert_close(got, plain, atol=1e-6, rtol=1e-5)
    assert ref.sparse_attention(q, kv, valid, torch.full((2,), 1e4), 0.5).abs().max() < 1e-30


def test_indexer_scores_match_naive():
    g = torch.Generator().manual_seed(2)
    n, hi, di, c = 5, 3, 8, 20
    q = torch.randn(n, hi, di, generator=g)
    w = torch.randn(n, hi, generator=g)       # negative head weights too
    keys = torch.randn(n, c, di, generator=g)
    visible = torch.rand(n, c, generator=g) < 0.7
    visible[2] = False
    keys[1, 4] = keys[1, 9]                   # ties
    got = ref.indexer_scores(q, w, keys, visible)
    want = torch.tensor(naive.indexer_scores(_nested(q), _nested(w), _nested(keys), visible.tolist()),
                        dtype=torch.float64)
    assert torch.equal(torch.isinf(got), ~visible)
    assert (got[~visible] == float("-inf")).all()
    torch.testing.assert_close(got[visible].double(), want[visible], atol=1e-5, rtol=1e-5)


def test_topk_ascending_matches_naive():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 5, (8, 12), generator=g).float()     # many ties
    scores[torch.rand(8, 12, generator=g) < 0.3] = float("-inf")
    scores[2] = float("-inf")                                        # nothing visible
    scores[3, :] = 1.0                                               # all tied
    scores[4, :10] = float("-inf")                                   # fewer finite than k
    scores[4, 10:] = 3.0
    for k in (1, 4, 12, 15):                                         # 15 > C: padded width
        got = ref.topk_ascending(scores, k)
        assert got.shape == (8, k) and got.dtype == torch.int64
        want = [naive.topk_ascending(row, k) for row in scores.tolist()]
        assert got.tolist() == want, k
    assert ref.topk_ascending(scores, 4)[3].tolist() == [0, 1, 2, 3]     # ties to the lower id
    assert ref.topk_ascending(scores, 4)[4].tolist() == [10, 11, -1, -1]


@pytest.mark.parametrize("block_size,keep", [(4, 3), (4, 1), (3, 2), (5, 9)])
def test_candidate_block_mask_matches_naive(block_size, keep):
    g = torch.Generator().manual_seed(4 + block_size + keep)
    n, c = 9, 18                                                     # last block partial
    scores = torch.randint(0, 6, (n, c), generator=g).float()
    counts = torch.tensor([18, 17, 13, 9, 5, 1, 0, 12, 16])
    for r in range(n):                                               # causal: -inf past the count
        scores[r, counts[r]:] = float("-inf")
    scores[7, :8] = float("-inf")                                    # whole -inf blocks
    scores[8, :] = torch.where(torch.arange(c) < 16, 2.0, float("-inf"))   # tied block scores
    got = ref.candidate_block_mask(scores, counts, block_size, keep)
    want = [naive.candidate_blocks(row, int(cnt), block_size, keep)
            for row, cnt in zip(scores.tolist(), counts)]
    assert got.tolist() == want
    # the newest visible position is always kept
    for r in range(n):
        if counts[r] > 0:
            assert got[r, counts[r] - 1]


def test_candidate_block_mask_pins_the_newest_block_even_when_it_scores_lowest():
    scores = torch.tensor([[9.0, 9, 9, 9, 8, 8, 8, 8, 7, 7, 7, 7, 0, float("-inf")]])
    mask = ref.candidate_block_mask(scores, torch.tensor([13]), 4, 2)
    assert mask.tolist() == [[True] * 4 + [False] * 8 + [True, True]]


# =============================================================================== 2. the model
PROMPTS = (45, 30)        # decode positions 45 (odd: completes a ratio-2 group) and 30 (even)
HOOKED = (0, 2, 3, 6, 8)


def _snapshot(caches):
    return {
        "window_kv": [t.clone() for t in caches.window_kv],
        "window_scale": [t.clone() for t in caches.window_scale],
        "global_kv": {k: v.clone() for k, v in caches.global_kv.items()},
        "global_scale": {k: v.clone() for k, v in caches.global_scale.items()},
        "index_k": {k: v.clone() for k, v in caches.index_k.items()},
        "index_scale": {k: v.clone() for k, v in caches.index_scale.items()},
    }


@pytest.fixture(scope="module")
def run(tiny_model):
    """Prefill two prompts, then decode one token each, capturing layer inputs / outputs."""
    model = tiny_model
    g = torch.Generator().manual_seed(42)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPTS]
    nxt = [[int(torch.randint(0, 256, (1,), generator=g))] for _ in PROMPTS]
    s = Session(model, max_batch_size=2, max_seq_len=64, block_size=16)
    rec: dict = {}
    handles = []
    for lid in HOOKED:
        attn = model.layers[lid].attn

        def pre(mod, args, lid=lid):
            x, ctx = args[0], args[1]
            rec[f"x{lid}"] = x.detach().clone()
            rec["pos"] = ctx.positions.clone()
            rec["seq"] = ctx.meta.token_seq.clone()

        def post(mod, args, out, lid=lid):
            rec[f"out{lid}"] = out.detach().clone()

        handles += [attn.register_forward_pre_hook(pre), attn.register_forward_hook(post)]

    def comp(mod, args, out):
        rec["latent2"], rec["group2"] = out[0].detach().clone(), out[1].clone()

    handles.append(model.layers[2].attn.compressor.register_forward_hook(comp))
    steps = []
    try:
        for call in (lambda: s.prefill(prompts), lambda: s.decode(nxt)):
            rec.clear()
            model.debug = {}
            call()
            steps.append({**rec, "debug": dict(model.debug), "caches": _snapshot(s.caches),
                          "blocks": [list(b) for b in s.blocks]})
    finally:
        model.debug = None
        for hnd in handles:
            hnd.remove()
    return {"model": model, "prefill": steps[0], "decode": steps[1], "prompts": prompts, "next": nxt}


def _w(linear):
    return linear.weight.double().tolist()


def _rows_of(blocks, ratio, block_size, count):
    """Cache rows (flattened [blocks * rows_per_block]) of compressed positions 0..count-1."""
    rpb = block_size // ratio
    return [blocks[j // rpb] * rpb + j % rpb for j in range(count)]


def _tokens_of(step):
    """[(token index, sequence, position)] of a captured step."""
    return list(zip(range(len(step["pos"])), step["seq"].tolist(), step["pos"].tolist()))


def _x_at(run, b, p):
    """Layer-2 attention input of sequence b at position p (prefill or decode)."""
    for name in ("prefill", "decode"):
        st = run[name]
        for t, sb, sp in _tokens_of(st):
            if sb == b and sp == p:
                return st["x2"][t].double().tolist()
    raise KeyError((b, p))


def _naive_latent(run, b, group):
    comp = run["model"].layers[2].attn.compressor
    wkv, wgate = _w(comp.wkv), _w(comp.wgate)
    xs = [_x_at(run, b, 2 * group + i) for i in range(2)]
    return naive.softmax_pool_ratio2([naive.matvec(wkv, x) for x in xs],
                                     [naive.matvec(wgate, x) for x in xs],
                                     comp.norm.weight.double().tolist(), comp.norm.eps)


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_ratio2_compressor_pooling(run, step):
    st = run[step]
    checked = 0
    for t, b, p in _tokens_of(st):
        group = int(st["group2"][t])
        assert group == ((p + 1) // 2 - 1 if p % 2 == 1 else -1), (b, p, group)
        if group < 0:
            continue
        want = _naive_latent(run, b, group)
        got = st["latent2"][t].double()
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=2e-5, rtol=1e-4)
        checked += 1
    # prefill: 22 + 15 groups; decode: position 45 completes group 22 with position 44 taken
    # from the prefill (the partial group kept between calls), position 30 completes none
    assert checked == (sum(n // 2 for n in PROMPTS) if step == "prefill" else 1)


def test_global_kv_and_index_keys_hold_the_roped_latents(run):
    """Layer 2's caches after the decode step: row of group j = FP4(RoPE(latent_j, pos 2j)) and
    index key = FP4(RoPE(RMSNorm(W_k latent_j), pos 2j)), within one FP4 rounding step."""
    model = run["model"]
    attn = model.layers[2].attn
    inv = attn.inv_freqs.double().tolist()
    caches, blocks = run["decode"]["caches"], run["decode"]["blocks"]
    gkv, gsc = caches["global_kv"][2].view(-1, 16), caches["global_scale"][2].view(-1, 2)
    ik, isc = caches["index_k"][2].view(-1, 16), caches["index_scale"][2].view(-1, 1)
    wk, kn = _w(attn.indexer.wk), attn.indexer.k_norm
    for b, n in enumerate(PROMPTS):
        count = (n + 1) // 2                 # groups complete after the decode token
        rows = _rows_of(blocks[b], 2, 16, count)
        for j, row in enumerate(rows):
            latent = _naive_latent(run, b, j)
            want_kv = naive.rope(latent, 2 * j, inv)
            codes = naive.unpack_nibbles(gkv[row].tolist())
            sbits = gsc[row].tolist()
            got_kv = naive.dequant_fp4_e4m3(codes, sbits, 16)
            for i, (gv, wv) in enumerate(zip(got_kv, want_kv)):
                sc = naive.e4m3_value(sbits[i // 16])
                assert abs(gv - wv) <= naive.fp4_error_bound(wv, sc) + 1e-4 * sc, (b, j, i, gv, wv)
            k = naive.rope(naive.rms_norm(naive.matvec(wk, latent), kn.weight.double().tolist(), kn.eps),
                           2 * j, inv)
            got_k = naive.dequant_fp4_ue8m0(naive.unpack_nibbles(ik[row].tolist()), isc[row].tolist(), 32)
            sc = naive.e8m0_value(isc[row].tolist()[0])
            assert max(abs(v) for v in k) <= 6 * sc * (1 + 1e-5)
            for i, (gv, wv) in enumerate(zip(got_k, k)):
                assert abs(gv - wv) <= naive.fp4_error_bound(wv, sc) + 1e-4 * sc, (b, j, i, gv, wv)


# ------------------------------------------------------------------------------- top-k
def _index_keys(step, src, blocks, ratio, count):
    caches = step["caches"]
    rows = torch.tensor(_rows_of(blocks, ratio, 16, count), dtype=torch.int64)
    keys = ref.gather_index_k(caches["index_k"][src], caches["index_scale"][src], rows, torch.float32)
    return keys.double().tolist()


def _indexer_query(model, lid, x, pos):
    """The layer's indexer query (library pieces: Linear, RoPE, FP4 fake quant) and weights."""
    from v41graph.model.layers import rope_rotation
    attn = model.layers[lid].attn
    with torch.no_grad():
        qr = attn.q_norm(attn.wq_a(x))
        q, w = attn.indexer.query(x, qr, rope_rotation(pos, attn.inv_freqs))
    return q, w


def _naive_indexer_query(model, lid, x, p):
    """The same query, naive: RoPE(W_qb^idx RMSNorm(W_qa x)) then FP4/ue8m0 per 32."""
    attn = model.layers[lid].attn
    cfg = model.config
    x = x.double().tolist()
    qr = naive.rms_norm(naive.matvec(_w(attn.wq_a), x), attn.q_norm.weight.double().tolist(), attn.q_norm.eps)
    q = naive.matvec(_w(attn.indexer.wq_b), qr)
    inv = attn.inv_freqs.double().tolist()
    di = cfg.index_head_dim
    heads = [naive.rope(q[h * di:(h + 1) * di], p, inv) for h in range(cfg.index_n_heads)]
    return [naive.dequant_fp4_ue8m0(*naive.quant_fp4_ue8m0(hq, 32), 32) for hq in heads]


def _scores(q, w, keys, count):
    vis = [[c < count for c in range(len(keys))]]
    return naive.indexer_scores([q], [w], [keys], vis)[0]


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_topk_of_full_and_reindex_layers_from_the_cache(run, step):
    model, st = run["model"], run[step]
    cfg = model.config
    k, bs, keep = cfg.index_topk, cfg.candidate_block_size, cfg.candidate_topk_blocks
    toks = _tokens_of(st)
    pos_t = st["pos"]
    q2, w2 = _indexer_query(model, 2, st["x2"], pos_t)
    q6, w6 = _indexer_query(model, 6, st["x6"], pos_t)
    q8, w8 = _indexer_query(model, 8, st["x8"], pos_t)
    checked = {2: 0, 6: 0, 8: 0}
    skipped = 0
    pruning_mattered = 0
    q_codes_equal = q_codes_total = 0
    for t, b, p in toks:
        blocks = st["blocks"][b]
        # the library's indexer query is the naive one (up to rare FP4 rounding-boundary flips)
        nq = _naive_indexer_query(model, 8, st["x8"][t], p)
        got_q = q8[t].double().tolist()
        for h in range(len(nq)):
            q_codes_equal += sum(abs(a - c) <= 1e-6 * max(1.0, abs(c)) for a, c in zip(got_q[h], nq[h]))
            q_codes_total += len(nq[h])
        # head weights w = W_w x * Di^-0.5 * Hi^-0.5
        want_w = [v * cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
                  for v in naive.matvec(_w(model.layers[8].attn.indexer.weights_proj), st["x8"][t].double().tolist())]
        assert w8[t].double().tolist() == pytest.approx(want_w, rel=1e-5, abs=1e-6)
        for lid, q, w, ratio in ((2, q2, w2, 2), (6, q6, w6, 1)):
            count = (p + 1) // ratio
            if count == 0:
                assert st["debug"][f"topk_positions.layer{lid}"][t].tolist() == [-1] * k
                continue
            keys = _index_keys(st, lid, blocks, ratio, count)
            sc = _scores(q[t].double().tolist(), w[t].double().tolist(), keys, count)
            if naive.topk_margin(sc, k) < 1e-5:
                skipped += 1
                continue
            want = naive.topk_ascending(sc, k)
            assert st["debug"][f"topk_positions.layer{lid}"][t].tolist() == want, (step, lid, b, p)
            checked[lid] += 1
        # layer 8: candidate blocks of layer 6's scores, then its own scores inside them
        count = p + 1
        keys = _index_keys(st, 6, blocks, 1, count)
        s6 = _scores(q6[t].double().tolist(), w6[t].double().tolist(), keys, count)
        mask = naive.candidate_blocks(s6, count, bs, keep)
        newest = (count - 1) // bs
        others = sorted((max(s6[i:i + bs]) for i in range(0, count, bs) if i // bs != newest),
                        reverse=True)
        block_margin = math.inf
        if len(others) >= keep and not others[keep - 2] == others[keep - 1] == 0.0:
            block_margin = others[keep - 2] - others[keep - 1]   # exact 0.0 ties are unambiguous
        s8 = _scores(q8[t].double().tolist(), w8[t].double().tolist(), keys, count)
        s8_in = [v if m else float("-inf") for v, m in zip(s8, mask)]
        if block_margin < 1e-5 or naive.topk_margin(s8_in, k) < 1e-5:
            skipped += 1
            continue
        want = naive.topk_ascending(s8_in, k)
        assert st["debug"]["topk_positions.layer8"][t].tolist() == want, (step, b, p, mask)
        assert len({i // bs for i in want if i >= 0}) <= keep
        pruning_mattered += want != naive.topk_ascending(s8, k)
        checked[8] += 1
    n = len(toks)
    assert q_codes_equal >= 0.995 * q_codes_total, (q_codes_equal, q_codes_total)
    assert skipped <= 3, skipped            # rows within 1e-5 of a tie are not compared
    starts = sum(1 for _, _, p in toks if p == 0)
    assert checked[2] + checked[6] + checked[8] == 3 * n - starts - skipped
    if step == "prefill":
        # the candidate blocks really prune: without them layer 8 would pick other positions
        assert pruning_mattered >= 10, pruning_mattered


# ------------------------------------------------------------------------------- attention output
def _fp8_row(caches, lid, slot, ring_pos):
    kv = caches["window_kv"][lid][slot, ring_pos].tolist()
    sc = caches["window_scale"][lid][slot, ring_pos].tolist()
    return naive.dequant_fp8_ue8m0(kv, sc, 32)


def _global_row(caches, src, row):
    d2 = caches["global_kv"][src].shape[-1]
    codes = naive.unpack_nibbles(caches["global_kv"][src].view(-1, d2)[row].tolist())
    sbits = caches["global_scale"][src].view(-1, caches["global_scale"][src].shape[-1])[row].tolist()
    return naive.dequant_fp4_e4m3(codes, sbits, 16)


def _naive_attention_output(model, lid, x, p, b, step):
    cfg = model.config
    attn = model.layers[lid].attn
    role = attn.role
    h, hd, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    inv = attn.inv_freqs.double().tolist()
    if role.ratio == 0:   # window layers: plain RoPE with rope_theta
        rd = cfg.qk_rope_head_dim
        assert inv == pytest.approx([cfg.rope_theta ** (-2 * i / rd) for i in range(rd // 2)], rel=1e-6)
    x = x.double().tolist()
    qr = naive.rms_norm(naive.matvec(_w(attn.wq_a), x), attn.q_norm.weight.double().tolist(), attn.q_norm.eps)
    qf = naive.matvec(_w(attn.wq_b), qr)
    q = [naive.rope(qf[i * hd:(i + 1) * hd], p, inv) for i in range(h)]
    caches = step["caches"]
    # window: positions max(0, p-w+1)..p, all still in the ring after this step
    rows = [_fp8_row(caches, lid, b, pos % w) for pos in range(max(0, p - w + 1), p + 1)]
    if role.ratio:
        top = step["debug"][f"topk_positions.layer{role.index_source}"]
        t = [i for i, sb, sp in _tokens_of(step) if sb == b and sp == p][0]
        comp = [c for c in top[t].tolist() if c >= 0]
        all_rows = _rows_of(step["blocks"][b], role.ratio, 16, max(comp) + 1 if comp else 0)
        rows += [_global_row(caches, role.kv_source, all_rows[c]) for c in comp]
    o = naive.sparse_attention([q], [rows], [[True] * len(rows)],
                               attn.attn_sink.double().tolist(), attn.softmax_scale)[0]
    o = [v for i in range(h) for v in naive.rope(o[i], p, inv, inverse=True)]
    g, rank = cfg.o_groups, cfg.o_lora_rank
    wo_a = attn.wo_a.weight.double().view(g, rank, -1).tolist()
    width = len(o) // g
    u = [v for gi in range(g) for v in naive.matvec(wo_a[gi], o[gi * width:(gi + 1) * width])]
    return naive.matvec(_w(attn.wo_b), u)


@pytest.mark.parametrize("lid", [0, 3, 8])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_attention_output_of_the_last_token(run, step, lid):
    model, st = run["model"], run[step]
    for b, n in enumerate(PROMPTS):
        p = n - 1 if step == "prefill" else n
        t = [i for i, sb, sp in _tokens_of(st) if sb == b and sp == p][0]
        want = _naive_attention_output(model, lid, st[f"x{lid}"][t], p, b, st)
        got = st[f"out{lid}"][t].double()
        assert got.abs().max() > 0.1
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)
