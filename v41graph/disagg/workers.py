"""The two workers of a disaggregated prefill: P runs the encoder half of a bounded-replay
prefill and packs each request's hand-over layer by layer; D admits a hand-over into its own
caches, runs the decoder half (first token) and then decodes like any Session.

    p = PrefillWorker(from_pretrained(ckpt, role="prefill"), max_batch_size=4, max_seq_len=4096)
    d = DecodeWorker(from_pretrained(ckpt, role="decode"), max_batch_size=4, max_seq_len=4096)
    [h] = p.prefill([prompt], request_ids=[7])          # Handover (parts by name)
    logits = d.admit(0, h)                              # [V]: the first token's logits
    d.decode([[token]])                                 # Session.decode from here on

`PrefillWorker.prefill(..., on_part=fn)` calls fn(request_id, part_name, bytes) as each part is
final (after its encoder layer), which is where v41graph.disagg.transfer starts a send.
"""
from __future__ import annotations

import math
import time

import torch

from v41graph.model.metadata import build_metadata, positions_of, replay_metadata
from v41graph.runtime.batch import CacheCapacityError, StepRunner, eager_model, token_ids_list
from v41graph.runtime.session import Session

from .handover import Handover, HandoverError, check, check_fingerprint, layout, pack_part, write_into
from .roles import handover_fingerprint

__all__ = ["PrefillWorker", "DecodeWorker", "HandoverError", "replay_handovers"]


def replay_handovers(runner: StepRunner, admitted) -> torch.Tensor:
    """Write checked hand-overs into `runner`'s caches and run the decoder layers over their
    replay inputs in one flat batch (runner.model.decode_replay: a CompiledModel's graph or
    the eager model) (what one process's replay prefill of the same batch does:
    the same rows in every GEMM, so the same bits). admitted: [(checked parts and fields from
    handover.check, slot, blocks, prompt_len)]. Returns the first tokens' logits [B, V]."""
    streams, pres = [], []
    for (parts, fields), slot, blocks, n in admitted:
        replay = write_into(runner.caches, runner.config, parts, fields, slot, blocks, n)
        streams.append(replay["streams"])
        pres.append(replay["pre"])
    meta = build_metadata([a[1] for a in admitted], [0] * len(admitted), [a[3] for a in admitted],
                          [a[2] for a in admitted], runner.max_blocks, device=runner.device)
    sub, keep = replay_metadata(meta, runner.config.sliding_window)
    with torch.no_grad():
        return runner.model.decode_replay(torch.cat(streams), torch.cat(pres), positions_of(meta)[keep],
                                  runner.caches, sub)


class PrefillWorker(StepRunner):
    """Runs V41Model.encode over a batch of prompts (its own caches, freed after each call: P
    keeps no request after its hand-over) and packs each request's parts."""
    runs_decoder = False

    def __init__(self, model, max_batch_size: int, max_seq_len: int, block_size: int = 128,
                 num_blocks: int | None = None):
        super().__init__(model, max_batch_size, max_seq_len, block_size, num_blocks,
                         persistent_metadata=False)
        self.base = eager_model(model)
        self.fingerprint = handover_fingerprint(self.base)
        self.timings: dict = {}

    def prefill(self, prompts, request_ids, on_part=None) -> list[Handover]:
        """Encode these prompts (one flat batch); returns their Handovers. on_part(request_id,
        part_name, data) is called as each part is final, in sending order."""
        prompts = [token_ids_list(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        request_ids = token_ids_list(request_ids, "request_ids")
        cfg = self.config
        if len(request_ids) != len(prompts):
            raise ValueError(f"prefill: {len(prompts)} prompts but {len(request_ids)} request ids")
        if not prompts or len(prompts) > self.max_batch_size:
            raise ValueError(f"prefill: 1..{self.max_batch_size} prompts per call, got {len(prompts)}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}]: empty token list")
            bad = [t for t in p if not 0 <= t < cfg.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}]: token id {bad[0]} outside the vocabulary 0..{cfg.vocab_size - 1}")
            if len(p) > self.max_seq_len:
                raise CacheCapacityError(f"prompts[{i}]: {len(p)} tokens exceed max_seq_len {self.max_seq_len}")
        need = [math.ceil(len(p) / self.block_size) for p in prompts]
        if sum(need) > self.allocator.num_free:
            raise CacheCapacityError(f"prefill needs {sum(need)} cache blocks, {self.allocator.num_free} free")
        blocks = [self.allocator.allocate(k) for k in need]
        slots = list(range(len(prompts)))
        dtype = self.base.compute_dtype
        parts = [layout(cfg, len(p), dtype) for p in prompts]
        out = [Handover(r, list(p), self.fingerprint) for r, p in zip(request_ids, prompts)]
        plan = self.base.plan

        def emit(index: int, part_i: int, data: torch.Tensor) -> None:
            h, part = out[index], parts[index][part_i]
            h.parts[part.name] = data
            if on_part is not None:
                on_part(h.request_id, part.name, data)

        def on_layer(layer_id: int) -> None:
            for i, p in enumerate(prompts):
                emit(i, layer_id, pack_part(self.caches, parts[i][layer_id], slots[i], blocks[i], len(p), plan))

        try:
            ids, positions, meta = self.host_inputs(slots, [0] * len(prompts), prompts, blocks)
            t0 = time.perf_counter()
            with torch.no_grad():
                streams, pre, sub, _ = self.model.encode(ids, positions, self.caches, meta,
                                                         cfg.sliding_window, on_layer=on_layer)
            self.timings["encode_s"] = time.perf_counter() - t0
            qs = sub.query_start.tolist()
            for i, p in enumerate(prompts):
                replay = {"history": self.caches.engram_history[slots[i]],
                          "streams": streams[qs[i]:qs[i + 1]], "pre": pre[qs[i]:qs[i + 1]].float()}
                emit(i, len(parts[i]) - 1, pack_part(self.caches, parts[i][-1], slots[i], blocks[i],
                                                     len(p), plan, replay))
        finally:
            for b in blocks:
                self.allocator.free(b)
        return out


class DecodeWorker(Session):
    """A Session whose sequences start from hand-overs (`admit`) instead of prompts; `decode`,
    `extend`, `release` as in Session. Its model is the whole model (role "decode")."""

    def __init__(self, model, max_batch_size: int, max_seq_len: int, block_size: int = 128,
                 num_blocks: int | None = None, persistent_metadata: bool = True):
        super().__init__(model, max_batch_size, max_seq_len, block_size, num_blocks, persistent_metadata)
        self.base = eager_model(model)
        self.fingerprint = handover_fingerprint(self.base)

    def admit(self, seq: int, handover: Handover) -> torch.Tensor:
        """Start sequence `seq` from a hand-over; the first token's logits [V]
        (admit_batch of one)."""
        return self.admit_batch([seq], [handover])[0]

    def admit_batch(self, seqs, handovers) -> torch.Tensor:
        """Start these sequences from their hand-overs: check each (fingerprint, every part's
        size, capacity), write them into this worker's caches, run the decoder layers over
        their replay inputs in one flat batch (as one process's prefill of the same batch
        does: the same rows in every GEMM, so the same bits). Returns the first tokens' logits
        [B, V]. A bad hand-over raises HandoverError naming its request before any state
        changes (admit the others without it)."""
        seqs = token_ids_list(seqs, "seqs")
        handovers = list(handovers)
        if len(seqs) != len(handovers) or not seqs:
            raise ValueError(f"admit_batch: {len(seqs)} sequence ids for {len(handovers)} hand-overs")
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"admit_batch: sequence ids repeat: {seqs}")
        cfg, dtype = self.config, self.base.compute_dtype
        checked, need_total, free = [], 0, self.allocator.num_free
        for seq, h in zip(seqs, handovers):
            if not isinstance(h, Handover):
                raise TypeError(f"admit: expected a Handover, got {type(h).__name__}")
            what = f"request {h.request_id}"
            if not 0 <= seq < self.max_batch_size:
                raise ValueError(f"admit: sequence id {seq} outside 0..{self.max_batch_size - 1}")
            check_fingerprint(self.fingerprint, h.fingerprint, what)
            n = h.prompt_len
            if n < 1:
                raise HandoverError(f"{what}: empty prompt")
            if n > self.max_seq_len:
                raise CacheCapacityError(f"{what}: {n} prompt tokens exceed max_seq_len {self.max_seq_len}")
            need_total += math.ceil(n / self.block_size)
            free += len(self.blocks[seq])
            checked.append(check(cfg, h, dtype, what))      # every part, before any state changes
        if need_total > free:
            raise CacheCapacityError(f"admitting requests {[h.request_id for h in handovers]} needs "
                                     f"{need_total} cache blocks, {free} free")
        for seq, h in zip(seqs, handovers):
            self.release(seq)
            self.blocks[seq] = self.allocator.allocate(math.ceil(h.prompt_len / self.block_size))
        logits = replay_handovers(self, [(c, seq, self.blocks[seq], h.prompt_len)
                                                    for c, seq, h in zip(checked, seqs, handovers)])
        for seq, h in zip(seqs, handovers):
            self.seq_lens[seq] = h.prompt_len
        self.last_prefill_mode = "replay"
        return logits
