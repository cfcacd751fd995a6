"""The shared expert's activation kernel (CUDA; imported lazily by cuda_impls.py).

  swiglu      h = silu(min(gate, limit)) * clamp(up, -limit, limit) in fp32, stored in the
              inputs' dtype (reference.swiglu_in_dtype): one launch instead of the seven
              kernels of the torch form (two upcasts, two clamps, silu, the product, the
              downcast), forty times a decode step.

Written to give the torch form's bits on the GPU (tests/test_kernels_cuda.py asks for every
bit; not yet run on a GPU): silu is x / (1 + exp(-x)) with libdevice's accurate exp and a
correctly rounded division, as torch's CUDA silu computes it (tl.exp and `/` would take the
approximate ex2 and division); the clamps keep NaN, as torch.clamp does. The MXFP4 MoE's
epilogue (moe_fp4._swiglu_h) computes the routed experts' SwiGLU with the fast exp and division
instead: it is inside a GEMM whose sums already differ from the reference's order, so it is not
reused here, nor this one there.
libdevice does not run in Triton's CPU interpreter (tests substitute it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import _TL_DTYPE, _wait_for_inputs, pdl


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, numel, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    _wait_for_inputs()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:      # comparisons, not min/max: a NaN stays NaN
        gate = tl.where(gate > limit, limit, gate)
        up = tl.where(up > limit, limit, tl.where(up < -limit, -limit, up))
    silu = tl.math.div_rn(gate, 1.0 + libdevice.exp(-gate))
    tl.store(out_ptr + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def swiglu_supported(gate, up) -> bool:
    return (gate.is_cuda and up.is_cuda and gate.dtype in _TL_DTYPE and gate.dtype == up.dtype
            and gate.shape == up.shape)


def swiglu(gate, up, limit: float, *, block: int = 1024):
    """gate, up [..., I] (bf16, fp16 or fp32) -> h [..., I] in their dtype."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    numel = gate.numel()
    if numel:
        _swiglu_kernel[(triton.cdiv(numel, block),)](
            gate, up, out, numel, float(limit), CLAMP=limit > 0, BLOCK=block, num_warps=4,
            enable_fp_fusion=False, launch_pdl=pdl(gate.device))    # the product rounded alone, as torch's mul
    return out
