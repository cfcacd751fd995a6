"""Lossless DSpark speculative decoding inside the serving engine (MODEL.md §8).

    head = load_dspark(ckpt, model.config)                    # or init_random_dspark_(DSparkHead(cfg))
    eng = Engine(model, 8, 256, speculative=SpecConfig(num_draft=5), draft_head=head)
    outs = eng.generate(prompts, SamplingParams(max_tokens=64))
    eng.spec.acceptance_length                                # mean tokens committed per verification

One engine step with speculation (`SpeculativeDecoder.step`), ONE target call per step. A step in
which every scheduled request decodes runs the static step instead when SpecConfig.step allows
(speculative_graph.py: the same algorithm over a bucket of rows on the device, captured on
CUDA); this module is the per-request reference and runs every other step:
  1. draft   for every running request whose prompt is done: the DSpark head drafts a block
             from the anchor = the pending (last committed, not yet cached) token at position
             p = num_cached, using the context of positions < p in its per-slot window rings.
             Greedy requests take the head's greedy drafts; sampled requests draw each draft
             from q_j = the request's filtered distribution (temperature, min_p, top_k, top_p)
             with counter-based noise keyed by (seed, tokens generated, draft index)
             (sampling.py, "speculative draws"); the verification's p is the same transform of
             the target logits, so it stays lossless. Penalties are refused with speculation
             (`SpeculativeDecoder.check`): a penalty at draft position j depends on drafts
             1..j-1, which the per-position transform does not model. Logprobs of the committed
             tokens come from the target rows that scored them (`token_logprobs`).
  2. schedule  verify lengths k_r <= num_draft (and <= max_tokens - len(output) - 1, so the
             chunk never leaves the blocks the request was given at admission) within the
             step's token budget; `schedule="confidence"` picks them from the survival products
             a_{r,j} = prod_{i<=j} sigmoid(c_{r,i}) of the confidence head (see `_verify_lengths`),
             `"fixed"` gives every request num_draft (budget permitting). Prefill chunks fill the
             rest of the budget, as in the plain engine.
  3. verify  the target runs once over the flat batch [anchor, d_1..d_k] per decoding request +
             prefill chunks, all_logits=True. Greedy: `verify_greedy` (accept while the draft
             equals the target's argmax, plus the correction/bonus token); sampling:
             `accept_rejection` (Leviathan/Chen, residual resampling, one bonus token).
  4. rollback  of everything the rejected positions p+m+1..p+k touched (m = accepted drafts):
       * window rings (every layer): the chunk wrote ring row pos % W for each chunk position;
         the rows of the rejected positions held positions pos - W that are still inside the
         window after rollback -> snapshot rows (p+1..p+K) % W before the call, restore the
         rejected ones after (needs K <= W - 1 so no two chunk positions share a row);
       * compressor state rings (ratio > 1 sources): same with rows pos % 32 (K <= 31);
       * Engram history: rewritten from the last n-1 committed tokens (compressed ids);
       * DSpark's own window rings: only the accepted positions' context is ever appended, so
         they need no restore;
       * seq_lens / blocks: num_cached advances by m + 1 only; blocks were allocated for the
         longest context at admission, so nothing is allocated or freed here.
       * Global KV / index-key rows (paged) written for rejected positions need NO rollback:
         a sequence only sees compressed rows of complete groups below its seq_len (visibility is
         computed from positions), and the row is rewritten when the real token at that
         position is processed (the group's earlier, accepted rows come from the compressor
         ring, which was restored).
  5. DSpark context: head.context() of the residual streams entering the target layers
     (returned by the target call: `return_streams=(t-1, ...)`, model.debug's
     `block_out.layer{t-1}`) of the accepted positions (and of every prefill token the decoder
     ran) is appended to the request's DSpark window rings.
The target of step 3 is the engine's model: with a v41graph.compile()d model the verify call
runs the compiled graph (uncaptured here: these steps' chunk lengths vary); steps with a
decoder-replay prefill chunk run eagerly, as in the plain engine.
Prefill chunks follow the engine's prefill_mode: with decoder bounded replay (the default for
prompts longer than the window) the decoder -- and so the target layers -- runs only over the
last `sliding_window` prompt tokens, exactly what DSpark's window rings hold.

Not done yet: compiled steps with a decoder-replay prefill chunk (eager, see above), penalties
with speculation (refused at add_request), a k per batch bucket (the static step verifies
num_draft drafts in every bucket; at batch 64 fewer pay better, docs/BENCHMARKS.md). Shared
draft/target top-k buffers (the seed's P5) do not apply: the draft's attention is window-only
(dspark.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from v41graph.model.kv_cache import COMPRESSOR_RING
from .batch import eager_model
from .sampling import (DRAFT_TAG, FINAL_TAG, accept_rejection, noise_race, noise_tag, params_logits,
                       row_keys, split_seed, token_logprobs, verify_greedy)


@dataclass(frozen=True)
class SpecConfig:
    num_draft: int = 5                 # k: drafts verified per request per step (<= block size)
    schedule: str = "fixed"            # "fixed" | "confidence"
    # confidence schedule: choose the number of verified drafts n maximising
    #   (expected committed tokens) / (step_cost + token_cost * verified tokens)
    step_cost: float = 1.0
    token_cost: float = 0.05
    min_survival: float = 0.0          # never verify a draft whose survival product is below this
    # which decode steps run the static step (speculative_graph.py: draft, verify, acceptance
    # and rollback on the device, captured on CUDA): "auto" = when the engine's model is a
    # v41graph.compile()d model; "static" = always (an eager model too); "eager" = never (the
    # per-request reference below runs every step)
    step: str = "auto"

    def __post_init__(self):
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {self.num_draft}")
        if self.schedule not in ("fixed", "confidence"):
            raise ValueError(f"schedule must be 'fixed' or 'confidence', got {self.schedule!r}")
        if self.step not in ("auto", "static", "eager"):
            raise ValueError(f"step must be 'auto', 'static' or 'eager', got {self.step!r}")


class SpeculativeDecoder:
    def __init__(self, engine, head, config: SpecConfig):
        if head is None:
            raise ValueError("speculative decoding needs draft_head= (a DSparkHead)")
        cfg = engine.config
        k = config.num_draft
        if k > head.block_size:
            raise ValueError(f"num_draft {k} > the DSpark block size {head.block_size}")
        if k > cfg.sliding_window - 1 or k > COMPRESSOR_RING - 1:
            raise ValueError(f"num_draft {k} must be <= sliding_window - 1 ({cfg.sliding_window - 1}) "
                             f"and <= {COMPRESSOR_RING - 1} (ring rollback)")
        self.engine, self.head, self.config = engine, head, config
        # The target runs as the engine runs it: its compiled model when it was given one
        # (verify steps run the compiled graph, without capture), else the eager V41Model. The
        # drafts use the eager model's embedding and head (shared weights).
        self.target = engine.model
        self.model = eager_model(engine.model)
        self.state = head.new_state(engine.caches.num_slots)   # the draft's rows per cache slot
        self.stats = engine.stats
        # streams entering each target layer t = leaving layer t - 1 (block_out.layer{t-1})
        self.targets = tuple(t - 1 for t in cfg.dspark_target_layer_ids)
        self.static = None
        if config.step == "static" or (config.step == "auto" and self.target is not self.model):
            from .speculative_graph import StaticSpeculativeStep
            self.static = StaticSpeculativeStep(self)

    @staticmethod
    def check(params) -> None:
        """Refuse what speculative decoding does not support (raised at add_request)."""
        if params.penalized:
            raise ValueError("repetition / presence / frequency penalties are not supported with "
                             "speculative decoding (a draft position's penalties depend on the drafts "
                             "before it); use an engine without speculative=")

    # ------------------------------------------------------------------ metrics
    @property
    def acceptance_length(self) -> float:
        """Mean tokens committed per verification with >= 1 draft (accepted drafts + 1)."""
        n = self.stats["spec_verifies"]
        return self.stats["spec_committed"] / n if n else float("nan")

    # ------------------------------------------------------------------ drafting
    def noise_seed(self, req) -> tuple[int, int]:
        """A sampled request's noise seed (lo, hi): its own seed, or one drawn once from its
        generator (then every draw of the request is counter-based, see sampling.py)."""
        if req.noise_seed is None:
            p, g = req.params, req.generator
            req.noise_seed = split_seed(p.seed if p.seed is not None else
                                        int(torch.randint(0, 2 ** 62, (1,), generator=g, device=g.device)))
        return req.noise_seed

    def step_keys(self, reqs) -> torch.Tensor:
        """[n] int64 on the host: each request's noise key for this step, (seed, tokens generated
        so far); 0 for greedy requests (they draw nothing)."""
        rows = [(*self.noise_seed(r), len(r.output)) if not r.params.greedy else (0, 0, 0) for r in reqs]
        lo, hi, made = torch.tensor(rows, dtype=torch.int64).view(-1, 3).unbind(1)
        return row_keys(lo, hi, made)

    def step_key(self, req) -> torch.Tensor:
        """[1] one request's step key on the device."""
        return self.step_keys([req]).to(self.engine.device)

    def _draft(self, req, anchor: int, pos: int):
        """(draft ids [block], draft probs q [block, V] or None (greedy), confidence logits)."""
        p = req.params
        choose = None
        if not p.greedy:
            key = self.step_key(req)
            choose = lambda j, lj: noise_race(params_logits(lj[None], p), noise_tag(key, DRAFT_TAG + j))  # noqa: E731
        ids, logits, conf = self.head.draft(self.state, req.slot, anchor, pos, self.model.embed,
                                            self.model.head, choose=choose)
        q = None if p.greedy else torch.softmax(params_logits(logits, p), -1)
        return ids[1:].tolist(), q, conf

    def _verify_lengths(self, kmax: list, conf: list, budget: int) -> list:
        """Verify lengths k_r <= kmax[r] with sum(k_r) <= budget (the extra tokens beyond one
        per decoding request)."""
        cands = []          # (survival, j, r): greedy by survival; j keeps prefixes per request
        for r, (km, c) in enumerate(zip(kmax, conf)):
            if km <= 0:
                continue
            if self.config.schedule == "fixed":
                surv = [1.0] * km
            else:
                surv = torch.sigmoid(c[:km].double()).cumprod(0).tolist()
            cands += [(s, j, r) for j, s in enumerate(surv) if s >= self.config.min_survival]
        cands.sort(key=lambda t: (-t[0], t[1], t[2]))
        cands = cands[:max(budget, 0)]
        n = len(cands)
        if self.config.schedule == "confidence" and cands:
            # expected committed tokens / step cost, over prefixes of the sorted candidates
            c = self.config
            base = len(kmax)
            best, best_n, gain = base / (c.step_cost + c.token_cost * base), 0, 0.0
            for i, (s, _, _) in enumerate(cands, 1):
                gain += s
                v = (base + gain) / (c.step_cost + c.token_cost * (base + i))
                if v > best:
                    best, best_n = v, i
            n = best_n
        k = [0] * len(kmax)
        for _, _, r in cands[:n]:
            k[r] += 1
        return k

    # ------------------------------------------------------------------ one step
    def step(self) -> list:
        eng, model, head = self.engine, self.model, self.head
        cfg = eng.config
        budget = eng.max_num_batched_tokens
        decodes = [r for r in eng.running if r.output and len(r.tokens) - r.num_cached == 1]
        if (self.static is not None and len(decodes) == len(eng.running)
                and self.static.applies(decodes)):
            return self.static.step(decodes)
        drafts, qs, confs, kmax = [], [], [], []
        with torch.no_grad():
            for req in decodes:
                km = min(self.config.num_draft, req.params.max_tokens - len(req.output) - 1)
                kmax.append(km)
                if km > 0:
                    d, q, c = self._draft(req, req.tokens[-1], req.num_cached)
                else:
                    d, q, c = [], None, None
                drafts.append(d)
                qs.append(q)
                confs.append(c)
        ks = self._verify_lengths(kmax, confs, budget - len(decodes))
        batch = [(req, [req.tokens[-1]] + drafts[i][:ks[i]]) for i, req in enumerate(decodes)]
        batch = eng._add_prefill_chunks(batch, budget - sum(len(c) for _, c in batch))
        if not batch:
            return []

        ids, positions, meta = eng._host_inputs(batch)
        # Prefill chunks of long prompts: decoder bounded replay, as in the plain engine. The
        # model then returns logits / decoder streams of the kept tokens only: row i's kept
        # tokens are the last kept[i] of its chunk (decodes, which lead the batch, keep all).
        lens = [len(c) for _, c in batch]
        floors = eng.replay_floors(batch, len(decodes))
        kept = lens if floors is None else [
            r.num_cached + n - min(max(r.num_cached, f), r.num_cached + n)
            for (r, _), n, f in zip(batch, lens, floors)]
        qstart = [0]
        for n in kept:
            qstart.append(qstart[-1] + n)
        replay_kw = {}
        if floors is not None:
            replay_kw["decoder_replay"] = torch.tensor(floors, dtype=torch.int64, device=eng.device)

        # Snapshot the ring rows the drafts of each decoding request will overwrite.
        nd = len(decodes)
        K = max(ks, default=0)
        snap = None
        if K > 0:
            slots = torch.tensor([r.slot for r in decodes], device=eng.device)
            base_pos = torch.tensor([r.num_cached for r in decodes], device=eng.device)
            dpos = base_pos[:, None] + 1 + torch.arange(K, device=eng.device)      # [nd, K]
            wrows, crows = dpos % cfg.sliding_window, dpos % COMPRESSOR_RING
            sl = slots[:, None]
            c = eng.caches
            snap = ([t[sl, wrows].clone() for t in c.window_kv],
                    [t[sl, wrows].clone() for t in c.window_scale],
                    {l: t[sl, crows].clone() for l, t in c.compressor_state.items()})

        keep = None
        if floors is not None:        # token indices (full batch) of the kept tokens
            full_start = 0
            idx = []
            for n, k in zip(lens, kept):
                idx.extend(range(full_start + n - k, full_start + n))
                full_start += n
            keep = torch.tensor(idx, dtype=torch.int64, device=eng.device)
        with torch.no_grad():
            logits, streams = self.target(ids, positions, eng.caches, meta, all_logits=True,
                                          return_streams=self.targets, **replay_kw)
            if keep is not None:   # a target before the decoder still has every token
                streams = [s[keep] if t < model.decoder_start else s
                           for s, t in zip(streams, self.targets)]
            main_x = head.context(streams)
        eng.stats["steps"] += 1
        eng.stats["tokens"] += ids.shape[0]
        if keep is not None:
            positions = positions[keep]

        events = []
        now = time.perf_counter()
        accepted = []                                     # m per decoding request
        commits, target_rows = [], []
        for i, req in enumerate(decodes):
            k = ks[i]
            rows = logits[qstart[i]: qstart[i] + k + 1]
            d = drafts[i][:k]
            if req.params.greedy:
                committed = verify_greedy(d, rows)
            else:
                p = torch.softmax(params_logits(rows, req.params), -1)
                q = qs[i][:k] if k else torch.empty(0, rows.shape[-1], device=rows.device)
                dt = torch.tensor([d], dtype=torch.int64, device=rows.device).view(1, k)
                out, count = accept_rejection(dt, q[None], p[None], self.step_key(req),
                                              torch.full((1,), k, device=rows.device))
                committed = out[0, :int(count)].tolist()
            m = len(committed) - 1
            accepted.append(m)
            commits.append(committed)
            target_rows.append(rows)          # rows[j] scored committed[j]
            if k > 0:
                eng.stats["spec_verifies"] += 1
                eng.stats["spec_drafted"] += k
                eng.stats["spec_accepted"] += m
                eng.stats["spec_committed"] += m + 1
                eng.stats["spec_rejections"] += int(m < k)

        if snap is not None:
            self._roll_back_rings(snap, accepted, slots, wrows, crows, K)
        # Global KV / index keys of rejected positions: no rollback needed (see module doc).

        # ---- bookkeeping, Engram history, DSpark context, emit
        for i, req in enumerate(decodes):
            m, committed = accepted[i], commits[i]
            req.num_cached += m + 1
            if ks[i] > m:   # the chunk rolled the history past rejected tokens
                self._roll_back_history(req, committed)
            r0 = qstart[i]
            head.append_context(self.state, req.slot, positions[r0: r0 + m + 1], main_x[r0: r0 + m + 1])
            events.append(self._emit(req, committed, target_rows[i], now))
        for i in range(nd, len(batch)):                       # prefill chunks
            req, chunk = batch[i]
            r0, r1 = qstart[i], qstart[i + 1]
            if req.num_cached == 0:
                self.state.reset(req.slot)
            if r1 > r0:       # (a replayed chunk before the segment keeps no token)
                head.append_context(self.state, req.slot, positions[r0:r1], main_x[r0:r1])
            req.num_cached += len(chunk)
            if req.num_cached == len(req.tokens):
                row = logits[r1 - 1]
                p = req.params
                tok = int(row.argmax()) if p.greedy else int(noise_race(
                    params_logits(row[None], p), noise_tag(self.step_key(req), FINAL_TAG)))
                events.append(self._emit(req, [tok], row[None], now))
        return events

    def _emit(self, req, tokens: list, rows, now: float) -> tuple:
        """The engine's emit, plus the logprobs of the tokens it kept (rows[j] scored tokens[j])."""
        event = self.engine._emit(req, tokens, now)
        if req.logprobs is not None and event[1]:
            req.logprobs.extend(token_logprobs(rows[:len(event[1])], event[1], req.params,
                                               self.engine.sampler.logprobs_mode))
        return event

    # ------------------------------------------------------------------ rollback
    def _roll_back_rings(self, snap, accepted: list, slots, wrows, crows, K: int) -> None:
        """Put back the window and compressor ring rows that rejected drafts overwrote."""
        eng = self.engine
        acc = torch.tensor(accepted, device=eng.device)
        rej = torch.arange(K, device=eng.device)[None, :] >= acc[:, None]       # draft j+1 rejected
        if bool(rej.any()):
            b_idx, j_idx = rej.nonzero(as_tuple=True)
            s_idx, w_idx, c_idx = slots[b_idx], wrows[b_idx, j_idx], crows[b_idx, j_idx]
            c = eng.caches
            for t, old in zip(c.window_kv, snap[0]):
                t[s_idx, w_idx] = old[b_idx, j_idx]
            for t, old in zip(c.window_scale, snap[1]):
                t[s_idx, w_idx] = old[b_idx, j_idx]
            for l, t in c.compressor_state.items():
                t[s_idx, c_idx] = snap[2][l][b_idx, j_idx]

    def _roll_back_history(self, req, committed: list) -> None:
        """Rewrite the request's Engram history row from its committed tokens (the verify
        chunk rolled it past the rejected drafts)."""
        eng, tmap = self.engine, self.model.engram_token_map
        lags = eng.caches.engram_history.shape[1]
        pad = int(tmap[eng.config.engram_pad_token_id])
        toks = req.tokens + committed          # positions 0.. (pending = committed[-1])
        n = req.num_cached
        hist = [int(tmap[toks[n - 1 - j]]) if n - 1 - j >= 0 else pad for j in range(lags)]
        eng.caches.engram_history[req.slot] = torch.tensor(hist, dtype=torch.int64)


def init_random_dspark_(head, seed: int = 0):
    """Deterministic random weights for a DSparkHead (tests, demo), like model.init_random_."""
    from v41graph.model.model import init_random_weights_
    return init_random_weights_(head, torch.Generator().manual_seed(seed))


__all__ = ["SpecConfig", "SpeculativeDecoder", "init_random_dspark_"]
