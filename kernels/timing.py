"""The one timer of the measurement code: median milliseconds of a call, on the device it runs on.

The kernel, offload and decode benchmarks each had their own (three functions, three defaults);
this is the one they share. It sits in kernels/, the bottom layer, so that every layer may use it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: torch.device, *, graph: bool = False,
              warmup: int | None = None, rep: int | None = None, cpu_calls: int = 1) -> float:
    """Median milliseconds of one call of fn.

    CUDA: triton's do_bench (warmup and rep in ms, triton's defaults where None; L2 flushed before
    each call, so a call shorter than its launch is timed at the launch), or with graph=True the
    replays of a CUDA graph of fn (device time only). Elsewhere: the median wall time of cpu_calls
    calls (Triton's interpreter and CPU times say little; they only exercise the code)."""
    if device.type == "cuda":
        import triton.testing

        given = {k: v for k, v in (("warmup", warmup), ("rep", rep)) if v is not None}
        if graph:
            given.pop("warmup", None)  # the graph timer warms up by capturing
            return float(triton.testing.do_bench_cudagraph(fn, **given, return_mode="median"))
        return float(triton.testing.do_bench(fn, **given, return_mode="median"))
    if cpu_calls < 1:
        raise ValueError(f"cpu_calls ({cpu_calls}) must be >= 1")
    times = []
    for _ in range(cpu_calls):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)
