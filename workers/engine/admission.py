"""Admission: whether an engine can ever serve a request, decided from a few of its numbers.

`EngineLimits` holds what the rules read. The Engine builds one when it is made and checks every
request with it; a GpuWorker hands the same object to the front end, so the HTTP server refuses
exactly what the engine would, with the same messages (each starts with the field it names), and
answers 400 before any work starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lockserve.configs.schema import ATTENTION_MODES
from lockserve.kernels import budget_pages


def locks_budget_pages(budget_tokens: int, page_size: int, sink_pages: int, recent_pages: int) -> int:
    """Pages of a LOCKS budget of budget_tokens. ValueError when the sink and recent pages, which
    every selection keeps, already use all of it."""
    pages, fixed = budget_pages(budget_tokens, page_size), sink_pages + recent_pages
    if pages <= fixed:
        raise ValueError(
            f"budget_tokens ({budget_tokens}) must exceed sink_pages + recent_pages ({fixed} pages = "
            f"{fixed * page_size} tokens): LOCKS must have a page to choose")
    return pages


@dataclass(frozen=True)
class EngineLimits:
    """The numbers the admission rules read; plain data, so it crosses Ray as is.

    max_model_len: cap on prompt + max_tokens; pages_capacity: page ids of KV capacity;
    tier, attention, budget_tokens: the engine's cache config; budget_pages: budget_tokens in
    pages. Every check raises ValueError naming field and value, and changes nothing.
    """

    vocab_size: int
    max_model_len: int
    page_size: int
    pages_capacity: int
    tier: str
    attention: str
    budget_tokens: int
    budget_pages: int
    sink_pages: int
    recent_pages: int

    def check(self, prompt_tokens: int, max_tokens: int, budget_tokens: int | None = None,
              attention: str | None = None, tier: str | None = None) -> int | None:
        """Refuse a prompt of prompt_tokens tokens with these options that the engine can never
        serve. Returns the request's LOCKS page budget (None = attend every page)."""
        if prompt_tokens < 1:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        budget = self.request_budget(budget_tokens, attention, tier)
        self.check_length(prompt_tokens, max_tokens)
        return budget

    def check_prompt_ids(self, prompt_ids) -> list[int]:
        """The prompt as a list of ints; refuses an empty one and ids outside the vocabulary."""
        prompt = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: a request needs at least one prompt token")
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt_ids[{i}] ({t!r}) must be a token id in [0, {self.vocab_size})")
        return prompt

    def check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse prompt + max_tokens beyond the model's positions or the KV capacity."""
        total = prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"model's maximum length ({self.max_model_len} positions)")
        need = math.ceil(total / self.page_size)
        if need > self.pages_capacity:
            raise ValueError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} KV pages of "
                f"{self.page_size} tokens, more than the engine's capacity ({self.pages_capacity} pages)")

    def request_budget(self, budget_tokens: int | None = None, attention: str | None = None,
                       tier: str | None = None) -> int | None:
        """A request's LOCKS page budget (None = attend every page); refuses a tier other than the
        engine's, dense for one request off tier hbm, a page selector other than the engine's, and a
        budget the engine cannot serve."""
        if tier is not None and tier != self.tier:
            raise ValueError(f"tier ({tier!r}) differs from the engine's tier ({self.tier!r}); "
                             "the tier is chosen per engine")
        mode = attention or self.attention
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention ({mode!r}) must be one of {', '.join(ATTENTION_MODES)}")
        if mode not in ("dense", "locks", self.attention):
            raise ValueError(f"attention ({mode!r}) for one request must be 'dense' or the engine's "
                             f"attention ({self.attention!r}): the page selector is chosen per engine")
        if mode == "locks" and self.attention not in ("locks", "dense"):
            raise ValueError(f"attention ('locks') for one request needs a locks engine, not "
                             f"{self.attention!r}")
        if mode == "dense":
            if self.attention != "dense" and self.tier != "hbm":
                raise ValueError(f"attention ('dense') for one request needs tier 'hbm', not {self.tier!r}")
            return None
        if self.attention == "dense" and self.tier != "hbm":
            raise ValueError(
                f"attention ('locks') for one request needs a locks engine on tier {self.tier!r}")
        if budget_tokens is None:
            return self.budget_pages
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens <= 0:
            raise ValueError(f"budget_tokens ({budget_tokens!r}) must be a positive integer")
        pages = locks_budget_pages(budget_tokens, self.page_size, self.sink_pages, self.recent_pages)
        # NOTE: off tier hbm the engine's budget sizes the hot-page cache, so a request may not exceed it.
        if self.tier != "hbm" and pages > self.budget_pages:
            raise ValueError(f"budget_tokens ({budget_tokens}) exceeds the engine's budget_tokens "
                             f"({self.budget_tokens}), which sizes the hot-page cache of tier {self.tier!r}")
        return pages
