"""Deliberately naive re-implementations of V4.1's number formats and attention pieces
(MODEL.md sections 4 and 5), written from the spec and NOT from v41graph's code.

Everything here is plain Python: explicit loops over queries, positions, heads and channels,
Python floats (float64) for arithmetic, and lookup tables built by enumeration. numpy is used
only to round to float32 where the spec asks for an fp32 step (e.g. fp32(1/448)). Speed is
irrelevant: the tests only call these on small inputs.
"""
from __future__ import annotations

import math
import operator
from typing import Sequence

import numpy as np

NEG_INF = float("-inf")
POS_INF = float("inf")


def f32(x: float) -> float:
    """Round a Python float to the nearest float32 value (returned as a Python float)."""
    return float(np.float32(x))


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(map(operator.mul, a, b))


# =============================================================================== FP4 E2M1
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]   # code & 7 -> magnitude


def e2m1_value(code: int) -> float:
    """Code 0..15 -> value; bit 3 is the sign."""
    mag = E2M1_MAGNITUDES[code & 7]
    return -mag if code & 8 else mag


def e2m1_code(v: float) -> int:
    """Nearest E2M1 value, exact ties to the even code, saturating at +-6; -0 and values that
    round to 0 get code 0 (no negative zero)."""
    a = min(abs(v), 6.0)
    best = None
    for code, mag in enumerate(E2M1_MAGNITUDES):
        d = abs(a - mag)
        if best is None or d < best[0] or (d == best[0] and code % 2 == 0):
            best = (d, code)
    code = best[1]
    if v < 0 and code != 0:
        code |= 8
    return code


def pack_nibbles(codes: Sequence[int]) -> list[int]:
    """Element 2i in the low nibble of byte i, element 2i+1 in the high nibble."""
    assert len(codes) % 2 == 0
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


def unpack_nibbles(data: Sequence[int]) -> list[int]:
    out = []
    for byte in data:
        out += [byte & 0xF, byte >> 4]
    return out


# =============================================================================== FP8 E4M3 (fn)
def e4m3_value(bits: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; 0x7F/0xFF NaN."""
    sign = -1.0 if bits & 0x80 else 1.0
    e, m = (bits >> 3) & 0xF, bits & 7
    if e == 0xF and m == 7:
        return float("nan")
    if e == 0:
        return sign * (m / 8.0) * 2.0 ** -6
    return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


E4M3_POSITIVE = [(e4m3_value(b), b) for b in range(0x7F)]   # 0 .. 448, increasing
E4M3_MAX = 448.0


def e4m3_bits(v: float) -> int:
    """Nearest E4M3 value (clamped to +-448 first), ties to the even code."""
    a = min(abs(v), E4M3_MAX)
    best = None
    for val, bits in E4M3_POSITIVE:
        d = abs(a - val)
        if best is None or d < best[0] or (d == best[0] and bits % 2 == 0):
            best = (d, bits)
    bits = best[1]
    if v < 0 and bits != 0:
        bits |= 0x80
    return bits


def e4m3_round(v: float) -> float:
    return e4m3_value(e4m3_bits(v))


# =============================================================================== E8M0 / UE8M0
def e8m0_value(e: int) -> float:
    return math.ldexp(1.0, e - 127)


def ceil_log2(x: float) -> int:
    """Exact ceil(log2(x)) for x > 0 (math.frexp: x = m * 2^k with m in [0.5, 1))."""
    m, k = math.frexp(x)
    return k - 1 if m == 0.5 else k


def ue8m0_exponent(amax: float, qmax: float) -> int:
    """Scale exponent of a UE8M0 block: ceil(log2(fp32(amax) * fp32(1/qmax))), the product
    rounded to fp32 as the spec computes it."""
    v = f32(f32(amax) * f32(1.0 / qmax))
    return ceil_log2(v)


# =============================================================================== block quantizers
def quant_fp8_ue8m0(row: Sequence[float], block: int = 32):
    """-> (E4M3 bit patterns, E8M0 scale bytes). Inputs must have a clearly nonzero amax."""
    bits, scales = [], []
    for b0 in range(0, len(row), block):
        blk = [f32(v) for v in row[b0:b0 + block]]
        e = ue8m0_exponent(max(abs(v) for v in blk), E4M3_MAX)
        scale = math.ldexp(1.0, e)
        bits += [e4m3_bits(v / scale) for v in blk]      # exact: scale is a power of two
        scales.append(e + 127)
    return bits, scales


def dequant_fp8_ue8m0(bits: Sequence[int], scales: Sequence[int], block: int = 32) -> list[float]:
    return [e4m3_value(b) * e8m0_value(scales[i // block]) for i, b in enumerate(bits)]


def quant_fp4_ue8m0(row: Sequence[float], block: int = 32):
    """-> (E2M1 codes (unpacked), E8M0 scale bytes)."""
    codes, scales = [], []
    for b0 in range(0, len(row), block):
        blk = [f32(v) for v in row[b0:b0 + block]]
        e = ue8m0_exponent(max(abs(v) for v in blk), 6.0)
        scale = math.ldexp(1.0, e)
        codes += [e2m1_code(v / scale) for v in blk]
        scales.append(e + 127)
    return codes, scales


def dequant_fp4_ue8m0(codes: Sequence[int], scales: Sequence[int], block: int = 32) -> list[float]:
    return [e2m1_value(c) * e8m0_value(scales[i // block]) for i, c in enumerate(codes)]


FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0 ** -9


def quant_fp4_e4m3(row: Sequence[float], block: int = 16):
    """Main KV: scale = e4m3(max(amax, 6*2^-9) / 6) (fp32 division), codes = e2m1(x / scale)
    with the division in fp32. -> (codes, E4M3 scale bit patterns)."""
    codes, scale_bits = [], []
    for b0 in range(0, len(row), block):
        blk = [f32(v) for v in row[b0:b0 + block]]
        amax = max(max(abs(v) for v in blk), FP4_E4M3_AMAX_FLOOR)
        sb = e4m3_bits(f32(amax / 6.0))
        scale = e4m3_value(sb)
        codes += [e2m1_code(f32(v / scale)) for v in blk]
        scale_bits.append(sb)
    return codes, scale_bits


def dequant_fp4_e4m3(codes: Sequence[int], scale_bits: Sequence[int], block: int = 16) -> list[float]:
    return [e2m1_value(c) * e4m3_value(scale_bits[i // block]) for i, c in enumerate(codes)]


# =============================================================================== RMSNorm / RoPE
def rms_norm(x: Sequence[float], weight: Sequence[float], eps: float) -> list[float]:
    r = 1.0 / math.sqrt(math.fsum(v * v for v in x) / len(x) + eps)
    return [w * v * r for v, w in zip(x, weight)]


def rope(x: Sequence[float], position: int, inv_freqs: Sequence[float], inverse: bool = False) -> list[float]:
    """Rotate interleaved pairs (x[2j], x[2j+1]) of the LAST 2*len(inv_freqs) channels by the
    angle position * inv_freqs[j] (negated for the inverse)."""
    pairs = len(inv_freqs)
    out = list(x)
    base = len(x) - 2 * pairs
    for j in range(pairs):
        ang = position * inv_freqs[j] * (-1.0 if inverse else 1.0)
        c, s = math.cos(ang), math.sin(ang)
        a, b = x[base + 2 * j], x[base + 2 * j + 1]
        out[base + 2 * j] = a * c - b * s
        out[base + 2 * j + 1] = a * s + b * c
    return out


def matvec(w: Sequence[Sequence[float]], x: Sequence[float]) -> list[float]:
    return [dot(row, x) for row in w]


# =============================================================================== attention
def sparse_attention(q, kv, valid, sink, softmax_scale):
    """q [N][H][D]; kv [N][S][D] (K = V); valid [N][S] bools; sink [H].

    o = sum_t e^{s_t - m} k_t / (sum_t e^{s_t - m} + e^{sink - m}) over the selected rows,
    s_t = scale * q.k_t. (m only stabilises; any m gives the same value mathematically.)
    """
    out = []
    for n in range(len(q)):
        rows = [t for t in range(len(kv[n])) if valid[n][t]]
        per_head = []
        for h in range(len(q[n])):
            scores = [softmax_scale * dot(q[n][h], kv[n][t]) for t in rows]
            m = max(scores + [sink[h]])
            weights = [math.exp(s - m) for s in scores]
            denom = math.fsum(weights) + math.exp(sink[h] - m)
            d = len(q[n][h])
            o = [math.fsum(weights[i] * kv[n][t][c] for i, t in enumerate(rows)) / denom
                 for c in range(d)]
            per_head.append(o)
        out.append(per_head)
    return out


# =============================================================================== indexer
def indexer_scores(q, weights, keys, visible):
    """I[n][c] = sum_h w[n][h] * relu(q[n][h] . k[n][c]); -inf where not visible.
    q [N][Hi][Di], weights [N][Hi], keys [N][C][Di], visible [N][C]."""
    out = []
    for n in range(len(q)):
        row = []
        for c in range(len(keys[n])):
            if not visible[n][c]:
                row.append(NEG_INF)
                continue
            row.append(math.fsum(weights[n][h] * max(0.0, dot(q[n][h], keys[n][c]))
                                 for h in range(len(q[n]))))
        out.append(row)
    return out


def causal_visible(position: int, ratio: int, capacity: int) -> list[bool]:
    """Compressed positions a query at `position` may see: c < floor((position + 1) / ratio)."""
    count = (position + 1) // ratio
    return [c < count for c in range(capacity)]


def topk_ascending(scores: Sequence[float], k: int) -> list[int]:
    """The k best finite scores (ties to the lower id), their ids sorted ascending, -1 padded."""
    finite = [c for c in range(len(scores)) if scores[c] > NEG_INF]
    best = sorted(finite, key=lambda c: (-scores[c], c))[:k]
    return sorted(best) + [-1] * (k - len(best))


def topk_margin(scores: Sequence[float], k: int) -> float:
    """Gap between the k-th and (k+1)-th best finite score (inf if there is no (k+1)-th).
    An exact tie of zeros (every head's ReLU is 0 for both) is no ambiguity: it resolves to the
    lower id in any precision, so it counts as an infinite margin."""
    finite = sorted((s for s in scores if s > NEG_INF), reverse=True)
    if len(finite) <= k:
        return POS_INF
    if finite[k - 1] == finite[k] == 0.0:
        return POS_INF
    return finite[k - 1] - finite[k]


def candidate_blocks(scores: Sequence[float], visible_count: int, block_size: int,
                     keep_blocks: int) -> list[bool]:
    """Block score = max over block_size consecutive positions; the block holding the newest
    visible position (visible_count - 1) is pinned to +inf; keep the best keep_blocks blocks
    (ties to the lower block id) whose score is finite or pinned. Returns a per-position mask."""
    c = len(scores)
    n_blocks = (c + block_size - 1) // block_size
    block_score = []
    for b in range(n_blocks):
        block_score.append(max(scores[b * block_size:(b + 1) * block_size]))
    if visible_count > 0:
        block_score[(visible_count - 1) // block_size] = POS_INF
    order = sorted(range(n_blocks), key=lambda b: (-block_score[b], b))[:keep_blocks]
    kept = {b for b in order if block_score[b] > NEG_INF}
    return [(pos // block_size) in kept for pos in range(c)]


# =============================================================================== compressor
def softmax_pool_ratio2(kv_rows, score_rows, norm_weight, eps):
    """One group of 2 tokens: per channel c, softmax over the 2 tokens of score[.][c], weighted
    sum of kv[.][c]; then RMSNorm. kv_rows / score_rows: 2 lists of D floats."""
    d = len(kv_rows[0])
    pooled = []
    for c in range(d):
        s0, s1 = score_rows[0][c], score_rows[1][c]
        m = max(s0, s1)
        e0, e1 = math.exp(s0 - m), math.exp(s1 - m)
        pooled.append((e0 * kv_rows[0][c] + e1 * kv_rows[1][c]) / (e0 + e1))
    return rms_norm(pooled, norm_weight, eps)


def fp4_error_bound(x: float, scale: float) -> float:
    """Largest |x - dequant(quant(x))| of E2M1 with this scale: half the local grid step, or
    the saturation error beyond 6*scale (plus a little fp32 slack)."""
    a = abs(x) / scale
    if a >= 6.0:
        err = abs(x) - 6.0 * scale
    elif a >= 4.0:
        err = 1.0 * scale
    elif a >= 2.0:
        err = 0.5 * scale
    else:
        err = 0.25 * scale
    return err + 1e-6 * max(abs(x), scale)


# =============================================================================== mHC coefficients
def mhc_coefficients(mixes: Sequence[float], scale: Sequence[float], base: Sequence[float], hc: int,
                     iters: int, eps: float):
    """MODEL.md §3 for one token, in float64: (pre [hc], post [hc], comb [hc][hc])."""
    def sigmoid(v: float) -> float:
        return 1.0 / (1.0 + math.exp(-v))
    pre = [sigmoid(mixes[j] * scale[0] + base[j]) + eps for j in range(hc)]
    post = [2.0 * sigmoid(mixes[hc + j] * scale[1] + base[hc + j]) for j in range(hc)]
    logits = [[mixes[2 * hc + i * hc + j] * scale[2] + base[2 * hc + i * hc + j] for j in range(hc)]
              for i in range(hc)]
    comb = []
    for row in logits:
        top = max(row)
        ex = [math.exp(v - top) for v in row]
        comb.append([e / math.fsum(ex) + eps for e in ex])

    def normalise_columns(m):
        sums = [math.fsum(m[i][j] for i in range(hc)) for j in range(hc)]
        return [[m[i][j] / (sums[j] + eps) for j in range(hc)] for i in range(hc)]

    def normalise_rows(m):
        return [[v / (math.fsum(row) + eps) for v in row] for row in m]

    comb = normalise_columns(comb)
    for _ in range(iters - 1):
        comb = normalise_columns(normalise_rows(comb))
    return pre, post, comb
