"""lockserve.cluster.measure: the measurement commands of `lockserve` and their harness, outside
the runtime (no module of kernels, offload, workers, configs or the server imports this package:
tests/test_imports.py checks it, and that no lockserve import cycles).

    python -m lockserve.cluster.measure {bench,experiment,report} ...

is the same as `lockserve bench|experiment|report ...` (same flags, outputs and exit codes) without
the rest of `lockserve`, so without the serve extra (Ray, FastAPI, uvicorn): what a GPU machine
without network has. `python -m lockserve.cluster.measure.eval.command ...` is `lockserve eval
retrieval ...` the same way, and `python -m lockserve.cluster.measure.decode.bench` the decode bench.

- ``commands``: the parsers of `bench decode`, `bench prefill`, `experiment capacity` and `report`,
  their help and one dispatcher (``run``); imports nothing heavy. ``accounting``: the capacity rule.
- ``decode``: the engines and requests every bench builds (``engines``), the decode bench
  (``bench``: its CLI, one mode's measurement, isolation and result merging), one step under the
  profiler (``step_profile``), a step's bytes and ceilings (``ceilings``), its grid (``sweep``:
  `lockserve bench decode`), the targets (``targets``) and context parallel (``cp_bench``).
- ``capacity``: `lockserve experiment capacity`; ``prefill``, ``plain_prefill``: `bench prefill`.
- ``report``, ``report_checks``: `lockserve report`, the measured pages from the result files.
- ``eval``: `lockserve eval retrieval` (tasks, the runner, metrics, its report and plots).
- ``harness``: what the commands share (``usage``: user errors; ``tables``; ``sizes``).
"""

from lockserve.cluster.measure.commands import COMMANDS, add_parsers, run

__all__ = ["COMMANDS", "add_parsers", "run"]
