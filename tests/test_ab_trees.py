"""scripts/ab_trees.sh: commits staged as package trees, then one command run at each of them and
at the checkout, alternating within each round, each with its own lockserve and LOCKSERVE_COMMIT."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "ab_trees.sh"
PROBE = ("import os, lockserve; "
         "print(os.environ.get('LOCKSERVE_COMMIT'), lockserve.__file__, '{round}', '{sha}')")


def test_a_staged_commit_and_the_checkout_alternate_with_their_own_packages(tmp_path):
    env = {**os.environ, "AB_DIR": str(tmp_path / "ab"), "LOCKSERVE_COMMIT": "abcdef0123",
           "PYTHONPATH": str(REPO)}
    staged = subprocess.run(["bash", str(SCRIPT), "stage", "HEAD~1"], env=env, capture_output=True, text=True,
                            check=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD~1"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert (tmp_path / "ab" / sha / "workers").is_dir(), staged.stdout
    out = subprocess.run(["bash", str(SCRIPT), "run", "2", "--", sys.executable, "-c", PROBE], env=env,
                         capture_output=True, text=True, check=True).stdout
    runs = [line.split() for line in out.splitlines() if not line.startswith("==")]
    # the checkout keeps its LOCKSERVE_COMMIT; {sha} names it by its first 7 characters
    assert [(r[0], r[2], r[3]) for r in runs] == [(sha, "1", sha), ("abcdef0123", "1", "abcdef0"),
                                                  (sha, "2", sha), ("abcdef0123", "2", "abcdef0")]
    staged_file, head_file = Path(runs[0][1]).resolve(), Path(runs[1][1]).resolve()
    assert staged_file.is_relative_to((tmp_path / "ab" / sha).resolve()), "the staged tree's lockserve"
    assert head_file.is_relative_to(REPO), "the checkout's lockserve"


def test_run_without_a_staged_tree_says_so(tmp_path):
    env = {**os.environ, "AB_DIR": str(tmp_path / "none")}
    done = subprocess.run(["bash", str(SCRIPT), "run", "1", "--", "true"], env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "nothing staged" in done.stderr
