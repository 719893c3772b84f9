"""A small deterministic EngineClient for testing the HTTP front end (not a model).

Tokens are Unicode code points. The reply to a prompt is the prompt reversed with
each character's case swapped, cut at the first stop string ("stop") or at
max_tokens ("length"); a reply that runs out ends with "stop", like an EOS.
One token per event, with ``await asyncio.sleep(delay)`` between them so
concurrent requests interleave. Prompts can ask for misbehaviour:
  "slow:"   anywhere: 20 ms per token (to disconnect mid-stream),
  "fail!"   anywhere: RuntimeError after the first token (an engine crash),
  "badval!" anywhere: ValueError before the first token (a user error found late),
  "down!"   anywhere: WorkerUnavailable before the first token (no worker could take it),
  "died!"   anywhere: WorkerUnavailable after the first token (its worker died mid-stream).

Admission is the real engine's: ``check_request`` runs an ``EngineLimits`` (tier hbm, LOCKS budget
512 tokens, pages of 16) sized to ``capacity`` tokens, so the messages are the engine's own.
The HTTP tests against the real engine (the tiny preset) are tests/cluster/test_real_engine.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lockserve.cluster.engine_client import (
    EngineClient,
    PromptBounds,
    RequestError,
    RequestOptions,
    SamplingParams,
    TokenEvent,
    WorkerUnavailable,
)
from lockserve.cluster.errors import param_of
from lockserve.workers.engine import EngineLimits

PAGE_SIZE = 16


def echo_reply(prompt: str, max_tokens: int, stop: list[str] | None = None) -> tuple[str, str]:
    """(text, finish_reason) the echo engine produces for ``prompt``."""
    full = prompt[::-1].swapcase()
    cut = min((i for s in stop or [] if (i := full.find(s)) >= 0), default=None)
    if cut is not None and cut <= max_tokens:
        return full[:cut], "stop"
    if len(full) > max_tokens:
        return full[:max_tokens], "length"
    return full, "stop"


def chat_prompt(messages: list[dict[str, str]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@dataclass
class Seen:
    prompt_ids: list[int]
    params: SamplingParams
    options: RequestOptions


class EchoEngine(EngineClient):
    def __init__(self, capacity: int = 4096, delay_s: float = 0.0, model_name: str = "echo-test"):
        self.model_name = model_name
        self.capacity = capacity
        self.delay_s = delay_s
        self.seen: dict[str, Seen] = {}
        self.aborted: list[str] = []
        self.active: set[str] = set()
        self.tokens_emitted = 0
        self.stats_values: dict[str, Any] = {"queue_len": 0, "hit_rate": 0.0}
        self.stats_error: Exception | None = None
        self.tokenize_threads: list[str] = []

    def tokenize(self, text: str) -> list[int]:
        self.tokenize_threads.append(threading.current_thread().name)
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return chat_prompt(messages)

    def limits(self) -> EngineLimits:
        pages = -(-self.capacity // PAGE_SIZE)
        return EngineLimits(vocab_size=0x110000, max_model_len=self.capacity, page_size=PAGE_SIZE,
                            pages_capacity=pages, tier="hbm", attention="locks", budget_tokens=512,
                            budget_pages=512 // PAGE_SIZE, sink_pages=1, recent_pages=2)

    def check_request(self, prompt_tokens: int, params: SamplingParams, options: RequestOptions) -> None:
        try:
            self.limits().check(prompt_tokens, params.max_tokens, budget_tokens=options.budget_tokens,
                                attention=options.attention, tier=options.tier)
        except ValueError as err:
            raise RequestError(400, str(err), param=param_of(str(err))) from None

    def prompt_bounds(self) -> PromptBounds:
        return PromptBounds(self.capacity, 1)  # a token is one code point

    async def generate(
        self, prompt: str | list[int], params: SamplingParams, options: RequestOptions, request_id: str
    ) -> AsyncIterator[TokenEvent]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        text = "".join(chr(i) for i in ids)
        self.seen[request_id] = Seen(ids, params, options)
        if "badval!" in text:
            raise ValueError(f"prompt ({len(ids)} tokens) holds a token outside the vocabulary")
        if "down!" in text:
            raise WorkerUnavailable("no GpuWorker can take a request now (echo); retry shortly", 3)
        reply, finish = echo_reply(text, params.max_tokens, params.stop)
        delay = 0.02 if "slow:" in text else self.delay_s
        self.active.add(request_id)
        try:
            for k, ch in enumerate(reply, start=1):
                await asyncio.sleep(delay)
                if k == 2 and "fail!" in text:
                    raise RuntimeError("echo engine crashed on purpose")
                if k == 2 and "died!" in text:
                    raise WorkerUnavailable("GpuWorker 0 died while serving this request (echo)", 2)
                self.tokens_emitted += 1
                last = k == len(reply)
                yield TokenEvent(ch, [ord(ch)], finish if last else None, len(ids), k)
            if not reply:
                yield TokenEvent("", [], finish, len(ids), 0)
        finally:
            self.active.discard(request_id)

    async def abort(self, request_id: str) -> None:
        # A real abort is a round trip to a worker: it suspends, so an unshielded abort
        # inside a cancelled task would never complete.
        await asyncio.sleep(0.001)
        self.aborted.append(request_id)

    def stats(self) -> dict[str, Any]:
        if self.stats_error is not None:
            raise self.stats_error
        return {**self.stats_values, "running": len(self.active)}


def start_server(engine: EngineClient, **server_fields: Any):
    """A started BackgroundServer for ``engine`` on a free loopback port (use as a context manager)."""
    from lockserve.cluster.runner import BackgroundServer
    from lockserve.cluster.server import build_app
    from lockserve.configs import ServerConfig

    config = ServerConfig(**{"port": 0, "log_level": "warning", **server_fields})
    return BackgroundServer(build_app(engine, config), config)
