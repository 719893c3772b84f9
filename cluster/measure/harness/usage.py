"""What every measurement command does with an error its user can fix: one line
`lockserve: error: ...` and exit status 2 (the other `lockserve` commands do the same)."""

from __future__ import annotations

EXIT_USER_ERROR = 2


class UsageError(ValueError):
    """A flag value the command cannot run with; printed as one line, exit status 2."""


def check_modes(modes: list[str]) -> None:
    """Every mode is one the decode bench runs (decode.engines.MODES), else UsageError naming it."""
    from lockserve.cluster.measure.decode.engines import MODES  # torch: only when a command runs

    for mode in modes:
        if mode not in MODES:
            raise UsageError(f"--modes: {mode!r} must be one of {', '.join(MODES)}")
