"""Parameter and KV-cache accounting, computed from the config alone (no model is built).

Everything here is derived from tensor shapes and the layer plan (`build_layer_plan`), so it
works for `V41Config.full()` (where it reproduces MODEL.md's headline numbers) as well as for
`tiny()` and any other config. Where a closed form is the clearest statement it is kept as a
sympy expression that later benchmarks and cost models can reuse:

  module_param_formulas()        parameters of each module, in config-field symbols
  segment_activated_formula()    weights one token touches in a run of layers (encoder/decoder)
  activated_params_formula(ph)   activated params per token, ph = "prefill" | "decode"
  global_kv_bytes_formula(cfg)   global KV bytes per token, in head_dim, index_head_dim, r_<id>
  window_kv_bytes_formula()      window KV bytes per cached slot per layer

`accounting(config)` substitutes the config's values into these and returns an `Accounting`.
`checkpoint_shapes(config)` lists every weight tensor the checkpoint holds, by the reference's
own names; the tests check the formulas against it and against the golden checkpoint's header.

Definitions
-----------
Parameters are weight elements. Quantisation scales (`*.scale`: UE8M0 block scales of FP8/FP4
weights and of the Engram table) are format metadata and are not counted. The DSpark stages
hold aliases of `embed`/`head` (not stored in the checkpoint); those are counted once.

backbone_params
    Everything the 40-layer (num_hidden_layers) target model owns except the Engram modules:
    `embed` [V, d] + `head` [V, d] + final `norm` [d] + every `layers.<i>.*` tensor that is
    not `layers.<i>.engram.*` (attention incl. compressor/indexer, mHC, norms, gate, routed
    and shared experts). The DSpark speculative stages (`mtp.*`) are NOT in the backbone;
    they are reported separately as `dspark_params`. full(): 551.57B (headline 552B; adding
    DSpark's 14.23B would give 565.8B, 2.5 % off, so the headline excludes it; dropping
    embed+head (1.32B) would give 550.2B, which no longer rounds to 552).

engram_params
    All `layers.<i>.engram.*` weights: the tables [rows, engram_head_dim] (2 x ~384M x 256 =
    196.6B for full()) plus wkv [(hc+1)d, (N-1)*heads*head_dim] and q_weight/k_weight [hc, d].
    full(): 196.9B (headline 196B).

activated_params_decode
    Weights one decode token touches (main model only; DSpark drafting not included):
    embedding row (d) + for every backbone layer its dense weights (attention with its
    compressor/indexer as the layer's mode requires, mHC, attn/ffn norms, MoE gate + bias)
    + num_experts_per_tok routed experts + the shared expert(s)
    + per Engram layer its dense weights (wkv, q_weight, k_weight) + the (N-1)*engram_n_heads
      table rows it gathers (24 x 256 for full())
    + final norm + the full head [V, d].
    full(): 16.13B (headline 16B).

activated_params_prefill
    CED prefill with decoder bounded replay (MODEL.md §9): the average, over the prompt
    tokens of a long prompt (n_prompt -> infinity), of the weights applied to each token.
    Every prompt token runs the embedding row, the encoder layers (with their Engram layers)
    and the global-KV build of the decoder's kv source(s) (attn_norm, compressor, index-key
    wk/k_norm: "the encoder alone builds all global KV"); only the last
    n_replay = min(sliding_window, n_prompt) tokens run the decoder layers and only the last
    token the head, so those terms are divided by n_prompt and vanish in the limit:

      P(n) = d + A_enc + K_dec + (n_replay * (A_dec - K_dec) + V*d + d) / n_prompt

    A_enc / A_dec = per-token activated weights of the encoder / decoder layers (as in
    decode), K_dec = the decoder's KV-build weights. full(): 7.90B (headline 8B).
    `activated_params(config, "prefill", n_prompt=n)` gives the finite-n value; for
    n_prompt <= sliding_window it is the decode count with the head amortised over n.

    Encoder / decoder split: the decoder starts at the LAST kv source layer (its global KV is
    a projection of the hidden state leaving the encoder). For full() that is layer 20
    (= num_hidden_layers / 2, MODEL.md §2); for tiny() layer 6 (tiny's ratio-2 layers 0-5
    mirror full's encoder, its ratio-1 layers 6-9 the decoder). Override with
    `accounting(config, n_encoder_layers=...)`.

global_kv_bytes_per_token
    MODEL.md §5: sum over kv source layers i of (main_row + index_row) / r_i with
    main_row = head_dim/2 (FP4 E2M1) + head_dim/16 (E4M3 scale per 16) = 288 B and
    index_row = index_head_dim/2 (FP4) + index_head_dim/32 (E8M0 per 32) = 68 B.
    full(): 3 x 356/2 + 356 = 890 B. (An int whenever the sum is integral, as for every
    shipped config; otherwise a fractions.Fraction holding the exact average.)

window_kv_bytes_per_token_per_layer
    head_dim (FP8 E4M3) + head_dim/32 (UE8M0 scale per 32) = 528 B per slot per layer for
    full(); bounded by sliding_window slots per layer, so not part of the global figure.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from fractions import Fraction
from typing import Iterator, Optional

import sympy as sp

from v41graph.model.config import V41Config
from v41graph.model.layer_plan import LayerRole, build_layer_plan

# --------------------------------------------------------------------------- symbols
# Named after the config fields they stand for.
d = sp.Symbol("hidden_size", positive=True, integer=True)
V = sp.Symbol("vocab_size", positive=True, integer=True)
H = sp.Symbol("num_attention_heads", positive=True, integer=True)
Dh = sp.Symbol("head_dim", positive=True, integer=True)
q_lora = sp.Symbol("q_lora_rank", positive=True, integer=True)
o_groups = sp.Symbol("o_groups", positive=True, integer=True)
o_lora = sp.Symbol("o_lora_rank", positive=True, integer=True)
hc = sp.Symbol("hc_mult", positive=True, integer=True)
E = sp.Symbol("n_routed_experts", positive=True, integer=True)
n_shared = sp.Symbol("n_shared_experts", nonnegative=True, integer=True)
k_act = sp.Symbol("num_experts_per_tok", positive=True, integer=True)
inter = sp.Symbol("moe_intermediate_size", positive=True, integer=True)
idx_heads = sp.Symbol("index_n_heads", positive=True, integer=True)
idx_dim = sp.Symbol("index_head_dim", positive=True, integer=True)
ngram = sp.Symbol("engram_max_ngram_size", positive=True, integer=True)
e_heads = sp.Symbol("engram_n_heads", positive=True, integer=True)
e_dim = sp.Symbol("engram_head_dim", positive=True, integer=True)
e_rows = sp.Symbol("engram_num_embeddings", positive=True, integer=True)   # one table
E_ds = sp.Symbol("dspark_n_routed_experts", positive=True, integer=True)
markov_rank = sp.Symbol("dspark_markov_rank", positive=True, integer=True)
n_targets = sp.Symbol("n_dspark_targets", positive=True, integer=True)      # len(dspark_target_layer_ids)
W = sp.Symbol("sliding_window", positive=True, integer=True)

# Aggregates used by the activated-parameter formulas.
n_prompt = sp.Symbol("n_prompt", positive=True, integer=True)
n_replay = sp.Symbol("n_replay", positive=True, integer=True)    # min(sliding_window, n_prompt)
A_enc = sp.Symbol("A_enc", nonnegative=True)   # activated weights per token, encoder layers
A_dec = sp.Symbol("A_dec", nonnegative=True)   # activated weights per token, decoder layers
K_dec = sp.Symbol("K_dec", nonnegative=True)   # decoder KV-build weights run on every prompt token

# Layer counts of one segment (encoder or decoder), for segment_activated_formula().
n_layers = sp.Symbol("n_layers", nonnegative=True, integer=True)
n_full_r1 = sp.Symbol("n_full_r1", nonnegative=True, integer=True)        # kv sources, ratio 1
n_full_gated = sp.Symbol("n_full_gated", nonnegative=True, integer=True)  # kv sources, ratio > 1
n_reindex = sp.Symbol("n_reindex", nonnegative=True, integer=True)
n_engram = sp.Symbol("n_engram", nonnegative=True, integer=True)


def kv_ratio_symbol(layer_id: int) -> sp.Symbol:
    """The compression-ratio symbol of kv source layer `layer_id` (r_2, r_8, ...)."""
    return sp.Symbol(f"r_{layer_id}", positive=True, integer=True)


# --------------------------------------------------------------------------- formulas
def module_param_formulas() -> dict[str, sp.Expr]:
    """Weight elements per module instance, from the checkpoint tensor shapes."""
    return dict(_module_param_formulas())


@lru_cache(maxsize=None)
def _module_param_formulas() -> dict[str, sp.Expr]:
    mods = {
        # wq_a [q_lora, d], q_norm [q_lora], wq_b [H*Dh, q_lora], wkv [Dh, d], kv_norm [Dh],
        # wo_a [o_groups*o_lora, H*Dh/o_groups], wo_b [d, o_groups*o_lora], attn_sink [H]
        "attn": (q_lora * d + q_lora + H * Dh * q_lora + Dh * d + Dh
                 + o_groups * o_lora * (H * Dh / o_groups) + d * o_groups * o_lora + H),
        "compressor_r1": Dh * d + Dh,                    # wkv [Dh, d], norm [Dh]
        "compressor_gated": 2 * Dh * d + Dh,             # wkv, wgate [Dh, d], norm [Dh]
        "indexer_query": idx_heads * idx_dim * q_lora + idx_heads * d,   # wq_b, weights_proj
        "indexer_key": idx_dim * Dh + idx_dim,           # wk [idx_dim, Dh], k_norm [idx_dim]
        # hc_{attn,ffn}_fn [(2+hc)*hc, hc*d], _base [(2+hc)*hc], _scale [3]
        "hc": 2 * ((2 + hc) * hc * hc * d + (2 + hc) * hc + 3),
        "block_norms": 2 * d,                            # attn_norm, ffn_norm
        "gate": E * d + E,                               # gate.weight [E, d], gate.bias [E]
        "expert": 3 * inter * d,                         # w1, w3 [inter, d], w2 [d, inter]
        "embed": V * d,
        "head": V * d,
        "final_norm": d,
        # wkv [(hc+1)*d, (N-1)*heads*head_dim], q_weight and k_weight [hc, d]
        "engram_dense": (hc + 1) * d * (ngram - 1) * e_heads * e_dim + 2 * hc * d,
        "engram_table": e_rows * e_dim,
        "engram_rows_per_token": (ngram - 1) * e_heads,  # a row count, not parameters
        "dspark_gate": E_ds * d + E_ds,
        "dspark_context": n_targets * d * d + d,         # mtp.0.main_proj [d, n*d], main_norm
        # last stage: norm [d], markov_head.embed/head [V, rank], confidence_head.proj [1, d+rank]
        "dspark_output": d + 2 * V * markov_rank + (d + markov_rank),
    }
    # Dense part of every block (what a token runs besides experts and attention extras).
    mods["block_dense"] = mods["attn"] + mods["hc"] + mods["block_norms"] + mods["gate"]
    return {k: sp.expand(v) for k, v in mods.items()}


def segment_activated_formula() -> sp.Expr:
    """Weights one token touches in a run of layers (encoder or decoder segment).

    n_layers blocks of dense weights + (num_experts_per_tok + n_shared_experts) experts each,
    plus the compressor and indexer of the layers whose mode has them, plus the Engram layers
    applied before blocks of the segment (dense weights + gathered rows).
    """
    m = _module_symbols()
    return (n_layers * (m["block_dense"] + (k_act + n_shared) * m["expert"])
            + n_full_r1 * (m["compressor_r1"] + m["indexer_query"] + m["indexer_key"])
            + n_full_gated * (m["compressor_gated"] + m["indexer_query"] + m["indexer_key"])
            + n_reindex * m["indexer_query"]
            + n_engram * (m["engram_dense"] + m["engram_rows_per_token"] * e_dim))


def activated_params_formula(phase: str = "decode") -> sp.Expr:
    """Activated parameters per token (see the module docstring for the definitions).

    decode:  d + A_enc + A_dec + V*d + d
    prefill: d + A_enc + K_dec + (n_replay*(A_dec - K_dec) + V*d + d) / n_prompt
             (`accounting` reports the limit n_prompt -> oo, i.e. d + A_enc + K_dec)
    """
    head = V * d + d                       # head + final norm
    if phase == "decode":
        return d + A_enc + A_dec + head
    if phase == "prefill":
        return d + A_enc + K_dec + (n_replay * (A_dec - K_dec) + head) / n_prompt
    raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")


def global_kv_bytes_formula(config: Optional[V41Config] = None) -> sp.Expr:
    """Global KV bytes per token: Σ over the kv sources i of (main_row + index_row) / r_i.

    Symbols: head_dim, index_head_dim and one ratio symbol r_<layer id> per kv source of
    `config` (default full(): r_2, r_8, r_14, r_20).
    """
    config = config or V41Config.full()
    main_row = Dh / 2 + Dh / 16             # FP4 E2M1 packed + one E4M3 scale per 16
    index_row = idx_dim / 2 + idx_dim / 32  # FP4 E2M1 packed + one E8M0 scale per 32
    return sum(((main_row + index_row) / kv_ratio_symbol(i)
                for i in config.kv_source_layer_ids), sp.Integer(0))


def window_kv_bytes_formula() -> sp.Expr:
    """Window KV bytes per cached slot per layer: FP8 E4M3 + one UE8M0 scale per 32."""
    return Dh + Dh / 32


# --------------------------------------------------------------------------- substitution
def _module_symbols() -> dict[str, sp.Symbol]:
    return {k: sp.Symbol(f"P_{k}", nonnegative=True) for k in _module_param_formulas()}


def config_symbol_values(config: V41Config) -> dict[sp.Symbol, int]:
    """Values of the config-field symbols (per-table Engram rows excluded: they differ)."""
    c = config
    return {d: c.hidden_size, V: c.vocab_size, H: c.num_attention_heads, Dh: c.head_dim,
            q_lora: c.q_lora_rank, o_groups: c.o_groups, o_lora: c.o_lora_rank,
            hc: c.hc_mult, E: c.n_routed_experts, n_shared: c.n_shared_experts,
            k_act: c.num_experts_per_tok, inter: c.moe_intermediate_size,
            idx_heads: c.index_n_heads, idx_dim: c.index_head_dim,
            ngram: c.engram_max_ngram_size, e_heads: c.engram_n_heads, e_dim: c.engram_head_dim,
            E_ds: c.dspark_n_routed_experts, markov_rank: c.dspark_markov_rank,
            n_targets: len(c.dspark_target_layer_ids), W: c.sliding_window}


def _to_int(expr: sp.Expr) -> int:
    expr = sp.nsimplify(expr)
    if not (expr.is_Integer):
        raise ValueError(f"expected an integer count, got {expr}")
    return int(expr)


def _exact(expr: sp.Expr):
    """int if integral, else fractions.Fraction (exact)."""
    expr = sp.Rational(expr)
    return int(expr) if expr.q == 1 else Fraction(int(expr.p), int(expr.q))


def module_params(config: V41Config) -> dict[str, int]:
    """module_param_formulas() evaluated for `config`, except `engram_table`, whose row count
    differs per table (engram_num_embeddings[i] x engram_head_dim)."""
    vals = config_symbol_values(config)
    out = {}
    for k, f in module_param_formulas().items():
        if e_rows in f.free_symbols:
            continue
        out[k] = _to_int(f.subs(vals))
    return out


def n_encoder_layers_default(config: V41Config) -> int:
    """First decoder layer = the last kv source (full(): 20 = num_hidden_layers / 2)."""
    return max(config.kv_source_layer_ids)


def _segment_counts(plan: list[LayerRole], lo: int, hi: int, config: V41Config) -> dict:
    roles = [r for r in plan if lo <= r.layer_id < hi]
    return {n_layers: len(roles),
            n_full_r1: sum(r.mode == "full" and r.ratio == 1 for r in roles),
            n_full_gated: sum(r.mode == "full" and r.ratio > 1 for r in roles),
            n_reindex: sum(r.mode == "reindex" for r in roles),
            n_engram: sum(r.engram_slot is not None for r in roles)}


def activated_params(config: V41Config, phase: str = "decode",
                     n_prompt_tokens: Optional[int] = None,
                     n_encoder_layers: Optional[int] = None):
    """Activated params per token for `phase`; prefill: at n_prompt_tokens (None = the limit).

    Returns an int, or a Fraction for a finite prefill average that is not integral.
    """
    plan = build_layer_plan(config)
    n_enc = n_encoder_layers_default(config) if n_encoder_layers is None else n_encoder_layers
    if not 0 <= n_enc <= config.num_hidden_layers:
        raise ValueError(f"n_encoder_layers {n_enc} out of range 0..{config.num_hidden_layers}")
    mods = module_params(config)
    msyms = _module_symbols()
    mvals = {msyms[k]: v for k, v in mods.items()}
    cvals = config_symbol_values(config)
    seg = segment_activated_formula().subs(mvals).subs(cvals)
    a_enc = seg.subs(_segment_counts(plan, 0, n_enc, config))
    a_dec = seg.subs(_segment_counts(plan, n_enc, config.num_hidden_layers, config))
    # Decoder kv sources build their global KV over every prompt token: attn_norm, compressor,
    # index keys (their input is the encoder output; the collapse uses the previous FFN's pre).
    k_dec = 0
    for r in plan[n_enc:]:
        if r.mode == "full":
            comp = mods["compressor_r1"] if r.ratio == 1 else mods["compressor_gated"]
            k_dec += config.hidden_size + comp + mods["indexer_key"]
    expr = activated_params_formula(phase).subs({A_enc: a_enc, A_dec: a_dec, K_dec: k_dec})
    expr = expr.subs(cvals)
    if phase == "prefill":
        if n_prompt_tokens is None:   # the terms over n_prompt vanish (limit n_prompt -> oo)
            expr = expr.subs(n_replay, config.sliding_window).subs(n_prompt, sp.oo)
        else:
            if n_prompt_tokens < 1:
                raise ValueError("n_prompt_tokens must be >= 1")
            expr = expr.subs({n_replay: min(config.sliding_window, n_prompt_tokens),
                              n_prompt: n_prompt_tokens})
    return _exact(expr)


def global_kv_bytes(config: V41Config):
    """global_kv_bytes_formula(config) with the config's head dims and source ratios."""
    build_layer_plan(config)  # validates sources / ratios
    ratios = {kv_ratio_symbol(i): config.compress_ratios[i] for i in config.kv_source_layer_ids}
    expr = global_kv_bytes_formula(config).subs(ratios).subs(
        {Dh: config.head_dim, idx_dim: config.index_head_dim})
    return _exact(expr)


def window_kv_bytes(config: V41Config):
    return _exact(window_kv_bytes_formula().subs(Dh, config.head_dim))


# --------------------------------------------------------------------------- checkpoint shapes
def checkpoint_shapes(config: V41Config) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, logical shape) of every weight tensor in the checkpoint, scales excluded.

    Names are the reference `state_dict()` names (as in the golden checkpoint); FP4 expert
    weights are given with their logical [out, in] shape. Independent of the formulas above,
    so tests can check one against the other.
    """
    c = config
    dd, hd = c.hidden_size, c.head_dim
    mix = (2 + c.hc_mult) * c.hc_mult

    def block(prefix: str, n_experts: int, role: Optional[LayerRole]):
        a = prefix + "attn."
        yield a + "wq_a.weight", (c.q_lora_rank, dd)
        yield a + "q_norm.weight", (c.q_lora_rank,)
        yield a + "wq_b.weight", (c.num_attention_heads * hd, c.q_lora_rank)
        yield a + "wkv.weight", (hd, dd)
        yield a + "kv_norm.weight", (hd,)
        yield a + "wo_a.weight", (c.o_groups * c.o_lora_rank,
                                  c.num_attention_heads * hd // c.o_groups)
        yield a + "wo_b.weight", (dd, c.o_groups * c.o_lora_rank)
        yield a + "attn_sink", (c.num_attention_heads,)
        if role is not None and role.mode == "full":
            yield a + "compressor.wkv.weight", (hd, dd)
            if role.ratio > 1:
                yield a + "compressor.wgate.weight", (hd, dd)
            yield a + "compressor.norm.weight", (hd,)
        if role is not None and role.mode in ("full", "reindex"):
            yield a + "indexer.wq_b.weight", (c.index_n_heads * c.index_head_dim, c.q_lora_rank)
            yield a + "indexer.weights_proj.weight", (c.index_n_heads, dd)
            if role.mode == "full":
                yield a + "indexer.wk.weight", (c.index_head_dim, hd)
                yield a + "indexer.k_norm.weight", (c.index_head_dim,)
        yield prefix + "attn_norm.weight", (dd,)
        yield prefix + "ffn_norm.weight", (dd,)
        f = prefix + "ffn."
        yield f + "gate.weight", (n_experts, dd)
        yield f + "gate.bias", (n_experts,)
        for e in range(n_experts):
            yield f"{f}experts.{e}.w1.weight", (c.moe_intermediate_size, dd)
            yield f"{f}experts.{e}.w2.weight", (dd, c.moe_intermediate_size)
            yield f"{f}experts.{e}.w3.weight", (c.moe_intermediate_size, dd)
        if c.n_shared_experts:
            si = c.n_shared_experts * c.moe_intermediate_size
            yield f + "shared_experts.w1.weight", (si, dd)
            yield f + "shared_experts.w2.weight", (dd, si)
            yield f + "shared_experts.w3.weight", (si, dd)
        for sub in ("attn", "ffn"):
            yield f"{prefix}hc_{sub}_fn", (mix, c.hc_mult * dd)
            yield f"{prefix}hc_{sub}_base", (mix,)
            yield f"{prefix}hc_{sub}_scale", (3,)

    yield "embed.weight", (c.vocab_size, dd)
    yield "head.weight", (c.vocab_size, dd)
    yield "norm.weight", (dd,)
    for role in build_layer_plan(c):
        p = f"layers.{role.layer_id}."
        yield from block(p, c.n_routed_experts, role)
        if role.engram_slot is not None:
            g = p + "engram."
            yield g + "embed.weight", (c.engram_num_embeddings[role.engram_slot],
                                       c.engram_head_dim)
            yield g + "wkv.weight", ((c.hc_mult + 1) * dd, (c.engram_max_ngram_size - 1)
                                     * c.engram_n_heads * c.engram_head_dim)
            yield g + "q_weight", (c.hc_mult, dd)
            yield g + "k_weight", (c.hc_mult, dd)
    n_stages = c.num_nextn_predict_layers
    for s in range(n_stages):
        p = f"mtp.{s}."
        yield from block(p, c.dspark_n_routed_experts, None)
        if s == 0:
            yield p + "main_proj.weight", (dd, len(c.dspark_target_layer_ids) * dd)
            yield p + "main_norm.weight", (dd,)
        if s == n_stages - 1:
            yield p + "norm.weight", (dd,)
            yield p + "markov_head.embed.weight", (c.vocab_size, c.dspark_markov_rank)
            yield p + "markov_head.head.weight", (c.vocab_size, c.dspark_markov_rank)
            yield p + "confidence_head.proj.weight", (1, dd + c.dspark_markov_rank)


# --------------------------------------------------------------------------- the summary
@dataclass(frozen=True)
class Accounting:
    backbone_params: int
    engram_params: int
    activated_params_prefill: int
    activated_params_decode: int
    global_kv_bytes_per_token: int
    window_kv_bytes_per_token_per_layer: int
    dspark_params: int = 0          # mtp.* stages, not part of the backbone
    n_encoder_layers: int = 0       # the encoder/decoder split used for prefill


def _param_totals(config: V41Config) -> tuple[int, int, int]:
    """(backbone, engram, dspark) from the module formulas and the layer plan."""
    c = config
    plan = build_layer_plan(c)
    m = module_params(c)
    backbone = m["embed"] + m["head"] + m["final_norm"]
    for r in plan:
        backbone += m["block_dense"] + (c.n_routed_experts + c.n_shared_experts) * m["expert"]
        if r.mode == "full":
            backbone += (m["compressor_r1"] if r.ratio == 1 else m["compressor_gated"])
            backbone += m["indexer_query"] + m["indexer_key"]
        elif r.mode == "reindex":
            backbone += m["indexer_query"]
    table = module_param_formulas()["engram_table"]
    engram = sum(m["engram_dense"] + _to_int(table.subs({e_rows: rows, e_dim: c.engram_head_dim}))
                 for rows in c.engram_num_embeddings)
    n_st = c.num_nextn_predict_layers
    dspark = 0
    if n_st:
        # A DSpark block is a window-only block with its own gate width and expert count.
        block = (m["block_dense"] - m["gate"] + m["dspark_gate"]
                 + (c.dspark_n_routed_experts + c.n_shared_experts) * m["expert"])
        dspark = n_st * block + m["dspark_context"] + m["dspark_output"]
    return backbone, engram, dspark


def accounting(config: V41Config, n_encoder_layers: Optional[int] = None) -> Accounting:
    """All headline numbers for `config` (definitions in the module docstring)."""
    backbone, engram, dspark = _param_totals(config)
    n_enc = n_encoder_layers_default(config) if n_encoder_layers is None else n_encoder_layers
    return Accounting(
        backbone_params=backbone,
        engram_params=engram,
        activated_params_prefill=activated_params(config, "prefill", n_encoder_layers=n_enc),
        activated_params_decode=activated_params(config, "decode", n_encoder_layers=n_enc),
        global_kv_bytes_per_token=global_kv_bytes(config),
        window_kv_bytes_per_token_per_layer=window_kv_bytes(config),
        dspark_params=dspark,
        n_encoder_layers=n_enc,
    )


def human_count(n) -> str:
    """552.3B / 7.8M / 12.3K / 512."""
    n = float(n)
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:g}"


def format_accounting(acc: Accounting) -> str:
    """A short human-readable table for the demo."""
    def b(x) -> str:
        return f"{float(x):g} B/token" if isinstance(x, Fraction) else f"{x} B/token"
    rows = [
        ("backbone params (embed+head+layers, no Engram/DSpark)", human_count(acc.backbone_params)),
        ("Engram params (tables + wkv + q/k weights)", human_count(acc.engram_params)),
        ("DSpark params (mtp.*, not in backbone)", human_count(acc.dspark_params)),
        (f"activated / token, prefill (CED, {acc.n_encoder_layers} encoder layers, long prompt)",
         human_count(acc.activated_params_prefill)),
        ("activated / token, decode", human_count(acc.activated_params_decode)),
        ("global KV", b(acc.global_kv_bytes_per_token)),
        ("window KV per layer (bounded, not in global)", b(acc.window_kv_bytes_per_token_per_layer)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
