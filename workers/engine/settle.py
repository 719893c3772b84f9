"""The summary build of the pages a decode step fills, replayed from CUDA graphs.

A decode step fills at most one page per sequence. After its forward the KV manager settles those
pages: their K/V to the tier, and a LOCKS summary of each into the table. Run eagerly, the summary
build is some sixty small launches (the gather of the keys, Algorithm 1, the quantisation, the
table's stores). That is about 2 ms of host time with the device idle, on one step in 16 at
batch 1 and on most steps of a batch whose sequences fill pages at different positions.

Here the build of M pages is captured once per M and replayed. The pages' ids and write-pool rows
go through fixed buffers. The first settle of each M runs eagerly; it is the capture's warm-up,
and the capture then only records, so no settle runs twice.

Capturable only where the build never waits on the host:
- the eigensolver is the Jacobi kernel (`summary.eigh_solver` says "jacobi" under the table's
  choice, LocksConfig.eigh);
- the table is LOCKS's own (the engine checks this).
Captured only for builds of at most MAX_CAPTURED_MATRICES eigenproblems (M x L x Hkv: a decode
step's few pages); larger settles, and all of them elsewhere and on CPU, the KV manager builds
eagerly with the same code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from lockserve.kernels.summary import DEFAULT_EIGH, EIGH_SOLVERS, eigh_solver

from .graphs import KeyedGraphs

# A graph keeps its build's intermediates in the pool (about 50 KiB an eigenproblem): capture the
# builds of a decode step's few pages (4 pages at Llama-3.1-8B's shape), not a batch's hundreds.
MAX_CAPTURED_MATRICES = 1024


def captures(m: int, matrices_per_page: int, page_size: int, eigh: str) -> bool:
    """Whether a settle of m pages replays from a graph (else the KV manager builds it eagerly):
    few enough eigenproblems, and an eigensolver that never waits on the host."""
    if m * matrices_per_page > MAX_CAPTURED_MATRICES:
        return False
    return eigh_solver(page_size, True, eigh) == "jacobi"


class SettleGraphs:
    """Captured summary builds, one per page count M in [1, max_pages].

    build(pids [M], locs [M]): the build of M pages (int64 device tensors: page ids and write-pool
    rows), capturable. matrices_per_page: the eigenproblems a page gives (layers x KV heads).
    eigh: the build's eigensolver choice (kernels/summary.py EIGH_SOLVERS, LocksConfig.eigh).
    """

    def __init__(self, build: Callable[[torch.Tensor, torch.Tensor], None], max_pages: int,
                 matrices_per_page: int, page_size: int, device: torch.device, eigh: str = DEFAULT_EIGH):
        if device.type != "cuda":
            raise ValueError(f"settle graphs need a CUDA device, not {device}")
        if max_pages < 1:
            raise ValueError(f"max_pages ({max_pages}) must be >= 1")
        if eigh not in EIGH_SOLVERS:
            raise ValueError(f"eigh ({eigh!r}) must be one of {EIGH_SOLVERS}")
        self._build, self.max_pages = build, max_pages
        self._matrices, self._page_size, self._eigh = matrices_per_page, page_size, eigh
        self._pids = torch.zeros(max_pages, dtype=torch.int64, device=device)
        self._locs = torch.zeros(max_pages, dtype=torch.int64, device=device)
        self.graphs = KeyedGraphs(torch.cuda.graph_pool_handle())  # by page count M

    @property
    def counters(self) -> dict[str, int]:
        return {"settle_replays": self.graphs.replays, "settle_captures": self.graphs.captures}

    def covers(self, m: int) -> bool:
        """Whether a settle of m pages replays (else the caller builds eagerly)."""
        return 1 <= m <= self.max_pages and captures(m, self._matrices, self._page_size, self._eigh)

    def run(self, pids: torch.Tensor, locs: torch.Tensor) -> None:
        """Build the summaries of pages pids [m] (write-pool rows locs [m]); `covers(m)` must hold."""
        m = pids.numel()
        self._pids[:m].copy_(pids)
        self._locs[:m].copy_(locs)
        captured = self.graphs.get(m)
        if captured is not None:
            self.graphs.replay(captured)
            return
        self._build(self._pids[:m], self._locs[:m])  # this settle, and the capture's warm-up
        self.graphs.capture(m, lambda: self._build(self._pids[:m], self._locs[:m]))
