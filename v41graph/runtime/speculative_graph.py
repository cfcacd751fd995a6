"""The static speculative step: draft, verify, acceptance and rollback of a decode batch on the
device, with static shapes and no host sync, one CUDA graph per (batch bucket, sampling kind).

    eng = Engine(v41graph.compile(model), 8, 256, speculative=SpecConfig(num_draft=5), draft_head=head)
    eng.generate(prompts, SamplingParams(max_tokens=64))       # decode steps: SpecStepGraph replays

`SpeculativeDecoder` (speculative.py) is the reference: per-request drafts and Python
verification, any batch. This module is the same algorithm for a step in which every scheduled
request decodes, written as one device program over a bucket of B rows (padding rows use the
caches' scratch slot, as decode buckets do) with exactly k = num_draft drafts per row:

  1. draft    `DSparkHead.draft_batch` over the B rows (greedy rows: argmax; sampling rows: one
              draw per draft from q_j = the request's filtered distribution, by the exponential
              race of the batched sampler over counter-based noise keyed by (seed, tokens
              generated, draft index), so a seeded request's draws never depend on its batch).
  2. cap      how many of the k drafts may be committed per row: the tokens the request has left
              (max_tokens), and with schedule="confidence" the prefix length n maximising
              (1 + sum of survival products s_1..s_n) / (step_cost + token_cost * (1 + n)) per
              row, computed from the confidence head on the device. The verify chunk has k + 1
              tokens whatever the cap (static shapes): the cap bounds what is committed, so a
              fixed-shape step saves no compute by verifying fewer drafts; it keeps the
              scheduler's decision (and the max_tokens limit) without a host round trip.
  3. snapshot the window-ring and compressor-ring rows of positions p+1 .. p+k (gathers).
  4. verify   the target model over [anchor, d_1 .. d_k] per row, all logits, DSpark's target
              streams returned (a compiled model: its verify graph, shapes fixed by the bucket).
  5. accept   greedy rows: accept while d_j == argmax of the target row; sampling rows: Leviathan /
              Chen rejection sampling on the device (accept d_j when u_j * q_j(d_j) < p_j(d_j);
              at the first rejection draw from norm(max(p_j - q_j, 0)); after the last allowed
              draft draw the bonus from p). m = accepted drafts (<= cap); m + 1 tokens commit.
  6. rollback ring rows of rejected positions p+m+1 .. p+k restored from the snapshot
              (torch.where over the whole [B, k] set, so no index list depends on m); the Engram
              history row rewritten from the committed tokens and the history before the step;
              DSpark's rings take the context of positions p .. p+m only (a masked write).
              Global KV / index-key rows of rejected positions need no rollback (see
              speculative.py).
  7. output   one [B, k + 2] int64 tensor: the committed tokens (k + 1, -1 after the last) and
              their count, copied to the host once per step.

The engine uses this step when every scheduled request is decoding, none asks for logprobs,
B * (k + 1) tokens fit the step's token budget and every row's chunk stays inside its block
table; any other step (a prefill chunk, logprobs) runs the reference decoder. On CUDA with a
capturing compiled model each (bucket, sampling kind) is captured once and replayed; on the CPU
the same program runs uncaptured (tests). The draft head runs as eager torch ops inside the
capture (replay removes their launch cost; compiling the head with our passes: not done).
"""
from __future__ import annotations

import time

import torch

from v41graph.compiler.compiled_model import CompiledModel
from v41graph.model.kv_cache import COMPRESSOR_RING
from v41graph.model.metadata import AttentionMetadata, upload
from .sampling import (DRAFT_TAG, accept_greedy, accept_rejection, filter_logits, noise_race,
                       noise_tag, row_keys, uniform_noise)


def confidence_cap(conf: torch.Tensor, step_cost: float, token_cost: float, min_survival: float):
    """[B, k] raw confidence logits -> [B] drafts to verify: the prefix n maximising expected
    committed tokens per unit of step cost, (1 + S_n) / (step_cost + token_cost * (1 + n)),
    S_n = s_1 + .. + s_n, s_j = prod_{i<=j} sigmoid(c_i); drafts with s_j < min_survival never."""
    surv = torch.sigmoid(conf.double()).cumprod(1)
    surv = torch.where(surv >= min_survival, surv, torch.zeros_like(surv)).cummin(1).values
    gain = torch.cat([torch.zeros_like(surv[:, :1]), surv.cumsum(1)], 1)      # S_0 .. S_k
    n = torch.arange(gain.shape[1], device=conf.device, dtype=torch.float64)
    value = (1 + gain) / (step_cost + token_cost * (1 + n))
    value = torch.where(torch.cat([torch.ones_like(surv[:, :1]), surv], 1) > 0, value, -1.0)
    return value.argmax(1)                                                    # first best n


class SpecStepInputs:
    """Persistent device buffers of one bucket's step (what the host loads before a replay)."""

    INT_COLS = ("anchor", "pos", "slot", "cap", "key")   # + block table columns
    FLOAT_COLS = ("temperature", "top_p", "top_k", "min_p")

    def __init__(self, rows: int, max_blocks: int, device):
        self.rows, self.max_blocks, self.device = rows, max_blocks, device
        # each field its own contiguous buffer (the verify graph guards on its inputs' strides,
        # so strided column views of one packed buffer would trace it again)
        for name in self.INT_COLS + self.FLOAT_COLS:
            dtype = torch.int64 if name in self.INT_COLS else torch.float32
            setattr(self, name, torch.zeros(rows, dtype=dtype, device=device))
        self.block_table = torch.zeros(rows, max_blocks, dtype=torch.int64, device=device)

    def load(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Host tensors [rows, ...] (padding rows included) -> the buffers: one upload per
        dtype, then device-side copies into the fields."""
        ints, floats = upload(ints, self.device), upload(floats, self.device)
        for j, name in enumerate(self.INT_COLS):
            getattr(self, name).copy_(ints[:, j])
        self.block_table.copy_(ints[:, len(self.INT_COLS):])
        for j, name in enumerate(self.FLOAT_COLS):
            getattr(self, name).copy_(floats[:, j])


class SpecStepGraph:
    """One bucket of rows and one sampling kind, kind = (some row samples, some row uses min_p,
    some row uses top-k / top-p): its buffers, its program, and on CUDA its captured graph (a
    greedy-only batch skips every sampling op)."""

    def __init__(self, spec: "StaticSpeculativeStep", rows: int, kind: tuple):
        self.spec, self.rows, self.kind = spec, rows, kind
        eng = spec.engine
        self.inputs = SpecStepInputs(rows, eng.max_blocks, eng.device)
        k = spec.k
        i64 = dict(dtype=torch.int64, device=eng.device)
        n = k + 1
        self.token_seq = torch.arange(rows, **i64).repeat_interleave(n)
        self.query_start = torch.arange(rows + 1, **i64) * n
        self.offsets = torch.arange(n, **i64)
        self.captures = (eng.device.type == "cuda" and isinstance(eng.model, CompiledModel)
                         and eng.model.capture)
        self.cuda_graph = None
        self.output = None

    # ------------------------------------------------------------------ the program
    def program(self) -> torch.Tensor:
        spec, eng, i = self.spec, self.spec.engine, self.inputs
        head, model, k = spec.head, spec.model, spec.k
        cfg, c = eng.config, eng.caches
        sampling, use_min_p, use_top_k_p = self.kind
        sample_rows = i.temperature > 0
        keys = i.key

        def params_logits(logits):            # [..., V] -> the rows' filtered logits
            shape = logits.shape
            flat = logits.reshape(shape[0], -1, shape[-1])
            per = flat.shape[1]
            rep = lambda t: t.repeat_interleave(per)  # noqa: E731
            x = filter_logits(flat.reshape(-1, shape[-1]).float(), rep(i.temperature), rep(i.top_p),
                              rep(i.top_k.long()), rep(i.min_p), use_min_p, use_top_k_p)
            return x.view(shape)

        def choose(j, lj):
            greedy = lj.argmax(-1)
            if not sampling:
                return greedy
            drawn = noise_race(params_logits(lj), noise_tag(keys, DRAFT_TAG + j))   # ~ softmax(filtered)
            return torch.where(sample_rows, drawn, greedy)

        drafts, dlogits, conf = head.draft_batch(spec.state, i.slot, i.anchor, i.pos, i.pos,
                                                 model.embed, model.head, choose=choose)
        drafts, dlogits, conf = drafts[:, :k], dlogits[:, :k], conf[:, :k]    # k <= block size
        if spec.draft_override is not None:       # tests / benchmarks: device-side drafts
            drafts = spec.draft_override(self, drafts)
        cap = i.cap
        if spec.config.schedule == "confidence":
            sc = spec.config
            cap = torch.minimum(cap, confidence_cap(conf, sc.step_cost, sc.token_cost, sc.min_survival))

        # snapshot the ring rows the chunk's drafts overwrite
        dpos = i.pos[:, None] + 1 + self.offsets[:k]                                   # [B, k]
        sl = i.slot[:, None].expand(-1, k)
        wrows, crows = dpos.remainder(cfg.sliding_window), dpos.remainder(COMPRESSOR_RING)
        snap_w = [t[sl, wrows] for t in c.window_kv]
        snap_s = [t[sl, wrows] for t in c.window_scale]
        snap_c = {l: t[sl, crows] for l, t in c.compressor_state.items()}
        hist_old = c.engram_history.index_select(0, i.slot)

        # verify
        chunk = torch.cat([i.anchor[:, None], drafts], 1)                             # [B, k+1]
        positions = i.pos[:, None] + self.offsets
        meta = AttentionMetadata(token_seq=self.token_seq, seq_slot=i.slot, chunk_start=i.pos,
                                 seq_len=i.pos + k + 1, query_start=self.query_start,
                                 block_table=i.block_table, logits_index=self.query_start[1:] - 1)
        logits, streams = spec.target(chunk.flatten(), positions.flatten(), c, meta, all_logits=True,
                                      return_streams=spec.targets)
        logits = logits.view(self.rows, k + 1, -1)

        # accept
        committed, count = accept_greedy(drafts, logits, cap)
        if sampling:
            q = torch.softmax(params_logits(dlogits), -1)
            p = torch.softmax(params_logits(logits), -1)
            s_committed, s_count = accept_rejection(drafts, q, p, keys, cap)
            committed = torch.where(sample_rows[:, None], s_committed, committed)
            count = torch.where(sample_rows, s_count, count)
        m = count - 1

        # rollback of rejected positions p+m+1 .. p+k
        rejected = (self.offsets[:k][None, :] >= m[:, None])[..., None]                # [B, k, 1]
        for t, old in zip(c.window_kv, snap_w):
            t[sl, wrows] = torch.where(rejected, old, t[sl, wrows])
        for t, old in zip(c.window_scale, snap_s):
            t[sl, wrows] = torch.where(rejected, old, t[sl, wrows])
        for l, t in c.compressor_state.items():
            t[sl, crows] = torch.where(rejected.view(*rejected.shape[:2], *([1] * (t.dim() - 2))),
                                       snap_c[l], t[sl, crows])
        # Engram history: the newest cached token is at p + m; older ones come from before the step
        lags = c.engram_history.shape[1]
        recent = torch.cat([model.engram_token_map[chunk].flip(1), hist_old], 1)      # p+k, .., p, p-1, ..
        hist = recent.gather(1, (k - m)[:, None] + torch.arange(lags, device=m.device))
        c.engram_history[i.slot] = hist
        # DSpark context of the committed positions p .. p+m
        main_x = head.context(streams)
        head.append_context_rows(spec.state, i.slot, positions, main_x,
                                 self.offsets[None, :] <= m[:, None])
        return torch.cat([committed, count[:, None]], 1)

    # ------------------------------------------------------------------ running it
    def run(self) -> torch.Tensor:
        if not self.captures:
            with torch.no_grad():
                return self.program()
        if self.cuda_graph is None:
            self._capture()
        self.cuda_graph.replay()
        return self.output

    def _capture(self) -> None:
        """Capture the program; the caches and DSpark rings the warm-up and the capture advanced
        are put back."""
        spec = self.spec
        keep = spec.engine.caches.tensors() + list(spec.state.kv)
        self.cuda_graph, self.output = spec.engine.model.capture_graph(self.program, keep=keep)


class StaticSpeculativeStep:
    """The engine side: decides whether a step can run as a SpecStepGraph, loads its inputs,
    runs it, and commits the results on the host (one device-to-host copy)."""

    def __init__(self, decoder, buckets=None):
        self.decoder = decoder                     # the SpeculativeDecoder (state, head, config)
        eng = decoder.engine
        self.engine, self.head, self.config = eng, decoder.head, decoder.config
        self.state, self.model, self.target = decoder.state, decoder.model, decoder.target
        self.targets, self.k = decoder.targets, decoder.config.num_draft
        if buckets is None:
            buckets = eng.model.batch_sizes if isinstance(eng.model, CompiledModel) else ()
        sizes = sorted({int(b) for b in buckets if int(b) < eng.max_batch_size} | {eng.max_batch_size})
        self.buckets = sizes
        self.graphs: dict[tuple, SpecStepGraph] = {}
        self.draft_override = None     # fn(graph, drafts [B, k]) -> drafts: tests and benchmarks

    def applies(self, decodes: list) -> bool:
        """Whether this step (the engine's running requests, all decoding) fits the static step."""
        eng, k = self.engine, self.k
        if not decodes or len(decodes) > self.buckets[-1]:
            return False
        if len(decodes) * (k + 1) > eng.max_num_batched_tokens:
            return False
        limit = eng.max_blocks * eng.block_size
        return all(r.logprobs is None and r.num_cached + k < limit for r in decodes)

    def step(self, decodes: list) -> list:
        eng, k = self.engine, self.k
        n = len(decodes)
        rows = next(b for b in self.buckets if b >= n)
        params = [r.params for r in decodes]
        sampling = not all(p.greedy for p in params)
        kind = (sampling, sampling and any(p.min_p > 0 for p in params),
                sampling and any(p.top_k > 0 or p.top_p < 1.0 for p in params))
        graph = self.graphs.get((rows, kind))
        if graph is None:
            graph = self.graphs[(rows, kind)] = SpecStepGraph(self, rows, kind)

        width, pad = eng.max_blocks, [0, 0, eng.caches.scratch_slot, 0, 0]
        caps = [max(0, min(k, r.params.max_tokens - len(r.output) - 1)) for r in decodes]
        keys = self.decoder.step_keys(decodes).tolist()        # host ints: no device work
        ints, floats = [], []
        for req, cap, key in zip(decodes, caps, keys):
            p = req.params
            ints.append([req.tokens[-1], req.num_cached, req.slot, cap, key]
                        + req.blocks + [-1] * (width - len(req.blocks)))
            floats.append([p.temperature, p.top_p, float(max(p.top_k, 0)), p.min_p])
        ints += [pad + [-1] * width] * (rows - n)
        floats += [[0.0] * len(SpecStepInputs.FLOAT_COLS)] * (rows - n)
        if hasattr(self.draft_override, "prepare"):
            self.draft_override.prepare(decodes)
        graph.inputs.load(torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32))

        out = graph.run()[:n].tolist()              # the step's one device-to-host copy
        eng.stats["steps"] += 1
        eng.stats["tokens"] += n * (k + 1)
        eng.stats["spec_static_steps"] += 1
        now = time.perf_counter()
        events = []
        for req, row, cap in zip(decodes, out, caps):
            count = row[-1]
            committed = row[:count]
            m = count - 1
            req.num_cached += count
            self.state.length[req.slot] = req.num_cached
            if cap > 0:
                eng.stats["spec_verifies"] += 1
                eng.stats["spec_drafted"] += k
                eng.stats["spec_accepted"] += m
                eng.stats["spec_committed"] += count
                eng.stats["spec_rejections"] += int(m < k)
            events.append(eng._emit(req, committed, now))
        return events


class ReferenceDrafts:
    """Device-side drafts with a controlled acceptance rate, for tests and benchmarks
    (`StaticSpeculativeStep.draft_override`): each request's known greedy continuation (from a
    run without speculation), with draft j replaced by a wrong token where a hash of (position,
    j) is >= accept_rate. The DSpark head still runs (its cost is paid), its drafts are replaced.
    Greedy output must equal the reference run's (the lossless check), and each draft survives
    with probability accept_rate given the ones before it (expected committed tokens per step
    1 + r + .. + r^k)."""

    def __init__(self, engine, continuations: dict, accept_rate: float, seed: int = 0):
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.engine, self.continuations, self.accept_rate = engine, continuations, accept_rate
        self.seed = seed
        k = engine.spec.config.num_draft
        self.table = torch.zeros(engine.caches.num_slots, engine.max_seq_len + k + 2, dtype=torch.int64,
                                 device=engine.device)
        self.loaded: dict[int, int] = {}        # slot -> request id whose tokens the row holds

    def prepare(self, decodes: list) -> None:
        """Load the table rows of requests new to their slot (host side, before the replay)."""
        for req in decodes:
            if self.loaded.get(req.slot) != req.request_id:
                toks = self.continuations[tuple(req.prompt)]
                self.table[req.slot].zero_()[:len(toks)].copy_(torch.tensor(toks))
                self.loaded[req.slot] = req.request_id

    def __call__(self, graph: SpecStepGraph, drafts: torch.Tensor) -> torch.Tensor:
        i, k = graph.inputs, drafts.shape[1]
        idx = (i.pos[:, None] + 1 + torch.arange(k, device=drafts.device)).clamp_max(self.table.shape[1] - 1)
        true = self.table[i.slot[:, None], idx]
        u = uniform_noise(row_keys(torch.full_like(i.pos, self.seed), torch.zeros_like(i.pos), i.pos), k)
        wrong = (true + 1).remainder(self.engine.config.vocab_size)
        return torch.where(u < self.accept_rate, true, wrong)


__all__ = ["ReferenceDrafts", "SpecStepGraph", "StaticSpeculativeStep", "confidence_cap"]
