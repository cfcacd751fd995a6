"""Cleanup: drop no-op nodes and dead code so the fusions see the plain pattern.

No-ops removed: `alias`, `clone` of a value nobody mutates, a dtype cast to the
value's own dtype, `view` to the same shape. Then dead-code elimination.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .base import GraphPass, cast_dtype, is_call

aten = torch.ops.aten


class Cleanup(GraphPass):
    name = "cleanup"

    def run(self, gm: fx.GraphModule) -> int:
        count = 0
        for node in list(gm.graph.nodes):
            if self._is_noop(node):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                count += 1
        before = len(gm.graph.nodes)
        gm.graph.eliminate_dead_code()
        return count + before - len(gm.graph.nodes)

    @staticmethod
    def _is_noop(node: fx.Node) -> bool:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
            return False
        src, val = node.args[0].meta.get("val"), node.meta.get("val")
        if src is None or val is None or not isinstance(val, torch.Tensor):
            return False
        if is_call(node, aten.alias.default):
            return True
        to = cast_dtype(node)
        if to is not None:
            return to == src.dtype
        if is_call(node, aten.view.default, aten.reshape.default):
            # guard_or_false: a size that cannot be guarded on (the unbacked batch of the shared
            # decode trace, e.g. in a collective's view) counts as different, not as an error
            same = len(val.shape) == len(src.shape) and all(
                guard_or_false(a == b) for a, b in zip(val.shape, src.shape))
            return same and val.dtype == src.dtype
        return False
