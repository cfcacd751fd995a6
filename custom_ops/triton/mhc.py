"""mHC Sinkhorn kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  mhc_sinkhorn        the mHC predictor's pre/post/comb, all Sinkhorn rounds in registers, one
                      thread per token (one launch instead of ~130 elementwise kernels per call;
                      hc_mult = 4, V4.1's: other widths run the reference).

It uses libdevice.exp (the accurate exp), which Triton's CPU interpreter cannot run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


# =============================================================================== mHC Sinkhorn
@triton.jit
def _exact_sigmoid(x):
    """1 / (1 + exp(-x)) with the accurate exp and division, as torch's CUDA sigmoid computes it
    (tl.sigmoid and tl.exp take the approximate ex2, `/` the approximate division)."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


@triton.jit
def _div_by_sum(a, b, c, d, eps, EPS_AFTER: tl.constexpr):
    """Four entries (a row or a column of each token's matrix, [BR] each) divided by their sum
    taken left to right, as reference._sum_in_order adds: x / (s + eps), or (EPS_AFTER, the
    first row pass) x / s + eps."""
    s = ((a + b) + c) + d
    if EPS_AFTER:
        return (tl.math.div_rn(a, s) + eps, tl.math.div_rn(b, s) + eps, tl.math.div_rn(c, s) + eps,
                tl.math.div_rn(d, s) + eps)
    s = s + eps
    return tl.math.div_rn(a, s), tl.math.div_rn(b, s), tl.math.div_rn(c, s), tl.math.div_rn(d, s)


@triton.jit
def _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33, eps,
                    FIRST: tl.constexpr):
    """One Sinkhorn round on each token's 4 x 4 matrix (x<row><col>, [BR] each): every row
    divided by its sum, then every column (FIRST: the rows' eps after the division)."""
    x00, x01, x02, x03 = _div_by_sum(x00, x01, x02, x03, eps, FIRST)
    x10, x11, x12, x13 = _div_by_sum(x10, x11, x12, x13, eps, FIRST)
    x20, x21, x22, x23 = _div_by_sum(x20, x21, x22, x23, eps, FIRST)
    x30, x31, x32, x33 = _div_by_sum(x30, x31, x32, x33, eps, FIRST)
    x00, x10, x20, x30 = _div_by_sum(x00, x10, x20, x30, eps, False)
    x01, x11, x21, x31 = _div_by_sum(x01, x11, x21, x31, eps, False)
    x02, x12, x22, x32 = _div_by_sum(x02, x12, x22, x32, eps, False)
    x03, x13, x23, x33 = _div_by_sum(x03, x13, x23, x33, eps, False)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33


@triton.jit
def _softmax_row(a, b, c, d):
    """exp(x - max) of one row's four entries (the max is exact in any order)."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    return libdevice.exp(a - m), libdevice.exp(b - m), libdevice.exp(c - m), libdevice.exp(d - m)


@triton.jit
def _comb_row(mix_ptr, base_ptr, r, rm, s2, i: tl.constexpr, W: tl.constexpr):
    """Row i of each token's 4 x 4 comb matrix after the softmax: exp(l - max) of the logits
    l = m*s2 + b, the mixes after pre's and post's 8 ([BR] each)."""
    k = 8 + 4 * i
    a = tl.load(mix_ptr + r * W + k, mask=rm, other=0.0) * s2 + tl.load(base_ptr + k)
    b = tl.load(mix_ptr + r * W + k + 1, mask=rm, other=0.0) * s2 + tl.load(base_ptr + k + 1)
    c = tl.load(mix_ptr + r * W + k + 2, mask=rm, other=0.0) * s2 + tl.load(base_ptr + k + 2)
    d = tl.load(mix_ptr + r * W + k + 3, mask=rm, other=0.0) * s2 + tl.load(base_ptr + k + 3)
    return _softmax_row(a, b, c, d)


@triton.jit
def _store_row(out, k: tl.constexpr, a, b, c, d, rm):
    """A comb row's four entries at out + k .. k + 3 (row-major, [BR] each)."""
    tl.store(out + k, a, mask=rm)
    tl.store(out + k + 1, b, mask=rm)
    tl.store(out + k + 2, c, mask=rm)
    tl.store(out + k + 3, d, mask=rm)


@triton.jit
def _mhc_sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, iters,
                         eps, HC: tl.constexpr, BR: tl.constexpr):
    """BR tokens per program, one per thread; each token's (2+HC)*HC mixes -> pre, post and the
    HC x HC comb matrix (HC = 4, V4.1's hc_mult). The comb matrix lives as 16 per-token
    registers (x<row><col>), so each Sinkhorn round is additions and divisions in one thread: no
    cross-thread reductions (the [BR, 4, 4] tile form took ~36 us per call on the H100, its 160
    reductions in a chain). The arithmetic is the reference's operation by operation (accurate
    exp and division, sums in order; launched without FMA contraction), so the result is
    bit-identical to the reference run on the GPU."""
    tl.static_assert(HC == 4, "the register-resident Sinkhorn is written for hc_mult = 4")
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
    tl.store(pre_ptr + r[:, None] * HC + c[None, :], pre, mask=rm[:, None])
    tl.store(post_ptr + r[:, None] * HC + c[None, :], post, mask=rm[:, None])
    x00, x01, x02, x03 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 0, W)
    x10, x11, x12, x13 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 1, W)
    x20, x21, x22, x23 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 2, W)
    x30, x31, x32, x33 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 3, W)
    # round 1 divides the softmax's rows with eps added after the division; the others before
    (x00, x01, x02, x03, x10, x11, x12, x13,
     x20, x21, x22, x23, x30, x31, x32, x33) = _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13,
                                                              x20, x21, x22, x23, x30, x31, x32, x33, eps, True)
    for _ in range(iters - 1):
        (x00, x01, x02, x03, x10, x11, x12, x13,
         x20, x21, x22, x23, x30, x31, x32, x33) = _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13,
                                                                  x20, x21, x22, x23, x30, x31, x32, x33, eps, False)
    out = comb_ptr + r * (HC * HC)
    _store_row(out, 0, x00, x01, x02, x03, rm)
    _store_row(out, 4, x10, x11, x12, x13, rm)
    _store_row(out, 8, x20, x21, x22, x23, rm)
    _store_row(out, 12, x30, x31, x32, x33, rm)


def mhc_sinkhorn_supported(mixes, scale, base, hc: int) -> bool:
    f32 = torch.float32
    return (mixes.is_cuda and scale.is_cuda and base.is_cuda and mixes.dtype == f32
            and scale.dtype == f32 and base.dtype == f32 and hc == 4
            and mixes.shape[-1] == (2 + hc) * hc and base.numel() == (2 + hc) * hc
            and scale.numel() >= 3)


def mhc_sinkhorn(mixes, scale, base, hc: int, iters: int, eps: float, *, rows_per_program: int = 32,
                 num_warps: int = 1):
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
