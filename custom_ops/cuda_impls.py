"""CUDA implementations of v41graph's custom ops (Triton kernels in the triton/ package).

Importing this module only registers Python functions for the CUDA dispatch key; it imports
neither triton nor CUDA, so it is safe on CPU-only machines. Triton is imported at the first
call on a CUDA tensor. Where Triton is missing, an input is outside what a kernel supports, or
V41GRAPH_DISABLE_TRITON=1 is set, the call runs the pure-torch reference (the specification)
on the GPU instead, so results never depend on which path ran beyond the stated tolerances.
V41GRAPH_DISABLE_TRITON=name,.. turns off only the named kernels (an op name; for the
indexer ops, indexer_scores and topk_ascending): A/B runs of one kernel inside the whole model
(scripts/bench.py's v41graph-sorttopk variant). It is read at every call, so it takes effect at
the next capture.

Registered: fused_wkv_rmsnorm, rms_norm, rope, window_kv_write, global_kv_write, index_k_write,
sparse_attention, engram_gather, mhc_sinkhorn, mhc_pre and mhc_post (the mHC residual's two sides),
mhc_predict and mhc_collapse (mhc_pre in two, for the P9 side stream), fake_quant, moe_gate (the
router), swiglu (the shared expert's activation), fp8_linear and mxfp4_moe (the released weight
formats, dequantized in registers), fused_ratio2_compressor(_update) (cuBLAS projections + one
Triton kernel for pooling, RMSNorm and the state-ring write); indexer_topk and
indexer_topk_candidates score with a Triton kernel that reads the FP4 keys in place (bit-identical
to the reference on the H200, fp32 and bf16) and select with a one-launch Triton top-k (the
reference's ids). (engram_hash and fused_pool_rmsnorm keep the reference on CUDA.)
"""
from __future__ import annotations

import importlib
import os
import warnings

import torch

from . import reference as ref
from .ops import fake_quant_reference

_NS = "v41graph"
_TK: dict = {}          # kernel family ("norms", "attention", ...) -> its module in triton/
_TK_FAILED = False      # Triton could not be imported: every CUDA op runs the reference


def _disabled(kernel: str | None) -> bool:
    """V41GRAPH_DISABLE_TRITON: "1" turns every kernel off, a comma list the named ones."""
    value = os.environ.get("V41GRAPH_DISABLE_TRITON", "0")
    if value in ("", "0"):
        return False
    return value == "1" or (kernel is not None and kernel in value.split(","))


def triton_module(family: str, kernel: str | None = None):
    """The kernel module triton/<family>.py, imported at the first call, or None when Triton is
    unavailable or disabled (all kernels, or `kernel` by name)."""
    global _TK_FAILED
    if _TK_FAILED or _disabled(kernel):
        return None
    tk = _TK.get(family)
    if tk is None:
        try:
            tk = _TK[family] = importlib.import_module(f".triton.{family}", __package__)
        except ImportError as e:   # no triton on this CUDA machine: reference fallback
            warnings.warn(f"v41graph: Triton kernels unavailable ({e}); CUDA ops run the "
                          "pure-torch reference", RuntimeWarning, stacklevel=3)
            _TK_FAILED = True
    return tk


# ----------------------------------------------------------------------------- registrations
# op name -> its CUDA impl (the Python function registered for the CUDA key): called directly
# by compiler/triton_precompile.py on stand-in tensors to note the Triton kernels it compiles
CUDA_IMPLS: dict = {}


def _cuda_impl(op: str):
    """Decorator: register `fn` as the CUDA impl of v41graph::`op` (and keep it in CUDA_IMPLS)."""
    def register(fn):
        CUDA_IMPLS[op] = fn
        torch.library.register_kernel(f"{_NS}::{op}", "cuda", fn)
        return fn
    return register


def _register_triton_first(op: str, family: str, checked: int, fallback) -> None:
    """CUDA impl of `op`: the Triton wrapper of the same name in triton/<family>.py when Triton
    is usable and `<op>_supported(*args[:checked])` accepts the inputs, else `fallback(*args)`,
    the pure-torch reference on the GPU (a plain function: it never dispatches back here)."""
    def impl(*args):
        tk = triton_module(family, op)
        if tk is not None and getattr(tk, f"{op}_supported")(*args[:checked]):
            return getattr(tk, op)(*args)
        return fallback(*args)
    _cuda_impl(op)(impl)


_register_triton_first("fused_wkv_rmsnorm", "norms", 3, ref.wkv_rmsnorm)
_register_triton_first("rope", "rope", 2,
                       lambda x, rotation, inverse: ref.apply_rope(x, rotation, inverse).contiguous())
_register_triton_first("rms_norm", "norms", 2, lambda x, weight, eps, cast_before_weight=False:
                       ref.rms_norm(x, weight, eps, cast_before_weight).contiguous())
_register_triton_first("sparse_attention", "attention", 9, ref.sparse_attention_over_caches)   # all but the scale
_register_triton_first("mhc_sinkhorn", "mhc", 4, ref.mhc_sinkhorn)


def _mhc_predict_torch(streams, fn, scale, base, hc, iters, hc_eps, norm_eps):
    """mhc_predict's fallback: the reference's torch ops with the Sinkhorn by its own op (its kernel)."""
    return torch.ops.v41graph.mhc_sinkhorn(ref.mhc_mixes(streams, fn, norm_eps), scale, base, hc, iters, hc_eps)


def _mhc_pre_torch(streams, pre_prev, fn, scale, base, hc, iters, hc_eps, norm_eps):
    """mhc_pre's fallback: the collapse and mhc_predict's fallback."""
    return (ref.mhc_collapse(streams, pre_prev),
            *_mhc_predict_torch(streams, fn, scale, base, hc, iters, hc_eps, norm_eps))


_register_triton_first("mhc_pre", "mhc", 6, _mhc_pre_torch)
_register_triton_first("mhc_predict", "mhc", 5, _mhc_predict_torch)
_register_triton_first("mhc_collapse", "mhc", 2, ref.mhc_collapse)
_register_triton_first("mhc_post", "mhc", 4, ref.mhc_post)
_register_triton_first("fake_quant", "cache_writes", 3, fake_quant_reference)
_register_triton_first("fp8_linear", "quant_gemm", 3, ref.fp8_linear)
_register_triton_first("mxfp4_moe", "moe_fp4", 7, ref.mxfp4_moe)
_register_triton_first("moe_gate", "moe_gate", 4, ref.moe_gate)
_register_triton_first("swiglu", "swiglu", 2, ref.swiglu_in_dtype)


def _register_cache_write(op: str, block: int) -> None:
    """CUDA impl of a cache write: the Triton kernel when it supports the inputs (scale
    block `block`), else the pure-torch reference."""
    def impl(cache, scale, values, slot_mapping):
        tk = triton_module("cache_writes", op)
        if tk is not None and tk.cache_write_supported(cache, scale, values, slot_mapping, block):
            getattr(tk, op)(cache, scale, values, slot_mapping)
        else:
            getattr(ref, op)(cache, scale, values, slot_mapping)
    _cuda_impl(op)(impl)


_register_cache_write("window_kv_write", 32)    # FP8 + UE8M0 per 32
_register_cache_write("global_kv_write", 16)    # FP4 + E4M3 per 16
_register_cache_write("index_k_write", 32)      # FP4 + UE8M0 per 32


@_cuda_impl("fused_ratio2_compressor")
def _fused_ratio2_compressor_cuda(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype):
    tk = triton_module("compressor", "fused_ratio2_compressor")
    if tk is not None and tk.ratio2_supported(x, wkv, wgate, state, member_rows, norm_weight, out_dtype):
        latent, kv, score = tk.ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype)
        return latent, torch.cat([kv, score], dim=-1)
    return ref.ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype)


@_cuda_impl("fused_ratio2_compressor_update")
def _fused_ratio2_compressor_update_cuda(x, wkv, wgate, state, member_rows, state_rows, norm_weight,
                                         eps, out_dtype):
    tk = triton_module("compressor", "fused_ratio2_compressor_update")
    if (tk is not None and state_rows.dim() == 1 and state_rows.shape[0] == x.shape[0]
            and tk.ratio2_supported(x, wkv, wgate, state, member_rows, norm_weight, out_dtype)):
        return tk.ratio2_compressor(x, wkv, wgate, state, member_rows, norm_weight, eps, out_dtype,
                                    state_rows=state_rows)[0]
    return ref.ratio2_compressor_update(x, wkv, wgate, state, member_rows, state_rows, norm_weight,
                                        eps, out_dtype)


@_cuda_impl("engram_gather")
def _engram_gather_cuda(table, scale, row_ids, out_dtype):
    tk = triton_module("engram", "engram_gather")
    if tk is not None and tk.engram_gather_supported(table, scale, row_ids, out_dtype):
        return tk.engram_gather(table, scale, row_ids, out_dtype)
    if not table.is_cuda:   # host table without a usable kernel: gather on the host, copy rows
        return ref.engram_gather(table, scale, row_ids.to(table.device), out_dtype).to(
            row_ids.device, non_blocking=True)
    return ref.engram_gather(table, scale, row_ids, out_dtype)


def _indexer_scores(q, weights, key_cache, key_scale, rows, visible):
    """[N, C] scores: the in-place FP4 kernel where supported, else the reference (gather +
    dequantize + einsum); bit-identical either way (tests/test_kernels_cuda.py)."""
    tk = triton_module("indexer", "indexer_scores")
    if tk is not None and tk.indexer_scores_supported(q, weights, key_cache, key_scale, rows, visible):
        return tk.indexer_scores(q, weights, key_cache, key_scale, rows, visible)
    return ref.indexer_scores(q, weights, ref.gather_index_k(key_cache, key_scale, rows, q.dtype), visible)


def _topk_ascending(scores, k):
    """reference.topk_ascending's ids: one Triton launch (a bitwise select in registers, no
    sort) where supported, else torch's two sorts."""
    tk = triton_module("indexer", "topk_ascending")
    if tk is not None and tk.topk_ascending_supported(scores, k):
        return tk.topk_ascending(scores, k)
    return ref.topk_ascending(scores, k)


@_cuda_impl("indexer_topk")
def _indexer_topk_cuda(q, weights, key_cache, key_scale, key_rows, visible, topk,
                       candidate_block_size, candidate_keep_blocks):
    scores = _indexer_scores(q, weights, key_cache, key_scale, key_rows, visible)
    return (_topk_ascending(scores, topk),
            ref.candidate_positions(scores, visible, candidate_block_size, candidate_keep_blocks,
                                    select=_topk_ascending))


@_cuda_impl("indexer_topk_candidates")
def _indexer_topk_candidates_cuda(q, weights, key_cache, key_scale, candidate_rows,
                                  candidate_positions, topk):
    listed = ref.listed_candidates(candidate_rows, candidate_positions)
    scores = _indexer_scores(q, weights, key_cache, key_scale, candidate_rows, listed)
    return ref.topk_over_candidates(scores, candidate_positions, topk, select=_topk_ascending)
