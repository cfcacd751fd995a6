"""Load a checkpoint in the official DeepSeek-V4.1-Flash layout (minimal loader).

Official tensor names (MODEL.md, DeepSeek's convert.py) map onto the modules here; FP8 / FP4
weights and E8M0 scales are kept as their raw bytes. DSpark stages (`mtp.*`) are not part of
the backbone model and are skipped (the serving runtime loads them). The weights issue adds
sharding hooks, streaming and save_pretrained on top of this.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import V41Config
from .engram_hash import build_compressed_token_map
from .model import V41Model

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def official_to_module_name(name: str, model: V41Model) -> str | None:
    """Official checkpoint name -> our parameter name (None for tensors we do not hold)."""
    if name.startswith("mtp."):
        return None
    if name == "head.weight":
        return "head"
    parts = name.split(".")
    if parts[0] == "layers":
        layer = int(parts[1])
        rest = ".".join(parts[2:])
        if rest.startswith("hc_"):                      # hc_attn_fn -> hc_attn.fn
            sub, field = rest.rsplit("_", 1)
            return f"layers.{layer}.{sub}.{field}"
        if rest.startswith("engram."):
            slot = model.plan[layer].engram_slot
            if slot is None:
                raise KeyError(f"{name}: layer {layer} has no Engram in this config")
            tail = rest[len("engram."):]
            tail = {"embed.weight": "embed_weight", "embed.scale": "embed_scale"}.get(tail, tail)
            return f"engram.{slot}.{tail}"
        return f"layers.{layer}.{rest}"
    return name


def _load_tensors(path: Path) -> dict:
    from safetensors import safe_open
    files = []
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted({path / f for f in weight_map.values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    tensors = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as handle:
                for k in handle.keys():
                    tensors[k] = handle.get_tensor(k)
        except Exception as exc:  # safetensors raises its own error types
            raise ValueError(f"{f}: cannot read safetensors file ({exc})") from exc
    return tensors


def load_official_state_dict(model: V41Model, tensors: dict) -> list[str]:
    """Copy official-name tensors into the model. Raises one ValueError listing every missing,
    unexpected or mismatched tensor. Returns the names that were skipped on purpose (mtp.*)."""
    params = dict(model.named_parameters())
    problems, skipped, loaded = [], [], set()
    for name, t in tensors.items():
        try:
            target = official_to_module_name(name, model)
        except KeyError as exc:
            problems.append(f"unexpected: {exc.args[0]}")
            continue
        if target is None:
            skipped.append(name)
            continue
        p = params.get(target)
        if p is None:
            problems.append(f"unexpected: {name}")
            continue
        if p.dtype == torch.uint8:                       # FP8 / FP4 / E8M0 raw bytes
            if t.element_size() != 1:
                problems.append(f"dtype: {name} is {t.dtype}, expected a 1-byte format")
                continue
            t = t.view(torch.uint8)
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"shape: {name} is {list(t.shape)}, expected {list(p.shape)}")
            continue
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        loaded.add(target)
    missing = sorted(set(params) - loaded)
    problems += [f"missing: {m}" for m in missing]
    if problems:
        raise ValueError("checkpoint does not match the model:\n  " + "\n  ".join(problems))
    return skipped


def from_pretrained(path: str | Path, numerics: str = "reference", **overrides) -> V41Model:
    """Build a model from a checkpoint directory in the official layout.

    numerics="reference" keeps DeepSeek's arithmetic (bf16 activations, blockwise FP8 GEMMs);
    "fast" dequantizes weights to the compute dtype once.
    """
    path = Path(path)
    config = V41Config.from_json(path)
    for k, v in overrides.items():
        setattr(config, k, v)
    dtype = _DTYPES.get(config.torch_dtype, torch.bfloat16)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = V41Model(config)
    finally:
        torch.set_default_dtype(previous)
    load_official_state_dict(model, _load_tensors(path))
    stub = path / "tokenizer_stub.json"
    if stub.is_file():   # the compressed-id map of Engram comes from the tokenizer's texts
        vocab = json.loads(stub.read_text())
        token_map, size = build_compressed_token_map(vocab["texts"], vocab.get("raw"))
        if size != config.engram_compressed_vocab_size:
            raise ValueError(f"{stub}: tokenizer gives {size} compressed ids, config says "
                             f"{config.engram_compressed_vocab_size}")
        model.engram_token_map.copy_(token_map)
    return model.set_numerics(numerics).eval()
