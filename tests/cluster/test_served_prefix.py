"""Prefix reuse as a user meets it: `lockserve serve` with its defaults (the embedded SmolLM2 on
CPU, prefix reuse on), a chat about a ~3K-token document asked twice and then with another
question. The repeat and the new question reuse the document's pages: each takes at most a third
of the first request's time, reports `usage.prompt_tokens_details.cached_tokens` >= 90% of its
prompt (streamed with include_usage too), and the repeat answers as the first did."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import openai
import pytest

from tests.cluster.test_served_default import CLI, env, read_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"


def document() -> str:
    """About 3K tokens of facts a question can point into."""
    lines = [f"Locker {i} holds the {colour} box number {(i * 7919) % 1000}."
             for i, colour in zip(range(180), ["red", "green", "blue", "amber"] * 45, strict=True)]
    return "Inventory of the lockers.\n" + "\n".join(lines)


def ask(client: openai.OpenAI, question: str) -> tuple[str, int, int, float]:
    """(answer, prompt tokens, cached tokens, seconds) of one greedy chat request."""
    start = time.perf_counter()
    reply = client.chat.completions.create(
        model=MODEL, max_tokens=24, temperature=0,
        messages=[{"role": "user", "content": f"{document()}\n\nQuestion: {question}"}])
    seconds = time.perf_counter() - start
    usage = reply.usage
    return reply.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, \
        seconds


def test_a_document_asked_twice_and_then_again_reuses_its_pages(tmp_path):
    seen: list[str] = []
    proc = subprocess.Popen([*CLI, "serve", "--port", "0"], cwd=tmp_path, env=env(), stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        url = read_until(proc, "lockserve: serving", 300, seen).rsplit(" at ", 1)[1].strip()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        first, prompt, cached, cold_s = ask(client, "Which box does locker 17 hold?")
        assert prompt > 2500 and cached == 0, (prompt, cached)
        again, prompt2, cached2, again_s = ask(client, "Which box does locker 17 hold?")
        other, prompt3, cached3, other_s = ask(client, "What colour is the box in locker 201?")
        print(f"\nserved SmolLM2, {prompt}-token chat: cold {cold_s:.2f} s, repeat {again_s:.2f} s "
              f"(cached {cached2}), new question {other_s:.2f} s (cached {cached3} of {prompt3})")
        assert again == first, "the repeat answered differently"
        assert cached2 >= 0.9 * prompt2 and cached3 >= 0.9 * prompt3, (cached2, prompt2, cached3, prompt3)
        assert again_s <= cold_s / 3 and other_s <= cold_s / 3, (cold_s, again_s, other_s)

        stream = client.chat.completions.create(
            model=MODEL, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "user", "content": f"{document()}\n\nQuestion: Which locker is last?"}])
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1, usage
        assert usage[0].prompt_tokens_details.cached_tokens >= 0.9 * usage[0].prompt_tokens, usage
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
