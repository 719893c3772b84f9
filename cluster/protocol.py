"""OpenAI-compatible request and response bodies (pydantic models).

Requests are validated in strict mode, so ``"max_tokens": "10"`` or ``true`` is a
type error rather than silently coerced. Unknown top-level fields are ignored
(OpenAI clients send fields this server has no use for, e.g. ``user``), but
fields that would change the output and are not implemented (``n > 1``, logprobs,
penalties, tools) are rejected by ``unsupported_fields`` with a message naming them.
The ``lockserve`` object carries this project's per-request extras and forbids
unknown keys, so a typo there is an error.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from lockserve.configs.schema import AttentionMode, Tier
from pydantic import BaseModel, ConfigDict, Field, model_serializer

# Friendly type descriptions for fields whose pydantic error would list union members.
FIELD_TYPES: dict[str, str] = {
    "prompt": "a string or a list of token ids (integers >= 0)",
    "stop": "a string, a list of strings, or null",
    "messages": "a list of {role, content} objects",
}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class LockserveOptions(BaseModel):
    """Per-request LOCKS extras: ``{"lockserve": {"budget_tokens": 1024, "tier": "host"}}``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    budget_tokens: int | None = Field(None, description="tokens attended per KV head per decode step")
    tier: Tier | None = Field(None, description="where this request's KV pages live")
    attention: AttentionMode | None = Field(None, description="locks (sparse) or dense")


class StreamOptions(_Request):
    include_usage: bool = False


class _GenerationRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM-compatible); 0 = off
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM-compatible)
    ignore_eos: bool = False  # extension (vLLM-compatible): run to max_tokens (benchmarks, load tests)
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    budget_tokens: int | None = None  # shorthand for lockserve.budget_tokens
    lockserve: LockserveOptions | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, reason) for every field set to a value this server does not implement."""
        found = []
        if self.n not in (None, 1):
            found.append(("n", f"n ({self.n}) is not supported; only n = 1"))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                found.append((name, f"{name} ({value}) is not supported; only 0"))
        if self.logit_bias:
            found.append(("logit_bias", "logit_bias is not supported"))
        return found

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. ``prompt`` is text or token ids; a one-element list of either is unwrapped."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        found = super().unsupported_fields()
        if self.echo:
            found.append(("echo", "echo is not supported"))
        if self.logprobs is not None:
            found.append(("logprobs", "logprobs is not supported"))
        if self.suffix:
            found.append(("suffix", "suffix is not supported"))
        if self.best_of not in (None, 1):
            found.append(("best_of", f"best_of ({self.best_of}) is not supported; only 1"))
        return found


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients send this instead of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported_fields(self) -> list[tuple[str, str]]:
        found = super().unsupported_fields()
        if self.logprobs:
            found.append(("logprobs", "logprobs is not supported"))
        if self.top_logprobs:
            found.append(("top_logprobs", "top_logprobs is not supported"))
        if self.tools:
            found.append(("tools", "tools are not supported"))
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            kind = self.response_format.get("type")
            found.append(("response_format", f"response_format type {kind!r} is not supported; only 'text'"))
        return found


# ----- responses -----------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI's field)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )

    @classmethod
    def of_event(cls, event) -> UsageInfo:
        """The usage a request's last TokenEvent reports."""
        return cls.of(event.prompt_tokens, event.completion_tokens, event.cached_tokens)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    """Body of a non-streaming completion; also each streamed chunk (then ``usage`` is None
    except on the final usage-only chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A streamed chat delta; unset fields are left out (``{}`` on the finish chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "lockserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
