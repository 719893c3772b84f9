"""Bind policy and API keys: loopback by default, a key required elsewhere, 401 without it."""

from __future__ import annotations

import socket

import httpx
import openai
import pytest
from lockserve.cluster.listen import API_KEY_ENV, BindError, is_loopback, resolve_server_config
from lockserve.cluster.runner import BackgroundServer, serve_app
from lockserve.cluster.server import build_app
from lockserve.configs import ConfigError, ServeConfig, ServerConfig

from tests.cluster.echo_engine import EchoEngine, start_server

KEY = "test-key-123"


@pytest.mark.parametrize(
    "host,loopback",
    [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("::", False), ("10.1.2.3", False), ("myhost.example", False)],
)  # fmt: skip
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_default_bind_is_loopback_without_key():
    config = resolve_server_config(ServerConfig(), env={})
    assert config.host == "127.0.0.1" and config.api_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3"])
def test_non_loopback_without_key_refuses(host):
    with pytest.raises(ConfigError) as info:
        resolve_server_config(ServerConfig(host=host), env={})
    message = str(info.value)
    assert repr(host) in message and API_KEY_ENV in message and "--api-key" in message, message


def test_non_loopback_with_key_from_config_or_env():
    from_config = resolve_server_config(ServerConfig(host="0.0.0.0", api_key=KEY), env={})
    assert from_config.api_key.get_secret_value() == KEY
    from_env = resolve_server_config(ServerConfig(host="0.0.0.0"), env={API_KEY_ENV: f" {KEY} "})
    assert from_env.api_key.get_secret_value() == KEY
    blank_env = {API_KEY_ENV: "   "}
    with pytest.raises(ConfigError, match="API key is required"):
        resolve_server_config(ServerConfig(host="0.0.0.0"), env=blank_env)


def test_config_key_wins_over_env():
    config = resolve_server_config(ServerConfig(api_key="from-config"), env={API_KEY_ENV: "from-env"})
    assert config.api_key.get_secret_value() == "from-config"


def test_serve_app_refuses_to_start_on_public_address_without_key(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    config = ServeConfig.model_validate({"server": {"host": "0.0.0.0", "port": 0}})
    with pytest.raises(ConfigError, match="is not a loopback address"):
        serve_app(EchoEngine(), config)  # raises before binding or serving anything


def test_busy_port_is_a_bind_error_naming_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig(port=port)
        with pytest.raises(BindError, match=f"cannot listen on 127.0.0.1:{port}"):
            BackgroundServer(build_app(EchoEngine(), config), config).start()


@pytest.fixture(scope="module")
def keyed_server():
    with start_server(EchoEngine(), api_key=KEY) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_http(keyed_server):
    with httpx.Client(base_url=keyed_server.url, timeout=10) as client:
        yield client


@pytest.mark.parametrize(
    "headers,reason",
    [({}, "missing Authorization header"), ({"Authorization": "Bearer wrong"}, "invalid API key"),
     ({"Authorization": KEY}, "invalid API key"), ({"Authorization": f"Basic {KEY}"}, "invalid API key")],
)  # fmt: skip
@pytest.mark.parametrize(
    "method,path", [("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics")]
)
def test_requests_without_the_key_get_401(keyed_http, headers, reason, method, path):
    r = keyed_http.request(method, path, headers=headers, json={"prompt": "x"})
    assert r.status_code == 401, r.text
    assert reason in r.json()["error"]["message"] and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_health_stays_open(keyed_server):
    assert httpx.get(keyed_server.url + "/health").status_code == 200


def test_right_key_works_with_the_openai_client(keyed_server):
    with openai.OpenAI(base_url=keyed_server.url + "/v1", api_key=KEY, max_retries=0) as client:
        assert (
            client.completions.create(model="echo-test", prompt="key", max_tokens=5).choices[0].text == "YEK"
        )
    with (
        openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="nope", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_auth_runs_before_the_body_is_read(keyed_server):
    # An unauthenticated oversized body is refused as 401, not 413: nothing is read before auth.
    r = httpx.post(keyed_server.url + "/v1/completions", content=b"x" * (40 << 20))
    assert r.status_code == 401


def test_key_is_compared_in_constant_time(keyed_server, monkeypatch):
    # A timing difference would leak how much of a guessed key is right: the comparison must be
    # hmac.compare_digest, on every request, whatever the guess.
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    guesses = ("t", "test-key-12", "test-key-124", "x" * 500, KEY)
    statuses = [httpx.get(keyed_server.url + "/v1/models", headers={"Authorization": f"Bearer {g}"},
                          timeout=10).status_code for g in guesses]
    assert statuses == [401, 401, 401, 401, 200]
    assert [a for a, _ in calls] == [f"Bearer {g}".encode() for g in guesses]
    assert all(b == f"Bearer {KEY}".encode() for _, b in calls)
