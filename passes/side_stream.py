"""Shared mechanics of the stream passes (P4 hoist_engram, P6 dual_stream).

`exclusive_ancestors` grows a set of target nodes by every producer used only by the set, and
`move_to_side_stream` moves such a group to the earliest point where its inputs are ready and
wraps it in a fork/join closure of stream and event ops:

    event_record(fork:T); stream_enter(aux:S); event_wait(fork:T)
    <group, in its original relative order>
    event_record(join:T); stream_exit()
    ... main-stream nodes (these overlap the group) ...
    event_wait(join:T)     before the first main node that uses the group's results or
                           touches a cache the group writes (else before the output)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from v41graph.custom_ops.streams import STREAM_OPS
from .base import MAIN_STREAM, STREAM_KEY, written_args

ops = torch.ops.v41graph


def exclusive_ancestors(targets: list) -> set:
    """targets plus every call_function producer whose users all lie in the set."""
    group = set(targets)
    changed = True
    while changed:
        changed = False
        for node in list(group):
            for inp in node.all_input_nodes:
                if inp in group or inp.op != "call_function" or inp.target in STREAM_OPS:
                    continue
                if all(u in group for u in inp.users):
                    group.add(inp)
                    changed = True
    return group


def move_to_side_stream(gm: fx.GraphModule, group: set, stream: str, tag: str) -> None:
    """Move `group` onto side stream `stream` with fork/join events named after `tag`."""
    graph = gm.graph
    nodes = [n for n in graph.nodes if n in group]
    order = {n: i for i, n in enumerate(graph.nodes)}
    written = list(dict.fromkeys(b for n in nodes for b in written_args(n)))   # ordered: deterministic dumps
    # Dependencies: inputs from outside the group, and earlier readers of caches it writes.
    deps = [i for n in nodes for i in n.all_input_nodes if i not in group]
    first = order[nodes[0]]
    deps += [u for b in written for u in b.users if u not in group and order[u] < first]
    anchor = max(deps, key=lambda d: order[d]) if deps else None
    # Place the group right after its last dependency (never before the placeholders).
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if anchor is None or order[anchor] < order[placeholders[-1]]:
        anchor = placeholders[-1]
    # A dependency inside another side-stream region: start after that region closes, and
    # wait for its join event (it may run on another stream).
    waits = []
    for d in deps:
        label = d.meta.get(STREAM_KEY, MAIN_STREAM)
        if label != MAIN_STREAM and d.meta.get("side_tag") not in waits:
            waits.append(d.meta["side_tag"])
    if anchor.meta.get(STREAM_KEY, MAIN_STREAM) != MAIN_STREAM:
        while not (anchor.op == "call_function" and anchor.target == ops.stream_exit.default):
            anchor = anchor.next
    cursor = anchor

    def emit(target, *args):
        nonlocal cursor
        with graph.inserting_after(cursor):
            node = graph.call_function(target, args)
        cursor = node
        return node

    fork = emit(ops.event_record.default, f"fork:{tag}")
    fork.meta[STREAM_KEY] = MAIN_STREAM
    label = f"aux:{stream}"
    emit(ops.stream_enter.default, label).meta[STREAM_KEY] = label
    for wait_tag in [tag] + waits:
        prefix = "fork" if wait_tag == tag else "join"
        emit(ops.event_wait.default, f"{prefix}:{wait_tag}").meta[STREAM_KEY] = label
    inputs = _tensor_nodes(dict.fromkeys(deps))
    if inputs:
        emit(ops.mark_stream_use.default, inputs).meta[STREAM_KEY] = label
    for n in nodes:
        cursor.append(n)
        cursor = n
        n.meta[STREAM_KEY] = label
        n.meta["side_tag"] = tag
    emit(ops.event_record.default, f"join:{tag}").meta[STREAM_KEY] = label
    emit(ops.stream_exit.default).meta[STREAM_KEY] = MAIN_STREAM
    # Join before the first main-stream consumer of the group's results or caches.
    order = {n: i for i, n in enumerate(graph.nodes)}
    consumers = [u for n in nodes for u in n.users if u not in group]
    consumers += [u for b in written for u in b.users if u not in group and order[u] > order[cursor]]
    consumers = [c for c in consumers if order[c] > order[cursor]]
    join_at = min(consumers, key=lambda c: order[c]) if consumers else next(
        n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(join_at):
        wait = graph.call_function(ops.event_wait.default, (f"join:{tag}",))
        outputs = _tensor_nodes(dict.fromkeys(n for n in nodes if any(u not in group for u in n.users)))
        if outputs:
            graph.call_function(ops.mark_stream_use.default, (outputs,)).meta[STREAM_KEY] = MAIN_STREAM
    wait.meta[STREAM_KEY] = MAIN_STREAM


def _tensor_nodes(nodes) -> list:
    """The nodes among `nodes` whose value is a single tensor."""
    return [n for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
