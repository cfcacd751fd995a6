"""Engram conditional memory (MODEL.md §7), applied to the residual streams before a layer.

Row ids come from `engram_hash.py` (they depend on token ids only, so they can be computed
before layer 0); each token gathers (n-1)*heads rows of its layer's FP8 table, projects them
to one key per residual stream plus a shared value, and every stream adds the value scaled by
its own gate.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import V41Config
from .layers import Linear, weight_fmt

ops = torch.ops.v41graph


class Engram(nn.Module):
    def __init__(self, config: V41Config, rows: int):
        super().__init__()
        self.hc, self.dim = config.hc_mult, config.hidden_size
        self.eps = config.rms_norm_eps
        n_rows = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        head_dim = config.engram_head_dim
        # The table is FP8 E4M3 bytes + one E8M0 scale per 32; it may live in host memory.
        self.embed_weight = nn.Parameter(torch.zeros(rows, head_dim, dtype=torch.uint8), requires_grad=False)
        self.embed_scale = nn.Parameter(torch.zeros(rows, head_dim // 32, dtype=torch.uint8), requires_grad=False)
        self.wkv = Linear(n_rows * head_dim, (self.hc + 1) * self.dim, fmt=weight_fmt(config, "fp8"))
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """streams [N, hc, d]; row_ids [N, (n-1)*heads] -> updated streams."""
        e = ops.engram_gather(self.embed_weight, self.embed_scale, row_ids, streams.dtype)
        kv = self.wkv(e)
        key = kv[:, : self.hc * self.dim].unflatten(-1, (self.hc, self.dim)).float()
        value = kv[:, self.hc * self.dim:].float()
        h = streams.float()
        w = self.q_weight.float() * self.k_weight.float()
        dot = (h * w * key).sum(-1)
        dot = dot * torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = dot * self.dim ** -0.5
        gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(dot.abs().clamp_min(1e-6)))
        return (h + gate.unsqueeze(-1) * value.unsqueeze(-2)).to(streams.dtype)
