"""PageStore's saved pages (`mark_saved`): a page whose bytes a file holds spills without a write,
reads back from that file bitwise, and lets go of the file once no page refers to it; and
PrefixStore's holds, which keep such a file from being dropped."""

from __future__ import annotations

import os
import random

import torch
from lockserve.offload.prefix_store import PrefixStore

from tests.offload.conftest import bits
from tests.offload.test_store import GEOMETRY, add_written, make_store, random_pages

SB = GEOMETRY.slot_bytes


class SavedFile:
    """A file of page bytes the test writes (what the prefix store's segments are to the store),
    and a count of its releases."""

    def __init__(self, path, pages: torch.Tensor, offsets: list[int]):
        with open(path, "wb") as f:
            for page, off in zip(pages, offsets, strict=True):
                f.seek(off)
                f.write(page.contiguous().view(torch.uint8).numpy().tobytes())
        self.path, self.offsets, self.releases = str(path), offsets, 0

    def release(self) -> None:
        self.releases += 1


def open_paths() -> list[str]:
    """The files this process holds open (Linux)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor, closed meanwhile
            pass
    return out


def nvme_pages_written(store) -> int:
    return store.nvme.bytes_written // SB


def test_a_saved_page_spills_without_a_write_and_reads_back_from_its_file(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=4, max_pages=16)
    ids, _ = store.allocate(4)
    pages = random_pages(4, seed=1)
    store.write(ids, pages)
    offsets = [5 * SB, 0, 2 * SB, 3 * SB]  # any order, gaps allowed
    f = SavedFile(tmp_path / "records.bin", pages, offsets)
    store.mark_saved(ids, f.path, offsets, f.release)
    more, _ = store.allocate(4)  # the arena is full: the four saved pages make the room
    store.write(more, random_pages(4, seed=2))
    assert store.location(ids) == ["saved"] * 4
    assert nvme_pages_written(store) == 0, "a saved page spilled with a write"
    d = store.describe()
    assert (d["pages_saved"], d["saved_spilled_pages"], d["spilled_pages"]) == (4, 4, 0), d
    assert torch.equal(bits(store.read(ids)), bits(pages)), "read from the file"
    res = store.ensure_resident(ids[:2])  # back on host (the newer pages spill to NVMe for it)
    assert store.location(ids[:2]) == ["host", "host"]
    assert torch.equal(bits(store.arena.pool[res.slots]), bits(pages[:2]))
    assert sorted(res.rewritten.tolist()) == sorted(res.slots.tolist())
    written = nvme_pages_written(store)
    store.spill(ids[:2])  # again without a write: the mark outlives a promotion
    assert store.location(ids[:2]) == ["saved", "saved"] and nvme_pages_written(store) == written
    store.free(ids[:3])
    assert f.releases == 0, "a page still refers to the file"
    store.free(ids[3:])
    assert f.releases == 1
    store.close()


def test_writing_a_saved_page_ends_its_mark(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=2, max_pages=8)
    ids, _ = store.allocate(2)
    pages = random_pages(2, seed=3)
    store.write(ids, pages)
    f = SavedFile(tmp_path / "records.bin", pages, [0, SB])
    store.mark_saved(ids, f.path, f.offsets, f.release)
    store.allocate(2)
    assert store.location(ids) == ["saved", "saved"]
    new = random_pages(1, seed=4)
    store.write(ids[:1], new)  # new bytes: the file no longer holds this page
    before = nvme_pages_written(store)
    store.spill(ids[:1])
    assert store.location(ids[:1]) == ["nvme"] and nvme_pages_written(store) == before + 1
    assert torch.equal(bits(store.read(ids)), bits(torch.cat([new, pages[1:]])))
    assert f.releases == 0
    store.write(ids[1:], new)
    assert f.releases == 1, "no page refers to the file any more"
    store.close()


def test_saved_pages_leave_at_once_beside_spills_written_behind(tmp_path, prefix):
    """spill_behind takes the coldest pages: the saved ones leave now (no write to wait for), the
    others are written behind; the count it returns covers both."""
    store = make_store(tmp_path, prefix, host_slots=6, max_pages=16)
    ids, _ = store.allocate(6)
    pages = random_pages(6, seed=5)
    store.write(ids, pages)
    store.touch(ids[4:])  # ids[:4] are the coldest
    f = SavedFile(tmp_path / "records.bin", pages[:2], [0, SB])
    store.mark_saved(ids[:2], f.path, f.offsets, f.release)
    assert store.spill_behind(4) == 4
    assert store.location(ids[:4]) == ["saved", "saved", "host", "host"]
    assert store.describe()["pages_leaving"] == 2
    store.wait_spills()
    assert store.location(ids[:4]) == ["saved", "saved", "nvme", "nvme"]
    assert nvme_pages_written(store) == 2
    assert torch.equal(bits(store.read(ids)), bits(pages))
    store.close()


def test_random_operations_on_saved_pages_lose_nothing_and_release_each_file_once(tmp_path, prefix):
    """Random allocate / write / mark_saved / ensure_resident / read / free / spill_behind on 5
    host slots: every page keeps its bytes, the spill tier holds only the pages on NVMe (never a
    saved one), and each file is released exactly when its last page stops referring to it."""
    rng = random.Random(7)
    store = make_store(tmp_path, prefix, host_slots=5, max_pages=48)
    expected: dict[int, torch.Tensor] = {}
    refers: dict[int, int] = {}  # page -> file number it is saved in (the model)
    files: list[SavedFile] = []
    seed = 0
    for step in range(400):
        op = rng.random()
        if len(expected) < 30 or (op < 0.15 and len(expected) < 44):
            seed += 1
            add_written(store, expected, rng.randint(1, 3), seed)
        elif op < 0.3:
            want = rng.sample(sorted(expected), rng.randint(1, 4))
            offsets = [SB * i for i in rng.sample(range(8), len(want))]
            f = SavedFile(tmp_path / f"file{step}.bin", torch.stack([expected[p] for p in want]), offsets)
            files.append(f)
            store.mark_saved(want, f.path, offsets, f.release)
            refers.update((p, len(files) - 1) for p in want)
        elif op < 0.4:
            store.spill_behind(rng.randint(1, 4))
        elif op < 0.5:
            want = rng.sample(sorted(expected), rng.randint(1, 3))
            res = store.ensure_resident(want)
            want_bits = bits(torch.stack([expected[p] for p in want]))
            assert torch.equal(bits(store.arena.pool[res.slots]), want_bits)
        elif op < 0.6:
            pid = rng.choice(sorted(expected))
            seed += 1
            store.write([pid], random_pages(1, seed))
            expected[pid] = random_pages(1, seed)[0]
            refers.pop(pid, None)
        elif op < 0.8:
            want = rng.sample(sorted(expected), rng.randint(1, 8))
            assert torch.equal(bits(store.read(want)), bits(torch.stack([expected[p] for p in want])))
        else:
            pid = rng.choice(sorted(expected))
            store.free([pid])
            del expected[pid]
            refers.pop(pid, None)
        live = set(refers.values())
        for k, f in enumerate(files):
            assert f.releases == (0 if k in live else 1), f"file {k}: {f.releases} releases"
    store.wait_spills()
    d = store.describe()
    assert d["saved_spilled_pages"] > 20 and d["saved_read_pages"] > 0, d
    assert d["pages_saved"] == sum(store.location([p]) == ["saved"] for p in expected)
    assert all(p in refers for p in expected if store.location([p]) == ["saved"])
    _, on_disk = store.nvme.stored_pages()
    assert sorted(on_disk.tolist()) == sorted(p for p in expected if store.location([p]) == ["nvme"]), \
        "the spill tier holds a copy of a saved page"
    every = sorted(expected)
    assert torch.equal(bits(store.read(every)), bits(torch.stack([expected[p] for p in every])))
    store.close()


def test_a_held_segment_is_never_dropped_and_a_put_stores_what_fits_beside_it(tmp_path):
    page = 64
    store = PrefixStore(str(tmp_path), page, capacity_bytes=4 * page)
    rec = torch.arange(4 * page, dtype=torch.int64).to(torch.uint8).view(4, page)
    digests = [bytes([i]) * 8 for i in range(8)]
    assert store.put(digests[:2], [rec[:2]]) == 2
    assert store.put(digests[2:4], [rec[2:]]) == 2
    held = store.hold(digests[:2])
    [(path, where)] = held.items()
    assert where == [(0, 0), (1, page)] and os.path.exists(path)
    assert store.put(digests[4:7], [rec[:3]]) == 2, "the held segment stays; two records fit beside it"
    assert digests[0] in store and digests[2] not in store and os.path.exists(path)
    store.release(path)
    assert store.put(digests[7:], [rec[:1]]) == 1
    assert digests[0] not in store and not os.path.exists(path), "released: dropped as the oldest"
    store.close()


def test_room_without_writes_counts_free_slots_and_unpinned_saved_pages(tmp_path, prefix):
    """room_without_writes(n): free host slots plus the slots of saved pages that are not pinned;
    spill_behind(saved_only=True) takes saved pages only, however cold the others are."""
    store = make_store(tmp_path, prefix, host_slots=6, max_pages=16)
    ids, _ = store.allocate(6)
    pages = random_pages(6, seed=8)
    store.write(ids, pages)
    assert not store.room_without_writes(1), "the arena is full of unsaved pages"
    f = SavedFile(tmp_path / "records.bin", pages[3:], [0, SB, 2 * SB])
    store.mark_saved(ids[3:], f.path, f.offsets, f.release)
    store.pin(ids[5:])
    assert store.room_without_writes(2) and not store.room_without_writes(3), "a pinned saved page is no room"
    store.touch(ids[3:])  # the unsaved pages are the coldest
    assert store.spill_behind(3, saved_only=True) == 2, "only the two unpinned saved pages"
    assert store.location(ids) == ["host"] * 3 + ["saved", "saved", "host"]
    assert store.describe()["pages_leaving"] == 0 and nvme_pages_written(store) == 0
    store.unpin(ids[5:])
    store.close()


def test_marks_of_one_file_share_a_descriptor_and_each_release_waits_for_every_page(tmp_path, prefix):
    """Two marks of one file (a restore marks a segment's records chunk by chunk): one descriptor
    reads both, and each mark's release comes once no page of either refers to the file."""
    store = make_store(tmp_path, prefix, host_slots=4, max_pages=16)
    ids, _ = store.allocate(4)
    pages = random_pages(4, seed=9)
    store.write(ids, pages)
    f = SavedFile(tmp_path / "records.bin", pages, [0, SB, 2 * SB, 3 * SB])
    calls = []
    store.mark_saved(ids[:2], f.path, f.offsets[:2], lambda: calls.append("first"))
    store.mark_saved(ids[2:], f.path, f.offsets[2:], lambda: calls.append("second"))
    store.spill(ids)
    assert torch.equal(bits(store.read(ids)), bits(pages))
    assert open_paths().count(f.path) == 1, open_paths()
    store.free(ids[:3])
    assert calls == [], "the fourth page still refers to the file"
    store.free(ids[3:])
    assert sorted(calls) == ["first", "second"]
    assert f.path not in open_paths(), "closed once released"
    store.close()
