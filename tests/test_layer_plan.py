"""The static layer plan (MODEL.md section 2) for the released config, tiny(), the golden config,
and every validation rule."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from v41graph.model.config import V41Config
from v41graph.model.layer_plan import build_layer_plan

FULL = {2, 8, 14, 20}
REINDEX = {24, 28, 32, 36}


def _by_mode(plan):
    out = {}
    for r in plan:
        out.setdefault(r.mode, set()).add(r.layer_id)
    return out


# =============================================================================== released config
@pytest.fixture(scope="module")
def full_plan():
    return build_layer_plan(V41Config.full())


def test_full_config_roles(full_plan):
    assert [r.layer_id for r in full_plan] == list(range(40))
    modes = _by_mode(full_plan)
    assert modes["window"] == {0, 1}
    assert modes["full"] == FULL
    assert modes["reindex"] == REINDEX
    assert modes["reuse"] == set(range(2, 40)) - FULL - REINDEX
    assert len(modes["reuse"]) == 30
    assert [r.layer_id for r in full_plan if r.is_candidate_source] == [20]
    assert all(r.candidate_source == 20 for r in full_plan if r.mode == "reindex")
    assert all(r.candidate_source is None for r in full_plan if r.mode != "reindex")
    assert {r.layer_id for r in full_plan if r.engram_slot is not None} == {1, 14}
    assert full_plan[1].engram_slot == 0 and full_plan[14].engram_slot == 1
    assert [r.ratio for r in full_plan] == [0, 0] + [2] * 18 + [1] * 20


def _latest(ids, i):
    return max(k for k in ids if k <= i)


def test_full_config_sources_follow_the_latest_source_rule(full_plan):
    kv_ids, idx_ids = [2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36]
    for r in full_plan:
        if r.ratio == 0:
            assert r.kv_source is None and r.index_source is None, r
            continue
        assert r.kv_source == _latest(kv_ids, r.layer_id), r
        assert r.index_source == _latest(idx_ids, r.layer_id), r
        assert full_plan[r.kv_source].ratio == r.ratio, r
        assert r.scores == (r.layer_id in FULL | REINDEX)


@pytest.mark.parametrize("layer,kv,index", [
    (2, 2, 2), (3, 2, 2), (9, 8, 8), (13, 8, 8), (19, 14, 14), (20, 20, 20), (23, 20, 20),
    (24, 20, 24), (25, 20, 24), (27, 20, 24), (28, 20, 28), (35, 20, 32), (39, 20, 36)])
def test_full_config_hand_picked_sources(full_plan, layer, kv, index):
    assert (full_plan[layer].kv_source, full_plan[layer].index_source) == (kv, index)


# =============================================================================== tiny
def test_tiny_keeps_every_role():
    plan = build_layer_plan(V41Config.tiny())
    assert [(r.mode, r.ratio) for r in plan] == [
        ("window", 0), ("window", 0), ("full", 2), ("reuse", 2), ("full", 2), ("reuse", 2),
        ("full", 1), ("reuse", 1), ("reindex", 1), ("reuse", 1)]
    assert [r.kv_source for r in plan] == [None, None, 2, 2, 4, 4, 6, 6, 6, 6]
    assert [r.index_source for r in plan] == [None, None, 2, 2, 4, 4, 6, 6, 8, 8]
    assert [r.layer_id for r in plan if r.is_candidate_source] == [6]
    assert plan[8].candidate_source == 6
    assert [r.layer_id for r in plan if r.engram_slot is not None] == [1, 4]


# =============================================================================== rule violations
def _full(**kw):
    return dataclasses.replace(V41Config.full(), **kw)


RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]

VIOLATIONS = {
    # name: (config, regexes the message must match: the layer and the rule)
    "kv_source_ratio_0": (_full(kv_source_layer_ids=[1, 2, 8, 14, 20],
                                index_source_layer_ids=[1, 2, 8, 14, 20, 24, 28, 32, 36]),
                          [r"layer 1\b", r"ratio"]),
    "index_source_ratio_0": (_full(index_source_layer_ids=[0, 2, 8, 14, 20, 24, 28, 32, 36]),
                             [r"layer 0\b", r"ratio"]),
    "ratio_mismatch_with_source": (_full(compress_ratios=RATIOS[:21] + [2] + RATIOS[22:]),
                                   [r"layer 21\b", r"ratio", r"20"]),
    "candidate_not_kv_source": (_full(candidate_source_layer_id=24), [r"24", r"candidate source", r"kv source"]),
    "unsorted_ids": (_full(kv_source_layer_ids=[8, 2, 14, 20]), [r"kv_source_layer_ids", r"sorted"]),
    "duplicate_ids": (_full(index_source_layer_ids=[2, 8, 8, 14, 20, 24, 28, 32, 36]),
                      [r"index_source_layer_ids", r"unique"]),
    "engram_out_of_range": (_full(engram_layer_ids=[1, 40]), [r"engram_layer_ids", r"layer 40\b", r"range"]),
    "engram_negative": (_full(engram_layer_ids=[-1, 14]), [r"engram_layer_ids", r"-1", r"range"]),
    "kv_source_not_index_source": (_full(kv_source_layer_ids=[2, 8, 14, 20, 22]),
                                   [r"layer 22\b", r"index source"]),
    "reindex_before_candidate_source": (_full(kv_source_layer_ids=[2, 8, 14, 20, 30],
                                              index_source_layer_ids=[2, 8, 14, 20, 24, 28, 30, 32, 36],
                                              candidate_source_layer_id=30),
                                        [r"layer 24\b", r"reindex", r"before", r"30"]),
    "compress_ratios_too_short": (_full(compress_ratios=RATIOS[:-1]), [r"compress_ratios", r"42", r"43"]),
    "compress_ratios_too_long": (_full(compress_ratios=RATIOS + [0]), [r"compress_ratios", r"44", r"43"]),
}


@pytest.mark.parametrize("name", list(VIOLATIONS))
def test_rule_violation_raises_value_error_naming_layer_and_rule(name):
    cfg, patterns = VIOLATIONS[name]
    with pytest.raises(ValueError) as info:
        build_layer_plan(cfg)
    msg = str(info.value)
    for pat in patterns:
        assert re.search(pat, msg), f"{name}: {pat!r} not in {msg!r}"


def test_unmodified_full_config_builds():
    """Guard for the table above: the configs there break only their one field."""
    assert len(build_layer_plan(_full())) == 40


# =============================================================================== from_json
GOLDEN_CONFIGS = [Path("/work/shared/golden/golden_v41_tiny/config.json"),
                  Path(__file__).resolve().parent / "data/golden_v41_tiny/config.json"]


@pytest.fixture(scope="module")
def golden_config_path():
    for p in GOLDEN_CONFIGS:
        if p.is_file():
            return p
    pytest.skip("golden_v41_tiny/config.json not found")


def test_from_json_maps_reference_names(golden_config_path):
    raw = json.loads(golden_config_path.read_text())
    cfg = V41Config.from_json(golden_config_path)
    assert cfg.hidden_size == raw["dim"] == 192
    assert cfg.num_hidden_layers == raw["n_layers"] == 10
    assert cfg.num_attention_heads == raw["n_heads"]
    assert cfg.num_nextn_predict_layers == raw["n_mtp_layers"]
    assert cfg.sliding_window == raw["window_size"] == 32
    assert cfg.kv_source_layer_ids == raw["kv_source_layers"] == [2, 4, 6]
    assert cfg.index_source_layer_ids == raw["index_source_layers"] == [2, 4, 6, 8]
    assert cfg.candidate_source_layer_id == raw["candidate_source_layer"] == 6
    assert cfg.num_experts_per_tok == raw["n_activated_experts"]
    assert cfg.dspark_num_experts_per_tok == raw["dspark_n_activated_experts"]
    assert cfg.moe_intermediate_size == raw["moe_inter_dim"]
    assert cfg.routed_scaling_factor == raw["route_scale"]
    assert cfg.qk_rope_head_dim == raw["rope_head_dim"]
    assert cfg.rms_norm_eps == raw["norm_eps"]
    assert cfg.engram_pad_token_id == raw["engram_pad_id"]
    assert cfg.scoring_func == raw["score_func"]
    assert cfg.rope_scaling["original_max_position_embeddings"] == raw["original_seq_len"]
    assert cfg.rope_scaling["factor"] == raw["rope_factor"]
    assert cfg.rope_scaling["beta_fast"] == raw["beta_fast"]
    assert cfg.rope_scaling["beta_slow"] == raw["beta_slow"]
    # same-named fields pass through
    for key in ("vocab_size", "head_dim", "q_lora_rank", "index_topk", "candidate_block_size",
                "candidate_topk_blocks", "index_n_heads", "index_head_dim", "compress_ratios"):
        assert getattr(cfg, key) == raw[key], key


def test_from_json_plan_of_the_golden_config(golden_config_path):
    plan = build_layer_plan(V41Config.from_json(golden_config_path))
    assert [(r.mode, r.ratio) for r in plan] == [
        ("window", 0), ("window", 0), ("full", 2), ("reuse", 2), ("full", 2), ("reuse", 2),
        ("full", 1), ("reuse", 1), ("reindex", 1), ("reuse", 1)]
    assert [r.layer_id for r in plan if r.is_candidate_source] == [6]


def test_from_json_accepts_a_directory(golden_config_path):
    assert V41Config.from_json(golden_config_path.parent) == V41Config.from_json(golden_config_path)


def test_from_json_keeps_unknown_fields(golden_config_path, tmp_path, caplog):
    """A released config.json carries keys v41graph does not use (pad_token_id, architectures...):
    they load, are kept in `extra` and come back out of save_pretrained; a near miss of a field's
    name is warned about."""
    raw = json.loads(golden_config_path.read_text())
    raw.update(pad_token_id=1, architectures=["DeepseekV41ForCausalLM"], hiden_size=7)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(raw))
    with caplog.at_level("WARNING", logger="v41graph.model.config"):
        cfg = V41Config.from_json(p)
    assert cfg.extra["pad_token_id"] == 1 and cfg.extra["architectures"] == ["DeepseekV41ForCausalLM"]
    assert cfg.hidden_size == raw["dim"]                  # the misspelt key did not set the field
    assert [r.message for r in caplog.records if "hiden_size" in r.message] == [
        "config.json: unknown field 'hiden_size' kept as is (did you mean 'hidden_size'?)"]
    assert V41Config.from_dict({"dim": 64, "bogus_knob": True}).extra == {"bogus_knob": True}
