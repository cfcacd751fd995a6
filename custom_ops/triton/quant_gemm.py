"""fp8_linear on CUDA: x times the checkpoint's FP8 E4M3 weight with E8M0 scales per 32x32
block, the activation's FP8 quantization fused in (imported lazily by cuda_impls.py).

One kernel for every shape: a program owns a [BM, BN] output tile and a share of K (split-K
when the tile grid alone would leave SMs idle, as in decode). Per 32-wide K block it loads the
activation block and quantizes it to E4M3 in registers (common._quant_fp8_block: the reference's
codes and scale), loads the weight block's E4M3 bytes as they are stored, runs an FP8
tensor-core dot and adds the partial times both scales to an fp32 accumulator: the reference's
per-block formulation in the reference's block order. What can differ is the sum of the 32
products inside the tensor core (its accumulation is narrower than fp32). Split-K partials go to an fp32 workspace [S, M, N] summed by torch in
a fixed order (deterministic; no atomics), then cast once, as the reference casts once.

The tile table (`_config`) comes from scripts/bench_ops.py --only quant on the H200.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

from .common import _FLOAT_DTYPES, _capability_at_least, _e8m0, _num_sms, _quant_fp8_block, _rows

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
                       BM: tl.constexpr, BN: tl.constexpr, SUB: tl.constexpr):
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BM + tl.arange(0, BM)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_mask, n_mask = m < M, n < N
    x_rows = x_ptr + m[:, None].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k_step in range(k_lo, k_hi, 32 * SUB):
        for j in tl.static_range(SUB):          # one 32-wide K block per dot, as the reference
            k0 = k_step + 32 * j
            k = k0 + tl.arange(0, 32)
            q, a_s = _quant_fp8_block(tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32))
            w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_mask[:, None], other=0)
            w_s = _e8m0(tl.load(s_ptr + (n // 32) * (K // 32) + k0 // 32, mask=n_mask, other=127), 0)
            acc += tl.dot(q, tl.trans(w.to(tl.float8e4nv, bitcast=True))) * (a_s[:, None] * w_s[None, :])
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


def _sub_blocks(k: int, largest: int) -> int:
    """32-wide K blocks per loop step: the largest power of two <= `largest` dividing k / 32."""
    sub = largest
    while (k // 32) % sub:
        sub //= 2
    return sub


def _config(m: int, n: int, k: int, device: torch.device):
    """(BM, BN, SUB, split, num_warps, num_stages) for an [m, k] x [n, k]^T product: split-K
    until the grid covers the SMs twice (decode), one K range per tile for prefill."""
    if m <= 16:
        bm, bn, sub, warps, stages = 16, 64, 4, 4, 3
    elif m <= 64:
        bm, bn, sub, warps, stages = 64, 64, 4, 4, 3
    else:
        bm, bn, sub, warps, stages = 128, 128, 2, 8, 3
    sub = _sub_blocks(k, sub)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    steps = k // (32 * sub)
    split = 1
    while tiles * split < 2 * _num_sms(device) and split * 2 <= steps and split < 16:
        split *= 2
    return bm, bn, sub, split, warps, stages


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               config=None) -> torch.Tensor:
    """`config` (BM, BN, SUB, split, num_warps, num_stages) overrides the table (bench_ops' sweep)."""
    x2 = _rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    bm, bn, sub, split, warps, stages = config or _config(m, n, k, x.device)
    sub = _sub_blocks(k, sub)
    step = 32 * sub
    k_per_split = triton.cdiv(k // step, split) * step
    split = triton.cdiv(k, k_per_split)
    out = torch.empty((split, m, n) if split > 1 else (m, n), device=x.device,
                      dtype=torch.float32 if split > 1 else out_dtype)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _fp8_linear_kernel[grid](x2, weight, scale, out, m, n, k, k_per_split, BM=bm, BN=bn, SUB=sub,
                             num_warps=warps, num_stages=stages)
    if split > 1:
        out = out.sum(0).to(out_dtype)
    return out.view(*x.shape[:-1], n)
