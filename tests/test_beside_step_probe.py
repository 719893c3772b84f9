"""scripts/beside_step_probe.py on the CPU (the tiny preset): the step's parts add up to its
total, the host part of execute is never more than execute, and cProfile names the engine's own
Python functions. A check that the script runs, not a figure."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("schedule", "plan", "execute", "commit", "sample")


def test_the_probe_splits_mixed_steps_and_profiles_their_python(tmp_path):
    out = tmp_path / "probe.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    subprocess.run([sys.executable, str(REPO / "scripts" / "beside_step_probe.py"), "--device", "cpu",
                    "--model", "tiny", "--context", "1024", "--chunk", "64", "--decoder", "64", "400",
                    "--steps", "2", "--profile-steps", "1", "--cprofile", "2", "--layers", "1",
                    "--busy-steps", "3", "--out", str(out)],
                   env=env, check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(out.read_text())
    for name in ("alone", "first", "late"):
        row = got[name]
        assert abs(sum(row[p] for p in PARTS) - row["total"]) < 1e-6 * max(1.0, row["total"]), name
        assert 0 < row["execute_host"] <= row["execute"], name
    assert got["alone"]["prefill_tokens"] == 0 and got["first"]["prefill_tokens"] == 64
    # the busy phase: engine steps at the late prefix, timed; no GPU here, so no busy share
    busy = got["busy"]
    assert busy["steps"] == 3 and busy["ms_per_step"] > 0 and got["layers"] == 1
    assert busy["prefix"] >= 3 * 1024 // 4
    assert busy["busy_share"] is None and busy["gpu_busy_ms_per_step"] is None
    python = {name for name, _, _ in got["top_python_ms"]}
    assert len(got["top_python_ms"]) == 30 and all(ms >= 0 for _, ms, _ in got["top_python_ms"])
    assert any(n.startswith(("attention.py", "model.py", "runner.py", "fused.py")) for n in python), python


def test_union_counts_overlapping_intervals_once():
    spec = importlib.util.spec_from_file_location("probe", REPO / "scripts" / "beside_step_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.union_us([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0
    assert probe.union_us([(0.0, 10.0), (2.0, 3.0), (4.0, 12.0)]) == 12.0
    assert probe.union_us([]) == 0.0
