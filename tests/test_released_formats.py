"""numerics="released": the checkpoint's FP8 / MXFP4 weights computed as stored, through the
fp8_linear and mxfp4_moe ops (CPU side; the CUDA kernels: tests/test_quant_gemm_cuda.py).

On the CPU the ops run their references, DeepSeek's blockwise arithmetic, so "released" must
reproduce the golden vectors bit for bit, equal numerics="reference" bit for bit (the ops are
the same function the Linear / MoE loop runs, through other code paths), keep every weight in
its checkpoint bytes (no dense copy, stacked experts as views), survive our compiler with both
ops in the graph, and refuse a malformed checkpoint at load time by name.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import v41graph
from golden_path import GOLDEN_DIR as GOLDEN
from v41graph.model.layers import Linear, default_dtype
from v41graph.model.model import V41Model, init_random_
from v41graph.model.moe import MoE
from v41graph.runtime.session import Session
from v41graph.weights.checkpoint import CheckpointError
from v41graph.weights.load import from_pretrained

ops = torch.ops.v41graph
needs_golden = pytest.mark.skipif(not (GOLDEN / "model.safetensors").is_file(),
                                  reason=f"golden vectors not found at {GOLDEN}")


@pytest.fixture(scope="module")
def tiny_released():
    cfg = v41graph.V41Config.tiny(weight_format="checkpoint", torch_dtype="bfloat16")
    with default_dtype(torch.bfloat16):
        model = init_random_(V41Model(cfg), seed=3).eval().requires_grad_(False)
    return model


def _prefill_and_decode(model, steps: int = 2):
    session = Session(model, 1, 64, block_size=16)
    ids = torch.randint(0, model.config.vocab_size, (1, 21), generator=torch.Generator().manual_seed(0))
    out = [session.prefill(ids)]
    for _ in range(steps):
        out.append(session.decode(out[-1].argmax(-1).view(1, 1)))
    return out


@needs_golden
@pytest.mark.usefixtures("reference_threads")
def test_released_reproduces_the_golden_prefill_bit_for_bit():
    from safetensors.torch import load_file
    io = load_file(str(GOLDEN / "io.safetensors"))
    model = from_pretrained(GOLDEN, numerics="released")
    assert {m.numerics for m in model.modules() if isinstance(m, Linear)} == {"released"}
    logits = Session(model, max_batch_size=1, max_seq_len=64, block_size=64).prefill(io["prompt_ids"])
    assert torch.equal(logits, io["prefill_logits"])
    assert sum(1 for m in model.modules() if isinstance(m, MoE) and m._s13 is not None) > 0   # the op ran


def test_released_equals_reference_bit_for_bit_prefill_and_decode(tiny_released):
    model = tiny_released
    want = _prefill_and_decode(model.set_numerics("reference"))
    got = _prefill_and_decode(model.set_numerics("released"))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_released_keeps_the_checkpoint_bytes(tiny_released):
    """No dense copy appears: every FP8/FP4 Linear keeps its uint8 weight and scale, no dense
    cache is built by a forward, and the stacked experts are views (the stack bytes are the
    experts' bytes, counted, and every expert parameter points into its stack)."""
    model = tiny_released.set_numerics("released")
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    _prefill_and_decode(model, steps=1)
    quantized = [m for m in model.modules() if isinstance(m, Linear) and m.fmt != "dense"]
    assert quantized and all(m._dense_cache is None and m.weight.dtype == m.scale.dtype == torch.uint8
                             for m in quantized)
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == before
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        assert moe.is_packed() and moe._s13 is not None
        expert_bytes = sum(t.numel() for e in moe.experts for lin in (e.w1, e.w3, e.w2)
                           for t in (lin.weight, lin.scale))
        assert sum(t.numel() for t in (moe._w13, moe._s13, moe._w2, moe._s2)) == expert_bytes
        start, end = moe._w13.data_ptr(), moe._w13.data_ptr() + moe._w13.numel()
        assert all(start <= e.w1.weight.data_ptr() < end for e in moe.experts)


def test_released_state_dict_is_the_checkpoint_layout(tiny_released):
    """Stacking the MXFP4 experts changes no name, shape or byte of the state dict."""
    model = tiny_released.set_numerics("reference")
    fresh = {k: v.clone() for k, v in model.state_dict().items()}
    model.set_numerics("released")
    _prefill_and_decode(model, steps=0)                            # packs the experts
    after = model.state_dict()
    assert fresh.keys() == after.keys()
    assert all(torch.equal(fresh[k], after[k]) for k in fresh)


def test_compiled_released_matches_eager_with_both_ops_in_the_graph(tiny_released):
    from compile_harness import CompiledSession, PassHarness, count_ops
    model = tiny_released.set_numerics("released")
    h = PassHarness(None)
    fn = h.compile(model, dynamic=False)
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    want = Session(model, 1, 32, block_size=16).prefill(ids)
    got = CompiledSession(model, fn, 1, 32, block_size=16).prefill(ids)
    assert torch.equal(got, want)
    g = h.after(0)
    cfg = model.config
    assert count_ops(g, ops.mxfp4_moe.default) == cfg.num_hidden_layers
    assert count_ops(g, ops.fp8_linear.default) > 0


def test_unknown_numerics_is_refused(tiny_released):
    with pytest.raises(ValueError, match="numerics must be one of"):
        tiny_released.set_numerics("fp8")


# ----------------------------------------------------------------------------- bad checkpoints
def _bad_copy(tmp_path, edit):
    from safetensors.torch import load_file, save_file
    d = tmp_path / "bad"
    shutil.copytree(GOLDEN, d, ignore=shutil.ignore_patterns("model.safetensors", "io.safetensors"))
    tensors = load_file(str(GOLDEN / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))
    return d


@needs_golden
@pytest.mark.parametrize("edit, message", [
    # a scale blocked per 16 instead of 32 x 32 (block size)
    (lambda t: t.__setitem__("layers.0.attn.wq_a.scale", torch.zeros(
        2 * t["layers.0.attn.wq_a.scale"].shape[0], 2 * t["layers.0.attn.wq_a.scale"].shape[1],
        dtype=torch.float8_e8m0fnu)), "wrong shape: layers.0.attn.wq_a.scale"),
    # an FP32 scale where E8M0 is stored
    (lambda t: t.__setitem__("layers.0.ffn.experts.0.w1.scale", t["layers.0.ffn.experts.0.w1.scale"].float()),
     "wrong dtype: layers.0.ffn.experts.0.w1.scale in model.safetensors is F32, expected F8_E8M0"),
    # an FP4 weight with one column missing (odd K)
    (lambda t: t.__setitem__("layers.0.ffn.experts.0.w2.weight",
                             t["layers.0.ffn.experts.0.w2.weight"][:, :-1].contiguous()),
     "wrong shape: layers.0.ffn.experts.0.w2.weight"),
], ids=["scale-block", "scale-dtype", "fp4-odd-k"])
def test_malformed_quantized_tensors_are_refused_before_any_allocation(tmp_path, edit, message):
    """The error names the tensor and the rule, and comes before the model is built: a
    device="cuda" load on this (possibly GPU-less) machine fails with it, not with CUDA."""
    d = _bad_copy(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[")):
        from_pretrained(d, numerics="released", device="cuda")


def test_quantized_ops_name_a_mismatched_tensor():
    """The ops check shapes at their boundary (eager and at trace time): the error names the op,
    the tensor and the rule instead of failing inside a view."""
    x = torch.zeros(3, 64)
    w, s = torch.zeros(48, 64, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)
    assert ops.fp8_linear(x, w, s, torch.float32).shape == (3, 48)
    with pytest.raises(ValueError, match="fp8_linear: x's last dim 32 must equal the weight's K 64"):
        ops.fp8_linear(torch.zeros(3, 32), w, s, torch.float32)
    with pytest.raises(ValueError, match=r"fp8_linear: scale shape \(2, 4\) != \(2, 2\)"):
        ops.fp8_linear(x, w, torch.zeros(2, 4, dtype=torch.uint8), torch.float32)
    with pytest.raises(TypeError, match="uint8"):
        ops.fp8_linear(x, w.float(), s, torch.float32)
    e, i = 2, 32
    stacks = dict(w13=torch.zeros(e, 2 * i, 32, dtype=torch.uint8), s13=torch.zeros(e, 2 * i, 2, dtype=torch.uint8),
                  w2=torch.zeros(e, 64, i // 2, dtype=torch.uint8), s2=torch.zeros(e, 64, 1, dtype=torch.uint8))
    chosen, weights = torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    assert ops.mxfp4_moe(x, weights, chosen, *stacks.values(), 10.0).shape == (3, 64)
    stacks["s2"] = torch.zeros(e, 64, 2, dtype=torch.uint8)             # scales per 16, not 32
    with pytest.raises(ValueError, match=r"mxfp4_moe: s2 shape \(2, 64, 2\) != \(2, 64, 1\)"):
        ops.mxfp4_moe(x, weights, chosen, *stacks.values(), 10.0)
