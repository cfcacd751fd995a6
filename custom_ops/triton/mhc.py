"""mHC kernels (CUDA; imported lazily by cuda_impls.py, never at package import).

  mhc_sinkhorn        the mHC predictor's pre/post/comb, all Sinkhorn rounds in registers, one
                      thread per token (one launch instead of ~130 elementwise kernels per call;
                      hc_mult = 4, V4.1's: other widths run the reference).
  mhc_pre             a sub-layer's input side: the collapse with the previous predictor's pre
                      and this predictor's mixes (RMS scale, the dot products with fn) from one
                      read of the streams, K-sliced partials, then a finish that runs the
                      Sinkhorn of its tokens in the same program: two launches instead of ~13
                      torch kernels.
  mhc_predict         mhc_pre without the collapse, and
  mhc_collapse        the collapse alone (one launch): what passes/mhc_side_stream.py splits
                      mhc_pre into, the predictor on a side stream; the same arithmetic, so the
                      same bits.
  mhc_post            the expand (post * out + comb^T . streams): one launch instead of five.

It uses libdevice.exp (the accurate exp), which Triton's CPU interpreter cannot run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import _TL_DTYPE, _num_sms, _wait_for_inputs, pdl


# =============================================================================== mHC Sinkhorn
@triton.jit
def _exact_sigmoid(x):
    """1 / (1 + exp(-x)) with the accurate exp and division, as torch's CUDA sigmoid computes it
    (tl.sigmoid and tl.exp take the approximate ex2, `/` the approximate division)."""
    return tl.math.div_rn(1.0, 1.0 + libdevice.exp(-x))


# IEEE division without a call per division. ptxas compiles each div.rn.f32 as a fast path
# (MUFU.RCP and five FMAs), a range check (FCHK) and a call to a slow path for operands of
# extreme exponent, each inside its own reconvergence barrier: no two divisions overlap, and the
# Sinkhorn's 640 divisions per token took 22 us at any batch (H100, twenty-ninth session).
# _div_fast is that fast path alone, instruction for instruction, so where the range check
# passes it gives div.rn's bits. The kernel uses it only while every numerator and denominator
# lies in [2^-32, 2^32], far inside the range check's window, and redoes a program's whole
# Sinkhorn with div_rn if any does not (NaN and inf included).
_FAST_DIV_PTX = tl.constexpr("""{
.reg .f32 r, t, y, q, e, nb;
rcp.approx.ftz.f32 r, $2;
neg.f32 nb, $2;
fma.rn.f32 t, nb, r, 0f3F800000;
fma.rn.f32 y, r, t, r;
fma.rn.f32 q, $1, y, 0f00000000;
fma.rn.f32 e, nb, q, $1;
fma.rn.f32 $0, y, e, q;
}""")
_FAST_LO = tl.constexpr(2.0 ** -32)
_FAST_HI = tl.constexpr(2.0 ** 32)


@triton.jit
def _div_fast(a, b):
    """a / b rounded to nearest (div.rn's bits) for a, b in [2^-32, 2^32]; see _FAST_DIV_PTX."""
    return tl.inline_asm_elementwise(_FAST_DIV_PTX, "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _div4(a, b, c, d, s, ok, FAST: tl.constexpr):
    """a, b, c, d / s; FAST: by _div_fast, with ok cleared for tokens whose operands leave its
    range (all entries are >= 0, so the smallest entry and the sum bound them all)."""
    if FAST:
        lo = tl.minimum(tl.minimum(a, b), tl.minimum(c, d))
        ok = ok & (lo >= _FAST_LO) & (s <= _FAST_HI)
        return _div_fast(a, s), _div_fast(b, s), _div_fast(c, s), _div_fast(d, s), ok
    return tl.math.div_rn(a, s), tl.math.div_rn(b, s), tl.math.div_rn(c, s), tl.math.div_rn(d, s), ok


@triton.jit
def _div_by_sum(a, b, c, d, eps, ok, EPS_AFTER: tl.constexpr, FAST: tl.constexpr):
    """Four entries (a row or a column of each token's matrix, [BR] each) divided by their sum
    taken left to right, as reference._sum_in_order adds: x / (s + eps), or (EPS_AFTER, the
    first row pass) x / s + eps."""
    s = ((a + b) + c) + d
    if EPS_AFTER:
        a, b, c, d, ok = _div4(a, b, c, d, s, ok, FAST)
        return a + eps, b + eps, c + eps, d + eps, ok
    return _div4(a, b, c, d, s + eps, ok, FAST)


@triton.jit
def _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33, eps, ok,
                    FIRST: tl.constexpr, FAST: tl.constexpr):
    """One Sinkhorn round on each token's 4 x 4 matrix (x<row><col>, [BR] each): every row
    divided by its sum, then every column (FIRST: the rows' eps after the division, and their
    division by div_rn: the softmax's entries may be as small as it likes)."""
    x00, x01, x02, x03, ok = _div_by_sum(x00, x01, x02, x03, eps, ok, FIRST, FAST and not FIRST)
    x10, x11, x12, x13, ok = _div_by_sum(x10, x11, x12, x13, eps, ok, FIRST, FAST and not FIRST)
    x20, x21, x22, x23, ok = _div_by_sum(x20, x21, x22, x23, eps, ok, FIRST, FAST and not FIRST)
    x30, x31, x32, x33, ok = _div_by_sum(x30, x31, x32, x33, eps, ok, FIRST, FAST and not FIRST)
    x00, x10, x20, x30, ok = _div_by_sum(x00, x10, x20, x30, eps, ok, False, FAST)
    x01, x11, x21, x31, ok = _div_by_sum(x01, x11, x21, x31, eps, ok, False, FAST)
    x02, x12, x22, x32, ok = _div_by_sum(x02, x12, x22, x32, eps, ok, False, FAST)
    x03, x13, x23, x33, ok = _div_by_sum(x03, x13, x23, x33, eps, ok, False, FAST)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33, ok


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
def _sinkhorn(mix_ptr, base_ptr, r, rm, s2, iters, eps, W: tl.constexpr, FAST: tl.constexpr):
    """The comb matrix of each token after the softmax and `iters` Sinkhorn rounds (16 [BR]
    registers), and whether every division stayed in _div_fast's range (FAST; masked rows
    count as in range)."""
    x00, x01, x02, x03 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 0, W)
    x10, x11, x12, x13 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 1, W)
    x20, x21, x22, x23 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 2, W)
    x30, x31, x32, x33 = _comb_row(mix_ptr, base_ptr, r, rm, s2, 3, W)
    ok = tl.zeros_like(r) == 0
    # round 1 divides the softmax's rows with eps added after the division; the others before
    (x00, x01, x02, x03, x10, x11, x12, x13,
     x20, x21, x22, x23, x30, x31, x32, x33, ok) = _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13,
                                                                  x20, x21, x22, x23, x30, x31, x32, x33,
                                                                  eps, ok, True, FAST)
    for _ in range(iters - 1):
        (x00, x01, x02, x03, x10, x11, x12, x13,
         x20, x21, x22, x23, x30, x31, x32, x33, ok) = _sinkhorn_round(x00, x01, x02, x03, x10, x11, x12, x13,
                                                                      x20, x21, x22, x23, x30, x31, x32, x33,
                                                                      eps, ok, False, FAST)
    return x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33, ok | (rm == 0)


@triton.jit
def _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, r, rm, iters, eps,
                   HC: tl.constexpr):
    """Tokens r [BR] (int64; rm: in range), one per thread; each token's (2+HC)*HC mixes -> pre,
    post and the HC x HC comb matrix (HC = 4, V4.1's hc_mult). The comb matrix lives as 16
    per-token registers (x<row><col>), so each Sinkhorn round is additions and divisions in one
    thread: no cross-thread reductions (the [BR, 4, 4] tile form took ~36 us per call on the
    H100, its 160 reductions in a chain). The arithmetic is the reference's operation by
    operation (accurate exp and division, sums in order; launched without FMA contraction), so
    the result is bit-identical to the reference run on the GPU. The divisions after the first
    row pass take _div_fast (div.rn's bits without its per-division call); a program that leaves
    its range runs the Sinkhorn again with div_rn."""
    tl.static_assert(HC == 4, "the register-resident Sinkhorn is written for hc_mult = 4")
    W: tl.constexpr = (2 + HC) * HC
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
    (x00, x01, x02, x03, x10, x11, x12, x13,
     x20, x21, x22, x23, x30, x31, x32, x33, ok) = _sinkhorn(mix_ptr, base_ptr, r, rm, s2, iters, eps, W, True)
    if tl.min(ok.to(tl.int32), axis=0) == 0:        # an operand left _div_fast's range: all by div_rn
        (x00, x01, x02, x03, x10, x11, x12, x13,
         x20, x21, x22, x23, x30, x31, x32, x33, ok) = _sinkhorn(mix_ptr, base_ptr, r, rm, s2, iters, eps, W, False)
    out = comb_ptr + r * (HC * HC)
    _store_row(out, 0, x00, x01, x02, x03, rm)
    _store_row(out, 4, x10, x11, x12, x13, rm)
    _store_row(out, 8, x20, x21, x22, x23, rm)
    _store_row(out, 12, x30, x31, x32, x33, rm)


@triton.jit
def _mhc_sinkhorn_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, n_rows, iters,
                         eps, HC: tl.constexpr, BR: tl.constexpr):
    """BR tokens per program: _sinkhorn_rows."""
    _wait_for_inputs()
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, r, r < n_rows, iters, eps, HC)


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
            HC=hc, BR=rows_per_program, num_warps=num_warps, launch_pdl=pdl(m.device),
            enable_fp_fusion=False)   # m*s + b rounded twice, as the reference's two ops
    return pre, post, comb


# =============================================================================== predictor + collapse
@triton.jit
def _collapse_step(collapsed, pre_ptr, rows, rmask, c: tl.constexpr, xc, HC: tl.constexpr):
    """The collapse after stream c: pre[row, c] * x[row, c, :] (fp32, rounded before the add:
    the kernels launch without FMA contraction) added to the streams before it, in stream
    order. One place for mhc_pre's and mhc_collapse's arithmetic, so the two give the same bits."""
    weighted = tl.load(pre_ptr + rows * HC + c, mask=rmask, other=0.0)[:, None] * xc
    if c == 0:
        return weighted
    return collapsed + weighted


@triton.jit
def _mhc_collapse_kernel(x_ptr, pre_ptr, out_ptr, N, D: tl.constexpr, HC: tl.constexpr, BM: tl.constexpr,
                         BK: tl.constexpr):
    """Program (row block, column block): sum_c pre[row, c] * x[row, c, :] of BM tokens' BK
    columns (_collapse_step), stored in x's dtype."""
    _wait_for_inputs()
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    rmask = rows < N
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = rmask[:, None] & (k < D)[None, :]
    xrow = x_ptr + rows.to(tl.int64)[:, None] * (HC * D)
    collapsed = tl.zeros((BM, BK), tl.float32)
    for c in tl.static_range(HC):
        xc = tl.load(xrow + c * D + k[None, :], mask=mask, other=0.0).to(tl.float32)
        collapsed = _collapse_step(collapsed, pre_ptr, rows, rmask, c, xc, HC)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + k[None, :], collapsed.to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _mhc_partials_kernel(x_ptr, pre_ptr, fn_ptr, part_ptr, out_ptr, N, D: tl.constexpr, HC: tl.constexpr,
                         MIX: tl.constexpr, COLS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                         BMIX: tl.constexpr, COLLAPSE: tl.constexpr):
    """Program (row block, column slice s): columns s*COLS .. +COLS of every stream of BM tokens
    (streams x [N, HC, D]). The predictor's partial sums over them: the MIX dot products with
    fn [MIX, HC*D] (fp32 FMA dots) and the sum of squares, to part[s, row, :MIX] and
    part[s, row, MIX]; and (COLLAPSE; mhc_predict has none) the collapse of these columns,
    _collapse_step's."""
    _wait_for_inputs()
    pm, s = tl.program_id(0), tl.program_id(1)
    rows = pm * BM + tl.arange(0, BM)
    rmask = rows < N
    j = tl.arange(0, BMIX)
    jmask = j < MIX
    xrow = x_ptr + rows.to(tl.int64)[:, None] * (HC * D)
    acc = tl.zeros((BM, BMIX), tl.float32)
    squares = tl.zeros((BM, BK), tl.float32)
    for k0 in range(s * COLS, s * COLS + COLS, BK):
        k = k0 + tl.arange(0, BK)
        collapsed = tl.zeros((BM, BK), tl.float32)
        for c in tl.static_range(HC):
            xc = tl.load(xrow + c * D + k[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
            squares += xc * xc
            w = tl.load(fn_ptr + j[:, None] * (HC * D) + c * D + k[None, :], mask=jmask[:, None], other=0.0)
            acc = tl.dot(xc, tl.trans(w), acc, input_precision="ieee")
            if COLLAPSE:
                collapsed = _collapse_step(collapsed, pre_ptr, rows, rmask, c, xc, HC)
        if COLLAPSE:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + k[None, :],
                     collapsed.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    at = part_ptr + (s * N + rows)[:, None] * BMIX
    acc = tl.where(j[None, :] == MIX, tl.sum(squares, axis=1)[:, None], acc)
    tl.store(at + j[None, :], acc, mask=rmask[:, None] & (j[None, :] <= MIX))


@triton.jit
def _mhc_finish_sinkhorn_kernel(part_ptr, mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, N, iters,
                                norm_eps, hc_eps, S: tl.constexpr, MIX: tl.constexpr, INV_K: tl.constexpr,
                                HC: tl.constexpr, BR: tl.constexpr, CH: tl.constexpr, BMIX: tl.constexpr):
    """BR tokens: mixes [N, MIX] = (the S slices' dot products) * rsqrt(mean of squares + eps),
    the slices summed CH at a time as one [BR, CH, BMIX] tile (a fixed tree, so deterministic),
    the chunks added in slice order (finish_config makes one chunk of every slice up to 256);
    then, in the same program, those tokens' Sinkhorn (_sinkhorn_rows) from the mixes it just
    wrote: one launch where the finish and mhc_sinkhorn took two (5.9 + 6.0 us a call at one
    token on the H100, twenty-ninth session), each mostly waiting."""
    _wait_for_inputs()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < N
    j = tl.arange(0, BMIX)
    jmask = j <= MIX
    c = tl.arange(0, CH)
    acc = tl.zeros((BR, BMIX), tl.float32)
    for s0 in range(0, S, CH):
        s = s0 + c
        at = part_ptr + ((s[None, :, None] * N + rows[:, None, None]) * BMIX + j[None, None, :])
        mask = rmask[:, None, None] & (s < S)[None, :, None] & jmask[None, None, :]
        acc += tl.sum(tl.load(at, mask=mask, other=0.0), axis=1)
    mean_square = tl.sum(tl.where(j[None, :] == MIX, acc, 0.0), axis=1) * INV_K
    rsqrt = libdevice.rsqrt(mean_square + norm_eps)
    tl.store(mix_ptr + rows[:, None] * MIX + j[None, :], acc * rsqrt[:, None], mask=rmask[:, None] & (j[None, :] < MIX))
    tl.debug_barrier()      # the program's mixes are written (block-level visibility) before its threads read them
    r = rows.to(tl.int64)
    _sinkhorn_rows(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, r, rmask, iters, hc_eps, HC)


# =============================================================================== expand
@triton.jit
def _expand_stream(post_ptr, comb_ptr, row, c: tl.constexpr, o, x0, x1, x2, x3, y_ptr, k, kmask, D):
    """Stream c of the new streams: post_c * out + sum over c' of comb[c', c] * x_c' (added in
    order c' = 0..3), in fp32, stored in the output's dtype."""
    mixed = (((tl.load(comb_ptr + row * 16 + c) * x0 + tl.load(comb_ptr + row * 16 + 4 + c) * x1)
              + tl.load(comb_ptr + row * 16 + 8 + c) * x2) + tl.load(comb_ptr + row * 16 + 12 + c) * x3)
    y = tl.load(post_ptr + row * 4 + c) * o + mixed
    tl.store(y_ptr + (row * 4 + c) * D + k, y.to(y_ptr.dtype.element_ty), mask=kmask)


@triton.jit
def _mhc_expand_kernel(out_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, D, BD: tl.constexpr):
    """Program (token, column block): the 4 new streams of BD columns (hc_mult = 4)."""
    _wait_for_inputs()
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BD + tl.arange(0, BD)
    kmask = k < D
    o = tl.load(out_ptr + row * D + k, mask=kmask, other=0.0).to(tl.float32)
    xrow = x_ptr + row * 4 * D + k
    x0 = tl.load(xrow, mask=kmask, other=0.0).to(tl.float32)
    x1 = tl.load(xrow + D, mask=kmask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + 2 * D, mask=kmask, other=0.0).to(tl.float32)
    x3 = tl.load(xrow + 3 * D, mask=kmask, other=0.0).to(tl.float32)
    for c in tl.static_range(4):
        _expand_stream(post_ptr, comb_ptr, row, c, o, x0, x1, x2, x3, y_ptr, k, kmask, D)


def mhc_predict_supported(streams, fn, scale, base, hc: int) -> bool:
    f32 = torch.float32
    return (streams.is_cuda and streams.dim() == 3 and streams.shape[1] == hc and streams.dtype in _TL_DTYPE
            and fn.dtype == f32 and fn.shape == ((2 + hc) * hc, hc * streams.shape[2])
            and streams.shape[2] % 32 == 0 and scale.dtype == base.dtype == f32 and scale.is_cuda
            and base.is_cuda and hc == 4 and base.numel() == (2 + hc) * hc and scale.numel() >= 3)


def mhc_pre_supported(streams, pre_prev, fn, scale, base, hc: int) -> bool:
    return (mhc_predict_supported(streams, fn, scale, base, hc) and pre_prev.dtype == torch.float32
            and pre_prev.shape == streams.shape[:2])


def pre_config(n: int, d: int, device) -> dict:
    """Rows per program (tl.dot needs 16) and column slices. Each slice is whole 32-column
    steps, and as many slices as keep about two programs per SM: a decode step's partials are
    latency-bound (fn, 2 MB of fp32, is read once per row block), so a program should take one
    or two steps, not a chain of them (32 slices of 5 steps each took 25.6 us at one token on
    the H100, twenty-ninth session)."""
    bm = 16 if n <= 16 else 32
    steps = d // 32
    blocks = triton.cdiv(n, bm)
    budget = max(1, 2 * _num_sms(device) // blocks)
    split = max(s for s in range(1, steps + 1) if steps % s == 0 and s <= budget)
    return dict(BM=bm, BK=32, split=split)


def finish_config(split: int, bmix: int, ch: int | None = None) -> dict:
    """The finish + Sinkhorn kernel's tile: CH slices x BR rows x BMIX mixes. All of a decode
    step's slices in one chunk (one round trip to L2; a loop of 32-slice chunks took 5.9 us at
    160 slices on the H100), up to 8192 values at 8 warps."""
    ch = ch or min(256, triton.next_power_of_2(split))
    br = max(1, min(64, 8192 // (ch * bmix)))
    return dict(CH=ch, BR=br, num_warps=8 if ch * bmix * br > 4096 else 4)


def mhc_collapse_supported(streams, pre) -> bool:
    return (streams.is_cuda and streams.dim() == 3 and streams.dtype in _TL_DTYPE and pre.dtype == torch.float32
            and pre.shape == streams.shape[:2] and pre.is_cuda)


def mhc_pre(streams, pre_prev, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float,
            *, config: dict | None = None):
    """streams [N, hc, d], pre_prev [N, hc] fp32, fn [(2+hc)*hc, hc*d] fp32 -> (the collapse
    [N, d] in the streams' dtype, pre [N, hc], post [N, hc], comb [N, hc, hc]): two launches
    (partials + collapse, then finish + Sinkhorn). config: pre_config's keys (BM, BK, split),
    and optionally the finish's CH (slices per chunk; tests)."""
    n, _, d = streams.shape
    collapsed = torch.empty((n, d), dtype=streams.dtype, device=streams.device)
    return (collapsed, *_predict("mhc_pre", streams, pre_prev, collapsed, fn, scale, base, hc, iters, hc_eps,
                                 norm_eps, config))


def mhc_predict(streams, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float,
                *, config: dict | None = None):
    """mhc_pre's (pre, post, comb) alone: its two launches without the collapse, same bits."""
    return _predict("mhc_predict", streams, None, None, fn, scale, base, hc, iters, hc_eps, norm_eps, config)


def mhc_collapse(streams, pre, *, block: int = 512):
    """streams [N, hc, d], pre [N, hc] fp32 -> sum_c pre[:, c] * streams[:, c] [N, d] in the
    streams' dtype: one launch, mhc_pre's collapse arithmetic (_collapse_step)."""
    n, hc, d = streams.shape
    out = torch.empty((n, d), dtype=streams.dtype, device=streams.device)
    if n:
        bm = 1 if n < 16 else 4
        _mhc_collapse_kernel[(triton.cdiv(n, bm), triton.cdiv(d, block))](
            streams.contiguous(), pre.contiguous(), out, n, D=d, HC=hc, BM=bm, BK=block, num_warps=4,
            launch_pdl=pdl(streams.device), enable_fp_fusion=False)     # products rounded, as the reference
    return out


def _predict(op, streams, pre_prev, collapsed, fn, scale, base, hc, iters, hc_eps, norm_eps, config):
    """The predictor's two launches (partials, then finish + Sinkhorn) -> (pre, post, comb); the
    partials kernel also writes the collapse with pre_prev into `collapsed` unless it is None."""
    n, _, d = streams.shape
    mix = (2 + hc) * hc
    cfg = dict(config or pre_config(n, d, streams.device))
    split, finish_ch = cfg.pop("split"), cfg.pop("CH", None)
    if d % (split * cfg["BK"]):
        raise ValueError(f"{op}: hidden size {d} is not {split} slices of whole {cfg['BK']}-column steps")
    x = streams.contiguous()
    f32 = dict(dtype=torch.float32, device=streams.device)
    mixes = torch.empty((n, mix), **f32)
    pre, post, comb = torch.empty((n, hc), **f32), torch.empty((n, hc), **f32), torch.empty((n, hc, hc), **f32)
    if n:
        bmix = triton.next_power_of_2(mix + 1)
        partials = torch.empty((split, n, bmix), dtype=torch.float32, device=streams.device)
        with_collapse = collapsed is not None      # without: pre_ptr / out_ptr are never read (any tensor)
        _mhc_partials_kernel[(triton.cdiv(n, cfg["BM"]), split)](
            x, pre_prev.contiguous() if with_collapse else mixes, fn.contiguous(), partials,
            collapsed if with_collapse else x, n, D=d, HC=hc, MIX=mix, COLS=d // split, BMIX=bmix,
            COLLAPSE=with_collapse, **cfg, num_warps=4, launch_pdl=pdl(x.device),
            enable_fp_fusion=False)     # the collapse's products rounded before the adds, as the reference
        fin = finish_config(split, bmix, finish_ch)
        _mhc_finish_sinkhorn_kernel[(triton.cdiv(n, fin["BR"]),)](
            partials, mixes, scale.contiguous(), base.contiguous(), pre, post, comb, n, iters, norm_eps, hc_eps,
            S=split, MIX=mix, INV_K=1.0 / (hc * d), HC=hc, BMIX=bmix, **fin, launch_pdl=pdl(partials.device),
            enable_fp_fusion=False)     # m*s + b and mean*(1/K) + eps rounded twice, as the reference's ops
    return pre, post, comb


def mhc_post_supported(out, streams, post, comb) -> bool:
    f32 = torch.float32
    return (out.is_cuda and streams.dim() == 3 and streams.shape[1] == 4 and out.dim() == 2
            and out.shape == (streams.shape[0], streams.shape[2]) and out.dtype in _TL_DTYPE
            and streams.dtype in _TL_DTYPE and post.dtype == comb.dtype == f32
            and post.shape == streams.shape[:2] and comb.shape == (streams.shape[0], 4, 4))


def mhc_post(out, streams, post, comb, *, block: int = 512):
    """out [N, d], streams [N, 4, d], post [N, 4], comb [N, 4, 4] -> the new streams [N, 4, d]
    in out's dtype: one launch."""
    n, _, d = streams.shape
    y = torch.empty(streams.shape, dtype=out.dtype, device=out.device)
    if n:
        _mhc_expand_kernel[(n, triton.cdiv(d, block))](
            out.contiguous(), streams.contiguous(), post.contiguous(), comb.contiguous(), y, d, BD=block,
            num_warps=4, launch_pdl=pdl(out.device),
            enable_fp_fusion=False)   # products rounded before the adds, as the reference
    return y
