"""Session: a thin, stateful front end for scripts and tests.

    s = Session(model, max_batch_size=2, max_seq_len=256)
    logits = s.prefill(prompt_ids)      # [B, T] (or a list of variable-length lists) -> [B, V]
    logits = s.decode(next_ids)         # [B, 1] -> [B, V]

The session owns the caches and the block allocator. Every request is validated before
anything is written, so a bad request raises a clear error and leaves all caches as they were.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .cache import BlockAllocator, CacheCapacityError, ModelCaches, build_metadata, positions_of
from .model import V41Model


class Session:
    def __init__(self, model, max_batch_size: int, max_seq_len: int,
                 block_size: int = 128, num_blocks: int | None = None):
        """model: a V41Model or a v41graph.compile()d one (same call signature)."""
        self.model = model
        base: V41Model = getattr(model, "model", model)
        self.config = base.config
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} > max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.max_blocks = math.ceil(max_seq_len / block_size)
        num_blocks = num_blocks if num_blocks is not None else max_batch_size * self.max_blocks
        device = base.embed.weight.device
        # One slot more than the batch: the last is the scratch slot that padded decode
        # batches of a compiled model write into.
        self.caches = ModelCaches.allocate(self.config, max_batch_size + 1, num_blocks, block_size, device)
        self.allocator = BlockAllocator(num_blocks)
        self.seq_lens = [0] * max_batch_size
        self.blocks: list[list[int]] = [[] for _ in range(max_batch_size)]

    # ------------------------------------------------------------------ public
    def prefill(self, prompt_ids, mode: str = "full") -> torch.Tensor:
        """Start sequences 0..B-1 afresh with these prompts; logits of each last token.

        mode="full" runs every layer over every token (as DeepSeek's reference does);
        mode="replay" is CED decoder bounded replay: decoder layers only over the last
        `sliding_window` tokens (MODEL.md §9). Both agree for prompts <= the window."""
        if mode not in ("full", "replay"):
            raise ValueError(f"prefill mode must be 'full' or 'replay', got {mode!r}")
        prompts = self._as_lists(prompt_ids, "prompt_ids")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts > max_batch_size {self.max_batch_size}")
        replay = self.config.sliding_window if mode == "replay" else None
        # A new prompt replaces whatever the slot held (only once the request is validated).
        return self._step(list(range(len(prompts))), prompts, replay, restart=True)

    def decode(self, ids) -> torch.Tensor:
        """One token per running sequence (ids [B, 1] or [B]); logits [B, V]."""
        tokens = self._as_lists(ids, "ids")
        if any(len(t) != 1 for t in tokens):
            raise ValueError(f"decode takes exactly one token per sequence, got shape {[len(t) for t in tokens]}")
        for b in range(len(tokens)):
            if b >= self.max_batch_size or self.seq_lens[b] == 0:
                raise ValueError(f"sequence {b} has no prefill; call prefill first")
        return self._step(list(range(len(tokens))), tokens)

    def extend(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append token chunks to the given sequences (chunked prefill / mixed batches)."""
        return self._step(list(seq_ids), [list(c) for c in chunks])

    def release(self, seq: int) -> None:
        """Forget a sequence and free its blocks."""
        self.allocator.free(self.blocks[seq])
        self.blocks[seq], self.seq_lens[seq] = [], 0

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _as_lists(ids, what: str) -> list[list[int]]:
        if isinstance(ids, torch.Tensor):
            if ids.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{what}: expected an integer tensor, got {ids.dtype}")
            if ids.dim() == 1:
                ids = ids.unsqueeze(-1)
            if ids.dim() != 2:
                raise ValueError(f"{what}: expected shape [B, T], got {list(ids.shape)}")
            return ids.tolist()
        return [list(map(int, row)) for row in ids]

    def _step(self, seqs: list[int], chunks: list[list[int]], replay: int | None = None,
              restart: bool = False) -> torch.Tensor:
        """Validate the whole request, then allocate, run and commit. restart=True starts the
        sequences afresh (their old blocks count as free for this request)."""
        cfg = self.config
        start = {s: (0 if restart else self.seq_lens[s]) for s in seqs if 0 <= s < self.max_batch_size}
        # --- validate everything before touching any state
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"sequence ids repeat in one step: {seqs}")
        new_blocks = {}
        for s, chunk in zip(seqs, chunks):
            if not 0 <= s < self.max_batch_size:
                raise ValueError(f"sequence id {s} outside 0..{self.max_batch_size - 1}")
            if not chunk:
                raise ValueError(f"sequence {s}: empty token list")
            bad = [t for t in chunk if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"sequence {s}: token id {bad[0]} outside the vocabulary 0..{cfg.vocab_size - 1}")
            end = start[s] + len(chunk)
            if end > cfg.max_position_embeddings:
                raise ValueError(f"sequence {s}: position {end - 1} beyond max_position_embeddings "
                                 f"{cfg.max_position_embeddings}")
            if end > self.max_seq_len:
                raise CacheCapacityError(f"sequence {s}: context of {end} tokens exceeds the cache "
                                         f"capacity of {self.max_seq_len} tokens per sequence")
            new_blocks[s] = math.ceil(end / self.block_size) - (0 if restart else len(self.blocks[s]))
        need = sum(new_blocks.values())
        free = self.allocator.num_free + (sum(len(self.blocks[s]) for s in seqs) if restart else 0)
        if need > free:
            raise CacheCapacityError(f"step needs {need} more cache blocks but only {free} are free")
        # --- commit
        for s, n in new_blocks.items():
            if restart:
                self.release(s)
            self.blocks[s] += self.allocator.allocate(n)
        meta = build_metadata(seqs, [start[s] for s in seqs], [len(c) for c in chunks],
                              [self.blocks[s] for s in seqs], self.max_blocks,
                              device=self.caches.engram_history.device)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64,
                           device=self.caches.engram_history.device)
        with torch.no_grad():
            logits = self.model(ids, positions_of(meta), self.caches, meta, decoder_replay=replay)
        for s, c in zip(seqs, chunks):
            self.seq_lens[s] = start[s] + len(c)
        return logits
