"""Our kernels' inline-PTX decodes (custom_ops/triton/common.py), executed on the CPU by a tiny
interpreter of the few PTX statements they use, against the codes' definitions (codecs):
- _e2m1_to_e4m3_ptx: E2M1 codes placed as E4M3 bytes (the MXFP4 MoE's blocks kernels);
- _e2m1_bytes_ptx: E2M1 codes times a bf16 scale (the MoE's tokens and rows kernels, the FP4
  attention rows);
- _e4m3_pairs_ptx: E4M3 bytes times a bf16 scale (the FP8 linear, the attention's FP8 ring).
Every byte value in every position of the 32-bit word, with neighbours set, and every scale the
callers pass. The CUDA tests run them inside the kernels; these catch a wrong shift, mask,
selector or constant without a GPU, and tests/triton_ptx_doubles.py's stand-ins (what the
interpreted kernel tests run instead) compute the same definitions."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton", reason="the PTX strings live in the Triton kernel modules")

from v41graph.custom_ops import codecs  # noqa: E402
from v41graph.custom_ops.triton.common import _e2m1_bytes_ptx, _e2m1_to_e4m3_ptx, _e4m3_pairs_ptx  # noqa: E402

_MASK = 0xFFFFFFFF
_STATEMENT = re.compile(r"(\w+)((?:\.\w+)+)\s+(.*);")


# Registers are int64 tensors of 32-bit values, one element per thread: the whole test is one run.
def _bf16_lanes(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two bf16 lanes of 32-bit words (lane 0 in the low half), as fp32."""
    lane = lambda bits: bits.to(torch.int16).view(torch.bfloat16).float()      # noqa: E731
    return lane(words & 0xFFFF), lane(words >> 16)


def _bf16_words(lane0: torch.Tensor, lane1: torch.Tensor) -> torch.Tensor:
    """fp32 lanes rounded to nearest even bf16 and packed as words (lane 0 low)."""
    bits = lambda v: v.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF   # noqa: E731
    return bits(lane0) | (bits(lane1) << 16)


def _prmt(a, b, selector: int):
    """prmt.b32 (default mode): result byte i is byte (selector nibble i) & 7 of the 8 bytes
    b:a (a's bytes are 0-3); nibble bit 3 replicates that byte's sign instead."""
    out = torch.zeros_like(a)
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        source = a if nibble & 7 < 4 else b
        byte = (source >> (8 * (nibble & 3))) & 0xFF
        if nibble & 8:
            byte = torch.where(byte >= 0x80, 0xFF, 0)
        out = out | (byte << (8 * i))
    return out


def _lop3(a, b, c, lut: int):
    """lop3.b32: bit i of the result is bit (a_i b_i c_i, as a 3-bit number) of the lookup table."""
    pick = lambda v, on: v if on else ~v & _MASK              # noqa: E731
    out = 0
    for index in range(8):
        if (lut >> index) & 1:
            out = out | (pick(a, index & 4) & pick(b, index & 2) & pick(c, index & 1))
    return out


def _fma_bf16x2(a, b, c):
    """fma.rn.bf16x2 lane by lane: a * b + c rounded once to bf16. Exact products of two bf16
    (16 significant bits) fit fp32, so fp32 then one rounding to bf16 is the single rounding."""
    (a0, a1), (b0, b1), (c0, c1) = _bf16_lanes(a), _bf16_lanes(b), _bf16_lanes(c)
    return _bf16_words(a0 * b0 + c0, a1 * b1 + c1)


_OPS = {"mov": lambda a: torch.as_tensor(a, dtype=torch.int64), "shl": lambda a, b: (a << b) & _MASK, "shr": lambda a, b: a >> b,
        "and": lambda a, b: a & b, "or": lambda a, b: a | b, "prmt": _prmt, "lop3": _lop3,
        "fma": _fma_bf16x2}
_TYPES = {"mov": ".b32", "shl": ".b32", "shr": ".b32", "and": ".b32", "or": ".b32", "prmt": ".b32",
          "lop3": ".b32", "fma": ".rn.bf16x2"}


def run_ptx(ptx: str, registers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Execute PTX made only of the statements in _OPS (with the types in _TYPES; anything else
    fails the test) on registers of unsigned 32-bit values (int64 tensors, or int immediates)."""
    regs = dict(registers)
    for line in ptx.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        m = _STATEMENT.fullmatch(line)
        assert m and _TYPES.get(m.group(1)) == m.group(2), f"statement the interpreter does not know: {line!r}"
        dst, *sources = [s.strip() for s in m.group(3).split(",")]
        regs[dst] = _OPS[m.group(1)](*[regs[s] if s in regs else int(s, 0) for s in sources])
    return regs


def _words() -> torch.Tensor:
    """Every byte value in every lane of a word (the others zero), then random words."""
    single = torch.arange(256, dtype=torch.int64)[:, None] << (8 * torch.arange(4))[None, :]
    rand = torch.randint(0, 1 << 32, (500,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    return torch.cat([single.flatten(), rand])


def _byte(words: torch.Tensor, i: int) -> torch.Tensor:
    return (words >> (8 * i)) & 0xFF


def test_e2m1_to_e4m3_places_every_code_in_every_lane():
    w = _words()
    regs = run_ptx(_e2m1_to_e4m3_ptx(), {"$2": w})
    got = torch.stack([_byte(regs[r], i) for r in ("$0", "$1") for i in range(4)])       # even codes, then odd
    codes = torch.stack([_byte(w, i) >> shift & 0xF for shift in (0, 4) for i in range(4)])
    got = got.to(torch.uint8).view(torch.float8_e4m3fn).float()
    assert torch.equal(got, codecs.e2m1_decode(codes.to(torch.uint8)).float() * 2.0 ** -6)
    # the sign of a zero code survives as E4M3's -0 (harmless: it adds nothing to a dot)
    negative_zero = codes == 8
    assert negative_zero.any() and torch.signbit(got[negative_zero]).all()


def _scales() -> torch.Tensor:
    """Scales the callers pass: every E8M0 power of two 2^-127..2^127 (the MoE's weights; the
    top ones overflow bf16 for the larger codes, as the fp32 reference does) and every E4M3
    value (the FP4 attention cache's per-16 scales)."""
    powers = 2.0 ** (torch.arange(255, dtype=torch.float64) - 127)
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).double()   # no NaN
    return torch.cat([powers, e4m3]).float()


def _every_word_with_every_scale():
    """(words, scale lane 0, scale lane 1): each word with each scale in both lanes (lane 1
    takes the next scale, so two lanes never share one by construction)."""
    w, s = _words(), _scales()
    s_next = s.roll(-1)
    return (w.repeat_interleave(len(s)), s.repeat(len(w)), s_next.repeat(len(w)))


def test_e2m1_bytes_times_scale_matches_the_decode():
    w, s0, s1 = _every_word_with_every_scale()
    regs = run_ptx(_e2m1_bytes_ptx(), {"$4": w, "$5": _bf16_words(s0, s1), "$6": _bf16_words(s1, s0)})
    scale = (s0, s1, s1, s0)           # bytes 0-1 take $5's lanes, bytes 2-3 $6's
    for out, nibble, (b0, b1) in (("$0", 0, (0, 1)), ("$1", 0, (2, 3)), ("$2", 4, (0, 1)), ("$3", 4, (2, 3))):
        got = _bf16_lanes(regs[out])
        for lane, byte in ((0, b0), (1, b1)):
            code = (_byte(w, byte) >> nibble & 0xF).to(torch.uint8)
            want = (codecs.e2m1_decode(code).float() * scale[byte]).to(torch.bfloat16).float()
            assert torch.isinf(want).any() and (want == 0).any()     # overflow and zero codes were met
            assert torch.equal(got[lane], want), (out, lane)


def test_e4m3_pairs_times_scale_matches_the_decode():
    w, s0, s1 = _every_word_with_every_scale()
    regs = run_ptx(_e4m3_pairs_ptx(), {"$2": w, "$3": _bf16_words(s0, s1)})
    # word 0 = bytes 0 (low), 1 (high); word 1 = bytes 2, 3; lane i takes word i and scale i
    for out, bytes_ in (("$0", (0, 2)), ("$1", (1, 3))):
        got = _bf16_lanes(regs[out])
        for lane, scale in ((0, s0), (1, s1)):
            value = _byte(w, bytes_[lane]).to(torch.uint8).view(torch.float8_e4m3fn).float()
            want = (value * scale).to(torch.bfloat16).float()
            keep = ~torch.isnan(want)      # NaN codes (0x7F, 0xFF) are never stored: not kept
            assert keep.float().mean() > 0.95
            assert torch.equal(got[lane][keep], want[keep]), (out, lane)
