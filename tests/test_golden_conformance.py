"""Conformance with DeepSeek's released reference code: shared/golden/golden_v41_tiny.

The checkpoint goes through our official-name loader into V41Model in reference numerics
(bf16 activations, FP8 activation QDQ per 32, blockwise fp32 GEMM partials, FP4 QDQ points,
P cast to bf16 before P.V, top-k ties to the lower index).

Every test here runs under MKL_CBWR=COMPATIBLE with 2 torch threads (tests/conftest.py), the
setting the vectors were made with: oneMKL's CPU-specific fp32 kernels would otherwise move last
bits, which the FP8/FP4 quantization points amplify to ~0.3 on a logit.

What is reached (and asserted):
  prefill  logits bit-exact; every sparse-attention index list and every MoE routing decision
           identical; every per-layer capture (block output, pre-mix coefficients, final norm)
           bit-exact.
  decode   layers 0-1 bit-exact at every step and the argmax token identical at every step.
           The one difference is the indexer selection of the ratio-2 Full layers (2 and 4) at
           even positions, where the newest ratio-2 group is still incomplete. There the
           reference's Indexer publishes no key cache (`shared_attn.index_k` is set only when a
           compressed latent exists), so its layer scores against the key cache another layer
           published last (the ratio-1 source's, from the previous step), sliced with its own
           ratio. v41graph scores each layer against its own index source, which is the intended
           behaviour, and keeps it. With the reference's selection substituted for those two
           layers, every layer's output, every index list and the logits of all 6 decode steps
           are bit-exact (test below). The strict xfail keeps the difference visible.
"""
from __future__ import annotations


import pytest
import torch

from golden_path import GOLDEN_DIR as GOLDEN
pytestmark = [pytest.mark.skipif(not (GOLDEN / "model.safetensors").is_file(),
                                 reason=f"golden vectors not found at {GOLDEN}"),
              pytest.mark.usefixtures("reference_threads")]
N_LAYERS, WINDOW, PROMPT = 10, 32, 40


@pytest.fixture(scope="module")
def golden():
    from safetensors.torch import load_file
    from v41graph.weights.load import from_pretrained
    from v41graph.runtime.session import Session
    io = load_file(str(GOLDEN / "io.safetensors"))
    model = from_pretrained(GOLDEN, numerics="reference")
    session = Session(model, max_batch_size=1, max_seq_len=64, block_size=64)
    model.debug = {}
    prefill = session.prefill(io["prompt_ids"])
    prefill_debug = model.debug
    steps = []
    for s in range(io["decode_ids"].shape[1]):
        model.debug = {}
        logits = session.decode(io["decode_ids"][:, s:s + 1])
        steps.append((logits, model.debug))
    model.debug = None
    return io, model, prefill, prefill_debug, steps


def reference_index_list(debug: dict, layer: int, decode: bool) -> torch.Tensor:
    """Our captured positions in the reference's convention: window entries are positions
    (prefill) or ring slots (decode); compressed entries are offset by the KV length."""
    win, topk = debug[f"window_positions.layer{layer}"], debug[f"topk_positions.layer{layer}"]
    offset = WINDOW if decode else PROMPT
    if decode:
        win = torch.where(win >= 0, win % WINDOW, -1)
    comp = torch.where(topk >= 0, topk + offset, -1)
    return torch.cat([win, comp], -1)


def test_engram_token_map_from_tokenizer_matches(golden):
    io, model, *_ = golden
    assert torch.equal(model.engram_token_map, io["engram_token_map"])


def test_prefill_logits_bit_exact(golden):
    io, _, prefill, _, _ = golden
    assert torch.equal(prefill, io["prefill_logits"])
    assert torch.equal(prefill.argmax(-1), io["prefill_argmax"])


def test_prefill_index_lists_and_routing_identical(golden):
    io, _, _, dbg, _ = golden
    for i in range(N_LAYERS):
        ref = io[f"debug.sparse_attn_topk_idxs.prefill.layer{i}"][0].long()
        assert torch.equal(reference_index_list(dbg, i, decode=False), ref), f"layer {i}"
        gate = io[f"debug.moe_gate_indices.prefill.layers.{i}.ffn.gate"]
        assert torch.equal(dbg[f"moe_gate_indices.layer{i}"].sort(-1).values, gate.sort(-1).values), f"layer {i}"


def test_prefill_layer_captures_bit_exact(golden):
    io, _, _, dbg, _ = golden
    for i in range(N_LAYERS):
        ref = io[f"debug.block_out.prefill.layer{i}"][0]
        ours = dbg[f"block_out.layer{i}"].view(ref.shape)
        assert torch.equal(ours, ref), f"layer {i}: {int((ours != ref).sum())} elements differ"
        assert torch.equal(dbg[f"block_pre_mix.layer{i}"].view(-1, 4),
                           io[f"debug.block_pre_mix.prefill.layer{i}"].view(-1, 4)), f"layer {i}"
    assert torch.equal(dbg["final_norm"], io["debug.final_norm.prefill"][0, -1:])


def test_decode_argmax_and_first_layers_identical(golden):
    io, _, _, _, steps = golden
    for s, (logits, dbg) in enumerate(steps):
        assert torch.equal(logits.argmax(-1), io["decode_argmax"][s]), f"step {s}"
        for i in (0, 1):
            ref = io[f"debug.block_out.decode{s}.layer{i}"].view(1, 4, -1)
            assert torch.equal(dbg[f"block_out.layer{i}"].view(ref.shape), ref), f"step {s} layer {i}"
        # Bounded: the decode difference stays a small perturbation of the logits.
        assert (logits - io["decode_logits"][s]).abs().max() < 1.0


def test_decode_bit_exact_given_reference_ratio2_selection():
    """Everything but the ratio-2 indexer selection at even decode positions is bit-exact."""
    from safetensors.torch import load_file
    from v41graph.weights.load import from_pretrained
    from v41graph.runtime.session import Session
    io = load_file(str(GOLDEN / "io.safetensors"))
    model = from_pretrained(GOLDEN, numerics="reference")
    session = Session(model, max_batch_size=1, max_seq_len=64, block_size=64)
    session.prefill(io["prompt_ids"])
    step = {"s": 0}
    for layer in (2, 4):   # the ratio-2 Full layers
        attn = model.layers[layer].attn
        attn._select = lambda *a, layer=layer: io[
            f"debug.sparse_attn_topk_idxs.decode{step['s']}.layer{layer}"][0, :, WINDOW:].long() - WINDOW
    for s in range(io["decode_ids"].shape[1]):
        step["s"] = s
        model.debug = {}
        logits = session.decode(io["decode_ids"][:, s:s + 1])
        assert torch.equal(logits, io["decode_logits"][s]), f"step {s}"
        for i in range(N_LAYERS):
            ref = io[f"debug.block_out.decode{s}.layer{i}"].view(1, 4, -1)
            assert torch.equal(model.debug[f"block_out.layer{i}"].view(ref.shape), ref), f"step {s} layer {i}"
            ref_idx = io[f"debug.sparse_attn_topk_idxs.decode{s}.layer{i}"][0].long()
            assert torch.equal(reference_index_list(model.debug, i, decode=True), ref_idx), f"step {s} layer {i}"


@pytest.mark.xfail(strict=True, reason="decode: at even positions (incomplete ratio-2 group) the reference's "
                   "ratio-2 Full layers (2, 4) score against the key cache another layer published last; "
                   "ours score their own index source (intended). Everything else is bit-exact")
def test_decode_index_lists_identical(golden):
    io, _, _, _, steps = golden
    for s, (_, dbg) in enumerate(steps):
        for i in range(N_LAYERS):
            ref = io[f"debug.sparse_attn_topk_idxs.decode{s}.layer{i}"][0].long()
            assert torch.equal(reference_index_list(dbg, i, decode=True), ref), f"step {s} layer {i}"
