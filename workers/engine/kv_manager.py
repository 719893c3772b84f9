"""Where the engine's KV lives: page ids -> arena slots, open pages, summaries, per-step commit.

Layout (static, no per-head allocation). A page id `pid` names one logical page of one sequence
across all layers and KV heads; the arena slot of (layer l, pid, KV head h) is
`(l * max_pages + pid) * Hkv + h`. Summaries: one QuantSummaries table per layer with leading
dims [max_pages, Hkv], on the device, never offloaded.

Pools:
- the *write pool* receives every new token's K/V. On tier `hbm` it is the arena itself (the
  location of a page is its pid); on `host` tiers it is a device-resident tail buffer whose
  locations are handed out per step (an open page keeps its location until it fills).
- *settled pages* (full pages that left the write pool) are read and written through the tier's
  `PageSource` (offload/source.py): the arena itself on hbm; on host tiers the hot-page cache, or
  without one a direct gather of the selected pages.
- the *attention pool* is the one tensor the decode attention reads: on hbm the arena; on host
  tiers `[front | write pool]`, the front being the hot-page cache's pool (or the direct-read
  buffer), so that full pages and open pages are attended in one kernel.
A page that fills during a step is committed at the end of the step: written to the tier (host
tiers) and summarised (build + quantise on the device, batched over all pages filled).
Invariant: a page is in exactly one place the decode attention reads - the write pool while its
sequence has it open or it filled in the current step, the tier (`settled`) afterwards.

Prefill window (host tiers): while a sequence prefills, the write-pool copies of its pages are
kept after they settle (`PrefillWindow`), up to `window_pages` settled pages over all prefilling
sequences (the oldest leave first), so a chunk's attention reads its prefix in HBM instead of
back over PCIe. On hbm the arena is the window.

Kept copies (host tiers): when a prefill ends, its window's settled copies stay in the write pool
(`_kept`: page id -> location, least recently used first) until a location is needed; a later
prefill whose prompt reuses those cached pages starts its window with them (lent, read-only), so a
second request over a cached document reads its prefix in HBM, not over PCIe. They cost no memory
that the window does not reserve already: a kept location is handed out like a free one.
Invariant: a kept location holds the bytes of its page id's tier copy (settled pages never change);
it is dropped when its page id is freed (`release_pages`), never while a window has it lent.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TypeVar

import torch
from lockserve.kernels import LocksConfig, QuantSummaries, build_summaries, quantize_summaries
from lockserve.kernels.select import DecodeSelection
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import pool_rows
from lockserve.offload.factory import make_tier
from lockserve.offload.host import HostArenaSpec
from lockserve.offload.source import PageSource
from lockserve.offload.stats import OffloadStats

from .scheduler import Chunk
from .settle import SettleGraphs
from .uploads import upload

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
        q = quantize_summaries(build_summaries(keys, self.cfg.rank, self.cfg.eigh), self.cfg)
        for f in fields(q):
            value = getattr(q, f.name)
            if isinstance(value, torch.Tensor):
                getattr(self.table, f.name)[:, pids] = value

    def page_rows(self, pids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the summaries of page ids pids [M]: field name -> [L, M, Hkv, ...] (a cached
        prefix's summaries leave the device or go to disk as these)."""
        return {name: t[:, pids].clone() for name, t in self._fields().items()}

    def put_page_rows(self, pids: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Write summaries `rows` (as `page_rows` returns them, any device) back for page ids pids [M]."""
        for name, t in self._fields().items():
            t[:, pids] = rows[name].to(t.device)

    def _fields(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self.table, f.name) for f in fields(self.table)
                if isinstance(getattr(self.table, f.name), torch.Tensor)}


GIB = 1 << 30


def kv_pages(model_config, cache, max_num_seqs: int, max_model_len: int, dtype: torch.dtype) -> int:
    """Page ids of KV capacity (a CacheConfig's): what host_capacity_gib holds, plus
    nvme_capacity_gib on tier host+nvme (a page lives in one of the two), capped at what
    max_num_seqs sequences of max_model_len tokens can use."""
    per_id = model_config.num_layers * model_config.num_kv_heads * 2 * cache.page_size \
        * model_config.head_dim * dtype.itemsize
    gib = cache.host_capacity_gib + (cache.nvme_capacity_gib if cache.tier == "host+nvme" else 0.0)
    pages = int(gib * GIB) // per_id
    if pages <= 0:
        raise ValueError(f"KV capacity ({gib:g} GiB: cache.host_capacity_gib"
                         f"{' + cache.nvme_capacity_gib' if cache.tier == 'host+nvme' else ''}) holds no "
                         f"page id of {per_id} bytes")
    return min(pages, max_num_seqs * math.ceil(max_model_len / cache.page_size))


@dataclass(frozen=True)
class TierSpec:
    """How to build the page source of settled pages. host_pages, nvme_pages: host-arena and NVMe
    slots of tier host+nvme (a page is in one of them);
    cache_pages: hot-page cache slots (None or 0 = no cache: decode gathers the selected pages from
    host memory every layer); max_selected: most slots one decode layer resolves; arena: tier host
    attaches this arena (made by the node's PageStore) instead of creating one."""

    kind: str
    cache_pages: int | None = None
    max_selected: int | None = None
    host_pages: int | None = None
    nvme_pages: int | None = None
    nvme_dir: str | None = None
    arena: HostArenaSpec | None = None
    lookahead: int = 0  # host+nvme: promote ahead of need (offload/spilled.py)
    io_threads: int = 4  # host+nvme: NVMe I/O threads
    spill_behind: bool = True  # host+nvme: the next allocation's spills written behind (offload/store.py)
    cache_commit: str = "inline"  # where the hot cache's commit runs (offload/cache.py COMMITS)
    verify_on_open: bool = True  # host+nvme: check the pages an earlier store left (offload/factory.py)

    @property
    def front_pages(self) -> int:
        """Rows of the attention pool in front of the write pool (host tiers): the cache's pool
        (its entries, then a staging row per request for the misses) or the direct-read buffer."""
        if self.cache_pages:
            return pool_rows(self.cache_pages, self.max_selected)
        return self.max_selected


def make_settled(spec: TierSpec, layout: KVLayout, device: torch.device,
                 front: torch.Tensor | None) -> PageSource:
    """The page source of the engine's settled pages; front: the attention pool's rows before the
    write pool (host tiers), which the source's resolve indexes."""
    kw = {} if spec.kind == "hbm" else {"cache_pages": spec.cache_pages, "max_selected": spec.max_selected,
                                        "pool": front, "arena": spec.arena,
                                        "cache_commit": spec.cache_commit}
    if spec.kind == "host+nvme":
        kw.update(host_pages=spec.host_pages, nvme_pages=spec.nvme_pages, nvme_dir=spec.nvme_dir,
                  lookahead=spec.lookahead, io_threads=spec.io_threads, verify_on_open=spec.verify_on_open,
                  spill_behind=spec.spill_behind)
    return make_tier(spec.kind, layout.geometry, layout.num_slots, device=device, **kw)


@dataclass
class PrefillWindow:
    """Host tiers: write-pool locations of a prefilling sequence's pages first, first + 1, ...
    (a suffix of its pages: locs[i] holds page first + i). Pages below `done` are full and
    settled (their tier copy written); pages below `first` are on the tier only. The first `lent`
    locations are kept copies of cached pages (KVManager._kept): read, never written nor freed."""

    first: int
    done: int
    locs: list[int] = field(default_factory=list)
    lent: int = 0

    @property
    def held(self) -> int:
        """Settled pages whose write-pool copy this window keeps."""
        return self.done - self.first


@dataclass(frozen=True)
class PrefixView:
    """Where a prefill chunk's attention reads pages 0..P-1 of its sequence (P: the pages up to
    the chunk's last): pages [0, tier_pages) from the tier, the rest at write-pool `locs`."""

    tier_pages: int
    locs: list[int]


class KVManager:
    """The engine's KV: write pool, settled pages, summaries; plans and commits each step.

    num_tail_pages: write-pool pages per (layer, KV head) on host tiers; must cover the open
    pages of all running sequences plus every page one step can touch. window_pages: more
    write-pool pages that prefilling sequences keep their settled pages in (host tiers; 0: a
    chunk reads its whole settled prefix from the tier).
    """

    def __init__(self, layout: KVLayout, locks: LocksConfig, spec: TierSpec, device: torch.device,
                 num_tail_pages: int, summaries=None, window_pages: int = 0):
        if window_pages < 0:
            raise ValueError(f"window_pages ({window_pages}) must be >= 0")
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
            rows = num_tail_pages + window_pages
            tail = layout.num_layers * rows * layout.num_kv_heads
            shape = (spec.front_pages + tail, *layout.geometry.page_shape)
            self.attn_pool = torch.zeros(shape, dtype=layout.dtype, device=device)
            self.write_front, self.write_rows = spec.front_pages, rows
            self.write_pool = self.attn_pool[spec.front_pages :]
            self.settled = make_settled(spec, layout, device, self.attn_pool[: spec.front_pages])
            self._free_locs = list(range(rows - 1, -1, -1))
        self.window_pages = 0 if self.resident else window_pages
        self._open_loc: dict[str, int] = {}  # host tiers: write-pool location of a partial page
        self._windows: dict[str, PrefillWindow] = {}  # host tiers: sequences in prefill
        self._kept: OrderedDict[int, int] = OrderedDict()  # host tiers: pid -> loc, oldest use first
        self._lent: dict[int, int] = {}  # kept loc -> windows that read it (never handed out)
        self.kept_pages_read = 0  # pages that prefills read from kept copies
        self.settle_graphs: SettleGraphs | None = None  # `capture_settles`

    def capture_settles(self, max_pages: int) -> None:
        """Replay the summary build of settles of up to max_pages pages from CUDA graphs (see
        engine/settle.py); only with LOCKS's own table, whose build the graphs capture (with the
        table's eigensolver choice, LocksConfig.eigh)."""
        if type(self.summaries) is not SummaryTable:
            name = type(self.summaries).__name__
            raise ValueError(f"settle graphs capture LOCKS's summary table, not {name}")
        lay = self.layout
        per_page = lay.num_layers * lay.num_kv_heads  # eigenproblems of one page id
        self.settle_graphs = SettleGraphs(self._build_summaries, max_pages, per_page, lay.page_size,
                                          self.device, self.summaries.cfg.eigh)

    def plan(self, chunk: Chunk, window: bool = False) -> list[int]:
        """Write-pool locations of the pages the chunk touches, in page order. window: the chunk is
        a prompt chunk whose sequence keeps its pages in a prefill window (host tiers; `prefix`
        then says where its attention reads them)."""
        b = self.layout.page_size
        first, last = chunk.start // b, (chunk.end - 1) // b
        if self.resident:
            return chunk.seq.pids[first : last + 1]
        if window:
            return self._plan_prefill(chunk, first, last)
        if chunk.seq.request_id in self._windows:  # decoding begins: the prefill is over
            self._close_window(chunk.seq.request_id, keep_open=chunk.start % b > 0, pids=chunk.seq.pids)
        locs = []
        for j in range(first, last + 1):
            reopen = j == first and chunk.start % b
            locs.append(self._open_loc.pop(chunk.seq.request_id) if reopen else self._take_loc())
        return locs

    def _plan_prefill(self, chunk: Chunk, first: int, last: int) -> list[int]:
        """Host tiers: a prefill chunk's pages first..last in its sequence's window (the partial
        page an earlier chunk left is already there; new pages take free locations)."""
        rid = chunk.seq.request_id
        window = self._windows.get(rid)
        if window is None:
            lent = self._lend(chunk.seq.pids, first)
            window = self._windows[rid] = PrefillWindow(first - len(lent), first, lent, len(lent))
            if chunk.start % self.layout.page_size:
                window.locs.append(self._open_loc.pop(rid))
        if window.first + len(window.locs) != first + (chunk.start % self.layout.page_size > 0):
            raise RuntimeError(f"request {rid!r}: prefill window holds pages {window.first}.."
                               f"{window.first + len(window.locs) - 1}, chunk starts at page {first}")
        while window.first + len(window.locs) <= last:
            window.locs.append(self._take_loc())
        return window.locs[first - window.first :]

    def _lend(self, pids: list[int], first: int) -> list[int]:
        """Kept locations of the longest run of pages ending at page first - 1 (cached pages a new
        prefill reuses) whose copies are kept, at most what the windows' budget has left (so the
        write pool keeps room for every window's new pages); lent until the window lets them go."""
        room = self.window_pages - sum(w.held for w in self._windows.values())
        j = first
        while j > max(0, first - room) and pids[j - 1] in self._kept:
            j -= 1
        locs = []
        for pid in pids[j:first]:
            self._kept.move_to_end(pid)
            loc = self._kept[pid]
            self._lent[loc] = self._lent.get(loc, 0) + 1
            locs.append(loc)
        self.kept_pages_read += len(locs)
        return locs

    def _unlend(self, loc: int) -> None:
        self._lent[loc] -= 1
        if not self._lent[loc]:
            del self._lent[loc]

    def _take_loc(self) -> int:
        """A write-pool location for a new page: a free one, else the least recently used kept copy
        that no window has lent."""
        if self._free_locs:
            return self._free_locs.pop()
        for pid, loc in self._kept.items():
            if loc not in self._lent:
                del self._kept[pid]
                return loc
        raise RuntimeError(f"write pool: all {self.write_rows} locations are in use")

    def prefix(self, chunk: Chunk) -> PrefixView:
        """Where a planned prefill chunk's attention finds its sequence's pages up to its last."""
        b = self.layout.page_size
        last = (chunk.end - 1) // b
        if self.resident:
            return PrefixView(0, chunk.seq.pids[: last + 1])
        window = self._windows[chunk.seq.request_id]
        return PrefixView(window.first, window.locs[: last + 1 - window.first])

    def commit(self, planned: list[tuple[Chunk, list[int]]]) -> None:
        """After the step's forward: settle and summarise every page that filled; on host tiers
        free the write-pool copies no window keeps."""
        b = self.layout.page_size
        pids, locs, owners, freed = [], [], [], []
        for chunk, chunk_locs in planned:
            first = chunk.start // b
            for i, loc in enumerate(chunk_locs):
                if (first + i + 1) * b <= chunk.end:
                    pids.append(chunk.seq.pids[first + i])
                    locs.append(loc)
                    owners.append(chunk.seq.pids[0])
                elif not self.resident and chunk.seq.request_id not in self._windows:
                    self._open_loc[chunk.seq.request_id] = loc
            if chunk.seq.request_id not in self._windows:
                freed.extend(chunk_locs[: (chunk.end // b) - first])
        if pids:
            self._settle(upload(pids, device=self.device), upload(locs, device=self.device),
                         upload(owners, device=self.device), host_pids=torch.tensor(pids))
        if not self.resident:
            self._free_locs.extend(freed)
            self._advance_windows([chunk for chunk, _ in planned])

    def _advance_windows(self, chunks: list[Chunk]) -> None:
        """Host tiers, after a step's settles: windows mark the pages that filled as settled; a
        prefill that ended gives its window back (its partial page becomes the open page); then
        the oldest settled copies leave until at most window_pages are kept. (A freed location is
        reused only by a later step's writes, ordered after this step's write-back on the stream.)"""
        b = self.layout.page_size
        for chunk in chunks:
            window = self._windows.get(chunk.seq.request_id)
            if window is None:
                continue
            window.done = chunk.end // b
            if chunk.end == chunk.seq.num_prompt:  # the prefill's last chunk: its window closes
                self._close_window(chunk.seq.request_id, keep_open=chunk.end % b > 0, pids=chunk.seq.pids)
        excess = sum(w.held for w in self._windows.values()) - self.window_pages
        while excess > 0:
            window = max(self._windows.values(), key=lambda w: w.held)
            loc = window.locs.pop(0)
            if window.lent:  # a kept copy stays kept
                window.lent -= 1
                self._unlend(loc)
            else:
                self._free_locs.append(loc)
            window.first += 1
            excess -= 1

    def _close_window(self, request_id: str, keep_open: bool, pids: list[int] | None = None) -> None:
        """A prefill ended (pids: its sequence's page ids: its settled copies stay kept) or was
        aborted (None: its copies are freed)."""
        window = self._windows.pop(request_id)
        if keep_open:
            self._open_loc[request_id] = window.locs.pop()
        for i, loc in enumerate(window.locs):
            if i < window.lent:
                self._unlend(loc)
            elif pids is not None and window.first + i < window.done:
                self._kept[pids[window.first + i]] = loc  # newest use last
            else:
                self._free_locs.append(loc)

    def _settle(self, pids: torch.Tensor, locs: torch.Tensor, owners: torch.Tensor | None = None,
                host_pids: torch.Tensor | None = None) -> None:
        # pids, locs, owners (each page's sequence's first page id): [M] on the device; host_pids:
        # pids on the CPU. A settle graph, where one covers M pages, replays the build of LOCKS's
        # table (which ignores owners).
        keys = None if self.resident else self._write_back(pids, locs, host_pids)
        if self.settle_graphs is not None and self.settle_graphs.covers(pids.numel()):
            self.settle_graphs.run(pids, locs)
            return
        self.summaries.store(pids, keys if keys is not None else self._settle_keys(pids, locs), owners)

    def _write_back(self, pids: torch.Tensor, locs: torch.Tensor,
                    host_pids: torch.Tensor | None = None) -> torch.Tensor:
        """Host tiers: filled pages pids [M] from write-pool rows locs [M] to the tier; returns their
        keys [L, M, Hkv, B, d] (the gathered copy). host_pids: pids [M] on the CPU (the tier's
        slots then reach it on the host too: no wait for this step's forward)."""
        lay = self.layout
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        tier = page_slots(layers, lay.max_pages, pids[None, :], self.heads)
        rows = page_slots(layers, self.write_rows, locs[None, :], self.heads)
        pages = self.write_pool.index_select(0, rows.flatten())
        host = None if host_pids is None else self.host_slots(host_pids)
        self.settled.write(tier.flatten(), pages, host_slots=host)
        return pages[:, 0].view(*tier.shape, lay.page_size, lay.head_dim)

    def host_slots(self, pids: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """The tier's slots [L * M * Hkv] (flat [L, M, Hkv], CPU) of page ids pids [M]: what
        page_slots gives on the device, made on the host (no wait for the device)."""
        lay = self.layout
        ids = torch.as_tensor(pids, dtype=torch.int64)
        layers = torch.arange(lay.num_layers)[:, None]
        return page_slots(layers, lay.max_pages, ids[None, :], torch.arange(lay.num_kv_heads)).flatten()

    def _settle_keys(self, pids: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
        """Keys [L, M, Hkv, B, d] of filled pages pids [M] (write-pool rows locs [M] on host tiers),
        from the write pool."""
        lay = self.layout
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        if self.resident:
            rows = page_slots(layers, lay.max_pages, pids[None, :], self.heads)
        else:
            rows = page_slots(layers, self.write_rows, locs[None, :], self.heads)
        return self.write_pool[rows.flatten(), 0].view(*rows.shape, lay.page_size, lay.head_dim)

    def _build_summaries(self, pids: torch.Tensor, locs: torch.Tensor) -> None:
        """The settle's summary build (what SettleGraphs captures): no host wait on CUDA with the
        Jacobi eigensolver."""
        self.summaries.store(pids, self._settle_keys(pids, locs))

    def fill_random(self, request_id: str, pids: list[int], num_tokens: int, seed: int,
                    chunk_pages: int = 256, first_page: int = 0,
                    on_pages: Callable[[int], None] | None = None) -> None:
        """Random K/V for a sequence's first num_tokens tokens (benchmarks: a stand-in for prefill).
        Full pages go to the tier and are summarised by the real code; a partial last page is left
        open in the write pool, as prefill would leave it. The bytes depend on seed and page index
        only (not on the tier or the chunking), so every tier holds the same cache. first_page: the
        sequence's page index of pids[0] (a context-parallel shard holds the pages one engine would).
        on_pages(n): called as each chunk of n full pages is stored (a progress bar)."""
        lay, b = self.layout, self.layout.page_size
        full, rest = divmod(num_tokens, b)
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        chunk_pages = min(chunk_pages, self._write_chunk_ids())
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
            if on_pages is not None:
                on_pages(m)
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
            ids = self.write_full_pages(pids[:full], pages[:, :full])
            self.summaries.store(ids, pages[:, :full, :, 0], owners=torch.full_like(ids, pids[0]))
        if rest:
            loc = pids[full] if self.resident else self._free_locs.pop()
            if not self.resident:
                self._open_loc[request_id] = loc
            slots = page_slots(layers, self.write_rows, torch.tensor([loc], device=self.device), self.heads)
            self.write_pool[slots.flatten(), :, :rest] = pages[:, full].reshape(-1, *lay.geometry.page_shape)[
                :, :, :rest]

    def write_full_pages(self, pids: list[int], pages: torch.Tensor) -> torch.Tensor:
        """Write full pages [L, M, Hkv, 2, B, d] of page ids pids [M] to where settled pages live
        (the arena on hbm, the tier on host tiers), in writes the tier takes; their summaries are
        the caller's. Returns pids on the device."""
        lay = self.layout
        layers = torch.arange(lay.num_layers, device=self.device)[:, None]
        ids = upload(pids, device=self.device)
        slots = page_slots(layers, lay.max_pages, ids[None, :], self.heads)  # [L, M, Hkv]
        step = max(1, min(len(pids), self._write_chunk_ids()))
        for start in range(0, len(pids), step):
            part = slots[:, start : start + step].flatten()
            rows = pages[:, start : start + step].to(self.device).reshape(-1, *lay.geometry.page_shape)
            if self.resident:
                self.write_pool[part] = rows
            else:
                self.settled.write(part, rows, host_slots=self.host_slots(pids[start : start + step]))
        return ids

    def release(self, request_id: str, pids: list[int], num_settled_pages: int) -> None:
        """A sequence ended: free its open write-pool page (and prefill window) and drop its
        settled pages' tier state."""
        if request_id in self._windows:
            self._close_window(request_id, keep_open=False)
        loc = self._open_loc.pop(request_id, None)
        if loc is not None:
            self._free_locs.append(loc)
        if num_settled_pages and pids:
            self.release_pages(pids[:num_settled_pages])

    def release_pages(self, pids: list[int]) -> None:
        """Drop the tier state of settled pages whose ids are being freed (hot-cache entries, NVMe
        slots): a sequence's own at its end, or cached pages the prefix cache evicted."""
        for pid in pids:
            loc = self._kept.pop(pid, None)
            if loc is not None:
                if loc in self._lent:
                    raise RuntimeError(f"page {pid} freed while a prefill reads its kept copy")
                self._free_locs.append(loc)
        if pids:
            lay = self.layout
            layers = torch.arange(lay.num_layers, device=self.device)[:, None]
            settled = upload(pids, device=self.device)
            self.settled.release(page_slots(layers, lay.max_pages, settled[None, :], self.heads).flatten())

    def _write_chunk_ids(self) -> int:
        """Most page ids one write to the tier may hold (all layers and KV heads of each)."""
        most, per_id = self.settled.max_write_pages, self.layout.num_layers * self.layout.num_kv_heads
        return (1 << 62) if most is None else max(1, most // per_id)

    def before_forward(self, reads: bool = True) -> None:
        """Order this step's reads of the tier after earlier write-backs (on the device; no host
        wait), and on host+nvme mirror the store's moves. Called before every forward (a CUDA-graph
        replay must not wait on events itself); reads: it has decode rows (resolves slots)."""
        self.settled.before_forward(reads)

    def begin_forward(self) -> None:
        """At every forward's start, before its first layer (inside a captured one): the tier's
        device work for a new step (the hot cache's step advances)."""
        self.settled.begin_forward()

    def join(self) -> None:
        """After every forward's last layer (inside a captured one): the tier's side-stream work
        (the hot cache's branch commits) joins the current stream."""
        self.settled.join()

    def run_forward(self, forward: Callable[[], T], eager: Callable[[], T] | None = None,
                    decodes: bool = True) -> T:
        """One forward over this KV: `forward()` after before_forward; on host+nvme, again after
        promoting the pages it found still on NVMe (its K/V writes are idempotent and nothing has
        sampled from it), at most MAX_RERUNS times; then, if one step's selections keep missing
        (they do not fit host memory at once), once more with reads promoted layer by layer on the
        host (`eager`, default `forward`: a pass that cannot miss). After the forward that stands,
        the tier promotes ahead of the next step what its decode layers recorded (`prefetch_ahead`;
        not after a forward without decode rows, whose record would be an older step's)."""
        for attempt in range(MAX_RERUNS + 1):
            self.before_forward(reads=decodes)  # without decode rows: no miss to wait for
            out = forward()
            if not self.settled.take_misses(rerun=attempt > 0):
                if decodes:
                    self.settled.prefetch_ahead()
                return out
        self.before_forward()
        with self.synchronous_reads():
            out = (eager or forward)()
        if decodes:
            self.settled.prefetch_ahead()
        return out

    def synchronous_reads(self) -> contextlib.AbstractContextManager:
        """host+nvme: decode reads promote on the host, layer by layer, inside this block (a step
        that cannot miss; for a step whose selections do not fit host memory at once)."""
        return self.settled.synchronous_reads()

    def resolve(self, sel: DecodeSelection) -> torch.Tensor:
        """Attention-pool indices [Bt, Hkv, K] of one decode layer's selection: full pages through
        the page source, the open page in the write pool (sel.idx)."""
        if self.resident:
            return sel.idx
        found = self.settled.resolve_or(sel.slots.flatten(), sel.is_open.flatten(), sel.idx.flatten())
        return found.view_as(sel.idx)

    @property
    def num_free_tail_pages(self) -> int:
        """Write-pool locations a new page can take: free ones and kept copies no window has lent."""
        return len(self._free_locs) + len(self._kept) - len(self._lent)

    @property
    def num_kept_pages(self) -> int:
        """Settled pages whose write-pool copy is kept after their prefill (host tiers)."""
        return len(self._kept)

    def stats(self) -> OffloadStats:
        return self.settled.stats()

    def close(self) -> None:
        self.settled.close()
