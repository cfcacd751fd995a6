"""Number formats of V4.1: FP4 E2M1, FP8 E4M3 and the E8M0 / UE8M0 power-of-two scales.

Pure torch, used by the reference op implementations, the weight loader and the tests.

  E2M1   magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 = sign, no inf/NaN; round to nearest,
         ties to the even code; saturates at +-6. Packed two per byte, element 2i in the low
         nibble.
  E4M3   torch.float8_e4m3fn (max 448); values are clamped before the cast, which rounds to
         nearest even.
  E8M0   a byte e meaning 2^(e-127) (torch.float8_e8m0fnu where available; kept as uint8 here
         so the code also runs where that dtype is missing).

The "QDQ" helpers quantize and dequantize in one go, which is how the reference computes
(fake quant); the cache writes store the real packed bytes, whose dequantized values are
bit-identical to the QDQ result.
"""
from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Decision boundaries between neighbouring E2M1 magnitudes, and for each whether an exact tie
# goes up (True: the upper code is even) or stays down.
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


# ----------------------------------------------------------------------------- E2M1 (FP4)
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float tensor -> uint8 codes 0..15 (sign in bit 3), RNE, saturating at +-6.
    Scalar comparisons only (no host-side tables), so it also runs inside a CUDA-graph capture."""
    a = x.abs().float()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, tie_up in zip(_E2M1_BOUNDS, _E2M1_TIE_UP):
        mag = mag + ((a > bound) | ((a == bound) & tie_up)).to(torch.uint8)
    sign = (torch.signbit(x) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 codes 0..15 -> float values: magnitude code = exponent (2 bits) | mantissa (1 bit),
    0.5*m when the exponent is 0, else 2^(e-1) * (1 + m/2)."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).float()
    val = torch.where(e == 0, 0.5 * m, torch.ldexp(1.0 + 0.5 * m, e - 1))
    return torch.where((c & 8) != 0, -val, val).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2n] codes -> [..., n] bytes; element 2i goes in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {codes.shape[-1]} must be even")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes (low nibble first)."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- scales
def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 powers of two 2^(e-127)."""
    if e.dtype != torch.uint8:
        e = e.view(torch.uint8)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)


def float_to_e8m0(s: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two -> E8M0 bytes (uint8). Non-powers of two are rounded up."""
    return (ceil_log2(s) + 127).clamp(0, 254).to(torch.uint8)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive fp32 x, read off the bits (no log rounding).
    Subnormals are scaled by 2^64 first (exact) so their exponent field is meaningful."""
    x = x.float()
    tiny = x < 2.0 ** -126
    x = torch.where(tiny, x * 2.0 ** 64, x)
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32) - tiny.to(torch.int32) * 64


def pow2_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """UE8M0 scale: 2^ceil(log2(max(amax, floor) * fp32(1/qmax))), in fp32."""
    # A Python scalar multiplies an fp32 tensor as fp32(1/qmax), like the reference's fp32
    # constant (1/448 is not exact in fp32); no host tensor, so this also runs in a capture.
    v = amax.float().clamp_min(floor) * (1.0 / qmax)
    return torch.ldexp(torch.ones_like(v), ceil_log2(v))


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest E4M3 value (clamped to +-448), returned as fp32."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


# ----------------------------------------------------------------------------- block helpers
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


# FP8 E4M3 with one UE8M0 scale per `block` (window KV, GEMM activations)
ACT_AMAX_FLOOR = 1e-4


def quant_fp8_ue8m0(x: torch.Tensor, block: int = 32):
    """x [..., K] -> (float8_e4m3fn [..., K], E8M0 bytes [..., K/block])."""
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), E4M3_MAX, ACT_AMAX_FLOOR)
    q = (xb / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2), float_to_e8m0(scale.squeeze(-1))


def dequant_fp8_ue8m0(q: torch.Tensor, scale_e8m0: torch.Tensor, block: int = 32) -> torch.Tensor:
    s = e8m0_to_float(scale_e8m0).unsqueeze(-1)
    return (_blocks(q.float(), block) * s).flatten(-2)


def qdq_fp8_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Fake-quant x through FP8 E4M3 / UE8M0-per-block; returns x's dtype."""
    q, s = quant_fp8_ue8m0(x, block)
    return dequant_fp8_ue8m0(q, s, block).to(x.dtype)


# FP4 E2M1 with one UE8M0 scale per `block` (index keys, indexer queries, expert weights)
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126   # smallest normal amax the pow2 scale can express


def quant_fp4_ue8m0(x: torch.Tensor, block: int = 32):
    """x [..., K] -> (packed bytes [..., K/2], E8M0 bytes [..., K/block])."""
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(-1, keepdim=True), E2M1_MAX, FP4_AMAX_FLOOR)
    codes = e2m1_encode(xb / scale)
    return pack_fp4(codes.flatten(-2)), float_to_e8m0(scale.squeeze(-1))


def dequant_fp4_ue8m0(packed: torch.Tensor, scale_e8m0: torch.Tensor, block: int = 32) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(packed))
    return (_blocks(vals, block) * e8m0_to_float(scale_e8m0).unsqueeze(-1)).flatten(-2)


def qdq_fp4_ue8m0(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    p, s = quant_fp4_ue8m0(x, block)
    return dequant_fp4_ue8m0(p, s, block).to(x.dtype)


# FP4 E2M1 with one E4M3 scale per 16 (main / global KV: NVFP4 without the second-level scale)
FP4_E4M3_SCALE_FLOOR = 6.0 * 2.0 ** -9   # amax floor so the scale is >= 2^-9


def quant_fp4_e4m3(x: torch.Tensor, block: int = 16):
    """x [..., K] -> (packed bytes [..., K/2], float8_e4m3fn scales [..., K/block])."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_E4M3_SCALE_FLOOR)
    scale = (amax / E2M1_MAX).to(torch.float8_e4m3fn)
    codes = e2m1_encode(xb / scale.float())
    return pack_fp4(codes.flatten(-2)), scale.squeeze(-1)


def dequant_fp4_e4m3(packed: torch.Tensor, scale: torch.Tensor, block: int = 16) -> torch.Tensor:
    vals = e2m1_decode(unpack_fp4(packed))
    return (_blocks(vals, block) * scale.float().unsqueeze(-1)).flatten(-2)


def qdq_fp4_e4m3(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    p, s = quant_fp4_e4m3(x, block)
    return dequant_fp4_e4m3(p, s, block).to(x.dtype)


# ----------------------------------------------------------------------------- weights
def dequant_fp8_weight(w: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 weight [out, in] with one E8M0 scale per block x block tile -> fp32."""
    out_f, in_f = w.shape
    s = e8m0_to_float(scale) if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) \
        else scale.float()
    s = s.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return w.float() * s


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP4 E2M1 weight packed [out, in/2] with one E8M0 scale per 32 along K -> fp32 [out, in]."""
    return dequant_fp4_ue8m0(packed.view(torch.uint8), scale.view(torch.uint8)
                             if scale.dtype != torch.uint8 else scale, block)
