"""Pure-torch reference implementations of v41graph's custom ops: the specification.

Every function here is static-shape (no `.item()`, no data-dependent shapes) so the same code
runs inside a captured graph. Fast implementations (Triton / NPU) are checked against these.

Index conventions: a row index of -1 means "empty" (skipped on write, score -inf on read).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .codecs import (dequant_fp4_e4m3, dequant_fp4_ue8m0, dequant_fp8_ue8m0, e2m1_decode, e8m0_to_float,
                     quant_fp4_e4m3, quant_fp4_ue8m0, quant_fp8_ue8m0, unpack_fp4)


# ----------------------------------------------------------------------------- cache writes
def masked_row_write(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """dst.view(-1, last)[rows] = values, skipping rows == -1, with static shapes.

    Skipped rows are redirected to the target of the last valid row with that row's value (or,
    when nothing is valid, to row 0 with its own contents), so duplicate targets always carry
    identical values and the write is deterministic on every backend.
    """
    flat = dst.view(-1, dst.shape[-1])
    values = values.reshape(-1, dst.shape[-1]).view(flat.dtype)
    valid = rows >= 0
    n = rows.shape[0]
    # index_select with a 1-element index tensor, not t[0-d tensor] (that would sync the host).
    last_valid = (valid.to(torch.int64) * torch.arange(1, n + 1, device=rows.device)).argmax().view(1)
    any_valid = valid.any()
    fallback_row = torch.where(any_valid, rows.index_select(0, last_valid), torch.zeros_like(rows[:1]))
    fallback_val = torch.where(any_valid, values.index_select(0, last_valid), flat[:1])
    targets = torch.where(valid, rows, fallback_row)
    vals = torch.where(valid.unsqueeze(-1), values, fallback_val)
    flat.index_copy_(0, targets, vals)


def window_kv_write(cache: torch.Tensor, scale: torch.Tensor, kv: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Window KV: FP8 E4M3 with one UE8M0 scale per 32 channels (all channels, RoPE included).
    cache [..., D] uint8 (E4M3 bits), scale [..., D/32] uint8, kv [N, D], slot_mapping [N]."""
    q, s = quant_fp8_ue8m0(kv, 32)
    masked_row_write(cache, slot_mapping, q.view(torch.uint8))
    masked_row_write(scale, slot_mapping, s)


def global_kv_write(cache: torch.Tensor, scale: torch.Tensor, kv: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Main (global) KV: FP4 E2M1 packed + one E4M3 scale per 16 channels (288 B per 512-d row).
    cache [..., D/2] uint8, scale [..., D/16] uint8 (E4M3 bits). A float cache [..., D] (the
    BF16 comparison variant, empty scale) stores the rows as they are."""
    if cache.is_floating_point():
        masked_row_write(cache, slot_mapping, kv.to(cache.dtype))
        return
    q, s = quant_fp4_e4m3(kv, 16)
    masked_row_write(cache, slot_mapping, q)
    masked_row_write(scale, slot_mapping, s.view(torch.uint8))


def index_k_write(cache: torch.Tensor, scale: torch.Tensor, k: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Index keys: FP4 E2M1 packed + one UE8M0 scale per 32 channels (68 B per 128-d row)."""
    q, s = quant_fp4_ue8m0(k, 32)
    masked_row_write(cache, slot_mapping, q)
    masked_row_write(scale, slot_mapping, s)


# ----------------------------------------------------------------------------- cache reads
def _gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    flat = cache.view(-1, *cache.shape[-1:])
    return flat.index_select(0, rows.clamp_min(0).flatten()).view(*rows.shape, cache.shape[-1])


def gather_window_kv(cache: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    q = _gather_rows(cache, rows).view(torch.float8_e4m3fn)
    return dequant_fp8_ue8m0(q, _gather_rows(scale, rows), 32).to(dtype)


def gather_global_kv(cache: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    if cache.is_floating_point():                   # BF16 comparison variant
        return _gather_rows(cache, rows).to(dtype)
    s = _gather_rows(scale, rows).view(torch.float8_e4m3fn)
    return dequant_fp4_e4m3(_gather_rows(cache, rows), s, 16).to(dtype)


def gather_index_k(cache: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    return dequant_fp4_ue8m0(_gather_rows(cache, rows), _gather_rows(scale, rows), 32).to(dtype)


# ----------------------------------------------------------------------------- attention
SPARSE_ATTN_BLOCK = 64


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """Attention of each query over its own list of KV rows, with a per-head sink.

    q [N, H, D]; kv [N, S, D] (the gathered rows, K = V); valid [N, S] bool; sink [H] fp32.
    Online softmax over blocks of 64 rows in list order (as the kernels do): logits in fp32,
    running max starting at -1e30, P cast to q's dtype before P.V with fp32 accumulation, and the
    sink exp(sink - m) added to the denominator only. Returns [N, H, D] in q's dtype.
    """
    n, h, d = q.shape
    qf = q.float()
    m = torch.full((n, h), -1e30, dtype=torch.float32, device=q.device)
    denom = torch.zeros((n, h), dtype=torch.float32, device=q.device)
    acc = torch.zeros((n, h, d), dtype=torch.float32, device=q.device)
    for start in range(0, kv.shape[1], SPARSE_ATTN_BLOCK):
        k_blk = kv[:, start:start + SPARSE_ATTN_BLOCK]
        s = torch.einsum("nhd,nsd->nhs", qf, k_blk.float()) * softmax_scale
        s = s.masked_fill(~valid[:, None, start:start + SPARSE_ATTN_BLOCK], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new.unsqueeze(-1))
        denom = denom * alpha + p.sum(-1)
        pv = torch.einsum("nhs,nsd->nhd", p.to(q.dtype).float(), k_blk.float())
        acc = acc * alpha.unsqueeze(-1) + pv
        m = m_new
    denom = denom + torch.exp(sink.float().unsqueeze(0) - m)
    return (acc / denom.unsqueeze(-1)).to(q.dtype)


def gather_window_or_fresh(window_kv, window_scale, fresh_kv, rows):
    """Window rows [..., M] -> values [..., M, D] in fresh_kv's dtype: row r < R (R = rows of the
    FP8 ring window_kv [slots, W, D]) is ring row r, dequantized (E4M3 x UE8M0 per 32); row
    r >= R is fresh_kv[r - R]. Only the listed ring rows are read; -1 rows give a finite filler
    (ring row 0, or fresh row 0 when the ring is empty) that callers mask out."""
    d = fresh_kv.shape[-1]
    n_ring = window_kv.numel() // d if d else 0
    valid = rows >= 0
    is_ring = valid & (rows < n_ring)
    if n_ring > 0:
        ring = gather_window_kv(window_kv, window_scale, torch.where(is_ring, rows, 0), fresh_kv.dtype)
    if fresh_kv.shape[0] == 0:
        return ring if n_ring > 0 else fresh_kv.new_zeros((*rows.shape, d))
    fresh_rows = torch.where(valid & ~is_ring, rows - n_ring, 0)
    fresh = fresh_kv.index_select(0, fresh_rows.flatten()).view(*rows.shape, d)
    return torch.where(is_ring.unsqueeze(-1), ring, fresh) if n_ring > 0 else fresh


def sparse_attention_over_caches(q, window_kv, window_scale, fresh_kv, window_rows, global_cache,
                                 global_scale, global_rows, sink, softmax_scale):
    """The `sparse_attention` op: gather the window rows (FP8 ring rows dequantized, or this
    call's fresh rows) and the FP4 global rows from the paged cache (window first), then
    `sparse_attention`."""
    win = gather_window_or_fresh(window_kv, window_scale, fresh_kv, window_rows)
    parts, valid = [win.to(q.dtype)], [window_rows >= 0]
    if global_rows.shape[-1] > 0:
        parts.append(gather_global_kv(global_cache, global_scale, global_rows, q.dtype))
        valid.append(global_rows >= 0)
    return sparse_attention(q, torch.cat(parts, 1), torch.cat(valid, 1), sink, softmax_scale)


def apply_rope(x, rotation, inverse):
    """The `rope` op: rotate the interleaved pairs of the LAST 2*pairs channels of x by the
    complex rotations [N, pairs] (conjugated when inverse), in fp32, result in x's dtype; the
    channels before them are copied. rotation broadcasts over any dims between N and D."""
    pairs = rotation.shape[-1]
    head, tail = x[..., : -2 * pairs], x[..., -2 * pairs:]
    xc = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    # conj_physical, not the lazy conj(): inside a compiled graph the op runs where the
    # conjugate bit of a view is not honoured (torch 2.13, CPU: the inverse rotation came out
    # unconjugated); the values are the same either way
    rot = rotation.conj_physical() if inverse else rotation
    while rot.dim() < xc.dim():
        rot = rot.unsqueeze(-2)
    rotated = torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


def rms_norm(x, weight, eps, cast_before_weight=False):
    """The `rms_norm` op: RMSNorm over the last dim, fp32 math, result in x's dtype. Also what
    the model's layers.RMSNorm runs (as plain ops, which the compiler's passes match).
    cast_before_weight: the normalised value is rounded to x's dtype before the weight multiply
    (Llama's `weight * hidden.to(dtype)`; the fp32 product of two bf16/fp16 values is exact, so
    this is that spelling's value whatever the weight's float dtype)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        xf = xf.to(x.dtype).float()
    return (weight.float() * xf).to(x.dtype)


def wkv_rmsnorm(x, wkv, norm_weight, eps):
    """The `fused_wkv_rmsnorm` op: RMSNorm(x @ wkv^T), norm in fp32, result in x's dtype."""
    return rms_norm(torch.nn.functional.linear(x, wkv), norm_weight, eps)


def pool_rmsnorm(kv, score, norm_weight, eps, out_dtype):
    """The `fused_pool_rmsnorm` op: per-channel softmax pooling over each group's r rows
    (kv, score [N, r, D] fp32), cast to out_dtype, then RMSNorm (fp32 math) in out_dtype."""
    latent = (kv * score.softmax(dim=1)).sum(dim=1).to(out_dtype)
    return rms_norm(latent, norm_weight, eps)


def ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype):
    """The `fused_ratio2_compressor` op: the ratio-2 compressor's read side, in the model's op
    order (attention.Compressor.forward). x [N, K] (cast to fp32), wkv / wgate [D, K] fp32,
    state [slots, ring, 2D] fp32 (the compressor state ring), member_rows [N*r] (pool rows:
    ring ++ this call's rows). Returns (latent [N, D] in out_dtype, rows [N, 2D] fp32)."""
    xf = x.float()
    rows = torch.cat([torch.nn.functional.linear(xf, wkv), torch.nn.functional.linear(xf, wgate)], dim=-1)
    pool = torch.cat([state.view(-1, state.shape[-1]), rows], dim=0)
    member = pool.index_select(0, member_rows).view(rows.shape[0], -1, pool.shape[-1])
    kv, score = member.chunk(2, dim=-1)
    return pool_rmsnorm(kv, score, norm_weight, eps, out_dtype), rows


def ratio2_compressor_update(x, wkv, wgate, state, member_rows, state_rows, norm_weight, eps, out_dtype):
    """The `fused_ratio2_compressor_update` op: ratio2_compressor, then the state-ring write
    the model does after it (rows to state_rows, -1 skipped). Reads the ring before writing it,
    as Compressor.forward does. Returns the latent [N, D]."""
    if tuple(state_rows.shape) != (x.shape[0],):
        raise ValueError(f"state_rows must hold one ring row (or -1) per token: shape "
                         f"{tuple(state_rows.shape)}, expected ({x.shape[0]},)")
    latent, rows = ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype)
    masked_row_write(state, state_rows, rows)
    return latent


# ----------------------------------------------------------------------------- indexer
def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                   visible: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer score I[n, c] = sum_h w[n, h] * relu(q[n, h] . k[n, c]).

    q [N, Hi, Di], weights [N, Hi], keys [N, C, Di] (each query's gathered keys), visible [N, C].
    Computed in q's dtype like the reference (bf16 there), the head sum accumulated in fp32;
    invisible entries are -inf.

    Each entry depends on its own column only, not on C: the head sum has one fixed order
    (`_head_sum`), and with FP4 queries and keys (the model's fake-quant points) the dot
    products are exact in the GEMM's fp32 accumulator, whatever order it picks (each product is
    an integer <= 144 times 2^(scale exponents), 128 of them fit 24 bits while the per-32
    scales of a query/key pair span at most 2^9). So a Reindex
    layer scoring its P candidates gets bit for bit the scores it would get among all C
    positions. (A library `.sum(dim=1)` picks its order by shape: in fp32 the last bit of a
    position's score then depended on the block table's width. In bf16 the fp32 accumulator
    is rounded away; the golden conformance tests are bit-exact either way.) With
    fake_quant=False the queries are not FP4 and the fp32 GEMM may still round differently
    per width in the last bit.
    """
    return finish_indexer_scores(indexer_head_partial(q, weights, keys).unsqueeze(1), visible, q.dtype)


def indexer_head_partial(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The fp32 head sum of `indexer_scores` over the heads given [N, C], before its cast and
    mask: the whole sum for all heads, or one tensor-parallel rank's share."""
    logits = torch.einsum("nhd,ncd->nhc", q, keys.to(q.dtype))
    return _head_sum(logits.relu() * weights.unsqueeze(-1))


def finish_indexer_scores(parts: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scores from head partials [N, R, C] (R = 1: all heads; R = tp: rank r's sum over heads
    r, r + tp, ..., which are the pairwise sum's partials at width R): the rest of the pairwise
    sum, cast to the query dtype, -inf where invisible."""
    return _head_sum(parts).to(dtype).masked_fill(~visible, float("-inf"))


def _head_sum(x: torch.Tensor) -> torch.Tensor:
    """x [N, H, C] -> [N, C]: the sum over heads in fp32, in one fixed pairwise order (halves
    added elementwise, zero-padded to even), so each entry is a function of its own column
    only, whatever C is and on every backend (a library reduction picks its order by shape)."""
    x = x.float()
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            x = torch.nn.functional.pad(x, (0, 0, 0, 1))
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0]


def candidate_pool_size(capacity, block_size: int, keep_blocks: int):
    """Width P of the compact candidate list: keep_blocks * block_size positions, clamped to the
    capacity C (a static shape per graph); 0 when no candidates are kept. Works on SymInts."""
    if keep_blocks <= 0:
        return 0
    pool = keep_blocks * block_size
    return torch.sym_min(pool, capacity) if isinstance(capacity, torch.SymInt) else min(pool, capacity)


def _block_scores(scores: torch.Tensor, visible_count: torch.Tensor, block_size: int) -> torch.Tensor:
    """[N, n_blocks] fp32: the max over each `block_size` consecutive compressed positions, the
    block holding the newest visible position pinned to +inf."""
    n, c = scores.shape
    n_blocks = (c + block_size - 1) // block_size
    padded = torch.nn.functional.pad(scores.float(), (0, n_blocks * block_size - c), value=float("-inf"))
    block_score = padded.view(n, n_blocks, block_size).amax(-1)
    newest = ((visible_count - 1).clamp_min(0) // block_size).unsqueeze(-1)
    has_visible = (visible_count > 0).unsqueeze(-1)
    block_ids = torch.arange(n_blocks, device=scores.device).unsqueeze(0)
    return torch.where((block_ids == newest) & has_visible, float("inf"), block_score)


def _top_blocks(scores: torch.Tensor, visible_count: torch.Tensor, block_size: int,
                keep_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block selection behind the candidates: `_block_scores`, stable descending sort
    (ties to the lower block id), first min(keep_blocks, n_blocks). Returns (block ids [N, k],
    kept [N, k] bool: the block's score is finite or pinned)."""
    block_score = _block_scores(scores, visible_count, block_size)
    k = min(keep_blocks, block_score.shape[1])
    order = torch.sort(block_score, dim=-1, descending=True, stable=True).indices[:, :k]
    return order, block_score.gather(1, order) > float("-inf")


def candidate_block_mask(scores: torch.Tensor, visible_count: torch.Tensor, block_size: int,
                         keep_blocks: int) -> torch.Tensor:
    """Hierarchical candidates as a mask: block score = max over `block_size` consecutive
    compressed positions; the block holding the newest visible position is pinned to +inf; keep
    the top-`keep_blocks` blocks with a finite (or pinned) score. Returns a [N, C] bool mask.
    (The model uses the compact form, `candidate_positions`; this is its specification.)"""
    n, c = scores.shape
    n_blocks = (c + block_size - 1) // block_size
    order, kept = _top_blocks(scores, visible_count, block_size, keep_blocks)
    keep = torch.zeros((n, n_blocks), dtype=torch.bool, device=scores.device)
    keep.scatter_(1, order, kept)
    return keep.repeat_interleave(block_size, dim=1)[:, :c]


def candidate_positions(scores: torch.Tensor, visible: torch.Tensor, block_size: int,
                        keep_blocks: int, select=None) -> torch.Tensor:
    """The compact candidate list: the positions of `candidate_block_mask(scores,
    visible.sum(-1), block_size, keep_blocks) & visible`, in ascending order, -1 padded at the
    end, fixed width P = candidate_pool_size(C, block_size, keep_blocks) (the kept blocks hold
    at most P positions below C, so nothing is cut off).

    scores [N, C] (-inf where invisible), visible [N, C] bool -> [N, P] int64.
    Built from the k <= keep_blocks chosen blocks, so after the block top-k it costs O(P). The
    kept blocks in ascending order are `topk_ascending` over the block scores (the same stable
    descending order, then ascending ids, -1 for blocks that are not kept); `select` computes
    it (a kernel's; default topk_ascending).
    """
    n, c = scores.shape
    width = candidate_pool_size(c, block_size, keep_blocks)
    if width == 0:
        return torch.full((n, 0), -1, dtype=torch.int64, device=scores.device)
    block_score = _block_scores(scores, visible.sum(-1), block_size)
    n_blocks = block_score.shape[1]
    blocks = (select or topk_ascending)(block_score, min(keep_blocks, n_blocks))
    blocks = torch.where(blocks >= 0, blocks, n_blocks)                       # ascending, unkept last
    pos = (blocks.unsqueeze(-1) * block_size
           + torch.arange(block_size, device=scores.device)).flatten(1)       # [N, k*bs] ascending
    ok = (blocks < n_blocks).repeat_interleave(block_size, dim=1) & (pos < c)
    ok = ok & visible.gather(1, pos.clamp_max(c - 1))
    pos = torch.where(ok, pos, -1)
    order = torch.argsort((~ok).to(torch.int8), dim=-1, stable=True)          # -1 to the end
    return pos.gather(1, order)[:, :width]


def topk_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k column ids per row, ties to the lower id, re-sorted ascending; entries whose score
    is -inf become -1 and go to the end. Fixed width k (padded with -1)."""
    n, c = scores.shape
    width = min(k, c)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :width]
    finite = scores.gather(1, order) > float("-inf")
    big = torch.iinfo(torch.int64).max
    ids = torch.where(finite, order, torch.full_like(order, big)).sort(dim=-1).values
    ids = torch.where(ids == big, torch.full_like(ids, -1), ids)
    if width < k:
        ids = torch.nn.functional.pad(ids, (0, k - width), value=-1)
    return ids


def select_from_scores(scores: torch.Tensor, visible: torch.Tensor, topk: int, block_size: int,
                       keep_blocks: int):
    """indexer_topk's selection from its [N, C] scores: (top-k ids, compact candidate list)."""
    return (topk_ascending(scores, topk),
            candidate_positions(scores, visible, block_size, keep_blocks))


def listed_candidates(candidate_rows: torch.Tensor, candidate_positions: torch.Tensor) -> torch.Tensor:
    """Entries of a compact candidate list that name a real cache row (the rest are padding)."""
    return (candidate_rows >= 0) & (candidate_positions >= 0)


def topk_over_candidates(scores: torch.Tensor, positions: torch.Tensor, k: int,
                         select=None) -> torch.Tensor:
    """`topk_ascending` over the columns of a compact candidate list, mapped back to compressed
    positions: scores [N, P] (-inf where the entry is empty), positions [N, P] ascending with -1
    at the end -> [N, k] positions, ascending, -1 padded.

    Equal to `topk_ascending` over the full [N, C] scores with -inf outside the candidates: the
    list is in ascending position order, so column order is position order, the stable sort
    gives ties to the lower position in both, and mapping ascending columns through an
    ascending list keeps the result ascending. `select` computes topk_ascending's ids (a
    kernel's; default topk_ascending)."""
    n, p = positions.shape
    if p == 0:
        return torch.full((n, k), -1, dtype=torch.int64, device=positions.device)
    cols = (select or topk_ascending)(scores, k)
    return torch.where(cols >= 0, positions.gather(1, cols.clamp_min(0)), -1)


# ----------------------------------------------------------------------------- Engram
def engram_hash_ids(
    compressed_ids: torch.Tensor,
    history: torch.Tensor,
    multipliers: torch.Tensor,
    primes: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """Table row ids for every token and Engram layer.

    compressed_ids [...]            current tokens (already through the map)
    history        [..., N-1]       previous ids: history[..., j] is the token j+1 positions
                                    back (the pad's id before the sequence start;
                                    v41graph/model/engram_hash.py builds it)
    multipliers    [L, N] or [N]    int64
    primes         [L, N-1, H] or [N-1, H]
    offsets        [L, (N-1)*H] or [(N-1)*H]
    returns        [..., L, (N-1)*H] (or [..., (N-1)*H] for 1-D multipliers)

    For order n: h_n = XOR_{k<n} x_{t-k} * m_k, then for each head prime p:
    row = (h_n mod p) + offset.  Column order is order-major, head-minor.
    Note h_n >= 0 always (ids >= 0, m > 0 and m * id < 2^63 by construction),
    so floor-mod vs truncating mod cannot differ; torch.remainder is used to
    match the reference's numpy ``%`` regardless.
    """
    single = multipliers.dim() == 1
    if single:
        multipliers, primes, offsets = multipliers[None], primes[None], offsets[None]
    n_layers, n_max = multipliers.shape
    _, n_orders, n_heads = primes.shape
    assert n_orders == n_max - 1 and history.shape[-1] == n_max - 1

    # x[..., k] = id of the token k back (k = 0 is the current token).
    x = torch.cat([compressed_ids.unsqueeze(-1), history], dim=-1).to(torch.int64)
    # prod[..., l, k] = x_{t-k} * m_{l,k}
    prod = x.unsqueeze(-2) * multipliers.to(x.device)
    # Rolling XOR: order n uses products k = 0..n-1.
    h = prod[..., 0]
    hashes = []
    for k in range(1, n_max):  # static loop over orders, not over tokens
        h = torch.bitwise_xor(h, prod[..., k])
        hashes.append(h)
    h = torch.stack(hashes, dim=-1)  # [..., L, N-1]
    rows = torch.remainder(h.unsqueeze(-1), primes.to(x.device))  # [..., L, N-1, H]
    rows = rows.flatten(-2) + offsets.to(x.device)  # [..., L, (N-1)*H]
    return rows[..., 0, :] if single else rows


def engram_gather(table: torch.Tensor, scale: torch.Tensor, row_ids: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor:
    """Rows of an FP8 E4M3 table with one E8M0 scale per 32, dequantized and concatenated:
    table [R, Dh], scale [R, Dh/32], row_ids [N, M] -> [N, M*Dh]."""
    rows = table.index_select(0, row_ids.flatten())
    rows = (rows.view(torch.float8_e4m3fn) if rows.dtype == torch.uint8 else rows).float()
    s = e8m0_to_float(scale.index_select(0, row_ids.flatten()))
    vals = (rows.unflatten(-1, (-1, 32)) * s.unsqueeze(-1)).flatten(-2)
    return vals.to(dtype).view(*row_ids.shape[:-1], -1)


# ----------------------------------------------------------------------------- mHC
def _sum_in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim, keepdim=True) added left to right. torch's CPU kernel adds these short rows
    (hc = 4) in this order too (so DeepSeek's golden vectors are unchanged); spelled out, the
    order is part of the specification and the GPU kernel reproduces it bit for bit."""
    total = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        total = total + x.select(dim, i)
    return total.unsqueeze(dim)


def mhc_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                 iters: int, eps: float):
    """mHC coefficients from the predictor's mixes (MODEL.md §3), fp32:
    mixes [..., (2+hc)*hc] -> pre [..., hc], post [..., hc], comb [..., hc, hc].
      pre  = sigmoid(m[:hc]*s0 + b) + eps;  post = 2*sigmoid(m[hc:2hc]*s1 + b)
      comb = Sinkhorn(softmax_rows(m[2hc:]*s2 + b) + eps), the softmax as exp(x - max) / sum:
             a column normalisation, then
             iters-1 rounds of (row, column) normalisation, each sum + eps in the divisor."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    # The row softmax spelled as DeepSeek's reference computes it: torch.softmax differs from
    # exp(x - max) / sum in the last bits of many entries, which flips bf16 values downstream.
    comb = (comb - comb.amax(-1, keepdim=True)).exp()
    comb = comb / _sum_in_order(comb, -1) + eps
    comb = comb / (_sum_in_order(comb, -2) + eps)
    for _ in range(iters - 1):
        comb = comb / (_sum_in_order(comb, -1) + eps)
        comb = comb / (_sum_in_order(comb, -2) + eps)
    return pre, post, comb


def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = sum_c pre_c X_c in fp32 (streams [..., hc, d], pre [..., hc]), cast to the streams'
    dtype."""
    return torch.sum(pre.unsqueeze(-1) * streams.float(), dim=-2).to(streams.dtype)


def mhc_pre(streams: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
            base: torch.Tensor, hc: int, iters: int, hc_eps: float, norm_eps: float):
    """A sub-layer's mHC input side (MODEL.md §3): its input, the collapse of the streams
    [..., hc, d] with the previous predictor's pre_prev [..., hc], and its own predictor's
    (pre, post, comb): mhc_sinkhorn of mhc_mixes."""
    return (mhc_collapse(streams, pre_prev), *mhc_predict(streams, fn, scale, base, hc, iters, hc_eps, norm_eps))


def mhc_predict(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                iters: int, hc_eps: float, norm_eps: float):
    """A sub-layer's own predictor alone (pre, post, comb): mhc_pre without the collapse. It
    does not read pre_prev, so it can run beside the sub-layer (passes/mhc_side_stream.py)."""
    return mhc_sinkhorn(mhc_mixes(streams, fn, norm_eps), scale, base, hc, iters, hc_eps)


def mhc_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The predictor's mixes [..., (2+hc)*hc]: (X flattened, fp32) @ fn^T times
    rsqrt(mean(X^2) + norm_eps)."""
    x = streams.flatten(-2).float()
    rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(x, fn) * rsqrt


def mhc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sub-layer's mHC expand: X'_c = post_c * F(x) + sum_c' comb[c', c] X_c' in fp32, in
    out's dtype (out [..., d], streams [..., hc, d], post [..., hc], comb [..., hc, hc])."""
    y = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * streams.unsqueeze(-2), dim=-3)
    return y.to(out.dtype)


# ----------------------------------------------------------------------------- quantized GEMMs
# DeepSeek's reference arithmetic for the checkpoint's FP8 / FP4 weights: the activation is
# quantized to FP8 E4M3 per 32 along K with a power-of-two (UE8M0) scale, and the GEMM sums
# fp32 partials per 32-wide K block times both scales, cast to the output dtype at the end.
QUANT_BLOCK = 32


def blockwise_gemm(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor,
                   w_scale: torch.Tensor) -> torch.Tensor:
    """sum_k fp32(A_k . W_k^T) * a_scale_k * w_scale_k over 32-wide K blocks, in block order.

    a_q [M, K] and w_q [N, K] hold the quantized values as fp32; a_scale [M, K/32];
    w_scale [N, K/32] (already expanded to rows). Scales are powers of two, so only the
    partial sums and the running fp32 add round.
    """
    m, k = a_q.shape
    nk = k // QUANT_BLOCK
    a_blocks = a_q.view(m, nk, QUANT_BLOCK).transpose(0, 1)
    w_blocks = w_q.view(w_q.shape[0], nk, QUANT_BLOCK).transpose(0, 1)
    partials = torch.bmm(a_blocks, w_blocks.transpose(1, 2))        # [nk, M, N]
    scales = a_scale.t().unsqueeze(-1) * w_scale.t().unsqueeze(1)   # [nk, M, N]
    acc = torch.zeros((m, w_q.shape[0]), dtype=torch.float32, device=a_q.device)
    for i in range(nk):
        acc = acc + partials[i] * scales[i]
    return acc


def fp8_weight_values(weight: torch.Tensor, scale: torch.Tensor):
    """FP8 E4M3 weight bytes [N, K] + E8M0 per 32x32 block [ceil(N/32), K/32] -> (codes as
    fp32 [N, K], scales expanded to one row per output [N, K/32])."""
    s = e8m0_to_float(scale).repeat_interleave(QUANT_BLOCK, 0)[: weight.shape[0]]
    return weight.view(torch.float8_e4m3fn).float(), s


def fp4_weight_values(weight: torch.Tensor, scale: torch.Tensor):
    """FP4 E2M1 weight packed [N, K/2] (even element in the low nibble) + E8M0 per 32 along K
    [N, K/32] (the MXFP4 layout) -> (codes as fp32 [N, K], scales [N, K/32])."""
    return e2m1_decode(unpack_fp4(weight)), e8m0_to_float(scale)


def quantized_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] times a quantized weight (fp32 codes w_q [N, K], row scales [N, K/32]) in the
    reference arithmetic; result [..., N] in out_dtype."""
    shape = x.shape
    a_q, a_s = quant_fp8_ue8m0(x.reshape(-1, shape[-1]), QUANT_BLOCK)
    y = blockwise_gemm(a_q.float(), e8m0_to_float(a_s), w_q, w_scale)
    return y.to(out_dtype).view(*shape[:-1], w_q.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The checkpoint's FP8 block-scaled projection in the reference arithmetic."""
    return quantized_linear(x, *fp8_weight_values(weight, scale), out_dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None):
    """The clamped SwiGLU in fp32, times the routing weight (before w2) when given."""
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = weight * h
    return h


def swiglu_in_dtype(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert's activation (the swiglu op): the clamped SwiGLU of the two
    projections in fp32, cast back to their dtype (what w2 reads)."""
    return swiglu(gate.float(), up.float(), limit).to(gate.dtype)


def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int,
             route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router (MODEL.md §6): scores = sqrt(softplus(x @ weight^T)) in fp32; the top-k
    of scores + bias (the bias only selects; ties to the lower expert id: a stable sort); their
    scores normalized to sum 1 and times route_scale. -> (weights [N, topk] fp32, chosen
    [N, topk] int64, best first)."""
    scores = F.softplus(F.linear(x.float(), weight.float())).sqrt()
    chosen = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :topk]
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * route_scale
    return weights, chosen


def pairs_by_expert(weights: torch.Tensor, chosen: torch.Tensor, n_experts: int):
    """The N*topk (token, expert) pairs of a routing grouped by expert, with static shapes and
    no host sync (the grouped MoE paths). Returns (ids [N, topk]: each token's experts in
    ascending order, the order the loop adds them; pair p = token * topk + slot of that order;
    pair_w [N*topk] fp32: each pair's routing weight; perm [N*topk]: the pairs sorted by expert,
    stable; offs [n_experts] int32: cumulative group ends, from a searchsorted rather than a
    bincount, so no data-dependent shape). Experts >= n_experts sort past the last group."""
    ids, order = chosen.sort(dim=-1, stable=True)     # equal ids (held elsewhere) keep slot order
    pair_w = weights.gather(1, order).reshape(-1).to(torch.float32)
    flat = ids.reshape(-1)
    perm = torch.argsort(flat, stable=True)
    offs = torch.searchsorted(flat[perm], torch.arange(n_experts, device=chosen.device, dtype=flat.dtype),
                              right=True, out_int32=True)
    return ids, pair_w, perm, offs


def dense_routing_weights(weights: torch.Tensor, chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[N, n_experts] fp32: each token's routing weight (fp32) per expert, 0 where it did not
    pick it; chosen == n_experts (an expert held elsewhere) lands in a dropped column: what
    the MoE loop multiplies every expert's output by."""
    dense = torch.zeros(chosen.shape[0], n_experts + 1, dtype=torch.float32, device=chosen.device)
    return dense.scatter(1, chosen, weights)[:, :n_experts]


def mxfp4_moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, w13: torch.Tensor,
              s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float) -> torch.Tensor:
    """[N, d] fp32: sum over each token's chosen experts of weight * expert(x), every expert in
    the reference arithmetic exactly as moe.Expert computes it (gate and up rounded to x's
    dtype, h = weight * SwiGLU rounded to x's dtype, w2's output in x's dtype), summed in fp32
    in ascending expert order. Stacked MXFP4 experts: w13 [E, 2I, d/2] (w1 rows, then w3 rows)
    + s13 [E, 2I, d/32]; w2 [E, d, I/2] + s2 [E, d, I/32]. chosen [N, topk] indexes the stack;
    the value E marks an expert held elsewhere (skipped). The specification is the loop: every
    expert runs on every token with a zero weight for tokens that did not pick it."""
    n_exp, inter = w13.shape[0], w13.shape[1] // 2
    dense_w = dense_routing_weights(weights, chosen, n_exp)
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(n_exp):
        gate = quantized_linear(x, *fp4_weight_values(w13[e, :inter], s13[e, :inter]), x.dtype).float()
        up = quantized_linear(x, *fp4_weight_values(w13[e, inter:], s13[e, inter:]), x.dtype).float()
        h = swiglu(gate, up, limit, dense_w[:, e:e + 1]).to(x.dtype)
        y = y + quantized_linear(h, *fp4_weight_values(w2[e], s2[e]), x.dtype)
    return y
