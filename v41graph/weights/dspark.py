"""Loading the DSpark draft head (`DSparkHead`, model/dspark.py) from the official `mtp.{i}.*`
tensors of a checkpoint, which V41Model itself does not hold.

    head = load_dspark(checkpoint_dir, model.config)
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from v41graph.model.config import V41Config
from v41graph.model.dspark import DSparkHead
from v41graph.model.layers import default_dtype

from .checkpoint import Checkpoint, CheckpointError
from .names import compute_dtype, hc_module_name

__all__ = ["load_dspark", "load_dspark_state_dict", "dspark_module_name"]


def dspark_module_name(official: str) -> str:
    """`mtp.{i}.X` -> `stages.{i}.X` (hc_attn_fn -> hc_attn.fn, as for the backbone)."""
    m = re.fullmatch(r"mtp\.(\d+)\.(.+)", official)
    if m is None:
        raise KeyError(f"{official}: not a DSpark (mtp.*) tensor")
    i, rest = m.groups()
    if rest.startswith("hc_"):
        rest = hc_module_name(rest)
    return f"stages.{i}.{rest}"


def load_dspark_state_dict(head: DSparkHead, tensors: dict) -> None:
    """Copy official `mtp.*` tensors into the head (FP8/FP4/E8M0 kept as bytes). Raises one
    ValueError listing every missing / unexpected / mismatched tensor."""
    params = dict(head.named_parameters())
    problems, loaded = [], set()
    for name, t in tensors.items():
        if not name.startswith("mtp."):
            continue
        target = dspark_module_name(name)
        p = params.get(target)
        if p is None:
            if name.endswith((".embed.weight", ".head.weight")) and "markov" not in name:
                continue          # aliases of the shared embedding / head
            problems.append(f"unexpected: {name}")
            continue
        if p.dtype == torch.uint8:
            t = t.view(torch.uint8)
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"shape: {name} is {list(t.shape)}, expected {list(p.shape)}")
            continue
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        loaded.add(target)
    problems += [f"missing: {n}" for n in sorted(set(params) - loaded)]
    if problems:
        raise ValueError("DSpark tensors do not match the head:\n  " + "\n  ".join(problems))


def load_dspark(path: str | Path, config: V41Config, numerics: str = "reference") -> DSparkHead:
    """Build the DSpark head from a checkpoint (directory, index or .safetensors file, as for
    from_pretrained) holding the official `mtp.*` tensors. `config` is the backbone's (e.g.
    `from_pretrained(...).config`). Raises CheckpointError for a checkpoint that cannot be read
    or has no `mtp.*` tensors, ValueError (from load_dspark_state_dict) for ones that do not fit."""
    with Checkpoint.open(path) as ckpt:
        tensors = {n: ckpt.read(n) for n in ckpt.names_in_file_order() if n.startswith("mtp.")}
        if not tensors:
            raise CheckpointError(f"{path}: no DSpark (mtp.*) tensors", path)
    with default_dtype(compute_dtype(config)):
        head = DSparkHead(config)
    load_dspark_state_dict(head, tensors)
    return head.set_numerics(numerics).eval()
