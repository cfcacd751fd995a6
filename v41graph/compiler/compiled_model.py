"""The compile-and-run API: the compiled model, its decode buckets, persistent buffers and
static capture.

    compiled = v41graph.compile(model, backend="auto", passes=None, disable=(), capture=True,
                                batch_sizes=(1, 2, 4, 8), dump_dir=None, share_decode_graph="all",
                                inductor_segments="auto", compile_prefill=True,
                                compile_cache=None,      # a directory: $V41GRAPH_COMPILE_CACHE
                                stamp_layers=True)       # trace one layer per kind (stamp.py)
    logits = compiled(input_ids, positions, caches, metadata)         # any step
    logits = compiled.decode(input_ids, positions, caches, metadata)  # a decode step: its bucket

Decode batches are padded up to the nearest bucket: padding tokens belong to the caches'
scratch slot (model/kv_cache.py), which the runtime never hands out, and have no cache blocks,
so they write nothing any real sequence reads.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from collections import defaultdict

import torch

from v41graph.custom_ops.hooks import layer_hook
from v41graph.model.kv_cache import ModelCaches
from v41graph.model.metadata import AttentionMetadata
from v41graph.model.model import check_step_inputs
from v41graph.progress import bar
from .backend import GraphCaptured, TracedGraph, make_backend, raise_dynamo_recompile_limit, resolve_platform
from .compile_cache import CompileCache, NotCacheable, cache_key, resolve_dir
from .stamp import StampRefused, map_checks, plan_stamping, stamp_graph
from .dump import graph_name
from .compile_workers import worker_count, workers
from .triton_precompile import make_precompile

_log = logging.getLogger(__name__)


class CompiledModel:
    """The compiled model: same call signature as V41Model.forward."""

    def __init__(self, model, backend="auto", passes=None, disable=(), capture=True,
                 batch_sizes=(1, 2, 4, 8), dump_dir=None, share_decode_graph="all",
                 inductor_segments="auto", compile_prefill=True, compile_cache=None, stamp_layers=True):
        from v41graph.model.model import V41Model
        if not isinstance(model, V41Model):
            # decode buckets, caches and capture follow V41Model's step contract; any other
            # module compiles with the plain backend
            raise TypeError(f"v41graph.compile expects a V41Model, got {type(model).__name__}; for any "
                            f"other module use torch.compile(module, backend=\"v41graph\") (same passes, "
                            f"options={{\"disable\": [...], \"dump_dir\": ...}}, no decode buckets or capture)")
        self.model = model.eval().requires_grad_(False)
        if share_decode_graph not in (True, False, "all"):
            raise ValueError(f"share_decode_graph must be True, False or \"all\", got {share_decode_graph!r}")
        self.share_decode_graph = share_decode_graph
        self.device = model.embed.weight.device
        self.platform = resolve_platform(backend, self.device)
        if inductor_segments not in (True, False, "auto"):
            raise ValueError(f"inductor_segments must be True, False or \"auto\", got {inductor_segments!r}")
        if inductor_segments is True and self.platform == "npu":
            raise ValueError("inductor_segments: torchair compiles the graphs on npu")
        # MoE experts as grouped GEMMs over stacked weights (moe.py): stack them before tracing.
        from v41graph.model.moe import pack_moe_experts_
        pack_moe_experts_(self.model)
        dump_dir = dump_dir or os.environ.get("V41GRAPH_DUMP") or None
        self.traced: list[TracedGraph] = []     # every graph compiled so far (set_passes)
        # Where compile time goes, in seconds: our passes ("passes_s") and the lowering
        # ("lower_s") of every graph (prefill too); for the decode buckets, each bucket's first
        # step split into tracing (Dynamo + AOT + passes + lowering, until the graph is ready:
        # "trace_s"; zero for a bucket that reuses a shared trace) and its first run (Triton JIT
        # of kernels seen for the first time, library setup: "first_run_s"), and on CUDA its
        # capture (second warm-up + graph capture: "capture_s"); "precompile_s": noting and
        # compiling Triton kernels in worker processes (for a stamped graph's first sizes during
        # its lowering, the first run waiting only for what is left: "precompile_wait_s"; for
        # other sizes part of their first run).
        self.timings: dict[str, float] = defaultdict(float)
        self.traced_by: dict[str, int] = defaultdict(int)   # graphs traced, by the step kind that traced
        self.notes: dict[str, str] = {}  # what timings cannot say: why the prefill traced its own graph
        self._graph_ready_at = 0.0       # when the backend last handed a graph over
        self._step_started = 0.0         # when the step that may trace began (for the log)
        self._tracing = ""               # which graph that step traces, if it does
        # The persistent compile cache (compile_cache.py): off unless a directory is given here
        # or in $V41GRAPH_COMPILE_CACHE; not on npu (torchair owns the compiled graphs there).
        cache_dir = resolve_dir(compile_cache)
        if cache_dir is not None and self.platform == "npu":
            _log.warning("compile_cache: not supported on npu (torchair compiles the graphs); off")
            cache_dir = None
        if cache_dir is not None and dump_dir is not None:   # a graph loaded from the cache writes no dump
            _log.warning("compile_cache: off, dump_dir %s is set (dumps are written while tracing)", dump_dir)
            cache_dir = None
        self.compile_cache = CompileCache(cache_dir) if cache_dir is not None else None
        # Layer stamping (compiler/stamp.py): a graph of the whole model is built from a trace of
        # the first layer of each kind. Not on npu (torchair traces there) nor for parallel
        # ranks (their collectives are not covered by the stamper's checks yet).
        self.stamp = None
        if stamp_layers and self.platform != "npu" and getattr(model, "parallel", None) is None:
            plan = plan_stamping(model.plan)
            self.stamp = plan if len(plan.traced) < plan.num_layers else None
        # Where CachedFunction finds graphs: the compile cache, or (no directory) one in memory
        # for the stamped graphs.
        self._graphs = self.compile_cache if self.compile_cache is not None else (
            CompileCache(None) if self.stamp is not None else None)
        # Read at each lowering (set_passes too), so it can be switched.
        self.inductor_segments = resolve_inductor_segments(
            inductor_segments, self.platform, self.compile_cache is not None,
            parallel=getattr(self.model, "parallel", None) is not None)
        if self.inductor_segments:   # Triton's environment as Inductor will set it, before any JIT
            from .inductor_segments import (WORKER_PRELOAD, pin_inductor_triton_env, segment_workers_on,
                                            start_inductor_compile_workers)
            pin_inductor_triton_env()
            segments_in_workers = segment_workers_on()   # a bad $V41GRAPH_SEGMENT_WORKERS fails here
            if worker_count() > 0:
                start_inductor_compile_workers()
                if segments_in_workers:    # the compile workers import Inductor while this traces
                    workers(preload=WORKER_PRELOAD)
        # On CUDA, each graph's Triton kernels are compiled by worker processes before its first
        # run with new sizes (triton_precompile.py); the workers start now, during the trace.
        self.precompile = make_precompile(self.platform, self.timings)
        self.backend, self.pass_manager = make_backend(passes, disable, dump_dir, self.platform,
                                                       traced=self.traced, lower=self._lower,
                                                       on_compiled=self._graph_compiled,
                                                       recorder=self._graphs, before_run=self.precompile)
        self.capture = capture
        self.batch_sizes = sorted(set(int(b) for b in batch_sizes))
        if not self.batch_sizes or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        self._set_cache_key()
        # Every CompiledModel adds 3-5 Dynamo entries for V41Model.forward (prefill, its dynamic
        # recompile, bucket 1, the shared decode graph); see raise_dynamo_recompile_limit.
        raise_dynamo_recompile_limit(64)
        # Decode buckets are compiled per static shape; prefill lets Dynamo mark the token
        # count dynamic after the first recompile.
        # With the cache on, Dynamo's guards are shown to it (guard_filter_fn keeps them all).
        # (A new dict for each torch.compile call: it pops the key from the one it is given.)
        def options():
            return {"options": {"guard_filter_fn": self._graphs.guard_filter}} if self._graphs else {}
        self._fn = CachedFunction(self, "decode", torch.compile(self.model, backend=self.backend, fullgraph=True,
                                                                 dynamic=False, **options()))
        # The decode buckets share one graph whose batch dimension is symbolic (marked on the
        # bucket's persistent buffers): tracing + passes run once, each bucket only captures.
        # Tracing the 40-layer model is most of compile time (~50 s per graph on an H200 host).
        # The default "all" marks the batch unbacked, so bucket 1 and the prefill (one sequence,
        # any token count) run that graph too; share_decode_graph=True marks it backed, which
        # Dynamo specializes at 1, so bucket 1 gets its own static graph (_fn) and a prefill of
        # one sequence traces a third graph (the shared one guards 2 <= the sequence count).
        self._shared_decode_fn = CachedFunction(self, "decode_shared", torch.compile(
            self.model, backend=self.backend, fullgraph=True, dynamic=None, **options()))
        # Everything that is not a decode step (prefill chunks, mixed steps, verify steps) runs
        # this graph, or the eager model with compile_prefill=False: a serving engine whose
        # step shapes vary widely then pays one trace (the decode graph) instead of two or three.
        self.compile_prefill = bool(compile_prefill)
        self._prefill_fn = (CachedFunction(self, "prefill", torch.compile(
            self.model, backend=self.backend, fullgraph=True, dynamic=None, **options()))
            if self.compile_prefill else self.model)
        # The two halves of a disaggregated prefill (v41graph.disagg): P's encoder graph and
        # D's decoder-replay graph, traced at their first call (most models never make one).
        self._encode_fn = self._decode_replay_fn = None
        self._decode: dict[tuple, DecodeGraph] = {}
        self._coming: list[DecodeGraph] = []    # buckets warmup() prepares next (_coming_scopes)
        # Captured buckets share one memory pool (they never run at the same time); it lives
        # as long as this object, so a later model never captures into a released pool.
        self.graph_pool = None

    @property
    def config(self):
        return self.model.config

    @property
    def compile_events(self) -> list[str]:
        """Why graphs were traced, stamped, not stamped or not stored (readable lines): the
        compile cache's events, or those of the in-memory store of stamped graphs."""
        return self._graphs.events if self._graphs is not None else []

    def _graph_compiled(self, passes_s: float, lower_s: float) -> None:
        self.traced_by[self._tracing or "step"] += 1
        self.timings["passes_s"] += passes_s
        self.timings["lower_s"] += lower_s
        self._graph_ready_at = time.perf_counter()
        _log.info("traced the %s graph in %.1f s (Dynamo + AOT + our passes %.2f s%s)", self._tracing or "step",
                  self._graph_ready_at - self._step_started, passes_s,
                  f" + lowering {lower_s:.1f} s" if lower_s >= 0.05 else "")

    def _traces(self, name: str):
        """The step about to run may trace (the first of its kind, a recompile): its graphs are
        named `name` in the dump, and the log says how long tracing took."""
        self._step_started, self._tracing = time.perf_counter(), name
        return graph_name(name)

    def _lower(self, gm) -> None:
        """Platform lowering of a final graph (after the passes): Inductor segments if asked for
        (their compiled code kept in the compile cache's segment store when the cache is on)."""
        if self.inductor_segments:
            from .inductor_segments import lower_inductor_segments
            lower_inductor_segments(gm, store=self.compile_cache.segments if self.compile_cache else None)

    def _set_cache_key(self) -> None:
        if self._graphs is not None:
            self._graphs.set_key(cache_key(
                self.model.config, self.pass_manager.uuid(),
                "inductor_segments" if self.inductor_segments else "executor", self.batch_sizes,
                self.platform, self.device, self.share_decode_graph))

    def _stamp(self, fn, scope: dict, kind: str, signature: str, args, kwargs):
        """Trace the first layer of each kind (`fn` with model.stamp_layers set), stamp the
        whole model's graph from it, run our passes and the lowering on it: its cache entry,
        or None (the reason in the compile cache's events) when it cannot be stamped and the
        caller traces the whole model instead."""
        import builtins
        cache, model = self._graphs, self.model
        # a verify step (return_streams) is the plain step's graph with more outputs: trace that
        streams_of = tuple(int(i) for i in scope.get("return_streams") or ())
        kwargs = {k: v for k, v in kwargs.items() if k != "return_streams"}
        t0 = time.perf_counter()
        cache.begin(stamping=True)
        model.stamp_layers = self.stamp.traced
        try:
            fn(*args, **kwargs)
        except GraphCaptured:
            pass
        except Exception as exc:      # the whole model's trace will say what is wrong, if anything
            cache.note(f"{kind}: stamping trace failed ({type(exc).__name__}: {str(exc)[:300]}); "
                       "tracing the whole model", logging.WARNING)
            cache.abandon()
            return None
        finally:
            model.stamp_layers = None
        record, guards = cache.take_stamping_trace()
        if record is None:
            cache.note(f"{kind}: an earlier stamping trace fits this call but its graph is not kept; "
                       "tracing the whole model")
            return None
        t1 = time.perf_counter()

        def resolve(source: str, call: dict = scope):   # a graph input's value in a call, by its Dynamo source
            return eval(source, {"__builtins__": builtins}, {"L": call})
        try:
            gm, sources = stamp_graph(record.gm, record.sources, self.stamp, resolve, streams_of)
        except StampRefused as exc:
            cache.note(f"{kind}: not stamped ({exc}); tracing the whole model", logging.WARNING)
            return None
        graph = TracedGraph(gm, self.precompile)
        t2 = time.perf_counter()
        self.pass_manager(gm)
        t3 = time.perf_counter()
        if self.precompile is not None:   # the workers compile this call's Triton kernels meanwhile,
            self.precompile.start(gm, [resolve(s) for s in sources])
            # and those of the decode buckets warmup() will run on this graph next (their first
            # runs waited for their own compiles: ~4 s of an H200 cold start)
            for coming in self._coming_scopes(kind, signature, scope):
                self.precompile.start(gm, [resolve(s, coming) for s in sources])
        self._lower(gm)
        t4 = time.perf_counter()
        try:
            entry = cache.add_stamped(kind, signature, record, guards, sources, gm, graph,
                                      lambda checks: map_checks(checks, self.stamp), streams=len(streams_of))
        except NotCacheable as exc:
            cache.note(f"{kind}: not stamped ({exc}); tracing the whole model", logging.WARNING)
            return None
        self.traced.append(graph)
        self.timings["stamp_trace_s"] += t1 - t0
        self.timings["stamp_s"] += t2 - t1
        self._graph_compiled(t3 - t2, t4 - t3)
        self.notes["stamp"] = (f"traced layers {list(self.stamp.traced)} of {self.stamp.num_layers}, "
                               "stamped the others")
        return entry

    def set_passes(self, passes=None, disable=()) -> None:
        """Change the pass list (same arguments as compile()) of every graph compiled so far and
        of later ones, without tracing again: each graph's untouched post-AOT copy goes through
        the new list. Captured decode graphs are dropped (they hold the old kernels) and are
        captured again at their next step. For ablations: one trace, many pass lists.
        The graphs are lowered again too, with Inductor segments if `self.inductor_segments`
        is set now."""
        if self.platform == "npu":
            raise NotImplementedError("set_passes: torchair owns the compiled graphs on npu; "
                                      "compile again with the new pass list")
        self.pass_manager.configure(passes, disable)    # the backend's own manager: later graphs too
        self._set_cache_key()     # graphs loaded from the cache are dropped: the new list's are others
        for graph in self.traced:
            graph.repass(self.pass_manager, self._lower)
        self._decode.clear()
        # A new pool too: capturing into the pool of graphs just released trips the caching
        # allocator (INTERNAL ASSERT use_count > 0, torch 2.11, seen on the H200).
        self.graph_pool = None

    def _check_inputs(self, input_ids, positions, metadata) -> None:
        """The device and the model contract's checks (check_step_inputs), before any graph runs
        (a captured replay runs no Python of the model's)."""
        for name, t in (("input_ids", input_ids), ("positions", positions)):
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the compiled model is on {self.device}")
        check_step_inputs(input_ids, positions, metadata)

    def decode(self, input_ids, positions, caches: ModelCaches, metadata: AttentionMetadata):
        """One decode step (one token per sequence, the logits of each): its bucket's graph,
        padded to the bucket and captured on CUDA. The caller (Session, Engine) knows a step is
        a decode step and says so by calling this; the model contract is V41Model.decode."""
        self._check_inputs(input_ids, positions, metadata)
        if input_ids.shape[0] != metadata.num_seqs:
            raise ValueError(f"decode: {input_ids.shape[0]} tokens for {metadata.num_seqs} sequences; "
                             f"a decode step has one token per sequence")
        with torch.no_grad():
            return self._decode_step(input_ids, positions, caches, metadata)

    def __call__(self, input_ids, positions, caches: ModelCaches, metadata: AttentionMetadata,
                 all_logits: bool = False, decoder_replay: int | None = None,
                 return_streams: tuple[int, ...] = ()):
        """Any step, as V41Model.forward, through the compiled graph without buckets or capture:
        prefill chunks, mixed steps and speculative verify steps (a chunk of anchor + drafts per
        request, all_logits=True, return_streams=DSpark's target layers). Their chunk lengths
        change every step, so a captured bucket would not fit them. Verify steps' token and
        sequence counts are marked dynamic from the first verify call on, so one trace (with
        the streams as extra outputs) serves every verify step of two or more sequences instead
        of a static trace and recompiles as the counts change (a step of one sequence gets one
        more trace: Dynamo specializes sizes of 1). decoder_replay (data-dependent shapes) runs
        the eager model. Decode steps go through `decode()`."""
        self._check_inputs(input_ids, positions, metadata)
        # only passed when asked for, so the plain prefill call (and its trace) stays as it was
        extra = {"return_streams": tuple(return_streams)} if return_streams else {}
        with torch.no_grad():
            if decoder_replay is not None:   # data-dependent shapes: runs eagerly
                return self.model(input_ids, positions, caches, metadata, all_logits, decoder_replay,
                                  **extra)
            if return_streams and self.compile_prefill:
                _mark_batch_dims_dynamic(input_ids, positions, metadata)
            elif self.share_decode_graph == "all" and self.compile_prefill:
                # marked as the decode buckets mark theirs: a prefill before the first decode
                # step traces the graph every bucket then runs (one trace, whichever comes first)
                _mark_shared_graph_dims(input_ids, positions, metadata, unbacked=True)
            what = "verify" if return_streams else "prefill"
            traced_before = self.traced_by[what]
            with self._traces(what):
                out = self._prefill_fn(input_ids, positions, caches, metadata, all_logits, **extra)
            if what == "prefill" and self.compile_prefill and "prefill" not in self.notes:
                self._note_prefill_graph(traced=self.traced_by[what] > traced_before)
            return out

    def _note_prefill_graph(self, traced: bool) -> None:
        """Say (once, in `notes["prefill"]`; `timings` keeps seconds and counts only) whether
        the first prefill ran a graph it traced itself or one it shares (the shared decode trace,
        or a graph of the compile cache), and if it traced although a decode graph existed, why
        Dynamo did not reuse it (the guard failure Dynamo recorded)."""
        if not traced:
            ran = self._prefill_fn.last_entry_kind if isinstance(self._prefill_fn, CachedFunction) else None
            self.notes["prefill"] = (f"runs the stored {ran} graph (compile cache)" if ran else
                                     "reuses a graph traced before it (the shared decode trace)")
        elif not (self.traced_by["decode"]):
            self.notes["prefill"] = "traced its own graph (no decode graph had been traced before it)"
        else:
            reasons = []
            try:
                from torch._dynamo.utils import guard_failures
                reasons = guard_failures.get(type(self.model).forward.__code__, [])[-1:]
            except (ImportError, AttributeError):
                pass
            self.notes["prefill"] = ("traced its own graph although a decode graph existed; Dynamo's guards "
                                     "of the decode graph failed: " + ("; ".join(map(str, reasons))[:500] or
                                                                       "(reason not recorded by this torch)"))
        _log.info("prefill graph: %s", self.notes["prefill"])

    # ------------------------------------------------------------------ disaggregated halves
    def encode(self, input_ids, positions, caches: ModelCaches, metadata: AttentionMetadata,
               decoder_replay, on_layer=None):
        """V41Model.encode (a prefill worker's half) with V41Model.encoder_forward as one graph
        of our passes (compile_prefill=False: eager, as every other non-decode step). The
        graph's layer_done ops call on_layer between its layers, as the eager model does, so a
        part's send still overlaps the next layer's compute."""
        self._check_inputs(input_ids, positions, metadata)
        if decoder_replay is None:
            raise ValueError("encode: decoder_replay is required (the decoder half runs elsewhere)")
        if not self.compile_prefill:
            with torch.no_grad():
                return self.model.encode(input_ids, positions, caches, metadata, decoder_replay, on_layer)
        if self._encode_fn is None:
            self._encode_fn = torch.compile(self.model.encoder_forward, backend=self.backend,
                                            fullgraph=True, dynamic=None)
        with torch.no_grad():
            with self._traces("encode"), layer_hook(on_layer):
                streams, pre = self._encode_fn(input_ids, positions, caches, metadata)
            return self.model.replay_inputs(streams, pre, positions, metadata, decoder_replay)

    def decode_replay(self, streams, pre, positions, caches: ModelCaches, metadata: AttentionMetadata):
        """V41Model.decode_replay (a decode worker's first token from a hand-over) as one graph
        of our passes: its shapes are the replay rows', fixed before the call (eager with
        compile_prefill=False)."""
        if not self.compile_prefill:
            with torch.no_grad():
                return self.model.decode_replay(streams, pre, positions, caches, metadata)
        if self._decode_replay_fn is None:
            self._decode_replay_fn = torch.compile(self.model.decode_replay, backend=self.backend,
                                                   fullgraph=True, dynamic=None)
        with torch.no_grad(), self._traces("decode_replay"):
            return self._decode_replay_fn(streams, pre, positions, caches, metadata)

    # ------------------------------------------------------------------ decode buckets
    def bucket_for(self, n: int) -> int:
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"decode batch of {n} sequences is larger than the largest captured "
                             f"bucket {self.batch_sizes[-1]}; pass larger batch_sizes")
        return self.batch_sizes[i]

    def _decode_step(self, input_ids, positions, caches, metadata):
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        graph = self._graph_for(bucket, caches, metadata.block_table.shape[1])
        logits = graph.run(input_ids, positions, metadata)[:n]
        # A replay writes the captured graph's output buffer again: hand out a copy, as an eager
        # call would (a caller keeping step t's logits must not see step t+1's). [n, vocab]
        # fp32, a few µs per step.
        return logits.clone() if graph.cuda_graph is not None else logits

    def _graph_for(self, bucket: int, caches: ModelCaches, width: int,
                   prepare: bool = False) -> "DecodeGraph":
        """The decode graph of a bucket, cache set and block-table width (made on first use, and
        then compiled + captured at once when `prepare`): a captured graph is bound to its
        buffers' addresses and shapes (the shared trace has the width symbolic, so another
        width costs a capture, not a trace)."""
        key = (bucket, id(caches), width)
        graph = self._decode.get(key)
        if graph is None or graph.caches is not caches:   # an id reused by a new cache set
            graph = self._decode[key] = DecodeGraph(self, bucket, caches, width)
            if prepare:
                graph.prepare()
        return graph

    def warmup(self, caches: ModelCaches, max_blocks: int, show_progress: bool | None = None) -> None:
        """Compile (and on CUDA capture) every decode bucket up front: each bucket logged, and a
        bar on a terminal (show_progress=None; True/False: always / never a bar)."""
        captures = self.platform == "cuda" and self.capture
        what = "Capturing CUDA graphs" if captures else "Compiling decode buckets"
        t0 = time.perf_counter()
        graphs = {b: self._graph_for(b, caches, max_blocks) for b in self.batch_sizes}
        # the buckets not prepared yet, known before the first one traces (_coming_scopes)
        self._coming = [graphs[b] for b in self.batch_sizes if not graphs[b].stepped]
        try:
            for b in bar(self.batch_sizes, desc=what, unit="bucket", show=show_progress):
                _log.info("decode bucket %d: %s", b, "compile + capture" if captures else "compile")
                if graphs[b] in self._coming:
                    graphs[b].prepare()
        finally:
            self._coming = []
        _log.info("%s: %d buckets in %.1f s", what, len(self.batch_sizes), time.perf_counter() - t0)

    def _coming_scopes(self, kind: str, signature: str, current: dict):
        """The calls (Dynamo's scope: argument name -> value) that warmup's buckets still to be
        prepared will make to the compiled function `kind` with the same constant arguments
        (`signature`), other than the `current` one: a graph traced now sees them before they run."""
        for graph in self._coming:
            fn = graph.compiled_function()
            if fn.kind == kind and not graph.stepped:
                scope = fn.scope(graph.input_ids, graph.positions, graph.caches, graph.meta)
                if fn.signature_of(scope) == signature and any(scope[k] is not current.get(k) for k in scope):
                    yield scope

    def capture_graph(self, step, keep=(), warm_up=None):
        """(CUDA graph, its output) of `step()`: warmed up on a side stream (compiles, allocates
        workspaces; default: two calls of `step`), then captured into this model's pool, which
        all its graphs share (they never run at the same time; it lives as long as this object,
        so a later model never captures into a released pool). The tensors in `keep` are put
        back afterwards: warm-up and capture must not advance state."""
        saved = [t.clone() for t in keep]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.no_grad():
            if warm_up is None:
                step()
                step()
            else:
                warm_up()
            torch.cuda.synchronize()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.graph_pool), torch.no_grad():
            output = step()
        for t, old in zip(keep, saved):
            t.copy_(old)
        return graph, output


def _mark_batch_dims_dynamic(input_ids, positions, metadata: AttentionMetadata) -> None:
    """Mark the token count and the sequence count of a step's inputs dynamic for Dynamo (a
    count of 1 is still specialized: `maybe_mark_dynamic` does not insist)."""
    for t in (input_ids, positions, *metadata.batch_tensors()):
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _mark_shared_graph_dims(input_ids, positions, metadata: AttentionMetadata, unbacked: bool) -> None:
    """Mark what the shared decode graph has symbolic: dim 0 of every batch tensor (token and
    sequence counts) and the block-table width (when >= 2: Dynamo would specialize a width of
    1). unbacked (share_decode_graph="all"): counts Dynamo does not specialize at 1 either, so
    every bucket and any prefill step marked the same way fit one graph, whichever traced it."""
    mark = torch._dynamo.decorators.mark_unbacked if unbacked else torch._dynamo.mark_dynamic
    for t in (input_ids, positions, *metadata.batch_tensors()):
        mark(t, 0)
    if metadata.block_table.shape[1] >= 2:
        torch._dynamo.mark_dynamic(metadata.block_table, 1)


def resolve_inductor_segments(value, platform: str, cache_on: bool, parallel: bool) -> bool:
    """compile(inductor_segments=...): True / False as given; "auto" on CUDA when a compile
    cache keeps the compiled segments (their compiles cost ~60 s of a ~185 s cold start on the
    H200; a warm start loads them in seconds), not for parallel rank models (segments around
    collectives are not measured yet), off otherwise."""
    if value == "auto":
        return platform == "cuda" and cache_on and not parallel
    return bool(value)


class CachedFunction:
    """One of CompiledModel's compiled functions (decode, shared decode, prefill) in front of
    the persistent compile cache: a call that a stored graph fits runs it without Dynamo; any
    other call goes to Dynamo (which traces if its own in-process cache has nothing), and a
    graph traced by it is stored. Without a cache this is the Dynamo function alone."""

    # the model arguments that are graph inputs; the others are constants of the trace
    TENSOR_ARGS = ("self", "input_ids", "positions", "caches", "metadata")

    def __init__(self, compiled: CompiledModel, kind: str, fn):
        import inspect
        self.compiled, self.kind, self.fn = compiled, kind, fn
        self._signature = inspect.signature(type(compiled.model).forward)
        self._seen: set = set()     # entries that ran here (timings["cache_hits"] counts each once)
        self.last_entry_kind = None   # the kind of the stored graph the last call ran, if any

    def scope(self, *args, **kwargs) -> dict:
        """The call's arguments by name (the model's forward's; what Dynamo's sources name)."""
        bound = self._signature.bind(self.compiled.model, *args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    def signature_of(self, scope: dict) -> str:
        """The call's constant (non-tensor) arguments: calls with equal ones may share a graph."""
        return repr(sorted((k, v) for k, v in scope.items() if k not in self.TENSOR_ARGS))

    def __call__(self, *args, **kwargs):
        compiled = self.compiled
        cache = compiled._graphs
        if cache is None:
            return self.fn(*args, **kwargs)
        scope = self.scope(*args, **kwargs)
        signature = self.signature_of(scope)
        entry, found = cache.lookup(self.kind, signature, scope)
        compiled.timings["cache_load_s"] = cache.load_s
        if entry is not None:
            if id(entry) not in self._seen and entry not in cache.resident:   # loaded, not stamped here
                self._seen.add(id(entry))
                compiled.timings["cache_hits"] += 1
                _log.info("compile cache: the %s graph loaded (%s), not traced", self.kind, entry.entry.digest)
            self.last_entry_kind = entry.entry.kind
            return entry(found)
        self.last_entry_kind = None
        # (a model in debug mode records every layer's values from Python: not from a stamped graph)
        if compiled.stamp is not None and scope.get("decoder_replay") is None and compiled.model.debug is None \
                and len(args) <= 5:      # return_streams, when given, by keyword (CompiledModel.__call__)
            entry = compiled._stamp(self.fn, scope, self.kind, signature, args, kwargs)
            if entry is not None:
                if compiled.compile_cache is not None:
                    compiled.timings["cache_misses"] += 1
                    cache.note(f"{self.kind}: stamped, " + ("; ".join(found)[:1000] if found else "nothing stored"))
                return entry(entry.args(scope))
        cache.begin()
        try:
            result = self.fn(*args, **kwargs)
        except BaseException:
            cache.abandon()
            raise
        if cache.traced:                   # this call traced: say why the stored graphs did not fit
            compiled.timings["cache_misses"] += 1
            cache.note(f"{self.kind}: traced, " + ("; ".join(found)[:1000] if found else "nothing stored"))
        cache.finish(self.kind, signature, scope, result)
        return result


class DecodeGraph:
    """One decode bucket: persistent input buffers, the compiled step, and on CUDA its graph."""

    def __init__(self, compiled: CompiledModel, bucket: int, caches: ModelCaches, max_blocks: int):
        self.compiled, self.bucket, self.caches = compiled, bucket, caches
        dev = compiled.device
        # Padding rows write into the caches' scratch slot (kv_cache.slots_with_scratch), which
        # the runtime never hands out; checking it here each step would cost a host sync.
        self.scratch_slot = caches.scratch_slot
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(bucket, **i64)
        self.positions = torch.zeros(bucket, **i64)
        self.meta = AttentionMetadata.decode_buffers(bucket, max_blocks, dev, self.scratch_slot)
        share = compiled.share_decode_graph
        self.shared = share == "all" or (bucket >= 2 and bool(share))
        if self.shared:   # the shared symbolic-batch graph (see CompiledModel.__init__)
            _mark_shared_graph_dims(self.input_ids, self.positions, self.meta, unbacked=share == "all")
        # cpu: the plain graph; npu: torchair captures itself; capture=False: the same bucketed
        # graph and buffers without a CUDA graph (so capture on/off changes nothing else)
        self.captures = compiled.platform == "cuda" and compiled.capture
        self.stepped = False      # whether the first (timed) step has run
        self.cuda_graph = None
        self.output = None
        self._static = None    # (static_key, n) of the seq_slot / block_table rows loaded

    def _load(self, input_ids, positions, meta: AttentionMetadata) -> None:
        n = input_ids.shape[0]
        if meta.block_table.shape[1] != self.meta.block_table.shape[1]:
            raise ValueError(f"block table width {meta.block_table.shape[1]} differs from the captured "
                             f"{self.meta.block_table.shape[1]}")
        self.input_ids.zero_()[:n].copy_(input_ids)
        self.positions.zero_()[:n].copy_(positions)
        # Slots and block tables of a persistent DecodeBatch change only when its rows do
        # (meta.static_key says so): skip reloading them while they are already here.
        static = None if meta.static_key is None else (meta.static_key, n)
        self.meta.load_decode_rows_(meta, self.scratch_slot, static=static is None or static != self._static)
        self._static = static

    def compiled_function(self):
        """The CompiledModel function this bucket's steps call."""
        return self.compiled._shared_decode_fn if self.shared else self.compiled._fn

    def _step(self):
        fn = self.compiled_function()
        # no_grad here too, not only in CompiledModel.__call__: warm-up (warmup(), prepare())
        # calls this directly, and a graph traced with grad mode on fails Dynamo's grad-mode
        # guard at every later no_grad step, which then traces the model again.
        with torch.no_grad(), self.compiled._traces("decode"):
            return fn(self.input_ids, self.positions, self.caches, self.meta)

    def prepare(self) -> None:
        """Compile this bucket (all-padding inputs) and, on CUDA, capture it."""
        if self.captures:
            self._capture()
        else:
            saved = [t.clone() for t in self.caches.tensors()]
            self._first_step()
            for t, old in zip(self.caches.tensors(), saved):
                t.copy_(old)

    def _first_step(self):
        """The bucket's first step, its time added to the compiled model's timings: the tracing
        part (if this step traced a graph: until the backend handed it over) as "trace_s", the
        rest (the first run: Triton JIT, library setup) as "first_run_s"."""
        compiled, timings = self.compiled, self.compiled.timings
        t0 = time.perf_counter()
        out = self._step()
        if compiled.platform == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        traced = compiled._graph_ready_at - t0 if compiled._graph_ready_at > t0 else 0.0
        timings["trace_s"] += traced
        timings["first_run_s"] += t1 - t0 - traced
        self.stepped = True
        return out

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        self._load(input_ids, positions, meta)
        if not self.captures:
            return self._step() if self.stepped else self._first_step()
        if self.cuda_graph is None:
            self._capture()
        self.cuda_graph.replay()
        return self.output

    def _capture(self) -> None:
        # Warm-up steps write only the scratch slot and real slots' current rows again.
        t0 = [0.0]

        def warm_up():
            self._first_step()
            t0[0] = time.perf_counter()
            self._step()                     # the second warm-up counts as capture
        self.cuda_graph, self.output = self.compiled.capture_graph(self._step, keep=self.caches.tensors(),
                                                                   warm_up=warm_up)
        self.compiled.timings["capture_s"] += time.perf_counter() - t0[0]


def compile(model, *, backend: str = "auto", passes=None, disable=(), capture: bool = True,
            batch_sizes=(1, 2, 4, 8), dump_dir=None, share_decode_graph: bool | str = "all",
            inductor_segments: bool | str = "auto", compile_prefill: bool = True,
            compile_cache=None, stamp_layers: bool = True) -> CompiledModel:
    """Compile a V41Model with the v41graph backend (a TypeError for any other module: compile
    those with torch.compile(module, backend="v41graph")). See the module docstring.
    capture=False runs the same decode buckets (padding, persistent buffers, graphs) without
    CUDA-graph capture: for debugging a capture, everything else stays the same.
    share_decode_graph="all" (the default) traces one graph for every decode bucket and the
    prefill (an unbacked batch size: 4 buckets + prefill = 1 trace); True traces bucket 1 on its
    own and shares one graph among buckets >= 2 (a one-sequence prefill then traces a third);
    False traces every decode bucket on its own (static shapes throughout).
    inductor_segments=True compiles the final graph's stream-free stretches with Inductor
    (compiler/inductor_segments.py); stream ops and cache writes stay with our executor. "auto"
    (the default) turns them on for CUDA when a compile cache is on (a warm start then loads
    them: H200, 9.2 s to the first captured step), off otherwise (their Inductor compiles would
    be paid at every start) and for parallel rank models; False: our executor only.
    compile_prefill=False runs every step that is not a plain decode step (prefill, mixed and
    verify steps) on the eager model; decode steps still run the compiled, captured buckets.
    compile_cache: a directory (default $V41GRAPH_COMPILE_CACHE; None and no variable, or
    False: off) where each traced graph is stored, so that a later process loads it instead of
    tracing (compiler/compile_cache.py); `timings["cache_hits"]` counts the graphs loaded,
    `compiled.compile_cache.events` says why a graph was traced or not stored.
    stamp_layers=True (the default) traces only the first layer of each kind and stamps the
    whole model's graph from it (compiler/stamp.py; `notes["stamp"]` says which layers were
    traced, `timings["stamp_trace_s"]` / `["stamp_s"]` the trace and the stamping); a call the
    stamper cannot serve traces every layer, as stamp_layers=False always does.
    On CUDA, worker processes compile a graph's Triton kernels before its first run with new
    sizes (compiler/triton_precompile.py), and with Inductor segments on they compile the
    distinct segments in parallel (compiler/compile_workers.py; $V41GRAPH_COMPILE_WORKERS=0
    turns the workers off, $V41GRAPH_SEGMENT_WORKERS=0 only the segments' part)."""
    return CompiledModel(model, backend=backend, passes=passes, disable=disable, capture=capture,
                         batch_sizes=batch_sizes, dump_dir=dump_dir,
                         share_decode_graph=share_decode_graph, inductor_segments=inductor_segments,
                         compile_prefill=compile_prefill, compile_cache=compile_cache,
                         stamp_layers=stamp_layers)


__all__ = ["compile", "CompiledModel", "DecodeGraph"]
