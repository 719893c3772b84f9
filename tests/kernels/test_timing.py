"""kernels.timing.median_ms on the CPU: the median of its calls' wall times, and a clear error."""

from __future__ import annotations

import time

import pytest
import torch
from lockserve.kernels.timing import median_ms


def test_cpu_time_is_the_median_of_the_calls():
    sleeps = iter([0.0, 0.05, 0.0])  # one slow call out of three: the median is a fast one
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(sleeps))

    ms = median_ms(fn, torch.device("cpu"), cpu_calls=3)
    assert len(calls) == 3 and ms < 25, ms


def test_cpu_calls_must_be_positive():
    with pytest.raises(ValueError, match=r"cpu_calls \(0\) must be >= 1"):
        median_ms(lambda: None, torch.device("cpu"), cpu_calls=0)
