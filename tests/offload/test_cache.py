"""Hot-page cache against a pure-Python set-associative LRU model (the test's reference), and the
Triton kernels (interpreter on CPU) against the torch reference path, bit for bit."""

from __future__ import annotations

import pytest
import torch
from lockserve.offload import cache as cache_module
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import COMMITS, HotPageCache, pool_rows, slot_sets

from tests.conftest import triton_devices
from tests.offload.conftest import bits
from tests.offload.lru_model import SetLruModel, check_step, random_outside, selections, set_of

INTERPRETER = "cpu" in triton_devices()
needs_interpreter = pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1")
BACKENDS = ["torch", pytest.param("triton", marks=needs_interpreter)]


def random_pool(n: int, geometry: PageGeometry, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *geometry.page_shape), generator=g).to(geometry.dtype)


# (ways, num_sets, max_m): direct-mapped, one set, non-power-of-2 ways; max_m up to C + 5.
SHAPES = [(1, 7, 12), (4, 3, 17), (16, 1, 21), (4, 7, 20), (3, 7, 26), (16, 3, 30)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ways,num_sets,max_m", SHAPES)
def test_cache_matches_the_set_lru_model(backend, ways, num_sets, max_m):
    geometry = PageGeometry(16, 16, [torch.bfloat16, torch.float16, torch.float32][ways % 3])
    num_slots = 3 * num_sets * ways + 20
    src = random_pool(num_slots, geometry, seed=num_slots)
    capacity = (num_sets - 1) * ways + 1  # rounded up to num_sets whole sets
    cache = HotPageCache(geometry, capacity, num_slots, max_m, "cpu", ways=ways, backend=backend)
    assert (cache.num_sets, cache.capacity) == (num_sets, num_sets * ways)
    model = SetLruModel(num_sets, ways)
    steps = 150 if backend == "torch" else 15  # the interpreter is slow; triton == torch is tested below
    for t, sel in enumerate(selections(num_slots, steps, max_m, seed=ways * 10 + num_sets)):
        check_step(cache, model, src, sel, t)
    s = cache.stats()
    assert s.steps == steps and s.bytes_moved == s.misses * geometry.slot_bytes
    assert 0.0 < s.hit_rate < 1.0 and s.hits + s.misses == s.requests
    assert s.capacity == num_sets * ways
    assert s.bytes_resident == (num_sets * ways + max_m) * geometry.slot_bytes


# On the CPU "branch" has no side stream and runs as "launch": one shape of it, not three (each of
# the larger two took 6-13 s of Triton's interpreter for what "launch" runs again).
REFERENCE_CASES = [(*shape, commit) for shape in [(4, 3, 17), (3, 7, 26), (16, 2, 37)] for commit in COMMITS
                   if commit != "branch" or shape == (4, 3, 17)]


@needs_interpreter
@pytest.mark.parametrize("ways,num_sets,max_m,commit", REFERENCE_CASES)
def test_triton_equals_the_torch_reference(ways, num_sets, max_m, commit):
    """Every commit: inside the lookup launch (its last program), as a second launch (on CPU
    "branch" has no side stream and runs as "launch"), "fused" past fused_commit_max, and "inline"
    (steps of three calls). The interpreter runs the programs one after another, so under "inline"
    each program sees every install of the programs before it: the view that differs most from
    the tables the reference reads (as they were before the call)."""
    geometry = PageGeometry(16, 32, torch.bfloat16)
    num_slots = 2 * num_sets * ways + 9
    src = random_pool(num_slots, geometry, seed=ways)
    caches = [
        HotPageCache(geometry, num_sets * ways, num_slots, max_m, "cpu", ways=ways, backend=b)
        for b in ("triton", "torch")
    ]
    for cache in caches:
        cache.commit = commit
    caches[0].fused_commit_max = max_m if ways != 16 else max_m - 1  # 16 ways: "fused" launches commit
    g = torch.Generator().manual_seed(ways)
    # 12 steps: every path (misses and evictions from the first step, `outside` on six steps, an
    # advance_step before four), at about 0.6 s a step in the interpreter.
    for t, sel in enumerate(selections(num_slots, 12, max_m, seed=num_sets, pad_to=max_m)):
        slots = torch.tensor(sel, dtype=torch.int64)
        outside = random_outside(slots, g) if t % 2 else None  # the folded where, every other step
        if t % 3 == 0:
            for cache in caches:
                cache.advance_step()  # a no-op but under "inline"
        got, want = (c.lookup_and_fill(slots, src, outside) for c in caches)
        assert torch.equal(got, want), f"step {t}: idx"
        tri, ref = caches
        assert torch.equal(tri.tags, ref.tags) and torch.equal(tri.last_used, ref.last_used), f"step {t}"
        assert tri.stats() == ref.stats(), f"step {t}: counters"
        if commit != "inline":
            assert torch.equal(tri._counters, ref._counters), f"step {t}: counters"
        assert torch.equal(bits(tri.pool), bits(ref.pool)), f"step {t}: pool bytes (entries and staging)"
        assert int(tri._done) == 0, f"step {t}: the ticket counter is back to 0 for the next call"


@needs_interpreter
@pytest.mark.parametrize("commit", ["inline", "fused"])
def test_pages_of_several_copy_chunks_equal_the_reference(commit):
    """A 16 KiB page is two copy chunks (2,048 words each). Under "inline" a request's install is
    visible to the launch's later programs, so its page must not be split over programs that
    probe the tables one after another (the interpreter runs chunk 1 after chunk 0 wrote)."""
    geometry = PageGeometry(32, 64, torch.float32)
    assert geometry.slot_bytes == 16384
    src = random_pool(40, geometry, seed=5)
    caches = [HotPageCache(geometry, 8, 40, 6, "cpu", ways=4, backend=b) for b in ("triton", "torch")]
    for cache in caches:
        cache.commit = commit
    for t, sel in enumerate([[3, 9, -1, 20], [9, 21, 3, 30, 31, 32], [30, 5, -1], [33, 34, 35, 36, 3]]):
        for cache in caches:
            cache.advance_step()
        got, want = (c.lookup_and_fill(torch.tensor(sel), src) for c in caches)
        assert torch.equal(got, want), f"call {t}: idx"
        tri, ref = caches
        assert torch.equal(tri.tags, ref.tags) and torch.equal(tri.last_used, ref.last_used), f"call {t}"
        assert torch.equal(bits(tri.pool), bits(ref.pool)), f"call {t}: pool bytes"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ways,num_sets,max_m", [(4, 3, 17), (16, 2, 37)])
def test_inline_commit_matches_the_model_with_steps_of_several_calls(backend, ways, num_sets, max_m):
    """Under "inline" the calls between two advance_step share a step: a way used by an earlier
    call of the step is not taken by this call's misses unless this call hits it."""
    geometry = PageGeometry(16, 16, torch.float32)
    num_slots = 2 * num_sets * ways + 9
    src = random_pool(num_slots, geometry, seed=7)
    cache = HotPageCache(geometry, num_sets * ways, num_slots, max_m, "cpu", ways=ways, backend=backend)
    cache.commit = "inline"
    model = SetLruModel(num_sets, ways)
    calls = 40 if backend == "torch" else 15
    for t, sel in enumerate(selections(num_slots, calls, max_m, seed=ways)):
        if t % 4 == 0:
            cache.advance_step()
            model.advance()
        before = cache.stats()
        idx = cache.lookup_and_fill(torch.tensor(sel, dtype=torch.int64), src)
        want, after = model.step(sel, advance=False), cache.stats()
        assert idx.tolist() == want.idx, f"call {t}: idx"
        assert (after.hits - before.hits, after.misses - before.misses) == (want.hits, want.misses), t
        assert after.not_installed - before.not_installed == want.not_installed, t
        assert cache.tags.tolist() == model.tags and cache.last_used.tolist() == model.last, f"call {t}"
    assert cache.stats().steps == model.steps == (calls - 1) // 4 + 1
    with pytest.raises(RuntimeError, match="not kept under the 'inline' commit"):
        _ = cache.last_step_misses


@needs_interpreter
@pytest.mark.parametrize("commit", ["inline", "fused"])
def test_a_scan_of_several_passes_equals_the_reference(monkeypatch, commit):
    """A miss scans the call in passes of _SCAN slots: at 16, calls of 45 requests take three, with
    several requests of one set in a pass (2 sets) and in different passes."""
    monkeypatch.setattr(cache_module, "_SCAN", 16)
    geometry = PageGeometry(16, 16, torch.float32)
    src = random_pool(70, geometry, seed=11)
    caches = [HotPageCache(geometry, 16, 70, 45, "cpu", ways=8, backend=b) for b in ("triton", "torch")]
    for cache in caches:
        cache.commit = commit
    for t, sel in enumerate(selections(70, 6, 45, seed=3, pad_to=45)):
        for cache in caches:
            cache.advance_step()
        got, want = (c.lookup_and_fill(torch.tensor(sel, dtype=torch.int64), src) for c in caches)
        assert torch.equal(got, want), f"call {t}: idx"
        tri, ref = caches
        assert torch.equal(tri.tags, ref.tags) and torch.equal(tri.last_used, ref.last_used), f"call {t}"
        assert tri.stats() == ref.stats(), f"call {t}: counters"
        assert torch.equal(bits(tri.pool), bits(ref.pool)), f"call {t}: pool bytes"


@pytest.mark.parametrize("backend", BACKENDS)
def test_way_ages_wrap_past_two_to_the_32_steps(backend):
    """Stamps are the low 32 bits of the step: LRU order and last_used stay right across a wrap."""
    geometry = PageGeometry(16, 16, torch.float32)
    src = random_pool(30, geometry, seed=2)
    cache = HotPageCache(geometry, 4, 30, 6, "cpu", ways=4, backend=backend)  # one set of 4 ways
    model = SetLruModel(1, 4)
    start = 2**32 - 3
    cache._counters[0] = start
    model.steps = start
    for t, sel in enumerate([[0, 1], [2, 0], [3, 1], [4, 5], [6, 2], [7, 8, 9], [1, 4]]):
        idx = cache.lookup_and_fill(torch.tensor(sel), src)
        assert idx.tolist() == model.step(sel).idx, f"call {t}"
        assert cache.tags.tolist() == model.tags and cache.last_used.tolist() == model.last, f"call {t}"
    assert int(cache._counters[0]) > 2**32


@pytest.mark.parametrize("backend", BACKENDS)
def test_victims_are_least_recently_used_free_ways_in_request_order(backend):
    geometry = PageGeometry(16, 16, torch.float32)
    src = random_pool(30, geometry, seed=1)
    cache = HotPageCache(geometry, 4, 30, 6, "cpu", ways=4, backend=backend)  # one set of 4 ways
    c = cache.capacity

    def lookup(sel):
        idx = cache.lookup_and_fill(torch.tensor(sel), src)
        assert torch.equal(cache.pool[idx], src[sel])
        return idx.tolist()

    assert lookup([0, 1, 2, 3]) == [c, c + 1, c + 2, c + 3]  # empty ways, lower way first
    assert cache.tags.tolist() == [[0, 1, 2, 3]]
    # 0 is a hit (its way is kept); 10, 11, 12 take the free ways 1..3 (equal last: lower way
    # first); 13 and 14 find no way left and are served from staging only.
    assert lookup([10, 0, 11, 12, 13, 14]) == [c, 0, c + 2, c + 3, c + 4, c + 5]
    assert cache.tags.tolist() == [[0, 10, 11, 12]] and cache.last_used.tolist() == [[1, 1, 1, 1]]
    assert cache.stats().not_installed == 2
    lookup([13, 1])  # all four ways were last used at step 1: ways 0 and 1 go
    assert cache.tags.tolist() == [[13, 1, 11, 12]] and cache.last_used.tolist() == [[2, 2, 1, 1]]
    lookup([20])  # least recently used: way 2 (step 1, lower than way 3)
    assert cache.tags.tolist() == [[13, 1, 20, 12]]
    s = cache.stats()
    assert (s.steps, s.requests, s.hits, s.misses, s.not_installed) == (4, 13, 1, 12, 2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_outside_rows_replace_the_cache_rows_and_change_nothing_else(backend):
    """lookup_and_fill(slots, src, (mask, rows)) == torch.where(mask, rows, lookup_and_fill(slots,
    src)), with the same tables, counters and pool bytes (the engine's open pages fold in)."""
    geometry = PageGeometry(16, 16, torch.bfloat16)
    src = random_pool(60, geometry, seed=3)
    caches = [HotPageCache(geometry, 8, 60, 9, "cpu", ways=4, backend=backend) for _ in range(2)]
    folded, plain = caches
    for t, sel in enumerate([[4, -1, 9, 33, -1, 7], [9, -1, 12, -1, 4, 51, -1, 2, 40], [-1, -1]]):
        slots = torch.tensor(sel)
        mask = torch.tensor([s < 0 and i % 2 == 1 for i, s in enumerate(sel)])
        rows = torch.where(mask, 500 + torch.arange(len(sel)), -1)
        got = folded.lookup_and_fill(slots, src, (mask, rows))
        want = torch.where(mask, rows, plain.lookup_and_fill(slots, src))
        assert torch.equal(got, want), f"step {t}: {got.tolist()} != {want.tolist()}"
        assert torch.equal(folded.tags, plain.tags) and torch.equal(folded.last_used, plain.last_used)
        assert torch.equal(folded._counters, plain._counters), f"step {t}: counters"
        assert torch.equal(bits(folded.pool), bits(plain.pool)), f"step {t}: pool bytes"
    assert got.tolist() == [0, 501], "outside rows where masked, padding 0 elsewhere"
    assert folded.stats().hits == 2, "9 and 4 hit in the second step"


def test_outside_is_validated():
    geometry = PageGeometry(16, 16, torch.float32)
    cache = HotPageCache(geometry, 8, 100, 4, "cpu", ways=4)
    src = random_pool(100, geometry, seed=0)
    slots = torch.tensor([3, -1, 5])
    want = r"outside {}: expected \(3,\) torch.{} on cpu, got \({}\) torch.{}"
    for outside, message in [
        ((torch.tensor([0, 1, 0]), slots), want.format("mask", "bool", "3,", "int64")),
        ((slots < 0, slots[:2]), want.format("rows", "int64", "2,", "int64")),
        ((slots < 0, slots.int()), want.format("rows", "int64", "3,", "int32")),
    ]:
        with pytest.raises(ValueError, match=message):
            cache.lookup_and_fill(slots, src, outside)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_entries_are_ignored(backend):
    geometry = PageGeometry(16, 16, torch.float16)
    src = random_pool(40, geometry, seed=2)
    cache = HotPageCache(geometry, 8, 40, 5, "cpu", ways=4, backend=backend)
    assert cache.lookup_and_fill(torch.tensor([-1, -1, -1]), src).tolist() == [0, 0, 0]
    c = cache.capacity
    idx = cache.lookup_and_fill(torch.tensor([-1, 5, -1, 9, -7]), src)
    assert idx.tolist() == [0, c + 1, 0, c + 3, 0]
    assert torch.equal(cache.pool[idx[[1, 3]]], src[[5, 9]])
    s = cache.stats()
    assert (s.steps, s.requests, s.hits, s.misses) == (2, 2, 0, 2)
    assert cache.lookup_and_fill(torch.empty(0, dtype=torch.int64), src).numel() == 0
    assert cache.stats().steps == 2, "an empty lookup is a no-op"


@pytest.mark.parametrize("backend", BACKENDS)
def test_update_and_invalidate_follow_rewrites(backend):
    geometry = PageGeometry(16, 16, torch.bfloat16)
    src = random_pool(30, geometry, seed=2)
    cache = HotPageCache(geometry, 8, 30, 6, "cpu", ways=4, backend=backend)
    model = SetLruModel(cache.num_sets, cache.ways)
    check_step(cache, model, src, [3, 4, 5], 0)
    new = random_pool(2, geometry, seed=9)
    src[[4, 11]] = new
    cache.update(torch.tensor([4, 11]), new)  # 4 is cached (refreshed), 11 is not (ignored)
    assert 11 not in cache.tags.flatten().tolist()
    src[5] = random_pool(1, geometry, seed=10)[0]
    cache.invalidate(torch.tensor([5, 12, -1]))  # 12 is absent, -1 padding: both ignored
    model.invalidate([5, 12])
    assert cache.tags.tolist() == model.tags and cache.last_used.tolist() == model.last
    before = cache.stats()
    check_step(cache, model, src, [3, 4, 5], 1)  # 5 comes back as a miss with its new bytes
    after = cache.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)


def test_pool_argument_is_used_and_validated():
    geometry = PageGeometry(16, 16, torch.float32)
    rows = pool_rows(10, 6, ways=4)
    assert rows == 12 + 6
    big = torch.zeros((rows + 5, *geometry.page_shape))
    cache = HotPageCache(geometry, 10, 50, 6, "cpu", pool=big[:rows], ways=4)
    assert cache.pool.data_ptr() == big.data_ptr() and cache.pool.shape[0] == cache.capacity + 6
    src = random_pool(50, geometry, seed=4)
    idx = cache.lookup_and_fill(torch.tensor([7, 8, 9]), src)
    assert torch.equal(big[idx], src[[7, 8, 9]])
    with pytest.raises(ValueError, match=r"pool: expected a contiguous \(18, 2, 16, 16\) torch.float32"):
        HotPageCache(geometry, 10, 50, 6, "cpu", pool=big[: rows - 1], ways=4)
    with pytest.raises(ValueError, match=r"pool: .*capacity 12 \+ max_selected 6 rows.*torch.float16"):
        HotPageCache(geometry, 10, 50, 6, "cpu", pool=big[:rows].half(), ways=4)
    assert HotPageCache(geometry, 4096, 10**6, 1024, "cpu").pool.shape[0] == pool_rows(4096, 1024) == 5120


def test_construction_and_request_checks():
    geometry = PageGeometry(16, 16, torch.float32)
    for kwargs, message in [
        ({"capacity": 0}, r"capacity \(0\) must be > 0"),
        ({"ways": 0}, r"ways \(0\) must be > 0"),
        ({"max_selected": 0}, r"max_selected \(0\) must be > 0"),
        ({"num_arena_slots": 2**31 + 1}, r"num_arena_slots \(2147483649\) must be in \[1, 2\*\*31\]"),
        ({"backend": "cuda"}, r"backend \('cuda'\) must be 'auto', 'triton' or 'torch'"),
    ]:
        args = {"capacity": 8, "num_arena_slots": 100, "max_selected": 4, "ways": 4} | kwargs
        with pytest.raises(ValueError, match=message):
            HotPageCache(geometry, device="cpu", **args)
    cache = HotPageCache(geometry, 8, 100, 4, "cpu", ways=4)
    src = random_pool(100, geometry, seed=0)
    with pytest.raises(ValueError, match=r"slots: 5 requested, more than max_selected \(4\)"):
        cache.lookup_and_fill(torch.arange(5), src)
    with pytest.raises(ValueError, match=r"slots: expected a 1-D int64 tensor, got \(3,\) torch.int32"):
        cache.lookup_and_fill(torch.arange(3, dtype=torch.int32), src)
    with pytest.raises(ValueError, match=r"src: expected shape \(S, 2, 16, 16\)"):
        cache.lookup_and_fill(torch.arange(3), src[:, :, :8])
    with pytest.raises(ValueError, match=r"src: expected dtype torch.float32"):
        cache.lookup_and_fill(torch.arange(3), src.half())


def test_hash_spreads_consecutive_slots_and_matches_the_model():
    for num_sets in (1, 3, 7, 64, 256):
        sets = slot_sets(torch.arange(16 * num_sets), num_sets)
        load = torch.bincount(sets, minlength=num_sets)
        assert load.numel() == num_sets and int(load.max()) <= 2 * 16, f"{num_sets} sets: {load.tolist()}"
    slots = torch.cat([torch.arange(100), torch.randint(0, 2**31, (1000,)), torch.tensor([2**31 - 1])])
    for num_sets in (1, 7, 256, 2**20):
        got = slot_sets(slots, num_sets).tolist()
        assert got == [set_of(s, num_sets) for s in slots.tolist()] and max(got) < num_sets


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_slot_never_leaves_a_stale_copy(backend):
    """Slots must be distinct; should a caller repeat one anyway, update and invalidate still
    reach every way that holds it."""
    geometry = PageGeometry(16, 16, torch.float32)
    src = random_pool(10, geometry, seed=5)
    cache = HotPageCache(geometry, 4, 10, 3, "cpu", ways=4, backend=backend)
    cache.lookup_and_fill(torch.tensor([5, 5, 2]), src)
    assert cache.tags.tolist() == [[5, 5, 2, -1]]
    new = random_pool(1, geometry, seed=6)
    src[5] = new[0]
    cache.update(torch.tensor([5]), new)
    assert torch.equal(cache.pool[[0, 1]], new.expand(2, *geometry.page_shape))
    cache.invalidate(torch.tensor([5]))
    assert cache.tags.tolist() == [[-1, -1, 2, -1]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_held_twice_is_hit_in_its_lower_way_only(backend):
    """Should a caller repeat a slot, two ways hold it; a later request hits the lower one, and
    the higher one stays a victim (least recently used after the empty way)."""
    geometry = PageGeometry(16, 16, torch.float32)
    src = random_pool(10, geometry, seed=7)
    cache = HotPageCache(geometry, 4, 10, 3, "cpu", ways=4, backend=backend)
    cache.lookup_and_fill(torch.tensor([5, 5, 2]), src)
    assert cache.tags.tolist() == [[5, 5, 2, -1]] and cache.last_used.tolist() == [[0, 0, 0, -1]]
    c = cache.capacity
    idx = cache.lookup_and_fill(torch.tensor([7, 5, 8]), src)
    assert idx.tolist() == [c, 0, c + 2]
    assert cache.tags.tolist() == [[5, 8, 2, 7]] and cache.last_used.tolist() == [[1, 1, 0, 1]]
    assert torch.equal(cache.pool[[1, 3]], src[[8, 7]])


def test_commit_placement_is_checked():
    cache = HotPageCache(PageGeometry(16, 32, torch.bfloat16), 8, 64, 4, "cpu", ways=4)
    assert cache.commit == "fused"
    with pytest.raises(ValueError, match=r"commit \('later'\) must be one of \('fused', 'branch',"):
        cache.commit = "later"
    assert cache.commit == "fused"
