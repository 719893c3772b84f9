"""Triton kernels of the set-associative hot-page cache (only @triton.jit code here).

One `lookup_and_fill` is three launches, each reading what the previous one wrote
(launch order is the only synchronisation):
  probe  (one program per BLOCK requests): hits, set of each miss, this call's counts;
  assign (one program per request):        the way each miss is installed into (-1: none);
  copy   (one program per request x page chunk): misses -> staging rows and installed ways.
The launchers and the pure-torch reference are in `cache.py`.

Tables (flat, contiguous): tags / last `[NUM_SETS * WAYS]` int64, -1 = empty way.
`counters [6]` int64 (indices below), `call [4]` int64 scratch: this call's requests, hits,
misses (zero between calls) and its step (written by assign for copy).
"""

import triton
import triton.language as tl

# Indices into the counters tensor (cache.py reads them through `.value`).
STEP = tl.constexpr(0)
REQUESTS = tl.constexpr(1)
HITS = tl.constexpr(2)
MISSES = tl.constexpr(3)
LAST_MISSES = tl.constexpr(4)
NOT_INSTALLED = tl.constexpr(5)
# Indices into the call scratch.
CALL_REQUESTS = tl.constexpr(0)
CALL_HITS = tl.constexpr(1)
CALL_MISSES = tl.constexpr(2)
CALL_STEP = tl.constexpr(3)


@triton.jit
def set_of_slot(slot, NUM_SETS):
    """Set of an arena slot: Fibonacci hashing (32-bit multiplicative hash, then the high bits
    scaled to [0, NUM_SETS)). slot in [0, 2**31): every product stays below 2**63."""
    x = slot.to(tl.int64) * 1640531527  # 0x61C88647, odd: consecutive slots spread over the sets
    x = x - ((x >> 32) << 32)  # x mod 2**32 (x >= 0)
    return (x * NUM_SETS) >> 32


@triton.jit
def cache_probe_kernel(
    slots_ptr,  # [M] int64 arena slots; < 0 = padding
    tags_ptr,  # [NUM_SETS * WAYS] int64
    last_ptr,  # [NUM_SETS * WAYS] int64: hits get the step
    counters_ptr,  # [6] int64
    call_ptr,  # [4] int64: requests, hits, misses added here
    idx_ptr,  # [M] int64 out: cache row of a hit, CAPACITY + i of a miss, 0 of padding
    set_of_ptr,  # [M] int32 out: set of a miss, -1 otherwise
    M,
    NUM_SETS,
    CAPACITY,
    WAYS: tl.constexpr,
    WAYS_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < M
    slot = tl.load(slots_ptr + offs, mask=in_range, other=-1)
    valid = slot >= 0
    sets = set_of_slot(tl.maximum(slot, 0), NUM_SETS)  # [BLOCK] int64
    ways = tl.arange(0, WAYS_P2)
    probe = valid[:, None] & (ways < WAYS)[None, :]
    tags = tl.load(tags_ptr + sets[:, None] * WAYS + ways[None, :], mask=probe, other=-1)
    # Slots are distinct and a slot sits in at most one way of its set: at most one match
    # (the lowest is taken, as the reference does, should a caller repeat a slot).
    way = tl.min(tl.where(probe & (tags == slot[:, None]), ways[None, :], WAYS_P2), axis=1)
    hit = way < WAYS_P2
    miss = valid & (way == WAYS_P2)
    entry = sets * WAYS + way
    step = tl.load(counters_ptr + STEP)
    # A hit way gets last = step: assign reads that as "hit in this call", never a victim.
    tl.store(last_ptr + entry, tl.zeros_like(entry) + step, mask=hit)
    idx = tl.where(hit, entry, tl.where(miss, CAPACITY + offs, 0))
    tl.store(idx_ptr + offs, idx, mask=in_range)
    tl.store(set_of_ptr + offs, tl.where(miss, sets, -1).to(tl.int32), mask=in_range)
    # Sums of integers: the totals do not depend on the order of the atomics.
    tl.atomic_add(call_ptr + CALL_REQUESTS, tl.sum(valid.to(tl.int64)))
    tl.atomic_add(call_ptr + CALL_HITS, tl.sum(hit.to(tl.int64)))
    tl.atomic_add(call_ptr + CALL_MISSES, tl.sum(miss.to(tl.int64)))


@triton.jit
def _fold_call_counts(counters_ptr, call_ptr, step):
    """Add this call's counts to the totals, zero them for the next call, pass the step to copy."""
    requests = tl.load(call_ptr + CALL_REQUESTS)
    hits = tl.load(call_ptr + CALL_HITS)
    misses = tl.load(call_ptr + CALL_MISSES)
    tl.store(counters_ptr + REQUESTS, tl.load(counters_ptr + REQUESTS) + requests)
    tl.store(counters_ptr + HITS, tl.load(counters_ptr + HITS) + hits)
    tl.store(counters_ptr + MISSES, tl.load(counters_ptr + MISSES) + misses)
    tl.store(counters_ptr + LAST_MISSES, misses)
    tl.store(call_ptr + CALL_REQUESTS, 0)
    tl.store(call_ptr + CALL_HITS, 0)
    tl.store(call_ptr + CALL_MISSES, 0)
    tl.store(call_ptr + CALL_STEP, step)


@triton.jit
def _earlier_misses_in_set(set_of_ptr, i, my_set, is_miss, limit, SCAN: tl.constexpr):
    """Misses before request i in set my_set, counted up to `limit` (past it the exact rank
    does not matter: the miss is not installed). Deterministic: a scan, no atomics."""
    count = i * 0
    start = i * 0
    while is_miss & (start < i) & (count < limit):
        offs = start + tl.arange(0, SCAN)
        sets = tl.load(set_of_ptr + offs, mask=offs < i, other=-1)
        count += tl.sum((sets == my_set).to(tl.int32))
        start += SCAN
    return count


@triton.jit
def _lru_position(last, free, ways):
    """[WAYS_P2] int32: each way's position among the free ways ordered by (last, way)."""
    # older[u, v]: way v goes before way u.
    older = (last[None, :] < last[:, None]) | (
        (last[None, :] == last[:, None]) & (ways[None, :] < ways[:, None])
    )
    return tl.sum((free[None, :] & older).to(tl.int32), axis=1)


@triton.jit
def cache_assign_kernel(
    set_of_ptr,  # [M] int32: set of a miss, -1 otherwise
    last_ptr,  # [NUM_SETS * WAYS] int64, as probe left it (read only here)
    counters_ptr,  # [6] int64
    call_ptr,  # [4] int64
    way_of_ptr,  # [M] int32 out: way the miss is installed into, -1 = not installed / not a miss
    WAYS: tl.constexpr,
    WAYS_P2: tl.constexpr,
    SCAN: tl.constexpr,
):
    i = tl.program_id(0)
    step = tl.load(counters_ptr + STEP)
    if i == 0:
        _fold_call_counts(counters_ptr, call_ptr, step)
    my_set = tl.load(set_of_ptr + i)
    is_miss = my_set >= 0
    ways = tl.arange(0, WAYS_P2)
    # Padding ways (>= WAYS) and programs that are not misses read `step`: never free.
    last = tl.load(last_ptr + my_set.to(tl.int64) * WAYS + ways, mask=is_miss & (ways < WAYS), other=step)
    free = last != step  # not hit in this call (installs write `step` only in the copy launch)
    rank = _earlier_misses_in_set(set_of_ptr, i, my_set, is_miss, tl.sum(free.to(tl.int32)), SCAN)
    # The rank-th free way in LRU order: misses of one set have distinct ranks, so distinct ways.
    pick = free & (_lru_position(last, free, ways) == rank)
    way = tl.max(tl.where(pick, ways, -1), axis=0)
    tl.store(way_of_ptr + i, way)
    tl.atomic_add(counters_ptr + NOT_INSTALLED, 1, mask=is_miss & (way < 0))


@triton.jit
def cache_copy_kernel(
    src_ptr,  # [S, PAGE_WORDS] words: the arena (a device tensor or a host pool under UVA)
    pool_ptr,  # [CAPACITY + max_selected, PAGE_WORDS] words: cache rows, then staging rows
    slots_ptr,  # [M] int64
    set_of_ptr,  # [M] int32
    way_of_ptr,  # [M] int32
    tags_ptr,  # [NUM_SETS * WAYS] int64: installed ways get their slot
    last_ptr,  # [NUM_SETS * WAYS] int64: installed ways get the step
    counters_ptr,  # [6] int64: program (0, 0) advances the step
    call_ptr,  # [4] int64: this call's step
    CAPACITY,
    WAYS: tl.constexpr,
    PAGE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    my_set = tl.load(set_of_ptr + i).to(tl.int64)
    way = tl.load(way_of_ptr + i)
    is_miss = my_set >= 0
    installed = way >= 0  # implies is_miss
    entry = my_set * WAYS + way
    slot = tl.load(slots_ptr + i, mask=is_miss, other=0)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # PAGE_WORDS is a multiple of 4 (16 bytes), so each thread's 4 words are one vector load.
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    in_page = offs < PAGE_WORDS
    # int64 row offsets: row * PAGE_WORDS passes 2**31 for pools over 8 GiB. Hits load nothing.
    vals = tl.load(src_ptr + slot * PAGE_WORDS + offs, mask=in_page & is_miss)
    staging = (CAPACITY + i).to(tl.int64)
    tl.store(pool_ptr + staging * PAGE_WORDS + offs, vals, mask=in_page & is_miss)
    tl.store(pool_ptr + entry * PAGE_WORDS + offs, vals, mask=in_page & installed)
    # Every program reads the step from `call`, so program (0, 0) may advance the counter.
    step = tl.load(call_ptr + CALL_STEP)
    first = chunk == 0
    tl.store(tags_ptr + entry, slot, mask=first & installed)
    tl.store(last_ptr + entry, step, mask=first & installed)
    tl.store(counters_ptr + STEP, step + 1, mask=first & (i == 0))
