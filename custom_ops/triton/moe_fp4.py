"""mxfp4_moe on CUDA: the routed experts of one MoE over their stacked MXFP4 checkpoint bytes
(imported lazily by cuda_impls.py).

  routing (torch)  each token's experts in ascending id order; the N*topk (token, expert) pairs
                   sorted by expert (stable); group ends from a searchsorted (a fixed [E] int32
                   tensor: no bincount, no host sync, so the step captures)
  qdq_rows         the tokens' activations quantized per 32 to FP8 once (exact in bf16)
  gate_up kernel   grid (I/BN, E): a program loops over its expert's pairs BM at a time, loads
                   the tokens' quantized rows (gathered through the pair -> token index),
                   dequantizes the FP4 tiles of w1 and w3 (same rows) to bf16 as even and odd
                   columns (no interleaving shuffle) and runs a dot per half; the epilogue rounds gate and up to x's dtype as
                   the reference's Linear does, applies the clamped SwiGLU and the routing weight
                   and stores h (x's dtype). An expert nobody picked reads no weights.
  down kernel      grid (d/BN, E): h quantized per 32 (qdq_rows), times w2 the same way; each row is stored at
                   its (token, slot) position (x's dtype, as the reference's w2 returns)
  combine (torch)  the topk slots summed in fp32 in ascending expert order: the loop's order.

Pairs routed to an expert held elsewhere (chosen == E) sort past the last group and stay 0.
The tile table comes from scripts/bench_ops.py --only quant on the H200.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _FLOAT_DTYPES, _fp4_weight_halves
from .quant_gemm import _block_k, fp8_capable, qdq_rows


@triton.jit
def _group_bounds(offs_ptr, e):
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    return start, tl.load(offs_ptr + e)


@triton.jit
def _fp4_dot(a_rows, r_mask, w_ptr, s_ptr, rows, n_mask, k0, K, acc, BN: tl.constexpr, BK: tl.constexpr):
    """acc + the quantized activation rows (a_rows: row pointers into bf16 [., K]) at columns
    k0..k0+BK times MXFP4 rows `rows` [BN]: the even and the odd columns as two dots."""
    j = tl.arange(0, BK // 2)
    a_even = tl.load(a_rows + (k0 + 2 * j)[None, :], mask=r_mask[:, None], other=0.0)
    a_odd = tl.load(a_rows + (k0 + 2 * j + 1)[None, :], mask=r_mask[:, None], other=0.0)
    w_even, w_odd = _fp4_weight_halves(w_ptr, s_ptr, rows, n_mask, k0, K, BN, BK)
    acc = tl.dot(a_even, tl.trans(w_even), acc)
    return tl.dot(a_odd, tl.trans(w_odd), acc)


@triton.jit
def _gate_up_kernel(a_ptr, tok_ptr, pw_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, D, I, limit,
                    HAS_LIMIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """a: the tokens' activations quantized per 32 (qdq_rows), bf16 [N, D]."""
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < I
    gate_rows = e.to(tl.int64) * 2 * I + n           # w1 rows of expert e in the [E*2I] stack
    up_rows = gate_rows + I                          # w3 rows
    for m0 in range(start, end, BM):
        r = m0 + tl.arange(0, BM)
        r_mask = r < end
        a_rows = a_ptr + tl.load(tok_ptr + r, mask=r_mask, other=0).to(tl.int64)[:, None] * D
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, D, BK):
            acc_g = _fp4_dot(a_rows, r_mask, w_ptr, s_ptr, gate_rows, n_mask, k0, D, acc_g, BN, BK)
            acc_u = _fp4_dot(a_rows, r_mask, w_ptr, s_ptr, up_rows, n_mask, k0, D, acc_u, BN, BK)
        out_ty = h_ptr.dtype.element_ty
        gate = acc_g.to(out_ty).to(tl.float32)       # w1(x), w3(x) return x's dtype
        up = acc_u.to(out_ty).to(tl.float32)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        pw = tl.load(pw_ptr + r, mask=r_mask, other=0.0)
        h = pw[:, None] * h
        tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(out_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(a_ptr, dest_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, D, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """a: h quantized per 32 (qdq_rows), bf16 [pairs, I], in sorted pair order."""
    pid_n, e = tl.program_id(0), tl.program_id(1)
    start, end = _group_bounds(offs_ptr, e)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < D
    rows = e.to(tl.int64) * D + n                    # w2 rows of expert e in the [E*d] stack
    for m0 in range(start, end, BM):
        r = m0 + tl.arange(0, BM)
        r_mask = r < end
        a_rows = a_ptr + r[:, None].to(tl.int64) * I
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            acc = _fp4_dot(a_rows, r_mask, w_ptr, s_ptr, rows, n_mask, k0, I, acc, BN, BK)
        dest = tl.load(dest_ptr + r, mask=r_mask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[:, None] * D + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


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
    """(BM, BN, BK_gate_up, BK_down, num_warps, num_stages) by the expected rows per expert."""
    if pairs_per_expert <= 16:
        return 16, 64, 128, 128, 8, 3
    if pairs_per_expert <= 64:
        return 64, 64, 64, 64, 4, 3
    return 128, 64, 64, 64, 8, 3


def mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, limit, config=None):
    """`config` (BM, BN, BK_gate_up, BK_down, num_warps, num_stages) overrides the table."""
    n, k = chosen.shape
    e, two_i, _ = w13.shape
    i, d = two_i // 2, x.shape[1]
    ids, order = chosen.sort(dim=-1)                                   # ascending expert per token
    pair_w = weights.gather(1, order).reshape(-1).to(torch.float32)
    flat = ids.reshape(-1)                                             # pair p = token * k + slot
    perm = torch.argsort(flat, stable=True)                            # pairs grouped by expert
    offs = torch.searchsorted(flat[perm], torch.arange(e, device=x.device, dtype=flat.dtype),
                              right=True, out_int32=True)
    tok = (perm // k).to(torch.int32)
    bm, bn, bk1, bk2, warps, stages = config or _config(n * k / e)
    bk1, bk2 = _block_k(d, bk1), _block_k(i, bk2)
    xq = qdq_rows(x.contiguous())
    h = torch.empty((n * k, i), device=x.device, dtype=x.dtype)
    _gate_up_kernel[(triton.cdiv(i, bn), e)](
        xq, tok, pair_w[perm].contiguous(), offs, w13, s13, h, d, i, float(limit),
        HAS_LIMIT=limit > 0, BM=bm, BN=bn, BK=bk1, num_warps=warps, num_stages=stages)
    pairs = torch.zeros((n * k, d), device=x.device, dtype=x.dtype)
    _down_kernel[(triton.cdiv(d, bn), e)](qdq_rows(h), perm.to(torch.int32), offs, w2, s2, pairs, d, i,
                                          BM=bm, BN=bn, BK=bk2, num_warps=warps, num_stages=stages)
    pairs = pairs.view(n, k, d)
    y = torch.zeros((n, d), device=x.device, dtype=torch.float32)
    for j in range(k):                                                 # fp32, ascending expert id
        y = y + pairs[:, j]
    return y
