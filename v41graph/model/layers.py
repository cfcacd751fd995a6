"""Building blocks shared by the model: RMSNorm, the quantization-aware Linear, RoPE.

Numerics modes (set per model, see `V41Model.set_numerics`):
  "reference"  DeepSeek's reference arithmetic (custom_ops/reference.py, pure torch on every
               device): FP8/FP4 weights stay quantized, activations are quantized to FP8 per 32
               along K (pow2 scales), and the GEMM sums fp32 partials per 32-wide K block times
               both scales, cast to the activation dtype.
  "released"   the same arithmetic through the `fp8_linear` / `mxfp4_moe` ops: weights stay in
               their checkpoint bytes on the device (no dense copy); on CUDA Triton kernels
               dequantize the weight tiles in registers and fuse the activation quantization
               (they differ from the reference only in summation order); elsewhere the ops run
               the reference, so on the CPU "released" is "reference" bit for bit.
  "fast"       weights are dequantized once to the compute dtype and F.linear does the rest.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from v41graph.custom_ops import codecs
from v41graph.custom_ops import reference as ref
from v41graph.custom_ops.reference import rms_norm as rms_norm_reference

NUMERICS = ("reference", "released", "fast")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules under `dtype` as torch's default (DeepSeek's checkpoints assume bf16)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class RMSNorm(nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)), in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # plain torch ops (the compiler's fuse_rmsnorm / P1 passes match them in the graph);
        # the same function is the reference of the v41graph::rms_norm op
        return rms_norm_reference(x, self.weight, self.eps)


def weight_fmt(config, fmt: str) -> str:
    """The released format of a weight ("fp8"/"fp4"), or "dense" when the config asks for it."""
    return fmt if config.weight_format == "checkpoint" else "dense"


class Linear(nn.Module):
    """A bias-free Linear whose weight is dense (bf16/fp32), FP8 E4M3 with one E8M0 scale per
    32x32 block, or FP4 E2M1 packed [out, in/2] with one E8M0 scale per 32 along K."""

    def __init__(self, in_features: int, out_features: int, fmt: str = "dense",
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.numerics = "fast"
        if fmt == "dense":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        elif fmt == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(math.ceil(out_features / 32), math.ceil(in_features / 32),
                                                  dtype=torch.uint8), requires_grad=False)
        elif fmt == "fp4":
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // 32, dtype=torch.uint8),
                                      requires_grad=False)
        else:
            raise ValueError(f"Linear: unknown weight format {fmt!r}")
        self._dense_cache: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as fp32 values (exact for FP8/FP4 times power-of-two scales)."""
        if self.fmt == "dense":
            return self.weight.float()
        if self.fmt == "fp8":
            return codecs.dequant_fp8_weight(self.weight.view(torch.float8_e4m3fn), self.scale)
        return codecs.dequant_fp4_weight(self.weight, self.scale)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype, or in `out_dtype`: a row-parallel split asks
        for fp32 partial sums, which the reference GEMM then returns before its final cast."""
        if self.fmt == "dense":
            y = F.linear(x, self.weight.to(x.dtype) if self.weight.dtype != x.dtype else self.weight)
        elif self.numerics == "released" and self.fmt == "fp8":
            return torch.ops.v41graph.fp8_linear(x, self.weight, self.scale, out_dtype or x.dtype)
        elif self.numerics in ("reference", "released"):   # FP4 outside the MoE op: the reference
            decode = ref.fp8_weight_values if self.fmt == "fp8" else ref.fp4_weight_values
            return ref.quantized_linear(x, *decode(self.weight, self.scale), out_dtype or x.dtype)
        else:
            if self._dense_cache is None or self._dense_cache.dtype != x.dtype:
                self._dense_cache = self.dequantized_weight().to(x.dtype)
            y = F.linear(x, self._dense_cache)
        return y if out_dtype is None else y.to(out_dtype)


def set_linear_numerics(module: nn.Module, numerics: str) -> None:
    """Put every Linear under `module` in one of NUMERICS. Their dense-weight caches are
    dropped: they may predate a weight (re)load, and only "fast" uses them."""
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
    for m in module.modules():
        if isinstance(m, Linear):
            m.numerics = numerics
            m._dense_cache = None


# ----------------------------------------------------------------------------- RoPE
def rope_inv_freqs(rope_dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                   beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """Per-pair inverse frequencies [rope_dim/2], with YaRN interpolation when
    original_seq_len > 0 (a linear ramp between the beta_fast and beta_slow correction dims)."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        def correction_dim(n_rot: float) -> float:
            return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_rotation(positions: torch.Tensor, inv_freqs: torch.Tensor) -> torch.Tensor:
    """Complex rotations [*, rope_dim/2] for the given integer positions."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freqs
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs of the LAST dims of x (x[..., -2*pairs:]); returns a new tensor.
    rotation [N, pairs] broadcasts over any head dims between N and the channels. The math is
    custom_ops/reference.apply_rope; the `rope` op runs it as one kernel on CUDA."""
    return torch.ops.v41graph.rope(x, rotation, inverse)
