"""V41Config: the model's hyper-parameters, named exactly as in the released `config.json`.

Three ready-made sizes:
  full()  the released DeepSeek-V4.1-Flash values (MODEL.md §1)
  tiny()  a CPU test size that keeps every structural feature of the layer plan
  bench() real per-layer widths with fewer experts / smaller Engram tables (fits one H200)

`V41Config.from_json` also accepts DeepSeek's reference `inference/config.json` names
(`dim`, `n_layers`, `window_size`, ...), which is what the golden vectors ship with.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


logger = logging.getLogger(__name__)

V41GRAPH_ONLY = {"v41graph_only": True}     # field metadata: a setting of ours, not of the release
SIDECAR = "v41graph.json"                   # where a checkpoint keeps those settings


def _default_rope_scaling() -> dict:
    return {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1}


@dataclass
class V41Config:
    # --- sizes ---
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    rms_norm_eps: float = 1e-20
    # --- positions ---
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict = field(default_factory=_default_rope_scaling)
    max_position_embeddings: int = 1048576
    sliding_window: int = 128
    # --- layer plan (one ratio per backbone layer, then one 0 per DSpark stage) ---
    compress_ratios: list = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    # --- MoE ---
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    # --- mHC ---
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # --- Engram ---
    engram_layer_ids: list = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    # --- DSpark (speculative head; modules come with the serving runtime) ---
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # --- weights ---
    quantization_config: dict = field(default_factory=lambda: {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0", "expert_dtype": "fp4"})
    torch_dtype: str = "bfloat16"
    # --- v41graph's own switches (not in the released config.json: save_pretrained writes them
    # to v41graph.json beside it) ---
    # Fake-quant points of MODEL.md §10 (cache formats, indexer q/k, GEMM activations).
    fake_quant: bool = field(default=True, metadata=V41GRAPH_ONLY)
    # "checkpoint": FP8/FP4 weights as released; "dense": every Linear dense in torch_dtype
    # (random-weight tests and speed experiments).
    weight_format: str = field(default="checkpoint", metadata=V41GRAPH_ONLY)
    # --- config.json keys v41graph does not use (pad_token_id, architectures, model_type, bos/eos
    # ids, the reference's runtime knobs...): kept as read, written back by save_pretrained ---
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self)

    # ------------------------------------------------------------------ derived
    # YaRN parameters, read from rope_scaling with the reference's defaults
    rope_factor = property(lambda self: float(self.rope_scaling.get("factor", 1)))
    original_seq_len = property(lambda self: int(self.rope_scaling.get("original_max_position_embeddings", 0)))
    beta_fast = property(lambda self: float(self.rope_scaling.get("beta_fast", 32)))
    beta_slow = property(lambda self: float(self.rope_scaling.get("beta_slow", 1)))

    # ------------------------------------------------------------------ sizes
    @classmethod
    def full(cls) -> "V41Config":
        """The released DeepSeek-V4.1-Flash configuration."""
        return cls()

    @classmethod
    def tiny(cls, **overrides: Any) -> "V41Config":
        """CPU test size that keeps every structural feature.

        Layers: 0-1 window only; 2-5 ratio 2 (Full 2 and 4, Reuse 3 and 5); 6-9 ratio 1 (Full
        candidate source 6, Reuse 7 and 9, Reindex 8). Engram before layers 1 and 4. Window 8,
        top-k 4 and 3 candidate blocks of 4 so prompts of a few dozen tokens cross the window,
        saturate top-k and prune candidate blocks ((3-1)*4 >= 4 keeps Reindex well defined).
        """
        cfg = cls(
            vocab_size=256, hidden_size=64, num_hidden_layers=10,
            num_attention_heads=4, head_dim=32, qk_rope_head_dim=16,
            q_lora_rank=32, o_groups=2, o_lora_rank=32,
            max_position_embeddings=4096, sliding_window=8,
            compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0],
            kv_source_layer_ids=[2, 4, 6], index_source_layer_ids=[2, 4, 6, 8],
            index_n_heads=4, index_head_dim=32, index_topk=4,
            candidate_source_layer_id=6, candidate_topk_blocks=3, candidate_block_size=4,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
            moe_intermediate_size=32,
            engram_layer_ids=[1, 4], engram_num_embeddings=[280, 434],
            engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32,
            engram_vocab_size=37, engram_compressed_vocab_size=256, engram_pad_token_id=2,
            dspark_noise_token_id=255, dspark_target_layer_ids=[7, 8, 9], dspark_markov_rank=16,
            dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
            torch_dtype="float32", weight_format="dense",
        )
        return dataclasses.replace(cfg, **overrides)

    @classmethod
    def bench(cls, **overrides: Any) -> "V41Config":
        """Real per-layer widths (all 40 layers, 5120 hidden, 64x512 heads), 16 experts and
        small Engram tables: ~30B parameters, ~60 GB in bf16, so it fits one 141 GB GPU."""
        from .engram_hash import engram_primes, engram_table_rows
        kwargs = {"n_routed_experts": 16, "engram_vocab_size": 40000, "dspark_n_routed_experts": 16,
                  **overrides}
        defaults = cls()
        value = lambda name: kwargs.get(name, getattr(defaults, name))   # noqa: E731
        primes = engram_primes(value("engram_vocab_size"), value("engram_layer_ids"),
                               value("engram_max_ngram_size"), value("engram_n_heads"))
        kwargs["engram_num_embeddings"] = [engram_table_rows(p) for p in primes]
        return cls(**kwargs)

    @classmethod
    def bench_rank(cls, **overrides: Any) -> "V41Config":
        """One EP8 rank's share of the released model on one GPU: bench()'s real widths and
        small Engram tables, 48 of the 384 routed experts per layer (top-6 of them) and the
        released weight formats (FP8 E4M3 + E8M0/32x32 projections, MXFP4 experts): ~49 GB as
        stored, what one of eight H200s holds of the 384-expert model's layers."""
        return cls.bench(**{"n_routed_experts": 48, "weight_format": "checkpoint", **overrides})

    # ------------------------------------------------------------------ (de)serialisation
    # DeepSeek's reference `inference/config.json` names -> released HF names.
    REFERENCE_NAMES = {
        "dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
        "n_mtp_layers": "num_nextn_predict_layers", "window_size": "sliding_window",
        "kv_source_layers": "kv_source_layer_ids", "index_source_layers": "index_source_layer_ids",
        "candidate_source_layer": "candidate_source_layer_id",
        "n_activated_experts": "num_experts_per_tok",
        "dspark_n_activated_experts": "dspark_num_experts_per_tok",
        "moe_inter_dim": "moe_intermediate_size", "route_scale": "routed_scaling_factor",
        "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps",
        "engram_pad_id": "engram_pad_token_id", "score_func": "scoring_func",
    }
    _ROPE_SCALING_NAMES = {"original_seq_len": "original_max_position_embeddings",
                           "rope_factor": "factor", "beta_fast": "beta_fast",
                           "beta_slow": "beta_slow"}
    @classmethod
    def from_dict(cls, raw: dict) -> "V41Config":
        """A config from config.json's keys: the released names, the reference's names
        (REFERENCE_NAMES), v41graph's own settings; any other key is kept in `extra` as read
        (with a warning when it looks like a misspelt field)."""
        raw = dict(raw.get("text_config", raw)) if "text_config" in raw else dict(raw)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra = dict(raw.pop("extra", None) or {})
        rope_scaling = dict(raw.pop("rope_scaling", None) or _default_rope_scaling())
        for key, value in raw.items():
            if key in cls._ROPE_SCALING_NAMES:
                rope_scaling[cls._ROPE_SCALING_NAMES[key]] = value
                continue
            name = cls.REFERENCE_NAMES.get(key, key)
            if name in names:
                kwargs[name] = list(value) if isinstance(value, tuple) else value
                continue
            close = difflib.get_close_matches(key, names, n=1, cutoff=0.85)
            if close:
                logger.warning("config.json: unknown field %r kept as is (did you mean %r?)", key, close[0])
            extra[key] = value
        kwargs["rope_scaling"] = rope_scaling
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> "V41Config":
        """Load a config.json, or the config.json inside a checkpoint directory (with the
        v41graph.json beside it, when there is one: v41graph's own settings)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        raw = _read_json(path)
        sidecar = path.parent / SIDECAR
        if path.name == "config.json" and sidecar.is_file():
            ours = _read_json(sidecar)
            known = {f.name for f in dataclasses.fields(cls) if f.metadata.get("v41graph_only")}
            if not set(ours) <= known:
                raise ValueError(f"{sidecar}: unknown v41graph settings {sorted(set(ours) - known)} "
                                 f"(known: {sorted(known)})")
            raw.update(ours)
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from exc

    def to_dict(self) -> dict:
        """Every field, v41graph's settings and `extra` included (what save_json writes)."""
        return dataclasses.asdict(self)

    def to_hf_dict(self) -> dict:
        """config.json as released: the keys it was read with (`extra`) and every model field,
        without v41graph's own settings."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "extra" and not f.metadata.get("v41graph_only")}
        return {**self.extra, **fields}

    def save_json(self, path: str | Path) -> None:
        """One JSON file with every field (from_json reads it back)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def save_pretrained(self, directory: str | Path) -> None:
        """A checkpoint's config: config.json as released (to_hf_dict) and v41graph's own
        settings in v41graph.json beside it."""
        directory = Path(directory)
        (directory / "config.json").write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")
        ours = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("v41graph_only")}
        (directory / SIDECAR).write_text(json.dumps(ours, indent=2) + "\n")


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw



# ============================================================================ validation
QUANT_BLOCK = 32     # activation / cache quantization block along a row (reference.QUANT_BLOCK)

_POSITIVE = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "max_position_embeddings",
    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "candidate_topk_blocks",
    "candidate_block_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
    "hc_mult", "hc_sinkhorn_iters", "engram_n_heads", "engram_head_dim", "engram_vocab_size",
    "engram_compressed_vocab_size", "dspark_block_size", "dspark_markov_rank",
    "dspark_n_routed_experts", "dspark_num_experts_per_tok")
_NON_NEGATIVE = ("n_shared_experts", "num_nextn_predict_layers", "candidate_source_layer_id",
                 "engram_pad_token_id", "dspark_noise_token_id")
_POSITIVE_FLOATS = ("rope_theta", "compress_rope_theta", "routed_scaling_factor", "swiglu_limit")
_NON_NEGATIVE_FLOATS = ("rms_norm_eps", "hc_eps")
_CHOICES = {"scoring_func": ("sqrtsoftplus",), "topk_method": ("noaux_tc",), "hidden_act": ("silu",),
            "torch_dtype": ("bfloat16", "float16", "float32"), "weight_format": ("checkpoint", "dense")}
_TYPES = {"int": int, "float": (int, float), "bool": bool, "str": str, "list": list, "dict": dict}


def _fail(name: str, rule: str, value=None):
    raise ValueError(f"config field {name!r}: {rule}" + ("" if value is None else f", got {value!r}"))


def check_fields(cfg: V41Config) -> None:
    """Every field's type, range and the rules between fields, at construction: a config that
    would build and then fail in the first forward (or run with nonsense) is refused here, naming
    the field and the rule. The layer plan's rules (which layer is what) are build_layer_plan's."""
    for f in dataclasses.fields(cfg):
        value, want = getattr(cfg, f.name), _TYPES[f.type]
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise TypeError(f"config field {f.name!r} must be {f.type}, got {type(value).__name__} {value!r}")
        if isinstance(value, list) and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError(f"config field {f.name!r} must be a list of ints, got {value!r}")
    for name in _POSITIVE:
        if getattr(cfg, name) <= 0:
            _fail(name, "must be > 0", getattr(cfg, name))
    for name in _NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            _fail(name, "must be >= 0", getattr(cfg, name))
    for name in _POSITIVE_FLOATS + _NON_NEGATIVE_FLOATS:
        value = getattr(cfg, name)
        if not math.isfinite(value) or value < 0 or (value == 0 and name in _POSITIVE_FLOATS):
            _fail(name, "must be a finite number " + ("> 0" if name in _POSITIVE_FLOATS else ">= 0"), value)
    for name, choices in _CHOICES.items():
        if getattr(cfg, name) not in choices:
            _fail(name, f"must be one of {list(choices)}", getattr(cfg, name))
    # attention
    if cfg.num_attention_heads % cfg.o_groups:
        _fail("o_groups", f"must divide num_attention_heads ({cfg.num_attention_heads})", cfg.o_groups)
    if cfg.head_dim % QUANT_BLOCK:
        _fail("head_dim", f"must be a multiple of the quantization block {QUANT_BLOCK}", cfg.head_dim)
    if cfg.qk_rope_head_dim % 2 or cfg.qk_rope_head_dim > cfg.head_dim:
        _fail("qk_rope_head_dim", f"must be even and at most head_dim ({cfg.head_dim})", cfg.qk_rope_head_dim)
    if cfg.index_head_dim % QUANT_BLOCK or cfg.qk_rope_head_dim > cfg.index_head_dim:
        _fail("index_head_dim", f"must be a multiple of {QUANT_BLOCK} and at least qk_rope_head_dim "
              f"({cfg.qk_rope_head_dim})", cfg.index_head_dim)
    if cfg.weight_format == "checkpoint":     # the blockwise GEMM's K blocks
        for name, k in (("hidden_size", cfg.hidden_size), ("q_lora_rank", cfg.q_lora_rank),
                        ("moe_intermediate_size", cfg.moe_intermediate_size),
                        ("o_lora_rank * o_groups", cfg.o_lora_rank * cfg.o_groups)):
            if k % QUANT_BLOCK:
                _fail(name, f"must be a multiple of {QUANT_BLOCK} with weight_format='checkpoint' "
                      "(FP8/FP4 weights are scaled per 32 along K)", k)
    # MoE
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        _fail("num_experts_per_tok", f"must be at most n_routed_experts ({cfg.n_routed_experts})",
              cfg.num_experts_per_tok)
    if cfg.dspark_num_experts_per_tok > cfg.dspark_n_routed_experts:
        _fail("dspark_num_experts_per_tok", f"must be at most dspark_n_routed_experts "
              f"({cfg.dspark_n_routed_experts})", cfg.dspark_num_experts_per_tok)
    # token ids and Engram
    for name in ("engram_pad_token_id", "dspark_noise_token_id"):
        if getattr(cfg, name) >= cfg.vocab_size:
            _fail(name, f"must be a token id below vocab_size ({cfg.vocab_size})", getattr(cfg, name))
    if cfg.engram_max_ngram_size < 2:
        _fail("engram_max_ngram_size", "must be >= 2 (Engram hashes 2-grams and longer)", cfg.engram_max_ngram_size)
    if any(n <= 0 for n in cfg.engram_num_embeddings):
        _fail("engram_num_embeddings", "every table must have > 0 rows", cfg.engram_num_embeddings)
    if any(r < 0 for r in cfg.compress_ratios):
        _fail("compress_ratios", "every ratio must be >= 0", cfg.compress_ratios)
    for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
        value = cfg.rope_scaling.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            _fail(f"rope_scaling.{key}", "must be a number >= 0", value)
