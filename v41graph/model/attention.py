"""CSA2 attention (MODEL.md §4): sliding window + compressed global sparse attention with sinks.

One module per layer; what it does depends on its LayerRole:
  window   attend to the last W positions only
  full     also compress (ratio 1: Linear + RMSNorm; ratio 2: fp32 pairwise softmax pooling),
           write global KV + index keys, score with the lightning indexer, take the top-k
  reindex  own indexer query, scored only on the candidate source's compact candidate list
           (P = candidate_topk_blocks x candidate_block_size positions: flat in the context)
  reuse    attend with the index source's top-k over the kv source's cache

Everything works on a flat batch of N tokens (see cache.AttentionMetadata) with static shapes.
Freshly computed rows are used exactly as the cache stores them (quantized), so a prefill and
the equivalent token-by-token decode see the same numbers.
"""
from __future__ import annotations

import torch
from torch import nn

import v41graph.custom_ops  # noqa: F401  (registers torch.ops.v41graph.*)
from .kv_cache import COMPRESSOR_RING
from .metadata import StepContext, layer_ref
from .config import V41Config
from .layer_plan import LayerRole
from .layers import (Linear, RMSNorm, weight_fmt, apply_rope, rope_inv_freqs, rope_rotation)

ops = torch.ops.v41graph


def _left_align(rows: torch.Tensor) -> torch.Tensor:
    """Move the -1 entries of each row to the end, keeping the order of the others."""
    order = torch.argsort((rows < 0).to(torch.int8), dim=-1, stable=True)
    return rows.gather(-1, order)


class Compressor(nn.Module):
    """Compressed (global) KV of a Full layer: one latent per group of `ratio` tokens."""

    def __init__(self, config: V41Config, ratio: int):
        super().__init__()
        d, self.ratio = config.head_dim, ratio
        if ratio == 1:
            self.wkv = Linear(config.hidden_size, d)            # Linear -> RMSNorm: P1's target
        else:
            self.wkv = Linear(config.hidden_size, d, dtype=torch.float32)
            self.wgate = Linear(config.hidden_size, d, dtype=torch.float32)
        self.norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_id: int):
        """Latents [N, D] (pre-RoPE) and the group index of each token that completes a group
        (-1 for tokens that do not)."""
        pos = ctx.positions
        group = ctx.shared(("compressed_group", self.ratio), lambda: self._groups(pos))
        if self.ratio == 1:
            return self.norm(self.wkv(x)), group
        xf = x.float()
        rows = torch.cat([self.wkv(xf), self.wgate(xf)], dim=-1)            # [N, 2D] fp32
        state = ctx.caches.compressor_state[layer_id]
        pool = torch.cat([state.view(-1, state.shape[-1]), rows], dim=0)
        member_rows = ctx.shared(("compressor_member_rows", self.ratio), lambda: self._member_rows(ctx))
        member = pool.index_select(0, member_rows).view(pos.shape[0], self.ratio, -1)
        kv, score = member.chunk(2, dim=-1)
        latent = (kv * score.softmax(dim=1)).sum(dim=1)
        ops.state_write(state, ctx.shared(("compressor_state_rows",), lambda: self._state_rows(ctx)), rows)
        return self.norm(latent.to(x.dtype)), group

    # The index tensors below depend on the step and the ratio only: every Full layer of a
    # ratio shares them (StepContext.shared).
    def _groups(self, pos: torch.Tensor) -> torch.Tensor:
        """The group each token completes (-1 for tokens that complete none)."""
        completes = (pos + 1).remainder(self.ratio) == 0
        return torch.where(completes, (pos + 1) // self.ratio - 1, -1)

    def _member_rows(self, ctx: StepContext) -> torch.Tensor:
        """[N * ratio] rows of (state ring ++ this call's rows): each token's group members."""
        pos = ctx.positions
        member_pos = pos.unsqueeze(-1) - torch.arange(self.ratio - 1, -1, -1, device=pos.device)
        return ctx.fresh_or_ring_rows(member_pos.clamp_min(0), COMPRESSOR_RING).flatten()

    @staticmethod
    def _state_rows(ctx: StepContext) -> torch.Tensor:
        """The state ring rows this call's rows go to: the last ring-size rows of each sequence
        (the partial group lives there), -1 for the others."""
        pos = ctx.positions
        keep = pos >= ctx.tok_seq_len - COMPRESSOR_RING
        return torch.where(keep, ctx.tok_slot * COMPRESSOR_RING + pos.remainder(COMPRESSOR_RING), -1)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed positions, returns each query's top-k."""

    def __init__(self, config: V41Config, role: LayerRole, tp: int = 1):
        super().__init__()
        # Under tensor parallelism this rank scores heads rank, rank + tp, ... (see
        # Attention._select_tp for why every tp-th head); the scale stays the whole model's.
        self.n_heads, self.head_dim = config.index_n_heads // tp, config.index_head_dim
        self.topk = config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fmt=weight_fmt(config, "fp8"))
        self.weights_proj = Linear(config.hidden_size, self.n_heads)
        self.weight_scale = self.head_dim ** -0.5 * config.index_n_heads ** -0.5
        if role.mode == "full":   # index keys are derived from the compressor's latent
            self.wk = Linear(config.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.fake_quant = config.fake_quant

    def query(self, x: torch.Tensor, qr: torch.Tensor, rotation: torch.Tensor):
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = apply_rope(q, rotation)
        if self.fake_quant:
            q = ops.fake_quant(q, "fp4_ue8m0", 32)
        weights = self.weights_proj(x) * self.weight_scale
        return q, weights


class Attention(nn.Module):
    def __init__(self, config: V41Config, role: LayerRole, parallel=None):
        super().__init__()
        self.role, self.config = role, config
        # Tensor parallelism (v41graph.parallel): this rank's query heads and output groups; the
        # KV projections, caches and compressor stay whole (one latent KV head serves all).
        self.parallel = parallel if parallel is not None and parallel.attention == "tp" else None
        tp = self.parallel.tp if self.parallel is not None else 1
        d, h, hd = config.hidden_size, config.num_attention_heads // tp, config.head_dim
        self.n_heads, self.head_dim = h, hd
        self.rope_dim = config.qk_rope_head_dim
        self.window = config.sliding_window
        self.softmax_scale = hd ** -0.5
        self.o_groups, self.o_rank = config.o_groups // tp, config.o_lora_rank
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32))
        self.wq_a = Linear(d, config.q_lora_rank, fmt=weight_fmt(config, "fp8"))
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = Linear(config.q_lora_rank, h * hd, fmt=weight_fmt(config, "fp8"))
        self.wkv = Linear(d, hd, fmt=weight_fmt(config, "fp8"))
        self.kv_norm = RMSNorm(hd, config.rms_norm_eps)
        self.wo_a = Linear(h * hd // self.o_groups, self.o_groups * self.o_rank)
        self.wo_b = Linear(self.o_groups * self.o_rank, d, fmt=weight_fmt(config, "fp8"))
        if role.mode == "full":
            self.compressor = Compressor(config, role.ratio)
        if role.scores:
            self.indexer = Indexer(config, role, tp)
        if role.ratio:   # long-context layers use YaRN frequencies, window-only plain RoPE
            inv = rope_inv_freqs(self.rope_dim, config.compress_rope_theta, config.original_seq_len,
                                 config.rope_factor, config.beta_fast, config.beta_slow)
        else:
            inv = rope_inv_freqs(self.rope_dim, config.rope_theta)
        self.rope_kind = "yarn" if role.ratio else "plain"   # layers of one kind share rotations
        self.register_buffer("inv_freqs", inv, persistent=False)

    # ------------------------------------------------------------------ pieces
    def _window_positions(self, ctx: StepContext) -> torch.Tensor:
        """[N, W] positions each query sees in its window: oldest first, left-aligned, -1 padded
        (the order DeepSeek's reference lists them in)."""
        pos = ctx.positions.unsqueeze(-1)
        wpos = (pos - self.window + 1).clamp_min(0) + torch.arange(self.window, device=pos.device)
        visible = wpos <= pos
        if ctx.meta.window_floor is not None:   # bounded replay: nothing before the segment
            visible = visible & (wpos >= ctx.meta.window_floor[ctx.tok_seq].unsqueeze(-1))
        return _left_align(torch.where(visible, wpos, -1))

    def _window_rows(self, ctx: StepContext) -> torch.Tensor:
        """Pool rows (ring ++ this call's rows) of _window_positions, -1 where empty."""
        wpos = self._window_positions(ctx)
        return torch.where(wpos >= 0, ctx.fresh_or_ring_rows(wpos.clamp_min(0), self.window), -1)

    def _ring_rows(self, ctx: StepContext) -> torch.Tensor:
        """Window-ring row each token is written to; -1 for tokens older than the last W of
        their sequence (the ring keeps only those)."""
        keep = ctx.positions >= ctx.tok_seq_len - self.window
        return torch.where(keep, ctx.tok_slot * self.window + ctx.positions.remainder(self.window), -1)

    def compress(self, x: torch.Tensor, ctx: StepContext) -> None:
        """Full layers: emit latents for completed groups, write global KV and index keys."""
        latent, group = self.compressor(x, ctx, self.role.layer_id)
        caches, lid, r = ctx.caches, self.role.layer_id, self.role.ratio

        def slots():
            rows_per_block = caches.block_size // r
            block = ctx.meta.block_table[ctx.tok_seq, group.clamp_min(0) // rows_per_block]
            return torch.where((group >= 0) & (block >= 0), block * rows_per_block + group.remainder(rows_per_block), -1)
        slot = ctx.shared(("compressed_slot", r), slots)
        rotation = ctx.shared(("compressed_rotation", self.rope_kind, r),
                              lambda: rope_rotation(group.clamp_min(0) * r, self.inv_freqs))
        idx = self.indexer
        k = apply_rope(idx.k_norm(idx.wk(latent)), rotation)
        ops.index_k_write(caches.index_k[lid], caches.index_scale[lid], k, slot)
        ops.global_kv_write(caches.global_kv[lid], caches.global_scale[lid], apply_rope(latent, rotation), slot)

    def _compressed_capacity(self, ctx: StepContext) -> int:
        """Compressed positions a sequence can hold: its block table's width in rows."""
        return ctx.meta.block_table.shape[1] * ctx.caches.block_size // self.role.ratio

    def _select(self, x: torch.Tensor, qr: torch.Tensor, rotation: torch.Tensor, ctx: StepContext):
        """Full / reindex layers: the indexer's top-k compressed positions [N, K].

        Full layers score all C visible positions (`indexer_topk`); the candidate source also
        keeps its compact candidate list [N, P] in ctx.candidates. Reindex layers score only
        that list (`indexer_topk_candidates`): every tensor they build has width P, whatever C
        is. Both give the same top-k as masking the full scores with the candidates."""
        role, caches = self.role, ctx.caches
        src = role.kv_source
        q, weights = self.indexer.query(x, qr, rotation)
        if role.mode == "reindex":
            # Same ratio and block table as the candidate source, so its positions (all
            # visible to the query) map to this layer's kv source's cache rows the same way.
            cand = ctx.candidates[role.candidate_source]
            cand_rows = ctx.shared(("candidate_rows", layer_ref(role.candidate_source), role.ratio),
                                   lambda: ctx.compressed_rows_padded(role.ratio, cand))
            if self.parallel is not None:
                parts = self._head_partials(q, weights, caches.index_k[src], caches.index_scale[src], cand_rows)
                return ops.indexer_select_candidates_from_partials(parts, cand_rows, cand, q.dtype,
                                                                   self.config.index_topk)
            return ops.indexer_topk_candidates(q, weights, caches.index_k[src], caches.index_scale[src],
                                               cand_rows, cand, self.config.index_topk)
        capacity = self._compressed_capacity(ctx)
        # keyed by ratio alone: the capacity follows from it (and may be symbolic, unhashable)
        rows = ctx.shared(("compressed_rows", role.ratio), lambda: ctx.compressed_rows(role.ratio, capacity))

        def visible_rows():
            visible_count = (ctx.positions + 1) // role.ratio
            return (torch.arange(capacity, device=rows.device) < visible_count.unsqueeze(-1)) & (rows >= 0)
        visible = ctx.shared(("visible_rows", role.ratio), visible_rows)
        keep_blocks = self.config.candidate_topk_blocks if role.is_candidate_source else 0
        if self.parallel is not None:
            parts = self._head_partials(q, weights, caches.index_k[src], caches.index_scale[src], rows)
            ids, cand = ops.indexer_select_from_partials(parts, visible, q.dtype, self.config.index_topk,
                                                         self.config.candidate_block_size, keep_blocks)
        else:
            ids, cand = ops.indexer_topk(q, weights, caches.index_k[src], caches.index_scale[src], rows,
                                         visible, self.config.index_topk,
                                         self.config.candidate_block_size, keep_blocks)
        if role.is_candidate_source:
            ctx.candidates[role.layer_id] = ctx.tag(("candidates", layer_ref(role.layer_id)), cand)
        return ids

    def _head_partials(self, q, weights, key_cache, key_scale, key_rows) -> torch.Tensor:
        """Tensor parallel: every rank's fp32 indexer head sum [N, tp, C], in rank order.
        The single-device head sum adds halves pairwise (reference._head_sum), whose partial
        sums at width tp are the sums over heads r, r + tp, ...: exactly the heads rank r holds.
        So the selection ops finish the same pairwise sum over these partials, and the scores,
        and so the top-k, are the single-device ones (bit for bit when index_n_heads / tp is a
        power of two; otherwise the padding of odd widths reorders a few adds)."""
        partial = ops.indexer_partial_scores(q, weights, key_cache, key_scale, key_rows)   # [N, C]
        return self.parallel.all_gather(partial.unsqueeze(1), dim=1)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        role, caches = self.role, ctx.caches
        n = x.shape[0]
        rotation = ctx.shared(("rotation", self.rope_kind), lambda: rope_rotation(ctx.positions, self.inv_freqs))
        qr = self.q_norm(self.wq_a(x))

        kv = apply_rope(self.kv_norm(self.wkv(x)), rotation)
        kv = ops.fake_quant(kv, "fp8_ue8m0", 32)     # exactly what the window cache will hold
        lid = role.layer_id
        ring_kv, ring_scale = caches.window_kv[lid], caches.window_scale[lid]
        # Window rows index (every slot's FP8 ring ++ this call's rows); sparse_attention reads
        # the ring rows it needs in place and dequantizes them, the fresh rows come from `kv`.
        window_rows = ctx.shared(("window_rows", self.window), lambda: self._window_rows(ctx))

        if role.mode == "full" and lid not in ctx.precompressed:
            self.compress(x, ctx)
        if role.scores:
            ctx.topk[lid] = ctx.tag(("topk", layer_ref(lid)), self._select(x, qr, rotation, ctx))
        # The query comes after the indexer and cache writes in program order so that, once
        # P6 moves those to the side stream, this projection overlaps them.
        q = apply_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), rotation)
        if role.ratio:
            topk = ctx.topk[role.index_source]
            # one per index source: its Reuse layers read the same top-k
            global_rows = ctx.shared(("global_rows", layer_ref(role.index_source), role.ratio),
                                     lambda: ctx.compressed_rows_padded(role.ratio, topk))
            gkv, gsc = caches.global_kv[role.kv_source], caches.global_scale[role.kv_source]
        else:
            topk = global_rows = torch.empty((n, 0), dtype=torch.int64, device=x.device)
            gkv = gsc = torch.empty((0, 1), dtype=torch.uint8, device=x.device)
        if ctx.debug is not None:
            ctx.debug[f"window_positions.layer{lid}"] = self._window_positions(ctx)
            ctx.debug[f"topk_positions.layer{lid}"] = topk

        o = ops.sparse_attention(q, ring_kv, ring_scale, kv, window_rows, gkv, gsc, global_rows,
                                 self.attn_sink, self.softmax_scale)
        # Window write after the read: keep the last W tokens of each sequence in the ring.
        ring_rows = ctx.shared(("ring_rows", self.window), lambda: self._ring_rows(ctx))
        ops.window_kv_write(ring_kv, ring_scale, kv, ring_rows)

        o = apply_rope(o, rotation, inverse=True)
        o = o.reshape(n, self.o_groups, -1)
        wo_a = self.wo_a.weight.view(self.o_groups, self.o_rank, -1).to(o.dtype)
        o = torch.einsum("ngd,grd->ngr", o, wo_a)
        if self.parallel is None:
            return self.wo_b(o.flatten(1))
        # Row-parallel wo_b: fp32 partial sums over this rank's output groups, summed over ranks.
        return self.parallel.all_reduce(self.wo_b(o.flatten(1), out_dtype=torch.float32)).to(x.dtype)
