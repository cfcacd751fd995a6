"""P1, ratio-2 half: grouped softmax pooling -> RMSNorm  ==>  v41graph::fused_pool_rmsnorm.

The ratio-2 compressor pools each group of r tokens per channel with a softmax over the
group's scores, casts the pooled fp32 latent to the activation dtype and RMSNorms it. As the
decomposed graph spells it:

    s    = score | clone(score)                        [N, r, D] fp32
    p    = _softmax(s, 1) | div(e, sum(e, [1], keepdim)), e = exp(sub(s, amax(s, [1], keepdim)))
                                                       (the second under Inductor's decompositions)
    lat  = sum(mul(kv, p) | mul(p, kv), [1])           [N, D]
    y    = lat | convert(lat, dtype)
    out  = RMSNorm(y)                                  (as in patterns.match_rmsnorm)

One op reads the r (kv, score) rows once and writes the normalised latent. Refuses a softmax
over another dim and intermediates with other users.

Second step: where the pooled (kv, score) come from the compressor's projection pair and state
ring, the fused pool node absorbs that too and becomes `v41graph::fused_ratio2_compressor`:

    rows   = cat([mm(x', t(wkv)), mm(x', t(wgate))], -1)     x' = x | convert(x, f32), t | permute
    pool   = cat([view(state, [-1, 2D]), rows])                         (dim 0)
    member = index(pool, [member_rows]) | index_select(pool, 0, member_rows)
    kv, score = getitem(split(view(member, [N, r, -1]), D, -1), 0 / 1)
    out    = fused_pool_rmsnorm(kv, score, g, eps, dtype)

  ==>  (out, rows') = fused_ratio2_compressor(x, wkv, wgate, state, member_rows, g, eps, dtype)

The state-ring update `state_write(state, state_rows, rows)` stays a separate node and now
writes rows' (the op's second output); the fused op is placed where the gather was, i.e. before
that write, so it reads the ring's old contents as the model does. Refuses near misses: a
projection output or any intermediate with another user, a rows user other than the pool and
state writes (or a write placed before the gather), a pool other than [state view, rows].
The plain pool fusion stays where the projections do not match.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .base import is_call
from .patterns import RMSNormFusion, RMSNormMatch, feeds_only, node_val, single_user, strip_convert, transposed_weight

aten = torch.ops.aten
STATE_WRITE = torch.ops.v41graph.state_write.default


def _same(a, b) -> bool:
    """Equal shapes, sizes plain ints or symbolic (a shared decode graph's batch dimension):
    compared by their expressions, so no guard is added."""
    return len(a) == len(b) and all(x is y or str(x) == str(y) for x, y in zip(a, b))


def _dims(node: fx.Node) -> list:
    return list(node.args[1]) if len(node.args) > 1 else []


class FusePoolRMSNorm(RMSNormFusion):
    name = "fuse_pool_rmsnorm"
    target = torch.ops.v41graph.fused_pool_rmsnorm.default
    kind = "pool+rmsnorm"
    ratio2_target = torch.ops.v41graph.fused_ratio2_compressor.default
    ratio2_kind = "ratio2 projections+pool+rmsnorm"

    def run(self, gm: fx.GraphModule) -> int:
        count = super().run(gm)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        widened = False               # matched_count stays the pool fusions: widening one is no new place
        for pooled in [n for n in gm.graph.nodes if is_call(n, self.target)]:
            m = self._match_projections(pooled, order)
            if m is not None:
                self._absorb(gm, pooled, m)
                widened = True
        if widened:                   # the absorbed projections, gather and split are dead now
            gm.graph.eliminate_dead_code()
        return count

    # ------------------------------------------------------------------ the projection pair
    def _match_projections(self, pooled: fx.Node, order: dict):
        kv, score, g, eps, out_dtype = pooled.args
        if not (is_call(kv, operator.getitem) and is_call(score, operator.getitem)
                and kv.args[0] is score.args[0] and (kv.args[1], score.args[1]) == (0, 1)
                and single_user(kv, pooled) and single_user(score, pooled)):
            return None
        split = kv.args[0]
        if not (is_call(split, aten.split.Tensor) and set(split.users) == {kv, score}
                and (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) in (-1, 2)):
            return None
        view = split.args[0]
        if not (is_call(view, aten.view.default, aten.reshape.default) and single_user(view, split)):
            return None
        gather = view.args[0]
        if is_call(gather, aten.index.Tensor) and len(gather.args[1]) == 1:
            pool, member_rows = gather.args[0], gather.args[1][0]
        elif is_call(gather, aten.index_select.default) and gather.args[1] == 0:
            pool, member_rows = gather.args[0], gather.args[2]
        else:
            return None
        if not (single_user(gather, view) and isinstance(member_rows, fx.Node)):
            return None
        if not (is_call(pool, aten.cat.default) and single_user(pool, gather)
                and (pool.args[1] if len(pool.args) > 1 else pool.kwargs.get("dim", 0)) == 0
                and len(pool.args[0]) == 2):
            return None
        state_view, rows = pool.args[0]
        if not (is_call(state_view, aten.view.default) and single_user(state_view, pool)):
            return None
        state = state_view.args[0]
        if not (isinstance(state, fx.Node) and state.op == "placeholder"):
            return None
        if not (is_call(rows, aten.cat.default) and len(rows.args[0]) == 2
                and (rows.args[1] if len(rows.args) > 1 else rows.kwargs.get("dim", 0)) in (-1, 1)):
            return None
        # rows: read by the pool and, after the gather, by the state-ring write(s) only
        for u in rows.users:
            if u is pool:
                continue
            is_write = (is_call(u, STATE_WRITE) or (is_call(u, torch.ops.higher_order.auto_functionalized_v2)
                                                     and u.args[0] is STATE_WRITE))
            if not is_write or order[u] < order[gather]:
                return None
        mms = rows.args[0]
        if not all(is_call(mm, aten.mm.default) and single_user(mm, rows) for mm in mms):
            return None
        xin = mms[0].args[0]
        if mms[1].args[0] is not xin:
            return None
        weights = []
        for mm in mms:
            w = transposed_weight(mm.args[1], mm)
            if not (isinstance(w, fx.Node) and w.op in ("placeholder", "get_attr")):
                return None
            weights.append(w)
        x, convert = strip_convert(xin, torch.float32)
        if convert is not None and set(convert.users) != set(mms):
            x = xin                                   # the fp32 copy has other users: keep it
        xv, wv, gv, rv, sv, mv = (node_val(n) for n in (x, weights[0], weights[1], rows, state, member_rows))
        lat_v = node_val(pooled)
        if None in (xv, wv, gv, rv, sv, mv, lat_v) or xv.dim() != 2 or mv.dim() != 1:
            return None
        if wv.dtype != torch.float32 or gv.dtype != torch.float32 or rv.dtype != torch.float32:
            return None
        if mv.dtype not in (torch.int64, torch.int32) or sv.dtype != torch.float32:
            return None
        d, n, vv = wv.shape[0], xv.shape[0], node_val(view)
        if not (vv is not None and _same(gv.shape, wv.shape) and _same(rv.shape, (n, 2 * d))
                and _same(sv.shape[-1:], (2 * d,)) and _same(vv.shape[:1], (n,))
                and split.args[1] == d and _same(lat_v.shape, (n, d))):
            return None
        return (x, weights[0], weights[1], state, member_rows, g, eps, out_dtype), rows, gather

    def _absorb(self, gm: fx.GraphModule, pooled: fx.Node, match):
        args, rows, gather = match
        graph = gm.graph
        with graph.inserting_before(gather):           # before the state write: reads the old ring
            fused = graph.call_function(self.ratio2_target, args)
            # named after the fused node: a fresh "getitem" name would depend on the graph's
            # naming history (a cloned graph counts differently) and the dumps must not
            latent = graph.create_node("call_function", operator.getitem, (fused, 0), name=f"{fused.name}_latent")
            new_rows = graph.create_node("call_function", operator.getitem, (fused, 1), name=f"{fused.name}_rows")
        base = {k: v for k, v in pooled.meta.items() if k not in ("val", "fused_from")}
        fused.meta.update(base)
        fused.meta["val"] = (pooled.meta.get("val"), rows.meta.get("val"))
        fused.meta["fused_from"] = self.ratio2_kind
        latent.meta.update(base)
        latent.meta["val"] = pooled.meta.get("val")
        new_rows.meta.update({k: v for k, v in rows.meta.items() if k != "fused_from"})
        pooled.replace_all_uses_with(latent)
        for u in [u for u in rows.users if u is not gather.args[0]]:
            u.replace_input_with(rows, new_rows)     # the state write(s) keep writing the rows
        graph.erase_node(pooled)

    def _match(self, norm: RMSNormMatch):
        y, out = norm.x, norm.out
        # the op multiplies by the weight in fp32 and the pooled latent must feed only the norm
        if norm.cast_before_weight or not feeds_only(y, norm):
            return None
        lat, convert_mid = strip_convert(y)
        if convert_mid is not None and not single_user(lat, convert_mid):
            return None
        if not (is_call(lat, aten.sum.dim_IntList) and _dims(lat) == [1] and len(lat.args) < 3):
            return None
        mul = lat.args[0]
        if not (is_call(mul, aten.mul.Tensor) and single_user(mul, lat)):
            return None
        a, b = mul.args
        s = _softmax_dim1_input(b)
        p, kv = (b, a) if s is not None else (a, b)
        s = s if s is not None else _softmax_dim1_input(a)
        if s is None or not single_user(p, mul):
            return None
        score = s.args[0] if is_call(s, aten.clone.default) else s
        kv_v, sc_v, out_v = node_val(kv), node_val(score), node_val(out)
        if None in (kv_v, sc_v, out_v) or kv_v.shape != sc_v.shape or kv_v.dim() != 3:
            return None
        if kv_v.dtype != torch.float32 or sc_v.dtype != torch.float32:
            return None
        if tuple(out_v.shape) != (kv_v.shape[0], kv_v.shape[2]) or node_val(y) is None \
                or node_val(y).dtype != out_v.dtype:      # the op normalises in its output dtype
            return None
        return out, (kv, score, norm.weight, norm.eps, out_v.dtype)


def _softmax_dim1_input(p):
    """s when p is softmax(s, dim=1) of a 3-D fp32 s, spelled `_softmax(s, 1, False)` or, under
    Inductor's decompositions, div(exp(sub(s, amax(s, [1]))), sum(exp(...), [1])); else None."""
    if not isinstance(p, fx.Node):
        return None
    if is_call(p, aten._softmax.default):
        s = p.args[0]
        sv = node_val(s)
        if sv is not None and sv.dim() == 3 and p.args[1] in (1, -2) and not p.args[2]:
            return s
        return None
    if not is_call(p, aten.div.Tensor):
        return None
    e, denom = p.args
    if not (is_call(e, aten.exp.default) and is_call(denom, aten.sum.dim_IntList)
            and denom.args[0] is e and _dims(denom) == [1] and set(e.users) == {p, denom}):
        return None
    sub = e.args[0]
    if not (is_call(sub, aten.sub.Tensor) and single_user(sub, e)):
        return None
    s, amax = sub.args
    if not (is_call(amax, aten.amax.default) and amax.args[0] is s and _dims(amax) == [1]):
        return None
    return s
