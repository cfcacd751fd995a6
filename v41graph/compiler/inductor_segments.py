"""Inductor segments (opt-in platform lowering, issue #5): stream-free stretches of the final
graph compiled by Inductor, the rest still run by our executor.

    v41graph.compile(model, ..., inductor_segments=True)

Our executor runs the final graph op by op (one kernel per ATen op). Inductor could fuse the
elementwise chains between the GEMMs and custom ops, but it knows nothing of our stream and
event ops, and a fused kernel must not straddle a stream switch or a cache write. So this step
runs after the pass manager (after the stream check, on the final graph) and cuts the graph into
segments: maximal runs of consecutive nodes that

  - have one stream label (node.meta["stream"]),
  - contain no stream / event op (stream_enter/exit, event_record/wait, mark_stream_use) or
    other side-effecting op,
  - contain no node that writes memory (our cache writes called in place after defunctionalize,
    copy_ into an input, any op whose schema marks an argument as written), nor a node whose
    value shares storage with memory that some node writes (a view of a cache: Inductor may hand
    out a copy where the graph had a view, and a later write would then not be seen through it),
  - are ATen / custom ops (OpOverloads) giving tensors; getitem joins the segment of its
    producer (also one read later, e.g. on the main stream after a join: a getitem launches
    nothing, and only tensors leave a segment). Higher-order ops, SymInt arithmetic and
    placeholders stay outside.

Node order is kept: a segment is a run of neighbouring nodes, so nothing moves across a stream
op or a write, and the stream semantics are unchanged without proving anything about them. Each
segment becomes a submodule called from the outer graph (`segment_<i>`, returning a tuple that
getitem nodes unpack), in the place of its first node. Segments with fewer than
`min_compute_nodes` compute nodes (views and getitems do not count) stay inline. The others are
compiled by Inductor (compile_fx_inner on the segment, decomposed with Inductor's table first,
fake inputs from node.meta["val"]); a segment Inductor refuses stays a plain GraphModule run by
the executor. Our functional custom ops (torch.ops.v41graph.*) inside a segment become Inductor
fallback kernels. Equal segments (the layers repeat a few) compile once; two or more distinct
ones compile in parallel in the compile workers (compile_workers.py), each returning Inductor's
generated module, which this process loads as a warm start loads a stored segment.

CUDA graphs: the compiled code reads the current stream at each call (so a segment inside a
side-stream region runs on that stream), allocates from the caching allocator and introduces no
host sync; Triton autotuning runs on a segment's first call, which is a warm-up step before
capture (DecodeGraph._capture). Inductor's own CUDA graphs are off: we capture the whole step.

Shapes: a graph with symbolic sizes gives segments with symbolic sizes. A segment whose compile
added shape guards (a specialization Inductor wanted) is refused: when set_passes re-lowers a
kept graph, Dynamo's guards are already built and would not check them.
"""
from __future__ import annotations

import contextlib
import logging
import operator
import os
import time
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.fx as fx

from v41graph.custom_ops.streams import STREAM_OPS
from v41graph.passes.base import MAIN_STREAM, STREAM_KEY, returns_alias, writes_memory, written_args

log = logging.getLogger(__name__)

# Segments with fewer compute nodes stay inline in the executor: compiling them costs compile
# time and a Python call for (at best) a kernel or two saved. A first guess, not measured.
MIN_COMPUTE_NODES = 4


@dataclass
class Segment:
    """A run of neighbouring graph nodes on one stream that Inductor may compile."""
    stream: str
    nodes: list = field(default_factory=list)     # in graph order

    def members(self) -> set:
        return set(self.nodes)

    def compute_nodes(self) -> int:
        """Nodes that do work: not getitem, not a view."""
        return sum(1 for n in self.nodes
                   if n.target is not operator.getitem and not getattr(n.target, "is_view", False))

    def inputs(self) -> list:
        """Nodes outside the segment that it reads, in order of first use."""
        members = self.members()
        return list(dict.fromkeys(i for n in self.nodes for i in n.all_input_nodes if i not in members))

    def outputs(self) -> list:
        """Nodes of the segment read outside it (by later nodes or the graph output)."""
        members = self.members()
        return [n for n in self.nodes if any(u not in members for u in n.users)]


# ---------------------------------------------------------------------------- partitioning
def _tensors(val) -> list:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def written_aliases(gm: fx.GraphModule) -> set:
    """Nodes whose value may share memory with a tensor some node of the graph writes: each
    written argument, what it is a view of (back to the placeholder), and every view of those.
    Followed through the graph by the ops' schemas (the fake values in node.meta do not share
    storages reliably across AOT's functionalization)."""
    roots, stack = set(), [arg for node in gm.graph.nodes for arg in written_args(node)]
    while stack:
        node = stack.pop()
        if node not in roots:
            roots.add(node)
            if returns_alias(node):
                stack.extend(node.all_input_nodes)
    family = set()
    for node in gm.graph.nodes:      # graph order: a view comes after what it views
        if node in roots or (returns_alias(node) and any(i in family for i in node.all_input_nodes)):
            family.add(node)
    return family


def is_segment_op(node: fx.Node, written: set) -> bool:
    """May this node (not a getitem) be part of a segment? See the module docstring.
    `written`: the graph's written_aliases."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target in STREAM_OPS or writes_memory(node) or node in written:
        return False
    if node.is_impure():     # any other op registered as side-effecting (torch.fx.node.has_side_effect)
        return False
    vals = _tensors(node.meta.get("val"))
    return bool(vals) and all(isinstance(v, torch.Tensor) for v in vals)


def find_segments(gm: fx.GraphModule) -> list[Segment]:
    """Every maximal run of neighbouring segment nodes on one stream, in graph order (tiny ones
    included)."""
    written = written_aliases(gm)
    segments: list[Segment] = []
    current: Segment | None = None
    members: set = set()
    for node in gm.graph.nodes:
        stream = node.meta.get(STREAM_KEY, MAIN_STREAM)
        if node.op == "call_function" and node.target is operator.getitem:
            joins = node.args[0] in members            # with its producer, or not at all
        else:
            joins = is_segment_op(node, written)
        if not joins:
            current, members = None, set()
            continue
        if current is None or current.stream != stream:
            current, members = Segment(stream), set()
            segments.append(current)
        current.nodes.append(node)
        members.add(node)
    for segment in segments:
        # A multi-output op read after the segment (indexer_topk's indices, read by the main
        # stream after the join): its getitems join the segment, so that only tensors leave
        # it. A getitem launches nothing, so moving it up changes no order of work.
        members = segment.members()
        segment.nodes += [u for n in segment.nodes if not isinstance(n.meta.get("val"), torch.Tensor)
                          for u in n.users if u not in members and u.target is operator.getitem]
    return segments


def _size_symbol_inputs(gm: fx.GraphModule, segment: Segment) -> list:
    """The graph's SymInt placeholders (one size symbol each, e.g. the batch s6) that the
    segment's sizes are made of. Inductor binds a symbol only from an input that is that symbol
    or has it as a whole size or stride; a segment that only sees 8*s6 fails without it."""
    from torch.fx.experimental.symbolic_shapes import free_symbols
    used = set()
    for n in segment.nodes + segment.inputs():
        if n.meta.get("val") is not None:
            used |= set(free_symbols(n.meta["val"]))
    by_symbol = {}      # the first placeholder of each symbol
    for n in gm.graph.nodes:
        if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt):
            by_symbol.setdefault(n.meta["val"].node.expr, n)
    return [n for symbol, n in by_symbol.items() if symbol in used]


def extract_segment(gm: fx.GraphModule, segment: Segment, name: str) -> fx.GraphModule:
    """Move `segment`'s nodes into a submodule `name` of gm (returning its outputs as a tuple)
    called in their place. Returns the submodule. Node names inside are generated from the
    ops (in_0, mm, mm_1, ...), so equal segments of different layers give equal code and are
    compiled once (segment_key).
    Not torch.fx.passes.split_module.split_module: it puts every node of the graph into some
    partition (we keep everything outside the segments inline, in our executor) and keeps the
    original node names inside each partition, so equal segments of different layers would
    not give equal code and each would be compiled again."""
    inputs, outputs, members = segment.inputs(), segment.outputs(), segment.members()
    if not all(isinstance(o.meta.get("val"), torch.Tensor) for o in outputs):
        raise ValueError(f"segment at {segment.nodes[0].name}: an output is not a tensor")
    inputs += [n for n in _size_symbol_inputs(gm, segment) if n not in inputs]
    graph = fx.Graph()
    env: dict = {}
    for i, n in enumerate(inputs):
        env[n] = graph.placeholder(f"in_{i}")
        env[n].meta = dict(n.meta)
    for n in segment.nodes:
        env[n] = graph.create_node(n.op, n.target, fx.map_arg(n.args, env.__getitem__),
                                   fx.map_arg(n.kwargs, env.__getitem__))
        env[n].meta = dict(n.meta)
    graph.output(tuple(env[o] for o in outputs))
    sub = fx.GraphModule(torch.nn.Module(), graph)
    gm.add_submodule(name, sub)

    outer = gm.graph
    with outer.inserting_before(segment.nodes[0]):
        call = outer.call_module(name, tuple(inputs))
        call.meta[STREAM_KEY] = segment.stream
        for i, o in enumerate(outputs):
            out = outer.create_node("call_function", operator.getitem, (call, i), name=f"{name}_out{i}")
            out.meta = {"val": o.meta.get("val"), STREAM_KEY: segment.stream}
            o.replace_all_uses_with(out, delete_user_cb=lambda user: user not in members)
    for n in reversed(segment.nodes):
        outer.erase_node(n)
    return sub


# ---------------------------------------------------------------------------- Inductor
class InductorSegment(torch.nn.Module):
    """A segment compiled by Inductor. `graph_module` is the segment before compiling."""

    def __init__(self, compiled, graph_module: fx.GraphModule):
        super().__init__()
        self.compiled = compiled
        self.graph_module = graph_module

    def forward(self, *args):
        return self.compiled(list(args))      # Inductor's calling convention: one list


def _shape_env_state(fake_mode):
    env = getattr(fake_mode, "shape_env", None)
    return None if env is None else (len(env.guards), len(env.replacements))


# compile_segment's Inductor settings (also in force when pin_inductor_triton_env asks Inductor
# which Triton environment they imply)
INDUCTOR_SETTINGS = {
    "triton.cudagraphs": False,          # we capture the whole step ourselves
    # Round where eager rounds (bf16 intermediates): the model's fake quantization turns a
    # last-bit difference into another FP8/FP4 code (see compiler.DECOMPOSITIONS).
    "emulate_precision_casts": True,
    # Inductor's FX graph cache could not pickle the key of any segment on torch 2.11 (25 of 25
    # in an H200 cold start, a logged traceback each; pytorch/pytorch#164682): the compile
    # cache's segment store keeps them by our own key instead.
    "fx_graph_cache": False,
}


def pin_inductor_triton_env() -> dict:
    """Set now what Inductor puts into the environment when it first compiles a kernel:
    TRITON_PTXAS_PATH (torch's own ptxas, where the wheel has one) and, under
    emulate_precision_casts, TRITON_LIBDEVICE_PATH (the CUDA toolkit's libdevice). Both are part
    of Triton's cache key of every kernel compiled after them, ours too. A cold start set them
    when Inductor compiled its first segment; a warm start, whose segments come from the compile
    cache, never did, so our kernels got other keys and the first warm start compiled them all
    again (57 Triton kernels: 39.9 s to the first captured step instead of 9.2 s on the H200).
    Set before anything compiles, the keys are the same on both starts. Called where segments
    come into a process: CompiledModel (a warm start loads its segments from the compile cache
    without lowering) and lower_inductor_segments (segments switched on later, set_passes).
    Returns the variables set (private Inductor helpers, looked up by name: a torch without
    them sets nothing)."""
    from torch._inductor import config as inductor_config
    try:
        from torch._inductor.runtime import compile_tasks
    except ImportError:
        return {}
    before = dict(os.environ)
    with inductor_config.patch(INDUCTOR_SETTINGS):
        for helper in ("_set_triton_ptxas_path", "_set_triton_libdevice_path"):
            if callable(getattr(compile_tasks, helper, None)):
                getattr(compile_tasks, helper)()
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def start_inductor_compile_workers() -> bool:
    """Start Inductor's pool of Triton-compile workers now. Inductor sends a kernel to its pool
    only once the pool has answered a first job; until then it compiles in this process, one
    kernel after another. Started at the first segment's first kernel (as Inductor does by
    itself), the pool is not ready for the first segments; started with the compiled model, its
    workers start up while Dynamo traces. Private Inductor API, looked up by name: False
    (nothing started) where it is missing or the pool is off (compile_threads 1)."""
    try:
        from torch._inductor.async_compile import AsyncCompile
        AsyncCompile.warm_pool()
        AsyncCompile.use_process_pool()     # submits the readiness job: the workers start
        return True
    except Exception as exc:     # another torch: Inductor starts its pool itself, later
        log.info("Inductor's compile workers not started early (%s: %s)", type(exc).__name__, exc)
        return False


@contextlib.contextmanager
def _logger_off(name: str):
    """The logger `name` silent inside the block."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def compile_segment(sub: fx.GraphModule):
    """Inductor's compiled callable for a segment GraphModule. Raises when Inductor refuses it."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    example_inputs = [n.meta["val"] for n in sub.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        raise ValueError("segment inputs carry no fake values (node.meta['val'])")
    before = _shape_env_state(fake_mode)
    # A fresh tracing context: Inductor records things (output strides...) in the current one,
    # which inside our backend is the whole graph's. Fake-tensor propagation logs the exception of
    # a segment Inductor refuses (e.g. a size it needs from the unbacked batch size) with a
    # 40-line traceback at ERROR before raising it (seen in every H200 cold start); the refusal
    # is ours to report, one line in the segment summary, so that logger is off meanwhile.
    with tracing(TracingContext(fake_mode)), inductor_config.patch(INDUCTOR_SETTINGS), \
            _logger_off("torch._subclasses.fake_tensor"):
        # Our graph keeps ops that Inductor expects decomposed (silu, clamp, _to_copy, t...):
        # re-trace the segment through Inductor's decomposition table first.
        decomposed = make_fx(sub, decomposition_table=select_decomp_table(),
                             tracing_mode="symbolic")(*example_inputs)
        compiled = compile_fx_inner(decomposed, example_inputs, is_inference=True)
    if _shape_env_state(fake_mode) != before:
        raise ValueError("Inductor added shape guards (a specialization) that nothing would check")
    return compiled


def _refusal(exc: Exception) -> str:
    """Inductor's refusal of a segment, one line (the segment report lists them)."""
    first_line = (str(exc).splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {first_line}"


def generated_code(compiled):
    """(source, inputs_to_check) of a compiled segment: Inductor's generated Python module (its
    Triton / C++ kernels inside as source) and the inputs whose alignment its wrapper checks;
    None when the output has no source or carries constants (it cannot be loaded from source)."""
    source = getattr(compiled, "source_code", None)
    if not isinstance(source, str) or getattr(compiled, "constants", None):
        return None
    return source, [int(i) for i in getattr(compiled, "inputs_to_check", ())]


def load_generated_code(source: str, inputs_to_check):
    """The callable of a segment from its generated code (a compile-cache load, a worker's
    compile): Inductor's module loaded through its own code cache (kernels compiled at load,
    from Triton's / Inductor's caches where they are there)."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import copy_misaligned_inputs
    call = PyCodeCache.load(source).call
    check = list(inputs_to_check)

    def run(args):
        if check:   # what Inductor's wrapper does: copy inputs that are not aligned as compiled for
            copy_misaligned_inputs(args, check)
        return call(args)
    return run


# ---------------------------------------------------------------------------- in worker processes
# A cold start's distinct segments compile in the compile workers (compile_workers.py), in
# parallel: Inductor's lowering and code generation are Python, one segment after another took
# 30-38 s of an H100 cold start. A job carries the segment and its fake inputs pickled by torch's
# GraphPickler (which keeps symbolic sizes with the ShapeEnv they come from); the worker returns
# the generated code, which this process loads as a warm start loads a stored segment.
# The generated code's Triton kernels are compiled as jobs of their own: a worker compiling its
# segment's kernels one after another made the largest segments (80-153 nodes, 11-12 s each on
# an H200) the lowering's critical path while other workers had nothing left to do.
WORKER_CALL = f"{__name__}:compile_segment_job"
KERNEL_CALL = f"{__name__}:compile_triton_kernel_job"
WORKER_PRELOAD = (__name__, "torch._inductor.compile_fx")   # imported by the workers at start
# "1" (default): segments in the workers, their Triton kernels as jobs of their own; "whole": a
# worker compiles its segment's kernels itself (the route before, for comparing); "0": every
# segment compiles in this process, one after another
SEGMENT_WORKERS_VAR = "V41GRAPH_SEGMENT_WORKERS"
SEGMENT_WORKER_MODES = ("0", "1", "whole")


def segment_workers_mode() -> str:
    """$V41GRAPH_SEGMENT_WORKERS (default "1"), checked: one of SEGMENT_WORKER_MODES."""
    value = os.environ.get(SEGMENT_WORKERS_VAR, "1").strip()
    if value not in SEGMENT_WORKER_MODES:
        raise ValueError(f"${SEGMENT_WORKERS_VAR} must be 0 (segments compile in this process), 1 (in the "
                         f"compile workers, their Triton kernels as jobs of their own) or whole (a worker "
                         f"compiles its segment's kernels itself), got {value!r}")
    return value


def segment_workers_on() -> bool:
    """Whether distinct segments go to the compile workers ($V41GRAPH_SEGMENT_WORKERS not 0)."""
    return segment_workers_mode() != "0"


def segment_job(sub: fx.GraphModule, kernels_apart: bool = False) -> dict | None:
    """The compile-worker job for a segment, or None (logged) where it cannot be pickled.
    `kernels_apart`: the worker returns the generated code's Triton kernels uncompiled, for
    jobs of their own (triton_kernel_job)."""
    import base64

    from torch._inductor import config as inductor_config
    from torch.fx._graph_pickler import GraphPickler, Options

    from .compile_workers import compile_env
    example_inputs = [n.meta["val"] for n in sub.graph.nodes if n.op == "placeholder"]
    # what else the generated code depends on: Inductor's settings as this process has them, and
    # its thread count (the CPU code parallelizes a loop only for more than one thread)
    settings = inductor_config.save_config_portable() if hasattr(inductor_config, "save_config_portable") else {}
    try:    # ops_filter None: our own ops too (a worker imports v41graph, which registers them)
        data = GraphPickler.dumps((sub, example_inputs, settings, torch.get_num_threads()),
                                  Options(ops_filter=None))
    except Exception as exc:
        log.info("inductor segment not sent to a worker (%s: %s)", type(exc).__name__, str(exc)[:200])
        return None
    return {"call": WORKER_CALL, "segment": base64.b64encode(data).decode("ascii"), "env": compile_env(),
            "kernels_apart": kernels_apart}


def triton_kernel_job(kernel: dict) -> dict:
    """The compile-worker job for one of a generated module's Triton kernels ({"name", "source"}
    as compile_segment_job noted it)."""
    from .compile_workers import compile_env
    return {"call": KERNEL_CALL, "name": kernel["name"], "source": kernel["source"], "env": compile_env()}


@contextlib.contextmanager
def _kernels_to_cache_only():
    """Inside: Inductor's Triton kernels compile into Triton's cache without being loaded onto
    the GPU (CachingAutotuner.precompile(warm_cache_only=True), as in Inductor's own compile
    workers): a worker never runs them, the process that does loads them from the cache. (A
    worker still gets a CUDA context from Inductor's code generation, 520 MiB on an H100,
    measured: see _compile_in_workers.) A torch without that method: no change."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
        original = CachingAutotuner.precompile
    except (ImportError, AttributeError):
        yield
        return

    def cache_only(self, *args, **kwargs):
        return original(self, warm_cache_only=True)
    with mock.patch.object(CachingAutotuner, "precompile", cache_only):
        yield


class _CompiledElsewhere:
    """Stands for a Triton kernel in a worker's generated module whose compile is a job of its
    own: the worker never runs the module, it only returns its source."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):     # AttributeError: hasattr() answers False
        raise AttributeError(f"Triton kernel {self.name} is compiled by a job of its own, not in this worker")


@contextlib.contextmanager
def _kernels_noted(kernels: list):
    """Inside: Inductor's Triton kernels are not compiled but noted in `kernels` ({"name",
    "source"}, what AsyncCompile.triton was given). Private Inductor API, looked up by name: a
    torch without it compiles them as before (nothing noted)."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        AsyncCompile = None
    if getattr(AsyncCompile, "triton", None) is None:
        yield
        return

    def note(self, kernel_name, source_code, *args, **kwargs):
        kernels.append({"name": kernel_name, "source": source_code})
        return _CompiledElsewhere(kernel_name)
    with mock.patch.object(AsyncCompile, "triton", note):
        yield


def compile_segment_job(job: dict) -> dict:
    """(In a worker.) Compile a segment_job: {"source", "inputs_to_check", "kernels"}
    (generated_code; "kernels" the Triton kernels left uncompiled, with job["kernels_apart"]),
    or {"refused": why} where Inductor refused it. Raises where the output cannot travel."""
    import base64

    from torch._inductor import config as inductor_config
    from torch._subclasses import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    pickled, _, settings, threads = GraphPickler.loads(base64.b64decode(job["segment"]),
                                                       FakeTensorMode(shape_env=ShapeEnv()))
    # unpickled as a bare GraphModule without forward (its class is made per instance): remake it
    sub = fx.GraphModule(torch.nn.Module(), pickled.graph)
    torch.set_num_threads(threads)
    # one worker of many: its kernels compile in this process, not in a pool of its own, and only
    # into Triton's on-disk cache (the process that runs the segment loads them from there); or,
    # kernels apart, not here at all
    kernels: list = []
    kernel_route = _kernels_noted(kernels) if job.get("kernels_apart") else _kernels_to_cache_only()
    with inductor_config.patch(settings), inductor_config.patch(compile_threads=1), kernel_route:
        try:
            compiled = compile_segment(sub)
        except Exception as exc:
            return {"refused": _refusal(exc)}
    generated = generated_code(compiled)
    if generated is None:
        raise ValueError("Inductor's output has no generated source, or has constants")
    return {"source": generated[0], "inputs_to_check": generated[1], "kernels": kernels,
            "cuda": torch.cuda.is_available() and torch.cuda.is_initialized()}


def compile_triton_kernel_job(job: dict) -> dict:
    """(In a worker.) Compile a triton_kernel_job into Triton's on-disk cache, as Inductor's own
    compile workers do (every config of the kernel; the process that runs it loads it from there)."""
    from torch._inductor.codecache import PyCodeCache
    kernel = getattr(PyCodeCache.load(job["source"]), job["name"])
    kernel.precompile(warm_cache_only=True)
    return {}


def _compile_in_workers(segments: dict, report: dict):
    """Yield (segment key, a worker's reply) as the compile workers finish them (with their
    Triton kernels, see above), for the `segments` ({key: (name, compute nodes, GraphModule)})
    they compiled or refused; the others (no workers, not picklable, a worker's error) are left
    to this process. A kernel job that fails is only logged: loading the code compiles it here.
    Counts the distinct kernel jobs in report["kernel_jobs"], failed ones in "kernel_jobs_failed"
    (per segment)."""
    from .compile_workers import workers
    pool = workers(preload=WORKER_PRELOAD)
    if pool is None:
        return
    kernels_apart = segment_workers_mode() == "1"
    # the largest first: the lowering waits for the slowest job, which should not start last
    order = sorted(segments, key=lambda key: -segments[key][1])
    jobs = {key: job for key, job in ((key, segment_job(segments[key][2], kernels_apart)) for key in order)
            if job is not None}
    kernels_seen: set = set()

    def kernel_jobs(reply: dict) -> dict:
        """A segment's kernels, by source (equal kernels of two segments compile once); submitted
        before the segments still queued, so that a segment loads here while the workers go on."""
        asked = {k["source"]: triton_kernel_job(k) for k in reply.get("kernels", ())}
        kernels_seen.update(asked)
        report["kernel_jobs"] = len(kernels_seen)
        return asked

    initialized_cuda = False
    for key, reply, kernel_replies in pool.as_done_with_follow_ups(jobs, kernel_jobs):
        initialized_cuda |= bool(reply.get("cuda"))
        if not reply.get("ok"):
            log.info("inductor segment: a worker failed (%s); compiling it here", reply.get("error"))
            continue
        for failed in (r for r in kernel_replies if not r.get("ok")):
            report["kernel_jobs_failed"] += 1
            log.info("inductor segment kernel: a worker failed (%s); it compiles here", failed.get("error"))
        # the segment's compile time: its code generation and its kernels (one shared by two
        # segments counts in both)
        reply["s"] = reply.get("s", 0.0) + sum(r.get("s", 0.0) for r in kernel_replies)
        yield key, reply
    if initialized_cuda:
        # Inductor's code generation for CUDA left a CUDA context in each worker (520 MiB on an
        # H100, sixteen workers 8.3 GB next to the model, measured): fresh workers replace them.
        # They import our kernels' modules, not Inductor: this graph's segments are done, and
        # a later size's or graph's Triton kernels are what they compile next.
        from .triton_precompile import WORKER_PRELOAD as KERNEL_MODULES
        pool.restart(preload=KERNEL_MODULES)


def segment_key(sub: fx.GraphModule) -> tuple:
    """Segments with equal keys compute the same function of their inputs: the same code (node
    names are generated from the ops, see extract_segment) and inputs of the same size, stride,
    dtype and device (symbolic sizes by their expressions, which name the graph's symbols)."""
    def meta(n):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            return ("tensor", str(tuple(v.shape)), str(v.stride()), str(v.dtype), str(v.device))
        return ("value", str(v))
    return (sub.code, tuple(meta(n) for n in sub.graph.nodes if n.op == "placeholder"))


def lower_inductor_segments(gm: fx.GraphModule, min_compute_nodes: int = MIN_COMPUTE_NODES,
                            compile_segments: bool = True, store=None) -> dict:
    """Split gm (in place) into segments and, with `compile_segments`, compile each with Inductor
    (two or more distinct ones in the compile workers, in parallel). Returns the summary also
    kept in gm.meta["inductor_segments"] and logged: segments found, split out, compiled (how
    many distinct, how many of those in workers, with how many Triton kernel jobs), left to the
    executor (too small / refused, with Inductor's reasons), compute nodes compiled, seconds
    (splitting + compiling).
    compile_segments=False only splits: the segments run as plain GraphModules (the same ops,
    for testing the split).
    `store` (compile_cache.SegmentStore): compiled segments are looked up there by their
    segment_key first ("loaded") and kept there once compiled ("stored"), across processes."""
    t0 = time.perf_counter()
    if compile_segments:
        pin_inductor_triton_env()     # before any kernel compiles, loaded or compiled segments alike
    segments = find_segments(gm)
    large = [s for s in segments if s.compute_nodes() >= min_compute_nodes]
    report = {"found": len(segments), "split": len(large), "compiled": 0, "distinct_compiled": 0,
              "too_small": len(segments) - len(large), "refused": 0, "refusals": [],
              "nodes_compiled": 0, "compile_s": 0.0, "loaded": 0, "stored": 0, "in_workers": 0,
              "kernel_jobs": 0, "kernel_jobs_failed": 0}
    subs = []
    for i, segment in enumerate(large):
        subs.append((f"segment_{i}", segment.compute_nodes(), extract_segment(gm, segment, f"segment_{i}")))
    gm.graph.lint()
    if compile_segments:
        # The 40 layers repeat a few segment shapes; compile each distinct one once. (Inductor's
        # own FX graph cache would do this, but on torch 2.11 with symbolic sizes it could not
        # pickle the cache key on the H200 and compiled every segment again, ~2 s each.)
        distinct: dict = {}    # segment key -> (name, compute nodes, sub) of its first segment
        for name, n_compute, sub in subs:
            distinct.setdefault(segment_key(sub), (name, n_compute, sub))
        done: dict = {}        # segment key -> compiled callable, or the refusal text
        digests: dict = {}     # segment key -> its digest in `store`
        for key in distinct:
            digests[key] = store.digest(key) if store is not None else None
            kept = store.load(digests[key]) if store is not None else None
            if kept is not None:
                done[key] = kept.compiled
                report["loaded"] += 1
        seconds: list = []     # (seconds, name, compute nodes) of each compile, here or in a worker

        def finish(key, reply: dict | None) -> None:
            """Take a worker's reply for segment `key` (its code loaded here), or with none (or
            one that does not load) compile it here; keep it in `store`."""
            name, n_compute, sub = distinct[key]
            t_compile, generated = time.perf_counter(), None
            if reply is not None and "refused" in reply:
                done[key] = reply["refused"]
            elif reply is not None:
                generated = (reply["source"], reply["inputs_to_check"])
                try:
                    done[key] = load_generated_code(*generated)
                    report["in_workers"] += 1
                except Exception as exc:
                    log.info("inductor segment %s: a worker's code did not load (%s); compiling it here",
                             name, _refusal(exc))
                    reply = None
            if reply is None:
                try:
                    done[key] = compile_segment(sub)
                    generated = generated_code(done[key])
                except Exception as exc:   # Inductor refused: the executor runs the segment
                    done[key] = _refusal(exc)
            if not isinstance(done[key], str):
                report["distinct_compiled"] += 1
                if store is not None and store.store(digests[key], generated):
                    report["stored"] += 1
            refused = " refused" if isinstance(done[key], str) else ""
            took = reply["s"] if reply is not None else time.perf_counter() - t_compile
            seconds.append((round(took, 2), name + refused, n_compute))

        todo = [key for key in distinct if key not in done]
        if len(todo) >= 2 and segment_workers_on():
            # in the compile workers, in parallel, each loaded here as soon as it is back
            for key, reply in _compile_in_workers({key: distinct[key] for key in todo}, report):
                finish(key, reply)
        for key in todo:        # one alone, or what the workers left
            if key not in done:
                finish(key, None)
        for name, n_compute, sub in subs:
            key = segment_key(sub)
            compiled = done[key]
            if isinstance(compiled, str):
                report["refused"] += 1
                report["refusals"].append(f"{name}: {compiled}")
                log.info("inductor segment %s refused: %s", name, compiled)
                continue
            segment = InductorSegment(compiled, sub)
            if store is not None and store.has(digests[key]):   # the compile cache names it by this
                segment.artifact_digest = digests[key]
            setattr(gm, name, segment)
            report["compiled"] += 1
            report["nodes_compiled"] += n_compute
        # where the lowering's time goes: the slowest compiles (refused ones too), with their sizes
        report["slowest"] = [f"{name} ({nodes} nodes): {s} s"
                             for s, name, nodes in sorted(seconds, reverse=True)[:5]]
        # compile seconds summed (in workers these overlap: compile_s is the wall time)
        report["compiling_s"] = round(sum(s for s, _, _ in seconds), 2)
    gm.recompile()
    report["left"] = report["found"] - report["compiled"]
    report["compile_s"] = round(time.perf_counter() - t0, 3)
    gm.meta["inductor_segments"] = report
    log.info("inductor segments: %d found, %d compiled (%d distinct, %d of them in compile workers, %d "
             "compute nodes; %d loaded from the compile cache), %d left (%d below %d compute nodes, %d "
             "refused), %.1f s", report["found"], report["compiled"], report["distinct_compiled"],
             report["in_workers"], report["nodes_compiled"], report["loaded"], report["left"],
             report["too_small"], min_compute_nodes, report["refused"], report["compile_s"])
    return report
