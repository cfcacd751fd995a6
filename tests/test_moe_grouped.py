"""MoE routed experts as grouped GEMMs over stacked weights (v41graph/moe.py) vs the loop over
all experts, which stays the specification.

CPU (fp32, tiny config): the grouped path through `grouped_mm_emulated` (pure torch, static
shapes) and through torch's own CPU `torch._grouped_mm` (per-group fallback) against the loop.
Tolerance ATOL = 1e-5 on MoE outputs of magnitude ~1-5: both paths add the same per-expert
contributions in the same (ascending expert id) fp32 order; only the GEMM shapes differ (the
loop multiplies all N tokens by each expert, the grouped path the T = N*topk sorted rows), so
MKL's blocking can change the last bits (measured: 0 to 7e-7, most cases bit-identical). A
routing or scatter bug (wrong row, wrong weight, wrong expert, lost pair) moves outputs by 1e-2
or more.

CUDA (`-m cuda`, skipped without a GPU): the real `torch._grouped_mm` kernel (sm90+, bf16)
against the loop, inside a CUDA graph replayed with new inputs, and whole-model greedy tokens.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import v41graph
from compile_harness import PassHarness
from cuda_graphs import capture
from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model, init_random_, init_random_weights_
from v41graph.model.moe import MoE, grouped_mm_emulated, pack_moe_experts_, set_moe_impl
from v41graph.runtime.session import Session

ATOL = 1e-5


def _cpu_grouped_mm_available() -> bool:
    try:
        a, b = torch.randn(4, 8), torch.randn(2, 8, 8)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


CPU_IMPLS = ["emulate"] + (["torch"] if _cpu_grouped_mm_available() else [])


def _moe(seed: int = 0, config=None, **kw) -> MoE:
    config = config or v41graph.V41Config.tiny()
    m = MoE(config, **kw)
    init_random_weights_(m, torch.Generator().manual_seed(seed))
    return m.eval().requires_grad_(False)


def _x(n: int, seed: int, d: int = 64, device="cpu", dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _run(m: MoE, x: torch.Tensor, impl: str):
    saved = m.grouped_impl
    m.grouped_impl = impl
    try:
        with torch.no_grad():
            return m(x)
    finally:
        m.grouped_impl = saved


def _counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    return torch.bincount(chosen.flatten(), minlength=n_experts)


# =============================================================================== grouped_mm itself
def test_emulation_matches_torch_grouped_mm_contract():
    """grouped_mm_emulated(a, b, offs) == per-group a[rows] @ b[e], empty groups and a tail of
    rows past offs[-1] included (those come out 0)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(11, 16, generator=g), torch.randn(5, 16, 8, generator=g)
    offs = torch.tensor([0, 4, 4, 9, 10], dtype=torch.int32)      # groups 0 and 2 empty, row 10 past the end
    out = grouped_mm_emulated(a, b.transpose(1, 2).contiguous().transpose(1, 2), offs)
    start = 0
    for e, end in enumerate(offs.tolist()):
        torch.testing.assert_close(out[start:end], a[start:end] @ b[e], atol=1e-5, rtol=0)
        start = end
    assert torch.equal(out[10:], torch.zeros(1, 8))
    if "torch" in CPU_IMPLS:
        want = torch._grouped_mm(a, b, offs=offs)
        torch.testing.assert_close(out[:10], want[:10], atol=1e-5, rtol=0)


# =============================================================================== grouped vs loop
CASES = {
    "n1": dict(n=1),
    "n9": dict(n=9),
    "n64": dict(n=64),
    "skewed": dict(n=24, bias={0: 50.0, 3: 50.0}),   # every token picks experts 0 and 3: 1, 2 get none
    "one_expert_idle": dict(n=5, bias={2: -50.0}),   # expert 2 never chosen
}


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_matches_loop(impl, case):
    spec = CASES[case]
    m = _moe(seed=1)
    with torch.no_grad():
        for e, v in spec.get("bias", {}).items():
            m.gate.bias[e] = v
    x = _x(spec["n"], seed=2)
    want, chosen = _run(m, x, "loop")
    got, chosen2 = _run(m, x, impl)
    assert torch.equal(chosen, chosen2)
    counts = _counts(chosen, m.n_experts)
    if case == "skewed":
        assert counts.tolist() == [spec["n"], 0, 0, spec["n"]]
    if case == "one_expert_idle":
        assert counts[2] == 0 and counts.sum() == spec["n"] * 2
    assert m.is_packed()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert want.abs().max() > 0.5                       # the comparison is not between zeros


@pytest.mark.parametrize("impl", CPU_IMPLS)
def test_grouped_matches_loop_dspark_shape(impl):
    """The DSpark head's MoE (its own expert count / top-k) and a larger top-k than experts/2."""
    m = _moe(seed=3, n_experts=6, topk=4)
    x = _x(13, seed=4)
    (want, c1), (got, c2) = _run(m, x, "loop"), _run(m, x, impl)
    assert torch.equal(c1, c2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_auto_on_cpu_is_the_loop_and_does_not_pack():
    m = _moe()
    assert m.grouped_impl == "auto" and not m.wants_grouped()
    with torch.no_grad():
        m(_x(3, seed=0))
    assert not m.is_packed() and m._w13 is None
    assert pack_moe_experts_(m) == 0


def test_quantized_formats_keep_the_loop():
    """MXFP4 experts stack (for the mxfp4_moe op of numerics="released"), but the dense grouped
    impls refuse them and "auto" keeps the loop in the other numerics."""
    m = MoE(v41graph.V41Config.tiny(weight_format="checkpoint"))
    assert m.can_pack() and not m.wants_grouped()
    m.grouped_impl = "emulate"
    assert not m.wants_grouped()
    with pytest.raises(ValueError, match="dense expert weights"):
        m(torch.zeros(2, 64))


def test_bad_impl_name():
    m = _moe()
    m.grouped_impl = "fast"
    with pytest.raises(ValueError, match="grouped_impl"):
        m(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="grouped_impl"):
        set_moe_impl(m, "fast")


def test_autograd_takes_the_loop():
    """Grouped GEMMs read the stacks (plain tensors): with grad enabled on trainable experts the
    forward takes the loop so gradients reach the expert parameters."""
    m = _moe().requires_grad_(True)
    m.grouped_impl = "emulate"
    m.pack_experts_()
    y, _ = m(_x(4, seed=1))
    y.sum().backward()
    assert m.experts[0].w1.weight.grad is not None


# =============================================================================== packing
def test_packing_keeps_state_dict_and_shares_storage():
    m = _moe(seed=5)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m.pack_experts_()
    after = m.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert after[k].shape == v.shape and after[k].dtype == v.dtype and torch.equal(after[k], v), k
    # every expert weight is a view of the stacks (no second copy)
    i = m.inter
    for e, ex in enumerate(m.experts):
        for w, stack, want in ((ex.w1.weight, m._w13, m._w13[e, :i]), (ex.w3.weight, m._w13, m._w13[e, i:]),
                               (ex.w2.weight, m._w2, m._w2[e])):
            assert w.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
            assert w.data_ptr() == want.data_ptr() and torch.equal(w, want)
            assert isinstance(w, torch.nn.Parameter)
    assert m._w13.shape == (m.n_experts, 2 * i, 64) and m._w2.shape == (m.n_experts, 64, i)
    assert m.is_packed()


def test_load_state_dict_after_packing_updates_stacks():
    m, donor = _moe(seed=6), _moe(seed=7)
    m.pack_experts_()
    w13, w2 = m._w13, m._w2
    m.load_state_dict(donor.state_dict())
    assert m._w13 is w13 and m._w2 is w2 and m.is_packed()       # loaded in place, into the stacks
    i = m.inter
    for e in range(m.n_experts):
        assert torch.equal(m._w13[e, :i], donor.experts[e].w1.weight)
        assert torch.equal(m._w13[e, i:], donor.experts[e].w3.weight)
        assert torch.equal(m._w2[e], donor.experts[e].w2.weight)
    x = _x(6, seed=8)
    torch.testing.assert_close(_run(m, x, "emulate")[0], _run(donor, x, "loop")[0], atol=ATOL, rtol=0)


def test_replaced_parameters_are_repacked_eagerly():
    """The loader's place_model swaps Parameter objects: the stacks go stale, the next eager
    grouped forward notices and packs again."""
    m = _moe(seed=9)
    m.grouped_impl = "emulate"
    m.pack_experts_()
    old = m._w13
    with torch.no_grad():
        new = m.experts[1].w3.weight.detach().clone() * 2
    m.experts[1].w3.weight = torch.nn.Parameter(new, requires_grad=False)
    assert not m.is_packed()
    x = _x(7, seed=10)
    got = _run(m, x, "emulate")[0]
    assert m.is_packed() and m._w13 is not old
    assert torch.equal(m._w13[1, m.inter:], new)
    torch.testing.assert_close(got, _run(m, x, "loop")[0], atol=ATOL, rtol=0)


def test_dtype_conversion_repacks():
    m = _moe(seed=11)
    m.pack_experts_()
    m.double()
    assert m._w13.dtype == torch.float64 and m.is_packed()
    x = _x(5, seed=12, dtype=torch.float64)
    torch.testing.assert_close(_run(m, x, "emulate")[0], _run(m, x, "loop")[0], atol=1e-12, rtol=0)


def test_deepcopy_repacks_on_first_grouped_forward():
    """Parameter.__deepcopy__ clones each parameter on its own, so a copy's stacks are stale;
    its first eager grouped forward packs it again, the original is untouched."""
    m = _moe(seed=13)
    m.grouped_impl = "emulate"
    m.pack_experts_()
    c = copy.deepcopy(m)
    assert not c.is_packed()
    x = _x(4, seed=14)
    torch.testing.assert_close(_run(c, x, "emulate")[0], _run(m, x, "loop")[0], atol=ATOL, rtol=0)
    assert c.is_packed() and m.is_packed() and c._w13.data_ptr() != m._w13.data_ptr()


# =============================================================================== traced / compiled
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_grouped_matches_eager_loop(dtype):
    """The grouped path traces through Dynamo + AOT autograd (our backend, fullgraph, static
    shapes) and the compiled graph gives the loop's numbers for new inputs and other routings.
    fp32 through the emulation; bf16 through torch._grouped_mm (its meta function is
    bf16-only) where the CPU op exists."""
    impl = "emulate" if dtype == torch.float32 else "torch"
    if impl not in CPU_IMPLS:
        pytest.skip("no CPU torch._grouped_mm in this torch")
    m = _moe(seed=14).to(dtype)
    m.grouped_impl = impl
    assert pack_moe_experts_(m) == 1
    f = PassHarness().compile(m, dynamic=False)
    atol = ATOL if dtype == torch.float32 else 3e-2
    for seed in range(3):
        x = _x(9, seed=20 + seed, dtype=dtype)
        with torch.no_grad():
            got, c1 = f(x)
        want, c2 = _run(m, x, "loop")
        assert torch.equal(c1, c2)
        torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    with torch.no_grad():                                    # skew the routing: experts 1, 2 idle
        m.gate.bias.copy_(torch.tensor([50.0, -50.0, -50.0, 50.0]))
        x = _x(9, seed=30, dtype=dtype)
        got, c1 = f(x)
    want, _ = _run(m, x, "loop")
    assert _counts(c1, 4).tolist() == [9, 0, 0, 9]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


def test_compiled_grouped_dynamic_token_count():
    """Prefill compiles with dynamic=None: after the first recompile the token count is symbolic;
    the grouped path (emulated, fp32) traces with a symbolic T = N * topk too."""
    m = _moe(seed=15)
    m.grouped_impl = "emulate"
    m.pack_experts_()
    f = PassHarness().compile(m, dynamic=None)
    for n in (9, 13, 20, 3):
        x = _x(n, seed=50 + n)
        with torch.no_grad():
            got, c1 = f(x)
        want, c2 = _run(m, x, "loop")
        assert torch.equal(c1, c2)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_model_with_grouped_moe_matches_loop():
    """Whole tiny model (fp32): prefill + a few decode steps, every MoE through the emulated
    grouped path vs the loop. Logits atol 1e-4 (as in test_model_consistency: last-bit GEMM
    differences passed through 10 layers)."""
    torch.manual_seed(0)
    model = init_random_(V41Model(v41graph.V41Config.tiny()), seed=3).eval().requires_grad_(False)
    prompt = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(4))
    runs = {}
    for impl in ("loop", "emulate"):
        set_moe_impl(model, impl)
        s = Session(model, 2, 64, block_size=16)
        with torch.no_grad():
            out = [s.prefill(prompt)]
            for _ in range(4):
                out.append(s.decode(out[-1].argmax(-1, keepdim=True)))
        runs[impl] = out
    assert all(m.is_packed() for m in model.modules() if isinstance(m, MoE))
    for step, (a, b) in enumerate(zip(runs["loop"], runs["emulate"])):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=lambda s, step=step: f"step {step}: {s}")


# =============================================================================== CUDA
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


# bf16: both paths round gate/up and the w2 output to bf16 after fp32 accumulation, in different
# kernels (cuBLAS vs CUTLASS grouped: different K split), so a product can land one bf16 ulp
# apart and that propagates through SwiGLU and w2; outputs are ~1-5 (one bf16 ulp there is
# 2^-7 to 2^-5 = 8e-3 to 3e-2), so the bound is a few ulps of the largest outputs, while a wrong
# row/expert/weight moves outputs by O(1). (Measured on an H200, torch 2.11: 0, i.e. bit-identical
# at the tiny widths, every case below; up to 1.6e-2 at the bench config's widths.)
BF16_ATOL = 2e-2


def _cuda_moe(seed: int) -> MoE:
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        m = MoE(v41graph.V41Config.tiny(torch_dtype="bfloat16"))
    init_random_weights_(m, torch.Generator(device="cuda").manual_seed(seed))
    return m.eval().requires_grad_(False)


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA GPU of sm90 or newer")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_grouped_mm_matches_loop(case):
    spec = CASES[case]
    m = _cuda_moe(seed=1)
    with torch.no_grad():
        for e, v in spec.get("bias", {}).items():
            m.gate.bias[e] = v
    assert m.wants_grouped() and m.grouped_impl == "auto"
    x = _x(spec["n"], seed=2, device="cuda", dtype=torch.bfloat16)
    want, c1 = _run(m, x, "loop")
    got, c2 = _run(m, x, "auto")                    # auto -> torch._grouped_mm on sm90+ bf16
    assert m.is_packed() and m._native
    assert torch.equal(c1, c2)
    torch.testing.assert_close(got.float(), want.float(), atol=BF16_ATOL, rtol=0)
    emu, _ = _run(m, x, "emulate")
    torch.testing.assert_close(got.float(), emu.float(), atol=BF16_ATOL, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA GPU of sm90 or newer")
def test_cuda_graph_capture_and_replay():
    """Capture one MoE forward on the grouped path; replay with new inputs and a new routing
    (experts left idle) and compare each replay with the eager loop."""
    m = _cuda_moe(seed=3)
    m.pack_experts_()
    n = 8
    x = torch.zeros(n, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        graph, (out, chosen) = capture(lambda: m(x), warmups=2)
    for seed, bias in ((40, None), (41, None), (42, [50.0, -50.0, -50.0, 50.0])):
        if bias is not None:
            with torch.no_grad():
                m.gate.bias.copy_(torch.tensor(bias, device="cuda"))
        x.copy_(_x(n, seed=seed, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        want, c = _run(m, x.clone(), "loop")
        assert torch.equal(chosen, c)
        torch.testing.assert_close(out.float(), want.float(), atol=BF16_ATOL, rtol=0)
    assert _counts(chosen, 4).tolist() == [n, 0, 0, n]


def _bf16_model(seed: int) -> V41Model:
    cfg = v41graph.V41Config.tiny(torch_dtype="bfloat16")
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = V41Model(cfg)
    init_random_weights_(model, torch.Generator(device="cuda").manual_seed(seed))
    with torch.no_grad():
        for e in model.engram:
            e.embed_weight.copy_(torch.randint(0, 256, e.embed_weight.shape, device="cuda", dtype=torch.uint8,
                                               generator=torch.Generator(device="cuda").manual_seed(seed)) & 0xB7)
            e.embed_scale.fill_(127)
    return model.eval().requires_grad_(False)


def _greedy_tokens(model_or_compiled, prompt, steps):
    s = Session(model_or_compiled, prompt.shape[0], 128, block_size=16)
    with torch.no_grad():
        logits = s.prefill(prompt)
        toks = [logits.argmax(-1)]
        for _ in range(steps):
            logits = s.decode(toks[-1].unsqueeze(-1))
            toks.append(logits.argmax(-1))
    return torch.stack(toks, 1).cpu()


@pytest.mark.cuda
@pytest.mark.skipif(not _sm90(), reason="needs an NVIDIA GPU of sm90 or newer")
def test_cuda_tiny_model_bf16_same_greedy_tokens(monkeypatch):
    """Whole tiny model in bf16: the same greedy tokens with the grouped MoE (eager, and
    compiled + captured decode) as with the loop (eager). The attention custom ops run their
    pure-torch references on the GPU (V41GRAPH_DISABLE_TRITON=1): this test is about the MoE,
    and the Triton kernels have their own tests (test_kernels_cuda.py)."""
    monkeypatch.setenv("V41GRAPH_DISABLE_TRITON", "1")
    model = _bf16_model(seed=5)
    prompt = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(6)).cuda()
    set_moe_impl(model, "loop")
    loop = _greedy_tokens(model, prompt, 24)
    set_moe_impl(model, "auto")
    grouped = _greedy_tokens(model, prompt, 24)
    assert all(m.is_packed() and m._native for m in model.modules() if isinstance(m, MoE))
    assert torch.equal(grouped, loop), f"first difference at step {(grouped != loop).any(0).nonzero()[0].item()}"
    compiled = v41graph.compile(model, backend="cuda", batch_sizes=(4,))
    captured = _greedy_tokens(compiled, prompt, 24)
    assert compiled._decode and all(g.cuda_graph is not None for g in compiled._decode.values())
    assert torch.equal(captured, loop), f"first difference at step {(captured != loop).any(0).nonzero()[0].item()}"
    # a second prompt length: the prefill graph recompiles with a symbolic token count
    short = prompt[:, :7]
    set_moe_impl(model, "loop")
    loop2 = _greedy_tokens(model, short, 6)
    set_moe_impl(model, "auto")
    assert torch.equal(_greedy_tokens(compiled, short, 6), loop2)


# ----------------------------------------------------------------------------- the gate op
def test_moe_gate_op_matches_naive_float64():
    """torch.ops.v41graph.moe_gate (the router the model calls) against a float64 reading of
    MODEL.md §6: the same expert ids in the same order (a tie to the lower id; a bias that
    selects an expert whose score is low, while the weight stays its score), weights within
    1e-6 and summing to route_scale."""
    g = torch.Generator().manual_seed(4)
    n, e, d, topk, scale = 9, 24, 64, 4, 2.5
    x, w, bias = torch.randn(n, d, generator=g), torch.randn(e, d, generator=g) / 8, torch.randn(e, generator=g) / 8
    w[11] = w[5]
    bias[5] = bias[11] = 10.0                                # 5 before 11, both chosen first
    w[17], bias[17] = 0.0, 20.0                              # score sqrt(softplus(0)) = sqrt(ln 2)
    weights, chosen = torch.ops.v41graph.moe_gate(x, w, bias, topk, scale)
    scores = torch.nn.functional.softplus(x.double() @ w.double().T).sqrt()
    want = torch.sort(scores + bias.double(), dim=-1, descending=True, stable=True).indices[:, :topk]
    assert torch.equal(chosen, want)
    assert torch.equal(chosen[:, :3], torch.tensor([[17, 5, 11]]).expand(n, 3))
    picked = scores.gather(1, want)
    assert torch.allclose(weights.double(), picked / picked.sum(-1, keepdim=True) * scale, rtol=1e-6, atol=0)
    assert torch.allclose(picked[:, 0], torch.full((n,), 2.0, dtype=torch.float64).log().sqrt(), rtol=1e-12)


@pytest.mark.parametrize("x, w, bias, topk, what", [
    (torch.zeros(2, 8), torch.zeros(4, 6), torch.zeros(4), 2, "must agree on d"),
    (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(5), 2, r"bias shape \(5,\) != \(4,\)"),
    (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4), 5, "topk 5 must be in 1..4"),
    (torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(4), 0, "topk 0 must be in 1..4"),
])
def test_moe_gate_op_refuses_bad_shapes(x, w, bias, topk, what):
    with pytest.raises(ValueError, match=what):
        torch.ops.v41graph.moe_gate(x, w, bias, topk, 1.0)


# ----------------------------------------------------------------------------- the swiglu op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_op_matches_naive_float64(dtype):
    """torch.ops.v41graph.swiglu (the shared expert's activation) against float64 arithmetic
    of MODEL.md's clamped SwiGLU: gate clamped above at the limit only, up on both sides, a NaN
    kept; within fp32 rounding, then the dtype's own rounding; limit 0 clamps nothing."""
    g = torch.Generator().manual_seed(6)
    gate, up = (torch.randn(5, 96, generator=g) * 8).to(dtype), (torch.randn(5, 96, generator=g) * 8).to(dtype)
    gate[0, :3], up[0, :3] = torch.tensor([30.0, -30.0, float("nan")]), torch.tensor([-30.0, 30.0, 1.0])
    for limit in (10.0, 0.0):
        got = torch.ops.v41graph.swiglu(gate, up, limit)
        gd, ud = gate.double(), up.double()
        if limit:
            gd, ud = torch.where(gd > limit, limit, gd), torch.where(ud > limit, limit, torch.where(ud < -limit, -limit, ud))
        want = gd * torch.sigmoid(gd) * ud
        assert got.dtype == dtype and got.shape == gate.shape
        assert torch.isnan(got[0, 2]) and torch.isnan(want[0, 2])
        rel = 2 ** -8 if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(got.double(), want, rtol=rel, atol=1e-30, equal_nan=True), limit
    # gate 30 -> 10, up -30 -> -10: silu(10) * -10; gate -30 is not clamped: silu(-30) * 10
    h = torch.ops.v41graph.swiglu(gate, up, 10.0)[0, :2].double()
    assert h.tolist() == pytest.approx([-100 / (1 + math.exp(-10)), -300 / (1 + math.exp(30))], rel=1e-2)


@pytest.mark.parametrize("gate, up, limit, what", [
    (torch.zeros(2, 8), torch.zeros(2, 6), 1.0, "one shape and dtype"),
    (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.bfloat16), 1.0, "one shape and dtype"),
    (torch.zeros(2, 8, dtype=torch.int32), torch.zeros(2, 8, dtype=torch.int32), 1.0, "floating"),
    (torch.zeros(2, 8), torch.zeros(2, 8), -1.0, "limit -1.0 must be finite and >= 0"),
    (torch.zeros(2, 8), torch.zeros(2, 8), float("inf"), "limit inf must be finite"),
])
def test_swiglu_op_refuses_bad_inputs(gate, up, limit, what):
    with pytest.raises(ValueError, match=what):
        torch.ops.v41graph.swiglu(gate, up, limit)
