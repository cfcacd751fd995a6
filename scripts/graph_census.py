"""Count what a decode step launches, on the CPU: the tiny model in released formats (FP8
projections, MXFP4 experts packed, numerics "released"), compiled with our passes, one decode
step at batch 1; the decode graph's call_function nodes, the ones that become kernels on a GPU
(aliases by their op's schema, stream and event bookkeeping and empty allocations left out) and
those per layer. A proxy for the launches of a CUDA-graph replay between device sessions; it says
nothing about their cost.

    python scripts/graph_census.py                   # totals and kernel nodes per layer
    python scripts/graph_census.py --layer 4         # layer 4's kernel nodes, one per line
    python scripts/graph_census.py --ops             # every op's count
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))      # the pass harness the compiler tests use


def launches(node) -> bool:
    """Whether a call_function node becomes a kernel on the GPU: not a view or tuple item
    (passes/base.returns_alias), not a stream op's bookkeeping, not an empty allocation."""
    import torch

    from v41graph.custom_ops.streams import STREAM_OPS
    from v41graph.passes.base import returns_alias
    return not (returns_alias(node) or node.target in STREAM_OPS or node.target is torch.ops.aten.empty.memory_format)


def op_name(node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def decode_graph():
    import torch

    import v41graph
    from compile_harness import CompiledSession, PassHarness
    from v41graph.model.layers import default_dtype
    from v41graph.model.model import V41Model, init_random_
    from v41graph.model.moe import pack_moe_experts_

    cfg = v41graph.V41Config.tiny(weight_format="checkpoint", torch_dtype="bfloat16")
    with default_dtype(torch.bfloat16):
        model = init_random_(V41Model(cfg), seed=3).eval().requires_grad_(False)
    model.set_numerics("released")
    pack_moe_experts_(model)
    harness = PassHarness(None)
    session = CompiledSession(model, harness.compile(model, dynamic=False), 1, 64, block_size=16)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    session.decode(session.prefill(ids).argmax(-1).view(1, 1))
    return model, harness.after(len(harness.traced) - 1)


def layers_of(nodes) -> list[list]:
    """Kernel nodes split into [before layer 0, layer 0, layer 1, ...]: a layer starts at its
    attention side's mhc_pre (two per layer). Trees older than the mhc_pre op give one list."""
    out, n_pre = [[]], 0
    for n in nodes:
        if op_name(n) == "mhc_pre":
            n_pre += 1
            if n_pre % 2 == 1:
                out.append([])
        out[-1].append(n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layer", type=int, help="list this layer's kernel nodes")
    ap.add_argument("--ops", action="store_true", help="every op's count in the decode graph")
    args = ap.parse_args()
    model, graph = decode_graph()
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    kernels = [n for n in calls if launches(n)]
    layers = layers_of(kernels)
    print(f"decode graph: {len(calls)} call_function nodes, {len(kernels)} kernel nodes "
          f"({len(layers[0])} before layer 0)")
    for i, (block, nodes) in enumerate(zip(model.layers, layers[1:])):
        role = block.role
        print(f"  layer {i:2d} {role.mode:8s} ratio {role.ratio}: {len(nodes)}")
    if args.layer is not None:
        for n in layers[args.layer + 1]:
            val = n.meta.get("val")
            print(f"    {n.name:40s} {op_name(n):28s} {tuple(val.shape) if hasattr(val, 'shape') else ''}")
    if args.ops:
        for name, count in collections.Counter(op_name(n) for n in calls).most_common():
            print(f"  {count:6d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
