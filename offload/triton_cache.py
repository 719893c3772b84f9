"""Triton kernels of the set-associative hot-page cache (only @triton.jit code here).

One `lookup_and_fill` is one launch, or two (large calls, or a commit on a side stream); commit
reads what lookup wrote:
  lookup (one program per request x page chunk): hit or miss, the way a miss is installed into,
      the page copied from the arena into its staging row and its installed way, the row returned
      (or the caller's row for entries outside the cache);
  commit: stamps the hit and installed ways (tag, stamp = step), adds this call's counts, advances
      the step. FUSED: the lookup program that arrives last (a ticket counter, acq_rel) commits
      every request itself, after all the others have read the tables and written their scratch;
      otherwise `cache_commit_kernel`, one program per BLOCK requests, after the lookup on its
      stream or on a side stream that the cache joins before its tables are next used;
  INLINE: no commit. Each lookup program stamps its own hit or installed way and adds its counts
      to its request position's row of `pos`; the step does not advance (the caller advances it
      once per decode step, so the lookups of one step share it). No ticket, no second launch.
      One program per request: it copies every chunk of a missed page itself.
The launchers and the pure-torch reference are in `cache.py`.

Table: `ways [NUM_SETS * WAYS]` int64, one word per way: the stamp (the low 32 bits of the step
of its last use) in the high 32 bits, tag + 1 in the low 32 (0: an empty way; tags are arena
slots < 2**31). One word, so that a program reading a way while another writes it (INLINE) sees
the old tag and stamp or the new ones, never a mix. Stamps compare as ages, (step - stamp) mod
2**32: the least recently used way is the oldest; an empty way is older than any.

Invariant that lets one launch do the probe and the victim choice without seeing the other
programs' writes: "the ways hit in this call" are recomputed by a miss for its own set, by
scanning the call's slots (each request hits the lowest way tagged with its slot), not read from
stamps. Under INLINE another program's install may show in a miss's view of its set or not: if
it shows, that way counts as hit by its slot (taken) and its miss no longer counts as an earlier
miss of the set; if not, the way is free with its old stamp and the miss counts. Either way this
miss's victim is the same way (its rank among the free ways in LRU order is unchanged), so the
misses of one set always get distinct ways. Hits' stamps touch only taken ways, which no miss
chooses.

`counters [6]` int64 (indices below); `call [1]` int64 scratch: this call's step, for commit;
`done [1]` int32: lookup programs finished in this call (FUSED; 0 between calls); `pos [P, 4]`
int64 (INLINE): requests, hits, misses, not installed, per request position.
Per-request scratch from lookup to commit: `entry [M]` int64 (the way to stamp, -1 none),
`kind [M]` int8 (KIND_* below) and `tag [M]` int64 (the request's slot).
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
NUM_COUNTERS = tl.constexpr(6)
# What lookup found for a request (commit counts them).
KIND_PADDING = tl.constexpr(0)
KIND_HIT = tl.constexpr(1)
KIND_INSTALLED = tl.constexpr(2)  # a miss, copied to staging and installed into a way
KIND_STAGED = tl.constexpr(3)  # a miss copied to staging only: its set had no free way left


@triton.jit
def set_of_slot(slot, NUM_SETS):
    """Set of an arena slot: Fibonacci hashing (32-bit multiplicative hash, then the high bits
    scaled to [0, NUM_SETS)). slot in [0, 2**31): every product stays below 2**63."""
    x = slot.to(tl.int64) * 1640531527  # 0x61C88647, odd: consecutive slots spread over the sets
    x = x - ((x >> 32) << 32)  # x mod 2**32 (x >= 0)
    return (x * NUM_SETS) >> 32


@triton.jit
def _low32(x):
    """x mod 2**32, in [0, 2**32) (two's complement: right for negative x too)."""
    return x - ((x >> 32) << 32)


@triton.jit
def pack_way(tag, step):
    """The word of a way holding `tag` (>= 0), last used at `step`."""
    return (step << 32) + (tag + 1)


@triton.jit
def _unpack_ways(words, step):
    """(tags, ages) of way words: tag -1 for an empty way; age (step - stamp) mod 2**32, and
    2**32 (older than any) for an empty way."""
    tags = _low32(words) - 1
    age = _low32(step - (words >> 32))
    return tags, tl.where(tags < 0, age + (1 << 32), age)


@triton.jit
def _scan_call(slots_ptr, M, i, my_set, tags, ways, active, NUM_SETS, SCAN: tl.constexpr):
    """Over this call's requests (only where `active`), for set my_set whose tags are `tags`:
    (taken [WAYS_P2] bool: the ways some request hits in this call, misses before request i).
    Hits never scan. Each pass hashes SCAN slots and keeps those of my_set (one reduction); only
    those (about SCAN / NUM_SETS a pass) are matched against the set's tags, one at a time: O(M)
    per miss + O(WAYS) per request of its set (matching every slot against every tag, O(M * WAYS),
    took 6.6 against 5.0 us a lookup at SmolLM2's shape, archived history:
    docs/results/archive/lookup_scan_by_set_h200.json)."""
    taken = tags != tags  # [WAYS_P2] all false
    earlier = i * 0
    rows = tl.arange(0, SCAN)
    start = i * 0
    while active & (start < M):
        offs = start + rows  # [SCAN] int32
        s = tl.load(slots_ptr + offs, mask=offs < M, other=-1)  # [SCAN] int64
        # Request i is a miss: its slot is in no way of its set, so it is left out.
        same = (s >= 0) & (set_of_slot(tl.maximum(s, 0), NUM_SETS) == my_set) & (offs != i)
        j = tl.min(tl.where(same, offs, M), axis=0)  # the pass's first request of the set; M: none
        while j < M:
            # Padding and empty ways hold tag -1, never a valid slot.
            match = tl.load(slots_ptr + j) == tags  # [WAYS_P2]
            taken = taken | match
            earlier += ((tl.max(match.to(tl.int32), axis=0) == 0) & (j < i)).to(tl.int32)
            same = same & (offs != j)
            j = tl.min(tl.where(same, offs, M), axis=0)
        start += SCAN
    # A request hits the lowest way holding its slot. Should a caller repeat a slot, two ways may
    # hold it; the higher one is then not hit (as in the reference).
    return taken & ~_held_lower(tags, ways), earlier


@triton.jit
def _held_lower(tags, ways):
    """[WAYS_P2] bool: a lower way holds the same tag."""
    lower = (tags[None, :] == tags[:, None]) & (ways[None, :] < ways[:, None])  # [u, v]: v < u, same tag
    return tl.max(lower.to(tl.int32), axis=1) > 0


@triton.jit
def _lru_position(age, free, ways):
    """[WAYS_P2] int32: each way's position among the free ways, oldest first (ties: lower way)."""
    # older[u, v]: way v goes before way u.
    older = (age[None, :] > age[:, None]) | ((age[None, :] == age[:, None]) & (ways[None, :] < ways[:, None]))
    return tl.sum((free[None, :] & older).to(tl.int32), axis=1)


@triton.jit
def _victim_way(age, taken, rank, ways, WAYS: tl.constexpr):
    """The rank-th way not hit in this call, oldest first; -1 when there is none. Misses of one set
    have distinct ranks, so they get distinct ways."""
    free = (ways < WAYS) & ~taken
    pick = free & (_lru_position(age, free, ways) == rank)
    return tl.max(tl.where(pick, ways, -1), axis=0)


@triton.jit
def _probe(ways_ptr, slot, my_set, step, ways, WAYS: tl.constexpr, WAYS_P2: tl.constexpr):
    """(tags [WAYS_P2] of the slot's set, -1 past WAYS; their ages; the lowest way holding the
    slot, WAYS_P2 if none), from one load of the set's words. Padding (slot < 0) reads nothing."""
    real = ways < WAYS
    words = tl.load(ways_ptr + my_set * WAYS + ways, mask=(slot >= 0) & real, other=0)
    tags, age = _unpack_ways(words, step)
    return tags, age, tl.min(tl.where(real & (tags == slot), ways, WAYS_P2), axis=0)


@triton.jit
def _store_row(i, row, idx_ptr, outside_ptr, rows_ptr, HAS_OUTSIDE: tl.constexpr):
    """Request i's returned row, or the caller's row where outside."""
    if HAS_OUTSIDE:
        row = tl.where(tl.load(outside_ptr + i) != 0, tl.load(rows_ptr + i), row)
    tl.store(idx_ptr + i, row)


@triton.jit
def _store_request(i, slot, row, entry, hit, installed, miss, idx_ptr, entry_ptr, kind_ptr, tag_ptr,
                   outside_ptr, rows_ptr, HAS_OUTSIDE: tl.constexpr):
    """Request i's returned row and what commit needs (the slot too: a commit launched on another
    stream must not read the caller's slots)."""
    _store_row(i, row, idx_ptr, outside_ptr, rows_ptr, HAS_OUTSIDE)
    tl.store(entry_ptr + i, tl.where(hit | installed, entry, -1))
    kind = tl.where(miss, tl.where(installed, KIND_INSTALLED, KIND_STAGED), KIND_PADDING)
    tl.store(kind_ptr + i, tl.where(hit, KIND_HIT, kind).to(tl.int8))
    tl.store(tag_ptr + i, slot)


@triton.jit
def cache_lookup_kernel(
    slots_ptr,  # [M] int64 arena slots; < 0 = padding
    ways_ptr,  # [NUM_SETS * WAYS] int64 way words (read only here, but for INLINE's stamps)
    counters_ptr,  # [6] int64: the step is read; program (0, 0) zeroes LAST_MISSES
    call_ptr,  # [1] int64 out: this call's step (program (0, 0))
    pos_ptr,  # [max_selected, 4] int64: INLINE's counts per request position
    src_ptr,  # [S, PAGE_WORDS] words: the arena (a device tensor or a host pool under UVA)
    pool_ptr,  # [CAPACITY + max_selected, PAGE_WORDS] words: cache rows, then staging rows
    idx_ptr,  # [M] int64 out: a hit's entry, CAPACITY + i for a miss, 0 padding; rows[i] if outside
    entry_ptr,  # [M] int64 out: the entry commit stamps (a hit's or the installed way), -1 none
    kind_ptr,  # [M] int8 out: KIND_*
    tag_ptr,  # [M] int64 out: the request's slot (what commit tags an installed way with)
    outside_ptr,  # [M] int8: 1 = return rows[i] instead of a cache row (read only if HAS_OUTSIDE)
    rows_ptr,  # [M] int64 (read only if HAS_OUTSIDE)
    done_ptr,  # [1] int32: the ticket counter (FUSED), back to 0 after the call
    M,
    NUM_SETS,
    CAPACITY,
    WAYS: tl.constexpr,
    WAYS_P2: tl.constexpr,
    PAGE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
    SCAN: tl.constexpr,
    HAS_OUTSIDE: tl.constexpr,
    FUSED: tl.constexpr,  # the last program to finish commits (no second launch)
    INLINE: tl.constexpr,  # every program stamps its own way and counts (no commit; step unchanged)
    COMMIT_BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,  # cdiv(PAGE_WORDS, BLOCK): INLINE's one program copies them all
):
    i = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + i)
    step = tl.load(counters_ptr + STEP)
    if INLINE:  # loaded first: the load is then off the program's chain (0.3 us a lookup on an H200)
        counts = tl.load(pos_ptr + i * 4 + tl.arange(0, 4))
    my_set = set_of_slot(tl.maximum(slot, 0), NUM_SETS)  # int64
    ways = tl.arange(0, WAYS_P2)
    tags, age, hit_way = _probe(ways_ptr, slot, my_set, step, ways, WAYS, WAYS_P2)
    hit = (slot >= 0) & (hit_way < WAYS_P2)
    miss = (slot >= 0) & (hit_way == WAYS_P2)
    # The page's read (PCIe for a host arena) is issued before the scan, so that the two overlap.
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # PAGE_WORDS is a multiple of 4 (16 bytes), so each thread's 4 words are one vector load.
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    in_page = offs < PAGE_WORDS
    # int64 row offsets: row * PAGE_WORDS passes 2**31 for pools over 8 GiB. Hits load nothing.
    vals = tl.load(src_ptr + tl.maximum(slot, 0) * PAGE_WORDS + offs, mask=in_page & miss)
    # NOTE: a scheduling fence, not a synchronisation: without it ptxas (Triton 3.6, sm_90) sinks
    # the read below the scan; a barrier does not wait for loads in flight.
    tl.debug_barrier()
    taken, rank = _scan_call(slots_ptr, M, i, my_set, tags, ways, miss, NUM_SETS, SCAN)
    victim = _victim_way(age, taken, rank, ways, WAYS)
    installed = miss & (victim >= 0)
    entry = my_set * WAYS + tl.where(hit, hit_way, victim)  # a real entry where hit | installed
    staging = (CAPACITY + i).to(tl.int64)
    tl.store(pool_ptr + staging * PAGE_WORDS + offs, vals, mask=in_page & miss)
    tl.store(pool_ptr + entry * PAGE_WORDS + offs, vals, mask=in_page & installed)
    if INLINE:
        # One program per request (grid (M, 1)): its install is seen by programs that run after
        # it, so a page's chunks must not be split over programs that probe the tables apart.
        for c in tl.static_range(1, CHUNKS):
            offs_c = c * BLOCK + tl.arange(0, BLOCK)
            in_page_c = offs_c < PAGE_WORDS
            vals_c = tl.load(src_ptr + tl.maximum(slot, 0) * PAGE_WORDS + offs_c, mask=in_page_c & miss)
            tl.store(pool_ptr + staging * PAGE_WORDS + offs_c, vals_c, mask=in_page_c & miss)
            tl.store(pool_ptr + entry * PAGE_WORDS + offs_c, vals_c, mask=in_page_c & installed)
        row = tl.where(hit, entry, tl.where(miss, staging, 0))  # (chunk is 0: the grid is (M, 1))
        _store_row(i, row, idx_ptr, outside_ptr, rows_ptr, HAS_OUTSIDE)
        # One word: a miss of this set that reads it sees the old way or the installed one.
        tl.store(ways_ptr + entry, pack_way(slot, step), mask=hit | installed)
        _count_position(pos_ptr, i, counts, slot >= 0, hit, miss, miss & ~installed)
    else:
        if chunk == 0:
            row = tl.where(hit, entry, tl.where(miss, staging, 0))
            _store_request(i, slot, row, entry, hit, installed, miss, idx_ptr, entry_ptr, kind_ptr, tag_ptr,
                           outside_ptr, rows_ptr, HAS_OUTSIDE)
        if FUSED:
            # Every store above is made visible before the ticket (barrier, then a release at GPU
            # scope); the last ticket's acquire sees them all, and no table read is left to come.
            tl.debug_barrier()
            ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
                tl.debug_barrier()
                _commit_all(tag_ptr, entry_ptr, kind_ptr, ways_ptr, counters_ptr, M, COMMIT_BLOCK)
                tl.store(done_ptr, 0)
        elif (chunk == 0) & (i == 0):  # no program of this launch reads `call` or LAST_MISSES
            tl.store(call_ptr, step)
            tl.store(counters_ptr + LAST_MISSES, 0)  # commit adds this call's misses


@triton.jit
def _count_position(pos_ptr, i, old, request, hit, miss, staged):
    """INLINE: add one request's counts to row i of pos (requests, hits, misses, not installed),
    whose value `old` [4] the program loaded when it started. Only this program touches row i in
    a call, and calls are ordered on the stream."""
    lane = tl.arange(0, 4)
    add = tl.where(lane == 0, request, tl.where(lane == 1, hit, tl.where(lane == 2, miss, staged)))
    tl.store(pos_ptr + i * 4 + lane, old + add.to(tl.int64))


@triton.jit
def _stamp(slots_ptr, entry_ptr, kind_ptr, ways_ptr, step, offs, M):
    """Stamp requests `offs` (the ways they hit or were installed into: tag and step in one word);
    returns their counts (requests, hits, misses, not installed). Entries are distinct: a hit's
    way holds its (distinct) slot, a miss's way was free (not hit) and misses of one set got
    distinct ways. Loads bypass L1 (.cg): other programs of the fused launch wrote the scratch."""
    in_range = offs < M
    entry = tl.load(entry_ptr + offs, mask=in_range, other=-1, cache_modifier=".cg")
    kind = tl.load(kind_ptr + offs, mask=in_range, other=KIND_PADDING, cache_modifier=".cg").to(tl.int32)
    stamp = entry >= 0
    slot = tl.load(slots_ptr + offs, mask=stamp, other=0, cache_modifier=".cg")
    tl.store(ways_ptr + entry, pack_way(slot, step), mask=stamp)
    # Sums of integers: the totals do not depend on the order of the programs.
    return (tl.sum((kind != KIND_PADDING).to(tl.int64)), tl.sum((kind == KIND_HIT).to(tl.int64)),
            tl.sum((kind >= KIND_INSTALLED).to(tl.int64)), tl.sum((kind == KIND_STAGED).to(tl.int64)))


@triton.jit
def _commit_all(slots_ptr, entry_ptr, kind_ptr, ways_ptr, counters_ptr, M, BLOCK: tl.constexpr):
    """One program commits the whole call (FUSED): stamps, counts, the step advanced. The counters
    are read and written as one vector: the tail after the last ticket is one round trip of loads
    (the counters and the first block's scratch, independent), then stores."""
    lane = tl.arange(0, 8)
    real = lane < NUM_COUNTERS
    counters = tl.load(counters_ptr + lane, mask=real, other=0, cache_modifier=".cg")  # [8] int64
    step = tl.sum(tl.where(lane == STEP, counters, 0))
    requests = tl.zeros((), dtype=tl.int64)
    hits, misses, staged = requests, requests, requests
    for start in range(0, M, BLOCK):
        r, h, m, n = _stamp(slots_ptr, entry_ptr, kind_ptr, ways_ptr, step, start + tl.arange(0, BLOCK), M)
        requests, hits, misses, staged = requests + r, hits + h, misses + m, staged + n
    add = (tl.where(lane == REQUESTS, requests, 0) + tl.where(lane == HITS, hits, 0)
           + tl.where(lane == MISSES, misses, 0) + tl.where(lane == NOT_INSTALLED, staged, 0)
           + tl.where(lane == STEP, 1, 0))
    tl.store(counters_ptr + lane, tl.where(lane == LAST_MISSES, misses, counters + add), mask=real)


@triton.jit
def cache_commit_kernel(
    slots_ptr,  # [M] int64: the lookup's slots (its tag scratch)
    entry_ptr,  # [M] int64: from lookup
    kind_ptr,  # [M] int8: from lookup
    ways_ptr,  # [NUM_SETS * WAYS] int64: hit and installed ways get (slot, step)
    counters_ptr,  # [6] int64: this call's counts added; program 0 advances the step
    call_ptr,  # [1] int64: this call's step
    M,
    BLOCK: tl.constexpr,
):
    # Every program reads the step from `call`, so program 0 may advance the counter.
    step = tl.load(call_ptr)
    requests, hits, misses, staged = _stamp(slots_ptr, entry_ptr, kind_ptr, ways_ptr, step,
                                            tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), M)
    tl.atomic_add(counters_ptr + REQUESTS, requests)
    tl.atomic_add(counters_ptr + HITS, hits)
    tl.atomic_add(counters_ptr + MISSES, misses)
    tl.atomic_add(counters_ptr + LAST_MISSES, misses)
    tl.atomic_add(counters_ptr + NOT_INSTALLED, staged)
    tl.store(counters_ptr + STEP, step + 1, mask=tl.program_id(0) == 0)
