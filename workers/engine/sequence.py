"""One request's state in the engine: tokens, KV pages, output text, and what a step returns.

Token bookkeeping: `tokens = prompt_ids + output_ids`; the first `num_computed` of them have
their K/V in the cache. A step processes `tokens[num_computed : num_computed + n]`; when that
reaches the end of `tokens`, the step also samples the next token from the last hidden state.
KV pages: `pids[j]` is the page id of the sequence's j-th page (all reserved at admission,
enough for prompt + max_tokens), so a running sequence never waits for memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling import SamplingParams, check_stop, stop_prefix_len


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class StepOutput:
    """What one step produced for one request.

    token_ids: the new token ids (0 or 1 per step; a stop token id is included).
    text: new output text since the previous StepOutput (stop strings and the text of stop
    tokens are never included; a suffix that could start a stop string is held back until it
    cannot). finish_reason: None while running, else "stop", "length" or "abort".
    """

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class Sequence:
    """A request inside the engine (plain state; the scheduler and engine mutate it)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    detokenizer: Any  # push(token_id) -> text delta; flush() -> held-back text (tokenizer.detokenizer)
    stop_ids: frozenset[int]  # params.stop_token_ids, plus the tokenizer's EOS ids unless ignore_eos
    budget_pages: int | None  # LOCKS page budget k; None = attend every page (dense)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    pids: list[int] = field(default_factory=list)
    pid_tensor: torch.Tensor | None = None  # pids on the device (attention.pid_tensor)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""  # output text so far, truncated at a stop string once one is found
    emitted: int = 0  # characters of `text` already returned in StepOutputs
    # Prefix reuse (prefix_cache.py): whether admission may reuse cached pages and the pages may be
    # shared (False for stand-in fills, whose K/V are not the model's); prompt tokens reused at
    # admission; leading pages the prefix cache holds for this sequence (pids[:num_shared]); the
    # chain hashes of its full pages so far.
    reuse_prefix: bool = True
    num_cached: int = 0
    num_shared: int = 0
    page_digests: list[bytes] = field(default_factory=list)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        n = self.num_prompt
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:  # decode: never copy a long prompt
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def append_token(self, token_id: int) -> StepOutput:
        """Record a sampled token, apply the stop rules, and return this step's output."""
        self.output_ids.append(token_id)
        delta = self.detokenizer.push(token_id)
        self.text += delta
        stop = check_stop(token_id, len(self.output_ids), self.text, len(delta), self.params, self.stop_ids)
        if stop is not None:
            if stop.reason == "length":
                self.text += self.detokenizer.flush()  # an incomplete character at the very end
            elif stop.text_end is not None:
                self.text = self.text[: stop.text_end]
            self.status = SequenceStatus.FINISHED
            self.finish_reason = stop.reason
        return self.make_output([token_id])

    def make_output(self, token_ids: list[int]) -> StepOutput:
        end = len(self.text)
        if not self.finished and self.params.stop:
            end -= stop_prefix_len(self.text, self.params.stop)  # may become a stop string
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return StepOutput(
            request_id=self.request_id,
            token_ids=token_ids,
            text=delta,
            finished=self.finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=self.num_prompt,
            num_output_tokens=len(self.output_ids),
            num_cached_tokens=self.num_cached,
        )
