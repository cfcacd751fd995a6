"""mxfp4_moe on CUDA: the routed experts of one MoE over their stacked MXFP4 checkpoint bytes
(imported lazily by cuda_impls.py).

  routing          reference.pairs_by_expert: the N*topk (token, expert) pairs sorted by
                   expert, group ends as a fixed [E] int32 tensor (no host sync: captures); in
                   one launch (_route_kernel; the default), or as torch ops
                   (V41GRAPH_MOE_ROUTING=torch)
  x quantized     once, per 32 to FP8 (quant_gemm's row kernel; bf16 holds the values exactly),
                   not once per output tile: at decode sizes the redundant quantization cost
                   about as many instructions per weight code as the FP4 decode itself
  gate_up kernel   grid (I/BN, slots, S): a program loops over its expert's pairs BM at a time, loads
                   the tokens' quantized rows (gathered through the pair -> token index),
                   dequantizes the FP4 tiles of w1 and w3 (same rows) to bf16 and runs two dots;
                   the epilogue rounds gate and up to x's dtype as the reference's Linear does,
                   applies the clamped SwiGLU and the routing weight, rounds h to x's dtype and
                   stores it quantized per 32 (w2's input quantization, done once here) as
                   bf16, which holds every quantized value exactly (fp16 would not: a block's
                   largest value can round up past 65504). An expert nobody picked reads no
                   weights.
  down kernel      grid (d/BN, slots): the quantized h times w2; each row is stored at its
                   (token, slot) position (x's dtype, as the reference's w2 returns)
  slots            axis 1 of both grids: the experts that have pairs, found from the group ends
                   in the kernel (_expert_tile), min(E, pairs) slots: 6 at one token, not 48
  split K          at decode sizes, opt-in (_split_k): gate_up's K loop cut into equal slices
                   over a third grid axis; the last program of a weight tile adds the fp32
                   slices in slice order and runs the epilogue (_gate_up_kernel with S > 1)
  blocks           the weight rows as the MMA's M side and an expert's few tokens as its N
                   side (a 64-row weight tile fills a Hopper wgmma), in the reference's own
                   arithmetic (reference.blockwise_gemm): per 32-wide K block one FP8 wgmma of
                   the codes alone, the E2M1 codes placed as E4M3 by bit moves (7 instructions
                   per 8 codes, no scale) against the activation's E4M3 codes, the partial times
                   the block's two scales, added in block order (_gate_up_blocks_kernel,
                   _down_blocks_kernel). x and h travel as codes + per-32 scales, each 32-block's
                   codes in split-pairs order (its even columns, then its odd ones) so a thread's
                   4 packed weight bytes decode straight into its A-fragment registers. Offline
                   SASS: 3.20 / 3.74 instructions per code at BN = 128 (gate_up / down) against
                   the tokens kernels' 5.87 / 6.34. Faster than tokens on the H200 but not
                   bit-close to the reference there (Hopper's FP8 dot does not sum in fp32), so
                   opt-in (_config). A third pair, the same rows-first layout on bf16 dots, was
                   slower than both at every batch (twenty-fourth session) and was removed.
  combine          the topk slots summed in fp32 in ascending expert order, the loop's order
                   (torch ops, or one launch: _combine_kernel).

Pairs routed to an expert held elsewhere (chosen == E) sort past the last group; the combine
adds them as zeros.
The tile table comes from scripts/bench_ops.py --only quant on the H200.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..reference import pairs_by_expert
from .common import (_FLOAT_DTYPES, _TL_DTYPE, _e8m0_scales, _e8m0_to_fp32, _exp2i, _fp4_block_e4m3, _fp4_weight_tile,
                     _next_k, _qdq_fp8_blocks, _quant_fp8_blocks, _split_pairs, _wait_for_inputs, pdl)
from .quant_gemm import _block_k, fp8_capable, quantize_rows, quantize_rows_codes, tile_counts


@triton.jit
def _expert_tile(offs_ptr, E, N, BN: tl.constexpr, BE: tl.constexpr):
    """This program's weight tile: its expert e, the expert's pairs [start, end) in the sorted
    pair list, and the tile's BN weight rows n of N (axis 0) with their mask. Axis 1 counts the
    experts that have pairs, not all E (BE >= E): program i takes the i-th of them, so at one
    token 6 slots of 48 experts are launched, not 48 of which 42 find nothing (the grid is
    min(E, pairs) wide: _expert_slots). A program past the last busy expert gets e = 0 and an
    empty pair range."""
    pid_n, slot = tl.program_id(0), tl.program_id(1)
    ee = tl.arange(0, BE)
    ends = tl.load(offs_ptr + ee, mask=ee < E, other=0)
    starts = tl.load(offs_ptr + ee - 1, mask=(ee > 0) & (ee < E), other=0)
    busy = ends > starts
    mine = busy & (tl.cumsum(busy.to(tl.int32), axis=0) == slot + 1)
    e = tl.sum(tl.where(mine, ee, 0), axis=0)
    start = tl.sum(tl.where(mine, starts, 0), axis=0)
    end = tl.sum(tl.where(mine, ends, 0), axis=0)
    n = pid_n * BN + tl.arange(0, BN)
    return e, start, end, n, n < N


@triton.jit
def _pair_tile(tok_ptr, m0, end, BM: tl.constexpr):
    """Pairs m0..m0+BM of an expert's group (those before `end`): their indexes, mask and
    token rows (int64; row 0 where masked)."""
    r = m0 + tl.arange(0, BM)
    r_mask = r < end
    return r, r_mask, tl.load(tok_ptr + r, mask=r_mask, other=0).to(tl.int64)


@triton.jit
def _swiglu_h(gate, up, pw, limit, HAS_LIMIT: tl.constexpr, X_DTYPE: tl.constexpr):
    """The gate_up epilogue on [BM pairs, BN] fp32 sums: gate and up rounded to x's dtype as the
    reference's Linear returns them, the clamped SwiGLU, the routing weight pw [BM], h rounded to
    x's dtype (as fp32); the callers quantize it per 32 columns (w2's input quantization, done
    once here: BN is a multiple of 32 and so is I)."""
    gate = gate.to(X_DTYPE).to(tl.float32)
    up = up.to(X_DTYPE).to(tl.float32)
    if HAS_LIMIT:
        up = tl.minimum(tl.maximum(up, -limit), limit)
        gate = tl.minimum(gate, limit)
    h = gate / (1.0 + tl.exp(-gate)) * up
    return (pw[:, None] * h).to(X_DTYPE).to(tl.float32)


@triton.jit
def _store_h(acc_g, acc_u, r, r_mask, n, n_mask, pw_ptr, h_ptr, I, limit, HAS_LIMIT: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, X_DTYPE: tl.constexpr):
    """gate_up's epilogue for BM pairs x BN columns: _swiglu_h with the pairs' routing weights,
    h quantized per 32 columns and stored (bf16 holds the quantized values exactly)."""
    pw = tl.load(pw_ptr + r, mask=r_mask, other=0.0)
    h = _qdq_fp8_blocks(_swiglu_h(acc_g, acc_u, pw, limit, HAS_LIMIT, X_DTYPE), BM, BN)
    tl.store(h_ptr + r[:, None].to(tl.int64) * I + n[None, :], h.to(tl.bfloat16),
             mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_kernel(xq_ptr, tok_ptr, pw_ptr, offs_ptr, w_ptr, s_ptr, h_ptr, ws_ptr, count_ptr, P, E, D, I,
                    K_SPLIT, limit, S: tl.constexpr, HAS_LIMIT: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr, X_DTYPE: tl.constexpr):
    """Program (column tile, expert slot, K slice): the slice's dots for each BM pairs of the
    expert's group. S = 1 (K_SPLIT = D): the epilogue at once (_store_h; ws and count unread).
    S > 1 (_split_k): the slice's fp32 sums of gate and up go to ws [S, P, 2I] at the pairs'
    sorted indexes, and the last of a weight tile's S programs (an atomic count per tile) adds
    the slices in slice order and runs the epilogue: deterministic, and no second launch."""
    _wait_for_inputs()
    e, start, end, n, n_mask = _expert_tile(offs_ptr, E, I, BN, BE)
    s = tl.program_id(2)
    if S == 1:              # the whole of D from a constant start: the unsplit loop as cheap as ever
        k_lo = 0
        k_hi = D
    else:
        k_lo = tl.multiple_of(s * K_SPLIT, BK)   # slices of whole BK steps: the loads vectorize
        k_hi = k_lo + K_SPLIT
    gate_rows = e.to(tl.int64) * 2 * I + n           # w1 rows of expert e in the [E*2I] stack
    up_rows = gate_rows + I                          # w3 rows
    for m0 in range(start, end, BM):
        r, r_mask, tok = _pair_tile(tok_ptr, m0, end, BM)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        u_g = _e8m0_scales(s_ptr, gate_rows, n_mask, k_lo, D, BK)
        u_u = _e8m0_scales(s_ptr, up_rows, n_mask, k_lo, D, BK)
        for k0 in range(k_lo, k_hi, BK):
            u_g_next = _e8m0_scales(s_ptr, gate_rows, n_mask, _next_k(k0, k_hi, BK), D, BK)   # a step ahead
            u_u_next = _e8m0_scales(s_ptr, up_rows, n_mask, _next_k(k0, k_hi, BK), D, BK)
            k = k0 + tl.arange(0, BK)
            a = tl.load(xq_ptr + tok[:, None] * D + k[None, :], mask=r_mask[:, None], other=0.0)
            acc_g = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, u_g, gate_rows, n_mask, k0, D, BN, BK)), acc_g)
            acc_u = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, u_u, up_rows, n_mask, k0, D, BN, BK)), acc_u)
            u_g, u_u = u_g_next, u_u_next
        if S == 1:
            _store_h(acc_g, acc_u, r, r_mask, n, n_mask, pw_ptr, h_ptr, I, limit, HAS_LIMIT, BM, BN, X_DTYPE)
        else:
            at = ws_ptr + (s * P + r[:, None]).to(tl.int64) * (2 * I) + n[None, :]
            mask = r_mask[:, None] & n_mask[None, :]
            tl.store(at, acc_g, mask=mask)
            tl.store(at + I, acc_u, mask=mask)
    if S > 1:
        tl.debug_barrier()      # every thread's slice is stored before the count is released
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == S - 1:
            for m0 in range(start, end, BM):
                r = m0 + tl.arange(0, BM)
                r_mask = r < end
                mask = r_mask[:, None] & n_mask[None, :]
                at = ws_ptr + r[:, None].to(tl.int64) * (2 * I) + n[None, :]
                acc_g = tl.load(at, mask=mask, other=0.0, cache_modifier=".cg")
                acc_u = tl.load(at + I, mask=mask, other=0.0, cache_modifier=".cg")
                for j in tl.static_range(1, S):     # fixed order whichever program came last
                    slice_at = at + (j * P).to(tl.int64) * (2 * I)
                    acc_g += tl.load(slice_at, mask=mask, other=0.0, cache_modifier=".cg")
                    acc_u += tl.load(slice_at + I, mask=mask, other=0.0, cache_modifier=".cg")
                _store_h(acc_g, acc_u, r, r_mask, n, n_mask, pw_ptr, h_ptr, I, limit, HAS_LIMIT, BM, BN, X_DTYPE)
            tl.atomic_xchg(count_ptr + tile, 0)   # left zeroed (tile_counts)


@triton.jit
def _down_kernel(h_ptr, dest_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, E, D, I,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr):
    _wait_for_inputs()
    e, start, end, n, n_mask = _expert_tile(offs_ptr, E, D, BN, BE)
    rows = e.to(tl.int64) * D + n                    # w2 rows of expert e in the [E*d] stack
    for m0 in range(start, end, BM):
        r = m0 + tl.arange(0, BM)
        r_mask = r < end
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        u = _e8m0_scales(s_ptr, rows, n_mask, 0, I, BK)
        for k0 in range(0, I, BK):
            u_next = _e8m0_scales(s_ptr, rows, n_mask, _next_k(k0, I, BK), I, BK)   # a step ahead
            k = k0 + tl.arange(0, BK)
            a = tl.load(h_ptr + r[:, None].to(tl.int64) * I + k[None, :], mask=r_mask[:, None], other=0.0)
            a = a.to(tl.bfloat16)                     # quantized by the gate_up epilogue, bf16
            acc = tl.dot(a, tl.trans(_fp4_weight_tile(w_ptr, u, rows, n_mask, k0, I, BN, BK)), acc)
            u = u_next
        dest = tl.load(dest_ptr + r, mask=r_mask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[:, None] * D + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _column(t, j: tl.constexpr, NC: tl.constexpr):
    """Column j of t [R, NC] (NC = 1, 2 or 4) as [R]: register moves (tl.split), no loads."""
    if NC == 1:
        return tl.reshape(t, (t.shape[0],))
    elif NC == 2:
        c0, c1 = tl.split(t)
        return c0 if j == 0 else c1
    else:
        even, odd = tl.split(tl.reshape(t, (t.shape[0], 2, 2)))       # columns (0, 2), (1, 3)
        c0, c2 = tl.split(even)
        c1, c3 = tl.split(odd)
        if j == 0:
            return c0
        elif j == 1:
            return c1
        elif j == 2:
            return c2
        else:
            return c3


@triton.jit
def _scale_words_at(s_ptr, rows, row_mask, k0, K, SCALE_WORDS: tl.constexpr):
    """SCALE_WORDS (BK = 128, K % 128 == 0, s_ptr 4-byte aligned): rows' four E8M0 scales of
    k0..k0+128 as one int32 word each [BN] (_scale_byte takes them apart): Triton's pipeliner
    copies word loads ahead like the weight bytes, where single bytes it loads in the loop and
    waits on. Masked rows read scale 1 (bytes 127). Else 0 (_scale_byte loads bytes)."""
    if SCALE_WORDS:
        return tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + rows * (K // 128) + k0 // 128, mask=row_mask,
                       other=0x7F7F7F7F)
    else:
        return 0


@triton.jit
def _scale_byte(s_ptr, words, rows, row_mask, kb, K, j: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """Rows' E8M0 scale of K block kb, the j-th of its word (int32 [BN])."""
    if SCALE_WORDS:
        return (words >> (8 * j)) & 0xFF
    else:
        return tl.load(s_ptr + rows * (K // 32) + kb, mask=row_mask, other=127).to(tl.int32)


@triton.jit
def _codes_scales(scale_ptr, rows, row_mask, k0, K, BK: tl.constexpr):
    """The activation rows' scales of the K blocks of k0..k0+BK times 2^6 ([BT, BK/32] fp32;
    2^6 undoes _fp4_block_e4m3's 2^-6, exactly), one load per K step (_column picks a block's)."""
    kb = k0 // 32 + tl.arange(0, BK // 32)
    return tl.load(scale_ptr + rows[:, None] * (K // 32) + kb[None, :], mask=row_mask[:, None], other=0.0) * 64.0


@triton.jit
def _codes_block(c_ptr, rows, row_mask, kb, K):
    """Rows' E4M3 codes of K block kb ([BT, 32], split-pairs order): the activation side of a
    block partial. Rows out of range read zeros."""
    return tl.load(c_ptr + rows[:, None] * K + kb * 32 + tl.arange(0, 32)[None, :], mask=row_mask[:, None], other=0.0)


@triton.jit
def _block_partial(w_ptr, rows, row_mask, kb, K, u, a, sa, acc, BN: tl.constexpr):
    """acc [BN, BT] + reference.blockwise_gemm's term of K block kb: one partial of the codes
    alone on an FP8 tensor-core dot, W's E2M1 codes as E4M3 (common._fp4_block_e4m3)
    [BN, 32] . the activation's codes a [BT, 32]^T, times the two power-of-two scales (u: W's
    E8M0 bytes [BN]; sa [BT]). The products are exact; the sum inside the dot is not fp32 on
    Hopper (scripts/probe_fp8_dot.py), so the partial can differ from the reference's in its
    last bits (Triton's interpreter, summing in fp32, matches it bit for bit)."""
    w = _fp4_block_e4m3(w_ptr, rows, row_mask, kb, K, BN)
    return acc + tl.dot(w, tl.trans(a)) * (_e8m0_to_fp32(u)[:, None] * sa[None, :])


@triton.jit
def _gate_up_blocks_kernel(xc_ptr, xs_ptr, tok_ptr, pw_ptr, offs_ptr, w_ptr, s_ptr, hc_ptr, hs_ptr, E, D, I,
                           limit, HAS_LIMIT: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, BE: tl.constexpr, X_DTYPE: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """The rows-first gate_up in the reference's own arithmetic (_block_partial): x as E4M3
    codes (split-pairs order) + scales, h stored the same way for the down kernel."""
    _wait_for_inputs()
    e, start, end, n, n_mask = _expert_tile(offs_ptr, E, I, BN, BE)
    gate_rows = e.to(tl.int64) * 2 * I + n
    up_rows = gate_rows + I
    for m0 in range(start, end, BT):
        r, r_mask, tok = _pair_tile(tok_ptr, m0, end, BT)
        acc_g = tl.zeros([BN, BT], dtype=tl.float32)
        acc_u = tl.zeros([BN, BT], dtype=tl.float32)
        for k0 in range(0, D, BK):
            words_g = _scale_words_at(s_ptr, gate_rows, n_mask, k0, D, SCALE_WORDS)
            words_u = _scale_words_at(s_ptr, up_rows, n_mask, k0, D, SCALE_WORDS)
            sa_k = _codes_scales(xs_ptr, tok, r_mask, k0, D, BK)
            for j in tl.static_range(BK // 32):
                kb = k0 // 32 + j
                a, sa = _codes_block(xc_ptr, tok, r_mask, kb, D), _column(sa_k, j, BK // 32)
                u = _scale_byte(s_ptr, words_g, gate_rows, n_mask, kb, D, j, SCALE_WORDS)
                acc_g = _block_partial(w_ptr, gate_rows, n_mask, kb, D, u, a, sa, acc_g, BN)
                u = _scale_byte(s_ptr, words_u, up_rows, n_mask, kb, D, j, SCALE_WORDS)
                acc_u = _block_partial(w_ptr, up_rows, n_mask, kb, D, u, a, sa, acc_u, BN)
        pw = tl.load(pw_ptr + r, mask=r_mask, other=0.0)
        h = _swiglu_h(tl.trans(acc_g), tl.trans(acc_u), pw, limit, HAS_LIMIT, X_DTYPE)
        codes, ex = _quant_fp8_blocks(h, BT, BN)
        r64 = r[:, None].to(tl.int64)
        tl.store(hc_ptr + r64 * I + n[None, :], _split_pairs(codes, BT, BN).to(tl.float8e4nv),
                 mask=r_mask[:, None] & n_mask[None, :])
        kb = tl.program_id(0) * (BN // 32) + tl.arange(0, BN // 32)
        tl.store(hs_ptr + r64 * (I // 32) + kb[None, :], _exp2i(ex),
                 mask=r_mask[:, None] & (kb < I // 32)[None, :])


@triton.jit
def _down_blocks_kernel(hc_ptr, hs_ptr, dest_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, E, D, I,
                        BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BE: tl.constexpr,
                        SCALE_WORDS: tl.constexpr):
    """The rows-first down kernel in the reference's own arithmetic (_block_partial) over h's
    codes and scales."""
    _wait_for_inputs()
    e, start, end, n, n_mask = _expert_tile(offs_ptr, E, D, BN, BE)
    rows = e.to(tl.int64) * D + n
    for m0 in range(start, end, BT):
        r = m0 + tl.arange(0, BT)
        r_mask = r < end
        r64 = r.to(tl.int64)
        acc = tl.zeros([BN, BT], dtype=tl.float32)
        for k0 in range(0, I, BK):
            words = _scale_words_at(s_ptr, rows, n_mask, k0, I, SCALE_WORDS)
            sa_k = _codes_scales(hs_ptr, r64, r_mask, k0, I, BK)
            for j in tl.static_range(BK // 32):
                kb = k0 // 32 + j
                a, sa = _codes_block(hc_ptr, r64, r_mask, kb, I), _column(sa_k, j, BK // 32)
                u = _scale_byte(s_ptr, words, rows, n_mask, kb, I, j, SCALE_WORDS)
                acc = _block_partial(w_ptr, rows, n_mask, kb, I, u, a, sa, acc, BN)
        dest = tl.load(dest_ptr + r, mask=r_mask, other=0).to(tl.int64)
        tl.store(out_ptr + dest[None, :] * D + n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & r_mask[None, :])


# =============================================================================== routing, combine
@triton.jit
def _route_kernel(chosen_ptr, weights_ptr, tok_ptr, pw_ptr, dest_ptr, ids_ptr, offs_ptr, P, E,
                  K: tl.constexpr, BQ: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """reference.pairs_by_expert in one launch, for BQ of the P = N*K (token, slot) pairs q per
    program. The sorted pair list is a stable sort of the flat ids by expert: pair q goes to
    position #{q' : id(q') < id(q)} + #{q' < q : id(q') == id(q)}, counted against all P
    (a [BQ, BP] compare per step: P is small at decode, and the kernel replaces ~12 torch
    launches). At that position: its token, its routing weight (fp32) and its pair index
    dest = token * K + its rank among the token's ids (ascending, ties by slot: the combine
    order). ids [P]: each pair index's expert (the combine masks experts held elsewhere).
    Program 0 also writes offs [E]: #{q : id(q) <= e}, the groups' ends."""
    _wait_for_inputs()
    q = tl.program_id(0) * BQ + tl.arange(0, BQ)
    q_mask = q < P
    e = tl.load(chosen_ptr + q, mask=q_mask, other=0).to(tl.int64)
    t = q // K
    j = q % K
    rank = tl.zeros([BQ], dtype=tl.int32)
    for j2 in tl.static_range(K):
        c2 = tl.load(chosen_ptr + t * K + j2, mask=q_mask, other=0).to(tl.int64)
        rank += ((c2 < e) | ((c2 == e) & (j2 < j))).to(tl.int32)
    pos = tl.zeros([BQ], dtype=tl.int32)
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        c = tl.load(chosen_ptr + p, mask=p < P, other=0).to(tl.int64)[None, :]
        before = (c < e[:, None]) | ((c == e[:, None]) & (p[None, :] < q[:, None]))
        pos += tl.sum((before & (p < P)[None, :]).to(tl.int32), axis=1)
    w = tl.load(weights_ptr + q, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(tok_ptr + pos, t.to(tl.int32), mask=q_mask)
    tl.store(pw_ptr + pos, w, mask=q_mask)
    tl.store(dest_ptr + pos, (t * K + rank).to(tl.int32), mask=q_mask)
    tl.store(ids_ptr + t * K + rank, e.to(tl.int32), mask=q_mask)
    if tl.program_id(0) == 0:
        for e0 in range(0, E, BE):
            ee = e0 + tl.arange(0, BE)
            count = tl.zeros([BE], dtype=tl.int32)
            for p0 in range(0, P, BP):
                p = p0 + tl.arange(0, BP)
                c = tl.load(chosen_ptr + p, mask=p < P, other=0).to(tl.int64)[None, :]
                count += tl.sum(((c <= ee[:, None]) & (p < P)[None, :]).to(tl.int32), axis=1)
            tl.store(offs_ptr + ee, count, mask=ee < E)


@triton.jit
def _combine_kernel(pairs_ptr, ids_ptr, y_ptr, D, E, K: tl.constexpr, BD: tl.constexpr):
    """y[t] = the token's K pair rows (x's dtype) summed in fp32 from +0, pair by pair in their
    order (ascending expert): the reference's loop, add for add. A pair whose expert is held
    elsewhere (id >= E) adds +0, as the reference's zero row does."""
    _wait_for_inputs()
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    d_mask = d < D
    y = tl.zeros([BD], dtype=tl.float32)
    for r in tl.static_range(K):
        here = tl.load(ids_ptr + t * K + r) < E
        y = y + tl.load(pairs_ptr + (t * K + r) * D + d, mask=d_mask & here, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + d, y, mask=d_mask)


# Above this many pairs the routing goes through torch (reference.pairs_by_expert): the route
# kernel's count is quadratic in the pairs (at 4096 tokens x top-6 it compares 0.6 G pairs).
ROUTE_KERNEL_MAX_PAIRS = 8192


def routing_kernels_on(pairs: int) -> bool:
    """Whether routing and combine run as the route and combine kernels: by default, up to
    ROUTE_KERNEL_MAX_PAIRS. $V41GRAPH_MOE_ROUTING="torch" (bench.py's v41graph-torchrouting
    variant; read at every call, so a capture takes it) runs the torch ops instead. Measured on
    an H100 (twenty-sixth session): the same bits as the torch ops, the MoE call 1.42 / 1.13 /
    1.11x faster at 1 / 8 / 64 tokens, the bench_rank decode step 5.0 % (B = 1) and 5.5 % (B = 64)
    shorter."""
    value = os.environ.get("V41GRAPH_MOE_ROUTING") or "kernels"
    if value not in ("kernels", "torch"):
        raise ValueError(f"V41GRAPH_MOE_ROUTING must be 'kernels' or 'torch', got {value!r}")
    return value == "kernels" and pairs <= ROUTE_KERNEL_MAX_PAIRS


def route_pairs(weights: torch.Tensor, chosen: torch.Tensor, n_experts: int, use_kernel: bool = True):
    """(tok, pw, dest, ids, offs): the routing of reference.pairs_by_expert as the kernels read
    it, the pairs sorted by expert: each pair's token [P] int32, routing weight [P] fp32, pair
    index [P] int32 (token * topk + rank among its ids); ids [P] int32: the expert of each pair
    index; offs [n_experts] int32: the groups' ends. use_kernel: one launch (_route_kernel),
    else torch ops (reference.pairs_by_expert)."""
    n, k = chosen.shape
    p = n * k
    if not use_kernel:
        ids, pair_w, perm, offs = pairs_by_expert(weights, chosen, n_experts)
        return ((perm // k).to(torch.int32), pair_w[perm].contiguous(), perm.to(torch.int32),
                ids.reshape(-1).to(torch.int32), offs)
    dev = chosen.device
    tok = torch.empty(p, device=dev, dtype=torch.int32)
    pw = torch.empty(p, device=dev, dtype=torch.float32)
    dest = torch.empty(p, device=dev, dtype=torch.int32)
    ids = torch.empty(p, device=dev, dtype=torch.int32)
    offs = torch.empty(n_experts, device=dev, dtype=torch.int32)
    bq = 64
    _route_kernel[(triton.cdiv(p, bq),)](chosen.contiguous(), weights.contiguous(), tok, pw, dest, ids, offs,
                                         p, n_experts, K=k, BQ=bq, BP=64, BE=64, num_warps=4,
                                         launch_pdl=pdl(chosen.device))
    return tok, pw, dest, ids, offs


def combine_pairs(pairs: torch.Tensor, ids: torch.Tensor, n_experts: int, topk: int,
                  use_kernel: bool = True) -> torch.Tensor:
    """[N, d] fp32: each token's topk pair rows of pairs [N*topk, d] summed in fp32 in pair
    order, rows whose expert (ids) is held elsewhere as zeros (reference.mxfp4_moe's combine).
    use_kernel: one launch (_combine_kernel), else torch ops."""
    d = pairs.shape[1]
    n = pairs.shape[0] // topk
    if not use_kernel:
        rows = torch.where((ids < n_experts)[:, None], pairs, 0.0).view(n, topk, d)
        y = torch.zeros((n, d), device=pairs.device, dtype=torch.float32)
        for j in range(topk):
            y = y + rows[:, j]
        return y
    y = torch.empty((n, d), device=pairs.device, dtype=torch.float32)
    bd = 1024
    _combine_kernel[(n, triton.cdiv(d, bd))](pairs, ids, y, d, n_experts, K=topk, BD=bd, num_warps=4,
                                             launch_pdl=pdl(pairs.device))
    return y


def mxfp4_moe_supported(x, weights, chosen, w13, s13, w2, s2) -> bool:
    tensors = (x, weights, chosen, w13, s13, w2, s2)
    if not (x.is_cuda and x.dtype in _FLOAT_DTYPES and x.dim() == 2 and all(t.device == x.device for t in tensors)
            and w13.dtype == w2.dtype == s13.dtype == s2.dtype == torch.uint8
            and all(t.is_contiguous() for t in (w13, s13, w2, s2))):
        return False
    e, two_i, d_half = w13.shape
    i, d = two_i // 2, x.shape[1]
    if (d % 32 or i % 32 or d_half * 2 != d or tuple(s13.shape) != (e, two_i, d // 32)
            or tuple(w2.shape) != (e, d, i // 2) or tuple(s2.shape) != (e, d, i // 32)):
        return False
    return fp8_capable(x.device)


KERNELS = ("tokens", "blocks")


def _config(pairs_per_expert: float):
    """(BM, BN, BK_gate_up, BK_down, num_warps, num_stages, kernel) by the expected rows per
    expert (decode: 4 warps; at 64 tokens on the H200 801 us against 8 warps' 1010 us in one
    sweep, tenth session). kernel: "tokens" (_gate_up_kernel, _down_kernel: BM pairs as the
    MMA's M side) or "blocks" (the _blocks kernels: the weight rows as the M side, BM pairs as
    its N side, FP8 dots per 32-wide K block). Measured on the H200 (twenty-fourth session, 48
    experts, top-6): blocks (BN 64) 163.6 / 427.4 / 794.6 us at 1 / 8 / 64 tokens against
    tokens' 193.0 / 502.1 / 812.9. tokens stays the default because Hopper's FP8 dot does not
    sum a block's 32 products in fp32: blocks leaves 71 % of bf16 outputs bit-equal to the
    reference (rel 1.1e-3; tokens 99.9 %, 5e-5). config=(16, 64, 128, 128, 4, 3, "blocks")
    opts in."""
    if pairs_per_expert <= 16:
        return 16, 64, 128, 128, 4, 3, "tokens"
    if pairs_per_expert <= 64:
        return 64, 64, 64, 64, 4, 3, "tokens"
    return 128, 64, 64, 64, 8, 3, "tokens"


def kernel_of(config) -> str:
    """The kernel pair a config names (its seventh field; "tokens" when it has six)."""
    return config[6] if len(config) > 6 else "tokens"


def maxnreg_of(config) -> int | None:
    """The register cap per thread a config asks for (its eighth field; None: the compiler's
    choice). The tokens gate_up compiles to 168 registers at the decode tile, 3 programs of 4
    warps per SM; capped at 128 (offline sm90 SASS: 747 loop instructions against 744, a 16-byte
    stack, no spill in the loop) 4 fit: a launch option to sweep (bench_ops --only mxfp4)."""
    return config[7] if len(config) > 7 else None


def _scale_words(scales: torch.Tensor, k: int, bk: int) -> bool:
    """Whether the blocks kernels may read these E8M0 scales as int32 words (_scale_words_at)."""
    return bk % 128 == 0 and k % 128 == 0 and scales.data_ptr() % 4 == 0


# gate_up's K split applies at decode sizes only (the first row of _config): there the unsplit
# kernel has few programs, and the fp32 slices stay small (at 4096 tokens x top-6, four slices
# would be 1.8 GB)
SPLIT_MAX_PAIRS_PER_EXPERT = 16


def _split_k(pairs_per_expert: float) -> int:
    """How many K slices of D the gate_up programs of one weight tile share
    (_gate_up_kernel's S), up to SPLIT_MAX_PAIRS_PER_EXPERT pairs per expert (else 1).
    $V41GRAPH_MOE_SPLIT (an integer; bench.py's v41graph-moesplit variant; read at every call,
    so a capture takes it) sets it; unset, 1 (no split). At B = 1 (48 experts, top-6) the
    unsplit gate_up runs 36 x 6 = 216 programs on 132 SMs, 40 K steps each; split 4 took it from
    95 to 74 us per call on an H100, but that form's separate finish launch ate the gain in the
    whole step (twenty-sixth session). This one-launch form is not yet timed."""
    value = os.environ.get("V41GRAPH_MOE_SPLIT")
    if not value:
        return 1
    try:
        split = int(value)
    except ValueError:
        split = 0
    if split < 1:
        raise ValueError(f"V41GRAPH_MOE_SPLIT must be an integer >= 1 (gate_up's K slices), got {value!r}")
    return split if pairs_per_expert <= SPLIT_MAX_PAIRS_PER_EXPERT else 1


def _split_width(k: int, splits: int, bk: int) -> tuple[int, int]:
    """(slice width, slices): K cut into equal slices of whole BK steps, as many as divide its
    steps evenly up to `splits` (the kernel's K loop then needs no bound check)."""
    steps = k // bk
    splits = max(s for s in range(1, min(splits, steps) + 1) if steps % s == 0)
    return k // splits, splits


def _expert_slots(n_experts: int, pairs: int) -> int:
    """The width of the expert kernels' axis 1: no more experts can have pairs than there are
    pairs (_expert_tile gives each busy expert one slot). A static size, so decode still
    captures: at one token x top-6 it is 6 of 48."""
    return max(1, min(n_experts, pairs))


def mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, limit, config=None, split=None):
    """`config` (BM, BN, BK_gate_up, BK_down, num_warps, num_stages[, kernel[, maxnreg]])
    overrides the table; kernel is one of KERNELS ("tokens" when left out), maxnreg caps both
    kernels' registers per thread (maxnreg_of). `split`: the tokens gate_up's K
    slices (_split_k when None; 1 = the unsplit kernel)."""
    n, k = chosen.shape
    e, two_i, _ = w13.shape
    i, d = two_i // 2, x.shape[1]
    config = config or _config(n * k / e)
    if len(config) not in (6, 7, 8):
        raise ValueError(f"mxfp4_moe: config must be (BM, BN, BK_gate_up, BK_down, num_warps, num_stages[, kernel"
                         f"[, maxnreg]]), got {config!r}")
    maxnreg = maxnreg_of(config)
    if maxnreg is not None and (not isinstance(maxnreg, int) or isinstance(maxnreg, bool) or not 24 <= maxnreg <= 255):
        raise ValueError(f"mxfp4_moe: config maxnreg must be None or an integer in [24, 255] (registers per "
                         f"thread), got {maxnreg!r}")
    kernel = kernel_of(config)
    bm, bn, bk1, bk2, warps, stages = config[:6]
    if kernel not in KERNELS:
        raise ValueError(f"mxfp4_moe: config kernel {kernel!r} is not one of {KERNELS}")
    if bn % 32:
        raise ValueError(f"mxfp4_moe: config BN must be a multiple of 32 (the gate_up epilogue quantizes h "
                         f"per 32 columns of its tile), got {bn}")
    if kernel == "blocks" and bm < 16:
        raise ValueError(f"mxfp4_moe: the blocks kernels' token tile BM must be >= 16 (the MMA's N side), got {bm}")
    split = _split_k(n * k / e) if split is None else split
    if not isinstance(split, int) or isinstance(split, bool) or split < 1:
        raise ValueError(f"mxfp4_moe: split must be an integer >= 1 (gate_up's K slices), got {split!r}")
    if kernel == "blocks" and split != 1:
        raise ValueError(f"mxfp4_moe: split {split!r}: only the tokens kernels split K")
    routing_kernels = routing_kernels_on(n * k)
    tok, pw, dest, ids, offs = route_pairs(weights, chosen, e, routing_kernels)
    bk1, bk2 = _block_k(d, bk1), _block_k(i, bk2)
    pairs = torch.empty((n * k, d), device=x.device, dtype=x.dtype)   # rows of held-elsewhere pairs: unread
    launch = dict(num_warps=warps, num_stages=stages, launch_pdl=pdl(x.device),
                  **({"maxnreg": maxnreg} if maxnreg is not None else {}))
    slots, be = _expert_slots(e, n * k), triton.next_power_of_2(e)
    grid_up, grid_down = (triton.cdiv(i, bn), slots), (triton.cdiv(d, bn), slots)
    if kernel == "blocks":  # codes + scales in, codes + scales between the two kernels
        xc, xs = quantize_rows_codes(x.contiguous(), torch.float8_e4m3fn, split_pairs=True)
        bk1, bk2 = min(bk1, 128), min(bk2, 128)     # one scale word per row and K step
        hc = torch.empty((n * k, i), device=x.device, dtype=torch.float8_e4m3fn)
        hs = torch.empty((n * k, i // 32), device=x.device, dtype=torch.float32)
        _gate_up_blocks_kernel[grid_up](xc, xs, tok, pw, offs, w13, s13, hc, hs, e, d, i, float(limit),
                                        HAS_LIMIT=limit > 0, BT=bm, BN=bn, BK=bk1, BE=be, X_DTYPE=_TL_DTYPE[x.dtype],
                                        SCALE_WORDS=_scale_words(s13, d, bk1), **launch)
        _down_blocks_kernel[grid_down](hc, hs, dest, offs, w2, s2, pairs, e, d, i, BT=bm, BN=bn, BK=bk2, BE=be,
                                       SCALE_WORDS=_scale_words(s2, i, bk2), **launch)
    else:
        xq = quantize_rows(x.contiguous())
        h = torch.empty((n * k, i), device=x.device, dtype=torch.bfloat16)   # quantized values
        width, slices = _split_width(d, split, bk1)
        if slices == 1:     # workspace and counts never read
            ws, count = h, offs
        else:               # fp32 slices (rows of held-elsewhere pairs: unwritten, unread), a count per tile
            ws = torch.empty((slices, n * k, 2 * i), device=x.device, dtype=torch.float32)
            count = tile_counts(grid_up[0] * grid_up[1], x.device)
        # split: at most 2 stages. With 3 the split kernel compiles to 224 registers for sm90
        # (2 programs per SM), with 2 to 167 like the unsplit one (offline SASS; not yet timed)
        up_launch = launch if slices == 1 else dict(launch, num_stages=min(stages, 2))
        _gate_up_kernel[grid_up + (slices,)](xq, tok, pw, offs, w13, s13, h, ws, count, n * k, e, d, i, width,
                                             float(limit), S=slices, HAS_LIMIT=limit > 0, BM=bm, BN=bn, BK=bk1,
                                             BE=be, X_DTYPE=_TL_DTYPE[x.dtype], **up_launch)
        _down_kernel[grid_down](h, dest, offs, w2, s2, pairs, e, d, i, BM=bm, BN=bn, BK=bk2, BE=be, **launch)
    return combine_pairs(pairs, ids, e, k, routing_kernels)
