"""Ratio-2 compressor kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  ratio2_compressor   the ratio-2 compressor after its cuBLAS projection pair: each token's two
                      group members from the state ring or this call, softmax pooling, cast,
                      RMSNorm and (fused_ratio2_compressor_update) the state-ring write, one
                      program per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _FLOAT_DTYPES, _wait_for_inputs, pdl


# =============================================================================== ratio-2 compressor
@triton.jit
def _ratio2_pool_kernel(kv_ptr, sc_ptr, state_ptr, member_ptr, srow_ptr, nw_ptr, out_ptr,
                        N, N_K, RING_ROWS, eps, D: tl.constexpr, RING: tl.constexpr, BD: tl.constexpr,
                        WRITE: tl.constexpr):
    """One token t (program axis 0): its 2 group members, each either a state-ring row
    (member row < RING_ROWS: state[row] = [kv | score]) or one of this call's projected rows
    (kv / sc [N, D] at row - RING_ROWS); per-channel softmax of the scores, pooled kv, cast to
    the output dtype, RMSNorm. With WRITE, also the ring write of this call's rows
    (srow_ptr: the ring row of each token, -1 skipped), after the reads it races with:

    A ring row R read by token i (its first member: the position before its chunk) can be a
    write target in the same call only when i's chunk is at least RING tokens long, and then its
    writer w is i's sequence's token RING*k positions later (w = i - 1 + RING*k; tokens of a
    chunk are contiguous with consecutive positions, as AttentionMetadata lays them out). Such a
    writer skips its write, and the reader, which owns R's old value, writes w's row after
    reading. Both sides search their partner among the N_K = N // RING + 1 candidates at the
    same offsets (integer loads only), so a skipped write is always written by its reader."""
    _wait_for_inputs()
    t = tl.program_id(0)
    d = tl.arange(0, BD)
    dm = d < D
    m = tl.full([BD], float("-inf"), tl.float32)
    den = tl.zeros([BD], tl.float32)
    acc = tl.zeros([BD], tl.float32)
    ring_row = tl.load(member_ptr + t * 2).to(tl.int64)   # the ring row this token reads
    ring_row = tl.where(ring_row < RING_ROWS, ring_row, -1)   # (-1: none)
    for j in tl.static_range(2):
        row = tl.load(member_ptr + t * 2 + j).to(tl.int64)
        in_ring = row < RING_ROWS
        is_fresh = row >= RING_ROWS
        fresh = row - RING_ROWS
        kv_r = tl.load(state_ptr + row * (2 * D) + d, mask=dm & in_ring, other=0.0)
        sc_r = tl.load(state_ptr + row * (2 * D) + D + d, mask=dm & in_ring, other=0.0)
        kv_f = tl.load(kv_ptr + fresh * D + d, mask=dm & is_fresh, other=0.0)
        sc_f = tl.load(sc_ptr + fresh * D + d, mask=dm & is_fresh, other=0.0)
        kv = tl.where(in_ring, kv_r, kv_f)
        sc = tl.where(in_ring, sc_r, sc_f)
        m_new = tl.maximum(m, sc)
        alpha = tl.exp(m - m_new)
        p = tl.exp(sc - m_new)
        den = den * alpha + p
        acc = acc * alpha + kv * p
        m = m_new
    y = (acc / den).to(out_ptr.dtype.element_ty).to(tl.float32)        # the cast the model does
    y = tl.where(dm, y, 0.0)
    r = tl.rsqrt(tl.sum(y * y, axis=0) / D + eps)
    nw = tl.load(nw_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + d, (nw * (y * r)).to(out_ptr.dtype.element_ty), mask=dm)
    if WRITE:
        tl.debug_barrier()                       # this program's ring reads are done
        own = tl.load(srow_ptr + t).to(tl.int64)
        readers = 0                              # tokens of this call that read `own` from the ring
        for k in range(1, N_K + 1):
            i = t + 1 - RING * k
            if i >= 0:
                readers += (tl.load(member_ptr + i * 2).to(tl.int64) == own).to(tl.int32)
        write_own = (own >= 0) & (readers == 0)  # else nothing to write, or the reader writes it
        kv_t = tl.load(kv_ptr + t * D + d, mask=dm)
        sc_t = tl.load(sc_ptr + t * D + d, mask=dm)
        tl.store(state_ptr + own * (2 * D) + d, kv_t, mask=dm & write_own)
        tl.store(state_ptr + own * (2 * D) + D + d, sc_t, mask=dm & write_own)
        if ring_row >= 0:                        # write the row that overwrites what we read
            for k in range(1, N_K + 1):
                w = t - 1 + RING * k
                if w < N:
                    if tl.load(srow_ptr + w).to(tl.int64) == ring_row:
                        tl.store(state_ptr + ring_row * (2 * D) + d,
                                 tl.load(kv_ptr + w * D + d, mask=dm), mask=dm)
                        tl.store(state_ptr + ring_row * (2 * D) + D + d,
                                 tl.load(sc_ptr + w * D + d, mask=dm), mask=dm)


def ratio2_supported(x, wkv, wgate, state, member_rows, norm_weight, out_dtype) -> bool:
    d = wkv.shape[0]
    return (x.is_cuda and x.dim() == 2 and wkv.dim() == 2 and wgate.shape == wkv.shape
            and wkv.dtype == wgate.dtype == state.dtype == torch.float32
            and state.dim() == 3 and state.is_contiguous() and state.shape[-1] == 2 * d
            and member_rows.dim() == 1 and member_rows.numel() == 2 * x.shape[0]
            and member_rows.dtype in (torch.int32, torch.int64)
            and norm_weight.shape == (d,) and norm_weight.is_contiguous()
            and out_dtype in _FLOAT_DTYPES and 0 < d <= 8192)


def ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype,
                      state_rows=None):
    """(latent, kv, score): reference.ratio2_compressor's latent and its rows' two halves, or,
    with state_rows, also the ring write of reference.ratio2_compressor_update, done by the same
    kernel (under the layout contract in ops.fused_ratio2_compressor_update).
    The projection pair runs as the reference runs it (two fp32 F.linear, so the rows are
    bit-identical); pooling, cast, RMSNorm and the ring write are one kernel."""
    xf = x.float()
    kv = torch.nn.functional.linear(xf, wkv)
    sc = torch.nn.functional.linear(xf, wgate)
    n, d = kv.shape
    out = torch.empty((n, d), dtype=out_dtype, device=x.device)
    if n:
        write = state_rows is not None
        members = member_rows.contiguous()
        srows = state_rows.contiguous() if write else members   # not read without WRITE
        _ratio2_pool_kernel[(n,)](
            kv, sc, state, members, srows, norm_weight, out,
            N=n, N_K=n // state.shape[1] + 1, RING_ROWS=state.shape[0] * state.shape[1], eps=float(eps),
            D=d, RING=state.shape[1], BD=max(16, triton.next_power_of_2(d)), WRITE=write, num_warps=4,
            launch_pdl=pdl(kv.device))
    return out, kv, sc
