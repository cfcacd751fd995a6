"""The compile workers' pool (v41graph/compiler/compile_workers.py): jobs name the function a
worker calls; replies come back in order, errors as replies; a restart replaces the processes
and the queued jobs still run; two batches at once share the workers; follow-up jobs asked for
by replies run before the batch's queued jobs, once per name."""
from __future__ import annotations

import os
import threading
import time

from v41graph.compiler.compile_workers import CompileWorkers, compile_env

CALL = f"{__name__}:job_in_worker"
# generous: workers import torch at nice 19 and starve while a loaded machine runs other tests
TIMEOUT = 600


def job_in_worker(job: dict) -> dict:
    """(In a worker.) Sleep a little, say who ran the job and when it started, fail where asked."""
    started = time.time()
    time.sleep(job.get("sleep", 0.0))
    if job.get("crash"):
        os._exit(3)
    if job.get("fail"):
        raise RuntimeError(f"asked to fail: {job['fail']}")
    return {"pid": os.getpid(), "tag": job["tag"], "env_seen": os.environ.get("TRITON_TEST_MARK"),
            "started": started, "follow": job.get("follow", []), "prepared": _PREPARED}


_PREPARED: list = []


def prepare_in_worker() -> None:
    """(In a worker, at its start: a "module:function" preload entry.)"""
    _PREPARED.append(os.getpid())


def fail_to_prepare() -> None:
    raise RuntimeError("a start-up step that fails must not stop the worker")


def _job(tag, **kw) -> dict:
    return {"call": CALL, "tag": tag, "env": compile_env(), **kw}


def test_replies_in_order_errors_as_replies_and_the_environment_sent(monkeypatch):
    monkeypatch.setenv("TRITON_TEST_MARK", "sent-with-the-job")   # set after nothing started
    pool = CompileWorkers(2)
    try:
        replies = pool.compile([_job(i, sleep=0.05 * (3 - i)) for i in range(3)] + [_job(3, fail="x")],
                               timeout=TIMEOUT)
    finally:
        pool.stop()
    assert [r["ok"] for r in replies] == [True, True, True, False]
    assert [r.get("tag") for r in replies[:3]] == [0, 1, 2]
    assert len({r["pid"] for r in replies[:3]}) == 2             # both workers served
    assert all(r["env_seen"] == "sent-with-the-job" for r in replies[:3])
    assert "RuntimeError: asked to fail: x" in replies[3]["error"]


def test_restart_replaces_the_processes_and_two_batches_share_them():
    pool = CompileWorkers(2)
    try:
        first = pool.compile([_job(0), _job(1, sleep=0.2)], timeout=TIMEOUT)
        slow: list = []
        background = threading.Thread(target=lambda: slow.extend(
            pool.compile([_job(f"slow{i}", sleep=0.3) for i in range(4)], timeout=TIMEOUT)))
        background.start()
        time.sleep(0.1)
        pool.restart()      # the slow batch's queued jobs wait for the new workers
        urgent = pool.compile([_job("urgent")], timeout=TIMEOUT, priority=0)
        background.join(120)
    finally:
        pool.stop()
    assert all(r["ok"] for r in first + slow + urgent) and len(slow) == 4
    old = {r["pid"] for r in first}
    assert urgent[0]["pid"] not in old          # run by a fresh worker
    assert {r["pid"] for r in slow[2:]}.isdisjoint(old)    # queued before the restart, run after it


def test_preload_imports_modules_and_calls_functions_before_the_first_job():
    pool = CompileWorkers(1, preload=(f"{__name__}:fail_to_prepare", "json", f"{__name__}:prepare_in_worker",
                                      "no_such_module_v41graph"))
    try:
        replies = pool.compile([_job(0), _job(1)], timeout=TIMEOUT)
    finally:
        pool.stop()
    assert all(r["ok"] for r in replies)
    # called once, at the start, in the worker that ran the jobs (not per job, not here)
    assert [r["prepared"] for r in replies] == [[replies[0]["pid"]]] * 2
    assert _PREPARED == []


def test_jobs_fail_fast_when_every_worker_died():
    pool = CompileWorkers(1)
    try:
        t0 = time.perf_counter()
        replies = pool.compile([_job("crash", crash=True), _job("after")], timeout=TIMEOUT)
        took = time.perf_counter() - t0
        again = pool.compile([_job("next batch")], timeout=TIMEOUT)      # new workers for a new batch
    finally:
        pool.stop()
    assert [r["ok"] for r in replies] == [False, False] and "worker exited" in replies[0]["error"]
    # failed when the worker died, not at the batch's timeout
    assert "no compile worker left" in replies[1]["error"] and took < TIMEOUT / 2, (replies, took)
    assert again[0]["ok"] and again[0]["tag"] == "next batch" and again[0]["nth"] == 1   # a fresh worker


def test_follow_up_jobs_run_before_queued_jobs_once_per_name_and_gate_their_job():
    pool = CompileWorkers(1)       # one worker: the order of the queue is the order of work
    jobs = {"a": _job("a", follow=["x", "shared"]), "b": _job("b", follow=["shared"], sleep=0.3), "c": _job("c"),
            "d": _job("d", fail="no follow-ups for a failed job")}
    asked = []

    def follow_ups(reply):
        asked.append(reply["tag"])
        return {name: _job(name, sleep=0.05) for name in reply["follow"]}
    try:
        results, yielded_at = [], {}
        for key, reply, follow in pool.as_done_with_follow_ups(jobs, follow_ups, timeout=TIMEOUT):
            results.append((key, reply, follow))
            yielded_at[key] = time.time()
    finally:
        pool.stop()
    by_key = {key: (reply, follow) for key, reply, follow in results}
    assert sorted(by_key) == ["a", "b", "c", "d"] and sorted(asked) == ["a", "b", "c"]
    assert [f["tag"] for f in by_key["a"][1]] == ["x", "shared"] and [f["tag"] for f in by_key["b"][1]] == ["shared"]
    assert by_key["a"][1][1]["started"] == by_key["b"][1][0]["started"]      # "shared" ran once
    assert not by_key["d"][0]["ok"] and by_key["d"][1] == []
    # one worker served all six jobs, and each reply says which of its jobs it was
    nths = [r["nth"] for r, _ in by_key.values()] + [f["nth"] for key in ("a", "b") for f in by_key[key][1]]
    assert sorted(set(nths)) == [1, 2, 3, 4, 5, 6], nths
    started = {r["tag"]: r["started"] for r, follow in by_key.values() if r["ok"]}
    started.update({f["tag"]: f["started"] for _, follow in by_key.values() for f in follow})
    # a's follow-ups went before c, still queued when a answered (b may have been taken by the
    # worker already: it asks for the next job as soon as it answers)
    assert started["a"] < started["x"] < started["shared"] < started["c"], started
    # a job is yielded only once its follow-ups are done (each sleeps 0.05 s)
    assert yielded_at["a"] >= started["shared"] + 0.05 and yielded_at["b"] >= started["shared"] + 0.05
