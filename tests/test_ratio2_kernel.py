"""The ratio-2 compressor kernel (custom_ops/triton/compressor.py `_ratio2_pool_kernel`): pooling,
RMSNorm and the state-ring write in one launch, vs the reference
(reference.ratio2_compressor_update: read the ring, then write it).

The write is where a kernel can go wrong: when a chunk is at least as long as the ring, one of
its tokens overwrites the ring row that the chunk's first token reads (the position before the
chunk). The kernel lets that reader write the row after reading it. Program order on a GPU
does not show the race (readers have lower program ids and usually run first), so the CPU test
runs the kernel in Triton's interpreter in both program orders; reversed, a kernel without the
hand-over gives wrong latents.

Tolerances (METHOD.md's rel = ||out - ref|| / ||ref||): fp32 latent rel < 1e-5 (exp and the
summation order differ from torch's softmax); bf16 rel < 1e-2 (a pooled value on a bf16
rounding boundary may round the other way before the norm); the state ring bit-identical
(the kernel copies the projection rows, which are the reference's own F.linear results).
"""
from __future__ import annotations

import pytest
import torch
from triton_interpreter import run_interpreted

import v41graph.custom_ops  # noqa: F401  (registers the ops)
from v41graph.custom_ops import reference as ref

ops = torch.ops.v41graph


def ratio2_layout(chunks, num_slots: int, ring: int):
    """(member_rows [2N], state_rows [N]) for chunks [(slot, chunk_start, length)] laid out as
    the model lays out a step (MODEL.md: a token at position p pools positions p-1 (0 for p = 0)
    and p; rows of this call follow the ring's num_slots * ring rows; the ring keeps each
    sequence's last `ring` positions)."""
    members, writes, base = [], [], num_slots * ring
    for slot, start, length in chunks:
        end = start + length
        for p in range(start, end):
            for q in (max(p - 1, 0), p):
                members.append(base + q - start if q >= start else slot * ring + q % ring)
            writes.append(slot * ring + p % ring if p >= end - ring else -1)
        base += length
    return torch.tensor(members), torch.tensor(writes)


def ratio2_inputs(chunks, num_slots, ring, d, k, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = sum(c[2] for c in chunks)
    x = torch.randn(n, k, generator=g).to(dtype)
    wkv = torch.randn(d, k, generator=g) / k ** 0.5
    wgate = torch.randn(d, k, generator=g) / k ** 0.5
    state = torch.randn(num_slots, ring, 2 * d, generator=g)
    norm_weight = torch.rand(d, generator=g) + 0.5
    member_rows, state_rows = ratio2_layout(chunks, num_slots, ring)
    return [t.to(device) for t in (x, wkv, wgate, state, member_rows, state_rows, norm_weight)]


def rel_err(out, want) -> float:
    o, w = out.double().cpu(), want.double().cpu()
    assert torch.isfinite(o).all()
    return ((o - w).norm() / w.norm()).item()


# chunk layouts: decode (one token per sequence), a chunk shorter than the ring, chunks as long
# as the ring and longer (the reader/writer hand-over), a sequence starting at position 0
LAYOUTS = {
    "decode": [(0, 5, 1), (1, 6, 1), (3, 0, 1), (2, 9, 1)],
    "short_chunk": [(0, 5, 3), (2, 3, 2)],
    "ring_long": [(1, 7, 8)],
    "long_mixed": [(0, 5, 20), (2, 3, 9), (1, 0, 4)],
    "two_long": [(0, 3, 40), (3, 0, 33)],
}


def test_layout_has_the_collisions_it_claims():
    """The layouts that should exercise the hand-over do: some write targets a ring row the
    same call reads."""
    for name, chunks in LAYOUTS.items():
        members, writes = ratio2_layout(chunks, 4, 8)
        ring_reads = set(members[members < 4 * 8].tolist())
        collides = bool(ring_reads & set(writes[writes >= 0].tolist()))
        assert collides == (name in ("ring_long", "long_mixed", "two_long")), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_op_and_layout_match_the_model(dtype):
    """At every ratio-2 compressor call of a tiny model over a 5-token prefill, chunks of 40 and 33
    tokens (longer than the 32-row ring, starting after position 0: a token of each overwrites
    the ring row its chunk's first token reads) and 3 decode steps: ratio2_layout (this file's reading of MODEL.md) gives the member rows the
    model uses, and fused_ratio2_compressor_update with ratio2_layout's rows, run on a copy of
    the ring, gives the model's latent and leaves the ring as the model's Compressor.forward
    leaves it, bit for bit."""
    import v41graph
    from v41graph.model.attention import COMPRESSOR_RING, Compressor
    from v41graph.model.model import V41Model, init_random_
    from v41graph.runtime.session import Session
    model = init_random_(V41Model(v41graph.V41Config.tiny(torch_dtype=dtype)), seed=3).eval()
    model.requires_grad_(False)
    checked, collisions = [], []

    def pre(mod, args):
        x, ctx, lid = args
        meta, state = ctx.meta, ctx.caches.compressor_state[lid]
        lens = (meta.query_start[1:] - meta.query_start[:-1]).tolist()
        chunks = list(zip(meta.seq_slot.tolist(), meta.chunk_start.tolist(), lens))
        members, writes = ratio2_layout(chunks, state.shape[0], COMPRESSOR_RING)
        member_pos = ctx.positions.unsqueeze(-1) - torch.arange(1, -1, -1)
        assert torch.equal(members, ctx.fresh_or_ring_rows(member_pos.clamp_min(0), COMPRESSOR_RING).flatten())
        ring_reads = set(members[members < state.shape[0] * COMPRESSOR_RING].tolist())
        collisions.append(bool(ring_reads & set(writes[writes >= 0].tolist())))
        mod._copy = state.clone()
        mod._latent = ops.fused_ratio2_compressor_update(x, mod.wkv.weight, mod.wgate.weight, mod._copy,
                                                         members, writes, mod.norm.weight, mod.norm.eps, x.dtype)

    def post(mod, args, out):
        x, ctx, lid = args
        assert torch.equal(mod._latent, out[0])
        assert torch.equal(mod._copy, ctx.caches.compressor_state[lid])
        checked.append(mod)

    mods = [m for m in model.modules() if isinstance(m, Compressor) and m.ratio == 2]
    for m in mods:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    g = torch.Generator().manual_seed(1)
    s = Session(model, 2, 64, block_size=16)
    s.prefill(torch.randint(0, 256, (2, 5), generator=g))
    logits = s.extend([0, 1], [torch.randint(0, 256, (n,), generator=g).tolist() for n in (40, 33)])
    for _ in range(3):
        logits = s.decode(logits.argmax(-1, keepdim=True))
    assert len(mods) == 2 and len(checked) == 2 * 5
    assert collisions == [False] * 2 + [True] * 2 + [False] * 6      # the long chunks only


def test_update_op_rejects_state_rows_of_the_wrong_length():
    x, wkv, wgate, state, members, writes, g = ratio2_inputs(LAYOUTS["decode"], 4, 8, 16, 24, torch.float32, 0)
    with pytest.raises(ValueError, match=r"state_rows must hold one ring row .* expected \(4,\)"):
        ops.fused_ratio2_compressor_update(x, wkv, wgate, state, members, writes[:3], g, 1e-6, torch.float32)


_INTERPRETER_SCRIPT = """
    import sys
    import torch
    import triton.runtime.interpreter as ti
    if sys.argv[1] == "reversed":   # run the programs last to first
        _set = ti.interpreter_builder.set_grid_idx
        ti.interpreter_builder.set_grid_idx = (
            lambda x, y, z: _set(ti.interpreter_builder.grid_dim[0] - 1 - x, y, z))
    from test_ratio2_kernel import LAYOUTS, ratio2_inputs, rel_err
    from v41graph.custom_ops import reference as ref
    from v41graph.custom_ops.triton import compressor as tk
    for name, chunks in LAYOUTS.items():
        for dtype in (torch.float32, torch.bfloat16):
            x, wkv, wgate, state, members, writes, g = ratio2_inputs(chunks, 4, 8, 16, 24, dtype, 0)
            want_state, got_state = state.clone(), state.clone()
            want = ref.ratio2_compressor_update(x, wkv, wgate, want_state, members, writes, g, 1e-6, dtype)
            got = tk.ratio2_compressor(x, wkv, wgate, got_state, members, g, 1e-6, dtype,
                                       state_rows=writes)[0]
            err = rel_err(got, want)
            ok = err < (1e-5 if dtype == torch.float32 else 1e-2) and torch.equal(got_state, want_state)
            print(name, dtype, f"{err:.2e}", torch.equal(got_state, want_state), "OK" if ok else "FAIL")
"""


@pytest.mark.parametrize("order", ["forward", "reversed"])
def test_kernel_in_triton_interpreter_any_program_order(order, tmp_path):
    """CPU: the kernel (Triton's interpreter) matches the reference whichever program runs first."""
    pytest.importorskip("triton")
    lines = run_interpreted(_INTERPRETER_SCRIPT, tmp_path, order)
    assert len(lines) == 2 * len(LAYOUTS), lines
    assert all(line.endswith("OK") for line in lines), lines


# ------------------------------------------------------------------------------------ CUDA
# the model's widths (hidden 5120, head_dim 512, COMPRESSOR_RING 32)
CUDA_LAYOUTS = {
    "decode_b1": [(0, 4095, 1)],
    "decode_b64": [(s, 4000 + 7 * s, 1) for s in range(64)],
    "verify_chunks": [(s, 100 + s, 6) for s in range(8)],
    "prefill_4096": [(0, 0, 4096)],
    "mixed_long": [(0, 17, 300), (1, 0, 64), (2, 5, 31), (3, 9, 32), (4, 2, 33)],
}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", list(CUDA_LAYOUTS))
def test_ratio2_update_kernel_matches_reference(layout, dtype):
    pytest.importorskip("triton")
    from v41graph.custom_ops.triton import compressor as tk
    chunks = CUDA_LAYOUTS[layout]
    slots = max(c[0] for c in chunks) + 2
    cpu = ratio2_inputs(chunks, slots, 32, 512, 5120, dtype, seed=len(layout))
    x, wkv, wgate, state, members, writes, g = [t.cuda() for t in cpu]
    want_state = state.clone()
    want = ref.ratio2_compressor_update(x, wkv, wgate, want_state, members, writes, g, 1e-6, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for rep in range(5):        # races, if any, do not show every time
        got_state = state.clone()
        got = ops.fused_ratio2_compressor_update(x, wkv, wgate, got_state, members, writes, g, 1e-6, dtype)
        assert rel_err(got, want) < tol, (rep, rel_err(got, want))
        assert torch.equal(got_state, want_state), rep
    # the kernel path ran, not the reference fallback
    from v41graph.custom_ops.cuda_impls import triton_module
    assert triton_module("compressor") is tk and tk.ratio2_supported(x, wkv, wgate, state, members, g, dtype)
    # the read-only op (the same kernel without the write) against the reference's read
    lat, rows = ops.fused_ratio2_compressor(x, wkv, wgate, state, members, g, 1e-6, dtype)
    want_lat, want_rows = ref.ratio2_compressor(x, wkv, wgate, state, members, g, 1e-6, dtype)
    assert rel_err(lat, want_lat) < tol and torch.equal(rows, want_rows)
