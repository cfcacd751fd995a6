"""The MXFP4 MoE's blocks kernels (custom_ops/triton/moe_fp4.py), the parts a CPU can check:
- the E2M1 -> E4M3 PTX: its few lines of 32-bit integer PTX (shifts and masks) executed by a
  tiny interpreter here, over every byte at every position of the word, against
  codecs.e2m1_decode times 2^-6 read back through torch's float8_e4m3fn;
- the split-pairs order of the activation codes (quantize_rows_codes(split_pairs=True)) in
  Triton's interpreter: each 32-block's even columns, then its odd ones, the scales unchanged.
The CUDA tests run both inside the kernels against the reference; these catch a wrong shift,
mask or permutation without a GPU. Also: a bad tuning config or codes dtype is refused with
the field and the rule, before anything is allocated or launched."""
from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton", reason="the PTX strings live in the Triton kernel modules")

from triton_interpreter import run_interpreted  # noqa: E402
from v41graph.custom_ops import codecs  # noqa: E402
from v41graph.custom_ops.triton import moe_fp4, quant_gemm  # noqa: E402
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
        operands = [regs[v] if v in regs else int(v, 0) for v in (a, b)]
        regs[dst] = _OPS[op](*operands)
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


_SPLIT_PAIRS_SCRIPT = """
    import torch
    from v41graph.custom_ops.triton import quant_gemm
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 3
    for dtype in (torch.float16, torch.float8_e4m3fn):
        codes, scales = quant_gemm.quantize_rows_codes(x, dtype)
        split, split_scales = quant_gemm.quantize_rows_codes(x, dtype, split_pairs=True)
        unsplit = split.float().view(5, -1, 2, 16).transpose(-1, -2).reshape(5, -1)
        moved = not torch.equal(split.float(), codes.float())
        ok = torch.equal(split_scales, scales) and torch.equal(unsplit, codes.float()) and moved
        print(dtype, "OK" if ok else "FAIL")
"""


def test_split_pairs_codes_in_triton_interpreter(tmp_path):
    lines = run_interpreted(_SPLIT_PAIRS_SCRIPT, tmp_path)
    assert len(lines) == 2 and all(line.endswith("OK") for line in lines), lines


@pytest.mark.parametrize("config,message", [
    ((16, 64, 128, 128, 4, 3, "columns"), r"config kernel 'columns' is not one of \('tokens', 'rows', 'blocks'\)"),
    ((16, 48, 128, 128, 4, 3, "blocks"), r"config BN must be a multiple of 32 .* got 48"),
    ((8, 64, 128, 128, 4, 3, "rows"), r"the rows kernels' token tile BM must be >= 16 .* got 8"),
])
def test_bad_config_is_refused_before_any_work(config, message):
    e, d, i = 4, 64, 32          # CPU tensors: the check comes before routing, buffers and launches
    args = (torch.zeros(2, d), torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int64),
            torch.zeros(e, 2 * i, d // 2, dtype=torch.uint8), torch.zeros(e, 2 * i, d // 32, dtype=torch.uint8),
            torch.zeros(e, d, i // 2, dtype=torch.uint8), torch.zeros(e, d, i // 32, dtype=torch.uint8), 10.0)
    with pytest.raises(ValueError, match=message):
        moe_fp4.mxfp4_moe(*args, config=config)


def test_quantize_rows_codes_refuses_other_code_dtypes():
    with pytest.raises(ValueError, match=r"codes_dtype must be torch.float16 or torch.float8_e4m3fn, got torch.bfloat16"):
        quant_gemm.quantize_rows_codes(torch.zeros(2, 64), torch.bfloat16)

