"""P1: Linear -> RMSNorm  ==>  torch.ops.v41graph.fused_wkv_rmsnorm (the seed's P1).

The ratio-1 compressor is `RMSNorm(W_kv x)`; one fused kernel reads x and W_kv once and
normalises the 512-wide row in registers. The pass matches the pair structurally, as the
post-AOT graph spells it (a cast `convert` is convert_element_type or _to_copy(dtype=), see
base.cast_dtype), so it fuses ANY bias-free
Linear followed by an RMSNorm over its output's last dim, whatever the shapes, dtypes or eps:

    x2   = x | view(x, [-1, K])
    y    = mm(x2, permute(w, [1, 0]) | t(w))    (no bias: addmm is not matched)
    y    = y | view(y, [..., N])
    out  = RMSNorm(y)                             (patterns.match_rmsnorm)
    out  = out | convert(out, x.dtype)

It refuses near misses: a bias, a norm over another dim or without keepdim, and any extra user
of an intermediate (the Linear output or the normalised value used elsewhere), since fusing
would then change what that user sees.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .base import is_call
from .patterns import RMSNormFusion, RMSNormMatch, feeds_only, node_val, single_user, transposed_weight

aten = torch.ops.aten


class FuseWkvRMSNorm(RMSNormFusion):
    name = "fuse_wkv_rmsnorm"
    target = torch.ops.v41graph.fused_wkv_rmsnorm.default
    kind = "linear+rmsnorm"

    # ------------------------------------------------------------------ matching
    def _match(self, norm: RMSNormMatch):
        y, out = norm.x, norm.out
        # the op multiplies by the weight in fp32 and the Linear's output must feed only the norm
        if norm.cast_before_weight or not feeds_only(y, norm):
            return None
        # the Linear: (view) <- mm(x2, permute(w)) (<- view)
        mm = y
        if is_call(y, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            if not single_user(y.args[0], y):
                return None
            mm = y.args[0]
        if not is_call(mm, aten.mm.default):
            return None
        x2, wt = mm.args
        w = transposed_weight(wt, mm)
        if w is None:
            return None
        x = x2.args[0] if is_call(x2, aten.view.default, aten.reshape.default) else x2
        xv, ov, wv = node_val(x), node_val(out), node_val(w)
        if xv is None or ov is None or wv is None or xv.dtype != ov.dtype or wv.dtype != xv.dtype:
            return None
        if tuple(ov.shape) != (*xv.shape[:-1], wv.shape[0]):
            return None
        return out, (x, w, norm.weight, norm.eps)
