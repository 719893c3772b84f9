"""GPU hot-page cache: a set-associative LRU of page copies in device memory, managed on the device.

Consecutive decode steps select heavily overlapping pages; hits are served from
the cache and only misses cross PCIe. One `lookup_and_fill` is one or two Triton
launches of fixed grids (no .item(), no host sync, no sort), so a decode step that
calls it can be captured in a CUDA graph: lookup (probe, victim choice, page copy and
the returned rows) and commit (table stamps and counters), inside the lookup launch or
after it, or no commit at all: every lookup program stamps its own way ("inline"; `commit`:
COMMITS).
Work: O(WAYS) per hit; each miss also scans the call's slots for the ways of its set
hit in this call and the misses of its set before it: O(M) per miss (the slots hashed to their
sets) + O(WAYS) per request of its set.

Layout: C = num_sets * ways entries (capacity rounded up to whole sets). Arena slot s
lives only in set `slot_sets(s)` (a multiplicative hash: consecutive slots spread).
The pool has C + max_selected rows: rows [0, C) are the entries (set k, way w is
row k * ways + w), rows [C, C + max_selected) are staging, one per request position.

Table (a device tensor): one int64 word per way, its tag (the arena slot it holds) and the
low 32 bits of the step of its last use (triton_cache.py); read as `tags [num_sets, ways]`
(-1 empty) and `last_used [num_sets, ways]` (-1 empty). Ways are ordered by age, (step -
stamp) mod 2**32: exact while no way outlives 2**32 steps unused.
Invariant: a slot is in at most one way, and only in its own set.

One call at step t (the device counter), slots distinct:
- a request whose slot is tagged in its set is a hit: last_used = t, idx = its row;
- a miss is always copied into staging row C + i (idx = C + i): a selected page is never
  skipped, whatever the replacement policy does. It is also installed into its set: the
  misses of one set, in request order, take that set's ways not hit in this call, least
  recently used first (ties: lower way); misses past the set's free ways are not installed.
- the step advances after the call, except under the "inline" commit: there the caller
  advances it (`advance_step`, once per decode step), and the calls between two advances
  share a step (the last use of a way is known to the step, not to the call).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from . import triton_cache as kern
from .arena import PageGeometry, resolve_device
from .gather import HostPool, Pool, check_pool, gather_pages, word_view

_COUNTERS = ("steps", "requests", "hits", "misses", "last_misses", "not_installed")
assert len(_COUNTERS) == kern.NUM_COUNTERS.value, "the fused commit reads the counters as one vector"
_STEP, _REQUESTS, _HITS, _MISSES, _LAST_MISSES, _NOT_INSTALLED = (
    kern.STEP.value, kern.REQUESTS.value, kern.HITS.value, kern.MISSES.value, kern.LAST_MISSES.value,
    kern.NOT_INSTALLED.value,
)  # fmt: skip
_HASH_MULT = 0x61C88647  # the kernels' multiplier (triton_cache.set_of_slot)
_MAX_SLOTS = 2**31  # slots below this keep the hash products inside int64
_COMMIT_BLOCK, _SCAN, _COPY_BLOCK = 256, 512, 2048  # requests / most slots a scan step reads / words
# Calls of at most this many requests may commit inside the lookup launch (its last program, in
# blocks of _FUSED_BLOCK). Larger calls keep a parallel commit launch, which beats one program
# stamping them all.
FUSED_COMMIT_MAX, _FUSED_BLOCK = 4096, 1024
# Where a call's commit runs (HotPageCache.commit): "fused" in the lookup launch (one launch, but its
# last program stamps serially after the slowest miss); "branch" a second launch on a side stream,
# so that it overlaps the caller's next kernels (the attention), joined before the tables are next
# used (CUDA; elsewhere as "launch"); "launch" a second launch after the lookup on the same stream;
# "inline" no commit: each lookup program stamps its own way and counts in its own row, and the
# step advances only by `advance_step` (no ticket on the lookup's critical path).
COMMITS = ("fused", "branch", "launch", "inline")
_LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class CacheStats:
    """Counters since construction. requests: non-negative entries asked for (= hits + misses);
    every miss crosses PCIe (bytes_moved = misses * slot bytes); not_installed: misses copied to
    staging only, their set having no way left that was not hit in the same call. steps: lookups,
    or advance_step calls under the "inline" commit; bytes_moved_last_step: 0 under "inline"."""

    steps: int
    requests: int
    hits: int
    misses: int
    bytes_moved: int
    bytes_moved_last_step: int
    capacity: int
    bytes_resident: int
    not_installed: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def num_sets_for(capacity: int, ways: int) -> int:
    return -(-capacity // ways)


def pool_rows(capacity: int, max_selected: int, ways: int = 16) -> int:
    """Rows of a cache's pool: entries (capacity rounded up to whole sets) + staging."""
    return num_sets_for(capacity, ways) * ways + max_selected


def slot_sets(slots: torch.Tensor, num_sets: int) -> torch.Tensor:
    """`[n]` int64: the set of each slot (slots in [0, 2**31)); the reference of
    `triton_cache.set_of_slot`, bit for bit."""
    x = (slots * _HASH_MULT) & 0xFFFFFFFF
    return (x * num_sets) >> 32


def _rank_in_set(sets: torch.Tensor, miss: torch.Tensor, num_sets: int) -> torch.Tensor:
    """`[M]` int64: for a miss, the number of misses before it (in request order) in its set."""
    key = torch.where(miss, sets, num_sets)
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    first = torch.searchsorted(sorted_key, sorted_key)  # first position of each key's group
    rank = torch.empty_like(key)
    rank[order] = torch.arange(key.numel(), device=key.device) - first
    return rank


def _victim_ways(age: torch.Tensor, free: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """`[M]` int64: the rank-th free way (not hit in this call), oldest first (ties: lower way),
    -1 when there is none. age, free: `[M, W]`, the request's set before the call."""
    w = torch.arange(age.shape[1], device=age.device)
    older = (age[:, None, :] > age[:, :, None]) | (
        (age[:, None, :] == age[:, :, None]) & (w[None, :] < w[:, None])
    )  # [M, W, W]: way v (last axis) goes before way u (middle axis)
    position = (older & free[:, None, :]).sum(2)
    pick = free & (position == rank[:, None])
    return torch.where(pick.any(1), pick.to(torch.int8).argmax(1), -1)


def _pack(slots: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Way words of `slots` (>= 0) used at `step`: the reference of `triton_cache.pack_way`, bit for
    bit (the low 32 bits of the step, sign-extended, times 2**32: no int64 overflow)."""
    high = ((step + 2**31) & _LOW32) - 2**31
    return high * 2**32 + slots + 1


def _unpack(words: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tags, ages) of way words, as `triton_cache._unpack_ways`: tag -1 for an empty way; age
    (step - stamp) mod 2**32, 2**32 for an empty way."""
    tags = (words & _LOW32) - 1
    age = (step - (words >> 32)) & _LOW32
    return tags, torch.where(tags < 0, age + 2**32, age)


class HotPageCache:
    """Pool `[C + max_selected, 2, B, d]` on `device` (see the module docstring) plus
    device-side set-associative LRU tables.

    capacity: entries wanted; C = ceil(capacity / ways) * ways (`self.capacity`).
    `HotPageCache(...).pool.shape[0] == pool_rows(capacity, max_selected, ways)
    == self.capacity + max_selected`.
    max_selected: the most entries one lookup may pass (padding included); any value >= 1.
    num_arena_slots: bound of the slot values (< 2**31; not checked on the device).
    gather: page copier of the torch path and of `update` (`gather_pages` contract).
    pool: use this contiguous `[C + max_selected, 2, B, d]` tensor (e.g. the front of a larger
    pool that an attention kernel reads together with other pages) instead of allocating one.
    backend: "triton" (the kernels; CUDA, or CPU under TRITON_INTERPRET=1), "torch" (the
    reference: same idx, tables and counters; host syncs on CUDA), or "auto": Triton on CUDA.
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
        ways: int = 16,
        backend: str = "auto",
        commit: str = "fused",
    ):
        _check_sizes(capacity, num_arena_slots, max_selected, ways)
        self.geometry, self.num_arena_slots, self.max_selected = geometry, num_arena_slots, max_selected
        self.device, self._gather = resolve_device(device), gather
        self.backend = _pick_backend(backend, self.device)
        if self.backend == "triton" and geometry.slot_bytes % 16:
            raise ValueError(f"page bytes ({geometry.slot_bytes}) must be a multiple of 16 for vector loads")
        self.ways, self.num_sets = ways, num_sets_for(capacity, ways)
        self.capacity = self.num_sets * ways
        self.pool = self._make_pool(pool)
        dev = self.device
        # The way words (0: empty). One trailing "trash" word absorbs writes of entries with
        # nothing to do.
        self._ways = torch.zeros(self.capacity + 1, dtype=torch.int64, device=dev)
        self._counters = torch.zeros(len(_COUNTERS), dtype=torch.int64, device=dev)
        self._step_cell = self._counters[_STEP : _STEP + 1]  # a view: advance_step's one launch
        # "inline" lookups' counts, per request position: requests, hits, misses, not installed.
        self._pos = torch.zeros(max_selected, 4, dtype=torch.int64, device=dev)
        # Triton path scratch, lookup -> commit: this call's step, each request's entry and kind.
        self._call = torch.zeros(1, dtype=torch.int64, device=dev)
        self._entry_of = torch.empty(max_selected, dtype=torch.int64, device=dev)
        self._kind_of = torch.empty(max_selected, dtype=torch.int8, device=dev)
        self._tag_of = torch.empty(max_selected, dtype=torch.int64, device=dev)
        self._done = torch.zeros(1, dtype=torch.int32, device=dev)  # the fused lookup's ticket counter
        self.fused_commit_max = FUSED_COMMIT_MAX  # "fused" calls up to this size are one launch
        self._side = None  # "branch" commits' stream, made when that placement is chosen
        self.commit = commit  # validated by the setter
        self._side_pending = False  # a branch commit not yet joined
        self._side_captured = False  # ... issued inside a graph capture

    @property
    def tags(self) -> torch.Tensor:
        """`[num_sets, ways]` int64: the arena slot each way holds, -1 empty (a copy)."""
        return _unpack(self._ways[: self.capacity], self._counters[_STEP])[0].view(self.num_sets, self.ways)

    @property
    def last_used(self) -> torch.Tensor:
        """`[num_sets, ways]` int64: the step of each way's last use, -1 empty (a copy)."""
        step = self._counters[_STEP]
        tags, age = _unpack(self._ways[: self.capacity], step)
        return torch.where(tags >= 0, step - age, -1).view(self.num_sets, self.ways)

    def _make_pool(self, pool: torch.Tensor | None) -> torch.Tensor:
        shape = (self.capacity + self.max_selected, *self.geometry.page_shape)
        dtype, dev = self.geometry.dtype, self.device
        if pool is None:
            return torch.zeros(shape, dtype=dtype, device=dev)
        ok = tuple(pool.shape) == shape and pool.dtype == dtype and pool.device == dev
        if not (ok and pool.is_contiguous()):
            raise ValueError(
                f"pool: expected a contiguous {shape} {dtype} tensor on {dev} (capacity {self.capacity}"
                f" + max_selected {self.max_selected} rows), got {tuple(pool.shape)} {pool.dtype} on"
                f" {pool.device}"
            )
        return pool

    @property
    def commit(self) -> str:
        """Where each call's commit runs (COMMITS); set it before capturing a graph."""
        return self._commit

    @commit.setter
    def commit(self, where: str) -> None:
        if where not in COMMITS:
            raise ValueError(f"commit ({where!r}) must be one of {COMMITS}")
        self._commit = where
        if where == "branch" and self._side is None and self.device.type == "cuda":
            # Only here: work on a second stream slows every graph replay of the process after it
            # (docs/notes/decode_step.md), so the default placements never make one.
            self._side = torch.cuda.Stream(self.device)

    def join(self) -> None:
        """Order the current stream after a branch commit still running on the side stream (on
        the device, no host wait). Every use of the tables calls it; a caller capturing a graph
        calls it before the capture ends (an unjoined side stream fails the capture)."""
        if not self._side_pending:
            return
        if torch.cuda.is_current_stream_capturing() and not self._side_captured:
            raise RuntimeError("a branch commit issued before this CUDA-graph capture began was not "
                               "joined: call HotPageCache.join() before capturing")
        torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._side_pending = False

    def advance_step(self) -> None:
        """Under the "inline" commit: the next lookups belong to a new step (one small launch, no
        host wait; call it at the start of each forward, inside its graph when captured). Elsewhere
        a no-op: each lookup advances the step itself."""
        if self.commit == "inline":
            self.join()
            self._step_cell.add_(1)

    @property
    def last_step_misses(self) -> torch.Tensor:
        """0-dim int64 device tensor: pages copied in by the last lookup (read it without a sync
        by copying it aside; `int(...)` syncs). Not kept under the "inline" commit (stats() is)."""
        if self.commit == "inline":
            raise RuntimeError("last_step_misses is not kept under the 'inline' commit; read stats()")
        self.join()
        return self._counters[_LAST_MISSES]

    def _check_slots(self, slots: torch.Tensor, limit: int | None) -> None:
        if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.dtype != torch.int64:
            got = f"{tuple(slots.shape)} {slots.dtype}" if isinstance(slots, torch.Tensor) else type(slots)
            raise ValueError(f"slots: expected a 1-D int64 tensor, got {got}")
        if slots.device != self.device:
            raise ValueError(f"slots: expected device {self.device}, got {slots.device}")
        if limit is not None and slots.numel() > limit:
            raise ValueError(f"slots: {slots.numel()} requested, more than max_selected ({limit})")

    def lookup_and_fill(self, slots: torch.Tensor, src: Pool,
                        outside: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Bring the requested arena slots' pages into the pool; return where they are.

        slots: `[M]` int64 on the cache's device, M <= max_selected; entries < 0 are padding;
        the others are in [0, num_arena_slots) and DISTINCT (neither is checked: it would sync).
        src: the arena pool `[num_arena_slots, 2, B, d]`: a HostPool under UVA, a device
        tensor, or a CPU tensor (tests).
        outside: optional (mask `[M]` bool, rows `[M]` int64): where mask is set, out[i] = rows[i]
        (pages that live outside the cache, such as the engine's open pages; their slots should be
        -1: a slot >= 0 is looked up and counted all the same).
        The same as `torch.where(mask, rows, lookup_and_fill(slots, src))`, folded into the lookup.
        Returns `[M]` int64: `self.pool[out[i]]` holds the page of `slots[i]` (padding: some
        valid row). Valid until the next `lookup_and_fill` / `update`. M == 0 is a no-op.
        """
        self._check_slots(slots, self.max_selected)
        check_pool("src", src, self.geometry.page_shape, self.geometry.dtype, self.device)
        if isinstance(src, HostPool) and self.device.type != "cuda":
            raise ValueError(f"src: a HostPool is read under UVA by a cuda cache, not one on {self.device}")
        if outside is not None:
            outside = self._check_outside(outside, slots.numel())
        slots = slots.contiguous()  # the kernels take unit-stride indices; a no-op when already so
        self.join()
        if slots.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.backend == "triton":
            return self._lookup_triton(slots, src, outside)
        idx = self._lookup_torch(slots, src)
        return idx if outside is None else torch.where(outside[0], outside[1], idx)

    def _check_outside(self, outside, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask [M] bool, rows [M] int64) on the cache's device, contiguous."""
        mask, rows = outside
        for name, t, dtype in (("outside mask", mask, torch.bool), ("outside rows", rows, torch.int64)):
            if t.shape != (m,) or t.dtype != dtype or t.device != self.device:
                raise ValueError(f"{name}: expected ({m},) {dtype} on {self.device}, got {tuple(t.shape)} "
                                 f"{t.dtype} on {t.device}")
        return mask.contiguous(), rows.contiguous()

    def _lookup_triton(self, slots: torch.Tensor, src: Pool,
                       outside: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Lookup (triton_cache.py), grid fixed by M: M x page chunks (1 for an 8 KiB page; hits
        skip the scan and the copy; "inline": M programs, each copying its page's chunks and
        stamping its own way); "fused" and M <=
        fused_commit_max: its last program commits; else a commit launch of cdiv(M, 256) programs,
        on the side stream where `commit` is "branch"."""
        m = slots.numel()
        inline = self.commit == "inline"
        fused = self.commit == "fused" and m <= self.fused_commit_max
        idx = torch.empty(m, dtype=torch.int64, device=self.device)
        page_words = self.geometry.slot_bytes // 4
        block = min(triton.next_power_of_2(page_words), _COPY_BLOCK)
        mask, rows = (slots, slots) if outside is None else (outside[0].view(torch.int8), outside[1])
        ways, ways_p2 = self.ways, triton.next_power_of_2(self.ways)
        scan = min(_SCAN, max(16, triton.next_power_of_2(m)))  # a few variants: M is fixed per graph
        chunks = triton.cdiv(page_words, block)
        # Launch on the tables' GPU, whatever the current device is.
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            kern.cache_lookup_kernel[(m, 1 if inline else chunks)](
                slots, self._ways, self._counters, self._call, self._pos, word_view(src, page_words),
                word_view(self.pool, page_words), idx, self._entry_of, self._kind_of, self._tag_of, mask,
                rows, self._done, m, self.num_sets, self.capacity,
                WAYS=ways, WAYS_P2=ways_p2, PAGE_WORDS=page_words, BLOCK=block, SCAN=scan,
                HAS_OUTSIDE=outside is not None, FUSED=fused, INLINE=inline, COMMIT_BLOCK=_FUSED_BLOCK,
                CHUNKS=chunks, num_warps=4,
            )  # fmt: skip
            if not (fused or inline):
                self._launch_commit(m)
        return idx

    def _launch_commit(self, m: int) -> None:
        # Reads only the cache's own scratch (the lookup's tag copy, not the caller's slots), so
        # that on the side stream no caller tensor needs keeping alive.
        branch = self.commit == "branch" and self._side is not None
        if branch:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side) if branch else contextlib.nullcontext():
            kern.cache_commit_kernel[(triton.cdiv(m, _COMMIT_BLOCK),)](
                self._tag_of, self._entry_of, self._kind_of, self._ways, self._counters, self._call, m,
                BLOCK=_COMMIT_BLOCK, num_warps=4,
            )  # fmt: skip
        self._side_pending = branch
        self._side_captured = branch and torch.cuda.is_current_stream_capturing()

    def _lookup_torch(self, slots: torch.Tensor, src: Pool) -> torch.Tensor:
        """The reference: same idx, tables and counters as the kernels (boolean indexing syncs)."""
        m, dev, step = slots.numel(), self.device, self._counters[_STEP].clone()  # (joined by the caller)
        positions = torch.arange(m, device=dev)
        valid = slots >= 0
        sets = slot_sets(slots.clamp(min=0), self.num_sets)
        tags, age = _unpack(self._ways[: self.capacity].view(self.num_sets, self.ways)[sets], step)  # [M, W]
        match = (tags == slots[:, None]) & valid[:, None]
        hit = match.any(1)
        entry = torch.where(hit, sets * self.ways + match.to(torch.int8).argmax(1), -1)
        taken = torch.zeros(self.capacity + 1, dtype=torch.bool, device=dev)
        taken[entry[hit]] = True  # the ways hit in this call
        miss = valid & ~hit
        rank = _rank_in_set(sets, miss, self.num_sets)
        free = ~taken[: self.capacity].view(self.num_sets, self.ways)[sets]
        way = torch.where(miss, _victim_ways(age, free, rank), -1)
        installed = way >= 0
        target = sets * self.ways + way
        used = torch.where(hit, entry, torch.where(installed, target, -1))
        self._ways[used[used >= 0]] = _pack(slots[used >= 0], step)
        staging = torch.where(miss, self.capacity + positions, -1)
        src_idx = slots.clamp(min=0)
        self._gather(src, src_idx, self.pool, staging)
        self._gather(src, src_idx, self.pool, torch.where(installed, target, -1))
        self._count(valid.sum(), hit.sum(), miss.sum(), (miss & ~installed).sum())
        return torch.where(hit, entry, torch.where(miss, staging, 0))

    def _count(self, requests, hits, misses, not_installed) -> None:
        c = self._counters
        c[_REQUESTS] += requests
        c[_HITS] += hits
        c[_MISSES] += misses
        c[_NOT_INSTALLED] += not_installed
        if self.commit != "inline":  # inline: the step advances by advance_step only
            c[_LAST_MISSES] = misses
            c[_STEP] += 1

    def _match(self, slots: torch.Tensor, sets: torch.Tensor) -> torch.Tensor:
        """`[n, W]` bool: the ways of each slot's set that hold it (none for slot < 0)."""
        return (self.tags[sets] == slots[:, None]) & (slots >= 0)[:, None]

    def _entries(self, slots: torch.Tensor) -> torch.Tensor:
        """`[n * W]` int64: every entry holding slots[i] at position i * W + w, -1 elsewhere.
        NOTE: all of them, not the first: should a caller break the distinct-slots contract, two
        ways may hold one slot, and update / invalidate must then reach both copies."""
        sets = slot_sets(slots.clamp(min=0), self.num_sets)
        rows = sets[:, None] * self.ways + torch.arange(self.ways, device=self.device)
        return torch.where(self._match(slots, sets), rows, -1).flatten()

    def update(self, slots: torch.Tensor, pages: torch.Tensor) -> None:
        """Refresh cached copies of slots whose contents were rewritten (others untouched).

        slots: `[n]` int64 distinct, on the device; pages: `[n, 2, B, d]` on the device.
        No host sync on the Triton gather (absent slots are skipped on the device).
        """
        self._check_slots(slots, None)
        self.join()
        src_idx = torch.arange(slots.numel(), dtype=torch.int64, device=self.device)
        self._gather(pages, src_idx.repeat_interleave(self.ways), self.pool, self._entries(slots))

    def invalidate(self, slots: torch.Tensor) -> None:
        """Drop cached copies of slots (their arena contents changed behind the cache's back).

        slots: `[n]` int64 on the device; absent and negative slots are ignored. No host sync.
        """
        self._check_slots(slots, None)
        self.join()
        entry = self._entries(slots)
        entry = torch.where(entry >= 0, entry, self.capacity)  # absent: the trash word
        self._ways.index_fill_(0, entry, 0)

    def copy_hits_misses(self, out: torch.Tensor) -> None:
        """out `[2]` int64 on the device = (hits, misses) so far, copied on the device (no host
        wait: a per-step record that does not disturb the steps)."""
        self.join()
        torch.add(self._counters[_HITS : _MISSES + 1], self._pos[:, 1:3].sum(0), out=out)

    def stats(self) -> CacheStats:
        """Read the device counters (a host sync: call outside the decode step)."""
        self.join()
        counters = self._counters.clone()
        pos = self._pos.sum(0)  # "inline" lookups' counts
        for col, name in enumerate((_REQUESTS, _HITS, _MISSES, _NOT_INSTALLED)):
            counters[name] += pos[col]
        c = dict(zip(_COUNTERS, counters.tolist(), strict=True))
        sb = self.geometry.slot_bytes
        return CacheStats(
            c["steps"], c["requests"], c["hits"], c["misses"], c["misses"] * sb, c["last_misses"] * sb,
            self.capacity, self.pool.numel() * self.pool.element_size(), c["not_installed"],
        )  # fmt: skip


def _check_sizes(capacity: int, num_arena_slots: int, max_selected: int, ways: int) -> None:
    if capacity <= 0:
        raise ValueError(f"capacity ({capacity}) must be > 0")
    if ways <= 0:
        raise ValueError(f"ways ({ways}) must be > 0")
    if max_selected <= 0:
        raise ValueError(f"max_selected ({max_selected}) must be > 0")
    if not 0 < num_arena_slots <= _MAX_SLOTS:
        raise ValueError(f"num_arena_slots ({num_arena_slots}) must be in [1, 2**31] (the set hash)")


def _pick_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend ({backend!r}) must be 'auto', 'triton' or 'torch'")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend 'triton' on {device} needs CUDA or TRITON_INTERPRET=1")
    return backend
