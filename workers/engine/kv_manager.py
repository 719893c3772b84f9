"""Where the engine's KV lives: page ids -> arena slots, open pages, summaries, per-step commit.

Layout (static, no per-head allocation). A page id `pid` names one logical page of one sequence
across all layers and KV heads; the arena slot of (layer l, pid, KV head h) is
`(l * max_pages + pid) * Hkv + h`. Summaries: one QuantSummaries table per layer with leading
dims [max_pages, Hkv], on the device, never offloaded.

Two pools per layer:
- the *write pool* receives every new token's K/V. On tier `hbm` it is the arena itself (the
  location of a page is its pid); on `host` tiers it is a device-resident tail buffer whose
  locations are handed out per step (an open page keeps its location until it fills).
- *settled pages* (full pages that left the write pool) are read through a `SettledPages`
  backend: identity on hbm, the hot-page cache (or a direct read) on host tiers.
A page that fills during a step is committed at the end of the step: written to the tier (host
tiers) and summarised (build + quantise on the device, batched over all pages filled).
Invariant: a page is in exactly one place the attention reads - the write pool while its
sequence has it open or it filled in the current step, the settled backend afterwards.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, fields

import torch
from lockserve.kernels import LocksConfig, QuantSummaries, build_summaries, quantize_summaries
from lockserve.offload.arena import PageGeometry
from lockserve.offload.factory import make_tier
from lockserve.offload.gather import gather_pages
from lockserve.offload.host import HostArenaSpec
from lockserve.offload.stats import OffloadStats

from .scheduler import Chunk
from .uploads import upload


@dataclass(frozen=True)
class KVLayout:
    """Shape of the engine's KV: model geometry, page size and the page-id capacity."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    max_pages: int

    @property
    def num_slots(self) -> int:
        return self.num_layers * self.max_pages * self.num_kv_heads

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.page_size, self.head_dim, self.dtype)

    @property
    def bytes_per_page_id(self) -> int:
        """Bytes of K+V of one page id (all layers and KV heads)."""
        return self.num_layers * self.num_kv_heads * self.geometry.slot_bytes


def page_slots(layer, rows_per_layer: int, locs: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Pool slots `(layer * rows_per_layer + loc) * Hkv + h`. locs: [...] -> [..., Hkv] int64.

    layer: an int or a tensor broadcasting against locs; heads: arange(Hkv) on locs' device.
    """
    return (layer * rows_per_layer + locs)[..., None] * heads.numel() + heads


class SummaryTable:
    """LOCKS summaries of every page id: one QuantSummaries per layer, leading dims [max_pages, Hkv]."""

    def __init__(self, layout: KVLayout, cfg: LocksConfig, device: torch.device):
        self.cfg, self.layout = cfg, layout
        zeros = torch.zeros(1, cfg.page_size, layout.head_dim)
        probe = quantize_summaries(build_summaries(zeros, cfg.rank), cfg)  # field shapes and dtypes
        lead = (layout.num_layers, layout.max_pages, layout.num_kv_heads)
        tensors = {
            f.name: torch.zeros((*lead, *getattr(probe, f.name).shape[1:]),
                                dtype=getattr(probe, f.name).dtype, device=device)
            for f in fields(probe) if isinstance(getattr(probe, f.name), torch.Tensor)
        }
        self.table = QuantSummaries(**tensors, basis_bits=cfg.basis_bits)
        # Views (no copies): table for layer l with leading dims [max_pages, Hkv].
        self.layers = [self.table.index(layer) for layer in range(layout.num_layers)]

    def store(self, pids: torch.Tensor, keys: torch.Tensor) -> None:
        """Summarise pages. pids: [M] int64 on the device; keys: [L, M, Hkv, B, d] post-RoPE."""
        q = quantize_summaries(build_summaries(keys, self.cfg.rank), self.cfg)
        for f in fields(q):
            value = getattr(q, f.name)
            if isinstance(value, torch.Tensor):
                getattr(self.table, f.name)[:, pids] = value


class SettledPages(abc.ABC):
    """Full pages in the tier, addressed by arena slot (see KVLayout). All slots: int64 on the device.

    resolve(slots [M]) -> (pool [S, 2, B, d], idx [M]): pool[idx[i]] holds slot i's page, for the
        selected pages of one decode layer (through the hot-page cache on host tiers).
    read(slots [n]) -> [n, 2, B, d] on the device: a bulk read that bypasses the cache (prefill).
    write(slots [n] distinct, pages [n, 2, B, d]): store pages that filled.
    release(slots [n]): the pages of a finished sequence; drop cached copies / tier storage.
    begin_direct_reads(): make earlier asynchronous writes visible to `read` (may sync the host).
    """

    source = None

    @abc.abstractmethod
    def resolve(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abc.abstractmethod
    def read(self, slots: torch.Tensor) -> torch.Tensor: ...

    def write(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        self.source.write_pages(slots, pages)

    def release(self, slots: torch.Tensor) -> None:
        self.source.invalidate(slots)

    def begin_direct_reads(self) -> None:
        self.source.synchronize()

    def stats(self) -> OffloadStats:
        return self.source.stats()

    def counters(self) -> dict[str, int]:
        """Tier-specific counters (e.g. NVMe spills); none by default."""
        return {}

    def close(self) -> None:
        self.source.close()


class ResidentPages(SettledPages):
    """Tier hbm: the arena is a device tensor; resolve is the identity."""

    def __init__(self, source):
        self.source = source
        self.pool = source.tier.pool  # [num_slots, 2, B, d]

    def resolve(self, slots):
        return self.source.resolve(slots)

    def read(self, slots):
        return self.pool.index_select(0, slots)


class HostPages(SettledPages):
    """Tier host: the arena in shared memory; decode reads go through the hot-page cache."""

    def __init__(self, source):
        self.source = source

    def resolve(self, slots):
        return self.source.resolve(slots)

    def read(self, slots):
        return read_host(self.source.arena, slots)


def read_host(arena, slots: torch.Tensor) -> torch.Tensor:
    """Pages `[n, 2, B, d]` of host-arena slots `[n]`, copied to slots' device (UVA gather on CUDA)."""
    if slots.device.type == "cpu":
        return arena.pool.index_select(0, slots)
    out = torch.empty((slots.numel(), *arena.geometry.page_shape), dtype=arena.geometry.dtype,
                      device=slots.device)
    dst = torch.arange(slots.numel(), dtype=torch.int64, device=slots.device)
    gather_pages(arena.uva_pool(), slots, out, dst)
    return out


class SpilledPages(SettledPages):
    """Tier host+nvme: a PageStore holds pages in host memory and spills cold ones to NVMe.

    The store hands out its own page ids, so a CPU table maps arena slot -> store id (-1 = none).
    NOTE: every resolve/read asks the store to promote spilled pages, which needs the slots on
    the host: one host synchronisation per decode layer on this tier (never on hbm/host).
    """

    def __init__(self, source, num_slots: int):
        self.source, self.store = source, source.store
        self._ids = torch.full((num_slots,), -1, dtype=torch.int64)

    def _host_slots(self, slots: torch.Tensor) -> torch.Tensor | None:
        self.source.synchronize()  # spills read host memory that async write-backs may still fill
        ids = self._ids[slots.cpu()]
        written = ids >= 0
        if not bool(written.any()):
            return None
        ids = torch.where(written, ids, ids[written][0])  # padding entries: any written page
        return self.source.ensure_resident(ids)

    def resolve(self, slots):
        host = self._host_slots(slots)
        if host is None:  # nothing written yet: every entry is padding
            pool = self.source.cache.pool if self.source.cache is not None else self.source.arena.pool
            return pool, torch.zeros_like(slots)
        return self.source.resolve(host)

    def read(self, slots):
        host = self._host_slots(slots)
        if host is None:
            return torch.zeros((slots.numel(), *self.source.geometry.page_shape),
                               dtype=self.source.geometry.dtype, device=slots.device)
        return read_host(self.source.arena, host)

    def write(self, slots, pages):
        self.source.synchronize()
        ids, host = self.store.allocate(slots.numel())  # may spill cold pages to NVMe
        self._ids[slots.cpu()] = ids
        self.source.write_pages(host.to(slots.device), pages)

    def counters(self) -> dict[str, int]:
        d = self.store.describe()
        return {"nvme_spilled_pages": d["spilled_pages"], "nvme_promoted_pages": d["promoted_pages"]}

    def release(self, slots):
        cpu_slots = slots.cpu()
        ids = self._ids[cpu_slots]
        ids = ids[ids >= 0]
        if ids.numel():
            host = self.store.host_slots_of(ids)
            self.store.free(ids)
            if bool((host >= 0).any()):
                self.source.invalidate(host[host >= 0])
        self._ids[cpu_slots] = -1


@dataclass(frozen=True)
class TierSpec:
    """How to build the settled-page backend. host_pages: host-arena slots of tier host+nvme;
    cache_pages: hot-page cache slots (None = no cache: CPU only); max_selected: most slots one
    decode layer resolves; direct_decode: decode reads bypass the cache (dense on host tiers);
    arena: tier host attaches this arena (made by the node's PageStore) instead of creating one."""

    kind: str
    cache_pages: int | None = None
    max_selected: int | None = None
    host_pages: int | None = None
    nvme_dir: str | None = None
    direct_decode: bool = False
    arena: HostArenaSpec | None = None


def make_settled(spec: TierSpec, layout: KVLayout, device: torch.device) -> SettledPages:
    geometry = layout.geometry
    if spec.kind == "hbm":
        return ResidentPages(make_tier("hbm", geometry, layout.num_slots, device=device))
    cache = None if spec.direct_decode else spec.cache_pages
    if spec.kind == "host":
        source = make_tier("host", geometry, layout.num_slots, device=device, cache_pages=cache,
                           max_selected=spec.max_selected, arena=spec.arena)
        return HostPages(source)
    source = make_tier("host+nvme", geometry, spec.host_pages, device=device, cache_pages=cache,
                       max_selected=spec.max_selected, max_pages=layout.num_slots, nvme_dir=spec.nvme_dir)
    return SpilledPages(source, layout.num_slots)


class KVManager:
    """The engine's KV: write pool, settled pages, summaries; plans and commits each step.

    num_tail_pages: write-pool pages per (layer, KV head) on host tiers; must cover the open
    pages of all running sequences plus every page one step can touch.
    """

    def __init__(self, layout: KVLayout, locks: LocksConfig, spec: TierSpec, device: torch.device,
                 num_tail_pages: int):
        self.layout, self.spec, self.device = layout, spec, device
        self.heads = torch.arange(layout.num_kv_heads, device=device)
        self.summaries = SummaryTable(layout, locks, device)
        self.settled = make_settled(spec, layout, device)
        self.resident = spec.kind == "hbm"
        if self.resident:
            self.write_pool, self.write_rows = self.settled.pool, layout.max_pages
            self._free_locs: list[int] = []
        else:
            shape = (layout.num_layers * num_tail_pages * layout.num_kv_heads, *layout.geometry.page_shape)
            self.write_pool = torch.zeros(shape, dtype=layout.dtype, device=device)
            self.write_rows = num_tail_pages
            self._free_locs = list(range(num_tail_pages - 1, -1, -1))
        self._open_loc: dict[str, int] = {}  # host tiers: write-pool location of a partial page

    def plan(self, chunk: Chunk) -> list[int]:
        """Write-pool locations of the pages the chunk touches, in page order."""
        b = self.layout.page_size
        first, last = chunk.start // b, (chunk.end - 1) // b
        if self.resident:
            return chunk.seq.pids[first : last + 1]
        locs = []
        for j in range(first, last + 1):
            reopen = j == first and chunk.start % b
            locs.append(self._open_loc.pop(chunk.seq.request_id) if reopen else self._free_locs.pop())
        return locs

    def commit(self, planned: list[tuple[Chunk, list[int]]]) -> None:
        """After the step's forward: settle and summarise every page that filled."""
        b = self.layout.page_size
        pids, locs = [], []
        for chunk, chunk_locs in planned:
            first = chunk.start // b
            for i, loc in enumerate(chunk_locs):
                if (first + i + 1) * b <= chunk.end:
                    pids.append(chunk.seq.pids[first + i])
                    locs.append(loc)
                elif not self.resident:
                    self._open_loc[chunk.seq.request_id] = loc
        if pids:
            self._settle(upload(pids, device=self.device), upload(locs, device=self.device))
        if not self.resident:
            self._free_locs.extend(locs)

    def _settle(self, pids: torch.Tensor, locs: torch.Tensor) -> None:
        # pids, locs: [M]; slots: [L, M, Hkv]
        lay = self.layout
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        tier = page_slots(layers, lay.max_pages, pids[None, :], self.heads)
        if self.resident:
            keys = self.write_pool[tier.flatten(), 0]  # [L*M*Hkv, B, d]
        else:
            pages = self.write_pool.index_select(0, page_slots(layers, self.write_rows, locs[None, :],
                                                               self.heads).flatten())
            self.settled.write(tier.flatten(), pages)
            keys = pages[:, 0]
        self.summaries.store(pids, keys.view(*tier.shape, lay.page_size, lay.head_dim))

    def release(self, request_id: str, pids: list[int], num_settled_pages: int) -> None:
        """A sequence ended: free its open write-pool page and drop its settled pages' tier state."""
        loc = self._open_loc.pop(request_id, None)
        if loc is not None:
            self._free_locs.append(loc)
        if num_settled_pages and pids:
            lay = self.layout
            layers = torch.arange(lay.num_layers, device=self.device)[:, None]
            settled = upload(pids[:num_settled_pages], device=self.device)
            self.settled.release(page_slots(layers, lay.max_pages, settled[None, :], self.heads).flatten())

    def gather_selected(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool and indices of selected settled pages for one decode layer. slots: [M] -> ([S,2,B,d], [M])."""
        if self.spec.direct_decode and not self.resident:
            return self.settled.read(slots), torch.arange(slots.numel(), device=slots.device)
        return self.settled.resolve(slots)

    @property
    def num_free_tail_pages(self) -> int:
        return len(self._free_locs)

    def stats(self) -> OffloadStats:
        return self.settled.stats()

    def close(self) -> None:
        self.settled.close()
