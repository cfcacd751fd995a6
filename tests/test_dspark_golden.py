"""DSpark conformance with DeepSeek's reference (golden_v41_tiny: dspark_output_ids /
dspark_logits / dspark_confidence, procedure in its README).

The head is fed the reference's OWN target hidden states (debug.block_out captures of layers
6/7/8 = the residual entering target layers 7/8/9), for the 40 prompt tokens (window seeding)
and then each decode token, and drafts from the reference's anchor (decode_argmax) at position
T + s + 1, like `forward_spec(argmax, main_hidden, T + s)`.

Reached (asserted, on 2 intra-op threads like the reference run):
  * draft ids (anchor + 5 greedy drafts) identical at all 6 steps;
  * MoE routing (expert ids) of all 3 stages identical at all 6 steps;
  * steps 0, 1, 2, 4, 5: dspark_logits, dspark_confidence and every stage's gate weights
    bit-exact;
  * step 3: first difference in stage 1 (stage 0's gate weights are bit-exact, stage 1's differ
    by ~1e-4), ending at max |d logits| ~0.05 and |d confidence| ~1.1 (raw logit of ~|50|).
    Not localised yet (no per-stage residual captures in the golden folder); the strict xfail
    keeps it visible. On ONE thread step 4 also differs slightly (the README's caveat: the DSpark
    fp32 head depends on the thread count), which is why this module runs on two.
"""
from __future__ import annotations

import pytest
import torch

from golden_path import GOLDEN_DIR as GOLDEN

pytestmark = pytest.mark.skipif(not (GOLDEN / "model.safetensors").is_file(),
                                reason=f"golden vectors not found at {GOLDEN}")
PROMPT, STEPS = 40, 6
EXACT_STEPS = [0, 1, 2, 4, 5]


@pytest.fixture(scope="module")
def drafts():
    from safetensors.torch import load_file
    from v41graph.dspark import load_dspark
    from v41graph.loader import from_pretrained
    io = load_file(str(GOLDEN / "io.safetensors"))
    model = from_pretrained(GOLDEN, numerics="reference")
    head = load_dspark(GOLDEN, model.config)
    targets = model.config.dspark_target_layer_ids

    def target_inputs(phase):
        return [io[f"debug.block_out.{phase}.layer{t - 1}"][0] for t in targets]

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = head.new_state(1)
        out = []
        with torch.no_grad():
            head.append_context(state, 0, torch.arange(PROMPT), head.context(target_inputs("prefill")))
            for s in range(STEPS):
                head.append_context(state, 0, torch.tensor([PROMPT + s]),
                                    head.context(target_inputs(f"decode{s}")))
                dbg = {}
                anchor = int(io["decode_argmax"][s, 0])
                ids, logits, conf = head.draft(state, 0, anchor, PROMPT + s + 1, model.embed, model.head,
                                               debug=dbg)
                out.append((ids, logits, conf, dbg))
    finally:
        torch.set_num_threads(threads)
    return io, out


def test_loader_maps_every_mtp_tensor():
    from safetensors import safe_open
    from v41graph.config import V41Config
    from v41graph.dspark import DSparkHead, dspark_module_name
    cfg = V41Config.from_json(GOLDEN / "config.json")
    with safe_open(str(GOLDEN / "model.safetensors"), "pt") as f:
        names = [n for n in f.keys() if n.startswith("mtp.")]
    assert {dspark_module_name(n) for n in names} == {n for n, _ in DSparkHead(cfg).named_parameters()}
    assert dspark_module_name("mtp.0.hc_attn_fn") == "stages.0.hc_attn.fn"


def test_draft_ids_identical(drafts):
    io, out = drafts
    for s, (ids, *_rest) in enumerate(out):
        assert ids.tolist() == io["dspark_output_ids"][s, 0].tolist(), f"step {s}"


def test_routing_identical(drafts):
    io, out = drafts
    for s, (*_r, dbg) in enumerate(out):
        for i in range(3):
            assert torch.equal(dbg[f"moe_gate_indices.stage{i}"],
                               io[f"debug.moe_gate_indices.spec{s}.mtp.{i}.ffn.gate"]), f"step {s} stage {i}"


@pytest.mark.parametrize("step", EXACT_STEPS)
def test_logits_confidence_bit_exact(drafts, step):
    io, out = drafts
    _, logits, conf, dbg = out[step]
    assert torch.equal(logits, io["dspark_logits"][step, 0])
    assert torch.equal(conf, io["dspark_confidence"][step, 0])
    for i in range(3):
        assert torch.equal(dbg[f"moe_gate_weights.stage{i}"],
                           io[f"debug.moe_gate_weights.spec{step}.mtp.{i}.ffn.gate"])


def test_step3_close_and_first_difference_in_stage1(drafts):
    io, out = drafts
    _, logits, conf, dbg = out[3]
    assert torch.equal(dbg["moe_gate_weights.stage0"], io["debug.moe_gate_weights.spec3.mtp.0.ffn.gate"])
    assert (logits - io["dspark_logits"][3, 0]).abs().max() < 0.2
    assert (conf - io["dspark_confidence"][3, 0]).abs().max() < 3.0


@pytest.mark.xfail(strict=True, reason="step 3 differs from stage 1 on (not localised yet)")
def test_step3_bit_exact(drafts):
    io, out = drafts
    assert torch.equal(out[3][1], io["dspark_logits"][3, 0])
