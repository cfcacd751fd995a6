"""Session: a thin, stateful front end for scripts and tests.

    s = Session(model, max_batch_size=2, max_seq_len=256)
    logits = s.prefill(prompt_ids)      # [B, T] (or a list of variable-length lists) -> [B, V]
    logits = s.decode(next_ids)         # [B, 1] -> [B, V]

The session owns the caches and the block allocator. Every request is validated before
anything is written, so a bad request raises a clear error and leaves all caches as they were.

Prefill modes: "full" runs every layer over every prompt token (DeepSeek's reference; the
Session default, which the reference / conformance tests rely on), "auto" is CED decoder
bounded replay (MODEL.md §9) for prompts longer than the sliding window and full otherwise (the
Engine's default), "replay" replays always. Pick per call (`prefill(..., mode=)`) or per session
(`Session(..., prefill_mode=)`).
One-token-per-sequence steps (`decode`) keep their metadata in a persistent `DecodeBatch`
(slots and block tables written when the decoding set changes or a sequence gets a new block,
lengths moved on by a device add); the token ids are still validated on the host, so a device
tensor of ids is read once per call (Engine, which samples on the host, reads nothing).
"""
from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch

from .batch import CacheCapacityError, StepRunner, check_ids_tensor, token_ids_list

PREFILL_MODES = ("auto", "full", "replay")


class Session(StepRunner):
    def __init__(self, model, max_batch_size: int, max_seq_len: int,
                 block_size: int = 128, num_blocks: int | None = None,
                 persistent_metadata: bool = True, prefill_mode: str = "full"):
        """model: a V41Model or a v41graph.compile()d one (same call signature).
        persistent_metadata=False rebuilds decode metadata from host lists every step.
        prefill_mode: what prefill() does when called without mode= (see the module doc)."""
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        super().__init__(model, max_batch_size, max_seq_len, block_size, num_blocks, persistent_metadata)
        self.prefill_mode = prefill_mode
        self.seq_lens = [0] * max_batch_size
        self.blocks: list[list[int]] = [[] for _ in range(max_batch_size)]
        self.last_prefill_mode = None     # "full" | "replay": what the last prefill ran

    # ------------------------------------------------------------------ public
    def prefill(self, prompt_ids, mode: str | None = None) -> torch.Tensor:
        """Start sequences 0..B-1 afresh with these prompts; logits of each last token.

        mode="full" runs every layer over every token (as DeepSeek's reference does);
        mode="replay" is CED decoder bounded replay: decoder layers only over the last
        `sliding_window` tokens (MODEL.md §9). Both agree for prompts <= the window.
        mode="auto": replay if a prompt is longer than the window, else full.
        mode=None: the session's prefill_mode ("full" unless the constructor said otherwise)."""
        mode = self.prefill_mode if mode is None else mode
        if mode not in PREFILL_MODES:
            raise ValueError(f"prefill mode must be one of {PREFILL_MODES}, got {mode!r}")
        prompts = self._as_lists(prompt_ids, "prompt_ids")
        if len(prompts) > self.max_batch_size:
            raise ValueError(f"batch of {len(prompts)} prompts > max_batch_size {self.max_batch_size}")
        w = self.config.sliding_window
        if mode == "auto":
            mode = "replay" if any(len(p) > w for p in prompts) else "full"
        replay = w if mode == "replay" else None
        # A new prompt replaces whatever the slot held (only once the request is validated).
        logits = self._step(list(range(len(prompts))), prompts, replay, restart=True)
        self.last_prefill_mode = mode
        return logits

    def decode(self, ids) -> torch.Tensor:
        """One token per running sequence (ids [B, 1] or [B]); logits [B, V]."""
        tokens = self._as_lists(ids, "ids", flat_is_one_per_row=True)
        if any(len(t) != 1 for t in tokens):
            raise ValueError(f"decode takes exactly one token per sequence, got shape {[len(t) for t in tokens]}")
        for b in range(len(tokens)):
            if b >= self.max_batch_size or self.seq_lens[b] == 0:
                raise ValueError(f"sequence {b} has no prefill; call prefill first")
        return self._step(list(range(len(tokens))), tokens)

    def extend(self, seq_ids: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append token chunks to the given sequences (chunked prefill / mixed batches)."""
        seqs = token_ids_list(seq_ids, "seq_ids")
        chunks = [] if isinstance(chunks, (str, bytes)) else list(chunks)
        if len(chunks) != len(seqs):
            raise ValueError(f"extend: needs one chunk of token ids per sequence id ({len(seqs)} ids)")
        return self._step(seqs, [token_ids_list(c, f"chunks[{i}]") for i, c in enumerate(chunks)])

    def release(self, seq: int) -> None:
        """Forget a sequence and free its blocks."""
        if isinstance(seq, bool) or not isinstance(seq, numbers.Integral) or not 0 <= seq < self.max_batch_size:
            raise ValueError(f"release: sequence id {seq!r} outside 0..{self.max_batch_size - 1}")
        self.allocator.free(self.blocks[seq])
        self.blocks[seq], self.seq_lens[seq] = [], 0
        if self.decode_batch is not None:
            self.decode_batch.discard([seq])

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _as_lists(ids, what: str, flat_is_one_per_row: bool = False) -> list[list[int]]:
        """Token ids per sequence: an integer tensor [B, T] (or [B], one token each), or a list
        of lists of ints; with flat_is_one_per_row (decode) also a flat list of ints, one token
        per sequence. Anything else (floats, strings, meta tensors) is a clear error."""
        if isinstance(ids, torch.Tensor):
            check_ids_tensor(ids, what)
            if ids.dim() == 1:
                ids = ids.unsqueeze(-1)
            if ids.dim() != 2:
                raise ValueError(f"{what}: expected shape [B, T], got {list(ids.shape)}")
            return ids.tolist()
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"{what} must be token ids, got a {type(ids).__name__}")
        rows = list(ids)
        if flat_is_one_per_row and not any(hasattr(r, "__iter__") for r in rows):
            return [[t] for t in token_ids_list(rows, what)]
        return [token_ids_list(row, f"{what}[{i}]") for i, row in enumerate(rows)]

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
        dec = self.decode_batch
        one_token = not restart and replay is None and all(len(c) == 1 for c in chunks)
        if dec is not None and one_token:
            inserted = dec.sync(seqs, lambda s: (s, self.seq_lens[s], self.blocks[s]))
            for s, n in new_blocks.items():      # kept rows: append their new blocks
                if n > 0 and s not in inserted:
                    row, have = dec.keys.index(s), len(self.blocks[s])
                    for j in range(have - n, have):
                        dec.set_block(row, j, self.blocks[s][j])
            ids, positions, meta = self.decode_inputs([c[0] for c in chunks])
        else:
            if dec is not None:   # these sequences' lengths move by other than one token
                dec.discard(seqs)
            ids, positions, meta = self.host_inputs(seqs, [start[s] for s in seqs], chunks,
                                                    [self.blocks[s] for s in seqs])
        # One token per sequence is a decode step for the model (a compiled model's buckets),
        # also when it is a fresh 1-token prompt that the persistent rows do not hold.
        decode = replay is None and all(len(c) == 1 for c in chunks)
        logits = self.call_model(ids, positions, meta, decode=decode, decoder_replay=replay)
        if dec is not None and one_token:
            dec.advance()
        for s, c in zip(seqs, chunks):
            self.seq_lens[s] = start[s] + len(c)
        return logits
