"""tests/test_kernels_cuda.py's kernels on the CPU, in Triton's interpreter with the PTX decodes
replaced by their stand-ins (tests/triton_ptx_doubles.py; the PTX itself:
tests/test_ptx_decodes_cpu.py), against the reference ops, at small sizes:
- sparse attention: the head-tile and the all-heads tile kernels, unsplit and split (+ the
  combine kernel), with and without prefetch, over FP8 ring rows, fresh rows, FP4 global rows, -1
  padding and a token with nothing to attend to;
- the three cache writes (FP8 window ring, FP4 global, FP4 index keys), bit for bit, with a
  skipped slot;
- the lightning indexer's scores read from the FP4 key cache (bit for bit) and its one-launch
  top-k (the reference's ids: ties to the lower column, -0 equal to +0, -inf last);
- RMSNorm (fp32 math; within rounding of the reference);
- the fused wkv + RMSNorm (P1) in each launch form, and RoPE;
- the fake-quant kernel (FP8 and FP4 round trips) and the Engram gather kernel's dequantization,
  bit for bit.
They catch an indexing, masking or online-softmax mistake without a GPU; the CUDA tests run the
same kernels at the model's widths. Not here: the Engram op's pinned-host path (it hands Triton a
raw host pointer, which the interpreter cannot follow; the test launches the kernel directly)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the kernels are Triton's; its interpreter runs them on the CPU")

from triton_interpreter import run_interpreted  # noqa: E402

_ATTENTION_SCRIPT = """
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
    # above attention.COMBINE_NARROW_TOKENS tokens the combine takes whole rows per program
    inputs = _attn_inputs(10, h, d, w, kg, torch.bfloat16, g, slots=4, ring_w=16, cache_rows=90)
    want = ops.sparse_attention(*inputs, d ** -0.5)
    out = attention.sparse_attention(*inputs, d ** -0.5, kernel="tile", n_split=3)
    rel = ((out.float() - want.float()).norm() / want.float().norm()).item()
    print("torch.bfloat16", "kernel=tile,n_split=3,n=10", rel, bool(torch.equal(out[1], torch.zeros_like(out[1]))))
"""


def test_attention_kernels_match_the_reference_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_ATTENTION_SCRIPT, tmp_path)]
    assert len(rows) == 10, rows
    for dtype, variant, rel, empty in rows:
        # bf16: P is rounded to bf16 per row block (the kernels' 32 rows, the reference's 64)
        assert float(rel) < (1e-2 if dtype == "torch.bfloat16" else 1e-5), (dtype, variant, rel)
        # token 1 sees no row: its output is exactly 0 (the denominator is the sink term alone)
        assert empty == "True", (dtype, variant)


_CACHE_AND_INDEXER_SCRIPT = """
    import torch
    from v41graph.custom_ops import codecs, reference
    from v41graph.custom_ops.triton import cache_writes, indexer, norms
    g = torch.Generator().manual_seed(7)
    writes = {"window": (cache_writes.window_kv_write, reference.window_kv_write, 1, 32),
              "global": (cache_writes.global_kv_write, reference.global_kv_write, 2, 16),
              "index": (cache_writes.index_k_write, reference.index_k_write, 2, 32)}
    d, n = 128, 9
    for kind, (kernel, ref_write, per_byte, per_scale) in writes.items():
        for dtype in (torch.bfloat16, torch.float32):
            cache = torch.randint(0, 256, (3, 16, d // per_byte), dtype=torch.uint8, generator=g)
            scale = torch.randint(0, 256, (3, 16, d // per_scale), dtype=torch.uint8, generator=g)
            x = (torch.randn(n, d, generator=g) * torch.logspace(-3, 2, n)[:, None]).to(dtype)
            slots = torch.randperm(48, generator=g)[:n]
            slots[2] = -1                                # skipped: its slot keeps its bytes
            want_c, want_s = cache.clone(), scale.clone()
            ref_write(want_c, want_s, x, slots)
            got_c, got_s = cache.clone(), scale.clone()
            kernel(got_c, got_s, x, slots)
            print("write", kind, str(dtype), torch.equal(got_c, want_c) and torch.equal(got_s, want_s))
    n, h, d, c = 3, 16, 32, 70
    for dtype in (torch.bfloat16, torch.float32):
        keys = torch.randn(2 * c + 5, d, generator=g) * torch.logspace(-2, 2, 2 * c + 5).unsqueeze(-1)
        kc, ks = codecs.quant_fp4_ue8m0(keys, 32)
        q = codecs.qdq_fp4_ue8m0(torch.randn(n, h, d, generator=g), 32).to(dtype)
        w = (torch.randn(n, h, generator=g) * 0.1).to(dtype)
        rows = torch.randint(-1, 2 * c + 5, (n, c), generator=g)
        visible = (torch.rand(n, c, generator=g) > 0.2) & (rows >= 0)
        want = reference.indexer_scores(q, w, reference.gather_index_k(kc, ks, rows, dtype), visible)
        print("scores", "indexer", str(dtype), torch.equal(indexer.indexer_scores(q, w, kc, ks, rows, visible), want))
    for kind in ("randn", "ties", "mostly_inf", "signed_zeros"):
        s = torch.randn(3, 300, generator=g)
        if kind == "ties":
            s = torch.randint(0, 5, (3, 300), generator=g).float()
        if kind == "mostly_inf":
            s[torch.rand(3, 300, generator=g) < 0.7] = float("-inf")
        if kind == "signed_zeros":                   # -0 ranks equal to +0 (ties to the lower column)
            s = torch.zeros(3, 300)
            s[:, ::3] = -0.0
            s[:, 1::7] = -1.0
        print("topk", kind, "k40", torch.equal(indexer.topk_ascending(s, 40), reference.topk_ascending(s, 40)))
    for dtype in (torch.bfloat16, torch.float32):
        x = (torch.randn(5, 128, generator=g) * 3).to(dtype)
        w = torch.rand(128, generator=g) + 0.5
        out, want = norms.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6)
        rel = ((out.double() - want.double()).norm() / want.double().norm()).item()
        print("rms_norm", "rows", str(dtype), rel < (4e-3 if dtype == torch.bfloat16 else 1e-6))
"""


def test_cache_writes_indexer_and_norm_kernels_match_the_reference_in_triton_interpreter(tmp_path):
    rows = [line.split() for line in run_interpreted(_CACHE_AND_INDEXER_SCRIPT, tmp_path)]
    assert len(rows) == 14, rows
    assert all(ok == "True" for *_, ok in rows), [r for r in rows if r[-1] != "True"]


_WKV_AND_ROPE_SCRIPT = """
    import torch
    from v41graph.custom_ops import ops
    from v41graph.custom_ops.triton import norms, rope
    from test_kernels_cuda import _wkv_truth
    norms._num_sms = lambda device: 132               # the split rule asks the GPU's SM count
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    g = torch.Generator().manual_seed(4)
    for m, k, n in ((3, 256, 48), (20, 320, 96)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
            nw = torch.rand(n, generator=g) + 0.5
            truth = _wkv_truth(x, w, nw, 1e-20)
            e_ref = rel(ops.fused_wkv_rmsnorm(x, w, nw, 1e-20), truth)   # the CPU reference
            # (split, block_n): the rule; whole rows in one program; odd splits; column tiles
            for split, block_n in ((None, None), (1, 1024), (3, None), (2, 32)):
                out = norms.fused_wkv_rmsnorm(x, w, nw, 1e-20, split=split, block_n=block_n)
                state = norms._wkv_state(x.device)      # the buffers the launch was given
                clean = not state[0].any().item() and not state[1].any().item()
                print("wkv", m, str(dtype), split, block_n, rel(out, truth), e_ref, clean)
    for shape, pairs in (((5, 64), 8), ((7, 3, 48), 16), ((4, 2, 32), 16)):
        for dtype in (torch.bfloat16, torch.float32):
            for inverse in (False, True):
                x = (torch.randn(shape, generator=g) * 2).to(dtype)
                ang = torch.rand(shape[0], pairs, generator=g) * 100
                rot = torch.polar(torch.ones_like(ang), ang)
                out = rope.rope(x, rot, inverse)
                head = shape[-1] - 2 * pairs
                t = x[..., head:].double().unflatten(-1, (-1, 2))
                c, s = rot.real.double(), rot.imag.double() * (-1 if inverse else 1)
                while c.dim() < t.dim() - 1:
                    c, s = c.unsqueeze(-2), s.unsqueeze(-2)
                truth = torch.stack([t[..., 0] * c - t[..., 1] * s, t[..., 0] * s + t[..., 1] * c], -1).flatten(-2)
                mag = (t[..., 0].abs() + t[..., 1].abs()).unsqueeze(-1).expand(*t.shape).flatten(-2)
                bound = mag * (2 ** -7 if dtype == torch.bfloat16 else 1e-6)
                ok = (torch.equal(out[..., :head], x[..., :head]) and out.dtype == dtype
                      and bool(((out[..., head:].double() - truth).abs() <= bound).all()))
                print("rope", "x".join(map(str, shape)), str(dtype), inverse, ok)
"""


def test_fused_wkv_rmsnorm_and_rope_kernels_in_triton_interpreter(tmp_path):
    """fused_wkv_rmsnorm in every launch form (one program per row block, split-K through the
    fp32 accumulator and the last-arrival counter, column tiles) against a float64 truth, with the
    accumulator and counters left zeroed after every launch (the next launch relies on it); RoPE
    as tests/test_kernels_cuda.py checks it: copied channels bit for bit, rotated ones within one
    rounding of the size of their pair."""
    rows = [line.split() for line in run_interpreted(_WKV_AND_ROPE_SCRIPT, tmp_path)]
    wkv = [r for r in rows if r[0] == "wkv"]
    rope_rows = [r for r in rows if r[0] == "rope"]
    assert len(wkv) == 16 and len(rope_rows) == 12, rows
    for _, m, dtype, split, block_n, err, err_ref, clean in wkv:
        if dtype == "torch.float32":
            assert float(err) < 1e-5, (m, dtype, split, block_n, err)
        else:
            assert float(err) < 1e-2 and float(err) <= 1.5 * float(err_ref) + 1e-3, (m, split, block_n, err, err_ref)
        assert clean == "True", (m, dtype, split, block_n)
    for r in rope_rows:
        assert r[-1] == "True", r


_FAKE_QUANT_SCRIPT = """
    import torch
    from v41graph.custom_ops import ops
    from v41graph.custom_ops.triton import cache_writes
    g = torch.Generator().manual_seed(8)
    for fmt, block in (("fp8_ue8m0", 32), ("fp4_ue8m0", 32), ("fp4_ue8m0", 16)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(9, 4, 128, generator=g) * torch.exp2(torch.randint(-20, 12, (9, 4, 1), generator=g).float())
            x[0, 0] = 0.0                                   # a zero row: the scale floor
            x = x.to(dtype)
            got = cache_writes.fake_quant(x, fmt, block)    # 36 rows: a tail program
            print(fmt, block, str(dtype), bool(torch.equal(got, ops.fake_quant_reference(x, fmt, block))))
"""


def test_fake_quant_kernel_in_triton_interpreter(tmp_path):
    """The fake-quant kernel (window KV rows through FP8, the indexer's query through FP4) bit for
    bit against the codecs, over magnitudes from 2^-20 to 2^12 and a zero row."""
    rows = [line.split() for line in run_interpreted(_FAKE_QUANT_SCRIPT, tmp_path)]
    assert len(rows) == 6 and all(r[-1] == "True" for r in rows), rows


_ENGRAM_SCRIPT = """
    import torch
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import engram
    from v41graph.custom_ops.triton.common import _TL_DTYPE
    g = torch.Generator().manual_seed(6)
    rows, dh = 50, 64
    table = torch.randint(0, 256, (rows, dh), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 256, (rows, dh // 32), generator=g, dtype=torch.uint8)
    scale[:2] = torch.tensor([0, 255], dtype=torch.uint8)   # 2^-127 (subnormal) and 2^128 (inf)
    ids = torch.randint(0, rows, (7, 3), generator=g)
    ids[0] = torch.tensor([0, 1, 0])                          # the extreme scales, a repeated row
    for dtype in (torch.bfloat16, torch.float32):
        want = reference.engram_gather(table, scale, ids, dtype)
        for br in (4, 8):                                     # 21 rows: a tail program each
            # the kernel itself: engram.engram_gather hands it a CPU table by raw pointer (UVA),
            # which the interpreter cannot follow
            out = torch.empty_like(want)
            engram._engram_gather_kernel[(-(-ids.numel() // br),)](
                table, scale, ids.reshape(-1), out, ids.numel(), DH=dh, NB=dh // 32, BR=br,
                OUT_DTYPE=_TL_DTYPE[dtype])
            same = (out == want) | (out.isnan() & want.isnan())
            print(str(dtype), br, bool(same.all()))
"""


def test_engram_gather_kernel_in_triton_interpreter(tmp_path):
    """The Engram gather's dequantization bit for bit (every FP8 byte value over random E8M0
    scales including 0 and 255, tail programs), launched on CPU tensors directly."""
    rows = [line.split() for line in run_interpreted(_ENGRAM_SCRIPT, tmp_path)]
    assert len(rows) == 4 and all(r[-1] == "True" for r in rows), rows


_MHC_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()                              # libdevice.exp -> the interpreter's exp
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import mhc
    g = torch.Generator().manual_seed(7)
    for n, iters, eps in ((1, 20, 1e-6), (70, 20, 1e-6), (5, 1, 1e-6), (40, 20, 1e-12)):   # 70 tokens: 3 programs
        mixes = torch.randn(n, 24, generator=g) * 3
        if eps < 1e-6:                                        # entries below the fast division's range, a NaN
            mixes, mixes[3, 9] = mixes * 10, float("nan")
        scale = torch.rand(3, generator=g) + 0.5
        base = torch.randn(24, generator=g)
        got = mhc.mhc_sinkhorn(mixes, scale, base, 4, iters, eps)
        want = reference.mhc_sinkhorn(mixes, scale, base, 4, iters, eps)
        nan_same = all(torch.equal(torch.isnan(a), torch.isnan(b)) for a, b in zip(got, want))
        print(n, iters, max(float((a - b).nan_to_num().abs().max()) for a, b in zip(got, want)), nan_same)
"""


def test_mhc_sinkhorn_kernel_in_triton_interpreter(tmp_path):
    """The mHC Sinkhorn kernel (one thread per token, the 4 x 4 comb matrix in registers): pre,
    post and comb within the last bits of the reference (the interpreter's exp is numpy's, not
    torch's; on the GPU, with libdevice's, tests/test_mhc_sinkhorn.py asks for every bit), one
    Sinkhorn round and twenty, a tail program; and a program that leaves the fast division's
    range (eps 1e-12, a NaN mix: the div_rn rerun; NaNs where the reference has them). The
    fast division itself is PTX: its stand-in here is IEEE division, tests/test_mhc_sinkhorn.py
    checks the PTX on the GPU."""
    rows = [line.split() for line in run_interpreted(_MHC_SCRIPT, tmp_path)]
    assert [r[:2] for r in rows] == [["1", "20"], ["70", "20"], ["5", "1"], ["40", "20"]], rows
    assert all(float(r[2]) < 2e-6 and r[3] == "True" for r in rows), rows


_MOE_GATE_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()                              # libdevice exp/log1p -> the interpreter's
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import moe_gate
    g = torch.Generator().manual_seed(11)
    e, d, topk = 40, 128, 6                                   # 40 experts: a masked expert tile
    for dtype, configs in ((torch.bfloat16, [dict(BM=16, BE=32, BK=64, DOT=True, split=1),
                                             dict(BM=16, BE=32, BK=32, DOT=True, split=4)]),
                           (torch.float32, [dict(BM=4, BE=8, BK=32, DOT=False, split=2),
                                            dict(BM=1, BE=8, BK=128, DOT=False, split=1)])):
        for n in (1, 5, 19):                                  # 19 tokens: two row tiles, a tail
            x = torch.randn(n, d, generator=g).to(dtype)
            w = (torch.randn(e, d, generator=g) / 8).to(dtype)
            w[7] = w[3]                                       # experts 3 and 7 tie: 3 must come first
            bias = torch.randn(e, generator=g) / 4
            bias[30], bias[3], bias[7] = 40.0, 20.0, 20.0    # chosen first, second, third
            want_w, want_ids = reference.moe_gate(x, w, bias, topk, 2.5)
            for cfg in configs:
                got_w, got_ids = moe_gate.moe_gate(x, w, bias, topk, 2.5, config=cfg)
                rel = float(((got_w - want_w).abs() / want_w.abs()).max())
                print(str(dtype), n, cfg["split"], cfg["BM"], bool(torch.equal(got_ids, want_ids)), rel,
                      bool((got_ids[:, :3] == torch.tensor([30, 3, 7])).all()))
"""


def test_moe_gate_kernels_in_triton_interpreter(tmp_path):
    """The MoE gate's two kernels (partial dot products over K slices, then softplus, sqrt,
    top-k and normalization per token) against reference.moe_gate: the same expert ids in the
    same order (tied experts to the lower id, a bias that forces an expert in), weights within
    1e-5; the tensor-core form (bf16) and the FMA form (fp32), one K slice and several, a
    masked expert tile and a token tail."""
    rows = [line.split() for line in run_interpreted(_MOE_GATE_SCRIPT, tmp_path)]
    assert len(rows) == 12, rows
    assert all(r[4] == r[6] == "True" and float(r[5]) < 1e-5 for r in rows), rows


_SWIGLU_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()                              # libdevice exp -> the interpreter's
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import swiglu
    g = torch.Generator().manual_seed(12)
    for dtype in (torch.bfloat16, torch.float32):
        gate, up = (torch.randn(3, 700, generator=g) * 8).to(dtype), (torch.randn(3, 700, generator=g) * 8).to(dtype)
        gate[0, :4], up[0, :4] = torch.tensor([30.0, -30.0, float("nan"), 10.5]), torch.tensor([-30.0, 30.0, 1.0, 12.0])
        for limit in (10.0, 0.0):
            for block in (256, 1024):                         # 2100 elements: a tail either way
                got = swiglu.swiglu(gate, up, limit, block=block)
                want = reference.swiglu_in_dtype(gate, up, limit)
                nan = torch.isnan(want)
                rtol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6   # one bf16 rounding / a few fp32 ulps
                close = torch.allclose(got[~nan].float(), want[~nan].float(), rtol=rtol, atol=0)
                equal = float((got == want)[~nan].float().mean())
                print(str(dtype), limit, block, bool(torch.equal(nan, torch.isnan(got))), close, equal)
"""


def test_swiglu_kernel_in_triton_interpreter(tmp_path):
    """The shared expert's activation kernel against reference.swiglu_in_dtype, with limit 10
    (gate clamped above only, up both sides) and 0 (no clamp), a NaN kept, bf16 and fp32, two
    block sizes with a tail: NaNs in the same places, values within one bf16 rounding (bf16;
    >= 99 % bit-equal) or 1e-6 (fp32): the interpreter's exp stands in for libdevice's and may
    differ from torch's CPU exp in the last bit, which fp32 outputs keep (the CUDA test asks for
    every bit)."""
    rows = [line.split() for line in run_interpreted(_SWIGLU_SCRIPT, tmp_path)]
    assert len(rows) == 8, rows
    assert all(r[3] == r[4] == "True" for r in rows), rows
    assert all(float(r[5]) >= 0.99 for r in rows if r[0] == "torch.bfloat16"), rows


_MHC_PRE_POST_SCRIPT = """
    import torch
    import triton_ptx_doubles
    triton_ptx_doubles.install()                              # libdevice -> the interpreter's
    from v41graph.custom_ops import reference
    from v41graph.custom_ops.triton import mhc
    g = torch.Generator().manual_seed(9)
    d, hc = 128, 4
    for dtype in (torch.bfloat16, torch.float32):
        for n in (1, 5, 20):                                  # 20 tokens: two row blocks, a tail
            streams = torch.randn(n, hc, d, generator=g).to(dtype)
            pre_prev = torch.rand(n, hc, generator=g)
            fn = torch.randn(24, hc * d, generator=g) / 16
            scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
            want = reference.mhc_pre(streams, pre_prev, fn, scale, base, hc, 20, 1e-6, 1e-6)
            for split in (1, 4):
                got = mhc.mhc_pre(streams, pre_prev, fn, scale, base, hc, 20, 1e-6, 1e-6,
                                  config=dict(BM=16, BK=32, split=split))
                coef = max(float((a - b).abs().max()) for a, b in zip(got[1:], want[1:]))
                print("pre", str(dtype), n, split, bool(torch.equal(got[0], want[0])), coef)
                # mhc_pre split in two (the P9 side stream): the same bits as mhc_pre's kernels
                predicted = mhc.mhc_predict(streams, fn, scale, base, hc, 20, 1e-6, 1e-6,
                                            config=dict(BM=16, BK=32, split=split))
                collapsed = mhc.mhc_collapse(streams, pre_prev, block=64)
                same = torch.equal(collapsed, got[0]) and all(torch.equal(a, b) for a, b in zip(predicted, got[1:]))
                print("split", str(dtype), n, split, bool(same), 0.0)
            out = torch.randn(n, d, generator=g).to(dtype)
            post, comb = torch.rand(n, hc, generator=g) * 2, torch.rand(n, hc, hc, generator=g)
            for block in (32, 128):
                got = mhc.mhc_post(out, streams, post, comb, block=block)
                print("post", str(dtype), n, block, bool(torch.equal(got, reference.mhc_post(out, streams, post, comb))), 0.0)
    d = 1280                                                  # 40 steps of 32 columns
    streams = torch.randn(9, hc, d, generator=g).to(torch.bfloat16)   # 40 slices: 3 finish programs
    pre_prev = torch.rand(9, hc, generator=g)
    fn = torch.randn(24, hc * d, generator=g) / 32
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g)
    want = reference.mhc_pre(streams, pre_prev, fn, scale, base, hc, 20, 1e-6, 1e-6)
    for split, ch in ((5, None), (40, None), (40, 32)):      # 40 slices: one chunk of 64, two of 32 (one masked)
        got = mhc.mhc_pre(streams, pre_prev, fn, scale, base, hc, 20, 1e-6, 1e-6,
                          config=dict(BM=16, BK=32, split=split, CH=ch))
        coef = max(float((a - b).abs().max()) for a, b in zip(got[1:], want[1:]))
        print("wide", "torch.bfloat16", 9, split, bool(torch.equal(got[0], want[0])), coef)
"""


def test_mhc_pre_and_post_kernels_in_triton_interpreter(tmp_path):
    """mhc_pre's kernels (the predictor's K-sliced partial sums with the collapse, the finish
    with its tokens' Sinkhorn) and mhc_post's expand against reference.mhc_pre / mhc_post: the collapse
    and the expand bit for bit (the same fp32 products and sums in the same order), pre, post
    and comb within 1e-5 (the dot products sum in another order); bf16 and fp32 streams, one
    slice and four, two row blocks with a tail, column blocks narrower than d; 5 and 40 slices
    of a wider d (the finish's one chunk, masked, and two chunks of 32, the second masked). And
    mhc_pre split in two, mhc_collapse + mhc_predict (passes/mhc_side_stream.py), bit for bit
    against mhc_pre's kernels."""
    rows = [line.split() for line in run_interpreted(_MHC_PRE_POST_SCRIPT, tmp_path)]
    assert len(rows) == 39, rows
    assert sum(r[0] == "split" for r in rows) == 12, rows
    assert all(r[4] == "True" and float(r[5]) < 1e-5 for r in rows), rows


def test_zeroed_workspaces_are_held_per_flow(monkeypatch):
    """common.zeroed_workspace: one buffer per name and flow, reused while large enough (the
    kernels leave it zeroed), a larger one when outgrown with the old one still held (captured
    graphs keep its address); on CUDA every stream but P6's side streams is the main flow (a
    capture's warm-up and capture streams included), each side stream a flow of its own."""
    import torch
    from v41graph.custom_ops.triton import common
    monkeypatch.setattr(common, "_ZEROED", {})
    a = common.zeroed_workspace("counts", 8, torch.int32, "cpu")
    assert common.zeroed_workspace("counts", 4, torch.int32, "cpu").data_ptr() == a.data_ptr()
    b = common.zeroed_workspace("counts", 16, torch.int32, "cpu")
    assert b.data_ptr() != a.data_ptr() and not b.any()
    assert [t.numel() for t in common._ZEROED[("counts", "cpu", "main")]] == [8, 16]
    side, warm_up, capture = object(), object(), object()
    monkeypatch.setattr(common.STREAMS, "streams", {(0, "indexer"): side})
    for current, flow in ((side, "indexer"), (warm_up, "main"), (capture, "main")):
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device, s=current: s)
        assert common._flow(torch.device("cuda", 0)) == flow
