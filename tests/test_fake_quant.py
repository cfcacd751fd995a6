"""`v41graph::fake_quant` (window KV rows through FP8, the indexer query through FP4): the op vs
the naive spec codecs (tests/naive.py), and (CUDA) the Triton kernel vs the reference, which
must be bit-identical (torch.equal): the kernel's values are what a cache write stores."""
from __future__ import annotations

import pytest
import torch

import v41graph  # noqa: F401  (registers the ops)
from v41graph.custom_ops import codecs

import naive

ops = torch.ops.v41graph
NAIVE = {"fp8_ue8m0": (naive.quant_fp8_ue8m0, naive.dequant_fp8_ue8m0),
         "fp4_ue8m0": (naive.quant_fp4_ue8m0, naive.dequant_fp4_ue8m0)}


def _rows(n: int, d: int, seed: int) -> torch.Tensor:
    """Random rows with per-row magnitudes from 1e-3 to 1e3, a row with exact E2M1 ties
    (0.25 * 2^k steps) and a zero row (amax floor)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-3, 3, n).unsqueeze(-1)
    x[0] = torch.arange(d) % 16 * 0.25
    x[1] = 0.0
    return x


@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "fp4_ue8m0"])
def test_op_matches_naive_codec(fmt):
    x = _rows(6, 64, seed=1)
    got = ops.fake_quant(x, fmt, 32)
    quant, dequant = NAIVE[fmt]
    for r in range(x.shape[0]):
        if r == 1:   # all-zero row: nothing to scale, the op must give zeros
            assert torch.equal(got[r], torch.zeros(64))
            continue
        codes, scales = quant(x[r].tolist(), 32)
        want = torch.tensor(dequant(codes, scales, 32), dtype=torch.float32)
        assert torch.equal(got[r], want), (fmt, r)


def test_op_rejects_unknown_format():
    with pytest.raises(ValueError, match="unknown format 'int3'"):
        ops.fake_quant(torch.zeros(2, 32), "int3", 32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["fp8_ue8m0", "fp4_ue8m0"])
@pytest.mark.parametrize("shape", [(1, 512), (64, 512), (3, 64, 128), (0, 512)])
def test_cuda_kernel_bit_identical(fmt, dtype, shape):
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton import cache_writes as tk
    x = _rows(max(2, shape[0] * (shape[1] if len(shape) == 3 else 1)), shape[-1], seed=7)
    x = x[: torch.Size(shape[:-1]).numel()].reshape(shape).to(dtype)
    xc = x.cuda()
    assert tk.fake_quant_supported(xc, fmt, 32)
    got = tk.fake_quant(xc, fmt, 32)
    want = codecs.qdq_fp8_ue8m0(x, 32) if fmt == "fp8_ue8m0" else codecs.qdq_fp4_ue8m0(x, 32)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got.cpu(), want)
    assert torch.equal(ops.fake_quant(xc, fmt, 32), got)      # the dispatcher picks the kernel
