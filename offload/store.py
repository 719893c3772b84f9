"""`PageStore`: a node's KV pages, in a shared-memory host arena with NVMe below it.

Logical page ids (int64, in [0, max_pages)) map to a location: a host arena slot
or an NVMe slot, never both. The two tiers add up: max_pages <= host_slots + nvme_slots,
so a page takes NVMe space only while it is spilled, and a promotion frees its NVMe slot
for the next spill. Each NVMe slot's manifest entry names its page id, so a restarted
store finds its spilled pages from the manifest alone. When the host arena is full,
cold pages spill to NVMe: lowest priority hint first, then least recently touched.
Nothing is ever dropped: `ensure_resident` promotes every page it is asked for.

Spills may also be written behind the caller (`spill_behind`): the pages stay in host memory, their
slots theirs and readable, until their write lands (checked at the next placing call, waited for
only when the room is needed); a page that a call writes, makes resident, pins or frees meanwhile
stays on host and its disk copy is dropped. One writer thread; the NVMe tier's own calls are safe
beside it.

Invariant that makes every allocation of free ids fit: host pages + NVMe pages = ids in
use, so while ids are free the NVMe slots free are at least the ids free minus the host
slots free: exactly the spills that room for them needs.

Saved pages (`mark_saved`): a page whose bytes another file holds already (the prefix store's
record of it, written and fsync'd) leaves host memory without a write: its location becomes that
file and offset ("saved"), read back from there, and it takes no NVMe slot. The mark lasts until
the page is written or freed; the file's owner keeps the file until the store calls the release it
was given (once no page refers to it). Saved reads are not checksummed here: the record's crc covers
the whole record (checked when the prefix store reads it back).

Host slots are what the GPU reads; a promoted page may land in a different host
slot than it had, and a reused slot gets new bytes. Calls that rewrite host
slots return those slots, so a GPU worker can invalidate its cached copies.

Plain Python over CPU tensors; a Ray actor wraps it (workers/). State is plain
tensors plus the arena and the NVMe tier, both rebuilt from their names/dirs.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .arena import (
    ArenaFullError,
    PageGeometry,
    RunAllocator,
    SlotAllocator,
    as_slot_tensor,
    check_pages,
    check_slots_in_range,
)
from .host import DEFAULT_PREFIX, DEFAULT_SHM_DIR, HostArena
from .nvme import NvmeTier

FREE, HOST, NVME, SAVED = 0, 1, 2, 3
_TIER_NAMES = {FREE: "free", HOST: "host", NVME: "nvme", SAVED: "saved"}
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Residency:
    """Result of making pages host-resident.

    slots: `[n]` int64 host slots of the requested ids, in request order.
    rewritten: `[k]` int64 host slots whose bytes this call replaced (promotions):
        a cached copy of any of them is stale.
    """

    slots: torch.Tensor
    rewritten: torch.Tensor


@dataclass(frozen=True)
class _Departure:
    """A spill written behind the caller: pages ids `[k]` going to NVMe slots disk `[k]`."""

    seq: int
    ids: torch.Tensor
    disk: torch.Tensor
    write: Future


@dataclass
class _SavedFile:
    """A file holding saved pages' bytes (`mark_saved`; one per path, one descriptor): every
    release it was given is called once no page refers to it."""

    path: str
    releases: list[Callable[[], None]]
    pages: int = 0  # pages marked saved in it
    fd: int = -1  # opened on the first read

    def open(self) -> None:
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def read_into(self, out: memoryview, offset: int) -> None:
        """out's bytes from offset (open first; any thread)."""
        done = 0
        while done < len(out):
            got = os.preadv(self.fd, [out[done:]], offset + done)
            if got == 0:
                raise OSError(f"saved page file {self.path} is short at offset {offset + done}")
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PageStore:
    """Owner of a node's host arena (created here) and optional NVMe spill directory."""

    def __init__(
        self,
        geometry: PageGeometry,
        host_slots: int,
        max_pages: int,
        *,
        nvme_dir: str | None = None,
        nvme_slots: int | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        prefix: str = DEFAULT_PREFIX,
        io_threads: int = 4,
        verify_on_open: bool = True,
    ):
        nvme_slots = _check_sizes(host_slots, max_pages, nvme_dir, nvme_slots)
        self.geometry, self.max_pages = geometry, max_pages
        self.arena = HostArena.create(geometry, host_slots, prefix=prefix, shm_dir=shm_dir)
        self.nvme = None
        if nvme_dir is not None:
            try:
                self.nvme = NvmeTier(geometry, nvme_dir, nvme_slots, io_threads=io_threads,
                                     verify_on_open=verify_on_open)
            except BaseException:
                self.arena.close()  # nothing else holds the segment: it would outlive the error
                raise
        self._ids = SlotAllocator(max_pages)
        self._host = SlotAllocator(host_slots)
        self._nvme = RunAllocator(nvme_slots) if nvme_slots else None  # spills in few runs
        self._loc = torch.zeros(max_pages, dtype=torch.int8)
        self._host_slot = torch.full((max_pages,), -1, dtype=torch.int64)
        self._nvme_slot = torch.full((max_pages,), -1, dtype=torch.int64)
        self._page_of_slot = torch.full((host_slots,), -1, dtype=torch.int64)
        self._last_touch = torch.zeros(max_pages, dtype=torch.int64)
        self._priority = torch.zeros(max_pages, dtype=torch.float64)
        self._prioritised = False  # a touch gave priorities (else all are 0)
        # Without priorities, spills take the coldest host pages from a queue ranked in one pass
        # (`_rank_host_pages`), refilled when it runs short; it ranks this many beyond a call's need.
        self._queue_extra = max(64, host_slots // 32)
        self._spill_queue = torch.empty(0, dtype=torch.int64)  # ids, coldest first
        self._queue_touch = torch.empty(0, dtype=torch.int64)  # their _last_touch when ranked
        self._protected = torch.zeros(max_pages, dtype=torch.bool)  # all False between calls
        self._pinned = torch.zeros(max_pages, dtype=torch.bool)  # `pin`: never spilled nor freed
        self.num_pinned = 0
        self._clock = 1
        self.counters = {"spilled_pages": 0, "promoted_pages": 0, "spill_calls": 0, "promote_calls": 0,
                         "spilled_behind_pages": 0, "spill_behind_waits": 0, "spill_behind_failures": 0,
                         "saved_spilled_pages": 0, "saved_read_pages": 0}
        # Saved pages (`mark_saved`): per page its file's key in _saved_files (-1: none) and offset.
        # Invariant: a file's `pages` counts the pages whose _saved_file is its key.
        self._saved_file = torch.full((max_pages,), -1, dtype=torch.int64)
        self._saved_offset = torch.zeros(max_pages, dtype=torch.int64)
        self._saved_files: dict[int, _SavedFile] = {}
        self._saved_keys: dict[str, int] = {}  # path -> its key in _saved_files
        self._next_saved_file = 0
        self._io_threads, self._saved_pool = io_threads, None  # saved reads' threads, made on first use
        # Spills written behind (`spill_behind`): per page the departure it leaves with, -1 none.
        # Invariant: _leaving[id] >= 0 only for host pages, and num_leaving counts them.
        self._leaving = torch.full((max_pages,), -1, dtype=torch.int64)
        self.num_leaving = 0
        self._departures: deque[_Departure] = deque()  # oldest first
        self._next_departure = 0
        self._writer: ThreadPoolExecutor | None = None  # made on the first spill_behind
        # (ids, host slots or -1) since the last drain_moves; kept only once a reader asks for them.
        self.journal_moves = False
        self._moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._recover()

    def _recover(self) -> None:
        """Adopt the pages a previous store of this NVMe directory left there."""
        if self.nvme is None:
            return
        slots, found = self.nvme.stored_pages()
        if not found.numel():
            return
        past = found >= self.max_pages
        if bool(past.any()):
            self.close()
            raise ValueError(f"nvme_dir {self.nvme.directory} holds page {int(found[past][0])}, beyond "
                             f"max_pages ({self.max_pages}) of this store")
        self._ids.claim(found)
        self._nvme.claim(slots)
        self._loc[found] = NVME
        self._nvme_slot[found] = slots

    # ---- identity ---------------------------------------------------------------------------

    @property
    def host_slots(self) -> int:
        return self._host.num_slots

    def arena_spec(self):
        """What a GPU worker passes to `HostArena.attach_spec` (plain data)."""
        return self.arena.spec()

    def recovered_ids(self) -> torch.Tensor:
        """`[k]` int64: pages on NVMe (after a restart: the ones found in the manifest)."""
        return torch.nonzero(self._loc == NVME).flatten()

    # ---- lifecycle of pages -----------------------------------------------------------------

    @property
    def nvme_slots(self) -> int:
        return self._nvme.num_slots if self._nvme is not None else 0

    def can_allocate(self, n: int) -> bool:
        if self._nvme is None:
            return self._ids.can_allocate(n) and n <= self._host.num_free
        # pinned pages never spill; leaving ones free their slots when their writes land
        spillable = min(self._host.num_used - self.num_pinned - self.num_leaving, self._nvme.num_free)
        return self._ids.can_allocate(n) and n <= self._host.num_free + self.num_leaving + spillable

    def allocate(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New pages: `(ids [n] int64, host slots [n] int64)`, contents undefined until written.

        Spills cold pages to make room. A returned slot may have held another page:
        whoever caches slots must treat it as rewritten once the new page is written.
        Raises ArenaFullError when the ids or the room run out.
        """
        if not self._ids.can_allocate(n):
            raise ArenaFullError(
                f"cannot allocate {n} pages: {self._ids.num_free} of {self.max_pages} ids free"
            )
        if n > self.host_slots:
            raise ArenaFullError(
                f"cannot allocate {n} pages at once: the host arena has {self.host_slots} slots"
            )
        self._make_room(n, protect=torch.empty(0, dtype=torch.int64))
        ids = self._ids.alloc(n)
        return ids, self._place(ids)

    def free(self, ids) -> None:
        """Forget pages wherever they are; their ids and slots become reusable. Raises ValueError
        for a pinned page (a reader still holds its host slot)."""
        ids = self._known(ids, "ids", distinct=True)
        if self.num_pinned and bool(self._pinned[ids].any()):
            raise ValueError(f"free: page {int(ids[self._pinned[ids]][0])} is pinned (unpin it first)")
        self._stay(ids)  # a write in flight may still read the slot: its disk copy is dropped on landing
        self._forget_saved(ids)
        on_host = ids[self._loc[ids] == HOST]
        on_nvme = ids[self._loc[ids] == NVME]
        self._host.free(self._host_slot[on_host])
        self._page_of_slot[self._host_slot[on_host]] = -1
        self._discard_nvme(on_nvme)
        self._loc[ids] = FREE
        self._host_slot[ids] = -1
        self._journal(ids, torch.full_like(ids, -1))
        self._priority[ids] = 0
        self._ids.free(ids)

    def write(self, ids, pages: torch.Tensor) -> Residency:
        """Store page contents `[n, 2, B, d]` (CPU) for ids `[n]`; a spilled page is re-homed on host."""
        ids = self._known(ids, "ids", distinct=True)
        check_pages(pages, ids.numel(), self.geometry)
        # Old bytes of spilled pages are about to be replaced: re-home them without reading.
        res = self._make_resident(ids, read_old=False)
        self._forget_saved(ids)  # new bytes: the saved copy is no longer theirs
        self.arena.write(res.slots, pages)
        return Residency(res.slots, res.slots.clone())

    def read(self, ids) -> torch.Tensor:
        """Page contents `[n, 2, B, d]` (CPU) of ids `[n]`, from wherever they are; moves nothing."""
        ids = self._known(ids, "ids")
        out = torch.empty((ids.numel(), *self.geometry.page_shape), dtype=self.geometry.dtype)
        on_host = self._loc[ids] == HOST
        if bool(on_host.any()):
            out[on_host] = self.arena.read(self._host_slot[ids[on_host]])
        on_nvme, saved = self._loc[ids] == NVME, self._loc[ids] == SAVED
        if bool(on_nvme.any()):
            uniq, inverse = torch.unique(ids[on_nvme], return_inverse=True)
            out[on_nvme] = self.nvme.read(self._nvme_slot[uniq])[inverse]
        if bool(saved.any()):
            out[saved] = self._read_saved(ids[saved])
        return out

    # ---- placement --------------------------------------------------------------------------

    def touch(self, ids, priority=None) -> None:
        """Record a selection of ids (LRU clock). priority `[n]` (e.g. a summary score) is a
        sticky hint: lower priority spills first, ties by least recent touch; pages never
        given one have priority 0."""
        ids = self._known(ids, "ids")
        self._last_touch[ids] = self._clock
        self._clock += 1
        if priority is not None:
            self._prioritised = True  # spills sort by (priority, touch) from now on
            p = torch.as_tensor(priority, dtype=torch.float64).reshape(-1)
            if p.numel() != ids.numel():
                raise ValueError(f"priority has {p.numel()} values for {ids.numel()} ids")
            self._priority[ids] = p

    def ensure_resident(self, ids) -> Residency:
        """Host slots for ids `[n]` (duplicates allowed), promoting spilled ones; also a touch.

        Never skips a page: every id comes back with a host slot holding its bytes.
        """
        ids = self._known(ids, "ids")
        res = self._make_resident(ids, read_old=True)
        self.touch(ids)
        return res

    def promote(self, ids) -> Residency:
        """Bring spilled pages back to host memory (same as ensure_resident without the touch)."""
        return self._make_resident(self._known(ids, "ids"), read_old=True)

    def spill(self, ids) -> None:
        """Move host-resident pages among ids to NVMe now (pages already spilled are skipped)."""
        ids = self._known(ids, "ids")
        self._land(block=True)
        self._spill(torch.unique(ids[self._loc[ids] == HOST]))

    def pin(self, ids) -> None:
        """Keep host pages ids `[n]` (distinct, none pinned) in their host slots until `unpin`:
        never spilled, and `free` refuses them. For a reader of their slots on another thread
        (the prefix store's writer, workers/engine/prefix_disk.py), which calls nothing here."""
        ids = self._known(ids, "ids", distinct=True)
        away = self._loc[ids] != HOST
        if bool(away.any()):
            raise ValueError(f"pin: page {int(ids[away][0])} is not in host memory")
        if bool(self._pinned[ids].any()):
            raise ValueError(f"pin: page {int(ids[self._pinned[ids]][0])} is pinned already")
        self._stay(ids)  # the pin's reader holds the host slot: it must stay there
        self._pinned[ids] = True
        self.num_pinned += ids.numel()

    def unpin(self, ids) -> None:
        """Pinned pages ids `[n]` may spill and be freed again."""
        ids = self._known(ids, "ids", distinct=True)
        if not bool(self._pinned[ids].all()):
            raise ValueError(f"unpin: page {int(ids[~self._pinned[ids]][0])} is not pinned")
        self._pinned[ids] = False
        self.num_pinned -= ids.numel()

    def host_slots_of(self, ids) -> torch.Tensor:
        """`[n]` int64: host slot of each id, -1 where the page is not in host memory."""
        return self._host_slot[self._known(ids, "ids")].clone()

    def drain_moves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every change of a page's host slot since the last call, in order: `(ids [n], slots [n])`
        int64, slot -1 = the page left host memory (spilled or freed). A reader that mirrors
        id -> host slot elsewhere (a GPU table) applies them in order to stay exact."""
        if not self._moves:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty.clone()
        ids, slots = (torch.cat(parts) for parts in zip(*self._moves, strict=True))
        self._moves.clear()
        return ids, slots

    def _journal(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        if self.journal_moves:
            self._moves.append((ids.clone(), slots.clone()))

    def location(self, ids) -> list[str]:
        return [_TIER_NAMES[int(v)] for v in self._loc[self._known(ids, "ids")]]

    def _make_resident(self, ids: torch.Tensor, read_old: bool) -> Residency:
        uniq = torch.unique(ids)
        if uniq.numel() > self.host_slots:
            raise ValueError(
                f"{uniq.numel()} distinct pages requested, more than host_slots ({self.host_slots})"
            )
        self._stay(uniq)  # a caller may write them now, or wants them: they stay on host
        saved = uniq[self._loc[uniq] == SAVED]
        self._promote_saved(saved, uniq, read_old)
        away = uniq[self._loc[uniq] == NVME]
        if away.numel():
            pages = self.nvme.read(self._nvme_slot[away]) if read_old else None
            # With NVMe full, the spills that make room need the promoted pages' slots: free them
            # first. NOTE: a spill's write failing then loses those pages' disk copies; otherwise
            # they are discarded only once their bytes are in host memory.
            spills = away.numel() - self._host.num_free
            early = spills > self._nvme.num_free
            if early:
                self._discard_nvme(away)
            self._make_room(away.numel(), protect=uniq)
            slots = self._place(away)
            if pages is not None:
                self.arena.write(slots, pages)
            if not early:
                self._discard_nvme(away)
            self.counters["promoted_pages"] += away.numel()
            self.counters["promote_calls"] += 1
        rewritten = self._host_slot[torch.cat([saved, away])]
        return Residency(self._host_slot[ids].clone(), rewritten)

    def _promote_saved(self, saved: torch.Tensor, protect: torch.Tensor, read_old: bool) -> None:
        """Saved pages `[k]` back into host slots (their file's bytes read if read_old); they stay
        saved (a later spill writes nothing again). protect: ids the room must not spill."""
        if not saved.numel():
            return
        pages = self._read_saved(saved) if read_old else None
        self._make_room(saved.numel(), protect=protect)
        slots = self._place(saved)
        if pages is not None:
            self.arena.write(slots, pages)
        self.counters["promoted_pages"] += saved.numel()
        self.counters["promote_calls"] += 1

    def _place(self, ids: torch.Tensor) -> torch.Tensor:
        """Give ids host slots (room must exist); returns the slots `[n]`."""
        slots = self._host.alloc(ids.numel())
        self._loc[ids] = HOST
        self._host_slot[ids] = slots
        self._page_of_slot[slots] = ids
        self._journal(ids, slots)
        self._last_touch[ids] = self._clock  # placement counts as a use
        self._clock += 1
        return slots

    def _make_room(self, n: int, protect: torch.Tensor) -> None:
        """Spill the coldest unprotected host pages until n host slots are free."""
        if self._departures:
            self._land(block=False)
        if n <= self._host.num_free:
            return
        if self.nvme is None:
            raise ArenaFullError(f"host arena full ({self.host_slots} slots) and no nvme_dir to spill to")
        if n > self._host.num_free and self._departures:  # room is on its way: wait for it
            self.counters["spill_behind_waits"] += 1
            self._land(block=True)
        need = n - self._host.num_free
        if need <= 0:
            return
        taken = self._coldest(need, protect)
        if taken is None:
            raise ArenaFullError(f"need {need} host slots but fewer pages can spill")
        self._spill(taken)

    def _coldest(self, need: int, protect: torch.Tensor) -> torch.Tensor | None:
        """The `need` coldest host pages, none of protect `[p]` nor pinned (None if fewer)."""
        if self._prioritised:  # priorities may fall: no ranking outlives a call
            try:
                return self._coldest_sorted(need, protect)
            except ArenaFullError:
                return None
        taken = self._take_queued(need, protect)
        if taken is None:
            self._rank_host_pages(need + protect.numel() + self.num_pinned + self._queue_extra)
            taken = self._take_queued(need, protect)
        return taken

    def _take_queued(self, need: int, protect: torch.Tensor) -> torch.Tensor | None:
        """The first `need` unprotected pages of the spill queue that no call touched or moved
        since it was ranked (None if it holds fewer); they leave the queue.

        Invariant (no priorities): the queue's live entries are the coldest host pages, in the
        order a full sort would give (oldest touch, ties by host slot). A ranking takes a prefix
        of that order; touches only raise a page's clock (placement counts as a touch), so a page
        outside the prefix never overtakes one inside, and a touched or moved one is dropped."""
        q, t = self._spill_queue, self._queue_touch
        live = (self._loc[q] == HOST) & (self._last_touch[q] == t)
        q, t = q[live], t[live]
        self._protected[protect] = True  # a mask kept between calls: isin took 1.7 ms a call
        spare = ~self._protected[q] & ~self._pinned[q] if self.num_pinned else ~self._protected[q]
        usable = torch.nonzero(spare).flatten()
        self._protected[protect] = False
        if usable.numel() < need:
            return None
        keep = torch.ones(q.numel(), dtype=torch.bool)
        keep[usable[:need]] = False
        self._spill_queue, self._queue_touch = q[keep], t[keep]
        return q[usable[:need]]

    def _rank_host_pages(self, m: int) -> None:
        """The spill queue: the m coldest host pages (all of them if fewer), coldest first. One
        bounded pass over the host pages (topk for the m-th smallest touch, then the ties in slot
        order), where sorting every resident page took 81 ms a call at 368K host pages (SmolLM2 at
        128K tokens; 2 CPU cores); the queue then serves many promotions without a pass."""
        ids = self._page_of_slot[self._page_of_slot >= 0]  # host pages in slot order
        touch = self._last_touch[ids]
        if m < ids.numel():
            cut = torch.topk(touch, m, largest=False, sorted=False).values.max()  # the m-th smallest
            below = torch.nonzero(touch < cut).flatten()
            ties = torch.nonzero(touch == cut).flatten()[: m - below.numel()]
            pos = torch.sort(torch.cat([below, ties])).values  # slot order
        else:
            pos = torch.arange(ids.numel())
        pos = pos[torch.argsort(touch[pos], stable=True)]  # oldest touch first, ties by slot
        self._spill_queue, self._queue_touch = ids[pos], touch[pos]

    def _coldest_sorted(self, n: int, protect: torch.Tensor) -> torch.Tensor:
        """With priorities: the n unprotected host pages of lowest (priority, last touch, host
        slot), by a full sort."""
        resident = self._page_of_slot[self._page_of_slot >= 0]
        protected = torch.zeros(self.max_pages, dtype=torch.bool)
        protected[protect] = True  # a mask, not isin: O(pages)
        resident = resident[~protected[resident] & ~self._pinned[resident]]
        if resident.numel() < n:
            raise ArenaFullError(f"need {n} host slots but only {resident.numel()} pages can spill")
        # lexsort by (priority, last_touch): sort by the minor key, then stably by the major one.
        order = torch.argsort(self._last_touch[resident], stable=True)
        order = order[torch.argsort(self._priority[resident][order], stable=True)]
        return resident[order[:n]]

    def _spill(self, ids: torch.Tensor) -> None:
        ids = self._leave_saved(ids)
        if ids.numel() == 0:
            return
        if self.nvme is None:
            raise ArenaFullError("cannot spill: the store has no nvme_dir")
        if ids.numel() > self._nvme.num_free:
            raise ArenaFullError(f"cannot spill {ids.numel()} pages: {self._nvme.num_free} of "
                                 f"{self.nvme_slots} NVMe slots free")
        slots, disk = self._host_slot[ids], self._nvme.alloc(ids.numel())
        try:
            self.nvme.write(disk, self.arena.pool, page_ids=ids, rows=slots)  # gathered on the I/O threads
        except BaseException:
            self._nvme.free(disk)  # the pages stay on host: nothing is lost
            raise
        self._to_nvme(ids, disk)

    def _to_nvme(self, ids: torch.Tensor, disk: torch.Tensor) -> None:
        """Host pages ids `[k]`, whose bytes NVMe slots disk `[k]` now hold, leave host memory."""
        self._nvme_slot[ids] = disk
        self._leave_host(ids, NVME)
        self.counters["spilled_pages"] += ids.numel()
        self.counters["spill_calls"] += 1

    def _leave_host(self, ids: torch.Tensor, loc: int) -> None:
        """Host pages ids `[k]` give up their host slots and are at loc (NVME or SAVED) now."""
        slots = self._host_slot[ids]
        self._host.free(slots)
        self._page_of_slot[slots] = -1
        self._host_slot[ids] = -1
        self._journal(ids, torch.full_like(ids, -1))
        self._loc[ids] = loc

    # ---- spills written behind ----------------------------------------------------------------

    def spill_behind(self, n: int, protect=None, saved_only: bool = False) -> int:
        """Start writing cold host pages to NVMe behind the caller, so that n host slots are free
        at the next allocation (counting the writes in flight); returns how many it started. The
        pages stay readable in host memory until their write lands (saved pages, which need no
        write, leave at once); protect `[p]`: ids it must
        not pick (e.g. pages whose bytes the caller is still copying in); saved_only: take only
        saved pages (no write at all; for a caller whose other pages will be saved soon). Never
        raises for want of room: an allocation that finds too little spills inline as before."""
        if self.nvme is None:
            return 0
        self._land(block=False)
        spillable = self._host.num_used - self.num_pinned - self.num_leaving
        need = min(n - self._host.num_free - self.num_leaving, self._nvme.num_free, spillable)
        if need <= 0:
            return 0
        held = [d.ids for d in self._departures]  # leaving pages must not leave twice
        if protect is not None:
            held.append(self._known(protect, "protect"))
        if saved_only:
            host, saved = self._saved_on_host()
            held.append(host[~saved])  # every unsaved host page
            need = min(need, int((saved & ~self._pinned[host] & (self._leaving[host] < 0)).sum()))
            if need <= 0:
                return 0
        taken = self._coldest(need, torch.cat(held) if held else torch.empty(0, dtype=torch.int64))
        if taken is None or taken.numel() == 0:
            return 0
        started = taken.numel()
        taken = self._leave_saved(taken)  # no write to wait for: they leave now
        if taken.numel() == 0:
            return started
        disk = self._nvme.alloc(taken.numel())
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="nvme-spill")
        seq, self._next_departure = self._next_departure, self._next_departure + 1
        write = self._writer.submit(self.nvme.write, disk, self.arena.pool, page_ids=taken,
                                    rows=self._host_slot[taken])
        self._departures.append(_Departure(seq, taken, disk, write))
        self._leaving[taken] = seq
        self.num_leaving += taken.numel()
        return started

    def room_without_writes(self, n: int) -> bool:
        """Whether n host slots can be had with no page written: free ones, those whose spills are
        in flight, and the slots of saved pages that are not pinned."""
        free = self._host.num_free + self.num_leaving
        if free >= n:
            return True
        host, saved = self._saved_on_host()
        return free + int((saved & ~self._pinned[host]).sum()) >= n

    def _saved_on_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host pages' ids `[h]` and whether each is saved `[h]` (bool)."""
        host = self._page_of_slot[self._page_of_slot >= 0]
        return host, self._saved_file[host] >= 0

    def wait_spills(self) -> None:
        """Wait for every spill written behind and land it."""
        self._land(block=True)

    def _stay(self, ids: torch.Tensor) -> None:
        """Pages ids `[n]` stay on host: a departure in flight drops their disk copies on landing."""
        if not self.num_leaving:
            return
        ids = torch.unique(ids)
        going = ids[self._leaving[ids] >= 0]
        self._leaving[going] = -1
        self.num_leaving -= going.numel()

    def _land(self, block: bool) -> None:
        """Finish the departures whose writes are done (all of them if block), oldest first: their
        pages still leaving go to NVMe; the disk copies of pages that stayed are dropped. A failed
        write loses nothing (its pages stay on host) and is logged."""
        while self._departures and (block or self._departures[0].write.done()):
            d = self._departures.popleft()
            mine = self._leaving[d.ids] == d.seq
            going = d.ids[mine]
            self._leaving[going] = -1
            self.num_leaving -= going.numel()
            try:
                d.write.result()
            except Exception as e:  # noqa: BLE001 (the pages are still on host)
                self._nvme.free(d.disk)
                self.counters["spill_behind_failures"] += 1
                log.warning("a spill written behind failed (its %d pages stay in host memory): %s",
                            d.ids.numel(), e)
                continue
            stayed = d.disk[~mine]
            if stayed.numel():
                self.nvme.discard(stayed)
                self._nvme.free(stayed)
            if going.numel():
                self._to_nvme(going, d.disk[mine])
                self.counters["spilled_behind_pages"] += going.numel()

    # ---- saved pages ----------------------------------------------------------------------------

    def mark_saved(self, ids, path: str, offsets, release: Callable[[], None]) -> None:
        """Pages ids `[k]` (distinct) hold the bytes that the file at path holds at offsets `[k]`
        (slot_bytes each) and will until they are written or freed: from now on their spills write
        nothing (module doc). The file must stay until release() is called, once no page refers to
        it (at once if k is 0). A page marked before is marked again (its old file released)."""
        ids = self._known(ids, "ids", distinct=True)
        offsets = torch.as_tensor(offsets, dtype=torch.int64).reshape(-1)
        if offsets.numel() != ids.numel():
            raise ValueError(f"mark_saved: {offsets.numel()} offsets for {ids.numel()} ids")
        if bool((offsets < 0).any()):
            raise ValueError(f"mark_saved: offset {int(offsets[offsets < 0][0])} is negative")
        self._forget_saved(ids)
        if not ids.numel():
            release()
            return
        key = self._saved_keys.get(path)
        if key is None:  # a file marked again shares its entry (a 1M-token restore marks ~1,000 times)
            key, self._next_saved_file = self._next_saved_file, self._next_saved_file + 1
            self._saved_files[key], self._saved_keys[path] = _SavedFile(path, []), key
        f = self._saved_files[key]
        f.releases.append(release)
        f.pages += ids.numel()
        self._saved_file[ids] = key
        self._saved_offset[ids] = offsets

    def _leave_saved(self, ids: torch.Tensor) -> torch.Tensor:
        """Saved host pages among ids `[n]` leave host memory now, writing nothing; returns the rest."""
        saved = self._saved_file[ids] >= 0
        if not bool(saved.any()):
            return ids
        self._leave_host(ids[saved], SAVED)
        self.counters["saved_spilled_pages"] += int(saved.sum())
        return ids[~saved]

    def _forget_saved(self, ids: torch.Tensor) -> None:
        """Pages ids `[n]` are no longer saved: their bytes change (write made them resident first)
        or they are freed. A file no page refers to any more is released."""
        keys = self._saved_file[ids]
        marked = keys >= 0
        if not bool(marked.any()):
            return
        keys, counts = torch.unique(keys[marked], return_counts=True)
        self._saved_file[ids[marked]] = -1
        for key, count in zip(keys.tolist(), counts.tolist(), strict=True):
            f = self._saved_files[key]
            f.pages -= count
            if f.pages == 0:
                del self._saved_files[key], self._saved_keys[f.path]
                f.close()
                for release in f.releases:
                    release()

    def _read_saved(self, ids: torch.Tensor) -> torch.Tensor:
        """Contents `[n, 2, B, d]` of saved pages ids `[n]`, read from their files: runs of
        consecutive offsets in one file are one pread."""
        sb, n = self.geometry.slot_bytes, ids.numel()
        keys, offs = self._saved_file[ids], self._saved_offset[ids]
        order = torch.argsort(keys * (1 << 40) + offs)  # file, then offset (offsets < 1 TiB)
        out = torch.empty((n, sb), dtype=torch.uint8)
        buf = memoryview(out.numpy()).cast("B")
        k, o = keys[order], offs[order]
        # runs: same file, next offset one slot on; found in one pass of tensor ops, not per page
        breaks = torch.ones(n + 1, dtype=torch.bool)
        breaks[1:n] = (k[1:] != k[:-1]) | (o[1:] != o[:-1] + sb)
        edges = torch.nonzero(breaks).flatten().tolist()  # run i: pages edges[i] .. edges[i + 1] - 1
        runs = []
        for start, end in zip(edges[:-1], edges[1:], strict=True):
            f = self._saved_files[int(k[start])]
            f.open()
            runs.append((f, buf[start * sb : end * sb], int(o[start])))
        if self._io_threads > 1 and len(runs) > 1:  # random pages: queue depth, as the NVMe tier
            if self._saved_pool is None:
                self._saved_pool = ThreadPoolExecutor(self._io_threads, thread_name_prefix="saved-read")
            parts = [runs[j :: self._io_threads] for j in range(self._io_threads)]
            for fut in [self._saved_pool.submit(_read_runs, part) for part in parts if part]:
                fut.result()
        else:
            _read_runs(runs)
        result = torch.empty_like(out)
        result[order] = out
        self.counters["saved_read_pages"] += n
        return result.view(self.geometry.dtype).view(n, *self.geometry.page_shape)

    def _discard_nvme(self, ids: torch.Tensor) -> None:
        """Forget the NVMe copies of spilled pages ids and free their slots."""
        if not ids.numel():
            return
        disk = self._nvme_slot[ids]
        self.nvme.discard(disk)
        self._nvme.free(disk)
        self._nvme_slot[ids] = -1

    def _known(self, ids, name: str, distinct: bool = False) -> torch.Tensor:
        t = as_slot_tensor(ids, name)
        check_slots_in_range(t, self.max_pages, name)
        free = self._loc[t] == FREE
        if bool(free.any()):
            raise ValueError(f"{name} holds page {int(t[free][0])}, which is not allocated")
        if distinct and t.numel() != torch.unique(t).numel():
            raise ValueError(f"{name} must be distinct, got {t.tolist()[:16]}")
        return t

    # ---- metrics and shutdown ---------------------------------------------------------------

    def describe(self) -> dict:
        """Plain-data summary for metrics and logs."""
        sb = self.geometry.slot_bytes
        n_host, n_nvme = int((self._loc == HOST).sum()), int((self._loc == NVME).sum())
        n_saved = int((self._loc == SAVED).sum())
        return {
            "arena": None if self.arena.closed else self.arena.name,
            "geometry": self.geometry.to_dict(),
            "slot_bytes": sb,
            "host_slots": self.host_slots,
            "nvme_slots": self.nvme_slots,
            "max_pages": self.max_pages,
            "pages_host": n_host,
            "pages_nvme": n_nvme,
            "bytes_host": n_host * sb,
            "bytes_nvme": n_nvme * sb,
            "pages_saved": n_saved,
            "bytes_saved": n_saved * sb,
            "bytes_host_reserved": self.host_slots * sb,
            "nvme_dir": self.nvme.directory if self.nvme else None,
            "nvme_direct_io": self.nvme.direct_io if self.nvme else None,
            "pages_leaving": self.num_leaving,
            **self.counters,
        }

    def close(self) -> None:
        """Remove the arena segment and close the NVMe files (spilled pages stay on disk); spills in
        flight land first."""
        if self._departures:
            self._land(block=True)
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        self.arena.close()
        if self._saved_pool is not None:
            self._saved_pool.shutdown(wait=True)
        for f in self._saved_files.values():  # not released: their owner closes with the store
            f.close()
        if self.nvme is not None:
            self.nvme.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_runs(runs: list[tuple[_SavedFile, memoryview, int]]) -> None:
    for f, out, offset in runs:
        f.read_into(out, offset)


def _check_sizes(host_slots: int, max_pages: int, nvme_dir: str | None, nvme_slots: int | None) -> int:
    """NVMe slots of a store (0 without nvme_dir); default: enough for every page not on host."""
    if nvme_dir is None:
        if max_pages > host_slots:
            raise ValueError(
                f"max_pages ({max_pages}) exceeds host_slots ({host_slots}) but nvme_dir is None"
            )
        if nvme_slots:
            raise ValueError(f"nvme_slots ({nvme_slots}) given but nvme_dir is None")
        return 0
    if nvme_slots is None:
        nvme_slots = max(1, max_pages - host_slots)
    if nvme_slots <= 0:
        raise ValueError(f"nvme_slots ({nvme_slots}) must be > 0")
    if max_pages > host_slots + nvme_slots:
        raise ValueError(f"max_pages ({max_pages}) exceeds host_slots ({host_slots}) + nvme_slots "
                         f"({nvme_slots}): some pages would have nowhere to go")
    return nvme_slots
