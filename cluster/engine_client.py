"""The contract between the HTTP front end and whatever generates tokens.

The server (``cluster/server.py``) only ever talks to an ``EngineClient``. The
real implementation drives the Ray ``GpuWorker`` actors; tests plug in a small
deterministic engine. Request-level values are plain dataclasses validated on
construction: a bad value raises ``ValueError`` naming the field and the value,
which the server turns into a 400.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from lockserve.configs.schema import ATTENTION_MODES, TIERS

# The engine's own sampling parameters, validated on construction (errors name field and value):
# the HTTP layer builds them, Ray carries them, the engine samples with them.
from lockserve.workers.engine.sampling import SamplingParams, require_int

FINISH_REASONS = ("stop", "length")
@dataclass
class RequestOptions:
    """Per-request LOCKS overrides; ``None`` keeps the engine's configured value.

    ``budget_tokens``: tokens attended per KV head per step; ``tier``: where this
    request's KV pages live (one of configs.TIERS); ``attention``: "locks" or "dense".
    """

    budget_tokens: int | None = None
    tier: str | None = None
    attention: str | None = None

    def __post_init__(self) -> None:
        if self.budget_tokens is not None:
            require_int("budget_tokens", self.budget_tokens)
            if self.budget_tokens <= 0:
                raise ValueError(f"budget_tokens ({self.budget_tokens}) must be > 0")
        if self.tier is not None and self.tier not in TIERS:
            raise ValueError(f"tier ({self.tier!r}) must be one of {', '.join(TIERS)}")
        if self.attention is not None and self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention ({self.attention!r}) must be one of {', '.join(ATTENTION_MODES)}")


@dataclass
class TokenEvent:
    """One step of a request's output.

    ``text`` is the new text since the previous event (a delta, possibly empty while
    a multi-byte character is incomplete); ``token_ids`` are the new tokens.
    ``finish_reason`` is None except on the last event ("stop" or "length").
    ``prompt_tokens`` and ``completion_tokens`` are running totals for the request.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


class RequestError(Exception):
    """A request the engine refuses; the server answers with ``status`` and ``message``.

    ``param`` names the offending request field when there is one (e.g. "max_tokens").
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        if not 400 <= status <= 599:
            raise ValueError(f"status ({status}) must be an HTTP error status in [400, 599]")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


class EngineClient(ABC):
    """What the HTTP front end needs from an engine. One instance serves one model.

    Methods are called from the server's event loop: async methods must not block it,
    and sync methods must return quickly (no remote round trip per call).
    """

    model_name: str

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids that ``generate(text)`` would consume, including any BOS the model adds.

        Invariant: ``generate(tokenize(text))`` produces the same events as ``generate(text)``.
        """

    @abstractmethod
    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Render chat ``messages`` ({"role", "content"} dicts) into the prompt text that asks
        the model for the assistant's next turn. Raises ValueError for roles it cannot render."""

    @abstractmethod
    def check_request(self, prompt_tokens: int, params: SamplingParams, options: RequestOptions) -> None:
        """Raise RequestError (status 400, ``param`` naming the field) when the engine cannot
        serve a prompt of ``prompt_tokens`` tokens with these params/options, e.g.
        ``prompt_tokens + params.max_tokens`` beyond the model's positions or the KV capacity,
        or an option the engine does not support. Returns None when the request is admissible."""

    @abstractmethod
    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions,
        request_id: str,
    ) -> AsyncIterator[TokenEvent]:
        """Async iterator over the request's output, one TokenEvent per engine step that produced
        text; the last event has ``finish_reason`` set and nothing follows it.

        ``request_id`` is unique among live requests. Closing the iterator early (or cancelling
        the task consuming it) must release the request, like ``abort``. Errors the user caused
        raise RequestError or ValueError; anything else is an engine failure.
        """

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop ``request_id`` and free its KV pages. Unknown or finished ids are a no-op."""

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """A snapshot for /metrics and ``lockserve status``. Known keys (all optional):

        queue_len (int, waiting requests), running (int, requests being decoded),
        hit_rate (float in [0, 1], GPU hot-page cache hits / lookups),
        bytes_per_tier (dict tier -> int bytes of KV pages held there),
        capacity_used (float in [0, 1], fraction of KV page capacity in use).
        Any other int/float key is exported as the gauge ``lockserve_engine_<key>``.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release what the engine holds (actors, shared memory). Called once when serving ends."""
