"""P1, last step: fold the compressor's state-ring write into the fused ratio-2 op.

After `fuse_pool_rmsnorm` and `defunctionalize` a ratio-2 compressor reads

    fused  = fused_ratio2_compressor(x, wkv, wgate, state, member_rows, g, eps, dtype)
    latent = getitem(fused, 0)
    rows   = getitem(fused, 1)                       [N, 2D] fp32, used only by the write
    ...
    state_write(dst=state, rows=state_rows, values=rows)      (in place)

and becomes

    latent = fused_ratio2_compressor_update(x, wkv, wgate, state, member_rows, state_rows,
                                            g, eps, dtype)     (reads the ring, then writes it)

placed where the write was, so `state_rows` is computed before it. On CUDA that is one
kernel for pooling, RMSNorm and the ring write, and the [N, 2D] rows never leave the GEMMs'
outputs. It runs after defunctionalize because before it the write is functional
(`auto_functionalized_v2`), and a mutating op cannot replace it there.

Refuses: rows with another user, a write into another tensor, a user of the latent placed
before the write, and any other node touching the state (or a view of it) between the read
and the write: a write there would change what the moved read sees. (A plain read there would
be harmless; refusing it keeps the rule simple, and the model has none.)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import GraphPass, is_call, returns_alias

ops = torch.ops.v41graph
READ = ops.fused_ratio2_compressor.default
UPDATE = ops.fused_ratio2_compressor_update.default
STATE_WRITE = ops.state_write.default


def _write_call(node: fx.Node) -> dict:
    """A state_write call's arguments by name, however the graph passes them."""
    return dict(zip(("dst", "rows", "values"), node.args), **node.kwargs)


class FuseRatio2StateWrite(GraphPass):
    name = "fuse_ratio2_state_write"

    def run(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        count = 0
        for fused in [n for n in graph.nodes if is_call(n, READ)]:
            match = self._match(fused, order)
            if match is None:
                continue
            latent, rows, write, state_rows = match
            x, wkv, wgate, state, member_rows, g, eps, dtype = fused.args
            with graph.inserting_before(write):
                update = graph.call_function(
                    UPDATE, (x, wkv, wgate, state, member_rows, state_rows, g, eps, dtype))
            update.meta.update({k: v for k, v in fused.meta.items() if k != "val"})
            update.meta["val"] = latent.meta.get("val")
            update.meta["fused_from"] = "ratio2 projections+pool+rmsnorm+state write"
            latent.replace_all_uses_with(update)
            for node in (write, rows, latent, fused):
                graph.erase_node(node)
            count += 1
        return count

    def _match(self, fused: fx.Node, order: dict):
        outputs = {u.args[1]: u for u in fused.users if is_call(u, operator.getitem)}
        if len(outputs) != len(fused.users) or set(outputs) != {0, 1}:
            return None
        latent, rows = outputs[0], outputs[1]
        if len(rows.users) != 1:
            return None
        (write,) = rows.users
        if not is_call(write, STATE_WRITE):
            return None
        call = _write_call(write)
        state = fused.args[3]
        if call.get("dst") is not state or call.get("values") is not rows:
            return None
        if any(order[u] < order[write] for u in latent.users):
            return None
        lo, hi = order[fused], order[write]
        if any(lo < order[u] < hi for a in _aliases(state) for u in a.users):
            return None
        return latent, rows, write, call["rows"]


def _aliases(node: fx.Node) -> list:
    """node and every view of it (transitively): what shares its memory."""
    found = [node]
    for n in found:                       # grows while it is walked
        found += [u for u in n.users if returns_alias(u) and u not in found]
    return found
