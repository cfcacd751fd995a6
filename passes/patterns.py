"""Matching helpers the fusion passes share (fuse_wkv_rmsnorm, fuse_pool_rmsnorm, fuse_rmsnorm).

`match_rmsnorm` finds an RMSNorm around an rsqrt node as the post-AOT graph spells it (a cast
`convert` is convert_element_type or _to_copy(dtype=), see base.cast_dtype):

    yf   = y | convert(y, f32)
    ms   = mean(pow(yf, 2) | mul(yf, yf), [-1], keepdim=True)
    nrm  = mul(yf, rsqrt(add(ms, eps)))
    out  = mul(g, nrm) | mul(nrm, g)              (g: the norm weight, maybe converted to f32)
    out  = out | convert(out, y.dtype)

and `RMSNormFusion` is the driver of the passes that fuse such a norm with what feeds it.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import GraphPass, cast_dtype, is_call

aten = torch.ops.aten


def node_val(node):
    """The node's fake value (`meta["val"]`); None for a non-node or a node without one."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def strip_convert(node, dtype=None):
    """(inner, cast_node_or_None) for an optional dtype cast (to `dtype` when given)."""
    to = cast_dtype(node)
    if to is not None and (dtype is None or to == dtype):
        return node.args[0], node
    return node, None


def transposed_weight(wt, mm: fx.Node):
    """w when `wt` is w transposed for a Linear's mm (`t(w)` or `permute(w, [1, 0])`) and feeds
    only that mm, else None."""
    if not (is_call(wt, aten.t.default) or (is_call(wt, aten.permute.default) and list(wt.args[1]) == [1, 0])):
        return None
    return wt.args[0] if single_user(wt, mm) else None


def single_user(node: fx.Node, user: fx.Node) -> bool:
    """`user` is the only user of `node`."""
    return list(node.users) == [user]


def match_rmsnorm(rsqrt: fx.Node):
    """The RMSNorm around an rsqrt node, as the post-AOT graph spells it:
    (normed input y before its optional fp32 upcast, output node, norm weight node, eps), or
    None. Requires keepdim over the last dim and that y (through the upcast) and every
    intermediate feed only the norm."""
    add = rsqrt.args[0]
    if not (is_call(add, aten.add.Tensor, aten.add.Scalar) and isinstance(add.args[1], (int, float))):
        return None
    eps, mean = float(add.args[1]), add.args[0]
    if not (is_call(mean, aten.mean.dim) and single_user(mean, add) and single_user(add, rsqrt)):
        return None
    square = mean.args[0]
    dims = list(mean.args[1]) if len(mean.args) > 1 else []
    keepdim = (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))
    if is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        yf = square.args[0]
    elif is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        yf = square.args[0]
    else:
        return None
    yv = node_val(yf)
    if yv is None or not keepdim or dims not in ([-1], [yv.dim() - 1]) or not single_user(square, mean):
        return None
    if len(rsqrt.users) != 1:
        return None
    norm = next(iter(rsqrt.users))
    if not (is_call(norm, aten.mul.Tensor) and set(norm.args) == {yf, rsqrt}):
        return None
    if set(yf.users) != {square, norm} or len(norm.users) != 1:
        return None
    scaled = next(iter(norm.users))
    if not is_call(scaled, aten.mul.Tensor) or len(scaled.args) != 2:
        return None
    g = scaled.args[0] if scaled.args[1] is norm else scaled.args[1]
    g_inner, _ = strip_convert(g)
    if not (isinstance(g_inner, fx.Node) and g_inner.op in ("placeholder", "get_attr")):
        return None
    out = scaled
    if len(scaled.users) == 1:
        (only,) = scaled.users
        if cast_dtype(only) is not None:
            out = only
    y, convert_in = strip_convert(yf, torch.float32)
    if convert_in is not None and not single_user(y, convert_in):
        return None
    return y, out, g_inner, eps


def replace_with(gm: fx.GraphModule, out: fx.Node, target, args, kind: str) -> fx.Node:
    """Insert target(*args) before `out` and take over its value and users (the caller drops
    what died, once: dead-code elimination walks the whole graph)."""
    with gm.graph.inserting_before(out):
        fused = gm.graph.call_function(target, args)
    # The fused op computes exactly `out`'s value, so its fake value is out's: taken over as
    # it is rather than propagated again (torch._inductor's FakeTensorUpdater would re-run the
    # fake kernels of every changed node, through an Inductor-internal API).
    fused.meta.update({k: v for k, v in out.meta.items() if k != "val"})
    fused.meta["val"] = out.meta.get("val")
    fused.meta["fused_from"] = kind
    out.replace_all_uses_with(fused)
    return fused


class RMSNormFusion(GraphPass):
    """Shared driver of the RMSNorm fusions: every rsqrt that `match_rmsnorm` accepts as an
    RMSNorm and whose surroundings `_match(y, out, weight, eps)` accepts becomes one `target`
    call; `_match` gets the norm's parts and returns (node to replace, call args) or None."""
    target = None
    kind = ""

    def run(self, gm: fx.GraphModule) -> int:
        count = 0
        for rsqrt in [n for n in gm.graph.nodes if is_call(n, aten.rsqrt.default)]:
            norm = match_rmsnorm(rsqrt)
            match = self._match(*norm) if norm is not None else None
            if match is not None:
                replace_with(gm, match[0], self.target, match[1], self.kind)
                count += 1
        if count:
            gm.graph.eliminate_dead_code()
        return count

    def _match(self, y: fx.Node, out: fx.Node, weight: fx.Node, eps: float):  # pragma: no cover
        raise NotImplementedError
