"""One rank of the multi-process checks, started by tests/test_parallel.py through torchrun
(gloo, CPU). For every layout asked for it builds the tiny model whole (same seed on every
rank) and as this rank's share, runs the same prefill + decode steps through both and writes
what it measured to {--out}.rank{r}.json; the test compares the numbers. Under tensor
parallelism rank 0 drives the share's steps through the SPMD runtime (v41graph.parallel.spmd)
and the other rank follows, so only rank 0 reports those layouts. All layouts of one job
share the world-size-2 process group (a ParallelState per layout), so one torchrun start and
one whole-model reference serve them all (the compiled runs on --compiled-plan three-layer: a
whole model of that plan of their own)."""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import v41graph  # noqa: E402
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/
from compile_harness import three_layer_config  # noqa: E402
from v41graph.model.layers import default_dtype  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402
from v41graph.parallel import ParallelConfig, ParallelState, init_parallel, shutdown, spmd  # noqa: E402
from v41graph.parallel.build import shard_model  # noqa: E402

LAYOUTS = {"tp2": ParallelConfig(tp=2), "tp2ep2": ParallelConfig(tp=2, ep=2),
           "dp2ep2": ParallelConfig(dp=2, ep=2), "dp2": ParallelConfig(dp=2)}
# numerics checks: (torch dtype, weight format, numerics, fake_quant)
CHECKS = {"fp32": ("float32", "dense", "fast", True),
          "fp32-nofq": ("float32", "dense", "fast", False),
          "fp32-reference": ("float32", "checkpoint", "reference", True),
          "bf16": ("bfloat16", "dense", "fast", True),      # the GPU's mode (grouped MoE on sm90)
          "bf16-reference": ("bfloat16", "checkpoint", "reference", True)}


def prompts_for(rank: int, data_parallel: bool):
    """Three prompts (5, 19 and 40 tokens): the same on every rank under tp, each rank its own
    under dp (the lengths match: a step's token count must be the same on every rank)."""
    g = torch.Generator().manual_seed(100 + (rank if data_parallel else 0))
    return [torch.randint(3, 250, (k,), generator=g).tolist() for k in (5, 19, 40)]


CAPTURE = False    # --nccl: NCCL collectives capture; gloo's cannot


def run_share(local, prompts, steps: int, compiled: bool, tokens, rank: int):
    """run_session over this rank's share: under data-parallel attention on every rank (each
    its own prompts); under tensor parallelism rank 0 drives the steps through the SPMD
    runtime and the other ranks follow them (they return None)."""
    runner = v41graph.compile(local, backend="auto", capture=CAPTURE) if compiled else local
    if local.parallel.attention == "dp":
        return run_session(runner, prompts, steps, tokens)
    return spmd.run(runner, lambda: run_session(runner, prompts, steps, tokens))


def run_session(model, prompts, steps: int, tokens=None):
    """Logits of the prefill and of `steps` decode steps [steps + 1, B, V], and the prefill's
    per-layer residual streams (model.debug). Decode feeds `tokens` [steps, B] when given (the
    reference run's greedy tokens: both runs then see the same inputs at every step, and a
    near tie that flips one argmax does not send the runs down different continuations), else
    its own greedy tokens."""
    base = model.model if isinstance(model, v41graph.CompiledModel) else model
    base.debug = {}
    sess = v41graph.Session(model, max_batch_size=len(prompts), max_seq_len=96, block_size=16)
    logits = [sess.prefill(prompts)]
    layers = {k: v.float() for k, v in base.debug.items() if k.startswith("block_out.")}
    base.debug = None
    for i in range(steps):
        ids = logits[-1].argmax(-1) if tokens is None else tokens[i]
        logits.append(sess.decode(ids.tolist()))
    return torch.stack(logits).float(), layers


def compare(ref, got, ref_layers, got_layers) -> dict:
    ordered = sorted(ref_layers, key=lambda k: int(k.rsplit("layer", 1)[1]))
    return {"max_abs_diff": (ref - got).abs().max().item(),
            "max_abs_logit": ref.abs().max().item(),
            "argmax_equal": torch.equal(ref.argmax(-1), got.argmax(-1)),
            "argmax_agreement": (ref.argmax(-1) == got.argmax(-1)).float().mean().item(),
            "layer_max_abs_diff": [(ref_layers[k] - got_layers[k]).abs().max().item() for k in ordered]}


def main():
    faulthandler.enable()
    ap = argparse.ArgumentParser()
    ap.add_argument("--checks", default="fp32=tp2,tp2ep2,dp2ep2,dp2",
                    help="CHECK=LAYOUT,LAYOUT;CHECK=... (checks: %s)" % ", ".join(CHECKS))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--device", default="cpu", help="cuda: every rank on the one GPU, collectives through gloo")
    ap.add_argument("--nccl", action="store_true",
                    help="one GPU per rank (cuda:LOCAL_RANK), NCCL, compiled shares captured (a multi-GPU machine)")
    ap.add_argument("--compiled", default="",
                    help="LAYOUT,...: also run these layouts' shares through v41graph.compile (first check only)")
    ap.add_argument("--compiled-plan", choices=("tiny", "three-layer"), default="tiny",
                    help="the layer plan of the compiled runs: tiny()'s, or compile_harness.three_layer_config's "
                         "(every compressor, indexer and cache kind at a third of the trace time) with its own "
                         "whole-model reference")
    ap.add_argument("--noise-floor", action="store_true",
                    help="also run the whole model on each prompt alone (its own batch-composition noise)")
    ap.add_argument("--load", nargs=2, metavar=("RANK0_DIR", "RANK1_DIR"),
                    help="instead: each rank loads its dp2+ep2 share from its directory and records the error")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    global CAPTURE
    CAPTURE = args.nccl
    if args.nccl:
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(args.device)
    # the world-size-2 group every layout below shares
    state = init_parallel(LAYOUTS["tp2"], backend="nccl" if args.nccl else "gloo")
    rank = dist.get_rank()
    result = {}
    if args.load:
        try:
            v41graph.from_pretrained(args.load[rank], parallel=ParallelState(LAYOUTS["dp2ep2"], rank, state.group))
            result["error"] = None
        except RuntimeError as e:
            result["error"] = str(e)
        args.checks = ""
    compiled = [c for c in args.compiled.split(",") if c]
    # (check, plan, [(layout, compiled?)]): the compiled runs join the first check's, or run
    # alone on their own plan
    jobs = []
    for spec in filter(None, args.checks.split(";")):
        check, layouts = spec.split("=")
        jobs.append((check, "tiny", [(name, False) for name in layouts.split(",")]))
    if compiled and jobs:
        runs = [(name, True) for name in compiled]
        if args.compiled_plan == "tiny":
            jobs[0][2].extend(runs)
        else:
            jobs.append((jobs[0][0], args.compiled_plan, runs))
    for check, plan, runs in jobs:
        dtype, fmt, numerics, fq = CHECKS[check]
        cfg = (v41graph.V41Config.tiny if plan == "tiny" else three_layer_config)(
            moe_intermediate_size=64, torch_dtype=dtype, weight_format=fmt, fake_quant=fq)
        with default_dtype(getattr(torch, dtype)):      # as a checkpoint of that dtype builds it
            whole = init_random_(V41Model(cfg), seed=0).eval().requires_grad_(False).to(args.device)
        whole.set_numerics(numerics)
        refs = {}
        for name, compile_it in runs:
            t0 = time.perf_counter()
            layout = LAYOUTS[name]
            dp = layout.attention == "dp"
            prompts = prompts_for(rank, dp)
            with torch.no_grad():
                if dp not in refs:
                    ref, ref_layers = run_session(whole, prompts, args.steps)
                    tokens, floor = ref.argmax(-1)[:-1], None
                    # The whole model's own noise floor: the same prompts one at a time (a
                    # different batch composition changes GEMM shapes and so roundings).
                    if args.noise_floor:
                        alone = [run_session(whole, [p], args.steps, tokens[:, i:i + 1])
                                 for i, p in enumerate(prompts)]
                        alone_layers = {k: torch.cat([a[1][k] for a in alone]) for k in ref_layers}
                        floor = compare(ref, torch.cat([a[0] for a in alone], 1), ref_layers, alone_layers)
                    refs[dp] = ref, ref_layers, tokens, floor
                ref, ref_layers, tokens, floor = refs[dp]
                local = shard_model(whole, ParallelState(layout, rank, dist.group.WORLD))
                got = run_share(local, prompts, args.steps, compile_it, tokens, rank)
            if got is None:           # a follower of rank 0's steps
                continue
            got, got_layers = got
            result[f"{name}{'-compiled' if compile_it else ''}/{check}"] = dict(
                compare(ref, got, ref_layers, got_layers), noise_floor=floor,
                params_local=sum(p.numel() for p in local.parameters()),
                params_whole=sum(p.numel() for p in whole.parameters()),
                seconds=time.perf_counter() - t0)
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f, indent=1)
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
