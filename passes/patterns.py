"""Matching helpers the fusion passes share (fuse_wkv_rmsnorm, fuse_pool_rmsnorm, fuse_rmsnorm).

`match_rmsnorm` finds an RMSNorm around an rsqrt node as the post-AOT graph spells it (a cast
`convert` is convert_element_type or _to_copy(dtype=), see base.cast_dtype):

    yf   = y | convert(y, f32)                    (the math in fp32)
    ms   = mean(pow(yf, 2) | mul(yf, yf), [-1], keepdim=True)
    nrm  = mul(yf, rsqrt(add(ms, eps)))
    nrm  = nrm | convert(nrm, y.dtype)            (Llama: cast before the weight multiply)
    out  = mul(g, nrm) | mul(nrm, g)              (g: the norm weight, maybe converted to f32)
    out  = out | convert(out, y.dtype)

and `RMSNormFusion` is the driver of the passes that fuse such a norm with what feeds it.
"""
from __future__ import annotations

from typing import NamedTuple

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


class RMSNormMatch(NamedTuple):
    """An RMSNorm found around an rsqrt node (`match_rmsnorm`)."""
    x: fx.Node                  # the normalised input, before its optional fp32 upcast
    out: fx.Node                # the node whose value the norm is (after the optional cast back)
    weight: fx.Node             # the [D] weight parameter, before its optional fp32 upcast
    eps: float
    cast_before_weight: bool    # Llama's spelling: the normalised value cast to x's dtype, then times the weight
    readers: frozenset          # the norm's nodes that read x: a fusion that also absorbs x's producer
                                # needs x to have no other user


_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # weight * fp32 stays fp32: exact


def match_rmsnorm(rsqrt: fx.Node) -> RMSNormMatch | None:
    """The RMSNorm around an rsqrt node, when the fused ops compute exactly its value:

        (w.float() * n).to(x.dtype)                      n = x.float() * rsqrt(mean(x.float()^2) + eps)
        (w.float() * n.to(x.dtype).float()).to(x.dtype)  cast_before_weight (Llama)

    so the math must run in fp32 (a bf16 norm without the upcast is refused), the weight may only
    be upcast to fp32 (a cast to fp16 would round it: refused), and every product must be the
    one above (a weight wider than fp32 is refused). Requires keepdim over the last dim and that
    the norm's intermediates feed only the norm; x itself may have other users (a pre-norm
    block's residual stream), the passes that also absorb x's producer check `readers`."""
    add = rsqrt.args[0]
    if not (is_call(add, aten.add.Tensor, aten.add.Scalar) and isinstance(add.args[1], (int, float))):
        return None
    eps, mean = float(add.args[1]), add.args[0]
    if not (is_call(mean, aten.mean.dim) and len(mean.args) <= 3 and mean.kwargs.get("dtype") is None
            and single_user(mean, add) and single_user(add, rsqrt) and len(rsqrt.users) == 1):
        return None
    square = mean.args[0]
    dims = list(mean.args[1]) if len(mean.args) > 1 else []
    keepdim = (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))
    if is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        xf = square.args[0]
    elif is_call(square, aten.mul.Tensor) and square.args[0] is square.args[1]:
        xf = square.args[0]
    else:
        return None
    xfv = node_val(xf)
    if xfv is None or xfv.dtype != torch.float32 or not keepdim or dims not in ([-1], [xfv.dim() - 1]):
        return None
    norm = next(iter(rsqrt.users))
    if not (is_call(norm, aten.mul.Tensor) and set(norm.args) == {xf, rsqrt}):
        return None
    if not (single_user(square, mean) and {square, norm} <= set(xf.users) and len(norm.users) == 1):
        return None
    x, convert_in = strip_convert(xf, torch.float32)
    xv = node_val(x)
    if xv is None:
        return None
    scaled = next(iter(norm.users))
    cast_before_weight = cast_dtype(scaled) is not None
    if cast_before_weight:            # n.to(x.dtype) * w
        if cast_dtype(scaled) != xv.dtype or len(scaled.users) != 1:
            return None
        normed, scaled = scaled, next(iter(scaled.users))
    else:
        normed = norm
    if not (is_call(scaled, aten.mul.Tensor) and len(scaled.args) == 2 and normed in scaled.args):
        return None
    g = scaled.args[0] if scaled.args[1] is normed else scaled.args[1]
    weight, weight_cast = strip_convert(g)
    if weight_cast is not None and cast_dtype(weight_cast) != torch.float32:
        return None
    wv, sv = node_val(weight), node_val(scaled)
    if not (isinstance(weight, fx.Node) and weight.op in ("placeholder", "get_attr")) or wv is None \
            or sv is None or wv.dtype not in _WEIGHT_DTYPES:
        return None
    if sv.dtype not in ((torch.float32, xv.dtype) if cast_before_weight else (torch.float32,)):
        return None
    out = scaled
    if len(scaled.users) == 1:
        (only,) = scaled.users
        if cast_dtype(only) is not None:
            out = only
    readers = frozenset({convert_in} if convert_in is not None else {square, norm})
    return RMSNormMatch(x, out, weight, eps, cast_before_weight, readers)


def feeds_only(node: fx.Node, norm: RMSNormMatch) -> bool:
    """`node` (the norm's input) has no user outside the norm."""
    return set(node.users) <= norm.readers


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
    RMSNorm and whose surroundings `_match(norm)` accepts becomes one `target` call; `_match`
    gets the RMSNormMatch and returns (node to replace, call args) or None."""
    target = None
    kind = ""

    def run(self, gm: fx.GraphModule) -> int:
        count = 0
        for rsqrt in [n for n in gm.graph.nodes if is_call(n, aten.rsqrt.default)]:
            norm = match_rmsnorm(rsqrt)
            match = self._match(norm) if norm is not None else None
            if match is not None:
                replace_with(gm, match[0], self.target, match[1], self.kind)
                count += 1
        if count:
            gm.graph.eliminate_dead_code()
        return count

    def _match(self, norm: RMSNormMatch):  # pragma: no cover
        raise NotImplementedError
