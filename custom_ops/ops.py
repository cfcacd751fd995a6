"""v41graph's custom ops (`torch.ops.v41graph.*`): schema + fake impl + reference impl.

These are the operations that later get fast kernels, fusions or stream placement. The model
calls them through `torch.ops.v41graph`, so the compiler sees one node per op. Cache writes
mutate their cache arguments in place (`mutates_args`). Fast implementations register for
their device key on top of the CPU/reference registration here.
"""
from __future__ import annotations

import torch
from torch.library import custom_op

from . import codecs
from . import reference as ref

_NS = "v41graph"


# ----------------------------------------------------------------------------- cache writes
@custom_op(f"{_NS}::window_kv_write", mutates_args=("cache", "scale"))
def window_kv_write(cache: torch.Tensor, scale: torch.Tensor, kv: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    ref.window_kv_write(cache, scale, kv, slot_mapping)


@custom_op(f"{_NS}::global_kv_write", mutates_args=("cache", "scale"))
def global_kv_write(cache: torch.Tensor, scale: torch.Tensor, kv: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    ref.global_kv_write(cache, scale, kv, slot_mapping)


@custom_op(f"{_NS}::index_k_write", mutates_args=("cache", "scale"))
def index_k_write(cache: torch.Tensor, scale: torch.Tensor, k: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    ref.index_k_write(cache, scale, k, slot_mapping)


@custom_op(f"{_NS}::state_write", mutates_args=("dst",))
def state_write(dst: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """dst.view(-1, last)[rows] = values, skipping rows == -1 (per-sequence state rings:
    compressor state, Engram history)."""
    ref.masked_row_write(dst, rows, values)


# ----------------------------------------------------------------------------- attention
@custom_op(f"{_NS}::sparse_attention", mutates_args=())
def sparse_attention(q: torch.Tensor, window_kv: torch.Tensor, window_scale: torch.Tensor,
                     fresh_kv: torch.Tensor, window_rows: torch.Tensor,
                     global_cache: torch.Tensor, global_scale: torch.Tensor,
                     global_rows: torch.Tensor, sink: torch.Tensor,
                     softmax_scale: float) -> torch.Tensor:
    """q [N,H,D]; the window ring read in place: window_kv [slots,W,D] uint8 (FP8 E4M3) +
    window_scale [slots,W,D/32] uint8 (UE8M0); fresh_kv [F,D] float (this call's rows, already
    FP8-QDQ'd, so identical to what the ring will hold); window_rows [N,W']: r < slots*W is ring
    row r (dequantized), r >= slots*W is fresh_kv[r - slots*W]; global cache FP4 [R,D/2] + E4M3
    scales [R,D/16]; global_rows [N,K] (may have K = 0). -1 = empty. Window rows come first in
    the list."""
    return ref.sparse_attention_over_caches(q, window_kv, window_scale, fresh_kv, window_rows,
                                            global_cache, global_scale, global_rows, sink,
                                            softmax_scale)


@sparse_attention.register_fake
def _(q, window_kv, window_scale, fresh_kv, window_rows, global_cache, global_scale, global_rows,
      sink, softmax_scale):
    return torch.empty_like(q)


# ----------------------------------------------------------------------------- indexer
# Two ops, one per kind of scoring layer (MODEL.md §4, lightning indexer):
#   indexer_topk             Full layers: score every visible compressed position (width C, the
#                            block table's width in compressed rows); the candidate source also
#                            returns the compact candidate list [N, P].
#   indexer_topk_candidates  Reindex layers: score only the P listed candidates; every input
#                            has width P, so the cost does not grow with the context.
# P = candidate_topk_blocks * candidate_block_size, clamped to C (static per graph).
@custom_op(f"{_NS}::indexer_topk", mutates_args=())
def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                 key_scale: torch.Tensor, key_rows: torch.Tensor, visible: torch.Tensor,
                 topk: int, candidate_block_size: int,
                 candidate_keep_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full layers: score every visible compressed position, take the top-k (ascending, -1
    padded; ties to the lower position).

    q [N, Hi, Di], weights [N, Hi]; key_rows [N, C]: cache row of compressed position c for
    each query (-1 = none); visible [N, C]: positions this query may select (causal, row >= 0).
    Returns (topk_ids [N, topk] compressed positions, candidates [N, P] int64). When
    candidate_keep_blocks > 0 (the candidate source) `candidates` is the compact candidate list:
    the visible positions of the top-`candidate_keep_blocks` blocks of `candidate_block_size`
    positions (block score = max, the newest visible block pinned), in ascending order, -1
    padded at the end, P = min(candidate_keep_blocks * candidate_block_size, C). Otherwise P = 0.
    Reindex layers pass the list to `indexer_topk_candidates`.
    """
    keys = ref.gather_index_k(key_cache, key_scale, key_rows, q.dtype)
    scores = ref.indexer_scores(q, weights, keys, visible)
    return ref.select_from_scores(scores, visible, topk, candidate_block_size, candidate_keep_blocks)


@indexer_topk.register_fake
def _(q, weights, key_cache, key_scale, key_rows, visible, topk, candidate_block_size,
      candidate_keep_blocks):
    n = q.shape[0]
    pool = ref.candidate_pool_size(visible.shape[-1], candidate_block_size, candidate_keep_blocks)
    return q.new_empty((n, topk), dtype=torch.int64), q.new_empty((n, pool), dtype=torch.int64)


@custom_op(f"{_NS}::indexer_topk_candidates", mutates_args=())
def indexer_topk_candidates(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                            key_scale: torch.Tensor, candidate_rows: torch.Tensor,
                            candidate_positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Reindex layers: score only the candidate source's candidates, take the top-k.

    q [N, Hi, Di], weights [N, Hi]; candidate_positions [N, P]: the candidate source's compact
    list (compressed positions, ascending, -1 padded at the end; every listed position is
    visible to the query, the candidate source only lists visible ones); candidate_rows [N, P]:
    the cache row of each listed position (-1 for the padding). Gathers and scores the P keys
    ([N, P] scores), takes the top-k over them and maps the columns back through the list.
    Returns topk_ids [N, topk] compressed positions, ascending, -1 padded: exactly (torch.equal)
    the top-k of scoring all C positions with everything outside the candidates invisible. The
    score of a position does not depend on which other positions are scored with it (see
    reference.indexer_scores), and the list's ascending order keeps the tie rule (ties to the
    lower position). tests/test_reindex_compact.py checks both against the mask formulation.
    """
    keys = ref.gather_index_k(key_cache, key_scale, candidate_rows, q.dtype)
    scores = ref.indexer_scores(q, weights, keys, ref.listed_candidates(candidate_rows, candidate_positions))
    return ref.topk_over_candidates(scores, candidate_positions, topk)


@indexer_topk_candidates.register_fake
def _(q, weights, key_cache, key_scale, candidate_rows, candidate_positions, topk):
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)


# Tensor-parallel indexer (v41graph.parallel): each rank scores its share of the heads, the
# partials are all-gathered, these finish the sum and select exactly as the ops above do.
@custom_op(f"{_NS}::indexer_partial_scores", mutates_args=())
def indexer_partial_scores(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                           key_scale: torch.Tensor, key_rows: torch.Tensor) -> torch.Tensor:
    """fp32 [N, C]: the pairwise head sum over the heads of q [N, Hi, Di] (this rank's), before
    the cast and the mask (reference.indexer_head_partial)."""
    keys = ref.gather_index_k(key_cache, key_scale, key_rows, q.dtype)
    return ref.indexer_head_partial(q, weights, keys)


@indexer_partial_scores.register_fake
def _(q, weights, key_cache, key_scale, key_rows):
    return q.new_empty(key_rows.shape, dtype=torch.float32)


@custom_op(f"{_NS}::indexer_select_from_partials", mutates_args=())
def indexer_select_from_partials(parts: torch.Tensor, visible: torch.Tensor, score_dtype: torch.dtype,
                                 topk: int, candidate_block_size: int,
                                 candidate_keep_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """indexer_topk's selection from the ranks' partials [N, tp, C] (rank order)."""
    scores = ref.finish_indexer_scores(parts, visible, score_dtype)
    return ref.select_from_scores(scores, visible, topk, candidate_block_size, candidate_keep_blocks)


@indexer_select_from_partials.register_fake
def _(parts, visible, score_dtype, topk, candidate_block_size, candidate_keep_blocks):
    pool = ref.candidate_pool_size(visible.shape[-1], candidate_block_size, candidate_keep_blocks)
    return (parts.new_empty((parts.shape[0], topk), dtype=torch.int64),
            parts.new_empty((parts.shape[0], pool), dtype=torch.int64))


@custom_op(f"{_NS}::indexer_select_candidates_from_partials", mutates_args=())
def indexer_select_candidates_from_partials(parts: torch.Tensor, candidate_rows: torch.Tensor,
                                            candidate_positions: torch.Tensor, score_dtype: torch.dtype,
                                            topk: int) -> torch.Tensor:
    """indexer_topk_candidates' selection from the ranks' partials [N, tp, P] (rank order)."""
    scores = ref.finish_indexer_scores(parts, ref.listed_candidates(candidate_rows, candidate_positions),
                                       score_dtype)
    return ref.topk_over_candidates(scores, candidate_positions, topk)


@indexer_select_candidates_from_partials.register_fake
def _(parts, candidate_rows, candidate_positions, score_dtype, topk):
    return parts.new_empty((parts.shape[0], topk), dtype=torch.int64)


# ----------------------------------------------------------------------------- quantized GEMMs
# The checkpoint's weight formats computed as stored (numerics="released"): the reference is
# DeepSeek's arithmetic (activation FP8 QDQ per 32 with pow2 scales, fp32 partial per 32-wide
# K block times both scales); on CUDA Triton kernels dequantize weight tiles in registers.
def _check_quantized_linear(op: str, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            scale_rows: int, k: int) -> None:
    """x [..., K] against a quantized weight (bytes, uint8) and its E8M0 scale (uint8
    [scale_rows, K/32]): the error names the op, the tensor and the rule."""
    if weight.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise TypeError(f"{op}: weight and scale must be the checkpoint's bytes (uint8), got "
                        f"{weight.dtype} and {scale.dtype}")
    if k % 32 or x.shape[-1] != k:
        raise ValueError(f"{op}: x's last dim {x.shape[-1]} must equal the weight's K {k}, a multiple of 32")
    if tuple(scale.shape) != (scale_rows, k // 32):
        raise ValueError(f"{op}: scale shape {tuple(scale.shape)} != {(scale_rows, k // 32)} "
                         f"(one E8M0 byte per 32-wide K block)")


def _check_fp8_linear(x, weight, scale) -> None:
    if weight.dim() != 2:
        raise ValueError(f"fp8_linear: weight must be [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_quantized_linear("fp8_linear", x, weight, scale, -(-n // 32), k)


@custom_op(f"{_NS}::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] times an FP8 E4M3 weight (uint8 bytes [N, K]) with one E8M0 scale per 32x32
    block (uint8 [ceil(N/32), K/32]); result [..., N] in out_dtype (float32: the fp32 sums
    before the final cast, for a row-parallel split)."""
    _check_fp8_linear(x, weight, scale)
    return ref.fp8_linear(x, weight, scale, out_dtype)


@fp8_linear.register_fake
def _(x, weight, scale, out_dtype):
    _check_fp8_linear(x, weight, scale)
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=out_dtype)


# ----------------------------------------------------------------------------- MoE
def _check_swiglu(gate, up, limit) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype or not gate.dtype.is_floating_point:
        raise ValueError(f"swiglu: gate and up must be floating tensors of one shape and dtype, got "
                         f"gate {tuple(gate.shape)} {gate.dtype}, up {tuple(up.shape)} {up.dtype}")
    if not limit >= 0 or limit == float("inf"):
        raise ValueError(f"swiglu: limit {limit} must be finite and >= 0 (0: no clamp)")


@custom_op(f"{_NS}::swiglu", mutates_args=())
def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert's clamped SwiGLU between its projections, in their dtype
    (reference.swiglu_in_dtype). One op because it is seven kernels when left to the graph
    (two upcasts, two clamps, silu, the product, the downcast); on CUDA it is one launch."""
    _check_swiglu(gate, up, limit)
    return ref.swiglu_in_dtype(gate, up, limit)


@swiglu.register_fake
def _(gate, up, limit):
    _check_swiglu(gate, up, limit)
    return torch.empty_like(gate)


def _check_moe_gate(x, weight, bias, topk) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"moe_gate: x [N, d] and weight [E, d] must agree on d, got x {tuple(x.shape)}, "
                         f"weight {tuple(weight.shape)}")
    if bias.shape != (weight.shape[0],):
        raise ValueError(f"moe_gate: bias shape {tuple(bias.shape)} != ({weight.shape[0]},) (one per expert)")
    if not 0 < topk <= weight.shape[0]:
        raise ValueError(f"moe_gate: topk {topk} must be in 1..{weight.shape[0]} (the number of experts)")


@custom_op(f"{_NS}::moe_gate", mutates_args=())
def moe_gate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, topk: int,
             route_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE router: (weights [N, topk] fp32, chosen expert ids [N, topk] int64)
    (reference.moe_gate). One op because it is ~12 kernels when left to the graph (the weight's
    fp32 cast, the GEMM, softplus, sqrt, the bias, a sort, a gather and the normalization); on
    CUDA it is two Triton launches."""
    _check_moe_gate(x, weight, bias, topk)
    return ref.moe_gate(x, weight, bias, topk, route_scale)


@moe_gate.register_fake
def _(x, weight, bias, topk, route_scale):
    _check_moe_gate(x, weight, bias, topk)
    n = x.shape[0]
    return (x.new_empty((n, topk), dtype=torch.float32), x.new_empty((n, topk), dtype=torch.int64))


def _check_mxfp4_moe(x, chosen, w13, s13, w2, s2) -> None:
    stacks = {"w13": w13, "s13": s13, "w2": w2, "s2": s2}
    bad = [n for n, t in stacks.items() if t.dtype != torch.uint8 or t.dim() != 3]
    if bad:
        raise TypeError(f"mxfp4_moe: {', '.join(bad)} must be 3-d stacks of the checkpoint's bytes (uint8)")
    e, two_i, d = w13.shape[0], w13.shape[1], x.shape[-1]
    i = two_i // 2
    if d % 32 or two_i % 64:
        raise ValueError(f"mxfp4_moe: x's last dim {d} and the intermediate size {i} must be multiples of 32")
    want = {"w13": (e, two_i, d // 2), "s13": (e, two_i, d // 32), "w2": (e, d, i // 2), "s2": (e, d, i // 32)}
    for name, t in stacks.items():
        if tuple(t.shape) != want[name]:
            raise ValueError(f"mxfp4_moe: {name} shape {tuple(t.shape)} != {want[name]} (x [N, {d}], {e} "
                             f"experts of intermediate size {i}, E8M0 scales per 32 along K)")
    if chosen.dim() != 2 or chosen.shape[0] != x.shape[0]:
        raise ValueError(f"mxfp4_moe: chosen must be [N, topk] with N = {x.shape[0]} tokens, got {tuple(chosen.shape)}")


@custom_op(f"{_NS}::mxfp4_moe", mutates_args=())
def mxfp4_moe(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, w13: torch.Tensor,
              s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, limit: float) -> torch.Tensor:
    """The routed experts of one MoE over stacked MXFP4 weights: [N, d] fp32, the sum over each
    token's chosen experts (chosen [N, topk] indexes the stack; the stack size E = held
    elsewhere) of weight * expert(x) (reference.mxfp4_moe). Static shapes, no host sync."""
    _check_mxfp4_moe(x, chosen, w13, s13, w2, s2)
    return ref.mxfp4_moe(x, weights, chosen, w13, s13, w2, s2, limit)


@mxfp4_moe.register_fake
def _(x, weights, chosen, w13, s13, w2, s2, limit):
    _check_mxfp4_moe(x, chosen, w13, s13, w2, s2)
    return x.new_empty(x.shape, dtype=torch.float32)


# ----------------------------------------------------------------------------- Engram
@custom_op(f"{_NS}::engram_hash", mutates_args=())
def engram_hash(compressed_ids: torch.Tensor, history: torch.Tensor, multipliers: torch.Tensor,
                primes: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Row ids [N, L, (n-1)*heads] of every Engram table for each token (reference.engram_hash_ids;
    the constants come from v41graph/model/engram_hash.py)."""
    return ref.engram_hash_ids(compressed_ids, history, multipliers, primes, offsets)


@engram_hash.register_fake
def _(compressed_ids, history, multipliers, primes, offsets):
    return compressed_ids.new_empty((*compressed_ids.shape, *offsets.shape))


@custom_op(f"{_NS}::engram_gather", mutates_args=())
def engram_gather(table: torch.Tensor, scale: torch.Tensor, row_ids: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """FP8 table rows (+E8M0/32 scales) gathered and dequantized: [N, M] -> [N, M*Dh]."""
    return ref.engram_gather(table, scale, row_ids, out_dtype)


@engram_gather.register_fake
def _(table, scale, row_ids, out_dtype):
    # The table may live in (pinned) host memory; the rows land where the ids are.
    return row_ids.new_empty((*row_ids.shape[:-1], row_ids.shape[-1] * table.shape[-1]), dtype=out_dtype)


# ----------------------------------------------------------------------------- fake quantization
FAKE_QUANT_FORMATS = {"fp8_ue8m0": codecs.qdq_fp8_ue8m0, "fp4_ue8m0": codecs.qdq_fp4_ue8m0}


def fake_quant_reference(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    if fmt not in FAKE_QUANT_FORMATS:
        raise ValueError(f"fake_quant: unknown format {fmt!r}; choose from {sorted(FAKE_QUANT_FORMATS)}")
    return FAKE_QUANT_FORMATS[fmt](x, block)


@custom_op(f"{_NS}::fake_quant", mutates_args=())
def fake_quant(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """x rounded through a block-scaled format and back (codecs.qdq_*), in x's dtype:
    fmt "fp8_ue8m0" (window KV rows: what the window cache will hold) or "fp4_ue8m0" (the
    indexer's query). One op because the codec is ~30 elementwise kernels when left to the
    graph; on CUDA it is one Triton launch."""
    return fake_quant_reference(x, fmt, block)


@fake_quant.register_fake
def _(x, fmt, block):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- mHC
@custom_op(f"{_NS}::mhc_sinkhorn", mutates_args=())
def mhc_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                 iters: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mHC predictor's coefficients (pre, post, comb) from its mixes, Sinkhorn included
    (reference.mhc_sinkhorn). One op because the 20 Sinkhorn rounds are ~130 tiny elementwise
    kernels per call when left to the graph, twice per layer; on CUDA it is one Triton launch."""
    if mixes.shape[-1] != (2 + hc) * hc:
        raise ValueError(f"mhc_sinkhorn: mixes last dim {mixes.shape[-1]} != (2 + hc) * hc = {(2 + hc) * hc}")
    return ref.mhc_sinkhorn(mixes, scale, base, hc, iters, eps)


@mhc_sinkhorn.register_fake
def _(mixes, scale, base, hc, iters, eps):
    lead = mixes.shape[:-1]
    return (mixes.new_empty((*lead, hc)), mixes.new_empty((*lead, hc)),
            mixes.new_empty((*lead, hc, hc)))


def _check_mhc_predictor(op, streams, fn, hc) -> None:
    if streams.dim() < 2 or streams.shape[-2] != hc:
        raise ValueError(f"{op}: streams must be [..., hc={hc}, d], got {tuple(streams.shape)}")
    d = streams.shape[-1]
    if tuple(fn.shape) != ((2 + hc) * hc, hc * d):
        raise ValueError(f"{op}: fn shape {tuple(fn.shape)} != ({(2 + hc) * hc}, {hc * d}) "
                         f"((2 + hc) * hc mixes over hc * d = the flattened streams)")


def _check_mhc_pre(streams, pre_prev, fn, hc) -> None:
    _check_mhc_predictor("mhc_pre", streams, fn, hc)
    if tuple(pre_prev.shape) != tuple(streams.shape[:-1]):
        raise ValueError(f"mhc_pre: streams must be [..., hc={hc}, d] and pre_prev [..., {hc}], got "
                         f"{tuple(streams.shape)} and {tuple(pre_prev.shape)}")


@custom_op(f"{_NS}::mhc_pre", mutates_args=())
def mhc_pre(streams: torch.Tensor, pre_prev: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
            base: torch.Tensor, hc: int, iters: int, hc_eps: float,
            norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sub-layer's mHC input side: (its input, the collapse of the streams with pre_prev;
    pre, post, comb of its own predictor) (reference.mhc_pre). One op because it is ~13
    kernels when left to the graph; on CUDA two launches that read the streams once."""
    _check_mhc_pre(streams, pre_prev, fn, hc)
    return ref.mhc_pre(streams, pre_prev, fn, scale, base, hc, iters, hc_eps, norm_eps)


@mhc_pre.register_fake
def _(streams, pre_prev, fn, scale, base, hc, iters, hc_eps, norm_eps):
    _check_mhc_pre(streams, pre_prev, fn, hc)
    lead = streams.shape[:-2]
    f32 = torch.float32
    return (streams.new_empty((*lead, streams.shape[-1])), streams.new_empty((*lead, hc), dtype=f32),
            streams.new_empty((*lead, hc), dtype=f32), streams.new_empty((*lead, hc, hc), dtype=f32))


def _check_mhc_collapse(streams, pre) -> None:
    if streams.dim() < 2 or tuple(pre.shape) != tuple(streams.shape[:-1]):
        raise ValueError(f"mhc_collapse: streams must be [..., hc, d] and pre [..., hc], got "
                         f"{tuple(streams.shape)} and {tuple(pre.shape)}")


@custom_op(f"{_NS}::mhc_collapse", mutates_args=())
def mhc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """mhc_pre's first output alone: the streams collapsed with pre, in their dtype
    (reference.mhc_collapse). With mhc_predict it is what passes/mhc_side_stream.py splits
    mhc_pre into; on CUDA one launch with the arithmetic of mhc_pre's kernel, so the same bits."""
    _check_mhc_collapse(streams, pre)
    return ref.mhc_collapse(streams, pre)


@mhc_collapse.register_fake
def _(streams, pre):
    _check_mhc_collapse(streams, pre)
    return streams.new_empty((*streams.shape[:-2], streams.shape[-1]))


@custom_op(f"{_NS}::mhc_predict", mutates_args=())
def mhc_predict(streams: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mhc_pre's (pre, post, comb) alone, the sub-layer's own predictor (reference.mhc_predict);
    on CUDA mhc_pre's two launches without the collapse, so the same bits."""
    _check_mhc_predictor("mhc_predict", streams, fn, hc)
    return ref.mhc_predict(streams, fn, scale, base, hc, iters, hc_eps, norm_eps)


@mhc_predict.register_fake
def _(streams, fn, scale, base, hc, iters, hc_eps, norm_eps):
    _check_mhc_predictor("mhc_predict", streams, fn, hc)
    lead, f32 = streams.shape[:-2], torch.float32
    return (streams.new_empty((*lead, hc), dtype=f32), streams.new_empty((*lead, hc), dtype=f32),
            streams.new_empty((*lead, hc, hc), dtype=f32))


def _check_mhc_post(out, streams, post, comb) -> None:
    hc = streams.shape[-2] if streams.dim() >= 2 else -1
    lead = tuple(streams.shape[:-2])
    if (tuple(out.shape) != lead + (streams.shape[-1],) or tuple(post.shape) != lead + (hc,)
            or tuple(comb.shape) != lead + (hc, hc)):
        raise ValueError(f"mhc_post: out [..., d], streams [..., hc, d], post [..., hc] and comb [..., hc, hc] "
                         f"must agree, got {tuple(out.shape)}, {tuple(streams.shape)}, {tuple(post.shape)}, "
                         f"{tuple(comb.shape)}")


@custom_op(f"{_NS}::mhc_post", mutates_args=())
def mhc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """A sub-layer's mHC expand, the new streams in out's dtype (reference.mhc_post). One op
    because it is five kernels when left to the graph; on CUDA one launch."""
    _check_mhc_post(out, streams, post, comb)
    return ref.mhc_post(out, streams, post, comb)


@mhc_post.register_fake
def _(out, streams, post, comb):
    _check_mhc_post(out, streams, post, comb)
    return streams.new_empty(streams.shape, dtype=out.dtype)


# ----------------------------------------------------------------------------- RoPE
@custom_op(f"{_NS}::rope", mutates_args=())
def rope(x: torch.Tensor, rotation: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [N, ..., D] with the interleaved pairs of its last 2*P channels rotated by rotation
    [N, P] (complex64; conjugated when inverse), in fp32, result in x's dtype and contiguous;
    the first D - 2P channels are copied. One op (one kernel on CUDA) for what is ~5 elementwise
    kernels spelled in torch (upcast, contiguous copy, complex multiply, downcast, concat); the
    model applies it five times per Full layer."""
    return ref.apply_rope(x, rotation, inverse).contiguous()


@rope.register_fake
def _(x, rotation, inverse):
    return x.new_empty(x.shape)


@custom_op(f"{_NS}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_before_weight: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in one op: fp32 math, result in x's dtype, weight [D]
    (cast_before_weight: the normalised value rounded to x's dtype before the weight multiply,
    Llama's spelling; see reference.rms_norm).
    passes/fuse_rmsnorm.py rewrites every RMSNorm the P1 fusions left (the attention, FFN and
    final norms; all of them with P1 off) into this op: one kernel instead of ~7 elementwise
    ones (upcast, square, mean, add, rsqrt, two multiplies, downcast). The result is always
    contiguous (the fast kernels write it so)."""
    return ref.rms_norm(x, weight, eps, cast_before_weight).contiguous()


@rms_norm.register_fake
def _(x, weight, eps, cast_before_weight=False):
    return x.new_empty(x.shape)


@custom_op(f"{_NS}::fused_wkv_rmsnorm", mutates_args=())
def fused_wkv_rmsnorm(x: torch.Tensor, wkv: torch.Tensor, norm_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """RMSNorm(x @ wkv^T) in one op: the ratio-1 compressor (the seed's P1). x [..., K] and
    wkv [N, K] of one float dtype; the norm runs in fp32 and the result has x's dtype.
    P1 (passes/fuse_wkv_rmsnorm.py) rewrites every matching Linear -> RMSNorm into this op."""
    return ref.wkv_rmsnorm(x, wkv, norm_weight, eps)


@fused_wkv_rmsnorm.register_fake
def _(x, wkv, norm_weight, eps):
    return x.new_empty((*x.shape[:-1], wkv.shape[0]))


@custom_op(f"{_NS}::fused_pool_rmsnorm", mutates_args=())
def fused_pool_rmsnorm(kv: torch.Tensor, score: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The ratio-2 compressor's pooling + RMSNorm in one op (the other half of P1): softmax over
    each group's r scores per channel, weighted sum of the r kv rows, cast, RMSNorm."""
    return ref.pool_rmsnorm(kv, score, norm_weight, eps, out_dtype)


@fused_pool_rmsnorm.register_fake
def _(kv, score, norm_weight, eps, out_dtype):
    return kv.new_empty((kv.shape[0], kv.shape[2]), dtype=out_dtype)


@custom_op(f"{_NS}::fused_ratio2_compressor", mutates_args=())
def fused_ratio2_compressor(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, state: torch.Tensor,
                            member_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio-2 compressor's read side in one op (P1, passes/fuse_pool_rmsnorm.py): the
    projection pair rows = [x wkv^T, x wgate^T] (fp32), the r member rows of each group
    gathered from the state ring ++ rows (member_rows: the index fed to index_select), softmax
    pooling, cast to out_dtype, RMSNorm. Returns (latent [N, D], rows [N, 2D]): it does NOT
    write the state ring; `rows` comes back because the separate `state_write` (which must run
    after this read of the state) still writes them."""
    return ref.ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype)


@fused_ratio2_compressor.register_fake
def _(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype):
    n, d = x.shape[0], wkv.shape[0]
    return (x.new_empty((n, d), dtype=out_dtype),
            x.new_empty((n, d + wgate.shape[0]), dtype=torch.float32))


@custom_op(f"{_NS}::fused_ratio2_compressor_update", mutates_args=("state",))
def fused_ratio2_compressor_update(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
                                   state: torch.Tensor, member_rows: torch.Tensor,
                                   state_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                   out_dtype: torch.dtype) -> torch.Tensor:
    """fused_ratio2_compressor with the state-ring write folded in (passes/fuse_ratio2_state_write.py):
    reads the ring's old rows, then writes this call's rows to `state_rows` (-1 skipped).
    Returns the latent [N, D]. On CUDA one Triton kernel does the pooling, the RMSNorm and
    the ring write (after the projection GEMMs). That kernel relies on the layout the model
    gives it (attention.Compressor): two members per token, only the first of which may be a
    ring row; each sequence (slot) at most once per call; a sequence's tokens contiguous with
    consecutive positions; distinct valid state_rows. The reference accepts any rows."""
    return ref.ratio2_compressor_update(x, wkv, wgate, state, member_rows, state_rows, norm_weight,
                                        eps, out_dtype)


@fused_ratio2_compressor_update.register_fake
def _(x, wkv, wgate, state, member_rows, state_rows, norm_weight, eps, out_dtype):
    return x.new_empty((x.shape[0], wkv.shape[0]), dtype=out_dtype)
