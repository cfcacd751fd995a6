"""A few hundred mixed requests through v41graph.Engine, random weights: the tiny model on the
CPU by default, or the bench model (real widths, scripts/bench.py's build_model) on a GPU.

    python scripts/serve_example.py [--requests 300] [--batch 8] [--compile]
                                    [--spec K [--schedule fixed|confidence]]
                                    [--prefill auto|full|replay] [--rebuild-metadata]
    python scripts/serve_example.py --config bench --device cuda --compile --batch 32 [--eager-prefill]
                                    [--compile-cache DIR]     # run twice: the second start is warm

Requests arrive a few per engine step (Poisson-ish), with prompt lengths 4..64, 4..32 new
tokens, half greedy and half sampled (temperature / top-p, per-request seeds), some with stop
ids, a few aborted midway. Prints throughput and latency / time-to-first-token percentiles.
With --spec K, DSpark speculative decoding (random-weight draft head, K drafts per step) runs
in the engine and the DSpark mean acceptance length (tokens committed per verification) is
printed; with random weights the drafts are almost never accepted, so expect ~1.0.
Prompts longer than the window (8 in tiny) prefill with decoder bounded replay unless
--prefill full; --rebuild-metadata rebuilds decode metadata from host lists every step.
"""
from __future__ import annotations

import argparse
import time

import torch

import v41graph
from v41graph.runtime.engine import Engine
from v41graph.model.model import V41Model, init_random_
from v41graph.runtime.sampling import SamplingParams


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="tiny", choices=("tiny", "bench"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", action="store_true", help="run through v41graph.compile (slow warm-up)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR",
                    help="with --compile: the persistent compile cache (a second run loads instead of tracing)")
    ap.add_argument("--eager-prefill", action="store_true",
                    help="with --compile: prefill / mixed steps run the eager model (one trace, "
                         "the decode graph, instead of two or three)")
    ap.add_argument("--warmup-requests", type=int, default=32,
                    help="with --compile: requests served before the timed run (compiles, captures)")
    ap.add_argument("--spec", type=int, default=0, help="DSpark drafts per step (0 = off)")
    ap.add_argument("--schedule", default="fixed", choices=("fixed", "confidence"))
    ap.add_argument("--prefill", default="auto", choices=("auto", "full", "replay"))
    ap.add_argument("--rebuild-metadata", action="store_true",
                    help="rebuild decode metadata every step (no persistent DecodeBatch)")
    args = ap.parse_args()
    if args.eager_prefill and not args.compile:
        ap.error("--eager-prefill only applies with --compile")
    if args.compile_cache and not args.compile:
        ap.error("--compile-cache only applies with --compile")
    torch.set_num_threads(args.threads)
    if args.config == "tiny":
        cfg = v41graph.V41Config.tiny()
        with torch.device(args.device):
            model = init_random_(V41Model(cfg), seed=0).eval()
        block_size = 16
    else:   # bf16 dense weights on the device, FP8 Engram rows with finite codes
        from bench import build_model
        model = build_model("bench", args.device)
        cfg = model.config
        block_size = 128   # the serving layout of MODEL.md (ratio-2 sources: 64 rows per block)
    buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(args.batch, 1))
    t_compile = time.perf_counter()
    runner = v41graph.compile(model, batch_sizes=buckets, share_decode_graph="all",
                              compile_prefill=not args.eager_prefill,
                              compile_cache=args.compile_cache) if args.compile else model
    spec_kw = {}
    if args.spec:
        from v41graph.model.dspark import DSparkHead
        from v41graph.runtime.speculative import SpecConfig, init_random_dspark_
        spec_kw = dict(speculative=SpecConfig(num_draft=args.spec, schedule=args.schedule),
                       draft_head=init_random_dspark_(DSparkHead(cfg), seed=1).eval().to(
                           model.embed.weight.device, model.embed.weight.dtype))
    eng = Engine(runner, max_batch_size=args.batch, max_seq_len=128, block_size=block_size,
                 max_num_batched_tokens=128, prefill_chunk_size=32, prefill_mode=args.prefill,
                 persistent_metadata=not args.rebuild_metadata, **spec_kw)
    g = torch.Generator().manual_seed(0)

    def rnd(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    def make_requests(n):
        reqs = []
        for i in range(n):
            prompt = torch.randint(0, cfg.vocab_size, (rnd(4, 64),), generator=g).tolist()
            greedy = i % 2 == 0
            params = SamplingParams(temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.9,
                                    max_tokens=rnd(4, 32), stop_ids=(7,) if i % 5 == 0 else (), seed=i)
            reqs.append((prompt, params))
        return reqs

    def serve(pending, abort_every=37):
        """Requests arrive 0-3 per engine step; every `abort_every` steps one running is aborted."""
        ids, steps, n_aborted = [], 0, 0
        while pending or eng.has_unfinished():
            for _ in range(min(len(pending), rnd(0, 3))):
                ids.append(eng.add_request(*pending.pop(0)))
            eng.step()
            steps += 1
            if steps % abort_every == 0:
                live = [r for r in ids if eng.requests[r].status == "running"]
                if live:
                    eng.abort(live[0])
                    n_aborted += 1
        return ids, steps, n_aborted

    if args.compile:   # compile + capture happen at first use: pay them before the timed run
        serve(make_requests(args.warmup_requests))
        print(f"compile + capture + warm-up ({args.warmup_requests} requests): "
              f"{time.perf_counter() - t_compile:.1f} s (Inductor segments "
              f"{'on' if runner.inductor_segments else 'off'}, {int(runner.timings['cache_hits'])} graphs "
              f"loaded from the compile cache, {sum(runner.traced_by.values())} traced)")
    pending = make_requests(args.requests)
    t0 = time.perf_counter()
    ids, steps, n_aborted = serve(pending)
    wall = time.perf_counter() - t0
    outs = [eng.output(r) for r in ids]
    done = [o for o in outs if o.finish_reason != "abort"]
    gen = sum(len(o.token_ids) for o in outs)
    prompt_toks = sum(len(o.prompt_token_ids) for o in outs)
    lat = [o.latency * 1e3 for o in done]
    ttft = [o.ttft * 1e3 for o in done if o.ttft is not None]
    print(f"{len(outs)} requests ({n_aborted} aborted, "
          f"{sum(o.finish_reason == 'stop' for o in outs)} hit a stop id) in {wall:.2f} s, {steps} steps")
    print(f"throughput: {gen / wall:.1f} generated tok/s, {(gen + prompt_toks) / wall:.1f} total tok/s, "
          f"{len(done) / wall:.1f} req/s")
    print("latency ms  p50 {:.1f}  p90 {:.1f}  p99 {:.1f}".format(*(pct(lat, q) for q in (50, 90, 99))))
    print("TTFT ms     p50 {:.1f}  p90 {:.1f}  p99 {:.1f}".format(*(pct(ttft, q) for q in (50, 90, 99))))
    st = eng.stats
    print(f"prefill ({args.prefill}): {st['replay_steps']} replay steps, {st['replay_dropped_tokens']} "
          f"prompt tokens skipped the decoder, {st['replay_full_steps']} chunks before the replay "
          f"segment ran full")
    if eng.spec is not None:
        print(f"DSpark acceptance length: {eng.spec.acceptance_length:.3f} tokens/verification "
              f"({st['spec_verifies']} verifications, {st['spec_accepted']}/{st['spec_drafted']} "
              f"drafts accepted, {st['spec_rejections']} with a rejection)")
    assert eng.num_free_blocks == eng.num_blocks, "blocks leaked"
    print("blocks all free after the run: yes")


if __name__ == "__main__":
    main()
