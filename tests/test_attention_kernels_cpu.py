"""The sparse attention's Triton kernels (custom_ops/triton/attention.py) on the CPU, in Triton's
interpreter with the PTX decodes replaced by their stand-ins (tests/triton_ptx_doubles.py; the
PTX itself: tests/test_ptx_decodes_cpu.py), against the reference op: the head-tile and the
all-heads tile kernels, unsplit and split (+ the combine kernel), with and without prefetch,
over FP8 ring rows, fresh rows, FP4 global rows, -1 padding and a token with nothing to attend
to. tests/test_kernels_cuda.py runs the same variants on the GPU at the model's widths; these
catch an indexing or online-softmax mistake without one."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels are Triton's; its interpreter runs them on the CPU")

from triton_interpreter import run_interpreted  # noqa: E402

_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()
    from v41graph.custom_ops import ops
    from v41graph.custom_ops.triton import attention
    from test_kernels_cuda import _attn_inputs
    attention._num_sms = lambda device: 132          # the launch rules ask the GPU's SM count
    g = torch.Generator().manual_seed(3)
    n, h, d, w, kg = 3, 16, 128, 40, 50
    for dtype in (torch.bfloat16, torch.float32):
        inputs = _attn_inputs(n, h, d, w, kg, dtype, g, slots=4, ring_w=16, cache_rows=90)
        want = ops.sparse_attention(*inputs, d ** -0.5)
        variants = [dict(kernel="heads"), dict(kernel="heads", n_split=3),
                    dict(kernel="heads", ptx_decode=False, prefetch=False)]
        if dtype == torch.bfloat16:
            variants += [dict(kernel="tile", n_split=1), dict(kernel="tile", n_split=3),
                         dict(kernel="tile", block_s=16, n_split=2)]
        for v in variants:
            out = attention.sparse_attention(*inputs, d ** -0.5, **v)
            rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
            empty = bool(torch.equal(out[1], torch.zeros_like(out[1])))
            print(str(dtype), ",".join(f"{k}={v[k]}" for k in v), rel, empty)
"""


def test_attention_kernels_match_the_reference_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_SCRIPT, tmp_path)]
    assert len(rows) == 9, rows
    for dtype, variant, rel, empty in rows:
        # bf16: P is rounded to bf16 per row block (the kernels' 32 rows, the reference's 64)
        assert float(rel) < (1e-2 if dtype == "torch.bfloat16" else 1e-5), (dtype, variant, rel)
        # token 1 sees no row: its output is exactly 0 (the denominator is the sink term alone)
        assert empty == "True", (dtype, variant)
