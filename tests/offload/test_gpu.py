"""The UVA path on a real GPU: a registered shared-memory arena read by the Triton kernel."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import HotPageCache
from lockserve.offload.factory import make_tier
from lockserve.offload.gather import gather_pages_triton
from lockserve.offload.host import DEFAULT_SHM_DIR, HostArena

from tests.offload.conftest import bits
from tests.offload.lru_model import LruModel, selections

pytestmark = pytest.mark.gpu
GEOMETRY = PageGeometry(16, 128, torch.bfloat16)


def random_pages(n: int, seed: int, geometry: PageGeometry = GEOMETRY) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *geometry.page_shape), generator=g).to(geometry.dtype)



@pytest.fixture
def arena(device):
    prefix = f"lockserve-test-{secrets.token_hex(4)}"
    a = HostArena.create(GEOMETRY, 4099, prefix=prefix)
    a.write(torch.arange(4099), random_pages(4099, 0))
    a.register_cuda()
    yield a
    a.close()
    assert not os.path.exists(os.path.join(DEFAULT_SHM_DIR, a.name))


@pytest.mark.parametrize("n", [1, 7, 97, 4099])
def test_uva_gather_equals_reference(arena, device, n):
    g = torch.Generator().manual_seed(n)
    src_idx = torch.randint(0, 4099, (n,), generator=g)
    src_idx[0] = 4098
    dst = torch.zeros((n + 3, *GEOMETRY.page_shape), dtype=GEOMETRY.dtype, device=device)
    dst_idx = torch.randperm(n + 3, generator=g)[:n]
    gather_pages_triton(arena.uva_pool(), src_idx.to(device), dst, dst_idx.to(device))
    torch.cuda.synchronize(device)
    assert torch.equal(bits(dst[dst_idx.to(device)].cpu()), bits(arena.pool[src_idx]))


def test_uva_write_back_into_the_arena(arena, device):
    pages = random_pages(33, 7).to(device)
    slots = torch.randperm(4099)[:33]
    gather_pages_triton(pages, torch.arange(33, device=device), arena.uva_pool(), slots.to(device))
    torch.cuda.synchronize(device)
    assert torch.equal(bits(arena.pool[slots]), bits(pages.cpu()))


def test_cache_on_the_gpu_matches_the_lru_model(arena, device):
    cache = HotPageCache(GEOMETRY, 40, 4099, 23, device)
    model, before = LruModel(40), cache.stats()
    for t, sel in enumerate(selections(4099, 60, 23, seed=4)):
        slots = torch.tensor(sel, device=device)
        idx = cache.lookup_and_fill(slots, arena.uva_pool())
        hits, misses = model.step(t, sel)
        after = cache.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == (hits, misses), f"step {t}"
        assert torch.equal(bits(cache.pool[idx].cpu()), bits(arena.pool[sel]))
        before = after


def test_lookup_and_fill_runs_in_a_cuda_graph(arena, device):
    """Capture fails on any host sync; replays must reproduce the LRU model step by step."""
    cache = HotPageCache(GEOMETRY, 40, 4099, 16, device)
    sels = [s + [s[0]] * (16 - len(s)) for s in selections(4099, 40, 16, seed=6)]  # fixed M = 16
    static = torch.tensor(sels[0], device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        cache.lookup_and_fill(static, arena.uva_pool())  # warm-up: compiles the kernel
    torch.cuda.current_stream(device).wait_stream(side)
    model = LruModel(40)
    model.step(-1, sels[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.lookup_and_fill(static, arena.uva_pool())
    before = cache.stats()
    for t, sel in enumerate(sels):
        static.copy_(torch.tensor(sel))
        graph.replay()
        after = cache.stats()
        assert (after.hits - before.hits, after.misses - before.misses) == model.step(t, sel), f"replay {t}"
        assert torch.equal(bits(cache.pool[out].cpu()), bits(arena.pool[sel]))
        before = after


def test_host_source_writes_back_asynchronously(device):
    geometry = PageGeometry(16, 64, torch.float16)
    source = make_tier("host", geometry, 300, device=device, cache_pages=16, max_selected=8)
    slots = torch.tensor([5, 299, 0, 17], device=device)
    pages = random_pages(4, 1, geometry).to(device)
    source.write_pages(slots, pages)
    pool, idx = source.resolve(slots[[1, 2, 2]])
    assert torch.equal(bits(pool[idx]), bits(pages[[1, 2, 2]]))
    source.write_pages(slots[[2]], random_pages(1, 2, geometry).to(device))  # rewrite a cached page
    pool, idx = source.resolve(slots)
    assert torch.equal(bits(pool[idx][2].cpu()), bits(random_pages(1, 2, geometry)[0]))
    source.synchronize()
    assert torch.equal(bits(source.arena.pool[slots.cpu()][[0, 1, 3]]), bits(pages[[0, 1, 3]].cpu()))
    s = source.stats()
    assert s.bytes_written == 5 * geometry.slot_bytes and s.hits + s.misses == 6
    source.close()


def test_bench_runs_small_on_the_gpu(tmp_path):
    from lockserve.offload import bench

    out = tmp_path / "gather.json"
    report = bench.main([
        "--out", str(out), "--pool-gib", "0.25", "--gather-pages", "7", "512", "--copy-mib", "64",
        "--steps", "32", "--streams", "8", "--pages-per-stream", "64", "--k", "8",
        "--cache-pages", "64", "128",
    ])  # fmt: skip
    assert out.exists() and "--out" in report["command"]
    assert all(r["bytes_correct"] for r in report["uva_gather"])
    gc = report["graph_capture"]
    assert gc["captured"] and gc["same_hits_misses_as_eager"] and gc["graph_bytes_correct"], gc
    assert report["profiler"].get("sync_like_calls") == [], report["profiler"]
