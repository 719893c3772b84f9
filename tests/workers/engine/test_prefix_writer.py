"""The prefix store's background writer (tier host+nvme, tiny preset, CPU, real files).

With a writer held back by a gate (PrefixStore._write_segment waits for the test), a document's
prefill returns its first token while its save is still queued; the pages it saves stay pinned in
the host arena until the writer has read them, and what it writes is the cached K/V and summaries
byte for byte, read in the background (no early reads: the arena holds every page; past the pin
budget, saves wait for room). Eviction of a page with a queued or deferred save waits for the writer
(it does not cancel the save): the tier frees the page only after its record is written. close
waits for the queue (a restart then finds the document); past close_drain_s it drops what is left
and nothing half-written stays on disk.
"""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from lockserve.offload.prefix_store import SEGMENT_INFIX, PrefixStore
from lockserve.workers.engine.prefix_cache import chain_hashes

from tests.workers.engine.test_engine import greedy, make_engine, run
from tests.workers.engine.test_prefix_restart import DOC_A, DOC_B, ENGINE, PAGE, Q1, Q2, serve

ROOMY = {"host_capacity_gib": 2048 * 4096 / 2**30}  # 2,048 slots: every page of 200 ids on host
SMALL = {"host_capacity_gib": 30 * 6 * 4096 / 2**30}  # 30 ids (6 slots each): saves pin at most 15
PAGES = len(DOC_A + Q1) // PAGE  # full pages of a prompt: 20

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    from lockserve.workers.model.presets import build_preset

    return build_preset("tiny", seed=0, device="cpu")


class Gate:
    """PrefixStore._write_segment held until `open`: records ("begins", thread) and ("written", n)
    in `events`. It gives up after 30 s with an error, so that an engine that waits for its writes
    on its own thread fails the test instead of hanging."""

    def __init__(self, monkeypatch):
        self.events: list[tuple] = []
        self._open = threading.Event()
        real = PrefixStore._write_segment

        def held(store, path, n, parts):
            self.events.append(("begins", threading.current_thread().name))
            if not self._open.wait(30):
                raise TimeoutError("the gate never opened: the engine waited for its writer")
            crcs = real(store, path, n, parts)
            self.events.append(("written", n))
            return crcs

        monkeypatch.setattr(PrefixStore, "_write_segment", held)

    def open(self, after_s: float = 0.0) -> None:
        if after_s:
            threading.Timer(after_s, self._open.set).start()
        else:
            self._open.set()

    @property
    def written(self) -> int:
        return sum(e[1] for e in self.events if e[0] == "written")


def until_first_token(engine, rid: str) -> list[int]:
    while True:
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                return out.token_ids


def records_of(engine, pids: list[int]) -> torch.Tensor:
    """What a record of each page id holds (prefix_disk.py's layout), from the engine's own copies:
    [M, page_bytes] uint8 of K/V [L, Hkv, 2, B, d] then each summary field's rows [L, Hkv, ...]."""
    kv = engine.kv.read_tokens("", pids, len(pids) * PAGE)  # [L, M, Hkv, 2, B, d]
    rows = engine.kv.summaries.page_rows(torch.tensor(pids))
    parts = [kv] + [rows[name] for name in engine.prefix_disk._fields]
    per_page = [t.transpose(0, 1).contiguous().view(torch.uint8).reshape(len(pids), -1) for t in parts]
    return torch.cat(per_page, dim=1)


def stored(engine, doc: list[int], pages: int) -> torch.Tensor:
    digests = chain_hashes(doc, PAGE, engine.prefix.salt)[:pages]
    assert engine.prefix_disk.store.match(digests) == pages, "the document's pages are stored"
    return engine.prefix_disk.store.read(digests)


def written_out(engine, gate) -> tuple[torch.Tensor, dict]:
    """The records a's cached pages must become (read now, before any is written), then the gate
    opened, the engine run to its end and the writer drained: (records, the engine's stats)."""
    pids = engine.prefix.match(chain_hashes(DOC_A + Q1, PAGE, engine.prefix.salt))
    want = records_of(engine, pids)
    gate.open()
    while engine.has_unfinished():
        engine.step()
    assert engine.prefix_disk.drain(60), "the writer finished"
    return want, engine.stats()


def test_first_token_does_not_wait_for_the_writes(tiny, tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    try:
        engine.add_request("a", DOC_A + Q1, greedy(3))
        assert until_first_token(engine, "a"), "a's first token"
        stats = engine.stats()
        assert gate.written == 0 and stats["prefix_disk_pages"] == 0, f"nothing written yet: {gate.events}"
        assert stats["prefix_disk_pending_pages"] == PAGES, stats
        disk = engine.prefix_disk
        assert disk.pages.num_pinned == PAGES * disk._per_id, "the queued pages are pinned in the arena"
        want, stats = written_out(engine, gate)
        assert gate.events[0] == ("begins", "prefix-store-writer"), gate.events
        assert stats["prefix_disk_pages"] == stats["prefix_disk_saved_pages"] == PAGES, stats
        assert stats["prefix_disk_written_bytes"] == PAGES * disk.page_bytes, stats
        assert stats["prefix_disk_early_reads"] == 0, "every page read by the writer, from the arena"
        assert stats["prefix_disk_pending_pages"] == 0 and disk.pages.num_pinned == 0, "unpinned once written"
        assert torch.equal(stored(engine, DOC_A + Q1, PAGES), want), "records: the cached pages bitwise"
    finally:
        gate.open()
        engine.close()


def test_the_writers_buffers_go_round_and_no_part_is_overwritten_in_flight(tiny, tmp_path, monkeypatch):
    """A save in parts of one page each (20 parts) goes through the writer's store.parts_held + 1
    reused buffers, and every record is the cached page bitwise although each part's write is held
    back (a buffer reused while its part is still being written would change the record)."""
    import time

    from lockserve.workers.engine import prefix_disk

    monkeypatch.setattr(prefix_disk, "WRITE_PART_BYTES", 1)  # one page a part
    buffers, write = set(), PrefixStore._write_checked

    def slow(self, fd, offset, part):
        buffers.add(part.data_ptr())
        time.sleep(0.02)  # the producer makes the next parts meanwhile
        return write(self, fd, offset, part)

    monkeypatch.setattr(PrefixStore, "_write_checked", slow)
    engine = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    try:
        engine.add_request("a", DOC_A + Q1, greedy(3))
        assert until_first_token(engine, "a")
        pids = engine.prefix.match(chain_hashes(DOC_A + Q1, PAGE, engine.prefix.salt))
        assert len(pids) == PAGES
        want = records_of(engine, pids)  # the engine's own copies (the arena holds every page)
        run(engine, {})
        assert engine.prefix_disk.drain(60)
        assert torch.equal(stored(engine, DOC_A + Q1, PAGES), want), "records: the cached pages bitwise"
        assert len(buffers) == engine.prefix_disk.store.parts_held + 1 < PAGES, buffers
    finally:
        engine.close()


def test_records_of_a_save_part_read_early_are_the_pages_bitwise(tiny, tmp_path):
    """A save's records built from host slots for some of its (layer, head) slots and early reads
    for the rest (a pin budget of 40 slots: the others read on the engine's thread) hold the
    cached pages' bytes, as records built from the arena alone do."""
    engine = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    try:
        run(engine, {"a": (DOC_A + Q1, greedy(3))})
        disk = engine.prefix_disk
        assert disk.drain(60)
        digests = chain_hashes(DOC_A + Q1, PAGE, engine.prefix.salt)[:PAGES]
        pids = engine.prefix.match(digests)
        want = records_of(engine, pids)
        for budget in (disk.pages.host_slots, 40):  # every slot pinned, then 40 of them
            disk._max_pinned = disk.pages.num_pinned + budget
            job = disk._snapshot(digests, pids)
            try:
                early = int((job.host < 0).sum())
                assert early == (0 if budget > job.host.numel() else job.host.numel() - budget), early
                assert torch.equal(torch.cat(list(disk._records(job))), want), f"{early} slots read early"
            finally:
                disk.pages.unpin(job.pinned)
    finally:
        engine.close()


def test_a_save_past_the_pin_budget_waits_for_room_not_the_first_token(tiny, tmp_path, monkeypatch):
    """Queued saves pin at most half the host arena (15 of its 30 ids here): of a's 20 pages, 15
    are queued by its first token and 5 deferred, none read on the engine's thread; once the
    writer has written the first save, the rest are queued; the records are the cached pages."""
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, **ENGINE, **SMALL)
    try:
        engine.add_request("a", DOC_A + Q1, greedy(3))
        assert until_first_token(engine, "a")
        disk = engine.prefix_disk
        assert disk._max_pinned == 15 * disk._per_id, disk._max_pinned
        assert disk.pages.num_pinned == 15 * disk._per_id and len(disk._deferred) == 5
        assert engine.stats()["prefix_disk_pending_pages"] == PAGES
        want, stats = written_out(engine, gate)
        assert stats["prefix_disk_saved_pages"] == PAGES and not disk._deferred, stats
        assert stats["prefix_disk_early_reads"] == 0, "every page read by the writer, from the arena"
        assert torch.equal(stored(engine, DOC_A + Q1, PAGES), want), "records: the cached pages bitwise"
    finally:
        gate.open()
        engine.close()


@pytest.mark.parametrize("arena", [ROOMY, SMALL], ids=["queued", "deferred"])
def test_eviction_waits_for_a_queued_save(tiny, tmp_path, monkeypatch, arena):
    """30 page ids: b's prompt (21) needs 11 of a's 20 idle cached pages while a's save is held
    (with the small arena 5 of them deferred: eviction queues them at once); the engine frees them
    only after the writer wrote them."""
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, max_pages=30, **ENGINE, **arena)
    released = []
    real_release = engine.kv.release_pages

    def release(pids):
        gate.events.append(("release", list(pids)))
        released.extend(pids)
        real_release(pids)

    monkeypatch.setattr(engine.kv, "release_pages", release)
    try:
        engine.add_request("a", DOC_A + Q1, greedy(2))
        until_first_token(engine, "a")
        pids = engine.prefix.match(chain_hashes(DOC_A + Q1, PAGE, engine.prefix.salt))
        want = records_of(engine, pids)
        while engine.has_unfinished():
            engine.step()
        assert gate.written == 0, "a's save is still held"
        gate.open(after_s=0.5)  # from another thread: this one blocks in the eviction
        got, _ = serve(engine, "b", DOC_B + Q2)
        assert engine.stats()["prefix_evicted_pages"] > 0 and set(released) & set(pids), "a's pages evicted"
        kinds = [e[0] for e in gate.events]
        frees_a = [i for i, e in enumerate(gate.events) if e[0] == "release" and set(e[1]) & set(pids)]
        assert kinds.index("written") < frees_a[0], f"a's pages freed before they were written: {gate.events}"
        assert torch.equal(stored(engine, DOC_A + Q1, PAGES), want), "the evicted pages were saved intact"
    finally:
        gate.open()
        engine.close()


def test_close_waits_for_the_queue(tiny, tmp_path, monkeypatch):
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    engine.add_request("a", DOC_A + Q1, greedy(2))
    until_first_token(engine, "a")
    gate.open(after_s=0.3)
    engine.close()  # a's save still held here: close waits for it
    assert gate.written == PAGES, gate.events
    again = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    try:
        assert serve(again, "a2", DOC_A + Q2)[1] == len(DOC_A) // PAGE * PAGE, "a restart finds a"
    finally:
        again.close()


def test_close_drops_what_outlives_its_drain(tiny, tmp_path, monkeypatch, caplog):
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    engine.prefix_disk.close_drain_s = 0.05
    engine.add_request("a", DOC_A + Q1, greedy(2))
    until_first_token(engine, "a")
    gate.open(after_s=0.5)  # after close gave up: the writer stops before reading a part
    with caplog.at_level(logging.WARNING):
        engine.close()
    assert f"{PAGES} queued pages not saved" in caplog.text, caplog.text
    assert gate.written == 0, gate.events
    nvme = tmp_path / "nvme"
    assert not [p.name for p in nvme.iterdir() if SEGMENT_INFIX in p.name], "no segment left half-written"
    again = make_engine(tiny, tmp_path, **ENGINE, **ROOMY)
    try:
        assert serve(again, "a2", DOC_A + Q2)[1] == 0, "nothing of a was indexed"
    finally:
        again.close()


def test_a_deferred_save_takes_the_summary_rows_before_they_go_idle(tiny, tmp_path, monkeypatch):
    """With idle summaries moved to the host at once (budget 0), a's pages go idle when it ends:
    its deferred saves are queued first, so the records hold its summaries, not the zeroed rows."""
    gate = Gate(monkeypatch)
    engine = make_engine(tiny, tmp_path, **ENGINE, **SMALL, idle_summary_gib=0.0)
    try:
        engine.add_request("a", DOC_A + Q1, greedy(3))
        until_first_token(engine, "a")
        disk = engine.prefix_disk
        assert len(disk._deferred) == 5, "the pin budget holds 15 of the 20 pages"
        pids = engine.prefix.match(chain_hashes(DOC_A + Q1, PAGE, engine.prefix.salt))
        want = records_of(engine, pids)
        while engine.has_unfinished():
            engine.step()
        assert engine.stats()["idle_summary_out_pages"] == PAGES, engine.stats()
        assert not disk._deferred, "queued before their rows left the table"
        gate.open()
        assert disk.drain(60), "the writer finished"
        assert torch.equal(stored(engine, DOC_A + Q1, PAGES), want), "records: the cached pages bitwise"
    finally:
        gate.open()
        engine.close()


def test_a_long_prompt_is_saved_a_segment_at_a_time_while_it_prefills(tiny, tmp_path):
    """cache.prefix_save_mib of 4 page ids: the saves of a 20-page prompt start chunk by chunk, 4
    pages at a time, while its later chunks are still to come (its early pages still in host memory,
    where a save reads them without a read back off NVMe); the rest goes at the prompt's end. With
    the default (1 GiB) nothing is queued before the prompt's end. Either way a restart finds every
    page and gives a cold request's tokens."""
    per_id = 3 * 2 * 4096  # a page id's K/V: 3 layers x 2 KV heads x a 4 KiB page
    queued_before_end = {}
    for name, mib in (("default", None), ("4 ids", 4 * per_id / 2**20)):
        extra = {} if mib is None else {"prefix_save_mib": mib}
        engine = make_engine(tiny, tmp_path / name, **ENGINE, **ROOMY, **extra)
        engine.add_request("a", DOC_A + Q1, greedy(2))
        seen = []
        while not engine.scheduler.find("a").output_ids:
            seen.append(engine.stats()["prefix_disk_queued_pages"])
            engine.step()
        queued_before_end[name] = seen  # before each step, the last one's included
        assert engine.prefix_disk.drain() and engine.stats()["prefix_disk_pages"] == PAGES, engine.stats()
        engine.close()
    assert set(queued_before_end["default"]) == {0}, queued_before_end
    mid = queued_before_end["4 ids"]
    assert mid[-1] >= 12 and all(n % 4 == 0 for n in mid), f"whole saves of 4 during the prefill: {mid}"
    again = make_engine(tiny, tmp_path / "4 ids", **ENGINE, **ROOMY)
    try:
        got, cached = serve(again, "a2", DOC_A + Q2)
        assert cached == len(DOC_A) // PAGE * PAGE, f"every page of the document found ({cached})"
        cold = make_engine(tiny, tmp_path / "cold", prefix_reuse=False, **ENGINE)
        assert got == run(cold, {"a2": (DOC_A + Q2, greedy())})["a2"], "and a cold request's tokens"
        cold.close()
    finally:
        again.close()


def test_an_allocation_waits_for_a_writer_behind_the_prefill_instead_of_writing(tiny, tmp_path, monkeypatch):
    """A 38-page prompt through a 30-id arena, saves of 4 ids, the writer held back for 3 s. By
    default the prefill goes on and pages whose saves are behind spill with a write of their own
    (and their saves read them back). With cache.nvme_wait_for_saves the allocation waits for the
    writer instead and the finished saves' pages leave without a write: nothing spills with a write,
    nothing is read back. The tokens are a cold engine's either way."""
    per_id = 3 * 2 * 4096  # a page id's K/V: 3 layers x 2 KV heads x a 4 KiB page
    prompt = DOC_A + DOC_B + Q1
    cold = make_engine(tiny, tmp_path / "cold", prefix_reuse=False, **ENGINE)
    want = run(cold, {"a": (prompt, greedy(4))})["a"]
    cold.close()
    for wait in (False, True):
        gate = Gate(monkeypatch)
        gate.open(after_s=3.0)
        engine = make_engine(tiny, tmp_path / str(wait), **ENGINE, **SMALL,
                             prefix_save_mib=4 * per_id / 2**20, nvme_wait_for_saves=wait)
        try:
            assert run(engine, {"a": (prompt, greedy(4))})["a"] == want
            assert engine.prefix_disk.drain(60)
            stats = engine.stats()
        finally:
            gate.open()
            engine.close()
        assert stats["prefix_disk_writer_s"] >= stats["prefix_disk_produce_s"] > 0, stats
        assert stats["prefix_disk_engine_s"] >= stats["prefix_disk_wait_s"], stats
        if wait:
            assert stats["prefix_disk_room_waits"] > 0 and stats["nvme_spilled_pages"] == 0, stats
            assert stats["prefix_disk_early_reads"] == 0 and stats["nvme_saved_spilled_pages"] > 0, stats
            # the engine's thread waited for the held writer, inside the tier's write
            assert stats["nvme_write_room_s"] >= stats["prefix_disk_wait_s"] > 0.2, stats
        else:
            assert stats["prefix_disk_room_waits"] == 0 and stats["nvme_spilled_pages"] > 0, stats
