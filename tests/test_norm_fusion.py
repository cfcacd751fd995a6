"""The RMSNorm fusions (P1's fuse_wkv_rmsnorm and fuse_rmsnorm) on norms that are not V4.1's:
every spelling whose value the fused op reproduces exactly is fused, bit for bit; every near miss
is left alone. Each case is its own small module compiled through our backend, compared with
eager by torch.equal, with the fused ops counted. Last, tiny random Llama and DeepseekV3 models
from `transformers` (built from config objects, nothing downloaded) through backend="v41graph".
"""
from __future__ import annotations

import pytest
import torch

from compile_harness import PassHarness, count_ops

ops = torch.ops.v41graph
aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32


# ---------------------------------------------------------------------------- norm spellings
def ours(x, w, eps=1e-6, dim=-1):
    """V4.1's spelling (layers.RMSNorm): fp32 math, weight multiply in fp32, cast back."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.square().mean(dim, keepdim=True) + eps))).to(x.dtype)


def llama(x, w, eps=1e-6):
    """transformers' LlamaRMSNorm: fp32 math, cast back, then the weight multiply."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def no_upcast(x, w, eps=1e-6):
    """Near miss: the math in x's dtype (bf16): the fp32 op would change values."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def half_weight(x, w, eps=1e-6):
    """Near miss: the weight rounded to fp16 before it multiplies fp32 activations."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.half()


def shared_normed(x, w, eps=1e-6):
    """Near miss: the normalised value has a second user."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w * n).to(x.dtype) + n.sum(-1, keepdim=True).to(x.dtype)


def no_cast_back(x, w, eps=1e-6):
    """Near miss: fp32 out of a bf16 input (the op returns x's dtype)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps))


def no_weight(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class Norm(torch.nn.Module):
    """One norm of a given spelling, its output plus 1 (so the graph's output is no norm node)."""

    def __init__(self, spelling, d, dtype, **kw):
        super().__init__()
        self.spelling, self.kw = spelling, kw
        self.w = torch.nn.Parameter((torch.rand(d) + 0.5).to(dtype))

    def forward(self, x):
        return self.spelling(x, self.w, **self.kw) + 1


class TorchNorm(torch.nn.Module):
    def __init__(self, d, dtype, eps=1e-3):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d, eps=eps, dtype=dtype)
        with torch.no_grad():
            self.norm.weight.copy_(torch.rand(d) + 0.5)

    def forward(self, x):
        return self.norm(x) + 1


class PreNormBlock(torch.nn.Module):
    """x + W norm(x): the norm's input (the residual stream) has another user."""

    def __init__(self, d, dtype, spelling=llama):
        super().__init__()
        self.norm = Norm(spelling, d, dtype)
        self.lin = torch.nn.Linear(d, d, bias=False, dtype=dtype)

    def forward(self, x):
        return x + self.lin(self.norm.spelling(x, self.norm.w))


class BiasAfter(torch.nn.Module):
    """w * n + b: the bias add stays after the fused norm (exact)."""

    def __init__(self, d, dtype):
        super().__init__()
        self.norm = Norm(ours, d, dtype)
        self.b = torch.nn.Parameter(torch.randn(d, dtype=dtype))

    def forward(self, x):
        return self.norm.spelling(x, self.norm.w) + self.b


class LayerNorm(torch.nn.Module):
    def __init__(self, d, dtype):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d, dtype=dtype)

    def forward(self, x):
        return self.norm(x) + 1


D = 24
CAST_FIRST = "cast first"      # fused as rms_norm(..., cast_before_weight=True)
# (case id, module factory, input shape, dtype, what fuses: 1, CAST_FIRST or 0)
RMSNORM_CASES = [
    ("torch-f32-2d", lambda dt: TorchNorm(D, dt), (6, D), F32, 1),
    ("torch-f32-3d", lambda dt: TorchNorm(D, dt), (2, 3, D), F32, 1),
    ("torch-bf16-3d", lambda dt: TorchNorm(D, dt), (2, 3, D), BF16, 1),      # type_as: _to_copy(layout=, device=)
    ("llama-f32-3d", lambda dt: Norm(llama, D, dt), (2, 3, D), F32, 1),      # the cast back is a no-op
    ("llama-bf16-2d", lambda dt: Norm(llama, D, dt), (6, D), BF16, CAST_FIRST),
    ("llama-bf16-3d", lambda dt: Norm(llama, D, dt), (2, 3, D), BF16, CAST_FIRST),
    ("ours-f32-2d", lambda dt: Norm(ours, D, dt), (6, D), F32, 1),
    ("ours-bf16-3d", lambda dt: Norm(ours, D, dt, eps=1e-2), (2, 3, D), BF16, 1),
    ("prenorm-llama-bf16", lambda dt: PreNormBlock(D, dt), (2, 3, D), BF16, CAST_FIRST),   # residual has another user
    ("prenorm-ours-f32", lambda dt: PreNormBlock(D, dt, ours), (2, 3, D), F32, 1),
    ("bias-after", lambda dt: BiasAfter(D, dt), (2, 3, D), BF16, 1),
    # near misses
    ("no-upcast-bf16", lambda dt: Norm(no_upcast, D, dt), (2, 3, D), BF16, 0),
    ("half-weight-f32", lambda dt: Norm(half_weight, D, dt), (2, 3, D), F32, 0),
    ("other-dim", lambda dt: Norm(ours, (3, 1), dt, dim=-2), (2, 3, D), F32, 0),
    ("shared-normed", lambda dt: Norm(shared_normed, D, dt), (2, 3, D), BF16, 0),
    ("no-cast-back", lambda dt: Norm(no_cast_back, D, F32), (2, 3, D), BF16, 0),
    ("no-weight", lambda dt: Norm(no_weight, D, dt), (2, 3, D), F32, 0),
    ("layernorm", lambda dt: LayerNorm(D, dt), (2, 3, D), F32, 0),
]


def _compiled_exactly(make, shape, dtype, passes) -> PassHarness:
    """The case's module (made by `make(dtype)`) on a random input of `shape` compiled through our
    backend with `passes` (Dynamo's caches reset first: every case compiles the same forward code
    objects anew); its output equals eager bit for bit. Returns the harness holding the graph."""
    torch.manual_seed(0)
    module = make(dtype).eval().requires_grad_(False)
    x = torch.randn(shape).to(dtype)
    torch._dynamo.reset()
    h = PassHarness(passes)
    out = h.compile(module)(x)
    assert len(h.traced) == 1
    want = module(x)
    assert torch.equal(out, want), (out.float() - want.float()).abs().max()
    return h


@pytest.mark.parametrize("make, shape, dtype, fused", [c[1:] for c in RMSNORM_CASES],
                         ids=[c[0] for c in RMSNORM_CASES])
def test_fuse_rmsnorm_exact_or_refused(make, shape, dtype, fused, reference_threads):
    h = _compiled_exactly(make, shape, dtype, ["cleanup", "fuse_rmsnorm"])
    g = h.after()
    nodes = [n for n in g.graph.nodes if n.op == "call_function" and n.target is ops.rms_norm.default]
    assert len(nodes) == (1 if fused else 0)
    assert count_ops(g, aten.rsqrt.default) == count_ops(h.before(), aten.rsqrt.default) - len(nodes)
    if nodes:
        assert nodes[0].args[3] == (fused == CAST_FIRST)


def test_fuse_rmsnorm_keeps_eps(reference_threads):
    h = _compiled_exactly(lambda dt: TorchNorm(D, dt, eps=1e-3), (4, D), F32, ["cleanup", "fuse_rmsnorm"])
    (node,) = [n for n in h.after().graph.nodes if n.target is ops.rms_norm.default]
    assert node.args[2] == pytest.approx(1e-3, rel=1e-6)


# ---------------------------------------------------------------------------- P1: Linear -> RMSNorm
class LinearNorm(torch.nn.Module):
    """Linear -> norm spelling; `second_user`: the Linear's output is also used elsewhere."""

    def __init__(self, spelling, k, n, dtype, bias=False, second_user=False, **kw):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=bias, dtype=dtype)
        self.norm = Norm(spelling, n if kw.get("dim", -1) == -1 else (3, 1), dtype, **kw)
        self.second_user = second_user

    def forward(self, x):
        y = self.lin(x)
        out = self.norm(y)
        return out + y.sum(-1, keepdim=True) if self.second_user else out


class LinearTorchNorm(torch.nn.Module):
    def __init__(self, k, n, dtype):
        super().__init__()
        self.lin = torch.nn.Linear(k, n, bias=False, dtype=dtype)
        self.norm = TorchNorm(n, dtype)

    def forward(self, x):
        return self.norm(self.lin(x))


K = 16
P1_CASES = [
    ("torch-norm-f32-3d", lambda dt: LinearTorchNorm(K, 40, dt), (2, 5, K), F32, 1),
    ("torch-norm-bf16-2d", lambda dt: LinearTorchNorm(K, 40, dt), (10, K), BF16, 1),
    ("ours-bf16-3d", lambda dt: LinearNorm(ours, K, 32, dt), (2, 5, K), BF16, 1),
    ("ours-f32-2d", lambda dt: LinearNorm(ours, K, 32, dt, eps=1e-5), (10, K), F32, 1),
    # near misses (fused_wkv_rmsnorm multiplies by the weight in fp32 and computes the Linear itself)
    ("llama-bf16", lambda dt: LinearNorm(llama, K, 32, dt), (2, 5, K), BF16, 0),
    ("bias", lambda dt: LinearNorm(ours, K, 32, dt, bias=True), (2, 5, K), F32, 0),
    ("second-user", lambda dt: LinearNorm(ours, K, 32, dt, second_user=True), (2, 5, K), BF16, 0),
    ("other-dim", lambda dt: LinearNorm(ours, K, 32, dt, dim=-2), (2, 3, K), F32, 0),
    ("no-upcast-bf16", lambda dt: LinearNorm(no_upcast, K, 32, dt), (2, 5, K), BF16, 0),
    ("half-weight", lambda dt: LinearNorm(half_weight, K, 32, dt), (2, 5, K), F32, 0),
]


@pytest.mark.parametrize("make, shape, dtype, fused", [c[1:] for c in P1_CASES], ids=[c[0] for c in P1_CASES])
def test_p1_exact_or_refused(make, shape, dtype, fused, reference_threads):
    h = _compiled_exactly(make, shape, dtype, ["cleanup", "fuse_wkv_rmsnorm"])
    g = h.after()
    assert count_ops(g, ops.fused_wkv_rmsnorm.default) == fused
    assert count_ops(g, aten.mm.default, aten.addmm.default) == 1 - fused
    assert count_ops(g, aten.rsqrt.default) == count_ops(h.before(), aten.rsqrt.default) - fused


# ---------------------------------------------------------------------------- transformers models
def _hf_model(kind: str, dtype):
    transformers = pytest.importorskip("transformers", reason="optional: the transformers models test")
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                  vocab_size=128, max_position_embeddings=64)
    if kind == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.DeepseekV3Config(
            num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1, **common)
        cls = transformers.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(config).to(dtype).eval().requires_grad_(False)


LAYERS = 2
# Counted from the architectures: Llama has an input and a post-attention norm per layer and a
# final norm, none fed by a Linear. DeepseekV3 has those plus q_a_layernorm (after the q_a_proj
# Linear: P1's in fp32; its Llama spelling casts before the weight multiply, which P1's op does
# not, so in bf16 fuse_rmsnorm takes it) and kv_a_layernorm (after a split of kv_a_proj's output).
HF_CASES = [
    ("llama", F32, 0, 2 * LAYERS + 1),
    ("llama", BF16, 0, 2 * LAYERS + 1),
    ("deepseek_v3", F32, LAYERS, 3 * LAYERS + 1),
    ("deepseek_v3", BF16, 0, 4 * LAYERS + 1),
]


@pytest.mark.parametrize("kind, dtype, p1, plain", HF_CASES,
                         ids=[f"{k}-{'bf16' if d == BF16 else 'f32'}" for k, d, *_ in HF_CASES])
def test_transformers_models_bit_exact_with_norms_fused(kind, dtype, p1, plain, reference_threads):
    model = _hf_model(kind, dtype)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    want = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    got = torch.compile(model, backend="v41graph")(ids, use_cache=False).logits
    assert torch.equal(got, want)
    # the same flow (make_backend, default pass list) through the harness, to count what fused
    torch._dynamo.reset()
    h = PassHarness(None)
    assert torch.equal(h.compile(model, fullgraph=False)(ids, use_cache=False).logits, want)
    fused_p1 = sum(count_ops(h.after(i), ops.fused_wkv_rmsnorm.default) for i in range(len(h.traced)))
    fused = sum(count_ops(h.after(i), ops.rms_norm.default) for i in range(len(h.traced)))
    left = sum(count_ops(h.after(i), aten.rsqrt.default) for i in range(len(h.traced)))
    assert (fused_p1, fused, left) == (p1, plain, 0)
