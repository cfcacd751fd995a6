"""Compile time, cold vs warm persistent compile cache (issue 24), and whether warm == cold bit for bit.

    python scripts/bench_compile.py --out $OUT                              # H200: both variants
    python scripts/bench_compile.py --variants executor --control --out $OUT   # + a cold-vs-cold control
    python scripts/bench_compile.py --variants inductor --out $OUT          # the long one
    python scripts/bench_compile.py --variants executor,executor-unstamped --out $OUT   # stamping vs not
    python scripts/bench_compile.py --config tiny --device cpu --buckets 1,4 --steps 4 \\
        --prefill 16 --context 40 --out /tmp/bc                             # CPU smoke run

For each variant (executor: our executor only; inductor: Inductor segments on; either with
"-unstamped": every layer traced, without layer stamping, compiler/stamp.py, or with
"-serialjit": no compile workers, compiler/triton_precompile.py, or with "-segshere": Inductor
segments compiled in the process, not in the compile workers, or with "-segwhole": each worker
compiles its segment's Triton kernels itself, not as jobs of their own), ONE invocation
runs two child processes one after the other on one cache directory: cold (the directory
emptied first) then warm (the directory as the cold run left it). Each child builds the model
(the config's random weights, as scripts/bench.py builds it), then times from
v41graph.compile(...) to the end of the first captured decode step: all decode buckets compiled
and captured (warmup), one prefill call, one decode step. Then it runs --steps captured decode
steps (step i decodes the first b sequences, b cycling through the buckets, so every captured
graph runs; the next token is the argmax) and hashes every step's logits. The parent prints a
table last (and writes bench_compile.json to --out): times, CompiledModel.timings, cache hits,
and whether the warm run's hashes equal the cold run's (the first differing step if not).
--control adds a second cold process (its own empty directory) between the two: whether two
cold starts agree bit for bit, without which warm != cold would say nothing about the cache.
With a variant and its "-unstamped" twin in one invocation, the two cold runs are compared too
(layer stamping must give the same bits as tracing every layer).
Children run with torch.use_deterministic_algorithms on unless --nondeterministic: the fused
wkv + RMSNorm's split-K atomics are not run-to-run deterministic (the ninth session's warm run
parted from the cold one at step 25 without it; with it, cold == cold2 == warm over 100 steps on
the H200, docs/BENCHMARKS.md). --warm-runs 2 adds a second warm process: each phase reports the
Triton kernels and Inductor files it added to the caches, so a warm start that compiles again
shows.

The children run with TRITON_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR unset, so both point under the
cache directory (compile_cache.point_tool_caches): cold really is cold, and warm keeps the Triton
JIT too. CUBLAS_WORKSPACE_CONFIG=:4096:8 makes cuBLAS deterministic across its streams.
"""
from __future__ import annotations

import time

_T_START = time.perf_counter()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# "-unstamped": every layer traced (stamp_layers=False), the route before layer stamping;
# "-serialjit": V41GRAPH_COMPILE_WORKERS=0, each Triton kernel compiled at its first launch, one
# after another, and Inductor's compile workers started by Inductor itself (the route before the
# eighteenth session's parallel precompile)
# "-segshere": V41GRAPH_SEGMENT_WORKERS=0, Inductor segments compiled in the process one after
# another (the route before the twenty-first session's segment compiles in the workers)
# "-segwhole": V41GRAPH_SEGMENT_WORKERS=whole, a worker compiles its segment's Triton kernels
# itself (the twenty-first session's route, before the kernels became jobs of their own)
# "-latepre": the Triton precompile of a graph's first sizes at its first run, after the lowering
# (the route before the nineteenth session, which starts it before the lowering)
VARIANTS = ("executor", "inductor", "executor-unstamped", "inductor-unstamped", "executor-serialjit",
            "inductor-serialjit", "inductor-latepre", "inductor-segshere", "inductor-segwhole")
PHASES = ("cold", "cold2", "warm", "warm2", "warm3")     # cold2: the --control run; warm2+: --warm-runs


def log(msg: str) -> None:
    print(f"[bench_compile {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="bench", help="V41Config classmethod: bench (default) or tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="executor,inductor", help="comma list of " + ", ".join(VARIANTS))
    p.add_argument("--buckets", default="1,8,32,64", help="decode buckets (batch sizes)")
    p.add_argument("--bucket-1-static", action="store_true",
                   help='share_decode_graph=True: bucket 1 traced on its own (the default "all": every '
                        'bucket and the prefill on one trace)')
    p.add_argument("--control", action="store_true",
                   help="a second cold process (its own empty cache directory) between cold and warm: "
                        "whether two cold starts agree bit for bit, the control for warm == cold")
    p.add_argument("--warm-runs", type=int, default=1,
                   help="warm processes one after the other on the cache (2: whether the first warm "
                        "still leaves work for the second, e.g. Triton kernels compiled again)")
    p.add_argument("--prefill", type=int, default=512, help="tokens of the one prefill call")
    p.add_argument("--context", type=int, default=1024, help="decode position of every sequence at step 0")
    p.add_argument("--steps", type=int, default=100, help="captured decode steps hashed")
    p.add_argument("--cache-root", default=None, help="cache directories (default: <out>/cache-<variant>)")
    p.add_argument("--child-timeout", type=int, default=480, help="seconds per child process")
    p.add_argument("--nondeterministic", action="store_true",
                   help="leave torch.use_deterministic_algorithms off (the fused wkv + RMSNorm then "
                        "sums split-K partials with atomics, so two runs can differ in the last bit)")
    p.add_argument("--profile", default="",
                   help="comma list of phases (cold, warm) whose compile + warm-up runs under cProfile: the "
                        "functions taking the most time go to <out>/<variant>-<phase>-profile.txt (the "
                        "profiler slows Python, so that phase's times are not comparable)")
    p.add_argument("--out", required=True)
    # internal: one child run
    p.add_argument("--child", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--profile-first-run", default="",
                   help="comma list of phases whose decode buckets' first runs (alone, without the trace) "
                        "are profiled into <out>/<variant>-<phase>-first-run-profile.txt (the tracing "
                        "bucket's trace runs under the profiler too, its data dropped: that phase's "
                        "times are inflated)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.warm_runs <= 3:
        p.error(f"--warm-runs must be 1, 2 or 3, got {args.warm_runs}")
    args.bucket_list = sorted({int(b) for b in args.buckets.split(",")})
    args.variant_list = [v for v in args.variants.split(",") if v]
    for v in args.variant_list:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; variants are {', '.join(VARIANTS)}")
    return args


# ----------------------------------------------------------------------------- child
def run_child(args) -> dict:
    import torch
    import_s = time.perf_counter() - _T_START
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench                      # scripts/bench.py: the model and caches as it builds them
    import v41graph
    from v41graph.model.metadata import build_metadata, positions_of

    device = args.device
    if args.variant.endswith("-serialjit"):
        os.environ["V41GRAPH_COMPILE_WORKERS"] = "0"
    if args.variant.endswith("-segshere"):
        os.environ["V41GRAPH_SEGMENT_WORKERS"] = "0"
    if args.variant.endswith("-segwhole"):
        os.environ["V41GRAPH_SEGMENT_WORKERS"] = "whole"
    if args.variant.endswith("-latepre"):
        from v41graph.compiler.triton_precompile import TritonPrecompile
        TritonPrecompile.start = lambda self, gm, args: None    # the first run notes and compiles
    jit = count_triton_compiles()
    if not args.nondeterministic:
        # the goal is "bit-identical with deterministic kernels": our kernels and cuBLAS pick
        # their deterministic paths; uninitialized memory is not filled (that would add kernels)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    t0 = time.perf_counter()
    model = bench.build_model(args.config, device)
    bench._sync(device)
    model_s = time.perf_counter() - t0
    buckets = args.bucket_list
    biggest = buckets[-1]
    max_context = args.context + args.steps + 1
    caches, blocks = bench.allocate_caches(model, biggest, max(max_context, args.prefill), device)

    first_runs = record_first_runs(args.child in args.profile_first_run.split(","))
    profiler = None
    if args.child in args.profile.split(","):
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    t_start = time.perf_counter()
    compiled = v41graph.compile(model, batch_sizes=buckets, inductor_segments=args.variant.startswith("inductor"),
                                stamp_layers=not args.variant.endswith("-unstamped"),
                                share_decode_graph=True if args.bucket_1_static else "all",
                                compile_cache=args.cache)
    compiled.warmup(caches, blocks, show_progress=False)
    bench._sync(device)
    t_warm = time.perf_counter()
    if profiler is not None:
        profiler.disable()
        write_profile(profiler, Path(args.out, f"{args.variant}-{args.child}-profile.txt"))
    if first_runs["profiles"]:
        write_profile(first_runs["profiles"], Path(args.out, f"{args.variant}-{args.child}-first-run-profile.txt"))
    jit_warmup = {k: (list(v) if isinstance(v, list) else v) for k, v in jit.items()}
    # one prefill chunk of sequence 0 (slot 0, its own blocks)
    table0 = list(range(blocks))
    meta = build_metadata([0], [0], [args.prefill], [table0], blocks, device)
    ids = torch.randint(0, model.config.vocab_size, (args.prefill,), device=device,
                        generator=torch.Generator(device=device).manual_seed(3))
    prefill_logits = compiled(ids, positions_of(meta), caches, meta)
    bench._sync(device)
    t_prefill = time.perf_counter()
    jit_prefill = {k: v[len(jit_warmup[k]):] if isinstance(v, list) else v - jit_warmup[k] for k, v in jit.items()}

    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(biggest)]
    pos = [args.context] * biggest
    tokens = torch.randint(0, model.config.vocab_size, (biggest,), device=device,
                           generator=torch.Generator(device=device).manual_seed(4))
    hashes, first_step_s = [], None
    prefill_hash = hashlib.sha256(prefill_logits.float().cpu().numpy().tobytes()).hexdigest()
    digest = hashlib.sha256(prefill_hash.encode())
    for step in range(args.steps):
        n = buckets[step % len(buckets)]
        meta = build_metadata(list(range(n)), pos[:n], [1] * n, tables[:n], blocks, device)
        logits = compiled.decode(tokens[:n], positions_of(meta), caches, meta)
        if first_step_s is None:
            bench._sync(device)
            first_step_s = time.perf_counter() - t_start
        tokens[:n] = logits.argmax(-1)
        pos[:n] = [p + 1 for p in pos[:n]]
        h = hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()
        hashes.append(h)
        digest.update(h.encode())
    bench._sync(device)
    segments = compiled.compile_cache.segments if compiled.compile_cache else None
    return {"variant": args.variant, "phase": args.child, "device": device, "config": args.config,
            "buckets": buckets, "import_s": round(import_s, 2), "model_s": round(model_s, 2),
            "to_first_step_s": round(first_step_s, 2), "warmup_s": round(t_warm - t_start, 2),
            "prefill_s": round(t_prefill - t_warm, 2),
            "timings": {k: round(v, 3) for k, v in compiled.timings.items()},
            # each bucket's first run (after its graph was ready), in warmup's order
            "first_runs_s": first_runs["s"],
            # Triton kernels compiled in this process (a worker's compile is a load here)
            "triton_jit": {"warmup": jit_warmup, "prefill": jit_prefill},
            "precompile": compiled.precompile.reports if compiled.precompile is not None else None,
            "segments_loaded": segments.loaded if segments else None,
            # each graph's lowering report (Inductor segments: compiled, loaded, slowest compiles)
            "lowering": [{k: v for k, v in g.current.meta.get("inductor_segments", {}).items() if k != "refusals"}
                         for g in compiled.traced],
            # Inductor's own phase times in this process (dynamo_timed), the largest first
            "inductor_phases_s": inductor_phase_seconds(),
            "segments_stored": segments.stored if segments else None,
            "cache_events": compiled.compile_cache.events[-30:] if compiled.compile_cache else [],
            "notes": dict(compiled.notes),
            # whether Triton's / Inductor's caches went under the cache directory (files there)
            "tool_cache_files": {sub: sum(1 for p in Path(args.cache, sub).rglob("*") if p.is_file())
                                 for sub in ("triton", "inductor")},
            "prefill_hash": prefill_hash,
            "step_hashes": hashes, "hash": digest.hexdigest()}


def record_first_runs(profile: bool) -> dict:
    """Each decode bucket's first-run seconds ({"s": {bucket: s}}), and with `profile` cProfiles
    of the first runs alone ({"profiles": [...]}): from the moment a traced graph is ready (the
    tracing bucket: what it profiled of the trace is dropped) or from the step's start (the
    others) to its end."""
    import cProfile

    from v41graph.compiler.compiled_model import CompiledModel, DecodeGraph
    got = {"s": {}, "profiles": []}
    first_step, graph_compiled = DecodeGraph._first_step, CompiledModel._graph_compiled

    def begin():
        if profile:
            got["profiles"].append(cProfile.Profile())
            got["profiles"][-1].enable()

    def end():
        if profile and got["profiles"]:
            got["profiles"][-1].disable()

    def timed_first_step(self):
        before = self.compiled.timings["first_run_s"]
        begin()
        try:
            return first_step(self)
        finally:
            end()
            got["s"][self.bucket] = round(self.compiled.timings["first_run_s"] - before, 3)

    def graph_ready(self, *a, **kw):   # the trace is done: what follows in the step is its first run
        end()
        if profile and got["profiles"]:
            got["profiles"].pop()
        out = graph_compiled(self, *a, **kw)
        begin()
        return out
    DecodeGraph._first_step = timed_first_step
    CompiledModel._graph_compiled = graph_ready
    return got


def write_profile(profiler, path: Path, top: int = 45) -> None:
    """The `top` functions by cumulative and by own time, as pstats prints them (`profiler`: one
    cProfile.Profile, or a list whose stats are summed)."""
    import io
    import pstats
    text = io.StringIO()
    profiles = profiler if isinstance(profiler, list) else [profiler]
    stats = pstats.Stats(*profiles, stream=text).strip_dirs()
    for order in ("cumulative", "tottime"):
        stats.sort_stats(order).print_stats(top)
    path.write_text(text.getvalue())


def inductor_phase_seconds(top: int = 30) -> dict:
    """Seconds per phase torch's compile timers recorded in this process (Dynamo, AOT,
    Inductor's lowering / codegen / waiting for its compile workers), the largest `top`."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return {}
    sums = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if v}
    return dict(sorted(sums.items(), key=lambda kv: -kv[1])[:top])


def count_triton_compiles() -> dict:
    """Counts of Triton compiles in this process from now on: "compiled" (a miss in Triton's
    on-disk cache: the JIT ran here) and "loaded" (a hit), through Triton's compilation
    listener (chained to one already set)."""
    counts = {"compiled": 0, "loaded": 0}
    try:
        from triton import knobs
    except ImportError:
        return counts
    previous = knobs.compilation.listener
    names = counts.setdefault("compiled_names", [])

    def listen(**kwargs):
        counts["loaded" if kwargs.get("cache_hit") else "compiled"] += 1
        if not kwargs.get("cache_hit"):
            src = kwargs.get("src")
            names.append(str(getattr(getattr(src, "fn", None), "__name__", None) or getattr(src, "name", "?")))
        if previous is not None:
            previous(**kwargs)
    knobs.compilation.listener = listen
    return counts


# ----------------------------------------------------------------------------- parent
def tool_cache_snapshot(cache: Path) -> dict:
    """What Triton's and Inductor's caches under `cache` hold: Triton's kernel directories (one
    per compiled kernel and key) with the kernel's name, and Inductor's files."""
    triton = {}
    # Inductor keeps its kernels in its own Triton directory when TRITON_CACHE_DIR is unset
    for root in (Path(cache, "triton"), Path(cache, "inductor", "triton")):
        for meta in root.rglob("*.json"):
            if not meta.name.startswith("__grp__"):
                triton[str(meta.parent.relative_to(cache))] = meta.stem
    inductor = {str(p.relative_to(cache)) for p in Path(cache, "inductor").rglob("*")
                if p.is_file() and "triton" not in p.relative_to(cache).parts}
    return {"triton": triton, "inductor": inductor}


def _first_differing_line(a: Path, b: Path) -> str | None:
    try:
        la, lb = a.read_text().splitlines(), b.read_text().splitlines()
    except OSError as e:
        return f"unreadable: {e}"
    for i, (x, y) in enumerate(zip(la, lb)):
        if x != y:
            return f"line {i + 1}: {x.strip()[:160]!r} vs {y.strip()[:160]!r}"
    return None if len(la) == len(lb) else f"lengths {len(la)} vs {len(lb)}"


def _differing_keys(a: Path, b: Path) -> dict | str:
    try:
        da, db = json.loads(a.read_text()), json.loads(b.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable: {e}"
    return {k: [str(da.get(k))[:120], str(db.get(k))[:120]] for k in sorted(set(da) | set(db))
            if da.get(k) != db.get(k)}


def tool_cache_growth(cache: Path, before: dict, after: dict, examples: int = 3) -> dict:
    """The Triton kernels and Inductor files a phase added (a warm start that adds Triton
    kernels paid their JIT again). For a few new kernels whose name cold had compiled under
    another key, the first line where the two Triton IRs differ: what changed the key."""
    new = {h: n for h, n in after["triton"].items() if h not in before["triton"]}
    old_by_name = {}
    for h, n in before["triton"].items():
        old_by_name.setdefault(n, h)
    same_name = []
    for h, n in sorted(new.items(), key=lambda kv: kv[1]):
        if n in old_by_name and len(same_name) < examples:
            old_dir, new_dir = Path(cache, old_by_name[n]), Path(cache, h)
            same_name.append({"kernel": n,
                              "ttir": _first_differing_line(old_dir / f"{n}.ttir", new_dir / f"{n}.ttir"),
                              "metadata": _differing_keys(old_dir / f"{n}.json", new_dir / f"{n}.json")})
    new_inductor = sorted(after["inductor"] - before["inductor"])
    return {"triton_kernels_new": len(new), "triton_new_names": sorted(set(new.values()))[:80],
            "triton_new_with_a_name_seen_before": sum(n in old_by_name for n in new.values()),
            "triton_same_name_diffs": same_name,
            "inductor_files_new": len(new_inductor),
            "inductor_new_suffixes": sorted({Path(p).suffix or Path(p).name for p in new_inductor})}


def child_command(args, variant: str, phase: str, cache: Path, out: Path) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase, "--variant", variant,
           "--cache", str(cache), "--child-out", str(out), "--out", str(out.parent),
           "--config", args.config, "--device", args.device, "--buckets", args.buckets,
           "--prefill", str(args.prefill), "--context", str(args.context), "--steps", str(args.steps)]
    return (cmd + (["--bucket-1-static"] if args.bucket_1_static else [])
            + (["--nondeterministic"] if args.nondeterministic else [])
            + (["--profile", args.profile] if args.profile else [])
            + (["--profile-first-run", args.profile_first_run] if args.profile_first_run else []))


def compare(cold: dict, warm: dict) -> dict:
    if "step_hashes" not in cold or "step_hashes" not in warm:
        return {"equal": None, "why": "a run failed"}
    diff = [i for i, (a, b) in enumerate(zip(cold["step_hashes"], warm["step_hashes"])) if a != b]
    return {"equal": cold["hash"] == warm["hash"], "prefill_equal": cold["prefill_hash"] == warm["prefill_hash"],
            "first_differing_step": diff[0] if diff else None, "differing_steps": len(diff)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        result = run_child(args)
        Path(args.child_out).write_text(json.dumps(result, indent=1))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "V41GRAPH_COMPILE_CACHE")}
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    results = {"args": {k: v for k, v in vars(args).items() if not k.startswith("child")}, "runs": [],
               "compare": {}}
    for variant in args.variant_list:
        runs = {}
        warms = ["warm"] + [f"warm{i}" for i in range(2, args.warm_runs + 1)]
        for phase in (["cold", "cold2"] if args.control else ["cold"]) + warms:
            # cold2 gets a directory of its own, so warm still loads what cold stored
            cache = Path(args.cache_root or out) / f"cache-{variant}{'-cold2' if phase == 'cold2' else ''}"
            if phase.startswith("cold"):
                shutil.rmtree(cache, ignore_errors=True)      # cold: empty
            before = tool_cache_snapshot(cache)
            child_out = out / f"{variant}-{phase}.json"
            child_out.unlink(missing_ok=True)
            log(f"{variant} {phase}: starting (cache {cache})")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(child_command(args, variant, phase, cache, child_out), env=env,
                                      timeout=args.child_timeout)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            wall = round(time.perf_counter() - t0, 1)
            run = json.loads(child_out.read_text()) if child_out.exists() else {"variant": variant, "phase": phase}
            run.update(rc=rc, process_wall_s=wall, tool_cache_growth=tool_cache_growth(
                cache, before, tool_cache_snapshot(cache)))
            log(f"{variant} {phase}: rc {rc}, {wall} s")
            runs[phase] = run
            results["runs"].append(run)
        results["compare"][variant] = compare(runs["cold"], runs["warm"])
        for phase in warms[1:]:
            results["compare"][f"{variant} {phase}"] = compare(runs["cold"], runs[phase])
        if "cold2" in runs:
            results["compare"][variant + " control"] = compare(runs["cold"], runs["cold2"])
        (out / "bench_compile.json").write_text(json.dumps(results, indent=1))
    # neither layer stamping nor the parallel precompile may change a bit: each variant's cold run
    # against its twin's without them
    colds = {r["variant"]: r for r in results["runs"] if r["phase"] == "cold"}
    for variant in colds:
        for suffix, what in (("-unstamped", "stamped"), ("-serialjit", "precompiled"),
                             ("-latepre", "precompiled before the lowering"),
                             ("-segshere", "segments from workers"),
                             ("-segwhole", "kernels as jobs")):
            if variant + suffix in colds:
                results["compare"][f"{variant} {what}"] = compare(colds[variant + suffix], colds[variant])
    (out / "bench_compile.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0 if all(r.get("rc") == 0 for r in results["runs"]) else 1


def print_table(results: dict) -> None:
    head = ("variant", "phase", "rc", "process s", "to 1st step s", "warmup s", "prefill s", "trace s",
            "first run s", "capture s", "lower s", "precompile s", "pre. wait s", "jit here", "hits", "misses", "segs loaded",
            "segs in workers", "kernel jobs", "triton new")
    rows = []
    for r in results["runs"]:
        t = r.get("timings", {})
        rows.append((r["variant"], r["phase"], r.get("rc"), r.get("process_wall_s"), r.get("to_first_step_s"),
                     r.get("warmup_s"), r.get("prefill_s"), t.get("trace_s"), t.get("first_run_s"),
                     t.get("capture_s"), t.get("lower_s"), t.get("precompile_s"), t.get("precompile_wait_s"),
                     "+".join(str(r.get("triton_jit", {}).get(k, {}).get("compiled")) for k in ("warmup", "prefill")),
                     t.get("cache_hits", 0), t.get("cache_misses", 0),
                     r.get("segments_loaded"), sum(g.get("in_workers", 0) for g in r.get("lowering") or []),
                     sum(g.get("kernel_jobs", 0) for g in r.get("lowering") or []),
                     r.get("tool_cache_growth", {}).get("triton_kernels_new")))
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in (head, *rows):
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    for variant, c in results["compare"].items():
        what = ("cold2 == cold" if variant.endswith(" control") else
                "stamped cold == unstamped cold" if variant.endswith(" stamped") else
                "precompiled cold == serial-JIT cold" if variant.endswith(" precompiled") else
                "cold == cold precompiled at the first run" if variant.endswith(" before the lowering") else
                "cold with segments from workers == segments compiled here" if variant.endswith(" from workers") else
                "cold with kernel jobs == kernels in the segment's job" if variant.endswith(" kernels as jobs") else
                f"{variant.split()[-1]} == cold" if " warm" in variant else "warm == cold")
        print(f"{variant}: {what} bit for bit: {c.get('equal')} (prefill {c.get('prefill_equal')}, "
              f"first differing step {c.get('first_differing_step')}, {c.get('differing_steps')} differ)")


if __name__ == "__main__":
    sys.exit(main())
