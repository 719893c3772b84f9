"""Passkey retrieval: the prompt builder (fast), and SmolLM2 finding the key in a 3K-token
essay under dense attention and under LOCKS on the host tier at a 384-token budget (slow)."""

from __future__ import annotations

import time

import pytest
import torch
from lockserve.cluster.measure.eval.passkey import (
    NEEDLE,
    build_passkey_prompt,
    haystack_path,
    haystack_text,
    passkey_found,
)
from lockserve.workers.api import LLM
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.tokenizer import byte_level_tokenizer

DEPTHS = ((0.1, "68213"), (0.5, "40917"), (0.9, "73058"))
CONTEXT = 3072  # tokens; the budget is an eighth of it (384, whole pages)


def test_haystack_is_the_installed_essays():
    assert haystack_path().name == "PaulGrahamEssays.json"
    assert len(haystack_text()) > 100_000


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_sits_at_the_requested_depth(depth):
    tok = byte_level_tokenizer()  # one token per byte: positions are exact
    p = build_passkey_prompt(tok, 3000, depth, passkey="12345", chat=False)
    text = tok.decode(p.prompt_ids)
    needle = NEEDLE.format(key="12345")
    assert text.count(needle) == 1 and p.passkey == "12345"
    assert abs(len(p.prompt_ids) - 3000) <= 64
    at = text.index(needle) / len(text)
    assert abs(at - depth) < 0.06, (at, depth)


def test_builder_rejects_bad_arguments():
    tok = byte_level_tokenizer()
    with pytest.raises(ValueError, match=r"depth \(1.5\)"):
        build_passkey_prompt(tok, 3000, 1.5)
    with pytest.raises(ValueError, match=r"passkey \('12a'\)"):
        build_passkey_prompt(tok, 3000, 0.5, passkey="12a")
    with pytest.raises(ValueError, match=r"context_tokens \(10\)"):
        build_passkey_prompt(tok, 10, 0.5)


def test_passkey_found_wants_the_whole_number():
    assert passkey_found(" 68213.", "68213") and passkey_found("is 68213", "68213")
    assert not passkey_found("682134", "68213") and not passkey_found("6821", "68213")


@pytest.mark.slow
@pytest.mark.parametrize("attention,tier", [("dense", "hbm"), ("locks", "host")])
def test_smollm2_finds_the_passkey(attention, tier):
    """3K-token prompts. LOCKS: three depths decoded together, about 55 s on a 2-core CPU (the
    prefill of 9K tokens of a 135M model dominates); the 384-token budget is an eighth of each
    context: LOCKS prunes seven pages in eight. Dense, the control that the prompt and the model
    can find the key at all: the middle depth alone (20 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    start = time.time()
    with LLM("default", attention=attention, tier=tier, budget_tokens=CONTEXT // 8, device="cpu",
             kv_capacity_tokens=3 * (CONTEXT + 64), max_num_seqs=3, prefill_chunk=1024,
             max_num_batched_tokens=3072, hot_cache_pages=3 * 3 * 32, host_capacity_gib=1.0) as llm:
        depths = DEPTHS if attention == "locks" else DEPTHS[1:2]
        prompts = [build_passkey_prompt(llm.tokenizer, CONTEXT, depth, key) for depth, key in depths]
        greedy = SamplingParams(temperature=0, max_tokens=8)
        completions = llm.generate([p.prompt_ids for p in prompts], greedy)
        stats = llm.stats()
    found = {p.depth: (c.text, passkey_found(c.text, p.passkey))
             for p, c in zip(prompts, completions, strict=True)}
    assert all(ok for _, ok in found.values()), f"{attention}/{tier}: {found}"
    if tier != "hbm":
        assert stats["cache_hits"] + stats["cache_misses"] > 0
    print(f"{attention}/{tier}: {found} in {time.time() - start:.0f}s")
