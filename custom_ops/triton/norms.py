"""RMSNorm kernels (CUDA; imported lazily by cuda_impls.py, never at package import).

  fused_wkv_rmsnorm   RMSNorm(x @ wkv^T) in one launch: split-K GEMM tiles, the last program of
                      each row block (found with an atomic counter, no spinning) sums the partials
                      in a fixed order (deterministic) and applies the RMSNorm in registers.
                      Above WKV_FUSED_MAX_M rows (prefill): cuBLAS GEMM + the row RMSNorm kernel.
  rms_norm            RMSNorm over the last dim, one program per row (per 4 rows when short).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _FLOAT_DTYPES, _num_sms, _rows, _wait_for_inputs, pdl, zeroed_workspace


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
    _wait_for_inputs()
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
def _rmsnorm_rows_kernel(y_ptr, nw_ptr, out_ptr, M, N, eps, BR: tl.constexpr, NP2: tl.constexpr,
                         CAST_BEFORE_WEIGHT: tl.constexpr):
    _wait_for_inputs()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, NP2)
    msk = (rows < M)[:, None] & (cols < N)[None, :]
    off = rows[:, None].to(tl.int64) * N + cols[None, :]
    y = tl.load(y_ptr + off, mask=msk, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(y * y, axis=1) / N + eps)
    normed = y * r[:, None]
    if CAST_BEFORE_WEIGHT:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    nw = tl.load(nw_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + off, (nw[None, :] * normed).to(out_ptr.dtype.element_ty), mask=msk)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and weight.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() >= 1
            and weight.dim() == 1 and weight.is_contiguous() and weight.shape[0] == x.shape[-1]
            and 0 < x.shape[-1] <= 16384)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim (reference.rms_norm): one program per row (per 4 rows when rows
    are short), fp32 math, result in x's dtype, contiguous."""
    x2 = _rows(x)
    m, n = x2.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if m:
        np2 = max(16, triton.next_power_of_2(n))
        rows = 1 if np2 >= 2048 else 4
        _rmsnorm_rows_kernel[(triton.cdiv(m, rows),)](
            x2, weight, out, m, n, float(eps), BR=rows, NP2=np2, CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            num_warps=8 if np2 >= 4096 else 4, launch_pdl=pdl(x2.device))
    return out


WKV_FUSED_MAX_M = 128          # above: cuBLAS GEMM + one RMSNorm kernel (prefill)
_WKV_ACC_FLOATS = WKV_FUSED_MAX_M * 1024


def _wkv_state(device: torch.device):
    """(fp32 accumulator, int32 counters), zeroed, one pair per device and flow
    (common.zeroed_workspace); the kernel leaves both zeroed again after every launch."""
    return (zeroed_workspace("wkv_acc", _WKV_ACC_FLOATS, torch.float32, device),
            zeroed_workspace("wkv_counts", 1024, torch.int32, device))


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
                                                   BR=br, NP2=np2, CAST_BEFORE_WEIGHT=False, num_warps=4,
                                                   launch_pdl=pdl(y.device))
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
        num_warps=warps, num_stages=stages, launch_pdl=pdl(x2.device))
    return out
