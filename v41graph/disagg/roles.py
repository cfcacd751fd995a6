"""The fingerprint P and D compare before a hand-over (config, the weights both roles hold,
numerics). Which tensors each role holds and what they weigh is v41graph/weights/roles.py (the
checkpoint loader reads it), re-exported here.
"""
from __future__ import annotations

import hashlib
import json

import torch

from v41graph.model.config import V41Config
from v41graph.model.layers import NUMERICS
# the role split is the checkpoint loader's (weights/roles.py); re-exported for disagg's users
from v41graph.weights.roles import (_KV_BUILD_PREFIXES, ROLES, check_role, decoder_start, role_holds,
                                    role_weight_bytes)

__all__ = ["ROLES", "check_role", "decoder_start", "role_holds", "role_weight_bytes", "config_fingerprint",
           "handover_fingerprint", "fingerprint_mismatch", "FINGERPRINT_BYTES"]


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
