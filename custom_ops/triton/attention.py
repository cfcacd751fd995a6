"""Sparse attention kernels (CUDA; imported lazily by cuda_impls.py, never at package import).

  sparse_attention    decode/prefill attention over (window rows ++ FP4 global rows) with a
                      per-head sink; window rows are read in place from the FP8 E4M3 + UE8M0
                      ring (or from this call's fresh rows), FP8 and FP4 dequantized in
                      registers; one program serves a tile of BH query heads, so each KV row is
                      loaded once for all heads of the tile (BH = H: once per token). Optional
                      split over the row list + combine. Also runs on a bf16 global cache (the
                      comparison variant).
  the tile kernel     the same op for bf16 q and at most 64 heads (the model on the GPU), the
                      default there: every head of a token in one MMA tile (wgmma at 64 heads),
                      so each row is gathered and dequantized once per token; its launch rule
                      (tile_config) comes from a tuning sweep on the H200.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .common import (_FLOAT_DTYPES, _TL_DTYPE, _e2m1_bytes_to_bf16, _e2m1_decode, _e4m3_pairs_to_bf16, _e8m0_to_bf16,
                     _num_sms, _pow2, _wait_for_inputs, pdl)


# =============================================================================== sparse attention
@triton.jit
def _load_raw(data_ptr, scale_ptr, rows, valid, D: tl.constexpr, D2: tl.constexpr,
              NB16: tl.constexpr, FP4: tl.constexpr, IS16: tl.constexpr):
    """Raw bytes of rows [BS] (what is carried one block ahead when prefetching).
    FP4: (codes uint8 [BS, D/16, 8], E4M3 scale bytes [BS, D/16]); 16-bit float rows: (int32
    words [BS, D/2], same); fp32 rows: (even [BS, D/2], odd [BS, D/2])."""
    if FP4:
        b = tl.arange(0, NB16)
        j = tl.arange(0, 8)
        byte = b[:, None] * 8 + j[None, :]
        raw = tl.load(data_ptr + rows[:, None, None] * D2 + byte[None, :, :],
                      mask=valid[:, None, None], other=0)
        sc = tl.load(scale_ptr + rows[:, None] * NB16 + b[None, :], mask=valid[:, None], other=0)
        return raw, sc
    else:
        i = tl.arange(0, D2)
        if IS16:
            w = tl.load(data_ptr + rows[:, None] * D2 + i[None, :], mask=valid[:, None], other=0)
            return w, w
        else:
            p = data_ptr + rows[:, None] * D + 2 * i[None, :]
            lo = tl.load(p, mask=valid[:, None], other=0.0)
            hi = tl.load(p + 1, mask=valid[:, None], other=0.0)
            return lo, hi


@triton.jit
def _decode_raw(ra, rb, BS: tl.constexpr, D2: tl.constexpr, DTYPE: tl.constexpr,
                FP4: tl.constexpr, IS16: tl.constexpr, PTX: tl.constexpr = False):
    """Raw rows -> (even, odd) halves [BS, D/2] in DTYPE; FP4 is dequantized here, in registers
    (E2M1 value x E4M3 scale is exact in bf16). PTX (bf16 only): the MoE's PTX byte decode,
    ~3 instructions per code instead of ~10 (the sm90 global-row loop: 1268 instructions per
    block of 32 rows instead of 1800, scripts/offline_sass.py); E2M1 (2 significant bits) x
    E4M3 (4) fits bf16's 8, so its FMA is exact and the values are the generic path's."""
    if FP4 and PTX:
        s = rb.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)[:, :, None]
        lo, hi = _e2m1_bytes_to_bf16(ra, s)
        return tl.reshape(lo, (BS, D2)), tl.reshape(hi, (BS, D2))
    elif FP4:
        c = ra.to(tl.int32)
        s = rb.to(tl.float8e4nv, bitcast=True).to(tl.float32)[:, :, None]
        lo = (_e2m1_decode(c & 0xF) * s).to(DTYPE)
        hi = (_e2m1_decode(c >> 4) * s).to(DTYPE)
        return tl.reshape(lo, (BS, D2)), tl.reshape(hi, (BS, D2))
    else:
        if IS16:
            lo = (ra & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
            hi = (ra >> 16).to(tl.int16).to(DTYPE, bitcast=True)
            return lo, hi
        else:
            return ra.to(DTYPE), rb.to(DTYPE)


@triton.jit
def _load_ring_raw(ring_ptr, rsc_ptr, rows, is_ring, D2: tl.constexpr, NB32: tl.constexpr):
    """Raw bytes of FP8 ring rows [BS] (what is carried one block ahead when prefetching): int16
    words [BS, D/32, 16] (word i holds E4M3 elements 2i (low byte) and 2i+1 (high byte)) and the
    UE8M0 scale bytes [BS, D/32]. Masked lanes issue no loads (their addresses need no clamp)."""
    b = tl.arange(0, NB32)
    j = tl.arange(0, 16)
    word = b[:, None] * 16 + j[None, :]
    rw = tl.load(ring_ptr + rows[:, None, None] * D2 + word[None, :, :],
                 mask=is_ring[:, None, None], other=0)
    rs = tl.load(rsc_ptr + rows[:, None] * NB32 + b[None, :], mask=is_ring[:, None], other=0)
    return rw, rs


@triton.jit
def _decode_window(rw, rs, fa, fb, is_ring, BS: tl.constexpr, D2: tl.constexpr,
                   DTYPE: tl.constexpr, IS16: tl.constexpr, PTX: tl.constexpr = False):
    """Window raw rows -> (even, odd) halves [BS, D/2] in DTYPE: ring rows dequantized in
    registers, E4M3 x 2^(e-127) in fp32 (exact, as codecs.dequant_fp8_ue8m0), fresh rows as is.
    PTX (bf16 only): the same values from bf16 multiplies (common._e4m3_pairs_to_bf16)."""
    if PTX:
        lo, hi = _e4m3_pairs_to_bf16(rw, _e8m0_to_bf16(rs)[:, :, None])
    else:
        w = rw.to(tl.int32)
        sc = rs.to(tl.int32)
        s = tl.where(sc == 0, 0x400000, sc << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2^(e-127)
        lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
        hi = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * s
    fe, fo = _decode_raw(fa, fb, BS, D2, DTYPE, False, IS16)
    ke = tl.where(is_ring[:, None], tl.reshape(lo.to(DTYPE), (BS, D2)), fe)
    ko = tl.where(is_ring[:, None], tl.reshape(hi.to(DTYPE), (BS, D2)), fo)
    return ke, ko


@triton.jit
def _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o, sm_scale, IEEE: tl.constexpr):
    """One row block's online-softmax step: the logits q.k over both column halves, the new
    running max and denominator, the accumulators rescaled and P.V added to them."""
    if IEEE:
        s = tl.dot(qe, tl.trans(ke), input_precision="ieee")
        s = tl.dot(qo, tl.trans(ko), s, input_precision="ieee")
    else:
        s = tl.dot(qe, tl.trans(ke))
        s = tl.dot(qo, tl.trans(ko), s)
    s = s * sm_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    pd = p.to(ke.dtype)                       # P in q's dtype before P.V (reference)
    if IEEE:
        acc_e = tl.dot(pd, ke, acc_e * alpha[:, None], input_precision="ieee")
        acc_o = tl.dot(pd, ko, acc_o * alpha[:, None], input_precision="ieee")
    else:
        acc_e = tl.dot(pd, ke, acc_e * alpha[:, None])
        acc_o = tl.dot(pd, ko, acc_o * alpha[:, None])
    return m_new, l, acc_e, acc_o


@triton.jit
def _attn_segment(qe, qo, m, l, acc_e, acc_o, idx_ptr, n, L, blk_lo, blk_hi, data_ptr, scale_ptr,
                  sm_scale, D: tl.constexpr, D2: tl.constexpr, NB16: tl.constexpr,
                  BS: tl.constexpr, DTYPE: tl.constexpr, FP4: tl.constexpr, IS16: tl.constexpr,
                  IEEE: tl.constexpr, PREFETCH: tl.constexpr, PTX: tl.constexpr):
    """Online-softmax over blocks blk_lo..blk_hi-1 of one row list (window or global)."""
    jj = tl.arange(0, BS)
    base = idx_ptr + n.to(tl.int64) * L
    if PREFETCH:   # next block's indices and bytes are in flight while this block computes
        j = blk_lo * BS + jj
        rows = tl.load(base + j, mask=(j < L) & (blk_lo < blk_hi), other=-1)
        valid = rows >= 0
        ra, rb = _load_raw(data_ptr, scale_ptr, tl.where(valid, rows, 0), valid, D, D2, NB16,
                           FP4, IS16)
        for b in range(blk_lo, blk_hi):
            jn = (b + 1) * BS + jj
            rows_n = tl.load(base + jn, mask=(jn < L) & (b + 1 < blk_hi), other=-1)
            valid_n = rows_n >= 0
            ra_n, rb_n = _load_raw(data_ptr, scale_ptr, tl.where(valid_n, rows_n, 0), valid_n,
                                   D, D2, NB16, FP4, IS16)
            ke, ko = _decode_raw(ra, rb, BS, D2, DTYPE, FP4, IS16, PTX)
            m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o,
                                              sm_scale, IEEE)
            ra = ra_n
            rb = rb_n
            valid = valid_n
    else:
        for b in range(blk_lo, blk_hi):
            j = b * BS + jj
            rows = tl.load(base + j, mask=j < L, other=-1)
            valid = rows >= 0
            ra, rb = _load_raw(data_ptr, scale_ptr, tl.where(valid, rows, 0), valid, D, D2, NB16,
                               FP4, IS16)
            ke, ko = _decode_raw(ra, rb, BS, D2, DTYPE, FP4, IS16, PTX)
            m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o,
                                              sm_scale, IEEE)
    return m, l, acc_e, acc_o


@triton.jit
def _attn_window_segment(qe, qo, m, l, acc_e, acc_o, idx_ptr, n, L, blk_lo, blk_hi, ring_ptr,
                         rsc_ptr, fresh_ptr, n_ring, sm_scale, D: tl.constexpr, D2: tl.constexpr,
                         NB16: tl.constexpr, NB32: tl.constexpr, BS: tl.constexpr,
                         DTYPE: tl.constexpr, IS16: tl.constexpr, IEEE: tl.constexpr,
                         PREFETCH: tl.constexpr, PTX: tl.constexpr):
    """_attn_segment over the window row list: row r < n_ring is FP8 ring row r, row r >= n_ring
    fresh row r - n_ring. Prefetching carries only the ring bytes one block ahead (at decode
    nearly every row is a ring row); the few fresh rows are loaded in the block that uses them."""
    jj = tl.arange(0, BS)
    base = idx_ptr + n.to(tl.int64) * L
    if PREFETCH:   # next block's indices and ring bytes are in flight while this block computes
        j = blk_lo * BS + jj
        rows = tl.load(base + j, mask=(j < L) & (blk_lo < blk_hi), other=-1)
        valid = rows >= 0
        is_ring = valid & (rows < n_ring)
        rw, rs = _load_ring_raw(ring_ptr, rsc_ptr, rows, is_ring, D2, NB32)
        for b in range(blk_lo, blk_hi):
            jn = (b + 1) * BS + jj
            rows_n = tl.load(base + jn, mask=(jn < L) & (b + 1 < blk_hi), other=-1)
            valid_n = rows_n >= 0
            is_ring_n = valid_n & (rows_n < n_ring)
            rw_n, rs_n = _load_ring_raw(ring_ptr, rsc_ptr, rows_n, is_ring_n, D2, NB32)
            fa, fb = _load_raw(fresh_ptr, fresh_ptr, rows - n_ring, valid & (rows >= n_ring), D,
                               D2, NB16, False, IS16)
            ke, ko = _decode_window(rw, rs, fa, fb, is_ring, BS, D2, DTYPE, IS16, PTX)
            m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o,
                                              sm_scale, IEEE)
            rw = rw_n
            rs = rs_n
            rows = rows_n
            valid = valid_n
            is_ring = is_ring_n
    else:
        for b in range(blk_lo, blk_hi):
            j = b * BS + jj
            rows = tl.load(base + j, mask=j < L, other=-1)
            valid = rows >= 0
            is_ring = valid & (rows < n_ring)
            rw, rs = _load_ring_raw(ring_ptr, rsc_ptr, rows, is_ring, D2, NB32)
            fa, fb = _load_raw(fresh_ptr, fresh_ptr, rows - n_ring, valid & (rows >= n_ring), D,
                               D2, NB16, False, IS16)
            ke, ko = _decode_window(rw, rs, fa, fb, is_ring, BS, D2, DTYPE, IS16, PTX)
            m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o,
                                              sm_scale, IEEE)
    return m, l, acc_e, acc_o


@triton.jit
def _store_pairs(ptr, off, mask, oe, oo, D2: tl.constexpr, DTYPE: tl.constexpr,
                 IS16: tl.constexpr):
    """Store (even, odd) halves [BH, D/2] interleaved into rows starting at element `off`."""
    i = tl.arange(0, D2)
    if IS16:
        lo = oe.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi = oo.to(DTYPE).to(tl.int16, bitcast=True).to(tl.int32)
        tl.store(ptr + off[:, None] // 2 + i[None, :], (hi << 16) | lo, mask=mask[:, None])
    else:
        p = ptr + off[:, None] + 2 * i[None, :]
        tl.store(p, oe.to(DTYPE), mask=mask[:, None])
        tl.store(p + 1, oo.to(DTYPE), mask=mask[:, None])


@triton.jit
def _sparse_attn_kernel(q_ptr, ring_ptr, rsc_ptr, fresh_ptr, wrows_ptr, gc_ptr, gs_ptr, grows_ptr,
                        sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, H, W, KG, n_ring, sm_scale,
                        blocks_per_split, n_split,
                        D: tl.constexpr, D2: tl.constexpr, NB16: tl.constexpr, NB32: tl.constexpr,
                        BH: tl.constexpr, BS: tl.constexpr,
                        DTYPE: tl.constexpr, IS16: tl.constexpr, GLOBAL_FP4: tl.constexpr,
                        IEEE: tl.constexpr, DIRECT: tl.constexpr, PREFETCH: tl.constexpr,
                        PTX: tl.constexpr):
    """Program (n, head tile, split): query token n, heads hb*BH.., blocks of its row list
    [window rows ++ global rows] in split sp. All BH heads share each loaded KV block. Window
    rows < n_ring are FP8 ring rows (ring_ptr: int16 words, rsc_ptr: UE8M0 bytes), the others
    rows of fresh_ptr (this call's rows, q's dtype)."""
    _wait_for_inputs()
    n = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    hrow = n.to(tl.int64) * H + heads                                       # row of [N*H, D]
    qa, qb = _load_raw(q_ptr, q_ptr, hrow, hmask, D, D2, NB16, False, IS16)
    qe, qo = _decode_raw(qa, qb, BH, D2, DTYPE, False, IS16)
    m = tl.full((BH,), -1e30, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc_e = tl.zeros((BH, D2), tl.float32)
    acc_o = tl.zeros((BH, D2), tl.float32)
    nbw = tl.cdiv(W, BS)
    nbg = tl.cdiv(KG, BS)
    b0 = sp * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, nbw + nbg)
    m, l, acc_e, acc_o = _attn_window_segment(qe, qo, m, l, acc_e, acc_o, wrows_ptr, n, W,
                                              b0, tl.minimum(b1, nbw), ring_ptr, rsc_ptr,
                                              fresh_ptr, n_ring, sm_scale, D, D2, NB16, NB32, BS,
                                              DTYPE, IS16, IEEE, PREFETCH, PTX)
    m, l, acc_e, acc_o = _attn_segment(qe, qo, m, l, acc_e, acc_o, grows_ptr, n, KG,
                                       tl.maximum(b0, nbw) - nbw, b1 - nbw, gc_ptr, gs_ptr,
                                       sm_scale, D, D2, NB16, BS, DTYPE, GLOBAL_FP4, IS16, IEEE,
                                       PREFETCH, PTX)
    _finish(acc_e, acc_o, m, l, n, sp, heads, hmask, hrow, sink_ptr, out_ptr, ws_acc_ptr,
            ws_ml_ptr, H, n_split, D, D2, BH, DTYPE, IS16, DIRECT)


@triton.jit
def _finish(acc_e, acc_o, m, l, n, sp, heads, hmask, hrow, sink_ptr, out_ptr, ws_acc_ptr,
            ws_ml_ptr, H, n_split, D: tl.constexpr, D2: tl.constexpr, BH: tl.constexpr,
            DTYPE: tl.constexpr, IS16: tl.constexpr, DIRECT: tl.constexpr):
    """A program's end: unsplit, the output (sink term added to the denominator); split, its
    partials for the combine kernel."""
    if DIRECT:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        l = l + tl.exp(sink - m)
        lb = tl.broadcast_to(l[:, None], [BH, D2])
        oe = tl.math.div_rn(acc_e, lb)
        oo = tl.math.div_rn(acc_o, lb)
        _store_pairs(out_ptr, hrow * D, hmask, oe, oo, D2, DTYPE, IS16)
    else:
        # partials: acc [N, n_split, H, 2, D/2] fp32, (m, l) [N, n_split, H, 2]
        prow = (n.to(tl.int64) * n_split + sp) * H + heads
        i = tl.arange(0, D2)
        pa = ws_acc_ptr + prow[:, None] * D + i[None, :]
        tl.store(pa, acc_e, mask=hmask[:, None])
        tl.store(pa + D2, acc_o, mask=hmask[:, None])
        tl.store(ws_ml_ptr + prow * 2, m, mask=hmask)
        tl.store(ws_ml_ptr + prow * 2 + 1, l, mask=hmask)


@triton.jit
def _sparse_attn_combine_kernel(ws_acc_ptr, ws_ml_ptr, sink_ptr, out_ptr, H, n_split,
                                D: tl.constexpr, D2: tl.constexpr, BD: tl.constexpr, NS: tl.constexpr,
                                DTYPE: tl.constexpr, IS16: tl.constexpr):
    """The split partials of one head of one token, BD (even, odd) column pairs: rescaled to the
    largest m, added in split order, the sink term added to the denominator. One head per
    program, so its (m, l) are scalars and every thread adds its own columns' shares: nothing
    crosses threads (several heads per program took block barriers and shuffles; see
    docs/BENCHMARKS.md, thirty-second session). The splits are unrolled NS at a time, so a
    step's loads leave together: one round trip per NS splits, not per split."""
    _wait_for_inputs()
    n, h = tl.program_id(0), tl.program_id(1)
    row0 = n.to(tl.int64) * n_split * H + h         # split 0's partial row; split s: + s * H
    mx = tl.full((), -1e30, tl.float32)             # a split that saw no row: m = -inf, weight 0
    for s0 in range(0, n_split, NS):
        for j in tl.static_range(NS):
            m_s = tl.load(ws_ml_ptr + (row0 + (s0 + j) * H) * 2, mask=s0 + j < n_split, other=-1e30)
            mx = tl.maximum(mx, m_s)
    i = tl.program_id(2) * BD + tl.arange(0, BD)
    l = tl.zeros((), tl.float32)
    acc_e = tl.zeros((BD,), tl.float32)
    acc_o = tl.zeros((BD,), tl.float32)
    for s0 in range(0, n_split, NS):
        for j in tl.static_range(NS):
            live = s0 + j < n_split
            prow = row0 + (s0 + j) * H
            wgt = tl.exp(tl.load(ws_ml_ptr + prow * 2, mask=live, other=-1e30) - mx)
            l += tl.load(ws_ml_ptr + prow * 2 + 1, mask=live, other=0.0) * wgt
            pa = ws_acc_ptr + prow * D + i
            acc_e += tl.load(pa, mask=live, other=0.0) * wgt
            acc_o += tl.load(pa + D2, mask=live, other=0.0) * wgt
    l += tl.exp(tl.load(sink_ptr + h).to(tl.float32) - mx)
    oe = tl.math.div_rn(acc_e, l)
    oo = tl.math.div_rn(acc_o, l)
    # _store_pairs takes a [rows] offset vector and [rows, pairs] halves: here one row
    row = tl.zeros((1,), tl.int64) + (n.to(tl.int64) * H + h) * D + 2 * tl.program_id(2) * BD
    _store_pairs(out_ptr, row, row >= 0, oe[None, :], oo[None, :], BD, DTYPE, IS16)


@triton.jit
def _sparse_attn_tile_kernel(q_ptr, ring_ptr, rsc_ptr, fresh_ptr, wrows_ptr, gc_ptr, gs_ptr,
                             grows_ptr, sink_ptr, out_ptr, ws_acc_ptr, ws_ml_ptr, H, W, KG,
                             n_ring, sm_scale, blocks_per_split, n_split,
                             D: tl.constexpr, D2: tl.constexpr, NB16: tl.constexpr,
                             NB32: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr,
                             GLOBAL_FP4: tl.constexpr, DIRECT: tl.constexpr,
                             STAGES: tl.constexpr):
    """Program (n, split): every head of query token n as one MMA tile (BH >= H; M = 64 heads is
    one wgmma tile), so each KV row is gathered and dequantized once per token; bf16 only.
    Registers: the two fp32 accumulators are [BH, D/2] each (128 per thread at 8 warps, BH =
    64) and q stays in shared memory, so no row loop spills (sm90: 255 registers, one program
    per SM); the register prefetch of _sparse_attn_kernel would not fit. STAGES > 1 lets Triton
    software-pipeline the row loops (cp.async gathers into shared memory); measured slower, so
    the launch rule uses 1."""
    _wait_for_inputs()
    n = tl.program_id(0)
    sp = tl.program_id(1)
    heads = tl.arange(0, BH)
    hmask = heads < H
    hrow = n.to(tl.int64) * H + heads                                       # row of [N*H, D]
    qa, qb = _load_raw(q_ptr, q_ptr, hrow, hmask, D, D2, NB16, False, True)
    qe, qo = _decode_raw(qa, qb, BH, D2, tl.bfloat16, False, True)
    m = tl.full((BH,), -1e30, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc_e = tl.zeros((BH, D2), tl.float32)
    acc_o = tl.zeros((BH, D2), tl.float32)
    nbw = tl.cdiv(W, BS)
    b0 = sp * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, nbw + tl.cdiv(KG, BS))
    jj = tl.arange(0, BS)
    wbase = wrows_ptr + n.to(tl.int64) * W
    for b in tl.range(b0, tl.minimum(b1, nbw), num_stages=STAGES):
        j = b * BS + jj
        rows = tl.load(wbase + j, mask=j < W, other=-1)
        valid = rows >= 0
        is_ring = valid & (rows < n_ring)
        rw, rs = _load_ring_raw(ring_ptr, rsc_ptr, rows, is_ring, D2, NB32)
        fa, fb = _load_raw(fresh_ptr, fresh_ptr, rows - n_ring, valid & (rows >= n_ring), D, D2,
                           NB16, False, True)
        ke, ko = _decode_window(rw, rs, fa, fb, is_ring, BS, D2, tl.bfloat16, True, True)
        m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o, sm_scale,
                                           False)
    gbase = grows_ptr + n.to(tl.int64) * KG
    for b in tl.range(tl.maximum(b0, nbw) - nbw, b1 - nbw, num_stages=STAGES):
        j = b * BS + jj
        rows = tl.load(gbase + j, mask=j < KG, other=-1)
        valid = rows >= 0
        if GLOBAL_FP4:
            ra, rb = _load_raw(gc_ptr, gs_ptr, tl.where(valid, rows, 0), valid, D, D2, NB16,
                               True, True)
            ke, ko = _decode_raw(ra, rb, BS, D2, tl.bfloat16, True, True, True)
        else:   # bf16 rows: the even and odd columns as two strided loads of the same lines
            p = gc_ptr + rows[:, None].to(tl.int64) * D + 2 * tl.arange(0, D2)[None, :]
            ke = tl.load(p, mask=valid[:, None], other=0.0)
            ko = tl.load(p + 1, mask=valid[:, None], other=0.0)
        m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o, sm_scale,
                                           False)
    _finish(acc_e, acc_o, m, l, n, sp, heads, hmask, hrow, sink_ptr, out_ptr, ws_acc_ptr,
            ws_ml_ptr, H, n_split, D, D2, BH, tl.bfloat16, True, DIRECT)


def sparse_attention_supported(q, window_kv, window_scale, fresh_kv, window_rows, global_cache,
                               global_scale, global_rows, sink) -> bool:
    if not (q.is_cuda and q.dim() == 3 and q.dtype in _FLOAT_DTYPES):
        return False
    d = q.shape[-1]
    if not (_pow2(d) and d >= 32 and window_rows.dim() == 2 and global_rows.dim() == 2
            and sink.numel() == q.shape[1]):
        return False
    # ring: FP8 bytes [.., D] + one UE8M0 byte per 32, contiguous (read in place)
    if not (window_kv.element_size() == 1 and window_scale.element_size() == 1
            and window_kv.shape[-1] == d and window_scale.shape[-1] == d // 32
            and window_kv.numel() // d == window_scale.numel() // (d // 32)
            and window_kv.is_contiguous() and window_scale.is_contiguous()):
        return False
    # fresh rows: ring values are dequantized straight to q's dtype, which equals the
    # reference's fp32 -> fresh dtype -> q dtype when the fresh dtype holds them exactly
    if not (fresh_kv.dim() == 2 and fresh_kv.shape[-1] == d
            and fresh_kv.dtype in (q.dtype, torch.bfloat16, torch.float32)):
        return False
    if global_rows.shape[-1] > 0:
        if global_scale is None or global_cache.is_floating_point():   # bf16 global cache variant
            return global_cache.shape[-1] == d and global_cache.dtype in _FLOAT_DTYPES
        return (global_cache.dtype == torch.uint8 and global_cache.shape[-1] == d // 2
                and global_scale.shape[-1] == d // 16 and global_cache.is_contiguous()
                and global_scale.is_contiguous())
    return True


def attention_config(n: int, h: int, w: int, kg: int, device, block_h=None, block_s=None,
                     n_split=None, dtype=torch.bfloat16):
    """(BH, BS, n_split, blocks_per_split, num_warps)."""
    bs = int(block_s or 32)
    # measured on the H200 (docs/BENCHMARKS.md): 16 heads per program wins at decode
    # (B <= 64), all 64 heads per program (KV rows loaded once per token) wins at prefill
    bh = int(block_h or (64 if h >= 64 and dtype != torch.float32 and n >= 512 else 16))
    bh = max(16, min(bh, triton.next_power_of_2(h)))
    total = max(1, triton.cdiv(w, bs) + triton.cdiv(kg, bs))
    progs = n * triton.cdiv(h, bh)
    if n_split is None:
        target = 2 * _num_sms(device)
        n_split = 1 if progs >= target // 2 else triton.cdiv(target, progs)
    n_split = max(1, min(int(n_split), total))
    per = triton.cdiv(total, n_split)
    n_split = triton.cdiv(total, per)
    warps = 8 if bh >= 64 else 4
    return bh, bs, n_split, per, warps


def tile_supported(h: int, dtype) -> bool:
    """The all-heads tile kernel: bf16 only, at most 64 heads (two fp32 [64, D/2] accumulators
    are 128 registers per thread at 8 warps; more heads would spill)."""
    return dtype == torch.bfloat16 and h <= 64


# The tile kernel's launch, from the tuning sweeps of scripts/bench_ops.py --only attn on the
# H200 (docs/BENCHMARKS.md, fifteenth session; H = 64, D = 512, 128 window + 512 global rows,
# FP4 cache): no software pipelining (2 or 3 stages: 5-12 % slower at every shape); 32 rows per
# block at decode (16: 1.2-1.5x slower; 64: B = 64 65.5 vs 63.0 us, B = 1 27.9 vs 25.2), 64 at
# prefill (T = 4096: 2706 vs 2896 us); the row list split so the programs fill the SMs once,
# with at least 2 blocks per program (B = 1: split 10 25.2 us, 20 27.0; B = 8: 10 27.9, 20
# 37.1; B = 32: 4 39.0, 3 48.6, 5 58.6; B = 64: 2 63.0, 1 106.0, 3 82.5; prefill: 1).
TILE_ROWS_PER_BLOCK = 32
TILE_ROWS_PER_BLOCK_PREFILL = 64        # from this many query tokens on
TILE_PREFILL_TOKENS = 512
TILE_STAGES = 1
TILE_MIN_BLOCKS_PER_PROGRAM = 2
TILE_WARPS = 8          # two warpgroups: the two fp32 [64, D/2] accumulators are 128 registers per thread


def tile_config(n: int, w: int, kg: int, device, n_split=None, stages=None, block_s=None):
    """(BS, n_split, blocks_per_split, stages) of the all-heads tile kernel: one program per
    (token, split) at ~255 registers x TILE_WARPS, so one program per SM. Arguments left None
    follow the measured rule above."""
    bs = int(block_s or (TILE_ROWS_PER_BLOCK_PREFILL if n >= TILE_PREFILL_TOKENS else TILE_ROWS_PER_BLOCK))
    if bs < 16 or not _pow2(bs) or (stages is not None and int(stages) < 1):
        raise ValueError(f"sparse_attention: block_s must be a power of two >= 16 and stages >= 1, "
                         f"got block_s={block_s}, stages={stages}")
    total = max(1, triton.cdiv(w, bs) + triton.cdiv(kg, bs))
    if n_split is None:
        n_split = min(_num_sms(device) // max(n, 1), total // TILE_MIN_BLOCKS_PER_PROGRAM)
    n_split = max(1, min(int(n_split), total))
    per = triton.cdiv(total, n_split)
    n_split = triton.cdiv(total, per)
    return bs, n_split, per, int(stages or TILE_STAGES)


def preferred_kernel() -> str:
    """$V41GRAPH_ATTN_KERNEL: "heads" runs the head-tile kernel where the tile kernel would run
    (the A/B switch of scripts/bench.py's v41graph-headsattn; read at every call, so a capture
    takes it); unset or "tile": the tile kernel where supported."""
    value = os.environ.get("V41GRAPH_ATTN_KERNEL") or "tile"
    if value not in ("tile", "heads"):
        raise ValueError(f"V41GRAPH_ATTN_KERNEL must be 'tile' or 'heads', got {value!r}")
    return value


ATTN_PREFETCH = True    # default; the bench compares both
# FP8 ring rows and FP4 rows decoded by PTX (bf16 q only; the values are the generic decode's)
ATTN_PTX_DECODE = True  # default; the bench compares both


def sparse_attention(q, window_kv, window_scale, fresh_kv, window_rows, global_cache,
                     global_scale, global_rows, sink, softmax_scale, *, kernel=None, block_h=None,
                     block_s=None, n_split=None, prefetch=None, ptx_decode=None, stages=None,
                     out=None):
    """torch.ops.v41graph.sparse_attention semantics: window rows r < slots*W read the FP8 ring
    window_kv / window_scale in place, rows r >= slots*W are fresh_kv[r - slots*W].
    `global_scale=None` (or a float `global_cache`) with a float `global_cache` [R, D] runs the
    same algorithm on a bf16/fp32 global cache. `ptx_decode` (default ATTN_PTX_DECODE) picks the
    FP8 ring and FP4 decodes for bf16 q: PTX (common._e4m3_pairs_to_bf16, _e2m1_bytes_to_bf16)
    or the generic ones (fp16 / fp32 q always use the generic ones); both give the same values.
    `kernel`: "tile" (all heads of a token in one MMA tile, _sparse_attn_tile_kernel; bf16 q,
    at most 64 heads; `stages` = its software-pipelining depth) or "heads" (head tiles of
    `block_h`, _sparse_attn_kernel; every dtype); default: "tile" where supported."""
    n, h, d = q.shape
    dt = q.dtype
    is16 = dt != torch.float32
    qc = q.contiguous()
    n_ring = window_kv.numel() // d
    if n_ring > 0:   # E4M3 element pairs (2i, 2i+1) read as one int16 word
        ring = window_kv.reshape(-1, d).contiguous().view(torch.uint8).view(torch.int16)
        rsc = window_scale.reshape(-1, d // 32).contiguous().view(torch.uint8)
    else:
        ring, rsc = qc.view(torch.int16), qc.view(torch.uint8)    # never read
    fresh = fresh_kv.reshape(-1, d)
    fresh = (fresh if fresh.dtype == dt else fresh.to(dt)).contiguous()
    if fresh.shape[0] == 0:
        fresh = qc.view(-1, d)                          # never read
    wrows = window_rows.contiguous()
    grows = global_rows.contiguous()
    w, kg = wrows.shape[1], grows.shape[1]
    fp4 = global_scale is not None and not global_cache.is_floating_point()
    if kg == 0:
        gc = gs = fresh                                 # never read
        fp4 = False
    elif fp4:
        gc, gs = global_cache, global_scale.view(torch.uint8)
    else:
        gc = global_cache.reshape(-1, d)
        gc = (gc if gc.dtype == dt else gc.to(dt)).contiguous()
        gs = gc
    if out is None:
        out = torch.empty_like(qc)
    if n == 0:
        return out
    if kernel is None:
        kernel = "tile" if preferred_kernel() == "tile" and tile_supported(h, dt) else "heads"
    if kernel == "tile":
        if not tile_supported(h, dt):
            raise ValueError(f"sparse_attention: kernel='tile' needs bf16 q with at most 64 heads, "
                             f"got {dt} with {h} heads")
        bs, n_split, per, n_stages = tile_config(n, w, kg, q.device, n_split, stages, block_s)
        bh = max(16, triton.next_power_of_2(h))
        ws_acc, ws_ml = _split_workspace(out, n, n_split, h, d)
        _sparse_attn_tile_kernel[(n, n_split)](
            qc.view(torch.int32), ring, rsc, fresh.view(torch.int32), wrows, gc, gs, grows, sink,
            out.view(torch.int32), ws_acc, ws_ml, h, w, kg, n_ring, float(softmax_scale), per,
            n_split, D=d, D2=d // 2, NB16=d // 16, NB32=d // 32, BH=bh, BS=bs, GLOBAL_FP4=fp4,
            DIRECT=n_split == 1, STAGES=n_stages, num_warps=TILE_WARPS, num_stages=1, launch_pdl=pdl(qc.device))
        _combine_splits(ws_acc, ws_ml, sink, out.view(torch.int32), n, h, d, n_split, tl.bfloat16, True)
        return out
    if kernel != "heads":
        raise ValueError(f"sparse_attention: kernel must be 'tile' or 'heads', got {kernel!r}")
    bh, bs, n_split, per, warps = attention_config(n, h, w, kg, q.device, block_h, block_s,
                                                    n_split, dt)
    dtl = _TL_DTYPE[dt]
    if prefetch is None:
        prefetch = ATTN_PREFETCH
    ptx_decode = bool(ATTN_PTX_DECODE if ptx_decode is None else ptx_decode) and dt == torch.bfloat16

    def i32(t):   # 16-bit float tensors are read/written as int32 words
        return t.view(torch.int32) if is16 else t

    direct = n_split == 1
    ws_acc, ws_ml = _split_workspace(out, n, n_split, h, d)
    grid = (n, triton.cdiv(h, bh), n_split)
    _sparse_attn_kernel[grid](
        i32(qc), ring, rsc, i32(fresh), wrows, i32(gc) if not fp4 else gc, gs, grows, sink,
        i32(out), ws_acc, ws_ml, h, w, kg, n_ring, float(softmax_scale), per, n_split,
        D=d, D2=d // 2, NB16=d // 16, NB32=d // 32, BH=bh, BS=bs, DTYPE=dtl, IS16=is16, GLOBAL_FP4=fp4,
        IEEE=(dt == torch.float32), DIRECT=direct, PREFETCH=bool(prefetch), PTX=ptx_decode,
        num_warps=warps, num_stages=1, launch_pdl=pdl(qc.device))
    _combine_splits(ws_acc, ws_ml, sink, i32(out), n, h, d, n_split, dtl, is16)
    return out


def _split_workspace(out, n, n_split, h, d):
    """fp32 partials (acc [N, n_split, H, D], (m, l) [N, n_split, H, 2]) when the row list is
    split; unsplit programs write `out` directly (the workspace arguments are never read)."""
    if n_split == 1:
        return out, out
    return (torch.empty((n, n_split, h, d), dtype=torch.float32, device=out.device),
            torch.empty((n, n_split, h, 2), dtype=torch.float32, device=out.device))


# The combine's program: one head of one token, 64 (even, odd) column pairs at a few tokens (B = 1,
# 64 heads, D = 512: 256 programs), all D/2 pairs above COMBINE_NARROW_TOKENS tokens (B = 64:
# 4096 programs), a warp per 64 pairs; up to COMBINE_SPLITS splits unrolled a step. Offline for
# sm90 (thirty-second session): no shuffle or barrier, far fewer instructions and registers than the
# 8-head program it replaced. In the captured bench_rank step on an H100 (thirty-third session):
# 3.9 / 11.6 us a call at B = 1 / 64, against the 8-head program's 18.8 / 61.2 (docs/BENCHMARKS.md).
COMBINE_PAIRS, COMBINE_SPLITS, COMBINE_NARROW_TOKENS = 64, 16, 8


def _combine_splits(ws_acc, ws_ml, sink, out, n, h, d, n_split, dtl, is16):
    if n_split == 1:
        return
    bd = min(COMBINE_PAIRS, d // 2) if n <= COMBINE_NARROW_TOKENS else d // 2
    _sparse_attn_combine_kernel[(n, h, d // 2 // bd)](
        ws_acc, ws_ml, sink, out, h, n_split, D=d, D2=d // 2, BD=bd,
        NS=min(triton.next_power_of_2(n_split), COMBINE_SPLITS), DTYPE=dtl, IS16=is16,
        num_warps=max(1, min(4, bd // 64)), launch_pdl=pdl(ws_acc.device))
