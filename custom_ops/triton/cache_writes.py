"""Cache-write and fake-quantization kernels (CUDA; imported lazily by cuda_impls.py, never at
package import). Both quantize rows in registers with common.py's encoders, the same arithmetic.

  window_kv_write     FP8 E4M3 + UE8M0 per 32            } one program per few rows, quantize in
  global_kv_write     FP4 E2M1 + E4M3 per 16             } registers, scatter by slot; slot -1
  index_k_write       FP4 E2M1 + UE8M0 per 32            } rows are skipped. Bit-identical.
  fake_quant          FP8 E4M3 / FP4 E2M1 + UE8M0 quantize-dequantize of rows (window KV, the
                      indexer query); bit-identical to codecs.qdq_*.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (_FLOAT_DTYPES, _TL_DTYPE, _ceil_log2, _e2m1_decode, _e2m1_encode, _exp2i, _pow2, _program_rows,
                     _rows, _wait_for_inputs, pdl)


# =============================================================================== cache writes
@triton.jit
def _fp8_ue8m0_write_kernel(x_ptr, slot_ptr, cache_ptr, scale_ptr, N,
                            D: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
                            BR: tl.constexpr):
    _wait_for_inputs()
    r, rmask, slot = _program_rows(slot_ptr, N, -1, BR)
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
    _wait_for_inputs()
    r, rmask, slot = _program_rows(slot_ptr, N, -1, BR)
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


def window_kv_write(cache, scale, kv, slot_mapping, *, rows_per_program: int = 4) -> None:
    x = _rows(kv)
    n, d = x.shape
    if n == 0:
        return
    _fp8_ue8m0_write_kernel[(triton.cdiv(n, rows_per_program),)](
        x, slot_mapping, cache, scale.view(torch.uint8), n, D=d, BLOCK=32, NB=d // 32,
        BR=rows_per_program, num_warps=4, launch_pdl=pdl(x.device))


def _fp4_write(cache, scale, x, slot_mapping, block: int, e4m3_scale: bool, rows_per_program: int):
    x = _rows(x)
    n, d = x.shape
    if n == 0:
        return
    _fp4_write_kernel[(triton.cdiv(n, rows_per_program),)](
        x, slot_mapping, cache, scale.view(torch.uint8), n, D=d, BLOCK=block, NB=d // block,
        HALF=block // 2, E4M3_SCALE=e4m3_scale, BR=rows_per_program, num_warps=4, launch_pdl=pdl(x.device))


def global_kv_write(cache, scale, kv, slot_mapping, *, rows_per_program: int = 4) -> None:
    """FP4 E2M1 + E4M3 scale per 16."""
    _fp4_write(cache, scale, kv, slot_mapping, 16, True, rows_per_program)


def index_k_write(cache, scale, k, slot_mapping, *, rows_per_program: int = 8) -> None:
    """FP4 E2M1 + UE8M0 scale per 32."""
    _fp4_write(cache, scale, k, slot_mapping, 32, False, rows_per_program)


# =============================================================================== fake quantization
@triton.jit
def _fake_quant_kernel(x_ptr, out_ptr, n_rows, D: tl.constexpr, BLOCK: tl.constexpr,
                       NB: tl.constexpr, FP4: tl.constexpr, BR: tl.constexpr,
                       OUT_DTYPE: tl.constexpr):
    """Quantize + dequantize BR rows in registers, the same arithmetic as the cache-write
    kernels (so the values equal what a cache would hold, bit for bit)."""
    _wait_for_inputs()
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
            BR=rows_per_program, OUT_DTYPE=_TL_DTYPE[x.dtype], num_warps=4, launch_pdl=pdl(x2.device))
    return out.view(x.shape)
