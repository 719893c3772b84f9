"""scripts/served_tpot.py end to end on CPU: the tiny model served through local Ray and real HTTP,
then decoded in process; its JSON must say the served text is the engine's and count every token."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import ray

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "served_tpot.py"


def load_script():
    spec = importlib.util.spec_from_file_location("served_tpot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_served_tokens_and_times_against_the_engine(tmp_path, monkeypatch):
    assert not ray.is_initialized(), "another test left Ray running"
    monkeypatch.setenv("LOCKSERVE_API_KEY", "bench-key")  # the script must send it, /metrics included
    out = tmp_path / "served.json"
    config = SCRIPT.parents[1] / "configs" / "serve-cpu.yaml"
    argv = [str(out), "--config", str(config), "--set", "model.source=preset:tiny",
            "--prompt-tokens", "300", "--max-tokens", "6", "--requests", "2"]
    assert load_script().main(argv) == 0
    assert not ray.is_initialized(), "the script must stop the Ray it started"
    got = json.loads(out.read_text())
    assert got["same_text_as_engine"], (got["served"]["requests"], got["engine"]["text"])
    requests = got["served"]["requests"]
    assert len(requests) == 2 and all(r["completion_tokens"] == 6 for r in requests)
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in requests)
    # the server timed 5 gaps of each request: its histogram counted both
    assert got["served"]["server_histogram"]["count"] == 2 * 5
    assert got["engine"]["tpot_ms"] > 0 and got["engine"]["prefill_ms"] > 0
    assert got["served_over_engine_tpot"] == got["served"]["tpot_ms_median"] / got["engine"]["tpot_ms"]
    assert 280 <= got["prompt_tokens"] <= 320
    assert got["commit"] and got["date"]


def test_refuses_a_single_request():
    with pytest.raises(SystemExit):
        load_script().parse_args(["x.json", "--requests", "1"])
