"""One background thread that owns the Engine: the HTTP handlers (asyncio, another thread) never
call it. They hand work over through a thread-safe command queue (`submit`, `abort`) and get
events back on their own asyncio.Queue (`call_soon_threadsafe`):

    ("accepted", prompt_tokens)                   the request passed validation and is queued
    ("rejected", status, message)                 refused (400: a bad request; 500: a bug)
    ("text", text_delta, new_ids, new_logprobs)   output text that may be shown now, the new
                                                  token ids, their {id: logprob} (or None)
    ("finished", finish_reason, error, tokens)    stop | length | abort | error

Between steps the thread applies every pending command, so a new request joins the running
batch at the next step (continuous batching) and an abort frees its blocks before the next
step. When idle it blocks on the command queue.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from v41graph.parallel.spmd import ParallelJobError
from v41graph.runtime.batch import CacheCapacityError
from v41graph.runtime.engine import Engine, RequestError
from v41graph.runtime.sampling import SamplingParams

log = logging.getLogger("v41graph.serving")

__all__ = ["EngineLoop", "Submission"]


@dataclass
class Submission:
    """One HTTP request's link to the engine thread."""
    prompt: Any                                        # token ids, a string or chat messages
    make_params: Callable[[int], SamplingParams]       # prompt length -> params (may raise ValueError)
    loop: asyncio.AbstractEventLoop | None           # None: no one listens any more
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None                      # set by the engine thread
    sent_chars: int = 0                                # output text already handed over
    finished: bool = False                             # set on the handler's side

    def _put(self, event: tuple) -> None:              # engine thread -> the handler's loop
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Submission] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="v41graph-engine", daemon=True)
        self.error: str | None = None                  # the last step failure, for /health
        # A failure that ends serving (a parallel job's ranks out of step): the thread stops
        # and calls on_fatal (the server's exit).
        self.fatal: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        self._snapshot = self._counts()

    # ---------------------------------------------------------------- handler side (any thread)
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, sub: Submission) -> None:
        self._commands.put(("add", sub))

    def abort(self, sub: Submission) -> None:
        self._commands.put(("abort", sub))

    def snapshot(self) -> dict:
        """Counts made by the engine thread after its last step (a dict replaced whole)."""
        return dict(self._snapshot)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            # Idle: sleep until a command comes. Busy: take what is there, then step.
            cmd = self._commands.get() if not eng.has_unfinished() else self._next_command()
            while cmd is not None:
                self._apply(*cmd)
                cmd = self._next_command()
            if eng.has_unfinished() and not self._stop.is_set():
                try:
                    eng.step()
                except Exception as e:   # noqa: BLE001  (a bug in a step: fail what runs, keep serving)
                    log.exception("engine step failed")
                    self.error = f"engine step failed: {type(e).__name__}: {e}"
                    for sub in list(self._live.values()):
                        sub._put(("finished", "error", self.error, 0))
                        try:
                            eng.abort(sub.request_id)
                        except Exception:   # noqa: BLE001  (the engine may be broken by now)
                            log.exception("abort after a failed step")
                        sub.loop = None      # nothing more to this request's handler
                    if isinstance(e, ParallelJobError):
                        self.fatal = self.error
                        if self.on_fatal is not None:
                            self.on_fatal()
                        break
            self._release_finished()
            self._snapshot = self._counts()
        for sub in list(self._live.values()):            # shutting down: abort what is left
            self._apply("abort", sub)

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, kind: str, sub: Submission | None) -> None:
        eng = self.engine
        if kind == "add":
            try:
                ids = eng.prompt_ids(sub.prompt)
                params = sub.make_params(len(ids))
                rid = eng.add_request(ids, params, callback=lambda r, new, fin: self._on_tokens(sub, new, fin))
            except (RequestError, CacheCapacityError, ValueError, TypeError) as e:
                sub._put(("rejected", 400, str(e)))
                return
            except Exception as e:   # noqa: BLE001  (a bug: refuse this request, keep serving)
                log.exception("adding a request failed")
                sub._put(("rejected", 500, f"adding the request failed: {type(e).__name__}: {e}"))
                return
            sub.request_id = rid
            self._live[rid] = sub
            sub._put(("accepted", len(ids)))
        elif kind == "abort":     # (a "wake" command only ends the wait)
            rid = sub.request_id
            if rid is not None and rid in self._live:
                eng.abort(rid)
                self._release_finished()

    def _on_tokens(self, sub: Submission, new: list, finished: bool) -> None:
        """The engine's stream callback (inside step / abort, on this thread)."""
        text = self.engine.text(sub.request_id) or ""
        delta, sub.sent_chars = text[sub.sent_chars:], len(text)
        req = self.engine.requests[sub.request_id]
        if delta or new:
            logprobs = None if req.logprobs is None or not new else req.logprobs[-len(new):]
            sub._put(("text", delta, list(new), logprobs))
        if finished:
            sub._put(("finished", req.finish_reason, req.error, len(req.output)))

    def _release_finished(self) -> None:
        for rid in [r for r in self._live if self.engine.requests[r].status == "finished"]:
            self.engine.release(rid)
            del self._live[rid]

    def _counts(self) -> dict:
        eng = self.engine
        return {"free_blocks": eng.num_free_blocks, "total_blocks": eng.num_blocks,
                "free_slots": len(eng.free_slots), "total_slots": eng.max_batch_size,
                "running": len(eng.running), "waiting": len(eng.waiting),
                "finished": {k[len("finished_"):]: v for k, v in eng.stats.items() if k.startswith("finished_")},
                "steps": eng.stats["steps"]}
