"""scripts/detached.sh: a command started in its own process session outlives the shell that
started it, is waited for with a deadline, and its files, log and exit status are collected."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "detached.sh"


def detached(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DETACHED_ROOT": str(root)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)


def test_a_command_outlives_its_starter_and_is_collected_with_its_status(tmp_path):
    root, dest = tmp_path / "runs", tmp_path / "out"
    gate = tmp_path / "gate"
    body = (f'echo started; while [ ! -f {gate} ]; do sleep 0.1; done; '
            f'echo \'{{"x": 1}}\' > "$1/r.json"; exit 3')
    assert detached(root, "start", "job", "--", "bash", "-c", body, "sh", "$DIR").returncode == 0
    # the starter has returned; the command still runs, waiting for the gate
    waited = detached(root, "wait", "job", "1")
    assert waited.returncode == 3 and "still running" in waited.stdout and "started" in waited.stdout
    assert detached(root, "collect", "job", str(dest)).returncode == 3 and not dest.exists()
    again = detached(root, "start", "job", "--", "true")
    assert again.returncode == 2 and "is running" in again.stderr
    gate.touch()
    waited = detached(root, "wait", "job", "30")
    assert waited.returncode == 0 and "exit status 3" in waited.stdout
    assert detached(root, "collect", "job", str(dest)).returncode == 0
    assert (dest / "r.json").read_text().strip() == '{"x": 1}'
    assert (dest / "job.rc").read_text().strip() == "3" and "started" in (dest / "job.log").read_text()


def test_a_killed_command_is_reported_not_waited_for(tmp_path):
    root = tmp_path / "runs"
    assert detached(root, "start", "job", "--", "sleep", "30").returncode == 0
    os.kill(int((root / "job" / "pid").read_text()), signal.SIGKILL)
    waited = detached(root, "wait", "job", "20")
    assert waited.returncode == 1 and "without an exit status" in waited.stderr


def test_wrong_use_says_how():
    assert detached(Path("/nonexistent"), "start", "job", "true").returncode == 2
    missing = detached(Path("/nonexistent"), "wait", "nothing", "1")
    assert missing.returncode == 2 and "nothing started as nothing" in missing.stderr
