"""Which checkpoint tensors a prefill (P) or decode (D) worker holds and what they weigh
(read by ShardSpec(role=...) when a checkpoint is loaded; v41graph.disagg builds on it, and
its fingerprint lives in v41graph/disagg/roles.py).

CED (MODEL.md §2, §9): the encoder (layers before the decoder start, the candidate source) and
the decoder start's global-KV build (attn_norm, compressor, index-key projection) run over every
prompt token; the decoder layers run on the last `sliding_window` prompt tokens only (bounded
replay). So a prefill worker needs

  "prefill"  embed, every `layers.i.*` with i < decoder_start (Engram of those layers included),
             and of layer decoder_start only attn_norm, attn.compressor.*, attn.indexer.wk /
             k_norm (what builds the decoder's global KV). No decoder layer, final norm, head
             or DSpark.

and a decode worker needs

  "decode"   the whole model and DSpark. A decode token runs all layers, the encoder
             included: its decoder input is the encoder's output for that token, and the
             encoder's window caches and ratio-2 global KV grow with it (accounting's decode
             activation is d + A_enc + A_dec + head). A decoder-only D worker could not make a
             second token; that is why the hand-over carries the encoder's caches too.

  "both"     everything (the single-process model).

`role_holds` is the one statement of this split: ShardSpec(role=...) applies it when a
checkpoint is read, `role_weight_bytes` sums the checkpoint's tensor sizes with it.
"""
from __future__ import annotations

from v41graph.model.config import V41Config

from .checkpoint import nbytes_of
from .names import official_tensor_specs

__all__ = ["ROLES", "check_role", "decoder_start", "role_holds", "role_weight_bytes"]

ROLES = ("both", "prefill", "decode")

# The decoder start's tensors that build its global KV from the encoder output (everything
# its Attention.compress touches, plus the attn_norm of its input).
_KV_BUILD_PREFIXES = ("attn_norm.", "attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.")


def check_role(role) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {list(ROLES)}, got {role!r}")
    return role


def decoder_start(config: V41Config) -> int:
    """First decoder layer: the candidate source (V41Model.decoder_start)."""
    return config.candidate_source_layer_id


def role_holds(name: str, role: str, config: V41Config) -> bool:
    """Whether a worker of `role` holds the official checkpoint tensor `name` (scales follow
    their weight: they share its prefix)."""
    check_role(role)
    if role != "prefill":
        return True
    if name == "embed.weight":
        return True
    parts = name.split(".")
    if parts[0] != "layers":
        return False          # head, final norm, mtp.* (DSpark)
    layer, rest = int(parts[1]), ".".join(parts[2:])
    dec = decoder_start(config)
    if layer < dec:
        return True
    return layer == dec and rest.startswith(_KV_BUILD_PREFIXES)


def role_weight_bytes(config: V41Config, role: str, include_mtp: bool = True) -> dict:
    """Checkpoint bytes a `role` worker reads, from the official layout's shapes and dtypes (no
    file needed, so it works for the released config): role_bytes / total_bytes (everything,
    DSpark included) and the same without the Engram tables (`*_device`: the tables live in
    host memory, MODEL.md §7), and the fractions. include_mtp=False: without DSpark (what
    from_pretrained reads; load_dspark reads the rest)."""
    specs = official_tensor_specs(config, include_mtp=include_mtp)
    out = dict(role_bytes=0, total_bytes=0, role_bytes_device=0, total_bytes_device=0)
    for name, spec in specs.items():
        n = nbytes_of(spec.dtype, spec.shape)
        table = spec.kind == "table" or (spec.kind == "scale" and specs[spec.weight].kind == "table")
        held = role_holds(name, role, config)
        out["total_bytes"] += n
        out["role_bytes"] += n if held else 0
        if not table:
            out["total_bytes_device"] += n
            out["role_bytes_device"] += n if held else 0
    out["fraction"] = out["role_bytes"] / out["total_bytes"]
    out["fraction_device"] = out["role_bytes_device"] / out["total_bytes_device"]
    return out
