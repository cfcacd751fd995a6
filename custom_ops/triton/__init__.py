"""Triton kernels for v41graph's custom ops (CUDA), one module per kernel family.

This package imports nothing: cuda_impls.py imports a family's module at the first call on a
CUDA tensor, so CPU-only machines never import triton.

Each public function computes the same function as its pure-torch reference in
`reference.py` / `ops.py` (the specification), comes with a `*_supported` check of the inputs
it handles (cuda_impls.py runs the reference otherwise), and is checked against the reference
by tests/test_kernels_cuda.py.

  common        shared pieces: dtype tables, `_pow2`, `_rows`, the SM count, and the
                @triton.jit UE8M0 exponent and FP4 E2M1 encode/decode helpers
  norms         fused_wkv_rmsnorm (split-K GEMM + RMSNorm in one launch), rms_norm
  rope          rope
  cache_writes  window_kv_write, global_kv_write, index_k_write, fake_quant
  attention     sparse_attention over the FP8 window ring and the FP4 global cache (+ combine)
  indexer       indexer_scores: lightning-indexer scores from the FP4 index keys in place
                and topk_ascending: their top-k ids in one launch (no sort)
  engram        engram_gather from a device or pinned host table
  mhc           mhc_pre (the collapse, the predictor's partial sums, their finish) and
                mhc_post (the expand); mhc_sinkhorn: the Sinkhorn rounds in registers
  compressor    ratio2_compressor (pooling, RMSNorm, state-ring write after cuBLAS projections)
  quant_gemm    fp8_linear: FP8 block-scaled weights, activation FP8 quantization fused in
  moe_fp4       mxfp4_moe: grouped gate+up+SwiGLU and down GEMMs over stacked MXFP4 experts
  moe_gate      moe_gate: the router (K-sliced scores, then top-k and normalization per token)
  swiglu        swiglu: the shared expert's clamped SwiGLU, one elementwise launch

Portability (triton-ascend): the E2M1 encode/decode are integer/bit arithmetic only; the FP8
conversions use tl.float8e4nv and the wkv kernel uses atomics + cache modifiers, which are the
CUDA-specific parts. The rest (RMSNorm, RoPE, ratio-2, Sinkhorn, FP4 writes, Engram gather,
indexer scores) use plain loads, stores, dots and math only.
"""
