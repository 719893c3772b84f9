"""Summaries of idle cached prefixes off the GPU, past a byte budget.

A cached page that no running sequence reads (refs 0 in the prefix cache: idle) needs its K/V
where they are but its summary only when some request reuses it. So the summaries of idle pages
stay in the device table only up to `budget_bytes` (cache.idle_summary_gib); past it, those of the
least recently used idle pages move to host memory, beside their pages, and their
table rows are zeroed; a request that reuses such a page brings its rows back (bitwise) before its
first step. Bytes are counted per page id: L x Hkv x the table's bytes per (layer, head) entry.

NOTE: the table itself is still allocated for every page id ([L, max_pages, Hkv, ...], indexed by
page id in the scorer): the rows moved out are free for a table indexed by row, not returned to
the allocator. So this costs copies and frees no device memory yet, and is off by default
(cache.idle_summary_gib None). Invariant: a page's rows are in exactly one place, the table
(resident) or here.

Copies: on CUDA both ways go through pinned host memory with non_blocking copies on the current
stream (the engine has no copy stream): ordered before the step's kernels that read the table,
with no host wait but an event wait before host code reads a batch moved out (long done by then).
A batch moved out by one `enforce` stays allocated until its last page comes back or is evicted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .kv_manager import SummaryTable
from .prefix_cache import PrefixCache
from .uploads import to_host, upload


class IdleSummaries:
    """Host copies of idle cached pages' summary rows, LRU by the prefix cache's idle order."""

    def __init__(self, table: SummaryTable, prefix: PrefixCache, budget_bytes: int, device: torch.device):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes ({budget_bytes}) must be >= 0")
        self.table, self.prefix, self.budget_bytes, self.device = table, prefix, budget_bytes, device
        lay = table.layout
        self.bytes_per_page = lay.num_layers * lay.num_kv_heads * table.bytes_per_page
        self._host: dict[int, dict[str, torch.Tensor]] = {}  # pid -> rows [L, Hkv, ...] per field (CPU)
        self._ready: dict[int, torch.cuda.Event] = {}  # CUDA: pid -> after its batch's copy out
        self.counters = {"idle_summary_out_pages": 0, "idle_summary_in_pages": 0}

    def is_resident(self, pid: int) -> bool:
        return pid not in self._host

    @property
    def hbm_bytes(self) -> int:
        """Summary bytes of idle cached pages in the device table."""
        return sum(p not in self._host for p in self.prefix.idle_pids()) * self.bytes_per_page

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.bytes_per_page

    def leaving(self) -> list[int]:
        """The idle pages whose rows `enforce` would move out now, least recently used first."""
        resident = [p for p in self.prefix.idle_pids() if p not in self._host]  # oldest first
        most = self.budget_bytes // self.bytes_per_page
        return resident[: max(0, len(resident) - most)]

    def enforce(self) -> int:
        """Move the rows of the least recently used idle pages out until the idle pages' rows in the
        table fit the budget (after pages became idle). Returns how many moved."""
        out = self.leaving()
        if out:
            ids = upload(out, device=self.device)
            rows = self.table.page_rows(ids)  # name -> [L, M, Hkv, ...]
            host = {name: to_host(t) for name, t in rows.items()}  # pinned, no host wait on CUDA
            ready = _record(self.device)
            for j, pid in enumerate(out):
                self._host[pid] = {name: h[:, j] for name, h in host.items()}  # views of the batch
                if ready is not None:
                    self._ready[pid] = ready
            self.table.put_page_rows(ids, {n: torch.zeros_like(t) for n, t in rows.items()})
            self.counters["idle_summary_out_pages"] += len(out)
        return len(out)

    def bring_back(self, pids: Sequence[int]) -> int:
        """Rows of pids that are on the host back into the table (a reuse, before its first step);
        one batched copy. Returns how many came back."""
        back = [p for p in pids if p in self._host]
        if back:
            for ready in {id(e): e for p in back if (e := self._ready.pop(p, None)) is not None}.values():
                ready.synchronize()  # the batch's copy out (queued steps ago) is on the host
            names = self._host[back[0]].keys()
            rows = {n: _stack(self.device, [self._host[p][n] for p in back]) for n in names}  # [L, M, ...]
            rows = {n: r.to(self.device, non_blocking=True) for n, r in rows.items()}  # pinned on CUDA
            self.table.put_page_rows(upload(back, device=self.device), rows)
            for p in back:
                del self._host[p]
            self.counters["idle_summary_in_pages"] += len(back)
        return len(back)

    def forget(self, pids: Sequence[int]) -> None:
        """Evicted pages: their host rows are dropped with them."""
        for p in pids:
            self._host.pop(p, None)
            self._ready.pop(p, None)

    def stats(self) -> dict[str, int]:
        return {"idle_summary_hbm_bytes": self.hbm_bytes, "idle_summary_host_bytes": self.host_bytes,
                "idle_summary_budget_bytes": self.budget_bytes, **self.counters}


def budget_bytes(gib: float) -> int:
    """cache.idle_summary_gib in bytes."""
    return math.floor(gib * (1 << 30))


def _record(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on device's current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _stack(device: torch.device, rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows [L, ...] of M pages stacked as [L, M, ...]; in pinned memory on CUDA (for a
    non_blocking upload)."""
    shape = (rows[0].shape[0], len(rows), *rows[0].shape[1:])
    out = torch.empty(shape, dtype=rows[0].dtype, pin_memory=device.type == "cuda")
    return torch.stack(rows, dim=1, out=out)
