"""A small vLLM-like serving engine on top of the model contract.

    eng = Engine(model_or_compiled, max_batch_size=8, max_seq_len=256, block_size=16)
    rid = eng.add_request([5, 6, 7], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seed=1))
    while eng.has_unfinished():
        for rid, new_tokens, finished in eng.step():
            ...
    outs = eng.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))   # greedy
    outs = eng.generate(["Hello", [{"role": "user", "content": "Hi"}]],       # text in, text out
                        SamplingParams(max_tokens=8, stop=["\n"]))           # outs[i].text
    for tokens in eng.stream([1, 2, 3], SamplingParams(max_tokens=8)): ...   # streaming

Scheduling (continuous batching): every step runs ONE model call over a flat batch that holds
  * a decode token for every running request whose prompt is done (always scheduled), then
  * prefill chunks of running requests still in their prompt, oldest first, one chunk per
    request per step, each at most `prefill_chunk_size` tokens, within the step's token budget
    `max_num_batched_tokens`.
Waiting requests are admitted FIFO whenever a cache slot and their blocks are free.

Decode metadata (the seed's P5): the decode rows of a step live in a persistent `DecodeBatch`
(v41graph/runtime/batch.py): slots and block tables are written when a request starts or stops
decoding, positions / chunk starts / sequence lengths move on by one with a single device add
after each step. A steady-state decode step (same decoding requests as the step before, no
prefill chunk) therefore builds its metadata without reading the device and without building a
tensor from host data; the scheduler counts lengths in Python ints itself. The new tokens are
the one host-to-device transfer (non-blocking, from pinned memory on CUDA). A step with
prefill chunks appends freshly built chunk metadata to the persistent decode rows.
`persistent_metadata=False` rebuilds everything from host lists every step (the old path).

Prefill (`prefill_mode`): "auto" (default) runs CED decoder bounded replay (MODEL.md §9) for
prompts longer than the sliding window: every prompt token goes through the encoder and the
decoder's global-KV source, the decoder layers only over the last `sliding_window` prompt
tokens with their window truncated there (chunk by chunk: a chunk wholly before that segment
skips the decoder). Prompts within the window prefill exactly as with "full", which runs every
layer over every prompt token (as DeepSeek's reference does); "replay" takes the replay path
for every prompt chunk (same results as "auto").

Memory: each request gets a cache slot (window ring, compressor ring, Engram history row) and,
on admission, every block its longest possible context (prompt + max_tokens - 1) can need, so a
running request never runs out of memory mid-generation and no preemption is needed. Slot
`max_batch_size` is the scratch slot a compiled model's padded decode batches write into. Blocks
and slot are freed on finish and on abort.

Validation (`add_request`) happens before anything is queued: empty prompts, token ids outside
the vocabulary, contexts longer than `max_seq_len` / `max_position_embeddings`, and requests that
need more blocks than the whole pool raise `RequestError` / `CacheCapacityError`; token ids must
be integers (floats are refused, not coerced; a string is a text prompt, which needs a
tokenizer); nothing about the other requests changes. A stream callback that raises fails its
own request only: it finishes with reason "error" (its blocks and slot freed, the exception text
in `RequestOutput.error`) and the step goes on with every other request.

Text (runtime/text.py): with a tokenizer (`Engine(..., tokenizer=DIR)`, or by default the one in
the checkpoint folder a `from_pretrained` model came from) a prompt may be a string (encoded with
the tokenizer's special tokens) or a list of chat messages (the chat template with the
generation prompt); every request then has its output text (`RequestOutput.text`, grown token by
token for streaming callbacks: `Engine.text(request_id)`), and `SamplingParams.stop` strings end a
request with finish reason "stop", its text cut just before the stop string. End-of-sequence is
a token id like any other: pass `stop_ids=[tokenizer.eos_token_id]` to stop there.

Sampling (v41graph.runtime.sampling.BatchSampler): one batched call per step for every row
that produces a token, on the device, one host copy. A seeded request's tokens depend only on
its own prompt, params and seed (its noise is a hash of (seed, position)), and the model
computes each sequence independently (up to fp32 summation order in differently shaped
batches, see tests/test_model_consistency.py); unseeded requests draw from the sampler's
generator. `SamplingParams(n=k)` in generate() runs k requests (k prefills of the prompt: the
engine has no prefix sharing) and returns them as one RequestOutput with k `outputs`;
`logprobs=k` fills `RequestOutput.logprobs` ({token id: logprob} per generated token; which
distribution: `Engine(..., logprobs_mode=...)`, vLLM's names and default).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from v41graph.model.metadata import concat_metadata
from .batch import CacheCapacityError, StepRunner, eager_model, token_ids_list
from .sampling import BatchSampler, SamplingParams
from .text import TextStream, Tokenizer, TokenizerError, has_tokenizer, is_chat


PREFILL_MODES = ("auto", "replay", "full")


class RequestError(ValueError):
    """A request that can never be served (bad token ids, too long, ...)."""


StreamCallback = Callable[[int, list, bool], None]


@dataclass
class Request:
    request_id: int
    prompt: list
    params: SamplingParams
    generator: torch.Generator | None
    callback: StreamCallback | None = None
    text_stream: TextStream | None = None    # the output text (with a tokenizer)
    slot: int | None = None
    blocks: list = field(default_factory=list)
    num_cached: int = 0                 # tokens of prompt + output already in the cache
    output: list = field(default_factory=list)
    status: str = "waiting"             # waiting | running | finished
    finish_reason: str | None = None    # stop | length | abort | error
    error: str | None = None            # why the request failed (finish_reason "error")
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list | None = None        # per generated token {token id: logprob} (params.logprobs)
    noise_seed: tuple | None = None     # speculation's draws: (lo, hi) of the request's seed

    @property
    def tokens(self) -> list:
        return self.prompt + self.output

    @property
    def max_context(self) -> int:
        """Tokens the cache must hold at most: the last generated token is never fed back."""
        return len(self.prompt) + self.params.max_tokens - 1


@dataclass
class CompletionOutput:
    """One of the n samples of a request."""
    index: int
    token_ids: list
    finish_reason: str | None
    logprobs: list | None = None
    error: str | None = None
    text: str | None = None             # the output text (None without a tokenizer)


@dataclass
class RequestOutput:
    """token_ids / finish_reason / logprobs / error are the first sample's; `outputs` holds
    all n (one for n=1)."""
    request_id: int
    prompt_token_ids: list
    token_ids: list
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None
    text: str | None = None             # the output text (None without a tokenizer)
    logprobs: list | None = None        # per generated token {token id: logprob}, sampled one first
    outputs: list = field(default_factory=list)     # [CompletionOutput] * n

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Engine(StepRunner):
    def __init__(self, model, max_batch_size: int, max_seq_len: int, block_size: int = 128,
                 num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                 prefill_chunk_size: int | None = None, speculative=None, draft_head=None,
                 prefill_mode: str = "auto", persistent_metadata: bool = True,
                 decode_width_buckets: bool = False, tokenizer=None, logprobs_mode: str = "raw_logprobs"):
        """model: a V41Model or a v41graph.compile()d CompiledModel (same call signature).

        speculative=SpecConfig(num_draft=k) with draft_head=DSparkHead: lossless DSpark
        speculative decoding (v41graph.runtime.speculative); its verify steps run `model` as given
        (a compiled model's graph, uncaptured; the draft head runs eagerly).
        prefill_mode: "auto" (decoder bounded replay for prompts longer than the window),
        "full" or "replay" (see the module docstring). persistent_metadata=False: rebuild the
        decode metadata from host lists every step instead of keeping it on the device.
        decode_width_buckets=True: a decode step's block tables are cut to its longest context,
        rounded up to a power of two of blocks, instead of max_seq_len (the Full layers score
        every position of the table width, so the step's cost then follows the contexts in it;
        same tokens). With a compiled model each width is one more capture of the shared
        decode trace, not a new trace.
        tokenizer: a runtime.text.Tokenizer, a folder with tokenizer.json, False for none, or
        None (default): the tokenizer of the checkpoint folder the model was loaded from, if any.
        logprobs_mode: "raw_logprobs" (vLLM's default: the model's distribution) or
        "processed_logprobs" (after penalties, temperature, min_p, top_k, top_p)."""
        if prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
        sizes = getattr(model, "batch_sizes", None)
        if sizes and getattr(model, "capture", False) and max_batch_size > max(sizes):
            raise ValueError(f"max_batch_size {max_batch_size} > the compiled model's largest decode "
                             f"bucket {max(sizes)}; compile with larger batch_sizes")
        super().__init__(model, max_batch_size, max_seq_len, block_size, num_blocks, persistent_metadata)
        self.max_num_batched_tokens = max_num_batched_tokens or max(256, max_batch_size)
        if self.max_num_batched_tokens < max_batch_size:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} < max_batch_size "
                             f"{max_batch_size}: every running decode must fit in one step")
        self.prefill_chunk_size = prefill_chunk_size or self.max_num_batched_tokens
        self.free_slots = list(range(max_batch_size - 1, -1, -1))
        self.requests: dict[int, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self.stats = collections.Counter()
        self.prefill_mode = prefill_mode
        self.decode_width_buckets = decode_width_buckets
        self.tokenizer = _resolve_tokenizer(tokenizer, model)
        self.sampler = BatchSampler(self.config.vocab_size, max_batch_size, self.device, logprobs_mode)
        self.spec = None
        if speculative is not None and self.spmd is not None:
            raise ValueError("speculative decoding does not run on a parallel model yet (its draft "
                             "and verify calls bypass the broadcast steps)")
        if speculative is not None:
            from .speculative import SpeculativeDecoder
            self.spec = SpeculativeDecoder(self, draft_head, speculative)

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, prompt) -> list:
        """A prompt's token ids: token ids as given (integers), a string through the tokenizer
        (with its special tokens, e.g. BOS), chat messages [{"role", "content"}] through its chat
        template with the generation prompt. Raises RequestError for what cannot be a prompt."""
        if isinstance(prompt, str) or is_chat(prompt):
            if self.tokenizer is None:
                what = ("token_ids must be a sequence of integer token ids, got a str; a text prompt"
                        if isinstance(prompt, str) else "a chat prompt")
                raise RequestError(f"{what} needs a tokenizer: Engine(..., tokenizer=DIR) or a model "
                                   f"loaded from a checkpoint folder with tokenizer.json")
            if isinstance(prompt, str) and not prompt:
                raise RequestError("empty prompt: the prompt text is an empty string")
            try:
                if isinstance(prompt, str):
                    return self.tokenizer.encode(prompt)
                return self.tokenizer.apply_chat_template(prompt)
            except TokenizerError as e:
                raise RequestError(str(e)) from None
        try:
            return token_ids_list(prompt, "token_ids")
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None

    def validate(self, token_ids, params: SamplingParams) -> list:
        """The checks add_request does, without queueing anything. Returns the prompt as ints
        (`token_ids` may be a string or chat messages with a tokenizer, see prompt_ids)."""
        cfg = self.config
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings (SamplingParams.stop) need a tokenizer; use stop_ids "
                               "for token ids")
        prompt = self.prompt_ids(token_ids)
        if not prompt:
            raise RequestError("empty prompt: a request needs at least one token")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} outside the vocabulary 0..{cfg.vocab_size - 1}")
        if params.logprobs is not None and params.logprobs > cfg.vocab_size:
            raise RequestError(f"SamplingParams.logprobs {params.logprobs} > the vocabulary size {cfg.vocab_size}")
        if self.spec is not None:
            try:
                self.spec.check(params)
            except ValueError as e:
                raise RequestError(str(e)) from None
        ctx = len(prompt) + params.max_tokens - 1
        if ctx > self.max_seq_len:
            raise RequestError(f"request too long: prompt {len(prompt)} + max_tokens {params.max_tokens} "
                               f"- 1 = {ctx} tokens of context > max_seq_len {self.max_seq_len}")
        need = math.ceil(ctx / self.block_size)
        if need > self.num_blocks:
            raise CacheCapacityError(f"request needs {need} cache blocks but the pool has only "
                                     f"{self.num_blocks}")
        return prompt

    def add_request(self, token_ids, params: SamplingParams | None = None,
                    callback: StreamCallback | None = None) -> int:
        """Queue a request (token ids, or a string / chat messages with a tokenizer); returns its
        id. callback(request_id, new_token_ids, finished) is called from step() whenever the
        request produces tokens (streaming; its text so far is `text(request_id)`)."""
        params = params if params is not None else SamplingParams()
        prompt = self.validate(token_ids, params)
        if params.n != 1:
            raise RequestError(f"SamplingParams.n = {params.n}: add_request queues one sample; use "
                               f"generate(), or add one request per params.samples() entry")
        rid = next(self._ids)
        gen = None if params.greedy or self.spec is None else params.make_generator(self.device)  # speculation's draws
        text = None if self.tokenizer is None else self.tokenizer.text_stream(params.stop)
        req = Request(rid, prompt, params, gen, callback, text, arrival_time=time.perf_counter(),
                      logprobs=None if params.logprobs is None else [])
        self.requests[rid] = req
        self.waiting.append(req)
        return rid

    def abort(self, request_id: int) -> bool:
        """Stop a request and free its memory. Returns False if it was already finished."""
        req = self._request(request_id)
        if req.status == "finished":
            return False
        if req.status == "waiting":
            self.waiting.remove(req)
        self._finish(req, "abort")
        self._notify(req, [], True)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _request(self, request_id: int) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request id {request_id!r} (never added, or already released)")
        return req

    def output(self, request_id: int) -> RequestOutput:
        r = self._request(request_id)
        logprobs = None if r.logprobs is None else list(r.logprobs)
        text = self.text(request_id)
        return RequestOutput(r.request_id, list(r.prompt), list(r.output), r.finish_reason,
                             r.arrival_time, r.first_token_time, r.finish_time, r.error,
                             text=text, logprobs=logprobs,
                             outputs=[CompletionOutput(0, list(r.output), r.finish_reason, logprobs, r.error, text)])

    def text(self, request_id: int) -> str | None:
        """The request's output text so far (None without a tokenizer): only text no later token
        can change, never part of a stop string; complete once the request has finished."""
        stream = self._request(request_id).text_stream
        return None if stream is None else stream.text

    def release(self, request_id: int) -> RequestOutput:
        """Output of a finished request, forgetting it (keeps a long-running engine small)."""
        if self._request(request_id).status != "finished":
            raise ValueError(f"request {request_id} has not finished")
        out = self.output(request_id)
        del self.requests[request_id]
        return out

    # ------------------------------------------------------------------ scheduling
    def _admit(self) -> None:
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            need = math.ceil(req.max_context / self.block_size)
            if need > self.allocator.num_free:
                break                       # FIFO: wait for memory rather than overtaking
            self.waiting.popleft()
            req.blocks = self.allocator.allocate(need)
            req.slot = self.free_slots.pop()
            req.status = "running"
            self.running.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        if req.status == "running":
            self.running.remove(req)
            self.allocator.free(req.blocks)
            self.free_slots.append(req.slot)
        req.blocks, req.slot = [], None
        if req.text_stream is not None:
            req.text_stream.finish()        # release the text held back for stop strings
        req.status, req.finish_reason = "finished", reason
        req.finish_time = time.perf_counter()
        self.stats[f"finished_{reason}"] += 1

    def _schedule(self) -> list:
        """[(request, chunk of tokens)] for this step: decodes first, then prefill chunks."""
        budget = self.max_num_batched_tokens
        batch = []
        for req in self.running:
            pending = len(req.tokens) - req.num_cached
            if req.output and pending == 1:
                batch.append((req, req.tokens[req.num_cached:]))
                budget -= 1
        return self._add_prefill_chunks(batch, budget)

    def _add_prefill_chunks(self, batch: list, budget: int) -> list:
        """Append one prefill chunk per prefilling request, oldest first, within `budget`."""
        for req in self.running:
            if budget <= 0:
                break
            if req.output:
                continue
            pending = req.prompt[req.num_cached:]
            n = min(len(pending), self.prefill_chunk_size, budget)
            batch.append((req, pending[:n]))
            budget -= n
        return batch

    def step(self) -> list:
        """One engine step. Returns [(request id, new token ids, finished)] for the requests that
        produced tokens (a prefill chunk that does not end the prompt produces none)."""
        self._admit()
        if self.spec is not None:
            return self.spec.step()
        batch = self._schedule()
        if not batch:
            return []
        logits = self._forward(batch)
        self.stats["steps"] += 1
        self.stats["tokens"] += sum(len(c) for _, c in batch)
        done = []   # (row, request) whose chunk reached the end of the known tokens
        for i, (req, chunk) in enumerate(batch):
            req.num_cached += len(chunk)
            if req.num_cached == len(req.tokens):
                done.append((i, req))
        events = []
        if done:
            if len(done) == len(batch):     # every row (a decode step): no row-index tensor
                chosen = logits
            else:
                rows = torch.tensor([i for i, _ in done], device=logits.device)
                chosen = logits.index_select(0, rows)
            reqs = [r for _, r in done]
            sampled = self.sampler.sample(chosen, [r.params for r in reqs], [r.slot for r in reqs],
                                          [r.prompt for r in reqs], [len(r.output) for r in reqs])
            now = time.perf_counter()
            for req, s in zip(reqs, sampled):
                if req.logprobs is not None:
                    req.logprobs.append(s.logprobs)
                events.append(self._emit(req, [s.token_id], now))
        return events

    # ------------------------------------------------------------------ one model call
    @staticmethod
    def _num_decodes(batch: list) -> int:
        """Decode entries lead the batch (requests with output); prefill chunks follow."""
        n = 0
        while n < len(batch) and batch[n][0].output:
            n += 1
        return n

    def _forward(self, batch: list) -> torch.Tensor:
        """The step's model call: metadata, input ids, the (replay) prefill choice; afterwards
        the persistent decode rows move on by one token (a device add)."""
        nd = self._num_decodes(batch)
        ids, positions, meta = self._inputs(batch, nd)
        floors = self.replay_floors(batch, nd)
        replay = None if floors is None else torch.tensor(floors, dtype=torch.int64, device=self.device)
        decode = floors is None and all(len(c) == 1 for _, c in batch)
        logits = self.call_model(ids, positions, meta, decode=decode, decoder_replay=replay)
        if self.decode_batch is not None and nd:
            self.decode_batch.advance()
        return logits

    def _inputs(self, batch: list, nd: int):
        """(input ids, positions, metadata) of a step whose first `nd` entries are decodes."""
        dec = self.decode_batch
        if dec is None:       # everything from host lists, every step
            return self._host_inputs(batch)
        dec.sync([r.request_id for r, _ in batch[:nd]], self._describe)
        if nd == len(batch):  # a decode step: the persistent rows as they are
            ids, positions, meta = self.decode_inputs([c[0] for _, c in batch])
            if self.decode_width_buckets:
                meta = dataclasses.replace(meta, block_table=meta.block_table[:, :self._decode_width(batch)])
            return ids, positions, meta
        pids, ppos, pmeta = self._host_inputs(batch[nd:])
        if nd == 0:
            return pids, ppos, pmeta
        dids, dpos, dmeta = self.decode_inputs([c[0] for _, c in batch[:nd]])
        return torch.cat([dids, pids]), torch.cat([dpos, ppos]), concat_metadata(dmeta, pmeta)

    def _decode_width(self, batch: list) -> int:
        """Blocks a decode step's tables need: its longest context after this token, rounded up
        to a power of two (>= 2, which keeps the width symbolic in the shared decode trace)."""
        need = max(math.ceil((r.num_cached + len(c)) / self.block_size) for r, c in batch)
        return min(self.max_blocks, max(2, 1 << max(0, need - 1).bit_length()))

    def _host_inputs(self, entries: list):
        """(input ids, positions, metadata) of (request, chunk) entries built from host lists."""
        return self.host_inputs([r.slot for r, _ in entries], [r.num_cached for r, _ in entries],
                                [c for _, c in entries], [r.blocks for r, _ in entries])

    def _describe(self, request_id: int):
        req = self.requests[request_id]
        return req.slot, req.num_cached, req.blocks

    def replay_floors(self, batch: list, nd: int) -> list | None:
        """Per-sequence decoder replay floors of a step (B positions; decode rows 0), or None
        for a plain (full) step. A prompt longer than the window replays its last
        `sliding_window` tokens; a step whose every token lies before its floor runs full (the
        decoder would have nothing to run; the decoder window rows it writes are never read:
        the replay window stops at the floor, and decoding reads only positions after it)."""
        if self.prefill_mode == "full" or nd == len(batch):
            return None
        w = self.config.sliding_window
        floors, kept = [], 0
        for i, (req, chunk) in enumerate(batch):
            f = 0 if i < nd else max(0, len(req.prompt) - w)
            end = req.num_cached + len(chunk)
            kept += end - min(max(req.num_cached, f), end)
            floors.append(f)
        if self.prefill_mode == "auto" and not any(floors):
            return None       # every prompt within the window: replay == full, run full
        if kept == 0:
            self.stats["replay_full_steps"] += 1
            return None
        self.stats["replay_steps"] += 1
        self.stats["replay_dropped_tokens"] += sum(len(c) for _, c in batch) - kept
        return floors

    def _emit(self, req: Request, toks: list, now: float | None = None) -> tuple:
        """Append newly committed tokens (stopping at a stop id, a stop string or max_tokens),
        finish the request if it is done, stream them. Returns the step() event."""
        new, reason = [], None
        for tok in toks:
            req.output.append(tok)
            new.append(tok)
            if tok in req.params.stop_ids:
                reason = "stop"
            elif req.text_stream is not None and req.text_stream.push(tok):
                reason = "stop"             # a stop string appeared in the text
            elif len(req.output) >= req.params.max_tokens:
                reason = "length"
            if reason is not None:
                break
        if req.first_token_time is None:
            req.first_token_time = now if now is not None else time.perf_counter()
        if reason is not None:
            self._finish(req, reason)
        finished = self._notify(req, new, reason is not None)
        return req.request_id, new, finished

    def _notify(self, req: Request, new: list, finished: bool) -> bool:
        """Stream new tokens to the request's callback. A callback that raises fails its own
        request only: it is finished with reason "error" (blocks and slot freed, the error kept
        in `error`), and the step goes on with every other request. Returns whether the request
        is finished now."""
        if req.callback is None:
            return finished
        try:
            req.callback(req.request_id, new, finished)
        except Exception as e:   # noqa: BLE001  (whatever the caller's code raises)
            req.error = f"callback raised {type(e).__name__}: {e}"
            if req.status != "finished":
                self._finish(req, "error")
            else:
                req.finish_reason = "error"
            return True
        return finished

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list:
        """Run these prompts (token ids, strings or chat message lists) to completion, together
        with whatever else is queued. Every request is validated before any is queued. Returns
        one RequestOutput per prompt (with `.text` when the engine has a tokenizer); with
        params.n > 1 each of the n samples runs as its own request (`SamplingParams.samples()`),
        gathered into that prompt's RequestOutput.outputs."""
        if isinstance(prompts, str) or is_chat(prompts):
            raise TypeError("generate takes a list of prompts; put a single string or chat "
                            "(a list of messages) in a list: generate([prompt])")
        params = params if params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        ids = [self.validate(p, sp) for p, sp in zip(prompts, plist)]
        groups = [[self.add_request(p, child) for child in sp.samples()] for p, sp in zip(ids, plist)]
        while any(self.requests[r].status != "finished" for g in groups for r in g):
            self.step()
        return [self._gather([self.release(r) for r in g]) for g in groups]

    @staticmethod
    def _gather(samples: list) -> RequestOutput:
        """One RequestOutput of a prompt's n sample outputs (the first one's id and fields)."""
        if len(samples) == 1:
            return samples[0]
        first = samples[0]
        times = [o.first_token_time for o in samples if o.first_token_time is not None]
        ends = [o.finish_time for o in samples if o.finish_time is not None]
        return dataclasses.replace(
            first, arrival_time=min(o.arrival_time for o in samples),
            first_token_time=min(times) if times else None, finish_time=max(ends) if ends else None,
            outputs=[dataclasses.replace(o.outputs[0], index=i) for i, o in enumerate(samples)])

    def stream(self, token_ids, params: SamplingParams | None = None) -> Iterator[list]:
        """Add a request and yield its new tokens as they are generated (drives step(); other
        queued requests progress too). Closing the iterator early aborts the request."""
        rid = self.add_request(token_ids, params)
        req = self.requests[rid]
        seen = 0
        try:
            while req.status != "finished":
                self.step()
                if len(req.output) > seen:
                    yield req.output[seen:]
                    seen = len(req.output)
        finally:
            if req.status != "finished":
                self.abort(rid)
            self.requests.pop(rid, None)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free


def _resolve_tokenizer(tokenizer, model) -> Tokenizer | None:
    """Engine's `tokenizer` argument as a Tokenizer or None (see Engine.__init__)."""
    if tokenizer is False:
        return None
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if tokenizer is None:
        folder = getattr(eager_model(model), "checkpoint_dir", None)
        return Tokenizer.from_pretrained(folder) if has_tokenizer(folder) else None
    return Tokenizer.from_pretrained(tokenizer)


__all__ = ["CompletionOutput", "Engine", "Request", "RequestError", "RequestOutput", "SamplingParams"]
