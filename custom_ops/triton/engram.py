"""Engram gather kernel (CUDA; imported lazily by cuda_impls.py, never at package import).

  engram_gather       FP8 rows + E8M0/32 scales, dequantized; the table may be a device tensor
                      or a pinned host tensor read directly over PCIe (UVA).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import _TL_DTYPE, _pow2, _program_rows, _wait_for_inputs, pdl


class _HostPtr:
    """Hands Triton a pinned host tensor: under UVA its address is valid on the device."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


# =============================================================================== Engram gather
@triton.jit
def _engram_gather_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, n_rows,
                          DH: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr,
                          OUT_DTYPE: tl.constexpr):
    _wait_for_inputs()
    r, rm, ids = _program_rows(ids_ptr, n_rows, 0, BR)
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
        num_warps=2 if rows_per_program * dh <= 1024 else 4, launch_pdl=pdl(out.device))
    return out
