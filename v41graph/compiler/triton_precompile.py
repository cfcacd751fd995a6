"""Compile a graph's Triton kernels in worker processes before its first run (issue 24).

A cold start's first run of the decode graph compiled our Triton kernels one after another as
the executor reached them: 44 kernels, 24.5 s of a 70 s cold start on the H200 (and the prefill
another 6 s). They do not depend on each other, so before a graph first runs with new sizes (a
decode bucket, a prefill length) the compiled model

  1. finds every call of a Triton-backed v41graph op in the graph and in its Inductor segments,
     with this call's sizes (the graph's size symbols bound from the arguments);
  2. calls each distinct one on zero-filled stand-in tensors of those sizes, strides, offsets and
     dtypes, with Triton's `jit_cache_hook` noting each kernel specialization it would compile
     and skipping that compile and its launch (every tensor allocated meanwhile is zero-filled,
     so torch code after a skipped kernel reads zeros: valid indices, finite values);
  3. compiles the noted specializations in worker processes into Triton's on-disk cache, where
     the first run finds them.

Nothing here changes what runs or its results: the first run is the same run, a kernel whose
compile the workers did not produce (a stand-in that missed a real call's specialization, e.g.
an unaligned view, or a worker error) is compiled there as before. Only the stand-ins run
(never the graph's tensors), so a skipped kernel cannot corrupt any state.

The workers are the compile workers (compile_workers.py): they start when a CompiledModel is
made on CUDA, so their imports overlap the trace. Triton's environment (TRITON_* variables:
cache directory, ptxas, libdevice) is sent with every job, so a worker's cache key is the first
run's even when the model changed it after the start.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import weakref

import torch
import torch.fx as fx

from v41graph.passes.base import written_args

from .compile_workers import CompileWorkers, compile_env, workers

_log = logging.getLogger(__name__)

# An op call whose stand-ins would take more is not made: its kernels compile at the first run.
# (A written tensor over the limit, a cache, gets a shrunk stand-in: _stand_in.) Stand-ins are
# freed after each call.
STAND_IN_LIMIT_BYTES = 1 << 30
# what a worker calls for a job (compile_workers.py), and what it does at its start: import our
# kernels' modules and initialize Triton's driver (otherwise a worker's first job pays for both)
WORKER_CALL = f"{__name__}:compile_specialization"
WORKER_PRELOAD = ("v41graph.custom_ops.cuda_impls", f"{__name__}:initialize_driver")


def initialize_driver() -> None:
    """Make Triton's active driver now (a worker's start-up): choosing it initializes CUDA's
    driver library (cuInit, no context) and loads Triton's CUDA utilities, which a launcher build
    (_build_launcher) needs. The prefill's kernels went to workers restarted after the Inductor
    segments, and their precompile took 6.2-7.0 s instead of 2.4-4.1 s once launchers were built
    there (twenty-second session)."""
    from triton.runtime import driver
    driver.active     # (made at its first use)
    try:
        from triton.backends.nvidia.driver import library_dirs
        library_dirs()    # (a launcher build's; runs `ldconfig -p` once per process)
    except ImportError:
        pass


def compile_specialization(job: dict) -> dict:
    """Compile one noted specialization (the worker's job) into Triton's on-disk cache: the
    kernel from its module, its specialization as Triton serializes it for a hook
    (signature, constexprs, attributes, options), for the target the job names, and its
    launcher. Uses no GPU. Returns {"launcher": whether it was built, "launcher_s": its seconds}."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    kernel = importlib.import_module(job["module"])
    for part in job["name"].split("."):
        kernel = getattr(kernel, part)
    spec = json.loads(job["spec"])

    def constant(value):
        if isinstance(value, str) and tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(value["constexpr"])
        return value

    def as_tuple(value):   # JSON made the tuples of a signature / options lists
        return tuple(as_tuple(v) for v in value) if isinstance(value, list) else value

    constexprs = {tuple(k): constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: as_tuple(v) for k, v in spec["signature"].items()}
    target = GPUTarget(*job["target"])
    options = make_backend(target).parse_options({k: as_tuple(v) for k, v in spec["options"].items()})
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                              options=options.__dict__)
    t0 = time.perf_counter()
    launcher = _build_launcher(compiled)
    return {"launcher": launcher, "launcher_s": round(time.perf_counter() - t0, 3)}


def _build_launcher(compiled) -> str:
    """Build the kernel's launcher into Triton's cache: a C stub per kernel signature, which
    Triton compiles with the host's C compiler at the kernel's first launch (21 of them, 4-5 s of
    an H100 cold start's first run, profiled). Built here, the launch finds it in the cache.
    Needs the driver's library (no CUDA context). Returns "built", or why not (the first launch
    then builds it, as before)."""
    try:
        from triton.runtime import driver
        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception as exc:
        return f"not built ({type(exc).__name__}: {str(exc)[:120]})"
    return "built"


# ============================================================================ noting kernels
class _Unbound(Exception):
    """A size this call cannot say (a symbol no argument binds, e.g. a data-dependent count)."""


class _Sizes:
    """The graph's size symbols bound to one call's values."""

    def __init__(self, placeholders: list, args):
        self.values: dict = {}
        self._memo: dict = {}
        for node, arg in zip(placeholders, args):
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt) and isinstance(arg, int):
                self._bind(val, arg)
            elif isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor) and val.dim() == arg.dim():
                for s, a in zip((*val.shape, *val.stride()), (*arg.shape, *arg.stride())):
                    if isinstance(s, torch.SymInt):
                        self._bind(s, a)

    def _bind(self, s: torch.SymInt, value: int) -> None:
        import sympy
        expr = s.node.expr
        if isinstance(expr, sympy.Symbol):
            self.values.setdefault(expr, sympy.Integer(int(value)))

    def __call__(self, s) -> int:
        if not isinstance(s, torch.SymInt):
            return int(s)
        expr = s.node.expr
        value = self._memo.get(expr)
        if value is None:
            done = expr.xreplace({k: v for k, v in self.values.items() if k in expr.free_symbols})
            if not done.is_number:
                raise _Unbound(str(expr))
            value = self._memo[expr] = int(done)
        return value


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_(t: torch.Tensor) -> torch.Tensor:
    """Zero a tensor of any dtype (fp8 E8M0 has no zero: its bytes are zeroed instead)."""
    as_int = _INT_OF_SIZE.get(t.element_size())
    (t.view(as_int) if as_int is not None and t.dtype.is_floating_point else t).zero_()
    return t


def _same_class(n: int) -> int:
    """A small size Triton specializes like n (an int argument is specialized on being 1 and
    on being a multiple of 16)."""
    return n if n <= 17 else (16 if n % 16 == 0 else 17)


def _stand_in(val: torch.Tensor, sizes: _Sizes, shrink: bool = False) -> torch.Tensor:
    """A zero-filled tensor with val's sizes, strides, storage offset, dtype and device. With
    `shrink`, the dimension of the largest stride (a cache's block or slot dimension) is cut to
    a small size of the same specialization class: a cache written in place is not copied
    whole (the wrappers take kernel choices from the rows written, not from the cache size)."""
    shape = [sizes(d) for d in val.shape]
    if shrink and shape:
        outer = max(range(len(shape)), key=lambda i: sizes(val.stride()[i]))
        shape[outer] = _same_class(shape[outer])
    stride = [sizes(s) for s in val.stride()]
    offset = sizes(val.storage_offset())
    extent = offset + (1 + sum((d - 1) * s for d, s in zip(shape, stride)) if all(shape) else 0)
    base = torch.zeros(max(extent, 1) * val.element_size(), dtype=torch.uint8, device=val.device)
    return base.view(val.dtype).as_strided(shape, stride, offset)


# Integer tensors that address memory (slot mappings, block tables, row ids): always zero
# stand-ins, never the graph's own. A kernel already compiled in this process does launch on a
# stand-in call, and zeros address row 0 of whatever it reads or writes, also of a shrunk cache.
_INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


class _Call:
    """The arguments one op call gets on the way to noting its kernels: the graph's own input
    where the op only reads a graph input that is not an index tensor (weights, caches, an
    Engram table in host memory: no copy of it is made), a zero-filled stand-in for everything
    else."""

    def __init__(self, node: fx.Node, sizes: _Sizes, inputs: dict, outer: dict):
        self.sizes, self.inputs, self.outer = sizes, inputs, outer
        self.written = set(written_args(node))
        self.bytes = 0

    def _input(self, arg: fx.Node):
        """The graph input an argument is (through Inductor segments' placeholders), or None."""
        while arg in self.outer:
            arg = self.outer[arg]
        return self.inputs.get(arg)

    def value(self, arg):
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.value(a) for a in arg)
        if not isinstance(arg, fx.Node):
            return arg
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            given = self._input(arg) if arg not in self.written and val.dtype not in _INDEX_DTYPES else None
            if isinstance(given, torch.Tensor):
                return given
            shrink = val.element_size() * max(1, _numel(val, self.sizes)) > STAND_IN_LIMIT_BYTES
            stand_in = _stand_in(val, self.sizes, shrink)
            self.bytes += stand_in.untyped_storage().nbytes()
            if self.bytes > STAND_IN_LIMIT_BYTES:
                raise _Unbound(f"stand-ins over {STAND_IN_LIMIT_BYTES >> 20} MiB")
            return stand_in
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            return self.sizes(val)
        if isinstance(val, (bool, float, str)) or val is None:
            return val
        raise _Unbound(f"{arg.name}: {type(val).__name__}")

    def describe(self, arg):
        """What of the argument decides a Triton specialization (the dedup key), unmade."""
        if isinstance(arg, (list, tuple)):
            return tuple(self.describe(a) for a in arg)
        if not isinstance(arg, fx.Node):
            return repr(arg)
        val, sizes = arg.meta.get("val"), self.sizes
        if isinstance(val, torch.Tensor):
            return ("t", tuple(sizes(d) for d in val.shape), tuple(sizes(s) for s in val.stride()),
                    sizes(val.storage_offset()), str(val.dtype), str(val.device))
        if isinstance(val, (torch.SymInt, int)) and not isinstance(val, bool):
            return repr(sizes(val))
        return repr(val)


def positional_args(op: torch._ops.OpOverload, args, kwargs) -> tuple:
    """An op call's arguments in its schema's order, all by position (a graph passes some by
    keyword, e.g. a cache write's `kv=`; the CUDA impls take them by position), defaults
    filled in."""
    out = list(args)
    for arg in op._schema.arguments[len(args):]:
        if arg.name in kwargs:
            out.append(kwargs[arg.name])
        elif arg.has_default_value():
            out.append(arg.default_value)
        else:
            raise TypeError(f"{op._schema.name}: no value for argument {arg.name!r}")
    return tuple(out)


def _numel(val: torch.Tensor, sizes: _Sizes) -> int:
    n = 1
    for d in val.shape:
        n *= sizes(d)
    return n


def _op_calls(gm: fx.GraphModule, impls: dict, outer: dict):
    """(op name, node) of every call of an op in `impls` in gm and its submodules' graphs
    (Inductor segments keep theirs in `graph_module`). `outer` collects, for a submodule's
    placeholders, the node of the calling graph each one is."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = node.target._schema.name
            if name.startswith("v41graph::") and name.split("::", 1)[1] in impls:
                yield name.split("::", 1)[1], node
        elif node.op == "call_module":
            sub = getattr(gm, node.target)
            sub = getattr(sub, "graph_module", sub)
            if isinstance(sub, fx.GraphModule):
                inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
                outer.update((i, a) for i, a in zip(inner, node.args) if isinstance(a, fx.Node))
                yield from _op_calls(sub, impls, outer)


class _ZeroFilledAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Every tensor allocated uninitialized comes out zero-filled."""
    _EMPTY = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in self._empty():
            _zero_(out)
        return out

    @classmethod
    def _empty(cls):
        if cls._EMPTY is None:
            aten = torch.ops.aten
            cls._EMPTY = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
        return cls._EMPTY


def note_specializations(gm: fx.GraphModule, args, impls: dict | None = None) -> tuple[list[dict], dict]:
    """The Triton specializations the first run of gm on `args` would compile (as worker jobs),
    and counts: op calls seen, distinct stand-in calls made, calls skipped (sizes not bound, or
    the stand-in call failed). `impls`: op name -> the function called for it (default: the
    CUDA impls, custom_ops/cuda_impls.py)."""
    try:
        from triton import knobs
    except ImportError:     # nothing to note (the stand-in calls still run: tests on CPU)
        knobs = None
    if impls is None:
        from v41graph.custom_ops.cuda_impls import CUDA_IMPLS as impls
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sizes = _Sizes(placeholders, args)
    inputs = dict(zip(placeholders, args))
    outer: dict = {}
    jobs: dict = {}

    def hook(*, fn, compile, **_):
        module, name = fn.module, fn.name
        if "<locals>" not in name:
            jobs.setdefault(compile["specialization_data"],
                            {"module": module, "name": name, "spec": compile["specialization_data"]})
        return True     # skip this compile (and so the launch): a worker makes it

    skips: list = []
    counts = {"op_calls": 0, "stand_in_calls": 0, "skipped": 0, "skips": skips}
    done: set = set()
    previous = knobs.runtime.jit_cache_hook if knobs is not None else None
    if knobs is not None:
        knobs.runtime.jit_cache_hook = hook
    try:
        with torch.no_grad(), _ZeroFilledAllocations():
            for name, node in _op_calls(gm, impls, outer):
                counts["op_calls"] += 1
                try:
                    call = _Call(node, sizes, inputs, outer)
                    args = positional_args(node.target, node.args, node.kwargs)
                    key = (name, call.describe(args))
                    if key in done:
                        continue
                    done.add(key)
                    impls[name](*call.value(args))
                    counts["stand_in_calls"] += 1
                except Exception as exc:   # that kernel compiles at the first run, as before
                    counts["skipped"] += 1
                    if len(skips) < 8:
                        skips.append(f"{name}: {type(exc).__name__}: {str(exc)[:160]}")
                    _log.debug("Triton precompile: %s at %s skipped (%s: %s)", name, node.name,
                               type(exc).__name__, exc)
    finally:
        if knobs is not None:
            knobs.runtime.jit_cache_hook = previous
    return list(jobs.values()), counts


# ============================================================================ the compiled model's hook
class TritonPrecompile:
    """Called before every run of a compiled graph (TracedGraph.before_run): the first time a
    graph runs with new sizes, its Triton kernels are compiled by the workers first."""

    def __init__(self, pool: CompileWorkers, timings: dict | None = None, impls: dict | None = None):
        self.pool = pool
        self.timings = timings if timings is not None else {}
        self.impls = impls      # note_specializations' (None: the CUDA impls)
        self.reports: list[dict] = []
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # gm -> size keys
        self._size_args: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # gm -> {key: [events]}
        self._lock = threading.Lock()
        self._owners: dict = {}      # a job (kernel + specialization) -> the done event of its batch

    def _quick_key(self, gm: fx.GraphModule, args) -> tuple:
        """The sizes of the arguments that have symbolic ones (cheap: every run asks)."""
        where = self._size_args.get(gm)
        if where is None:
            where = []
            for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
                val = n.meta.get("val")
                if isinstance(val, torch.SymInt):
                    where.append((i, None))
                elif isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in
                                                           (*val.shape, *val.stride())):
                    where.append((i, True))
            self._size_args[gm] = where
        return tuple((args[i].shape, args[i].stride()) if t else args[i] for i, t in where)

    def start(self, gm: fx.GraphModule, args) -> None:
        """Note `gm`'s specializations for `args` now and compile them in the background: the
        compiled model calls this after our passes, before the lowering (Inductor segments,
        ~30 s cold), so the workers compile while this process lowers. The run with these sizes
        waits for them (__call__). The lowering moves only aten nodes into segments, so the op
        calls noted here are the ones that run."""
        key = self._new_sizes(gm, args)
        batch = self._note(gm, args) if key is not None else None
        if batch is None:
            return
        done, others = self._take_jobs(batch[0])
        self._pending.setdefault(gm, {})[key] = [done, *others]
        threading.Thread(target=self._compile, args=(*batch, done), daemon=True,
                         name="v41graph-triton-precompile").start()

    def _take_jobs(self, jobs: list[dict]) -> tuple[threading.Event, set]:
        """Remove from `jobs` (in place) the specializations an earlier batch compiles or
        compiled; the others are this batch's. Returns (this batch's event, set by _compile when
        it is done; the events of the earlier batches still compiling some of the removed ones:
        a run needing them waits for those too). Two buckets of one graph share most kernels:
        noted before either ran (start), each batch would otherwise compile them again (88 jobs
        for 44 kernels, H100)."""
        done, others, mine = threading.Event(), set(), []
        with self._lock:
            for job in jobs:
                owner = self._owners.setdefault(json.dumps(job, sort_keys=True, default=str), done)
                if owner is done:
                    mine.append(job)
                elif not owner.is_set():
                    others.add(owner)
        jobs[:] = mine
        return done, others

    def __call__(self, gm: fx.GraphModule, args) -> None:
        pending = self._pending.get(gm)
        if pending:                     # started before the lowering: wait for its compiles
            events = pending.pop(self._quick_key(gm, args), None)
            if events is not None:
                t0 = time.perf_counter()
                for event in events:
                    event.wait()
                self.timings["precompile_wait_s"] = (self.timings.get("precompile_wait_s", 0.0)
                                                     + time.perf_counter() - t0)
                return
        if self._new_sizes(gm, args) is None:
            return
        batch = self._note(gm, args)
        if batch is not None:
            done, others = self._take_jobs(batch[0])
            for event in others:
                event.wait()
            self._compile(*batch, done)

    def _new_sizes(self, gm: fx.GraphModule, args):
        """The size key of `args` if `gm` has not seen it yet (now it has), else None."""
        key = self._quick_key(gm, args)
        seen = self._seen.setdefault(gm, set())
        if key in seen:
            return None
        seen.add(key)
        return key

    def _note(self, gm: fx.GraphModule, args):
        """(jobs, counts, t0, t1) for the specializations `gm` would compile with `args`, or None."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None     # stand-ins would be captured into the graph; the warm-up ran first anyway
        t0 = time.perf_counter()
        try:
            jobs, counts = note_specializations(gm, args, self.impls)
            target = self._target() if jobs else None
        except Exception as exc:     # never fail the run for this: the first run compiles
            _log.warning("Triton precompile skipped (%s: %s)", type(exc).__name__, exc)
            return None
        env = compile_env()
        for job in jobs:
            job["call"], job["target"], job["env"] = WORKER_CALL, target, env
        return jobs, counts, t0, time.perf_counter()

    def _compile(self, jobs: list[dict], counts: dict, t0: float, t1: float, done: threading.Event) -> None:
        try:
            results = self.pool.compile(jobs)
        finally:     # the batch's kernels are in Triton's cache (or compile at their first run)
            done.set()
        failed = [r.get("error", "") for r in results if not r.get("ok")]
        report = {**counts, "kernels": len(jobs), "failed": len(failed), "note_s": round(t1 - t0, 3),
                  "compile_s": round(time.perf_counter() - t1, 3), "workers": self.pool.n,
                  "worker_s": round(sum(r.get("s", 0.0) for r in results), 3),
                  # the slowest job, and whether it was its worker's first (a fresh worker's
                  # start-up costs fall on its first job)
                  "slowest_job_s": max((r.get("s", 0.0) for r in results), default=0.0),
                  "first_jobs_of_a_worker": sum(r.get("nth") == 1 for r in results),
                  # launchers the workers built (their seconds), and the first reason one was not
                  "launchers": sum(r.get("launcher") == "built" for r in results),
                  "launcher_s": round(sum(r.get("launcher_s", 0.0) for r in results), 3),
                  "launcher_note": next((r["launcher"] for r in results
                                         if r.get("ok") and r.get("launcher") not in (None, "built")), "")}
        with self._lock:     # a background batch (start) may finish while a run adds its own
            self.reports.append(report)
            # seconds noting + compiling, whether or not a run waited for them (precompile_wait_s)
            self.timings["precompile_s"] = self.timings.get("precompile_s", 0.0) + time.perf_counter() - t0
            self.timings["precompiled_kernels"] = (self.timings.get("precompiled_kernels", 0)
                                                   + len(jobs) - len(failed))
        # a failed compile costs only time (the first run compiles that kernel), but say it louder
        _log.log(logging.WARNING if failed else logging.INFO,
                 "Triton precompile: %d kernels on %d workers in %.1f s (noting %.2f s: %d op calls, %d "
                 "stand-in calls, %d skipped; %d failed%s)", len(jobs), self.pool.n, report["compile_s"],
                 report["note_s"], counts["op_calls"], counts["stand_in_calls"], counts["skipped"],
                 len(failed), f": {failed[0]}" if failed else "")

    @staticmethod
    def _target() -> list:
        from triton.runtime import driver
        target = driver.active.get_current_target()
        return [target.backend, target.arch, target.warp_size]


def make_precompile(platform: str, timings: dict | None = None) -> TritonPrecompile | None:
    """The hook for a compiled model on `platform` (CUDA with Triton and workers), else None.
    Starts the workers now, so that their start-up overlaps the trace."""
    if platform != "cuda":
        return None
    try:
        import triton  # noqa: F401
        from triton import knobs  # noqa: F401  (the hook needs Triton >= 3.4's knobs)
    except ImportError:
        return None
    pool = workers(preload=WORKER_PRELOAD)
    return TritonPrecompile(pool, timings) if pool is not None else None

