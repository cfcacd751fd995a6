"""P8: overlap every functional collective with independent work (issue early, wait late).

Dynamo + AOT spell `v41graph.parallel`'s collectives as a `_c10d_functional.<collective>` node
followed at once by its `wait_tensor`: nothing runs while the bytes travel. This pass reorders
the graph, and only reorders, so that each collective

  * is issued as early as its inputs allow (its input chain is scheduled first),
  * is waited for as late as possible: just before the first node that needs its result,
  * has the work that does not depend on it in between. In the tiny model's rank graphs
    (2 ranks, decode): under DP attention + expert parallelism (`MoE._dispatch_combine`) the
    shared expert and the layer's next mHC coefficients (`hc_ffn`: norm, projection, Sinkhorn)
    and comb mixing run between the dispatch all-to-all (tokens and routing in one) and its
    wait. The combine all-to-all's window stays empty: all the independent work is already
    behind the dispatch, and everything after the combine needs its result; splitting the work
    between the windows would need a cost model.
    Under TP: `expand`'s comb mixing (which does not read the attention output) behind the
    wo_b all-reduce, the next `hc_ffn` coefficients behind the MoE all-reduce, the query
    projection `wq_b` + RoPE behind the indexer's partial-score all-gather, step metadata and
    the first `hc_attn` behind the embedding all-reduce (25 of 26; the head's all-gather has
    nothing after it). Under TP the shared expert is no independent work: its partial sum is
    part of the MoE all-reduce's input.

How: the graph is cut into runs at barriers (nodes that write memory, stream/event ops and
everything on a side stream, i.e. P4/P6's regions, collectives refused below, other c10d ops,
impure or random nodes, placeholders and the output). Only nodes inside one run move, so no node
crosses a cache write, a stream boundary or an event, and the values every node reads are the
ones it read before. A run with a usable collective is list-scheduled: the next collective (in
the original order) as soon as it is ready, else its ready input chain, else the earliest ready
other node (in original order: independent of every collective still in flight, since a node
that needs one is not ready until its wait is placed), and a wait only when nothing else can run
(the wait whose first user comes first). Runs without a collective are left as they are, so a
single-device graph is untouched.

Refused (left where traced, counted in `refused`, and a barrier): a collective whose result
has any user but exactly one `wait_tensor`, whose wait is not in its run (a cache write, stream
op or other barrier lies between them: the collective may still be reading an input that the
write changes), or that runs on a side stream. Collectives keep their exact relative order:
every rank must issue them in the same order or NCCL deadlocks (the graph is the same on every
rank and the schedule depends only on it; the pass checks the order after rewriting and raises
if it changed, which would be a bug here).

Why no side stream (unlike P4 / P6): on NCCL a collective already runs on the process group's
own stream once issued (the NCCL stream waits for the producer on the current stream,
`wait_tensor` makes the current stream wait for the NCCL stream), and under CUDA-graph capture
those are graph edges; so placing independent work between issue and wait is the whole
overlap of transfer and compute. A P6-style fork of the shared expert onto an aux stream would
add only compute / compute overlap with the routed experts: both are GEMMs reading weights at
decode sizes (bandwidth-bound), the fork/join adds events, and it has not been measured. The
pass therefore changes no stream label and adds no node; the stream check sees what P4 / P6 left.
(torch's own comm reordering, `torch._inductor.comms`, works on Inductor's scheduler nodes;
our executor runs the FX graph as it stands, so the reordering has to happen in FX.)

It runs after the stream passes, just before the stream check: P4 / P6 move whole groups and
place their joins from the graph's data flow, so running last lets this pass see every fork
and join as a barrier and guarantee the collective order and the regions of the final graph.
`matched_count`: collectives with work placed between issue and wait that was not there before.
"""
from __future__ import annotations

import heapq

import torch
import torch.fx as fx

from v41graph.custom_ops.streams import STREAM_OPS
from .base import MAIN_STREAM, STREAM_KEY, GraphPass, writes_memory

c10d = torch.ops._c10d_functional
# Collectives that return one new tensor and are completed by one wait_tensor on it.
COLLECTIVES = frozenset(getattr(c10d, name).default for name in (
    "all_reduce", "all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor", "broadcast")
    if hasattr(c10d, name))
WAIT = c10d.wait_tensor.default
# Any op of these namespaces talks to other ranks (or waits on them): never crossed when not
# one of COLLECTIVES / WAIT (coalesced variants, in-place or legacy c10d ops, DTensor's).
COMM_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor")


def is_comm(node: fx.Node) -> bool:
    """The node is a collective or waits on one (any op of COMM_NAMESPACES)."""
    return node.op == "call_function" and getattr(node.target, "namespace", None) in COMM_NAMESPACES


def _single_wait(node: fx.Node) -> "fx.Node | None":
    """The one wait_tensor of collective `node`, if that is its only user."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target is WAIT \
            and users[0].args[0] is node:
        return users[0]
    return None


def _movable(node: fx.Node) -> bool:
    """A node that may change places inside a run: pure main-stream work (or a constant)."""
    if node.op == "get_attr":
        return True
    if node.op != "call_function" or node.target in STREAM_OPS:
        return False
    if node.meta.get(STREAM_KEY, MAIN_STREAM) != MAIN_STREAM or node.meta.get("side_tag"):
        return False
    if is_comm(node):
        return True          # decided by run(): usable collectives and their waits move
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:   # reordering would change the random draws
        return False
    return not writes_memory(node) and not node.is_impure()


def _between(first: fx.Node, last: fx.Node):
    """The nodes strictly between `first` and `last` (graph order)."""
    node = first.next
    while node is not last:
        yield node
        node = node.next


class OverlapCollectives(GraphPass):
    name = "overlap_collectives"

    def run(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        comm_before = [n for n in graph.nodes if is_comm(n) and n.target is not WAIT]
        # Usable collectives: exactly one wait, both movable, only movable nodes between them
        # (a refused collective is a barrier, so refusing one can refuse another: repeat).
        wait_of = {n: _single_wait(n) for n in comm_before if n.target in COLLECTIVES}
        wait_of = {n: w for n, w in wait_of.items() if w is not None and _movable(n) and _movable(w)}
        while True:
            waits = set(wait_of.values())
            blocked = [n for n, w in wait_of.items()
                       if not all(self._free(m, wait_of, waits) for m in _between(n, w))]
            if not blocked:
                break
            for n in blocked:
                del wait_of[n]
        self.refused = len(comm_before) - len(wait_of)
        if not wait_of:
            return 0

        matched = 0
        run: list = []
        for node in list(graph.nodes):
            if self._free(node, wait_of, waits):
                run.append(node)
                continue
            matched += self._reorder(run, wait_of)
            run = []
        matched += self._reorder(run, wait_of)
        comm_after = [n for n in graph.nodes if is_comm(n) and n.target is not WAIT]
        if comm_after != comm_before:   # cannot happen: each run issues its collectives in order
            raise RuntimeError("overlap_collectives changed the order of the collectives")
        return matched

    @staticmethod
    def _free(node: fx.Node, wait_of: dict, waits: set) -> bool:
        """The node may move inside its run: a usable collective, its wait, or movable work."""
        if is_comm(node):
            return node in wait_of or node in waits
        return _movable(node)

    # ------------------------------------------------------------------ one run
    @staticmethod
    def _reorder(run: list, wait_of: dict) -> int:
        """List-schedule `run` (consecutive movable nodes) in place; returns how many of its
        collectives got work between issue and wait that was not there before."""
        collectives = [n for n in run if n in wait_of]
        if not collectives:
            return 0
        index = {n: i for i, n in enumerate(run)}
        waits = {wait_of[c]: c for c in collectives}
        preds = {n: {i for i in n.all_input_nodes if i in index} for n in run}
        users = {n: [u for u in n.users if u in index] for n in run}
        missing = {n: len(preds[n]) for n in run}
        # a wait is placed when nothing else can run; first the one whose first user comes first
        first_use = {w: min((index[u] for u in users[w]), default=len(run)) for w in waits}

        placed: set = set()

        def ancestors(node) -> set:
            """The not yet placed nodes `node` needs (placed ones end the walk: linear overall
            on a chain of layers)."""
            seen, stack = set(), [p for p in preds[node] if p not in placed]
            while stack:
                n = stack.pop()
                if n not in seen:
                    seen.add(n)
                    stack.extend(p for p in preds[n] if p not in placed)
            return seen

        queue_c = list(collectives)
        target = queue_c.pop(0)
        feeds = ancestors(target)        # the next collective's input chain
        ready_feed, ready_other, ready_wait = [], [], []

        def push(n):
            if n in waits:
                heapq.heappush(ready_wait, (first_use[n], index[n]))
            elif n in wait_of:
                pass                      # collectives are taken in order, below
            elif n in feeds:
                heapq.heappush(ready_feed, index[n])
            else:
                heapq.heappush(ready_other, index[n])

        for n in run:
            if missing[n] == 0:
                push(n)
        order = []
        while len(order) < len(run):
            if target is not None and missing[target] == 0:
                pick = target
                target = queue_c.pop(0) if queue_c else None
                feeds = ancestors(target) if target is not None else set()
                regroup = ready_feed + ready_other
                ready_feed = [i for i in regroup if run[i] in feeds]
                ready_other = [i for i in regroup if run[i] not in feeds]
                heapq.heapify(ready_feed)
                heapq.heapify(ready_other)
            elif ready_feed:
                pick = run[heapq.heappop(ready_feed)]
            elif ready_other:
                pick = run[heapq.heappop(ready_other)]
            else:
                pick = run[heapq.heappop(ready_wait)[1]]
            order.append(pick)
            placed.add(pick)
            for u in users[pick]:
                missing[u] -= 1
                if missing[u] == 0:
                    push(u)
        # Move the nodes into the new order (the run stays between the same barriers).
        anchor = run[0].prev
        for n in order:
            anchor.append(n)
            anchor = n
        matched = 0
        position = {n: i for i, n in enumerate(order)}
        for c in collectives:
            between = set(order[position[c] + 1:position[wait_of[c]]])
            before = set(run[index[c] + 1:index[wait_of[c]]])
            if between - before:
                matched += 1
        return matched
