"""A new user's first minutes, with the real default model (SmolLM2-135M-Instruct on CPU):
`lockserve serve` with no flag but a free port (local Ray, CPU workers, the host arena sized from
the memory free), prefix reuse as a user meets it, the README's first examples sent as written, and
`lockserve generate --prompt "The capital of France is" --max-tokens 8` with no other flag.

One `lockserve serve` serves the module (it takes ~27 s to come up on 2 cores): the prefix test
runs first (its first request must find nothing cached, and the README's chat shares the chat
template's first page with it), the README test last (it stops the server with SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "lockserve.cluster.cli"]
MODEL = "SmolLM2-135M-Instruct"


def readme_curl_body() -> dict:
    """The JSON body of the README's first curl example, as a user would paste it."""
    readme = (REPO / "README.md").read_text()
    match = re.search(r"curl -s http://127\.0\.0\.1:8000/v1/chat/completions.*?-d '(\{.*?\})'", readme, re.S)
    assert match, "the README's first example (curl .../v1/chat/completions -d '...') is missing"
    return json.loads(match.group(1))


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("RAY_ADDRESS", "LOCKSERVE_API_KEY"):
        out.pop(name, None)
    return out


def read_until(proc: subprocess.Popen, needle: str, timeout_s: float, seen: list[str]) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if ready:
            line = proc.stderr.readline()
            if line:
                seen.append(line.rstrip())
            if needle in line:
                return line
            if not line and proc.poll() is not None:
                break
    tail = "\n".join(seen[-30:])
    raise AssertionError(f"no {needle!r} from lockserve serve (exit {proc.poll()}):\n{tail}")


@dataclass
class Served:
    """`lockserve serve --port 0` started with its defaults: its process, URL, stderr lines (read on
    in a thread once it serves, so that the pipe never fills) and /dev/shm's names before it."""

    proc: subprocess.Popen
    url: str
    seen: list[str]
    shm_before: set[str]


def drain(proc: subprocess.Popen, seen: list[str]) -> None:
    for line in proc.stderr:
        seen.append(line.rstrip())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    seen: list[str] = []
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([*CLI, "serve", "--port", "0"], cwd=tmp_path_factory.mktemp("serve"), env=env(),
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = read_until(proc, "lockserve: serving", 300, seen).rsplit(" at ", 1)[1].strip()
        threading.Thread(target=drain, args=(proc, seen), name="serve-stderr", daemon=True).start()
        yield Served(proc, url, seen, shm_before)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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


def test_a_document_asked_twice_and_then_again_reuses_its_pages(served):
    """Prefix reuse as a user meets it (prefix reuse is on by default): a chat about a ~3K-token
    document asked twice and then with another question. The repeat and the new question reuse the
    document's pages: each takes at most a third of the first request's time, reports
    `usage.prompt_tokens_details.cached_tokens` >= 90% of its prompt (streamed with include_usage
    too), and the repeat answers as the first did."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)
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


def test_readme_examples_against_the_served_default(served):
    """Last in the module: it stops the server."""
    proc, url, seen, shm_before = served.proc, served.url, served.seen, served.shm_before
    try:
        assert any("no GPU on this machine: serving on CPU workers" in line for line in seen), seen
        arena = [line for line in seen if "host arena" in line]
        assert arena and "auto" in arena[0], seen

        answer = httpx.post(url + "/v1/chat/completions", json=readme_curl_body(), timeout=120)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert "Paris" in text, f"the README's first example answered {text!r}"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL]
        stream = client.chat.completions.create(
            model=MODEL, max_tokens=64, stream=True,
            messages=[{"role": "user", "content": "Write a haiku about page tables."}],
            extra_body={"lockserve": {"budget_tokens": 256}},
        )
        chunks = list(stream)
        haiku = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(haiku.split()) >= 5 and chunks[-1].choices[0].finish_reason in ("stop", "length"), haiku

        remote = subprocess.run([*CLI, "generate", "--url", url, "--prompt", "The capital of France is",
                                 "--max-tokens", "8"], env=env(), capture_output=True, text=True, timeout=120)
        assert remote.returncode == 0 and "Paris" in remote.stdout, (remote.stdout, remote.stderr)

        health = httpx.get(url + "/health", timeout=10).json()
        assert health["status"] == "ok" and health["ready"] == health["total"] == 1, health
        family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}  # Ray, its actors
        ours = {n for n in set(os.listdir("/dev/shm")) - shm_before
                if n.startswith("lockserve-arena.") and int(n.split(".")[2]) in family}
        assert ours, "the served default keeps its KV pages in a shared-memory segment"
        for name in ours:
            assert os.stat(f"/dev/shm/{name}").st_mode & 0o777 == 0o600, name
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, "\n".join(seen[-20:])
        left = ours & set(os.listdir("/dev/shm"))
        assert left == set(), f"segments left in /dev/shm after shutdown: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_generate_with_no_other_flag_says_paris(tmp_path):
    done = subprocess.run([*CLI, "generate", "--prompt", "The capital of France is", "--max-tokens", "8"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout, f"lockserve generate answered {done.stdout!r}"
    assert re.search(r"\[finish: length, \d+ prompt \+ 8 completion tokens", done.stderr), done.stderr[-500:]
