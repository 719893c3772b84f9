"""A new user's first minutes, with the real default model (SmolLM2-135M-Instruct on CPU):
`lockserve serve` with no flag but a free port (local Ray, CPU workers, the host arena sized from
the memory free), the README's first examples sent as written, and
`lockserve generate --prompt "The capital of France is" --max-tokens 8` with no other flag."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "lockserve.cluster.cli"]


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


def test_readme_examples_against_the_served_default(tmp_path):
    seen: list[str] = []
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([*CLI, "serve", "--port", "0"], cwd=tmp_path, env=env(), stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        url = read_until(proc, "lockserve: serving", 300, seen).rsplit(" at ", 1)[1].strip()
        assert any("no GPU on this machine: serving on CPU workers" in line for line in seen), seen
        arena = [line for line in seen if "host arena" in line]
        assert arena and "auto" in arena[0], seen

        answer = httpx.post(url + "/v1/chat/completions", json=readme_curl_body(), timeout=120)
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert "Paris" in text, f"the README's first example answered {text!r}"

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=64, stream=True,
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
