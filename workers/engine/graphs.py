"""CUDA graphs of a forward, keyed by the shapes and branches the forward takes.

    graphs = KeyedGraphs(pool)                  # one per set of fixed input addresses
    captured = graphs.get(key)
    if captured is None:
        out = forward()                          # this step's answer; warms every kernel
        graphs.capture(key, forward)             # then the key is captured: no step runs twice
    else:
        out = graphs.replay(captured)            # the capture's output, rewritten by the replay

The engine's runner keys a batch's decode step by `GraphKey` (batch bucket, page-table width bucket,
selection width, scored); a context-parallel rank keys its one row by the same key and whether it
owns the token's page; the KV manager's settle keys a summary build by its page count. All capture
and replay through this class.
Invariant: a captured forward reads its inputs from tensors at fixed addresses (the caller writes
them before `replay`), and its output tensor is the one `replay` returns.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's garbage collector off inside the block (on again after, if it was on)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class GraphKey:
    rows: int  # batch bucket
    width: int  # page-table columns
    k: int  # selection width
    scored: bool


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    output: Any  # what the captured forward returned (tensors a replay rewrites)
    extra: Any = None  # what the caller notes of the capture (a rank: the collectives a replay issues)


class KeyedGraphs:
    """Graphs by key (see the module docstring). pool: a graph memory pool, shared with other sets
    (torch.cuda.graph_pool_handle()). replay_events: None, or a list each replay appends
    (start, end) CUDA events and the host's perf_counter before and after the replay call to."""

    def __init__(self, pool):
        self.pool = pool
        self._graphs: dict[Hashable, Captured] = {}
        self.captures = 0
        self.replays = 0
        self.replay_events: list | None = None

    def __len__(self) -> int:
        return len(self._graphs)

    def get(self, key: Hashable) -> Captured | None:
        return self._graphs.get(key)

    def drop_all(self) -> None:
        """Drop every graph; later captures go to a fresh pool (a pool whose graphs were all freed
        cannot be captured into again)."""
        self._graphs.clear()
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, key: Hashable, forward: Callable[[], Any]) -> Captured:
        """Record forward() under key (nothing runs on the device). The key must be new."""
        assert key not in self._graphs, key
        graph = torch.cuda.CUDAGraph()
        # Other threads run beside a capture (the host+nvme spill writer, the prefix store's saver):
        # in CUDA's global capture mode any unsafe call they make (a free) invalidates it, and a
        # garbage collection during it (in any thread) may free a CUDA object. Both seen on an H200:
        # the capture is thread-local and the collector waits (torch.cuda.graph collects first).
        with _collector_paused(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()
        captured = self._graphs[key] = Captured(graph, output)
        self.captures += 1
        return captured

    def replay(self, captured: Captured) -> Any:
        """Replay a capture; returns its output tensors, rewritten."""
        self.replays += 1
        if self.replay_events is None:
            captured.graph.replay()
            return captured.output
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        called = time.perf_counter()
        captured.graph.replay()
        returned = time.perf_counter()
        end.record()
        self.replay_events.append((start, end, called, returned))
        return captured.output
