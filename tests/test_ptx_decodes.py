"""The E2M1 -> E4M3 PTX of the MXFP4 MoE's blocks kernels, checked on the CPU: a few lines of
32-bit integer PTX (shifts and masks) executed by a tiny interpreter here, over every byte at
every position of the word, against codecs.e2m1_decode times 2^-6 read back through torch's
float8_e4m3fn. The CUDA tests run the same string inside the kernels; this one catches a wrong
shift or mask without a GPU."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton", reason="the PTX strings live in the Triton kernel modules")

from v41graph.custom_ops import codecs  # noqa: E402
from v41graph.custom_ops.triton.common import _e2m1_to_e4m3_ptx  # noqa: E402

_MASK = 0xFFFFFFFF
_OPS = {"shl": lambda a, b: (a << b) & _MASK, "shr": lambda a, b: a >> b,
        "and": lambda a, b: a & b, "or": lambda a, b: a | b}
_LINE = re.compile(r"(\w+)\.b32\s+(\$?\w+),\s*(\$?\w+),\s*(\$?\w+);")


def run_ptx(ptx: str, registers: dict[str, int]) -> dict[str, int]:
    """Execute PTX made only of 32-bit shl / shr / and / or (the statements this decode uses;
    anything else fails the test) on unsigned 32-bit registers."""
    regs = dict(registers)
    for line in ptx.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        m = _LINE.fullmatch(line)
        assert m and m.group(1) in _OPS, f"statement the interpreter does not know: {line!r}"
        op, dst, a, b = m.groups()
        value = [regs[v] if v in regs else int(v, 0) for v in (a, b)]
        regs[dst] = _OPS[op](*value)
    return regs


def test_e2m1_to_e4m3_ptx_places_every_code_in_every_lane():
    ptx = _e2m1_to_e4m3_ptx()
    g = torch.Generator().manual_seed(0)
    words = [b << (8 * lane) for b in range(256) for lane in range(4)]          # every byte, every lane
    words += torch.randint(0, 1 << 32, (2000,), generator=g, dtype=torch.int64).tolist()   # neighbours set
    as_bytes = lambda w: [(w >> (8 * i)) & 0xFF for i in range(4)]            # noqa: E731
    outputs, codes = [], []
    for w in words:
        regs = run_ptx(ptx, {"$2": w})
        outputs += as_bytes(regs["$0"]) + as_bytes(regs["$1"])
        codes += [b & 0xF for b in as_bytes(w)] + [b >> 4 for b in as_bytes(w)]   # even codes, then odd
    got = torch.tensor(outputs, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    want = codecs.e2m1_decode(torch.tensor(codes, dtype=torch.uint8)).float() * 2.0 ** -6
    assert torch.equal(got, want)
    # the sign of a zero code survives as E4M3's -0 (harmless: it adds nothing to a dot)
    negative_zero = torch.tensor(codes) == 8
    assert negative_zero.any() and torch.signbit(got[negative_zero]).all()
