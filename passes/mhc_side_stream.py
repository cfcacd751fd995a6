"""P9 (opt-in): each sub-layer's mHC predictor on a side stream, beside the sub-layer it serves.

`mhc_pre` gives a sub-layer two things from one read of the streams: its input (the collapse
with the previous predictor's `pre`) and its own predictor's (pre, post, comb). Only the input
is needed to start the sub-layer; post and comb are first read by the sub-layer's `mhc_post`,
pre by the next sub-layer's collapse. So the predictor (K-sliced dot products over the 20480
flattened stream columns, then a serial 20-round Sinkhorn per token: ~22 µs a call at one token
on an H100, 80 calls a step) need not sit on the main stream. This pass splits every mhc_pre
node into

    mhc_collapse(streams, pre_prev)                              main stream (one short launch)
    mhc_predict(streams, fn, scale, base, ...) -> pre, post, comb   side stream "mhc"

forked as soon as the streams exist and joined before the first consumer of pre / post / comb
(the sub-layer's mhc_post). The two ops are mhc_pre's own arithmetic, so every value is
unchanged; the streams are read twice instead of once (2.6 MB at 64 tokens).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import GraphPass, is_call
from .side_stream import exclusive_ancestors, move_to_side_stream

ops = torch.ops.v41graph


class MhcSideStream(GraphPass):
    name = "mhc_side_stream"

    def run(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        count = self.refused = 0
        for node in [n for n in graph.nodes if is_call(n, ops.mhc_pre.default)]:
            if node.kwargs or len(node.args) != 9 or any(
                    not (u.op == "call_function" and u.target is operator.getitem) for u in node.users):
                self.refused += 1   # not the positional schema, or a use of the whole tuple: left alone
                continue
            streams, pre_prev, fn, scale, base, *rest = node.args
            with graph.inserting_before(node):
                collapse = graph.call_function(ops.mhc_collapse.default, (streams, pre_prev))
                predict = graph.call_function(ops.mhc_predict.default, (streams, fn, scale, base, *rest))
            for new in (collapse, predict):
                new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            val = node.meta.get("val")
            if val is not None:
                collapse.meta["val"], predict.meta["val"] = val[0], tuple(val[1:])
            outputs = []
            for user in list(node.users):
                index = user.args[1]
                if index == 0:
                    user.replace_all_uses_with(collapse)
                    graph.erase_node(user)
                else:
                    user.args = (predict, index - 1)
                    outputs.append(user)
            graph.erase_node(node)
            move_to_side_stream(gm, exclusive_ancestors([predict, *outputs]), "mhc", f"mhc.{count}")
            count += 1
        return count
