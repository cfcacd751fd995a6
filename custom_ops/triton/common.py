"""Pieces shared by the Triton kernel modules (imported lazily, never at package import).

Host side: the torch -> Triton dtype table, the float dtypes the kernels accept, `_pow2`, the
device's SM count (grid sizing) and `_rows` (a tensor as contiguous [rows, last dim]).
@triton.jit helpers inlined by several families: exact ceil(log2) and 2^e from the fp32 bits
(UE8M0 scale exponents) and the FP4 E2M1 encode/decode, used by the cache writes, fake
quantization, sparse attention and the lightning indexer; a program's rows and their indices
(cache writes, Engram gather).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


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


@triton.jit
def _program_rows(index_ptr, n_rows, other, BR: tl.constexpr):
    """The BR rows of this program, their in-range mask and each row's int64 index (a cache
    slot or a table row) loaded from index_ptr (`other` for rows out of range)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    in_range = r < n_rows
    index = tl.load(index_ptr + r, mask=in_range, other=other).to(tl.int64)
    return r, in_range, index


# =============================================================================== quantized GEMM tiles
# The checkpoint's FP8 / FP4 weights feed FP8 tensor-core dots as stored, one 32-wide K block
# per dot, each partial times its activation and weight scales into an fp32 accumulator: the
# reference's own formulation (reference.blockwise_gemm), in the same block order
# (quant_gemm.py, moe_fp4.py).
@triton.jit
def _quant_fp8_block(x):
    """x [BM, 32] fp32 -> (E4M3 codes [BM, 32], fp32 power-of-two scales [BM]): one UE8M0 scale
    per row of 32 (codecs.quant_fp8_ue8m0: amax floor 1e-4, scale 2^ceil(log2(amax/448)))."""
    amax = tl.max(tl.abs(x), axis=1)
    ex = _ceil_log2(tl.maximum(amax, 1e-4) * 0.002232142857142857)     # fp32(1/448)
    q = x * _exp2i(-ex)[:, None]
    return tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv), _exp2i(ex)


@triton.jit
def _e2m1_as_e4m3(c):
    """E2M1 codes (int32 0..15) -> E4M3 bytes of the same values times 2^-6, exactly: the
    exponent and mantissa bits drop into E4M3's low exponent and top mantissa bits (E2M1's
    subnormal 0.5 lands on E4M3's subnormal 2^-7), the sign moves to bit 7."""
    return (((c & 7) << 2) | ((c & 8) << 4)).to(tl.uint8)


@triton.jit
def _fp4_block_as_e4m3(w_ptr, rows, row_mask, k0, K, BN: tl.constexpr):
    """Columns k0..k0+32 of MXFP4 rows `rows` [BN] (int64; packed [N, K/2], even column in the
    low nibble) as E4M3 [BN, 32] holding the E2M1 values times 2^-6."""
    b = k0 // 2 + tl.arange(0, 16)
    p = tl.load(w_ptr + rows[:, None] * (K // 2) + b[None, :], mask=row_mask[:, None], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(_e2m1_as_e4m3(p & 15), _e2m1_as_e4m3(p >> 4)), (BN, 32))
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _e8m0(scale_bytes, extra_exponent):
    """E8M0 bytes -> fp32 2^(byte - 127 + extra_exponent)."""
    return _exp2i(scale_bytes.to(tl.int32) - 127 + extra_exponent)


def _capability_at_least(device: torch.device, major: int, minor: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (major, minor)
