"""scripts/beside_step_probe.py on the CPU (the tiny preset): the step's parts add up to its
total, the host part of execute is never more than execute, and cProfile names the engine's own
Python functions. A check that the script runs, not a figure."""
from __future__ import annotations

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
                    "--steps", "2", "--profile-steps", "1", "--cprofile", "2", "--out", str(out)],
                   env=env, check=True, capture_output=True, text=True, timeout=300)
    got = json.loads(out.read_text())
    for name in ("alone", "first", "late"):
        row = got[name]
        assert abs(sum(row[p] for p in PARTS) - row["total"]) < 1e-6 * max(1.0, row["total"]), name
        assert 0 < row["execute_host"] <= row["execute"], name
    assert got["alone"]["prefill_tokens"] == 0 and got["first"]["prefill_tokens"] == 64
    python = {name for name, _, _ in got["top_python_ms"]}
    assert len(got["top_python_ms"]) == 30 and all(ms >= 0 for _, ms, _ in got["top_python_ms"])
    assert any(n.startswith(("attention.py", "model.py", "runner.py", "fused.py")) for n in python), python
