"""`python -m lockserve.cluster.measure {bench decode, experiment capacity, report} ...`: the
experiment commands without the rest of `lockserve`, so without the serve extra (what a GPU
machine without network has). Same flags, outputs and exit codes as `lockserve bench decode` etc.
"""

from __future__ import annotations

import argparse
import sys

from lockserve.cluster.measure.commands import add_parsers, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure",
                                     description="lockserve's benchmark, experiment and report commands.")
    add_parsers(parser.add_subparsers(dest="command", required=True, metavar="{bench,experiment,report}"))
    argv = sys.argv[1:] if argv is None else list(argv)
    return run(parser.parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())
