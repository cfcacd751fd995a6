"""Single-pass mHC residual (MODEL.md §3): 4 residual streams mixed by per-token coefficients.

A sub-layer's predictor reads the streams X [N, hc, d] and gives
  pre  [N, hc]      sigma(m*s0 + b) + eps           (collapse weights)
  post [N, hc]      2*sigma(m*s1 + b)               (expand weights)
  comb [N, hc, hc]  Sinkhorn(softmax_rows(m*s2 + b) + eps)
V4.1's single-pass shift: a sub-layer COLLAPSES with the `pre` of the previous sub-layer's
predictor (the block does this bookkeeping), and expands with its own post/comb.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import v41graph.custom_ops  # noqa: F401  (registers torch.ops.v41graph.mhc_sinkhorn)


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                   iters: int, eps: float):
    """mixes [N, (2+hc)*hc] fp32 -> (pre [N,hc], post [N,hc], comb [N,hc,hc]); the math is
    custom_ops/reference.mhc_sinkhorn, one op (one Triton kernel on CUDA) in the graph."""
    return torch.ops.v41graph.mhc_sinkhorn(mixes, scale, base, hc, iters, eps)


class HyperConnection(nn.Module):
    """The coefficient predictor of one sub-layer (attention or FFN)."""

    def __init__(self, hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor):
        x = streams.flatten(-2).float()
        rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + self.norm_eps)
        mixes = F.linear(x, self.fn) * rsqrt
        return sinkhorn_split(mixes, self.scale, self.base, self.hc, self.iters, self.hc_eps)


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x = sum_c pre_c X_c (fp32), cast to the streams' dtype."""
    return torch.sum(pre.unsqueeze(-1) * streams.float(), dim=-2).to(streams.dtype)


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_c = post_c * F(x) + sum_c' comb[c', c] X_c'."""
    y = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.sum(comb.unsqueeze(-1) * streams.unsqueeze(-2), dim=-3)
    return y.to(out.dtype)
