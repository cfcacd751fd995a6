"""Lightning-indexer score kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  indexer_scores      [N, C] scores of reference.indexer_scores, bit for bit, reading the FP4
                      index keys (E2M1 + UE8M0 per 32) in place from the paged cache: no [N, C, D]
                      gather.
  topk_ascending      reference.topk_ascending's ids (the top-k of every row, ties to the lower
                      column, ascending) in one launch: a bitwise select in registers, no sort.
                      Also picks indexer_topk's candidate blocks (over the block scores).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _TL_DTYPE, _e2m1_decode, _exp2i, _pow2, _wait_for_inputs, pdl


# =============================================================================== lightning indexer
@triton.jit
def _round_as(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest even), returned as fp32. bf16 rounding is spelled out
    on the bits: a plain cast is round-to-nearest-even on CUDA but truncates in Triton's CPU
    interpreter, and the score must not depend on where the kernel runs."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536        # 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, kc_ptr, ks_ptr, rows_ptr, vis_ptr, out_ptr, C,
                           H: tl.constexpr, D2: tl.constexpr, NB: tl.constexpr,
                           BC: tl.constexpr, LOG2H: tl.constexpr, F32_DOT: tl.constexpr,
                           DTYPE: tl.constexpr):
    """Scores of token n (program axis 0) for BC positions (axis 1), reading the FP4 index keys
    (E2M1 + UE8M0 per 32) straight from the paged cache: no [N, C, D] gather. Same arithmetic
    as reference.indexer_scores, step for step: exact fp32 dot products (FP4 x FP4), rounded to
    the query dtype, ReLU, times the head weight in that dtype, the head sum in fp32 in the
    reference's pairwise order (x[:H/2] + x[H/2:], repeated), rounded, -inf where invisible."""
    _wait_for_inputs()
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    cm = c < C
    h = tl.arange(0, H)
    j = tl.arange(0, D2)                                   # byte j holds channels 2j, 2j+1
    qrow = q_ptr + n * H * (2 * D2) + h[:, None] * (2 * D2) + 2 * j[None, :]
    qe = tl.load(qrow)                                     # [H, D2] even channels
    qo = tl.load(qrow + 1)                                 # [H, D2] odd channels
    rows = tl.load(rows_ptr + n * C + c, mask=cm, other=-1).to(tl.int64)
    ok = cm & (rows >= 0)
    packed = tl.load(kc_ptr + rows[:, None] * D2 + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
    sc = tl.load(ks_ptr + rows[:, None] * NB + (j[None, :] // 16), mask=ok[:, None], other=127)
    scale = _exp2i(sc.to(tl.int32) - 127)                  # [BC, D2]
    ke = (_e2m1_decode(packed & 0xF) * scale).to(DTYPE)
    ko = (_e2m1_decode(packed >> 4) * scale).to(DTYPE)
    if F32_DOT:   # fp32 queries (and a check path): IEEE fp32 products, no TF32
        logits = tl.dot(qe.to(tl.float32), tl.trans(ke.to(tl.float32)), input_precision="ieee")
        logits = tl.dot(qo.to(tl.float32), tl.trans(ko.to(tl.float32)), logits, input_precision="ieee")
    else:
        logits = tl.dot(qe, tl.trans(ke))
        logits = tl.dot(qo, tl.trans(ko), logits)         # [H, BC] fp32, exact for FP4 inputs
    w = tl.load(w_ptr + n * H + h).to(tl.float32)
    x = tl.maximum(_round_as(logits, DTYPE), 0.0)
    x = _round_as(x * w[:, None], DTYPE)
    # pairwise head sum: [H, BC] -> [2, H/2, BC], add the halves, repeat
    for i in tl.static_range(LOG2H):
        x = tl.sum(tl.reshape(x, [2, H >> (i + 1), BC]), axis=0)
    score = _round_as(tl.reshape(x, [BC]), DTYPE)
    vis = tl.load(vis_ptr + n * C + c, mask=cm, other=0) != 0
    score = tl.where(vis & ok, score, float("-inf")).to(DTYPE)      # exact: already rounded
    tl.store(out_ptr + n * C + c, score, mask=cm)


def indexer_scores_supported(q, weights, key_cache, key_scale, key_rows, visible) -> bool:
    if q.dim() != 3:
        return False
    n, h, d = q.shape
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and weights.shape == (n, h) and weights.dtype == q.dtype and key_cache.dtype == torch.uint8
            and key_cache.is_contiguous() and key_scale.is_contiguous()
            and key_cache.dim() >= 2 and key_cache.shape[-1] * 2 == d and _pow2(h) and h >= 16
            and d % 32 == 0 and d // 2 >= 16 and _pow2(d // 2) and key_rows.dim() == 2
            and visible.shape == key_rows.shape and key_rows.shape[0] == n)


def indexer_scores(q, weights, key_cache, key_scale, key_rows, visible, *, block_c: int = 64,
                   f32_dot: bool = False):
    """[N, C] scores of reference.indexer_scores(q, weights, gather_index_k(...), visible),
    bit for bit, without materialising the gathered keys. bf16/fp16 queries use the tensor-core
    dot (exact: FP4 x FP4 products, fp32 sums); f32_dot=True computes it in IEEE fp32 instead,
    same result (Triton's CPU interpreter cannot run bf16 dots, so its check uses this)."""
    n, h, d = q.shape
    c = key_rows.shape[1]
    out = torch.empty((n, c), dtype=q.dtype, device=q.device)
    if n == 0 or c == 0:
        return out
    _indexer_scores_kernel[(n, triton.cdiv(c, block_c))](
        q.contiguous(), weights.contiguous(), key_cache.view(torch.uint8), key_scale.view(torch.uint8),
        key_rows.contiguous(), visible.to(torch.uint8).contiguous(), out, c,
        H=h, D2=d // 2, NB=d // 32, BC=block_c, LOG2H=h.bit_length() - 1,
        F32_DOT=f32_dot or q.dtype == torch.float32, DTYPE=_TL_DTYPE[q.dtype], num_warps=4,
        # no fused multiply-add: in fp32 `relu(dot) * w` then the head sum would contract into
        # FMAs (one rounding instead of two) and differ from the reference in the last bit
        enable_fp_fusion=False, launch_pdl=pdl(q.device))
    return out


# =============================================================================== top-k selection
TOPK_MAX_COLUMNS = 16384   # a row lives in one program's registers (32 values per thread)


@triton.jit
def _topk_ascending_kernel(s_ptr, out_ptr, C, K, stride, BC: tl.constexpr, KP: tl.constexpr):
    """Row n (program axis 0) of reference.topk_ascending: the column ids of the K largest of
    scores[n, :C], ties to the lower column, in ascending order, then -1 (for -inf entries and
    padding). The row is held in registers; the K-th largest value is found bit by bit (32
    counting passes over an order-preserving integer key), then the selected columns are
    compacted in column order with a prefix sum: no sort, one launch for all rows. NaN scores
    are not expected: +NaN ranks first, as in the reference's sort, but a NaN with the sign bit
    set ranks below -inf here (the sort puts every NaN first)."""
    _wait_for_inputs()
    n = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BC)
    x = tl.load(s_ptr + n * stride + c, mask=c < C, other=float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)      # -0 as +0: the sort compares them equal
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)     # int32 in the floats' order: negatives' magnitude flipped
    finite = x > float("-inf")
    # the K-th largest key = the largest t with count(key >= t) >= K: its sign first, then its
    # bits from the top (t | bit only grows t, for negative t too)
    kth = tl.where(tl.sum((key >= 0).to(tl.int32), axis=0) >= K, 0, -2147483648)
    for b in tl.static_range(31):
        candidate = kth | (1 << (30 - b))
        kth = tl.where(tl.sum((key >= candidate).to(tl.int32), axis=0) >= K, candidate, kth)
    above = key > kth
    tied = key == kth
    tie_rank = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)     # among ties, in column order
    take = (above | (tied & (tie_rank < K - tl.sum(above.to(tl.int32), axis=0)))) & finite
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + n * K + slot, c.to(tl.int64), mask=take)
    j = tl.arange(0, KP)
    tl.store(out_ptr + n * K + j, tl.full([KP], -1, tl.int64), mask=(j < K) & (j >= tl.sum(take.to(tl.int32), axis=0)))


def topk_ascending_supported(scores: torch.Tensor, k: int) -> bool:
    return (scores.is_cuda and scores.dim() == 2 and scores.dtype == torch.float32 and k >= 1
            and 0 < scores.shape[1] <= TOPK_MAX_COLUMNS and scores.stride(1) == 1)


def topk_ascending(scores: torch.Tensor, k: int) -> torch.Tensor:
    """reference.topk_ascending, the same ids: [N, C] fp32 scores -> [N, k] int64."""
    n, c = scores.shape
    out = torch.empty((n, k), dtype=torch.int64, device=scores.device)
    if n == 0:
        return out
    bc = triton.next_power_of_2(c)
    _topk_ascending_kernel[(n,)](scores, out, c, k, scores.stride(0), BC=bc,
                                 KP=triton.next_power_of_2(k), num_warps=max(4, min(16, bc // 512)),
                                 launch_pdl=pdl(scores.device))
    return out
