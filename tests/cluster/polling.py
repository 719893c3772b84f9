"""Waiting in tests for something another process or thread makes true."""

from __future__ import annotations

import threading
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


class Timeline:
    """check()'s value, polled every poll_s in a daemon thread while the `with` block runs, kept at
    each change as (monotonic time, value). For a state that may come and go before the test gets
    to look (a worker that is down for a few seconds while the test waits on something else)."""

    def __init__(self, check, poll_s: float = 0.05):
        self._check, self._poll_s = check, poll_s
        self.changes: list[tuple[float, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-timeline", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def first(self, wanted, after: float) -> float | None:
        """The first time at or after `after` that the value became `wanted`; None if it never did."""
        return next((t for t, value in self.changes if t >= after and value == wanted), None)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                value = self._check()
            except Exception as err:  # a refused connection is a value too, and must not end the thread
                value = f"error: {type(err).__name__}"
            if not self.changes or self.changes[-1][1] != value:
                self.changes.append((time.monotonic(), value))
            self._stop.wait(self._poll_s)
