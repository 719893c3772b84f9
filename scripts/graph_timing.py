"""Device time of CUDA graph replays, for the diagnostics in scripts/ (not part of the package)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def replay_times(graph: torch.cuda.CUDAGraph, reps: int,
                 before: Callable[[int], None] | None = None) -> list[float]:
    """`reps` replays, each timed (ms) by events recorded around it on the current stream and
    waited for; before(i), if given, runs ahead of replay i, outside its timing."""
    times = []
    for i in range(reps):
        if before is not None:
            before(i)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times
