"""lockserve.offload: where KV pages live and how the selected ones reach the GPU.

A page is one (layer, KV head) page, K then V: `[2, B, d]`. Tiers hold pages in
slots (`hbm` device pool, `host` shared-memory arena, `nvme` page files); the
node's `PageStore` owns the host arena and spills cold pages to NVMe; a GPU
worker reads and writes pages through one `PageSource` (built by `make_tier`),
whose `resolve` returns the rows of its device pool that hold the selected
slots, misses gathered zero-copy from the host arena into the `HotPageCache`
by a Triton kernel.
"""

from .arena import ArenaFullError, PageGeometry, PageTier, SlotAllocator
from .cache import CacheStats, HotPageCache, pool_rows
from .factory import KINDS, make_tier
from .gather import HostPool, gather_pages, gather_pages_reference, gather_pages_triton
from .hbm import HbmTier
from .host import HostArena, HostArenaSpec, remove_stale_segments
from .manifest import ManifestError
from .nvme import NvmeTier, PageChecksumError, PageFileMissingError, PageNotStoredError
from .pool import PoolTier
from .source import HostSource, PageSource, ResidentSource
from .spilled import SpilledSource
from .stats import OffloadStats
from .store import PageStore, Residency

__all__ = [
    "KINDS",
    "ArenaFullError",
    "CacheStats",
    "HbmTier",
    "HostArena",
    "HostArenaSpec",
    "HostPool",
    "HostSource",
    "HotPageCache",
    "ManifestError",
    "NvmeTier",
    "OffloadStats",
    "PageChecksumError",
    "PageFileMissingError",
    "PageGeometry",
    "PageNotStoredError",
    "PageSource",
    "PageStore",
    "PageTier",
    "PoolTier",
    "ResidentSource",
    "Residency",
    "SlotAllocator",
    "SpilledSource",
    "gather_pages",
    "gather_pages_reference",
    "gather_pages_triton",
    "make_tier",
    "pool_rows",
    "remove_stale_segments",
]
