"""The contract between the HTTP front end and whatever generates tokens.

The server (``cluster/server.py``) only ever talks to an ``EngineClient``. The
real implementation drives the Ray ``GpuWorker`` actors; tests plug in a small
deterministic engine. Request-level values are plain dataclasses validated on
construction: a bad value raises ``ValueError`` naming the field and the value,
which the server turns into a 400.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# The engine's own request types, validated on construction (errors name field and value): the
# HTTP layer builds them, Ray carries them as they are, the engine samples with them.
from lockserve.workers.engine.request import RequestOptions, TokenEvent
from lockserve.workers.engine.sampling import SamplingParams

FINISH_REASONS = ("stop", "length")
class RequestError(Exception):
    """A request the engine refuses; the server answers with ``status`` and ``message``.

    ``param`` names the offending request field when there is one (e.g. "max_tokens");
    ``retry_after`` (seconds) becomes a Retry-After header: the request may succeed later.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        if not 400 <= status <= 599:
            raise ValueError(f"status ({status}) must be an HTTP error status in [400, 599]")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after


class WorkerUnavailable(RequestError):
    """No worker can take the request now (all restarting, or the one serving it died): a 503 with
    Retry-After. The request itself was fine; sent again later it can succeed."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(503, message, code="worker_unavailable", retry_after=retry_after)


# JSON escapes a byte of text in at most 6 bytes (a control character becomes "\u0001").
JSON_BYTES_PER_TEXT_BYTE = 6
BODY_OVERHEAD_PER_TOKEN = 32  # a chat message per token at worst: {"role": "user", "content": ...}
BODY_OVERHEAD = 1 << 20


@dataclass(frozen=True)
class PromptBounds:
    """What the front end can decide about a prompt before tokenising it.

    ``context_tokens``: prompt + max_tokens never exceeds this (the model's positions and the KV
    capacity); ``max_chars_per_token``: no token covers more characters of text than this (the
    longest token of the vocabulary, in UTF-8 bytes, which bound its characters). So a text of n
    characters is at least ceil(n / max_chars_per_token) tokens, whatever the tokenizer does.
    """

    context_tokens: int
    max_chars_per_token: int

    def __post_init__(self) -> None:
        if self.context_tokens < 1 or self.max_chars_per_token < 1:
            raise ValueError(f"context_tokens ({self.context_tokens}) and max_chars_per_token "
                             f"({self.max_chars_per_token}) must be >= 1")

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of ``text``, in O(1)."""
        return math.ceil(len(text) / self.max_chars_per_token)

    def body_limit(self) -> int:
        """The largest request body whose prompt could still fit: a context full of the longest
        token, every byte JSON-escaped at worst, a chat message per token, plus 1 MiB."""
        per_token = self.max_chars_per_token * JSON_BYTES_PER_TEXT_BYTE + BODY_OVERHEAD_PER_TOKEN
        return self.context_tokens * per_token + BODY_OVERHEAD


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

    def tokenize_chat(self, prompt: str) -> list[int]:
        """Token ids of a prompt rendered by ``apply_chat_template``: no BOS is added, the template
        writes its own (as transformers' ``apply_chat_template(tokenize=True)`` does)."""
        return self.tokenize(prompt)

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

    def prompt_bounds(self) -> PromptBounds | None:
        """Bounds that let the server refuse a hopeless prompt before tokenising it and derive its
        body limit; None when the engine has none (then server.max_body_bytes must be set)."""
        return None

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's own defaults for "temperature", "top_p", "top_k" (those it sets), used when a
        request leaves them out; the OpenAI API's (1, 1, off) otherwise."""
        return {}

    def health(self) -> dict[str, Any]:
        """{"ready": workers able to take a request now, "total": workers, ...}. The default reads
        one stats() call: one worker, ready when stats() answers."""
        try:
            self.stats()
        except Exception as err:  # health reports engine trouble instead of raising it
            return {"ready": 0, "total": 1, "error": repr(err)}
        return {"ready": 1, "total": 1}

    def close(self) -> None:  # noqa: B027 - optional hook, deliberately not abstract
        """Release what the engine holds (actors, shared memory). Called once when serving ends."""
