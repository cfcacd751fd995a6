"""P1, ratio-2 half: grouped softmax pooling -> RMSNorm  ==>  v41graph::fused_pool_rmsnorm.

The ratio-2 compressor pools each group of r tokens per channel with a softmax over the
group's scores, casts the pooled fp32 latent to the activation dtype and RMSNorms it. As the
decomposed graph spells it:

    s    = score | clone(score)                        [N, r, D] fp32
    e    = exp(sub(s, amax(s, [1], keepdim)))
    p    = div(e, sum(e, [1], keepdim))
    lat  = sum(mul(kv, p) | mul(p, kv), [1])           [N, D]
    y    = lat | convert_element_type(lat, dtype)
    out  = RMSNorm(y)                                  (as in fuse_wkv_rmsnorm.match_rmsnorm)

One op reads the r (kv, score) rows once and writes the normalised latent. The projections and
the state-ring update stay separate nodes (they also feed the state write). Refuses a softmax
over another dim and intermediates with other users.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import is_call
from .fuse_wkv_rmsnorm import RMSNormFusion, _single_user, _strip_convert, _val, match_rmsnorm

aten = torch.ops.aten


def _dims(node: fx.Node) -> list:
    return list(node.args[1]) if len(node.args) > 1 else []


class FusePoolRMSNorm(RMSNormFusion):
    name = "fuse_pool_rmsnorm"
    target = torch.ops.v41graph.fused_pool_rmsnorm.default
    kind = "pool+rmsnorm"

    def _match(self, rsqrt: fx.Node):
        norm = match_rmsnorm(rsqrt)
        if norm is None:
            return None
        yf, out, g, eps = norm
        y, convert_in = _strip_convert(yf, torch.float32)
        if convert_in is not None and not _single_user(y, convert_in):
            return None
        lat, convert_mid = _strip_convert(y)
        if convert_mid is not None and not _single_user(lat, convert_mid):
            return None
        if not (is_call(lat, aten.sum.dim_IntList) and _dims(lat) == [1] and len(lat.args) < 3):
            return None
        mul = lat.args[0]
        if not (is_call(mul, aten.mul.Tensor) and _single_user(mul, lat)):
            return None
        a, b = mul.args
        p, kv = (b, a) if is_call(b, aten.div.Tensor) else (a, b)
        if not (is_call(p, aten.div.Tensor) and _single_user(p, mul)):
            return None
        e, denom = p.args
        if not (is_call(e, aten.exp.default) and is_call(denom, aten.sum.dim_IntList)
                and denom.args[0] is e and _dims(denom) == [1] and set(e.users) == {p, denom}):
            return None
        sub = e.args[0]
        if not (is_call(sub, aten.sub.Tensor) and _single_user(sub, e)):
            return None
        s, amax = sub.args
        if not (is_call(amax, aten.amax.default) and amax.args[0] is s and _dims(amax) == [1]):
            return None
        score = s.args[0] if is_call(s, aten.clone.default) else s
        kv_v, sc_v, out_v = _val(kv), _val(score), _val(out)
        if None in (kv_v, sc_v, out_v) or kv_v.shape != sc_v.shape or kv_v.dim() != 3:
            return None
        if kv_v.dtype != torch.float32 or sc_v.dtype != torch.float32:
            return None
        if tuple(out_v.shape) != (kv_v.shape[0], kv_v.shape[2]):
            return None
        return out, (kv, score, g, eps, out_v.dtype)
