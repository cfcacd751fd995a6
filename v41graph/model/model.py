"""DeepSeek-V4.1-Flash as plain torch modules.

    embed -> copy to hc streams -> [Engram?] -> Block x num_hidden_layers -> collapse -> norm -> head

`V41Model.forward(input_ids, positions, caches, metadata)` takes a flat batch of tokens from
several sequences (vLLM style); everything it needs about the batch is in tensors, so a
captured decode graph replays with new contents. Caches are updated in place.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .kv_cache import ModelCaches
from .metadata import (AttentionMetadata, StepContext, check_index_tensor, layer_ref, replay_metadata,
                       state_or_fresh_rows)
from .config import V41Config
from .engram import Engram
from .engram_hash import engram_hash_params
from .layer_plan import LayerRole, build_layer_plan
from .layers import Linear, RMSNorm, set_linear_numerics
from .mhc import HyperConnection, collapse, expand, first_pre
from .moe import MoE
from v41graph.custom_ops.hooks import layer_hook

ops = torch.ops.v41graph


def _layer_caches(caches: ModelCaches, layer_id: int, window: bool = True) -> list:
    """The cache tensors layer `layer_id` writes (its window ring, and its global KV, index
    keys and compressor ring when it is a kv source)."""
    out = [caches.window_kv[layer_id], caches.window_scale[layer_id]] if window else []
    for d in (caches.global_kv, caches.global_scale, caches.index_k, caches.index_scale, caches.compressor_state):
        if layer_id in d:
            out.append(d[layer_id])
    return out


class Block(nn.Module):
    """Attention + MoE, each wrapped in a single-pass mHC residual."""

    def __init__(self, config: V41Config, role: LayerRole, parallel=None):
        super().__init__()
        self.role = role
        d, hc = config.hidden_size, config.hc_mult
        args = (hc, d, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*args), HyperConnection(*args)
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.attn = Attention(config, role, parallel)
        self.ffn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ffn = MoE(config, parallel=parallel)
        # each sub-layer's output is all-reduced: the expands stay torch ops, which P8 overlaps
        self.tensor_parallel = parallel is not None and parallel.attention == "tp"

    def attn_input(self, streams: torch.Tensor, pre_prev: torch.Tensor) -> torch.Tensor:
        """The normalized attention input: collapse with the previous sub-layer's `pre`."""
        return self.attn_norm(collapse(streams, pre_prev))

    def forward(self, streams: torch.Tensor, pre_prev: torch.Tensor, ctx: StepContext):
        """streams [N, hc, d]; pre_prev [N, hc] -> (streams, this block's FFN `pre`)."""
        x, pre_attn, post, comb = self.hc_attn(streams, pre_prev)
        out = self.attn(self.attn_norm(x), ctx)
        streams = expand(out, streams, post, comb, as_op=not self.tensor_parallel)
        x, pre_ffn, post, comb = self.hc_ffn(streams, pre_attn)
        out, chosen = self.ffn(self.ffn_norm(x))
        if ctx.debug is not None:
            ctx.debug[f"moe_gate_indices.layer{self.role.layer_id}"] = chosen
        return expand(out, streams, post, comb, as_op=not self.tensor_parallel), pre_ffn


class V41Model(nn.Module):
    """parallel: a v41graph.parallel.ParallelState to build this rank's share of the model
    (None: the whole model, one device). Parameter names are the same either way; shapes are
    the rank's slices (ShardSpec says which)."""

    def __init__(self, config: V41Config, parallel=None):
        super().__init__()
        self.config = config
        self.plan = build_layer_plan(config)
        if parallel is not None:
            parallel.config.check(config)
            if parallel.world_size == 1:
                parallel = None           # one rank: the single-device model, no collective
        self.parallel = parallel
        # vocab-parallel embedding and head under tensor-parallel attention
        self.vocab_parallel = parallel is not None and parallel.attention == "tp"
        vocab = config.vocab_size // parallel.tp if self.vocab_parallel else config.vocab_size
        self.vocab_start = parallel.rank * vocab if self.vocab_parallel else 0
        d = config.hidden_size
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(config, role, parallel) for role in self.plan)
        self.engram = nn.ModuleList(Engram(config, rows) for rows in config.engram_num_embeddings)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.head = nn.Parameter(torch.zeros(vocab, d, dtype=torch.float32))
        # Engram hashing constants and the token -> compressed-id map (identity until a
        # tokenizer-derived map is loaded).
        params = engram_hash_params(config.engram_layer_ids, config.engram_max_ngram_size,
                                    config.engram_n_heads, config.engram_vocab_size,
                                    config.engram_compressed_vocab_size)
        for name in ("multipliers", "primes", "offsets"):
            self.register_buffer(f"engram_{name}", params[name], persistent=False)
        tables = [int(r) for r in params["table_rows"]]
        if tables != list(config.engram_num_embeddings):
            raise ValueError(f"engram_num_embeddings {list(config.engram_num_embeddings)} does not match "
                             f"the prime schedule's table sizes {tables}")
        token_map = torch.arange(config.vocab_size) % config.engram_compressed_vocab_size
        self.register_buffer("engram_token_map", token_map, persistent=False)
        # what encoder_forward's layer_done points "write" (custom_ops/hooks.py: ordering only)
        self.register_buffer("layer_done_token", torch.zeros(1, dtype=torch.uint8), persistent=False)
        self.numerics = "fast"
        self.debug: dict | None = None
        # Set only while the compiler traces the layers it stamps into the others
        # (compiler/stamp.py): forward then runs these layers alone, their shared values tagged.
        self.stamp_layers: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ numerics
    def set_numerics(self, numerics: str) -> "V41Model":
        """"reference" (DeepSeek's blockwise FP8 GEMM arithmetic, pure torch), "released" (the
        same arithmetic on the checkpoint bytes through the fp8_linear / mxfp4_moe ops: Triton
        on CUDA) or "fast" (weights dequantized once to the compute dtype): layers.py."""
        set_linear_numerics(self, numerics)
        self.numerics = numerics
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    # ------------------------------------------------------------------ Engram ids
    def _engram_rows(self, input_ids: torch.Tensor, ctx: StepContext):
        """Row ids [N, n_engram_layers, (n-1)*heads] and each sequence's next history."""
        cfg, caches, meta = self.config, ctx.caches, ctx.meta
        lags = cfg.engram_max_ngram_size - 1
        compressed = self.engram_token_map[input_ids]
        pad = self.engram_token_map[cfg.engram_pad_token_id]
        state = caches.engram_history                                # [slots, lags]
        pool = torch.cat([state.flatten(), compressed])

        def ids_at(pos, seq):   # compressed id at positions pos [M, k] of sequences seq [M]
            chunk_start = meta.chunk_start[seq].unsqueeze(-1)
            rows = state_or_fresh_rows(   # the history row holds the most recent id first
                pos, chunk_start, meta.query_start[seq].unsqueeze(-1), state.numel(),
                lambda: meta.seq_slot[seq].unsqueeze(-1) * lags + (chunk_start - 1 - pos).clamp(0, lags - 1))
            return torch.where(pos >= 0, pool[rows.clamp_min(0)], pad)

        back = torch.arange(1, lags + 1, device=input_ids.device)
        history = ids_at(ctx.positions.unsqueeze(-1) - back, ctx.tok_seq)
        rows = ops.engram_hash(compressed, history, self.engram_multipliers, self.engram_primes,
                               self.engram_offsets)
        seqs = torch.arange(meta.num_seqs, device=input_ids.device)
        return rows, ids_at(meta.seq_len.unsqueeze(-1) - back, seqs)

    # ------------------------------------------------------------------ forward
    @property
    def decoder_start(self) -> int:
        """First decoder layer of the CED split: the candidate source, whose ratio-1 projection
        of the encoder output is the decoder's only global KV (MODEL.md §2, §9)."""
        return self.config.candidate_source_layer_id

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: ModelCaches,
                metadata: AttentionMetadata, all_logits: bool = False,
                decoder_replay: int | None = None, return_streams: tuple[int, ...] = ()):
        """Logits (fp32) of the last token of each sequence [B, V], or of every token [N, V].

        decoder_replay=R (prefill only): CED "decoder bounded replay" (MODEL.md §9). The
        encoder runs over every token, the first decoder layer compresses every token's encoder
        output into the global KV, and the decoder layers then run only on the last R tokens of
        each sequence with their window truncated to that segment.

        return_streams=(i, ...): also return the residual streams [N, hc, d] leaving each of
        these layers (= entering layer i + 1; what `model.debug` records as
        `block_out.layer{i}`), in the order given: the call then returns (logits, [streams]).
        They are ordinary graph outputs, so a compiled graph returns them too (DSpark's context
        comes from them). With decoder_replay, a layer before the decoder start keeps every
        token, a later one only the replayed ones (as its debug entry). Empty (the default):
        the logits alone, as always.
        """
        check_step_inputs(input_ids, positions, metadata)
        wanted = tuple(int(i) for i in return_streams)
        bad = [i for i in wanted if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"return_streams: layer {bad[0]} outside 0..{len(self.layers) - 1}")
        kept_streams = {}
        stamp = self.stamp_layers is not None
        ctx = StepContext.build(metadata, caches, positions, self.debug, stamp=stamp)
        streams, pre, engram_rows, history = self._embed_streams(input_ids, ctx)
        for block in (self.layers if not stamp else [self.layers[i] for i in self.stamp_layers]):
            role = block.role
            if decoder_replay is not None and role.layer_id == self.decoder_start:
                streams, pre, engram_rows, ctx = self._enter_replay(block, streams, pre, engram_rows, ctx,
                                                                    decoder_replay)
                metadata = ctx.meta
            if stamp:   # where the layer starts and ends, for the stamper
                streams, pre = _tag_streams(ctx, "layer_in", role.layer_id, streams, pre)
            streams, pre = self._block(block, streams, pre, engram_rows, ctx)
            if stamp:
                streams, pre = _tag_streams(ctx, "layer_out", role.layer_id, streams, pre)
            if role.layer_id in wanted:
                kept_streams[role.layer_id] = streams
        if history is not None:   # roll the Engram history last (P4 hoists the gathers before)
            ops.state_write(caches.engram_history, metadata.seq_slot, history)
        logits = self._logits(streams, pre, metadata, all_logits)
        if wanted:
            return logits, [kept_streams[i] for i in wanted]
        return logits

    # ------------------------------------------------------------------ forward's pieces
    # (also what a prefill worker and a decode worker of v41graph.disagg run, in the same
    # order: their two halves of a bounded-replay prefill are this forward, split)
    def _embed_streams(self, input_ids: torch.Tensor, ctx: StepContext):
        """(streams [N, hc, d], block 0's `pre`, Engram row ids or None, next Engram history)."""
        cfg = self.config
        engram_rows = history = None
        if len(self.engram):
            engram_rows, history = self._engram_rows(input_ids, ctx)
        h = self._embed(input_ids)
        streams = h.unsqueeze(1).repeat(1, cfg.hc_mult, 1)
        pre = first_pre(h.shape[0], cfg.hc_mult, h.device)
        return streams, pre, engram_rows, history

    def _enter_replay(self, block: Block, streams, pre, engram_rows, ctx: StepContext, decoder_replay):
        """At the decoder start of a bounded replay: the decoder's global KV from every token
        (its Attention.compress), then the context, streams, pre and Engram rows of the replay
        segment only."""
        block.attn.compress(block.attn_input(streams, pre), ctx)
        metadata, keep = replay_metadata(ctx.meta, decoder_replay)
        ctx = self.replay_context(metadata, ctx.caches, ctx.positions[keep])
        return streams[keep], pre[keep], (engram_rows[keep] if engram_rows is not None else None), ctx

    def replay_context(self, metadata: AttentionMetadata, caches: ModelCaches, positions: torch.Tensor):
        """The StepContext of the decoder layers in a bounded replay (metadata from
        replay_metadata): the decoder start's KV is already written."""
        ctx = StepContext.build(metadata, caches, positions, self.debug)
        ctx.precompressed.add(self.decoder_start)
        return ctx

    def _block(self, block: Block, streams, pre, engram_rows, ctx: StepContext):
        """One backbone layer: its Engram (if any) and its Block."""
        role = block.role
        if role.engram_slot is not None:
            streams = self.engram[role.engram_slot](streams, engram_rows[:, role.engram_slot])
            if self.debug is not None:
                self.debug[f"engram_out.layer{role.layer_id}"] = streams
        streams, pre = block(streams, pre, ctx)
        if self.debug is not None:
            self.debug[f"block_out.layer{role.layer_id}"] = streams
            self.debug[f"block_pre_mix.layer{role.layer_id}"] = pre
        return streams, pre

    def _logits(self, streams, pre, metadata: AttentionMetadata, all_logits: bool = False):
        if not all_logits:
            streams, pre = streams[metadata.logits_index], pre[metadata.logits_index]
        x = self.norm(collapse(streams, pre))
        if self.debug is not None:
            self.debug["final_norm"] = x
        logits = F.linear(x.float(), self.head.float())
        if self.vocab_parallel:            # every rank gets the whole vocabulary's logits
            logits = self.parallel.all_gather(logits, dim=-1)
        return logits

    # ------------------------------------------------------------------ the two CED halves
    def encode(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: ModelCaches,
               metadata: AttentionMetadata, decoder_replay, on_layer=None):
        """A prefill worker's half of `forward(..., decoder_replay=R)`: `encoder_forward` over
        every token, then the replay segment's rows (`replay_inputs`). Returns (streams
        [M, hc, d], pre [M, hc], metadata, positions [M]) of the replay segment entering the
        decoder start: the decoder's replay input. on_layer(layer_id) is called after each
        encoder layer and after the decoder start's KV is written (the caches of that layer are
        final for this call: a worker starts sending them while the next layer computes)."""
        if decoder_replay is None:
            raise ValueError("encode: decoder_replay is required (the decoder half runs elsewhere)")
        with layer_hook(on_layer):
            streams, pre = self.encoder_forward(input_ids, positions, caches, metadata)
        return self.replay_inputs(streams, pre, positions, metadata, decoder_replay)

    def encoder_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: ModelCaches,
                        metadata: AttentionMetadata):
        """Embedding, Engram and the encoder layers over every token, the decoder start's
        global KV from every token, the Engram history rolled: the same ops in the same order
        as forward's replay path up to the decoder start. Returns (streams [N, hc, d], pre
        [N, hc]) of every token entering the decoder start. Static shapes (no replay
        selection): one graph (CompiledModel.encode). After each encoder layer and after the
        decoder start's KV, a layer_done op (custom_ops/hooks.py) with that layer's caches:
        where the function of an enclosing layer_hook runs, in the graph too."""
        check_step_inputs(input_ids, positions, metadata)
        ctx = StepContext.build(metadata, caches, positions, self.debug)
        streams, pre, engram_rows, history = self._embed_streams(input_ids, ctx)
        dec = self.decoder_start
        for block in self.layers[:dec]:
            streams, pre = self._block(block, streams, pre, engram_rows, ctx)
            ops.layer_done(self.layer_done_token, _layer_caches(caches, block.role.layer_id), block.role.layer_id)
        block = self.layers[dec]
        block.attn.compress(block.attn_input(streams, pre), ctx)
        if history is not None:
            ops.state_write(caches.engram_history, metadata.seq_slot, history)
        ops.layer_done(self.layer_done_token, _layer_caches(caches, dec, window=False) + [caches.engram_history], dec)
        return streams, pre

    def replay_inputs(self, streams: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor,
                      metadata: AttentionMetadata, decoder_replay):
        """The replay segment's rows of encoder_forward's output: (streams [M, hc, d], pre
        [M, hc], metadata, positions [M]) (replay_metadata: data-dependent, so eager)."""
        sub, keep = replay_metadata(metadata, decoder_replay)
        return streams[keep], pre[keep], sub, positions[keep]

    def decode_replay(self, streams: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor,
                      caches: ModelCaches, metadata: AttentionMetadata) -> torch.Tensor:
        """A decode worker's half: the decoder layers over the replay segment (what `encode`
        returned, metadata from replay_metadata) with the decoder start's global KV already in
        the caches; the logits of each sequence's last token [B, V]."""
        if any(b.role.engram_slot is not None for b in self.layers[self.decoder_start:]):
            raise NotImplementedError("decode_replay: Engram before a decoder layer needs the replay tokens' "
                                      "row ids, which the hand-over does not carry")
        ctx = self.replay_context(metadata, caches, positions)
        for block in self.layers[self.decoder_start:]:
            streams, pre = self._block(block, streams, pre, None, ctx)
        return self._logits(streams, pre, metadata)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.vocab_parallel:
            return self.embed(input_ids)
        # This rank's rows of the table; the other ranks' tokens add zeros (exact).
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.num_embeddings)
        h = self.embed(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(self.embed.weight.dtype)
        return self.parallel.all_reduce(h)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: ModelCaches,
               metadata: AttentionMetadata) -> torch.Tensor:
        """A decode step (one token per sequence): the same computation as forward. The
        runtime calls this for decode steps so that a compiled model (CompiledModel.decode)
        can run them through its captured buckets."""
        return self(input_ids, positions, caches, metadata)


def _tag_streams(ctx: StepContext, where: str, layer_id: int, streams, pre):
    """The residual streams and `pre` entering ("layer_in") or leaving ("layer_out") a layer,
    tagged for the stamper (StepContext.tag)."""
    return (ctx.tag((where, layer_ref(layer_id), "streams"), streams),
            ctx.tag((where, layer_ref(layer_id), "pre"), pre))


def check_step_inputs(input_ids, positions, metadata) -> None:
    """The model contract's inputs, checked where they enter (shapes and dtypes only, so a
    traced graph keeps no data-dependent branch): input_ids and positions integer [N] tensors of
    one length, metadata an AttentionMetadata of N tokens. Under torch.compile only the types,
    dtypes and ranks are checked: comparing sizes there would guard on them, and a decode graph
    with an unbacked batch size cannot (CompiledModel runs every check before its graphs)."""
    for name, t in (("input_ids", input_ids), ("positions", positions)):
        check_index_tensor(t, name)
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D [N] (the step's tokens, flattened), got shape {list(t.shape)}")
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    sizes = not torch.compiler.is_compiling()
    if sizes and positions.shape[0] != input_ids.shape[0]:
        raise ValueError(f"positions has {positions.shape[0]} entries but input_ids {input_ids.shape[0]}: "
                         "one position per token")
    metadata.check_batch(input_ids.shape[0], sizes=sizes)


def init_random_weights_(module: nn.Module, generator: torch.Generator) -> nn.Module:
    """Random weights for any module built from our layers (model, DSpark head): sensible
    activation ranges; quantized Linears get random codes with power-of-two scales of about
    in_features^-0.5. The generator's device decides where the numbers are drawn."""
    import math
    g = generator
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.uint8:
                continue      # quantized weights and tables: below
            if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=p.device))
            elif name.endswith("attn_sink"):
                p.copy_(torch.randn(p.shape, generator=g, device=p.device))
            elif name.endswith(".fn"):
                p.copy_(0.02 * torch.randn(p.shape, generator=g, device=p.device))
            elif name.endswith((".base", "gate.bias")):
                p.copy_(0.1 * torch.randn(p.shape, generator=g, device=p.device))
            elif name.endswith(".scale"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * p.shape[-1] ** -0.5)
        for m in module.modules():
            if isinstance(m, Linear) and m.fmt != "dense":
                exponent = round(math.log2(m.in_features ** -0.5))
                # FP8: clear bits 6 and 3 so no code is NaN and |value| < 1; FP4: any nibble.
                codes = torch.randint(0, 256, m.weight.shape, generator=g, dtype=torch.uint8,
                                      device=m.weight.device)
                m.weight.copy_(codes & 0xB7 if m.fmt == "fp8" else codes)
                m.scale.fill_(127 + exponent + (1 if m.fmt == "fp8" else -1))
    return module


def make_greedy_successor_a_permutation_(model: nn.Module, generator: torch.Generator,
                                          embed_scale: float = 1000.0) -> torch.Tensor:
    """Random weights whose greedy ids survive rounding, for benchmarks that must check
    outputs across kernels (speculative verify vs plain decode): random weights alone leave
    top-2 logits so close that reduction order flips greedy ids from the first tokens on (the
    H200, bench() config). The embedding is scaled by embed_scale, so it dominates the residual
    streams (every layer reads them through an RMSNorm, so the layers compute as before and
    their outputs stay small beside it; mHC's doubly stochastic mixing keeps the embedding), and
    head row v becomes embedding row perm[v] (unit norm): the largest logit after token t is
    then at v = perm^-1[t], about sqrt(hidden_size) (the final RMSNorm's output norm) against
    a few for the rest. Returns that successor table, next_id[t] (a permutation of the
    vocabulary)."""
    if getattr(model, "vocab_parallel", False):
        raise ValueError("make_greedy_successor_a_permutation_: the model's head is vocabulary-parallel "
                         "(each rank holds a slice); build it on one rank")
    with torch.no_grad():
        e = model.embed.weight
        vocab = e.shape[0]
        perm = torch.randperm(vocab, generator=generator, device=generator.device).to(e.device)
        unit = e.float() / e.float().norm(dim=-1, keepdim=True)
        model.head.copy_(unit[perm].to(model.head.dtype))
        e.mul_(embed_scale)
    return torch.argsort(perm)


def init_random_(model: V41Model, seed: int = 0) -> V41Model:
    """Deterministic random weights for the model (tests, demo, benchmarks), Engram tables
    included (FP8 codes without NaN)."""
    g = torch.Generator().manual_seed(seed)
    init_random_weights_(model, g)
    with torch.no_grad():
        for e in model.engram:
            e.embed_weight.copy_(torch.randint(0, 256, e.embed_weight.shape, generator=g,
                                               dtype=torch.uint8) & 0xB7)
            e.embed_scale.fill_(127)
    return model
