"""DSpark: the 3-stage speculative draft head of DeepSeek-V4.1-Flash (MODEL.md §8).

    head = load_dspark(checkpoint_dir, config)          # weights/dspark.py: official `mtp.{0,1,2}.*`
    state = head.new_state(num_slots)                   # per-sequence window rings
    main_x = head.context([in_37, in_38, in_39])        # residual streams entering the targets
    head.append_context(state, slot, positions, main_x) # fill every stage's window
    ids, logits, conf = head.draft(state, slot, anchor, anchor_pos, embed, lm_head)

Structure (as this module implements it; what the golden vectors confirm is reported by
tests/test_dspark_golden.py):
  context   main_x = main_norm(main_proj([mean_c X_37 ; mean_c X_38 ; mean_c X_39]))  (stage 0's
            weights), one row per target token; every stage writes kv_norm(wkv(main_x)) with RoPE
            at the token's position, FP8-QDQ'd like the backbone's window KV, into its own ring of
            `sliding_window` slots.
  block     [anchor, noise x (k-1)] at positions anchor_pos .. anchor_pos+k-1, embedded with the
            shared embedding, copied to the hc streams; each stage is a normal mHC block
            (single-pass `pre` shift, stage 0 collapses with the one-hot) whose attention is
            window-only: the block's queries see the valid ring slots (in slot order) and all k
            block positions (non-causal inside the block); MoE with dspark_n_routed_experts /
            dspark_num_experts_per_tok. Block KV is not written to the ring.
  heads     last stage: collapse with the last ffn `pre`, norm, shared fp32 head -> U [k, V];
            Markov: logits_j = U_j + markov.head(markov.embed(x_{j-1})) (x_0 = anchor, greedy
            x_j = argmax logits_j); confidence c_j = proj([h_j ; markov.embed(x_{j-1})]) (raw logit;
            sigmoid gives the acceptance estimate), h_j = the last stage's collapsed residual BEFORE
            the final norm.
Shared draft/target top-k buffers (the seed's P5 suggestion) do not apply to V4.1-Flash's
DSpark: its attention is window-only (MODEL.md §8), so the draft never reads an indexer top-k
or candidate list that it could share with the target's verification step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import v41graph.custom_ops  # noqa: F401  (registers torch.ops.v41graph.*)
from .attention import Attention
from .config import V41Config
from .layer_plan import LayerRole
from .layers import Linear, RMSNorm, apply_rope, rope_rotation, set_linear_numerics, weight_fmt
from .mhc import HyperConnection, collapse, expand, first_pre
from .moe import MoE

ops = torch.ops.v41graph


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank)
        self.head = Linear(rank, vocab, dtype=torch.float32)

    def bias(self, prev_ids: torch.Tensor):
        """(logit bias [N, V] fp32, the low-rank embedding [N, r]) of the previous tokens."""
        e = self.embed(prev_ids)
        return F.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = Linear(dim, 1, dtype=torch.float32)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = torch.cat([h.float(), e.float()], dim=-1)
        return x @ self.proj.weight.float()[0]      # (matches the reference's rounding exactly)


class DSparkStage(nn.Module):
    def __init__(self, config: V41Config, index: int, last: bool):
        super().__init__()
        d, hc = config.hidden_size, config.hc_mult
        args = (hc, d, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*args), HyperConnection(*args)
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        role = LayerRole(config.num_hidden_layers + index, "window", 0, None, None, None, False, None)
        self.attn = Attention(config, role)       # window-only: plain RoPE, no compressor/indexer
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ffn = MoE(config, config.dspark_n_routed_experts, config.dspark_num_experts_per_tok)
        if index == 0:
            n_targets = len(config.dspark_target_layer_ids)
            self.main_proj = Linear(n_targets * d, d, fmt=weight_fmt(config, "fp8"))
            self.main_norm = RMSNorm(d, config.rms_norm_eps)
        if last:
            self.norm = RMSNorm(d, config.rms_norm_eps)
            self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(d + config.dspark_markov_rank)

    # ------------------------------------------------------------------ attention
    def window_kv(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = self.attn
        kv = apply_rope(a.kv_norm(a.wkv(x)), rope_rotation(positions, a.inv_freqs))
        return torch.ops.v41graph.fake_quant(kv, "fp8_ue8m0", 32)

    def attention(self, x: torch.Tensor, positions: torch.Tensor, rings: torch.Tensor,
                  ring_valid: torch.Tensor) -> torch.Tensor:
        """x [B*k, d]: B blocks of k tokens; rings [B, W, D] each block's sequence's window KV,
        ring_valid [B, W] bool. Each block's queries see its own valid ring slots (in slot
        order) and its own k block tokens; rows of other blocks are never listed."""
        a = self.attn
        b, w = rings.shape[0], rings.shape[1]
        k = x.shape[0] // b
        dev = x.device
        rotation = rope_rotation(positions, a.inv_freqs)
        qr = a.q_norm(a.wq_a(x))
        kv = torch.ops.v41graph.fake_quant(apply_rope(a.kv_norm(a.wkv(x)), rotation), "fp8_ue8m0", 32)
        q = apply_rope(a.wq_b(qr).unflatten(-1, (a.n_heads, a.head_dim)), rotation)
        pool = torch.cat([rings.flatten(0, 1).to(kv.dtype), kv])       # every ring, then every block
        slots = torch.where(ring_valid, torch.arange(w, device=dev), -1)
        slots = slots.gather(1, torch.argsort((slots < 0).to(torch.int8), dim=1, stable=True))  # valid first
        first = torch.arange(b, device=dev)[:, None]
        ring_rows = torch.where(slots >= 0, slots + first * w, -1)
        block_rows = b * w + first * k + torch.arange(k, device=dev)
        rows = torch.cat([ring_rows, block_rows], 1).repeat_interleave(k, dim=0)   # [B*k, W+k]
        empty_rows = torch.empty((b * k, 0), dtype=torch.int64, device=dev)
        empty_kv = torch.empty((0, 1), dtype=torch.uint8, device=dev)
        # DSpark keeps its ring as float values (post-QDQ), so there is no FP8 ring to read in
        # place: an empty ring, and every row (ring ++ block) is a fresh row of `pool`.
        no_ring = torch.empty((0, w, a.head_dim), dtype=torch.uint8, device=dev)
        no_ring_scale = torch.empty((0, w, a.head_dim // 32), dtype=torch.uint8, device=dev)
        o = ops.sparse_attention(q, no_ring, no_ring_scale, pool, rows.contiguous(), empty_kv, empty_kv,
                                 empty_rows, a.attn_sink, a.softmax_scale)
        o = apply_rope(o, rotation, inverse=True).reshape(b * k, a.o_groups, -1)
        wo_a = a.wo_a.weight.view(a.o_groups, a.o_rank, -1).to(o.dtype)
        o = torch.einsum("ngd,grd->ngr", o, wo_a)
        return a.wo_b(o.flatten(1))


class DSparkState:
    """Per-slot window rings of every stage (the values the window holds, post-QDQ)."""

    def __init__(self, num_stages: int, num_slots: int, window: int, head_dim: int,
                 dtype: torch.dtype, device):
        self.window = window
        self.kv = [torch.zeros(num_slots, window, head_dim, dtype=dtype, device=device)
                   for _ in range(num_stages)]
        self.length = [0] * num_slots        # context tokens seen per slot

    def reset(self, slot: int) -> None:
        self.length[slot] = 0


class DSparkHead(nn.Module):
    def __init__(self, config: V41Config):
        super().__init__()
        self.config = config
        n = config.num_nextn_predict_layers
        self.stages = nn.ModuleList(DSparkStage(config, i, i == n - 1) for i in range(n))
        self.block_size = config.dspark_block_size
        self.noise_id = config.dspark_noise_token_id

    def set_numerics(self, numerics: str) -> "DSparkHead":
        """"reference", "released" or "fast", as V41Model.set_numerics."""
        set_linear_numerics(self, numerics)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.stages[0].attn.wo_a.weight.dtype

    def new_state(self, num_slots: int) -> DSparkState:
        c = self.config
        return DSparkState(len(self.stages), num_slots, c.sliding_window, c.head_dim, self.dtype,
                           self.stages[0].attn_norm.weight.device)

    # ------------------------------------------------------------------ context
    def context(self, target_inputs) -> torch.Tensor:
        """target_inputs: the residual streams [N, hc, d] entering each dspark_target_layer
        -> main_x [N, d]."""
        s0 = self.stages[0]
        x = torch.cat([t.mean(dim=-2) for t in target_inputs], dim=-1)
        return s0.main_norm(s0.main_proj(x))

    def append_context(self, state: DSparkState, slot: int, positions: torch.Tensor,
                       main_x: torch.Tensor) -> None:
        """Write the window KV of these context tokens (consecutive positions) of one slot."""
        w = state.window
        keep = positions >= positions.max() - w + 1
        for stage, ring in zip(self.stages, state.kv):
            kv = stage.window_kv(main_x, positions)
            ring[slot, positions[keep] % w] = kv[keep].to(ring.dtype)
        state.length[slot] = int(positions.max()) + 1

    def append_context_rows(self, state: DSparkState, slots: torch.Tensor, positions: torch.Tensor,
                            main_x: torch.Tensor, keep: torch.Tensor) -> None:
        """The batched, sync-free form of append_context: slots [B]; positions [B, n]
        (consecutive per row, n <= window); main_x [B * n, d]; keep [B, n] bool: which of
        them are context (a rejected draft's row leaves the ring as it was)."""
        w = state.window
        rows = positions.remainder(w)
        sl = slots[:, None].expand_as(rows)
        for stage, ring in zip(self.stages, state.kv):
            kv = stage.window_kv(main_x, positions.flatten()).view(*rows.shape, -1).to(ring.dtype)
            ring[sl, rows] = torch.where(keep[..., None], kv, ring[sl, rows])

    # ------------------------------------------------------------------ drafting
    def draft(self, state: DSparkState, slot: int, anchor: int, anchor_pos: int, embed: nn.Embedding,
              lm_head: torch.Tensor, debug: dict | None = None, choose=None):
        """Draft one block for one sequence: (ids [k+1] = anchor + k drafts, logits [k, V] fp32
        (base + Markov bias), confidence [k] raw logits). `draft_batch` of one row.

        choose(j, logits_j [V]) -> token id picks draft j + 1 (default: argmax, the greedy
        drafts); speculative sampling passes a sampler so drafts are drawn from q_j."""
        dev = lm_head.device
        one = lambda v: torch.tensor([v], dtype=torch.int64, device=dev)  # noqa: E731
        pick = None if choose is None else (lambda j, lj: one(int(choose(j, lj[0]))))
        drafts, logits, conf = self.draft_batch(state, one(slot), one(anchor), one(anchor_pos),
                                                one(state.length[slot]), embed, lm_head,
                                                choose=pick, debug=debug)
        return torch.cat([one(anchor), drafts[0]]), logits[0], conf[0]

    def draft_batch(self, state: DSparkState, slots: torch.Tensor, anchors: torch.Tensor,
                    anchor_pos: torch.Tensor, context_len: torch.Tensor, embed: nn.Embedding,
                    lm_head: torch.Tensor, choose=None, debug: dict | None = None):
        """Draft one block for each of B sequences at once, static shapes and no host sync (the
        captured speculative step runs this): slots / anchors / anchor_pos / context_len [B]
        int64 (context_len: context tokens in the slot's rings, = anchor_pos while decoding).
        Returns (drafts [B, k] int64, logits [B, k, V] fp32, confidence [B, k] raw logits).

        choose(j, logits_j [B, V]) -> [B] int64 picks draft j + 1 of every row (default argmax:
        the greedy drafts); the Markov bias of draft j + 1 depends on draft j, so the k picks
        are sequential."""
        cfg, k = self.config, self.block_size
        b = slots.shape[0]
        dev = lm_head.device
        noise = torch.full((b, k - 1), self.noise_id, dtype=torch.int64, device=dev)
        ids = torch.cat([anchors[:, None], noise], 1).flatten()                     # [B*k]
        positions = (anchor_pos[:, None] + torch.arange(k, device=dev)).flatten()
        h = embed(ids)
        streams = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = first_pre(b * k, cfg.hc_mult, dev)
        valid = torch.arange(state.window, device=dev)[None, :] < context_len.clamp_max(state.window)[:, None]
        for i, (stage, ring) in enumerate(zip(self.stages, state.kv)):
            x, pre_attn, post, comb = stage.hc_attn(streams, pre)
            out = stage.attention(stage.attn_norm(x), positions, ring.index_select(0, slots), valid)
            streams = expand(out, streams, post, comb)
            x, pre_ffn, post, comb = stage.hc_ffn(streams, pre_attn)
            ffn_in = stage.ffn_norm(x)
            out, chosen = stage.ffn(ffn_in)
            if debug is not None:
                debug[f"moe_gate_indices.stage{i}"] = chosen
                debug[f"moe_gate_weights.stage{i}"] = stage.ffn.gate(ffn_in)[0]
                debug[f"attn_out.stage{i}"] = out
            streams, pre = expand(out, streams, post, comb), pre_ffn
            if debug is not None:
                debug[f"block_out.stage{i}"] = streams
        last = self.stages[-1]
        collapsed = collapse(streams, pre)
        hid = last.norm(collapsed)
        if debug is not None:
            debug["collapsed"] = collapsed
            debug["hidden"] = hid
        base = F.linear(hid.float(), lm_head.float()).view(b, k, -1)            # [B, k, V]
        prev, picked, logits = anchors, [], []
        for j in range(k):                    # Markov bias token by token
            bias, _ = last.markov_head.bias(prev)
            lj = base[:, j] + bias
            logits.append(lj)
            prev = lj.argmax(-1) if choose is None else choose(j, lj)
            picked.append(prev)
        drafts = torch.stack(picked, 1)                                          # [B, k]
        before = torch.cat([anchors[:, None], drafts[:, :-1]], 1).flatten()     # x_{j-1}
        conf = last.confidence_head(collapsed, last.markov_head.embed(before)).view(b, k)
        return drafts, torch.stack(logits, 1), conf


__all__ = ["DSparkHead", "DSparkStage", "DSparkState"]
