"""RoPE kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  rope                reference.apply_rope in one launch: each row's leading channels copied,
                      the interleaved pairs after them rotated by the token's (cos, sin) in fp32.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import _FLOAT_DTYPES, _wait_for_inputs, pdl


# =============================================================================== rope
@triton.jit
def _rope_kernel(x_ptr, rot_ptr, out_ptr, M, D, HEAD, P, INVERSE: tl.constexpr,
                 BH: tl.constexpr, BP: tl.constexpr):
    """One row of x (program axis 0 over N*M rows): copy its first HEAD channels, rotate the
    P interleaved pairs after them by the row's token rotation (cos, sin), fp32 math."""
    _wait_for_inputs()
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
                              BP=max(16, triton.next_power_of_2(p)), num_warps=2, launch_pdl=pdl(x3.device))
    return out
