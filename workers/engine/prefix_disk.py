"""Cached prefixes kept across engine restarts (tier host+nvme): a page id's K/V and summaries as one
record of a `PrefixStore` in the NVMe directory, written in the background after the prefix cache
takes the page, and read back into fresh page ids when a later engine's admission finds its digest.

A record of page id p: its K/V of every layer and KV head, `[L, Hkv, 2, B, d]` in the KV dtype,
then each summary field's rows `[L, Hkv, ...]` (SummaryTable.page_rows), as bytes. Summaries are
persisted, not rebuilt: a restored page is bitwise the page that was cached, summary included.
The store's files are `<nvme_dir>/prefix-<salt>.*`: another model, dtype, page size, rank, bits or
attention mode opens other files and never reads these records.

Saves in the background: `save` (the engine's thread, when the cache takes pages: a prompt's full
pages chunk by chunk as it is prefilled) defers the pages; as the pin budget allows (queued saves
pin at most half the host arena), a deferred run is taken (`_submit`, at `save` and at every `reap`;
before a prompt's end only whole saves of save_job_bytes, so that a long prompt's saves start while
its pages are still in host memory and a short one's stay one segment): its summary rows copied to
the host (a device gather, copied without a host wait on CUDA), its K/V's host slots pinned in the
page store (never spilled, and `free` refuses them), and the save queued; one writer thread reads
the K/V from the host arena, builds the records and `put`s them (segment written and fsync'd, then
its index record appended: crash safety is the store's). Pages on NVMe when taken are read then, on
the engine's thread (the writer never calls the store: their NVMe slots move on promotion); so are
deferred pages that eviction or `close` needs before pins allow. The writer touches no device and no
store state: it reads host slots that pins keep, and host memory the engine gave it.
Why deferred: a 32K-token document's save past the budget was read on the engine's thread inside
the request's first step (2 GiB of K/V copied out of the arena: 0.8 s of a 2.5 s TTFT on the H100).

Saved spills (saved_spills, cache.nvme_saved_spills): once a save is written, its pages are marked
saved in the page store with their records' offsets (`_mark_saved`, at reap, before the unpin), so
that spilling them later writes nothing: the page store reads them back from the segment, which the
prefix store keeps (held) while a page refers to it. So are restored pages, whose records were read.
Without it, a document spilled during its own prefill was written to disk twice (its records and
its spills): 31.6 GB for 128K tokens of the 8B shape, the disk's bound (docs/notes/prefill.md).

NOTE: a page id with a queued or deferred save is never freed before the writer has read it:
eviction (`wait_for`) takes the deferred ones at once and waits for the saves that hold the pages
it frees (it does not cancel them: a cached document being evicted is the one a restart would
want). Saves end in queue order; the engine's
thread unpins a finished save's pages (`reap`, at each step) - the writer never changes the store.
Killed (SIGKILL) with saves queued: those saves are lost (their segments unindexed, removed on the
next open); the ones indexed before stay.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from lockserve.offload.prefix_store import PrefixStore

from .kv_manager import KVManager, SummaryTable
from .uploads import to_host, upload

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 256 << 20  # records read from the tier (or the store) per part of a restore
WRITE_PART_BYTES = 64 << 20  # records a part of a save (the writer's buffers hold store.parts_held + 1)
SAVE_JOB_BYTES = 1 << 30  # K/V bytes of one queued save (one segment); a larger save is split
CLOSE_DRAIN_S = 300.0  # how long `close` waits for queued saves before dropping the rest
MAX_QUEUED_BYTES = 4 << 30  # host copies queued saves may hold (rows, early reads) before save waits


@dataclass
class _Save:
    """One queued save: cached page ids pids [M] named digests [M], one segment of the store."""

    digests: list[bytes]
    pids: list[int]
    host: torch.Tensor  # [L, M, Hkv] host-arena slots of their K/V (CPU; -1: read early)
    pinned: torch.Tensor  # [k] the store ids pinned for them, unpinned when the save is reaped
    pinned_at: torch.Tensor  # [k] their positions in host's flat [L, M, Hkv]
    early: torch.Tensor  # [s, 2, B, d] K/V of the pages that were on NVMe, read when queued
    rows: dict[str, torch.Tensor]  # summary field -> [L, M, Hkv, ...] on the host
    ready: torch.cuda.Event | None  # CUDA: after the arena's write-backs and the rows' copy
    done: threading.Event = field(default_factory=threading.Event)
    written: int = 0  # pages the store took (0 on a failure)

    @property
    def num_pages(self) -> int:
        return len(self.pids)

    @property
    def held_bytes(self) -> int:
        """Host bytes of its copies (the summary rows and the early reads)."""
        return sum(t.numel() * t.element_size() for t in (self.early, *self.rows.values()))


class PrefixDisk:
    """The scheduler's persistent prefix index (see Scheduler): `save` after the prefix cache takes
    pages (queued; returns at once), `restore` at admission for the pages after the in-memory hit,
    `wait_for` before page ids are freed. close_drain_s: how long `close` waits for queued saves;
    max_queued_bytes: host copies queued saves may hold before `save` waits for the oldest;
    save_job_bytes: K/V bytes of one save (one segment; cache.prefix_save_mib); saved_spills: mark
    written and restored pages saved in the page store (the module doc; cache.nvme_saved_spills);
    wait_for_saves: the tier's allocations wait for queued saves rather than spill a page with a
    write (`_wait_for_room`; cache.nvme_wait_for_saves, needs saved_spills)."""

    def __init__(self, kv: KVManager, nvme_dir: str, salt: bytes, capacity_bytes: int,
                 close_drain_s: float = CLOSE_DRAIN_S, max_queued_bytes: int = MAX_QUEUED_BYTES,
                 save_job_bytes: int = SAVE_JOB_BYTES, saved_spills: bool = True,
                 wait_for_saves: bool = False):
        if type(kv.summaries) is not SummaryTable:
            name = type(kv.summaries).__name__
            raise ValueError(f"persisted prefixes need LOCKS's summary table, not {name}")
        if kv.spec.kind != "host+nvme":
            raise ValueError(f"persisted prefixes need tier host+nvme, not {kv.spec.kind}")
        self.kv, self.close_drain_s, self.saved_spills = kv, close_drain_s, saved_spills
        self.pages = kv.settled.store  # the node's PageStore: its host arena holds the K/V
        lay = kv.layout
        probe = kv.summaries.page_rows(torch.zeros(1, dtype=torch.int64, device=kv.device))
        self._fields = {name: (t.shape[2:], t.dtype) for name, t in probe.items()}  # [Hkv, ...] each
        self._per_id = lay.num_layers * lay.num_kv_heads  # store pages of one page id
        self._kv_bytes = self._per_id * lay.geometry.slot_bytes
        self.page_bytes = self._kv_bytes + sum(t[:, 0].numel() * t.element_size() for t in probe.values())
        header = {"salt": salt.hex(), "layers": lay.num_layers, "kv_heads": lay.num_kv_heads,
                  "page_size": lay.page_size, "head_dim": lay.head_dim, "dtype": str(lay.dtype),
                  "summary": repr(sorted((n, tuple(s), str(d)) for n, (s, d) in self._fields.items()))}
        self.store = PrefixStore(nvme_dir, self.page_bytes, capacity_bytes, header,
                                 name=f"prefix-{salt.hex()}")
        self._chunk = max(1, READ_CHUNK_BYTES // self.page_bytes)
        # The writer's part buffers, used in turn, and the arena gather's (one part's K/V), made at
        # its first save (`_records`): a new buffer a part took a page fault per 4 KiB page as it
        # was filled (scripts/save_floor_probe.py: docs/results/save_floor_devvm_90da285.json).
        self._part_pages = max(1, WRITE_PART_BYTES // self.page_bytes)
        self._parts: list[torch.Tensor] = []
        self._gathered: torch.Tensor | None = None
        # Pins of queued saves take at most half the host arena (the other half spills for the
        # engine's writes and promotions, which take at most half at once: SpilledSource).
        self._max_pinned = self.pages.host_slots // 2
        self._job_pages = max(1, save_job_bytes // self._kv_bytes)
        self._jobs: deque[_Save] = deque()  # queued and not yet reaped, oldest first
        self._deferred: dict[bytes, int] = {}  # digest -> page id, saves not taken yet, oldest first
        self._flush = False  # take every deferred page as the budget allows (else whole saves only)
        self._pending: dict[bytes, _Save] = {}
        self._by_pid: dict[int, _Save] = {}
        # Bounded by what queued saves hold: pinned host slots (at most _max_pinned) and host
        # copies (at most max_queued_bytes past one save: `save` waits for the oldest beyond it).
        self._queue: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self.max_queued_bytes = max_queued_bytes
        self._abandon = threading.Event()
        self.counters = {"prefix_disk_saved_pages": 0, "prefix_disk_restored_pages": 0,
                         "prefix_disk_written_bytes": 0, "prefix_disk_failed_pages": 0,
                         "prefix_disk_early_reads": 0, "prefix_disk_save_waits": 0,
                         "prefix_disk_queued_pages": 0, "prefix_disk_room_waits": 0,
                         # seconds: the engine's thread in save / take / wait_for / the room wait
                         # (snapshots, early reads, waits), of which waiting for the writer; the writer
                         # reading and writing saves, of which building their records (gathering the
                         # K/V and summaries into them; the rest is the store's writes, checksums and
                         # fsyncs, as far as they outlast the building)
                         "prefix_disk_engine_s": 0.0, "prefix_disk_wait_s": 0.0,
                         "prefix_disk_writer_s": 0.0, "prefix_disk_produce_s": 0.0}
        if wait_for_saves:
            if not saved_spills:
                raise ValueError("wait_for_saves needs saved_spills (a finished save frees room only then)")
            kv.settled.wait_for_saves(self._wait_for_room)
        self._writer = threading.Thread(target=self._run, name="prefix-store-writer", daemon=True)
        self._writer.start()

    # ---- the engine's thread ------------------------------------------------------------------

    def save(self, digests: Sequence[bytes], pids: Sequence[int], flush: bool = True) -> int:
        """Queue the cached pages pids [M] named digests [M] (their K/V settled in the tier and
        their summaries in the table) for the writer; those stored or queued already are skipped.
        Returns without waiting for the writer: pages past the pin budget stay deferred until
        queued saves are written (`reap` takes them). flush False (a prompt's chunk, more to
        come): deferred pages are taken only a whole save (save_job_bytes) at a time, so a long
        prompt's saves start while its first pages are still in host memory and a short one's stay
        one segment. Returns pages queued or deferred."""
        with self._timed("prefix_disk_engine_s"):
            new = [(d, p) for d, p in zip(digests, pids, strict=True)
                   if d not in self._pending and d not in self._deferred and d not in self.store]
            self._deferred.update(new)
            self._flush = self._flush or flush
            self.reap()
        return len(new)

    def take(self, pids: Sequence[int]) -> None:
        """Queue the deferred saves of page ids pids now, whatever the pin budget: their K/V or their
        summary rows are about to leave (eviction, idle summaries moving to the host)."""
        with self._timed("prefix_disk_engine_s"):
            self._submit(force=pids)

    @contextlib.contextmanager
    def _timed(self, counter: str) -> Iterator[None]:
        """Adds the block's seconds to counters[counter]."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.counters[counter] += time.perf_counter() - start

    def _submit(self, force: Sequence[int] = ()) -> None:
        """Queue deferred saves, oldest first, while the pin budget has room for their pages (a save
        of at most save_job_bytes each); with `force`, those page ids now whatever the budget
        (eviction frees them: what pins cannot hold is read early). Past max_queued_bytes of host
        copies in queued saves, waits for the oldest (prefix_disk_save_waits)."""
        forced = set(force)
        while self._deferred:
            wanted = [(d, p) for d, p in self._deferred.items() if p in forced][: self._job_pages] \
                if forced else []  # no scan of the deferred pages at a plain step's reap
            if not wanted:
                if not self._flush and len(self._deferred) < self._job_pages:
                    return  # a part of a save: wait for the rest of it, or for the prompt's end
                room = (self._max_pinned - self.pages.num_pinned) // self._per_id
                if room <= 0:
                    return
                wanted = list(itertools.islice(self._deferred.items(), min(room, self._job_pages)))
            while self._jobs and sum(j.held_bytes for j in self._jobs) > self.max_queued_bytes:
                self.counters["prefix_disk_save_waits"] += 1
                self._wait(self._jobs[0])
                self._reap_done()
            for d, _ in wanted:
                del self._deferred[d]
            job = self._snapshot([d for d, _ in wanted], [p for _, p in wanted])
            self._jobs.append(job)
            self._pending.update((d, job) for d in job.digests)
            self._by_pid.update((p, job) for p in job.pids)
            self._queue.put(job)
            self.counters["prefix_disk_queued_pages"] += job.num_pages
        self._flush = False  # nothing deferred: the next prompt's chunks wait for whole saves again

    def _snapshot(self, digests: list[bytes], pids: list[int]) -> _Save:
        """What the writer needs of pids, taken now: their summary rows on the host, their K/V's
        host slots pinned. Read now (counted as prefix_disk_early_reads): pages on NVMe, and those
        past the pin budget (queued saves pin at most half the host arena)."""
        lay, dev = self.kv.layout, self.kv.device
        ids = upload(pids, device=dev)
        store_ids = self._store_ids(pids)  # [L * M * Hkv], made on the host: no wait for the step
        host = self.pages.host_slots_of(store_ids)
        room = max(0, self._max_pinned - self.pages.num_pinned)
        on_host = torch.nonzero(host >= 0).flatten()
        host[on_host[room:]] = -1  # past the budget: read now
        away = host < 0
        if bool(away.any()):
            self.kv.settled.synchronize()  # host pages that async write-backs may still fill
            early = self.pages.read(store_ids[away])
        else:
            early = torch.empty(0)
        self.counters["prefix_disk_early_reads"] += int(away.sum())
        self.pages.pin(store_ids[~away])
        rows = {name: to_host(t) for name, t in self.kv.summaries.page_rows(ids).items()}
        ready = None
        if dev.type == "cuda":  # write-backs to the arena and the rows' copies are on this stream
            ready = torch.cuda.Event()
            ready.record()
        kept = torch.nonzero(~away).flatten()
        shape = (lay.num_layers, len(pids), lay.num_kv_heads)
        return _Save(digests, pids, host.view(shape), store_ids[kept], kept, early, rows, ready)

    def reap(self) -> int:
        """Unpin the pages of the saves the writer finished (oldest first), then queue deferred
        saves that their room allows; returns how many saves finished."""
        n = self._reap_done()
        self._submit()
        return n

    def _reap_done(self) -> int:
        n = 0
        while self._jobs and self._jobs[0].done.is_set():
            job = self._jobs.popleft()
            if job.written and self.saved_spills:  # still pinned: on host, the bytes the writer read
                self._mark_saved(job.digests[: job.written], job.pinned, job.pinned_at, job.num_pages)
            self.pages.unpin(job.pinned)
            for d in job.digests:
                del self._pending[d]
            for p in job.pids:
                del self._by_pid[p]
            self.counters["prefix_disk_saved_pages"] += job.written
            self.counters["prefix_disk_written_bytes"] += job.written * self.page_bytes
            self.counters["prefix_disk_failed_pages"] += job.num_pages - job.written
            n += 1
        return n

    def _wait_for_room(self, n: int) -> None:
        """Before the tier allocates n store pages and would spill a page with a write: wait for
        queued saves, oldest first, and mark their pages saved (the reap without queueing more),
        until n slots can be had without a write or no save is queued (then it spills as before).
        Called from the tier's write (SpilledSource.wait_for_saves); the writer needs nothing of
        this thread, so the wait ends."""
        with self._timed("prefix_disk_engine_s"):
            while self._jobs and not self.pages.room_without_writes(n):
                self.counters["prefix_disk_room_waits"] += 1
                self._wait(self._jobs[0])
                self._reap_done()

    def _wait(self, job: _Save) -> None:
        """The engine's thread waits until the writer has finished job (timed)."""
        with self._timed("prefix_disk_wait_s"):
            job.done.wait()

    def wait_for(self, pids: Sequence[int]) -> None:
        """Before page ids pids are freed (evicted): queue the deferred saves among them, wait until
        the writer has finished every queued save that holds one of them (it has read their K/V),
        then unpin them."""
        with self._timed("prefix_disk_engine_s"):
            self._submit(force=pids)
            waits = {id(job): job for p in pids if (job := self._by_pid.get(p)) is not None}
            for job in waits.values():
                self._wait(job)
            self.reap()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Queue every deferred save and wait for all of them (at most timeout_s); True if none is
        left."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._jobs or self._deferred:
            self._submit(force=list(self._deferred.values()))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._jobs[-1].done.wait(left):  # saves end in queue order
                return False
            self._reap_done()
        return True

    @property
    def pending_pages(self) -> int:
        """Pages of the saves deferred, or queued and not yet written."""
        return len(self._deferred) + sum(job.num_pages for job in list(self._jobs) if not job.done.is_set())

    def restore(self, digests: Sequence[bytes], pids: Sequence[int]) -> int:
        """Read the longest stored run of digests (pages j, j+1, ... of a prompt) into the fresh
        page ids pids (one per digest at least): K/V to the tier, summaries to the table. Returns
        how many pages it restored (those ids now hold them)."""
        n = self.store.match(digests)
        for i in range(0, n, self._chunk):
            m = min(n, i + self._chunk) - i
            self._write(pids[i : i + m], self.store.read(digests[i : i + m]))
            if self.saved_spills:
                ids = self._store_ids(pids[i : i + m])  # [L * m * Hkv]
                self._mark_saved(digests[i : i + m], ids, torch.arange(ids.numel()), m)
        self.counters["prefix_disk_restored_pages"] += n
        return n

    def _store_ids(self, pids: Sequence[int]) -> torch.Tensor:
        """The page store's ids of page ids pids [M], flat [L, M, Hkv] (CPU)."""
        return self.kv.settled.store_ids(self.kv.host_slots(pids))

    def _mark_saved(self, digests: Sequence[bytes], store_ids: torch.Tensor, at: torch.Tensor,
                    width: int) -> None:
        """Store pages store_ids [k], at positions at [k] of a flat [L, width, Hkv] (layer, index in
        digests, KV head), hold the K/V of their records: marked saved in the page store, each
        segment held by the prefix store until the page store lets go of it. Positions past
        digests are left alone (a save that stored fewer pages)."""
        hkv, sb = self.kv.layout.num_kv_heads, self.kv.layout.geometry.slot_bytes
        layer, page, head = at // (width * hkv), (at // hkv) % width, at % hkv
        try:
            held = self.store.hold(digests)
        except KeyError:  # a later save dropped the segment already: the pages stay unsaved
            return
        for path, where in held.items():
            record = torch.full((len(digests),), -1, dtype=torch.int64)  # byte offset of each record here
            record[[i for i, _ in where]] = torch.tensor([off for _, off in where], dtype=torch.int64)
            mine = (page < len(digests)) & (record[page.clamp_max(len(digests) - 1)] >= 0)
            offsets = record[page[mine]] + (layer[mine] * hkv + head[mine]) * sb  # [L, Hkv, 2, B, d] first
            self.pages.mark_saved(store_ids[mine], path, offsets, functools.partial(self.store.release, path))

    def _write(self, pids: Sequence[int], records: torch.Tensor) -> None:
        """Records [M, page_bytes] uint8 into page ids pids [M]: K/V to the tier, summaries to the table."""
        lay = self.kv.layout
        page = (lay.num_layers, lay.num_kv_heads, *lay.geometry.page_shape)
        kv = _from_bytes(records[:, : self._kv_bytes], page, lay.dtype)  # [L, M, Hkv, 2, B, d]
        ids = self.kv.write_full_pages(list(pids), kv)
        rows, at = {}, self._kv_bytes
        for name, (shape, dtype) in self._fields.items():
            nbytes = lay.num_layers * math.prod(shape) * dtype.itemsize
            rows[name] = _from_bytes(records[:, at : at + nbytes], (lay.num_layers, *shape), dtype)
            at += nbytes
        self.kv.summaries.put_page_rows(ids, rows)

    def stats(self) -> dict[str, float]:
        """Counters (saved, written, failed: as of the last reap; seconds end in _s). Changes
        nothing: a metrics scrape may call it from another thread."""
        return {"prefix_disk_pages": self.store.num_pages, "prefix_disk_bytes": self.store.bytes_used,
                "prefix_disk_pending_pages": self.pending_pages, **self.counters}

    def close(self) -> None:
        """Wait up to close_drain_s for the queued saves, drop the rest (logged), stop the writer."""
        if not self._writer.is_alive():
            self.store.close()
            return
        if not self.drain(self.close_drain_s):
            log.warning("prefix store: %d queued pages not saved after %.0f s; dropped", self.pending_pages,
                        self.close_drain_s)
            self._abandon.set()  # the writer stops between parts; the cut segment is removed
        self._queue.put(None)
        self._writer.join(timeout=60.0)
        self.store.close()

    # ---- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            start = time.perf_counter()
            try:
                if not self._abandon.is_set():
                    if job.ready is not None:
                        job.ready.synchronize()
                    job.written = self.store.put(job.digests, self._records(job))
            except Exception:  # a save lost is a cache miss after a restart, not an engine failure
                log.exception("prefix store: saving %d pages failed", job.num_pages)
            finally:
                self.counters["prefix_disk_writer_s"] += time.perf_counter() - start
                job.done.set()

    def _records(self, job: _Save) -> Iterator[torch.Tensor]:
        """Records [m, page_bytes] uint8 of the save's pages, `_chunk` pages at a time. The K/V is
        gathered page-major (a record's layers and heads in a row) and copied into the record once:
        two passes over its bytes, not four (gather, mask, transpose, concatenate)."""
        early_at = torch.full((job.host.numel(),), -1, dtype=torch.int64)  # flat -> row of job.early
        away = job.host.flatten() < 0
        early_at[away] = torch.arange(int(away.sum()))
        early_at = early_at.view(job.host.shape)
        if not self._parts:
            # NOTE: the store's contract (PrefixStore.parts_held): part k's buffer is free again once
            # it took part k + parts_held + 1, so that many buffers go round.
            self._parts = [torch.empty((self._part_pages, self.page_bytes), dtype=torch.uint8)
                           for _ in range(self.store.parts_held + 1)]
            lay = self.kv.layout
            self._gathered = torch.empty((self._part_pages * self._per_id, *lay.geometry.page_shape),
                                         dtype=lay.dtype)
        for k, i in enumerate(range(0, job.num_pages, self._part_pages)):
            if self._abandon.is_set():
                raise RuntimeError("prefix store: the engine closed before this save was written")
            with self._timed("prefix_disk_produce_s"):
                part = self._record_part(job, early_at, i, self._parts[k % len(self._parts)])
            yield part

    def _record_part(self, job: _Save, early_at: torch.Tensor, i: int, buffer: torch.Tensor) -> torch.Tensor:
        """Records [m, page_bytes] of the save's pages i .. i + _part_pages (early_at: see `_records`),
        in the first m rows of buffer."""
        host = job.host[:, i : i + self._part_pages].transpose(0, 1)  # [m, L, Hkv], page-major
        at = early_at[:, i : i + self._part_pages].transpose(0, 1)
        part = buffer[: host.shape[0]]
        part[:, : self._kv_bytes] = self._page_major_kv(host, at, job.early).view(torch.uint8)
        offset = self._kv_bytes
        for name in self._fields:
            rows = _bytes_per_page(job.rows[name][:, i : i + self._part_pages])  # [m, bytes]
            part[:, offset : offset + rows.shape[1]] = rows
            offset += rows.shape[1]
        return part

    def _page_major_kv(self, host: torch.Tensor, at: torch.Tensor, early: torch.Tensor) -> torch.Tensor:
        """K/V [m, L x Hkv x slot elements] of host slots host [m, L, Hkv] (-1: the row of early
        given by at instead)."""
        lay = self.kv.layout
        if bool((host >= 0).all()):  # the usual save: every page still in the arena, one gather
            slots = host.reshape(-1)
            return self.pages.arena.read(slots, out=self._gathered[: slots.numel()]).view(host.shape[0], -1)
        kv = torch.empty((*host.shape, *lay.geometry.page_shape), dtype=lay.dtype)  # [m, L, Hkv, 2, B, d]
        kv[host >= 0] = self.pages.arena.read(host[host >= 0])
        kv[at >= 0] = early[at[at >= 0]]
        return kv.view(host.shape[0], -1)


def _bytes_per_page(t: torch.Tensor) -> torch.Tensor:
    """[L, M, ...] -> [M, bytes of one page's L x ... entries] uint8 on the CPU."""
    per_page = t.detach().to("cpu").transpose(0, 1).contiguous()
    return per_page.view(torch.uint8).reshape(per_page.shape[0], -1)


def _from_bytes(raw: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """raw [M, nbytes] uint8 -> [shape[0], M, *shape[1:]] of dtype (the inverse of _bytes_per_page)."""
    m = raw.shape[0]
    return raw.contiguous().view(dtype).view(m, *shape).transpose(0, 1)
