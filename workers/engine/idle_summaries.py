"""Summaries of idle cached prefixes off the GPU, past a byte budget.

A cached page that no running sequence reads (refs 0 in the prefix cache: idle) needs its K/V
where they are but its summary only when some request reuses it. So the summaries of idle pages
stay in the device table only up to `budget_bytes` (cache.idle_summary_gib); past it, those of the
least recently used idle pages move to host memory, beside their pages, and their
table rows are zeroed; a request that reuses such a page brings its rows back (bitwise) before its
first step. Bytes are counted per page id: L x Hkv x the table's bytes per (layer, head) entry.

NOTE: the table itself is still allocated for every page id ([L, max_pages, Hkv, ...], indexed by
page id in the scorer): the rows moved out are free for a table indexed by row, not returned to
the allocator. Invariant: a page's rows are in exactly one place, the table (resident) or here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .kv_manager import SummaryTable
from .prefix_cache import PrefixCache
from .uploads import upload


class IdleSummaries:
    """Host copies of idle cached pages' summary rows, LRU by the prefix cache's idle order."""

    def __init__(self, table: SummaryTable, prefix: PrefixCache, budget_bytes: int, device: torch.device):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes ({budget_bytes}) must be >= 0")
        self.table, self.prefix, self.budget_bytes, self.device = table, prefix, budget_bytes, device
        lay = table.layout
        self.bytes_per_page = lay.num_layers * lay.num_kv_heads * table.bytes_per_page
        self._host: dict[int, dict[str, torch.Tensor]] = {}  # pid -> rows [L, Hkv, ...] per field (CPU)
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

    def enforce(self) -> int:
        """Move the rows of the least recently used idle pages out until the idle pages' rows in the
        table fit the budget (after pages became idle). Returns how many moved."""
        resident = [p for p in self.prefix.idle_pids() if p not in self._host]  # oldest first
        most = self.budget_bytes // self.bytes_per_page
        out = resident[: max(0, len(resident) - most)]
        if out:
            ids = upload(out, device=self.device)
            rows = self.table.page_rows(ids)  # name -> [L, M, Hkv, ...]
            for name, t in rows.items():
                host = t.to("cpu")  # NOTE: pageable, one copy per call (pinning per page costs more)
                for j, pid in enumerate(out):
                    self._host.setdefault(pid, {})[name] = host[:, j].clone()  # its own bytes: freed alone
            self.table.put_page_rows(ids, {n: torch.zeros_like(t) for n, t in rows.items()})
            self.counters["idle_summary_out_pages"] += len(out)
        return len(out)

    def bring_back(self, pids: Sequence[int]) -> int:
        """Rows of pids that are on the host back into the table (a reuse, before its first step);
        one batched copy. Returns how many came back."""
        back = [p for p in pids if p in self._host]
        if back:
            names = self._host[back[0]].keys()
            rows = {n: torch.stack([self._host[p][n] for p in back], dim=1) for n in names}  # [L, M, ...]
            self.table.put_page_rows(upload(back, device=self.device), rows)
            for p in back:
                del self._host[p]
            self.counters["idle_summary_in_pages"] += len(back)
        return len(back)

    def forget(self, pids: Sequence[int]) -> None:
        """Evicted pages: their host rows are dropped with them."""
        for p in pids:
            self._host.pop(p, None)

    def stats(self) -> dict[str, int]:
        return {"idle_summary_hbm_bytes": self.hbm_bytes, "idle_summary_host_bytes": self.host_bytes,
                "idle_summary_budget_bytes": self.budget_bytes, **self.counters}


def budget_bytes(gib: float) -> int:
    """cache.idle_summary_gib in bytes."""
    return math.floor(gib * (1 << 30))
