"""The lockserve CLI: flags -> config, one-line user errors (exit 2), generate and status
against a real server, and `serve` end to end in a subprocess stopped by SIGINT."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import yaml
from lockserve.cluster.cli import build_parser, config_from_args, main
from lockserve.cluster.listen import API_KEY_ENV
from lockserve.configs import load_config

from tests.cluster.echo_engine import EchoEngine, chat_prompt, echo_reply, start_server

REPO = Path(__file__).resolve().parents[2]


class ClosingEcho(EchoEngine):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.closed = 0
        self.configs = []

    def close(self) -> None:
        self.closed += 1


def factory_for(engine: ClosingEcho):
    def factory(config):
        engine.configs.append(config)
        return engine

    return factory


def never_called(config):
    raise AssertionError("the engine must not be started for this command")


def run_cli(capsys, argv, factory=never_called) -> tuple[int, str, str]:
    code = main(argv, engine_factory=factory)
    out, err = capsys.readouterr()
    return code, out, err


# ----- flags and config ------------------------------------------------------------------


def test_the_cli_loads_the_web_server_and_prometheus_parser_only_for_the_commands_that_use_them():
    """`lockserve bench`, `experiment`, `eval` and `generate` run where only the measurement's and
    the engine's dependencies are installed (a GPU box without the serving stack)."""
    heavy = ("uvicorn", "fastapi", "starlette", "prometheus_client")
    code = ("import sys, lockserve.cluster.cli as cli; cli.build_parser(); "
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"server": {"port": 9000}, "cache": {"budget_tokens": 256, "rank": 4}}))
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--port", "0", "--budget-tokens", "1K", "--attention", "dense",
         "--tier", "hbm", "--cpu-only", "--device", "cpu", "--set", "cache.rank=8",
         "--set", "ray.address=auto"]
    )  # fmt: skip
    config = config_from_args(args)
    assert config.server.port == 0 and config.cache.budget_tokens == 1024
    assert (config.cache.attention, config.cache.tier, config.cache.rank) == ("dense", "hbm", 8)
    assert config.ray.cpu_only and config.ray.address == "auto" and config.model.device == "cpu"


def test_print_config_round_trips(capsys, tmp_path):
    code, out, _ = run_cli(capsys, ["serve", "--print-config", "--budget-tokens", "2048", "--port", "9123"])
    assert code == 0
    path = tmp_path / "printed.yaml"
    path.write_text(out)
    printed = load_config(path)
    assert printed.cache.budget_tokens == 2048 and printed.server.port == 9123
    assert printed == load_config(overrides={"cache.budget_tokens": 2048, "server.port": 9123})


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["serve", "--set", "cache.rnk=3"], "unknown key 'cache.rnk' in overrides; did you mean 'rank'"),
        (["serve", "--port", "70000"], "server.port = 70000: must be <= 65535"),
        (["serve", "--budget-tokens", "100"], "budget_tokens (100) must be a multiple of page_size (16)"),
        (["serve", "--config", "/nonexistent/x.yaml"], "config file /nonexistent/x.yaml does not exist"),
        (["serve", "--set", "cache.rank"], "must look like section.field=value"),
        (["serve", "--host", "0.0.0.0"], "server.host ('0.0.0.0') is not a loopback address"),
        (["generate", "--prompt", "x", "--max-tokens", "0"], "max_tokens (0) must be >= 1"),
        (["generate", "--prompt", "x", "--url", "http://127.0.0.1:9"], "cannot reach lockserve at"),
        (["status", "--url", "http://127.0.0.1:9"], "cannot reach lockserve at http://127.0.0.1:9"),
    ],
)
def test_user_errors_are_one_line_exit_2(capsys, monkeypatch, argv, needle):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    code, out, err = run_cli(capsys, argv)
    assert code == 2, (out, err)
    assert err.startswith("lockserve: error: ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_token_flag_is_refused_by_the_parser_naming_it(capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "--prompt", "x", "--budget-tokens", "lots"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "argument --budget-tokens: token count ('lots') must be a number with an optional unit" in err, err


def test_missing_engine_bootstrap_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lockserve.cluster.bootstrap", None)  # as if not built yet
    code = main(["serve", "--port", "0"])  # the default engine factory
    err = capsys.readouterr().err
    assert code == 2 and "the Ray engine is not available" in err and "Traceback" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--port", "abc"])
    assert info.value.code == 2 and "invalid int value: 'abc'" in capsys.readouterr().err


# ----- generate --------------------------------------------------------------------------


def test_generate_locally_completes_the_prompt_greedily_or_chats(capsys):
    engine = ClosingEcho()
    argv = ["generate", "--prompt", "Hello", "--max-tokens", "3"]
    code, out, err = run_cli(capsys, argv, factory_for(engine))
    assert code == 0 and out == "OLL\n" and "[finish: length, 5 prompt + 3 completion tokens" in err
    [params] = [seen.params for seen in engine.seen.values()]
    assert (params.temperature, params.max_tokens) == (0.0, 3), "generate is greedy unless told otherwise"
    assert run_cli(capsys, ["generate", "--prompt", "Hello", "--raw", "--max-tokens", "3"],
                   factory_for(engine))[1] == "OLL\n", "--raw is the default, still accepted"
    assert engine.closed == 2
    code, out, _ = run_cli(capsys, ["generate", "--prompt", "Hi", "--chat", "--max-tokens", "100"],
                           factory_for(engine))
    expected = echo_reply(chat_prompt([{"role": "user", "content": "Hi"}]), 100)[0]
    assert code == 0 and out == expected + "\n" and engine.closed == 3


def test_serve_checks_the_port_before_starting_the_engine(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        code, _, err = run_cli(capsys, ["serve", "--port", str(port)])  # never_called: no engine starts
    assert code == 2 and time.monotonic() - start < 5
    assert err == f"lockserve: error: cannot listen on 127.0.0.1:{port}: Address already in use " \
                  "(another server? stop it or pass --port)\n", err


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["generate", "--prompt", "x"]])
def test_engine_start_up_failure_is_one_line(capsys, command):
    def broken(config):
        raise RuntimeError("GpuWorker 0 could not start: ActorDiedError\n" + "Traceback line\n" * 40)

    code, out, err = run_cli(capsys, command, broken)
    assert code == 2 and out == ""
    assert err == ("lockserve: error: the engine could not start: RuntimeError: GpuWorker 0 could not "
                   "start: ActorDiedError (set LOCKSERVE_DEBUG=1 for the traceback)\n"), err


def test_serve_warns_when_the_working_dir_is_another_checkout(capsys, tmp_path, monkeypatch):
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "cli.py").write_text("# an uploaded copy\n")
    monkeypatch.chdir(tmp_path)
    engine = ClosingEcho()
    monkeypatch.setattr("lockserve.cluster.runner.serve_app", lambda *a: None)  # cmd_serve imports it late
    code, _, err = run_cli(capsys, ["serve", "--port", "0"], factory_for(engine))
    assert code == 0 and engine.closed == 1
    assert f"warning: {tmp_path} holds a lockserve checkout, but the code that runs is {REPO}" in err, err
    assert "`ray up` again" in err


def test_generate_locally_passes_engine_flags_to_the_config(capsys):
    engine = ClosingEcho()
    argv = ["generate", "--prompt", "x", "--budget-tokens", "64", "--attention", "dense", "--api-key", "k"]
    assert run_cli(capsys, argv, factory_for(engine))[0] == 0
    config = engine.configs[0]
    assert config.cache.budget_tokens == 64 and config.cache.attention == "dense"
    assert config.server.api_key is None, "--api-key of generate is for --url, not the local server"


def test_generate_locally_refused_by_the_engine(capsys):
    engine = ClosingEcho(capacity=10)
    code, _, err = run_cli(capsys, ["generate", "--prompt", "long prompt"], factory_for(engine))
    assert code == 2 and engine.closed == 1
    assert "prompt (11 tokens) + max_tokens (128) = 139 exceeds the model's maximum length (10" in err


@pytest.fixture(scope="module")
def served():
    engine = EchoEngine()
    with start_server(engine, max_tokens_limit=1000) as server:
        yield server, engine


def test_generate_against_a_server(capsys, served):
    server, engine = served
    argv = ["generate", "--url", server.url, "--prompt", "remote", "--budget-tokens", "512"]
    code, out, err = run_cli(capsys, argv)
    assert code == 0 and out == "ETOMER\n" and "[finish: stop, 6 prompt + 6 completion tokens" in err
    request = next(s for s in engine.seen.values() if s.prompt_ids == [ord(c) for c in "remote"])
    assert request.options.budget_tokens == 512
    code, out, _ = run_cli(
        capsys, ["generate", "--url", server.url, "--prompt", "chat me", "--chat", "--max-tokens", "7"]
    )
    assert code == 0 and out == echo_reply(chat_prompt([{"role": "user", "content": "chat me"}]), 7)[0] + "\n"


def test_generate_against_a_server_that_refuses(capsys, served):
    server, _ = served
    code, _, err = run_cli(capsys, ["generate", "--url", server.url, "--prompt", "x", "--max-tokens", "5000"])
    assert code == 2 and "server answered 400: max_tokens (5000) must be <= 1000" in err


# ----- status ----------------------------------------------------------------------------


def test_status_prints_a_table(capsys, served):
    server, engine = served
    engine.stats_values = {
        "queue_len": 2,
        "hit_rate": 0.5,
        "capacity_used": 0.125,
        "bytes_per_tier": {"host": 3 << 20},
    }
    httpx.post(server.url + "/v1/completions", json={"prompt": "status", "max_tokens": 4})
    code, out, _ = run_cli(capsys, ["status", "--url", server.url])
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"lockserve at {server.url}: ok (model echo-test)"
    assert lines[1].split() == ["workers", "ready", "1/1"]
    table = {line[:22].strip(): line[22:].strip() for line in lines[1:]}
    assert table["queue length"] == "2" and table["hot-cache hit rate"] == "50.0%"
    assert table["capacity used"] == "12.5%" and table["KV bytes host"] == "3.0 MiB"
    assert re.fullmatch(r"\d+\.\d ms \(n=\d+\)", table["TTFT mean"]), table["TTFT mean"]
    assert int(table["generated tokens"]) >= 4 and "length" in table["requests finished"]


def test_status_with_an_api_key(capsys, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with start_server(EchoEngine(), api_key="sekret") as server:
        code, _, err = run_cli(capsys, ["status", "--url", server.url])
        assert code == 2 and "needs an API key" in err and API_KEY_ENV in err
        assert run_cli(capsys, ["status", "--url", server.url, "--api-key", "sekret"])[0] == 0
        monkeypatch.setenv(API_KEY_ENV, "sekret")
        assert run_cli(capsys, ["status", "--url", server.url])[0] == 0


# ----- serve end to end ------------------------------------------------------------------

SERVE_SCRIPT = textwrap.dedent(
    """
    import sys
    from lockserve.cluster.cli import main
    from tests.cluster.echo_engine import EchoEngine

    class Engine(EchoEngine):
        def close(self):
            print("engine closed", file=sys.stderr, flush=True)

    sys.exit(main(sys.argv[1:], engine_factory=lambda config: Engine(model_name=config.model.name)))
    """
)


def read_line_with(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.2)
        if ready:
            line = proc.stderr.readline()
            if needle in line:
                return line
            if not line and proc.poll() is not None:
                break
    raise AssertionError(f"no line with {needle!r} from the serve process (exit {proc.poll()})")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_runs_until_a_signal(tmp_path, stop):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop(API_KEY_ENV, None)
    argv = ["--port", "0", "--model-name", "served-echo", "--set", "server.log_level=warning"]
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE_SCRIPT, "serve", *argv],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = read_line_with(proc, "lockserve: serving", timeout_s=60)
        url = line.rsplit(" at ", 1)[1].strip()
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        r = httpx.post(
            url + "/v1/completions", json={"model": "served-echo", "prompt": "up", "max_tokens": 5}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "PU"
        proc.send_signal(stop)
        assert proc.wait(timeout=30) == 0
        assert "engine closed" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
