"""`v41graph serve` (v41graph/serving) on loopback with the tiny random checkpoint and a real HTTP
client: OpenAI schema, streaming, concurrency through the Engine's batching, 4xx validation,
disconnect = abort, every cache block free afterwards.

The server runs in a thread of this process (uvicorn, bound to 127.0.0.1 on a free port, built
from the `v41graph serve` command line by the same code the command runs) and is stopped by the
fixture; one test also starts the real command in a subprocess. Expected texts come from an
Engine in this process over the same checkpoint, each prompt run alone, decoded by transformers'
tokenizer (greedy tokens are the same alone and batched, tests/test_engine.py)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import v41graph
from v41graph.runtime.engine import Engine
from v41graph.runtime.sampling import SamplingParams

for _mod in ("fastapi", "uvicorn", "httpx", "transformers"):
    pytest.importorskip(_mod, reason="the server tests need the [serve] packages")
import httpx  # noqa: E402
from processes import free_port, wait_until_healthy  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_SEQ = 96
NAME = "tiny-test"
LONG = 70                     # max_tokens of the requests the client abandons (fits the context)


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    from transformers import AutoTokenizer, PretrainedConfig
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint), config=PretrainedConfig())


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from v41graph.serving.server import build_server
    from v41graph.tools.cli import _parser

    args = _parser().parse_args(["serve", str(tiny_checkpoint), "--port", "0", "--max-batch-size", "6",
                                 "--max-seq-len", str(MAX_SEQ), "--served-model-name", NAME,
                                 "--log-level", "warning"])
    srv, app = build_server(args)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    srv.should_exit = True
    thread.join(30)
    sock.close()
    assert not thread.is_alive(), "server did not stop"


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, hf):
    """Greedy ids of a prompt (token ids) run alone, stopping at EOS like the server."""
    model = v41graph.from_pretrained(tiny_checkpoint)
    eng = Engine(model, 1, MAX_SEQ, block_size=16, tokenizer=False)
    cache = {}

    def run(prompt_ids, max_tokens, stop=()):
        key = (tuple(prompt_ids), max_tokens)
        if key not in cache:
            cache[key] = eng.generate([prompt_ids], SamplingParams(
                max_tokens=max_tokens, stop_ids=[hf.eos_token_id]))[0].token_ids
        return cache[key]
    return run


def _chat_ids(hf, messages):
    return hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)


def _health(base):
    return httpx.get(f"{base}/health", timeout=10).json()


def _wait_idle(base, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        h = _health(base)
        if h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, f"engine still busy: {h}"
        time.sleep(0.1)


def _check_completion(body, chat: bool, max_tokens: int, prompt_tokens: int):
    """The OpenAI response schema (the fields clients read), with counted usage."""
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-") and isinstance(body["created"], int)
    assert body["model"] == NAME and len(body["choices"]) == 1
    c = body["choices"][0]
    assert c["index"] == 0 and c["finish_reason"] in ("stop", "length")
    text = c["message"]["content"] if chat else c["text"]
    if chat:
        assert c["message"]["role"] == "assistant"
    assert isinstance(text, str)
    u = body["usage"]
    assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= max_tokens
    assert (c["finish_reason"] == "length") == (u["completion_tokens"] == max_tokens)
    return text, u["completion_tokens"]


def _sse_events(lines):
    """The JSON objects of an SSE body, checking it ends with [DONE]."""
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _check_stream(events, chat: bool):
    """Chunk schema; returns (text, finish reason, usage chunk or None)."""
    assert len({e["id"] for e in events}) == 1 and all(e["model"] == NAME for e in events)
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert all(e["object"] == obj for e in events)
    usage = [e for e in events if not e["choices"]]
    body = [e for e in events if e["choices"]]
    reasons = [e["choices"][0]["finish_reason"] for e in body]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    if chat:
        assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in body)
    else:
        text = "".join(e["choices"][0]["text"] for e in body)
    return text, reasons[-1], (usage[0]["usage"] if usage else None)


# ================================================================================ the 20 requests
def test_twenty_concurrent_chat_requests(server, hf, reference):
    base, _ = server
    url = f"{base}/v1/chat/completions"
    words = ["Hi", "Hello there", "What is 1 + 2?", "café 😀", "The quick brown fox", "Tell me a story",
             "abc", "Paris or Berlin?", "def add(a, b):", "über alles", "x"]
    plain = [{"messages": [{"role": "user", "content": w}], "max_tokens": 3 + i % 4, "temperature": 0}
             for i, w in enumerate(words)]                                            # 11 greedy
    plain[3]["messages"].insert(0, {"role": "system", "content": "Be brief."})
    sampled = {"messages": [{"role": "user", "content": "Roll the dice"}], "max_tokens": 5,
               "temperature": 0.8, "top_p": 0.9, "seed": 7}
    streaming = [{"messages": [{"role": "user", "content": w}], "max_tokens": 6, "temperature": 0,
                  "stream": True} for w in ("Stream me", "One more", "naïve €5")]       # 3 greedy
    streaming[0]["stream_options"] = {"include_usage": True}
    abandoned = {"messages": [{"role": "user", "content": "Go on forever"}], "max_tokens": LONG,
                 "temperature": 0}
    invalid = [(b'{"messages": [{"role": "user", "content": "Hi"}', "invalid JSON"),
               (json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "frequency_of_cats": 1}).encode(), "frequency_of_cats: unknown field"),
               (json.dumps({"messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": MAX_SEQ}).encode(), "more than the context has room for")]

    async def post(client, body):
        r = await client.post(url, json=body)
        return r.status_code, r.json()

    async def stream(client, body):
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            return [ln async for ln in r.aiter_lines()]

    async def abandon_stream(client, body):
        """Read the first content chunk, then hang up."""
        async with client.stream("POST", url, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for ln in r.aiter_lines():
                if '"content": "' in ln and '"content": ""' not in ln:
                    return ln
        raise AssertionError("the stream ended before the client hung up")

    async def abandon_plain(client, body):
        """A non-streaming request whose client gives up after a second."""
        try:
            await client.post(url, json=body, timeout=httpx.Timeout(1.0))
        except httpx.TimeoutException:
            return "gave up"
        raise AssertionError(f"a {LONG}-token request finished within a second")

    async def bad(client, raw):
        r = await client.post(url, content=raw, headers={"content-type": "application/json"})
        return r.status_code, r.json()

    async def main():
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            return await asyncio.gather(
                *[post(client, b) for b in plain], post(client, sampled),
                *[stream(client, b) for b in streaming],
                abandon_stream(client, abandoned), abandon_plain(client, abandoned),
                *[bad(client, raw) for raw, _ in invalid])

    before = _health(base)
    results = asyncio.run(main())
    n_plain, n_stream = len(plain) + 1, len(streaming)
    assert len(results) == 20 == n_plain + n_stream + 2 + len(invalid)
    for body, (status, resp) in zip(plain + [sampled], results[:n_plain]):
        assert status == 200, resp
        prompt = _chat_ids(hf, body["messages"])
        text, n = _check_completion(resp, True, body["max_tokens"], len(prompt))
        if body["temperature"] == 0:
            want = reference(prompt, body["max_tokens"])
            assert n == len(want) and text == hf.decode(want, skip_special_tokens=True), body
    for body, lines in zip(streaming, results[n_plain:n_plain + n_stream]):
        text, reason, usage = _check_stream(_sse_events(lines), chat=True)
        prompt = _chat_ids(hf, body["messages"])
        want = reference(prompt, body["max_tokens"])
        assert text == hf.decode(want, skip_special_tokens=True)
        assert reason == ("length" if len(want) == body["max_tokens"] else "stop")
        if "stream_options" in body:
            assert usage == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                             "total_tokens": len(prompt) + len(want)}
        else:
            assert usage is None
    assert results[n_plain + n_stream + 1] == "gave up"
    for (raw, words_), (status, resp) in zip(invalid, results[-len(invalid):]):
        assert status == 400 and resp["error"]["type"] == "invalid_request_error"
        assert words_ in resp["error"]["message"], resp
    # the two abandoned requests were aborted; nothing holds a block or a slot
    after = _wait_idle(base)
    finished = {k: after["finished"].get(k, 0) - before["finished"].get(k, 0) for k in after["finished"]}
    assert finished.get("abort", 0) == 2, finished
    assert sum(finished.values()) == n_plain + n_stream + 2
    assert after["free_blocks"] == after["total_blocks"] and after["free_slots"] == after["total_slots"]
    assert after["status"] == "ok" and after["error"] is None


# ================================================================================ completions, stop strings
def test_completions_greedy_stop_strings_and_models(server, hf, reference):
    base, _ = server
    prompt = "The quick brown fox"
    ids = hf(prompt)["input_ids"]
    want = reference(ids, 8)
    full = hf.decode(want, skip_special_tokens=True)
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0},
                   timeout=120)
    text, _ = _check_completion(r.json(), False, 8, len(ids))
    assert text == full
    # token ids as the prompt give the same
    r = httpx.post(f"{base}/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.json()["choices"][0]["text"] == full
    # a stop string cuts the text just before it, streaming or not
    i = next(j for j in range(len(full) // 2, len(full) - 2) if full.find(full[j:j + 2]) == j
             and "\ufffd" not in full[j:j + 2])
    stop = full[i:i + 2]
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": stop, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                text, reason, _ = _check_stream(_sse_events(list(r.iter_lines())), chat=False)
        else:
            c = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]
            text, reason = c["text"], c["finish_reason"]
        assert text == full[:i] and reason == "stop", (stream, stop)
    # the sampling fields reach the engine: top_k=1 samples the argmax at any temperature, and a
    # stop token id ends the output right after it (its text left out, as vLLM does by default)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 1.5, "top_k": 1, "seed": 3,
            "presence_penalty": 0.0, "min_p": 0.0}
    assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == full
    j = want.index(want[3])
    c = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                   "stop_token_ids": [want[3]]}, timeout=120).json()
    assert c["usage"]["completion_tokens"] == j + 1 and c["choices"][0]["finish_reason"] == "stop"
    assert c["choices"][0]["text"] == hf.decode(want[:j], skip_special_tokens=True)
    models = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    assert models["data"][0]["object"] == "model"


def test_logprobs_in_completions_and_chat_streams(server, hf, reference, tiny_checkpoint):
    """logprobs reach the client in OpenAI's two layouts: the engine's values (an engine alone,
    same prompt, greedy), the top alternatives sorted, at most the number asked for, and for
    greedy tokens the sampled one on top."""
    base, _ = server
    prompt = "Hello, how are"
    ids = hf(prompt)["input_ids"]
    eng = Engine(v41graph.from_pretrained(tiny_checkpoint), 1, MAX_SEQ, block_size=16, tokenizer=False)
    out = eng.generate([ids], SamplingParams(max_tokens=5, stop_ids=[hf.eos_token_id], logprobs=2))[0]
    assert out.token_ids == reference(ids, 5)
    token_text = [hf.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False)
                  for t in out.token_ids]
    r = httpx.post(f"{base}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == token_text
    assert lp["token_logprobs"] == pytest.approx([d[t] for t, d in zip(out.token_ids, out.logprobs)], abs=1e-6)
    assert lp["text_offset"] == [sum(len(t) for t in token_text[:i]) for i in range(len(token_text))]
    for t, d, top in zip(out.token_ids, out.logprobs, lp["top_logprobs"]):
        assert len(top) == 2 and list(top.values()) == sorted(top.values(), reverse=True)
        assert max(top.values()) == pytest.approx(d[t], abs=1e-6)
    assert httpx.post(f"{base}/v1/completions", timeout=120, json={"prompt": prompt, "max_tokens": 2}
                      ).json()["choices"][0]["logprobs"] is None
    # chat, streaming: each chunk carries its new tokens' entries
    msgs = [{"role": "user", "content": "Hi there"}]
    want = reference(_chat_ids(hf, msgs), 4)
    body = {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as resp:
        events = _sse_events(list(resp.iter_lines()))
    content = [c for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in content] == [
        hf.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in want]
    for c in content:
        assert c["bytes"] == list(c["token"].encode()) and len(c["top_logprobs"]) == 1
        assert c["top_logprobs"][0]["logprob"] == c["logprob"] <= 0
    assert _wait_idle(base)["free_blocks"] == _health(base)["total_blocks"]


def test_n_choices_streaming_and_not(server, hf, tiny_checkpoint):
    """n choices: one engine request each with seed + index (what Engine.generate does with
    SamplingParams.n), so a seeded request's choices are an engine's samples of the prompt alone;
    streamed, each choice's chunks carry its index and add up to the same texts."""
    base, _ = server
    prompt = "Once upon a time"
    ids = hf(prompt)["input_ids"]
    eng = Engine(v41graph.from_pretrained(tiny_checkpoint), 3, MAX_SEQ, block_size=16, tokenizer=False)
    alone = eng.generate([ids], SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=6,
                                               stop_ids=[hf.eos_token_id]))[0].outputs
    want = [hf.decode(o.token_ids, skip_special_tokens=True) for o in alone]
    assert len(set(want)) > 1                     # the seeds differ: the choices do too
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    assert [c["text"] for c in r["choices"]] == want
    assert r["usage"]["completion_tokens"] == sum(len(o.token_ids) for o in alone)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as resp:
        events = _sse_events(list(resp.iter_lines()))
    texts, reasons = ["", "", ""], [None] * 3
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] += c["text"]
            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    assert texts == want and all(reasons)
    assert [e["usage"]["completion_tokens"] for e in events if not e["choices"]] == [r["usage"]["completion_tokens"]]
    assert _wait_idle(base)["free_blocks"] == _health(base)["total_blocks"]


def test_request_validation(server):
    base, _ = server
    chat = f"{base}/v1/chat/completions"
    hi = [{"role": "user", "content": "Hi"}]
    cases = [
        (f"{base}/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "empty prompt"),
        (f"{base}/v1/completions", {"prompt": [], "max_tokens": 3}, 400, "empty prompt"),
        (f"{base}/v1/completions", {"prompt": [1, 999]}, 400, "outside the vocabulary"),
        (f"{base}/v1/completions", {"max_tokens": 3}, 400, "prompt: Field required"),
        (chat, {"messages": []}, 400, "messages"),
        (chat, {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
        (chat, {"messages": hi, "max_tokens": "5"}, 400, "max_tokens"),
        (chat, {"messages": hi, "max_tokens": 0}, 400, "max_tokens"),
        (chat, {"messages": hi, "temperature": -1}, 400, "temperature"),
        (chat, {"messages": hi, "n": 17}, 400, "n"),
        (chat, {"messages": hi, "n": 0}, 400, "n"),
        (chat, {"messages": hi, "presence_penalty": 3}, 400, "presence_penalty"),
        (chat, {"messages": hi, "top_k": -2}, 400, "top_k"),
        (chat, {"messages": hi, "repetition_penalty": 0}, 400, "repetition_penalty"),
        (chat, {"messages": hi, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
        (f"{base}/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
        (chat, {"messages": hi, "stop": [""]}, 400, "non-empty strings"),
        (chat, {"messages": hi, "model": "gpt-4"}, 404, "'gpt-4' is not served"),
    ]
    for url, body, status, words in cases:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert words in err["message"], (body, err)
    assert _wait_idle(base)["free_blocks"] == _health(base)["total_blocks"]


def test_openai_client(server, hf, reference):
    openai = pytest.importorskip("openai")
    base, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120, max_retries=0)
    messages = [{"role": "user", "content": "Hello there"}]
    want = hf.decode(reference(_chat_ids(hf, messages), 5), skip_special_tokens=True)
    resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    assert resp.choices[0].message.content == want and resp.usage.completion_tokens <= 5
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    with pytest.raises(openai.BadRequestError, match="unknown field"):
        client.chat.completions.create(model=NAME, messages=messages, max_tokens=5,
                                       extra_body={"bogus": 1})
    assert [m.id for m in client.models.list()] == [NAME]


def test_a_failed_step_fails_the_running_requests_and_serving_goes_on(server):
    base, app = server
    loop_, url = app.state.engine_loop, f"{base}/v1/chat/completions"
    eng = loop_.engine
    real_step, failures = eng.step, []

    def step_that_fails_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("injected step failure")
        return real_step()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    eng.step = step_that_fails_once        # read by the engine thread at its next step
    try:
        r = httpx.post(url, json=body, timeout=120)
        assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
        h = _wait_idle(base)
        assert h["status"] == "degraded" and "injected step failure" in h["error"]
        assert h["free_blocks"] == h["total_blocks"] and h["free_slots"] == h["total_slots"]
        r = httpx.post(url, json=body, timeout=120)       # the next request is served
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    finally:
        del eng.step
        loop_.error = None


def test_engine_loop_refuses_what_the_pool_can_never_hold(tiny_model):
    """Without HTTP: a request needing more blocks than the whole pool is refused (400), and the
    engine thread goes on serving."""
    from v41graph.serving.engine_loop import EngineLoop, Submission

    loop_ = EngineLoop(Engine(tiny_model, 2, 64, block_size=16, num_blocks=2, tokenizer=False))
    loop_.start()

    async def submit(ids, max_tokens):
        sub = Submission(ids, lambda n: SamplingParams(max_tokens=max_tokens), asyncio.get_running_loop())
        loop_.submit(sub)
        events = [await asyncio.wait_for(sub.events.get(), 60)]
        while events[-1][0] not in ("rejected", "finished"):
            events.append(await asyncio.wait_for(sub.events.get(), 60))
        return events
    try:
        too_big = asyncio.run(submit([1, 2, 3], 40))
        fits = asyncio.run(submit([1, 2, 3], 2))
    finally:
        loop_.stop()
    assert too_big == [("rejected", 400, "request needs 3 cache blocks but the pool has only 2")]
    assert fits[0] == ("accepted", 3) and fits[-1] == ("finished", "length", None, 2)
    assert loop_.snapshot()["free_blocks"] == 2


# ================================================================================ the command itself
def test_serve_command_starts_and_stops(tiny_checkpoint):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "v41graph.tools.cli", "serve", str(tiny_checkpoint),
                             "--port", str(port), "--max-seq-len", "64", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        h = wait_until_healthy(port, [proc], "v41graph serve")
        assert h["status"] == "ok" and h["free_blocks"] == h["total_blocks"] > 0
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_serve_compile_option_compiles_every_bucket_before_serving(tiny_checkpoint, monkeypatch):
    """`serve --compile`: the model goes through v41graph.compile with decode buckets up to the
    batch size (one shared trace) and every bucket is warmed up before the app exists; the
    Engine runs the compiled model. (The compile itself is stood in for: tracing costs minutes
    on CPU; tests/test_engine.py runs an Engine over a real compiled model.)"""
    from v41graph.compiler.compiled_model import CompiledModel
    from v41graph.serving.server import build_server, decode_buckets
    from v41graph.tools.cli import _parser

    assert decode_buckets(1) == (1,) and decode_buckets(6) == (1, 2, 4, 8) and decode_buckets(8) == (1, 2, 4, 8)
    seen = {}

    class FakeCompiled(CompiledModel):      # a CompiledModel to the Engine, running the eager model
        capture = False

        def __init__(self, model, **kw):        # not super().__init__: that would trace
            self.model, self.batch_sizes = model, kw["batch_sizes"]
            seen["compile"] = kw

        def warmup(self, caches, max_blocks):
            seen["warmup"] = (caches, max_blocks)

        def __call__(self, *args, **kw):
            return self.model(*args, **kw)

        def decode(self, *args):
            return self.model.decode(*args)

    monkeypatch.setattr(v41graph, "compile", FakeCompiled)
    args = _parser().parse_args(["serve", str(tiny_checkpoint), "--max-batch-size", "6", "--max-seq-len",
                                 str(MAX_SEQ), "--compile"])
    srv, app = build_server(args)
    engine = app.state.engine_loop.engine
    assert isinstance(engine.model, FakeCompiled)
    assert seen["compile"] == {"batch_sizes": (1, 2, 4, 8), "share_decode_graph": "all", "compile_prefill": False,
                               "compile_cache": None}
    assert seen["warmup"] == (engine.caches, engine.max_blocks)
    build_server(_parser().parse_args(["serve", str(tiny_checkpoint), "--compile", "--compile-cache", "/tmp/cc"]))
    assert seen["compile"]["compile_cache"] == "/tmp/cc"
    for flag in (["--compile-prefill"], ["--compile-cache", "/tmp/cc"]):
        with pytest.raises(ValueError, match=f"{flag[0]} only applies with --compile"):
            build_server(_parser().parse_args(["serve", str(tiny_checkpoint), *flag]))
