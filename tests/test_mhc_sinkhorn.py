"""The mHC coefficient op (`v41graph::mhc_sinkhorn`): reference vs a naive float64 reading of
MODEL.md §3, and (CUDA) the Triton kernel vs the reference. Its count in the compiled graph is
checked in test_compiler.py (test_mhc_one_op_per_side).

Error measure: max |out - want| over all entries (the coefficients are O(1): pre in (eps, 1+eps),
post in (0, 2), comb entries in [0, 1]); fp32 reference vs float64 naive < 1e-5 after 20
Sinkhorn rounds; Triton vs fp32 reference < 2e-6 (same algorithm, different sum order / exp).
"""
from __future__ import annotations

import pytest
import torch

import v41graph  # noqa: F401  (registers the ops)
from v41graph.custom_ops import reference as ref

import naive

ops = torch.ops.v41graph
HC, ITERS, EPS = 4, 20, 1e-6


def _inputs(n: int, seed: int, spread: float = 3.0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mixes = torch.randn(n, (2 + HC) * HC, generator=g) * spread
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn((2 + HC) * HC, generator=g)
    return mixes.to(device), scale.to(device), base.to(device)


@pytest.mark.parametrize("spread", [0.1, 3.0, 30.0], ids=["flat", "normal", "peaked"])
def test_op_matches_naive_float64(spread):
    mixes, scale, base = _inputs(9, seed=int(spread * 10), spread=spread)
    pre, post, comb = ops.mhc_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    assert pre.shape == (9, HC) and post.shape == (9, HC) and comb.shape == (9, HC, HC)
    worst = 0.0
    for t in range(9):
        want = naive.mhc_coefficients(mixes[t].tolist(), scale.tolist(), base.tolist(), HC, ITERS, EPS)
        for got, w in zip((pre[t], post[t], comb[t]), want):
            worst = max(worst, (got.double() - torch.tensor(w, dtype=torch.float64)).abs().max().item())
    assert worst < 1e-5, worst


def test_op_rejects_wrong_mixes_width():
    with pytest.raises(ValueError, match=r"mixes last dim 20 != \(2 \+ hc\) \* hc = 24"):
        ops.mhc_sinkhorn(torch.zeros(2, 20), torch.ones(3), torch.zeros(24), HC, ITERS, EPS)


def test_mhc_input_side_ops_reject_mismatched_shapes():
    """mhc_pre and its P9 halves (mhc_collapse, mhc_predict) name the op and the rule broken."""
    streams, pre, fn = torch.randn(3, HC, 8), torch.rand(3, HC), torch.randn((2 + HC) * HC, HC * 8)
    scale, base = torch.ones(3), torch.zeros((2 + HC) * HC)
    with pytest.raises(ValueError, match=r"mhc_collapse: streams must be \[..., hc, d\] and pre \[..., hc\]"):
        ops.mhc_collapse(streams, pre[:, :2])
    with pytest.raises(ValueError, match=r"mhc_predict: fn shape \(24, 16\) != \(24, 32\)"):
        ops.mhc_predict(streams, fn[:, :16], scale, base, HC, ITERS, EPS, 1e-6)
    with pytest.raises(ValueError, match=r"mhc_predict: streams must be \[..., hc=4, d\], got \(3, 2, 8\)"):
        ops.mhc_predict(streams[:, :2], fn, scale, base, HC, ITERS, EPS, 1e-6)
    with pytest.raises(ValueError, match=r"mhc_pre: streams must be \[..., hc=4, d\] and pre_prev \[..., 4\]"):
        ops.mhc_pre(streams, pre[:2], fn, scale, base, HC, ITERS, EPS, 1e-6)


def test_comb_is_doubly_stochastic_after_sinkhorn():
    # Counted property of the spec: after the final column normalisation every column sums to
    # 1 (up to eps), and the row sums move towards 1 with more rounds.
    mixes, scale, base = _inputs(16, seed=3)
    _, _, comb = ops.mhc_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    assert (comb.sum(-2) - 1).abs().max() < 1e-5
    _, _, one_round = ops.mhc_sinkhorn(mixes, scale, base, HC, 1, EPS)   # rows not balanced yet
    assert (one_round.sum(-1) - 1).abs().mean() > 10 * (comb.sum(-1) - 1).abs().mean()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("n", [1, 33, 4096])
def test_cuda_kernel_matches_reference(n):
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton import mhc as tk
    mixes, scale, base = _inputs(n, seed=n, device="cuda")
    assert tk.mhc_sinkhorn_supported(mixes, scale, base, HC)
    got = tk.mhc_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    # Bit-identical to the reference run on the GPU (same exp, division, summation order and
    # rounding of every operation); close to the CPU reference, whose exp is another one.
    on_gpu = ref.mhc_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    on_cpu = ref.mhc_sinkhorn(mixes.cpu(), scale.cpu(), base.cpu(), HC, ITERS, EPS)
    for name, g, w, c in zip(("pre", "post", "comb"), got, on_gpu, on_cpu):
        assert g.shape == w.shape and torch.isfinite(g).all()
        assert torch.equal(g, w), f"{name}: {int((g != w).sum())} entries differ, max {(g - w).abs().max()}"
        assert (g.cpu() - c).abs().max().item() < 2e-6
    # The dispatcher picks the kernel for CUDA tensors (same result as calling it directly).
    via_op = ops.mhc_sinkhorn(mixes, scale, base, HC, ITERS, EPS)
    assert all(torch.equal(a, b) for a, b in zip(via_op, got))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_kernel_falls_back_to_div_rn_outside_the_fast_range():
    """The kernel's branch-free division covers operands in [2^-32, 2^32]; a program with one
    token outside (an eps of 1e-12 after a peaked softmax leaves entries near 2^-40; a NaN mix)
    redoes its Sinkhorn with div_rn. Every token, the others of that program included, keeps
    the GPU reference's bits and NaNs stay where the reference has them."""
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton import mhc as tk
    mixes, scale, base = _inputs(70, seed=5, spread=30.0, device="cuda")
    mixes[3, 9] = float("nan")
    for eps in (1e-12, EPS):
        got = tk.mhc_sinkhorn(mixes, scale, base, HC, ITERS, eps)
        want = ref.mhc_sinkhorn(mixes, scale, base, HC, ITERS, eps)
        for name, g, w in zip(("pre", "post", "comb"), got, want):
            assert torch.equal(torch.isnan(g), torch.isnan(w)), name
            assert torch.equal(g.nan_to_num(), w.nan_to_num()), f"{name} at eps {eps}"
        assert torch.isnan(got[2][3]).any() and not torch.isnan(got[2][4:]).any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_fast_division_is_ieee_division_in_its_range():
    """mhc._div_fast (div.rn's fast path without its range check and slow-path call) against
    torch's CUDA division, which is div.rn: 2^24 operand pairs log-uniform over its range
    [2^-32, 2^32], plus the range's ends; every quotient bit for bit."""
    pytest.importorskip("triton")
    import triton
    import triton.language as tl
    from v41graph.custom_ops.triton import mhc as tk

    @triton.jit
    def divide(a_ptr, b_ptr, q_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(q_ptr + i, tk._div_fast(tl.load(a_ptr + i, mask=m, other=1.0), tl.load(b_ptr + i, mask=m, other=1.0)),
                 mask=m)

    g = torch.Generator(device="cuda").manual_seed(0)
    n = 1 << 24
    a, b = (torch.exp2(torch.rand(n, device="cuda", generator=g) * 64 - 32) for _ in range(2))
    ends = torch.tensor([2.0 ** -32, 2.0 ** 32, 1.0, 3.0, 0.1], device="cuda")
    a = torch.cat([a, ends.repeat_interleave(5)])
    b = torch.cat([b, ends.repeat(5)])
    q = torch.empty_like(a)
    divide[(triton.cdiv(a.numel(), 1024),)](a, b, q, a.numel(), BLOCK=1024)
    want = a / b
    assert torch.equal(q, want), f"{int((q != want).sum())} of {q.numel()} quotients differ"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 8, 64, 300])
def test_cuda_pre_and_post_kernels_match_reference(n, dtype):
    """mhc_pre (the collapse + the predictor, two launches), mhc_post (the expand, one) and
    mhc_collapse + mhc_predict (mhc_pre split for P9, bit for bit against mhc_pre) at
    the released width d = 5120 against the reference on the same GPU: the collapse and the
    expand within one rounding of the output dtype (the same products; torch may add its four
    in another order) and equal in >= 99 % of entries, pre / post / comb within 2e-5 (the
    predictor's 20480-long dot products sum in another order)."""
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton import mhc as tk
    g = torch.Generator().manual_seed(n)
    d = 5120
    streams = torch.randn(n, HC, d, generator=g).to(dtype).cuda()
    pre_prev = torch.rand(n, HC, generator=g).cuda()
    fn = (torch.randn((2 + HC) * HC, HC * d, generator=g) / 64).cuda()
    _, scale, base = _inputs(1, seed=n, device="cuda")
    assert tk.mhc_pre_supported(streams, pre_prev, fn, scale, base, HC)
    got = ops.mhc_pre(streams, pre_prev, fn, scale, base, HC, ITERS, EPS, 1e-6)
    want = ref.mhc_pre(streams, pre_prev, fn, scale, base, HC, ITERS, EPS, 1e-6)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -22
    assert torch.allclose(got[0].float(), want[0].float(), rtol=ulp, atol=64 * ulp ** 2)
    assert torch.eq(got[0], want[0]).float().mean().item() >= 0.99
    for name, a, b in zip(("pre", "post", "comb"), got[1:], want[1:]):
        assert (a - b).abs().max().item() < 2e-5, name
    out = torch.randn(n, d, generator=g).to(dtype).cuda()
    post, comb = got[2], got[3]
    assert tk.mhc_post_supported(out, streams, post, comb)
    y, y_ref = ops.mhc_post(out, streams, post, comb), ref.mhc_post(out, streams, post, comb)
    assert torch.allclose(y.float(), y_ref.float(), rtol=ulp, atol=64 * ulp ** 2)
    assert torch.eq(y, y_ref).float().mean().item() >= 0.99
    # mhc_pre split in two (P9: the predictor on a side stream): mhc_pre's bits exactly
    assert tk.mhc_predict_supported(streams, fn, scale, base, HC) and tk.mhc_collapse_supported(streams, pre_prev)
    split = (ops.mhc_collapse(streams, pre_prev), *ops.mhc_predict(streams, fn, scale, base, HC, ITERS, EPS, 1e-6))
    for name, a, b in zip(("collapse", "pre", "post", "comb"), split, got):
        assert torch.equal(a, b), name
