"""`PageSource`: what the decode engine reads selected pages through, one per GPU worker.

Per step the engine hands `resolve` the arena slots of the selected pages and
gets back a device pool and the indices where those pages now are; the
attention kernel reads `pool[idx[i]]`. Pages the engine produces (prefill, a
page that fills during decode) go in through `write_pages`, which also keeps
any cached copy current.
"""

from __future__ import annotations

import abc

import torch

from .arena import Closable, PageGeometry, check_pages, resolve_device
from .cache import HotPageCache
from .gather import gather_pages
from .hbm import HbmTier
from .host import HostArena
from .stats import OffloadStats


def _check_slots(slots: torch.Tensor, device: torch.device, name: str = "slots") -> None:
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {getattr(slots, 'shape', type(slots))}")
    if slots.device != device:
        raise ValueError(f"{name}: expected device {device}, got {slots.device}")


class PageSource(Closable):
    """Contract:
    - `resolve(slots [M] int64 on device) -> (pool [S, 2, B, d], idx [M] int64)`,
      both on the device, `pool[idx[i]]` holding the page of arena slot `slots[i]`;
      non-negative slots are distinct, entries < 0 are padding (their idx: some valid row);
      no host synchronisation (CUDA-graph capturable when the source allows it).
      Valid until the next `resolve` or `write_pages`.
    - `write_pages(slots [n] int64 distinct, pages [n, 2, B, d])` on the device:
      later `resolve`s see the new bytes (asynchronous on CUDA, ordered on the stream).
    - `invalidate(slots)`: the arena bytes of these slots changed elsewhere (the store).
    - `stats() -> OffloadStats` (syncs; call outside the step).
    """

    kind: str
    geometry: PageGeometry
    device: torch.device

    @abc.abstractmethod
    def resolve(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def write_pages(self, slots: torch.Tensor, pages: torch.Tensor) -> None: ...

    def invalidate(self, slots: torch.Tensor) -> None:
        """Default: nothing cached, nothing to drop."""
        return None

    def read_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """`[n, 2, B, d]` on the device: the pages as `resolve` would present them (tests, debugging)."""
        pool, idx = self.resolve(slots)
        return pool.index_select(0, idx)

    def synchronize(self) -> None:
        """Wait for pending write-backs (a host sync). Default: writes are synchronous."""
        return None

    def order_after_writes(self) -> None:
        """Order later reads after pending write-backs on the device (no host sync). Default:
        writes are synchronous."""
        return None

    @abc.abstractmethod
    def stats(self) -> OffloadStats: ...


class ResidentSource(PageSource):
    """kind "hbm": the arena is in device memory; resolve is the identity."""

    kind = "hbm"

    def __init__(self, tier: HbmTier):
        self.tier, self.geometry, self.device = tier, tier.geometry, tier.device
        self._bytes_written = 0

    def resolve(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_slots(slots, self.device)
        return self.tier.pool, slots.clamp(min=0)  # padding -> row 0

    def write_pages(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        _check_slots(slots, self.device)
        check_pages(pages, slots.numel(), self.geometry)
        self.tier.pool.index_copy_(0, slots, pages)
        self._bytes_written += slots.numel() * self.geometry.slot_bytes

    def stats(self) -> OffloadStats:
        return OffloadStats(self.kind, {"hbm": self.tier.bytes_resident}, bytes_written=self._bytes_written)

    def close(self) -> None:
        self.tier.close()


class OffloadedSource(PageSource):
    """kinds "host" / "host+nvme": pages in the shared host arena, hot ones cached on the device.

    On CUDA the arena must be registered (UVA); misses are copied from it by the cache's
    Triton kernels and write-backs go to it on a side stream. On CPU (tests) the cache runs
    its torch reference; without a cache (CPU only) resolve is the identity. With a cache,
    resolve returns the cache's pool: entries, then one staging row per request position.
    `owns` lists what close() closes (an arena this source created, or a local store).
    """

    def __init__(self, kind: str, arena: HostArena, cache: HotPageCache | None, device, store=None, owns=()):
        self.kind, self.arena, self.cache, self.store = kind, arena, cache, store
        self.geometry, self.device, self._owns = arena.geometry, resolve_device(device), list(owns)
        if self.device.type == "cuda":
            self._src = arena.uva_pool()
            self._side = torch.cuda.Stream(self.device)
            self._written = torch.cuda.Event()
        else:
            self._src, self._side, self._written = arena.pool, None, None
        self._bytes_written = 0
        self._write_pending = False

    def resolve(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_slots(slots, self.device)
        if self.cache is None:
            if self.device.type == "cuda":
                raise RuntimeError("resolve without a hot-page cache on cuda: gather the pages instead")
            return self.arena.pool, slots.clamp(min=0)
        self.order_after_writes()
        return self.cache.pool, self.cache.lookup_and_fill(slots, self._src)

    def order_after_writes(self) -> None:
        """Make the current stream wait (on the device) for write-backs issued on the side stream,
        so that reads of the arena see them. Only after a write: call it before replaying a graph
        that reads the arena, and the graph itself records no foreign wait."""
        if self._write_pending:
            torch.cuda.current_stream(self.device).wait_event(self._written)
            self._write_pending = False

    def write_pages(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        _check_slots(slots, self.device)
        check_pages(pages, slots.numel(), self.geometry)
        if pages.device != self.device:
            raise ValueError(f"pages: expected device {self.device}, got {pages.device}")
        slots, pages = slots.contiguous(), pages.contiguous()  # the gather kernel's layout
        if self.cache is not None:
            self.cache.update(slots, pages)  # on the current stream: later lookups are ordered after it
        if self._side is None:
            self.arena.write(slots, pages)
        else:
            self._write_back_async(slots, pages)
        self._bytes_written += slots.numel() * self.geometry.slot_bytes

    def _write_back_async(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        # pages: [n, 2, B, d] device -> arena slots over UVA, on the side stream.
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)  # pages are produced on the current stream
        with torch.cuda.stream(self._side):
            src_idx = torch.arange(slots.numel(), dtype=torch.int64, device=self.device)
            gather_pages(pages, src_idx, self._src, slots, backend="triton")
            self._written.record(self._side)
        self._write_pending = True
        # The caller may free pages/slots after this returns: keep them alive for the side stream.
        for t in (pages, slots, src_idx):
            t.record_stream(self._side)

    def invalidate(self, slots: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.invalidate(torch.as_tensor(slots, dtype=torch.int64).to(self.device))

    def ensure_resident(self, ids) -> torch.Tensor:
        """Host slots `[n]` (on the device) of logical page ids, promoting spilled pages first.

        Needs the local store (kind "host+nvme"); cached copies of rewritten slots are dropped.
        """
        if self.store is None:
            raise RuntimeError(f"ensure_resident needs a page store; kind {self.kind!r} has none")
        res = self.store.ensure_resident(ids)
        if res.rewritten.numel():
            self.invalidate(res.rewritten)
        return res.slots.to(self.device)

    def synchronize(self) -> None:
        if self._written is not None:
            self._written.synchronize()

    def stats(self) -> OffloadStats:
        self.synchronize()
        resident = {"host": self.arena.bytes_resident}
        direct_io = None
        if self.store is not None and self.store.nvme is not None:
            resident["nvme"] = self.store.nvme.bytes_resident
            direct_io = self.store.nvme.direct_io
        if self.cache is None:
            return OffloadStats(
                self.kind, resident, bytes_written=self._bytes_written, nvme_direct_io=direct_io
            )
        c = self.cache.stats()
        resident["cache"] = c.bytes_resident
        return OffloadStats(
            self.kind, resident, c.steps, c.requests, c.hits, c.misses, c.bytes_moved,
            c.bytes_moved_last_step, self._bytes_written, direct_io,
        )  # fmt: skip

    def close(self) -> None:
        """Wait for the device, then close what this source owns (unregistering the arena)."""
        self.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel may still read the arena we unregister
        for owned in self._owns:
            owned.close()
        self._owns.clear()
