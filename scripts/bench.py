"""Decode-step benchmark: eager vs torch.compile (Inductor) vs reduce-overhead vs v41graph
(all passes + capture) vs v41graph with each pass switched off, side by side in one run.

    python scripts/bench.py --config bench --device cuda --batches 1,8,64 --contexts 4096,32768 --out $OUT
    python scripts/bench.py --config tiny --device cpu --batches 1,2 --contexts 64 --steps 3   # smoke run

The context is synthetic: caches are filled with random valid FP8/FP4 bytes and the block tables
of B sequences at length `context` (a decode step's cost does not depend on the values), then the
same decode step is timed repeatedly (CUDA events on GPU). Prints a table last and writes
bench.json to --out. Issue 8 (docs/BENCHMARKS.md) is what this is for; run it on the device.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import v41graph
from v41graph.accounting import accounting
from v41graph.cache import ModelCaches, build_metadata, positions_of
from v41graph.layers import default_dtype
from v41graph.model import V41Model, init_random_weights_

VARIANTS = ("eager", "inductor", "reduce-overhead", "v41graph", "v41graph-noP1", "v41graph-noP4",
            "v41graph-noP6")


def build_model(config: str, device: str) -> V41Model:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = getattr(v41graph.V41Config, config)(weight_format="dense",
                                              torch_dtype=str(dtype).replace("torch.", ""))
    with default_dtype(dtype), torch.device(device):   # parameters and buffers on the device
        model = V41Model(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    init_random_weights_(model, g)
    with torch.no_grad():
        for e in model.engram:
            e.embed_weight.copy_(torch.randint(0, 256, e.embed_weight.shape, device=device,
                                               dtype=torch.uint8, generator=g) & 0xB7)
            e.embed_scale.fill_(127)
    return model.eval().requires_grad_(False)


def synthetic_step(model: V41Model, batch: int, context: int, device: str, block_size: int = 128):
    """Caches holding `batch` sequences of length `context` (random bytes), plus the metadata
    and inputs of one decode step at position `context`."""
    cfg = model.config
    blocks_per_seq = math.ceil((context + 1) / block_size)
    caches = ModelCaches.allocate(cfg, batch + 1, batch * blocks_per_seq, block_size, device)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for t in caches.tensors():
            if t.dtype == torch.uint8:
                t.copy_(torch.randint(0, 256, t.shape, device=device, dtype=torch.uint8, generator=g) & 0xB7)
    tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
    meta = build_metadata(list(range(batch)), [context] * batch, [1] * batch, tables, blocks_per_seq, device)
    ids = torch.randint(0, cfg.vocab_size, (batch,), device=device, generator=g)
    return caches, meta, ids, positions_of(meta)


def make_runner(model: V41Model, variant: str, batch: int, device: str):
    if variant == "eager":
        return model, 0.0
    t0 = time.perf_counter()
    if variant == "inductor":
        runner = torch.compile(model, dynamic=False)
    elif variant == "reduce-overhead":
        runner = torch.compile(model, mode="reduce-overhead", dynamic=False)
    else:
        disable = {"v41graph": (), "v41graph-noP1": ("P1",), "v41graph-noP4": ("P4",),
                   "v41graph-noP6": ("P6",)}[variant]
        runner = v41graph.compile(model, backend="auto", disable=disable, batch_sizes=(batch,))
    return runner, t0


def time_steps(runner, args, steps: int, device: str) -> list[float]:
    """Per-step milliseconds over `steps` decode steps (after the caller's warm-up)."""
    out = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner(*args)
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            runner(*args)
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def copy_bandwidth(device: str) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written)."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    if device == "cuda":
        torch.cuda.synchronize()
    return 2 * 5 * n / (time.perf_counter() - t0) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench", choices=("tiny", "bench"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = args.device
    model = build_model(args.config, device)
    acc = accounting(model.config)
    bw = copy_bandwidth(device)
    print(f"[bench] {args.config} on {device}: copy bandwidth {bw:.0f} GB/s", file=sys.stderr)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for variant in args.variants.split(","):
                caches, meta, ids, pos = synthetic_step(model, batch, context, device)
                runner, t0 = make_runner(model, variant, batch, device)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                step_args = (ids, pos, caches, meta)
                with torch.no_grad():
                    for _ in range(args.warmup):
                        runner(*step_args)
                    compile_s = time.perf_counter() - t0 if t0 else 0.0
                    ms = time_steps(runner, step_args, args.steps, device)
                # The floor: activated weights once per step plus each sequence's KV reads.
                weight_bytes = acc.activated_params_decode * (2 if device == "cuda" else 4)
                kv_bytes = batch * context * acc.global_kv_bytes_per_token
                floor_ms = (weight_bytes + kv_bytes) / (bw / 2 * 1e9) * 1e3
                med = statistics.median(ms)
                rows.append({"context": context, "batch": batch, "variant": variant,
                             "step_ms": med, "tokens_per_s": batch / med * 1e3,
                             "compile_capture_s": compile_s, "floor_ms": floor_ms,
                             "floor_fraction": floor_ms / med,
                             "peak_mem_gb": (torch.cuda.max_memory_allocated() / 1e9
                                             if device == "cuda" else None)})
                print(f"[bench] ctx {context} B {batch} {variant}: {med:.3f} ms", file=sys.stderr, flush=True)
                del runner, caches
                torch._dynamo.reset()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench.json").write_text(json.dumps(
            {"config": args.config, "device": device, "copy_gbps": bw, "rows": rows}, indent=1))
    print(f"{'ctx':>6} {'B':>4} {'variant':<16} {'ms/step':>9} {'tok/s':>9} {'compile s':>9} {'floor':>6}")
    for r in rows:
        print(f"{r['context']:>6} {r['batch']:>4} {r['variant']:<16} {r['step_ms']:>9.3f} "
              f"{r['tokens_per_s']:>9.1f} {r['compile_capture_s']:>9.1f} {r['floor_fraction']:>6.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
