"""mxfp4_moe on CUDA: the routed experts of one MoE over their stacked MXFP4 checkpoint bytes
(imported lazily by cuda_impls.py).

  routing (torch)  reference.pairs_by_expert: the N*topk (token, expert) pairs sorted by
                   expert, group ends as a fixed [E] int32 tensor (no host sync: captures)
  x quantized     once, per 32 to FP8 (quant_gemm's row kernel; bf16 holds the values exactly),
                   not once per output tile: at decode sizes the redundant quantization cost
                   about as many instructions per weight code as the FP4 decode itself
  gate_up kernel   grid (I/BN, E): a program loops over its expert's pairs BM at a time, loads
                   the tokens' quantized rows (gathered through the pair -> token index),
                   dequantizes the FP4 tiles of w1 and w3 (same rows) to bf16 and runs two dots;
                   the epilogue rounds gate and up to x's dtype as the reference's Linear does,
                   applies the clamped SwiGLU and the routing weight, rounds h to x's dtype and
                   stores it quantized per 32 (w2's input quantization, done once here) as
                   bf16, which holds every quantized value exactly (fp16 would not: a block's
                   largest value can round up past 65504). An expert nobody picked reads no
                   weights.
  down kernel      grid (d/BN, E): the quantized h times w2; each row is stored at its
                   (token, slot) position (x's dtype, as the reference's w2 returns)
  rows-first       the same two kernels with the weight rows as the MMA's M side and an
                   expert's few tokens as its N side (_gate_up_rows_kernel, _down_rows_kernel:
                   a 64-row weight tile fills a Hopper wgmma, whose A operand comes from the
                   registers the FP4 decode wrote; the tokens-first kernels' 16-token tiles
                   run mma.sync). They read the even and odd columns as two halves (no
                   interleave in registers) and the scales as int32 words.
  combine (torch)  the topk slots summed in fp32 in ascending expert order: the loop's order.

Pairs routed to an expert held elsewhere (chosen == E) sort past the last group and stay 0.
The tile table comes from scripts/bench_ops.py --only quant on the H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import pairs_by_expert
from .common import (_FLOAT_DTYPES, _TL_DTYPE, _bf16_column_halves, _fp4_weight_halves, _fp4_weight_tile,
                     _qdq_fp8_blocks)
from .quant_gemm import _block_k, fp8_capable, quantize_rows


@triton.jit
def _group_bounds(offs_ptr, e):
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    return start, tl.load(offs_ptr + e)


@triton.jit
def _swiglu_h(gate, up, pw, limit, HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              X_DTYPE: tl.constexpr):
    """The gate_up epilogue on [BM pairs, BN] fp32 sums: gate and up rounded to x's dtype as the
    reference's Linear returns them, the clamped SwiGLU, the routing weight pw [BM], h rounded to
    x's dtype and quantized per 32 columns (w2's input quantization, done once here); fp32
    values that bf16 holds exactly."""
    gate = gate.to(X_DTYPE).to(tl.float32)
    up = up.to(X_DTYPE).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    h = (pw[:, None] * h).to(X_DTYPE).to(tl.float32)
    return _qdq_fp8_blocks(h, BM, BN)                # BN is a multiple of 32 and so is I


@triton.jit
def _gate_up_kernel(xq_ptr, tok_ptr, pw_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, D, I, limit,
                    HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    X_DTYPE: tl.constexpr):
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < I
    gate_rows = e.to(tl.int64) * 2 * I + n           # w1 rows of expert e in the [E*2I] stack
    up_rows = gate_rows + I                          # w3 rows
    for m0 in range(start, end, BM):
        r = m0 + tl.arange(0, BM)
        r_mask = r < end
        tok = tl.load(tok_ptr + r, mask=r_mask, other=0).to(tl.int64)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(xq_ptr + tok[:, None] * D + k[None, :], mask=r_mask[:, None], other=0.0)
            acc_g = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, s_ptr, gate_rows, n_mask, k0, D, BN, BK)), acc_g)
            acc_u = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, s_ptr, up_rows, n_mask, k0, D, BN, BK)), acc_u)
        pw = tl.load(pw_ptr + r, mask=r_mask, other=0.0)
        h = _swiglu_h(acc_g, acc_u, pw, limit, HAS_LIMIT, BM, BN, X_DTYPE)
        tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(tl.bfloat16),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(h_ptr, dest_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, D, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < D
    rows = e.to(tl.int64) * D + n                    # w2 rows of expert e in the [E*d] stack
    for m0 in range(start, end, BM):
        r = m0 + tl.arange(0, BM)
        r_mask = r < end
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            k = k0 + tl.arange(0, BK)
            a = tl.load(h_ptr + r[:, None].to(tl.int64) * I + k[None, :], mask=r_mask[:, None], other=0.0)
            a = a.to(tl.bfloat16)                     # quantized by the gate_up epilogue, bf16
            acc = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, s_ptr, rows, n_mask, k0, I, BN, BK)), acc)
        dest = tl.load(dest_ptr + r, mask=r_mask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[:, None] * D + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _dot_halves(w_ptr, s_ptr, rows, row_mask, k0, K, a_words_ptr, a_rows, a_mask, acc,
                BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """acc [BN, BT] += W[rows, k0:k0+BK] . A[a_rows, k0:k0+BK]^T, the weight rows as the MMA's
    M side: its even and odd columns against A's (bf16, read as int32 words) in two dots."""
    w_even, w_odd = _fp4_weight_halves(w_ptr, s_ptr, rows, row_mask, k0, K, BN, BK, SCALE_WORDS)
    a_even, a_odd = _bf16_column_halves(a_words_ptr, a_rows, a_mask, k0, K, BT, BK)
    acc = tl.dot(tl.reshape(w_even, (BN, BK // 2)), tl.trans(a_even), acc)
    return tl.dot(tl.reshape(w_odd, (BN, BK // 2)), tl.trans(a_odd), acc)


@triton.jit
def _gate_up_rows_kernel(xw_ptr, tok_ptr, pw_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, D, I, limit,
                         HAS_LIMIT: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         X_DTYPE: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """_gate_up_kernel with the weight rows as the MMA's M side (h^T [BN, BT] = W . x^T), so
    a 64-row weight tile fills a wgmma whatever an expert's few tokens (decode); x as int32
    words of its quantized bf16 values."""
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < I
    gate_rows = e.to(tl.int64) * 2 * I + n
    up_rows = gate_rows + I
    for m0 in range(start, end, BT):
        r = m0 + tl.arange(0, BT)
        r_mask = r < end
        tok = tl.load(tok_ptr + r, mask=r_mask, other=0).to(tl.int64)
        acc_g = tl.zeros([BN, BT], dtype=tl.float32)
        acc_u = tl.zeros([BN, BT], dtype=tl.float32)
        for k0 in range(0, D, BK):
            acc_g = _dot_halves(w_ptr, s_ptr, gate_rows, n_mask, k0, D, xw_ptr, tok, r_mask, acc_g,
                                BN, BT, BK, SCALE_WORDS)
            acc_u = _dot_halves(w_ptr, s_ptr, up_rows, n_mask, k0, D, xw_ptr, tok, r_mask, acc_u,
                                BN, BT, BK, SCALE_WORDS)
        pw = tl.load(pw_ptr + r, mask=r_mask, other=0.0)
        h = _swiglu_h(tl.trans(acc_g), tl.trans(acc_u), pw, limit, HAS_LIMIT, BT, BN, X_DTYPE)
        tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(tl.bfloat16),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_rows_kernel(hw_ptr, dest_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, D, I,
                      BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """_down_kernel with the weight rows as the MMA's M side (out^T [BN, BT] = W2 . h^T); h as
    int32 words of its bf16 values."""
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < D
    rows = e.to(tl.int64) * D + n
    for m0 in range(start, end, BT):
        r = m0 + tl.arange(0, BT)
        r_mask = r < end
        acc = tl.zeros([BN, BT], dtype=tl.float32)
        for k0 in range(0, I, BK):
            acc = _dot_halves(w_ptr, s_ptr, rows, n_mask, k0, I, hw_ptr, r.to(tl.int64), r_mask, acc,
                              BN, BT, BK, SCALE_WORDS)
        dest = tl.load(dest_ptr + r, mask=r_mask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[None, :] * D + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])


def mxfp4_moe_supported(x, weights, chosen, w13, s13, w2, s2) -> bool:
    tensors = (x, weights, chosen, w13, s13, w2, s2)
    if not (x.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() == 2 and all(t.device == x.device for t in tensors)
            and w13.dtype == w2.dtype == s13.dtype == s2.dtype == torch.uint8
            and all(t.is_contiguous() for t in (w13, s13, w2, s2))):
        return False
    e, two_i, d_half = w13.shape
    i, d = two_i // 2, x.shape[1]
    if (d % 32 or i % 32 or d_half * 2 != d or tuple(s13.shape) != (e, two_i, d // 32)
            or tuple(w2.shape) != (e, d, i // 2) or tuple(s2.shape) != (e, d, i // 32)):
        return False
    return fp8_capable(x.device)


def _config(pairs_per_expert: float):
    """(BM, BN, BK_gate_up, BK_down, num_warps, num_stages, rows_first) by the expected rows per
    expert (decode: 4 warps; at 64 tokens on the H200 801 us against 8 warps' 1010 us in one
    sweep, tenth session). rows_first: the _rows kernels (the weight rows as the MMA's M side,
    BM tokens as its N side)."""
    if pairs_per_expert <= 16:
        return 16, 64, 128, 128, 4, 3, False
    if pairs_per_expert <= 64:
        return 64, 64, 64, 64, 4, 3, False
    return 128, 64, 64, 64, 8, 3, False


def _scale_words(scales: torch.Tensor, k: int, bk: int) -> bool:
    """Whether a kernel may read these E8M0 scales as int32 words (common._fp4_weight_halves)."""
    return bk % 128 == 0 and k % 128 == 0 and scales.data_ptr() % 4 == 0


def mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, limit, config=None):
    """`config` (BM, BN, BK_gate_up, BK_down, num_warps, num_stages[, rows_first]) overrides the
    table."""
    n, k = chosen.shape
    e, two_i, _ = w13.shape
    i, d = two_i // 2, x.shape[1]
    _, pair_w, perm, offs = pairs_by_expert(weights, chosen, e)
    tok = (perm // k).to(torch.int32)
    bm, bn, bk1, bk2, warps, stages, *rest = config or _config(n * k / e)
    rows_first = bool(rest and rest[0])
    bk1, bk2 = _block_k(d, bk1), _block_k(i, bk2)
    assert bn % 32 == 0, "the gate_up epilogue quantizes h per 32 columns of its tile"
    xq = quantize_rows(x.contiguous())
    h = torch.empty((n * k, i), device=x.device, dtype=torch.bfloat16)   # quantized values
    pairs = torch.zeros((n * k, d), device=x.device, dtype=x.dtype)
    pw = pair_w[perm].contiguous()
    launch = dict(num_warps=warps, num_stages=stages)
    if rows_first:      # the bf16 activations as int32 words (two columns each)
        _gate_up_rows_kernel[(triton.cdiv(i, bn), e)](
            xq.view(torch.int32), tok, pw, offs, w13, s13, h, d, i, float(limit), HAS_LIMIT=limit > 0,
            BT=bm, BN=bn, BK=bk1, X_DTYPE=_TL_DTYPE[x.dtype], SCALE_WORDS=_scale_words(s13, d, bk1), **launch)
        _down_rows_kernel[(triton.cdiv(d, bn), e)](h.view(torch.int32), perm.to(torch.int32), offs, w2, s2,
                                                   pairs, d, i, BT=bm, BN=bn, BK=bk2,
                                                   SCALE_WORDS=_scale_words(s2, i, bk2), **launch)
    else:
        _gate_up_kernel[(triton.cdiv(i, bn), e)](
            xq, tok, pw, offs, w13, s13, h, d, i, float(limit), HAS_LIMIT=limit > 0,
            BM=bm, BN=bn, BK=bk1, X_DTYPE=_TL_DTYPE[x.dtype], **launch)
        _down_kernel[(triton.cdiv(d, bn), e)](h, perm.to(torch.int32), offs, w2, s2, pairs, d, i,
                                              BM=bm, BN=bn, BK=bk2, **launch)
    pairs = pairs.view(n, k, d)
    y = torch.zeros((n, d), device=x.device, dtype=torch.float32)
    for j in range(k):                                                 # fp32, ascending expert id
        y = y + pairs[:, j]
    return y
