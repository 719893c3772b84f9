"""Property-based fuzzing of the HTTP API (hypothesis) over the fake engine, many examples: every
body gets an answer in time, a 4xx with an OpenAI-shaped JSON error or a 200, never a 5xx. The same
bodies go to the real engine in test_real_engine.py; invalid config files are fuzzed in
test_config.py."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.cluster.echo_engine import EchoEngine, start_server
from tests.cluster.fuzz_bodies import request_bodies


@pytest.fixture(scope="module")
def server():
    with start_server(EchoEngine(capacity=4096)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(case=request_bodies(max_tokens_cap=16))
def test_any_body_gets_a_4xx_json_error_or_an_answer(http, case):
    path, body = case
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert error["type"] == "invalid_request_error" and error["message"], error
    elif b'"stream": true' not in body:
        assert r.json()["choices"], r.text


def test_a_body_past_the_limit_is_413_before_it_is_sent(server):
    # Only the headers go out: the server answers from Content-Length (30 MB, over the echo engine's
    # derived limit of 4096 tokens x 38 bytes + 1 MiB) without waiting for the body.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{" % (30 << 20))
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    error = json.loads(body)["error"]
    limit = 4096 * 38 + (1 << 20)
    assert error["code"] == "request_too_large" and f"limit of {limit} bytes" in error["message"], error
