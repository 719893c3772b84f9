"""`PageSource`: the one interface the decode engine reads and writes full KV pages through.

A GPU worker has one source, built by `make_tier`. Slots are the engine's arena slots (one page of
one (layer, KV head)); every slot tensor is int64 on the source's device. Per decode layer the
engine hands `resolve` the slots of the selected pages and gets the rows of `pool` where those
pages now are; the attention kernel reads `pool[idx[i]]`. Pages the engine produces (prefill, a
page that fills during decode) go in through `write`, which also keeps any cached copy current.

Kinds: `ResidentSource` ("hbm": the arena is device memory), `HostSource` ("host": the shared
host arena, hot pages cached on the device) and `SpilledSource` ("host+nvme", offload/spilled.py:
a page store spills cold pages of the host arena to NVMe).
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from .arena import Closable, PageGeometry, check_pages
from .cache import HotPageCache
from .gather import gather_pages
from .hbm import HbmTier
from .host import HostArena
from .stats import OffloadStats


def check_slots(slots: torch.Tensor, device: torch.device, name: str = "slots") -> None:
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {getattr(slots, 'shape', type(slots))}")
    if slots.device != device:
        raise ValueError(f"{name}: expected device {device}, got {slots.device}")


class PageSource(Closable):
    """Contract (slots: int64 on `device`):
    - `pool [F, 2, B, d]`: the device tensor that `resolve`'s rows index.
    - `resolve(slots [M]) -> idx [M]`: one decode layer's selection; non-negative slots distinct,
      -1 = nothing to read (some row comes back, never read). No host synchronisation, so a
      decode step that calls it can be captured in a CUDA graph. Valid until the next `resolve`
      or `write`. Validated when the caller is built, not per call (the decode hot path).
    - `resolve_or(slots [M], outside [M] bool, rows [M]) -> idx [M]`: `resolve`, but entries where
      `outside` is set get rows[i] (pages the engine keeps elsewhere in the pool: its open pages).
    - `read(slots [n]) -> [n, 2, B, d]` on the device: a bulk read that bypasses any cache
      (prefill); call `begin_direct_reads` first after asynchronous writes.
    - `write(slots [n] distinct, pages [n, 2, B, d], host_slots=None)`: store pages that filled;
      later `resolve`s see the new bytes (asynchronous on CUDA, ordered on the stream).
      host_slots: the same slots on the CPU, where the caller has them; a source that keeps host
      state per slot (host+nvme) then needs no host wait for the forward that made `slots`.
    - `release(slots [n])`: the pages of a finished sequence; cached copies and storage go.
    - At the end of every forward, inside a captured one: `join()`, which orders the current
      stream after work the source left on a side stream (the hot cache's branch commits).
    - At the start of every forward, inside a captured one: `begin_forward()`, device work that
      a decode graph replays (the hot cache's step).
    - Around every forward: `before_forward(reads)`, then after it `take_misses()`: True when the
      forward read past pages that were not readable (host+nvme) and must run again; inside
      `synchronous_reads()` a forward cannot miss (it promotes on the host instead). reads=False:
      the forward resolves no slot (no decode row: a prefill-only step), so it can neither miss
      nor select, and `take_misses` after it returns False without a host wait.
    - Where `lookahead` > 0 (host+nvme): each decode layer passes its selection at `lookahead` x
      the budget to `note_ahead` (device only, capturable), and after the forward that stands
      `prefetch_ahead()` brings those pages into host memory for the next step.
    - `stats() -> OffloadStats` and `counters()` sync; call them outside the step.
    """

    kind: str
    geometry: PageGeometry
    device: torch.device
    pool: torch.Tensor
    max_write_pages: int | None = None  # most slots one `write` may take (None: any number)

    @abc.abstractmethod
    def resolve(self, slots: torch.Tensor) -> torch.Tensor: ...

    def resolve_or(self, slots: torch.Tensor, outside: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`torch.where(outside, rows, resolve(slots))`; slots, rows: [M] int64, outside: [M] bool.
        A source whose lookup can return rows[i] itself overrides this (one launch fewer a layer)."""
        return torch.where(outside, rows, self.resolve(slots))

    @abc.abstractmethod
    def read(self, slots: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def write(self, slots: torch.Tensor, pages: torch.Tensor,
              host_slots: torch.Tensor | None = None) -> None: ...

    def release(self, slots: torch.Tensor) -> None:
        """Default: nothing cached, nothing to drop (the slots are simply reused)."""
        return None

    def synchronize(self) -> None:
        """Wait for pending write-backs (a host sync). Default: writes are synchronous."""
        return None

    def begin_direct_reads(self) -> None:
        """Make earlier asynchronous writes visible to `read` (may wait on the host)."""
        self.synchronize()

    def before_forward(self, reads: bool = True) -> None:
        """Before every forward (eager or a graph replay, which must not wait on events itself);
        reads: whether it resolves slots (decode rows). Default: nothing (writes are ordered on the
        stream)."""
        return None

    def begin_forward(self) -> None:
        """At the start of every forward, inside it: captured with a decode graph and replayed
        with it, so device work only (no host wait, no host state). Default: nothing."""
        return None

    def take_misses(self, rerun: bool = False) -> bool:
        """After a forward: True if it must run again (rerun: it already ran again this step)."""
        return False

    def join(self) -> None:
        """At a forward's end: side-stream work joins the current stream. Default: none."""
        return None

    @contextlib.contextmanager
    def synchronous_reads(self) -> Iterator[None]:
        """A block whose forwards cannot miss. Default: none can."""
        yield

    def counters(self) -> dict[str, float]:
        """Kind-specific counters (NVMe spills and reruns, seconds ending in _s); none by default."""
        return {}

    lookahead = 0  # host+nvme: decode layers record wider selections (note_ahead) for prefetch_ahead

    def note_ahead(self, layer: int, slots: torch.Tensor) -> None:
        """A decode layer's selection at `lookahead` x the budget (only where lookahead > 0)."""

    def prefetch_ahead(self) -> None:
        """After the forward that stands: bring what note_ahead recorded closer; nothing by default."""

    @abc.abstractmethod
    def stats(self) -> OffloadStats: ...


class ResidentSource(PageSource):
    """kind "hbm": the arena is in device memory, and it is the pool; resolve is the identity."""

    kind = "hbm"

    def __init__(self, tier: HbmTier):
        self.tier, self.geometry, self.device = tier, tier.geometry, tier.device
        self.pool = tier.pool  # [num_slots, 2, B, d]
        self._bytes_written = 0

    def resolve(self, slots: torch.Tensor) -> torch.Tensor:
        return slots.clamp(min=0)  # padding -> row 0

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.pool.index_select(0, slots)

    def write(self, slots: torch.Tensor, pages: torch.Tensor, host_slots: torch.Tensor | None = None) -> None:
        check_slots(slots, self.device)
        check_pages(pages, slots.numel(), self.geometry)
        self.pool.index_copy_(0, slots, pages)
        self._bytes_written += slots.numel() * self.geometry.slot_bytes

    def stats(self) -> OffloadStats:
        return OffloadStats(self.kind, {"hbm": self.tier.bytes_resident}, bytes_written=self._bytes_written)

    def close(self) -> None:
        self.tier.close()


class HostSource(PageSource):
    """kind "host": pages in the shared host arena, hot ones cached on the device.

    With a cache, `pool` is the cache's pool (its entries, then one staging row per selected
    position) and misses are copied from the arena by the cache's kernels; without one, `pool` is
    a read buffer of max_selected rows that every resolve gathers its pages into (every selected
    page, every layer: the PCIe-bound floor). On CUDA the arena must be registered (UVA) and
    write-backs go to it over UVA on the current stream; on CPU (tests) the cache runs its torch
    reference.
    Arena slot == engine slot here (SpilledSource maps them). `owns` lists what close() closes.
    """

    kind = "host"

    def __init__(self, arena: HostArena, cache: HotPageCache | None, pool: torch.Tensor,
                 device: torch.device, owns=()):
        self.arena, self.cache, self.pool = arena, cache, pool  # pool: [F, 2, B, d] on device
        self.geometry, self.device, self._owns = arena.geometry, device, list(owns)
        if self.device.type == "cuda":
            self._src, self._written = arena.uva_pool(), torch.cuda.Event()
        else:
            self._src, self._written = arena.pool, None
        self._bytes_written = 0
        # Pages gathered without a cache, counted on the device (a replayed graph adds to it too).
        self._direct = torch.zeros((), dtype=torch.int64, device=device)

    @property
    def _fold_outside(self) -> bool:
        """resolve_or's where runs inside the cache's lookup (with a cache)."""
        return self.cache is not None

    # ---- decode reads (device) ------------------------------------------------------------------

    def _arena_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Arena slots [M] of engine slots [M] (-1 = nothing to read): the same here; a subclass
        that keeps pages elsewhere too maps them (SpilledSource)."""
        return slots

    def resolve(self, slots: torch.Tensor) -> torch.Tensor:
        # slots: [M] engine slots, distinct, -1 = nothing to read -> rows of pool [M]
        slots = self._arena_slots(slots)
        if self.cache is not None:
            return self.cache.lookup_and_fill(slots, self._src)
        rows = torch.arange(slots.numel(), device=slots.device)
        wanted = slots >= 0
        if slots.is_cuda:
            gather_pages(self._src, slots, self.pool, torch.where(wanted, rows, -1))
        else:  # padding rows copy page 0: never read (length 0)
            self.pool[: rows.numel()] = self.arena.pool.index_select(0, slots.clamp_min(0))
        self._direct.add_(wanted.sum())
        return rows

    def resolve_or(self, slots: torch.Tensor, outside: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # slots, rows: [M] int64, outside: [M] bool -> rows of pool [M]; the where is in the lookup
        if not self._fold_outside:
            return super().resolve_or(slots, outside, rows)
        slots = self._arena_slots(slots)
        return self.cache.lookup_and_fill(slots, self._src, outside=(outside, rows))

    def join(self) -> None:
        if self.cache is not None:
            self.cache.join()

    def begin_forward(self) -> None:
        """A new step for the hot cache (its lookups commit inline: the layers of one forward
        share a step; one small kernel, inside the decode graph)."""
        if self.cache is not None:
            self.cache.advance_step()

    # ---- bulk reads and writes ------------------------------------------------------------------

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return read_host(self.arena, slots)

    def write(self, slots: torch.Tensor, pages: torch.Tensor, host_slots: torch.Tensor | None = None) -> None:
        check_slots(slots, self.device)
        check_pages(pages, slots.numel(), self.geometry)
        if pages.device != self.device:
            raise ValueError(f"pages: expected device {self.device}, got {pages.device}")
        slots, pages = slots.contiguous(), pages.contiguous()  # the gather kernel's layout
        if self.cache is not None:
            self.cache.update(slots, pages)  # on the current stream: later lookups are ordered after it
        if self.device.type == "cuda":
            self._write_back(slots, pages)
        else:
            self.arena.write(slots, pages)
        self._bytes_written += slots.numel() * self.geometry.slot_bytes

    def _write_back(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        # pages: [n, 2, B, d] device -> arena slots over UVA, in the current stream's order, so
        # later reads on it see them. Not on a side stream: a kernel run on a second stream puts
        # every CUDA graph replay of the process into a slower launch state for good (about 0.3 us
        # more idle per kernel; docs/notes/decode_step.md), and these writes are small (the pages a
        # step settles, a few hundred KiB every page_size steps).
        src_idx = torch.arange(slots.numel(), dtype=torch.int64, device=self.device)
        gather_pages(pages, src_idx, self._src, slots, backend="triton")
        self._written.record()

    def invalidate(self, slots: torch.Tensor) -> None:
        """The arena bytes of these slots changed elsewhere (the store): drop cached copies."""
        if self.cache is not None:
            self.cache.invalidate(torch.as_tensor(slots, dtype=torch.int64).to(self.device))

    def release(self, slots: torch.Tensor) -> None:
        self.invalidate(slots)

    def synchronize(self) -> None:
        if self._written is not None:
            self._written.synchronize()

    # ---- outside the step -----------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """The arena's and cache's counters; pages gathered without a cache count in bytes_moved."""
        self.synchronize()
        resident = {"host": self.arena.bytes_resident, **self._more_resident()}
        direct = int(self._direct) * self.geometry.slot_bytes
        direct_io = self._direct_io()
        if self.cache is None:
            return OffloadStats(self.kind, resident, bytes_moved=direct, bytes_written=self._bytes_written,
                                nvme_direct_io=direct_io)
        c = self.cache.stats()
        resident["cache"] = c.bytes_resident
        stats = OffloadStats(
            self.kind, resident, c.steps, c.requests, c.hits, c.misses, c.bytes_moved,
            c.bytes_moved_last_step, self._bytes_written, direct_io,
        )  # fmt: skip
        return dataclasses.replace(stats, bytes_moved=stats.bytes_moved + direct)

    def _more_resident(self) -> dict[str, int]:
        return {}

    def _direct_io(self) -> bool | None:
        return None

    def close(self) -> None:
        """Wait for the device, then close what this source owns (unregistering the arena)."""
        self.synchronize()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no kernel may still read the arena we unregister
        for owned in self._owns:
            owned.close()
        self._owns.clear()


def read_host(arena: HostArena, slots: torch.Tensor) -> torch.Tensor:
    """Pages `[n, 2, B, d]` of host-arena slots `[n]`, copied to slots' device (UVA gather on CUDA)."""
    if slots.device.type == "cpu":
        return arena.pool.index_select(0, slots)
    out = torch.empty((slots.numel(), *arena.geometry.page_shape), dtype=arena.geometry.dtype,
                      device=slots.device)
    dst = torch.arange(slots.numel(), dtype=torch.int64, device=slots.device)
    gather_pages(arena.uva_pool(), slots, out, dst)
    return out
