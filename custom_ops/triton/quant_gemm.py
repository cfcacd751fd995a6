"""fp8_linear on CUDA: x times the checkpoint's FP8 E4M3 weight with E8M0 scales per 32x32
block, the activation's FP8 quantization fused in (imported lazily by cuda_impls.py).

Decode and small batches (M < PREFILL_ROWS, or a result that is not bf16): one kernel. A
program owns a [BM, BN] output tile and a share of K (split-K when the tile grid alone would
leave SMs idle, as in decode); per BK step it loads the activation tile (from
QUANTIZE_FIRST_ROWS rows on, x quantized once by `quantize_rows`; below, quantized per 32 in
registers, common._qdq_fp8_blocks, which at one real row is cheaper than a launch), loads the FP8 weight tile with its block scales,
dequantizes it to bf16 (exact) and accumulates a bf16 tensor-core dot in fp32. Split-K
partials go to an fp32 workspace [S, M, N] summed by torch in a fixed order (deterministic;
no atomics), then cast once, as the reference casts once.

Prefill (M >= PREFILL_ROWS, a bf16 result): the activation is quantized by one kernel, the
weight dequantized to a transient bf16 copy by another, and cuBLAS multiplies them
(`_fp8_linear_prefill`): the Triton kernel reached only 0.20-0.34x of cuBLAS there on the
H200, this path 0.71-0.96x (docs/BENCHMARKS.md, eighth session).

The tile table (`_config`) comes from scripts/bench_ops.py --only quant on the H200.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .common import (_FLOAT_DTYPES, _capability_at_least, _fp8_weight_tile, _num_sms,
                     _qdq_fp8_blocks, _rows)

_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per reason and process: the op then runs the reference."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def fp8_capable(device: torch.device) -> bool:
    """FP8 E4M3 conversions in Triton need sm89+ (Ada / Hopper); older GPUs run the reference."""
    if _capability_at_least(device, 8, 9):
        return True
    warn_once("fp8-capability", f"v41graph: {torch.cuda.get_device_name(device)} (sm"
              f"{''.join(map(str, torch.cuda.get_device_capability(device)))}) has no FP8 conversions "
              "(sm89+ needed): fp8_linear / mxfp4_moe run the pure-torch reference")
    return False


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_PER_SPLIT,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANTIZED: tl.constexpr):
    """QUANTIZED: x is already FP8-quantized per 32 (quantize_rows); else quantize each tile."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BM + tl.arange(0, BM)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=m_mask[:, None], other=0.0)
        if QUANTIZED:
            a = a.to(tl.bfloat16)
        else:
            a = _qdq_fp8_blocks(a.to(tl.float32), BM, BK).to(tl.bfloat16)
        w = _fp8_weight_tile(w_ptr, s_ptr, n, n_mask, k0, K, BN, BK)
        acc = tl.dot(a, tl.trans(w), acc)
    out = out_ptr + pid_k.to(tl.int64) * M * N + m[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def fp8_linear_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dtype in _FLOAT_DTYPES and weight.dtype == torch.uint8 and weight.dim() == 2
            and scale.dtype == torch.uint8 and weight.is_contiguous() and scale.is_contiguous()
            and weight.device == x.device == scale.device and x.shape[-1] == weight.shape[1]):
        return False
    n, k = weight.shape
    if k % 32 or tuple(scale.shape) != (-(-n // 32), k // 32):
        return False
    return fp8_capable(x.device)


def _block_k(k: int, largest: int) -> int:
    bk = largest
    while k % bk:
        bk //= 2
    return bk


def _config(m: int, n: int, k: int, device: torch.device):
    """(BM, BN, BK, split, num_warps, num_stages) for an [m, k] x [n, k]^T product: the best
    configs of the H200 sweep (scripts/bench_ops.py --only quant), split-K until the grid
    covers the SMs twice."""
    if m <= 16:
        bm, bn, bk, warps, stages = 16, 128, _block_k(k, 128), 4, 3
    elif m <= 64:
        bm, bn, bk, warps, stages = 64, 128, _block_k(k, 128), 4, 3
    else:
        bm, bn, bk, warps, stages = 128, 256, _block_k(k, 64), 8, 3
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = k // bk
    split = 1
    while tiles * split < 2 * _num_sms(device) and split * 2 <= steps and split < 16:
        split *= 2
    return bm, bn, bk, split, warps, stages


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    k0 = tl.program_id(1) * BK
    w = _fp8_weight_tile(w_ptr, s_ptr, n, n < N, k0, K, BN, BK)
    k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + n[:, None] * K + k[None, :], w, mask=(n < N)[:, None])


@triton.jit
def _qdq_rows_kernel(x_ptr, out_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    offs = m[:, None].to(tl.int64) * K + k[None, :]
    x = tl.load(x_ptr + offs, mask=(m < M)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _qdq_fp8_blocks(x, BM, BK).to(tl.bfloat16), mask=(m < M)[:, None])


PREFILL_ROWS = 256   # from here on: dequantize the weight (transient bf16) + cuBLAS
QUANTIZE_FIRST_ROWS = 17   # from here on the decode kernel reads x quantized once (quantize_rows):
                           # re-quantizing it in every output tile cost more than the extra launch


def quantize_rows(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] (K % 32 == 0) FP8-quantized per 32 (codecs.qdq_fp8_ue8m0's values), as bf16:
    the values are E4M3 codes times powers of two, which bf16 holds exactly."""
    m, k = x2.shape
    bk = _block_k(k, 128)
    a = torch.empty((m, k), device=x2.device, dtype=torch.bfloat16)
    _qdq_rows_kernel[(triton.cdiv(m, 32), k // bk)](x2, a, m, k, BM=32, BK=bk, num_warps=4)
    return a


def _fp8_linear_prefill(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Prefill shapes: the activation quantized per 32 (exact values, so bf16 holds them)
    times the weight dequantized to bf16 (exact too), in cuBLAS: the same products and an fp32
    accumulation at cuBLAS's speed, for a transient bf16 copy of this one weight."""
    n, k = weight.shape
    bk = _block_k(k, 128)
    dense = torch.empty((n, k), device=x2.device, dtype=torch.bfloat16)
    _fp8_dequant_kernel[(triton.cdiv(n, 64), k // bk)](weight, scale, dense, n, k, BN=64, BK=bk, num_warps=4)
    return torch.nn.functional.linear(quantize_rows(x2), dense)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               config=None) -> torch.Tensor:
    """`config` (BM, BN, BK, split, num_warps, num_stages) overrides the table (bench_ops' sweep)."""
    x2 = _rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if config is None and m >= PREFILL_ROWS and out_dtype == torch.bfloat16:
        return _fp8_linear_prefill(x2, weight, scale).view(*x.shape[:-1], n)
    bm, bn, bk, split, warps, stages = config or _config(m, n, k, x.device)
    k_per_split = triton.cdiv(k // bk, split) * bk
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n) if split > 1 else (m, n), device=x.device,
                      dtype=torch.float32 if split > 1 else out_dtype)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    quantized = m >= QUANTIZE_FIRST_ROWS
    _fp8_linear_kernel[grid](quantize_rows(x2) if quantized else x2, weight, scale, out, m, n, k, k_per_split,
                             BM=bm, BN=bn, BK=bk, QUANTIZED=quantized, num_warps=warps, num_stages=stages)
    if split > 1:
        out = out.sum(0).to(out_dtype)
    return out.view(*x.shape[:-1], n)
