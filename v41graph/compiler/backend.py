"""The v41graph torch.compile backend.

    torch.compile(model, backend="v41graph")        # registered; v41graph.compile builds on it
    torch.compile(model, backend="v41graph", options={"disable": ["P6"], "dump_dir": "dumps/"})

The name resolves without `import v41graph`: the package declares it as a
`torch_dynamo_backends` entry point (pyproject.toml), which torch loads on first lookup.
`options` (see BACKEND_OPTIONS): passes, disable, dump_dir (default $V41GRAPH_DUMP),
platform, inductor_segments. `mode`: "default" only; the others ask for Inductor's autotuning
or CUDA graphs, which this backend does not do on its own (see `check_mode`).

Flow (DESIGN.md): Dynamo graph -> aot_autograd(DECOMPOSITIONS,
keep_inference_input_mutations=True) -> our pass manager (cleanup, P1, defunctionalize, P4,
P6, P8 (collective issue/wait overlap; graphs of parallel ranks only), stream check) -> platform lowering (opt-in: Inductor segments) -> our executor (the FX
graph's own forward; stream ops are real on CUDA, no-ops on CPU). The compiled model and its
static capture of decode steps per batch bucket (CUDA graphs on NVIDIA; ACL graphs through
torchair on Ascend) are in compiled_model.py.
"""
from __future__ import annotations

import logging
import os
import time

import torch
from torch._dynamo.backends.common import aot_autograd

from v41graph.passes.pass_manager import PassManager

_log = logging.getLogger(__name__)

BACKENDS = ("auto", "cuda", "npu", "cpu")

# No decomposition table (DESIGN.md suggested Inductor's select_decomp_table). That table splits
# ops such as silu, softplus, clamp and dtype casts into several primitives so that Inductor can
# fuse them; our executor runs the graph op by op, so for us it meant more kernels per step
# and results a last bit away from eager, which the model's fake quantization can turn into a
# different FP4/FP8 code (seen on CPU: a 0.25 logit difference on one of ten prompts). Without
# it the CPU graph is bit-identical to eager on those prompts and ~7 % smaller. Ops that
# are CompositeImplicit (linear, rms_norm, ...) are still decomposed while tracing.
DECOMPOSITIONS: dict = {}


class TracedGraph:
    """One graph as AOT autograd handed it over (before our passes), and the passed copy that
    runs. Keeping the untouched graph lets the pass list change without tracing again:
    tracing (Dynamo + AOT) is ~90 % of compile time, our passes a few seconds."""

    def __init__(self, gm: torch.fx.GraphModule, before_run=None):
        self.untouched = copy_graph_module(gm)
        self.current = gm
        # before_run(gm, args), if given, sees every call first (triton_precompile.TritonPrecompile)
        self.before_run = before_run

    def __call__(self, *args):
        if self.before_run is not None:
            self.before_run(self.current, args)
        return self.current.forward(*args)

    def repass(self, manager: PassManager, lower=None) -> None:
        gm = copy_graph_module(self.untouched)
        manager(gm)
        if lower is not None:
            lower(gm)
        self.current = gm


def copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy with its own nodes (node.meta copied shallowly, so fake values are shared),
    recompiling lazily when gm does (graph_module_like)."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph_module_like(gm, graph)


def graph_module_like(root: torch.fx.GraphModule, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule of `graph` (attributes from `root`), lazily recompiling when `root` does:
    AOT hands over torch.fx's _LazyGraphModule, whose recompile() after each pass only marks
    the forward stale; a plain GraphModule generates its 10 000-line forward again each time
    (3-4 s of our passes on a 40-layer graph). Private in torch: a plain one where it is gone."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:
        return torch.fx.GraphModule(root, graph)
    cls = _LazyGraphModule if isinstance(root, _LazyGraphModule) else torch.fx.GraphModule
    return cls(root, graph)


def make_backend(passes=None, disable=(), dump_dir=None, platform: str = "cpu", traced=None,
                 lower=None, on_compiled=None, recorder=None, before_run=None):
    """A torch.compile backend running our pass manager; returns (backend, pass_manager).
    `traced`, a list, collects a TracedGraph per compiled graph (CompiledModel.set_passes).
    `lower(gm)`, if given, is the platform lowering run on each final graph after the passes
    (Inductor segments, compiler/inductor_segments.py). `on_compiled(passes_s, lower_s)`, if
    given, is called when a graph is ready to run, with the seconds our passes and the lowering
    took on it. `recorder` (the persistent compile cache, compiler/compile_cache.py) sees the
    Dynamo graph (`dynamo_graph(gm)`), the post-AOT graph (`aot_graph(gm)`) and the final one
    (`graph_ready(gm, fn)`, which may wrap the callable to see its first call). `before_run`:
    TracedGraph's hook (with `traced` only)."""
    from functorch.compile import make_boxed_func

    manager = PassManager(passes, disable, dump_dir)
    if platform == "npu":   # torchair compiles and captures; our passes run as its post-grad pass
        from .npu import torchair_backend
        return torchair_backend(manager), manager

    def fw_compiler(gm, example_inputs):
        if recorder is not None and recorder.stamping:
            # a trace of the layers the compiler stamps (compiler/stamp.py): the graph is all
            # it wants; the call that traced it must not run it (it is not the whole model)
            recorder.aot_graph(gm, keep=True)
            return make_boxed_func(_graph_captured)
        graph = TracedGraph(gm, before_run) if traced is not None else None
        if recorder is not None:
            recorder.aot_graph(gm)
        t0 = time.perf_counter()
        manager(gm)
        t1 = time.perf_counter()
        if lower is not None:
            lower(gm)
        if on_compiled is not None:
            on_compiled(t1 - t0, time.perf_counter() - t1)
        fn = gm.forward if graph is None else graph
        if graph is not None:
            traced.append(graph)
        if recorder is not None:
            fn = recorder.graph_ready(gm, fn)
        return make_boxed_func(fn)

    backend = aot_autograd(fw_compiler=fw_compiler, decompositions=DECOMPOSITIONS,
                           keep_inference_input_mutations=True)
    if recorder is None:
        return backend, manager

    def recording_backend(gm, example_inputs):
        recorder.dynamo_graph(gm)
        return backend(gm, example_inputs)
    return recording_backend, manager


class GraphCaptured(Exception):
    """Raised by the function compiled for a stamping trace when Dynamo calls it: the graph
    was all that call was for (CachedFunction catches it)."""


def _graph_captured(*args):
    raise GraphCaptured()


# torch.compile(backend="v41graph", options={...}): the keys make_backend takes from a user.
BACKEND_OPTIONS = ("passes", "disable", "dump_dir", "platform", "inductor_segments")
BACKEND_NAME = "v41graph"


def check_mode(mode: str | None) -> None:
    """torch.compile's `mode` for this backend. "reduce-overhead" means CUDA graphs: a graph
    of V41Model writes its caches in place, which torch's CUDA-graph trees refuse, so the capture
    lives in v41graph.compile (persistent buffers per decode bucket); the max-autotune modes are
    Inductor's autotuning, which this backend does not run."""
    if mode in (None, "default"):
        return
    if mode == "reduce-overhead":
        raise ValueError('torch.compile(backend="v41graph", mode="reduce-overhead"): CUDA-graph capture '
                         "of a V41Model runs through v41graph.compile(model, capture=True) (decode buckets "
                         "over persistent buffers); with torch.compile, leave mode unset")
    if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
        raise ValueError(f'torch.compile(backend="v41graph", mode={mode!r}): autotuning is Inductor\'s; '
                         "this backend lowers through our executor (opt in to Inductor for stream-free "
                         "segments with options={\"inductor_segments\": True}); leave mode unset")
    raise ValueError(f'torch.compile(backend="v41graph"): unknown mode {mode!r}; use "default" (or leave it unset)')


def v41graph_backend(gm, example_inputs, mode: str | None = None, options: dict | None = None):
    """The backend torch.compile(backend="v41graph", mode=..., options=...) calls for each graph
    Dynamo captures. Each graph is dumped under the next number of its dump directory in this
    process (a graph break or recompile never overwrites graph0)."""
    check_mode(mode)
    options = dict(options or {})
    unknown = sorted(set(options) - set(BACKEND_OPTIONS))
    if unknown:
        raise ValueError(f'torch.compile(backend="v41graph"): unknown option(s) {", ".join(map(repr, unknown))}; '
                         f"options are {', '.join(BACKEND_OPTIONS)}")
    inductor_segments = bool(options.pop("inductor_segments", False))
    options.setdefault("dump_dir", os.environ.get("V41GRAPH_DUMP") or None)
    if inductor_segments:
        from .inductor_segments import lower_inductor_segments
        options["lower"] = lower_inductor_segments
    backend, manager = make_backend(**options)
    if manager.dump_dir is not None:
        from .dump import next_graph_index
        manager.graph_index = next_graph_index(manager.dump_dir)
    return backend(gm, example_inputs)


def _register() -> None:
    """Register the backend name at import. When torch is resolving the name through our entry
    point right now (it imports this module, then registers what the entry point names), leave
    the registering to torch: a second registration of one name is an error there."""
    try:
        from torch._dynamo.backends import registry
        found_by_entry_point = (registry._BACKENDS.get(BACKEND_NAME) is not None
                                and BACKEND_NAME not in registry._COMPILER_FNS)
        if BACKEND_NAME in registry._COMPILER_FNS or found_by_entry_point:
            return
    except (ImportError, AttributeError):   # a torch without these private names
        pass
    torch._dynamo.register_backend(name=BACKEND_NAME)(v41graph_backend)


_register()


def resolve_platform(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return {"cuda": "cuda", "npu": "npu"}.get(device.type, "cpu")
    if backend == "npu":
        from .npu import require_torch_npu
        require_torch_npu()
    if backend != "cpu" and device.type != backend:
        raise ValueError(f"backend {backend!r} but the model's weights are on {device}")
    return backend



# The key's name across torch versions: `recompile_limit` since 2.6, `cache_size_limit` before
# (kept as its alias). Read through getattr: a config key can also be hidden at run time (torch's
# config module hides a key that was `del`-ed, which is what pytest >= 9's monkeypatch.undo does
# to a key it did not find in the module's __dict__).
_RECOMPILE_LIMIT_KEYS = ("recompile_limit", "cache_size_limit")


def raise_dynamo_recompile_limit(at_least: int) -> None:
    """Dynamo keeps at most `recompile_limit` (default 8) compiled entries per code object;
    compiling V41Model a second time in one process (ablations, tests) then fails hard under
    fullgraph=True. Raise the limit to `at_least` (never lower it); if this torch has neither
    key, say so once in the log and go on (only repeated compiles in one process are affected)."""
    config = torch._dynamo.config
    for key in _RECOMPILE_LIMIT_KEYS:
        try:   # a hidden key reads as missing but can be set (which shows it again)
            setattr(config, key, max(getattr(config, key, at_least), at_least))
            return
        except AttributeError:   # not a key of this torch
            continue
    _log.warning("torch._dynamo.config has none of %s: the per-code recompile limit stays as it is",
                 ", ".join(_RECOMPILE_LIMIT_KEYS))


__all__ = ["make_backend", "copy_graph_module", "TracedGraph", "GraphCaptured", "DECOMPOSITIONS", "resolve_platform",
           "raise_dynamo_recompile_limit", "v41graph_backend", "check_mode", "BACKEND_OPTIONS"]
