"""One rank of an SPMD runtime check, started by tests/test_parallel_runtime.py (gloo, CPU):
either through torchrun or as a plain process with torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) when the test must control single ranks.

  --mode engine        for each --layout: rank 0 runs the same mixed Engine scenario (and a
                       Session) over the whole model in-process and over its share of the
                       parallel model while the other ranks follow; rank 0 writes both outputs
  --mode kill-follower rank 1 kills itself (SIGKILL) after --die-after steps; rank 0 keeps
                       stepping an Engine and must fail with ParallelJobError
  --mode hang-follower rank 1 stops answering (sleeps) instead: rank 0 must fail at the
                       process-group timeout
  --mode kill-leader   rank 0 kills itself after --die-after engine steps; the followers must fail
  --mode lead-fails    rank 0's lead function raises after --die-after steps; the followers must
                       fail naming it

Every rank writes --out.rank<R>.json: what it saw (outputs, the error it raised, timings).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

import v41graph  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402
from v41graph.parallel import ParallelConfig, ParallelState  # noqa: E402
from v41graph.parallel import spmd  # noqa: E402
from v41graph.parallel.build import shard_model  # noqa: E402
from v41graph.runtime.engine import Engine, RequestError  # noqa: E402
from v41graph.runtime.sampling import SamplingParams  # noqa: E402

LAYOUTS = {"tp2": ParallelConfig(tp=2), "tp2ep2": ParallelConfig(tp=2, ep=2), "dp2ep2": ParallelConfig(dp=2, ep=2)}


def whole_model():
    cfg = v41graph.V41Config.tiny(moe_intermediate_size=64)
    return init_random_(V41Model(cfg), seed=0).float().eval().requires_grad_(False).set_numerics("fast")


def prompt(n: int, seed: int) -> list:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def scenario(model, max_tokens: int) -> dict:
    """A mixed Engine run, the same driver for any model: four prompt lengths (two beyond the
    8-token window: replay prefill), greedy and seeded sampling, a rejected request, a request
    added mid-run and one aborted mid-run. Returns every request's tokens and finish reason."""
    eng = Engine(model, max_batch_size=4, max_seq_len=64, block_size=16, prefill_chunk_size=16)
    greedy = SamplingParams(max_tokens=max_tokens)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, seed=7)
    rids = {"short_greedy": eng.add_request(prompt(5, 1), greedy),
            "long_seeded": eng.add_request(prompt(40, 2), seeded),
            "mid_greedy": eng.add_request(prompt(19, 3), greedy)}
    rejected = []
    try:            # bad input on rank 0: refused before any broadcast
        eng.add_request([1, 2, model.config.vocab_size], greedy)
    except RequestError as e:
        rejected.append(str(e))
    step = 0
    while eng.has_unfinished():
        if step == 2:
            rids["added_seeded"] = eng.add_request(prompt(11, 4), SamplingParams(   # runs alone at the end
                temperature=1.0, max_tokens=max_tokens + 3, seed=3))
        if step == 4:
            eng.abort(rids["mid_greedy"])
        eng.step()
        step += 1
    outs = {name: eng.output(rid) for name, rid in rids.items()}
    return {"tokens": {k: o.token_ids for k, o in outs.items()},
            "finish": {k: o.finish_reason for k, o in outs.items()},
            "rejected": rejected, "model_calls": eng.stats["steps"]}


def session_run(model, steps: int) -> list:
    """A Session over two prompts (one past the window: an int replay), greedy decode steps."""
    sess = v41graph.Session(model, max_batch_size=2, max_seq_len=64, block_size=16, prefill_mode="auto")
    ids = sess.prefill([prompt(6, 5), prompt(13, 6)]).argmax(-1)
    got = [ids.tolist()]
    for _ in range(steps):
        ids = sess.decode(ids.tolist()).argmax(-1)
        got.append(ids.tolist())
    return got


def write(args, rank: int, result: dict) -> None:
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def run_engine_mode(args, state, whole):
    result = {"rank": state.rank, "layouts": {}}
    reference = None
    if state.rank == 0:
        reference = {"engine": scenario(whole, args.max_tokens), "session": session_run(whole, args.steps)}
        result["reference"] = reference
    for name in args.layout:
        local = shard_model(whole, ParallelState(LAYOUTS[name], state.rank, state.group))
        if state.rank == 0:      # model calls: the engine's steps, the session's prefill + decodes
            got = spmd.run(local, lambda: {"engine": scenario(local, args.max_tokens),
                                           "session": session_run(local, args.steps)})
            got["model_calls"] = got["engine"]["model_calls"] + 1 + args.steps
        else:
            got = {"followed_steps": spmd.follow(local)}
        result["layouts"][name] = got
    # A follower whose model differs from rank 0's (other numerics): rank 0's Engine refuses
    # to start, naming the rank and the difference; the job then stops cleanly.
    if state.rank == 0:
        def lead():
            try:
                Engine(local, max_batch_size=2, max_seq_len=32, block_size=16)
            except ValueError as e:
                return str(e)
            return None
        result["mismatch"] = spmd.run(local, lead)
    else:
        local.set_numerics("reference")
        result["mismatch_steps"] = spmd.follow(local)
    return result


def run_failure_mode(args, state, whole):
    local = shard_model(whole, ParallelState(LAYOUTS[args.layout[0]], state.rank, state.group))
    result = {"rank": state.rank, "steps": 0}
    write(args, state.rank, result)             # a rank that is killed leaves this behind
    if state.rank == 0:
        def lead():
            eng = Engine(local, max_batch_size=2, max_seq_len=64, block_size=16)
            for i in range(2):
                eng.add_request(prompt(5 + i, i), SamplingParams(max_tokens=40))
            while eng.has_unfinished():
                if result["steps"] == args.die_after:
                    if args.mode == "kill-leader":
                        with open(f"{args.out}.died", "w") as f:
                            f.write(str(time.time()))
                        os.kill(os.getpid(), signal.SIGKILL)
                    if args.mode == "lead-fails":
                        raise RuntimeError("the lead function gave up on purpose")
                eng.step()
                result["steps"] += 1
                result["last_step_time"] = time.time()
        spmd.run(local, lead)
    else:
        if args.mode in ("kill-follower", "hang-follower"):   # die / hang in the follower loop, mid-run
            real_run = spmd.run_model
            count = [0]

            def dying(*a, **kw):
                if count[0] == args.die_after:
                    with open(f"{args.out}.died", "w") as f:
                        f.write(str(time.time()))
                    if args.mode == "hang-follower":
                        time.sleep(3600)     # alive, never joins the step's collectives
                    os.kill(os.getpid(), signal.SIGKILL)
                count[0] += 1
                return real_run(*a, **kw)
            spmd.run_model = dying
        result["steps"] = spmd.follow(local)
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="engine",
                    choices=("engine", "kill-follower", "hang-follower", "kill-leader", "lead-fails"))
    ap.add_argument("--layout", nargs="+", choices=sorted(LAYOUTS), default=["tp2"])
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--steps", type=int, default=3, help="Session decode steps")
    ap.add_argument("--die-after", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout (s)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    t0 = time.time()
    try:
        with spmd.job(LAYOUTS[args.layout[0]], timeout_s=args.timeout) as state:
            whole = whole_model()
            with torch.no_grad():
                run = run_engine_mode if args.mode == "engine" else run_failure_mode
                result = run(args, state, whole)
    except spmd.ParallelJobError as e:
        print(f"rank {rank}: ParallelJobError: {e}", file=sys.stderr, flush=True)
        write(args, rank, {"rank": rank, "error": str(e), "error_time": time.time(), "elapsed": time.time() - t0})
        return 3
    result["elapsed"] = time.time() - t0
    write(args, rank, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
