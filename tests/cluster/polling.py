"""Waiting in tests for something another process or thread makes true."""

from __future__ import annotations

import time


def wait_until(check, timeout_s: float, what: str, poll_s: float = 0.05):
    """check()'s first truthy result, polled every poll_s; AssertionError "<what> within N s"."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(poll_s)
    raise AssertionError(f"{what} within {timeout_s:.0f} s")
