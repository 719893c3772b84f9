"""Hot-page cache against a pure-Python LRU model (the test's reference)."""

from __future__ import annotations

import functools

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import HotPageCache
from lockserve.offload.gather import gather_pages

from tests.conftest import triton_devices
from tests.offload.lru_model import LruModel, selections


def random_pool(n: int, geometry: PageGeometry, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *geometry.page_shape), generator=g).to(geometry.dtype)


def check_tables(cache: HotPageCache, model: LruModel) -> None:
    s2c, c2s = cache.slot_to_cache, cache.cache_to_slot
    cached = torch.nonzero(s2c >= 0).flatten()
    assert sorted(cached.tolist()) == sorted(model.last), "cached slot set differs from the LRU model"
    assert torch.equal(c2s[s2c[cached].long()], cached), "slot_to_cache and cache_to_slot are not inverse"
    assert int((c2s >= 0).sum()) == cached.numel(), "cache_to_slot holds a slot slot_to_cache forgot"


def run_against_model(cache, pool, steps, max_m, seed):
    model = LruModel(cache.capacity)
    before = cache.stats()
    for t, sel in enumerate(selections(pool.shape[0], steps, max_m, seed)):
        slots = torch.tensor(sel, dtype=torch.int64)
        idx = cache.lookup_and_fill(slots, pool)
        hits, misses = model.step(t, sel)
        after = cache.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (hits, misses), f"step {t}: {sel}"
        assert after.requests - before.requests == len(sel)
        assert torch.equal(cache.pool[idx].view(torch.uint8), pool[slots].view(torch.uint8)), (
            f"bytes, step {t}"
        )
        check_tables(cache, model)
        before = after
    return model


@pytest.mark.parametrize(
    "num_slots,capacity,max_m,dtype",
    [(97, 16, 16, torch.bfloat16), (300, 40, 23, torch.float16), (50, 7, 7, torch.float32)],
)
def test_cache_matches_lru_model(num_slots, capacity, max_m, dtype):
    geometry = PageGeometry(16, 32, dtype)
    pool = random_pool(num_slots, geometry, seed=num_slots)
    cache = HotPageCache(geometry, capacity, num_slots, max_m, "cpu")
    run_against_model(cache, pool, steps=80, max_m=max_m, seed=capacity)
    s = cache.stats()
    assert s.steps == 80 and s.bytes_moved == s.misses * geometry.slot_bytes
    assert 0.0 < s.hit_rate < 1.0


@pytest.mark.parametrize("device", triton_devices())
def test_cache_with_triton_gather(device):
    geometry = PageGeometry(16, 64, torch.bfloat16)
    pool = random_pool(60, geometry, seed=3).to(device)
    gather = functools.partial(gather_pages, backend="triton")
    cache = HotPageCache(geometry, 9, 60, 8, device, gather=gather)
    run_against_model(cache, pool, steps=12, max_m=8, seed=5)


def test_duplicates_in_one_request():
    geometry = PageGeometry(16, 16, torch.float32)
    pool = random_pool(10, geometry, seed=0)
    cache = HotPageCache(geometry, 4, 10, 4, "cpu")
    idx = cache.lookup_and_fill(torch.tensor([5, 5, 5, 2]), pool)
    assert idx[0] == idx[1] == idx[2] != idx[3]
    s = cache.stats()
    assert (s.hits, s.misses, s.requests) == (0, 2, 4)
    cache.lookup_and_fill(torch.tensor([2, 2]), pool)
    s = cache.stats()
    assert (s.hits, s.misses, s.bytes_moved_last_step) == (1, 2, 0)


def test_requested_entries_are_never_evicted_in_their_step():
    geometry = PageGeometry(16, 16, torch.float32)
    pool = random_pool(20, geometry, seed=1)
    cache = HotPageCache(geometry, 4, 20, 4, "cpu")
    cache.lookup_and_fill(torch.tensor([0, 1, 2, 3]), pool)
    # The oldest entry (slot 0) is requested again while 3 new slots need room.
    idx = cache.lookup_and_fill(torch.tensor([0, 7, 8, 9]), pool)
    assert torch.equal(cache.pool[idx], pool[[0, 7, 8, 9]])
    assert int(cache.slot_to_cache[0]) >= 0 and int((cache.slot_to_cache >= 0).sum()) == 4


def test_update_and_invalidate_follow_rewrites():
    geometry = PageGeometry(16, 16, torch.bfloat16)
    pool = random_pool(30, geometry, seed=2)
    cache = HotPageCache(geometry, 8, 30, 6, "cpu")
    cache.lookup_and_fill(torch.tensor([3, 4, 5]), pool)
    new = random_pool(2, geometry, seed=9)
    pool[[4, 11]] = new
    cache.update(torch.tensor([4, 11]), new)  # 4 is cached (refreshed), 11 is not (ignored)
    assert int(cache.slot_to_cache[11]) == -1
    pool[5] = random_pool(1, geometry, seed=10)[0]
    cache.invalidate(torch.tensor([5, 12]))
    before = cache.stats()
    idx = cache.lookup_and_fill(torch.tensor([3, 4, 5]), pool)
    after = cache.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 1)
    assert torch.equal(cache.pool[idx], pool[[3, 4, 5]]), "a rewritten page came back stale"


def test_construction_and_request_checks():
    geometry = PageGeometry(16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"max_selected \(9\) must be in \[1, capacity \(8\)\]"):
        HotPageCache(geometry, 8, 100, 9, "cpu")
    cache = HotPageCache(geometry, 8, 100, 4, "cpu")
    pool = random_pool(100, geometry, seed=0)
    with pytest.raises(ValueError, match=r"5 requested, more than max_selected \(4\)"):
        cache.lookup_and_fill(torch.arange(5), pool)
    with pytest.raises(ValueError, match="int64"):
        cache.lookup_and_fill(torch.arange(3, dtype=torch.int32), pool)
    assert cache.lookup_and_fill(torch.empty(0, dtype=torch.int64), pool).numel() == 0
