"""The decode worker's Engine: requests arrive as hand-overs (their KV already built by a
prefill worker) and are admitted like any request; plain prompts still work (D holds the whole
model).

    eng = DecodeEngine(from_pretrained(ckpt, role="decode"), max_batch_size=8, max_seq_len=4096)
    rid = eng.add_handover(handover, SamplingParams(max_tokens=64))   # checked here
    while eng.has_unfinished():
        eng.step()

A hand-over request waits for a slot and its blocks like any other (FIFO). The step that
admits it writes its hand-over into the caches and runs the decoder layers over the replay
inputs of every request admitted in that step (one batched call, V41Model.decode_replay),
samples each one's first token, and then runs its decode batch, these requests included.
"""
from __future__ import annotations

import time

from v41graph.runtime.batch import eager_model
from v41graph.runtime.engine import Engine

from .handover import Handover, check, check_fingerprint
from .roles import handover_fingerprint
from .workers import replay_handovers

__all__ = ["DecodeEngine"]


class DecodeEngine(Engine):
    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        if self.spec is not None:
            raise ValueError("DecodeEngine: speculative decoding of hand-over requests is not built yet")
        self.base = eager_model(model)
        self.fingerprint = handover_fingerprint(self.base)
        self.handovers: dict = {}          # request id -> (checked parts, fields)
        self._started: list = []           # this step's events of started hand-overs

    def add_handover(self, handover: Handover, params=None, callback=None) -> int:
        """Queue a request that a prefill worker handed over. The hand-over is checked here
        (fingerprint, every part against this worker's layout: HandoverError), the request
        like add_request's (RequestError); nothing is queued if either fails."""
        if not isinstance(handover, Handover):
            raise TypeError(f"add_handover: expected a Handover, got {type(handover).__name__}")
        what = f"request {handover.request_id}"
        check_fingerprint(self.fingerprint, handover.fingerprint, what)
        checked = check(self.config, handover, self.base.compute_dtype, what)
        rid = self.add_request(handover.prompt_ids, params, callback)
        self.handovers[rid] = checked
        return rid

    def _finish(self, req, reason: str) -> None:
        self.handovers.pop(req.request_id, None)
        super()._finish(req, reason)

    def step(self) -> list:
        self._started = []
        events = super().step()
        return self._started + events

    def _admit(self) -> None:
        # A hand-over request starts in the step that admits it, before the step's batch is
        # scheduled: its prompt is then cached and its first token sampled, so the scheduler
        # never gives it a prefill chunk (it decodes with the others in this same step).
        super()._admit()
        self._started += self._start_handovers()

    def _start_handovers(self) -> list:
        """Write the hand-overs of the requests admitted since the last step, run their
        decoder replay in one call, sample their first tokens."""
        if not self.handovers:               # the common step: nothing handed over waits
            return []
        reqs = [r for r in self.running if r.request_id in self.handovers]
        if not reqs:
            return []
        logits = replay_handovers(self, [(self.handovers.pop(r.request_id), r.slot, r.blocks,
                                                     len(r.prompt)) for r in reqs])
        self.stats["handover_admissions"] += len(reqs)
        for r in reqs:
            r.num_cached = len(r.prompt)
        sampled = self.sampler.sample(logits, [r.params for r in reqs], [r.slot for r in reqs],
                                      [r.prompt for r in reqs], [0] * len(reqs))
        now = time.perf_counter()
        events = []
        for r, s in zip(reqs, sampled):
            if r.logprobs is not None:
                r.logprobs.append(s.logprobs)
            events.append(self._emit(r, [s.token_id], now))
        return events
