"""Compile worker processes (issue 24): a cold start's compiles that do not depend on each other
run in a few worker processes instead of one after another in this one.

Three kinds of job use them:
  - Triton kernel specializations noted before a graph's first run (triton_precompile.py),
  - Inductor segments, each compiled to Inductor's generated Python module (inductor_segments.py),
  - and that module's Triton kernels, follow-up jobs of the segment's (as_done_with_follow_ups).

Workers are `python -m v41graph.compiler.compile_workers` subprocesses talking JSON lines on their
stdin/stdout (not multiprocessing: its spawn re-imports the user's __main__, which may be a script
that compiles the model). A job names the function that does it (`"call": "module:function"`,
given the job dict, returning a dict of results or raising); the reply is that dict with
`"ok": True`, or `"ok": False` and the error, with the seconds it took and which of the worker's
jobs it was (`"s"`, `"nth"`). The environment variables a compile or a cache key
reads (TRITON_*, TORCHINDUCTOR_*, ...) are sent with every job, so a worker compiles into the
caches, and with the settings, that this process has now, even when they changed after the start.

One queue feeds all workers, ordered by priority then submission: a batch submitted while
another runs (segments while Triton kernels compile in the background) shares the workers instead
of waiting for the whole other batch. Workers start when a CompiledModel is made on CUDA or
with Inductor segments on, so their imports overlap the trace, and stop after IDLE_S without work. $V41GRAPH_COMPILE_WORKERS
sets their number (0: off; default min(16, CPUs)).
"""
from __future__ import annotations

import atexit
import importlib
import itertools
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

_log = logging.getLogger(__name__)

ENV_VAR = "V41GRAPH_COMPILE_WORKERS"
IDLE_S = 60.0           # workers stop after this long without a job (restarted when needed)
JOB_TIMEOUT_S = 300.0   # a batch waits at most this long; its callers do what is left themselves


def worker_count() -> int:
    """$V41GRAPH_COMPILE_WORKERS, else min(16, CPUs of this process)."""
    value = os.environ.get(ENV_VAR, "").strip()
    if value:
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"${ENV_VAR} must be a whole number of worker processes (0: off), got {value!r}")
        if n < 0:
            raise ValueError(f"${ENV_VAR} must be >= 0, got {n}")
        return n
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(16, cpus)


# the environment variables a compile or a cache key reads (Triton's, its compilers', Inductor's)
_ENV_PREFIXES = ("TRITON_", "MLIR_", "LLVM_", "TORCHINDUCTOR_")


def compile_env() -> dict:
    """Those variables as this process has them now (sent with every job)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}


# A worker lowers its priority before importing anything: the workers start while this process
# traces (single-threaded Python), and sixteen imports of torch at normal priority slowed that
# trace by 8 s on an H100 host (26.4 s instead of 18.7 s).
_WORKER_START = (f"import os; getattr(os, 'nice', abs)(19); import runpy; "
                 f"runpy.run_module({__name__!r}, run_name='__main__')")


class _Worker:
    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.stopping = threading.Event()


class CompileWorkers:
    """A few worker processes serving one queue of compile jobs (see the module docstring).
    `preload`: what each worker does when it starts, before its first job: a "module" is
    imported, a "module:function" imported and called (no arguments; a failure is ignored, the
    jobs that need it then fail or pay for it themselves)."""

    def __init__(self, n: int, preload: tuple = ()):
        self.n = n
        self.preload = tuple(preload)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()     # submission order within a priority
        self._in_flight = 0                 # jobs submitted and not answered
        self._timer: threading.Timer | None = None

    def add_preload(self, modules) -> None:
        """Workers started from now on also import `modules` first."""
        self.preload = tuple(dict.fromkeys(self.preload + tuple(modules)))

    def start(self) -> None:
        with self._lock:
            self._cancel_timer()
            self._workers = [w for w in self._workers if w.proc.poll() is None and not w.stopping.is_set()]
            env = dict(os.environ)
            # the package as this process imports it, installed or not
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            while len(self._workers) < self.n:
                proc = subprocess.Popen(
                    [sys.executable, "-c", _WORKER_START, "--worker", *self.preload], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
                worker = _Worker(proc)
                self._workers.append(worker)
                threading.Thread(target=self._serve, args=(worker,), daemon=True,
                                 name="v41graph-compile-worker").start()

    def stop(self, kill: bool = False, if_idle: bool = False) -> None:
        """Close the workers' input (they exit when done), or with `kill` end them now (the jobs
        they were running report an error). `if_idle` (the idle timer): only with no job in flight."""
        with self._lock:
            if if_idle and self._in_flight:
                return
            self._cancel_timer()
            workers, self._workers = self._workers, []
        for w in workers:
            w.stopping.set()
            try:
                w.proc.kill() if kill else w.proc.stdin.close()
            except OSError:
                pass
        for w in workers:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()

    def restart(self, preload: tuple | None = None) -> None:
        """Replace the workers by fresh ones (each finishes its current job first; queued jobs
        wait for the new ones): what a job left in a worker (a CUDA context) goes with it.
        `preload`, if given, replaces the modules the new workers import first."""
        self.stop()
        if preload is not None:
            self.preload = tuple(preload)
        self.start()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _serve(self, worker: _Worker) -> None:
        """A worker's thread: take the next job, send it, wait for the reply."""
        while not worker.stopping.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if worker.stopping.is_set():    # stopped meanwhile: the job waits for another worker
                self._queue.put(item)
                return
            _, _, job, future = item
            line = ""
            try:
                worker.proc.stdin.write(json.dumps(job) + "\n")
                line = worker.proc.stdout.readline()
                reply = json.loads(line) if line else {"ok": False, "error": "worker exited"}
            except (OSError, ValueError) as exc:
                reply = {"ok": False, "error": f"worker: {type(exc).__name__}: {exc}"}
            self._answer(future, reply)
            if not line:
                worker.stopping.set()
                self._fail_queued_if_none_left()
                return

    def _fail_queued_if_none_left(self) -> None:
        """Every worker gone (they crashed, or were killed): the queued jobs fail now instead of
        waiting out their batch's timeout (the next batch starts new workers)."""
        with self._lock:
            if any(w.proc.poll() is None and not w.stopping.is_set() for w in self._workers):
                return
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._answer(item[3], {"ok": False, "error": "no compile worker left (they exited)"})

    def _answer(self, future: Future, reply: dict) -> None:
        if not future.done():
            future.set_result(reply)
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:      # idle: stop after IDLE_S unless more work comes
                self._cancel_timer()
                self._timer = threading.Timer(IDLE_S, self.stop, kwargs={"if_idle": True})
                self._timer.daemon = True
                self._timer.start()

    def submit(self, jobs: list[dict], priority: int = 1) -> list[Future]:
        """One future per job, resolved with its reply ({"ok": bool, "s": seconds, "error": text,
        ...}); a job whose worker died resolves with ok False. Lower `priority` first."""
        futures = []
        with self._lock:      # in flight before anything else: the idle timer no longer stops them
            self._cancel_timer()
            self._in_flight += len(jobs)
        for job in jobs:
            future: Future = Future()
            self._queue.put((priority, next(self._order), job, future))
            futures.append(future)
        self.start()
        return futures

    def give_up(self, futures: list[Future], timeout: float) -> None:
        """`futures` not done after `timeout`: the workers are stuck; kill them (their jobs fail,
        callers do them themselves) and resolve what is left with ok False."""
        _log.warning("compile workers: %d jobs not done after %.0f s; stopping the workers",
                     sum(not f.done() for f in futures), timeout)
        self.stop(kill=True)
        for future in futures:
            if not future.done():
                future.set_result({"ok": False, "error": "not done in time"})

    def as_done_with_follow_ups(self, jobs: dict, follow_ups, priority: int = 0, follow_priority: int = -1,
                                timeout: float = JOB_TIMEOUT_S):
        """Submit `jobs` ({key: job}) at `priority`; each reply that is ok may ask for more jobs:
        `follow_ups(reply)` gives them as {name: job}, submitted at `follow_priority` (lower:
        before the batch's jobs still queued), a name already submitted by another reply of
        the batch not again. Yields (key, reply, [its follow-ups' replies]) as soon as a job and
        all its follow-ups are answered. Past `timeout` the workers are given up (give_up:
        what is left answers ok False)."""
        first = dict(zip(self.submit(list(jobs.values()), priority), jobs))
        named: dict = {}          # follow-up name -> its future
        waiting: dict = {}        # job key -> (its reply, its follow-ups' futures)
        pending, deadline = set(first), time.monotonic() + timeout
        while pending or waiting:
            done, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                 return_when=FIRST_COMPLETED)
            if not done and pending:
                self.give_up(list(pending), timeout)
                continue
            for future in (f for f in done if f in first):
                reply = future.result()
                asked = follow_ups(reply) if reply.get("ok") else {}
                new = [name for name in asked if name not in named]
                for name, follow_up in zip(new, self.submit([asked[name] for name in new], follow_priority)):
                    named[name] = follow_up
                    pending.add(follow_up)
                waiting[first[future]] = (reply, [named[name] for name in asked])
            for key in [key for key, (_, futures) in waiting.items() if all(f.done() for f in futures)]:
                reply, futures = waiting.pop(key)
                yield key, reply, [f.result() for f in futures]

    def compile(self, jobs: list[dict], timeout: float = JOB_TIMEOUT_S, priority: int = 1) -> list[dict]:
        """Each job's reply, in order (submit); a job not done within `timeout` reports ok False."""
        if not jobs:
            return []
        futures = self.submit(jobs, priority)
        if wait(futures, timeout=timeout).not_done:
            self.give_up(futures, timeout)
        return [f.result() for f in futures]


_WORKERS: CompileWorkers | None = None


def workers(preload: tuple = ()) -> CompileWorkers | None:
    """The process's workers, started (None when $V41GRAPH_COMPILE_WORKERS is 0); `preload`
    adds modules that workers started from now on import first."""
    global _WORKERS
    n = worker_count()
    if n == 0:
        return None
    if _WORKERS is None:
        _WORKERS = CompileWorkers(n)
        atexit.register(_WORKERS.stop)
    _WORKERS.add_preload(preload)
    _WORKERS.start()
    return _WORKERS


def _worker_main(preload: list) -> None:
    # the protocol owns stdout: anything else printed (C libraries too) goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    for entry in ["triton", *preload]:     # done before the first job: part of the start-up
        module, _, function = entry.partition(":")
        try:
            imported = importlib.import_module(module)
            if function:
                getattr(imported, function)()
        except Exception:     # (the jobs that need it then report the error or pay the cost)
            pass
    for nth, line in enumerate(sys.stdin, start=1):
        job = json.loads(line)
        for key in [k for k in os.environ if k.startswith(_ENV_PREFIXES)]:
            del os.environ[key]
        os.environ.update(job["env"])
        t0 = time.perf_counter()
        try:
            module, name = job["call"].split(":")
            reply = {"ok": True, **(getattr(importlib.import_module(module), name)(job) or {})}
        except Exception as exc:   # reported; the caller does this job itself
            reply = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        reply["s"] = round(time.perf_counter() - t0, 3)
        reply["nth"] = nth      # this worker's how-manieth job (its first pays what its start left)
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker_main(sys.argv[2:])
