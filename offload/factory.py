"""`make_tier`: the one place that builds a PageSource of a given kind."""

from __future__ import annotations

import functools

import torch

from .arena import PageGeometry, resolve_device
from .cache import HotPageCache
from .gather import gather_pages
from .hbm import HbmTier
from .host import DEFAULT_SHM_DIR, HostArena, HostArenaSpec
from .source import HostSource, PageSource, ResidentSource
from .spilled import SpilledSource
from .store import PageStore

KINDS = ("hbm", "host", "host+nvme")


def make_tier(
    kind: str,
    geometry: PageGeometry,
    num_slots: int,
    *,
    device: torch.device | str = "cpu",
    cache_pages: int | None = None,
    max_selected: int | None = None,
    arena: HostArenaSpec | None = None,
    host_pages: int | None = None,
    nvme_pages: int | None = None,
    nvme_dir: str | None = None,
    shm_dir: str = DEFAULT_SHM_DIR,
    gather_backend: str = "auto",
    pool: torch.Tensor | None = None,
    lookahead: int = 0,
    io_threads: int = 4,
    cache_commit: str = "inline",
    verify_on_open: bool = True,
    spill_behind: bool = False,
) -> PageSource:
    """Build the page source a GPU worker reads through, for engine slots [0, num_slots).

    kind "hbm": an arena of num_slots pages in device memory (resident mode).
    kind "host": the host arena of num_slots pages: attached by `arena` (a spec from
        the node's PageStore) or, without one, created here and owned by the source.
    kind "host+nvme": a local PageStore with a host arena of host_pages slots (default
        num_slots) that spills cold pages to nvme_pages slots of files in nvme_dir (default: the
        slots the host arena lacks); a page is in one of the two, so they must add up to num_slots.
    cache_pages: size of the device hot-page cache (None or 0: none, every selected page is
        gathered every layer); max_selected: most slots one resolve may ask for (default
        cache_pages). gather_backend: "auto", "triton" or "torch" (also the cache's backend).
    pool: the device tensor resolve's rows index, when the caller places it (the engine puts it in
        front of its write pool): `[pool_rows(cache_pages, max_selected), 2, B, d]` with a cache
        (its entries, then staging rows), else `[>= max_selected, 2, B, d]`; default: its own.
    lookahead: host+nvme, promote ahead of need what each row would select at this multiple of its
        budget (0: off; see offload/spilled.py). io_threads: host+nvme, the NVMe tier's I/O threads.
    verify_on_open: host+nvme, read every page an earlier store left in nvme_dir to check its
        checksum as the store opens (False for an owner that frees them all unread).
    spill_behind: host+nvme, after each write start the spills the next write of its size would
        need, written behind (PageStore.spill_behind) instead of inline in that write.
    cache_commit: where the hot cache's commit runs (offload/cache.py COMMITS; "inline", the
        default: the source's before_forward advances the cache's step).
    """
    if kind not in KINDS:
        raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")
    device = resolve_device(device)
    if kind == "hbm":
        return ResidentSource(HbmTier(geometry, num_slots, device))
    cache_pages = cache_pages or None
    if kind == "host+nvme" and nvme_dir is None:
        raise ValueError("kind 'host+nvme' needs nvme_dir")
    if cache_pages is None and not max_selected and pool is None:
        raise ValueError(f"kind {kind!r} needs cache_pages or max_selected (the rows one resolve reads into)")
    if cache_pages is None and pool is not None:
        _check_pool(pool, geometry, device, max_selected or 0)
    store, host, owns = _host_arena(kind, geometry, num_slots, arena, host_pages, nvme_pages, nvme_dir,
                                    shm_dir, io_threads, verify_on_open)
    if device.type == "cuda":
        host.register_cuda()
    cache = None
    if cache_pages is not None:
        gather = functools.partial(gather_pages, backend=gather_backend)
        cache = HotPageCache(geometry, cache_pages, host.num_slots, max_selected or cache_pages, device,
                             gather, pool=pool, backend=gather_backend, commit=cache_commit)
        pool = cache.pool
    elif pool is None:
        pool = torch.zeros((max_selected, *geometry.page_shape), dtype=geometry.dtype, device=device)
    if store is not None:
        return SpilledSource(store, cache, pool, device, num_slots, owns=owns,
                             max_selected=max_selected or cache_pages or 0, lookahead=lookahead,
                             spill_behind=spill_behind)
    return HostSource(host, cache, pool, device, owns=owns)


def _check_pool(pool: torch.Tensor, geometry: PageGeometry, device: torch.device, rows: int) -> None:
    """A caller's read buffer: [>= rows, 2, B, d] of the pages' dtype on the source's device."""
    shape_ok = pool.dim() == 4 and pool.shape[0] >= rows and tuple(pool.shape[1:]) == geometry.page_shape
    if not shape_ok or pool.dtype != geometry.dtype or pool.device != device:
        page = ", ".join(map(str, geometry.page_shape))
        raise ValueError(f"pool: expected [>= {rows} rows, {page}] {geometry.dtype} on {device}, got "
                         f"{tuple(pool.shape)} {pool.dtype} on {pool.device}")


def _host_arena(kind, geometry, num_slots, arena, host_pages, nvme_pages, nvme_dir, shm_dir, io_threads,
                verify_on_open):
    """(store or None, the host arena, what the source owns) of an offloaded kind."""
    if kind == "host+nvme":
        store = PageStore(geometry, host_pages or num_slots, num_slots, nvme_dir=nvme_dir,
                          nvme_slots=nvme_pages, shm_dir=shm_dir, io_threads=io_threads,
                          verify_on_open=verify_on_open)
        return store, store.arena, [store]
    host = HostArena.attach_spec(arena) if arena is not None else HostArena.create(geometry, num_slots,
                                                                                   shm_dir=shm_dir)
    if host.num_slots != num_slots or host.geometry != geometry:
        host.close()
        raise ValueError(
            f"arena has {host.num_slots} slots of {host.geometry}, expected {num_slots} of {geometry}"
        )
    return None, host, [host]
