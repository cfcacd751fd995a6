"""Which tensors a prefill (P) or decode (D) worker holds, what they weigh, and the fingerprint
both sides compare before a hand-over.

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

import hashlib
import json

import torch

from v41graph.model.config import V41Config
from v41graph.model.layers import NUMERICS

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
    from v41graph.weights.checkpoint import nbytes_of
    from v41graph.weights.names import official_tensor_specs

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


def config_fingerprint(config: V41Config) -> str:
    """sha256 of every model field (layer plan, sizes, formats); `extra` (keys v41graph does not
    use) left out."""
    d = config.to_dict()
    d.pop("extra", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def handover_fingerprint(model) -> bytes:
    """24 bytes that P and D compare before a hand-over: 8 of the config's fingerprint (layer
    plan, sizes, formats), 8 of a hash of the weights both roles hold that make the hand-over's
    contents (the embedding and the decoder start's global-KV build), and 8 naming the numerics
    mode (model.numerics, its index in layers.NUMERICS): P's numerics make the hand-over's bits
    and D's continue them, so a pair that differs there would not match one process either.
    Workers loaded from different checkpoints differ in the second part, with another config or
    layer plan in the first, with another numerics= in the third."""
    config = model.config
    h = hashlib.sha256()
    dec = decoder_start(config)
    params = dict(model.named_parameters())
    names = ["embed.weight"] + sorted(n for n in params if n.startswith(f"layers.{dec}.")
                                      and n[len(f"layers.{dec}."):].startswith(_KV_BUILD_PREFIXES))
    for n in names:
        t = params[n].detach()
        if t.is_meta:
            raise ValueError(f"handover_fingerprint: {n} is not loaded on this worker")
        h.update(n.encode())
        h.update(t.contiguous().cpu().view(torch.uint8).numpy())      # the buffer, not a bytes copy
    numerics = NUMERICS.index(model.numerics).to_bytes(8, "little")
    return bytes.fromhex(config_fingerprint(config))[:8] + h.digest()[:8] + numerics


FINGERPRINT_BYTES = 24


def _numerics_name(part: bytes) -> str:
    i = int.from_bytes(part, "little")
    return repr(NUMERICS[i]) if i < len(NUMERICS) else f"unknown mode #{i}"


def fingerprint_mismatch(mine: bytes, theirs: bytes) -> str | None:
    """None if equal, else what differs, in words (`theirs` is P's, `mine` this worker's)."""
    if theirs == mine:
        return None
    why = []
    if theirs[:8] != mine[:8]:
        why.append("another config or layer plan")
    elif theirs[8:16] != mine[8:16]:
        why.append("the same config but other weights (another checkpoint)")
    if theirs[16:] != mine[16:]:
        why.append(f"numerics: P runs {_numerics_name(theirs[16:])}, this worker {_numerics_name(mine[16:])} "
                   "(load both roles with the same numerics=)")
    return "; ".join(why)
