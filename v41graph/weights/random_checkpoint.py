"""`write_random_checkpoint`: a random checkpoint of any config in the official layout, streamed
to disk one small piece at a time (peak memory about one attention module, whatever the
config), with `init_random_`'s rules; used by scripts/make_random_checkpoint.py and the tests.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from v41graph.model.config import V41Config
from v41graph.model.engram import Engram
from v41graph.model.layer_plan import build_layer_plan
from v41graph.model.layers import RMSNorm, default_dtype
from v41graph.model.model import Block, init_random_
from v41graph.model.moe import MoE

from .checkpoint import DEFAULT_MAX_SHARD_BYTES, ST_DTYPES, CheckpointWriter, progress_default, torch_dtype_of
from .names import TensorSpec, compute_dtype, module_to_official_name, official_tensor_specs
from .random_tokenizer import write_random_tokenizer
from .save import official_tensor

__all__ = ["write_random_checkpoint"]


def _unit_generator(seed: int, unit: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + unit) % (2 ** 63))


def _random_official(spec: TensorSpec, specs, g: torch.Generator) -> torch.Tensor:
    """Random data for one official tensor by name, with init_random_'s rules (used for the
    DSpark stages, which V41Model does not hold)."""
    name = spec.name
    if spec.kind in ("fp8", "table"):
        return torch.randint(0, 256, spec.physical_shape, generator=g, dtype=torch.uint8) & 0xB7
    if spec.kind == "fp4":
        return torch.randint(0, 256, spec.physical_shape, generator=g, dtype=torch.uint8)
    if spec.kind == "scale":
        w = specs[spec.weight]
        if w.kind == "table":
            return torch.full(spec.shape, 127, dtype=torch.uint8)
        exponent = round(math.log2(w.shape[1] ** -0.5))
        return torch.full(spec.shape, 127 + exponent + (1 if w.kind == "fp8" else -1), dtype=torch.uint8)
    shape = spec.shape
    if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
        t = 1.0 + 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("attn_sink"):
        t = torch.randn(shape, generator=g)
    elif name.endswith("_fn"):
        t = 0.02 * torch.randn(shape, generator=g)
    elif name.endswith(("_base", "gate.bias")):
        t = 0.1 * torch.randn(shape, generator=g)
    elif name.endswith("_scale"):
        t = torch.ones(shape)
    else:
        t = torch.randn(shape, generator=g) * shape[-1] ** -0.5
    return t.to(torch_dtype_of(spec.dtype))


def _unit_groups(module: nn.Module, path: str):
    """(path, submodule) pieces of a layer small enough to initialise one at a time: every
    child, with MoE and ModuleLists (the experts) split into their children."""
    for name, child in module.named_children():
        sub = f"{path}.{name}"
        if isinstance(child, (nn.ModuleList, MoE)):
            yield from _unit_groups(child, sub)
        else:
            yield sub, child


def write_random_checkpoint(config: V41Config, out: str | Path, seed: int = 0, *,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                            single_file: bool | None = None, include_mtp: bool = True,
                            progress=None, chunk_bytes: int = 64 << 20, tokenizer: bool = True) -> list[Path]:
    """A random checkpoint of `config` in the official layout, streamed.

    Each layer (and each Engram module) is built with unallocated storage (torch.empty), then
    one piece at a time (attention, each expert, the gate, norms, hc_*) is filled by
    `init_random_`, written at its final offset in its shard and freed; the embedding and head
    go through init_random_ in blocks of rows, the Engram tables are generated in blocks of rows
    with init_random_'s rule, the DSpark tensors (`mtp.*`, not part of V41Model) one by one with
    the same rules. Peak memory is about one attention module or chunk_bytes, whatever the
    config. Deterministic in `seed`; not the values of init_random_(V41Model(config), seed)
    (each piece has its own generator).

    tokenizer=True also writes a small real tokenizer of `config.vocab_size` tokens
    (random_tokenizer.py); config.json's engram_compressed_vocab_size is then the size of the
    Engram map that tokenizer gives (from_pretrained builds the map from it and checks that)."""
    out = Path(out)
    specs = official_tensor_specs(config, include_mtp)
    entries = [(s.name, s.dtype, s.shape) for s in specs.values()]
    total = sum(math.prod(s.physical_shape) * ST_DTYPES[s.dtype][1] for s in specs.values())
    compute = compute_dtype(config)
    counter = iter(range(1 << 62))

    def next_seed() -> int:
        return (seed * 1_000_003 + next(counter)) % (2 ** 63)

    def init_and_write(w, path: str, module: nn.Module) -> None:
        """init_random_ on `module` (named as at `path` in V41Model), write, free."""
        attr = path.rsplit(".", 1)[-1]
        holder = nn.Module()
        if isinstance(module, nn.Parameter):
            holder.register_parameter(attr, module)
        else:
            setattr(holder, attr if not attr.isdigit() else "unit", module)
        holder.engram = nn.ModuleList()          # tables are generated separately, in blocks
        init_random_(holder, seed=next_seed())
        named = [("", module)] if isinstance(module, nn.Parameter) else list(module.named_parameters())
        for n, p in named:
            if p.numel():
                name = module_to_official_name(f"{path}.{n}" if n else path, config)
                w.write(name, official_tensor(specs[name], p)[0])
        if not isinstance(module, nn.Parameter):
            for m in module.modules():           # drop the storage (shapes stay, on meta)
                for pn, p in list(m._parameters.items()):
                    if p is not None:
                        m._parameters[pn] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype,
                                                                     device="meta"),
                                                         requires_grad=p.requires_grad)

    def rows_in_blocks(w, name: str, rows: int, row_bytes: int, make) -> None:
        step = max(1, chunk_bytes // max(row_bytes, 1))
        for r0 in range(0, rows, step):
            n = min(step, rows - r0)
            w.write(name, make(n), byte_offset=r0 * row_bytes)

    with CheckpointWriter(out, entries, max_shard_bytes, single_file,
                          metadata={"producer": "v41graph.write_random_checkpoint", "seed": seed},
                          progress=progress_default(progress, total)) as w, default_dtype(compute):
        d, vocab = config.hidden_size, config.vocab_size
        for name, dtype in (("embed.weight", compute), ("head.weight", torch.float32)):
            spec = specs[name]

            def block_of_rows(n, name=name, dtype=dtype, spec=spec):
                holder = nn.Module()
                holder.engram = nn.ModuleList()
                holder.weight = nn.Parameter(torch.empty(n, d, dtype=dtype))
                init_random_(holder, seed=next_seed())     # randn * d^-0.5, as for the model
                return official_tensor(spec, holder.weight)[0]
            row_bytes = d * ST_DTYPES[spec.dtype][1]
            rows_in_blocks(w, name, vocab, row_bytes, block_of_rows)
        init_and_write(w, "norm", RMSNorm(d, config.rms_norm_eps))
        for role in build_layer_plan(config):
            if role.engram_slot is not None:
                slot = role.engram_slot
                engram = Engram(config, 0)                      # tables: below, in blocks
                for path, piece in _unit_groups(engram, f"engram.{slot}"):
                    init_and_write(w, path, piece)
                for pn in ("q_weight", "k_weight"):
                    init_and_write(w, f"engram.{slot}.{pn}", getattr(engram, pn))
                table = f"layers.{role.layer_id}.engram.embed.weight"
                rows, hd = specs[table].shape
                g = _unit_generator(seed, next(counter))
                rows_in_blocks(w, table, rows, hd, lambda n: torch.randint(
                    0, 256, (n, hd), generator=g, dtype=torch.uint8) & 0xB7)
                rows_in_blocks(w, table[: -len("weight")] + "scale", rows, hd // 32,
                               lambda n: torch.full((n, hd // 32), 127, dtype=torch.uint8))
                del engram
            block = Block(config, role)     # Linear weights: torch.empty, untouched until init
            covered = set()
            for path, piece in _unit_groups(block, f"layers.{role.layer_id}"):
                covered.update(f"{path}.{n}" for n, _ in piece.named_parameters())
                init_and_write(w, path, piece)
            assert len(covered) == sum(1 for _ in block.parameters()), "layer pieces missed a parameter"
            del block
        if include_mtp:
            for name, spec in specs.items():
                if name.startswith("mtp."):
                    w.write(name, _random_official(spec, specs, _unit_generator(seed, next(counter))))
        files = [w.dir / f for f in w.file_names]
    if tokenizer:
        from v41graph.model.engram_hash import build_compressed_token_map, tokenizer_token_texts
        from tokenizers import Tokenizer

        tok_file = write_random_tokenizer(out, config.vocab_size, config.max_position_embeddings)
        texts, raw = tokenizer_token_texts(Tokenizer.from_file(str(tok_file)), config.vocab_size)
        # ids 0 / 1 are the tokenizer's BOS / EOS (random_tokenizer.SPECIAL_TOKENS), named in
        # config.json as a released checkpoint names them
        config = dataclasses.replace(config, engram_compressed_vocab_size=build_compressed_token_map(texts, raw)[1],
                                     extra={**config.extra, "bos_token_id": 0, "eos_token_id": 1})
    config.save_pretrained(out)
    return files
