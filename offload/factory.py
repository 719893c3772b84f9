"""`make_tier`: the one place that builds a PageSource of a given kind."""

from __future__ import annotations

import functools

import torch

from .arena import PageGeometry, resolve_device
from .cache import HotPageCache
from .gather import gather_pages
from .hbm import HbmTier
from .host import DEFAULT_SHM_DIR, HostArena, HostArenaSpec
from .source import OffloadedSource, PageSource, ResidentSource
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
    max_pages: int | None = None,
    nvme_dir: str | None = None,
    shm_dir: str = DEFAULT_SHM_DIR,
    gather_backend: str = "auto",
    cache_pool: torch.Tensor | None = None,
) -> PageSource:
    """Build the page source a GPU worker reads through.

    kind "hbm": an arena of num_slots pages in device memory (resident mode).
    kind "host": the host arena of num_slots pages: attached by `arena` (a spec from
        the node's PageStore) or, without one, created here and owned by the source.
    kind "host+nvme": a local PageStore (host arena of num_slots slots, max_pages
        logical pages, spill files in nvme_dir); engine ids go through `ensure_resident`.
    cache_pages: size of the device hot-page cache (required on cuda for the
        offloaded kinds); max_selected: most slots one resolve may ask for
        (default cache_pages). gather_backend: "auto", "triton" or "torch" (also the cache's
        backend). cache_pool: the cache's `[pool_rows(cache_pages, max_selected), 2, B, d]` device
        tensor (entries, then staging rows), when the caller places it (default: its own).
        Without a cache an offloaded source cannot `resolve`: its reader gathers pages itself.
    """
    if kind not in KINDS:
        raise ValueError(f"kind ({kind!r}) must be one of {KINDS}")
    device = resolve_device(device)
    if kind == "hbm":
        return ResidentSource(HbmTier(geometry, num_slots, device))
    store, owns = None, []
    if kind == "host+nvme":
        if nvme_dir is None:
            raise ValueError("kind 'host+nvme' needs nvme_dir")
        store = PageStore(geometry, num_slots, max_pages or num_slots, nvme_dir=nvme_dir, shm_dir=shm_dir)
        host, owns = store.arena, [store]
    elif arena is not None:
        host = HostArena.attach_spec(arena)
        owns = [host]
    else:
        host = HostArena.create(geometry, num_slots, shm_dir=shm_dir)
        owns = [host]
    if host.num_slots != num_slots or host.geometry != geometry:
        raise ValueError(
            f"arena has {host.num_slots} slots of {host.geometry}, expected {num_slots} of {geometry}"
        )
    if device.type == "cuda":
        host.register_cuda()
    cache = None
    if cache_pages is not None:
        gather = functools.partial(gather_pages, backend=gather_backend)
        cache = HotPageCache(geometry, cache_pages, num_slots, max_selected or cache_pages, device, gather,
                             pool=cache_pool, backend=gather_backend)
    return OffloadedSource(kind, host, cache, device, store=store, owns=owns)
