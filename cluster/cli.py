"""The ``lockserve`` command: ``serve``, ``generate`` and ``status``; ``bench decode``,
``experiment capacity`` and ``report`` (``lockserve.cluster.measure``); ``eval retrieval``
(``lockserve.cluster.measure.eval.command``).

User errors (bad config, bad flags, unreachable server, refused request) print one
line ``lockserve: error: ...`` to stderr and exit with status 2, without a traceback.
The engine comes from an injectable factory; the default one is
``lockserve.cluster.bootstrap.start_engine(config)`` (Ray startup, workers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import yaml
from lockserve.cluster import measure as experiments
from lockserve.cluster.engine_client import EngineClient, RequestError, RequestOptions, SamplingParams
from lockserve.cluster.listen import API_KEY_ENV, BindError, bind_socket, resolve_server_config
from lockserve.cluster.measure.eval import command as eval_retrieval
from lockserve.configs import ATTENTION_MODES, TIERS, ConfigError, ServeConfig, load_config, parse_override
from lockserve.configs.units import token_count

EngineFactory = Callable[[ServeConfig], EngineClient]
EXIT_USER_ERROR = 2
DEFAULT_URL = "http://127.0.0.1:8000"
DEBUG_ENV = "LOCKSERVE_DEBUG"  # set to 1: start-up failures print their traceback too
log = logging.getLogger(__name__)

# flag dest -> dotted config key; SERVER_FLAGS apply to serve only.
SERVER_FLAGS: dict[str, str] = {"host": "server.host", "port": "server.port", "api_key": "server.api_key"}
ENGINE_FLAGS: dict[str, str] = {
    "model": "model.source",
    "model_name": "model.name",
    "device": "model.device",
    "dtype": "model.dtype",
    "budget_tokens": "cache.budget_tokens",
    "attention": "cache.attention",
    "tier": "cache.tier",
    "ray_address": "ray.address",
    "num_gpu_workers": "ray.num_gpu_workers",
}


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 2."""


def default_engine_factory(config: ServeConfig) -> EngineClient:
    """Start Ray and the workers for ``config`` (``lockserve.cluster.bootstrap.start_engine``)."""
    try:
        from lockserve.cluster.bootstrap import start_engine
    except ImportError as err:
        if err.name != "lockserve.cluster.bootstrap":
            raise
        raise CLIError(
            "the Ray engine is not available in this build (lockserve.cluster.bootstrap)"
        ) from None
    return start_engine(config)


# ----- argument parsing ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockserve", description="LOCKS long-context serving with Ray.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{serve,generate,status,bench,experiment,report,eval}")
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    _add_config_flags(serve)
    serve.add_argument("--host", help="bind address (default 127.0.0.1; others need an API key)")
    serve.add_argument("--port", type=int, help="bind port (0 = a free port)")
    serve.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    serve.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    gen = sub.add_parser("generate", help="complete a prompt once (greedy by default; --chat for the chat "
                         "template), locally or from a running server (--url)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help="send the prompt as a user message through the model's chat template")
    mode.add_argument("--raw", action="store_true", help="complete the prompt as is (the default)")
    gen.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (else start one locally)")
    gen.add_argument("--api-key", help=f"bearer key for --url (default: ${API_KEY_ENV})")
    _add_config_flags(gen)
    status = sub.add_parser("status", help="health and metrics of a running server")
    status.add_argument("--url", default=DEFAULT_URL, help=f"server URL (default {DEFAULT_URL})")
    status.add_argument("--api-key", help=f"bearer key for /metrics (default: ${API_KEY_ENV})")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per HTTP call")
    experiments.add_parsers(sub)
    eval_retrieval.add_parser(sub)
    return parser


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config (default: the packaged serve.yaml)")
    parser.add_argument("--model", help='"default" (embedded SmolLM2) or a GGUF file / HF directory')
    parser.add_argument("--model-name", help="name served by /v1/models")
    parser.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--dtype", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--budget-tokens", type=_tokens_flag,
                        help="LOCKS budget: tokens per KV head per step (512, 1K)")
    parser.add_argument("--attention", choices=ATTENTION_MODES)
    parser.add_argument("--tier", choices=TIERS, help="where KV pages live")
    parser.add_argument("--ray-address", help='Ray cluster to join ("auto"); default starts a local one')
    parser.add_argument("--num-gpu-workers", type=_workers_flag, help='GPU workers in all, or "auto"')
    parser.add_argument("--cpu-only", action="store_true", help="run the workers on CPU")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="any config field, e.g. cache.rank=8"
    )


def _tokens_flag(value: str) -> int:
    try:
        return token_count(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _workers_flag(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: an integer or 'auto'") from None


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The config file (``--config``) with ``--set`` and then the named flags applied on top."""
    overrides: dict[str, Any] = dict(parse_override(item) for item in args.set)
    flags = {**ENGINE_FLAGS, **(SERVER_FLAGS if args.command == "serve" else {})}
    for dest, key in flags.items():
        if getattr(args, dest, None) is not None:
            overrides[key] = getattr(args, dest)
    if args.cpu_only:
        overrides["ray.cpu_only"] = True
    return load_config(args.config, overrides)


# ----- commands --------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, engine_factory: EngineFactory) -> int:
    config = config_from_args(args)
    if args.print_config:
        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    server = resolve_server_config(config.server)  # refuse an unsafe bind before starting Ray
    sock = bind_socket(server.host, server.port)  # and a busy port: before Ray and the model start
    try:
        warn_if_shadowed(os.getcwd())
        engine = start_engine_or_fail(engine_factory, config)
    except BaseException:
        sock.close()
        raise
    from lockserve.cluster.runner import serve_app  # the web framework loads for serving only

    try:
        serve_app(engine, config, sock)
    finally:
        engine.close()
    return 0


def start_engine_or_fail(engine_factory: EngineFactory, config: ServeConfig) -> EngineClient:
    """The engine, or a CLIError of one line: a start-up failure says what failed, not a page of
    traceback (LOCKSERVE_DEBUG=1 adds it)."""
    try:
        return engine_factory(config)
    except (CLIError, ConfigError, BindError, KeyboardInterrupt):
        raise
    except Exception as err:
        if os.environ.get(DEBUG_ENV):
            log.exception("engine start-up failed")
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        first = lines[0] if lines else ""
        raise CLIError(f"the engine could not start: {type(err).__name__}: {first} "
                       f"(set {DEBUG_ENV}=1 for the traceback)") from None


def warn_if_shadowed(cwd: str) -> None:
    """Warn when the working directory is a lockserve checkout other than the code that runs: `ray
    job submit --working-dir .` uploads one, but the nodes run the copy `ray up` installed."""
    here = os.path.join(cwd, "cluster", "cli.py")
    if os.path.isfile(here) and os.path.realpath(here) != os.path.realpath(__file__):
        print(f"lockserve: warning: {cwd} holds a lockserve checkout, but the code that runs is "
              f"{os.path.dirname(os.path.dirname(os.path.realpath(__file__)))} (installed); to run "
              "changed code on a cluster, `ray up` again (docs/cluster.md)", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace, engine_factory: EngineFactory) -> int:
    if args.url is not None:
        return _generate_remote(args)
    config = config_from_args(args)
    params = _contract(
        SamplingParams,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    engine = start_engine_or_fail(engine_factory, config)
    try:
        return asyncio.run(_generate_local(engine, args, params))
    finally:
        engine.close()


async def _generate_local(engine: EngineClient, args: argparse.Namespace, params: SamplingParams) -> int:
    if args.chat:
        ids = engine.tokenize_chat(engine.apply_chat_template([{"role": "user", "content": args.prompt}]))
    else:
        ids = engine.tokenize(args.prompt)
    options = RequestOptions()
    try:
        engine.check_request(len(ids), params, options)
    except RequestError as err:
        raise CLIError(err.message) from None
    start, finish, usage = time.monotonic(), None, (len(ids), 0)
    async for event in engine.generate(ids, params, options, request_id=f"cli-{os.getpid()}"):
        print(event.text, end="", flush=True)
        finish, usage = event.finish_reason, (event.prompt_tokens, event.completion_tokens)
    print()
    _print_summary(finish, usage, time.monotonic() - start)
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    path, body = _remote_request(args)
    start, finish, usage = time.monotonic(), None, (0, 0)
    with _http(args) as client:
        try:
            with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise CLIError(f"server answered {response.status_code}: {_error_message(response)}")
                for chunk in _sse_payloads(response.iter_lines()):
                    if "error" in chunk:
                        raise CLIError(f"server error: {chunk['error'].get('message')}")
                    finish = _print_chunk(chunk, finish)
                    if chunk.get("usage"):
                        usage = (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"])
        except httpx.HTTPError as err:
            raise CLIError(f"cannot reach lockserve at {args.url}: {err}") from None
    print()
    _print_summary(finish, usage, time.monotonic() - start)
    return 0


def _remote_request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.seed is not None:
        body["seed"] = args.seed
    if args.stop:
        body["stop"] = args.stop
    extras = {
        k: getattr(args, k) for k in ("budget_tokens", "attention", "tier") if getattr(args, k) is not None
    }
    if extras:
        body["lockserve"] = extras
    if not args.chat:
        return "/v1/completions", {**body, "prompt": args.prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": args.prompt}]}


def _print_chunk(chunk: dict[str, Any], finish: str | None) -> str | None:
    for choice in chunk.get("choices", []):
        text = choice.get("text")
        if text is None:
            text = choice.get("delta", {}).get("content") or ""
        print(text, end="", flush=True)
        finish = choice.get("finish_reason") or finish
    return finish


def _print_summary(finish: str | None, usage: tuple[int, int], seconds: float) -> None:
    prompt, completion = usage
    print(
        f"[finish: {finish}, {prompt} prompt + {completion} completion tokens, {seconds:.2f} s]",
        file=sys.stderr,
    )


def cmd_status(args: argparse.Namespace) -> int:
    from lockserve.cluster.status import render_status  # the Prometheus parser loads for this only

    with _http(args) as client:
        try:
            health = client.get("/health")
            metrics = client.get("/metrics")
        except httpx.HTTPError as err:
            raise CLIError(f"cannot reach lockserve at {args.url}: {err}") from None
    if metrics.status_code == 401:
        raise CLIError(f"{args.url}/metrics needs an API key: pass --api-key or set {API_KEY_ENV}")
    if metrics.status_code != 200:
        raise CLIError(f"{args.url}/metrics answered {metrics.status_code}: {_error_message(metrics)}")
    print(render_status(args.url, _json_or_text(health), health.status_code, metrics.text))
    return 0 if health.status_code == 200 else 1


# ----- helpers ---------------------------------------------------------------------------


def _http(args: argparse.Namespace) -> httpx.Client:
    key = args.api_key or os.environ.get(API_KEY_ENV, "").strip() or None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = getattr(args, "timeout", None) or httpx.Timeout(10.0, read=None)  # a generation may take long
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=timeout)


def _sse_payloads(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: ") :])


def _json_or_text(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _error_message(response: httpx.Response) -> str:
    body = _json_or_text(response)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)[:200]


def _contract(cls: Any, **kwargs: Any) -> Any:
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise CLIError(str(err)) from None


def main(argv: list[str] | None = None, *, engine_factory: EngineFactory | None = None) -> int:
    """Entry point of ``lockserve``; returns the exit status."""
    args = build_parser().parse_args(argv)
    factory = engine_factory or default_engine_factory
    if args.command in experiments.COMMANDS:
        return experiments.run(args, sys.argv[1:] if argv is None else list(argv))
    if args.command == "eval":
        return eval_retrieval.run(args, sys.argv[1:] if argv is None else list(argv))
    try:
        if args.command == "serve":
            return cmd_serve(args, factory)
        if args.command == "generate":
            return cmd_generate(args, factory)
        return cmd_status(args)
    except (CLIError, ConfigError, BindError) as err:
        print(f"lockserve: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
