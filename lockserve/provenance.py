"""Where a result came from: the provenance every benchmark, experiment and probe writes.

    run_provenance(command_line("-m lockserve.kernels.bench", argv), device)
    -> {"command": [...], "commit": "cbb9c14", "device": "NVIDIA H200", "torch": "2.9.0", "date": "...Z"}

These are the fields `lockserve report` audits (cluster/measure/report_checks.py FIELDS) and
prints (cluster/measure/report.py, harness/tables.py run_header). A file adds its own keys beside
them. The module imports no lockserve module, so the micro-benchmarks beside the kernels and the
offload tiers use it as the measurement commands do without an import against the dependency
direction (cluster -> workers -> offload -> kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["command_line", "device_name", "run_provenance", "source_commit", "utc_date"]


def source_commit() -> str | None:
    """$LOCKSERVE_COMMIT when set (a tree copied to another machine, whose .git, if any, may be
    stale), else the checkout's short HEAD (git), else None."""
    if os.environ.get("LOCKSERVE_COMMIT"):
        return os.environ["LOCKSERVE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's name on a CUDA device (None: the current one where CUDA is there), else the
    device's type ("cpu")."""
    if device is None:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def utc_date() -> str:
    """Now in UTC to the second, e.g. 2025-01-31T12:00:00Z."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def command_line(program: str, argv: Sequence[str] | None = None) -> list[str]:
    """The command as a user types it: python, then program ("-m lockserve.kernels.bench" or a
    script's path from the repository root, "scripts/served_tpot.py"), then argv (None: this
    process's sys.argv[1:]). Never sys.argv[0]: run as a module that is this file's absolute path."""
    return ["python", *program.split(), *(sys.argv[1:] if argv is None else argv)]


def run_provenance(command: Sequence[str] | str, device: torch.device | str | None = None) -> dict:
    """command (as the file records it: a list of words, see command_line), commit, device
    (device_name), torch version and date (utc_date) of a run."""
    return {"command": command if isinstance(command, str) else list(command), "commit": source_commit(),
            "device": device_name(device), "torch": torch.__version__, "date": utc_date()}
