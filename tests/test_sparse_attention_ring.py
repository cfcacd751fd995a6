"""`sparse_attention` reads the FP8 window ring in place (no dequantized pool).

The op's window rows index (every slot's FP8 E4M3 + UE8M0 ring ++ this call's fresh rows); the
reference must give bit-for-bit what the former formulation gave: dequantize every ring into a
float pool, append the fresh rows, gather the pool rows.
"""
from __future__ import annotations

import pytest
import torch

import v41graph.custom_ops  # noqa: F401  (registers the ops)
from v41graph.custom_ops import codecs, reference as ref

ops = torch.ops.v41graph


def _pool_formulation(q, ring, ring_scale, fresh, rows, gc, gs, grows, sink, scale):
    """The former op: the whole ring dequantized into a pool, then the pool rows gathered."""
    d = fresh.shape[-1]
    n_ring = ring.numel() // d
    pool = torch.cat([ref.gather_window_kv(ring, ring_scale, torch.arange(n_ring), fresh.dtype), fresh])
    win = pool.index_select(0, rows.clamp_min(0).flatten()).view(*rows.shape, d)
    parts, valid = [win.to(q.dtype)], [rows >= 0]
    if grows.shape[-1] > 0:
        parts.append(ref.gather_global_kv(gc, gs, grows, q.dtype))
        valid.append(grows >= 0)
    return ref.sparse_attention(q, torch.cat(parts, 1), torch.cat(valid, 1), sink, scale)


def _inputs(slots, w, n, h, d, wl, kg, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ring = torch.zeros(slots, w, d, dtype=torch.uint8)
    ring_scale = torch.zeros(slots, w, d // 32, dtype=torch.uint8)
    if slots:
        vals = torch.randn(slots * w, d, generator=g) * torch.logspace(-3, 2, slots * w).unsqueeze(-1)
        written = torch.randperm(slots * w, generator=g)[: slots * w * 3 // 4]   # some rows never written
        ref.window_kv_write(ring, ring_scale, vals[written].to(dtype), written)
    fresh = codecs.qdq_fp8_ue8m0(torch.randn(n, d, generator=g) * 3, 32).to(dtype)
    rows = torch.randint(0, slots * w + n, (n, wl), generator=g)
    rows = torch.where(torch.rand(n, wl, generator=g) < 0.25, -1, rows)
    if n > 1:
        rows[1] = -1                                     # a token with nothing to attend to
    cache_rows = 50
    gc = torch.zeros(cache_rows, d // 2, dtype=torch.uint8)
    gs = torch.zeros(cache_rows, d // 16, dtype=torch.uint8)
    ref.global_kv_write(gc, gs, torch.randn(cache_rows, d, generator=g), torch.arange(cache_rows))
    grows = torch.randint(0, cache_rows, (n, kg), generator=g)
    grows = torch.where(torch.rand(n, kg, generator=g) < 0.2, -1, grows)
    if n > 1:
        grows[1] = -1
    q = torch.randn(n, h, d, generator=g).to(dtype)
    sink = torch.randn(h, generator=g)
    return q, ring, ring_scale, fresh, rows, gc, gs, grows, sink


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots,w,n,wl,kg", [(3, 8, 5, 8, 6), (2, 16, 4, 100, 0), (0, 8, 3, 6, 4),
                                             (4, 8, 1, 8, 0)])
def test_ring_in_place_is_bit_identical_to_pool(slots, w, n, wl, kg, dtype):
    h, d = 4, 64
    args = _inputs(slots, w, n, h, d, wl, kg, dtype, seed=slots * 100 + wl + kg)
    scale = d ** -0.5
    want = _pool_formulation(*args, scale)
    got = ops.sparse_attention(*args[:4], args[4], *args[5:], scale)
    assert got.dtype == dtype and torch.equal(got, want)
    if n > 1:
        assert torch.equal(got[1], torch.zeros_like(got[1]))      # nothing visible: exactly 0


def test_only_listed_ring_rows_are_read():
    """Ring rows outside the list may hold anything (NaN codes included): never dequantized."""
    h, d, slots, w, n = 2, 32, 2, 4, 3
    q, ring, ring_scale, fresh, rows, gc, gs, grows, sink = _inputs(slots, w, n, h, d, 4, 0,
                                                                    torch.float32, seed=7)
    rows = torch.tensor([[0, 1, 8, -1], [-1, -1, -1, -1], [1, 9, 10, -1]])
    want = ops.sparse_attention(q, ring, ring_scale, fresh, rows, gc, gs, grows, sink, 0.3)
    poisoned = ring.clone()
    poisoned.view(-1, d)[2:] = 0x7F                                # E4M3 NaN in unlisted rows
    got = ops.sparse_attention(q, poisoned, ring_scale, fresh, rows, gc, gs, grows, sink, 0.3)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_gather_window_or_fresh_values():
    d, slots, w = 32, 2, 4
    ring = torch.zeros(slots, w, d, dtype=torch.uint8)
    ring_scale = torch.zeros(slots, w, d // 32, dtype=torch.uint8)
    vals = torch.randn(slots * w, d)
    ref.window_kv_write(ring, ring_scale, vals, torch.arange(slots * w))
    fresh = torch.randn(3, d)
    rows = torch.tensor([[5, 8, -1, 10, 0]])
    got = ref.gather_window_or_fresh(ring, ring_scale, fresh, rows)
    assert torch.equal(got[0, 0], codecs.qdq_fp8_ue8m0(vals[5:6], 32)[0])
    assert torch.equal(got[0, 1], fresh[0]) and torch.equal(got[0, 3], fresh[2])
    assert torch.equal(got[0, 4], codecs.qdq_fp8_ue8m0(vals[0:1], 32)[0])
    assert torch.isfinite(got[0, 2]).all()                         # -1: a finite filler
