"""Layer stamping: trace one layer per role and copy it into the others (issue 24).

Tracing (Dynamo + AOT autograd) costs the same for each of the model's layers, and the 40
layers of the released plan are only a handful of kinds: every Reuse layer of a ratio-2 KV
source does the same ops on its own weights and caches. So the cold start traces the model
with only the first layer of each kind (`V41Model.stamp_layers`) and builds the whole model's
post-AOT graph from that one by copying each traced layer into the layers of its kind, with
their own weights and caches as new graph inputs. The result is the graph a full trace gives,
node for node (tests/test_stamp.py compares the two), at a fraction of the tracing time.

Which layers are alike (`layer_kind`): same mode, ratio, Engram slot and candidate-source flag,
and the same sources (KV, index, candidate: present or not, the layer itself or another). A
copy maps the layer ids by the field it reads through them (`FIELDS`): layer 9 copied from
layer 3 reads layer 8's top-k and KV where layer 3 read layer 2's; layer 37 copied from 21 reads
layer 20's KV as 21 does, but layer 36's top-k where 21 read layer 20's. The released plan:
8 of 40 layers traced.

What a copy reads from outside its layer is found by name, not by position:
  - graph inputs by their Dynamo source (`L['caches'].window_kv[3]` -> `...window_kv[9]`);
    a new input must have the same shape, strides and dtype as the traced layer's;
  - the values layers hand each other (streams in and out, a source's top-k and candidate
    list, index tensors that the first layer needing them builds for all) by the tags the
    model puts on them while tracing for stamping (StepContext.tag, custom_ops/stamp_tag.py).
    A shared value that already exists when a copy would build it again is the existing one
    (the copy's build is dead code, removed);
  - a cache's current value (AOT functionalized the writes) as the latest write of that cache;
  - a symbolic size by its expression.
Anything else a layer reads from another layer stops the stamping (StampRefused, with the node
and the reason); the compiler then traces the whole model as before. The tags are removed
before our passes see the graph.
"""
from __future__ import annotations

import ast
import dataclasses
import operator
import re

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

STAMP_TAG = torch.ops.v41graph.stamp_tag.default
COPY_ = torch.ops.aten.copy_.default


class StampRefused(Exception):
    """The traced graph cannot be stamped into the whole model (the message says why)."""


# ----------------------------------------------------------------------------- which layers
# The layer ids a layer refers to, by what it reads through each: its own weights, window ring
# and streams ("self"); its KV source's global KV, index keys and compressor ring ("kv"); its
# index source's top-k and global rows ("index"); the candidate source's candidates ("candidate").
FIELDS = ("self", "kv", "index", "candidate")


def _refs(role) -> dict:
    return dict(zip(FIELDS, (role.layer_id, role.kv_source, role.index_source, role.candidate_source)))


def layer_kind(role) -> tuple:
    """Layers of one kind trace the same ops on their own weights, caches and sources: same
    mode, ratio, candidate-source flag and Engram slot, and the same sources present (each
    either the layer itself or another one). Which other layer a source is does not matter: a
    copy reads its own sources' values through the same fields."""
    refs = _refs(role)
    sources = tuple(None if refs[f] is None else refs[f] == role.layer_id for f in FIELDS[1:])
    return (role.mode, role.ratio, role.is_candidate_source, role.engram_slot, sources)


@dataclasses.dataclass
class StampPlan:
    traced: tuple            # the layers traced: the first of each kind
    copied_from: dict        # layer -> the traced layer it is a copy of (itself when traced)
    layer_maps: dict         # layer -> {field: {its traced layer's id there -> its own}}

    @property
    def num_layers(self) -> int:
        return len(self.copied_from)


def plan_stamping(plan) -> StampPlan:
    first = {}
    for role in plan:
        first.setdefault(layer_kind(role), role)
    copied_from, maps = {}, {}
    for role in plan:
        rep = first[layer_kind(role)]
        copied_from[role.layer_id] = rep.layer_id
        theirs, mine = _refs(rep), _refs(role)
        maps[role.layer_id] = {f: {theirs[f]: mine[f]} for f in FIELDS if theirs[f] is not None}
    return StampPlan(tuple(sorted(r.layer_id for r in first.values())), copied_from, maps)


# ----------------------------------------------------------------------------- names
_LAYER_IN_SOURCE = re.compile(r"(\['layers'\]\._modules\['|\.layers\[|\.(window_kv|window_scale|compressor_state"
                              r"|global_kv|global_scale|index_k|index_scale)\[)(\d+)")
_LAYER_IN_TAG = re.compile(r"'layer(\d+)'")
# which field a tag's layer id is read through (StepContext.tag keys; "shared" keys by their name)
_TAG_FIELDS = {"layer_in": "self", "layer_out": "self", "topk": "index", "candidates": "candidate",
               "global_rows": "index", "candidate_rows": "candidate"}
# LayerRole fields that hold layer ids (a guard on them expects the copy's ids)
_ROLE_REFS = {".role.layer_id": "self", ".role.kv_source": "kv", ".role.index_source": "index",
              ".role.candidate_source": "candidate"}


def _mapped(layer_map: dict, field: str, layer: int) -> int:
    """`layer` through `field` of a layer map; the candidate source's own candidates are read
    through "candidate" by Reindex layers but made by the source itself ("self")."""
    for f in (field, "self") if field == "candidate" else (field,):
        if layer in layer_map.get(f, {}):
            return layer_map[f][layer]
    return layer


def map_source(source: str, layer_map: dict) -> str:
    """A Dynamo source (or guard name) with its layer ids mapped: module paths under `layers`
    and the window ring through "self", the other per-layer caches through "kv"."""
    def sub(m):
        field = "self" if m.group(2) in (None, "window_kv", "window_scale") else "kv"
        return m.group(1) + str(_mapped(layer_map, field, int(m.group(3))))
    return _LAYER_IN_SOURCE.sub(sub, source)


def map_tag(tag: str, layer_map: dict) -> str:
    key = ast.literal_eval(tag)
    kind = key[1] if key[0] == "shared" else key[0]
    if kind not in _TAG_FIELDS:
        if _LAYER_IN_TAG.search(tag):
            raise StampRefused(f"tag {tag}: a layer id in a value of unknown kind {kind!r}")
        return tag
    return _LAYER_IN_TAG.sub(lambda m: f"'layer{_mapped(layer_map, _TAG_FIELDS[kind], int(m.group(1)))}'", tag)


def _module_stack_map(stack, layer_map: dict):
    """nn_module_stack with the layer's own id mapped (dumps and passes read it)."""
    if not stack:
        return stack
    pattern = re.compile(r"(layers[._\[']*)(\d+)")

    def sub(text: str) -> str:
        return pattern.sub(lambda m: m.group(1) + str(layer_map.get(int(m.group(2)), int(m.group(2)))), text)
    return {sub(k): (sub(path) if isinstance(path, str) else path, t) for k, (path, t) in stack.items()}


def _tag(node: fx.Node):
    return node.args[1] if node.op == "call_function" and node.target is STAMP_TAG else None


def _sym_key(node: fx.Node):
    val = node.meta.get("val")
    if isinstance(val, (torch.SymInt, torch.SymBool, torch.SymFloat)):
        return str(val.node.expr)
    return None


# ----------------------------------------------------------------------------- the stamper
class _Stamper:
    def __init__(self, gs: fx.GraphModule, sources: list, stamp: StampPlan, resolve, streams_of=()):
        self.gs, self.stamp, self.resolve, self.streams_of = gs, stamp, resolve, tuple(streams_of)
        nodes = list(gs.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        if len(self.placeholders) != len(sources):
            raise StampRefused(f"{len(self.placeholders)} graph inputs but {len(sources)} sources")
        self.source_of = dict(zip(self.placeholders, sources))
        self.regions = self._regions(nodes)
        self.graph = fx.Graph()
        self.sources: list[str] = []
        self.inputs: dict[str, fx.Node] = {}       # source -> placeholder of the new graph
        self.tagged: dict[str, fx.Node] = {}       # tag -> node of the new graph
        self.latest: dict[str, fx.Node] = {}       # cache source -> its latest value (new graph)
        self.symbols: dict[str, fx.Node] = {}      # symbolic expression -> node (new graph)
        self.outer: dict[fx.Node, fx.Node] = {}    # traced graph's inputs and prologue -> new graph
        self.fake_mode = None

    def _regions(self, nodes) -> dict:
        """Traced layer -> (first, last) node index: from its first layer_in tag to its last
        layer_out tag. Before the first region is the prologue (embedding, Engram ids), after
        the last the epilogue (head, write-backs); between two regions there must be no op."""
        spans = {}
        for i, n in enumerate(nodes):
            tag = _tag(n)
            if tag is None:
                continue
            key = ast.literal_eval(tag)
            if key[0] in ("layer_in", "layer_out"):
                layer = int(key[1][len("layer"):])
                start, end = spans.get(layer, (i, i))
                spans[layer] = (min(start, i), max(end, i))
        if sorted(spans) != list(self.stamp.traced):
            raise StampRefused(f"the traced graph has layers {sorted(spans)}, expected {list(self.stamp.traced)}")
        order = sorted(spans.values())
        for (_, end), (start, _) in zip(order, order[1:]):
            between = [n for n in nodes[end + 1:start] if n.op == "call_function"]
            if between:
                raise StampRefused(f"ops between two layers ({between[0].name}): a region boundary is unclear")
        self.nodes = nodes
        return spans

    # --------------------------------------------------------------- inputs
    def _input(self, source: str, like: fx.Node) -> fx.Node:
        """The new graph's input for `source` (made on first use, as the traced layer's `like`)."""
        if source in self.inputs:
            return self.inputs[source]
        mine, theirs = self.resolve(source), self.resolve(self.source_of[like])
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)) or (
                mine.shape, mine.stride(), mine.dtype, mine.device) != (
                theirs.shape, theirs.stride(), theirs.dtype, theirs.device):
            raise StampRefused(f"{source} does not match {self.source_of[like]} (shape, strides, dtype or device)")
        val = like.meta.get("val")
        if not isinstance(val, torch.Tensor) or any(not isinstance(d, int) for d in (*val.shape, *val.stride())):
            raise StampRefused(f"{self.source_of[like]} has symbolic sizes: a layer's own input must be static")
        with self.fake_mode:
            fresh = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        with self.graph.inserting_after(self._last_input):
            node = self.graph.placeholder(f"stamped_{len(self.sources)}")
        node.meta = {**like.meta, "val": fresh}
        self._last_input = node
        self.inputs[source] = node
        self.sources.append(source)
        self.latest.setdefault(source, node)
        return node

    def _version_source(self, node: fx.Node) -> str | None:
        """The cache source of a functionalized write's new value (getitem i >= 1 of an
        auto_functionalized_v2), None for any other node."""
        if node.op != "call_function" or node.target is not operator.getitem:
            return None
        write, index = node.args
        if not (isinstance(write, fx.Node) and write.op == "call_function" and write.target is auto_functionalized_v2):
            return None
        if index == 0:
            return None
        base = write.kwargs["_all_bases"][index - 1]
        if base.op != "placeholder":
            raise StampRefused(f"{write.name} writes {base.name}, which is not a graph input")
        return self.source_of[base]

    # --------------------------------------------------------------- copying
    def _lookup(self, a: fx.Node, env: dict, layer_map: dict, layer: int) -> fx.Node:
        if a in env:
            return env[a]
        if a.op == "placeholder":
            source = map_source(self.source_of[a], layer_map)
            return self.outer[a] if source == self.source_of[a] else self._input(source, a)
        if a in self.outer:
            return self.outer[a]
        tag = _tag(a)
        if tag is not None:
            mapped = map_tag(tag, layer_map)
            if mapped in self.tagged:
                return self.tagged[mapped]
            raise StampRefused(f"layer {layer} reads {mapped}, which no earlier layer made")
        source = self._version_source(a)
        if source is not None:
            mapped = map_source(source, layer_map)
            if mapped not in self.latest:
                raise StampRefused(f"layer {layer} reads {mapped} as written by another layer, which was not copied")
            return self.latest[mapped]
        key = _sym_key(a)
        if key is not None and key in self.symbols:
            return self.symbols[key]
        raise StampRefused(f"layer {layer} reads {a.name} ({a.target}) of another layer, which is neither a "
                           f"graph input, a tagged value, a cache write nor a symbolic size")

    def _copy(self, n: fx.Node, env: dict, layer_map: dict, layer: int, own: dict | None) -> None:
        """Copy node n of the traced graph into the new one (env: this copy's node map)."""
        tag = _tag(n)
        if tag is not None:
            key = ast.literal_eval(tag)
            name = map_tag(tag, layer_map)
            if name in self.tagged:              # a shared value an earlier layer built: that one
                env[n] = self.tagged[name]
                return
            if key[0] == "layer_in" and layer > 0:   # the previous layer's output, whichever it was
                value = self.tagged[repr(("layer_out", f"layer{layer - 1}", key[2]))]
            else:
                value = self._lookup(n.args[0], env, layer_map, layer)
            env[n] = self.tagged[name] = self.graph.call_function(STAMP_TAG, (value, name))
            env[n].meta = dict(n.meta)
            return
        key = _sym_key(n)
        if key is not None and key in self.symbols:
            env[n] = self.symbols[key]
            return
        copy = self.graph.node_copy(n, lambda a: self._lookup(a, env, layer_map, layer))
        copy.meta = dict(n.meta)
        if own:
            copy.meta["nn_module_stack"] = _module_stack_map(n.meta.get("nn_module_stack"), own)
            # a value object of its own: dumps find what a fused op replaced by value identity
            copy.meta["val"] = self._fresh(n.meta.get("val"))
        env[n] = copy
        if key is not None:
            self.symbols[key] = copy
        source = self._version_source(n)
        if source is not None:
            self.latest[map_source(source, layer_map)] = copy

    def _fresh(self, val):
        """A fake value like `val` (same sizes, symbolic ones included, strides and dtype)."""
        if isinstance(val, torch.Tensor):
            with self.fake_mode:
                return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
        if isinstance(val, (tuple, list)):
            return type(val)(self._fresh(v) for v in val)
        return val

    # --------------------------------------------------------------- the whole graph
    def run(self) -> tuple[fx.GraphModule, list]:
        from torch._guards import detect_fake_mode
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in self.placeholders
                                           if isinstance(n.meta.get("val"), torch.Tensor)])
        if self.fake_mode is None:
            raise StampRefused("the traced graph's inputs have no fake values")
        for ph in self.placeholders:
            node = self.graph.placeholder(ph.name)
            node.meta = dict(ph.meta)
            self.outer[ph] = node
            source = self.source_of[ph]
            self.inputs[source], self.latest[source] = node, node
            self.sources.append(source)
            key = _sym_key(ph)
            if key is not None:
                self.symbols.setdefault(key, node)
            self._last_input = node
        first_start = min(start for start, _ in self.regions.values())
        last_end = max(end for _, end in self.regions.values())
        prologue = [n for n in self.nodes[:first_start] if n.op != "placeholder"]
        for n in prologue:
            self._copy(n, self.outer, {}, -1, None)
        for layer in range(self.stamp.num_layers):
            traced = self.stamp.copied_from[layer]
            start, end = self.regions[traced]
            layer_map = self.stamp.layer_maps[layer]
            env: dict = {}
            for n in self.nodes[start:end + 1]:
                if n.op == "call_function" and n.target is COPY_ and n.args[0].op == "placeholder":
                    continue        # a mutated input's write-back: made for every cache below
                self._copy(n, env, layer_map, layer, {traced: layer} if traced != layer else None)
        last_traced, last = self.stamp.traced[-1], self.stamp.num_layers - 1
        epilogue_map = {"self": {last_traced: last}}
        env = dict(self.outer)
        output = None
        for n in self.nodes[last_end + 1:]:
            if n.op == "output":
                output = n
                break
            if n.op == "call_function" and n.target is COPY_ and n.args[0].op == "placeholder":
                continue
            self._copy(n, env, epilogue_map, last + 1, None)
        # AOT writes each mutated graph input back at the end (keep_inference_input_mutations)
        for source, node in self.inputs.items():
            value = self.latest[source]
            if value is not node:
                self.graph.call_function(COPY_, (node, value))
        outputs = fx.node.map_arg(output.args[0], lambda a: self._lookup(a, env, epilogue_map, last + 1))
        if self.streams_of:     # forward(return_streams=...): the streams leaving those layers too
            if not isinstance(outputs, (list, tuple)):
                raise StampRefused("the traced graph's output is not a tuple")
            missing = [w for w in self.streams_of if not 0 <= w <= last]
            if missing:
                raise StampRefused(f"return_streams: layer {missing[0]} is not a layer of the model")
            outputs = (*outputs, *(self.tagged[repr(("layer_out", f"layer{w}", "streams"))] for w in self.streams_of))
        self.graph.output(outputs)
        self._check_write_backs()
        strip_tags(self.graph)
        self.graph.eliminate_dead_code()
        self._drop_unread_inputs()
        from .backend import graph_module_like
        return graph_module_like(self.gs, self.graph), self.sources

    def _drop_unread_inputs(self) -> None:
        """A copy's build of a shared value that an earlier layer had built is dead code; an
        input made for it alone (the copied layer's own RoPE frequencies, say) is dropped with
        it, as a full trace would not have lifted it."""
        for source, node in list(self.inputs.items()):
            if not node.users and node.name.startswith("stamped_"):
                self.graph.erase_node(node)
                self.sources.remove(source)
                del self.inputs[source]

    def _check_write_backs(self) -> None:
        """Every input the traced graph wrote back is written back here too."""
        traced = {self.source_of[n.args[0]] for n in self.nodes
                  if n.op == "call_function" and n.target is COPY_ and n.args[0].op == "placeholder"}
        written = {s for s, node in self.inputs.items() if self.latest[s] is not node}
        missing = traced - written
        if missing:
            raise StampRefused(f"the traced graph writes back {sorted(missing)[0]}, the stamped one does not")


_STAMPING_ONLY = re.compile(r"stamp_layers|^return_streams\b")


def map_checks(checks: list, stamp: StampPlan) -> list:
    """Dynamo's guard checks of the traced layers (compile_cache.guards_from_entries) made the
    whole model's: each check naming a traced layer's modules or caches repeated for every
    layer copied from it, names mapped; checks on what the stamping call sees otherwise than
    the stamped graph's calls dropped: `stamp_layers` (unset when the stamped graph runs) and
    the `return_streams` argument (the stamping call omits it; the entry's signature holds the
    call's value, so a verify entry would otherwise refuse every later verify step)."""
    kept = [tuple(c) for c in checks if not _STAMPING_ONLY.search(c[1])]
    out, seen = list(kept), {repr(c) for c in kept}     # expected values may be lists
    naming = {}
    for c in kept:
        for m in _LAYER_IN_SOURCE.finditer(c[1]):
            naming.setdefault(int(m.group(3)), []).append(c)
    for layer, traced in stamp.copied_from.items():
        if layer == traced:
            continue
        layer_map = stamp.layer_maps[layer]
        for kind, name, expected in naming.get(traced, ()):
            field = next((f for suffix, f in _ROLE_REFS.items() if name.endswith(suffix)), None)
            if field is not None and expected[0] == "value" and isinstance(expected[1], int):
                expected = ("value", _mapped(layer_map, field, expected[1]))   # a layer id the role holds
            mapped = (kind, map_source(name, layer_map), expected)
            if repr(mapped) not in seen:
                seen.add(repr(mapped))
                out.append(mapped)
    return out


def strip_tags(graph: fx.Graph) -> int:
    """Remove every stamp_tag node (each is a copy of its input)."""
    tags = [n for n in graph.nodes if n.op == "call_function" and n.target is STAMP_TAG]
    for n in tags:
        n.replace_all_uses_with(n.args[0])
        graph.erase_node(n)
    return len(tags)


def stamp_graph(gs: fx.GraphModule, sources: list, stamp: StampPlan, resolve,
                streams_of=()) -> tuple[fx.GraphModule, list]:
    """The whole model's post-AOT graph from `gs`, the graph of the traced layers (with tags),
    and its inputs' sources; `resolve(source)` gives the value a source names in the call
    being compiled (to check each new input against the traced layer's). streams_of: layers
    whose outgoing streams become outputs after `gs`'s own (what forward's return_streams
    adds: a verify step's graph is the plain step's with these outputs). Raises StampRefused."""
    return _Stamper(gs, sources, stamp, resolve, streams_of).run()


__all__ = ["StampPlan", "StampRefused", "plan_stamping", "stamp_graph", "strip_tags", "layer_kind", "map_checks",
           "map_source", "map_tag"]
