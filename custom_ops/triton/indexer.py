"""Lightning-indexer score kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  indexer_scores      [N, C] scores of reference.indexer_scores, bit for bit, reading the FP4
                      index keys (E2M1 + UE8M0 per 32) in place from the paged cache: no [N, C, D]
                      gather. indexer_topk / indexer_topk_candidates select from them in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _TL_DTYPE, _e2m1_decode, _exp2i, _pow2


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
        enable_fp_fusion=False)
    return out
