"""The attention that finds its pages in the hot cache itself (offload/cached_attention.py)
against its reference (the pages gathered where they are, the torch attention), forward after
forward: each layer reads the tables the last fill left, then one fill of every layer's slots.
The Triton fill against the torch one: the same tables, counters and cache ways."""

from __future__ import annotations

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import HotPageCache

from tests.conftest import triton_devices
from tests.offload.conftest import bits

BT, HKV, HQ, PAGE, D = 2, 2, 4, 16, 16
NUM_SLOTS, OPEN_ROWS, LAYERS = 120, 4, 3


def make(backend: str, k: int, ways: int, num_sets: int, device: str = "cpu"):
    """(attention pool, its cache): the cache's pool is the front, then OPEN_ROWS write-pool rows."""
    geometry = PageGeometry(PAGE, D, torch.float32)
    m = BT * HKV * k
    front = num_sets * ways + m
    pool = torch.zeros(front + OPEN_ROWS, 2, PAGE, D)
    pool[front:] = torch.randn(OPEN_ROWS, 2, PAGE, D, generator=torch.Generator().manual_seed(5))
    pool = pool.to(device)
    cache = HotPageCache(geometry, num_sets * ways, NUM_SLOTS, m, device, pool=pool[:front], ways=ways,
                         backend=backend, max_fill=LAYERS * m)
    return pool, cache


def selection(k: int, front: int, step: int, layer: int = 0):
    """A layer's (slots, is_open, rows, lens) [BT, HKV, k]: distinct slots of the layer's third of
    the arena, drawn from a window that slides (so later steps hit), per (b, h) one open page at
    the end, some padding."""
    g = torch.Generator().manual_seed(100 * layer + step)
    m, per_layer = BT * HKV * k, NUM_SLOTS // LAYERS
    window = layer * per_layer + torch.arange(step * 3, step * 3 + 2 * m) % per_layer
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


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("k,ways,num_sets", [(3, 2, 2), (6, 4, 3), (9, 2, 5)])
def test_cached_attention_and_fill_equal_their_references(k, ways, num_sets, device):
    """k = 3 is one split, 6 and 9 two or three; small caches, so that misses evict and some sets
    run out of free ways."""
    from lockserve.offload.cached_attention import cached_sparse_decode, cached_sparse_decode_ref

    src = torch.randn(NUM_SLOTS, 2, PAGE, D, generator=torch.Generator().manual_seed(k)).to(device)
    pool, cache = make("triton", k, ways, num_sets, device)
    ref_pool, ref_cache = make("torch", k, ways, num_sets, device)
    front, m = cache.pool.shape[0], BT * HKV * k
    fill, ref_fill = (torch.full((LAYERS * m,), -7, dtype=torch.int64, device=device) for _ in range(2))
    for step in range(6):
        for layer in range(LAYERS):
            slots, is_open, rows, lens = (t.to(device) for t in selection(k, front, step, layer))
            q = torch.randn(BT, HQ, D, generator=torch.Generator().manual_seed(step)).to(device)
            part = slice(layer * m, (layer + 1) * m)
            o, lse = cached_sparse_decode(q, pool, cache, src, slots, is_open, rows, lens, fill[part])
            ro, rlse = cached_sparse_decode_ref(q, ref_pool, ref_cache, src, slots, is_open, rows, lens,
                                                ref_fill[part])
            where = f"step {step}, layer {layer}"
            torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5, msg=f"{where}: o")
            torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5, msg=f"{where}: lse")
            assert torch.equal(fill[part], slots.flatten()), f"{where}: the fill list"
        cache.fill(fill, src)
        ref_cache.fill(ref_fill, src)
        assert torch.equal(cache.tags, ref_cache.tags), f"step {step}: tags"
        assert torch.equal(cache.last_used, ref_cache.last_used), f"step {step}: last used"
        assert torch.equal(cache._counters, ref_cache._counters), f"step {step}: counters"
        ways_rows = cache.capacity
        assert torch.equal(bits(pool[:ways_rows]), bits(ref_pool[:ways_rows])), f"step {step}: cache ways"
    stats = cache.stats()
    assert stats.hits > 0 and stats.misses > 0 and stats.not_installed > 0, stats
    assert stats.direct_reads == stats.misses, "every miss was read by an attention before its fill"
    assert stats.bytes_moved == 2 * stats.misses * cache.geometry.slot_bytes


@pytest.mark.skipif("cpu" not in triton_devices(), reason="needs TRITON_INTERPRET=1")
def test_cached_attention_refuses_a_pool_that_does_not_hold_the_cache():
    from lockserve.offload.cached_attention import cached_sparse_decode

    pool, cache = make("triton", 3, 4, 3)
    slots, is_open, rows, lens = selection(3, cache.pool.shape[0], 0)
    src, q = torch.zeros(NUM_SLOTS, 2, PAGE, D), torch.zeros(BT, HQ, D)
    fill = torch.zeros(99, dtype=torch.int64)
    with pytest.raises(ValueError, match="cache's pool"):
        cached_sparse_decode(q, pool.clone(), cache, src, slots, is_open, rows, lens, fill)
    with pytest.raises(ValueError, match="is_open"):
        cached_sparse_decode(q, pool, cache, src, slots, is_open.int(), rows, lens, fill)
    with pytest.raises(ValueError, match="fill"):
        cached_sparse_decode(q, pool, cache, src, slots, is_open, rows, lens, fill[:3])
