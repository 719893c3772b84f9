"""The OpenAI-compatible server over real HTTP (uvicorn on a free port), with the official
openai client for the happy paths and httpx for malformed input."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from lockserve.cluster.engine_client import WorkerUnavailable
from lockserve.cluster.runner import BackgroundServer
from lockserve.cluster.server import TOKENIZE_INLINE_CHARS, build_app
from lockserve.configs import ServerConfig

from tests.cluster.echo_engine import EchoEngine, chat_prompt, echo_reply, start_server

LIMITS = dict(
    port=0, log_level="warning", max_body_bytes=64 * 1024, max_tokens_limit=1000, default_max_tokens=40
)


@pytest.fixture(scope="module")
def engine():
    return EchoEngine(capacity=2000)


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(**LIMITS)
    with BackgroundServer(build_app(engine, config), config) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def sse_events(lines) -> list:
    """Decoded `data:` payloads of an SSE body; "[DONE]" stays a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ----- happy paths with the official client ---------------------------------------------


def test_completion_text_prompt(client):
    prompt = "Hello, LOCKS world"
    out = client.completions.create(model="echo-test", prompt=prompt, max_tokens=50)
    expected, finish = echo_reply(prompt, 50)
    assert out.choices[0].text == expected == "DLROW skcol ,OLLEh"
    assert out.choices[0].finish_reason == finish == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), len(expected))
    assert out.usage.total_tokens == len(prompt) + len(expected)
    assert out.model == "echo-test" and out.id.startswith("cmpl-")


def test_completion_is_cut_at_max_tokens(client):
    out = client.completions.create(model="echo-test", prompt="abcdefghij", max_tokens=4)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("JIHG", "length")
    assert out.usage.completion_tokens == 4


def test_completion_default_max_tokens_from_config(client):
    prompt = "x" * 100
    out = client.completions.create(model="echo-test", prompt=prompt)
    assert len(out.choices[0].text) == LIMITS["default_max_tokens"]
    assert out.choices[0].finish_reason == "length"


def test_escaped_surrogate_pair_is_one_character(http):
    r = http.post("/v1/completions", content=b'{"prompt": "a\\ud83d\\ude00", "max_tokens": 5}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "\U0001f600A", r.text


def test_completion_token_id_prompt(client, engine):
    ids = [ord(c) for c in "token ids"]
    out = client.completions.create(model="echo-test", prompt=ids, max_tokens=20)
    assert out.choices[0].text == echo_reply("token ids", 20)[0]
    assert engine.seen[out.id].prompt_ids == ids


def test_completion_stop_string(client, engine):
    out = client.completions.create(model="echo-test", prompt="one two three", max_tokens=20, stop=["OW"])
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("EERHT ", "stop")
    assert engine.seen[out.id].params.stop == ["OW"]


def test_sampling_fields_reach_the_engine(client, engine):
    out = client.completions.create(
        model="echo-test", prompt="abc", max_tokens=3, temperature=0.0, top_p=0.5, seed=7,
        extra_body={"top_k": 5, "stop_token_ids": [2]},
    )  # fmt: skip
    params = engine.seen[out.id].params
    assert (params.temperature, params.top_p, params.seed, params.top_k) == (0.0, 0.5, 7, 5)
    assert params.stop_token_ids == [2] and params.max_tokens == 3


def test_completion_stream_with_usage(client):
    prompt = "streaming works"
    chunks = list(
        client.completions.create(
            model="echo-test",
            prompt=prompt,
            max_tokens=50,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == echo_reply(prompt, 50)[0]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and all(f is None for f in finishes[:-1])
    assert len(finishes) == len(prompt), "one chunk per token"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(prompt)


def test_chat_completion(client, engine):
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model="echo-test", messages=messages, max_tokens=200)
    expected, finish = echo_reply(chat_prompt(messages), 200)
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == finish
    assert out.usage.prompt_tokens == len(chat_prompt(messages))
    assert engine.seen[out.id].prompt_ids == [ord(c) for c in chat_prompt(messages)]


def test_chat_max_completion_tokens_and_content_parts(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    out = client.chat.completions.create(model="echo-test", messages=messages, max_completion_tokens=5)
    prompt = chat_prompt([{"role": "user", "content": "abcd"}])
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (
        echo_reply(prompt, 5)[0],
        "length",
    )


def test_chat_stream_with_usage(client):
    messages = [{"role": "user", "content": "stream me"}]
    chunks = list(
        client.chat.completions.create(
            model="echo-test",
            messages=messages,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == echo_reply(chat_prompt(messages), 8)[0]
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_stream_without_usage_has_no_usage_chunk(http):
    body = {"model": "echo-test", "prompt": "abc", "max_tokens": 5, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert all(e["choices"] and e["usage"] is None for e in events[:-1])


def test_sse_lines_survive_unicode_line_separators(http):
    # U+2028, U+2029 and U+0085 are line breaks to str.splitlines() (httpx's iter_lines): escaped.
    prompt = "a\u2028b\u2029c\x85d"
    body = {"prompt": prompt, "max_tokens": 20, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == echo_reply(prompt, 20)[0]


def test_long_prompt_is_tokenized_off_the_event_loop():
    # Beyond TOKENIZE_INLINE_CHARS the prompt is tokenised in a worker thread; same answer.
    prompt = "".join(chr(ord("a") + i % 26) for i in range(TOKENIZE_INLINE_CHARS + 123))
    engine = EchoEngine(capacity=10**6)
    with start_server(engine, max_body_bytes=1 << 20) as running:
        short = httpx.post(
            running.url + "/v1/completions", json={"prompt": "short", "max_tokens": 3}, timeout=30
        )
        r = httpx.post(running.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 30}, timeout=30)
    assert short.status_code == 200
    assert engine.tokenize_threads[0] == "lockserve-http", "a short prompt is tokenised on the event loop"
    assert engine.tokenize_threads[1] != "lockserve-http", "a long prompt must not block the event loop"
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == echo_reply(prompt, 30)[0]
    assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_eight_concurrent_streams_each_get_their_own_answer(server):
    prompts = [f"client {i}: " + "abcdefghij"[: i + 2] * (i + 1) for i in range(8)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model="echo-test", prompt=prompt, max_tokens=500, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == [echo_reply(p, 500)[0] for p in prompts]


def test_models(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["echo-test"]
    assert client.models.retrieve("echo-test").id == "echo-test"
    missing = http.get("/v1/models/other-model")
    assert missing.status_code == 404 and "'other-model'" in missing.json()["error"]["message"]


def test_health(http):
    assert http.get("/health").json() == {"status": "ok", "model": "echo-test", "ready": 1, "total": 1}


# ----- LOCKS extras -------------------------------------------------------------------------


def test_lockserve_extras_reach_the_engine(client, engine):
    out = client.completions.create(
        model="echo-test", prompt="abc", max_tokens=2,
        extra_body={"lockserve": {"budget_tokens": 1000, "tier": "hbm", "attention": "dense"}},
    )  # fmt: skip
    options = engine.seen[out.id].options
    assert (options.budget_tokens, options.tier, options.attention) == (1000, "hbm", "dense")


def test_top_level_budget_tokens(client, engine):
    out = client.chat.completions.create(
        model="echo-test", messages=[{"role": "user", "content": "x"}], max_tokens=1,
        extra_body={"budget_tokens": 256},
    )  # fmt: skip
    assert engine.seen[out.id].options.budget_tokens == 256
    assert engine.seen[out.id].options.tier is None and engine.seen[out.id].options.attention is None


# ----- bad input: right status, a message naming the problem, and the server keeps serving ----------

C = "/v1/completions"
CHAT = "/v1/chat/completions"
OK = {"model": "echo-test", "prompt": "ok", "max_tokens": 3}
MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (id, path, body (dict or raw bytes), status, param, substrings of the message)
    ("malformed-json", C, b'{"prompt": "x",', 400, None, ["malformed JSON"]),
    ("not-utf8", C, b"\xff\xfe{", 400, None, ["malformed JSON"]),
    ("json-array", C, b"[1, 2]", 400, None, ["JSON object", "list"]),
    ("lone-surrogate", C, b'{"prompt": "a\\ud800b"}', 400, None, ["lone UTF-16 surrogate (\\ud800)"]),
    ("missing-prompt", C, {"model": "echo-test"}, 400, "prompt", ["prompt", "required"]),
    ("max-tokens-string", C, {**OK, "max_tokens": "ten"}, 400, "max_tokens", ["max_tokens", "'ten'"]),
    ("max-tokens-bool", C, {**OK, "max_tokens": True}, 400, "max_tokens", ["max_tokens", "True"]),
    ("temperature-string", C, {**OK, "temperature": "hot"}, 400, "temperature", ["temperature", "'hot'"]),
    ("stream-string", C, {**OK, "stream": "yes"}, 400, "stream", ["stream", "'yes'"]),
    (
        "prompt-int",
        C,
        {**OK, "prompt": 5},
        400,
        "prompt",
        ["prompt must be a string or a list of token ids", "5"],
    ),
    ("prompt-floats", C, {**OK, "prompt": [1.5]}, 400, "prompt", ["prompt must be", "[1.5]"]),
    ("prompt-empty", C, {**OK, "prompt": ""}, 400, "prompt", ["prompt must not be empty"]),
    ("prompt-negative-id", C, {**OK, "prompt": [5, -1]}, 400, "prompt", ["-1 at index 1"]),
    ("prompt-batch", C, {**OK, "prompt": ["a", "b"]}, 400, "prompt", ["batches of 2 prompts"]),
    ("unknown-model", C, {**OK, "model": "gpt-9"}, 404, "model", ["'gpt-9' does not exist", "'echo-test'"]),
    ("max-tokens-negative", C, {**OK, "max_tokens": -5}, 400, "max_tokens", ["max_tokens (-5) must be >= 1"]),
    ("max-tokens-zero", C, {**OK, "max_tokens": 0}, 400, "max_tokens", ["max_tokens (0) must be >= 1"]),
    (
        "max-tokens-huge",
        C,
        {**OK, "max_tokens": 10**12},
        400,
        "max_tokens",
        ["max_tokens (1000000000000)", "1000"],
    ),
    (
        "temperature-negative",
        C,
        {**OK, "temperature": -1},
        400,
        "temperature",
        ["temperature (-1.0) must be >= 0"],
    ),
    ("top-p-zero", C, {**OK, "top_p": 0}, 400, "top_p", ["top_p (0.0) must be in (0, 1]"]),
    ("top-k-negative", C, {**OK, "top_k": -2}, 400, "top_k", ["top_k (-2) must be >= 0"]),
    ("seed-negative", C, {**OK, "seed": -1}, 400, "seed", ["seed (-1)"]),
    ("stop-empty-string", C, {**OK, "stop": [""]}, 400, "stop", ["stop ([''])", "non-empty"]),
    ("n-two", C, {**OK, "n": 2}, 400, "n", ["n (2) is not supported"]),
    ("logprobs", C, {**OK, "logprobs": 3}, 400, "logprobs", ["logprobs is not supported"]),
    ("penalty", C, {**OK, "presence_penalty": 0.5}, 400, "presence_penalty", ["presence_penalty (0.5)"]),
    (
        "beyond-capacity-before-tokenising",
        C,
        {**OK, "prompt": "z" * 1999, "max_tokens": 2},
        400,
        "prompt",
        ["prompt (1999 characters, at least 1999 tokens) + max_tokens (2) exceeds", "(2000 tokens)"],
    ),
    (
        "beyond-capacity-token-ids",
        C,
        {**OK, "prompt": [7] * 1999, "max_tokens": 2},
        400,
        "prompt",
        ["prompt (1999 tokens) + max_tokens (2) exceeds the model's context (2000 tokens)"],
    ),
    (
        "engine-tier",
        C,
        {**OK, "lockserve": {"tier": "host"}},
        400,
        "tier",
        ["tier ('host') differs from the engine's tier ('hbm')"],
    ),
    (
        "engine-budget",
        C,
        {**OK, "budget_tokens": 32},
        400,
        "budget_tokens",
        ["budget_tokens (32) must exceed sink_pages + recent_pages (3 pages = 48 tokens)"],
    ),
    ("budget-zero", C, {**OK, "budget_tokens": 0}, 400, "budget_tokens", ["budget_tokens (0) must be > 0"]),
    (
        "budget-conflict",
        C,
        {**OK, "budget_tokens": 32, "lockserve": {"budget_tokens": 64}},
        400,
        "budget_tokens",
        ["budget_tokens (32) and lockserve.budget_tokens (64) disagree"],
    ),
    ("tier-unknown", C, {**OK, "lockserve": {"tier": "ssd"}}, 400, "lockserve", ["lockserve.tier", "'ssd'"]),
    (
        "attention-unknown",
        C,
        {**OK, "lockserve": {"attention": "flash"}},
        400,
        "lockserve",
        ["lockserve.attention", "'flash'"],
    ),
    (
        "lockserve-typo",
        C,
        {**OK, "lockserve": {"budget": 64}},
        400,
        "lockserve",
        ["lockserve.budget: unknown field"],
    ),
    (
        "late-value-error",
        C,
        {**OK, "prompt": "badval!"},
        400,
        "prompt",
        ["prompt (7 tokens) holds a token outside"],
    ),
    (
        "chat-no-messages",
        CHAT,
        {"model": "echo-test", "messages": []},
        400,
        "messages",
        ["messages", "at least 1"],
    ),
    (
        "chat-messages-string",
        CHAT,
        {"messages": "hi"},
        400,
        "messages",
        ["messages: Input should be a valid list", "'hi'"],
    ),
    (
        "chat-bad-role",
        CHAT,
        {"messages": [{"role": "robot", "content": "x"}]},
        400,
        "messages",
        ["messages[0].role", "'robot'"],
    ),
    (
        "chat-content-int",
        CHAT,
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages",
        ["messages[0].content", "5"],
    ),
    (
        "chat-image-part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages",
        ["messages[0].content[0].type ('image_url') is not supported"],
    ),
    (
        "chat-max-completion-huge",
        CHAT,
        {"messages": MSG, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
        ["max_completion_tokens (5000) must be <= 1000"],
    ),
    ("chat-tools", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", ["tools"]),
    ("chat-unknown-model", CHAT, {"model": "x", "messages": MSG}, 404, "model", ["'x' does not exist"]),
]


@pytest.mark.parametrize(
    "path,body,status,param,needles", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_request_is_a_clear_4xx_and_the_server_keeps_serving(http, path, body, status, param, needles):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = http.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    for needle in needles:
        assert needle in error["message"], f"{needle!r} not in {error['message']!r}"
    follow_up = http.post(C, json=OK)
    assert follow_up.status_code == 200 and follow_up.json()["choices"][0]["text"] == "KO"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_oversized_body_is_413(http, chunked):
    body = json.dumps({**OK, "prompt": "y" * (70 * 1024)}).encode()
    content = iter([body[i : i + 8192] for i in range(0, len(body), 8192)]) if chunked else body
    r = http.post(C, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert "exceeds the limit of 65536 bytes" in error["message"] and error["code"] == "request_too_large"
    assert http.post(C, json=OK).status_code == 200


def test_unknown_path_and_method_use_the_error_shape(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found"
    r = http.get(C)
    assert r.status_code == 405 and "error" in r.json()


# ----- engine failures and disconnects ------------------------------------------------------


def test_engine_crash_non_stream_is_500_and_server_survives(http, engine):
    r = http.post(C, json={**OK, "prompt": "fail! now", "max_tokens": 5})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in r.json()["error"]["message"]
    assert http.post(C, json=OK).status_code == 200


def test_engine_crash_mid_stream_is_an_sse_error_event(http, engine):
    body = {**OK, "prompt": "fail! now", "max_tokens": 5, "stream": True}
    with http.stream("POST", C, json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["text"] == "W", "the token before the crash arrives"
    assert "RuntimeError" in events[1]["error"]["message"] and events[-1] == "[DONE]"
    request_id = events[0]["id"]
    assert request_id in engine.aborted, "a crashed request is aborted in the engine"
    assert http.post(C, json=OK).status_code == 200


@pytest.mark.parametrize("path,body", [(C, {**OK, "prompt": "badval!"}),
                                       (CHAT, {"messages": [{"role": "user", "content": "badval!"}]})],
                         ids=["completions", "chat"])
def test_error_before_the_first_token_of_a_stream_is_a_real_status(http, path, body):
    # The stream is primed before the response starts, so a refusal is a 400, not a 200 + error event.
    r = http.post(path, json={**body, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and "outside the vocabulary" in error["message"], error


@pytest.mark.parametrize(
    "path,body",
    [
        (C, {**OK, "prompt": "slow:" + "a" * 200, "max_tokens": 200, "stream": True}),
        (
            CHAT,
            {
                "messages": [{"role": "user", "content": "slow:" + "a" * 200}],
                "max_tokens": 200,
                "stream": True,
            },
        ),
    ],
    ids=["completions", "chat"],
)
def test_client_disconnect_mid_stream_aborts_the_engine_request(server, engine, path, body):
    with httpx.Client(base_url=server.url, timeout=10) as c, c.stream("POST", path, json=body) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    request_id = json.loads(first[len("data: ") :])["id"]
    assert wait_until(lambda: request_id in engine.aborted), "disconnect did not abort the engine request"
    assert wait_until(lambda: request_id not in engine.active), "the engine stream was not closed"
    assert engine.tokens_emitted > 0


def test_client_disconnect_non_stream_aborts_the_engine_request(server, engine):
    body = {**OK, "prompt": "slow:" + "b" * 300, "max_tokens": 300}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.3) as c:
        c.post(C, json=body)
    ids = [ord(c) for c in body["prompt"]]
    slow = [rid for rid, seen in engine.seen.items() if seen.prompt_ids == ids]
    assert len(slow) == 1
    assert wait_until(lambda: slow[0] in engine.aborted), "disconnect did not abort the non-stream request"
    assert wait_until(lambda: slow[0] not in engine.active)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_no_worker_before_the_first_token_is_503_with_retry_after(http, stream):
    r = http.post(C, json={**OK, "prompt": "down! now", "stream": stream})
    assert r.status_code == 503 and r.headers["retry-after"] == "3", r.text
    assert r.json()["error"]["code"] == "worker_unavailable" and r.json()["error"]["type"] == "server_error"


def test_worker_dying_mid_stream_is_an_sse_error_event(http, engine):
    with http.stream("POST", C, json={**OK, "prompt": "died! now", "max_tokens": 9, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[0]["choices"][0]["text"] == "W" and events[-1] == "[DONE]"
    assert events[1]["error"]["code"] == "worker_unavailable" and "died" in events[1]["error"]["message"]
    assert events[0]["id"] in engine.aborted


def test_openai_client_retries_a_503_after_retry_after():
    class FlakyEcho(EchoEngine):
        failures = 1

        async def generate(self, prompt, params, options, request_id):
            if self.failures:
                self.failures -= 1
                raise WorkerUnavailable("no GpuWorker can take a request now; retry shortly", 1)
            async for event in super().generate(prompt, params, options, request_id):
                yield event

    engine = FlakyEcho()
    with start_server(engine) as running, \
            openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=2) as patient:
        start = time.monotonic()
        out = patient.completions.create(model="echo-test", prompt="retry", max_tokens=5)
    assert out.choices[0].text == "YRTER" and engine.failures == 0
    assert time.monotonic() - start >= 1.0, "the client waited Retry-After before trying again"


def test_hopeless_prompt_is_refused_before_tokenising():
    engine = EchoEngine(capacity=2000)
    with start_server(engine, max_body_bytes=8 << 20) as running:
        start = time.monotonic()
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "q" * (4 << 20), "max_tokens": 5},
                       timeout=30)
        took = time.monotonic() - start
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "prompt (4194304 characters, at least 4194304 tokens)" in r.json()["error"]["message"]
    assert engine.tokenize_threads == [], "the prompt must be refused without being tokenised"
    assert took < 5, took


def test_body_limit_is_derived_from_the_context():
    from lockserve.cluster.server import body_limit

    bounds = EchoEngine(capacity=2000).prompt_bounds()
    derived = body_limit(EchoEngine(capacity=2000), ServerConfig())
    assert derived == bounds.body_limit() == 2000 * 38 + (1 << 20), "context x (6 bytes + 32) + 1 MiB"
    assert body_limit(EchoEngine(), ServerConfig(max_body_bytes=4096)) == 4096, "an explicit limit wins"


def test_sampling_defaults_come_from_the_model_unless_the_request_sets_them():
    class ModelDefaults(EchoEngine):
        def sampling_defaults(self):
            return {"temperature": 0.2, "top_p": 0.9, "top_k": 7}

    engine = ModelDefaults()
    with start_server(engine) as running, openai.OpenAI(base_url=running.url + "/v1", api_key="x") as c:
        plain = c.completions.create(model="echo-test", prompt="abc", max_tokens=2)
        mine = c.completions.create(model="echo-test", prompt="abc", max_tokens=2, temperature=0, top_p=1,
                                    extra_body={"top_k": 0})
    got = engine.seen[plain.id].params
    assert (got.temperature, got.top_p, got.top_k) == (0.2, 0.9, 7)
    got = engine.seen[mine.id].params
    assert (got.temperature, got.top_p, got.top_k) == (0.0, 1.0, 0)
    plain_engine = EchoEngine()  # no generation config: the OpenAI API's defaults
    with start_server(plain_engine) as running, openai.OpenAI(base_url=running.url + "/v1", api_key="x") as c:
        out = c.completions.create(model="echo-test", prompt="abc", max_tokens=2)
    got = plain_engine.seen[out.id].params
    assert (got.temperature, got.top_p, got.top_k) == (1.0, 1.0, 0)


@pytest.mark.parametrize("ready,total,status,code", [(2, 2, "ok", 200), (1, 2, "degraded", 200),
                                                     (0, 2, "unavailable", 503)])
def test_health_follows_worker_readiness(ready, total, status, code):
    class Workers(EchoEngine):
        def health(self):
            return {"ready": ready, "total": total}

    with start_server(Workers()) as running:
        r = httpx.get(running.url + "/health", timeout=10)
    assert r.status_code == code and r.json()["status"] == status, r.text
    assert (r.headers.get("retry-after") is not None) == (code == 503)


def test_finished_requests_are_not_aborted(client, engine):
    out = client.completions.create(model="echo-test", prompt="fine", max_tokens=10)
    stream = client.completions.create(model="echo-test", prompt="fine too", max_tokens=10, stream=True)
    stream_id = [c.id for c in stream][0]
    assert out.id not in engine.aborted and stream_id not in engine.aborted
