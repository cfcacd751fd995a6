"""Ascend NPU implementations of v41graph's custom ops, dispatched lazily.

Nothing here imports torch_npu at import time. The kernels are registered for the PrivateUse1
dispatch key, which is the key torch_npu's "npu" device dispatches to once torch_npu has been
imported (it renames PrivateUse1 to "npu"); so on a machine without torch_npu these
registrations are inert, and on an Ascend machine they are reached only with NPU tensors, at
which point torch_npu is already loaded. Each kernel checks for the torch_npu function it needs
and raises a RuntimeError naming exactly what is missing.

Ops with a torch_npu equivalent:
  fused_wkv_rmsnorm   matmul (aclnn through torch) + torch_npu.npu_rms_norm
  rms_norm            torch_npu.npu_rms_norm
Ops without one keep the pure-torch reference (it runs on NPU tensors through torch_npu's
aten kernels): the cache writes (FP8 / FP4 E2M1 with UE8M0 or E4M3 scales have no torch_npu
quantize op with these exact formats), sparse_attention (the seed's P2: SparseFlashMla compiles
BF16 only), indexer_topk, indexer_topk_candidates, engram_hash, engram_gather, fp8_linear and
mxfp4_moe (torch_npu.npu_quant_matmul / npu_grouped_matmul on A2/A3 take int8/int4 with
per-channel and per-token scales, not E4M3 / E2M1 with E8M0 per 32: README, "Released weight
formats"). The Triton kernels in triton/ are the starting point for triton-ascend versions.
"""
from __future__ import annotations

import torch

from . import reference as ref

_NS = "v41graph"
_KEY = "privateuseone"     # torch_npu's device type before/after the rename


def torch_npu_module(need: str = ""):
    """import torch_npu, or raise a RuntimeError that says what is missing and how to get it."""
    try:
        import torch_npu  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            f"v41graph NPU kernels need torch_npu (and the Ascend CANN runtime it loads), but "
            f"`import torch_npu` failed: {e}. Install the torch-npu build matching torch "
            f"{torch.__version__} and source CANN's set_env.sh"
            + (f"; needed for {need}" if need else "")) from e
    if need and not hasattr(torch_npu, need):
        raise RuntimeError(f"v41graph: torch_npu {getattr(torch_npu, '__version__', '?')} has no "
                           f"torch_npu.{need}; upgrade torch-npu (npu_rms_norm needs >= 2.1)")
    return torch_npu


def _fused_wkv_rmsnorm_npu(x, wkv, norm_weight, eps):
    torch_npu = torch_npu_module("npu_rms_norm")
    y = torch.nn.functional.linear(x, wkv).float()      # rounded to x's dtype first, as the ref
    out = torch_npu.npu_rms_norm(y, norm_weight.float(), epsilon=float(eps))[0]
    return out.to(x.dtype)


def _rms_norm_npu(x, weight, eps, cast_before_weight=False):
    if cast_before_weight:     # npu_rms_norm multiplies by the weight in fp32: the reference here
        return ref.rms_norm(x, weight, eps, True).contiguous()
    torch_npu = torch_npu_module("npu_rms_norm")
    return torch_npu.npu_rms_norm(x.float(), weight.float(), epsilon=float(eps))[0].to(x.dtype)


def register() -> None:
    """Register the NPU kernels (idempotent; runs at package import, needs no torch_npu)."""
    global _REGISTERED
    if _REGISTERED:
        return
    torch.library.register_kernel(f"{_NS}::fused_wkv_rmsnorm", _KEY, _fused_wkv_rmsnorm_npu)
    torch.library.register_kernel(f"{_NS}::rms_norm", _KEY, _rms_norm_npu)
    _REGISTERED = True


_REGISTERED = False
register()
