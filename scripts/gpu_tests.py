"""Run pytest and keep its own output as a result file, headed by the run's provenance.

    python scripts/gpu_tests.py OUT.txt [pytest arguments ...]
    python scripts/gpu_tests.py docs/results/gpu_tests_h200_COMMIT.txt -m gpu -q tests/kernels tests/offload

The file's first line is `# provenance: {...}` (JSON: command, commit, device, torch, date; the
command is pytest's, as typed), then pytest's output as it printed it (also echoed here) but for
this machine's paths (the working directory written `.`, Python's prefix `<python>`, other
PYTHONPATH folders `<site>`: a result file names no machine's paths), then `# exit status: N`.
`lockserve report` reads the first line as it reads a JSON result's fields
(cluster/measure/report_checks.py). Exits with pytest's status. Set LOCKSERVE_COMMIT where the
tree was copied without its .git.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lockserve.cluster.measure.report_checks import LOG_PROVENANCE

from lockserve.provenance import run_provenance


def pytest_temp_root() -> str:
    """The folder under which pytest makes its tmp_path folders (its default basetemp's parent)."""
    return os.path.join(tempfile.gettempdir(), f"pytest-of-{getpass.getuser()}")


def without_paths(line: str) -> str:
    """line with this machine's working directory as `.`, Python's prefixes as `<python>`, the
    other PYTHONPATH folders (where scripts/gpu_env.sh puts the carried wheels) as `<site>` and
    pytest's temporary folders (a failure prints its tmp_path) under `<pytest-tmp>`."""
    cwd = os.getcwd()
    extra = [(p, "<site>") for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != cwd]
    pairs = [(cwd, "."), (sys.prefix, "<python>"), (sys.base_prefix, "<python>"), *extra,
             (pytest_temp_root(), "<pytest-tmp>")]
    for path, name in sorted(pairs, key=lambda pair: -len(pair[0])):  # the longest first: nested paths
        line = line.replace(path, name)
    return line


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    out, args = Path(argv[0]), argv[1:]
    command = ["python", "-m", "pytest", *(without_paths(a) for a in args)]
    provenance = run_provenance(command)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as log:
        log.write(LOG_PROVENANCE + json.dumps(provenance) + "\n")
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:  # written as it comes: a crash or a time limit keeps what ran
            sys.stdout.write(line)
            log.write(without_paths(line))
            log.flush()
        code = proc.wait()
        log.write(f"# exit status: {code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
