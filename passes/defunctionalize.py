"""Defunctionalize: turn functionalized cache writes back into in-place calls.

aot_autograd functionalizes our mutating custom ops (window/global/index-K writes, state
writes): the graph holds `auto_functionalized_v2(op, ..., _all_bases=[cache, ...])`, reads the
new cache from its outputs and ends with `copy_(cache, new_cache)`. Executed as is that clones
every cache on every step. This pass calls the op in place on the graph inputs instead, points
every later reader at the input itself and drops the trailing copy_.

It only rewrites a write whose bases are graph inputs that nothing reads after the write
through the old value (true for the model: reads of a cache come before its write in program
order); anything else is left functional and counted in `refused`, which the pass record reports
(`refused`, only where there are any: each one is a cache cloned on every step).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized_v2

from .base import GraphPass, is_call

COPY_ = torch.ops.aten.copy_.default


class Defunctionalize(GraphPass):
    name = "defunctionalize"

    def run(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        writes = [n for n in graph.nodes if is_call(n, auto_functionalized_v2)]
        self.refused = 0
        for node in writes:
            op, kwargs = node.args[0], dict(node.kwargs)
            bases = kwargs.pop("_all_bases")
            if not self._safe(node, bases, order) or any(k.endswith(("_size", "_stride", "_storage_offset"))
                                                         and v is not None for k, v in kwargs.items()):
                self.refused += 1
                continue
            call_kwargs = {}
            for k, v in kwargs.items():
                if k.endswith("_base_index"):
                    call_kwargs[k[1:-len("_base_index")]] = bases[v]
                else:
                    call_kwargs[k] = v
            with graph.inserting_before(node):
                call = graph.call_function(op, (), call_kwargs)
            call.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            call.meta["defunctionalized"] = True
            order[call] = order[node]   # a later write of the same base (_safe) sees where it reads
            for user in list(node.users):
                assert is_call(user, operator.getitem)
                idx = user.args[1]
                if idx == 0:            # the op's own (None) result
                    user.replace_all_uses_with(call)
                    graph.erase_node(user)
                    continue
                base = bases[idx - 1]
                for reader in list(user.users):
                    if is_call(reader, COPY_) and reader.args[0] is base and reader.args[1] is user:
                        graph.erase_node(reader)        # copy_(cache, cache) is a no-op
                user.replace_all_uses_with(base)
                graph.erase_node(user)
            graph.erase_node(node)
        return len(writes) - self.refused         # every functional write is rewritten or refused

    @staticmethod
    def _safe(node: fx.Node, bases: list, order: dict) -> bool:
        for base in bases:
            if base.op != "placeholder":
                return False
            for reader in base.users:
                if reader is node or is_call(reader, COPY_):
                    continue
                if order[reader] > order[node]:   # a later read of the OLD value
                    return False
        return True
