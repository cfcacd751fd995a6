"""World size 1 through the parallel code path on one GPU, side by side with the single-device
model in one process (issue 19's "the parallel layer must be free when N = 1"), plus the
collectives-in-a-captured-graph check that one GPU allows (NCCL, world size 1).

    python scripts/bench_parallel_ws1.py --out $OUT            # on the H200
    python scripts/bench_parallel_ws1.py --config tiny --device cpu --batches 1 --steps 3

1. single: V41Model(cfg) as today; parallel-ws1: the model built by the parallel path
   (init_parallel(ParallelConfig()) with an NCCL process group of one rank, shard_model), both
   through v41graph.compile (all passes, captured decode buckets); decode steps timed in
   alternating rounds (median of rounds), the ratio printed.
2. A module whose forward calls ParallelState.all_reduce / all_gather / all_to_all, compiled
   with the v41graph backend and captured in a CUDA graph, replayed with new inputs: the NCCL
   collectives are captured (world size 1: each is the identity, which the check compares).
3. shutdown() (barrier + destroy_process_group) and exit: the probe hung at exit without it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench  # noqa: E402  (the model builder, caches, decode inputs and timer of scripts/bench.py)

import v41graph  # noqa: E402
from v41graph.parallel import ParallelConfig, ParallelState, init_parallel, shutdown  # noqa: E402
from v41graph.parallel.build import shard_model  # noqa: E402


class Collectives(torch.nn.Module):
    def __init__(self, state: ParallelState):
        super().__init__()
        self.state = state

    def forward(self, x):
        y = self.state.all_reduce(x @ x.T)
        y = self.state.all_gather(y, dim=0)
        return self.state.all_to_all(y) + 1


def check_captured_collectives(state: ParallelState, device: str) -> dict:
    mod = Collectives(state)
    fn = torch.compile(mod, backend="v41graph", fullgraph=True)
    x = torch.randn(8, 8, device=device)
    want = mod(x).clone()
    got = fn(x)
    result = {"compiled_equal": torch.equal(got, want)}
    if device == "cuda":
        static = x.clone()
        fn(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(static)
        new = torch.randn(8, 8, device=device)
        static.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        result["captured_replay_equal"] = torch.equal(out, mod(new))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="bench")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device, batches = args.device, [int(b) for b in args.batches.split(",")]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", world_size=1, rank=0)
    state = init_parallel(ParallelConfig(), device=device)
    collectives = check_captured_collectives(state, device)
    bench.log(f"collectives in a compiled{' + captured' if device == 'cuda' else ''} graph: {collectives}")

    single = bench.build_model(args.config, device)
    parallel = shard_model(single, state)
    runners = {name: v41graph.compile(m, backend="auto", batch_sizes=batches)
               for name, m in (("single", single), ("parallel-ws1", parallel))}
    caches, bps = bench.allocate_caches(single, max(batches), args.context, device)
    rows = []
    for batch in batches:
        ids, pos, meta = bench.decode_inputs(single, batch, args.context, bps, device)
        per = {name: [] for name in runners}
        with torch.no_grad():
            for name, r in runners.items():       # compile + capture + warm-up
                t0 = time.perf_counter()
                for _ in range(3):
                    r.decode(ids, pos, caches, meta)
                bench._sync(device)
                bench.log(f"{name} B={batch}: first calls {time.perf_counter() - t0:.1f} s")
            for _ in range(args.rounds):           # alternate: drift hits both alike
                for name, r in runners.items():
                    per[name].append(statistics.median(
                        bench.time_calls(lambda: r.decode(ids, pos, caches, meta), args.steps, device)))
        ms = {name: statistics.median(v) for name, v in per.items()}
        rows.append({"batch": batch, "context": args.context, **{f"{k}_ms": v for k, v in ms.items()},
                     "ratio": ms["parallel-ws1"] / ms["single"], "rounds": per})
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "config": args.config,
              "collectives": collectives, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_parallel_ws1.json").write_text(json.dumps(result, indent=1))
    t0 = time.perf_counter()
    shutdown()
    print(f"shutdown {time.perf_counter() - t0:.2f} s")
    print(f"{'B':>4} {'single ms':>10} {'ws1 ms':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>4} {r['single_ms']:>10.3f} {r['parallel-ws1_ms']:>10.3f} {r['ratio']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
