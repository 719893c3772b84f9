"""Where the engine's KV lives: page ids -> arena slots, open pages, summaries, per-step commit.

Layout (static, no per-head allocation). A page id `pid` names one logical page of one sequence
across all layers and KV heads; the arena slot of (layer l, pid, KV head h) is
`(l * max_pages + pid) * Hkv + h`. Summaries: one QuantSummaries table per layer with leading
dims [max_pages, Hkv], on the device, never offloaded.

Pools:
- the *write pool* receives every new token's K/V. On tier `hbm` it is the arena itself (the
  location of a page is its pid); on `host` tiers it is a device-resident tail buffer whose
  locations are handed out per step (an open page keeps its location until it fills).
- *settled pages* (full pages that left the write pool) are read through a `SettledPages`
  backend: the arena itself on hbm; on host tiers the hot-page cache, or without one a direct
  gather of the selected pages.
- the *attention pool* is the one tensor the decode attention reads: on hbm the arena; on host
  tiers `[front | write pool]`, the front being the hot-page cache's pool (or the direct-read
  buffer), so that full pages and open pages are attended in one kernel.
A page that fills during a step is committed at the end of the step: written to the tier (host
tiers) and summarised (build + quantise on the device, batched over all pages filled).
Invariant: a page is in exactly one place the attention reads - the write pool while its
sequence has it open or it filled in the current step, the settled backend afterwards.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import torch
from lockserve.kernels import LocksConfig, QuantSummaries, build_summaries, quantize_summaries
from lockserve.kernels.select import DecodeSelection
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import pool_rows
from lockserve.offload.factory import make_tier
from lockserve.offload.gather import gather_pages
from lockserve.offload.host import HostArenaSpec
from lockserve.offload.stats import OffloadStats

from .scheduler import Chunk
from .uploads import to_device, upload

T = TypeVar("T")
MAX_RERUNS = 2  # host+nvme: reruns of a forward that read past pages on NVMe, before the host path


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
    """LOCKS summaries of every page id: one QuantSummaries per layer, leading dims [rows, Hkv],
    rows = max_pages rounded up to a multiple of 16.

    NOTE: the rounding keeps every layer's tables 16-byte aligned (the CUDA score kernel's vector
    loads need it; with 3 KV heads and an odd max_pages most layers fell back to the Triton
    kernel, 10x slower). Rows past max_pages are never referenced."""

    def __init__(self, layout: KVLayout, cfg: LocksConfig, device: torch.device):
        self.cfg, self.layout = cfg, layout
        zeros = torch.zeros(1, cfg.page_size, layout.head_dim)
        probe = quantize_summaries(build_summaries(zeros, cfg.rank), cfg)  # field shapes and dtypes
        self.rows = -(-layout.max_pages // 16) * 16
        lead = (layout.num_layers, self.rows, layout.num_kv_heads)
        tensors = {
            f.name: torch.zeros((*lead, *getattr(probe, f.name).shape[1:]),
                                dtype=getattr(probe, f.name).dtype, device=device)
            for f in fields(probe) if isinstance(getattr(probe, f.name), torch.Tensor)
        }
        self.table = QuantSummaries(**tensors, basis_bits=cfg.basis_bits)
        # Views (no copies): table for layer l with leading dims [max_pages, Hkv].
        self.layers = [self.table.index(layer) for layer in range(layout.num_layers)]
        self.bytes_per_page = sum(t.numel() * t.element_size() for t in tensors.values()) // (
            layout.num_layers * self.rows * layout.num_kv_heads)

    def store(self, pids: torch.Tensor, keys: torch.Tensor, owners: torch.Tensor | None = None) -> None:
        """Summarise pages. pids: [M] int64 on the device; keys: [L, M, Hkv, B, d] post-RoPE;
        owners: each page's sequence (unused: a LOCKS summary is the page's own)."""
        q = quantize_summaries(build_summaries(keys, self.cfg.rank), self.cfg)
        for f in fields(q):
            value = getattr(q, f.name)
            if isinstance(value, torch.Tensor):
                getattr(self.table, f.name)[:, pids] = value


class SettledPages(abc.ABC):
    """Full pages in the tier, addressed by arena slot (see KVLayout). All slots: int64 on the device.

    resolve(slots [M]) -> idx [M]: the pages of the slots are at these rows of the attention
        pool's front (one decode layer's selection, distinct slots and -1 = nothing to read (any
        row comes back); through the hot-page cache on host tiers).
    read(slots [n]) -> [n, 2, B, d] on the device: a bulk read that bypasses the cache (prefill).
    write(slots [n] distinct, pages [n, 2, B, d]): store pages that filled.
    release(slots [n]): the pages of a finished sequence; drop cached copies / tier storage.
    begin_direct_reads(): make earlier asynchronous writes visible to `read` (may sync the host).
    """

    source = None

    @abc.abstractmethod
    def resolve(self, slots: torch.Tensor) -> torch.Tensor: ...

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
    """Tier hbm: the arena is a device tensor (the attention pool); resolve is the identity."""

    def __init__(self, source):
        self.source = source
        self.pool = source.tier.pool  # [num_slots, 2, B, d]

    def resolve(self, slots):
        return slots

    def read(self, slots):
        return self.pool.index_select(0, slots)


class HostPages(SettledPages):
    """Tier host: the arena in shared memory; decode reads go through the hot-page cache, whose pool
    is `front`, or without one are gathered into `front` (every selected page, every layer)."""

    def __init__(self, source, front: torch.Tensor):
        self.source, self.front = source, front  # front: [F, 2, B, d]
        # Pages gathered without a cache, counted on the device (a replayed graph adds to it too).
        self._direct = torch.zeros((), dtype=torch.int64, device=front.device)

    def resolve(self, slots):
        return self._lookup(slots)

    def _lookup(self, host_slots: torch.Tensor) -> torch.Tensor:
        # host_slots: [M] distinct, -1 = nothing to read -> rows of front [M]
        if self.source.cache is not None:
            return self.source.resolve(host_slots)[1]
        rows = torch.arange(host_slots.numel(), device=host_slots.device)
        wanted = host_slots >= 0
        if host_slots.is_cuda:
            gather_pages(self.source.arena.uva_pool(), host_slots, self.front, torch.where(wanted, rows, -1))
        else:  # padding rows copy page 0: never read (length 0)
            self.front[: rows.numel()] = self.source.arena.pool.index_select(0, host_slots.clamp_min(0))
        self._direct.add_(wanted.sum())
        return rows

    def stats(self) -> OffloadStats:
        """The source's counters, plus the pages gathered without a cache in bytes_moved."""
        stats = self.source.stats()
        direct = int(self._direct) * self.source.geometry.slot_bytes
        return dataclasses.replace(stats, bytes_moved=stats.bytes_moved + direct)

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


class SpilledPages(HostPages):
    """Tier host+nvme: a PageStore holds pages in host memory and spills cold ones to NVMe.

    The store hands out its own page ids. Decode reads resolve on the device, with no host wait
    (graph capturable): arena slot -> store id -> host slot through two device tables, mirrored
    from the store's moves before every forward (`sync_tables`). A selected page found on NVMe is
    not read: it is recorded as missed, and the runner promotes the missed pages (one synchronous
    NVMe read) and runs the step again (`take_misses`) before anything samples from it; its K/V
    writes are idempotent. Pages the decode selects are touched in the store's LRU (`touch_selected`,
    before any spill), so spills pick pages no recent step selected.
    """

    def __init__(self, source, front: torch.Tensor, num_slots: int):
        super().__init__(source, front)
        self.store = source.store
        self.store.journal_moves = True
        dev = front.device
        self._ids = torch.full((num_slots,), -1, dtype=torch.int64)  # CPU mirror: arena slot -> id
        self._dev_ids = torch.full((num_slots,), -1, dtype=torch.int64, device=dev)
        self._dev_host = torch.full((self.store.max_pages,), -1, dtype=torch.int64, device=dev)
        self._missed = torch.zeros(num_slots + 1, dtype=torch.int8, device=dev)  # + a trash entry
        self._miss_count = torch.zeros((), dtype=torch.int64, device=dev)
        self._touched = torch.zeros(self.store.max_pages + 1, dtype=torch.int64, device=dev)
        self._clock = torch.zeros((), dtype=torch.int64, device=dev)  # forwards run, on the device
        self._forwards = 0  # the same count on the host
        self._touch_synced = 0
        self.sync_reads = False  # resolve promotes on the host, layer by layer (never misses)
        # missed pages, reruns, steps that reran at least once, steps that fell back to host reads
        self.counters_ = {"nvme_missed_pages": 0, "nvme_step_reruns": 0, "nvme_steps_missed": 0,
                          "nvme_sync_steps": 0}

    # ---- decode reads (device) ------------------------------------------------------------------

    def resolve(self, slots):
        # slots: [M] distinct arena slots, -1 = nothing to read -> rows of front [M]
        if self.sync_reads:
            host = self._host_slots(slots)
            return torch.zeros_like(slots) if host is None else self._lookup(host)
        valid = slots >= 0
        ids = torch.where(valid, self._dev_ids[slots.clamp_min(0)], -1)
        host = torch.where(ids >= 0, self._dev_host[ids.clamp_min(0)], -1)
        missing = (ids >= 0) & (host < 0)
        num_slots = self._missed.numel() - 1
        self._missed.index_fill_(0, torch.where(missing, slots, num_slots), 1)
        self._miss_count.add_(missing.sum())
        self._touched.index_put_((torch.where(ids >= 0, ids, self.store.max_pages),), self._clock)
        return self._lookup(torch.where(missing, -1, host))

    def sync_tables(self) -> None:
        """Before a forward: mirror the store's moves on the device and advance the step clock."""
        self._apply_moves()
        self._clock.add_(1)
        self._forwards += 1

    def _apply_moves(self) -> None:
        """The store's moves since the last call into the device table, in order (a small upload).
        Called after every host-side store call that may move pages, so that a decode read in the
        same forward never sees a slot the store has given to another page."""
        ids, slots = self.store.drain_moves()
        if ids.numel():
            dev = self._dev_host.device
            self._dev_host.index_copy_(0, to_device(ids, dev), to_device(slots, dev))

    def take_misses(self) -> bool:
        """After a forward: promote the pages it found on NVMe; True if it must run again. One host
        wait (the miss count) per forward on this tier; the promotion reads NVMe synchronously."""
        if int(self._miss_count) == 0:
            return False
        slots = torch.nonzero(self._missed[:-1]).flatten().cpu()
        self._missed.zero_()
        self._miss_count.zero_()
        res = self.store.ensure_resident(self._ids[slots])
        self._apply_moves()
        if res.rewritten.numel():
            self.source.invalidate(res.rewritten.to(self.front.device))
        self.counters_["nvme_missed_pages"] += slots.numel()
        self.counters_["nvme_step_reruns"] += 1
        return True

    def touch_selected(self) -> None:
        """Tell the store's LRU which pages decode steps selected since the last call."""
        if self._forwards == self._touch_synced:
            return
        recent = torch.nonzero(self._touched[:-1] > self._touch_synced).flatten().cpu()
        if recent.numel():
            self.store.touch(recent)
        self._touch_synced = self._forwards

    # ---- bulk reads and writes (host) -----------------------------------------------------------

    def _host_slots(self, slots: torch.Tensor) -> torch.Tensor | None:
        """Host slots [n] of arena slots [n] (-1 stays -1), spilled pages promoted; None when no
        entry names a written page."""
        self.source.synchronize()  # spills read host memory that async write-backs may still fill
        cpu = slots.cpu()
        ids = torch.where(cpu >= 0, self._ids[cpu.clamp_min(0)], -1)
        written = ids >= 0
        if not bool(written.any()):
            return None
        res = self.store.ensure_resident(ids[written])
        self._apply_moves()
        if res.rewritten.numel():
            self.source.invalidate(res.rewritten.to(slots.device))
        out = torch.full_like(slots, -1)
        out[written.to(slots.device)] = res.slots.to(slots.device)
        return out

    def read(self, slots):
        host = self._host_slots(slots)
        if host is None:
            return torch.zeros((slots.numel(), *self.source.geometry.page_shape),
                               dtype=self.source.geometry.dtype, device=slots.device)
        return read_host(self.source.arena, host.clamp_min(0))  # prefill reads only written pages

    def write(self, slots, pages):
        self.source.synchronize()
        self.touch_selected()  # the spills this allocation may cause must spare recently selected pages
        ids, host = self.store.allocate(slots.numel())  # may spill cold pages to NVMe
        self._apply_moves()
        self._ids[slots.cpu()] = ids
        self._dev_ids.index_copy_(0, slots, to_device(ids, slots.device))
        self.source.write_pages(host.to(slots.device), pages)

    def counters(self) -> dict[str, int]:
        d = self.store.describe()
        return {"nvme_spilled_pages": d["spilled_pages"], "nvme_promoted_pages": d["promoted_pages"],
                **self.counters_}

    def release(self, slots):
        cpu_slots = slots.cpu()
        ids = self._ids[cpu_slots]
        ids = ids[ids >= 0]
        if ids.numel():
            host = self.store.host_slots_of(ids)
            self.store.free(ids)
            self._apply_moves()
            if bool((host >= 0).any()):
                self.source.invalidate(host[host >= 0])
        self._ids[cpu_slots] = -1
        self._dev_ids.index_fill_(0, slots, -1)


@dataclass(frozen=True)
class TierSpec:
    """How to build the settled-page backend. host_pages: host-arena slots of tier host+nvme;
    cache_pages: hot-page cache slots (None or 0 = no cache: decode gathers the selected pages from
    host memory every layer); max_selected: most slots one decode layer resolves; arena: tier host
    attaches this arena (made by the node's PageStore) instead of creating one."""

    kind: str
    cache_pages: int | None = None
    max_selected: int | None = None
    host_pages: int | None = None
    nvme_dir: str | None = None
    arena: HostArenaSpec | None = None

    @property
    def front_pages(self) -> int:
        """Rows of the attention pool in front of the write pool (host tiers): the cache's pool
        (its entries, then a staging row per request for the misses) or the direct-read buffer."""
        if self.cache_pages:
            return pool_rows(self.cache_pages, self.max_selected)
        return self.max_selected


def make_settled(spec: TierSpec, layout: KVLayout, device: torch.device, front: torch.Tensor | None):
    geometry = layout.geometry
    if spec.kind == "hbm":
        return ResidentPages(make_tier("hbm", geometry, layout.num_slots, device=device))
    cache = spec.cache_pages or None
    pool = front if cache else None
    if spec.kind == "host":
        source = make_tier("host", geometry, layout.num_slots, device=device, cache_pages=cache,
                           max_selected=spec.max_selected, arena=spec.arena, cache_pool=pool)
        return HostPages(source, front)
    source = make_tier("host+nvme", geometry, spec.host_pages, device=device, cache_pages=cache,
                       max_selected=spec.max_selected, max_pages=layout.num_slots, nvme_dir=spec.nvme_dir,
                       cache_pool=pool)
    return SpilledPages(source, front, layout.num_slots)


class KVManager:
    """The engine's KV: write pool, settled pages, summaries; plans and commits each step.

    num_tail_pages: write-pool pages per (layer, KV head) on host tiers; must cover the open
    pages of all running sequences plus every page one step can touch.
    """

    def __init__(self, layout: KVLayout, locks: LocksConfig, spec: TierSpec, device: torch.device,
                 num_tail_pages: int, summaries=None):
        self.layout, self.spec, self.device = layout, spec, device
        self.heads = torch.arange(layout.num_kv_heads, device=device)
        # summaries: the page selector's table (engine/selectors.py), given pages as they fill;
        # by default LOCKS's own.
        self.summaries = summaries if summaries is not None else SummaryTable(layout, locks, device)
        self.resident = spec.kind == "hbm"
        if self.resident:
            self.settled = make_settled(spec, layout, device, None)
            self.attn_pool = self.write_pool = self.settled.pool
            self.write_front, self.write_rows = 0, layout.max_pages
            self._free_locs: list[int] = []
        else:
            if not spec.front_pages:
                raise ValueError("a host tier needs cache_pages or max_selected (the decode read buffer)")
            tail = layout.num_layers * num_tail_pages * layout.num_kv_heads
            shape = (spec.front_pages + tail, *layout.geometry.page_shape)
            self.attn_pool = torch.zeros(shape, dtype=layout.dtype, device=device)
            self.write_front, self.write_rows = spec.front_pages, num_tail_pages
            self.write_pool = self.attn_pool[spec.front_pages :]
            self.settled = make_settled(spec, layout, device, self.attn_pool[: spec.front_pages])
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
        pids, locs, owners = [], [], []
        for chunk, chunk_locs in planned:
            first = chunk.start // b
            for i, loc in enumerate(chunk_locs):
                if (first + i + 1) * b <= chunk.end:
                    pids.append(chunk.seq.pids[first + i])
                    locs.append(loc)
                    owners.append(chunk.seq.pids[0])
                elif not self.resident:
                    self._open_loc[chunk.seq.request_id] = loc
        if pids:
            self._settle(upload(pids, device=self.device), upload(locs, device=self.device),
                         upload(owners, device=self.device))
        if not self.resident:
            self._free_locs.extend(locs)

    def _settle(self, pids: torch.Tensor, locs: torch.Tensor, owners: torch.Tensor | None = None) -> None:
        # pids, locs, owners (each page's sequence's first page id): [M]; slots: [L, M, Hkv]
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
        self.summaries.store(pids, keys.view(*tier.shape, lay.page_size, lay.head_dim), owners)

    def fill_random(self, request_id: str, pids: list[int], num_tokens: int, seed: int,
                    chunk_pages: int = 256, first_page: int = 0) -> None:
        """Random K/V for a sequence's first num_tokens tokens (benchmarks: a stand-in for prefill).
        Full pages go to the tier and are summarised by the real code; a partial last page is left
        open in the write pool, as prefill would leave it. The bytes depend on seed and page index
        only (not on the tier or the chunking), so every tier holds the same cache. first_page: the
        sequence's page index of pids[0] (a context-parallel shard holds the pages one engine would)."""
        lay, b = self.layout, self.layout.page_size
        full, rest = divmod(num_tokens, b)
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        if isinstance(self.settled, SpilledPages):  # one write must fit the host arena
            per_id = lay.num_layers * lay.num_kv_heads
            chunk_pages = max(1, min(chunk_pages, self.settled.store.host_slots // per_id // 2))
        for start in range(0, full, chunk_pages):
            m = min(full, start + chunk_pages) - start
            ids = upload(pids[start : start + m], device=self.device)
            slots = page_slots(layers, lay.max_pages, ids[None, :], self.heads)  # [L, m, Hkv]
            pages = self._random_pages(first_page + start, m, seed).reshape(-1, *lay.geometry.page_shape)
            if self.resident:
                self.write_pool[slots.flatten()] = pages
            else:
                self.settled.write(slots.flatten(), pages)
            self.summaries.store(ids, pages[:, 0].view(*slots.shape, b, lay.head_dim),
                                 owners=torch.full_like(ids, pids[0]))
        if rest:
            loc = pids[full] if self.resident else self._free_locs.pop()
            if not self.resident:
                self._open_loc[request_id] = loc
            slots = page_slots(layers, self.write_rows, torch.tensor([loc], device=self.device), self.heads)
            page = self._random_pages(first_page + full, 1, seed).reshape(-1, *lay.geometry.page_shape)
            self.write_pool[slots.flatten(), :, :rest] = page[:, :, :rest]

    def _random_pages(self, first: int, m: int, seed: int, block: int = 16) -> torch.Tensor:
        """[L, m, Hkv, 2, B, d] standard normal K/V of a sequence's pages first..first+m-1, drawn per
        block of 16 pages from a generator seeded by (seed, block)."""
        lay = self.layout
        parts = []
        for blk in range(first // block, (first + m - 1) // block + 1):
            gen = torch.Generator(device=self.device).manual_seed(seed * 1_000_003 + blk)
            shape = (lay.num_layers, block, lay.num_kv_heads, *lay.geometry.page_shape)
            parts.append(torch.randn(shape, generator=gen, device=self.device).to(lay.dtype))
        offset = first - (first // block) * block
        return torch.cat(parts, dim=1)[:, offset : offset + m]

    def read_tokens(self, request_id: str, pids: list[int], num_tokens: int) -> torch.Tensor:
        """K/V of a sequence's first num_tokens tokens as pages [L, P, Hkv, 2, B, d], P =
        ceil(num_tokens / B): full pages from the tier (bypassing the cache), the open page from
        the write pool (its slots past num_tokens hold whatever is there). A copy; for
        `fill_pages` (an evaluation prefills a prompt once and decodes it in many engines)."""
        lay, b = self.layout, self.layout.page_size
        full, rest = divmod(num_tokens, b)
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        shape = (lay.num_layers, -1, lay.num_kv_heads, *lay.geometry.page_shape)
        parts = []
        if full:
            self.settled.begin_direct_reads()
            ids = upload(pids[:full], device=self.device)
            slots = page_slots(layers, lay.max_pages, ids[None, :], self.heads)  # [L, full, Hkv]
            parts.append(self.settled.read(slots.flatten()))
        if rest:
            loc = pids[full] if self.resident else self._open_loc[request_id]
            slots = page_slots(layers, self.write_rows, torch.tensor([loc], device=self.device), self.heads)
            parts.append(self.write_pool.index_select(0, slots.flatten()))
        return torch.cat([part.view(shape) for part in parts], dim=1)

    def fill_pages(self, request_id: str, pids: list[int], num_tokens: int, pages: torch.Tensor) -> None:
        """Write a sequence's first num_tokens tokens from pages [L, P, Hkv, 2, B, d] (`read_tokens`
        of another engine of the same layout): a stand-in for its prefill. Full pages go to the tier
        and to the summaries (one `store` of all of them, owned by pids[0]); a partial last page is
        left open in the write pool, as prefill would leave it."""
        lay, b = self.layout, self.layout.page_size
        full, rest = divmod(num_tokens, b)
        want = (lay.num_layers, -(-num_tokens // b), lay.num_kv_heads, *lay.geometry.page_shape)
        if tuple(pages.shape) != want or pages.dtype != lay.dtype:
            raise ValueError(f"pages: expected shape {want} and dtype {lay.dtype}, got {tuple(pages.shape)} "
                             f"{pages.dtype}")
        pages = pages.to(self.device)
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        if full:
            ids = upload(pids[:full], device=self.device)
            slots = page_slots(layers, lay.max_pages, ids[None, :], self.heads)  # [L, full, Hkv]
            step = full
            if isinstance(self.settled, SpilledPages):  # one write must fit the host arena
                step = max(1, self.settled.store.host_slots // (lay.num_layers * lay.num_kv_heads) // 2)
            for start in range(0, full, step):
                part = slots[:, start : start + step].flatten()
                rows = pages[:, start : start + step].reshape(-1, *lay.geometry.page_shape)
                if self.resident:
                    self.write_pool[part] = rows
                else:
                    self.settled.write(part, rows)
            self.summaries.store(ids, pages[:, :full, :, 0], owners=torch.full_like(ids, pids[0]))
        if rest:
            loc = pids[full] if self.resident else self._free_locs.pop()
            if not self.resident:
                self._open_loc[request_id] = loc
            slots = page_slots(layers, self.write_rows, torch.tensor([loc], device=self.device), self.heads)
            self.write_pool[slots.flatten(), :, :rest] = pages[:, full].reshape(-1, *lay.geometry.page_shape)[
                :, :, :rest]

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

    def before_forward(self) -> None:
        """Order this step's reads of the tier after earlier write-backs (on the device; no host
        wait), and on host+nvme mirror the store's moves. Called before every forward (a CUDA-graph
        replay must not wait on events itself)."""
        if not self.resident:
            self.settled.source.order_after_writes()
        if isinstance(self.settled, SpilledPages):
            self.settled.sync_tables()

    def take_misses(self) -> bool:
        """After a forward: True if it read past pages still on NVMe (host+nvme); they are promoted
        now and the forward must run again."""
        return isinstance(self.settled, SpilledPages) and self.settled.take_misses()

    def run_forward(self, forward: Callable[[], T], eager: Callable[[], T] | None = None) -> T:
        """One forward over this KV: `forward()` after before_forward; on host+nvme, again after
        promoting the pages it found still on NVMe (its K/V writes are idempotent and nothing has
        sampled from it), at most MAX_RERUNS times; then, if one step's selections keep missing
        (they do not fit host memory at once), once more with reads promoted layer by layer on the
        host (`eager`, default `forward`: a pass that cannot miss)."""
        for attempt in range(MAX_RERUNS + 1):
            self.before_forward()
            out = forward()
            if not self.take_misses():
                return out
            if attempt == 0:
                self.settled.counters_["nvme_steps_missed"] += 1
        self.before_forward()
        with self.synchronous_reads():
            return (eager or forward)()

    @contextlib.contextmanager
    def synchronous_reads(self):
        """host+nvme: decode reads promote on the host, layer by layer, inside this block (a step
        that cannot miss; for a step whose selections do not fit host memory at once)."""
        spilled = self.settled if isinstance(self.settled, SpilledPages) else None
        if spilled is not None:
            spilled.sync_reads = True
            spilled.counters_["nvme_sync_steps"] += 1
        try:
            yield
        finally:
            if spilled is not None:
                spilled.sync_reads = False

    def resolve(self, sel: DecodeSelection) -> torch.Tensor:
        """Attention-pool indices [Bt, Hkv, K] of one decode layer's selection: full pages through
        the settled backend, the open page in the write pool (sel.idx)."""
        if self.resident:
            return sel.idx
        found = self.settled.resolve(sel.slots.flatten()).view_as(sel.idx)
        return torch.where(sel.is_open, sel.idx, found)

    @property
    def num_free_tail_pages(self) -> int:
        return len(self._free_locs)

    def stats(self) -> OffloadStats:
        return self.settled.stats()

    def close(self) -> None:
        self.settled.close()
