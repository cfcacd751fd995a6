"""Every RMSNorm the compressor fusions (P1) left  ==>  torch.ops.v41graph.rms_norm.

Our executor runs the graph op by op, and an RMSNorm as the post-AOT graph spells it is ~7
kernels (fp32 upcast, square, mean, add eps, rsqrt, two multiplies, downcast; see
patterns.match_rmsnorm for the accepted spellings). P1 takes the norms that follow a
Linear (query, KV and indexer-key norms, the compressors); this pass takes the rest: every
layer's attention and FFN norms and the final norm (with P1 off, all of them). At batch 1, where
a captured step is bound by how many small kernels it runs, one kernel per norm matters.

Both spellings of the weight multiply are taken (`w * n` cast back, and Llama's `w * n.to(dtype)`,
the op's `cast_before_weight`). It refuses what would change a value: a norm whose output dtype
is not its input's (no cast back), a weight that is not one [D] parameter, and what
match_rmsnorm refuses (math not in fp32, a weight rounded before the multiply, an extra user of
an intermediate). The norm's input may have other users (the residual stream of a pre-norm block).
"""
from __future__ import annotations

import torch
from .patterns import RMSNormFusion, RMSNormMatch, node_val


class FuseRMSNorm(RMSNormFusion):
    name = "fuse_rmsnorm"
    target = torch.ops.v41graph.rms_norm.default
    kind = "rmsnorm"

    def _match(self, norm: RMSNormMatch):
        xv, ov, wv = node_val(norm.x), node_val(norm.out), node_val(norm.weight)
        if xv is None or ov is None or wv is None:
            return None
        if ov.dtype != xv.dtype or tuple(wv.shape) != (xv.shape[-1],):
            return None
        return norm.out, (norm.x, norm.weight, norm.eps, norm.cast_before_weight)
