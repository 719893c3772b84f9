"""`SpilledSource` (kind "host+nvme"): a PageStore holds pages in host memory and spills cold ones
to NVMe; the engine's slots reach them through the store's page ids.

Decode reads resolve on the device, with no host wait (graph capturable): engine slot -> store id
-> host slot through two device tables, mirrored from the store's moves before every forward
(`before_forward`). A selected page found on NVMe is not read: it is recorded as missed, and after
the forward `take_misses` promotes the missed pages (one synchronous NVMe read) and asks for the
forward to run again, before anything samples from it (the engine's K/V writes are idempotent).
Pages the decode selects are touched in the store's LRU (`touch_selected`, before any spill), so
spills pick pages no recent step selected.

Looking ahead (`lookahead` >= 2): each decode layer also records, on the device, the pages each row
would select at `lookahead` x its budget (`note_ahead`; a superset of the selection, the pages
nearest to entering it). After every forward `prefetch_ahead` touches them and promotes those on
NVMe, so that the next step, whose selection drifts into them, finds them in host memory instead of
missing and running again. A forward that misses anyway has its own record promoted with its missed
pages, in the same read: its rerun's later layers select near it (their inputs changed).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch
import triton

from . import triton_spilled as kern
from .arena import to_device
from .cache import HotPageCache
from .source import HostSource, read_host
from .store import PageStore, Residency


class SpilledSource(HostSource):
    """HostSource over a local PageStore's arena, for engine slots [0, num_slots)."""

    kind = "host+nvme"

    def __init__(self, store: PageStore, cache: HotPageCache | None, pool: torch.Tensor,
                 device: torch.device, num_slots: int, owns=(), max_selected: int = 0, lookahead: int = 0,
                 spill_behind: bool = False):
        super().__init__(store.arena, cache, pool, device, owns)
        if lookahead < 0 or lookahead == 1:
            raise ValueError(f"lookahead ({lookahead}) must be 0 (off) or >= 2 (a multiple of the budget)")
        self.lookahead = lookahead if max_selected > 0 else 0
        self._ahead_rows = self.lookahead * max_selected  # per layer: the widest wider selection
        self._ahead: dict[int, torch.Tensor] = {}  # layer -> engine slots [ahead_rows], -1 = none
        self.store = store
        self.store.journal_moves = True
        self.spill_behind = spill_behind
        # `wait_for_saves`: called with n before an allocation of n pages that would write a page
        self._room_waiter: Callable[[int], None] | None = None
        self.max_write_pages = store.host_slots // 2  # one write must fit the host arena
        self._ids = torch.full((num_slots,), -1, dtype=torch.int64)  # CPU mirror: engine slot -> id
        self._dev_ids = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self._dev_host = torch.full((store.max_pages,), -1, dtype=torch.int64, device=device)
        self._missed = torch.zeros(num_slots + 1, dtype=torch.int8, device=device)  # + a trash entry
        self._touched = torch.zeros(store.max_pages + 1, dtype=torch.int64, device=device)
        self._clock = torch.zeros((), dtype=torch.int64, device=device)  # forwards run, on the device
        self._forwards = 0  # the same count on the host
        self._touch_synced = 0
        self._read_forward = 0  # the last forward that resolved slots (host count; == _forwards: this one)
        self._sync_reads = False  # resolve promotes on the host, layer by layer (never misses)
        # missed pages, reruns, steps that reran at least once, steps that fell back to host reads
        self.counters_ = {"nvme_missed_pages": 0, "nvme_step_reruns": 0, "nvme_steps_missed": 0,
                          "nvme_sync_steps": 0, "nvme_prefetched_pages": 0}
        # Seconds the caller's thread spent in `write`: waiting for the last write-back, and making
        # room (waits for saves, allocation with its spills, spills written behind).
        self.seconds_ = {"nvme_write_sync_s": 0.0, "nvme_write_room_s": 0.0}

    # ---- decode reads (device) ------------------------------------------------------------------

    def _arena_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Host slots [M] of engine slots [M] (HostSource's resolve and resolve_or read through it):
        through the device tables, pages on NVMe marked missed and read as -1; inside
        `synchronous_reads`, promoted on the host first (never missed)."""
        if self._sync_reads:
            host = self._host_slots(slots)
            return torch.full_like(slots, -1) if host is None else host
        return spilled_resolve(slots, self._dev_ids, self._dev_host, self._missed, self._touched,
                               self._clock)

    def before_forward(self, reads: bool = True) -> None:
        """Mirror the store's moves on the device; count the forward on the host (its device clock
        advances in begin_forward: both count every forward once), and note whether it may miss
        or select pages (reads)."""
        super().before_forward(reads)
        self._apply_moves()
        self._forwards += 1
        if reads:
            self._read_forward = self._forwards

    def begin_forward(self) -> None:
        """The hot cache's step and the device clock that stamps selected pages advance, inside the
        forward: a decode graph replays both (no launch from Python before the replay)."""
        super().begin_forward()
        self._clock.add_(1)

    def _apply_moves(self) -> None:
        """The store's moves since the last call into the device table, in order (a small upload).
        Called after every host-side store call that may move pages, so that a decode read in the
        same forward never sees a slot the store has given to another page."""
        ids, slots = self.store.drain_moves()
        if ids.numel():
            self._dev_host.index_copy_(0, to_device(ids, self.device), to_device(slots, self.device))

    def take_misses(self, rerun: bool = False) -> bool:
        """After a forward: promote the pages it found on NVMe; True if it must run again. One host
        wait (the missed slots) per forward that resolved slots; the promotion reads NVMe
        synchronously. A forward that resolved none (a prefill-only step) missed nothing: no wait."""
        if self._read_forward != self._forwards:
            return False
        slots = torch.nonzero(self._missed[:-1]).flatten().cpu()
        if not slots.numel():
            return False
        self._missed.zero_()
        # The rerun's later layers select from changed hidden states, near this forward's wider
        # selections: promote their cold pages in the same read, so that the rerun does not miss.
        ids, room = self._ids[slots], self.max_write_pages
        ahead = self._cold_ahead(room)
        ahead = ahead[~torch.isin(ahead, ids)][: max(0, room - ids.numel())]
        self.touch_selected()  # the promotion's spills must spare the pages this forward read
        self._promote(torch.cat([ids, ahead]))
        self.counters_["nvme_missed_pages"] += slots.numel()
        self.counters_["nvme_prefetched_pages"] += ahead.numel()
        self.counters_["nvme_step_reruns"] += 1
        self.counters_["nvme_steps_missed"] += 0 if rerun else 1
        return True

    def note_ahead(self, layer: int, slots: torch.Tensor) -> None:
        """Record one decode layer's wider selection (engine slots, any shape, -1 = none) in a fixed
        device buffer (graph capturable: a copy and a fill). A selection wider than the buffer keeps
        its first entries (a hint, not a read)."""
        buf = self._ahead.get(layer)
        if buf is None:  # the first decode step of any key runs eagerly: allocated before a capture
            buf = torch.full((self._ahead_rows,), -1, dtype=torch.int64, device=self.device)
            self._ahead[layer] = buf
        n = min(slots.numel(), buf.numel())
        buf[:n].copy_(slots.flatten()[:n])
        buf[n:].fill_(-1)

    def prefetch_ahead(self) -> None:
        """After a forward: touch the pages of the recorded wider selections (spills spare them) and
        promote those on NVMe, at most half the host arena per call. One host wait."""
        cold = self._cold_ahead(max(1, self.max_write_pages))
        if not cold.numel():
            return
        self.touch_selected()  # the promotion's spills must spare what this step selected
        self._promote(cold)
        self.counters_["nvme_prefetched_pages"] += cold.numel()

    def _promote(self, ids: torch.Tensor) -> Residency:
        """Bring store ids [n] (CPU) into host memory, mirror the moves on the device and drop
        cached copies of the host slots that now hold other pages."""
        res = self.store.ensure_resident(ids)
        self._apply_moves()
        if res.rewritten.numel():
            self.invalidate(res.rewritten)
        return res

    def _cold_ahead(self, most: int) -> torch.Tensor:
        """Store ids [<= most] (CPU) of the recorded wider selections' pages that are on NVMe, the
        recorded pages touched on the device (spills spare them). One host wait; empty without a
        record."""
        if not self._ahead or most <= 0:
            return torch.empty(0, dtype=torch.int64)
        slots = torch.cat(list(self._ahead.values()))
        ids = torch.where(slots >= 0, self._dev_ids[slots.clamp_min(0)], -1)
        self._touched.index_put_((torch.where(ids >= 0, ids, self.store.max_pages),), self._clock)
        host = torch.where(ids >= 0, self._dev_host[ids.clamp_min(0)], -1)
        return torch.unique(ids[(ids >= 0) & (host < 0)]).cpu()[:most]

    @contextlib.contextmanager
    def synchronous_reads(self) -> Iterator[None]:
        """Decode reads promote on the host, layer by layer, inside this block (a step that cannot
        miss; for a step whose selections do not fit host memory at once)."""
        self._sync_reads = True
        self.counters_["nvme_sync_steps"] += 1
        try:
            yield
        finally:
            self._sync_reads = False

    def touch_selected(self) -> None:
        """Tell the store's LRU which pages decode steps selected since the last call. One host
        wait, only where a forward since the last call resolved slots (stamps come only from
        those and from `_cold_ahead`, which runs after one)."""
        if self._read_forward <= self._touch_synced:
            return
        recent = torch.nonzero(self._touched[:-1] > self._touch_synced).flatten().cpu()
        if recent.numel():
            self.store.touch(recent)
        self._touch_synced = self._forwards

    # ---- bulk reads and writes (host) -----------------------------------------------------------

    def _host_slots(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Host slots [n] of engine slots [n] (-1 stays -1), spilled pages promoted; None when no
        entry names a written page."""
        self.synchronize()  # spills read host memory that async write-backs may still fill
        cpu = slots.cpu()
        ids = torch.where(cpu >= 0, self._ids[cpu.clamp_min(0)], -1)
        written = ids >= 0
        if not bool(written.any()):
            return None
        res = self._promote(ids[written])
        out = torch.full_like(slots, -1)
        out[written.to(slots.device)] = res.slots.to(slots.device)
        return out

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Pages [n, 2, B, d] of engine slots [n] (zeros where none was written), on slots' device,
        moving no page: host pages gathered from the arena, spilled ones read from NVMe in place.
        A prefill chunk reads every earlier page of each layer. Promoting them spilled as many
        others, which the next layer's read brought back: SmolLM2's 128K prefill spilled 8.5M
        pages (11 x its KV) and took 123 s, against 5 s on tier host."""
        self.synchronize()  # host pages that async write-backs may still fill
        cpu = slots.cpu()
        ids = torch.where(cpu >= 0, self._ids[cpu.clamp_min(0)], -1)  # [n] store ids, -1 unwritten
        written = ids >= 0
        host = torch.full_like(ids, -1)
        host[written] = self.store.host_slots_of(ids[written])
        out = torch.zeros((slots.numel(), *self.geometry.page_shape), dtype=self.geometry.dtype,
                          device=slots.device)
        on_host, on_nvme = host >= 0, written & (host < 0)
        if bool(on_host.any()):
            out[on_host.to(slots.device)] = read_host(self.arena, host[on_host].to(slots.device))
        if bool(on_nvme.any()):
            out[on_nvme.to(slots.device)] = self.store.read(ids[on_nvme]).to(slots.device)
        return out

    def write(self, slots: torch.Tensor, pages: torch.Tensor, host_slots: torch.Tensor | None = None) -> None:
        """HostSource.write through the store: ids allocated (spilling cold pages), the slot
        tables updated. With host_slots (slots on the CPU) no step here waits for the device: the
        forward that made the pages may still run."""
        start = time.perf_counter()
        self.synchronize()
        synced = time.perf_counter()
        self.touch_selected()  # the spills this allocation may cause must spare recently selected pages
        n, waiter = slots.numel(), self._room_waiter
        if waiter is not None and not self.store.room_without_writes(n):
            waiter(n)  # saves that finish make their pages saved: they leave without a write
        ids, host = self.store.allocate(n)  # may spill cold pages to NVMe
        if self.spill_behind:  # the next write's room, written while the step that fills it runs
            self.store.spill_behind(n, protect=ids, saved_only=waiter is not None)
        self._apply_moves()
        self.seconds_["nvme_write_sync_s"] += synced - start
        self.seconds_["nvme_write_room_s"] += time.perf_counter() - synced
        self._ids[slots.cpu() if host_slots is None else host_slots] = ids
        self._dev_ids.index_copy_(0, slots, to_device(ids, slots.device))
        super().write(to_device(host, slots.device), pages)

    def wait_for_saves(self, waiter: Callable[[int], None]) -> None:
        """Pages here are saved soon (a prefix store's writer, workers/engine/prefix_disk.py): before
        an allocation that would spill a page with a write, call waiter(n), which waits for saves to
        finish and marks their pages saved (`PageStore.mark_saved`), so that they leave without a
        write; spills written behind take saved pages only. A page spilled with a write would be
        written twice (spill and record) and read back for its save."""
        self._room_waiter = waiter

    def release(self, slots: torch.Tensor) -> None:
        cpu_slots = slots.cpu()
        ids = self._ids[cpu_slots]
        ids = ids[ids >= 0]
        if ids.numel():
            host = self.store.host_slots_of(ids)
            self.store.free(ids)
            self._apply_moves()
            self._touched.index_fill_(0, to_device(ids, self.device), 0)  # touch_selected skips freed ids
            if bool((host >= 0).any()):
                self.invalidate(host[host >= 0])
        self._ids[cpu_slots] = -1
        self._dev_ids.index_fill_(0, slots, -1)

    def store_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """The store's page ids [n] (CPU) of engine slots [n] (any device; -1: never written)."""
        return self._ids[slots.cpu()]

    # ---- outside the step -----------------------------------------------------------------------

    def counters(self) -> dict[str, float]:
        d = self.store.describe()
        return {"nvme_spilled_pages": d["spilled_pages"], "nvme_promoted_pages": d["promoted_pages"],
                "nvme_spilled_behind_pages": d["spilled_behind_pages"],
                "nvme_spill_behind_waits": d["spill_behind_waits"],
                "nvme_saved_spilled_pages": d["saved_spilled_pages"],
                "nvme_saved_read_pages": d["saved_read_pages"],
                **self.counters_, **self.seconds_}

    def _more_resident(self) -> dict[str, int]:
        return {"nvme": self.store.nvme.bytes_resident} if self.store.nvme is not None else {}

    def _direct_io(self) -> bool | None:
        return self.store.nvme.direct_io if self.store.nvme is not None else None


# ---- the decode read's table walk ---------------------------------------------------------------

_RESOLVE_BLOCK = 256


def spilled_resolve(slots: torch.Tensor, dev_ids: torch.Tensor, dev_host: torch.Tensor,
                    missed: torch.Tensor, touched: torch.Tensor, clock: torch.Tensor,
                    backend: str | None = None) -> torch.Tensor:
    """Host slots [M] of engine slots [M] (distinct where >= 0; -1 = nothing to read), through
    dev_ids [num_slots] (slot -> store id) and dev_host [max_pages] (id -> host slot); -1 where
    nothing is read or the page is on NVMe. Marks those pages in missed [num_slots + 1] (1 at the
    slot; the last entry is the reference's trash) and stamps every read id's entry of touched
    [max_pages + 1] with clock []. No host wait. backend: "triton" (one launch; CUDA, or CPU under
    TRITON_INTERPRET=1), "torch" (the reference: a dozen small kernels); default by device."""
    backend = backend or ("triton" if slots.is_cuda else "torch")
    if backend == "torch":
        return _resolve_reference(slots, dev_ids, dev_host, missed, touched, clock)
    flat = slots.reshape(-1).contiguous()
    out = torch.empty_like(flat)
    m = flat.numel()
    if m:
        kern.spilled_resolve_kernel[(triton.cdiv(m, _RESOLVE_BLOCK),)](
            flat, dev_ids, dev_host, missed, touched, clock, out, m, BLOCK=_RESOLVE_BLOCK)
    return out.view(slots.shape)


def _resolve_reference(slots, dev_ids, dev_host, missed, touched, clock) -> torch.Tensor:
    valid = slots >= 0
    ids = torch.where(valid, dev_ids[slots.clamp_min(0)], -1)
    host = torch.where(ids >= 0, dev_host[ids.clamp_min(0)], -1)
    missing = (ids >= 0) & (host < 0)
    missed.index_fill_(0, torch.where(missing, slots, missed.numel() - 1).flatten(), 1)
    touched.index_put_((torch.where(ids >= 0, ids, touched.numel() - 1),), clock)
    return torch.where(missing, -1, host)
