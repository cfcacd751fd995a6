"""MoE (MODEL.md §6): sqrt-softplus gate with a selection-only bias, normalised top-k x scale,
clamped SwiGLU experts, one shared expert.

The routed experts run as a static-shape loop over ALL experts with a zero routing weight for
tokens that did not pick them: the result is bit-identical to gathering each expert's tokens
(a zero weight zeroes h before w2, and adding 0.0 changes nothing), has no data-dependent
shapes, and is what a captured decode graph needs. Fast grouped kernels replace it later.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import V41Config
from .layers import Linear, weight_fmt


class Gate(nn.Module):
    def __init__(self, config: V41Config, n_experts: int, topk: int):
        super().__init__()
        self.topk, self.route_scale = topk, config.routed_scaling_factor
        if config.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {config.scoring_func!r}: only 'sqrtsoftplus' is V4.1's")
        self.weight = nn.Parameter(torch.zeros(n_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        scores = F.softplus(F.linear(x.float(), self.weight.float())).sqrt()
        # Selection uses score + bias; ties go to the lower expert id (stable sort).
        chosen = torch.sort(scores + self.bias, dim=-1, descending=True, stable=True).indices[:, : self.topk]
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.route_scale
        return weights, chosen


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, fmt: str):  # fmt: fp8 / fp4 / dense
        super().__init__()
        self.w1, self.w3 = Linear(dim, inter, fmt=fmt), Linear(dim, inter, fmt=fmt)
        self.w2 = Linear(inter, dim, fmt=fmt)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.w1(x).float(), self.w3(x).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: V41Config, n_experts: int | None = None, topk: int | None = None):
        super().__init__()
        n_experts = n_experts or config.n_routed_experts
        self.n_experts = n_experts
        self.gate = Gate(config, n_experts, topk or config.num_experts_per_tok)
        d, inter, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.experts = nn.ModuleList(Expert(d, inter, lim, weight_fmt(config, "fp4")) for _ in range(n_experts))
        if config.n_shared_experts != 1:
            raise ValueError(f"n_shared_experts={config.n_shared_experts}: V4.1 has exactly one")
        self.shared_experts = Expert(d, inter, lim, weight_fmt(config, "fp8"))

    def forward(self, x: torch.Tensor):
        """-> (output [N, d], chosen expert ids [N, topk])."""
        weights, chosen = self.gate(x)
        dense_w = torch.zeros(x.shape[0], self.n_experts, dtype=torch.float32, device=x.device)
        dense_w.scatter_(1, chosen, weights)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):   # expert-index order, fp32 sum
            y = y + expert(x, dense_w[:, e:e + 1])
        y = y + self.shared_experts(x)
        return y.to(x.dtype), chosen
