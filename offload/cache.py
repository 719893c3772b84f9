"""GPU hot-page cache: a fixed pool of C page slots in device memory, managed on the device.

Consecutive decode steps select heavily overlapping pages; hits are served from
this pool and only misses cross PCIe. One `lookup_and_fill` is a fixed sequence
of tensor ops of fixed sizes (no Python loop over pages, no .item(), no host
sync), so a decode step that calls it can be captured in a CUDA graph.

Tables (device tensors; each has one extra trailing "trash" row that absorbs the
writes of entries with nothing to do, so no data-dependent sizes are needed):
- `slot_to_cache: [num_arena_slots] int32`: cache entry of an arena slot, -1 = absent.
- `cache_to_slot: [C] int64`: arena slot held by an entry, -1 = empty.
- `last_used: [C] int64`: step of the entry's last request, -1 = empty.

Replacement: exact LRU over steps; among entries last used in the same step, the
one holding the lower arena slot goes first; empty entries go before any.
Invariant: slot_to_cache and cache_to_slot are inverse on their non-negative entries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .arena import PageGeometry, resolve_device
from .gather import Pool, gather_pages

_PROTECTED = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class CacheStats:
    """Counters since construction (distinct pages per step; `requests` counts every position)."""

    steps: int
    requests: int
    hits: int
    misses: int
    bytes_moved: int
    bytes_moved_last_step: int
    capacity: int
    bytes_resident: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class HotPageCache:
    """Pool `[capacity, 2, B, d]` on `device` plus device-side LRU tables.

    `max_selected` bounds M, the number of slots one step may request
    (duplicates included); M <= capacity guarantees room for every miss.
    `pool`: use this contiguous `[capacity, 2, B, d]` tensor (e.g. the front of a larger pool that
    an attention kernel reads together with other pages) instead of allocating one.
    """

    def __init__(
        self,
        geometry: PageGeometry,
        capacity: int,
        num_arena_slots: int,
        max_selected: int,
        device: torch.device | str,
        gather: Callable[..., None] = gather_pages,
        pool: torch.Tensor | None = None,
    ):
        if num_arena_slots <= 0:
            raise ValueError(f"num_arena_slots ({num_arena_slots}) must be > 0")
        if not 0 < max_selected <= capacity:
            raise ValueError(f"max_selected ({max_selected}) must be in [1, capacity ({capacity})]")
        if num_arena_slots >= 2**31 - 1:
            raise ValueError(f"num_arena_slots ({num_arena_slots}) must fit int32 cache tables")
        self.geometry, self.capacity, self.num_arena_slots = geometry, capacity, num_arena_slots
        self.max_selected, self.device, self._gather = max_selected, resolve_device(device), gather
        dev = self.device
        shape = (capacity, *geometry.page_shape)
        if pool is None:
            pool = torch.zeros(shape, dtype=geometry.dtype, device=dev)
        elif tuple(pool.shape) != shape or pool.dtype != geometry.dtype or pool.device != dev \
                or not pool.is_contiguous():
            raise ValueError(f"pool: expected a contiguous {shape} {geometry.dtype} tensor on {dev}, got "
                             f"{tuple(pool.shape)} {pool.dtype} on {pool.device}")
        self.pool = pool
        self._slot_to_cache = torch.full((num_arena_slots + 1,), -1, dtype=torch.int32, device=dev)
        self._cache_to_slot = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
        self._last_used = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
        # Scratch for dedupe: first request position of each slot (only requested slots are read).
        self._first = torch.zeros(num_arena_slots, dtype=torch.int32, device=dev)
        self._positions = torch.arange(max_selected, dtype=torch.int32, device=dev)
        self._step = torch.zeros((), dtype=torch.int64, device=dev)
        # Device counters, read only by stats(): requests, hits, misses, misses of the last step.
        self._requests, self._hits, self._misses, self._last_misses = (
            torch.zeros((), dtype=torch.int64, device=dev) for _ in range(4)
        )

    @property
    def slot_to_cache(self) -> torch.Tensor:
        return self._slot_to_cache[: self.num_arena_slots]

    @property
    def cache_to_slot(self) -> torch.Tensor:
        return self._cache_to_slot[: self.capacity]

    @property
    def last_used(self) -> torch.Tensor:
        return self._last_used[: self.capacity]

    @property
    def last_step_misses(self) -> torch.Tensor:
        """0-dim int64 device tensor: pages copied in by the last lookup (read it without a sync
        by copying it aside; `int(...)` syncs)."""
        return self._last_misses

    def _check_slots(self, slots: torch.Tensor, limit: int | None) -> None:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
            raise ValueError(f"slots: expected a 1-D int64 tensor, got {getattr(slots, 'shape', slots)}")
        if slots.device != self.device:
            raise ValueError(f"slots: expected device {self.device}, got {slots.device}")
        if limit is not None and slots.numel() > limit:
            raise ValueError(f"slots: {slots.numel()} requested, more than max_selected ({limit})")

    def _dedupe(self, slots: torch.Tensor) -> torch.Tensor:
        """`[M]` bool: position i is the first request of its slot in this step."""
        pos = self._positions[: slots.numel()]
        # include_self=False: each requested slot gets exactly the min of its positions.
        self._first.scatter_reduce_(0, slots, pos, reduce="amin", include_self=False)
        return self._first.index_select(0, slots) == pos

    def _victims(self, entry: torch.Tensor, hit: torch.Tensor, m: int) -> torch.Tensor:
        """`[m]` int64: the m entries to evict first, hits of this step excluded."""
        key = self._last_used * (self.num_arena_slots + 1) + self._cache_to_slot
        protect = torch.where(hit, entry.long(), self.capacity)  # misses land on the trash row
        key.index_fill_(0, protect, _PROTECTED)
        return torch.topk(key[: self.capacity], m, largest=False, sorted=True).indices

    def _install(self, slots: torch.Tensor, new_entry: torch.Tensor, miss_leader: torch.Tensor) -> None:
        """Evict the chosen entries' old slots and point tables at the new ones."""
        trash_slot = self.num_arena_slots
        old_slot = self._cache_to_slot.index_select(0, new_entry)
        self._slot_to_cache.index_fill_(0, torch.where(old_slot >= 0, old_slot, trash_slot), -1)
        install = torch.where(miss_leader, slots, trash_slot)
        self._slot_to_cache.scatter_(0, install, torch.where(miss_leader, new_entry, -1).to(torch.int32))
        self._cache_to_slot.scatter_(0, new_entry, torch.where(miss_leader, slots, -1))

    def lookup_and_fill(self, slots: torch.Tensor, src: Pool) -> torch.Tensor:
        """Make the requested arena slots cache-resident; return their cache entries.

        slots: `[M]` int64 on the cache's device, M <= max_selected, values in
        [0, num_arena_slots) (not checked: it would sync), duplicates allowed.
        src: the arena pool `[num_arena_slots, 2, B, d]`: a HostPool under UVA, a
        device tensor, or a CPU tensor (tests).
        Returns `[M]` int64: `self.pool[out[i]]` holds the page of `slots[i]`.
        """
        self._check_slots(slots, self.max_selected)
        slots = slots.contiguous()  # the kernel takes unit-stride indices; a no-op when already so
        m = slots.numel()
        if m == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        leader = self._dedupe(slots)
        entry = self._slot_to_cache.index_select(0, slots)  # [M] int32, -1 = miss
        hit = entry >= 0
        miss_leader = leader & ~hit
        victims = self._victims(entry, hit, m)  # [M]
        rank = (torch.cumsum(miss_leader, 0) - 1).clamp_(min=0)
        new_entry = torch.where(miss_leader, victims.index_select(0, rank), self.capacity)
        self._install(slots, new_entry, miss_leader)
        cache_idx = self._slot_to_cache.index_select(0, slots).long()
        # index_put_ with a 0-dim device value: index_fill_ would read it with .item().
        self._last_used.index_put_((cache_idx,), self._step)
        self._gather(src, slots, self.pool, torch.where(miss_leader, new_entry, -1))
        self._count(m, leader, miss_leader)
        return cache_idx

    def _count(self, m: int, leader: torch.Tensor, miss_leader: torch.Tensor) -> None:
        misses = miss_leader.sum()
        self._requests.add_(m)  # a scalar kernel argument, not a host->device copy
        self._hits.add_(leader.sum() - misses)
        self._misses.add_(misses)
        self._last_misses.copy_(misses)
        self._step.add_(1)

    def update(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Refresh cached copies of slots whose contents were rewritten (others untouched).

        slots: `[n]` int64 distinct, on the device; pages: `[n, 2, B, d]` on the device.
        """
        self._check_slots(slots, None)
        entry = self._slot_to_cache.index_select(0, slots).long()  # -1 = not cached: skipped
        src_idx = torch.arange(slots.numel(), dtype=torch.int64, device=self.device)
        self._gather(pages, src_idx, self.pool, entry)

    def invalidate(self, slots: torch.Tensor) -> None:
        """Drop cached copies of slots (their arena contents changed behind the cache's back).

        slots: `[n]` int64 on the device; absent slots are ignored.
        """
        self._check_slots(slots, None)
        entry = self._slot_to_cache.index_select(0, slots).long()
        entry = torch.where(entry >= 0, entry, self.capacity)
        self._cache_to_slot.index_fill_(0, entry, -1)
        self._last_used.index_fill_(0, entry, -1)
        self._slot_to_cache.index_fill_(0, slots, -1)

    def stats(self) -> CacheStats:
        """Read the device counters (a host sync: call outside the decode step)."""
        counters = torch.stack([self._step, self._requests, self._hits, self._misses, self._last_misses])
        steps, requests, hits, misses, last_misses = (int(v) for v in counters.tolist())
        sb = self.geometry.slot_bytes
        return CacheStats(
            steps,
            requests,
            hits,
            misses,
            misses * sb,
            last_misses * sb,
            self.capacity,
            self.pool.numel() * self.pool.element_size(),
        )
