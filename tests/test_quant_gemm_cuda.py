"""The released weight formats on CUDA: fp8_linear and mxfp4_moe (Triton) vs their pure-torch
references (custom_ops/reference.py, DeepSeek's blockwise arithmetic).

The kernels compute exact products (FP8/FP4 codes times power-of-two scales and the FP8
quantized activation are exact in bf16) and sum them in fp32 in another order than the
reference's per-32-block partials (prefill shapes: cuBLAS on the same exact bf16 values), so:
  fp8_linear, fp32 output        rel < 1e-5 (summation order only), any input dtype
  fp8_linear, bf16 output        every element within one bf16 ulp of the reference (plus
                                 1e-6 of the largest output, where a sum cancels)
  mxfp4_moe                      rel < 2e-3 (fp32) / 1.5e-2 (bf16): an order-level difference
                                 before one of the reference's roundings (gate/up and h to x's
                                 dtype, h's FP8 quantization) can move that element by a step
Inputs are random bytes with random scales; outputs are poisoned first where the op takes
them; the captured graphs must replay bit-identically to eager (no host sync, deterministic).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
triton = pytest.importorskip("triton")

import v41graph.custom_ops  # noqa: E402,F401  (registers the ops and the CUDA kernels)
from cuda_graphs import capture  # noqa: E402
from v41graph.custom_ops import reference as ref  # noqa: E402
from v41graph.custom_ops.triton import moe_fp4, quant_gemm  # noqa: E402

ops = torch.ops.v41graph
DEV = "cuda"
FP32_OUT_REL = 1e-5     # see the module docstring


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    o, w = out.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(o).all(), "non-finite output"
    return ((o - w).norm() / w.norm().clamp_min(1e-300)).item()


def fp8_weight(n: int, k: int, g: torch.Generator):
    w = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8) & 0xB7      # no NaN codes
    s = torch.randint(118, 126, (-(-n // 32), k // 32), generator=g, dtype=torch.uint8)
    return w.to(DEV), s.to(DEV)


def fp4_stack(e: int, rows: int, k: int, g: torch.Generator):
    w = torch.randint(0, 256, (e, rows, k // 2), generator=g, dtype=torch.uint8)
    s = torch.randint(118, 126, (e, rows, k // 32), generator=g, dtype=torch.uint8)
    return w.to(DEV), s.to(DEV)


def activations(m: int, k: int, dtype, g: torch.Generator):
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).add(0.1)
    x[:, : k // 4] *= 8.0                      # uneven 32-blocks: different activation scales
    return x.to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,k", [(1, 512, 5120), (8, 1280, 5120), (17, 4096, 1280), (64, 5120, 2304),
                                   (300, 1280, 5120), (3, 48, 64), (5, 100, 96), (512, 640, 96)])
def test_fp8_linear_matches_reference(m, n, k, dtype):
    g = torch.Generator().manual_seed(m * 7919 + n + k)
    w, s = fp8_weight(n, k, g)
    x = activations(m, k, dtype, g)
    assert quant_gemm.fp8_linear_supported(x, w, s)
    want32 = ref.fp8_linear(x, w, s, torch.float32)
    got32 = ops.fp8_linear(x, w, s, torch.float32)
    assert got32.dtype == torch.float32 and got32.shape == (m, n)
    err = rel_err(got32, want32)
    assert err < FP32_OUT_REL, err
    got = ops.fp8_linear(x, w, s, dtype)
    assert got.dtype == dtype
    want = want32.to(dtype).float()
    # one ulp of the output dtype, plus the fp32 order difference where the sum cancels
    ulp = want.abs() * (2.0 ** -6 if dtype == torch.bfloat16 else 2.0 ** -20) + FP32_OUT_REL * want32.abs().max()
    worst = ((got.float() - want).abs() - ulp).max().item()
    assert worst <= 0, worst


def test_fp8_linear_every_split_and_tile_config():
    """Every config the table can return, forced on one shape, agrees with the reference."""
    g = torch.Generator().manual_seed(5)
    w, s = fp8_weight(640, 2048, g)
    x = activations(24, 2048, torch.bfloat16, g)
    want = ref.fp8_linear(x, w, s, torch.float32)
    for bm, bn, bk, warps, stages in [(16, 64, 256, 4, 4), (64, 64, 128, 4, 4), (128, 128, 64, 8, 3),
                                      (16, 128, 128, 4, 3), (32, 32, 32, 2, 2), (128, 256, 64, 8, 3)]:
        for split in (1, 2, 4, 8, 16):
            config = (bm, bn, bk, split, warps, stages)
            err = rel_err(quant_gemm.fp8_linear(x, w, s, torch.float32, config=config), want)
            assert err < FP32_OUT_REL, (bm, bn, bk, split, err)


def test_fp8_linear_skinny_every_config_and_deterministic_split():
    """The skinny kernel at the tile shapes and splits its sweep tries (3 pipeline stages; the
    weight through pointers and through TMA), on a
    shape that fills no tile (N = 200 rows: a partial 64- and 128-row tile; 24 and 70 tokens: a
    partial token tile, two token tiles), quantized and unquantized x, agrees with the
    reference; the split-K reduction by the last program of a tile repeats bit for bit."""
    g = torch.Generator().manual_seed(11)
    w, s = fp8_weight(200, 2048, g)
    for m in (1, 8, 24, 70):
        x = activations(m, 2048, torch.bfloat16, g)
        want = ref.fp8_linear(x, w, s, torch.float32)
        bt = quant_gemm.skinny_token_tile(m)
        assert bt == (16 if m <= 16 else 32 if m <= 32 else 64)
        for bn, bk, warps, tma in [(64, 128, 4, False), (128, 256, 4, True), (128, 128, 8, False),
                                   (64, 256, 4, False), (128, 128, 4, True)]:
            for split in (1, 2, 4, 8, 16, 32):
                config = (bt, bn, bk, split, warps, 3, tma)
                got = quant_gemm.fp8_linear(x, w, s, torch.float32, config=config, kernel="skinny")
                err = rel_err(got, want)
                assert err < FP32_OUT_REL, (m, config, err)
                again = quant_gemm.fp8_linear(x, w, s, torch.float32, config=config, kernel="skinny")
                assert torch.equal(got, again), (m, config)
    with pytest.raises(ValueError, match="kernel must be"):
        quant_gemm.fp8_linear(x, w, s, torch.float32, kernel="gemv")


def test_fp8_linear_blocks_every_config_and_deterministic_split():
    """The blocks kernel (per-32-block partials of the codes, the reference's arithmetic) at
    the token tiles, row tiles, BK, splits, warps and pipeline depths its sweep tries, the
    weight through TMA (rows past N: the descriptor's zero fill) and through pointers, on a
    shape that fills no tile (N = 200; 1, 8, 13 and 40 tokens), against the reference; the
    split-K reduction repeats bit for bit. Its x quantization (codes, scales) is
    codecs.qdq_fp8_ue8m0's, value for value."""
    from v41graph.custom_ops import codecs
    g = torch.Generator().manual_seed(13)
    w, s = fp8_weight(200, 2048, g)
    for m in (1, 8, 13, 40):
        x = activations(m, 2048, torch.bfloat16, g)
        codes, scales = quant_gemm.quantize_rows_codes(x)
        qdq = (codes.float().view(m, -1, 32) * scales[:, :, None]).view(m, -1)
        assert torch.equal(qdq, codecs.qdq_fp8_ue8m0(x.float(), 32)), m
        want = ref.fp8_linear(x, w, s, torch.float32)
        for bt in (8, 16, 64) if m > 8 else (8, 16):
            for bn, bk, warps, stages, tma in [(64, 128, 4, 4, True), (128, 128, 4, 6, False), (128, 256, 8, 3, True),
                                               (256, 128, 8, 4, False), (128, 128, 4, 4, True)]:
                for split in (1, 2, 4, 8, 16):
                    config = (bt, bn, bk, split, warps, stages, tma)
                    got = quant_gemm.fp8_linear(x, w, s, torch.float32, config=config, kernel="blocks")
                    err = rel_err(got, want)
                    assert err < FP32_OUT_REL, (m, config, err)
                    again = quant_gemm.fp8_linear(x, w, s, torch.float32, config=config, kernel="blocks")
                    assert torch.equal(got, again), (m, config)
    # a weight at an address TMA refuses (not 16-byte aligned) takes the pointer loads
    odd = torch.empty(w.numel() + 2, dtype=torch.uint8, device=DEV)[2:].view(w.shape)   # even: skinny reads int16
    odd.copy_(w)
    assert odd.data_ptr() % 16 and not quant_gemm._tma_aligned(odd)
    for kernel in ("blocks", "skinny"):
        assert rel_err(quant_gemm.fp8_linear(x, odd, s, torch.float32, kernel=kernel), want) < FP32_OUT_REL, kernel
    with pytest.raises(ValueError, match="config must be"):
        quant_gemm.fp8_linear(x, w, s, torch.float32, config=(8, 64, 128), kernel="blocks")


def test_fp8_kernel_switch_picks_the_kernel_and_refuses_a_bad_value(monkeypatch):
    """V41GRAPH_FP8_KERNEL forces a decode kernel (bench.py's fp8 A/B variants); unset, the
    measured rule: wq_b's 32768 rows take the skinny kernel even at 64 tokens, wo_b's K = 8192
    the blocks kernel up to 8 tokens."""
    dev = torch.device(DEV)
    monkeypatch.delenv("V41GRAPH_FP8_KERNEL", raising=False)
    assert quant_gemm.decode_kernel(64, 32768, 1280, dev) == "skinny"
    assert quant_gemm.decode_kernel(1, 5120, 8192, dev) == "blocks"
    assert quant_gemm.decode_kernel(8, 5120, 8192, dev) == "blocks"
    assert quant_gemm.decode_kernel(9, 5120, 8192, dev) == "tiles"
    assert quant_gemm.decode_kernel(1, 1280, 5120, dev) == "skinny"
    assert quant_gemm.decode_kernel(64, 1280, 5120, dev) == "tiles"
    g = torch.Generator().manual_seed(3)
    w, s = fp8_weight(256, 512, g)
    x = activations(4, 512, torch.bfloat16, g)
    want = ref.fp8_linear(x, w, s, torch.float32)
    for kernel in quant_gemm.DECODE_KERNELS:
        monkeypatch.setenv("V41GRAPH_FP8_KERNEL", kernel)
        assert quant_gemm.decode_kernel(64, 1280, 5120, dev) == kernel
        assert rel_err(ops.fp8_linear(x, w, s, torch.float32), want) < FP32_OUT_REL, kernel
    monkeypatch.setenv("V41GRAPH_FP8_KERNEL", "gemv")
    with pytest.raises(ValueError, match="V41GRAPH_FP8_KERNEL must be"):
        quant_gemm.decode_kernel(1, 1280, 5120, dev)


def test_e2m1_byte_decode_is_exact_for_every_byte_and_scale():
    """The MXFP4 tile decode (PTX bit moves + two bf16 FMAs) equals codecs' decode times the
    E8M0 scale for all 256 bytes x all 255 finite scales, subnormal codes, signed zeros and
    overflow (scale 2^127 x 6 = inf in both) included."""
    import triton.language as tl
    from v41graph.custom_ops import codecs
    from v41graph.custom_ops.triton import common

    @triton.jit
    def decode(p_ptr, u_ptr, even_ptr, odd_ptr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        even, odd = common._e2m1_bytes_to_bf16(tl.load(p_ptr + i), common._e8m0_to_bf16(tl.load(u_ptr + i)))
        tl.store(even_ptr + i, even)
        tl.store(odd_ptr + i, odd)

    p = torch.arange(256, dtype=torch.uint8).repeat(255)
    u = torch.arange(255, dtype=torch.uint8).repeat_interleave(256)
    scale = codecs.e8m0_to_float(u)
    want_even = (codecs.e2m1_decode((p & 15).long()) * scale).bfloat16()
    want_odd = (codecs.e2m1_decode((p >> 4).long()) * scale).bfloat16()
    even = torch.empty(p.numel(), dtype=torch.bfloat16, device=DEV)
    odd = torch.empty_like(even)
    decode[(p.numel() // 256,)](p.to(DEV), u.to(DEV), even, odd, BLOCK=256)   # 255 programs
    for got, want in ((even.cpu(), want_even), (odd.cpu(), want_odd)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), \
            (got != want).nonzero()[:5].flatten().tolist()


def test_fp8_tile_decode_is_exact_for_every_byte_and_scale():
    """The FP8 weight tile's dequantization (fp8_linear, the shared expert) equals the E4M3
    value times the E8M0 scale rounded to bf16 for all 254 non-NaN bytes x all 255 finite
    scales: scale byte 0 is 2^-127 (the codec's value, not 0), subnormal products and overflow
    to inf included."""
    import triton.language as tl
    from v41graph.custom_ops import codecs
    from v41graph.custom_ops.triton import common

    @triton.jit
    def decode(w_ptr, u_ptr, out_ptr):
        k = tl.arange(0, 256)
        codes = tl.load(w_ptr + k).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        scale = tl.load(u_ptr + tl.program_id(0) + 0 * tl.arange(0, 8))          # one scale, 8 blocks
        tile = common._scaled_tile(tl.broadcast_to(codes[None, :], (16, 256)),
                                   tl.broadcast_to(scale[None, :], (16, 8)), 16, 256)
        tl.store(out_ptr + tl.program_id(0) * 256 + k, tl.max(tile.to(tl.float32), axis=0))   # rows equal

    w = torch.arange(256, dtype=torch.uint8)
    u = torch.arange(255, dtype=torch.uint8)
    out = torch.empty(255 * 256, dtype=torch.float32, device=DEV)
    decode[(255,)](w.to(DEV), u.to(DEV), out)
    want = (w.view(torch.float8_e4m3fn).float()[None, :] * codecs.e8m0_to_float(u)[:, None]).bfloat16()
    got = out.cpu().view(255, 256).bfloat16()
    finite = ~want.isnan()            # bytes 0x7F and 0xFF are E4M3's NaN
    assert finite.sum() == 255 * 254
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16)), \
        (got != want)[finite].nonzero()[:5].flatten().tolist()


def _routing(n: int, k: int, e: int, g: torch.Generator, held_elsewhere: bool = False):
    scores = torch.rand(n, e + int(held_elsewhere), generator=g)
    chosen = scores.topk(k, dim=-1).indices                       # e = an expert of another rank
    weights = torch.rand(n, k, generator=g) + 0.1
    return weights.to(DEV), chosen.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,e,d,i,elsewhere", [(1, 6, 48, 512, 256, False), (64, 6, 48, 512, 256, False),
                                                 (400, 6, 16, 256, 128, False), (5, 2, 4, 64, 32, True),
                                                 (33, 4, 8, 256, 96, True)])
def test_mxfp4_moe_matches_reference(n, k, e, d, i, elsewhere, dtype):
    g = torch.Generator().manual_seed(n * 31 + e + d)
    w13, s13 = fp4_stack(e, 2 * i, d, g)
    w2, s2 = fp4_stack(e, d, i, g)
    x = activations(n, d, dtype, g)
    weights, chosen = _routing(n, k, e, g, elsewhere)
    args = (x, weights, chosen, w13, s13, w2, s2, 10.0)
    assert moe_fp4.mxfp4_moe_supported(*args[:7])
    got = ops.mxfp4_moe(*args)
    want = ref.mxfp4_moe(*args)
    assert got.dtype == torch.float32 and got.shape == (n, d)
    err = rel_err(got, want)
    assert err < (2e-3 if dtype == torch.float32 else 1.5e-2), err


@pytest.mark.parametrize("n,dtype", [(12, torch.bfloat16), (64, torch.bfloat16), (40, torch.float32)])
def test_mxfp4_moe_every_tile_config(n, dtype):
    """The tile shapes the table and the sweep use agree with the reference (top-6 over 16
    experts: 12 tokens give groups of 0 to ~10 rows, 64 tokens groups past a 16-row tile)."""
    g = torch.Generator().manual_seed(11 + n)
    e, d, i = 16, 512, 256
    w13, s13 = fp4_stack(e, 2 * i, d, g)
    w2, s2 = fp4_stack(e, d, i, g)
    x = activations(n, d, dtype, g)
    weights, chosen = _routing(n, 6, e, g)
    args = (x, weights, chosen, w13, s13, w2, s2, 10.0)
    want = ref.mxfp4_moe(*args)
    if n == 64:
        assert int(torch.bincount(chosen.flatten()).max()) > 32    # some group spans 3+ tiles of 16
    # the blocks kernels' activation codes: E4M3 bytes, each 32-block's even columns first
    codes, scales = quant_gemm.quantize_rows_codes(x)
    split, split_scales = quant_gemm.quantize_rows_codes(x, torch.float8_e4m3fn, split_pairs=True)
    assert torch.equal(split_scales, scales)
    assert torch.equal(split.float().view(n, -1, 2, 16).transpose(-1, -2).reshape(n, -1), codes.float())
    for tile in [(16, 64, 128, 128, 4, 3), (16, 128, 128, 128, 4, 3), (16, 64, 256, 256, 8, 3),
                 (64, 64, 64, 64, 4, 3), (128, 64, 64, 64, 8, 3), (16, 32, 32, 32, 4, 4),
                 # the weight rows first on FP8 dots per 32-wide block (scales as words at BK 128, as
                 # bytes below; one whose 16-token tile a group outgrows)
                 (16, 64, 128, 128, 4, 3, "blocks"), (16, 128, 128, 128, 4, 3, "blocks"),
                 (16, 128, 128, 128, 8, 3, "blocks"), (32, 128, 128, 128, 4, 3, "blocks"),
                 (16, 64, 64, 64, 4, 3, "blocks"), (16, 32, 32, 32, 4, 3, "blocks")]:
        err = rel_err(moe_fp4.mxfp4_moe(*args, config=tile), want)
        assert err < (2e-3 if dtype == torch.float32 else 1.5e-2), (tile, err)


@pytest.mark.parametrize("n,dtype", [(1, torch.bfloat16), (12, torch.bfloat16), (64, torch.float32)])
def test_mxfp4_moe_split_k(n, dtype):
    """The tokens gate_up with K split over programs (moe_fp4._split_k; the last program of a
    tile adds the slices): within the unsplit kernels' bound of the reference, the same bits at
    every call (whichever program comes last, and again after a capture's worth of calls: the
    per-tile counts start from zero), with an expert held elsewhere."""
    g = torch.Generator().manual_seed(21 + n)
    e, d, i = 16, 512, 256
    w13, s13 = fp4_stack(e, 2 * i, d, g)
    w2, s2 = fp4_stack(e, d, i, g)
    x = activations(n, d, dtype, g)
    weights, chosen = _routing(n, 6, e, g, held_elsewhere=True)
    args = (x, weights, chosen, w13, s13, w2, s2, 10.0)
    want = ref.mxfp4_moe(*args)
    for split in (2, 4):
        first = moe_fp4.mxfp4_moe(*args, split=split)
        for _ in range(5):
            assert torch.equal(moe_fp4.mxfp4_moe(*args, split=split), first), split
        err = rel_err(first, want)
        assert err < (2e-3 if dtype == torch.float32 else 1.5e-2), (split, err)


def test_mxfp4_moe_unpicked_experts_and_no_limit():
    """Experts nobody picked contribute nothing; limit 0 = plain SwiGLU (no clamp)."""
    g = torch.Generator().manual_seed(9)
    e, d, i = 8, 128, 64
    w13, s13 = fp4_stack(e, 2 * i, d, g)
    w2, s2 = fp4_stack(e, d, i, g)
    x = activations(6, d, torch.float32, g)
    chosen = torch.tensor([[1, 5]] * 6, device=DEV)               # 6 of 8 experts unpicked
    weights = torch.rand(6, 2, generator=g).to(DEV)
    for limit in (0.0, 0.5):
        args = (x, weights, chosen, w13, s13, w2, s2, limit)
        assert rel_err(ops.mxfp4_moe(*args), ref.mxfp4_moe(*args)) < 2e-3


def test_released_ops_capture_replay_bit_identical():
    g = torch.Generator().manual_seed(3)
    w, s = fp8_weight(1024, 2048, g)
    w13, s13 = fp4_stack(16, 256, 512, g)
    w2, s2 = fp4_stack(16, 512, 128, g)
    x = activations(8, 2048, torch.bfloat16, g)
    xm = activations(8, 512, torch.bfloat16, g)
    weights, chosen = _routing(8, 6, 16, g)

    def step():
        return ops.fp8_linear(x, w, s, torch.bfloat16), ops.mxfp4_moe(xm, weights, chosen, w13, s13, w2, s2, 10.0)

    eager = step()
    graph, captured = capture(step)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured))


def test_from_pretrained_streams_the_checkpoint_bytes_to_the_gpu():
    """device="cuda", numerics="released": the quantized weights land on the GPU as stored
    (uint8, the checkpoint's shapes) and the device holds the parameters' bytes, nothing more
    than 2 % (buffers) beyond them: no dense copy anywhere."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from golden_path import GOLDEN_DIR
    from v41graph.model.layers import Linear
    from v41graph.weights.load import from_pretrained
    if not (GOLDEN_DIR / "model.safetensors").is_file():
        pytest.skip(f"golden checkpoint not found at {GOLDEN_DIR}")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = from_pretrained(GOLDEN_DIR, numerics="released", device="cuda")
    held = torch.cuda.memory_allocated() - base
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.fmt != "dense"]
    assert quantized and all(m.weight.is_cuda and m.weight.dtype == torch.uint8 for m in quantized)
    on_gpu = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_cuda)
    assert on_gpu <= held <= 1.02 * on_gpu + (2 << 20)      # + one allocator block of slack
