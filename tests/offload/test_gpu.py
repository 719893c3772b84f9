"""The UVA path on a real GPU: a registered shared-memory arena read by the Triton kernel."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import COMMITS, HotPageCache
from lockserve.offload.factory import make_tier
from lockserve.offload.gather import gather_pages_triton
from lockserve.offload.host import DEFAULT_SHM_DIR, HostArena

from tests.offload.conftest import bits
from tests.offload.lru_model import SetLruModel, check_step, random_outside, selections

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


@pytest.mark.parametrize("ways,num_sets,max_m", [(4, 7, 33), (3, 5, 20), (16, 256, 1024)])
def test_cache_on_the_gpu_matches_the_model(arena, device, ways, num_sets, max_m):
    """The Triton path reading the registered arena under UVA; the last shape is the H200
    measurement's (C = 4096, M = 1024)."""
    cache = HotPageCache(GEOMETRY, num_sets * ways, 4099, max_m, device, ways=ways)
    assert cache.backend == "triton"
    model = SetLruModel(num_sets, ways)
    for t, sel in enumerate(selections(4099, 40, max_m, seed=ways, pad_to=max_m)):
        check_step(cache, model, arena.uva_pool(), sel, t, pages=arena.pool)


@pytest.mark.parametrize("commit", COMMITS)
def test_triton_equals_the_torch_reference_on_the_gpu(arena, device, commit):
    """Every commit: by the lookup's last program (one launch), by a second launch on a side
    stream (joined when the tables are next used), on the same stream, and "inline" (every program
    stamps its own way while the others run: 90 requests on 8 sets, so the misses of a set race)."""
    src = arena.pool[:600].to(device)
    caches = [HotPageCache(GEOMETRY, 64, 600, 90, device, ways=8, backend=b) for b in ("triton", "torch")]
    for cache in caches:
        cache.commit = commit
    g = torch.Generator().manual_seed(3)
    for t, sel in enumerate(selections(600, 40, 90, seed=3, pad_to=90)):
        if t % 3 == 0:
            for cache in caches:
                cache.advance_step()  # a no-op but under "inline"
        slots = torch.tensor(sel, device=device)
        outside = random_outside(slots, g) if t % 2 else None  # the engine's open pages, folded in
        got, want = (c.lookup_and_fill(slots, src, outside) for c in caches)
        tri, ref = caches
        assert torch.equal(got, want), f"step {t}: idx"
        assert torch.equal(tri.tags, ref.tags) and torch.equal(tri.last_used, ref.last_used), f"step {t}"
        assert tri.stats() == ref.stats(), f"step {t}: counters"
        if commit != "inline":
            assert torch.equal(tri._counters, ref._counters), f"step {t}: counters"
        assert torch.equal(bits(tri.pool), bits(ref.pool)), f"step {t}: pool bytes"
        assert int(tri._done) == 0, f"step {t}: the ticket counter is back to 0"


@pytest.mark.parametrize("commit", COMMITS)
def test_lookup_and_fill_runs_in_a_cuda_graph(arena, device, commit):
    """Capture fails on any host sync or an unjoined side stream; replays must reproduce the
    model step by step (with the engine's open pages outside the cache, whose rows the lookup
    returns as given)."""
    m = 40
    cache = HotPageCache(GEOMETRY, 48, 4099, m, device, ways=4)
    cache.commit = commit
    sels = list(selections(4099, 40, m, seed=6, pad_to=m))  # fixed M, -1 padding
    static = torch.tensor(sels[0], device=device)
    g = torch.Generator().manual_seed(6)
    mask, rows = random_outside(static, g)  # static buffers too, refilled before every replay
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        cache.lookup_and_fill(static, arena.uva_pool(), (mask, rows))  # warm-up: compiles the kernels
        cache.join()  # as every forward ends (a branch commit left outside a capture cannot join it)
    torch.cuda.current_stream(device).wait_stream(side)
    model = SetLruModel(cache.num_sets, cache.ways)
    inline = commit == "inline"  # the step advances before each replay, outside the graph
    model.step(sels[0], advance=not inline)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cache.lookup_and_fill(static, arena.uva_pool(), (mask, rows))
        cache.join()
    before = cache.stats()
    for t, sel in enumerate(sels):
        static.copy_(torch.tensor(sel))
        new_mask, new_rows = random_outside(static, g)
        mask.copy_(new_mask), rows.copy_(new_rows)
        if inline:
            cache.advance_step()
            model.advance()
        graph.replay()
        want = model.step(sel, advance=not inline)
        after = cache.stats()
        expected = torch.where(new_mask.cpu(), new_rows.cpu(), torch.tensor(want.idx))
        assert out.tolist() == expected.tolist(), f"replay {t}: idx"
        assert (after.hits - before.hits, after.misses - before.misses) == (want.hits, want.misses), t
        assert cache.tags.tolist() == model.tags and cache.last_used.tolist() == model.last, t
        valid = [i for i, s in enumerate(sel) if s >= 0]
        pages = cache.pool[out[valid]].cpu()
        assert torch.equal(bits(pages), bits(arena.pool[[sel[i] for i in valid]])), f"replay {t}: bytes"
        before = after


def test_host_source_writes_back_asynchronously(device):
    geometry = PageGeometry(16, 64, torch.float16)
    source = make_tier("host", geometry, 300, device=device, cache_pages=16, max_selected=8)
    slots = torch.tensor([5, 299, 0, 17], device=device)
    pages = random_pages(4, 1, geometry).to(device)
    source.write(slots, pages)
    idx = source.resolve(slots[[1, 2]])
    assert torch.equal(bits(source.pool[idx]), bits(pages[[1, 2]]))
    source.write(slots[[2]], random_pages(1, 2, geometry).to(device))  # rewrite a cached page
    idx = source.resolve(slots)
    assert torch.equal(bits(source.pool[idx][2].cpu()), bits(random_pages(1, 2, geometry)[0]))
    source.synchronize()
    assert torch.equal(bits(source.arena.pool[slots.cpu()][[0, 1, 3]]), bits(pages[[0, 1, 3]].cpu()))
    assert torch.equal(bits(source.read(slots[[2]]).cpu()), bits(random_pages(1, 2, geometry)))
    open_rows = torch.tensor([-1, 7000, -1, -1], device=device)  # entry 1: a page outside the tier
    idx = source.resolve_or(torch.tensor([5, -1, 299, -1], device=device), open_rows >= 0, open_rows)
    assert idx[1] == 7000 and idx[3] == 0, "outside rows as given, padding some row"
    assert torch.equal(bits(source.pool[idx[[0, 2]]].cpu()), bits(pages[[0, 1]].cpu()))
    s = source.stats()
    assert s.bytes_written == 5 * geometry.slot_bytes and s.hits + s.misses == s.requests == 8
    source.close()


def test_host_source_without_a_cache_gathers_every_selected_page(device):
    geometry = PageGeometry(16, 64, torch.bfloat16)
    source = make_tier("host", geometry, 300, device=device, max_selected=4)
    slots = torch.tensor([5, 299, 0, 17], device=device)
    pages = random_pages(4, 3, geometry).to(device)
    source.write(slots, pages)  # the write-back runs on this stream: the gather below sees it
    idx = source.resolve(torch.tensor([17, -1, 299], device=device))
    assert torch.equal(bits(source.pool[idx[[0, 2]]].cpu()), bits(pages[[3, 1]].cpu()))
    assert source.stats().bytes_moved == 2 * geometry.slot_bytes
    source.close()


def test_host_nvme_prefill_only_forward_and_write_leave_the_device_running(device, tmp_path):
    """After a forward without decode rows, take_misses and a write given its slots on the host
    (what the engine's commit does) return while the forward still runs: no host wait for it.
    A ~0.2 s device sleep stands for the forward; the stream must still be busy after both calls,
    and the pages must then read back (the write spilled the older ones to NVMe)."""
    geometry = PageGeometry(16, 64, torch.bfloat16)
    source = make_tier("host+nvme", geometry, 64, device=device, host_pages=8, nvme_dir=str(tmp_path),
                       cache_pages=8, max_selected=4)
    first = torch.arange(8)
    source.write(first.to(device), random_pages(8, 4, geometry).to(device), host_slots=first)
    # The write's inputs reach the device before the forward: a pageable copy queued behind it
    # would itself wait for it (the engine's pages are the forward's own output).
    new = torch.arange(8, 12)
    new_slots, new_pages = new.to(device), random_pages(4, 5, geometry).to(device)
    source.synchronize()
    source.before_forward(reads=False)
    source.begin_forward()
    torch.cuda._sleep(400_000_000)  # cycles: about 0.2 s at the H100's and H200's clocks
    assert not source.take_misses()
    source.write(new_slots, new_pages, host_slots=new)
    busy = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize(device)
    assert busy, "take_misses or write waited for the forward"
    want = torch.cat([random_pages(8, 4, geometry), random_pages(4, 5, geometry)])
    assert torch.equal(bits(source.read(torch.arange(12, device=device)).cpu()), bits(want))
    assert source.counters()["nvme_spilled_pages"] >= 4
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
