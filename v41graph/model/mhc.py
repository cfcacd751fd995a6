"""Single-pass mHC residual (MODEL.md §3): 4 residual streams mixed by per-token coefficients.

A sub-layer's predictor reads the streams X [N, hc, d] and gives
  pre  [N, hc]      sigma(m*s0 + b) + eps           (collapse weights)
  post [N, hc]      2*sigma(m*s1 + b)               (expand weights)
  comb [N, hc, hc]  Sinkhorn(softmax_rows(m*s2 + b) + eps)
V4.1's single-pass shift: a sub-layer COLLAPSES with the `pre` of the previous sub-layer's
predictor (the block does this bookkeeping), and expands with its own post/comb. The predictor
and the collapse read the same streams, so they are one op (mhc_pre), the expand another
(mhc_post); the math is custom_ops/reference.py's.
"""
from __future__ import annotations

import torch
from torch import nn

import v41graph.custom_ops  # noqa: F401  (registers torch.ops.v41graph.mhc_pre / mhc_post)
from v41graph.custom_ops import reference as ref


class HyperConnection(nn.Module):
    """The coefficient predictor of one sub-layer (attention or FFN)."""

    def __init__(self, hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, pre_prev: torch.Tensor):
        """streams [N, hc, d], pre_prev [N, hc] (the previous sub-layer's pre) -> (the sub-layer's
        input: the streams collapsed with pre_prev, in their dtype; and this predictor's pre,
        post, comb). reference.mhc_pre, as the mhc_pre op (one node; three Triton launches on
        CUDA) unless autograd is to reach the predictor's parameters (the op has no backward)."""
        args = (streams, pre_prev, self.fn, self.scale, self.base, self.hc, self.iters, self.hc_eps, self.norm_eps)
        if torch.is_grad_enabled() and any(p.requires_grad for p in (self.fn, self.scale, self.base)):
            return ref.mhc_pre(*args)
        return torch.ops.v41graph.mhc_pre(*args)


def first_pre(n: int, hc: int, device) -> torch.Tensor:
    """The `pre` the first sub-layer collapses with: one-hot [1, 0, ..., 0] per token, [n, hc]
    fp32. Built by a comparison on the expanded arange (no host scalar write, which a CUDA-graph
    capture would reject), so it is a fresh contiguous tensor: an expanded one has row stride 0
    under a traced batch size but 4 in eager at n = 1, and the mhc_pre kernel would compile
    twice for the two."""
    return (torch.arange(hc, device=device).expand(n, hc) == 0).to(torch.float32)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = sum_c pre_c X_c (fp32), cast to the streams' dtype (the model's output side)."""
    return ref.mhc_collapse(streams, pre)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
           *, as_op: bool = True) -> torch.Tensor:
    """X'_c = post_c * F(x) + sum_c' comb[c', c] X_c' (reference.mhc_post): the mhc_post op (one
    node, one Triton launch on CUDA), or with as_op=False its torch ops in the graph (a
    tensor-parallel block: the comb part does not read out, so P8 overlaps it with out's
    all-reduce)."""
    if as_op:
        return torch.ops.v41graph.mhc_post(out, streams, post, comb)
    return ref.mhc_post(out, streams, post, comb)
