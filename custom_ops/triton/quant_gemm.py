"""fp8_linear on CUDA: x times the checkpoint's FP8 E4M3 weight with E8M0 scales per 32x32
block, the activation's FP8 quantization fused in (imported lazily by cuda_impls.py).

Decode and small batches (M < PREFILL_ROWS, or a result that is not bf16): one of three kernels,
picked by a rule measured on the GPU (`decode_kernel`):
- the tiles kernel (`_fp8_linear_kernel`): a program owns a [BM, BN] output tile and a share of
  K (split-K when the tile grid alone would leave SMs idle, as in decode); per BK step it loads
  the activation tile (from QUANTIZE_FIRST_ROWS rows on, x quantized once by `quantize_rows`;
  below, quantized per 32 in registers, common._qdq_fp8_blocks, which at one real row is
  cheaper than a launch), loads the FP8 weight tile with its block scales, dequantizes it to
  bf16 (exact) and accumulates a bf16 tensor-core dot in fp32. Split-K shares are added in
  split order by the tile's last program and cast once, as the reference casts once
  (deterministic; until the twenty-ninth session torch summed an fp32 workspace: two more
  launches per call, ~6 us at M = 64 on the H100);
- the skinny kernel (`_fp8_linear_skinny_kernel`): the same values with the weight rows as the
  MMA's M side and the few tokens as its N side, the E4M3 decode in PTX, and the split-K
  shares added in split order by the tile's last program (deterministic, no second launch);
- the blocks kernel (`_fp8_linear_blocks_kernel`): the skinny kernel's shape doing the
  reference's own arithmetic (reference.blockwise_gemm): one fp32 partial per 32-wide K block
  of the codes alone (fp16 MMAs: E4M3 codes are exact in fp16, two converted per instruction),
  times the block's weight and activation scales, added in block order; x quantized once to
  (codes, scales) by `quantize_rows_codes`; the weight tiles by TMA.

Prefill (M >= PREFILL_ROWS, a bf16 result): the activation is quantized by one kernel, the
weight dequantized to a transient bf16 copy by another, and cuBLAS multiplies them
(`_fp8_linear_prefill`): the Triton kernel reached only 0.20-0.34x of cuBLAS there on the
H200, this path 0.71-0.96x (docs/BENCHMARKS.md, eighth session).

The tile tables (`_config`, `_skinny_config`, `_blocks_config`) and the choice between the
kernels come from scripts/bench_ops.py --only fp8 on the GPU.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import (_FLOAT_DTYPES, _bf16_column_halves, _capability_at_least, _e4m3_pairs_to_bf16, _e8m0_scales,
                     _e8m0_to_bf16, _e8m0_to_fp32, _exp2i, _fp8_weight_tile, _next_k, _num_sms, _qdq_fp8_blocks,
                     _quant_fp8_blocks, _rows, _split_pairs, _wait_for_inputs, pdl, zeroed_workspace)

_WARNED: set = set()


def warn_once(key: str, message: str) -> None:
    """One RuntimeWarning per reason and process: the op then runs the reference."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def fp8_capable(device: torch.device) -> bool:
    """FP8 E4M3 conversions in Triton need sm89+ (Ada / Hopper); older GPUs run the reference."""
    if _capability_at_least(device, 8, 9):
        return True
    warn_once("fp8-capability", f"v41graph: {torch.cuda.get_device_name(device)} (sm"
              f"{''.join(map(str, torch.cuda.get_device_capability(device)))}) has no FP8 conversions "
              "(sm89+ needed): fp8_linear / mxfp4_moe run the pure-torch reference")
    return False


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, K_PER_SPLIT, n_split,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANTIZED: tl.constexpr,
                       SPLIT: tl.constexpr):
    """QUANTIZED: x is already FP8-quantized per 32 (quantize_rows); else quantize each tile.
    SPLIT: see _store_or_reduce_split."""
    _wait_for_inputs()
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BM + tl.arange(0, BM)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    m_mask, n_mask = m < M, n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    s_rows = n // 32                                        # one scale row per 32 weight rows
    u = _e8m0_scales(s_ptr, s_rows, n_mask, k_lo, K, BK)
    for k0 in range(k_lo, k_hi, BK):
        u_next = _e8m0_scales(s_ptr, s_rows, n_mask, _next_k(k0, k_hi, BK), K, BK)    # a step ahead
        k = k0 + tl.arange(0, BK)
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=m_mask[:, None], other=0.0)
        if QUANTIZED:
            a = a.to(tl.bfloat16)
        else:
            a = _qdq_fp8_blocks(a.to(tl.float32), BM, BK).to(tl.bfloat16)
        w = _fp8_weight_tile(w_ptr, u, n, n_mask, k0, K, BN, BK)
        acc = tl.dot(a, tl.trans(w), acc)
        u = u_next
    at = m[:, None].to(tl.int64) * N + n[None, :]
    _store_or_reduce_split(acc, out_ptr, ws_ptr, count_ptr, at, m_mask[:, None] & n_mask[None, :], pid_n, pid_m,
                           pid_k, M, N, n_split, BM, BN, SPLIT)


@triton.jit
def _fp8_linear_skinny_kernel(x_ptr, w_src, s_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, K_PER_SPLIT,
                              n_split, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              QUANTIZED: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr):
    """Few activation rows (decode): the weight rows are the MMA's M side and the tokens its N
    side, out^T [BN, BT] = W [BN, K] . x [BT, K]^T, so a 64/128-row weight tile fills a wgmma
    whatever the token count and every weight byte is read once per call (the tile kernel
    above reads it once per BM rows of x). The weight is read as int16 words (two E4M3 codes)
    and decoded by PTX with its 32x32 block's scale (common._e4m3_pairs_to_bf16: the values of
    _fp8_weight_tile); the even and odd columns go through two dots, x split the same way.
    TMA: w_src is a descriptor of the int16 weight as [N, K/32, 16] (see the blocks kernel);
    else the int16 weight's pointer. SPLIT: see _store_or_reduce_split."""
    _wait_for_inputs()
    pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    n_mask, t_mask = n < N, t < M
    kb_i = tl.arange(0, BK // 32)
    j16 = tl.arange(0, 16)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    s_rows = n // 32                                        # one scale row per 32 weight rows
    u = _e8m0_scales(s_ptr, s_rows, n_mask, k_lo, K, BK)
    for k0 in range(k_lo, k_hi, BK):
        u_next = _e8m0_scales(s_ptr, s_rows, n_mask, _next_k(k0, k_hi, BK), K, BK)    # a step ahead
        kb = k0 // 32 + kb_i
        if TMA:
            words = w_src.load([pid_n * BN, k0 // 32, 0])
        else:
            words = tl.load(w_src + n[:, None, None] * (K // 2) + kb[None, :, None] * 16 + j16[None, None, :],
                            mask=n_mask[:, None, None], other=0)
        we, wo = _e4m3_pairs_to_bf16(words, _e8m0_to_bf16(u)[:, :, None])
        if QUANTIZED:   # bf16 x from quantize_rows, read as int32 words (columns 2i, 2i+1)
            xe, xo = _bf16_column_halves(x_ptr, t.to(tl.int64), t_mask, k0, K, BT, BK)
        else:
            k = k0 + tl.arange(0, BK)
            a = tl.load(x_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=t_mask[:, None], other=0.0)
            a = _qdq_fp8_blocks(a.to(tl.float32), BT, BK).to(tl.bfloat16)
            xe, xo = tl.split(tl.reshape(a, (BT, BK // 2, 2)))
        acc = tl.dot(tl.reshape(we, (BN, BK // 2)), tl.trans(xe), acc)
        acc = tl.dot(tl.reshape(wo, (BN, BK // 2)), tl.trans(xo), acc)
        u = u_next
    mask = n_mask[:, None] & t_mask[None, :]
    at = t[None, :].to(tl.int64) * N + n[:, None]
    _store_or_reduce_split(acc, out_ptr, ws_ptr, count_ptr, at, mask, pid_n, pid_t, pid_k, M, N,
                           n_split, BN, BT, SPLIT)


@triton.jit
def _fp8_linear_blocks_kernel(xc_ptr, xs_ptr, w_src, s_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, K_PER_SPLIT,
                              n_split, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              SPLIT: tl.constexpr, TMA: tl.constexpr):
    """The reference's own arithmetic (reference.blockwise_gemm) in the skinny kernel's shape,
    out^T [BN, BT]: per 32-wide K block one fp32 partial of the codes alone, W codes [BN, 32] .
    x codes [BT, 32]^T, times that block's two power-of-two scales (exact), added in block
    order. E4M3 codes are exact in fp16, so the weight needs one cvt per two codes and no
    per-code scale; the scales cost an outer product on the [BN, BT] partial instead, which
    is cheap while BT is small (decode). x arrives as codes (quantize_rows_codes: fp16 codes,
    fp32 scales per 32). TMA: w_src is a host tensor descriptor of the weight with [BN, 32]
    boxes, so the copy engine moves the weight (0-8 % faster than cp.async on the H100); else
    w_src is the weight's pointer. SPLIT: see _store_or_reduce_split."""
    _wait_for_inputs()
    pid_n, pid_t, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    t = pid_t * BT + tl.arange(0, BT)
    n_mask, t_mask = n < N, t < M
    c32 = tl.arange(0, 32)
    acc = tl.zeros([BN, BT], dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BK):
        for j in tl.static_range(BK // 32):
            k = k0 + j * 32 + c32
            if TMA:     # rows past N arrive as zeros
                w = w_src.load([pid_n * BN, k0 + j * 32])
            else:
                w = tl.load(w_src + n[:, None] * K + k[None, :], mask=n_mask[:, None], other=0)
            xc = tl.load(xc_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=t_mask[:, None], other=0.0)
            kb = k0 // 32 + j
            u = tl.load(s_ptr + (n // 32) * (K // 32) + kb, mask=n_mask, other=127)
            sx = tl.load(xs_ptr + t * (K // 32) + kb, mask=t_mask, other=0.0)
            part = tl.dot(w.to(tl.float8e4nv, bitcast=True).to(tl.float16), tl.trans(xc))
            acc += part * (_e8m0_to_fp32(u)[:, None] * sx[None, :])
    mask = n_mask[:, None] & t_mask[None, :]
    at = t[None, :].to(tl.int64) * N + n[:, None]
    _store_or_reduce_split(acc, out_ptr, ws_ptr, count_ptr, at, mask, pid_n, pid_t, pid_k, M, N,
                           n_split, BN, BT, SPLIT)


@triton.jit
def _store_or_reduce_split(acc, out_ptr, ws_ptr, count_ptr, at, mask, pid_n, pid_t, pid_k, M, N,
                           n_split, BN: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr):
    """A [BN, BT] output tile's end (the tiles kernel's [BM, BN]: the shape is all that
    matters). SPLIT: this program's K share goes to the fp32 workspace [n_split, M, N]; the
    last program of the tile (an atomic count per tile) adds the shares in split order and
    writes the output: deterministic, and no second launch."""
    if SPLIT:
        tl.store(ws_ptr + pid_k.to(tl.int64) * M * N + at, acc, mask=mask)
        tl.debug_barrier()      # every thread's share is stored before the count is released
        tile = pid_t * tl.num_programs(0) + pid_n
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == n_split - 1:
            total = tl.zeros([BN, BT], dtype=tl.float32)
            for s in range(0, n_split):   # fixed order whichever program came last
                total += tl.load(ws_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + at, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(count_ptr + tile, 0)   # left zeroed for the next call (tile_counts)
    else:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_linear_supported(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    if not (x.is_cuda and x.dtype in _FLOAT_DTYPES and weight.dtype == torch.uint8 and weight.dim() == 2
            and scale.dtype == torch.uint8 and weight.is_contiguous() and scale.is_contiguous()
            and weight.device == x.device == scale.device and x.shape[-1] == weight.shape[1]):
        return False
    n, k = weight.shape
    if k % 32 or tuple(scale.shape) != (-(-n // 32), k // 32):
        return False
    return fp8_capable(x.device)


def _block_k(k: int, largest: int) -> int:
    bk = largest
    while k % bk:
        bk //= 2
    return bk


def _config(m: int, n: int, k: int, device: torch.device):
    """(BM, BN, BK, split, num_warps, num_stages) for an [m, k] x [n, k]^T product: the best
    configs of the H200 sweep (scripts/bench_ops.py --only quant); from 17 rows on, 64-column
    tiles with split-K until the grid covers the SMs once (the thirty-second session's H100
    sweep at M = 64: the tile's last program adds the n_split shares alone, so a split of 16
    cost 10-40 % against the best; this rule is within 11 % of the best split of every bench
    shape). Below 17 rows the split still covers the SMs twice (an M = 16 tile's shares are a
    quarter of the bytes); above 64 rows as before (not yet swept with the last-program
    reduction)."""
    if m <= 16:
        bm, bn, bk, warps, stages, cover = 16, 128, _block_k(k, 128), 4, 3, 2
    elif m <= 64:
        bm, bn, bk, warps, stages, cover = 64, 64, _block_k(k, 128), 4, 4, 1
    else:
        bm, bn, bk, warps, stages, cover = 128, 256, _block_k(k, 64), 8, 3, 2
    split = _split_k(triton.cdiv(m, bm) * triton.cdiv(n, bn), k // bk, cover * _num_sms(device), 16)
    return bm, bn, bk, split, warps, stages


def _whole_step_split(k: int, bk: int, split: int) -> tuple[int, int]:
    """(K per split, split) of a launch: each share a whole number of BK steps, and the split
    recounted from those shares (a share past K would be empty)."""
    k_per_split = triton.cdiv(k // bk, split) * bk
    return k_per_split, triton.cdiv(k, k_per_split)


def _split_k(tiles: int, steps: int, cover: int, most: int) -> int:
    """The split-K of a decode grid: doubled until tiles x split reaches `cover` programs, while
    each share keeps at least one BK step and the split stays at most `most`."""
    split = 1
    while tiles * split < cover and split * 2 <= steps and split < most:
        split *= 2
    return split


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, BN: tl.constexpr, BK: tl.constexpr):
    _wait_for_inputs()
    n = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
    k0 = tl.program_id(1) * BK
    w = _fp8_weight_tile(w_ptr, _e8m0_scales(s_ptr, n // 32, n < N, k0, K, BK), n, n < N, k0, K, BN, BK)
    k = k0 + tl.arange(0, BK)
    tl.store(out_ptr + n[:, None] * K + k[None, :], w, mask=(n < N)[:, None])


@triton.jit
def _qdq_rows_kernel(x_ptr, out_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr):
    _wait_for_inputs()
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    offs = m[:, None].to(tl.int64) * K + k[None, :]
    x = tl.load(x_ptr + offs, mask=(m < M)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _qdq_fp8_blocks(x, BM, BK).to(tl.bfloat16), mask=(m < M)[:, None])


@triton.jit
def _quant_rows_kernel(x_ptr, codes_ptr, scale_ptr, M, K, BM: tl.constexpr, BK: tl.constexpr,
                       SPLIT_PAIRS: tl.constexpr):
    _wait_for_inputs()
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * K + k[None, :], mask=(m < M)[:, None], other=0.0)
    q, ex = _quant_fp8_blocks(x.to(tl.float32), BM, BK)
    q = _split_pairs(q, BM, BK) if SPLIT_PAIRS else tl.reshape(q, (BM, BK))
    tl.store(codes_ptr + m[:, None].to(tl.int64) * K + k[None, :], q.to(codes_ptr.dtype.element_ty),
             mask=(m < M)[:, None])
    kb = tl.program_id(1) * (BK // 32) + tl.arange(0, BK // 32)
    tl.store(scale_ptr + m[:, None].to(tl.int64) * (K // 32) + kb[None, :], _exp2i(ex), mask=(m < M)[:, None])


PREFILL_ROWS = 256   # from here on: dequantize the weight (transient bf16) + cuBLAS
QUANTIZE_FIRST_ROWS = 17   # from here on the decode kernel reads x quantized once (quantize_rows):
                           # re-quantizing it in every output tile cost more than the extra launch


def quantize_rows(x2: torch.Tensor) -> torch.Tensor:
    """x2 [M, K] (K % 32 == 0) FP8-quantized per 32 (codecs.qdq_fp8_ue8m0's values), as bf16:
    the values are E4M3 codes times powers of two, which bf16 holds exactly."""
    m, k = x2.shape
    bk = _block_k(k, 128)
    a = torch.empty((m, k), device=x2.device, dtype=torch.bfloat16)
    _qdq_rows_kernel[(triton.cdiv(m, 32), k // bk)](x2, a, m, k, BM=32, BK=bk, num_warps=4, launch_pdl=pdl(x2.device))
    return a


def quantize_rows_codes(x2: torch.Tensor, codes_dtype: torch.dtype = torch.float16, split_pairs: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (K % 32 == 0) FP8-quantized per 32 as (codes [M, K] in codes_dtype: fp16,
    which holds every E4M3 value exactly, or float8_e4m3fn; scales [M, K/32] fp32, powers of
    two): codecs.qdq_fp8_ue8m0's values are codes * scales. split_pairs: each 32-block's codes
    stored even columns first, then odd (common._split_pairs, the MXFP4 MoE's blocks kernels)."""
    if codes_dtype not in (torch.float16, torch.float8_e4m3fn):
        raise ValueError(f"quantize_rows_codes: codes_dtype must be torch.float16 or torch.float8_e4m3fn, "
                         f"got {codes_dtype}")
    m, k = x2.shape
    bk = _block_k(k, 128)
    codes = torch.empty((m, k), device=x2.device, dtype=codes_dtype)
    scales = torch.empty((m, k // 32), device=x2.device, dtype=torch.float32)
    _quant_rows_kernel[(triton.cdiv(m, 16), k // bk)](x2, codes, scales, m, k, BM=16, BK=bk, SPLIT_PAIRS=split_pairs,
                                                      num_warps=4, launch_pdl=pdl(x2.device))
    return codes, scales


def _fp8_linear_prefill(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Prefill shapes: the activation quantized per 32 (exact values, so bf16 holds them)
    times the weight dequantized to bf16 (exact too), in cuBLAS: the same products and an fp32
    accumulation at cuBLAS's speed, for a transient bf16 copy of this one weight."""
    n, k = weight.shape
    bk = _block_k(k, 128)
    dense = torch.empty((n, k), device=x2.device, dtype=torch.bfloat16)
    _fp8_dequant_kernel[(triton.cdiv(n, 64), k // bk)](weight, scale, dense, n, k, BN=64, BK=bk, num_warps=4,
                                                       launch_pdl=pdl(weight.device))
    return torch.nn.functional.linear(quantize_rows(x2), dense)


# Which decode kernel: the sixteenth session's H200 sweep (scripts/bench_ops.py --only fp8
# --flush read, docs/BENCHMARKS.md) picked the skinny kernel at M <= 16 rows except K = 8192
# (wo_b), and at any M where the 128-row weight tiles alone cover the SMs (wq_b, N = 32768:
# M = 64 31.2 vs 52.8 us); the tiles kernel won the other M = 64 shapes (by 6-20 %). The
# twentieth session's H100 sweep (--fp8-rows 1,8) added the blocks kernel for K = 8192 at M <= 8
# (wo_b 24.8 / 26.9 us at M = 1 / 8 against the tiles kernel's 29.2 / 30.0), the weight through
# TMA in both swapped kernels (0-8 % faster) and 64-row skinny tiles from 2 tokens on (wq_a,
# wkv at M = 8: 11.7 / 9.6 us against 15.7 / 13.0).
SKINNY_MAX_ROWS = 16
SKINNY_MAX_K = 4096 + 2048
SKINNY_MAX_TOKEN_TILE = 64   # tokens per program (the MMA's N side): more rows, more token tiles
DECODE_KERNELS = ("blocks", "skinny", "tiles")
BLOCKS_MAX_ROWS = 8          # the blocks kernel's 8-token tile (mma.sync); its scale product grows with BT


def skinny_token_tile(m: int) -> int:
    """BT, the skinny kernel's token tile for m activation rows: a power of two in [16, 64]."""
    return max(16, min(SKINNY_MAX_TOKEN_TILE, triton.next_power_of_2(m)))


def decode_kernel(m: int, n: int, k: int, device: torch.device) -> str:
    """The measured rule above, unless $V41GRAPH_FP8_KERNEL names a kernel (one of
    DECODE_KERNELS: the A/B switch of scripts/bench.py's fp8 variants; read at every call, so a
    capture takes it)."""
    forced = os.environ.get("V41GRAPH_FP8_KERNEL") or "auto"
    if forced not in ("auto",) + DECODE_KERNELS:
        raise ValueError(f"V41GRAPH_FP8_KERNEL must be 'auto' or one of {DECODE_KERNELS}, got {forced!r}")
    if forced != "auto":
        return forced
    if triton.cdiv(n, 128) >= _num_sms(device):
        return "skinny" if m <= SKINNY_MAX_TOKEN_TILE else "tiles"
    if k > SKINNY_MAX_K:
        return "blocks" if m <= BLOCKS_MAX_ROWS else "tiles"
    return "skinny" if m <= SKINNY_MAX_ROWS else "tiles"


def _skinny_config(m: int, n: int, k: int, device: torch.device):
    """(BT, BN, BK, split, num_warps, num_stages, tma) of the skinny kernel: 128 weight rows x
    BK 128 per step, 64 rows from 2 tokens on where the 128-row tiles leave SMs idle (more
    programs: the H100 sweep's best at M = 8), split-K until the grid covers the SMs 1.5 times
    (wq_b: no split; wkv: 32; the sweeps' best splits), the weight through TMA on sm90+."""
    bt = skinny_token_tile(m)
    few_tiles = triton.cdiv(n, 128) < _num_sms(device)
    bn = 64 if m > 1 and m <= SKINNY_MAX_ROWS and few_tiles else 128
    bk, warps, stages = _block_k(k, 128), 4, 3
    split = _split_k(triton.cdiv(m, bt) * triton.cdiv(n, bn), k // bk, 3 * _num_sms(device) // 2, 64)
    return bt, bn, bk, split, warps, stages, _capability_at_least(device, 9, 0)


def _blocks_config(m: int, n: int, k: int, device: torch.device):
    """(BT, BN, BK, split, num_warps, num_stages, tma) of the blocks kernel: 8 or 16 tokens (its
    scale product grows with BT; 8 makes Triton use mma.sync, which reads the weight tile from
    shared memory in 8-byte words), 64 weight rows x BK 128 per step (the H100 sweep's best at
    every shape), split-K until the grid covers the SMs 1.5 times, the weight through TMA where
    the GPU has it (sm90+)."""
    bt = 8 if m <= BLOCKS_MAX_ROWS else 16
    bn, bk, warps, stages = 64, _block_k(k, 128), 4, 4
    split = _split_k(triton.cdiv(m, bt) * triton.cdiv(n, bn), k // bk, 3 * _num_sms(device) // 2, 64)
    return bt, bn, bk, split, warps, stages, _capability_at_least(device, 9, 0)


def tile_counts(tiles: int, device) -> torch.Tensor:
    """One zeroed int32 count per output tile of a split-K kernel (common.zeroed_workspace):
    the tile's last program sets its count back to zero. At least 4096 are held, so the
    buffer seldom grows."""
    return zeroed_workspace("tile_counts", max(tiles, 4096), torch.int32, device)[:tiles]


def _split_launch(m: int, n: int, k: int, bt: int, bn: int, bk: int, split: int, device, out_dtype):
    """The grid and buffers of the decode kernels (bt: the token tile, BT or the tiles
    kernel's BM): (grid, K per split, out, fp32 workspace, per-tile counts), the split in whole
    BK steps (_whole_step_split)."""
    if bk % 32 or k % bk:
        raise ValueError(f"fp8_linear: the kernel's BK must be a multiple of 32 dividing K={k}, got {bk}")
    k_per_split, split = _whole_step_split(k, bk, split)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bt), split)
    out = torch.empty((m, n), device=device, dtype=out_dtype)
    if split > 1:   # fp32 shares + one zeroed count per output tile
        ws = torch.empty((split, m, n), device=device, dtype=torch.float32)
        count = tile_counts(grid[0] * grid[1], device)
    else:
        ws = count = out    # never read
    return grid, k_per_split, out, ws, count


def _tma_aligned(weight: torch.Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base (its row stride, K bytes with K % 32 == 0,
    always is); a weight viewed at an odd offset takes the pointer loads instead."""
    return weight.data_ptr() % 16 == 0


def _swapped_config(config, weight: torch.Tensor) -> tuple:
    """A swapped kernel's (BT, BN, BK, split, num_warps, num_stages, tma): the 6-field configs
    of earlier sweeps mean no TMA, and TMA only where the weight allows it."""
    if len(config) not in (6, 7):
        raise ValueError(f"fp8_linear: config must be (BT, BN, BK, split, num_warps, num_stages[, tma]), "
                         f"got {config!r}")
    *fields, tma = (*config, False) if len(config) == 6 else config
    return (*fields, bool(tma) and _tma_aligned(weight))


def _fp8_linear_skinny(x2, weight, scale, out_dtype, config):
    m, k = x2.shape
    n = weight.shape[0]
    bt, bn, bk, split, warps, stages, tma = _swapped_config(config or _skinny_config(m, n, k, x2.device), weight)
    grid, k_per_split, out, ws, count = _split_launch(m, n, k, bt, bn, bk, split, x2.device, out_dtype)
    quantized = m >= QUANTIZE_FIRST_ROWS
    xq = quantize_rows(x2).view(torch.int32) if quantized else x2
    words = weight.view(torch.int16)
    w_src = TensorDescriptor(words, [n, k // 32, 16], [k // 2, 16, 1], [bn, bk // 32, 16]) if tma else words
    _fp8_linear_skinny_kernel[grid](xq, w_src, scale, out, ws, count, m, n, k,
                                    k_per_split, grid[2], BT=bt, BN=bn, BK=bk, QUANTIZED=quantized,
                                    SPLIT=grid[2] > 1, TMA=tma, num_warps=warps, num_stages=stages,
                                    launch_pdl=pdl(xq.device))
    return out


def _fp8_linear_blocks(x2, weight, scale, out_dtype, config):
    m, k = x2.shape
    n = weight.shape[0]
    bt, bn, bk, split, warps, stages, tma = _swapped_config(config or _blocks_config(m, n, k, x2.device), weight)
    grid, k_per_split, out, ws, count = _split_launch(m, n, k, bt, bn, bk, split, x2.device, out_dtype)
    codes, scales = quantize_rows_codes(x2)
    # the descriptor is encoded by Triton's launcher on the host at every launch and passed by
    # value, so a captured graph keeps it (the weight's address never changes)
    w_src = TensorDescriptor(weight, [n, k], [k, 1], [bn, 32]) if tma else weight
    _fp8_linear_blocks_kernel[grid](codes, scales, w_src, scale, out, ws, count, m, n, k, k_per_split,
                                    grid[2], BT=bt, BN=bn, BK=bk, SPLIT=grid[2] > 1, TMA=tma,
                                    num_warps=warps, num_stages=stages, launch_pdl=pdl(codes.device))
    return out


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               config=None, kernel=None) -> torch.Tensor:
    """`kernel`: one of DECODE_KERNELS ("blocks": _fp8_linear_blocks_kernel, "skinny":
    _fp8_linear_skinny_kernel, "tiles": _fp8_linear_kernel); default below PREFILL_ROWS rows:
    the measured choice of decode_kernel; `config` (BM or BT, BN, BK, split, num_warps,
    num_stages, and for the swapped kernels tma) overrides the chosen kernel's table (bench_ops'
    sweep)."""
    x2 = _rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    if kernel is None:
        if config is None and m >= PREFILL_ROWS and out_dtype == torch.bfloat16:
            return _fp8_linear_prefill(x2, weight, scale).view(*x.shape[:-1], n)
        kernel = decode_kernel(m, n, k, x.device)
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"fp8_linear: kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
    if kernel == "skinny":
        return _fp8_linear_skinny(x2, weight, scale, out_dtype, config).view(*x.shape[:-1], n)
    if kernel == "blocks":
        return _fp8_linear_blocks(x2, weight, scale, out_dtype, config).view(*x.shape[:-1], n)
    bm, bn, bk, split, warps, stages = config or _config(m, n, k, x.device)
    grid, k_per_split, out, ws, count = _split_launch(m, n, k, bm, bn, bk, split, x.device, out_dtype)
    quantized = m >= QUANTIZE_FIRST_ROWS
    _fp8_linear_kernel[grid](quantize_rows(x2) if quantized else x2, weight, scale, out, ws, count, m, n, k,
                             k_per_split, grid[2], BM=bm, BN=bn, BK=bk, QUANTIZED=quantized, SPLIT=grid[2] > 1,
                             num_warps=warps, num_stages=stages, launch_pdl=pdl(x2.device))
    return out.view(*x.shape[:-1], n)
