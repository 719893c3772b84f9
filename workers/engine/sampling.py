"""Sampling parameters, the per-step sampler, and the stop rules.

The sampler runs on the logits' device with no host synchronisation: greedy rows
take an argmax; the others are temperature-scaled, filtered by top-k and top-p, and
drawn by an exponential race (argmax of p / E with E ~ Exp(1), which is a draw from
p) whose noise comes from the request's own `torch.Generator`. Each request draws
exactly one noise row of size vocab per sampled token, so its tokens do not depend
on which other requests share the batch. The engine makes the single host transfer
of the sampled ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .uploads import upload

_MAX_SEED = 2**63 - 1


def require_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} ({value!r}) must be an integer")


def _require_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} ({value!r}) must be a finite number")


@dataclass
class SamplingParams:
    """How one request picks tokens. Invalid values raise ValueError naming field and value.

    temperature: 0 = greedy (argmax), else logits / temperature.
    top_p: nucleus mass in (0, 1]; 1 = off.   top_k: keep the k best; 0 = off.
    max_tokens: completion tokens at most (>= 1).   seed: per-request generator seed.
    stop: strings that end generation when they appear in the text (not returned).
    stop_token_ids: token ids that end generation (the id is returned, its text is not).
    ignore_eos: keep going past the tokenizer's end-of-sequence token.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        require_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1")
        _require_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0")
        _require_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p ({self.top_p}) must be in (0, 1]")
        require_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k ({self.top_k}) must be >= 0 (0 = off)")
        if self.seed is not None:
            require_int("seed", self.seed)
            if not 0 <= self.seed <= _MAX_SEED:
                raise ValueError(f"seed ({self.seed}) must be in [0, 2**63 - 1]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop ({self.stop!r}) must be a list of non-empty strings")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        for token_id in self.stop_token_ids:
            require_int("stop_token_ids[]", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids ({self.stop_token_ids!r}) must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def coerce(cls, value) -> SamplingParams:
        """None -> defaults; a dict -> fields; another object with the same field names (e.g. the
        HTTP layer's params) -> a validated copy of those fields."""
        if value is None or isinstance(value, cls):
            return value if value is not None else cls()
        if isinstance(value, dict):
            return cls(**value)
        names = [f.name for f in fields(cls)]
        return cls(**{n: getattr(value, n) for n in names if hasattr(value, n)})


def make_generator(params: SamplingParams, device: torch.device, fallback: torch.Generator
                   ) -> torch.Generator:
    """The request's own generator on `device`: seeded by params.seed, else by a draw from `fallback`
    (the engine's CPU generator, so unseeded runs are still reproducible from the engine seed)."""
    seed = params.seed
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,), generator=fallback).item())
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> torch.Tensor:
    """One token per row. logits: [N, V] float32 -> token ids [N] int64 on logits.device.

    Row i follows params[i] and draws its noise from generators[i] (only if it samples).
    """
    n, vocab = logits.shape
    if len(params) != n or len(generators) != n:
        raise ValueError(f"expected {n} params and generators, got {len(params)} and {len(generators)}")
    greedy_ids = logits.argmax(dim=-1)  # [N]
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled_rows:
        return greedy_ids
    rows = upload(sampled_rows, device=logits.device)
    sub = params_subset(params, sampled_rows)
    probs = filtered_probs(logits.index_select(0, rows), sub, logits.device)  # [Ns, V]
    noise = torch.stack(
        [torch.empty(vocab, device=logits.device).exponential_(generator=generators[i]) for i in sampled_rows]
    )  # [Ns, V]
    drawn = (probs / noise).argmax(dim=-1)  # [Ns]
    return greedy_ids.index_copy(0, rows, drawn)


def params_subset(params: list[SamplingParams], rows: list[int]) -> list[SamplingParams]:
    return [params[i] for i in rows]


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """Temperature, then top-k, then top-p (on the top-k survivors), then softmax.

    logits: [N, V] -> probs [N, V] float32; filtered-out tokens have probability 0; the best
    token always survives.
    """
    n, vocab = logits.shape
    temp = upload([p.temperature for p in params], device=device, dtype=torch.float32)
    top_k = upload([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = upload([p.top_p for p in params], device=device, dtype=torch.float32)
    scaled = logits.float() / temp[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [N, V]
    rank = torch.arange(vocab, device=device)[None, :]
    keep = rank < top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of strictly better tokens
    keep = keep & (mass_before < top_p[:, None])
    keep[:, 0] = True
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)


@dataclass
class StopDecision:
    """Why and where a sequence stops. reason: "stop" or "length"; text_end: where the returned text
    ends (None = all of it)."""

    reason: str
    text_end: int | None = None


def check_stop(
    token_id: int,
    num_output_tokens: int,
    text: str,
    new_text_len: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
) -> StopDecision | None:
    """Stop rules after one new token. `text` is the output text so far, of which the last
    `new_text_len` characters are new; only a stop string that overlaps the new characters
    is searched for (earlier ones were checked on earlier steps). stop_ids: token ids that end
    the sequence (params.stop_token_ids and, unless ignore_eos, the tokenizer's EOS ids).
    """
    if token_id in stop_ids:
        return StopDecision("stop", text_end=len(text) - new_text_len)
    if params.stop and new_text_len:
        hit = find_stop(text, new_text_len, params.stop)
        if hit is not None:
            return StopDecision("stop", text_end=hit)
    if num_output_tokens >= params.max_tokens:
        return StopDecision("length")
    return None


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string: the text a
    stream must hold back, since the next tokens may complete the stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def find_stop(text: str, new_text_len: int, stops: list[str]) -> int | None:
    """Earliest start of a stop string that ends inside the last new_text_len characters."""
    best = None
    for s in stops:
        start = max(0, len(text) - new_text_len - len(s) + 1)
        pos = text.find(s, start)
        if pos >= 0 and (best is None or pos < best):
            best = pos
    return best
