"""PageStore: spill/promote under a tiny host capacity loses nothing; restart; placement policy."""

from __future__ import annotations

import os
import random

import pytest
import torch
from lockserve.offload.arena import ArenaFullError, PageGeometry
from lockserve.offload.host import DEFAULT_SHM_DIR
from lockserve.offload.store import PageStore

from tests.offload.conftest import bits

GEOMETRY = PageGeometry(16, 32, torch.float16)


def random_pages(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *GEOMETRY.page_shape), generator=g).to(GEOMETRY.dtype)




def add_written(store: PageStore, expected: dict[int, torch.Tensor], n: int, seed: int) -> None:
    """Allocate n pages, write random_pages(n, seed) to them (recorded in expected), and start the
    spills the next allocation of n would need behind the caller."""
    ids, _ = store.allocate(n)
    pages = random_pages(n, seed)
    store.write(ids, pages)
    expected.update(zip(ids.tolist(), pages, strict=True))
    store.spill_behind(n, protect=ids)


def make_store(tmp_path, prefix, host_slots=3, max_pages=64, **kw) -> PageStore:
    return PageStore(GEOMETRY, host_slots, max_pages, nvme_dir=str(tmp_path / "nvme"), prefix=prefix, **kw)


def check_everything(store: PageStore, expected: dict[int, torch.Tensor]) -> None:
    ids = sorted(expected)
    got = store.read(ids)
    for i, pid in enumerate(ids):
        assert torch.equal(bits(got[i]), bits(expected[pid])), (
            f"page {pid} ({store.location([pid])[0]}) changed"
        )
    d = store.describe()
    assert d["pages_host"] <= store.host_slots and d["pages_host"] + d["pages_nvme"] == len(expected)


def test_tiny_host_capacity_loses_nothing(tmp_path, prefix):
    """3 host slots, 50+ pages, random allocate / write / rewrite / ensure_resident / read / free."""
    rng = random.Random(0)
    store = make_store(tmp_path, prefix)
    expected: dict[int, torch.Tensor] = {}
    seed = 0
    for step in range(240):
        op = rng.random()
        if len(expected) < 50 or op < 0.1:
            n = rng.randint(1, 3)
            ids, slots = store.allocate(n)
            seed += 1
            store.write(ids, random_pages(n, seed))
            expected.update(zip(ids.tolist(), random_pages(n, seed), strict=True))
        elif op < 0.55:
            want = rng.sample(sorted(expected), rng.randint(1, 3))
            want += want[:1]  # a duplicate
            res = store.ensure_resident(want)
            for pid, slot in zip(want, res.slots.tolist(), strict=True):
                assert torch.equal(bits(store.arena.pool[slot]), bits(expected[pid])), (
                    f"step {step} page {pid}"
                )
        elif op < 0.7:
            pid = rng.choice(sorted(expected))
            seed += 1
            store.write([pid], random_pages(1, seed))
            expected[pid] = random_pages(1, seed)[0]
        elif op < 0.9:
            want = rng.sample(sorted(expected), rng.randint(1, 8))
            got = store.read(want)
            assert torch.equal(bits(got), bits(torch.stack([expected[p] for p in want])))
        else:
            pid = rng.choice(sorted(expected))
            store.free([pid])
            del expected[pid]
    check_everything(store, expected)
    d = store.describe()
    assert d["spilled_pages"] > 50 and d["promoted_pages"] > 20, d
    store.close()


def test_lru_and_priority_hint_choose_what_spills(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=4)
    ids, _ = store.allocate(4)
    store.write(ids, random_pages(4, 1))
    store.touch(ids[[2, 0, 3, 1]][:2])  # pages 2 and 0 recent; 3 and 1 untouched since placement
    store.touch(ids[[3]])
    new, _ = store.allocate(1)  # one must go: page 1 is the least recently touched
    assert store.location(ids) == ["host", "nvme", "host", "host"]
    # A low summary score spills first, however recent (page 2 is touched last).
    store.touch(torch.cat([ids[[0, 3]], new]), priority=[0.9, 0.5, 0.7])
    store.touch(ids[[2]], priority=[0.1])
    store.allocate(1)
    assert store.location(torch.cat([ids, new])) == ["host", "nvme", "nvme", "host", "host"]
    store.close()


def test_spills_the_least_recently_touched_ties_by_host_slot(tmp_path, prefix):
    """Without priorities the spill set comes from a bounded pass (kthvalue), not a sort: it must
    be the sort's set — oldest touch first, ties (one touch call stamps many pages) by host slot."""
    rng = random.Random(3)
    store = make_store(tmp_path, prefix, host_slots=40, max_pages=64)
    ids, _ = store.allocate(40)
    store.write(ids, random_pages(40, 2))
    for _ in range(6):  # six touch calls over random groups: many pages share a clock value
        store.touch(rng.sample(ids.tolist(), 9))
    on_host = ids[store.host_slots_of(ids) >= 0]
    touch, slot = store._last_touch[on_host].tolist(), store.host_slots_of(on_host).tolist()
    expected = sorted(on_host.tolist(), key=lambda i: (touch[on_host.tolist().index(i)],
                                                       slot[on_host.tolist().index(i)]))[:7]
    store.allocate(7)
    spilled = [i for i, where in zip(ids.tolist(), store.location(ids), strict=True) if where == "nvme"]
    assert sorted(spilled) == sorted(expected)
    store.close()


def expected_spills(store: PageStore, need: int, protect: list[int]) -> set[int]:
    """A full sort's choice: the `need` unprotected host pages of oldest touch, ties by host slot."""
    ids = store._page_of_slot[store._page_of_slot >= 0].tolist()
    ids = [i for i in ids if i not in set(protect)]
    ids.sort(key=lambda i: (int(store._last_touch[i]), int(store._host_slot[i])))
    return set(ids[: max(0, need)])


def test_queued_spills_match_a_full_sort_over_many_calls(tmp_path, prefix):
    """Spills come from a queue ranked once and reused across calls (touches, promotions, frees
    and new pages in between): every call must spill exactly what a full sort would choose then."""
    rng = random.Random(11)
    store = make_store(tmp_path, prefix, host_slots=48, max_pages=160)
    store._queue_extra = 24  # the queue serves several calls between rankings
    live: list[int] = []
    rankings = 0
    rank = store._rank_host_pages

    def counting(m):
        nonlocal rankings
        rankings += 1
        rank(m)

    store._rank_host_pages = counting
    for step in range(120):
        before = {i for i in live if store.location([i])[0] == "host"}
        op = rng.random()
        if op < 0.25 or len(live) < 40:
            n = rng.randint(1, 6)
            if not store.can_allocate(n):
                continue
            want = expected_spills(store, n - store._host.num_free, [])
            ids, _ = store.allocate(n)
            store.write(ids, random_pages(n, step))
            live += ids.tolist()
        elif op < 0.45:
            store.touch(rng.sample(live, 8))
            continue
        elif op < 0.55:
            gone = rng.sample(live, 3)
            store.free(gone)
            live = [i for i in live if i not in gone]
            continue
        else:
            ids = rng.sample(live, 10)
            away = [i for i in ids if store.location([i])[0] == "nvme"]
            want = expected_spills(store, len(away) - store._host.num_free, ids)
            store.ensure_resident(ids)
        spilled = {i for i in before if store.location([i])[0] == "nvme"}
        assert spilled == want, f"step {step}"
    assert 0 < rankings < 40  # the queue did serve calls without a pass
    store.close()


def test_promotion_reports_rewritten_slots(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=2)
    a, _ = store.allocate(2)
    store.write(a, random_pages(2, 2))
    b, b_slots = store.allocate(2)  # spills both pages of a; b reuses their slots
    store.write(b, random_pages(2, 3))
    assert store.location(a) == ["nvme", "nvme"]
    res = store.ensure_resident(a[[1]])
    assert res.rewritten.tolist() == res.slots.tolist() and res.slots[0] in b_slots.tolist()
    assert torch.equal(bits(store.arena.pool[res.slots]), bits(random_pages(2, 2)[[1]]))
    again = store.ensure_resident(a[[1]])
    assert again.rewritten.numel() == 0 and torch.equal(again.slots, res.slots)
    store.close()


def test_restarted_store_recovers_spilled_pages(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=2)
    ids, _ = store.allocate(2)
    store.write(ids, random_pages(2, 4))
    more, _ = store.allocate(2)
    store.write(more, random_pages(2, 5))  # ids are now on NVMe, `more` in host memory
    arena = store.arena.name
    store.close()
    assert not os.path.exists(os.path.join(DEFAULT_SHM_DIR, arena)), "closed store left its segment"
    again = make_store(tmp_path, prefix, host_slots=2)
    assert again.recovered_ids().tolist() == sorted(ids.tolist())
    assert torch.equal(bits(again.read(ids)), bits(random_pages(2, 4)))
    res = again.ensure_resident(ids)
    assert torch.equal(bits(again.arena.pool[res.slots]), bits(random_pages(2, 4)))
    with pytest.raises(ValueError, match="not allocated"):  # host-only pages died with the old store
        again.read(more)
    new_ids, _ = again.allocate(2)
    assert not set(new_ids.tolist()) & set(ids.tolist()), "a recovered page id was handed out again"
    again.close()


def test_errors_name_the_problem(tmp_path, prefix):
    no_disk = PageStore(GEOMETRY, 2, 2, prefix=prefix)
    no_disk.allocate(2)
    with pytest.raises(ArenaFullError, match=r"cannot allocate 1 pages: 0 of 2 ids free"):
        no_disk.allocate(1)
    no_disk.close()
    with pytest.raises(ValueError, match=r"max_pages \(9\) exceeds host_slots \(2\) but nvme_dir is None"):
        PageStore(GEOMETRY, 2, 9, prefix=prefix)
    store = make_store(tmp_path, prefix, host_slots=2)
    ids, _ = store.allocate(2)
    more, _ = store.allocate(2)
    with pytest.raises(ValueError, match=r"3 distinct pages requested, more than host_slots \(2\)"):
        store.ensure_resident(torch.cat([ids, more[:1]]))
    with pytest.raises(ArenaFullError, match="at once"):
        store.allocate(3)
    with pytest.raises(ValueError, match=r"ids holds page 7, which is not allocated"):
        store.read([7])
    with pytest.raises(ValueError, match=r"priority has 1 values for 2 ids"):
        store.touch(ids, priority=[0.5])
    store.free(ids)
    with pytest.raises(ValueError, match="not allocated"):
        store.free(ids)
    store.close()


def test_host_and_nvme_add_up_and_a_full_nvme_still_promotes(tmp_path, prefix):
    """3 host slots + 5 NVMe slots hold 8 pages, none twice: with both full, every promotion frees
    the NVMe slots its spills take, and no page changes."""
    rng = random.Random(1)
    store = make_store(tmp_path, prefix, host_slots=3, max_pages=8, nvme_slots=5)
    expected: dict[int, torch.Tensor] = {}
    for seed in range(8):
        assert store.can_allocate(1), f"room for page {seed} of 8"
        ids, _ = store.allocate(1)
        store.write(ids, random_pages(1, seed))
        expected[int(ids[0])] = random_pages(1, seed)[0]
    assert not store.can_allocate(1)
    for step in range(60):
        want = rng.sample(sorted(expected), rng.randint(1, 3))
        res = store.ensure_resident(want)
        for pid, slot in zip(want, res.slots.tolist(), strict=True):
            assert torch.equal(bits(store.arena.pool[slot]), bits(expected[pid])), f"step {step} page {pid}"
        if step % 7 == 0:  # a rewrite of a spilled page re-homes it without reading the old bytes
            pid = rng.choice([p for p in expected if store.location([p])[0] == "nvme"])
            store.write([pid], random_pages(1, 100 + step))
            expected[pid] = random_pages(1, 100 + step)[0]
        d = store.describe()
        assert (d["pages_host"], d["pages_nvme"]) == (3, 5), (step, d)
        assert store.nvme.bytes_resident == 5 * GEOMETRY.slot_bytes
    check_everything(store, expected)
    assert store.describe()["promoted_pages"] > 40
    store.close()


def test_a_promotions_spills_land_on_consecutive_nvme_slots(tmp_path, prefix):
    """A promotion frees its pages' NVMe slots, scattered, just before its spills take slots: the
    spills go to the next free stretch instead (one write run), and nothing changes."""
    store = make_store(tmp_path, prefix, host_slots=8, max_pages=64, nvme_slots=64)
    ids = []
    for i in range(5):  # 40 pages, 8 at a time: 32 spill, to NVMe slots 0..31
        ids += store.allocate(8)[0].tolist()
        store.write(ids[-8:], random_pages(8, i))
    expected = dict(zip(ids, torch.cat([random_pages(8, i) for i in range(5)]), strict=True))
    slots, pages = store.nvme.stored_pages()
    assert slots.tolist() == list(range(32))
    before = dict(zip(pages.tolist(), slots.tolist(), strict=True))  # page id -> NVMe slot
    on_nvme = [p for p in ids if store.location([p])[0] == "nvme"]
    for want, stretch in [(on_nvme[3:27:6], [32, 33, 34, 35]), (on_nvme[5:29:6], [36, 37, 38, 39])]:
        store.ensure_resident(want)  # 4 pages from NVMe: 4 host pages spill
        slots, pages = store.nvme.stored_pages()
        new = sorted(s for s, p in zip(slots.tolist(), pages.tolist(), strict=True) if p not in before)
        assert new[-4:] == stretch, f"spills went to {new}, not the next free stretch"
        before = dict(zip(pages.tolist(), slots.tolist(), strict=True))
    check_everything(store, expected)
    store.close()


def test_restart_recovers_pages_whose_nvme_slot_is_not_their_id(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=2, max_pages=6, nvme_slots=4)
    pages = random_pages(6, 7)
    for first in range(0, 6, 2):  # pages 0-3 spill to NVMe slots 0-3 as 2-5 arrive
        new, _ = store.allocate(2)
        store.write(new, pages[first : first + 2])
    ids = torch.arange(6)
    store.ensure_resident([0, 1])  # spills 4 and 5 into the slots 0 and 1 left
    assert store.location(ids) == ["host", "host", "nvme", "nvme", "nvme", "nvme"]
    assert store._nvme_slot[4:6].tolist() != [4, 5], "the test needs slots that are not the ids"
    store.close()
    again = make_store(tmp_path, prefix, host_slots=2, max_pages=6, nvme_slots=4)
    assert again.recovered_ids().tolist() == [2, 3, 4, 5]
    assert torch.equal(bits(again.read([2, 3, 4, 5])), bits(pages[2:]))
    again.close()
    with pytest.raises(ValueError, match=r"holds page [45], beyond max_pages \(4\)"):
        make_store(tmp_path, prefix, host_slots=2, max_pages=4, nvme_slots=4)


def test_sizes_that_cannot_hold_the_pages_are_refused(tmp_path, prefix):
    with pytest.raises(ValueError, match=r"max_pages \(9\) exceeds host_slots \(2\) \+ nvme_slots \(6\)"):
        make_store(tmp_path, prefix, host_slots=2, max_pages=9, nvme_slots=6)
    with pytest.raises(ValueError, match=r"nvme_slots \(4\) given but nvme_dir is None"):
        PageStore(GEOMETRY, 2, 2, nvme_slots=4, prefix=prefix)


@pytest.mark.parametrize("prioritised", [False, True])
def test_pinned_pages_never_spill_and_cannot_be_freed(tmp_path, prefix, prioritised):
    """Pinned host pages (a reader on another thread holds their slots) keep their slot under
    pressure, whatever their touch or priority; `free` refuses them until unpinned."""
    store = make_store(tmp_path, prefix, host_slots=4, max_pages=16)
    ids, slots = store.allocate(4)
    store.write(ids, random_pages(4, seed=1))
    pinned, where = ids[:2], slots[:2].clone()
    store.pin(pinned)
    if prioritised:
        store.touch(ids, priority=[0.0, 0.0, 9.0, 9.0])  # the pinned ones would spill first
    for k in range(3):  # each allocation spills; only the unpinned may go
        more, _ = store.allocate(2)
        store.write(more, random_pages(2, seed=10 + k))
        assert store.location(pinned) == ["host", "host"], f"allocation {k}: a pinned page spilled"
        assert torch.equal(store.host_slots_of(pinned), where), "pinned pages keep their slots"
    assert not store.can_allocate(3), "3 slots would need a pinned page to spill"
    with pytest.raises(ValueError, match="is pinned"):
        store.free(pinned)
    with pytest.raises(ValueError, match="pinned already"):
        store.pin(pinned[:1])
    store.unpin(pinned)
    with pytest.raises(ValueError, match="not pinned"):
        store.unpin(pinned[:1])
    store.allocate(4)  # the formerly pinned pages spill now
    assert store.location(pinned) == ["nvme", "nvme"]
    store.free(pinned)
    store.close()


def test_pin_refuses_a_page_on_nvme(tmp_path, prefix):
    store = make_store(tmp_path, prefix, host_slots=2, max_pages=8)
    ids, _ = store.allocate(2)
    store.write(ids, random_pages(2, seed=3))
    store.spill(ids[:1])
    with pytest.raises(ValueError, match="not in host memory"):
        store.pin(ids[:1])
    store.close()


# ---- spills written behind (PageStore.spill_behind) ------------------------------------------------


def test_a_spill_written_behind_lands_at_the_next_allocation(tmp_path, prefix):
    """The pages stay readable in host memory until the next placing call; that allocation then
    finds its room made, spills nothing inline, and the pages read back from NVMe unchanged."""
    store = make_store(tmp_path, prefix, host_slots=6, max_pages=16)
    ids, _ = store.allocate(6)
    pages = random_pages(6, seed=1)
    store.write(ids, pages)
    store.touch(ids[2:])  # ids[:2] are the coldest
    assert store.spill_behind(2) == 2
    assert store.spill_behind(2) == 0, "the writes in flight already make the room"
    assert store.location(ids[:2]) == ["host", "host"] and store.describe()["pages_leaving"] == 2
    assert torch.equal(bits(store.read(ids)), bits(pages)), "leaving pages read from host memory"
    assert store.can_allocate(2)
    more, _ = store.allocate(2)
    assert store.location(ids[:2]) == ["nvme", "nvme"]
    d = store.describe()
    assert (d["spill_calls"], d["spilled_pages"], d["spilled_behind_pages"]) == (1, 2, 2), d
    assert d["pages_leaving"] == 0
    assert torch.equal(bits(store.read(ids)), bits(pages))
    store.close()


@pytest.mark.parametrize("call", ["free", "write", "ensure_resident", "pin"])
def test_a_page_a_call_names_while_it_leaves_stays_and_its_disk_copy_is_dropped(tmp_path, prefix, call):
    """free, write, ensure_resident and pin all cancel a page's departure: on landing the page is
    where the call left it (freed, or on host) and the NVMe manifest does not name it."""
    store = make_store(tmp_path, prefix, host_slots=6, max_pages=16)
    ids, _ = store.allocate(6)
    store.write(ids, random_pages(6, seed=2))
    store.touch(ids[2:])
    assert store.spill_behind(2) == 2
    page = ids[:1]
    new = random_pages(1, seed=3)
    if call == "free":
        store.free(page)
    elif call == "write":
        store.write(page, new)
    else:
        getattr(store, call)(page)
    store.wait_spills()
    assert store.location(ids[1:2]) == ["nvme"], "the other page left"
    _, stored = store.nvme.stored_pages()
    assert stored.tolist() == [int(ids[1])], "only the page that left has a disk copy"
    if call != "free":
        assert store.location(page) == ["host"]
        want = new if call == "write" else random_pages(6, seed=2)[:1]
        assert torch.equal(bits(store.read(page)), bits(want))
    assert store.describe()["pages_leaving"] == 0
    store.close()


def test_spills_written_behind_lose_nothing_and_restart_finds_exactly_the_spilled(tmp_path, prefix):
    """Random allocate / write / ensure_resident / read / free / pin with spill_behind between them,
    on 5 host slots: every page keeps its bytes, and a store reopened on the directory finds
    exactly the pages that were on NVMe (no copy of a page that stayed or was freed)."""
    rng = random.Random(1)
    store = make_store(tmp_path, prefix, host_slots=5, max_pages=64)
    expected: dict[int, torch.Tensor] = {}
    seed = 0
    for _ in range(300):
        op = rng.random()
        if len(expected) < 40 or (op < 0.15 and len(expected) < 56):
            seed += 1
            add_written(store, expected, rng.randint(1, 3), seed)
        elif op < 0.35:
            store.spill_behind(rng.randint(1, 4))
        elif op < 0.5:
            want = rng.sample(sorted(expected), rng.randint(1, 3))
            res = store.ensure_resident(want)
            got = store.arena.pool[res.slots]
            assert torch.equal(bits(got), bits(torch.stack([expected[p] for p in want])))
        elif op < 0.6:
            pid = rng.choice(sorted(expected))
            seed += 1
            store.write([pid], random_pages(1, seed))
            expected[pid] = random_pages(1, seed)[0]
        elif op < 0.8:
            want = rng.sample(sorted(expected), rng.randint(1, 8))
            assert torch.equal(bits(store.read(want)), bits(torch.stack([expected[p] for p in want])))
        elif op < 0.85:
            pid = rng.choice(sorted(expected))
            if store.location([pid]) == ["host"]:
                store.pin([pid])
                store.spill_behind(store.host_slots)  # pressure while pinned
                store.wait_spills()
                assert store.location([pid]) == ["host"], "a pinned page left"
                store.unpin([pid])
        else:
            pid = rng.choice(sorted(expected))
            store.free([pid])
            del expected[pid]
    store.wait_spills()
    d = store.describe()
    assert d["spilled_behind_pages"] > 40 and d["spilled_pages"] > d["spilled_behind_pages"] // 2, d
    on_nvme = sorted(p for p in expected if store.location([p]) == ["nvme"])
    store.close()
    again = make_store(tmp_path, prefix, host_slots=5, max_pages=64)
    assert again.recovered_ids().tolist() == on_nvme
    got = again.read(on_nvme)
    assert torch.equal(bits(got), bits(torch.stack([expected[p] for p in on_nvme])))
    again.close()


def test_a_spill_written_behind_that_fails_loses_nothing(tmp_path, prefix, monkeypatch, caplog):
    """A write that fails (a full disk) leaves its pages on host, logged and counted; the next
    allocation then spills inline."""
    store = make_store(tmp_path, prefix, host_slots=4, max_pages=16)
    ids, _ = store.allocate(4)
    pages = random_pages(4, seed=5)
    store.write(ids, pages)
    real = store.nvme.write

    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.nvme, "write", full_disk)
    assert store.spill_behind(2) == 2
    monkeypatch.setattr(store.nvme, "write", real)
    with caplog.at_level("WARNING", logger="lockserve.offload.store"):
        store.allocate(2)
    assert "No space left on device" in caplog.text
    d = store.describe()
    assert d["spill_behind_failures"] == 1 and d["spilled_behind_pages"] == 0 and d["spilled_pages"] == 2, d
    assert torch.equal(bits(store.read(ids)), bits(pages))
    store.close()
