"""`save_pretrained`: write a V41Model as a checkpoint in the official layout (names and dtypes
as released, sharded with an index), carrying over the DSpark `mtp.*` tensors and tokenizer
files of the checkpoint it was loaded from. `official_tensor` casts one parameter to its
official dtype (also used by the random-checkpoint writer).
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Mapping, Sequence

import torch

from v41graph.model.model import V41Model

from .checkpoint import (DEFAULT_MAX_SHARD_BYTES, ST_DTYPES, TORCH_TO_ST, Checkpoint, CheckpointError, CheckpointWriter, logical_shape_of, progress_default, torch_dtype_of)
from .names import TensorSpec, official_tensor_specs, official_to_module_name

__all__ = ["save_pretrained", "official_tensor", "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer_stub.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def official_tensor(spec: TensorSpec, p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor in the official dtype and physical shape, whether the cast rounded values)."""
    p = p.detach()
    want = torch_dtype_of(spec.dtype)
    if p.dtype == torch.uint8 and ST_DTYPES[spec.dtype][1] == 1:
        return (p if want == torch.uint8 else p.view(want)), False
    if not p.is_floating_point() or ST_DTYPES[spec.dtype][1] == 1:
        raise ValueError(f"{spec.name}: a {p.dtype} parameter cannot be saved as {spec.dtype}")
    if p.dtype == want:
        return p, False
    t = p.to(want)
    return t, not torch.equal(t.to(p.dtype), p)


def save_pretrained(model: V41Model, path: str | Path, *,
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, single_file: bool | None = None,
                    extra_tensors: Mapping[str, torch.Tensor] | None = None, mtp="auto",
                    copy_files: Sequence[str] = TOKENIZER_FILES, progress=None) -> list[Path]:
    """Write the model in the official layout: config.json, shards of at most max_shard_bytes
    (`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, or one
    `model.safetensors` when it all fits / single_file=True), official names and dtypes.

    mtp: "auto" copies the DSpark tensors (`mtp.*`, which V41Model does not hold) from the
    checkpoint the model was loaded from, if it had them; a path copies them from that
    checkpoint; None writes none. extra_tensors: more official-name tensors to write as they are
    (official torch dtypes; F4 as float4_e2m1fn_x2 [.., n/2]).
    copy_files: tokenizer files copied from the source checkpoint directory (the Engram
    compressed-id map is rebuilt from tokenizer_stub.json when loading).
    Values that the official dtype cannot hold exactly (e.g. fp32 norm weights of a random
    bf16 model) are rounded, with a warning. Returns the shard files.
    """
    path = Path(path)
    config = model.config
    specs = official_tensor_specs(config, include_mtp=False)
    params = dict(model.named_parameters())
    extra = dict(extra_tensors or {})
    source = getattr(model, "checkpoint_dir", None)
    mtp_ckpt = None
    if mtp == "auto":
        mtp = source
    if mtp is not None and not any(n.startswith("mtp.") for n in extra):
        try:
            mtp_ckpt = Checkpoint.open(mtp)
        except CheckpointError:
            if mtp is not source:
                raise
        if mtp_ckpt is not None and Path(mtp_ckpt.root).resolve() == path.resolve():
            raise ValueError(f"save_pretrained: cannot overwrite the checkpoint {path} the DSpark "
                             f"tensors are read from; save elsewhere or pass mtp=None")
    mtp_names = [n for n in (mtp_ckpt.names_in_file_order() if mtp_ckpt else []) if n.startswith("mtp.")]

    entries, problems = [], []
    for name, spec in specs.items():
        p = params.get(official_to_module_name(name, model))
        if p is None:
            problems.append(f"{name}: no model parameter")
            continue
        if tuple(p.shape) != spec.physical_shape:
            problems.append(f"{name}: parameter is {list(p.shape)}, layout says {list(spec.physical_shape)}")
        entries.append((name, spec.dtype, spec.shape))
    if problems:
        raise RuntimeError("V41Model and the checkpoint layout disagree:\n  " + "\n  ".join(problems))
    for name, t in extra.items():
        if name in specs:
            raise ValueError(f"extra_tensors: {name} is a model tensor")
        st = TORCH_TO_ST.get(t.dtype)
        if st is None:
            raise ValueError(f"extra_tensors: {name} has dtype {t.dtype} with no safetensors name")
        entries.append((name, st, logical_shape_of(t, st)))
    for name in mtp_names:
        info = mtp_ckpt.info(name)
        entries.append((name, info.dtype, info.shape))

    lossy = []
    try:
        with CheckpointWriter(path, entries, max_shard_bytes, single_file,
                              metadata={"producer": "v41graph.save_pretrained"},
                              progress=progress_default(progress, sum(
                                  p.numel() * p.element_size() for p in params.values()))) as w:
            for name, spec in specs.items():
                t, rounded = official_tensor(spec, params[official_to_module_name(name, model)])
                if rounded:
                    lossy.append(name)
                w.write(name, t)
            for name, t in extra.items():
                w.write(name, t)
            for name in mtp_names:
                w.write(name, mtp_ckpt.read(name))
            files = [w.dir / f for f in w.file_names]
    finally:
        if mtp_ckpt is not None:
            mtp_ckpt.close()
    config.save_pretrained(path)
    if source is not None and Path(source).resolve() != path.resolve():
        for fname in copy_files:
            if (Path(source) / fname).is_file():
                shutil.copyfile(Path(source) / fname, path / fname)
    if lossy:
        warnings.warn(f"save_pretrained: {len(lossy)} tensors were rounded to their official dtype "
                      f"(e.g. {', '.join(lossy[:5])})")
    return files

