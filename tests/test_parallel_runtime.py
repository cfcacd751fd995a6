"""The SPMD runtime (v41graph/parallel/spmd.py): rank 0's Engine / Session broadcast every model
call and the other ranks follow it.

In this process: the wire format (a step's tensors through header + flat payload and back),
`--parallel` parsing, world size 1 touching no collective, the role errors and the engine loop's
fatal path. As multi-process jobs (gloo on CPU, tests/parallel/engine_worker.py): the mixed
Engine scenario and a Session under TP2 and TP2+EP2 give exactly the
token ids of one process over the whole model, and every rank exits 0; a follower whose model
differs is named by rank 0's Engine; a killed follower, a killed rank 0 and a failing lead
function end every rank with a clear error within the timeout; `v41graph serve --parallel`
answers like one process and stops cleanly on SIGINT.

The engine job runs through torchrun (`python -m torch.distributed.run`). The failure and
serving jobs start each rank as a plain process with the environment torchrun would give it
(RANK, WORLD_SIZE, MASTER_ADDR/PORT): torchrun's agent kills the remaining ranks itself when one
dies, so only without it can the test see that rank 0 ends on its own, and a signal reach rank 0
alone."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import v41graph
from processes import wait_until_healthy
from v41graph.model.metadata import build_metadata, positions_of
from v41graph.model.model import V41Model, init_random_
from v41graph.parallel import ParallelConfig, ParallelState
from v41graph.parallel import spmd
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is unavailable in this torch build", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("single_thread")

WORKER = Path(__file__).parent / "parallel" / "engine_worker.py"
STEP_TIMEOUT_S = 20          # the process-group timeout of the failure jobs
JOB_LIMIT_S = 240            # a job that runs longer hangs: killed, and the test fails


def tiny_config():
    """The tiny config with experts TP2 divides into whole 32-wide scale blocks."""
    return v41graph.V41Config.tiny(moe_intermediate_size=64)


def _free_port(lo: int = 29650, hi: int = 29700) -> int:
    """A free TCP port of this test's range (29650-29699)."""
    for port in range(lo, hi):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {lo}..{hi - 1}")


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE", **extra}


def _start_ranks(argv: list, n: int = 2) -> list:
    """n plain processes with torchrun's environment for ranks 0..n-1 (one rendezvous port)."""
    port = _free_port()
    return [subprocess.Popen(argv, env=_env(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r),
                                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for r in range(n)]


def _wait_all(procs: list, limit: float = JOB_LIMIT_S) -> list:
    """[(exit status, output)] of every process; kills what is still running after `limit`."""
    deadline, got = time.monotonic() + limit, []
    for p in procs:
        try:
            out = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out = p.communicate()[0]
            pytest.fail(f"a rank still ran after {limit} s (a hang): {out.decode(errors='replace')[-3000:]}")
        got.append((p.returncode, out.decode(errors="replace")))
    return got


def _read(out: Path, rank: int) -> dict:
    return json.loads(Path(f"{out}.rank{rank}.json").read_text())


# ------------------------------------------------------------------------------ in this process
def _step_of(seed: int, int32: bool = False):
    """A mixed step (a decode row, two prefill chunks) with metadata built from host lists."""
    g = torch.Generator().manual_seed(seed)
    chunks = [[5], [1, 2, 3], list(range(7))]
    meta = build_metadata([2, 0, 1], [9, 0, 4], [len(c) for c in chunks], [[3, 4], [0], [1, 2, 5]], 4)
    if int32:
        meta.seq_slot = meta.seq_slot.to(torch.int32)
    ids = torch.randint(0, 256, (sum(len(c) for c in chunks),), generator=g)
    return ids, positions_of(meta), meta


@pytest.mark.parametrize("replay", [None, 8, "tensor"])
@pytest.mark.parametrize("decode", [False, True])
def test_a_step_crosses_the_wire_unchanged(replay, decode):
    ids, positions, meta = _step_of(1, int32=replay == 8)
    meta.static_key = 41 if decode else None
    replay_arg = torch.tensor([0, 0, 3]) if replay == "tensor" else replay
    header, tensors = spmd._step_header(7, ids, positions, meta, decode, replay_arg)
    assert len(header) == spmd.HEADER_LEN and header[:3] == [spmd.STEP, 7, int(decode)]
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    got = spmd._step_from(header, flat, "cpu")
    assert got["decode"] is decode and got["meta"].static_key == meta.static_key
    for name, want, have in [("ids", ids, got["ids"]), ("positions", positions, got["positions"])] + [
            (f, getattr(meta, f), getattr(got["meta"], f)) for f in spmd._META_FIELDS]:
        if want is None:
            assert have is None, name
            continue
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name
    if replay == "tensor":
        assert torch.equal(got["decoder_replay"], replay_arg)
    else:
        assert got["decoder_replay"] == replay


def test_parse_layout():
    assert spmd.parse_layout("tp=2,ep=2") == ParallelConfig(tp=2, ep=2)
    assert spmd.parse_layout(" dp=4 , ep=4 ") == ParallelConfig(dp=4, ep=4)
    for bad, what in [("tp2", "NAME=N"), ("pp=2", "NAME=N"), ("tp=x", "not an integer"),
                      ("tp=2,tp=2", "given twice"), ("", "at least one"), ("tp=2,dp=2", "not both")]:
        with pytest.raises(ValueError, match=what):
            spmd.parse_layout(bad)


def test_serve_refuses_data_parallel_attention_before_joining(tmp_path):
    """`serve --parallel dp=...` is not built (rank 0 would have to split the requests over the
    dp ranks): refused with a clear error before any process group exists."""
    from v41graph.tools.cli import _parser
    args = _parser().parse_args(["serve", str(tmp_path), "--parallel", "dp=2,ep=2"])
    with pytest.raises(ValueError, match="data-parallel attention is not served yet"):
        spmd.serve(args)
    assert not dist.is_initialized()


def test_world_size_one_broadcasts_nothing(monkeypatch):
    """A model built with a ParallelState of one rank is the single-device model: its Engine
    has no leader and never reaches torch.distributed."""
    def no_collective(*a, **kw):
        raise AssertionError("a collective at world size 1")
    for name in ("broadcast", "broadcast_object_list", "all_gather_object", "new_group"):
        monkeypatch.setattr(dist, name, no_collective)
    torch.manual_seed(0)
    model = init_random_(V41Model(tiny_config(), parallel=ParallelState(ParallelConfig(), 0)), seed=0).eval()
    assert model.parallel is None
    eng = Engine(model, max_batch_size=2, max_seq_len=32, block_size=16)
    assert eng.spmd is None
    out = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2))
    assert [len(o.token_ids) for o in out] == [2, 2]


def test_only_rank_0_runs_an_engine_and_only_others_follow():
    cfg = tiny_config()
    rank1 = V41Model(cfg, parallel=ParallelState(ParallelConfig(tp=2), 1))
    with pytest.raises(ValueError, match="rank 1 .*only rank 0 runs a Session or Engine.*follow"):
        Engine(rank1, max_batch_size=2, max_seq_len=32, block_size=16)
    with pytest.raises(ValueError, match="not parallel"):
        spmd.follow(V41Model(cfg))
    rank0 = V41Model(cfg, parallel=ParallelState(ParallelConfig(tp=2), 0))
    with pytest.raises(ValueError, match="runs on ranks > 0"):
        spmd.follow(rank0)


def test_a_broken_job_stops_the_engine_loop(monkeypatch):
    """A step that fails with ParallelJobError (the ranks out of step) ends serving: the engine
    thread fails what runs, records the failure and calls on_fatal (the server's exit), instead
    of serving on as after an ordinary step failure."""
    from v41graph.serving.engine_loop import EngineLoop, Submission
    model = init_random_(V41Model(tiny_config()), seed=0).eval()
    eng = Engine(model, max_batch_size=2, max_seq_len=32, block_size=16)

    def broken_step():
        raise spmd.ParallelJobError("rank 0: step 0 failed: a rank went away")
    monkeypatch.setattr(eng, "step", broken_step)
    loop = EngineLoop(eng)
    called = []
    loop.on_fatal = lambda: called.append(True)
    loop.start()
    loop.submit(Submission([1, 2, 3], lambda n: SamplingParams(max_tokens=2), None))
    loop._thread.join(30)
    assert not loop._thread.is_alive() and called == [True]
    assert loop.fatal == "engine step failed: ParallelJobError: rank 0: step 0 failed: a rank went away"
    assert eng.running == [] and eng.num_free_blocks == eng.num_blocks    # its request aborted


# ------------------------------------------------------------------------------ multi-process
def test_engine_and_session_under_tp2_and_tp2_ep2_match_one_process(tmp_path):
    """Rank 0 runs the same mixed scenario (prompt lengths 5..40, greedy and seeded sampling,
    a rejected request, a request added mid-run and one aborted, a lone sequence at the end)
    over the whole model in-process and over the parallel model; the tokens must be equal, the
    follower must have run exactly rank 0's model calls, and torchrun's exit status 0 says every
    rank shut down cleanly."""
    out = tmp_path / "engine"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                             str(WORKER), "--mode", "engine", "--layout", "tp2", "tp2ep2",
                             "--max-tokens", "5", "--steps", "3", "--out", str(out)],
                            env=_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    [(code, log)] = _wait_all([proc])
    assert code == 0, log[-4000:]
    r0, r1 = _read(out, 0), _read(out, 1)
    ref = r0["reference"]
    assert ref["engine"]["rejected"] and "outside the vocabulary" in ref["engine"]["rejected"][0]
    assert ref["engine"]["finish"]["mid_greedy"] == "abort"
    assert sorted(ref["engine"]["tokens"]) == ["added_seeded", "long_seeded", "mid_greedy", "short_greedy"]
    for layout in ("tp2", "tp2ep2"):
        got = r0["layouts"][layout]
        assert got["engine"]["tokens"] == ref["engine"]["tokens"], layout
        assert got["engine"]["finish"] == ref["engine"]["finish"], layout
        assert got["engine"]["rejected"] == ref["engine"]["rejected"], layout
        assert got["session"] == ref["session"], layout
        assert r1["layouts"][layout]["followed_steps"] == got["model_calls"], layout
    assert r0["mismatch"] == ("the ranks' models do not match: rank 1's model numerics is reference, "
                              "rank 0's is fast")
    assert r1["mismatch_steps"] == 0


def _failure_job(tmp_path, mode: str):
    out = tmp_path / mode
    procs = _start_ranks([sys.executable, str(WORKER), "--mode", mode, "--die-after", "3",
                          "--timeout", str(STEP_TIMEOUT_S), "--out", str(out)])
    return out, _wait_all(procs)


def test_a_killed_follower_ends_rank_0_with_an_error(tmp_path):
    out, [(code0, log0), (code1, _)] = _failure_job(tmp_path, "kill-follower")
    assert code1 == -signal.SIGKILL
    assert code0 == 3, log0[-3000:]                  # the worker's exit status for ParallelJobError
    r0 = _read(out, 0)
    assert "rank 0 of attention TP2" in r0["error"] and "step 3 failed" in r0["error"]
    died = float(Path(f"{out}.died").read_text())
    assert r0["error_time"] - died < STEP_TIMEOUT_S


def test_a_hung_follower_ends_rank_0_at_the_timeout(tmp_path):
    """A follower that is alive but stops answering (asleep before its step's collectives):
    rank 0's step fails at the process-group timeout, not later and not never."""
    out = tmp_path / "hang"
    procs = _start_ranks([sys.executable, str(WORKER), "--mode", "hang-follower", "--die-after", "3",
                          "--timeout", str(STEP_TIMEOUT_S), "--out", str(out)])
    try:
        [(code0, log0)] = _wait_all(procs[:1])
    finally:
        procs[1].kill()                  # asleep for an hour: it never notices by itself
        procs[1].wait()
    assert code0 == 3, log0[-3000:]
    r0 = _read(out, 0)
    assert "step 3 failed" in r0["error"] and "Timed out" in r0["error"]
    waited = r0["error_time"] - float(Path(f"{out}.died").read_text())
    assert STEP_TIMEOUT_S - 1 < waited < STEP_TIMEOUT_S + 10


def test_a_killed_rank_0_ends_the_followers_with_an_error(tmp_path):
    out, [(code0, _), (code1, log1)] = _failure_job(tmp_path, "kill-leader")
    assert code0 == -signal.SIGKILL
    assert code1 == 3, log1[-3000:]
    r1 = _read(out, 1)
    assert "rank 1" in r1["error"] and "lost rank 0" in r1["error"]
    assert r1["error_time"] - float(Path(f"{out}.died").read_text()) < STEP_TIMEOUT_S


def test_a_failing_lead_function_ends_the_followers_naming_it(tmp_path):
    out, [(code0, log0), (code1, log1)] = _failure_job(tmp_path, "lead-fails")
    assert code0 != 0 and "the lead function gave up on purpose" in log0
    assert code1 == 3, log1[-3000:]
    assert "rank 0 failed: RuntimeError: the lead function gave up on purpose" in _read(out, 1)["error"]


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    """A random tiny checkpoint that TP2 divides (moe_intermediate_size 64: the shared expert's
    halves are whole 32-wide scale blocks)."""
    pytest.importorskip("transformers", reason="serving needs the [serve] packages")
    from v41graph.weights.random_checkpoint import write_random_checkpoint
    out = tmp_path_factory.mktemp("tp_checkpoint")
    write_random_checkpoint(tiny_config(), out, seed=0, progress=False)
    return out


def test_serve_parallel_answers_like_one_process_and_stops_cleanly(tp_checkpoint):
    for mod in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(mod, reason="serving needs the [serve] packages")
    import httpx
    http_port = _free_port(29690, 29700)
    procs = _start_ranks([sys.executable, "-m", "v41graph.tools.cli", "serve", str(tp_checkpoint),
                          "--parallel", "tp=2,ep=2", "--port", str(http_port), "--max-seq-len", "64",
                          "--log-level", "warning", "--parallel-timeout", "60"])
    try:
        health = wait_until_healthy(http_port, procs, "v41graph serve --parallel")
        assert health["status"] == "ok"
        r = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                       json={"prompt": "Hello there", "max_tokens": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
        procs[0].send_signal(signal.SIGINT)             # rank 0 only: it stops the follower
        (code0, log0), (code1, log1) = _wait_all(procs, 90)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert code0 == 0, log0[-3000:]
    assert code1 == 0 and "stopped by rank 0" in log1, log1[-3000:]
    model = v41graph.from_pretrained(tp_checkpoint, numerics="fast")
    eng = Engine(model, 1, 64, block_size=16)
    want = eng.generate(["Hello there"], SamplingParams(max_tokens=4, stop_ids=[eng.tokenizer.eos_token_id]))[0]
    assert got == want.text
