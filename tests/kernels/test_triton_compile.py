"""The selection, hot-page cache, sparse attention and paged prefill kernels compile for sm_90 with the
specialisations the engine's launches produce.

Triton specialises integer arguments divisible by 16 (and pointers aligned to 16 bytes); some of
its passes then fail on shapes the tests' odd sizes never hit (select_slots_kernel failed in
RemoveLayoutConversions on the H200 when C = chunks * k was a multiple of 16). Compiling to PTX
needs no GPU, so CI checks every launch configuration here: triton_compile_check.py, run in a
process without TRITON_INTERPRET (CI sets it; interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# Two halves of about equal compile time (30 s each on a 2-core CPU), run side by side: the compiles
# are single-threaded and this process only waits.
HALVES = ("decode or cache or eigh", "not (decode or cache or eigh)")
CHECKS = 38


def test_selection_cache_and_attention_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    check = Path(__file__).with_name("triton_compile_check.py")
    runs = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(check),
                              "-k", half], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for half in HALVES]
    passed = 0
    for run, half in zip(runs, HALVES, strict=True):
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"-k {half!r}:\n" + out[-4000:] + err[-2000:]
        counts = re.search(r"(\d+) passed", out)
        assert counts and "skipped" not in out, out[-2000:]
        passed += int(counts.group(1))
    assert passed == CHECKS, f"{passed} of the {CHECKS} compile checks ran"
