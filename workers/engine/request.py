"""What crosses the boundary between a request's client and the engine, one type each way:
`RequestOptions` in (validated once, where it is made: the HTTP layer or a caller of the engine),
`TokenEvent` out (one per step that produced output). Ray carries both as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

from lockserve.configs.schema import ATTENTION_MODES, TIERS

from .sampling import require_int
from .sequence import StepOutput


@dataclass
class RequestOptions:
    """Per-request LOCKS overrides; None keeps the engine's configured value. budget_tokens: tokens
    attended per KV head per step; attention: "locks" or "dense" (dense for one request needs tier
    hbm); tier: one of configs.TIERS, and the engine's own (the tier is per engine). A bad value
    raises ValueError naming the field and the value (the server answers 400)."""

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

    @classmethod
    def coerce(cls, value: RequestOptions | dict | None) -> RequestOptions:
        """value itself, the defaults for None, or a dict's fields (validated)."""
        if value is None or isinstance(value, cls):
            return value or cls()
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"options ({type(value).__name__}) must be RequestOptions, a dict or None")


@dataclass
class TokenEvent:
    """One step of a request's output.

    text: the new text since the previous event (a delta, possibly empty while a multi-byte
    character is incomplete); token_ids: the new tokens. finish_reason: None except on the last
    event ("stop" or "length"). prompt_tokens and completion_tokens: running totals for the
    request; cached_tokens: prompt tokens whose KV the engine reused from its prefix cache.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @classmethod
    def of(cls, out: StepOutput) -> TokenEvent:
        return cls(out.text, list(out.token_ids), out.finish_reason, out.num_prompt_tokens,
                   out.num_output_tokens, out.num_cached_tokens)
