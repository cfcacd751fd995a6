"""Where tracing time goes (issue 24): the released 40-layer plan at tiny widths, traced once on the CPU.

    python scripts/bench_trace.py                              # the default one-graph trace
    python scripts/bench_trace.py --share-decode-graph False   # a static-shape trace, to compare
    python scripts/bench_trace.py --profile /tmp/trace.prof    # + cProfile: Dynamo vs AOT parts
    python scripts/bench_trace.py --roles                      # + which layers trace the same ops
    python scripts/bench_trace.py --duplicates                 # + computations the graph repeats
    python scripts/bench_trace.py --stamp-layers False         # trace all 40 layers (no stamping)

Tracing (Dynamo + AOT autograd + our passes) is host work whose cost follows the op count and
the symbolic shapes, not the tensor widths, so this stands in for the GPU host's cold trace
(bench config, ~54 s on an H200 host) without a GPU. The config is tiny()'s widths with the
released model's layer plan (40 layers, its compress ratios, KV / index / candidate sources,
Engram layers and DSpark targets). One prefill of 3 sequences traces the graph every decode
bucket then shares; the script prints the trace time (by default the layer-stamping route:
the first layer of each kind traced, the others stamped, compiler/stamp.py; --stamp-layers
False traces every layer, as before) and, with --profile, the cumulative time
of Dynamo's symbolic execution, AOT's metadata pass and AOT's graph capture. --roles groups the
layers of the untouched post-AOT graph by their op sequence (a node's layer from its
nn_module_stack) and counts the edges from a layer into a later, non-adjacent one: what
tracing one layer per role and stamping it into the others would have to reproduce.
--duplicates counts the deterministic, side-effect-free computations of that graph that repeat
an earlier one exactly (same op, same inputs, same constants): what a common-subexpression pass
would remove, split into views (no kernel) and the rest (a kernel each on the GPU).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import re
import time

os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch  # noqa: E402

import v41graph  # noqa: E402
from v41graph.model.config import V41Config  # noqa: E402
from v41graph.model.model import V41Model, init_random_  # noqa: E402
from v41graph.runtime.session import Session  # noqa: E402

# (label, function whose cumulative time it is) in the profile
PARTS = (("AOT autograd (all)", "aot_module_simplified"),
         ("AOT metadata pass", "create_aot_state"),
         ("AOT graph capture", "aot_stage1_graph_capture"),
         ("our backend: passes + lowering", "fw_compiler"),
         ("fake-tensor cache hits rebuilt", "_get_output_tensor_from_cache_entry"),
         ("SymNode arithmetic", "binary_magic_impl"))


def released_plan_at_tiny_widths() -> V41Config:
    full = V41Config()
    return V41Config.tiny(num_hidden_layers=full.num_hidden_layers, compress_ratios=full.compress_ratios,
                          kv_source_layer_ids=full.kv_source_layer_ids,
                          index_source_layer_ids=full.index_source_layer_ids,
                          candidate_source_layer_id=full.candidate_source_layer_id,
                          engram_layer_ids=full.engram_layer_ids,
                          dspark_target_layer_ids=full.dspark_target_layer_ids)


def layer_roles(gm) -> tuple[dict, collections.Counter, int]:
    """({op sequence: [layer, ...]}, {(from layer, to layer): edges} for edges into a later,
    non-adjacent layer, call_function nodes outside any layer) of a post-AOT graph."""
    layer_path = re.compile(r"layers[.\[_](\d+)")
    layer_of = {}
    for node in gm.graph.nodes:
        found = [layer_path.search(str(path)) for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        found = [int(m.group(1)) for m in found if m]
        layer_of[node] = found[-1] if found else None
    ops = collections.defaultdict(list)
    outside = 0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            if layer_of[node] is None:
                outside += 1
            else:
                ops[layer_of[node]].append(str(node.target))
    roles = collections.defaultdict(list)
    for layer in sorted(ops):
        roles[tuple(ops[layer])].append(layer)
    cross = collections.Counter()
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            a, b = layer_of[arg], layer_of[node]
            if a is not None and b is not None and b > a + 1:
                cross[(a, b)] += 1
    return roles, cross, outside


def duplicate_computations(gm) -> collections.Counter:
    """{(op, is a view): count} of the call_function nodes of `gm` that repeat an earlier node
    exactly: the same aten op on the same input nodes (a repeat's inputs count as the node it
    repeats) with the same constants. Only ops that always give the same bits for the same inputs
    and change nothing count: not impure ones (mutation, side effects), not random ones, not
    those torch tags as bitwise nondeterministic."""
    skip = (torch.Tag.nondeterministic_seeded, torch.Tag.nondeterministic_bitwise)
    first, same_as, found = {}, {}, collections.Counter()

    def key(value):
        if isinstance(value, torch.fx.Node):
            return same_as.get(value, value)
        if isinstance(value, (list, tuple)):
            return tuple(key(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, key(v)) for k, v in value.items()))
        return (type(value).__name__, repr(value))

    for node in gm.graph.nodes:
        op = node.target
        if (node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or node.is_impure()
                or any(t in op.tags for t in skip)):
            continue
        signature = (op, key(node.args), key(node.kwargs))
        if signature in first:
            same_as[node] = first[signature]
            found[(str(op), op.is_view)] += 1
        else:
            first[signature] = node
    return found


def parse_share(value: str):
    choices = {"all": "all", "True": True, "False": False}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"--share-decode-graph must be one of {', '.join(choices)}, got {value!r}")
    return choices[value]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share-decode-graph", type=parse_share, default="all", help="all (default), True or False")
    ap.add_argument("--stamp-layers", choices=("True", "False"), default="True",
                    help="trace the first layer of each kind and stamp the others (default True)")
    ap.add_argument("--profile", default=None, metavar="OUT.prof", help="cProfile the trace into this file")
    ap.add_argument("--roles", action="store_true", help="group the traced layers by their op sequence")
    ap.add_argument("--duplicates", action="store_true", help="count the computations the graph repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = released_plan_at_tiny_widths()
    model = init_random_(V41Model(cfg), seed=0).eval()
    compiled = v41graph.compile(model, backend="cpu", batch_sizes=(4,), compile_cache=False,
                                share_decode_graph=args.share_decode_graph,
                                stamp_layers=args.stamp_layers == "True")
    session = Session(compiled, 3, 48, block_size=16)
    prompt = torch.randint(0, cfg.vocab_size, (3, 9), generator=torch.Generator().manual_seed(5))
    profile = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    session.prefill(prompt)
    if profile:
        profile.disable()
    trace_s = time.perf_counter() - t0
    print(f"{cfg.num_hidden_layers} layers, share_decode_graph={args.share_decode_graph!r}, "
          f"stamp_layers={args.stamp_layers}: first prefill (one trace) {trace_s:.1f} s; our passes "
          f"{compiled.timings['passes_s']:.2f} s")
    if "stamp" in compiled.notes:
        print(f"  {compiled.notes['stamp']}: trace {compiled.timings['stamp_trace_s']:.1f} s, "
              f"stamping {compiled.timings['stamp_s']:.1f} s")
    if profile:
        profile.dump_stats(args.profile)
        stats = pstats.Stats(args.profile).stats     # {(file, line, name): (cc, nc, tt, ct, callers)}
        for label, name in PARTS:
            cumulative = max((v[3] for k, v in stats.items() if k[2] == name), default=0.0)
            print(f"  {label:32s} {cumulative:7.1f} s")
        print(f"  (Dynamo's own work is the rest of the {trace_s:.1f} s; profile in {args.profile})")
    if args.roles:
        roles, cross, outside = layer_roles(compiled.traced[0].untouched)
        print(f"{len(roles)} distinct layer op sequences over {cfg.num_hidden_layers} layers "
              f"({outside} ops outside the layers):")
        for sequence, layers in roles.items():
            print(f"  {len(sequence):4d} ops: layers {layers}")
        sources = collections.Counter(a for a, _ in cross.elements())
        print(f"edges into a later, non-adjacent layer: {sum(cross.values())}, from layers "
              + ", ".join(f"{a} ({n})" for a, n in sorted(sources.items())))
    if args.duplicates:
        gm = compiled.traced[0].untouched
        found = duplicate_computations(gm)
        nodes = sum(n.op == "call_function" for n in gm.graph.nodes)
        views = sum(c for (_, view), c in found.items() if view)
        print(f"{sum(found.values())} of {nodes} call_function nodes repeat an earlier one ({views} views, "
              f"{sum(found.values()) - views} others):")
        for (op, view), count in found.most_common(15):
            print(f"  {count:5d} {op}{' (view)' if view else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
