"""One rank of a multi-process check, started by tests/test_parallel.py through torchrun (gloo,
CPU): builds the tiny model whole (same seed on every rank) and as this rank's share, runs the
same prefill + decode steps through both and writes what it measured to --out (rank 0 writes
the whole job's result; every rank compares its own logits)."""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

import v41graph  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402
from v41graph.parallel import ParallelConfig, init_parallel, shutdown  # noqa: E402
from v41graph.parallel.build import shard_model  # noqa: E402

LAYOUTS = {"tp2": ParallelConfig(tp=2), "ep2": ParallelConfig(dp=2, ep=2),
           "tp2ep2": ParallelConfig(tp=2, ep=2), "dp2": ParallelConfig(dp=2)}


def prompts_for(rank: int, layout: str, n: int = 3):
    """The prompts a rank runs: the same on every rank under tp, different ones under dp (all
    ranks the same lengths: a step's token count must match across ranks)."""
    g = torch.Generator().manual_seed(100 + (rank if layout in ("ep2", "dp2") else 0))
    lengths = [5, 19, 40][:n]
    return [torch.randint(3, 250, (k,), generator=g).tolist() for k in lengths]


def run_session(model, prompts, steps: int, compiled: bool):
    if compiled:
        model = v41graph.compile(model, backend="cpu")
    sess = v41graph.Session(model, max_batch_size=len(prompts), max_seq_len=96, block_size=16)
    logits = [sess.prefill(prompts)]
    ids = logits[0].argmax(-1)
    for _ in range(steps):
        logits.append(sess.decode(ids.tolist()))
        ids = logits[-1].argmax(-1)
    return torch.stack([torch.cat([l.flatten() for l in logits])]), [l.argmax(-1).tolist() for l in logits]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--numerics", default="fast")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    layout = LAYOUTS[args.layout]
    state = init_parallel(layout)
    dtype = getattr(torch, args.dtype)
    cfg = v41graph.V41Config.tiny(moe_intermediate_size=64, torch_dtype=args.dtype)
    whole = init_random_(V41Model(cfg), seed=0).to(dtype).eval().requires_grad_(False).set_numerics(args.numerics)
    local = shard_model(whole, state)
    prompts = prompts_for(state.rank, args.args if False else args.layout)
    with torch.no_grad():
        ref, ref_ids = run_session(whole, prompts, args.steps, compiled=False)
        got, got_ids = run_session(local, prompts, args.steps, compiled=args.compiled)
    diff = (ref.float() - got.float()).abs().max().item()
    result = {"rank": state.rank, "max_abs_diff": diff, "argmax_equal": ref_ids == got_ids,
              "params_local": sum(p.numel() for p in local.parameters()),
              "params_whole": sum(p.numel() for p in whole.parameters())}
    with open(f"{args.out}.rank{state.rank}.json", "w") as f:
        json.dump(result, f)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
