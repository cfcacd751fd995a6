"""One torch.compile backend for the pass tests, built on `v41graph.compiler.backend.make_backend`
(so every test runs the real flow: Dynamo -> aot_autograd(DECOMPOSITIONS,
keep_inference_input_mutations=True) -> PassManager(passes) -> optional lowering).

    h = PassHarness(["cleanup", "fuse_wkv_rmsnorm"])       # None: the default pass list
    out = h.compile(module)(x)                             # torch.compile(module, backend=h, fullgraph=True)
    h.before(0), h.after(0)                                # graph 0 before / after the passes
    h.check_before_ops([torch.ops.aten.rsqrt.default], fully_replaced=False)
    h.check_after_ops([torch.ops.v41graph.fused_wkv_rmsnorm.default])
    h.passed(0, passes)       # graph 0's untouched copy through another pass list (cached)
    with h.using(passes, lower): ...   # the compiled function runs that pass list, no new trace

Tracing (Dynamo + AOT) costs far more than our passes, so a test module traces once and
re-runs the kept post-AOT graphs (TracedGraph.untouched) through other pass lists.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from v41graph import V41Config
from v41graph.compiler.backend import TracedGraph, make_backend
from v41graph.passes.pass_manager import PassManager, resolve_passes
from v41graph.runtime.session import Session


def count_ops(gm: fx.GraphModule, *targets) -> int:
    """How many call_function nodes of `gm` call one of `targets`."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def _op_name(op) -> str:
    return op.name() if hasattr(op, "name") else str(op)


class _Selected:
    """Stands in as a kept graph's running module (TracedGraph.current) after the selection
    changed: the passed graph is made on the first call that needs it, then reused."""

    def __init__(self, harness: "PassHarness", index: int):
        self.harness, self.index = harness, index

    def forward(self, *args):
        return self.harness.after(self.index).forward(*args)


class PassHarness:
    """A torch.compile backend (pass the object itself) that keeps every compiled graph as a
    TracedGraph, before the passes (`before`) and after them (`after`), and can switch the
    pass list and lowering the compiled function runs without tracing again.

    `variants` maps (graph index, resolved pass names, lower) to the passed graph; a running
    variant appears there only once a call ran it (or `after` asked for it)."""

    def __init__(self, passes=None, lower=None):
        self.traced: list[TracedGraph] = []
        self.variants: dict = {}
        self._seeded = 0          # traced graphs whose compile-time graph is in `variants`
        self.passes, self.lower = None, None
        self.select(passes, lower)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        return self._backend(gm, example_inputs)

    def compile(self, module, **kwargs):
        """torch.compile(module) through this backend, fullgraph unless told otherwise."""
        kwargs.setdefault("fullgraph", True)
        return torch.compile(module, backend=self, **kwargs)

    # ------------------------------------------------------------------ the selection
    def _key(self, passes, lower):
        return tuple(resolve_passes(passes)), lower

    def _seed(self) -> None:
        """Graphs compiled since the last look ran the selection of that time: keep them."""
        for index in range(self._seeded, len(self.traced)):
            self.variants.setdefault((index, *self._key(self.passes, self.lower)), self.traced[index].current)
        self._seeded = len(self.traced)

    def select(self, passes=None, lower=None) -> None:
        """Every kept graph, and any compiled from now on, runs `passes` then `lower(gm)`."""
        self._seed()
        self.passes = None if passes is None else tuple(passes)
        self.lower = lower
        self._backend, self.manager = make_backend(None if passes is None else list(passes),
                                                   traced=self.traced, lower=lower)
        for index, graph in enumerate(self.traced):
            graph.current = _Selected(self, index)

    @contextlib.contextmanager
    def using(self, passes=None, lower=None):
        """select(passes, lower) for the block, then the selection before it again."""
        before = self.passes, self.lower
        self.select(passes, lower)
        try:
            yield self
        finally:
            self.select(*before)

    def _variant(self, index: int, passes, lower) -> fx.GraphModule:
        self._seed()
        key = (index, *self._key(passes, lower))
        if key not in self.variants:
            graph = self.traced[index]
            running = graph.current
            graph.repass(PassManager(list(key[1])), lower)
            self.variants[key], graph.current = graph.current, running
        return self.variants[key]

    # ------------------------------------------------------------------ graphs
    def before(self, index: int = 0) -> fx.GraphModule:
        """Graph `index` as AOT autograd handed it over, before any pass."""
        return self.traced[index].untouched

    def after(self, index: int = 0) -> fx.GraphModule:
        """Graph `index` after the selected passes (and lowering): what the compiled function runs."""
        return self._variant(index, self.passes, self.lower)

    def passed(self, index: int = 0, passes=None) -> fx.GraphModule:
        """Graph `index`'s untouched copy through `passes` (None: the default list), no lowering;
        cached, so do not edit it in place (copy_graph_module it first)."""
        return self._variant(index, passes, None)

    # ------------------------------------------------------------------ assertions
    def _counts(self, op, index, passes):
        after = self.after(index) if passes is None else self.passed(index, passes)
        return count_ops(self.before(index), op), count_ops(after, op)

    def check_before_ops(self, ops, fully_replaced: bool = True, index: int = 0, passes=None) -> None:
        """Each op is in graph `index` before the passes and fewer times after them (none at
        all if fully_replaced). After: the selected passes, or `passes` if given."""
        for op in ops:
            pre, post = self._counts(op, index, passes)
            assert pre > 0, f"{_op_name(op)} not in graph {index} before the passes"
            assert post < pre, f"all {pre} {_op_name(op)} of graph {index} are left after the passes"
            if fully_replaced:
                assert post == 0, f"{post} {_op_name(op)} left in graph {index} after the passes"

    def check_after_ops(self, ops, index: int = 0, passes=None) -> None:
        """Each op is absent from graph `index` before the passes and present after them."""
        for op in ops:
            pre, post = self._counts(op, index, passes)
            assert pre == 0, f"{pre} {_op_name(op)} in graph {index} before the passes"
            assert post > 0, f"{_op_name(op)} not in graph {index} after the passes"


class _CompiledSteps:
    """The model contract over one torch.compile'd V41Model `fn`: a call for any step and
    decode() for a decode step, both `fn` on the step's first four arguments (input_ids,
    positions, caches, metadata)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(*args[:4])

    def decode(self, *args):
        return self.fn(*args[:4])


class CompiledSession(Session):
    """A Session whose steps (prefill and decode) go through `fn`, a torch.compile'd `model`,
    without v41graph.compile's buckets or capture."""

    def __init__(self, model, fn, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self.model = _CompiledSteps(fn)


def three_layer_config(**overrides) -> V41Config:
    """tiny() cut to a window layer, a Full ratio-2 and a Full ratio-1 layer (the candidate
    source), with Engram and the DSpark targets: every kind of compressor, indexer and cache,
    at a third of tiny()'s CPU trace time. Reuse and Reindex layers are left out: for tests of
    the compile API and the compile cache, or of fusions those layers do not add."""
    return V41Config.tiny(num_hidden_layers=3, compress_ratios=[0, 2, 1, 0, 0, 0],
                          kv_source_layer_ids=[1, 2], index_source_layer_ids=[1, 2],
                          candidate_source_layer_id=2, engram_layer_ids=[1], engram_num_embeddings=[280],
                          dspark_target_layer_ids=[0, 1, 2], **overrides)


def four_layer_config(**overrides) -> V41Config:
    """Window, a ratio-1 KV source with Engram and two Reuse layers (the second a copy of the
    first): the smallest plan the stamper (compiler/stamp.py) copies a layer in, for tests of
    what does not depend on the plan, at well under half of tiny()'s tracing time (about 3 s
    per layer traced)."""
    return V41Config.tiny(num_hidden_layers=4, compress_ratios=[0, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[1],
                          index_source_layer_ids=[1], candidate_source_layer_id=1, engram_layer_ids=[1],
                          engram_num_embeddings=[280], dspark_target_layer_ids=[1, 2, 3], **overrides)


__all__ = ["PassHarness", "CompiledSession", "count_ops", "four_layer_config", "three_layer_config"]
