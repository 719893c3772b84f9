"""Every tier gives back the bytes it was given; the factory's page sources keep caches coherent."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from lockserve.offload.arena import PageGeometry, RunAllocator, SlotAllocator
from lockserve.offload.cache import pool_rows
from lockserve.offload.factory import make_tier
from lockserve.offload.hbm import HbmTier
from lockserve.offload.host import HostArena
from lockserve.offload.nvme import NvmeTier
from lockserve.offload.store import PageStore

from tests.conftest import triton_devices
from tests.offload.conftest import bits

needs_interpreter = pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1")


def start_forward(*sources) -> None:
    """What the engine does at each forward: before_forward around it, begin_forward inside it
    (the hot cache's step)."""
    for source in sources:
        source.before_forward()
        source.begin_forward()


def random_pages(n: int, geometry: PageGeometry, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *geometry.page_shape), generator=g).to(geometry.dtype)




def make(kind: str, geometry: PageGeometry, num_slots: int, tmp_path, prefix):
    if kind == "hbm":
        return HbmTier(geometry, num_slots, "cpu")
    if kind == "host":
        return HostArena.create(geometry, num_slots, prefix=prefix)
    return NvmeTier(geometry, str(tmp_path / "nvme"), num_slots, slots_per_file=37)


@pytest.mark.parametrize("kind", ["hbm", "host", "nvme"])
@pytest.mark.parametrize(
    "geometry", [PageGeometry(16, 128, torch.bfloat16), PageGeometry(16, 64, torch.float32)]
)
def test_every_tier_returns_the_same_bytes(kind, geometry, tmp_path, prefix):
    tier = make(kind, geometry, 211, tmp_path, prefix)
    g = torch.Generator().manual_seed(1)
    written: dict[int, torch.Tensor] = {}
    for step, n in enumerate([1, 7, 97, 7]):  # the last batch overwrites some slots
        slots = torch.randperm(211, generator=g)[:n]
        pages = random_pages(n, geometry, seed=step)
        pages.view(torch.uint8)[0, 0, 0, :4] = 0xFF  # a NaN pattern must survive too
        tier.write(slots, pages)
        written.update(zip(slots.tolist(), pages, strict=True))
        back = tier.read(slots.flip(0))
        assert torch.equal(bits(back), bits(pages.flip(0))), f"{kind} step {step}"
    everything = sorted(written)
    assert torch.equal(bits(tier.read(everything)), bits(torch.stack([written[s] for s in everything])))
    tier.close()


def test_slot_allocator():
    a = SlotAllocator(5)
    assert a.alloc(3).tolist() == [0, 1, 2] and a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(RuntimeError, match=r"cannot allocate 3 slots: 2 of 5 free"):
        a.alloc(3)
    a.free([1])
    with pytest.raises(ValueError, match=r"double free: slot 1 is not allocated"):
        a.free([1])
    with pytest.raises(ValueError, match=r"ids holds 5, outside \[0, 5\)"):
        a.free([5])
    with pytest.raises(ValueError, match="repeat"):
        a.free([0, 0])
    assert sorted(a.alloc(3).tolist()) == [1, 3, 4] and a.num_free == 0
    b = SlotAllocator(6)
    b.claim([4, 1])
    assert sorted(b.alloc(4).tolist()) == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="already allocated"):
        b.claim([0])


def test_run_allocator_takes_the_next_free_slots_in_order():
    """Slots freed at random are not reused first: a batch gets the next free stretch after the
    last allocation (one I/O run), wrapping past the end; frees, claims and refusals as
    SlotAllocator's."""
    a = RunAllocator(12, window=4)
    assert a._free is None, "the mask is the free set: no stack of every slot id"
    assert a.alloc(5).tolist() == [0, 1, 2, 3, 4]
    a.free([3, 1])
    assert a.alloc(3).tolist() == [5, 6, 7], "after the cursor, not the slots freed last"
    a.claim([9])
    assert a.alloc(4).tolist() == [8, 10, 11, 1] and a.num_free == 1, "wraps past the end"
    with pytest.raises(RuntimeError, match=r"cannot allocate 2 slots: 1 of 12 free"):
        a.alloc(2)
    with pytest.raises(ValueError, match=r"double free: slot 3 is not allocated"):
        a.free([3])
    with pytest.raises(ValueError, match="already allocated"):
        a.claim([0])
    assert a.alloc(1).tolist() == [3] and a.alloc(0).numel() == 0 and a.num_free == 0
    g = torch.Generator().manual_seed(0)
    b, held = RunAllocator(1000, window=64), set()
    for _ in range(200):  # every slot handed out is free, and the count stays exact
        got = b.alloc(int(torch.randint(0, 40, (1,), generator=g)))
        assert held.isdisjoint(got.tolist()) and got.unique().numel() == got.numel()
        held.update(got.tolist())
        drop = [s for s in held if torch.rand(1, generator=g) < 0.3]
        b.free(drop)
        held.difference_update(drop)
        assert b.num_free == 1000 - len(held)


@pytest.mark.parametrize("kind", ["hbm", "host", "host without a cache"])
def test_page_source_resolves_written_pages(kind):
    geometry = PageGeometry(16, 32, torch.bfloat16)
    kw = {"hbm": {}, "host": {"cache_pages": 6, "max_selected": 5}}.get(kind, {"max_selected": 5})
    source = make_tier(kind.split()[0], geometry, 40, device="cpu", **kw)
    slots = torch.tensor([3, 39, 0, 17, 8])
    source.write(slots, random_pages(5, geometry, 1))
    start_forward(source)  # as the engine does before each forward: a step of the hot cache
    idx = source.resolve(torch.tensor([39, 8, -1]))  # distinct slots; -1 pads
    assert torch.equal(bits(source.pool[idx[:2]]), bits(random_pages(5, geometry, 1)[[1, 4]]))
    source.write(slots[[1]], random_pages(1, geometry, 2))  # rewrite a cached page
    start_forward(source)
    idx = source.resolve(slots[[4, 1]])
    assert torch.equal(bits(source.pool[idx[1]]), bits(random_pages(1, geometry, 2)[0])), "stale cached page"
    want = torch.cat([random_pages(1, geometry, 2), random_pages(5, geometry, 1)[[0]]])
    assert torch.equal(bits(source.read(slots[[1, 0]])), bits(want)), "read bypasses the cache"
    s = source.stats()
    assert s.kind == kind.split()[0] and s.bytes_written == 6 * geometry.slot_bytes
    if kind == "host":
        assert (s.steps, s.hits, s.misses, s.requests) == (2, 2, 2, 4) and s.hit_rate == 0.5
        rows = pool_rows(6, 5)  # 6 entries round up to one set of 16 ways, + 5 staging rows
        assert s.bytes_resident == {"host": 40 * geometry.slot_bytes, "cache": rows * geometry.slot_bytes}
        assert s.bytes_moved == 2 * geometry.slot_bytes
    elif kind == "host without a cache":  # every selected page crosses, every time
        assert source.pool.shape[0] == 5 and s.bytes_moved == 4 * geometry.slot_bytes
    source.close()


@pytest.mark.parametrize("kind,backend", [
    ("host", "torch"), pytest.param("host", "triton", marks=needs_interpreter),
    ("host without a cache", "torch"),
    ("host+nvme", "torch"), pytest.param("host+nvme", "triton", marks=needs_interpreter),
])
def test_resolve_or_is_resolve_with_the_outside_rows(kind, backend, tmp_path):
    """resolve_or(slots, outside, rows) == torch.where(outside, rows, resolve(slots)), on twin
    sources: the tiers with a cache fold the where into its lookup (host+nvme after walking its
    tables), the one without runs it after resolve."""
    geometry = PageGeometry(16, 32, torch.bfloat16)
    kw = {"max_selected": 6, "gather_backend": backend} | ({} if "without" in kind else {"cache_pages": 8})
    nvme = kind == "host+nvme"
    dirs = [{"nvme_dir": str(tmp_path / str(n)), "host_pages": 40} if nvme else {} for n in range(2)]
    folded, plain = (make_tier(kind.split()[0], geometry, 40, **kw, **d) for d in dirs)
    pages = random_pages(40, geometry, 5)
    for source, half in itertools.product((folded, plain), (0, 20)):  # a write takes half the host arena
        source.write(torch.arange(half, half + 20), pages[half : half + 20])
    assert folded._fold_outside == ("without" not in kind), "the tiers with a cache fold the where"
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        slots = torch.randperm(40, generator=g)[:6]
        slots[torch.randperm(6, generator=g)[:3]] = -1
        outside = (slots < 0) & (torch.rand(6, generator=g) < 0.6)  # the engine's open pages
        rows = torch.where(outside, 900 + torch.arange(6), -1)
        start_forward(folded, plain)
        got = folded.resolve_or(slots, outside, rows)
        want = torch.where(outside, rows, plain.resolve(slots))
        assert not (folded.take_misses() or plain.take_misses()), "every page is in host memory"
        assert torch.equal(got, want), f"step {step}: {got.tolist()} != {want.tolist()}"
        inside = slots >= 0
        assert torch.equal(bits(folded.pool[got[inside]]), bits(pages[slots[inside]])), f"step {step}"
    a, b = folded.stats(), plain.stats()
    assert (a.hits, a.misses, a.bytes_moved) == (b.hits, b.misses, b.bytes_moved)
    folded.close(), plain.close()


def test_host_source_attaches_a_stores_arena(prefix):
    geometry = PageGeometry(16, 32, torch.float16)
    with PageStore(geometry, 12, 12, prefix=prefix) as store:
        ids, slots = store.allocate(4)
        store.write(ids, random_pages(4, geometry, 3))
        source = make_tier("host", geometry, 12, arena=store.arena_spec(), cache_pages=4)
        idx = source.resolve(slots)
        assert torch.equal(bits(source.pool[idx]), bits(random_pages(4, geometry, 3)))
        source.close()
        assert os.path.exists(store.arena.path), (
            "closing an attached source must not unlink the store's arena"
        )


def test_host_nvme_source_never_serves_stale_pages(tmp_path):
    """12 engine slots through 4 host slots: pages spill and come back in other host slots, and
    cached copies of reused host slots must follow. A forward that selects a page still on NVMe
    is told to run again (take_misses); the rerun reads the right bytes."""
    geometry = PageGeometry(16, 32, torch.float16)
    source = make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path), cache_pages=4,
                       max_selected=3)
    expected, engine_slots = {}, torch.tensor([5, 9, 0, 31, 7, 12, 3, 30, 1, 2, 20, 21])
    for i in range(6):  # two at a time, each resolved so that it is cached when its host slot is reused
        slots = engine_slots[2 * i : 2 * i + 2]
        source.write(slots, random_pages(2, geometry, i))
        expected.update(zip(slots.tolist(), random_pages(2, geometry, i), strict=True))
        start_forward(source)
        source.resolve(slots)
        assert not source.take_misses(), "pages just written are in host memory"
    g, reruns = torch.Generator().manual_seed(0), 0
    for _ in range(30):
        want = engine_slots[torch.randperm(12, generator=g)[:3]]
        for attempt in range(3):
            start_forward(source)
            idx = source.resolve(want)
            if not source.take_misses(rerun=attempt > 0):
                break
            reruns += 1
        else:
            raise AssertionError(f"{want.tolist()} still missed after two reruns")
        assert torch.equal(bits(source.pool[idx]), bits(torch.stack([expected[s] for s in want.tolist()])))
    with source.synchronous_reads():  # promotes on the host: nothing can miss
        start_forward(source)
        idx = source.resolve(engine_slots[[11, 0, 4]])
        assert not source.take_misses()
    assert torch.equal(bits(source.pool[idx]), bits(torch.stack([expected[s] for s in (21, 5, 7)])))
    assert torch.equal(bits(source.read(engine_slots)), bits(torch.stack([expected[s] for s in
                                                                          engine_slots.tolist()])))
    c = source.counters()
    assert reruns > 0 and c["nvme_step_reruns"] == reruns and c["nvme_steps_missed"] <= reruns
    assert c["nvme_sync_steps"] == 1 and c["nvme_spilled_pages"] > 0 and c["nvme_promoted_pages"] > 0
    assert source.stats().bytes_resident["nvme"] > 0
    source.release(engine_slots[:6])
    assert source.store.describe()["pages_host"] + source.store.describe()["pages_nvme"] == 6
    source.close()


def test_host_nvme_bulk_read_moves_no_page(tmp_path):
    """A prefill's bulk read gives every page's bytes (zeros where nothing was written) from host
    memory and NVMe alike, and leaves each page where it was: promoting them spilled as many
    others, which the next layer's read brought back."""
    geometry = PageGeometry(16, 32, torch.float16)
    source = make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path), cache_pages=4,
                       max_selected=3)
    written = torch.tensor([5, 9, 0, 31, 7, 12, 3, 30, 1, 2])
    for i in range(5):
        source.write(written[2 * i : 2 * i + 2], random_pages(2, geometry, i))
    expected = {s: p for i in range(5) for s, p in zip(written[2 * i : 2 * i + 2].tolist(),
                                                        random_pages(2, geometry, i), strict=True)}
    store = source.store
    ids = source._ids[written]
    where, before = store.location(ids), store.describe()
    assert where.count("nvme") == 6 and where.count("host") == 4
    want = torch.tensor([12, 4, 5, 31, 2, 9, 30, 0, 7, 3, 1])  # 4 was never written
    back = source.read(want)
    assert torch.equal(bits(back[1]), bits(torch.zeros_like(back[1])))
    keep = [i for i, s in enumerate(want.tolist()) if s != 4]
    assert torch.equal(bits(back[keep]), bits(torch.stack([expected[s] for s in want[keep].tolist()])))
    after = store.describe()
    assert store.location(ids) == where, "a bulk read moved pages"
    moved = ("promoted_pages", "spilled_pages")
    assert [after[k] for k in moved] == [before[k] for k in moved]
    source.close()


def test_host_nvme_lookahead_promotes_what_the_next_step_may_select(tmp_path):
    """note_ahead records a wider selection per layer; prefetch_ahead promotes its pages that are on
    NVMe, so a step that then selects them does not miss; without lookahead the same step misses."""
    geometry = PageGeometry(16, 32, torch.float16)
    misses = {}
    for lookahead in (0, 2):
        source = make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path / str(lookahead)),
                           cache_pages=4, max_selected=3, lookahead=lookahead)
        slots = torch.arange(8)
        for i in range(4):  # 8 pages through 4 host slots: the first ones spill
            source.write(slots[2 * i : 2 * i + 2], random_pages(2, geometry, i))
        on_nvme = slots[source.store.host_slots_of(slots) < 0]
        assert on_nvme.numel() >= 2
        want = on_nvme[:2]
        start_forward(source)
        source.note_ahead(0, torch.cat([want, torch.tensor([-1])]).view(1, 1, 3))  # the layer's wide pick
        source.note_ahead(1, torch.full((1, 1, 3), -1))
        assert not source.take_misses()
        source.prefetch_ahead()
        start_forward(source)
        idx = source.resolve(want)
        misses[lookahead] = source.take_misses()
        if not misses[lookahead]:
            expected = torch.cat([random_pages(2, geometry, i) for i in range(4)])[want]
            assert torch.equal(bits(source.pool[idx]), bits(expected))
        c = source.counters()
        assert c["nvme_prefetched_pages"] == (2 if lookahead else 0), c
        source.close()
    assert misses == {0: True, 2: False}, misses


def test_host_nvme_miss_promotes_the_forwards_lookahead_too(tmp_path):
    """A forward that misses a page also recorded wider selections: the promotion before its rerun
    takes their cold pages in the same read, so that the rerun's drifting selections find them."""
    geometry = PageGeometry(16, 32, torch.float16)
    source = make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path), cache_pages=4,
                       max_selected=3, lookahead=2)
    slots = torch.arange(8)
    for i in range(4):
        source.write(slots[2 * i : 2 * i + 2], random_pages(2, geometry, i))
    cold = slots[source.store.host_slots_of(slots) < 0]
    missed, ahead = cold[:1], cold[1:2]
    start_forward(source)
    source.note_ahead(0, torch.cat([ahead, missed, torch.tensor([-1] * 4)]))  # the forward's wide pick
    source.resolve(missed)
    assert source.take_misses(), "the resolved page was on NVMe"
    start_forward(source)  # the rerun, whose selection drifted to the wider pick's page
    source.resolve(torch.cat([missed, ahead]))
    assert not source.take_misses(), "both pages were promoted before the rerun"
    c = source.counters()
    assert c["nvme_missed_pages"] == 1 and c["nvme_prefetched_pages"] == 1, c
    source.close()


def test_host_nvme_spills_spare_decode_selections_across_prefill_only_forwards(tmp_path):
    """A prefill-only forward (before_forward(reads=False)) cannot miss or select, so neither
    take_misses nor the next write waits for it; the pages an earlier decode forward selected
    are still spared by the spills of a later write, which gets its slots on the host too."""
    geometry = PageGeometry(16, 32, torch.float16)
    source = make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path), cache_pages=4,
                       max_selected=3)
    expected = {}
    for i, slots in enumerate([torch.tensor([0, 1]), torch.tensor([2, 3])]):
        source.write(slots, random_pages(2, geometry, i), host_slots=slots.clone())
        expected.update(zip(slots.tolist(), random_pages(2, geometry, i), strict=True))
    start_forward(source)  # a decode forward selects the oldest page
    source.resolve(torch.tensor([0]))
    assert not source.take_misses()
    for _ in range(2):  # two prefill-only forwards
        source.before_forward(reads=False)
        source.begin_forward()
        assert not source.take_misses()
    new = torch.tensor([4, 5])
    source.write(new, random_pages(2, geometry, 9), host_slots=new.clone())  # spills two pages
    expected.update(zip(new.tolist(), random_pages(2, geometry, 9), strict=True))
    where = source.store.location(source._ids[torch.arange(6)])
    assert where[0] == "host", f"the selected page spilled: {where}"
    assert where.count("nvme") == 2, where
    written = torch.arange(6)
    assert torch.equal(bits(source.read(written)), bits(torch.stack([expected[s] for s in range(6)])))
    source.close()


@pytest.mark.parametrize("kind", ["host", "host+nvme"])
def test_a_forwards_device_steps_advance_inside_it(tmp_path, kind):
    """before_forward (host work, run before a graph replay) leaves the step counters on the device
    alone; begin_forward (captured inside the forward) advances them: the hot cache's step and, on
    host+nvme, the clock that stamps selected pages. A replayed decode graph then launches nothing
    from Python for them."""
    geometry = PageGeometry(16, 32, torch.float16)
    extra = {"nvme_dir": str(tmp_path)} if kind == "host+nvme" else {}
    source = make_tier(kind, geometry, 32, host_pages=4, cache_pages=4, **extra)

    def device_steps() -> list[int]:
        clock = [int(source._clock)] if kind == "host+nvme" else []
        return [source.cache.stats().steps, *clock]

    before = device_steps()
    source.before_forward()
    assert device_steps() == before
    source.begin_forward()
    assert device_steps() == [n + 1 for n in before]
    source.close()


def test_lookahead_of_one_is_refused(tmp_path):
    geometry = PageGeometry(16, 32, torch.float16)
    with pytest.raises(ValueError, match="lookahead"):
        make_tier("host+nvme", geometry, 32, host_pages=4, nvme_dir=str(tmp_path / "x"), cache_pages=4,
                  max_selected=3, lookahead=1)


def test_factory_rejects_bad_arguments(tmp_path):
    geometry = PageGeometry(16, 32, torch.float16)
    with pytest.raises(ValueError, match=r"kind \('nvme'\) must be one of"):
        make_tier("nvme", geometry, 4)
    with pytest.raises(ValueError, match="needs nvme_dir"):
        make_tier("host+nvme", geometry, 4)
    with pytest.raises(ValueError, match=r"head_dim \(0\) must be > 0"):
        PageGeometry(16, 0, torch.float16)
    with pytest.raises(ValueError, match=r"kind 'host' needs cache_pages or max_selected"):
        make_tier("host", geometry, 4)
    with pytest.raises(ValueError, match=r"pool: expected \[>= 2 rows, 2, 16, 32\] torch.float16 on cpu"):
        make_tier("host", geometry, 4, max_selected=2, pool=torch.zeros(2, 2, 16, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"pool: expected \[>= 3 rows.*got \(2, 2, 16, 32\)"):
        make_tier("host", geometry, 4, max_selected=3, pool=torch.zeros(2, 2, 16, 32, dtype=torch.float16))
    source = make_tier("hbm", geometry, 4)
    with pytest.raises(ValueError, match=r"slots: expected a 1-D int64 tensor"):
        source.write(torch.tensor([1.0]), random_pages(1, geometry, 0))
    with pytest.raises(ValueError, match=r"pages: expected shape \(1, 2, 16, 32\)"):
        source.write(torch.tensor([1]), random_pages(2, geometry, 0))
