"""`v41graph serve CHECKPOINT`: an OpenAI-compatible HTTP server over one Engine.

    v41graph serve /tmp/v41_tiny --port 8000 --max-batch-size 8 --max-seq-len 256
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}'

Endpoints: POST /v1/completions and /v1/chat/completions (non-streaming JSON, or server-sent
events with `"stream": true`, ending with `data: [DONE]`), GET /v1/models, GET /health (the
engine's free / total cache blocks and slots, running and waiting requests, finish counts).
Concurrent requests share the Engine's continuous batching; the Engine runs on one background
thread (engine_loop.py). A client that disconnects aborts its request (blocks freed). Bad
requests get HTTP 400 (404 for an unknown model) with an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`: bad JSON, unknown fields, wrong types,
an empty prompt, max_tokens beyond the context, token ids outside the vocabulary.
Generation stops at the tokenizer's end-of-sequence token, at a `stop` string, or at max_tokens
(chat's default: the rest of the context).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams

from .engine_loop import EngineLoop, Submission
from .protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("v41graph.serving")

__all__ = ["build_app", "build_server", "compiled_for_serving", "decode_buckets", "serve_main"]

# How often a non-streaming handler looks whether its client is still there.
DISCONNECT_POLL_S = 0.1


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": kind, "param": param, "code": status}})


class _EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the stream ends: completed, client gone
    (Starlette cancels the stream) or an error, so an abandoned request is always aborted."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def build_app(engine: Engine, model_name: str) -> FastAPI:
    """The FastAPI app serving `engine` (which needs a tokenizer) under `model_name`. The engine
    thread starts and stops with the app's lifespan."""
    if engine.tokenizer is None:
        raise ValueError("serving needs a tokenizer: the checkpoint folder has no tokenizer.json "
                         "(scripts/make_random_checkpoint.py writes one)")
    loop_ = EngineLoop(engine)
    eos = engine.tokenizer.eos_token_id
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        loop_.start()
        try:
            yield
        finally:
            loop_.stop()

    app = FastAPI(title="v41graph", lifespan=lifespan)
    app.state.engine_loop = loop_

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        problems, params = [], []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            if err.get("type") == "json_invalid":   # loc: ("body", character position)
                problems.append(f"invalid JSON body at character {loc}: "
                                f"{err.get('ctx', {}).get('error', err.get('msg'))}")
                loc = None
            elif err.get("type") == "extra_forbidden":
                problems.append(f"{loc}: unknown field")
            else:
                problems.append(f"{loc or 'body'}: {err.get('msg')}")
            params.append(loc)
        return _error(400, "; ".join(problems) or "invalid request", next(filter(None, params), None))

    def _params(body, max_new: int | None, index: int = 0):
        """prompt length -> the SamplingParams of choice `index` (of body.n: seed + index)."""
        def make(prompt_len: int) -> SamplingParams:
            room = engine.max_seq_len - prompt_len + 1      # tokens the context has room for
            n = max_new if max_new is not None else room
            if n > room:
                raise ValueError(f"max_tokens {n} is more than the context has room for: prompt "
                                 f"{prompt_len} tokens, max_seq_len {engine.max_seq_len} (at most {room})")
            if n < 1:
                raise ValueError(f"the prompt ({prompt_len} tokens) fills the context "
                                 f"(max_seq_len {engine.max_seq_len})")
            stop_ids = (() if eos is None else (eos,)) + tuple(body.stop_token_ids or ())
            return SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=n,
                                  stop_token_ids=stop_ids, stop=body.stop_strings(), seed=body.seed,
                                  top_k=body.top_k, min_p=body.min_p,
                                  repetition_penalty=body.repetition_penalty,
                                  presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty, logprobs=body.num_logprobs(),
                                  n=body.n).samples()[index]
        return make

    def _check_model(body):
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here; this server serves "
                               f"{model_name!r} (GET /v1/models)", "model", "not_found_error")
        return None

    async def _start(prompt, body, max_new):
        """Submit the body's n choices (one engine request each: the Engine batches them like
        any others); returns ([submission] * n, prompt_tokens) or (None, an error response)."""
        subs = [Submission(prompt, _params(body, max_new, i), asyncio.get_running_loop())
                for i in range(body.n)]
        for sub in subs:
            loop_.submit(sub)
        firsts = [await sub.events.get() for sub in subs]
        for sub, event in zip(subs, firsts):
            if event[0] == "rejected":
                sub.finished = True
        rejected = [e for e in firsts if e[0] == "rejected"]
        if rejected:
            for sub in subs:
                _close(sub)
            status, message = rejected[0][1], rejected[0][2]
            kind = "invalid_request_error" if status < 500 else "server_error"
            return None, _error(status, message, kind=kind)
        return subs, firsts[0][1]

    def _close(sub: Submission):
        if not sub.finished:           # the client went away (or the handler failed): abort
            sub.finished = True
            loop_.abort(sub)

    async def _collect(request: Request, sub: Submission):
        """Text, finish reason, error, token count and [(token id, {id: logprob})] (with logprobs)
        of a finished request, or None if the client disconnected first (the request is then
        aborted)."""
        parts, scored, last_check = [], [], time.monotonic()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(sub.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    event = None
                if event is not None and event[0] == "text":
                    parts.append(event[1])
                    scored += _scored(event)
                elif event is not None and event[0] == "finished":
                    sub.finished = True
                    return "".join(parts), event[1], event[2], event[3], scored
                if time.monotonic() - last_check >= DISCONNECT_POLL_S:
                    last_check = time.monotonic()
                    if await request.is_disconnected():
                        return None
        finally:
            _close(sub)

    async def _events(sub: Submission):
        """(text delta, finish reason, error, completion tokens, scored tokens) until the request
        finishes."""
        while True:
            event = await sub.events.get()
            if event[0] == "text":
                yield event[1], None, None, None, _scored(event)
            elif event[0] == "finished":
                sub.finished = True
                yield "", event[1], event[2], event[3], []
                return

    def _scored(event) -> list:
        """[(token id, {id: logprob})] of a text event, empty without logprobs."""
        _, _, ids, logprobs = event
        return [] if logprobs is None else list(zip(ids, logprobs))

    def _token_text(token_id: int) -> str:
        return engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(scored: list, k: int | None, chat: bool, offset: int = 0):
        """OpenAI's logprobs object of these tokens (None when not asked for): chat's
        {"content": [{token, logprob, bytes, top_logprobs}]}, completions' {tokens,
        token_logprobs, top_logprobs, text_offset}. The engine's dicts hold the sampled token
        first, then the k most likely."""
        if k is None:
            return None
        entries = []
        for tok, lps in scored:
            top = sorted(lps.items(), key=lambda kv: -kv[1])[:k]
            entries.append((_token_text(tok), lps[tok], [(_token_text(t), v) for t, v in top]))
        if chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())}
                                                  for a, v in top]} for t, lp, top in entries]}
        offsets, at = [], offset
        for t, _, _ in entries:
            offsets.append(at)
            at += len(t)
        return {"tokens": [t for t, _, _ in entries], "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": [dict(top) for _, _, top in entries], "text_offset": offsets}

    def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _finish_reason(reason: str) -> str:
        return reason if reason in ("stop", "length") else "stop"

    async def _respond(request, body, prompt, max_new, chat: bool):
        bad = _check_model(body)
        if bad is not None:
            return bad
        subs, started = await _start(prompt, body, max_new)
        if subs is None:
            return started
        prompt_tokens = started
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())

        k = body.num_logprobs()

        def choice(index, text, reason, delta: bool, logprobs=None):
            if chat and delta:     # OpenAI's closing chunk has an empty delta
                return {"index": index, "delta": {"content": text} if text or reason is None else {},
                        "logprobs": logprobs, "finish_reason": reason}
            if chat:
                return {"index": index, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs, "finish_reason": reason}
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}

        if not body.stream:
            try:
                got = await asyncio.gather(*(_collect(request, sub) for sub in subs))
            finally:
                for sub in subs:
                    _close(sub)
            if any(g is None for g in got):
                return _error(499, "client disconnected")
            failed = [err for _, reason, err, _, _ in got if reason == "error"]
            if failed:
                return _error(500, f"generation failed: {failed[0]}", kind="server_error")
            return {"id": rid, "object": obj, "created": now, "model": model_name,
                    "choices": [choice(i, text, _finish_reason(reason), False, _logprobs(scored, k, chat))
                                for i, (text, reason, _, _, scored) in enumerate(got)],
                    "usage": _usage(prompt_tokens, sum(g[3] for g in got))}

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def merged():
            """(choice index, event tuple of _events) of all n choices, as they come."""
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, sub):
                async for item in _events(sub):
                    await queue.put((i, item))

            tasks = [asyncio.create_task(pump(i, sub)) for i, sub in enumerate(subs)]
            try:
                for _ in range(len(subs)):     # each choice ends with one event carrying its reason
                    while True:
                        i, item = await queue.get()
                        yield i, item
                        if item[1] is not None:
                            break
            finally:
                for t in tasks:
                    t.cancel()

        async def stream():
            head = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": now,
                    "model": model_name}
            if chat:   # OpenAI's first chunk of each choice carries the role
                for i in range(len(subs)):
                    yield _sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
            offsets, completion_tokens = [0] * len(subs), 0
            async for i, (text, reason, err, n, scored) in merged():
                if reason == "error":
                    yield _sse({"error": {"message": f"generation failed: {err}", "type": "server_error",
                                          "param": None, "code": 500}})
                    break
                if text or reason is not None or scored:
                    lp = _logprobs(scored, k, chat, offsets[i]) if scored else None
                    if lp is not None and not chat:       # completions' text_offset runs on
                        offsets[i] += sum(len(t) for t in lp["tokens"])
                    yield _sse({**head, "choices": [choice(i, text, None if reason is None else
                                                           _finish_reason(reason), True, lp)]})
                completion_tokens += n or 0
            else:
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"

        def close_all():
            for sub in subs:
                _close(sub)

        return _EngineStreamingResponse(stream(), on_close=close_all, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await _respond(request, body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return await _respond(request, body, messages, body.max_new_tokens(), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "v41graph", "max_model_len": engine.max_seq_len}]}

    @app.get("/health")
    async def health():
        snap = loop_.snapshot()
        status = "ok" if loop_.error is None else "degraded"
        return {"status": status, "model": model_name, "error": loop_.error, **snap}

    return app


# ------------------------------------------------------------------------------------ command line
def decode_buckets(max_batch_size: int) -> tuple:
    """Powers of two up to the first that holds max_batch_size sequences."""
    buckets = [1]
    while buckets[-1] < max_batch_size:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def compiled_for_serving(model, max_batch_size: int, compile_prefill: bool = False, compile_cache=None):
    """The model through v41graph.compile for `serve --compile`: decode buckets up to the batch
    size, one shared trace for all of them; prefill eager unless asked (its shapes vary);
    `compile_cache` a directory (None: $V41GRAPH_COMPILE_CACHE, if set)."""
    import v41graph
    return v41graph.compile(model, batch_sizes=decode_buckets(max_batch_size), share_decode_graph="all",
                            compile_prefill=compile_prefill, compile_cache=compile_cache)


def build_server(args, model=None):
    """(uvicorn.Server, app) for parsed `serve` arguments (options.add_serve_arguments): the
    checkpoint loaded (or `model`, already loaded: rank 0's share under --parallel), its Engine
    and app built; `server.run()` serves until stopped."""
    import uvicorn

    from v41graph.weights.load import from_pretrained

    if model is None:
        model = from_pretrained(args.checkpoint, numerics=args.numerics, device=args.device)
    for flag in ("compile_prefill", "compile_cache"):
        if getattr(args, flag, None) and not args.compile:
            raise ValueError(f"--{flag.replace('_', '-')} only applies with --compile")
    t0 = time.perf_counter()
    runner = (compiled_for_serving(model, args.max_batch_size, args.compile_prefill, getattr(args, "compile_cache", None))
              if args.compile else model)
    engine = Engine(runner, args.max_batch_size, args.max_seq_len, block_size=args.block_size,
                    num_blocks=args.num_blocks)
    if args.compile:     # compile (and capture) every decode bucket before the first request
        if engine.spmd is not None:     # rank 0 of --parallel: every rank warms up together
            engine.spmd.warmup(engine.max_blocks)
        else:
            runner.warmup(engine.caches, engine.max_blocks)
        cache = getattr(runner, "compile_cache", None)
        log.info("decode buckets %s compiled and captured in %.1f s%s", runner.batch_sizes,
                 time.perf_counter() - t0, f" (compile cache {cache.root}: {dict(runner.timings)})" if cache else "")
    name = args.served_model_name or Path(args.checkpoint).resolve().name
    app = build_app(engine, name)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config), app


def serve_main(args) -> int:
    if getattr(args, "parallel", None):       # one rank of a torchrun job (v41graph.parallel.spmd)
        from v41graph.parallel.spmd import serve
        return serve(args)
    server, _ = build_server(args)
    try:
        server.run()
    except KeyboardInterrupt:   # uvicorn shuts down on Ctrl-C, then raises it again
        pass
    return 0
