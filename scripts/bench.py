"""Decode-step and prefill benchmark of the whole model: eager vs torch.compile (Inductor) vs
reduce-overhead vs v41graph (all passes + CUDA-graph capture) vs v41graph with one thing changed
(P1 / P4 / P6 / the RMSNorm fusion off, stream-free segments compiled by Inductor, a BF16 global cache instead of FP4
(P2), Engram tables in pinned host memory, the indexer's top-k by torch's sorts instead of the
one-launch kernel), side by side in one process.

    python scripts/bench.py --out $OUT                          # the issue-8 run, on the H200
    python scripts/bench.py --config tiny --device cpu --batches 1,2 --contexts 64,128 \\
        --prefill 32 --steps 3                                  # smoke run (tests do this)

How a step is measured. One cache set holds max(batches) sequences at max(contexts) tokens,
filled with random valid FP8/FP4 bytes (a decode step's cost does not depend on the values).
Each context gets block tables as wide as it needs (the Full layers' indexer scores the whole
width, so a table sized for 32K would make a 4K step cost a 32K one); v41graph's shared decode
trace has the width symbolic, so another context costs a capture, not a trace (bucket 1 and
the other variants trace per width). The same decode step (B sequences at position `context`)
is then timed repeatedly: CUDA events around each call, median of --steps after --warmup calls.
Compile/capture time is the wall time of the first call(s) of a batch size (for v41graph: the
explicit warm-up of every bucket, reported once as "compile+capture of N buckets").

The floor is what the step must read once, over the measured device copy bandwidth (bytes read
+ written per second of a 1 GiB copy): every weight a step touches (routed experts: the
expected number of distinct experts B tokens pick, E*(1-(1-k/E)^B) per layer; embedding and
Engram tables: only the rows read) plus each sequence's cache reads (window rows, top-k global
rows, every index key a Full layer scores, the candidate pool of a Reindex layer).

Writes bench.json (every row, the profile) to --out and prints a short table last; with the
profile (default on CUDA) also a Chrome/Perfetto trace of the captured steps of the largest batch
and context per variant (trace_<variant>_b<B>_ctx<C>.json, open in ui.perfetto.dev).
scripts/plot_bench.py turns bench.json into the PNG of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import v41graph
from v41graph.model.kv_cache import ModelCaches, slots_with_scratch
from v41graph.model.metadata import build_metadata, positions_of
from v41graph.compiler.backend import raise_dynamo_recompile_limit
from v41graph.compiler.compiled_model import CompiledModel
from v41graph.model.layer_plan import build_layer_plan
from v41graph.model.layers import default_dtype
from v41graph.model.model import V41Model, init_random_weights_
from v41graph.passes.pass_manager import DEFAULT_PASSES
from v41graph.tools.profiling import profile_steps

VARIANTS = ("eager", "inductor", "reduce-overhead", "v41graph", "v41graph-noP1", "v41graph-noP4",
            "v41graph-noP6", "v41graph-noRMS", "v41graph-inductor", "v41graph-bf16cache",
            "v41graph-engram-host", "v41graph-sorttopk", "v41graph-headsattn",
            "v41graph-tilesfp8", "v41graph-blocksfp8", "v41graph-torchrouting", "v41graph-moesplit",
            "v41graph-torchgate", "v41graph-torchmhc", "v41graph-torchswiglu", "v41graph-pdl", "v41graph-P9")
# variant -> the environment it runs under (read by the CUDA ops at every call, so a capture
# takes it): one kernel's share of the whole step, before / after in one run. sorttopk: the
# indexer's top-k as the torch reference; headsattn: sparse attention by the head-tile kernel
# instead of the all-heads tile kernel; tilesfp8 / blocksfp8: every decode fp8_linear by the
# tiles / blocks kernel; torchrouting: the released MoE's routing and combine as torch ops instead
# of its route and combine kernels; moesplit: the released MoE's tokens gate_up with K split in 4
# over programs (moe_fp4._split_k); torchgate: the MoE gate as torch ops (reference.moe_gate) instead
# of its two kernels; torchmhc: mHC's two sides as torch ops (the Sinkhorn still one kernel) instead of
# the mhc_pre / mhc_post kernels; torchswiglu: the shared expert's activation as torch ops instead of
# the swiglu kernel; pdl: our kernels launched with programmatic dependent launch
VARIANT_ENV = {"v41graph-sorttopk": {"V41GRAPH_DISABLE_TRITON": "topk_ascending"},
               "v41graph-headsattn": {"V41GRAPH_ATTN_KERNEL": "heads"},
               "v41graph-tilesfp8": {"V41GRAPH_FP8_KERNEL": "tiles"},
               "v41graph-blocksfp8": {"V41GRAPH_FP8_KERNEL": "blocks"},
               "v41graph-torchrouting": {"V41GRAPH_MOE_ROUTING": "torch"},
               "v41graph-moesplit": {"V41GRAPH_MOE_SPLIT": "4"},
               "v41graph-torchgate": {"V41GRAPH_DISABLE_TRITON": "moe_gate"},
               "v41graph-torchmhc": {"V41GRAPH_DISABLE_TRITON": "mhc_pre,mhc_post"},
               "v41graph-torchswiglu": {"V41GRAPH_DISABLE_TRITON": "swiglu"},
               "v41graph-pdl": {"V41GRAPH_PDL": "1"}}
DISABLE = {"v41graph-noP1": ("P1",), "v41graph-noP4": ("P4",), "v41graph-noP6": ("P6",),
           "v41graph-noRMS": ("fuse_rmsnorm",)}
# variant -> its pass list when not the default: P9, the opt-in mHC predictor side stream
PASSES = {"v41graph-P9": (*DEFAULT_PASSES, "P9")}
# v41graph with its stream-free segments compiled by Inductor (compile(inductor_segments=True))
INDUCTOR_SEGMENT_VARIANTS = ("v41graph-inductor",)
# One trace, pass lists (and the Inductor-segment lowering) switched by make_runner. In VARIANTS
# they come before the variants after which main() calls torch._dynamo.reset() (that would make
# the shared model trace again).
SHARED_TRACE_VARIANTS = ("v41graph", *DISABLE, *PASSES, *INDUCTOR_SEGMENT_VARIANTS, *VARIANT_ENV)
BLOCK = 128
SHARE_DECODE_GRAPH = "all"    # the default; --bucket-1-static: True; --no-shared-decode-graph: False


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- model and data
def build_model(config: str, device: str, weights: str = "dense") -> V41Model:
    """weights="dense": bf16 (fp32 on the CPU) copies of every projection; "released": the
    checkpoint's FP8 / MXFP4 bytes, computed as stored (numerics="released")."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = getattr(v41graph.V41Config, config)(weight_format="checkpoint" if weights == "released" else "dense",
                                              torch_dtype=str(dtype).replace("torch.", ""))
    with default_dtype(dtype), torch.device(device):   # parameters and buffers on the device
        model = V41Model(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    init_random_weights_(model, g)
    with torch.no_grad():
        for e in model.engram:
            e.embed_weight.copy_(_random_bytes(e.embed_weight, g))
            e.embed_scale.fill_(127)
    if weights == "released":
        model.set_numerics("released")
    return model.eval().requires_grad_(False)


def _random_bytes(t: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    # 0xB7 keeps FP8/FP4 codes finite (no NaN/Inf encodings) and scales moderate
    return torch.randint(0, 256, t.shape, device=t.device, dtype=torch.uint8, generator=g) & 0xB7


def place_engram(model: V41Model, where: str) -> None:
    """Move every Engram table (FP8 rows + scales) to device memory or pinned host memory."""
    device = model.embed.weight.device
    for e in model.engram:
        for p in (e.embed_weight, e.embed_scale):
            p.data = p.data.to(device) if where == "device" else p.data.cpu().pin_memory()


def allocate_caches(model: V41Model, batch: int, context: int, device: str,
                    global_kv_dtype=torch.uint8):
    """Caches for `batch` sequences of up to `context` tokens (+1 scratch slot), random bytes."""
    blocks_per_seq = math.ceil((context + 1) / BLOCK)
    caches = ModelCaches.allocate(model.config, slots_with_scratch(batch), batch * blocks_per_seq, BLOCK, device,
                                  global_kv_dtype=global_kv_dtype)
    g = torch.Generator(device=device).manual_seed(1)
    with torch.no_grad():
        for t in caches.tensors():
            if t.dtype == torch.uint8:
                t.copy_(_random_bytes(t, g))
            elif t.is_floating_point():
                t.normal_(generator=g)
    return caches, blocks_per_seq


def decode_inputs(model: V41Model, batch: int, context: int, blocks_per_seq: int, device: str):
    """One decode step of sequences 0..batch-1 at position `context`. Sequence b owns blocks
    b*blocks_per_seq... of the cache set; its table is as wide as `context` needs, as a
    serving engine sized for that context would give it (Full layers score the whole width)."""
    width = min(blocks_per_seq, math.ceil((context + 1) / BLOCK))
    tables = [list(range(b * blocks_per_seq, b * blocks_per_seq + width)) for b in range(batch)]
    meta = build_metadata(list(range(batch)), [context] * batch, [1] * batch, tables, width, device)
    g = torch.Generator(device=device).manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=device, generator=g)
    return ids, positions_of(meta), meta


# ----------------------------------------------------------------------------- floor
def floor_bytes(model: V41Model, batch: int, context: int) -> int:
    """Bytes one decode step must read (see the module docstring)."""
    cfg = model.config
    total = 0
    for name, p in model.named_parameters():
        if name.startswith(("mtp.", "dspark.")):
            continue
        nbytes = p.numel() * p.element_size()
        if ".experts." in name and ".shared_experts." not in name:
            e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
            nbytes *= (1 - (1 - k / e) ** batch)        # expected share of experts picked
        elif name == "embed.weight":
            nbytes = batch * p.shape[-1] * p.element_size()
        elif name.endswith(("embed_weight", "embed_scale")):    # Engram: 24 rows per token
            rows = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            nbytes = batch * rows * p.shape[-1] * p.element_size()
        total += nbytes
    d, di = cfg.head_dim, cfg.index_head_dim
    per_seq = 0
    pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
    for role in build_layer_plan(cfg):
        per_seq += cfg.sliding_window * (d + d // 32)                 # FP8 window + UE8M0
        if role.ratio:
            per_seq += cfg.index_topk * (d // 2 + d // 16)            # FP4 global rows + E4M3
        if role.scores:
            positions = context // role.ratio
            if role.mode == "reindex":
                positions = min(positions, pool)
            per_seq += positions * (di // 2 + di // 32)               # FP4 index keys + UE8M0
    return int(total + batch * per_seq)


def copy_bandwidth(device: str) -> float:
    """Device copy bandwidth in bytes/s (bytes read + written, 1 GiB copies)."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    _sync(device)
    return 2 * 5 * n / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_calls(fn, steps: int, device: str) -> list[float]:
    """Milliseconds per call, one measurement per call."""
    out = []
    for _ in range(steps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


# Every variant compiles the same V41Model.forward (Inductor and reduce-overhead too): more than
# Dynamo's default per-code-object limit of 8 in one process (v41graph.compile raises it too).
raise_dynamo_recompile_limit(64)
_PASS_ABLATIONS: dict = {}   # the one CompiledModel that v41graph and its -noP* variants share


def make_runner(model: V41Model, variant: str, batches: list[int]):
    """(the callable a variant times, whether it reuses an earlier variant's trace).
    SHARED_TRACE_VARIANTS share one trace: the first of them compiles, the others only re-run
    the passes (and the Inductor-segment lowering, for v41graph-inductor) on the kept post-AOT
    graphs (CompiledModel.set_passes) and capture again, so an ablation costs no trace."""
    if variant in SHARED_TRACE_VARIANTS:
        inductor_segments = variant in INDUCTOR_SEGMENT_VARIANTS
        compiled = _PASS_ABLATIONS.get("model")
        if compiled is None:
            compiled = _PASS_ABLATIONS["model"] = v41graph.compile(
                model, backend="auto", passes=PASSES.get(variant), disable=DISABLE.get(variant, ()),
                batch_sizes=batches,
                share_decode_graph=SHARE_DECODE_GRAPH, inductor_segments=inductor_segments)
            return compiled, False
        compiled.inductor_segments = inductor_segments     # read when set_passes lowers again
        compiled.set_passes(passes=PASSES.get(variant), disable=DISABLE.get(variant, ()))
        return compiled, True
    if variant == "eager":
        return model, False
    if variant == "inductor":
        return torch.compile(model, dynamic=False), False
    if variant == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False), False
    # bf16-cache / Engram-host: other cache dtypes or table devices, so a trace of their own
    return v41graph.compile(model, backend="auto", batch_sizes=batches,
                            share_decode_graph=SHARE_DECODE_GRAPH), False


def inductor_segment_totals(runner) -> dict | None:
    """The Inductor-segment reports (compiler/inductor_segments.py) of every graph the runner
    runs now, summed; None when it runs none (not a v41graph-inductor variant)."""
    reports = [g.current.meta.get("inductor_segments") for g in getattr(runner, "traced", ())]
    reports = [r for r in reports if r]
    if not reports:
        return None
    totals = {k: sum(r[k] for r in reports)
              for k in ("found", "compiled", "distinct_compiled", "left", "too_small", "refused",
                        "nodes_compiled", "compile_s")}
    totals["graphs"] = len(reports)
    totals["refusals"] = [x for r in reports for x in r["refusals"]]
    return totals


# ----------------------------------------------------------------------------- profile
_KERNEL_CLASSES = (   # (class, regex on the kernel name), first match wins
    ("sparse attention", r"sparse_attn"),
    ("P1 fused compressor", r"wkv|pool_rmsnorm"),
    ("cache writes", r"kv_write|index_k_write|_write_kernel"),
    ("Engram", r"engram"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|splitK|grouped_mm"),
    ("sort / top-k", r"sort|topk|radix|bitonic"),
    ("gather / scatter / index", r"index|gather|scatter|cat"),
    ("copy", r"copy|memcpy|memset|fill"),
    ("elementwise / reduce", r"elementwise|vectorized|reduce|unrolled|triton_"),
)


def profile_step(fn, device: str, steps: int = 3, trace: Path | None = None) -> dict:
    """Kernel time of `steps` calls grouped by kernel class and by stream (ms per call; CUDA
    kernels only), and with `trace` their Chrome/Perfetto trace (v41graph/tools/profiling.py:
    on CUDA the captured replays' kernels per stream, on CPU the ops of the uncaptured steps)."""
    prof = profile_steps(fn, device, steps, trace=trace)
    by_class, by_stream, by_name, n_kernels = {}, {}, {}, 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = (e.time_range.end - e.time_range.start) / 1e3 / steps
        cls = next((c for c, rx in _KERNEL_CLASSES if re.search(rx, e.name, re.I)), "other")
        by_class[cls] = by_class.get(cls, 0.0) + ms
        stream = f"stream {getattr(e, 'device_resource_id', '?')}"
        by_stream[stream] = by_stream.get(stream, 0.0) + ms
        ms_calls = by_name.setdefault(e.name[:120], [0.0, 0])
        ms_calls[0] += ms
        ms_calls[1] += 1
        n_kernels += 1
    # the kernels that cost most, by name: where the next fusion or GEMM fix should look
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:60]
    return {"by_class_ms": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "by_stream_ms": by_stream, "kernels_per_step": n_kernels / steps,
            "top_kernels": [{"name": k, "ms_per_step": round(v[0], 4), "calls_per_step": v[1] / steps}
                            for k, v in top],
            "chrome_trace": str(trace) if trace is not None else None}


# ----------------------------------------------------------------------------- main
def run_variant(model, variant, batches, contexts, prefill, args, device, bw) -> list[dict]:
    rows = []
    place_engram(model, "host" if variant == "v41graph-engram-host" and device == "cuda" else "device")
    gdtype = torch.bfloat16 if variant == "v41graph-bf16cache" else torch.uint8
    caches, bps = allocate_caches(model, max(batches), max(contexts), device, gdtype)
    t0 = time.perf_counter()
    runner, trace_reused = make_runner(model, variant, batches)
    setup_s = time.perf_counter() - t0     # set_passes (and Inductor segments) on a reused trace
    if setup_s > 1:
        log(f"{variant}: ready in {setup_s:.1f} s")
    warm_s, breakdown = None, None
    if variant.startswith("v41graph") and device == "cuda":
        runner.timings.clear()      # this variant's warm-up only (a reused trace keeps the dict)
        t0 = time.perf_counter()
        runner.warmup(caches, bps, show_progress=False)   # compile + capture every bucket
        _sync(device)
        warm_s = time.perf_counter() - t0
        breakdown = {k: round(v, 2) for k, v in runner.timings.items() if k.endswith("_s")}
        what = "passes + capture (trace reused)" if trace_reused else "compile + capture"
        log(f"{variant}: {what} of {len(batches)} buckets {warm_s:.1f} s; breakdown {breakdown}")
    segments = inductor_segment_totals(runner)
    if segments:
        log(f"{variant}: Inductor segments {segments}")
    for batch in batches:
        first = True
        for context in contexts:
            ids, pos, meta = decode_inputs(model, batch, context, bps, device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.no_grad():
                # v41graph: the decode entry point (its captured buckets); the eager model and
                # torch.compile'd modules run a decode step as their forward
                decode = runner.decode if isinstance(runner, CompiledModel) else runner
                step = lambda: decode(ids, pos, caches, meta)   # noqa: E731
                for _ in range(args.warmup):
                    step()
                _sync(device)
                compile_s = (time.perf_counter() - t0) if first and variant != "eager" else 0.0
                ms = time_calls(step, args.steps, device)
                trace = (Path(args.out) / f"trace_{variant}_b{batch}_ctx{context}.json"
                         if args.out else None)
                profile = (profile_step(step, device, trace=trace)
                           if (device == "cuda" or args.profile_cpu) and args.profile
                           and (args.profile_all or batch == max(batches)) and context == max(contexts)
                           else None)
            first = False
            med = statistics.median(ms)
            fb = floor_bytes(model, batch, context)
            rows.append({"kind": "decode", "context": context, "batch": batch, "variant": variant,
                         "step_ms": med, "step_ms_min": min(ms), "tokens_per_s": batch / med * 1e3,
                         "compile_s": compile_s, "warmup_all_buckets_s": warm_s, "setup_s": setup_s,
                         "warmup_breakdown_s": breakdown, "trace_reused": trace_reused,
                         "floor_bytes": fb, "floor_ms": fb / bw * 1e3,
                         "floor_fraction": fb / bw * 1e3 / med,
                         "peak_mem_gb": (torch.cuda.max_memory_allocated() / 1e9
                                         if device == "cuda" else None),
                         "inductor_segments": segments,
                         "profile": profile})
            log(f"{variant} B={batch} ctx={context}: {med:.3f} ms (compile {compile_s:.1f} s)")
    del caches
    if prefill and variant in ("eager", "inductor", "v41graph", "v41graph-inductor"):
        rows.append(run_prefill(model, runner, variant, prefill, args, device))
    place_engram(model, "device")
    return rows


def run_prefill(model, runner, variant, n_tokens, args, device) -> dict:
    """One sequence, `n_tokens` prompt tokens in one chunk, last-token logits."""
    caches, bps = allocate_caches(model, 1, n_tokens, device)
    meta = build_metadata([0], [0], [n_tokens], [list(range(bps))], bps, device)
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), device=device,
                        generator=torch.Generator(device=device).manual_seed(3))
    pos = positions_of(meta)
    t0 = time.perf_counter()
    with torch.no_grad():   # v41graph: a forward call, the uncaptured prefill graph
        step = lambda: runner(ids, pos, caches, meta)   # noqa: E731
        step()
        _sync(device)
        compile_s = time.perf_counter() - t0 if variant != "eager" else 0.0
        ms = time_calls(step, max(2, args.steps // 4), device)
    med = statistics.median(ms)
    log(f"{variant} prefill {n_tokens}: {med:.1f} ms")
    return {"kind": "prefill", "context": n_tokens, "batch": 1, "variant": variant, "step_ms": med,
            "tokens_per_s": n_tokens / med * 1e3, "compile_s": compile_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="bench", choices=("tiny", "bench", "bench_rank"))
    ap.add_argument("--weights", choices=("dense", "released"), default=None,
                    help="dense: bf16 copies of the projections (default for tiny / bench); released: the "
                         "checkpoint's FP8 / MXFP4 bytes computed as stored (default for bench_rank)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32,64", help="decode buckets (all are captured)")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--prefill", type=int, default=4096, help="prefill tokens (0 = skip)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="no profile of the largest batch and context (by default on CUDA: kernel classes "
                         "in bench.json and a Chrome trace per variant, --out/trace_<variant>_b<B>_ctx<C>.json)")
    ap.add_argument("--profile-all", action="store_true",
                    help="profile every batch at the largest context, not only the largest batch")
    ap.add_argument("--profile-cpu", action="store_true",
                    help="profile on the CPU too (the op-by-op trace of uncaptured steps)")
    ap.add_argument("--no-shared-decode-graph", dest="shared", action="store_false",
                    help="v41graph: trace each decode bucket separately")
    ap.add_argument("--bucket-1-static", dest="shared", action="store_const", const=True,
                    help="v41graph: bucket 1 traced on its own, buckets >= 2 share a graph "
                         "(share_decode_graph=True; the default is 'all': every bucket and the prefill on one trace)")
    ap.add_argument("--share-bucket-1", dest="shared", action="store_const", const="all",
                    help="(the default) every bucket shares the decode graph (share_decode_graph='all')")
    ap.set_defaults(shared="all")
    ap.add_argument("--speculative", default=None, metavar="K,..",
                    help="instead of the variants: the speculative step for these draft counts "
                         "(scripts/bench_speculative.py) at --batches and the first of --contexts")
    ap.add_argument("--acceptance", default="", help="(--speculative) more acceptance lengths L to "
                    "compute the speedup at, besides the public 3.51")
    ap.add_argument("--e2e", action="store_true", help="(--speculative) end-to-end tokens/s with "
                    "reference drafts of a controlled acceptance rate")
    ap.add_argument("--rates", default="0.5,0.7,0.9", help="(--e2e) draft acceptance rates")
    ap.add_argument("--e2e-tokens", type=int, default=64, help="(--e2e) tokens generated per request; "
                    "each is checked against the known greedy successor")
    ap.add_argument("--e2e-only", action="store_true", help="(--speculative) only the end-to-end run: "
                    "skips the per-part timings, whose captures cost 1.5-2 min per batch on the bench config")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.acceptance = [float(x) for x in args.acceptance.split(",") if x]
    args.rates = [float(x) for x in args.rates.split(",") if x]
    if (args.e2e or args.e2e_only) and not args.speculative:
        ap.error("--e2e / --e2e-only only apply with --speculative K,..")
    if args.e2e_tokens < 1:
        ap.error(f"--e2e-tokens must be >= 1, got {args.e2e_tokens}")
    device = args.device
    batches = sorted(int(b) for b in args.batches.split(","))
    contexts = sorted(int(c) for c in args.contexts.split(","))
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    t_build = time.perf_counter()
    weights = args.weights or ("released" if args.config == "bench_rank" else "dense")
    model = build_model(args.config, device, weights)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    built_bytes = torch.cuda.memory_allocated() if device == "cuda" else None   # weights + buffers
    bw = copy_bandwidth(device)
    log(f"{args.config} model ({weights} weights, {weight_bytes / 2 ** 30:.2f} GiB) on {device} built in "
        f"{time.perf_counter() - t_build:.0f} s; copy bandwidth {bw / 1e9:.0f} GB/s")
    global SHARE_DECODE_GRAPH
    SHARE_DECODE_GRAPH = args.shared
    rows, out = [], Path(args.out) if args.out else None
    if args.speculative:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_speculative
        ks = [int(k) for k in args.speculative.split(",")]
        rows = bench_speculative.run(model, batches, contexts[0], ks, args, device, log, time_calls,
                                     _random_bytes)
        if out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_speculative.json").write_text(json.dumps(
                {"config": args.config, "device": device, "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "rows": rows}, indent=1))
        bench_speculative.print_table(rows, args.acceptance)
        return 0
    for variant in variants:
        env = VARIANT_ENV.get(variant, {})
        kept = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            rows += run_variant(model, variant, batches, contexts, args.prefill, args, device, bw)
        except Exception as e:   # one broken variant must not cost the others' device time
            traceback.print_exc()
            log(f"{variant} FAILED: {type(e).__name__}: {e}")
            rows.append({"kind": "error", "variant": variant, "error": f"{type(e).__name__}: {e}"})
            place_engram(model, "device")
            if device == "cuda":
                torch.cuda.empty_cache()
        finally:
            for name, value in kept.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if variant not in SHARED_TRACE_VARIANTS:   # those keep the shared trace (make_runner)
            torch._dynamo.reset()
        if out:   # after every variant: a killed run still leaves its numbers
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench.json").write_text(json.dumps(
                {"config": args.config, "weights": weights, "weight_bytes": weight_bytes,
                 "device_bytes_after_build": built_bytes,
                 "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
                 "device": device, "copy_bytes_per_s": bw,
                 "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                 "torch": torch.__version__, "rows": rows}, indent=1))
    peak = (f", {built_bytes / 2 ** 30:.2f} GiB allocated after the build, peak device memory "
            f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB") if device == "cuda" else ""
    print(f"{args.config}, {weights} weights: {weight_bytes / 2 ** 30:.2f} GiB of parameters{peak}")
    print(f"{'kind':<7} {'ctx':>6} {'B':>3} {'variant':<21} {'ms':>9} {'tok/s':>9} "
          f"{'compile s':>9} {'floor':>6}")
    for r in rows:
        if r["kind"] == "error":
            print(f"{'error':<7} {'':>6} {'':>3} {r['variant']:<21} {r['error'][:60]}")
            continue
        floor = f"{r['floor_fraction']:>6.1%}" if "floor_fraction" in r else f"{'':>6}"
        print(f"{r['kind']:<7} {r['context']:>6} {r['batch']:>3} {r['variant']:<21} "
              f"{r['step_ms']:>9.3f} {r['tokens_per_s']:>9.1f} {r['compile_s']:>9.1f} {floor}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
