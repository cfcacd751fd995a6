"""Pieces shared by the Triton kernel modules (imported lazily, never at package import).

Host side: the torch -> Triton dtype table, the float dtypes the kernels accept, `_pow2`, the
device's SM count (grid sizing), `_rows` (a tensor as contiguous [rows, last dim]) and
`zeroed_workspace` (counters and accumulators zeroed once, which the kernels leave zeroed),
`pdl` with `_wait_for_inputs` (programmatic dependent launch: every kernel's first statement).
@triton.jit helpers inlined by several families: exact ceil(log2) and 2^e from the fp32 bits
(UE8M0 scale exponents) and the FP4 E2M1 encode/decode, used by the cache writes, fake
quantization, sparse attention and the lightning indexer; a program's rows and their indices
(cache writes, Engram gather); the weight tiles of the FP8 and MXFP4 kernels and their E8M0
scale loads, which a K loop issues one step ahead (_next_k).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..streams import RUNTIME as STREAMS


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# Zeroed buffers that kernels leave zeroed, per (name, device, flow): zeroed once, not per call
# (a torch.zeros per call is a memset node per launch in a captured step). The main flow's
# calls run one after another, whichever stream carries them (the default stream, a capture's
# warm-up stream, the capture stream); a call on one of P6's side streams may run beside them,
# so each side stream has its own buffer. Keying the main flow by its stream would leave the
# capture stream's buffer allocated inside the first capture: its memset recorded, not run,
# and another graph replayed first would read garbage counts. Buffers are never freed: a
# captured graph keeps their addresses, so one outgrown stays held.
_ZEROED: dict[tuple, list[torch.Tensor]] = {}


def _flow(device: torch.device) -> str:
    """The tag of the P6 side stream current on `device`, or "main"."""
    if device.type != "cuda":
        return "main"
    current = torch.cuda.current_stream(device)
    return next((tag for (_, tag), stream in STREAMS.streams.items() if stream == current), "main")


def zeroed_workspace(name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`numel` zeroed elements of the buffer `name` for a kernel launched now on the current
    stream; the kernel must leave them zeroed again."""
    device = torch.device(device)
    held = _ZEROED.setdefault((name, str(device), _flow(device)), [])
    if held and held[-1].numel() >= numel:
        return held[-1][:numel]
    fresh = torch.zeros(numel, device=device, dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh    # zeroed by this graph's memset node only: not for later graphs' calls
    held.append(fresh)
    return fresh


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
    """E2M1 codes (int32 0..15) -> fp32, exactly. The magnitude bits moved to an fp16's low
    exponent and top mantissa bits give the value times 2^-14 (E2M1's subnormal 0.5 lands on
    an fp16 subnormal), the sign goes to bit 15; fp16 -> fp32 and the times 2^14 are exact.
    Eight instructions per code instead of the ~14 of a select chain (the FP4 decode bounds the
    MXFP4 MoE and the FP4 attention kernels)."""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _program_rows(index_ptr, n_rows, other, BR: tl.constexpr):
    """The BR rows of this program, their in-range mask and each row's int64 index (a cache
    slot or a table row) loaded from index_ptr (`other` for rows out of range)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    in_range = r < n_rows
    index = tl.load(index_ptr + r, mask=in_range, other=other).to(tl.int64)
    return r, in_range, index


# =============================================================================== quantized GEMM tiles
# The checkpoint's FP8 / FP4 weights are dequantized tile by tile in registers and fed to bf16
# tensor-core dots: every FP8/FP4 code times its power-of-two scale is exact in bf16, and so is
# the FP8-quantized activation, so the products are exact and only the fp32 summation order
# differs from the reference's per-32-block partial sums (quant_gemm.py, moe_fp4.py).
@triton.jit
def _quant_fp8_blocks(x, BM: tl.constexpr, BK: tl.constexpr):
    """x [BM, BK] fp32 -> its FP8 E4M3 quantization with one UE8M0 scale per 32 columns
    (codecs.qdq_fp8_ue8m0: amax floor 1e-4, scale 2^ceil(log2(amax/448))): the codes' values
    as fp32 [BM, BK/32, 32] and the scale exponents (int32 [BM, BK/32])."""
    xb = tl.reshape(x, (BM, BK // 32, 32))
    amax = tl.max(tl.abs(xb), axis=2)
    ex = _ceil_log2(tl.maximum(amax, 1e-4) * 0.002232142857142857)     # fp32(1/448)
    q = xb * _exp2i(-ex)[:, :, None]
    return tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv).to(tl.float32), ex


@triton.jit
def _qdq_fp8_blocks(x, BM: tl.constexpr, BK: tl.constexpr):
    """x [BM, BK] fp32 -> its FP8 E4M3 quantize-dequantize (_quant_fp8_blocks), fp32, exact values."""
    q, ex = _quant_fp8_blocks(x, BM, BK)
    return tl.reshape(q * _exp2i(ex)[:, :, None], (BM, BK))


@triton.jit
def _e8m0_to_fp32(scale_bytes):
    """E8M0 scale bytes -> 2^(u-127) as fp32, from the bits: byte u is the fp32 exponent field,
    and u = 0 is the subnormal 2^-127 (bits 0x00400000; _exp2i would give 0.0)."""
    # 2^-127's bits are below every u >= 1's, so one max covers u = 0 (no compare and select)
    return tl.maximum(scale_bytes.to(tl.int32) << 23, 0x00400000).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_tile(v, scale_bytes, BN: tl.constexpr, BK: tl.constexpr):
    """v [BN, BK] fp32 codes times their E8M0 scales [BN, BK/32] (one per 32 columns), as bf16."""
    s = _e8m0_to_fp32(scale_bytes)
    v = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * s[:, :, None], (BN, BK))
    return v.to(tl.bfloat16)


# Scale prefetch. A decode kernel's K loop loads the E8M0 scale bytes of the step after the one
# it decodes (a loop-carried value: `u = _e8m0_scales(.., k_lo, ..)` before the loop, then in
# it `u_next = _e8m0_scales(.., _next_k(k0, k_hi, BK), ..)` ... `u = u_next`). Triton software-
# pipelines a loop's loads only where cp.async can move them (4 bytes or more per thread), so a
# scale byte loaded in the step that uses it is a memory round trip waited on before the step's
# decode. Offline sm90 SASS (scripts/offline_sass.py), instructions from a scale load to its
# first read: MoE gate_up 10-17 -> ~700, down ~110 -> ~350, FP8 skinny 129 -> ~340, FP8 tiles
# ~40 -> ~355, at +3..-15 instructions a step. The values are the same. The FP8 blocks kernel
# keeps its per-block loads: they already sit ~100 instructions ahead of their use, and taking a
# prefetched [BN, BK/32] tile apart by columns cost it 39 instructions a step (210 -> 249).
@triton.jit
def _next_k(k0, k_hi, BK: tl.constexpr):
    """The K step whose scales a loop prefetches while it decodes step k0: k0 + BK, or k0 itself
    on the last step (an in-bounds load nobody uses, rather than a read past k_hi)."""
    return tl.minimum(k0 + BK, k_hi - BK)


@triton.jit
def _e8m0_scales(s_ptr, rows, row_mask, k0, K, BK: tl.constexpr):
    """E8M0 scale bytes [R, BK/32] of scale rows `rows` (int64 [R]; K/32 bytes each) for the K
    blocks of k0..k0+BK; masked rows read 127 (scale 1). An MXFP4 weight [N, K] has one scale
    row per weight row (rows = n), an FP8 weight one per 32 weight rows (rows = n // 32)."""
    kb = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(s_ptr + rows[:, None] * (K // 32) + kb[None, :], mask=row_mask[:, None], other=127)


@triton.jit
def _fp8_weight_tile(w_ptr, u, n, n_mask, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows n [BN] (int64), columns k0..k0+BK of an FP8 E4M3 weight [N, K], dequantized to bf16
    [BN, BK] with their scale bytes u (_e8m0_scales of rows n // 32)."""
    k = k0 + tl.arange(0, BK)
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=n_mask[:, None], other=0)
    return _scaled_tile(w.to(tl.float8e4nv, bitcast=True).to(tl.float32), u, BN, BK)


# The two PTX decodes below share one idea: each code byte goes to the low byte of a 16-bit lane
# (prmt), its magnitude bits are shifted under a bf16's exponent/mantissa and its sign to bit 15,
# which is the code's value times a power of two 2^-p (the format's subnormals land on bf16
# subnormals); two bf16x2 FMAs with -0 apply 2^p (exact) and the scale (one rounding).
def _lane_decode_prologue(mag_mask: int, power_bits: int) -> list[str]:
    """Registers and constants of a lane decode: the magnitude mask and 2^p (bf16 pairs)."""
    return [".reg .b32 z, mag, k, nz, x, t, u;", "mov.b32 z, 0;", f"mov.b32 mag, 0x{mag_mask:08X};",
            f"mov.b32 k, 0x{power_bits:08X};", "mov.b32 nz, 0x80008000;"]


def _lane_decode(out: str, mag_shift: int, sign_shift: int, scale: str) -> list[str]:
    """Lanes of x -> bf16 pairs in `out`: magnitude and sign bits moved, times 2^p, times scale."""
    return [f"shl.b32 t, x, {mag_shift};", f"shl.b32 u, x, {sign_shift};", "and.b32 u, u, 0x80008000;",
            "lop3.b32 t, t, mag, u, 0xEA;", "fma.rn.bf16x2 t, t, k, nz;", f"fma.rn.bf16x2 {out}, t, {scale}, nz;"]


def _e2m1_bytes_ptx() -> str:
    """PTX for one call over 4 packed bytes (8 E2M1 codes) in $4 and their 4 scales (bf16
    pairs: $5 for bytes 0-1, $6 for bytes 2-3): the low-nibble values go to $0, $1 and the
    high-nibble values to $2, $3 (bf16 pairs). A code's magnitude bits move to bf16 bits 8:6,
    which is the E2M1 value times 2^-126. 26 instructions per 8 codes (plus 5 constant moves
    per call) where the generic decode (fp16 bit moves, fp32 scale, bf16 cast) took ~10 per
    code."""
    lines = _lane_decode_prologue(0x01C001C0, 0x7E807E80)                    # 2^126
    for pair, (select, scale) in enumerate((("0x4140", "$5"), ("0x4342", "$6"))):
        lines.append(f"prmt.b32 x, $4, z, {select};")
        for out, mag_shift, sign_shift in ((pair, 6, 12), (pair + 2, 2, 8)):    # low nibble, high nibble
            lines += _lane_decode(f"${out}", mag_shift, sign_shift, scale)
    return "{\n" + "\n".join(lines) + "\n}"


_E2M1_BYTES_PTX = tl.constexpr(_e2m1_bytes_ptx())


@triton.jit
def _e2m1_bytes_to_bf16(packed, scale):
    """packed uint8 (two E2M1 codes, the even column in the low nibble) times scale (bf16,
    broadcast to packed's shape: a power of two, or an E4M3 value, whose 4 significant bits
    times E2M1's 2 fit bf16's 8) -> (even, odd) bf16 values, exactly codecs.e2m1_decode(code) *
    scale rounded to bf16 (exact unless it overflows)."""
    return tl.inline_asm_elementwise(_E2M1_BYTES_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)


@triton.jit
def _e8m0_to_bf16(u):
    """E8M0 scale bytes -> 2^(u-127) as bf16, exactly (u = 0 is the subnormal 2^-127)."""
    # bits u << 7 put u in the exponent field; 2^-127 is bits 64, below every u >= 1's bits,
    # so one max covers u = 0 (no compare and select)
    return tl.maximum(u.to(tl.int16) << 7, 64).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp4_weight_halves(w_ptr, u, n, n_mask, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """Rows n [BN] (int64), columns k0..k0+BK of an MXFP4 weight: E2M1 packed [N, K/2] (even
    column in the low nibble) times their scales (u: _e8m0_scales of rows n), as bf16 (even columns,
    odd columns), each [BN, BK/32, 16]. The bytes are loaded as [BN, BK/32, 16] so each
    32-block's 16 bytes share one scale."""
    kb = k0 // 32 + tl.arange(0, BK // 32)
    byte = kb[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
    p = tl.load(w_ptr + n[:, None, None] * (K // 2) + byte, mask=n_mask[:, None, None], other=0)
    return _e2m1_bytes_to_bf16(p, _e8m0_to_bf16(u)[:, :, None])


def _e2m1_to_e4m3_ptx() -> str:
    """PTX for one call over 4 packed bytes ($2: 8 E2M1 codes, each byte's even code in its low
    nibble): the even codes as 4 E4M3 bytes in $0, the odd codes in $1. A code's magnitude bits
    go to bits 4:2 (E4M3's low exponent bits and top mantissa bit) and its sign to bit 7, which
    is the E2M1 value times 2^-6 (E2M1's subnormal 0.5 lands on E4M3's subnormal 2^-7): 7
    instructions per 8 codes, no scale (the scale multiplies a block's fp32 partial instead)."""
    return ("{\n.reg .b32 t, u;\n"
            "shl.b32 t, $2, 2;\nand.b32 t, t, 0x1C1C1C1C;\nshl.b32 u, $2, 4;\nand.b32 u, u, 0x80808080;\n"
            "or.b32 $0, t, u;\n"
            "shr.b32 t, $2, 2;\nand.b32 t, t, 0x1C1C1C1C;\nand.b32 u, $2, 0x80808080;\nor.b32 $1, t, u;\n}")


_E2M1_TO_E4M3_PTX = tl.constexpr(_e2m1_to_e4m3_ptx())


@triton.jit
def _fp4_block_e4m3(w_ptr, rows, row_mask, kb, K, BN: tl.constexpr):
    """Rows [BN] (int64) of an MXFP4 weight's 32-wide K block kb (E2M1 packed [N, K/2], even
    column in the low nibble) as FP8 E4M3 [BN, 32] in split-pairs order (_split_pairs: the
    block's 16 even columns, then its 16 odd ones), each the E2M1 code times 2^-6 exactly: the
    weight side of reference.blockwise_gemm's per-block partial on an FP8 tensor-core dot. In
    that order a thread's 4 packed bytes decode straight into its two A-fragment registers of
    Hopper's FP8 wgmma (K positions 4t..4t+3 and 16+4t..16+4t+3): no byte shuffles."""
    p = tl.load(w_ptr + rows[:, None] * (K // 2) + kb * 16 + tl.arange(0, 16)[None, :],
                mask=row_mask[:, None], other=0)
    even, odd = tl.inline_asm_elementwise(_E2M1_TO_E4M3_PTX, "=r,=r,r", [p], dtype=(tl.uint8, tl.uint8),
                                          is_pure=True, pack=4)
    w = tl.reshape(tl.permute(tl.join(even, odd), (0, 2, 1)), (BN, 32))
    return w.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _split_pairs(q, BM: tl.constexpr, BK: tl.constexpr):
    """[BM, BK/32, 32] -> [BM, BK] with each 32-block's even columns first, then its odd ones:
    the K order of _fp4_block_e4m3's weight tiles, which the activation codes must share."""
    q = tl.reshape(q, (BM, BK // 32, 16, 2))
    return tl.reshape(tl.permute(q, (0, 1, 3, 2)), (BM, BK))


@triton.jit
def _fp4_weight_tile(w_ptr, u, n, n_mask, k0, K, BN: tl.constexpr, BK: tl.constexpr):
    """_fp4_weight_halves interleaved: the weight tile as bf16 [BN, BK]."""
    even, odd = _fp4_weight_halves(w_ptr, u, n, n_mask, k0, K, BN, BK)
    return tl.reshape(tl.join(even, odd), (BN, BK))


@triton.jit
def _bf16_column_halves(words_ptr, rows, row_mask, k0, K, BR: tl.constexpr, BK: tl.constexpr):
    """Rows [BR] (int64), columns k0..k0+BK of a bf16 [*, K] tensor given as its int32 words
    (two columns each): (even columns, odd columns), bf16 [BR, BK/2] each, the activation side
    of dots with a weight's even / odd columns (_fp4_weight_halves, _e4m3_pairs_to_bf16), so
    neither side is interleaved in registers."""
    i = k0 // 2 + tl.arange(0, BK // 2)
    words = tl.load(words_ptr + rows[:, None] * (K // 2) + i[None, :], mask=row_mask[:, None], other=0)
    even = (words & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    odd = (words >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return even, odd


def _e4m3_pairs_ptx() -> str:
    """PTX for one call over 2 int16 words ($2: 4 E4M3 bytes, each word = elements 2i (low
    byte), 2i+1 (high byte)) and their 2 scales ($3, a bf16 pair): the low bytes' values go to
    $0 and the high bytes' to $1 (bf16 pairs). A byte's magnitude bits move to bf16 bits 10:4,
    which is the E4M3 value times 2^-120. 14 instructions per 4 elements, against ~9 per
    element through fp32."""
    lines = _lane_decode_prologue(0x07F007F0, 0x7B807B80)                    # 2^120
    for out, select in ((0, "0x4240"), (1, "0x4341")):          # low bytes, high bytes
        lines += [f"prmt.b32 x, $2, z, {select};", *_lane_decode(f"${out}", 4, 8, "$3")]
    return "{\n" + "\n".join(lines) + "\n}"


_E4M3_PAIRS_PTX = tl.constexpr(_e4m3_pairs_ptx())


@triton.jit
def _e4m3_pairs_to_bf16(words, scale):
    """int16 words (two E4M3 codes: element 2i in the low byte) times scale (bf16, broadcast to
    words' shape) -> (even, odd) bf16 values: the E4M3 value times the scale rounded once to
    bf16, which is codecs.dequant_fp8_ue8m0's fp32 product cast to bf16 whenever that product
    is exact (always, for a power-of-two scale, down to 2^-149). NaN codes are not kept (cache
    writes saturate, so none are stored)."""
    return tl.inline_asm_elementwise(_E4M3_PAIRS_PTX, "=r,=r,r,r", [words, scale],
                                     dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


def _capability_at_least(device: torch.device, major: int, minor: int) -> bool:
    return torch.cuda.get_device_capability(device) >= (major, minor)


# Programmatic dependent launch (sm90+). A decode step is ~2200 launches of a few µs each at
# B = 1, so the gap between one kernel's end and the next one's start is a real part of the
# step. Launched with PDL, a kernel's programs may be placed while the kernel before it on the
# stream still finishes; each waits at _wait_for_inputs until that kernel has completed and its
# writes are visible. So every kernel here calls it before touching memory, in every program
# (one that exited without waiting would let the kernel complete early, and the next one's
# wait would not cover the kernel before). A kernel that never triggers early, as ours, lets
# the next start as its last programs exit. CUDA graphs keep the launch attribute (a
# programmatic edge); kernels of other libraries before or after ours are unaffected.
@triton.jit
def _wait_for_inputs():
    if tl.target_info.cuda_capability_geq(9, 0):    # griddepcontrol is sm90+ PTX
        tl.extra.cuda.gdc_wait()


def pdl(device) -> bool:
    """Whether to launch with programmatic dependent launch on `device`: sm90+ with
    $V41GRAPH_PDL=1 (the A/B switch of scripts/bench.py's v41graph-pdl; read at every launch, so
    a capture takes it). Off by default until a GPU run has timed it: the waits are compiled in
    either way, and without the launch attribute they return at once."""
    value = os.environ.get("V41GRAPH_PDL") or "0"
    if value not in ("0", "1"):
        raise ValueError(f"V41GRAPH_PDL must be '0' or '1', got {value!r}")
    return value == "1" and _pdl_capable(torch.device(device))


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:     # once per device: pdl runs at every launch
    return device.type == "cuda" and _capability_at_least(device, 9, 0)
