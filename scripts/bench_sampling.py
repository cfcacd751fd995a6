#!/usr/bin/env python
"""Time the Engine's batch sampler (v41graph.runtime.sampling.BatchSampler) on the released
vocabulary, next to nothing else: one `sample()` call = build the rows' parameter tensors (one
upload), penalties / temperature / min_p / top_k / top_p / the seeded exponential race on the
device, one copy of the ids (and logprobs) back to the host.

    python scripts/bench_sampling.py [--device cuda] [--vocab 129280] [--batches 1,8,64,256] [--out DIR]

Variants per batch size: greedy (argmax only), sampled (temperature 0.8, top_p 0.95, seeded),
filtered (+ top_k 50, min_p 0.05), penalized (+ repetition 1.1, presence 0.5, frequency 0.5),
logprobs (sampled + 5 top logprobs), and beside them plain torch (softmax + torch.multinomial +
one host copy, unseeded, unfiltered). Median of --reps calls after --warmup, wall time with a
device sync (the call ends with its host copy anyway). Prints a table; writes
bench_sampling.json to --out (default $OUT or the current folder).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from v41graph.runtime.sampling import BatchSampler, SamplingParams

SAMPLED = dict(temperature=0.8, top_p=0.95)
VARIANTS = {
    "greedy": {},
    "sampled": SAMPLED,
    "filtered": {**SAMPLED, "top_k": 50, "min_p": 0.05},
    "penalized": {**SAMPLED, "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logprobs": {**SAMPLED, "logprobs": 5},
}


def median_ms(call, device, warmup: int, reps: int) -> float:
    """Median milliseconds of call(step) over `reps` steps after `warmup`, device synced around
    each call."""
    times = []
    for step in range(warmup + reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_variant(device, vocab: int, batch: int, kw: dict, warmup: int, reps: int) -> float:
    """Median milliseconds of one BatchSampler.sample call over `batch` rows."""
    sampler = BatchSampler(vocab, batch, device, generator=torch.Generator(device).manual_seed(0))
    params = [SamplingParams(seed=i if kw else None, **kw) for i in range(batch)]
    prompts = [[1, 2, 3]] * batch
    logits = torch.randn(batch, vocab, device=device, generator=torch.Generator(device).manual_seed(1))
    return median_ms(lambda step: sampler.sample(logits, params, list(range(batch)), prompts, [step] * batch),
                     device, warmup, reps)


def time_multinomial(device, vocab: int, batch: int, warmup: int, reps: int) -> float:
    """The plain torch baseline beside it: softmax(logits / T), torch.multinomial, one host copy
    (no seeds, no filters)."""
    logits = torch.randn(batch, vocab, device=device, generator=torch.Generator(device).manual_seed(1))
    return median_ms(lambda step: torch.multinomial(torch.softmax(logits / 0.8, -1), 1).view(-1).tolist(),
                     device, warmup, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    rows = [{"batch": b, "variant": name,
             "ms": time_variant(device, args.vocab, b, kw, args.warmup, args.reps)}
            for b in batches for name, kw in VARIANTS.items()]
    rows += [{"batch": b, "variant": "torch multinomial",
              "ms": time_multinomial(device, args.vocab, b, args.warmup, args.reps)} for b in batches]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_sampling.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   "torch": torch.__version__, "vocab": args.vocab, "rows": rows}, f, indent=2)
    print(f"BatchSampler.sample, vocab {args.vocab}, {device} (median ms of {args.reps})")
    print("batch  " + "".join(f"{v:>11}" for v in VARIANTS) + "  torch multinomial")
    for b in batches:
        print(f"{b:>5}  " + "".join(f"{r['ms']:>11.3f}" for r in rows if r["batch"] == b))


if __name__ == "__main__":
    main()
