"""lockserve.cluster.measure: the measurement commands of `lockserve`.

- ``commands``: the parsers of `bench decode`, `experiment capacity` and `report`, their help
  (the capacity accounting) and one dispatcher (``run``); imports nothing heavy.
- ``sweep``: `lockserve bench decode`, the decode benchmark (workers/bench.py) over a grid.
- ``capacity``: `lockserve experiment capacity`, resident vs offloaded KV at a fixed HBM budget.
- ``report``: `lockserve report`, the README's measured section from the result files.
- ``tables``, ``plots``, ``sizes``: rows as JSON / CSV / markdown, PNG plots, sizes and limits.
"""

from lockserve.cluster.measure.commands import COMMANDS, add_parsers, run

__all__ = ["COMMANDS", "add_parsers", "run"]
