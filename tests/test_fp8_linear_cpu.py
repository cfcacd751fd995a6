"""The FP8 block-scaled linear's Triton kernels (custom_ops/triton/quant_gemm.py: tiles, skinny,
blocks) on the CPU, in Triton's interpreter with the PTX decodes replaced by their stand-ins
(tests/triton_ptx_doubles.py; the PTX itself: tests/test_ptx_decodes_cpu.py), against the
reference op: 1, 5 and 20 rows (20: the activation quantized once before the kernel), bf16 and
fp32 out, split-K and not, an output width that leaves a partial 32-row scale block and tile;
and the prefill path (256 rows: the weight dequantized by _fp8_dequant_kernel, one GEMM).
tests/test_quant_gemm_cuda.py runs them on the GPU (with TMA, which this does not cover)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels are Triton's; its interpreter runs them on the CPU")

from triton_interpreter import run_interpreted  # noqa: E402

_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import quant_gemm
    quant_gemm._num_sms = lambda device: 132          # the launch rules ask the GPU's SM count
    g = torch.Generator().manual_seed(1)
    n, k = 80, 256
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0                         # no NaN codes (the checkpoint has none)
    s = torch.randint(118, 128, ((n + 31) // 32, k // 32), generator=g, dtype=torch.uint8)
    # (kernel, config): BM or BT, BN, BK, split-K, warps, stages[, TMA]
    configs = [("tiles", (16, 32, 64, 1, 4, 3)), ("tiles", (16, 64, 128, 2, 4, 3)),
               ("skinny", (16, 64, 128, 1, 4, 3, False)), ("skinny", (16, 32, 64, 2, 4, 3, False)),
               ("blocks", (8, 64, 128, 1, 4, 3, False)), ("blocks", (16, 32, 64, 4, 4, 3, False)),
               ("tiles", None)]      # the launch rule's config (20 rows: 64 x 64 tiles, split 2)
    for m in (1, 5, 20):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(m, k, generator=g) * 2).to(dtype)
            want = reference.fp8_linear(x, w, s, dtype)
            for kernel, config in configs:
                got = quant_gemm.fp8_linear(x, w, s, dtype, config=config, kernel=kernel)
                rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
                print(kernel, m, str(dtype), config[3] if config else "rule", rel)
    # the split kernels share one count buffer (zeroed once) and leave it zeroed
    from v41graph.custom_ops.triton import common
    [counts] = [held for key, held in common._ZEROED.items() if key[0] == "tile_counts"]
    print("counts", len(counts), int(counts[0].count_nonzero()))
    # prefill (PREFILL_ROWS rows, bf16 out): x quantized, the weight dequantized to a transient
    # bf16 copy (_fp8_dequant_kernel), one GEMM
    m = quant_gemm.PREFILL_ROWS
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    want = reference.fp8_linear(x, w, s, torch.bfloat16)
    calls = []
    prefill = quant_gemm._fp8_linear_prefill
    quant_gemm._fp8_linear_prefill = lambda *a: calls.append(1) or prefill(*a)
    got = quant_gemm.fp8_linear(x, w, s, torch.bfloat16)
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    print("prefill", m, "torch.bfloat16", len(calls), rel)
"""


def test_fp8_linear_kernels_match_the_reference_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_SCRIPT, tmp_path)]
    assert len(rows) == 44, rows
    _, _, _, calls, rel = rows.pop()
    # the split calls ran on one buffer and left every tile count at zero (a count left
    # behind would also leave a later call's tiles unwritten: the rel checks below)
    assert rows.pop() == ["counts", "1", "0"]
    # the prefill path ran; its bf16 GEMM rounds the sum to bf16 once, as the reference does,
    # but sums in another order: at most one bf16 ulp apart
    assert calls == "1" and float(rel) < 4e-3, rows
    for kernel, m, dtype, split, rel in rows:
        # exact products (FP8 codes x power-of-two scales, bf16-exact activations), fp32 sums in
        # another order than the reference's per-32-block partials: fp32 rounding only, which the
        # bf16 output absorbs
        assert float(rel) < 1e-6, (kernel, m, dtype, split, rel)
