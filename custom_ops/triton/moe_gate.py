"""MoE gate kernels (CUDA; imported lazily by cuda_impls.py, never at package import).

  moe_gate    the router: scores = sqrt(softplus(x @ W^T)) in fp32, the top-k of scores + bias
              (ties to the lower expert id), their scores normalized to sum 1 and scaled
              (reference.moe_gate). Two launches instead of ~12: the torch form casts the bf16
              gate weight to fp32 at every call (a 7.9 MB copy at 384 experts x 5120), runs an
              fp32 cuBLAS GEMM (26 us per call at one token on the H100: its M = 1 heuristics) and
              ~10 small kernels for softplus, sqrt, the bias, a sort, a gather and the
              normalization.

1. `_gate_partials_kernel`: each program takes BE experts x BM tokens over one of S equal slices
   of K and writes the fp32 partial dot products. bf16/fp16 inputs multiply on the tensor cores
   (a product of two 16-bit floats is exact in fp32, accumulated in fp32, as the reference's
   fp32 GEMM of the upcast inputs; only the order of the additions differs); fp32 inputs use
   FMA in registers. The K slices spread a decode step's 3.9 MB weight read over the SMs.
2. `_gate_select_kernel`: one program per token adds its S partials in slice order, applies
   softplus (libdevice's exp and log1p, as torch's CUDA softplus) and the correctly rounded
   sqrt, takes the top-k by repeated argmax (the first index of the maximum: the reference's
   stable descending sort) and normalizes the chosen scores with correctly rounded divisions.

It uses libdevice (exp, log1p), which Triton's CPU interpreter cannot run (tests substitute it).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import _TL_DTYPE, _num_sms, _wait_for_inputs, pdl

SOFTPLUS_THRESHOLD = 20.0      # F.softplus's default: x itself above it


@triton.jit
def _gate_partials_kernel(x_ptr, w_ptr, part_ptr, N, E, D: tl.constexpr, K_SLICE: tl.constexpr,
                          BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr):
    """part[s, n, e] = sum over k in slice s of x[n, k] * w[e, k], fp32."""
    _wait_for_inputs()
    pe, pm, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pm * BM + tl.arange(0, BM)
    experts = pe * BE + tl.arange(0, BE)
    rmask, emask = rows < N, experts < E
    k = tl.arange(0, BK)
    acc = tl.zeros((BM, BE), tl.float32)
    for k0 in range(s * K_SLICE, s * K_SLICE + K_SLICE, BK):
        xt = tl.load(x_ptr + rows[:, None] * D + k0 + k[None, :], mask=rmask[:, None], other=0.0)
        wt = tl.load(w_ptr + experts[:, None] * D + k0 + k[None, :], mask=emask[:, None], other=0.0)
        if DOT:
            acc = tl.dot(xt, tl.trans(wt), acc)
        else:
            acc += tl.sum(xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    out = part_ptr + s * N * E + rows[:, None] * E + experts[None, :]
    tl.store(out, acc, mask=rmask[:, None] & emask[None, :])


@triton.jit
def _gate_select_kernel(part_ptr, bias_ptr, weights_ptr, ids_ptr, N, E, route_scale,
                        S: tl.constexpr, TOPK: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
                        THRESHOLD: tl.constexpr):
    _wait_for_inputs()
    n = tl.program_id(0)
    e = tl.arange(0, BE)
    emask = e < E
    logits = tl.load(part_ptr + n * E + e, mask=emask, other=0.0)
    for s in tl.static_range(1, S):                       # slice order: deterministic
        logits += tl.load(part_ptr + s * N * E + n * E + e, mask=emask, other=0.0)
    softplus = tl.where(logits > THRESHOLD, logits, libdevice.log1p(libdevice.exp(logits)))
    scores = tl.sqrt_rn(softplus)
    keys = tl.where(emask, scores + tl.load(bias_ptr + e, mask=emask, other=0.0), float("-inf"))
    slot = tl.arange(0, BT)
    chosen = tl.zeros((BT,), tl.int32)
    picked = tl.zeros((BT,), tl.float32)
    total = 0.0
    for j in tl.static_range(TOPK):
        best = tl.argmax(keys, axis=0, tie_break_left=True)
        value = tl.sum(tl.where(e == best, scores, 0.0), axis=0)
        chosen = tl.where(slot == j, best, chosen)
        picked = tl.where(slot == j, value, picked)
        total += value                                    # left to right, as the reference's sum of k
        keys = tl.where(e == best, float("-inf"), keys)
    weights = tl.math.div_rn(picked, total + 1e-20) * route_scale
    smask = slot < TOPK
    tl.store(weights_ptr + n * TOPK + slot, weights, mask=smask)
    tl.store(ids_ptr + n * TOPK + slot, chosen.to(tl.int64), mask=smask)


def moe_gate_supported(x, weight, bias, topk: int) -> bool:
    return (x.is_cuda and weight.is_cuda and bias.is_cuda and x.dim() == 2
            and x.dtype in _TL_DTYPE and weight.dtype == x.dtype and bias.dtype == torch.float32
            and weight.dim() == 2 and weight.shape[1] == x.shape[1] and bias.shape == (weight.shape[0],)
            and x.shape[1] % 64 == 0 and 0 < topk <= weight.shape[0] <= 4096)


def gate_config(n: int, e: int, d: int, dtype: torch.dtype, device) -> dict:
    """Tiles and K slices for n tokens: 16-bit inputs on the tensor cores (at least 16 rows per
    tile, as tl.dot needs), fp32 with FMA in registers (few rows: the [BM, BE, BK] product lives
    in registers); enough K slices to give every SM about two programs, each slice whole BK
    steps."""
    dot = dtype != torch.float32
    bm = max(16, min(64, triton.next_power_of_2(n))) if dot else min(4, triton.next_power_of_2(n))
    be = 32 if dot else 8
    bk = min(128 if dot else 8192 // (bm * be), d & -d)    # d & -d: d's largest power-of-two factor
    tiles = triton.cdiv(e, be) * triton.cdiv(n, bm)
    steps = d // bk
    split = 1
    while split * 2 <= steps and steps % (split * 2) == 0 and tiles * split * 2 <= 2 * _num_sms(device):
        split *= 2
    return dict(BM=bm, BE=be, BK=bk, DOT=dot, split=split)


def moe_gate(x, weight, bias, topk: int, route_scale: float, *, config: dict | None = None):
    """x [N, D] (bf16, fp16 or fp32), weight [E, D] of x's dtype, bias [E] fp32 -> (weights
    [N, topk] fp32, chosen [N, topk] int64)."""
    n, d = x.shape
    e = weight.shape[0]
    cfg = dict(config or gate_config(n, e, d, x.dtype, x.device))
    split = cfg.pop("split")
    if d % (split * cfg["BK"]):
        raise ValueError(f"moe_gate: hidden size {d} is not {split} K slices of whole {cfg['BK']}-wide steps")
    weights = torch.empty((n, topk), dtype=torch.float32, device=x.device)
    chosen = torch.empty((n, topk), dtype=torch.int64, device=x.device)
    if n == 0:
        return weights, chosen
    x, weight = x.contiguous(), weight.contiguous()
    partials = torch.empty((split, n, e), dtype=torch.float32, device=x.device)
    _gate_partials_kernel[(triton.cdiv(e, cfg["BE"]), triton.cdiv(n, cfg["BM"]), split)](
        x, weight, partials, n, e, D=d, K_SLICE=d // split, **cfg, num_warps=4, launch_pdl=pdl(x.device))
    _gate_select_kernel[(n,)](
        partials, bias.contiguous(), weights, chosen, n, e, float(route_scale), S=split, TOPK=topk,
        BE=triton.next_power_of_2(e), BT=triton.next_power_of_2(topk), THRESHOLD=SOFTPLUS_THRESHOLD,
        num_warps=4, launch_pdl=pdl(partials.device))
    return weights, chosen
