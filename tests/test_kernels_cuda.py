"""Fast CUDA (Triton) implementations vs their pure-torch references (the specification).

Every test is marked `cuda` and skipped without a GPU or without Triton. Each draws fresh random
inputs, poisons outputs (NaN-filled `out=` buffers; caches pre-filled with random bytes), and
compares with the reference computed on the CPU from the same inputs.

Error measure (METHOD.md): rel = ||out - ref|| / ||ref|| in float64, NaN never passes.
  cache writes, Engram gather       bit-identical (torch.equal on the bytes / values)
  fused_wkv_rmsnorm  bf16 / fp16    rel < 1e-2 vs fp64 truth AND within 1.5x of the CPU
                                    reference's own error + 1e-3;  fp32: rel < 1e-5. Split-K sums
                                    in fp32 atomics (order varies run to run); bit-reproducible
                                    under torch.use_deterministic_algorithms(True)
  sparse_attention   bf16           rel < 1e-2 vs the CPU reference; fp32: rel < 1e-5; window
                                    rows read from the FP8 ring (dequantized in registers) or the
                                    fresh rows: bit-identical values (one-row lists), both
                                    decodes over every FP8 / FP4 code and scale
"""
from __future__ import annotations

import zlib

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
triton = pytest.importorskip("triton")

import v41graph.custom_ops  # noqa: E402,F401  (registers the ops and the CUDA kernels)
from cuda_graphs import capture  # noqa: E402
from v41graph.custom_ops import codecs, reference as ref  # noqa: E402
from v41graph.custom_ops.triton import attention, cache_writes, engram, indexer, norms, rope  # noqa: E402

ops = torch.ops.v41graph
DEV = "cuda"


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    o, w = out.detach().double().cpu(), want.detach().double().cpu()
    assert torch.isfinite(o).all(), "non-finite output (unwritten / NaN)"
    return ((o - w).norm() / w.norm().clamp_min(1e-300)).item()


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _rng(seed):
    g = torch.Generator().manual_seed(seed)
    return g


# =============================================================================== fused_wkv_rmsnorm
def _wkv_truth(x, w, nw, eps):
    y = x.double() @ w.double().T
    y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)
    return nw.double() * y


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k,n", [(1, 5120, 512), (8, 5120, 512), (17, 5120, 512), (64, 5120, 512),
                                   (130, 640, 512), (200, 640, 512), (3, 64, 32), (5, 96, 48)])
def test_fused_wkv_rmsnorm(m, k, n, dtype):
    g = _rng(1000 + m * 7 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    nw = torch.rand(n, generator=g) + 0.5
    eps = 1e-20
    truth = _wkv_truth(x, w, nw, eps)
    cpu_ref = ops.fused_wkv_rmsnorm(x, w, nw, eps)                  # CPU = reference impl
    xd, wd, nwd = x.to(DEV), w.to(DEV), nw.to(DEV)
    # (split, block_n): default; whole rows in one program (no atomics); odd splits; column tiles
    variants = [(None, None), (1, 1024), (3, None), (7, 128), (1000, None)]
    for split, block_n in variants:
        out = poisoned((m, n), dtype)
        norms.fused_wkv_rmsnorm(xd, wd, nwd, eps, split=split, block_n=block_n, out=out)
        e = rel_err(out, truth)
        if dtype == torch.float32:
            assert e < 1e-5, (split, block_n, e)
        else:
            e_ref = rel_err(cpu_ref, truth)
            assert e < 1e-2 and e <= 1.5 * e_ref + 1e-3, (split, block_n, e, e_ref)
    # through the dispatcher (registered CUDA kernel), repeatedly (the kernel's accumulator and
    # counters must be left clean), 3-D input
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for _ in range(3):
        a = ops.fused_wkv_rmsnorm(xd.view(1, m, k), wd, nwd, eps)
        assert a.shape == (1, m, n) and a.dtype == dtype
        assert rel_err(a, truth.view(1, m, n)) < tol
    # bit-for-bit reproducible under torch.use_deterministic_algorithms (no split-K atomics)
    torch.use_deterministic_algorithms(True, warn_only=True)   # warn_only: cuBLAS path (M > 128)
    try:
        a = ops.fused_wkv_rmsnorm(xd, wd, nwd, eps)
        b = ops.fused_wkv_rmsnorm(xd, wd, nwd, eps)
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(a, b) and rel_err(a, truth) < tol


# =============================================================================== rms_norm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 5120), (64, 5120), (4096, 5120), (3, 7, 512), (64, 1536),
                                   (5, 128), (9, 33), (0, 64)])
def test_rms_norm(shape, dtype):
    """Triton RMSNorm (one row per program, fp32 math) vs a float64 truth, beside the CPU
    reference: fp32 within 2e-6 relative; bf16 outputs within one bf16 rounding of the truth,
    elementwise (the reference itself is one rounding away)."""
    g = _rng(300 + shape[-1] + len(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = torch.rand(shape[-1], generator=g) + 0.5
    eps = 1e-6
    xf = x.double()
    truth = w.double() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))
    xd, wd = x.to(DEV), w.to(DEV)
    assert norms.rms_norm_supported(xd, wd)
    out = norms.rms_norm(xd, wd, eps)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    if x.numel() == 0:
        return
    o = out.double().cpu()
    assert torch.isfinite(o).all()
    if dtype == torch.float32:
        assert rel_err(out, truth) < 2e-6
    else:   # |o - truth| <= one bf16 ulp of truth (2^-7 relative) plus the fp32 math's slack
        assert ((o - truth).abs() <= truth.abs() * 2 ** -7 + 1e-6).all()
    # dispatcher path, a strided view as input (non-contiguous unless it has one row): same result
    wide = torch.cat([xd, xd], dim=-1)[..., : shape[-1]]
    assert torch.equal(ops.rms_norm(wide, wd, eps), out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64, 5120), (3, 7, 512), (9, 33)])
def test_rms_norm_cast_before_weight(shape, dtype):
    """Llama's spelling (normalised value rounded to x's dtype, then times the weight): the
    Triton kernel against the same spelling in torch on the GPU, within one rounding of the
    normalised value (the kernel's sum order differs from torch's mean)."""
    g = _rng(400 + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEV)
    eps = 1e-6
    out = ops.rms_norm(x, w, eps, True)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    assert out.dtype == dtype and out.shape == x.shape
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert ((out.float() - want.float()).abs() <= want.float().abs() * 2 * ulp + 1e-6).all()
    # differs from the cast-after spelling somewhere (the flag reaches the kernel)
    assert not torch.equal(out, ops.rms_norm(x, w, eps))


# =============================================================================== rope
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,pairs", [((1, 512), 32), ((64, 512), 32), ((64, 64, 512), 32),
                                         ((4096, 512), 32), ((7, 3, 128), 32), ((5, 64), 32), ((0, 512), 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(shape, pairs, dtype, inverse):
    """One-launch RoPE vs a float64 truth of the same rotation: the copied channels bit for
    bit; each rotated channel within 1e-6 (fp32) or 2^-7 (bf16: one rounding) of |a| + |b|,
    the size of its pair (the rotation's products can cancel, so not of the result)."""
    g = _rng(500 + shape[-1] + len(shape) + inverse)
    x = (torch.randn(shape, generator=g) * 2).to(dtype)
    ang = torch.rand(shape[0], pairs, generator=g) * 100
    rot = torch.polar(torch.ones_like(ang), ang)
    xd, rd = x.to(DEV), rot.to(DEV)
    assert rope.rope_supported(xd, rd)
    out = rope.rope(xd, rd, inverse)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    if x.numel() == 0:
        return
    head = shape[-1] - 2 * pairs
    assert torch.equal(out[..., :head].cpu(), x[..., :head])
    t = x[..., head:].double().unflatten(-1, (-1, 2))
    c, s = rot.real.double(), rot.imag.double() * (-1 if inverse else 1)
    while c.dim() < t.dim() - 1:
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    truth = torch.stack([t[..., 0] * c - t[..., 1] * s, t[..., 0] * s + t[..., 1] * c], -1).flatten(-2)
    o = out[..., head:].double().cpu()
    mag = (t[..., 0].abs() + t[..., 1].abs()).unsqueeze(-1).expand(*t.shape).flatten(-2)   # |a| + |b|
    bound = mag * (2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    assert ((o - truth).abs() <= bound).all()
    # dispatcher path, non-contiguous input: same result
    wide = torch.cat([xd, xd], dim=-1)[..., : shape[-1]]
    assert torch.equal(ops.rope(wide, rd, inverse), out)


def test_fused_wkv_rmsnorm_cuda_graph_replay():
    g = _rng(7)
    m, k, n = 4, 5120, 512
    w = (torch.randn(n, k, generator=g) * k ** -0.5).bfloat16().to(DEV)
    nw = (torch.rand(n, generator=g) + 0.5).to(DEV)
    x = torch.randn(m, k, generator=g).bfloat16().to(DEV)
    graph, out = capture(lambda: ops.fused_wkv_rmsnorm(x, w, nw, 1e-20))
    for i in range(3):
        x.copy_(torch.randn(m, k, generator=g).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        want = _wkv_truth(x.cpu(), w.cpu(), nw.cpu(), 1e-20)
        assert rel_err(out, want) < 1e-2


# =============================================================================== cache writes
def _kv_rows(n, d, dtype, g):
    """Random rows with varied magnitudes, an all-zero row, exact E2M1 ties and huge/tiny rows."""
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-12, 8, (n, 1), generator=g).float())
    if n > 1:
        x[1] = 0.0
    if n > 2:
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -2.5, -5.0,
                             0.0, -0.0, 1.0, 0.5])
        x[2] = ties.repeat(d // 16 + 1)[:d] * 0.5
    if n > 3:
        x[3] = x[3] * 1e-30
    return x.to(dtype)


def _slots(n, capacity, g, frac_skip=0.3):
    perm = torch.randperm(capacity, generator=g)[:n]
    skip = torch.rand(n, generator=g) < frac_skip
    return torch.where(skip, torch.full_like(perm, -1), perm)


WRITE_CASES = {
    # name: (op, kernel, block, cache last dim fn, scale last dim fn)
    "window": (ops.window_kv_write, cache_writes.window_kv_write, lambda d: d, lambda d: d // 32),
    "global": (ops.global_kv_write, cache_writes.global_kv_write, lambda d: d // 2, lambda d: d // 16),
    "index": (ops.index_k_write, cache_writes.index_k_write, lambda d: d // 2, lambda d: d // 32),
}


@pytest.mark.parametrize("kind", list(WRITE_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,d", [(1, 512), (5, 512), (64, 512), (130, 128), (7, 32), (3, 64)])
@pytest.mark.parametrize("via_op", [False, True])
def test_cache_write_bit_identical(kind, dtype, n, d, via_op):
    op, kern, cdim, sdim = WRITE_CASES[kind]
    if kind == "index" and d == 512:
        d = 128
    g = _rng(zlib.crc32(f"{kind}{n}{d}{dtype}".encode()))
    blocks, rows = 3, 64
    cache = torch.randint(0, 256, (blocks, rows, cdim(d)), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 256, (blocks, rows, sdim(d)), dtype=torch.uint8, generator=g)
    x = _kv_rows(n, d, dtype, g)
    for slots in (_slots(n, blocks * rows, g), torch.full((n,), -1, dtype=torch.int64)):
        want_c, want_s = cache.clone(), scale.clone()
        op(want_c, want_s, x, slots)                               # CPU reference
        got_c, got_s = cache.to(DEV), scale.to(DEV)
        if via_op:
            op(got_c, got_s, x.to(DEV), slots.to(DEV))
        else:
            kern(got_c, got_s, x.to(DEV), slots.to(DEV))
        torch.cuda.synchronize()
        assert torch.equal(got_c.cpu(), want_c), f"{kind} cache bytes differ"
        assert torch.equal(got_s.cpu(), want_s), f"{kind} scale bytes differ"


# =============================================================================== sparse attention
def _attn_inputs(n, h, d, w, kg, dtype, g, slots=15, ring_w=20, cache_rows=700):
    """Window rows over (FP8 ring [slots, ring_w, D] ++ fresh rows [n, D]): ring rows, fresh rows
    and -1. The ring's last quarter is never listed and holds NaN codes (must not be read)."""
    q = torch.randn(n, h, d, generator=g).to(dtype)
    n_ring = slots * ring_w
    ring = torch.full((slots, ring_w, d), 0x7F, dtype=torch.uint8)          # E4M3 NaN
    ring_scale = torch.randint(0, 256, (slots, ring_w, d // 32), dtype=torch.uint8, generator=g)
    used = n_ring * 3 // 4
    vals = torch.randn(used, d, generator=g) * torch.logspace(-2, 1, used).unsqueeze(-1)
    if used:
        ref.window_kv_write(ring, ring_scale, vals.to(dtype), torch.arange(used))
    fresh = codecs.qdq_fp8_ue8m0(torch.randn(n, d, generator=g) * 2, 32).to(dtype)
    pick = torch.randint(0, used + n, (n, w), generator=g)
    wrows = torch.where(pick < used, pick, n_ring + pick - used)
    wrows = torch.where(torch.rand(n, w, generator=g) < 0.2, -1, wrows)
    kv = torch.randn(cache_rows, d, generator=g) * 2
    gc = torch.zeros(cache_rows, d // 2, dtype=torch.uint8)
    gs = torch.zeros(cache_rows, d // 16, dtype=torch.uint8)
    ref.global_kv_write(gc, gs, kv, torch.arange(cache_rows))
    grows = torch.stack([torch.randperm(cache_rows, generator=g)[:kg].sort().values
                         for _ in range(n)]) if kg else torch.zeros(n, 0, dtype=torch.int64)
    if kg:
        grows = torch.where(torch.rand(n, kg, generator=g) < 0.2, -1, grows)
    if n > 1:                        # one token with nothing to attend to (empty window)
        wrows[1] = -1
        if kg:
            grows[1] = -1
    sink = torch.randn(h, generator=g)
    return q, ring, ring_scale, fresh, wrows, gc, gs, grows, sink


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,h,d,w,kg,slots", [(3, 64, 512, 128, 512, 15), (4, 64, 512, 128, 0, 15),
                                              (2, 16, 512, 100, 77, 15), (5, 4, 32, 8, 4, 15),
                                              (3, 16, 512, 40, 0, 0), (64, 64, 512, 128, 512, 65)])
def test_sparse_attention(n, h, d, w, kg, slots, dtype):
    g = _rng(n * 1000 + h + w + kg + slots)
    inputs = _attn_inputs(n, h, d, w, kg, dtype, g, slots=slots)
    scale = d ** -0.5
    want = ops.sparse_attention(*inputs, scale)                                  # CPU reference
    args = [t.to(DEV) for t in inputs]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    # default (bf16: the tile kernel; fp32: the head-tile kernel); the head-tile kernel: its
    # defaults (prefetch on, PTX decodes), no prefetch, splits + combine, the generic decodes,
    # BS = 64, all 64 heads in one program; the tile kernel: unsplit, split + pipelined,
    # pipelined at its default split, rows in blocks of 16 and of 64 (prefill's)
    variants = [dict(), dict(kernel="heads"), dict(kernel="heads", block_h=16, n_split=1, prefetch=False),
                dict(kernel="heads", block_h=16, n_split=3, prefetch=True),
                dict(kernel="heads", ptx_decode=False)]
    if dtype == torch.bfloat16 and d == 512:
        variants += [dict(kernel="heads", block_h=16, block_s=64, n_split=1),
                     dict(kernel="heads", block_h=64, n_split=2)]
    if dtype == torch.bfloat16:
        variants += [dict(kernel="tile", n_split=1), dict(kernel="tile", n_split=3, stages=3),
                     dict(kernel="tile", stages=2), dict(kernel="tile", block_s=16, n_split=2),
                     dict(kernel="tile", block_s=64, n_split=1)]
    for v in variants:
        out = poisoned((n, h, d), dtype)
        attention.sparse_attention(*args, scale, out=out, **v)
        e = rel_err(out, want)
        assert e < tol, (v, e)
        if n > 1:   # the token with no visible rows gives exactly 0 (denominator = sink term only)
            assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    assert attention.sparse_attention_supported(*args)
    got = ops.sparse_attention(*args, scale)                                     # dispatcher
    assert rel_err(got, want) < tol


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "tile"), (torch.bfloat16, "heads"),
                                          (torch.float32, "heads")])
def test_sparse_attention_window_rows_exact(dtype, kernel):
    """One visible window row per query: the output is that row (softmax weight 1 up to the
    sink, which is -inf-like here), so the kernel's in-register FP8 dequantization must give
    exactly the reference's values (ring rows) and the fresh rows as they are."""
    g = _rng(4242)
    n, h, d, w = 8, 16, 512, 16
    q, ring, ring_scale, fresh, wrows, gc, gs, grows, sink = _attn_inputs(n, h, d, w, 0, dtype, g)
    n_ring = ring.shape[0] * ring.shape[1]
    only = torch.tensor([0, 7, n_ring * 3 // 4 - 1, n_ring, n_ring + 5, 3, 100, n_ring + 7])
    wrows = torch.full((n, w), -1, dtype=torch.int64)
    wrows[:, 5] = only
    sink = torch.full((h,), -1e4)
    want = ops.sparse_attention(q, ring, ring_scale, fresh, wrows, gc, gs, grows, sink, d ** -0.5)
    rows = ref.gather_window_or_fresh(ring, ring_scale, fresh, only.view(n, 1))[:, 0]
    assert torch.equal(want, rows.unsqueeze(1).expand(n, h, d).to(dtype))
    out = poisoned((n, h, d), dtype)
    attention.sparse_attention(*[t.to(DEV) for t in (q, ring, ring_scale, fresh, wrows, gc, gs,
                                                     grows, sink)], d ** -0.5, n_split=1,
                               kernel=kernel, out=out)
    assert torch.equal(out.cpu(), want)


@pytest.mark.parametrize("kernel,ptx_decode", [("heads", True), ("heads", False), ("tile", None)])
def test_sparse_attention_decodes_exact_over_every_code(kernel, ptx_decode):
    """Both decodes of both caches, every code at every scale: each query lists one ring row or
    one global row, q = 0 and a -inf-like sink make the output that row, so it must equal the
    reference's dequantized row bit for bit. Ring: all 254 non-NaN E4M3 bytes at each UE8M0
    scale byte 0..245 (larger ones overflow 448 x scale); global: all 256 E2M1 byte pairs at
    each of the 254 non-NaN E4M3 scales."""
    d, h = 512, 16
    e4m3 = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    n_ring_rows = 246 * 8 * 32 // d                        # 8 blocks of 32 codes per scale byte
    ring = e4m3[torch.arange(n_ring_rows * d) % 254].view(1, n_ring_rows, d)
    ring_scale = (torch.arange(n_ring_rows * d // 32) // 8).to(torch.uint8).view(1, n_ring_rows, d // 32)
    gc = torch.arange(256, dtype=torch.uint8).repeat(254, d // 2 // 256)       # [254, D/2]
    gs = e4m3[:, None].expand(254, d // 16).contiguous()                      # one scale per row
    n = n_ring_rows + 254
    wrows = torch.full((n, 1), -1, dtype=torch.int64)
    grows = torch.full((n, 1), -1, dtype=torch.int64)
    wrows[:n_ring_rows, 0] = torch.arange(n_ring_rows)
    grows[n_ring_rows:, 0] = torch.arange(254)
    fresh = torch.zeros(1, d, dtype=torch.bfloat16)
    want = torch.cat([ref.gather_window_or_fresh(ring, ring_scale, fresh, wrows[:n_ring_rows])[:, 0],
                      ref.gather_global_kv(gc, gs, torch.arange(254), torch.float32)]).bfloat16()
    q = torch.zeros(n, h, d, dtype=torch.bfloat16)
    sink = torch.full((h,), -1e4)
    out = poisoned((n, h, d), torch.bfloat16)
    attention.sparse_attention(*[t.to(DEV) for t in (q, ring, ring_scale, fresh, wrows, gc, gs,
                                                     grows, sink)], d ** -0.5, n_split=1,
                               kernel=kernel, ptx_decode=ptx_decode, out=out)
    got = out.cpu()
    assert torch.equal(got, want.unsqueeze(1).expand(n, h, d)), \
        [int(i) for i in (got != want.unsqueeze(1)).any(-1).any(-1).nonzero()[:8, 0]]


@pytest.mark.parametrize("kernel,n_split,prefetch", [("heads", 1, False), ("heads", 4, True),
                                                     ("tile", 1, None), ("tile", 4, None)])
def test_sparse_attention_bf16_cache_variant(kernel, n_split, prefetch):
    """The comparison variant: same kernel over a bf16 global cache holding the dequantized rows."""
    g = _rng(99 + n_split)
    n, h, d, w, kg = 3, 64, 512, 128, 512
    q, ring, ring_scale, fresh, wrows, gc, gs, grows, sink = _attn_inputs(n, h, d, w, kg,
                                                                          torch.bfloat16, g)
    want = ops.sparse_attention(q, ring, ring_scale, fresh, wrows, gc, gs, grows, sink, d ** -0.5)
    dense = ref.gather_global_kv(gc, gs, torch.arange(gc.shape[0]), torch.bfloat16)
    out = poisoned((n, h, d), torch.bfloat16)
    attention.sparse_attention(*[t.to(DEV) for t in (q, ring, ring_scale, fresh, wrows)],
                               dense.to(DEV), None, grows.to(DEV), sink.to(DEV), d ** -0.5,
                               kernel=kernel, n_split=n_split, prefetch=prefetch, out=out)
    assert rel_err(out, want) < 1e-2


def test_sparse_attention_kernel_choice_is_checked(monkeypatch):
    """kernel='tile' outside what it supports (fp32, more than 64 heads), an unknown kernel name
    (argument or $V41GRAPH_ATTN_KERNEL) and tile knobs out of range are refused with the rule
    they break, before anything launches; V41GRAPH_ATTN_KERNEL=heads makes the default the head-tile kernel."""
    g = _rng(6)
    bf16 = [t.to(DEV) for t in _attn_inputs(3, 64, 512, 128, 512, torch.bfloat16, g)]
    tile, heads = (attention.sparse_attention(*bf16, 0.04, kernel=k) for k in ("tile", "heads"))
    assert not torch.equal(tile, heads)          # the two kernels round differently
    monkeypatch.setenv("V41GRAPH_ATTN_KERNEL", "heads")
    assert torch.equal(attention.sparse_attention(*bf16, 0.04), heads)
    monkeypatch.setenv("V41GRAPH_ATTN_KERNEL", "fast")
    with pytest.raises(ValueError, match="V41GRAPH_ATTN_KERNEL must be 'tile' or 'heads'"):
        attention.sparse_attention(*bf16, 0.04)
    monkeypatch.delenv("V41GRAPH_ATTN_KERNEL")
    assert torch.equal(attention.sparse_attention(*bf16, 0.04), tile)
    g = _rng(5)
    args = [t.to(DEV) for t in _attn_inputs(2, 16, 64, 8, 4, torch.float32, g)]
    with pytest.raises(ValueError, match="bf16 q with at most 64 heads"):
        attention.sparse_attention(*args, 0.125, kernel="tile")
    with pytest.raises(ValueError, match="kernel must be 'tile' or 'heads'"):
        attention.sparse_attention(*args, 0.125, kernel="fast")
    with pytest.raises(ValueError, match="block_s must be a power of two >= 16"):
        attention.sparse_attention(*bf16, 0.04, kernel="tile", block_s=24)
    with pytest.raises(ValueError, match="stages >= 1"):
        attention.sparse_attention(*bf16, 0.04, kernel="tile", stages=0)
    args[0] = torch.randn(2, 128, 64, device=DEV).bfloat16()
    with pytest.raises(ValueError, match="at most 64 heads"):
        attention.sparse_attention(*args[:8], torch.zeros(128, device=DEV), 0.125, kernel="tile")


# =============================================================================== Engram gather
@pytest.mark.parametrize("where", ["device", "pinned_host"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,m,dh", [(1, 24, 256), (7, 24, 256), (64, 24, 256), (5, 3, 32)])
def test_engram_gather_bit_identical(where, out_dtype, n, m, dh):
    g = _rng(n * 31 + m + dh)
    rows = 5000
    table = torch.randint(0, 256, (rows, dh), dtype=torch.uint8, generator=g)
    table[(table & 0x7F) == 0x7F] = 0                               # no NaN codes
    scale = torch.randint(100, 150, (rows, dh // 32), dtype=torch.uint8, generator=g)
    scale[0, 0] = 0                                                 # subnormal 2^-127 scale
    ids = torch.randint(0, rows, (n, m), generator=g)
    ids[0, 0] = 0
    want = ref.engram_gather(table, scale, ids, out_dtype)
    if where == "device":
        t, s = table.to(DEV), scale.to(DEV)
    else:
        t, s = table.pin_memory(), scale.pin_memory()
    out = poisoned((n, m * dh), out_dtype)
    engram.engram_gather(t, s, ids.to(DEV), out_dtype, out=out)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), want)
    got = ops.engram_gather(t, s, ids.to(DEV), out_dtype)          # dispatcher
    assert got.is_cuda and torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------- lightning indexer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,h,d,c", [(1, 64, 128, 4096), (64, 64, 128, 1000), (3, 16, 32, 70)])
def test_indexer_scores_bit_identical(n, h, d, c, dtype):
    """Scores read from the paged FP4 index-key cache in place vs the reference (gather +
    dequantize + einsum + fixed-order head sum): torch.equal, -inf where invisible or no row.
    Queries are FP4 fake-quantized as in the model, so every dot product is exact."""
    g = torch.Generator().manual_seed(n * 7 + c)
    rows_total = 2 * c + 5
    keys = torch.randn(rows_total, d, generator=g) * torch.logspace(-2, 2, rows_total).unsqueeze(-1)
    kc, ks = codecs.quant_fp4_ue8m0(keys, 32)
    q = codecs.qdq_fp4_ue8m0(torch.randn(n, h, d, generator=g), 32).to(dtype)
    w = (torch.randn(n, h, generator=g) * 0.1).to(dtype)
    rows = torch.randint(-1, rows_total, (n, c), generator=g)
    visible = (torch.rand(n, c, generator=g) > 0.2) & (rows >= 0)
    want = ref.indexer_scores(q, w, ref.gather_index_k(kc, ks, rows, dtype), visible)
    args = [t.to(DEV) for t in (q, w, kc, ks, rows, visible)]
    assert indexer.indexer_scores_supported(*args)
    got = indexer.indexer_scores(*args)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(indexer.indexer_scores(*args, f32_dot=True).cpu(), want)


@pytest.mark.parametrize("n,c,k", [(3, 100, 10), (2, 64, 64), (2, 50, 80), (64, 8192, 512), (4, 16384, 512),
                                   (2, 17, 1), (8, 2048, 512)])
@pytest.mark.parametrize("kind", ["randn", "ties", "mostly_inf", "one_finite", "signed_zeros", "pinned_inf"])
def test_topk_ascending_kernel_selects_the_reference_ids(n, c, k, kind):
    """The one-launch select returns reference.topk_ascending's ids exactly: ties to the lower
    column, -inf entries as -1 at the end, k > C padded, -0 ranked equal to +0, +inf (the
    candidate blocks' pinned newest block) first."""
    g = torch.Generator().manual_seed(n * 131 + c + k)
    s = torch.randn(n, c, generator=g)
    if kind == "ties":
        s = torch.randint(0, 5, (n, c), generator=g).float()
    elif kind == "mostly_inf":
        s[torch.rand(n, c, generator=g) < 0.7] = float("-inf")
    elif kind == "one_finite":
        s[:] = float("-inf")
        s[0, c // 2] = 1.0
    elif kind == "signed_zeros":
        s = torch.zeros(n, c)
        s[:, ::3] = -0.0
        s[:, 1::7] = -1.0
    elif kind == "pinned_inf":
        s[:, c - 1] = float("inf")
        s[:, : c // 3] = float("-inf")
    assert indexer.topk_ascending_supported(s.to(DEV), k)
    assert torch.equal(indexer.topk_ascending(s.to(DEV), k).cpu(), ref.topk_ascending(s, k))


def test_disable_triton_by_kernel_name(monkeypatch):
    """V41GRAPH_DISABLE_TRITON=topk_ascending (bench.py's v41graph-sorttopk) turns off only the
    top-k kernel: the indexer's score kernel stays, "1" turns off both."""
    from v41graph.custom_ops import cuda_impls
    monkeypatch.setenv("V41GRAPH_DISABLE_TRITON", "topk_ascending")
    assert cuda_impls.triton_module("indexer", "topk_ascending") is None
    assert cuda_impls.triton_module("indexer", "indexer_scores") is not None
    monkeypatch.setenv("V41GRAPH_DISABLE_TRITON", "1")
    assert cuda_impls.triton_module("indexer", "indexer_scores") is None


def test_indexer_ops_with_kernel_match_reference():
    """indexer_topk / indexer_topk_candidates on CUDA (scores from the Triton kernel) give the
    reference's ids (same scores bit for bit, same selection code)."""
    g = torch.Generator().manual_seed(3)
    n, h, d, c = 8, 64, 128, 2048
    keys = torch.randn(c, d, generator=g)
    kc, ks = codecs.quant_fp4_ue8m0(keys, 32)
    q = codecs.qdq_fp4_ue8m0(torch.randn(n, h, d, generator=g), 32).bfloat16()
    w = (torch.randn(n, h, generator=g) * 0.1).bfloat16()
    rows = torch.arange(c).expand(n, c).contiguous()
    visible = torch.arange(c) < torch.randint(100, c, (n, 1), generator=g)
    want = ops.indexer_topk(q, w, kc, ks, rows, visible, 512, 8, 64)
    assert indexer.indexer_scores_supported(*[t.to(DEV) for t in (q, w, kc, ks, rows, visible)])
    got = ops.indexer_topk(*[t.to(DEV) for t in (q, w, kc, ks, rows, visible)], 512, 8, 64)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    cand = want[1]
    cand_rows = torch.where(cand >= 0, cand, -1)
    want_c = ops.indexer_topk_candidates(q, w, kc, ks, cand_rows, cand, 512)
    got_c = ops.indexer_topk_candidates(*[t.to(DEV) for t in (q, w, kc, ks, cand_rows, cand)], 512)
    assert torch.equal(got_c.cpu(), want_c)


# ----------------------------------------------------------------------------- MoE gate
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 8, 64, 300])
def test_moe_gate(n, dtype):
    """The gate kernels (custom_ops/triton/moe_gate.py) at bench_rank's width (384 experts x
    5120, top-6): the expert ids of the float64 reference (the draws leave no near ties), weights
    within 1e-5 of it, and the same ids as the fp32 reference on the same GPU; tied experts to
    the lower id."""
    from v41graph.custom_ops.triton import moe_gate
    g = _rng(n * 7 + (dtype == torch.float32))
    e, d, topk = 384, 5120, 6
    x = torch.randn(n, d, generator=g).to(dtype)
    w = (torch.randn(e, d, generator=g) / 64).to(dtype)
    w[201] = w[200]                                           # a tie: 200 must come before 201
    bias = torch.randn(e, generator=g) / 8
    bias[200] = bias[201] = 30.0
    x, w, bias = x.to(DEV), w.to(DEV), bias.to(DEV)
    assert moe_gate.moe_gate_supported(x, w, bias, topk)
    got_w, got_ids = ops.moe_gate(x, w, bias, topk, 2.5)
    scores = torch.nn.functional.softplus(x.double() @ w.double().T).sqrt()      # float64 truth
    want_ids = torch.sort(scores + bias.double(), dim=-1, descending=True, stable=True).indices[:, :topk]
    want_w = scores.gather(1, want_ids)
    want_w = want_w / want_w.sum(-1, keepdim=True) * 2.5
    assert torch.equal(got_ids, want_ids)
    assert torch.equal(got_ids[:, :2].cpu(), torch.tensor([[200, 201]]).expand(n, 2))
    assert ((got_w.double() - want_w).abs() / want_w.abs()).max().item() < 1e-5
    fp32_w, fp32_ids = ref.moe_gate(x, w, bias, topk, 2.5)     # today's torch form on this GPU
    assert torch.equal(got_ids, fp32_ids)
    assert ((got_w - fp32_w).abs() / fp32_w.abs()).max().item() < 1e-5


# ----------------------------------------------------------------------------- shared expert's SwiGLU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("limit", [10.0, 0.0])
def test_swiglu(dtype, limit):
    """The swiglu kernel (custom_ops/triton/swiglu.py) at the shared expert's width (64 tokens x
    2048, and 3 x 700 for a tail) against the torch form on the same GPU, bit for bit (the same
    accurate exp, correctly rounded division and single product), NaN included."""
    from v41graph.custom_ops.triton import swiglu
    for shape in ((64, 2048), (3, 700)):
        g = _rng(shape[0] + int(limit) + (dtype == torch.float32))
        gate, up = (torch.randn(shape, generator=g) * 8).to(dtype), (torch.randn(shape, generator=g) * 8).to(dtype)
        gate[0, :3], up[0, :3] = torch.tensor([30.0, -30.0, float("nan")]), torch.tensor([-30.0, 30.0, 1.0])
        gate, up = gate.to(DEV), up.to(DEV)
        assert swiglu.swiglu_supported(gate, up)
        got = ops.swiglu(gate, up, limit)
        want = ref.swiglu_in_dtype(gate, up, limit)
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and bool(torch.isnan(got[0, 2]))
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok]), (got[ok] != want[ok]).sum().item()
