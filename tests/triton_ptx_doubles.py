"""Stand-ins for our kernels' inline-PTX decodes (and libdevice's exp, log1p and rsqrt), in plain Triton ops, so the
whole kernels run in Triton's CPU interpreter (which cannot run inline assembly or libdevice). Each stand-in computes what its PTX
original's docstring promises, from the codes' definitions; tests/test_ptx_decodes_cpu.py checks
the PTX itself against the same definitions, so a kernel test with the stand-ins plus that PTX
test cover the kernel as the GPU runs it.

Import this only inside an interpreted script (tests/triton_interpreter.py), then `install()`."""
from __future__ import annotations

import triton
import triton.language as tl

from v41graph.custom_ops.triton import attention, common, mhc, moe_fp4, moe_gate, quant_gemm, swiglu
from v41graph.custom_ops.triton.common import _e2m1_decode


@triton.jit
def _e2m1_bytes_to_bf16(packed, scale):
    """common._e2m1_bytes_to_bf16: (even, odd) = e2m1(low nibble), e2m1(high nibble) x scale."""
    c = packed.to(tl.int32)
    s = scale.to(tl.float32)
    return (_e2m1_decode(c & 0xF) * s).to(tl.bfloat16), (_e2m1_decode(c >> 4) * s).to(tl.bfloat16)


@triton.jit
def _e4m3_pairs_to_bf16(words, scale):
    """common._e4m3_pairs_to_bf16: int16 words of two E4M3 bytes (element 2i low) x scale."""
    w = words.to(tl.int32)
    s = scale.to(tl.float32)
    lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    hi = ((w >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return (lo * s).to(tl.bfloat16), (hi * s).to(tl.bfloat16)


@triton.jit
def _fp4_block_e4m3(w_ptr, rows, row_mask, kb, K, BN: tl.constexpr):
    """common._fp4_block_e4m3: a 32-wide K block's E2M1 codes as E4M3 (value x 2^-6), split-pairs
    order, by the same bit moves done on whole bytes."""
    p = tl.load(w_ptr + rows[:, None] * (K // 2) + kb * 16 + tl.arange(0, 16)[None, :],
                mask=row_mask[:, None], other=0).to(tl.int32)
    even = ((p << 2) & 0x1C) | ((p << 4) & 0x80)
    odd = ((p >> 2) & 0x1C) | (p & 0x80)
    w = tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), (BN, 32))
    return w.to(tl.uint8).to(tl.float8e4nv, bitcast=True)


_STAND_INS = {"_e2m1_bytes_to_bf16": _e2m1_bytes_to_bf16, "_e4m3_pairs_to_bf16": _e4m3_pairs_to_bf16,
              "_fp4_block_e4m3": _fp4_block_e4m3}


@triton.jit
def _libdevice_exp(x):
    """libdevice.exp, the accurate exp: the interpreter's tl.exp (numpy's, also accurate; it may
    differ from torch's CPU exp in the last bit)."""
    return tl.exp(x)


@triton.jit
def _libdevice_log1p(x):
    """libdevice.log1p: log(1 + x) in the interpreter (not correctly rounded for small x)."""
    return tl.log(1.0 + x)


@triton.jit
def _libdevice_rsqrt(x):
    """libdevice.rsqrt: 1 / sqrt(x) in the interpreter."""
    return 1.0 / tl.sqrt(x)


@triton.jit
def _div_fast(a, b):
    """mhc._div_fast: a / b rounded to nearest (the interpreter's division is IEEE's)."""
    return tl.math.div_rn(a, b)


class _Libdevice:
    exp = _libdevice_exp
    log1p = _libdevice_log1p
    rsqrt = _libdevice_rsqrt


def install() -> None:
    """Point every kernel module's name for a PTX decode at its stand-in (the interpreter looks
    a jit function's callees up in its module's globals at call time)."""
    for module in (common, attention, moe_fp4, quant_gemm):
        for name, stand_in in _STAND_INS.items():
            if hasattr(module, name):
                setattr(module, name, stand_in)
    mhc.libdevice = moe_gate.libdevice = swiglu.libdevice = _Libdevice
    mhc._div_fast = _div_fast
