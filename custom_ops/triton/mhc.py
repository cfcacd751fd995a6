"""mHC Sinkhorn kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  mhc_sinkhorn        the mHC predictor's pre/post/comb, all Sinkhorn rounds in registers (one
                      launch instead of ~130 elementwise kernels per call).

It uses libdevice.exp (the accurate exp), which Triton's CPU interpreter cannot run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import _pow2


# =============================================================================== mHC Sinkhorn
@triton.jit
def _exact_sigmoid(x):
    """1 / (1 + exp(-x)) with the accurate exp and division, as torch's CUDA sigmoid computes it
    (tl.sigmoid and tl.exp take the approximate ex2, `/` the approximate division)."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


@triton.jit
def _sum_in_order(x, idx, AXIS: tl.constexpr, N: tl.constexpr):
    """x summed over AXIS left to right, like reference._sum_in_order (tl.sum's order is the
    compiler's). idx: the index along AXIS, broadcast to x's shape. Each masked tl.sum adds one
    value to zeros, which is exact."""
    total = tl.sum(tl.where(idx == 0, x, 0.0), axis=AXIS)
    for k in tl.static_range(1, N):
        total = total + tl.sum(tl.where(idx == k, x, 0.0), axis=AXIS)
    return total


@triton.jit
def _mhc_sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, iters,
                         eps, HC: tl.constexpr, BR: tl.constexpr):
    """BR tokens per program; each token's (2+HC)*HC mixes -> pre, post and the HC x HC comb
    matrix, whose Sinkhorn rounds run entirely in registers (axis 2 = row sums, axis 1 =
    column sums of each token's matrix). The arithmetic is the reference's operation by
    operation (accurate exp and division, sums in order; launched without FMA contraction), so
    the result is bit-identical to the reference run on the GPU."""
    W: tl.constexpr = (2 + HC) * HC
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rm = r < n_rows
    c = tl.arange(0, HC)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    m_pre = tl.load(mix_ptr + r[:, None] * W + c[None, :], mask=rm[:, None], other=0.0)
    m_post = tl.load(mix_ptr + r[:, None] * W + HC + c[None, :], mask=rm[:, None], other=0.0)
    pre = _exact_sigmoid(m_pre * s0 + tl.load(base_ptr + c)[None, :]) + eps
    post = 2.0 * _exact_sigmoid(m_post * s1 + tl.load(base_ptr + HC + c)[None, :])
    ij = c[:, None] * HC + c[None, :]
    col = c[None, None, :]      # index along axis 2 (a row's entries)
    row = c[None, :, None]      # index along axis 1 (a column's entries)
    x = tl.load(mix_ptr + r[:, None, None] * W + 2 * HC + ij[None, :, :], mask=rm[:, None, None],
                other=0.0)
    x = x * s2 + tl.load(base_ptr + 2 * HC + ij)[None, :, :]
    x = libdevice.exp(x - tl.max(x, axis=2)[:, :, None])
    x = tl.math.div_rn(x, _sum_in_order(x, col, 2, HC)[:, :, None]) + eps
    x = tl.math.div_rn(x, _sum_in_order(x, row, 1, HC)[:, None, :] + eps)
    for _ in range(iters - 1):
        x = tl.math.div_rn(x, _sum_in_order(x, col, 2, HC)[:, :, None] + eps)
        x = tl.math.div_rn(x, _sum_in_order(x, row, 1, HC)[:, None, :] + eps)
    tl.store(pre_ptr + r[:, None] * HC + c[None, :], pre, mask=rm[:, None])
    tl.store(post_ptr + r[:, None] * HC + c[None, :], post, mask=rm[:, None])
    tl.store(comb_ptr + r[:, None, None] * (HC * HC) + ij[None, :, :], x, mask=rm[:, None, None])


def mhc_sinkhorn_supported(mixes, scale, base, hc: int) -> bool:
    f32 = torch.float32
    return (mixes.is_cuda and scale.is_cuda and base.is_cuda and mixes.dtype == f32
            and scale.dtype == f32 and base.dtype == f32 and _pow2(hc)
            and mixes.shape[-1] == (2 + hc) * hc and base.numel() == (2 + hc) * hc
            and scale.numel() >= 3)


def mhc_sinkhorn(mixes, scale, base, hc: int, iters: int, eps: float, *, rows_per_program: int = 32,
                 num_warps: int = 4):
    """mixes [..., (2+hc)*hc] fp32 -> (pre [..., hc], post [..., hc], comb [..., hc, hc])."""
    lead = mixes.shape[:-1]
    m = mixes.reshape(-1, mixes.shape[-1]).contiguous()
    n = m.shape[0]
    pre = torch.empty((*lead, hc), dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty((*lead, hc, hc), dtype=torch.float32, device=mixes.device)
    if n:
        _mhc_sinkhorn_kernel[(triton.cdiv(n, rows_per_program),)](
            m, scale.contiguous(), base.contiguous(), pre, post, comb, n, iters, eps,
            HC=hc, BR=rows_per_program, num_warps=num_warps,
            enable_fp_fusion=False)   # m*s + b rounded twice, as the reference's two ops
    return pre, post, comb
