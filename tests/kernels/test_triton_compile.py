"""The selection, hot-page cache and sparse attention kernels compile for sm_90 with the
specialisations the engine's launches produce.

Triton specialises integer arguments divisible by 16 (and pointers aligned to 16 bytes); some of
its passes then fail on shapes the tests' odd sizes never hit (select_slots_kernel failed in
RemoveLayoutConversions on the H200 when C = chunks * k was a multiple of 16). Compiling to PTX
needs no GPU, so CI checks every launch configuration here: triton_compile_check.py, run in a
process without TRITON_INTERPRET (CI sets it; interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_selection_cache_and_attention_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    check = Path(__file__).with_name("triton_compile_check.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(check)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "32 passed" in run.stdout, run.stdout[-2000:]
