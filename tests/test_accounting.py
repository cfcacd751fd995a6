"""Accounting: headline numbers of MODEL.md, sympy formulas, and hand counts for tiny()."""
from __future__ import annotations

import json
import math
import struct
from fractions import Fraction

import pytest
import sympy as sp

from v41graph.weights.accounting import (Accounting, accounting, activated_params, activated_params_formula, checkpoint_shapes, format_accounting, global_kv_bytes_formula, kv_ratio_symbol, window_kv_bytes_formula)
from v41graph.model.config import V41Config

from golden_path import GOLDEN_DIR as GOLDEN


@pytest.fixture(scope="module")
def full_acc() -> Accounting:
    return accounting(V41Config.full())


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


# ------------------------------------------------------------------ full(): MODEL.md headlines
def test_full_headline_params(full_acc):
    assert abs(full_acc.backbone_params - 552e9) / 552e9 < 0.01
    assert abs(full_acc.engram_params - 196e9) / 196e9 < 0.01
    assert abs(full_acc.activated_params_prefill - 8e9) / 8e9 < 0.10
    assert abs(full_acc.activated_params_decode - 16e9) / 16e9 < 0.10
    assert full_acc.n_encoder_layers == 20
    # Engram tables alone: 2 x ~384M rows x 256.
    assert full_acc.engram_params > (384006168 + 384016682) * 256


def test_full_kv_bytes_exact(full_acc):
    assert full_acc.global_kv_bytes_per_token == 890
    assert full_acc.window_kv_bytes_per_token_per_layer == 528
    assert isinstance(full_acc.global_kv_bytes_per_token, int)


def test_kv_formulas_evaluate_to_fields(full_acc):
    cfg = V41Config.full()
    f = global_kv_bytes_formula(cfg)
    assert f.free_symbols == {sp.Symbol("head_dim", positive=True, integer=True),
                              sp.Symbol("index_head_dim", positive=True, integer=True),
                              *(kv_ratio_symbol(i) for i in (2, 8, 14, 20))}
    subs = {s: cfg.compress_ratios[int(s.name[2:])] for s in f.free_symbols
            if s.name.startswith("r_")}
    subs.update({s: getattr(cfg, s.name) for s in f.free_symbols if not s.name.startswith("r_")})
    assert f.subs(subs) == full_acc.global_kv_bytes_per_token == 890
    w = window_kv_bytes_formula()
    assert w.subs({s: getattr(cfg, s.name) for s in w.free_symbols}) == 528


def test_changing_one_kv_ratio_follows_formula():
    base = V41Config.full()
    f = global_kv_bytes_formula(base)
    r2 = kv_ratio_symbol(2)
    # Layer 2 is the kv source of layers 2..7; they must share its ratio.
    ratios = list(base.compress_ratios)
    ratios[2:8] = [4] * 6
    changed = V41Config(compress_ratios=ratios)
    got = accounting(changed).global_kv_bytes_per_token
    predicted = 890 + (288 + 68) * (Fraction(1, 4) - Fraction(1, 2))
    assert got == predicted == 801
    # Same through the formula: only r_2 changes.
    vals = {sp.Symbol("head_dim", positive=True, integer=True): 512,
            sp.Symbol("index_head_dim", positive=True, integer=True): 128,
            kv_ratio_symbol(8): 2, kv_ratio_symbol(14): 2, kv_ratio_symbol(20): 1}
    assert f.subs(vals).subs(r2, 4) == got
    assert f.subs(vals).subs(r2, 2) - f.subs(vals).subs(r2, 4) == 89


def test_full_checkpoint_enumeration_matches_formulas(full_acc):
    backbone = engram = dspark = 0
    for name, shape in checkpoint_shapes(V41Config.full()):
        n = math.prod(shape)
        if name.startswith("mtp."):
            dspark += n
        elif ".engram." in name:
            engram += n
        else:
            backbone += n
    assert (backbone, engram, dspark) == (full_acc.backbone_params, full_acc.engram_params,
                                          full_acc.dspark_params)


def test_activated_formula_shapes():
    dec = activated_params_formula("decode")
    pre = activated_params_formula("prefill")
    n = sp.Symbol("n_prompt", positive=True, integer=True)
    # With one prompt token (replay = the whole prompt) prefill equals decode.
    assert sp.simplify(pre.subs({sp.Symbol("n_replay", positive=True, integer=True): 1, n: 1})
                       - dec) == 0
    cfg = V41Config.full()
    assert activated_params(cfg, "prefill", n_prompt_tokens=1) == activated_params(cfg, "decode")
    with pytest.raises(ValueError):
        activated_params_formula("train")


# ------------------------------------------------------------------ tiny(): counted by hand
# tiny(): d=64 V=256 H=4 Dh=32 q_lora=32 o_groups=2 o_lora=32 hc=4 (mix 24, 4d=256),
# experts 4 (top-2) + 1 shared, inter 32, indexer 4x32, Engram 2 heads x 32, n-gram 4,
# tables 280 / 434 rows, DSpark 4 experts, markov rank 16, 3 targets.
ATTN = [("wq_a", (32, 64)), ("q_norm", (32,)), ("wq_b", (4 * 32, 32)), ("wkv", (32, 64)),
        ("kv_norm", (32,)), ("wo_a", (2 * 32, 4 * 32 // 2)), ("wo_b", (64, 2 * 32)),
        ("attn_sink", (4,))]
BLOCK = [("attn_norm", (64,)), ("ffn_norm", (64,)),
         ("hc_attn_fn", (24, 256)), ("hc_attn_base", (24,)), ("hc_attn_scale", (3,)),
         ("hc_ffn_fn", (24, 256)), ("hc_ffn_base", (24,)), ("hc_ffn_scale", (3,))]
GATE4 = [("gate.weight", (4, 64)), ("gate.bias", (4,))]
EXPERT = [("w1", (32, 64)), ("w2", (64, 32)), ("w3", (32, 64))]
COMP_R1 = [("compressor.wkv", (32, 64)), ("compressor.norm", (32,))]
COMP_R2 = COMP_R1 + [("compressor.wgate", (32, 64))]
IDX_Q = [("indexer.wq_b", (4 * 32, 32)), ("indexer.weights_proj", (4, 64))]
IDX_K = [("indexer.wk", (32, 32)), ("indexer.k_norm", (32,))]
ENGRAM_DENSE = [("engram.wkv", (5 * 64, 3 * 2 * 32)), ("engram.q_weight", (4, 64)),
                ("engram.k_weight", (4, 64))]
EXTRA = {"window": [], "full_r2": COMP_R2 + IDX_Q + IDX_K, "full_r1": COMP_R1 + IDX_Q + IDX_K,
         "reindex": IDX_Q, "reuse": []}
TINY_MODES = ["window", "window", "full_r2", "reuse", "full_r2", "reuse",
              "full_r1", "reuse", "reindex", "reuse"]


def _tiny_layer(mode: str, n_experts_counted: int) -> int:
    dense = _numel(s for _, s in ATTN + BLOCK + GATE4 + EXTRA[mode])
    return dense + n_experts_counted * _numel(s for _, s in EXPERT)


def test_tiny_params_by_hand():
    acc = accounting(V41Config.tiny())
    embed_head_norm = 256 * 64 * 2 + 64
    layers = sum(_tiny_layer(m, 4 + 1) for m in TINY_MODES)
    assert acc.backbone_params == embed_head_norm + layers
    engram = 280 * 32 + 434 * 32 + 2 * _numel(s for _, s in ENGRAM_DENSE)
    assert acc.engram_params == engram
    dspark_block = (_numel(s for _, s in ATTN + BLOCK + GATE4)
                    + (4 + 1) * _numel(s for _, s in EXPERT))
    dspark = 3 * dspark_block + (64 * 3 * 64 + 64) + (64 + 2 * 256 * 16 + (64 + 16))
    assert acc.dspark_params == dspark
    # main row 16 + 2, index row 16 + 1; sources 2 and 4 at ratio 2, source 6 at ratio 1.
    row = (16 + 2) + (16 + 1)
    assert acc.global_kv_bytes_per_token == 2 * row // 2 + row == 70
    assert acc.window_kv_bytes_per_token_per_layer == 32 + 1


def test_tiny_activated_by_hand():
    acc = accounting(V41Config.tiny())
    assert acc.n_encoder_layers == 6             # decoder starts at the last kv source, 6
    engram_tok = _numel(s for _, s in ENGRAM_DENSE) + 3 * 2 * 32   # 6 gathered rows of 32
    per_layer = [_tiny_layer(m, 2 + 1) for m in TINY_MODES]
    decode = 64 + sum(per_layer) + 2 * engram_tok + 256 * 64 + 64
    assert acc.activated_params_decode == decode
    # Prefill (long prompt): embedding row + encoder layers 0-5 (both Engram layers) + layer 6's
    # global-KV build (attn_norm, ratio-1 compressor, index keys).
    k_dec = 64 + _numel(s for _, s in COMP_R1 + IDX_K)
    prefill = 64 + sum(per_layer[:6]) + 2 * engram_tok + k_dec
    assert acc.activated_params_prefill == prefill
    # Finite prompt: replay min(8, n) tokens through the decoder, head once.
    n = 40
    want = Fraction(n * prefill + 8 * (sum(per_layer[6:]) - k_dec) + 256 * 64 + 64, n)
    assert activated_params(V41Config.tiny(), "prefill", n_prompt_tokens=n) == want


# ------------------------------------------------------------------ the released reference checkpoint
def _golden_header() -> dict:
    with open(GOLDEN / "model.safetensors", "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: tuple(v["shape"]) for k, v in header.items() if not k.endswith(".scale")}


@pytest.mark.skipif(not (GOLDEN / "model.safetensors").is_file(), reason="golden vectors absent")
def test_shapes_match_golden_checkpoint():
    cfg = V41Config.from_json(GOLDEN)
    mine = dict(checkpoint_shapes(cfg))
    ref = _golden_header()
    assert mine == ref
    acc = accounting(cfg)
    assert acc.backbone_params + acc.engram_params + acc.dspark_params == _numel(ref.values())


def test_format_accounting(full_acc):
    text = format_accounting(full_acc)
    assert "551.6B" in text and "196.9B" in text and "890 B/token" in text
    assert "528 B/token" in text
