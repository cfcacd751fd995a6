"""Speculative decoding benchmark (`python scripts/bench.py --speculative 1,2,3,4,5` runs this):
the captured static speculative step (v41graph.runtime.speculative_graph) against a plain
captured decode step, on the bench() config with random weights and a random DSpark head.

    python scripts/bench.py --speculative 1,2,3,4,5 --batches 1,8,64 --contexts 4096 --out $OUT
    python scripts/bench.py --config tiny --device cpu --speculative 1,2 --batches 1,2 \\
        --contexts 64 --steps 2                                    # smoke run

Per batch B (context C, the first of --contexts) and k drafts, each its own CUDA graph, CUDA
events around each replay, median of --steps:
  decode_ms  one plain decode step (the compiled model's captured bucket)
  draft_ms   DSparkHead.draft_batch of B rows (k <= block size: the head always runs its block)
  verify_ms  the target over B x (k + 1) tokens, all logits + DSpark's target streams
  step_ms    the whole static step: draft + snapshot + verify + acceptance + rollback + context
  speedup(L) = L * decode_ms / (draft_ms + verify_ms) (the issue's formula) and
               L * decode_ms / step_ms, for L = 3.51 (InferenceX's reference acceptance length of
               5-token DSpark) and the lengths given by --acceptance.
End to end (--e2e, or --e2e-only without the per-part timings): B requests of
128-token prompts generate 64 tokens, plain engine vs the speculative engine with
ReferenceDrafts (the expected continuation, each draft kept with probability `rate`, so
acceptance is controlled; rate 0 = every draft rejected); tokens/s over the generate() call
after a warm-up run. The random weights are made decisive first
(make_greedy_successor_a_permutation_: greedy token t is followed by a fixed permutation of t,
by a margin rounding cannot flip), so the expected output is known and every run, plain and
speculative, is checked against it (the lossless check).
"""
from __future__ import annotations

import statistics
import time

import torch

import v41graph
from v41graph.model.dspark import DSparkHead
from v41graph.model.layers import default_dtype
from v41graph.model.metadata import AttentionMetadata
from v41graph.model.model import init_random_weights_, make_greedy_successor_a_permutation_
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams
from v41graph.runtime.speculative import SpecConfig
from v41graph.runtime.speculative_graph import ReferenceDrafts, SpecStepGraph

BLOCK = 128
PUBLIC_ACCEPTANCE = 3.51


def _captured(compiled, fn, device: str):
    """fn as a replayable callable: on CUDA warmed up and captured (its outputs are reused)."""
    if device != "cuda":
        return fn
    return compiled.capture_graph(fn)[0].replay


def _median_ms(fn, steps: int, device: str, time_calls) -> float:
    return statistics.median(time_calls(fn, steps, device))


def build_head(model, device: str) -> DSparkHead:
    with default_dtype(model.embed.weight.dtype), torch.device(device):
        head = DSparkHead(model.config)
    init_random_weights_(head, torch.Generator(device=device).manual_seed(1))
    return head.eval().requires_grad_(False)


def run(model, batches, context, ks, args, device, log, time_calls, random_bytes) -> list[dict]:
    head = build_head(model, device)
    next_id = None
    if args.e2e or args.e2e_only:     # before compiling: the graphs see the final weights
        next_id = make_greedy_successor_a_permutation_(model, torch.Generator(device=device).manual_seed(2))
    compiled = v41graph.compile(model, backend="auto", batch_sizes=batches)
    if args.e2e_only:                 # the e2e engines build their own caches
        return run_e2e(compiled, head, batches, args, log, device, next_id, new=args.e2e_tokens)
    eng = Engine(compiled, max(batches), context + 16, block_size=BLOCK,
                 max_num_batched_tokens=max(batches) * (max(ks) + 1) + 1024,
                 speculative=SpecConfig(num_draft=max(ks)), draft_head=head)
    static = eng.spec.static
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for t in eng.caches.tensors():
            if t.dtype == torch.uint8:
                t.copy_(random_bytes(t, g))
            elif t.is_floating_point():
                t.normal_(generator=g)
        for r in static.state.kv:
            r.normal_(generator=g)
    width, cfg = eng.max_blocks, model.config
    targets = static.targets
    rows = []
    for b in batches:
        i64 = dict(dtype=torch.int64, device=device)
        slots = torch.arange(b, **i64)
        table = slots[:, None] * width + torch.arange(width, **i64)
        pos = torch.full((b,), context, **i64)
        anchors = torch.randint(0, cfg.vocab_size, (b,), generator=g, device=device)
        meta = AttentionMetadata(token_seq=slots, seq_slot=slots, chunk_start=pos, seq_len=pos + 1,
                                 query_start=torch.arange(b + 1, **i64), block_table=table,
                                 logits_index=slots)
        t0 = time.perf_counter()
        decode = lambda: compiled.decode(anchors, pos, eng.caches, meta)  # noqa: E731
        decode()
        log(f"B={b}: decode bucket ready in {time.perf_counter() - t0:.1f} s")
        decode_ms = _median_ms(decode, args.steps, device, time_calls)
        for k in ks:
            static.k = k
            t0 = time.perf_counter()
            n = k + 1
            ids = torch.randint(0, cfg.vocab_size, (b * n,), generator=g, device=device)
            tok_seq = slots.repeat_interleave(n)
            vpos = (pos[:, None] + torch.arange(n, **i64)).flatten()
            qs = torch.arange(b + 1, **i64) * n
            vmeta = AttentionMetadata(token_seq=tok_seq, seq_slot=slots, chunk_start=pos, seq_len=pos + n,
                                      query_start=qs, block_table=table, logits_index=qs[1:] - 1)
            with torch.no_grad():
                verify = _captured(compiled, lambda: compiled(ids, vpos, eng.caches, vmeta, all_logits=True,
                                                    return_streams=targets), device)
                draft = _captured(compiled, lambda: head.draft_batch(static.state, slots, anchors, pos, pos,
                                                           model.embed, model.head), device)
            graph = SpecStepGraph(static, b, (False, False, False))
            graph.inputs.anchor.copy_(anchors)
            graph.inputs.pos.copy_(pos)
            graph.inputs.slot.copy_(slots)
            graph.inputs.cap.fill_(k)
            graph.inputs.block_table.copy_(table)
            graph.run()
            setup_s = time.perf_counter() - t0
            with torch.no_grad():
                row = {"kind": "speculative", "batch": b, "context": context, "k": k,
                       "decode_ms": decode_ms,
                       "draft_ms": _median_ms(draft, args.steps, device, time_calls),
                       "verify_ms": _median_ms(verify, args.steps, device, time_calls),
                       "step_ms": _median_ms(graph.run, args.steps, device, time_calls),
                       "setup_s": setup_s}
            for L in [PUBLIC_ACCEPTANCE] + list(args.acceptance):
                Lk = min(L, k + 1)
                row[f"speedup_parts_L{L:g}"] = Lk * decode_ms / (row["draft_ms"] + row["verify_ms"])
                row[f"speedup_step_L{L:g}"] = Lk * decode_ms / row["step_ms"]
            rows.append(row)
            log(f"B={b} k={k}: decode {decode_ms:.2f} draft {row['draft_ms']:.2f} verify {row['verify_ms']:.2f} "
                f"step {row['step_ms']:.2f} ms (setup {setup_s:.1f} s)")
        static.graphs.clear()
    static.k = max(ks)
    if args.e2e:
        rows += run_e2e(compiled, head, batches, args, log, device, next_id, new=args.e2e_tokens)
    return rows


def _successors(next_id: torch.Tensor, last: int, n: int) -> list[int]:
    """The n greedy tokens after `last` of a model built by make_greedy_successor_a_permutation_."""
    out = []
    for _ in range(n):
        last = int(next_id[last])
        out.append(last)
    return out


def run_e2e(compiled, head, batches, args, log, device: str, next_id: torch.Tensor,
            prompt_len: int = 128, new: int = 64, k: int = 5) -> list[dict]:
    """Plain engine, then the speculative engine at rate 0 (every draft wrong: the cost of a
    step that commits one token) and at each --rates. The model's greedy successor is a known
    permutation (make_greedy_successor_a_permutation_, applied before compiling), so the
    expected output is known without running anything; it is the drafts' source and the
    lossless check for every run (with plain random weights reduction-order rounding flipped
    greedy ids from the first tokens on: the H200, bench() config, eleventh session)."""
    cfg = compiled.config
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for b in batches:
        g = torch.Generator().manual_seed(b)
        prompts = [torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
        expected = [_successors(next_id.cpu(), p[-1], new) for p in prompts]
        params = SamplingParams(max_tokens=new)

        def timed(eng, variant, **extra):
            eng.generate(prompts, SamplingParams(max_tokens=8))      # warm-up: this batch's captures
            sync()
            t0 = time.perf_counter()
            outs = [o.token_ids for o in eng.generate(prompts, params)]
            sync()
            t = time.perf_counter() - t0
            wrong = [i for i, (o, e) in enumerate(zip(outs, expected)) if o != e]
            rows.append({"kind": "e2e", "batch": b, "variant": variant, "tokens_per_s": b * new / t,
                         "seconds": t, "requests": b, "outputs_as_expected": b - len(wrong), **extra})
            if wrong:
                log(f"e2e B={b} {variant}: requests {wrong} differ from the expected greedy tokens")
            return t
        kw = dict(block_size=BLOCK, max_num_batched_tokens=max(4096, b * 8))
        t_plain = timed(Engine(compiled, b, prompt_len + new + 16, **kw), "plain")
        log(f"e2e B={b} plain: {b * new / t_plain:.1f} tokens/s, {rows[-1]['outputs_as_expected']}/{b} outputs as expected")
        for rate in [0.0] + [r for r in args.rates if r != 0.0]:
            eng = Engine(compiled, b, prompt_len + new + 16, speculative=SpecConfig(num_draft=k),
                         draft_head=head, **kw)
            eng.spec.static.draft_override = ReferenceDrafts(
                eng, {tuple(p): p + e for p, e in zip(prompts, expected)}, rate)
            # each draft survives with probability `rate` given the ones before it
            t = timed(eng, f"spec k={k} rate={rate}", expected_acceptance_length=sum(rate ** j for j in range(k + 1)))
            r = rows[-1]
            r.update(speedup=t_plain / t, acceptance_length=eng.spec.acceptance_length,
                     static_steps=eng.stats["spec_static_steps"], steps=eng.stats["steps"])
            log(f"e2e B={b} rate={rate}: {r['speedup']:.2f}x plain, L={r['acceptance_length']:.2f} "
                f"(expected {r['expected_acceptance_length']:.2f}), {r['outputs_as_expected']}/{b} outputs as expected")
    return rows


def print_table(rows: list[dict], acceptance) -> None:
    Ls = [PUBLIC_ACCEPTANCE] + list(acceptance)
    head = " ".join(f"{'x@L' + format(L, 'g'):>8}" for L in Ls)
    print(f"{'B':>3} {'k':>2} {'decode':>8} {'draft':>8} {'verify':>8} {'step':>8} {'(d+v)/dec':>9} {head}")
    for r in rows:
        if r["kind"] != "speculative":
            continue
        ratio = (r["draft_ms"] + r["verify_ms"]) / r["decode_ms"]
        sp = " ".join(f"{r[f'speedup_parts_L{L:g}']:>8.2f}" for L in Ls)
        print(f"{r['batch']:>3} {r['k']:>2} {r['decode_ms']:>8.2f} {r['draft_ms']:>8.2f} {r['verify_ms']:>8.2f} "
              f"{r['step_ms']:>8.2f} {ratio:>9.2f} {sp}")
    for r in rows:
        if r["kind"] == "e2e":
            extra = f" {r['outputs_as_expected']}/{r['requests']} as expected" + ("" if r["variant"] == "plain" else (
                f", {r['speedup']:.2f}x, L={r['acceptance_length']:.2f} (expected "
                f"{r['expected_acceptance_length']:.2f})"))
            print(f"e2e B={r['batch']:>3} {r['variant']:<20} {r['tokens_per_s']:>9.1f} tok/s{extra}")


__all__ = ["run", "print_table"]
