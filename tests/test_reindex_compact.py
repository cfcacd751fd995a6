"""Reindex layers score only the candidate source's compact candidate list (cost flat in context).

The candidate source (a Full layer) returns its candidates as a compact list [N, P] of
compressed positions (ascending, -1 padded at the end, P = candidate_topk_blocks x
candidate_block_size clamped to the capacity C), and Reindex layers gather and score only those
P positions (`indexer_topk_candidates`). Before this change the candidate source returned a
[N, C] mask and Reindex layers scored all C positions with the mask ANDed into `visible`; that
formulation is kept here (`_old_*`; the block mask itself stays in reference.py as
`candidate_block_mask`, checked against tests/naive.py) as the specification the new one must
equal.

1. op level, random inputs in float32 and bfloat16 (keys from the FP4 cache, FP4 indexer
   queries, as in the model): same top-k ids, same candidate sets, torch.equal, with exact ties
   constructed on purpose (duplicated key rows and cache blocks, zero head weights, zero keys),
   tokens with fewer visible positions than the pool, with none, with -1 rows, N > 1 over
   sequences of different lengths, C not a multiple of the block size and C < P. "Before"
   includes the old scorer; why the new one sums heads in a fixed order: the score of a
   position must not depend on how many other positions are scored with it (the old
   `.sum(dim=1)` picks its order by shape: last-bit differences in fp32), which
   `test_scores_are_a_function_of_their_own_column` checks.
2. model level: the tiny model, prefill of three sequences of different lengths and batched
   decode steps, with today's selection patched in vs the new one: every layer's top-k and the
   logits torch.equal.
3. flat in context: the same batch with block tables 4 and 256 blocks wide (C = 64 vs 4096 at
   ratio 1): every op the Reindex layer runs (dispatch trace) has the same output shapes, and
   the Reindex indexer's inputs are [N, P] in both, while the Full layers' are [N, C].
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from v41graph.model.attention import Attention
from v41graph.model.metadata import StepContext
from v41graph.model.kv_cache import ModelCaches
from v41graph.model.metadata import build_metadata, positions_of
from v41graph.custom_ops import codecs
from v41graph.custom_ops import reference as ref
from v41graph.model.layer_plan import build_layer_plan

ops = torch.ops.v41graph


# =============================================================================== today's formulation
def _old_indexer_scores(q, weights, keys, visible):
    """reference.indexer_scores as it was before the change (verbatim): the head sum is a
    library reduction, whose order (so the last fp32 bit) depends on the number of columns."""
    logits = torch.einsum("nhd,ncd->nhc", q, keys.to(q.dtype))
    score = (logits.relu() * weights.unsqueeze(-1)).sum(dim=1)
    return score.masked_fill(~visible, float("-inf"))


def _old_indexer_topk(q, weights, key_cache, key_scale, key_rows, visible, topk,
                      candidate_block_size, candidate_keep_blocks):
    """The v41graph::indexer_topk op as it was before the change: (ids, [N, C] mask, scores)."""
    keys = ref.gather_index_k(key_cache, key_scale, key_rows, q.dtype)
    scores = _old_indexer_scores(q, weights, keys, visible)
    ids = ref.topk_ascending(scores, topk)
    if candidate_keep_blocks > 0:
        cand = ref.candidate_block_mask(scores, visible.sum(-1), candidate_block_size,
                                        candidate_keep_blocks) & visible
    else:
        cand = visible.clone()
    return ids, cand, scores


def _old_select(self, x, qr, rotation, ctx):
    """Attention._select as it was before the change (the mask formulation)."""
    role, caches = self.role, ctx.caches
    src = role.kv_source
    capacity = self._compressed_capacity(ctx)
    rows = ctx.compressed_rows(role.ratio, capacity)
    visible_count = (ctx.positions + 1) // role.ratio
    visible = (torch.arange(capacity, device=rows.device) < visible_count.unsqueeze(-1)) & (rows >= 0)
    keep_blocks = 0
    if role.mode == "reindex":
        visible = visible & ctx.candidates[role.candidate_source]
    elif role.is_candidate_source:
        keep_blocks = self.config.candidate_topk_blocks
    q, weights = self.indexer.query(x, qr, rotation)
    ids, cand, _ = _old_indexer_topk(q, weights, caches.index_k[src], caches.index_scale[src], rows,
                                     visible, self.config.index_topk,
                                     self.config.candidate_block_size, keep_blocks)
    if role.is_candidate_source:
        ctx.candidates[role.layer_id] = cand
    return ids


def _compact(mask: torch.Tensor, width: int) -> torch.Tensor:
    """The positions of a [N, C] mask, ascending, -1 padded to `width` (all must fit)."""
    assert int(mask.sum(-1).max()) <= width
    pos = torch.where(mask, torch.arange(mask.shape[1]), -1)
    order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)
    out = pos.gather(1, order)[:, :width]
    return torch.nn.functional.pad(out, (0, width - out.shape[1]), value=-1)


# =============================================================================== 1. op level
def _index_cache(n_rows, di, g, dup_pairs, zero_rows):
    """An FP4 index-key cache of n_rows rows; rows in dup_pairs (dst, src) are copies of src
    (identical codes, so exact score ties), zero_rows are all-zero keys (score 0)."""
    k = torch.randn(n_rows, di, generator=g) * torch.rand(n_rows, 1, generator=g).add(0.25)
    for dst, src in dup_pairs:
        k[dst] = k[src]
    k[zero_rows] = 0
    cache = torch.zeros(n_rows, di // 2, dtype=torch.uint8)
    scale = torch.zeros(n_rows, di // 32, dtype=torch.uint8)
    ref.index_k_write(cache, scale, k, torch.arange(n_rows))
    return cache, scale


def _query(n, heads, di, dtype, g, zero_weight_tokens, zero_head_tokens):
    q = codecs.qdq_fp4_ue8m0(torch.randn(n, heads, di, generator=g), 32).to(dtype)
    w = torch.randn(n, heads, generator=g).to(dtype)
    w[zero_weight_tokens] = 0            # every score 0: all visible positions tie
    q[zero_head_tokens, : heads // 2] = 0
    return q, w


def _make_case(seed, dtype, *, rows_per_block, width, bs, keep, topk, heads=4, di=64):
    """Query tokens of 3 sequences with different lengths and block tables (visible counts
    from 0 to C), their cache rows [N, C] and visibility (causal, rows >= 0), over one shared
    FP4 cache; the Full layer's query (q, w) and the Reindex layer's (q2, w2)."""
    g = torch.Generator().manual_seed(seed)
    c = width * rows_per_block
    n_blocks_cache = 3 * width + 2
    n_rows = n_blocks_cache * rows_per_block
    # block tables: seq 0 uses every entry, with one block repeated (identical keys in two
    # blocks); seq 1 leaves its last entries unallocated (-1); seq 2 has a hole (-1) in the middle
    perm = torch.randperm(n_blocks_cache, generator=g)
    tables = torch.full((3, width), -1, dtype=torch.int64)
    tables[0] = perm[:width]
    if width >= 3:
        tables[0, width - 1] = tables[0, 0]
    half = max(1, width // 2)
    tables[1, :half] = perm[width:width + half]
    tables[2] = perm[2 * width:3 * width]
    if width >= 3:
        tables[2, 1] = -1
    seq_of, pos = [], []
    for b, count in enumerate((c, half * rows_per_block, c)):
        # positions (= visible counts at ratio 1): 0 (nothing visible), small, around P, full
        chosen = {0, 1, 2, min(count, bs * keep - 1), min(count, bs * keep), min(count, bs * keep + 3),
                  count, max(0, count - 1)}
        chosen |= set(torch.randint(0, count + 1, (6,), generator=g).tolist())
        for p in sorted(chosen):
            seq_of.append(b)
            pos.append(p)
    seq_of, visible_count = torch.tensor(seq_of), torch.tensor(pos)
    n = seq_of.shape[0]
    j = torch.arange(c)
    block = tables[seq_of][:, j // rows_per_block]
    rows = torch.where(block >= 0, block * rows_per_block + j % rows_per_block, -1)
    visible = (j < visible_count.unsqueeze(-1)) & (rows >= 0)
    # duplicate rows inside blocks too (ties between positions of one block and across blocks)
    dup = [(int(r2), int(r1)) for r1, r2 in torch.randint(0, n_rows, (n_rows // 4, 2), generator=g)]
    zero = torch.randint(0, n_rows, (n_rows // 8,), generator=g)
    cache, scale = _index_cache(n_rows, di, g, dup, zero)
    special = torch.randperm(n, generator=g)
    q, w = _query(n, heads, di, dtype, g, special[:2], special[2:4])
    q2, w2 = _query(n, heads, di, dtype, g, special[4:6], special[6:8])     # the Reindex layer's
    return dict(q=q, w=w, q2=q2, w2=w2, cache=cache, scale=scale, rows=rows, visible=visible,
                topk=topk, bs=bs, keep=keep)


def _boundary_ties(scores, k):
    """Rows whose k-th and (k+1)-th largest finite scores are equal (the tie rule decides)."""
    s = scores.float().sort(dim=-1, descending=True).values
    if s.shape[1] <= k:
        return 0
    return int(((s[:, k - 1] == s[:, k]) & (s[:, k] > float("-inf"))).sum())


CASES = [   # rows_per_block, table width, candidate block size, keep blocks, top-k
    (4, 6, 4, 3, 4),      # tiny-like: C 24, P 12
    (8, 8, 8, 4, 16),     # C 64, P 32, top-k 16
    (3, 5, 4, 2, 3),      # C 15: not a multiple of the candidate block size
    (4, 3, 4, 8, 5),      # C 12 < keep * bs 32: P clamped to C
    (6, 7, 2, 5, 3),      # small candidate blocks
    (4, 9, 4, 1, 4),      # keep 1: only the pinned newest block
    (16, 4, 8, 3, 40),    # top-k wider than the pool (P 24 < 40)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"rpb{c[0]}-w{c[1]}-bs{c[2]}-keep{c[3]}-k{c[4]}" for c in CASES])
def test_compact_candidates_equal_the_mask_formulation(case, dtype):
    rpb, width, bs, keep, topk = case
    ties = {"full": 0, "reindex": 0, "blocks": 0}
    fewer_than_pool = pruned = empty = 0
    for seed in range(6):
        a = _make_case(seed * 7 + width, dtype, rows_per_block=rpb, width=width, bs=bs, keep=keep, topk=topk)
        c = a["rows"].shape[1]
        pool = min(keep * bs, c)
        assert ref.candidate_pool_size(c, bs, keep) == pool
        args = (a["cache"], a["scale"], a["rows"], a["visible"], topk, bs)
        ids_old, mask_old, scores_old = _old_indexer_topk(a["q"], a["w"], *args, keep)
        ids_new, cand = ops.indexer_topk(a["q"], a["w"], *args, keep)
        # the candidate source: same top-k, same candidate set as a compact ascending list
        assert torch.equal(ids_new, ids_old)
        assert cand.dtype == torch.int64 and cand.shape == (ids_new.shape[0], pool)
        assert torch.equal(cand, _compact(mask_old, pool))
        # a Full layer that is not the candidate source: same top-k, an empty list
        ids0, cand0 = ops.indexer_topk(a["q2"], a["w2"], *args, 0)
        assert torch.equal(ids0, _old_indexer_topk(a["q2"], a["w2"], *args, 0)[0])
        assert cand0.shape == (ids0.shape[0], 0)
        # the Reindex layer: its own query over the candidates only
        r_old, _, r_scores = _old_indexer_topk(a["q2"], a["w2"], a["cache"], a["scale"], a["rows"],
                                               a["visible"] & mask_old, topk, bs, 0)
        cand_rows = torch.where(cand >= 0, a["rows"].gather(1, cand.clamp_min(0)), -1)
        r_new = ops.indexer_topk_candidates(a["q2"], a["w2"], a["cache"], a["scale"], cand_rows, cand, topk)
        assert torch.equal(r_new, r_old)
        # bookkeeping: the situations the test is meant to cover really occur
        ties["full"] += _boundary_ties(scores_old, topk)
        ties["reindex"] += _boundary_ties(r_scores, topk)
        counts = a["visible"].sum(-1)
        fewer_than_pool += int(((counts > 0) & (counts < pool)).sum())
        pruned += int((mask_old.sum(-1) < counts).sum())
        empty += int((counts == 0).sum())
        assert bool((cand[counts == 0] == -1).all())
        n_blocks = -(-c // bs)
        padded = torch.nn.functional.pad(scores_old.float(), (0, n_blocks * bs - c), value=float("-inf"))
        bscore = padded.view(-1, n_blocks, bs).amax(-1)
        if n_blocks > keep:
            ties["blocks"] += _boundary_ties(bscore, keep)
    assert ties["full"] > 0, ties
    if pool > topk:      # else the Reindex top-k takes every candidate: no boundary to tie at
        assert ties["reindex"] > 0, ties
    assert fewer_than_pool > 0 and empty > 0
    if pool < rpb * width:
        assert pruned > 0 and ties["blocks"] > 0, (pruned, ties)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,di", [(4, 64), (32, 128), (5, 32)])
def test_scores_are_a_function_of_their_own_column(dtype, heads, di):
    """The score of a position is the same whether it is scored among all C positions or among
    the P candidates (torch.equal): the dot products of FP4 queries and FP4 keys are exact in
    the accumulator and the head sum has one fixed order. (The old scorer fails this in fp32.)"""
    old_differs = 0
    for case in CASES:
        rpb, width, bs, keep, topk = case
        for seed in range(3):
            a = _make_case(seed, dtype, rows_per_block=rpb, width=width, bs=bs, keep=keep, topk=topk,
                           heads=heads, di=di)
            _, cand = ops.indexer_topk(a["q"], a["w"], a["cache"], a["scale"], a["rows"], a["visible"],
                                       topk, bs, keep)
            listed = cand >= 0
            cand_rows = torch.where(listed, a["rows"].gather(1, cand.clamp_min(0)), -1)
            keys_c = ref.gather_index_k(a["cache"], a["scale"], a["rows"], dtype)
            keys_p = ref.gather_index_k(a["cache"], a["scale"], cand_rows, dtype)
            for score in (ref.indexer_scores, _old_indexer_scores):
                full = score(a["q2"], a["w2"], keys_c, a["visible"]).gather(1, cand.clamp_min(0))
                pool = score(a["q2"], a["w2"], keys_p, listed)
                same = torch.equal(pool[listed], full[listed])
                if score is ref.indexer_scores:
                    assert same, (case, seed)
                else:
                    old_differs += not same
    if dtype == torch.float32 and heads >= 32:
        assert old_differs > 0      # the reason for the fixed order (bf16 rounds it away)


def test_head_sum_is_the_sum():
    x = torch.randn(3, 7, 50, dtype=torch.float64)
    for h in (1, 2, 3, 5, 7):
        got = ref._head_sum(x[:, :h].float())
        assert got.dtype == torch.float32 and got.shape == (3, 50)
        assert torch.allclose(got.double(), x[:, :h].float().double().sum(1), rtol=1e-6, atol=1e-6)


def test_ties_go_to_the_lower_position_through_the_candidate_list():
    """Hand-made: every key identical, so every visible position has the same score; the top-k
    are the lowest candidate positions, as with the mask."""
    di, heads, c, bs, keep, topk = 32, 2, 20, 4, 2, 3
    cache, scale = _index_cache(c, di, torch.Generator().manual_seed(1), [(r, 0) for r in range(1, c)], [])
    q, w = _query(3, heads, di, torch.float32, torch.Generator().manual_seed(2), [], [])
    w = w.abs() + 0.1
    rows = torch.arange(c).expand(3, c)
    visible = torch.arange(c) < torch.tensor([[17], [5], [0]])
    ids, cand = ops.indexer_topk(q, w, cache, scale, rows, visible, topk, bs, keep)
    # all blocks tie: the pinned newest block (16..16 for count 17, 4 for 5) + the lowest other
    assert cand.tolist() == [[0, 1, 2, 3, 16, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1], [-1] * 8]
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2], [-1, -1, -1]]
    cand_rows = torch.where(cand >= 0, rows.gather(1, cand.clamp_min(0)), -1)
    r = ops.indexer_topk_candidates(q, w, cache, scale, cand_rows, cand, 5)
    assert r.tolist() == [[0, 1, 2, 3, 16], [0, 1, 2, 3, 4], [-1] * 5]
    old = _old_indexer_topk(q, w, cache, scale, rows, visible & _old_indexer_topk(
        q, w, cache, scale, rows, visible, topk, bs, keep)[1], 5, bs, 0)[0]
    assert torch.equal(r, old)


def test_fake_shapes():
    """The fake (meta) implementations give the static shapes: [N, P] with P clamped to C."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, w = torch.empty(5, 4, 64), torch.empty(5, 4)
        cache, scale = torch.empty(100, 32, dtype=torch.uint8), torch.empty(100, 2, dtype=torch.uint8)
        for c, want in ((4096, 12), (8, 8), (12, 12)):
            rows = torch.empty(5, c, dtype=torch.int64)
            ids, cand = ops.indexer_topk(q, w, cache, scale, rows, torch.empty(5, c, dtype=torch.bool), 4, 4, 3)
            assert ids.shape == (5, 4) and cand.shape == (5, want) and cand.dtype == torch.int64
            _, none = ops.indexer_topk(q, w, cache, scale, rows, torch.empty(5, c, dtype=torch.bool), 4, 4, 0)
            assert none.shape == (5, 0)
        r = ops.indexer_topk_candidates(q, w, cache, scale, torch.empty(5, 12, dtype=torch.int64),
                                        torch.empty(5, 12, dtype=torch.int64), 4)
        assert r.shape == (5, 4) and r.dtype == torch.int64


# =============================================================================== 2. model level
BLOCK = 16


def _tables(lengths, width, first_block=0):
    """Per sequence the blocks its length needs (distinct, descending ids), padded by -1 later."""
    tables, nxt = [], first_block
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(list(range(nxt + need - 1, nxt - 1, -1)))
        nxt += need
    assert all(len(t) <= width for t in tables)
    return tables


def _steps(model, lengths, decode_steps, width, seed=3):
    """Prefill of len(lengths) sequences in one flat batch, then batched decode steps.
    Returns (logits, debug) of every step."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    final = [n + decode_steps for n in lengths]
    tables = _tables(final, width)
    caches = ModelCaches.allocate(cfg, len(lengths), sum(len(t) for t in tables) + 1, BLOCK)
    seqs = list(range(len(lengths)))
    toks = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in final]
    out = []
    schedule = [(list(lengths), [0] * len(lengths))] + [
        ([1] * len(lengths), [n + i for n in lengths]) for i in range(decode_steps)]
    for qlens, starts in schedule:
        meta = build_metadata(seqs, starts, qlens, tables, width)
        ids = torch.tensor([t for s in seqs for t in toks[s][starts[s]:starts[s] + qlens[s]]])
        model.debug = {}
        try:
            with torch.no_grad():
                logits = model(ids, positions_of(meta), caches, meta, all_logits=True)
            out.append((logits, model.debug))
        finally:
            model.debug = None
    return out


@pytest.mark.parametrize("width", [4, 16])
def test_model_selection_and_logits_equal_todays(tiny_model, width, monkeypatch):
    lengths = [47, 20, 5]
    new = _steps(tiny_model, lengths, 4, width)
    with monkeypatch.context() as m:
        m.setattr(Attention, "_select", _old_select)
        old = _steps(tiny_model, lengths, 4, width)
    plan = build_layer_plan(tiny_model.config)
    reindex = [r.layer_id for r in plan if r.mode == "reindex"]
    assert reindex == [8]
    for step, ((lo, do), (ln, dn)) in enumerate(zip(old, new)):
        for role in plan:
            if role.ratio:
                key = f"topk_positions.layer{role.layer_id}"
                assert torch.equal(dn[key], do[key]), (step, key)
        assert torch.equal(ln, lo), step
    # the Reindex layer really prunes (its top-k differs from scoring every position)
    assert not torch.equal(new[0][1]["topk_positions.layer8"], new[0][1]["topk_positions.layer6"])


def test_compressed_rows_at_equals_the_gathered_full_rows(tiny_model):
    cfg = tiny_model.config
    caches = ModelCaches.allocate(cfg, 3, 40, BLOCK)
    tables = [[7, 3, -1, 9], [5], [12, 2, 30]]
    meta = build_metadata([0, 1, 2], [40, 3, 0], [3, 1, 30], [[b for b in t] for t in tables], 6)
    ctx = StepContext.build(meta, caches, positions_of(meta))
    g = torch.Generator().manual_seed(0)
    for ratio in (1, 2):
        cap = 6 * BLOCK // ratio
        full = ctx.compressed_rows(ratio, cap)
        pos = torch.randint(0, cap, (full.shape[0], 9), generator=g)
        assert torch.equal(ctx.compressed_rows_at(ratio, pos), full.gather(1, pos))


# =============================================================================== 3. flat in context
class _Recorder(TorchDispatchMode):
    """Records (op, output shapes, tensor input shapes) of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat_out = out if isinstance(out, (tuple, list)) else (out,)
        self.calls.append((str(func),
                           tuple(tuple(t.shape) for t in flat_out if isinstance(t, torch.Tensor)),
                           tuple(tuple(t.shape) for t in (*args, *(kwargs or {}).values())
                                 if isinstance(t, torch.Tensor))))
        return out


def _trace(model, width, monkeypatch):
    """One prefill of two sequences with block tables `width` blocks wide: the dispatch trace
    of every scoring layer's attention forward."""
    plan = build_layer_plan(model.config)
    traces = {}
    with monkeypatch.context() as m:
        for role in plan:
            if not role.scores:
                continue
            attn = model.layers[role.layer_id].attn

            def forward(x, ctx, _attn=attn, _lid=role.layer_id):
                with _Recorder() as rec:
                    out = type(_attn).forward(_attn, x, ctx)
                traces[_lid] = rec.calls
                return out
            m.setattr(attn, "forward", forward)
        _steps(model, [30, 9], 0, width)
    return traces


def test_reindex_layer_is_flat_in_the_context(tiny_model, monkeypatch):
    cfg = tiny_model.config
    plan = build_layer_plan(cfg)
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size          # 12
    narrow, wide = _trace(tiny_model, 4, monkeypatch), _trace(tiny_model, 256, monkeypatch)
    n = 30 + 9
    for role in plan:
        if not role.scores:
            continue
        c_narrow, c_wide = 4 * BLOCK // role.ratio, 256 * BLOCK // role.ratio
        if role.mode == "reindex":
            # the Reindex indexer's inputs are [N, P] whatever the block table's width ...
            for trace in (narrow, wide):
                calls = [c for c in trace[role.layer_id] if "indexer_topk" in c[0]]
                assert [c[0] for c in calls] == ["v41graph.indexer_topk_candidates.default"]
                q, w, kc, ks, cand_rows, cand_pos = calls[0][2]
                assert cand_rows == cand_pos == (n, pool)
            # ... and so is everything else the layer computes: the same ops with the same
            # output shapes, none of them as wide as the wide context
            assert [c[:2] for c in narrow[role.layer_id]] == [c[:2] for c in wide[role.layer_id]]
            assert not any(c_wide in shape for c in wide[role.layer_id] for shape in c[1])
        else:
            # Full layers keep scoring every position: [N, C] inputs (and a [N, P] candidate
            # list out of the candidate source)
            for trace, c in ((narrow, c_narrow), (wide, c_wide)):
                calls = [x for x in trace[role.layer_id] if "indexer_topk" in x[0]]
                assert [x[0] for x in calls] == ["v41graph.indexer_topk.default"]
                assert calls[0][2][4] == calls[0][2][5] == (n, c)
                want_p = min(pool, c) if role.is_candidate_source else 0
                assert calls[0][1] == ((n, cfg.index_topk), (n, want_p))
