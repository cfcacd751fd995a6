"""Triton kernels for v41graph's custom ops (CUDA; imported lazily, never at package import).

Each public function here computes the same function as its pure-torch reference in
`reference.py` / `ops.py` (the specification) and is checked against it by
tests/test_kernels_cuda.py:

  fused_wkv_rmsnorm   RMSNorm(x @ wkv^T) in one launch: split-K GEMM tiles, the last program of
                      each row block (found with an atomic counter, no spinning) sums the partials
                      in a fixed order (deterministic) and applies the RMSNorm in registers.
  window_kv_write     FP8 E4M3 + UE8M0 per 32            } one program per few rows, quantize in
  global_kv_write     FP4 E2M1 + E4M3 per 16             } registers, scatter by slot; slot -1
  index_k_write       FP4 E2M1 + UE8M0 per 32            } rows are skipped. Bit-identical.
  sparse_attention    decode/prefill attention over (window rows ++ FP4 global rows) with a
                      per-head sink; window rows are read in place from the FP8 E4M3 + UE8M0
                      ring (or from this call's fresh rows), FP8 and FP4 dequantized in
                      registers; one program serves a tile of BH query heads, so each KV row is
                      loaded once for all heads of the tile (BH = H: once per token). Optional
                      split over the row list + combine. Also runs on a bf16 global cache (the
                      comparison variant).
  engram_gather       FP8 rows + E8M0/32 scales, dequantized; the table may be a device tensor
                      or a pinned host tensor read directly over PCIe (UVA).
  mhc_sinkhorn        the mHC predictor's pre/post/comb, all Sinkhorn rounds in registers (one
                      launch instead of ~130 elementwise kernels per call).
  fake_quant          FP8 E4M3 / FP4 E2M1 + UE8M0 quantize-dequantize of rows (window KV, the
                      indexer query); bit-identical to codecs.qdq_*.
  ratio2_compressor   the ratio-2 compressor after its cuBLAS projection pair: each token's two
                      group members from the state ring or this call, softmax pooling, cast,
                      RMSNorm and (fused_ratio2_compressor_update) the state-ring write, one
                      program per token.

Portability (triton-ascend): the E2M1 encode/decode are integer/bit arithmetic only; the FP8
conversions use tl.float8e4nv and the wkv kernel uses atomics + cache modifiers, which are the
CUDA-specific parts. The rest (RMSNorm, RoPE, ratio-2, Sinkhorn, FP4 writes, Engram gather,
indexer scores) use plain loads, stores, dots and math only.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


class _HostPtr:
    """Hands Triton a pinned host tensor: under UVA its address is valid on the device."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


# =============================================================================== helpers (jit)
@triton.jit
def _ceil_log2(v):
    """Exact ceil(log2(v)) of positive normal fp32 v, from the bits (codecs.ceil_log2)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _exp2i(e):
    """2^e as fp32 for integer e in [-126, 127]."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_encode(v):
    """fp32 -> E2M1 codes (int32 0..15), round to nearest even, saturating (codecs.e2m1_encode)."""
    a = tl.abs(v)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    neg = (v.to(tl.int32, bitcast=True) < 0) & (mag > 0)
    return mag | (neg.to(tl.int32) << 3)


@triton.jit
def _e2m1_decode(c):
    """E2M1 codes (int32 0..15) -> fp32, from the bits."""
    m = c & 7
    bits = tl.where(m >= 2, (((m >> 1) + 126) << 23) | ((m & 1) << 22),
                    tl.where(m == 1, 126 << 23, 0))
    bits = bits | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


# =============================================================================== fused_wkv_rmsnorm
@triton.jit
def _wkv_rmsnorm_kernel(x_ptr, w_ptr, nw_ptr, out_ptr, acc_ptr, cnt_ptr,
                        M, K, N, eps, tiles_per_split, n_parts,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NP2: tl.constexpr,
                        IEEE: tl.constexpr, DIRECT: tl.constexpr):
    """Program (m, n, s): rows m*BM.., columns n*BN.., K tiles of split s. DIRECT: one program
    holds whole rows (BN >= N, no split) and normalizes in registers. Otherwise every program
    adds its fp32 tile into a zeroed accumulator (relaxed atomics), then bumps the row block's
    counter; the program that arrives last reads the finished rows, re-zeroes the accumulator,
    applies the RMSNorm and resets the counter (no spinning, reusable across launches)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BK)
    t0 = pid_s * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, k_tiles)
    for t in range(t0, t1):
        k = t * BK + offs_k
        k_mask = k < K
        xt = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * K + k[None, :],
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :],
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    if DIRECT:
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)     # linear() rounds to x's dtype
        r = tl.rsqrt(tl.sum(y * y, axis=1) / N + eps)
        nw = tl.load(nw_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        o = nw[None, :] * (y * r[:, None])
        tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        tl.atomic_add(acc_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
                      mask=m_mask[:, None] & n_mask[None, :], sem="relaxed")
        tl.debug_barrier()
        prev = tl.atomic_add(cnt_ptr + pid_m, 1, sem="acq_rel", scope="gpu")
        if prev == n_parts - 1:
            cols = tl.arange(0, NP2)
            c_mask = cols < N
            fm = m_mask[:, None] & c_mask[None, :]
            pf = acc_ptr + offs_m[:, None] * N + cols[None, :]
            y = tl.load(pf, mask=fm, other=0.0, cache_modifier=".cg")
            tl.store(pf, tl.zeros((BM, NP2), dtype=tl.float32), mask=fm)
            y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
            r = tl.rsqrt(tl.sum(y * y, axis=1) / N + eps)
            nw = tl.load(nw_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)
            o = nw[None, :] * (y * r[:, None])
            tl.store(out_ptr + offs_m[:, None] * N + cols[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=fm)
            tl.atomic_xchg(cnt_ptr + pid_m, 0)


@triton.jit
def _rmsnorm_rows_kernel(y_ptr, nw_ptr, out_ptr, M, N, eps, BR: tl.constexpr, NP2: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, NP2)
    msk = (rows < M)[:, None] & (cols < N)[None, :]
    off = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + off, mask=msk, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(y * y, axis=1) / N + eps)
    nw = tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, (nw[None, :] * (y * r[:, None])).to(out_ptr.dtype.element_ty), mask=msk)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and weight.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == x.shape[-1]
            and 0 < x.shape[-1] <= 16384)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (reference.rms_norm): one program per row (per 4 rows when rows
    are short), fp32 math, result in x's dtype, contiguous."""
    x2 = _rows(x)
    m, n = x2.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m:
        np2 = max(16, triton.next_power_of_2(n))
        rows = 1 if np2 >= 2048 else 4
        _rmsnorm_rows_kernel[(triton.cdiv(m, rows),)](
            x2, weight, out, m, n, float(eps), BR=rows, NP2=np2, num_warps=8 if np2 >= 4096 else 4)
    return out


# =============================================================================== rope
@triton.jit
def _rope_kernel(x_ptr, rot_ptr, out_ptr, M, D, HEAD, P, INVERSE: tl.constexpr,
                 BH: tl.constexpr, BP: tl.constexpr):
    """One row of x (program axis 0 over N*M rows): copy its first HEAD channels, rotate the
    P interleaved pairs after them by the row's token rotation (cos, sin), fp32 math."""
    row = tl.program_id(0).to(tl.int64)
    n = row // M
    base = row * D
    h = tl.arange(0, BH)
    tl.store(out_ptr + base + h, tl.load(x_ptr + base + h, mask=h < HEAD), mask=h < HEAD)
    j = tl.arange(0, BP)
    jm = j < P
    a = tl.load(x_ptr + base + HEAD + 2 * j, mask=jm, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + base + HEAD + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
    c = tl.load(rot_ptr + (n * P + j) * 2, mask=jm, other=0.0)
    sn = tl.load(rot_ptr + (n * P + j) * 2 + 1, mask=jm, other=0.0)
    if INVERSE:
        sn = -sn
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + base + HEAD + 2 * j, (a * c - b * sn).to(dt), mask=jm)
    tl.store(out_ptr + base + HEAD + 2 * j + 1, (a * sn + b * c).to(dt), mask=jm)


def rope_supported(x: torch.Tensor, rotation: torch.Tensor) -> bool:
    return (x.is_cuda and rotation.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() >= 2
            and rotation.dtype == torch.complex64 and rotation.dim() == 2
            and rotation.shape[0] == x.shape[0] and 0 < 2 * rotation.shape[1] <= x.shape[-1]
            and x.shape[-1] <= 8192)


def rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool) -> torch.Tensor:
    """reference.apply_rope as one launch: out contiguous, x's dtype."""
    n, d, p = x.shape[0], x.shape[-1], rotation.shape[1]
    x3 = x.reshape(n, math.prod(x.shape[1:-1]), d)      # no -1: ambiguous when n == 0
    if not x3.is_contiguous():
        x3 = x3.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x3.shape[0] * x3.shape[1]
    if rows:
        rot = torch.view_as_real(rotation.contiguous())           # [N, P, 2] fp32 (cos, sin)
        head = d - 2 * p
        _rope_kernel[(rows,)](x3, rot, out, x3.shape[1], d, head, p, INVERSE=bool(inverse),
                              BH=max(16, triton.next_power_of_2(max(head, 1))),
                              BP=max(16, triton.next_power_of_2(p)), num_warps=2)
    return out


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
            D=d, RING=state.shape[1], BD=max(16, triton.next_power_of_2(d)), WRITE=write, num_warps=4)
    return out, kv, sc


WKV_FUSED_MAX_M = 128          # above: cuBLAS GEMM + one RMSNorm kernel (prefill)
_WKV_ACC_FLOATS = WKV_FUSED_MAX_M * 1024
_STATE: dict = {}


def _wkv_state(device: torch.device):
    """(fp32 accumulator, int32 counters), zeroed, one pair per (device, stream); the kernel
    leaves both zeroed again after every launch."""
    key = (device.index, torch.cuda.current_stream(device).cuda_stream)
    st = _STATE.get(key)
    if st is None:
        st = (torch.zeros(_WKV_ACC_FLOATS, dtype=torch.float32, device=device),
              torch.zeros(1024, dtype=torch.int32, device=device))
        _STATE[key] = st
    return st


def fused_wkv_rmsnorm_supported(x: torch.Tensor, wkv: torch.Tensor, norm_weight: torch.Tensor) -> bool:
    return (x.is_cuda and wkv.is_cuda and norm_weight.is_cuda and x.dtype == wkv.dtype
            and x.dtype in _FLOAT_DTYPES and wkv.dim() == 2 and x.shape[-1] == wkv.shape[1]
            and wkv.shape[0] <= 1024 and norm_weight.numel() == wkv.shape[0] and x.numel() > 0)


def wkv_config(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device,
               split: int | None = None, block_n: int | None = None):
    """(BM, BN, BK, NP2, split, n_blocks_n, num_warps, num_stages) of the fused kernel."""
    np2 = max(16, triton.next_power_of_2(n))
    bm = 16
    deterministic = torch.are_deterministic_algorithms_enabled()
    bn = np2 if deterministic else min(np2, int(block_n or 256))
    bk = 32 if (dtype == torch.float32 or bn > 256) else 64
    nbn = triton.cdiv(n, bn)
    k_tiles = triton.cdiv(k, bk)
    n_mb = triton.cdiv(m, bm)
    if deterministic:
        split = 1
    elif split is None:
        # fill the chip (~2 programs per SM) with few K tiles per program, and cap the fp32
        # atomics (m * n * split) at ~640K
        split = min(k_tiles, triton.cdiv(2 * _num_sms(device), n_mb * nbn),
                    max(1, 655360 // max(m * n, 1)))
    split = max(1, min(int(split), k_tiles))
    tiles = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, tiles)          # no empty splits
    warps = 8 if bm * bn >= 8192 and dtype == torch.float32 else 4
    return bm, bn, bk, np2, split, nbn, warps, 3 if tiles >= 3 else 2


def fused_wkv_rmsnorm(x: torch.Tensor, wkv: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      *, split: int | None = None, block_n: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[-1]
    n = wkv.shape[0]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    w = wkv if wkv.is_contiguous() else wkv.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    np2 = max(16, triton.next_power_of_2(n))
    if m > WKV_FUSED_MAX_M:
        # prefill: a tensor-core GEMM is the bulk of the work; fuse only the norm (1 kernel)
        y = torch.nn.functional.linear(x2, w)
        br = 4
        _rmsnorm_rows_kernel[(triton.cdiv(m, br),)](y, norm_weight, out, m, n, float(eps),
                                                   BR=br, NP2=np2, num_warps=4)
        return out
    bm, bn, bk, np2, split, nbn, warps, stages = wkv_config(m, k, n, x.dtype, x.device, split,
                                                            block_n)
    tiles = triton.cdiv(triton.cdiv(k, bk), split)
    n_mb = triton.cdiv(m, bm)
    acc, cnt = _wkv_state(x.device)
    direct = split == 1 and nbn == 1
    _wkv_rmsnorm_kernel[(n_mb, nbn, split)](
        x2, w, norm_weight, out, acc, cnt, m, k, n, float(eps), tiles, nbn * split,
        BM=bm, BN=bn, BK=bk, NP2=np2, IEEE=(x.dtype == torch.float32), DIRECT=direct,
        num_warps=warps, num_stages=stages)
    return out


# =============================================================================== cache writes
@triton.jit
def _fp8_ue8m0_write_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, N,
                            D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                            BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < N
    slot = tl.load(slot_ptr + r, mask=rmask, other=-1).to(tl.int64)
    valid = rmask & (slot >= 0)
    b = tl.arange(0, NB)
    e = tl.arange(0, BLOCK)
    col = b[:, None] * BLOCK + e[None, :]                                   # [NB, BLOCK]
    x = tl.load(x_ptr + r[:, None, None].to(tl.int64) * D + col[None, :, :],
                mask=rmask[:, None, None], other=0.0).to(tl.float32)       # [BR, NB, BLOCK]
    amax = tl.max(tl.abs(x), axis=2)
    v = tl.maximum(amax, 1e-4) * 0.002232142857142857                       # fp32(1/448)
    ex = _ceil_log2(v)
    q = x * _exp2i(-ex)[:, :, None]                                         # exact: / 2^ex
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    qb = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    sb = tl.minimum(tl.maximum(ex + 127, 0), 254).to(tl.uint8)
    tl.store(cache_ptr + slot[:, None, None] * D + col[None, :, :], qb, mask=valid[:, None, None])
    tl.store(scale_ptr + slot[:, None] * NB + b[None, :], sb, mask=valid[:, None])


@triton.jit
def _fp4_write_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, N,
                      D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr, HALF: tl.constexpr,
                      E4M3_SCALE: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = r < N
    slot = tl.load(slot_ptr + r, mask=rmask, other=-1).to(tl.int64)
    valid = rmask & (slot >= 0)
    b = tl.arange(0, NB)
    h = tl.arange(0, HALF)
    even = b[:, None] * BLOCK + 2 * h[None, :]                              # [NB, HALF]
    base = x_ptr + r[:, None, None].to(tl.int64) * D + even[None, :, :]
    xe = tl.load(base, mask=rmask[:, None, None], other=0.0).to(tl.float32)
    xo = tl.load(base + 1, mask=rmask[:, None, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=2), tl.max(tl.abs(xo), axis=2))  # [BR, NB]
    if E4M3_SCALE:
        amax = tl.maximum(amax, 0.01171875)                                 # 6 * 2^-9
        s8 = tl.math.div_rn(amax, tl.full([BR, NB], 6.0, tl.float32)).to(tl.float8e4nv)
        s = s8.to(tl.float32)
        sb = s8.to(tl.uint8, bitcast=True)
        s3 = tl.broadcast_to(s[:, :, None], [BR, NB, HALF])
        ce = _e2m1_encode(tl.math.div_rn(xe, s3))
        co = _e2m1_encode(tl.math.div_rn(xo, s3))
    else:
        v = tl.maximum(amax, 7.052966104933725e-38) * 0.16666666666666666   # floor 6*2^-126, fp32(1/6)
        ex = _ceil_log2(v)
        inv = _exp2i(-ex)[:, :, None]
        ce = _e2m1_encode(xe * inv)
        co = _e2m1_encode(xo * inv)
        sb = tl.minimum(tl.maximum(ex + 127, 0), 254).to(tl.uint8)
    packed = (ce | (co << 4)).to(tl.uint8)
    byte = b[:, None] * HALF + h[None, :]
    tl.store(cache_ptr + slot[:, None, None] * (D // 2) + byte[None, :, :], packed,
             mask=valid[:, None, None])
    tl.store(scale_ptr + slot[:, None] * NB + b[None, :], sb, mask=valid[:, None])


def cache_write_supported(cache: torch.Tensor, scale: torch.Tensor, x: torch.Tensor,
                          slot_mapping: torch.Tensor, block: int) -> bool:
    d = x.shape[-1]
    return (cache.is_cuda and scale.is_cuda and x.is_cuda and slot_mapping.is_cuda
            and x.dtype in _FLOAT_DTYPES and d % block == 0 and _pow2(d // block)
            and cache.is_contiguous() and scale.is_contiguous()
            and cache.dtype == torch.uint8 and slot_mapping.dim() == 1
            and x.numel() // d == slot_mapping.shape[0])


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def window_kv_write(cache, scale, kv, slot_mapping, *, rows_per_program: int = 4) -> None:
    x = _rows(kv)
    n, d = x.shape
    if n == 0:
        return
    _fp8_ue8m0_write_kernel[(triton.cdiv(n, rows_per_program),)](
        x, slot_mapping, cache, scale.view(torch.uint8), n, D=d, BLOCK=32, NB=d // 32,
        BR=rows_per_program, num_warps=4)


def global_kv_write(cache, scale, kv, slot_mapping, *, rows_per_program: int = 4) -> None:
    x = _rows(kv)
    n, d = x.shape
    if n == 0:
        return
    _fp4_write_kernel[(triton.cdiv(n, rows_per_program),)](
        x, slot_mapping, cache, scale.view(torch.uint8), n, D=d, BLOCK=16, NB=d // 16, HALF=8, E4M3_SCALE=True,
        BR=rows_per_program, num_warps=4)


def index_k_write(cache, scale, k, slot_mapping, *, rows_per_program: int = 8) -> None:
    x = _rows(k)
    n, d = x.shape
    if n == 0:
        return
    _fp4_write_kernel[(triton.cdiv(n, rows_per_program),)](
        x, slot_mapping, cache, scale.view(torch.uint8), n, D=d, BLOCK=32, NB=d // 32, HALF=16, E4M3_SCALE=False,
        BR=rows_per_program, num_warps=4)


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
                FP4: tl.constexpr, IS16: tl.constexpr):
    """Raw rows -> (even, odd) halves [BS, D/2] in DTYPE; FP4 is dequantized here, in registers
    (E2M1 value x E4M3 scale is exact in bf16)."""
    if FP4:
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
                   DTYPE: tl.constexpr, IS16: tl.constexpr):
    """Window raw rows -> (even, odd) halves [BS, D/2] in DTYPE: ring rows dequantized in
    registers, E4M3 x 2^(e-127) in fp32 (exact, as codecs.dequant_fp8_ue8m0), fresh rows as is."""
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
                  IEEE: tl.constexpr, PREFETCH: tl.constexpr):
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
            ke, ko = _decode_raw(ra, rb, BS, D2, DTYPE, FP4, IS16)
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
            ke, ko = _decode_raw(ra, rb, BS, D2, DTYPE, FP4, IS16)
            m, l, acc_e, acc_o = _attn_update(qe, qo, ke, ko, valid, m, l, acc_e, acc_o,
                                              sm_scale, IEEE)
    return m, l, acc_e, acc_o


@triton.jit
def _attn_window_segment(qe, qo, m, l, acc_e, acc_o, idx_ptr, n, L, blk_lo, blk_hi, ring_ptr,
                         rsc_ptr, fresh_ptr, n_ring, sm_scale, D: tl.constexpr, D2: tl.constexpr,
                         NB16: tl.constexpr, NB32: tl.constexpr, BS: tl.constexpr,
                         DTYPE: tl.constexpr, IS16: tl.constexpr, IEEE: tl.constexpr,
                         PREFETCH: tl.constexpr):
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
            ke, ko = _decode_window(rw, rs, fa, fb, is_ring, BS, D2, DTYPE, IS16)
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
            ke, ko = _decode_window(rw, rs, fa, fb, is_ring, BS, D2, DTYPE, IS16)
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
                        IEEE: tl.constexpr, DIRECT: tl.constexpr, PREFETCH: tl.constexpr):
    """Program (n, head tile, split): query token n, heads hb*BH.., blocks of its row list
    [window rows ++ global rows] in split sp. All BH heads share each loaded KV block. Window
    rows < n_ring are FP8 ring rows (ring_ptr: int16 words, rsc_ptr: UE8M0 bytes), the others
    rows of fresh_ptr (this call's rows, q's dtype)."""
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
                                              DTYPE, IS16, IEEE, PREFETCH)
    m, l, acc_e, acc_o = _attn_segment(qe, qo, m, l, acc_e, acc_o, grows_ptr, n, KG,
                                       tl.maximum(b0, nbw) - nbw, b1 - nbw, gc_ptr, gs_ptr,
                                       sm_scale, D, D2, NB16, BS, DTYPE, GLOBAL_FP4, IS16, IEEE,
                                       PREFETCH)
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
                                D: tl.constexpr, D2: tl.constexpr, BH: tl.constexpr,
                                DTYPE: tl.constexpr, IS16: tl.constexpr):
    n = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BH + tl.arange(0, BH)
    hmask = heads < H
    i = tl.arange(0, D2)
    mx = tl.full((BH,), -1e30, tl.float32)
    for s in range(0, n_split):
        prow = (n.to(tl.int64) * n_split + s) * H + heads
        mx = tl.maximum(mx, tl.load(ws_ml_ptr + prow * 2, mask=hmask, other=-1e30))
    l = tl.zeros((BH,), tl.float32)
    acc_e = tl.zeros((BH, D2), tl.float32)
    acc_o = tl.zeros((BH, D2), tl.float32)
    for s in range(0, n_split):
        prow = (n.to(tl.int64) * n_split + s) * H + heads
        ms = tl.load(ws_ml_ptr + prow * 2, mask=hmask, other=-1e30)
        ls = tl.load(ws_ml_ptr + prow * 2 + 1, mask=hmask, other=0.0)
        wgt = tl.exp(ms - mx)
        l += ls * wgt
        pa = ws_acc_ptr + prow[:, None] * D + i[None, :]
        acc_e += tl.load(pa, mask=hmask[:, None], other=0.0) * wgt[:, None]
        acc_o += tl.load(pa + D2, mask=hmask[:, None], other=0.0) * wgt[:, None]
    sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    l = l + tl.exp(sink - mx)
    lb = tl.broadcast_to(l[:, None], [BH, D2])
    oe = tl.math.div_rn(acc_e, lb)
    oo = tl.math.div_rn(acc_o, lb)
    hrow = n.to(tl.int64) * H + heads
    _store_pairs(out_ptr, hrow * D, hmask, oe, oo, D2, DTYPE, IS16)


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


ATTN_PREFETCH = True    # default; the bench compares both


def sparse_attention(q, window_kv, window_scale, fresh_kv, window_rows, global_cache,
                     global_scale, global_rows, sink, softmax_scale, *, block_h=None,
                     block_s=None, n_split=None, prefetch=None, out=None):
    """torch.ops.v41graph.sparse_attention semantics: window rows r < slots*W read the FP8 ring
    window_kv / window_scale in place, rows r >= slots*W are fresh_kv[r - slots*W].
    `global_scale=None` (or a float `global_cache`) with a float `global_cache` [R, D] runs the
    same algorithm on a bf16/fp32 global cache."""
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
    bh, bs, n_split, per, warps = attention_config(n, h, w, kg, q.device, block_h, block_s,
                                                    n_split, dt)
    dtl = _TL_DTYPE[dt]
    if prefetch is None:
        prefetch = ATTN_PREFETCH

    def i32(t):   # 16-bit float tensors are read/written as int32 words
        return t.view(torch.int32) if is16 else t

    direct = n_split == 1
    if direct:
        ws_acc = ws_ml = out
    else:
        ws_acc = torch.empty((n, n_split, h, d), dtype=torch.float32, device=q.device)
        ws_ml = torch.empty((n, n_split, h, 2), dtype=torch.float32, device=q.device)
    grid = (n, triton.cdiv(h, bh), n_split)
    _sparse_attn_kernel[grid](
        i32(qc), ring, rsc, i32(fresh), wrows, i32(gc) if not fp4 else gc, gs, grows, sink,
        i32(out), ws_acc, ws_ml, h, w, kg, n_ring, float(softmax_scale), per, n_split,
        D=d, D2=d // 2, NB16=d // 16, NB32=d // 32, BH=bh, BS=bs, DTYPE=dtl, IS16=is16, GLOBAL_FP4=fp4,
        IEEE=(dt == torch.float32), DIRECT=direct, PREFETCH=bool(prefetch),
        num_warps=warps, num_stages=1)
    if not direct:
        cbh = 16
        _sparse_attn_combine_kernel[(n, triton.cdiv(h, cbh))](
            ws_acc, ws_ml, sink, i32(out), h, n_split, D=d, D2=d // 2, BH=cbh, DTYPE=dtl,
            IS16=is16, num_warps=4)
    return out


# =============================================================================== Engram gather
@triton.jit
def _engram_gather_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, n_rows,
                          DH: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr,
                          OUT_DTYPE: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    rm = r < n_rows
    ids = tl.load(ids_ptr + r, mask=rm, other=0).to(tl.int64)
    b = tl.arange(0, NB)
    e = tl.arange(0, 32)
    col = b[:, None] * 32 + e[None, :]
    q = tl.load(table_ptr + ids[:, None, None] * DH + col[None, :, :], mask=rm[:, None, None], other=0)
    sc = tl.load(scale_ptr + ids[:, None] * NB + b[None, :], mask=rm[:, None], other=127).to(tl.int32)
    s = tl.where(sc == 0, 0x400000, sc << 23).to(tl.float32, bitcast=True)   # 2^(e-127)
    v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, :, None]
    tl.store(out_ptr + r[:, None, None].to(tl.int64) * DH + col[None, :, :], v.to(OUT_DTYPE),
             mask=rm[:, None, None])


def engram_gather_supported(table, scale, row_ids, out_dtype) -> bool:
    dh = table.shape[-1]
    host_ok = table.is_cuda or (table.device.type == "cpu" and table.is_pinned()
                                and scale.is_pinned())
    return (row_ids.is_cuda and host_ok and table.dim() == 2 and dh % 32 == 0
            and _pow2(dh // 32) and table.element_size() == 1 and scale.element_size() == 1
            and table.is_contiguous() and scale.is_contiguous() and out_dtype in _TL_DTYPE
            and scale.device.type == table.device.type)


def engram_gather(table, scale, row_ids, out_dtype, *, rows_per_program: int = 4, out=None):
    """[N, M] row ids -> [N, M*Dh]; `table` may be a pinned host tensor (read over PCIe)."""
    dh = table.shape[-1]
    ids = row_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n_rows = ids.numel()
    if out is None:
        out = torch.empty((*row_ids.shape[:-1], row_ids.shape[-1] * dh), dtype=out_dtype,
                          device=row_ids.device)
    if n_rows == 0:
        return out
    t8 = table.view(torch.uint8)
    s8 = scale.view(torch.uint8)
    if not table.is_cuda:
        t8, s8 = _HostPtr(t8), _HostPtr(s8)
    _engram_gather_kernel[(triton.cdiv(n_rows, rows_per_program),)](
        t8, s8, ids, out, n_rows, DH=dh, NB=dh // 32, BR=rows_per_program, OUT_DTYPE=_TL_DTYPE[out_dtype],
        num_warps=2 if rows_per_program * dh <= 1024 else 4)
    return out


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


def mhc_sinkhorn(mixes, scale, base, hc: int, iters: int, eps: float, *, rows_per_program: int = 32):
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
            HC=hc, BR=rows_per_program, num_warps=4,
            enable_fp_fusion=False)   # m*s + b rounded twice, as the reference's two ops
    return pre, post, comb


# =============================================================================== fake quantization
@triton.jit
def _fake_quant_kernel(x_ptr, out_ptr, n_rows, D: tl.constexpr, BLOCK: tl.constexpr,
                       NB: tl.constexpr, FP4: tl.constexpr, BR: tl.constexpr,
                       OUT_DTYPE: tl.constexpr):
    """Quantize + dequantize BR rows in registers, the same arithmetic as the cache-write
    kernels (so the values equal what a cache would hold, bit for bit)."""
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    rmask = r < n_rows
    b = tl.arange(0, NB)
    e = tl.arange(0, BLOCK)
    offs = r[:, None, None] * D + (b[:, None] * BLOCK + e[None, :])[None, :, :]
    x = tl.load(x_ptr + offs, mask=rmask[:, None, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)
    if FP4:   # E2M1 + UE8M0: floor 6*2^-126, fp32(1/6)
        ex = _ceil_log2(tl.maximum(amax, 7.052966104933725e-38) * 0.16666666666666666)
        codes = _e2m1_encode(x * _exp2i(-ex)[:, :, None])
        deq = _e2m1_decode(codes) * _exp2i(ex)[:, :, None]
    else:     # E4M3 + UE8M0: floor 1e-4, fp32(1/448)
        ex = _ceil_log2(tl.maximum(amax, 1e-4) * 0.002232142857142857)
        q = tl.minimum(tl.maximum(x * _exp2i(-ex)[:, :, None], -448.0), 448.0)
        deq = q.to(tl.float8e4nv).to(tl.float32) * _exp2i(ex)[:, :, None]
    tl.store(out_ptr + offs, deq.to(OUT_DTYPE), mask=rmask[:, None, None])


def fake_quant_supported(x, fmt: str, block: int) -> bool:
    d = x.shape[-1] if x.dim() else 0
    return (x.is_cuda and x.dtype in _FLOAT_DTYPES and fmt in ("fp8_ue8m0", "fp4_ue8m0")
            and block in (16, 32) and d % block == 0 and _pow2(d // block))


def fake_quant(x, fmt: str, block: int, *, rows_per_program: int = 4):
    """x [..., D] -> x through the block-scaled format and back, in x's dtype."""
    x2 = _rows(x)
    n, d = x2.shape
    out = torch.empty_like(x2)
    if n:
        _fake_quant_kernel[(triton.cdiv(n, rows_per_program),)](
            x2, out, n, D=d, BLOCK=block, NB=d // block, FP4=fmt == "fp4_ue8m0",
            BR=rows_per_program, OUT_DTYPE=_TL_DTYPE[x.dtype], num_warps=4)
    return out.view(x.shape)


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
