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
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
    # --- v41graph's own switches (not in the checkpoint) ---
    # Fake-quant points of MODEL.md §10 (cache formats, indexer q/k, GEMM activations).
    fake_quant: bool = True
    # "checkpoint": FP8/FP4 weights as released; "dense": every Linear dense in torch_dtype
    # (random-weight tests and speed experiments).
    weight_format: str = "checkpoint"

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
        cfg = cls(n_routed_experts=16, engram_vocab_size=40000,
                  engram_num_embeddings=[0, 0], dspark_n_routed_experts=16)
        cfg = dataclasses.replace(cfg, **overrides)
        from .engram_hash import engram_primes, engram_table_rows
        primes = engram_primes(cfg.engram_vocab_size, cfg.engram_layer_ids,
                               cfg.engram_max_ngram_size, cfg.engram_n_heads)
        cfg.engram_num_embeddings = [engram_table_rows(p) for p in primes]
        return cfg

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
    # Reference-only runtime knobs that are not model hyper-parameters.
    _IGNORED = {"max_batch_size", "max_seq_len", "temperature", "dtype", "expert_dtype",
                "gate_temp", "vision_n_layers", "architectures", "model_type",
                "transformers_version", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                "text_config", "initializer_range", "use_cache", "attention_bias"}

    @classmethod
    def from_dict(cls, raw: dict) -> "V41Config":
        raw = dict(raw.get("text_config", raw)) if "text_config" in raw else dict(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        rope_scaling = dict(raw.pop("rope_scaling", None) or _default_rope_scaling())
        for key, value in raw.items():
            if key in cls._ROPE_SCALING_NAMES:
                rope_scaling[cls._ROPE_SCALING_NAMES[key]] = value
                continue
            key = cls.REFERENCE_NAMES.get(key, key)
            if key in names:
                kwargs[key] = list(value) if isinstance(value, tuple) else value
            elif key not in cls._IGNORED:
                raise ValueError(f"config.json: unknown field {key!r}")
        kwargs["rope_scaling"] = rope_scaling
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> "V41Config":
        """Load a config.json, or the config.json inside a checkpoint directory."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")
