"""What a runtime front end (Session, Engine, speculative decoding) keeps between steps and
how it builds a step: the caches (with their scratch slot), the block allocator, the persistent
decode rows, the step's inputs, and the model call (decode steps through `model.decode`, every
other step through `model(...)`)."""
from __future__ import annotations

import itertools
import math
import numbers
from typing import Sequence

import torch

from v41graph.compiler.compiled_model import CompiledModel
from v41graph.model.kv_cache import ModelCaches, slots_with_scratch
from v41graph.model.metadata import AttentionMetadata, build_metadata, check_index_tensor, positions_of


class CacheCapacityError(RuntimeError):
    """Raised when a request needs more cache blocks or slots than are free."""


class BlockAllocator:
    """A free list of cache block ids shared by all kv sources."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheCapacityError(f"need {n} cache blocks but only {len(self._free)} of "
                                     f"{self.num_blocks} are free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks or b in self._free:
                raise ValueError(f"block {b} is not an allocated block id")
            self._free.append(b)


_STATIC_KEYS = itertools.count(1)


class DecodeBatch:
    """Persistent device metadata of decode rows (one new token per sequence), kept across
    steps (the seed's P5: metadata cached instead of rebuilt every step).

    Rows 0..n-1 are sequences in the caller's order; `keys[i]` names row i's owner (a request
    or sequence id). What does not change between decode steps -- slot ids and block tables --
    is written only when a row is inserted or removed or a sequence gets a new block
    (`insert`, `remove`, `set_block`, `sync`). What does -- positions, chunk starts, sequence
    lengths -- lives in one [3, capacity] counter tensor that `advance()` moves on by one token
    with a single in-place add on the device. A steady-state step therefore reads nothing from
    the device and builds no tensor from host data: `metadata()` returns cached views, the
    scheduler counts lengths in Python ints itself, and the only host-to-device transfer is the
    new tokens (`load_ids`: a non-blocking copy from a pinned staging buffer on CUDA).

    Row order is kept stable (inserts and removes shift the rows behind them on the device), so
    a batch lists its sequences in the same order a freshly built one would.
    """

    def __init__(self, capacity: int, max_blocks: int, device: torch.device | str = "cpu"):
        self.capacity, self.max_blocks = capacity, max_blocks
        self.device = torch.device(device)
        self.keys: list = []
        # counters[0] = chunk_start (tokens already cached), [1] = seq_len, [2] = positions:
        # one tensor, so that advance() moves all three with one add
        self.counters = torch.zeros(3, capacity, dtype=torch.int64, device=self.device)
        self.buffers = AttentionMetadata.decode_buffers(
            capacity, max_blocks, self.device, scratch_slot=0,
            use={"chunk_start": self.counters[0], "seq_len": self.counters[1]})
        self.slot, self.block_table = self.buffers.seq_slot, self.buffers.block_table
        self.ids = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        # New tokens come from the host sampler: stage them in pinned memory and copy without a
        # sync (on CPU the staging buffer is the ids buffer itself).
        self._ids_host = self._ids_copied = None
        if self.device.type == "cuda":
            self._ids_host = torch.zeros(capacity, dtype=torch.int64).pin_memory()
            self._ids_copied = torch.cuda.Event()
        self.static_key = next(_STATIC_KEYS)
        self._views = None

    # ------------------------------------------------------------------ reading
    @property
    def n(self) -> int:
        return len(self.keys)

    def _live(self):
        """(positions, metadata, live counters [3, n]): views of the persistent buffers, made
        once per change of the rows."""
        if self._views is None:
            n = self.n
            meta = self.buffers.first_rows(n, self.static_key)
            live = self.counters[:, :n]
            self._views = (live[2], meta, live)
        return self._views

    def metadata(self):
        """(positions [n], AttentionMetadata of the n rows): cached views, nothing built."""
        return self._live()[:2]

    def load_ids(self, tokens) -> torch.Tensor:
        """This step's input ids (one host int per row) -> the persistent ids view [n]."""
        n = len(tokens)
        if n != self.n:
            raise ValueError(f"{n} tokens for {self.n} decode rows")
        if self._ids_host is None:
            self.ids.numpy()[:n] = tokens
        else:
            # The previous step's copy out of the staging buffer has long finished when a
            # caller read that step's logits; wait for it only if it has not (query: no sync).
            if not self._ids_copied.query():
                self._ids_copied.synchronize()
            self._ids_host.numpy()[:n] = tokens
            self.ids[:n].copy_(self._ids_host[:n], non_blocking=True)
            self._ids_copied.record()
        return self.ids[:n]

    # ------------------------------------------------------------------ per step
    def advance(self) -> None:
        """Every row's sequence took one token: chunk_start, seq_len and positions += 1 (one
        in-place add on the device, no host involvement)."""
        if self.keys:
            self._live()[2].add_(1)

    # ------------------------------------------------------------------ row changes
    def _changed(self) -> None:
        self.static_key = next(_STATIC_KEYS)
        self._views = None

    def insert(self, row: int, key, slot: int, length: int, blocks) -> None:
        """A new row at `row` (the rows behind it move back by one): sequence in cache slot
        `slot` with `length` tokens already cached and these blocks."""
        n = self.n
        if n >= self.capacity:
            raise ValueError(f"decode batch full ({self.capacity} rows)")
        if not 0 <= row <= n:
            raise ValueError(f"row {row} outside 0..{n}")
        if len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks > max_blocks {self.max_blocks}")
        if row < n:
            for t in (self.slot, self.block_table):
                t[row + 1:n + 1] = t[row:n].clone()
            self.counters[:, row + 1:n + 1] = self.counters[:, row:n].clone()
        self.slot[row] = slot
        self.block_table[row] = -1
        if blocks:
            self.block_table[row, :len(blocks)] = torch.tensor(list(blocks), dtype=torch.int64)
        self.counters[0, row] = length
        self.counters[1, row] = length + 1
        self.counters[2, row] = length
        self.keys.insert(row, key)
        self._changed()

    def remove(self, row: int) -> None:
        """Drop a row (the rows behind it move up by one)."""
        n = self.n
        if not 0 <= row < n:
            raise ValueError(f"row {row} outside 0..{n - 1}")
        if row < n - 1:
            for t in (self.slot, self.block_table):
                t[row:n - 1] = t[row + 1:n].clone()
            self.counters[:, row:n - 1] = self.counters[:, row + 1:n].clone()
        self.block_table[n - 1] = -1
        del self.keys[row]
        self._changed()

    def discard(self, keys) -> None:
        """Remove the rows of these keys, if present."""
        for k in keys:
            if k in self.keys:
                self.remove(self.keys.index(k))

    def clear(self) -> None:
        if self.keys:
            self.block_table[:self.n] = -1
            self.keys = []
            self._changed()

    def set_block(self, row: int, index: int, block: int) -> None:
        """Row `row`'s sequence got block `block` as its `index`-th block."""
        self.block_table[row, index] = block
        self._changed()

    def sync(self, keys, describe) -> list:
        """Make the rows exactly `keys`, in this order. describe(key) -> (slot, cached length,
        blocks) for a key that needs a new row. Rows kept keep their device state. Returns the
        keys that got a new row (none in a steady state: one list comparison, nothing else)."""
        keys = list(keys)
        if keys == self.keys:
            return []
        want = set(keys)
        for i in range(self.n - 1, -1, -1):
            if self.keys[i] not in want:
                self.remove(i)
        have = set(self.keys)
        if [k for k in keys if k in have] != self.keys:     # reordered: rebuild
            self.clear()
            have = set()
        inserted = []
        for i, k in enumerate(keys):
            if k not in have:
                self.insert(i, k, *describe(k))
                inserted.append(k)
        return inserted

    def host_view(self) -> dict:
        """The rows' state read back to the host (tests and debugging only: syncs)."""
        n = self.n
        return dict(keys=list(self.keys), slot=self.slot[:n].tolist(),
                    block_table=self.block_table[:n].tolist(),
                    chunk_start=self.counters[0, :n].tolist(), seq_len=self.counters[1, :n].tolist(),
                    positions=self.counters[2, :n].tolist())


def check_ids_tensor(ids: torch.Tensor, what: str) -> None:
    """A tensor of token ids must be integer and have values (not on the meta device)."""
    check_index_tensor(ids, what)
    if ids.device.type == "meta":
        raise ValueError(f"{what} is a meta tensor: it has no values")


def token_ids_list(ids, what: str) -> list[int]:
    """A sequence of token ids as Python ints, or a clear error naming `what`: a string, floats,
    bools or other non-integers are rejected, never coerced (int(1.5) would silently be 1)."""
    if isinstance(ids, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of integer token ids, got a {type(ids).__name__}")
    if isinstance(ids, torch.Tensor):
        check_ids_tensor(ids, what)
        if ids.dim() != 1:
            raise ValueError(f"{what}: expected a 1-D tensor of token ids, got shape {list(ids.shape)}")
        return ids.tolist()
    try:
        items = list(ids)
    except TypeError:
        raise TypeError(f"{what} must be a sequence of integer token ids, got "
                        f"{type(ids).__name__}") from None
    for i, t in enumerate(items):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"{what} must hold integers: {what}[{i}] = {t!r} is a {type(t).__name__}")
    return [int(t) for t in items]


def eager_model(model):
    """The V41Model behind a model argument: the model itself, or a CompiledModel's model."""
    return model.model if isinstance(model, CompiledModel) else model


class StepRunner:
    """The part every front end shares: caches for `max_batch_size` sequences plus the scratch
    slot, the block allocator, the persistent decode rows (DecodeBatch, unless
    persistent_metadata=False) and a step's inputs and model call. `model` is a V41Model or a
    CompiledModel (same contract: `model(...)` for any step, `model.decode(...)` for a decode
    step)."""

    runs_decoder = True     # False for a front end that only runs the encoder (disagg.PrefillWorker)

    def __init__(self, model, max_batch_size: int, max_seq_len: int, block_size: int = 128,
                 num_blocks: int | None = None, persistent_metadata: bool = True):
        base = eager_model(model)
        if self.runs_decoder and getattr(base, "role", "both") == "prefill":
            raise ValueError(f"{type(self).__name__}: the model was loaded with role='prefill' (the encoder "
                             "half only); decoding needs role='decode' or the whole model")
        self.model, self.config = model, base.config
        for name, value in (("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                            ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int)
                                       or num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive integer or None, got {num_blocks!r}")
        if max_seq_len > self.config.max_position_embeddings:
            raise ValueError(f"max_seq_len {max_seq_len} > max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        self.max_batch_size, self.max_seq_len, self.block_size = max_batch_size, max_seq_len, block_size
        self.max_blocks = math.ceil(max_seq_len / block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_batch_size * self.max_blocks
        self.device = base.embed.weight.device
        self.caches = ModelCaches.allocate(self.config, slots_with_scratch(max_batch_size),
                                           self.num_blocks, block_size, self.device)
        self.allocator = BlockAllocator(self.num_blocks)
        self.decode_batch = DecodeBatch(max_batch_size, self.max_blocks, self.device) \
            if persistent_metadata else None
        # A model of several ranks with tensor-parallel attention: this is rank 0, whose every
        # model call is first broadcast to the other ranks, which make it on their own caches
        # (v41graph.parallel.spmd). None at world size 1 (the model then has no ParallelState)
        # and under data-parallel attention, where every rank drives its own sequences (the
        # same number of tokens per step on every rank is then the caller's rule, as the
        # model's: its expert all-to-all has fixed shapes).
        self.spmd = None
        parallel = getattr(base, "parallel", None)
        if parallel is not None and parallel.attention == "tp":
            from v41graph.parallel.spmd import leader_for
            self.spmd = leader_for(self)

    def host_inputs(self, slots: Sequence[int], starts: Sequence[int], chunks: Sequence[Sequence[int]],
                    blocks: Sequence[Sequence[int]]):
        """(input ids, positions, metadata) of sequences in these slots, each with `starts[i]`
        tokens cached and chunk `chunks[i]` to run, built from host lists."""
        meta = build_metadata(slots, starts, [len(c) for c in chunks], blocks, self.max_blocks,
                              device=self.device)
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.int64, device=self.device)
        return ids, positions_of(meta), meta

    def decode_inputs(self, tokens: Sequence[int]):
        """(input ids, positions, metadata) of the persistent decode rows as they are now (the
        caller made them this step's sequences with DecodeBatch.sync), one token per row."""
        positions, meta = self.decode_metadata()
        return self.decode_batch.load_ids(tokens), positions, meta

    def decode_metadata(self):
        """(positions, metadata) of the persistent decode rows: cached views, nothing built,
        nothing read from the device (tests watch this call)."""
        return self.decode_batch.metadata()

    def call_model(self, ids, positions, meta, *, decode: bool, decoder_replay=None):
        """The step's model call: a decode step through `model.decode` (a compiled model's
        captured buckets), any other step through `model(...)`; on rank 0 of a parallel model
        broadcast to every rank first."""
        if self.spmd is not None:
            return self.spmd.call_model(ids, positions, meta, decode=decode, decoder_replay=decoder_replay)
        return run_model(self.model, self.caches, ids, positions, meta, decode=decode,
                         decoder_replay=decoder_replay)


def run_model(model, caches, ids, positions, meta, *, decode: bool, decoder_replay=None):
    """A step's model call, the same on every rank of a parallel job (the one place a step
    reaches the model): a decode step through `model.decode` (a compiled model's captured
    buckets), any other step through `model(...)`."""
    with torch.no_grad():
        if decode:
            return model.decode(ids, positions, caches, meta)
        if decoder_replay is None:
            return model(ids, positions, caches, meta)
        return model(ids, positions, caches, meta, decoder_replay=decoder_replay)
