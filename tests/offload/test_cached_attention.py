"""The attention that looks its pages up in the hot cache (one launch, plus the merge) against its
reference (the cache's torch lookup, then the torch attention at the rows it returns): same
outputs, and the same tables, counters and cache ways, step after step."""

from __future__ import annotations

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import HotPageCache

from tests.conftest import triton_devices
from tests.offload.conftest import bits

pytestmark = pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1")

BT, HKV, HQ, PAGE, D = 2, 2, 4, 16, 16
NUM_SLOTS, OPEN_ROWS = 40, 4


def make(backend: str, k: int, ways: int, num_sets: int):
    """(attention pool, its cache): the cache's pool is the front, then OPEN_ROWS write-pool rows."""
    geometry = PageGeometry(PAGE, D, torch.float32)
    m = BT * HKV * k
    front = num_sets * ways + m
    pool = torch.zeros(front + OPEN_ROWS, 2, PAGE, D)
    pool[front:] = torch.randn(OPEN_ROWS, 2, PAGE, D, generator=torch.Generator().manual_seed(5))
    cache = HotPageCache(geometry, num_sets * ways, NUM_SLOTS, m, "cpu", pool=pool[:front], ways=ways,
                         backend=backend)
    return pool, cache


def selection(k: int, front: int, step: int):
    """A step's (slots, is_open, rows, lens) [BT, HKV, k]: distinct slots drawn from a window that
    slides (so later steps hit), per (b, h) one open page at the end, some padding."""
    g = torch.Generator().manual_seed(100 + step)
    m = BT * HKV * k
    window = torch.arange(step * 3, step * 3 + 2 * m) % NUM_SLOTS
    slots = window[torch.randperm(window.numel(), generator=g)[:m]].view(BT, HKV, k).clone()
    lens = torch.full((BT, HKV, k), PAGE, dtype=torch.int32)
    is_open = torch.zeros(BT, HKV, k, dtype=torch.bool)
    is_open[..., -1] = True
    pad = torch.rand(BT, HKV, k, generator=g) < 0.15
    pad[..., -1] = False
    slots[is_open | pad] = -1
    lens[pad] = 0
    lens[..., -1] = torch.randint(1, PAGE + 1, (BT, HKV), generator=g, dtype=torch.int32)
    rows = torch.where(is_open, front + torch.randint(0, OPEN_ROWS, (BT, HKV, k), generator=g), slots)
    return slots, is_open, rows, lens


@pytest.mark.parametrize("k,ways,num_sets", [(3, 2, 2), (6, 4, 3), (9, 2, 5)])
def test_cached_attention_equals_lookup_then_attention(k, ways, num_sets):
    """k = 3 is one split (the commit launches alone), 6 and 9 two or three (the commit rides in
    the merge); small caches, so that misses evict and some sets run out of free ways."""
    from lockserve.offload.cached_attention import cached_sparse_decode, cached_sparse_decode_ref

    src = torch.randn(NUM_SLOTS, 2, PAGE, D, generator=torch.Generator().manual_seed(k))
    (pool, cache), (ref_pool, ref_cache) = make("triton", k, ways, num_sets), make("torch", k, ways, num_sets)
    front = cache.pool.shape[0]
    for step in range(6):
        slots, is_open, rows, lens = selection(k, front, step)
        q = torch.randn(BT, HQ, D, generator=torch.Generator().manual_seed(step))
        o, lse = cached_sparse_decode(q, pool, cache, src, slots, is_open, rows, lens)
        ro, rlse = cached_sparse_decode_ref(q, ref_pool, ref_cache, src, slots, is_open, rows, lens)
        torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5, msg=f"step {step}: o")
        torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5, msg=f"step {step}: lse")
        assert torch.equal(cache.tags, ref_cache.tags), f"step {step}: tags"
        assert torch.equal(cache.last_used, ref_cache.last_used), f"step {step}: last used"
        assert torch.equal(cache._counters, ref_cache._counters), f"step {step}: counters"
        ways_rows = cache.capacity
        assert torch.equal(bits(pool[:ways_rows]), bits(ref_pool[:ways_rows])), f"step {step}: cache ways"
    stats = cache.stats()
    assert stats.hits > 0 and stats.misses > 0 and stats.not_installed > 0, stats


def test_cached_attention_refuses_a_pool_that_does_not_hold_the_cache():
    from lockserve.offload.cached_attention import cached_sparse_decode

    pool, cache = make("triton", 3, 4, 3)
    slots, is_open, rows, lens = selection(3, cache.pool.shape[0], 0)
    src = torch.zeros(NUM_SLOTS, 2, PAGE, D)
    with pytest.raises(ValueError, match="cache's pool"):
        cached_sparse_decode(torch.zeros(BT, HQ, D), pool.clone(), cache, src, slots, is_open, rows, lens)
    with pytest.raises(ValueError, match="is_open"):
        cached_sparse_decode(torch.zeros(BT, HQ, D), pool, cache, src, slots, is_open.int(), rows, lens)
