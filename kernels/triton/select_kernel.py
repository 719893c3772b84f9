"""@triton.jit code for the decode selection (kernels/select.py is the reference).

Top-k without a sort, in two launches: `chunk_topk_kernel` keeps the best k of each chunk of a
row's pages (keys made on load: +inf forced, -inf past the row, between them the share-averaged
group score of Eq. 5, computed from the scores and the heads' normalisers), and
`select_slots_kernel` keeps the best `budget` of those candidates and writes, per selected
entry, the tier slot to look up, the valid token count and the attention-pool index. Both find
the k-th largest key on the keys' order-preserving int32 images (at most 32 / BITS counting passes
over registers, `_take`: a bisection, or two bits a pass, each stopping once the keys at or above
its bound are exactly the ones needed) and compact with a prefix sum, so ties go to
the lower position and the result is in ascending position order. `dense_slots_kernel` is the
every-page case.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ordered(x):
    """float32 -> int32 with the same order (-inf < finite < +inf; no NaN here)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _take(ik, valid, k, BITS: tl.constexpr):
    """Mask of the min(k, valid) largest keys among `valid` (ties: lower index first), and its size.

    The threshold takes serial passes of one block reduction each: their latency, not the work, is
    the cost. BITS = 1 bisects the 32 bits, BITS = 2 fixes two a pass (_threshold_radix2); both
    stop as soon as the keys at or above their bound are exactly the ones needed."""
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    need = tl.minimum(k, n_valid)
    key = ik.to(tl.int64)
    if BITS == 1:
        lo, fill, _ = _threshold_bisect(key, valid, need)
    else:
        tl.static_assert(BITS == 2, "BITS is 1 or 2")
        lo, fill, _ = _threshold_radix2(key, valid, need, n_valid)
    greater = valid & (key > lo)
    equal = valid & (key == lo)
    take = greater | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= fill))
    return take & (need > 0), need


@triton.jit
def _threshold_bisect(key, valid, need):
    """(T, fill, passes): a T whose keys at or above it hold the best need (int64 keys in the int32
    range; where a tie straddles the need-th key, the largest T with count(key >= T) >= need), and
    how many keys equal to T the best need take (need - count(key > T)).

    Invariant: count(key >= lo) >= need and no T above hi has that count. A pass whose count is
    exactly need ends the search (lo = hi = mid): the keys at or above mid are the best need, so
    distinct keys stop once the interval is narrower than the gap below the need-th key (about half
    of the 32 passes for a few thousand float scores); ties at the boundary run all 32."""
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    passes = tl.zeros((), dtype=tl.int32)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        count = tl.sum((valid & (key >= mid)).to(tl.int32), axis=0)
        enough = count >= need
        lo = tl.where(enough, mid, lo)
        hi = tl.where(count == need, mid, tl.where(enough, hi, mid - 1))
        passes += 1
    return lo, need - tl.sum((valid & (key > lo)).to(tl.int32), axis=0), passes


@triton.jit
def _threshold_radix2(key, valid, need, n_valid):
    """_threshold_bisect's contract, two bits a pass, most significant first. A pass counts the keys
    still in play (their higher bits are T's) with a digit >= 1, >= 2 and >= 3 in one reduction:
    three 21-bit fields of an int64 (N < 2**21). T's digit is how many of those counts reach what is
    still needed (they do not increase with the digit); the keys in play above it leave the need.
    When every key in play is needed, T is the prefix followed by zeros and the search ends."""
    tl.static_assert(key.shape[0] < 2097152, "the packed counts need fewer than 2**21 keys")
    u = key + 2147483647 + 1  # [N] in [0, 2**32), the order kept
    field = (1 << 21) - 1
    prefix = tl.zeros((), dtype=tl.int64)  # T's bits fixed so far
    rem = need.to(tl.int64)  # invariant (need > 0): 1 <= rem <= in_play
    in_play = n_valid.to(tl.int64)  # valid keys whose fixed bits are T's
    shift = tl.full((), 30, tl.int64)  # of the next digit
    passes = tl.zeros((), dtype=tl.int32)
    while (shift >= 0) & (rem < in_play):
        digit = (u >> shift) & 3
        counted = valid & ((u >> (shift + 2)) == prefix)
        packed = tl.where(counted, (digit >= 1).to(tl.int64) + ((digit >= 2).to(tl.int64) << 21)
                          + ((digit >= 3).to(tl.int64) << 42), 0)
        total = tl.sum(packed, axis=0)
        ge1, ge2, ge3 = total & field, (total >> 21) & field, total >> 42
        d = (ge1 >= rem).to(tl.int64) + (ge2 >= rem).to(tl.int64) + (ge3 >= rem).to(tl.int64)
        above = tl.where(d == 0, ge1, tl.where(d == 1, ge2, tl.where(d == 2, ge3, 0)))
        at = tl.where(d == 0, in_play, tl.where(d == 1, ge1, tl.where(d == 2, ge2, ge3)))
        rem -= above
        in_play = at - above
        prefix = prefix * 4 + d
        shift -= 2
        passes += 1
    t = (prefix << (shift + 2)) - 2147483647 - 1  # the prefix, then zeros
    return t, need - tl.sum((valid & (key > t)).to(tl.int32), axis=0), passes


@triton.jit
def _share_average(s_ptr, stats_ptr, row, pos, P, G: tl.constexpr, CH: tl.constexpr):
    """m_bar [CH] of pages `pos` (Eq. 5): mean over the G heads of exp(s - max) / sum, with the
    heads' normalisers (max, sum) from stats [ROWS, G, 2]; s: [ROWS, G, P] float32."""
    m = tl.zeros((CH,), dtype=tl.float32)
    for g in tl.static_range(G):
        top = tl.load(stats_ptr + (row * G + g) * 2)
        total = tl.load(stats_ptr + (row * G + g) * 2 + 1)
        s = tl.load(s_ptr + (row * G + g) * P + pos, mask=pos < P, other=float("-inf"))
        m += tl.exp(s - tl.where(top == float("-inf"), 0.0, top)) / tl.maximum(total, 1e-30)
    return m / G


@triton.jit
def chunk_topk_kernel(s_ptr, stats_ptr, num_pages_ptr, cand_key_ptr, cand_pos_ptr, P, K, NC, SINK, RECENT,
                      HKV: tl.constexpr, G: tl.constexpr, CH: tl.constexpr, BITS: tl.constexpr):
    """Grid (NC, Bt * HKV). s: [Bt * HKV, G, P] scores and stats [Bt * HKV, G, 2] normalisers
    (float32, contiguous); candidates: [Bt * HKV, NC * K] (key float32, position int32): chunk c's
    best K keys at [c * K, c * K + K), -inf / -1 after."""
    row = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(0)
    pos = chunk * CH + tl.arange(0, CH)
    n = tl.load(num_pages_ptr + row // HKV).to(tl.int32)
    s = _share_average(s_ptr, stats_ptr, row, pos, P, G, CH)
    s = tl.maximum(tl.where(s != s, 0.0, s), -3.4028234663852886e38)  # NaN -> 0; finite
    key = tl.where((pos < SINK) | (pos >= n - RECENT), float("inf"), s)
    valid = (pos < n) & (pos < P)
    _store_best(key, pos, valid, K, cand_key_ptr, cand_pos_ptr, row * NC * K + chunk * K, CH, BITS)


@triton.jit
def shard_topk_kernel(s_ptr, stats_ptr, first_ptr, settled_ptr, num_pages_ptr, cand_key_ptr, cand_pos_ptr,
                      P, K, NC, SINK, RECENT, HKV: tl.constexpr, G: tl.constexpr, CH: tl.constexpr,
                      BITS: tl.constexpr):
    """chunk_topk_kernel for one rank of a context-parallel sequence (kernels/select.py
    shard_chunk_topk_ref): column j is global page first + j, and only the pages that compete for
    the budget enter (full pages of the rank, not the sink or the recent ones: the rank adds those
    by position). stats are the global normalisers; first, settled (full pages of the rank's
    range), num_pages (the sequence's, open page included): [Bt]. Candidates as chunk_topk_kernel,
    positions = columns."""
    row = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(0)
    pos = chunk * CH + tl.arange(0, CH)
    b = row // HKV
    n = tl.load(num_pages_ptr + b).to(tl.int32)
    gpos = tl.load(first_ptr + b).to(tl.int32) + pos
    settled = tl.load(settled_ptr + b).to(tl.int32)
    s = _share_average(s_ptr, stats_ptr, row, pos, P, G, CH)
    key = tl.maximum(tl.where(s != s, 0.0, s), -3.4028234663852886e38)  # NaN -> 0; finite
    valid = (pos < settled) & (pos < P) & (gpos >= SINK) & (gpos < n - RECENT)
    _store_best(key, pos, valid, K, cand_key_ptr, cand_pos_ptr, row * NC * K + chunk * K, CH, BITS)


@triton.jit
def _store_best(key, pos, valid, K, cand_key_ptr, cand_pos_ptr, out, CH: tl.constexpr, BITS: tl.constexpr):
    """The best K valid keys [CH] (ties: lower pos) at out .. out + K - 1 in ascending pos, then
    -inf / -1 up to K (K <= CH)."""
    take, count = _take(_ordered(key), valid, K, BITS)
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(cand_key_ptr + out + slot, key, mask=take)
    tl.store(cand_pos_ptr + out + slot, pos, mask=take)
    r = tl.arange(0, CH)
    tl.store(cand_key_ptr + out + r, float("-inf"), mask=(r >= count) & (r < K))
    tl.store(cand_pos_ptr + out + r, -1, mask=(r >= count) & (r < K))


@triton.jit
def _entry(b, h, j, keep, n, num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr, st_b,
           layer_base, write_front, write_base, HKV: tl.constexpr, PAGE: tl.constexpr):
    """(slot, lens, is_open, idx) of selected page positions j (see decode_page_slots)."""
    is_open = keep & (j == n - 1)
    settled = keep & (j != n - 1)
    pid = tl.load(table_ptr + b * st_b + j, mask=settled, other=0).to(tl.int64)
    slot = tl.where(settled, (layer_base + pid) * HKV + h, -1)
    tail_len = tl.load(tail_len_ptr + b).to(tl.int32)
    lens = tl.where(is_open, tail_len, tl.where(settled, PAGE, 0))
    open_idx = write_front + (write_base + tl.load(tail_loc_ptr + b).to(tl.int64)) * HKV + h
    return slot, lens, is_open, tl.where(is_open, open_idx, slot)


@triton.jit
def _store_entries(slots_ptr, lens_ptr, open_ptr, idx_ptr, at, slot, lens, is_open, idx, mask):
    """One DecodeSelection's entries (_entry's values) at offsets `at` where mask."""
    tl.store(slots_ptr + at, slot, mask=mask)
    tl.store(lens_ptr + at, lens, mask=mask)
    tl.store(open_ptr + at, is_open.to(tl.int8), mask=mask)
    tl.store(idx_ptr + at, idx, mask=mask)


# NOTE: C is not specialised: Triton 3.6 fails to compile this kernel (RemoveLayoutConversions,
# "operand does not dominate this use") when it may assume C divisible by 16, as C = chunks * k
# usually is; reproduced offline for sm_90 (tests/kernels/test_triton_compile.py).
@triton.jit(do_not_specialize=["C"])
def select_slots_kernel(
    cand_key_ptr, cand_pos_ptr, budgets_ptr, num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr,
    slots_ptr, lens_ptr, open_ptr, idx_ptr,
    C, K, st_b, layer_base, write_front, write_base,
    HKV: tl.constexpr, PAGE: tl.constexpr, CB: tl.constexpr, KB: tl.constexpr, BITS: tl.constexpr,
):
    """Grid (Bt * HKV,). candidates: [Bt * HKV, C]; outputs [Bt * HKV, K]: the best budget[b]
    candidates in ascending position order, then padding (slot and idx -1, lens 0, not open)."""
    row = tl.program_id(0).to(tl.int64)
    b, h = row // HKV, row % HKV
    c = tl.arange(0, CB)
    key = tl.load(cand_key_ptr + row * C + c, mask=c < C, other=float("-inf"))
    pos = tl.load(cand_pos_ptr + row * C + c, mask=c < C, other=-1).to(tl.int64)
    budget = tl.minimum(tl.load(budgets_ptr + b).to(tl.int32), K)
    take, count = _take(_ordered(key), key > float("-inf"), budget, BITS)
    at = tl.cumsum(take.to(tl.int32), axis=0) - 1  # ascending: chunks and positions in order
    n = tl.load(num_pages_ptr + b).to(tl.int64)
    slot, lens, is_open, idx = _entry(b, h, pos, take, n, num_pages_ptr, tail_len_ptr, tail_loc_ptr,
                                      table_ptr, st_b, layer_base, write_front, write_base, HKV, PAGE)
    out = row * K
    _store_entries(slots_ptr, lens_ptr, open_ptr, idx_ptr, out + at, slot, lens, is_open, idx, take)
    r = tl.arange(0, KB)
    pad = (r >= count) & (r < K)
    slot, lens, is_open, idx = _entry(b, h, r.to(tl.int64), r < 0, n, num_pages_ptr, tail_len_ptr,
                                      tail_loc_ptr, table_ptr, st_b, layer_base, write_front, write_base,
                                      HKV, PAGE)
    _store_entries(slots_ptr, lens_ptr, open_ptr, idx_ptr, out + r, slot, lens, is_open, idx, pad)


@triton.jit
def dense_slots_kernel(
    num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr, slots_ptr, lens_ptr, open_ptr, idx_ptr,
    K, st_b, layer_base, write_front, write_base,
    HKV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (cdiv(K, BLOCK), Bt * HKV): entry r is page r (every page of the row), then padding."""
    row = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b, h = row // HKV, row % HKV
    n = tl.load(num_pages_ptr + b).to(tl.int64)
    j = r.to(tl.int64)
    slot, lens, is_open, idx = _entry(b, h, j, j < n, n, num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr,
                                      st_b, layer_base, write_front, write_base, HKV, PAGE)
    out = row * K + r
    in_k = r < K
    _store_entries(slots_ptr, lens_ptr, open_ptr, idx_ptr, out, slot, lens, is_open, idx, in_k)


@triton.jit
def _forced(w, n, first, count, SINK: tl.constexpr, RECENT: tl.constexpr, NO_PAGE):
    """Entry w of a rank's forced pages (w < SINK: sink page w; then the recent pages n - RECENT ..),
    its global position where the rank holds it and it exists, else NO_PAGE; NO_PAGE past them."""
    fixed = tl.where(w < SINK, w, n - RECENT + (w - SINK)).to(tl.int64)
    mine = (fixed >= first) & (fixed < first + count) & (fixed >= 0) & (fixed < n)
    return tl.where((w < SINK + RECENT) & mine, fixed, NO_PAGE)


@triton.jit
def shard_select_kernel(
    gath_ptr, cand_ptr, take_ptr, first_ptr, count_ptr, num_pages_ptr, out_ptr,
    R, ROWS, T, EMPTY, NO_PAGE,
    SINK: tl.constexpr, RECENT: tl.constexpr, HKV: tl.constexpr, TB: tl.constexpr, WB: tl.constexpr,
    GC: tl.constexpr, UC: tl.constexpr,
):
    """Grid (Bt * HKV,): kernels/select.py shard_select_ref for one (row, KV head).

    gathered [R, Bt * HKV, T] and candidates [Bt * HKV, T] int64 order keys (distinct, EMPTY for
    none); out [Bt * HKV, W] int64, W = SINK + RECENT + T: the rank's selected global positions
    ascending, -1 after them. A candidate is kept when it is real and fewer than
    need = min(max(take, 1), real gathered) gathered keys beat it (the keys are distinct: that is
    global_threshold's take-th best), without a sort: the counts run over chunks of GC gathered keys,
    and each output's place is its count of smaller (position, index) entries over chunks of UC."""
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    j = tl.arange(0, TB)
    cand = tl.load(cand_ptr + row * T + j, mask=j < T, other=EMPTY)  # [TB]
    real_cand = cand > EMPTY
    beaten = tl.zeros([TB], dtype=tl.int32)
    n_real = tl.zeros((), dtype=tl.int32)
    for start in range(0, R * T, GC):
        i = start + tl.arange(0, GC)
        rank_base = (i // T).to(tl.int64) * ROWS * T  # int64: R * Bt * HKV * T may pass 2**31
        g = tl.load(gath_ptr + rank_base + row * T + i % T, mask=i < R * T, other=EMPTY)
        real = g > EMPTY
        n_real += tl.sum(real.to(tl.int32), axis=0)
        beaten += tl.sum((real[None, :] & (g[None, :] > cand[:, None])).to(tl.int32), axis=1)
    need = tl.minimum(tl.maximum(tl.load(take_ptr + b).to(tl.int32), 1), n_real)
    kept = real_cand & (beaten < need)
    # The low 32 bits of the key (NO_PAGE - position), without a literal Triton might type uint32
    # and sign-extend: cand - floor(cand / 2**32) * 2**32, arithmetic shifts.
    pos = NO_PAGE - (cand - ((cand >> 32) << 32))
    # The combined row: w < F forced pages (sink, then recent), then the T candidates.
    F: tl.constexpr = SINK + RECENT
    w = tl.arange(0, WB)
    n = tl.load(num_pages_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b).to(tl.int64)
    count = tl.load(count_ptr + b).to(tl.int64)
    forced = _forced(w, n, first, count, SINK, RECENT, NO_PAGE)
    total = F + T
    out = row * total
    # The candidates' values go through `out` (written, then read back in chunks): a register
    # vector cannot be indexed by another layout's positions.
    cand_val = tl.where(kept, pos, NO_PAGE)
    tl.store(out_ptr + out + F + j, cand_val, mask=j < T)
    tl.debug_barrier()
    cw = tl.load(out_ptr + out + w, mask=(w >= F) & (w < total), other=NO_PAGE)
    val = tl.where(w < F, forced, cw)  # [WB]
    place = tl.zeros([WB], dtype=tl.int32)
    for ustart in range(0, total, UC):
        u = ustart + tl.arange(0, UC)
        uc = tl.load(out_ptr + out + u, mask=(u >= F) & (u < total), other=NO_PAGE)
        uval = tl.where(u < F, _forced(u, n, first, count, SINK, RECENT, NO_PAGE), uc)
        smaller = uval[None, :] < val[:, None]  # [WB, UC]
        tie_before = (uval[None, :] == val[:, None]) & (u[None, :] < w[:, None])
        place += tl.sum(((smaller | tie_before) & (u[None, :] < total)).to(tl.int32), axis=1)
    tl.debug_barrier()  # every read of `out` above is done before the sorted row overwrites it
    tl.store(out_ptr + out + place, tl.where(val == NO_PAGE, -1, val), mask=w < total)


@triton.jit
def shard_slots_kernel(
    sel_ptr, first_ptr, num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr,
    slots_ptr, lens_ptr, open_ptr, idx_ptr,
    K, st_b, layer_base, write_front, write_base,
    HKV: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (cdiv(K, BLOCK), Bt * HKV): kernels/select.py shard_slots_ref. sel [Bt * HKV, K] a
    rank's selected global positions (-1 padding); global page g is the rank's local page
    g - first, and its local page max(num_pages - first, 1) - 1 is the open page (past the range on
    a rank without it). Entries as select_slots_kernel's, in sel's order."""
    row = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b, h = row // HKV, row % HKV
    in_k = r < K
    g = tl.load(sel_ptr + row * K + r, mask=in_k, other=-1)
    first = tl.load(first_ptr + b).to(tl.int64)
    j = tl.where(g >= 0, g - first, -1)
    n = tl.maximum(tl.load(num_pages_ptr + b).to(tl.int64) - first, 1)
    slot, lens, is_open, idx = _entry(b, h, j, j >= 0, n, num_pages_ptr, tail_len_ptr, tail_loc_ptr,
                                      table_ptr, st_b, layer_base, write_front, write_base, HKV, PAGE)
    out = row * K + r
    _store_entries(slots_ptr, lens_ptr, open_ptr, idx_ptr, out, slot, lens, is_open, idx, in_k)


@triton.jit
def shard_candidates_kernel(key_ptr, col_ptr, first_ptr, out_ptr, C, T, EMPTY, NO_PAGE,
                            HKV: tl.constexpr, CB: tl.constexpr, TB: tl.constexpr, BITS: tl.constexpr):
    """Grid (Bt * HKV,): kernels/select.py local_candidates from shard_topk_kernel's output (keys
    float32 and columns int32 [Bt * HKV, C], chunk by chunk in ascending column order, -inf / -1
    for none): the best T under (key desc, position asc) as order keys, written in ascending
    position order (not descending: every consumer counts or sorts), then EMPTY up to T."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CB)
    key = tl.load(key_ptr + row * C + c, mask=c < C, other=float("-inf"))
    key = tl.where(key == 0.0, 0.0, key)  # -0.0 as +0.0, as order_keys compares them
    col = tl.load(col_ptr + row * C + c, mask=c < C, other=-1)
    valid = (key > float("-inf")) & (col >= 0)
    take, count = _take(_ordered(key), valid, T, BITS)  # ties: the lower index, i.e. the lower position
    # order_keys: the float's bits made monotonic (-0.0 as +0.0), then NO_PAGE - position below them
    bits = key.to(tl.int32, bitcast=True).to(tl.int64)
    mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    pos = tl.load(first_ptr + row // HKV).to(tl.int64) + col
    ordered = (mono << 32) + (NO_PAGE - pos)  # the low part is in [0, 2**32): + is |
    at = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * T + at, ordered, mask=take)
    r = tl.arange(0, TB)
    tl.store(out_ptr + row * T + r, tl.zeros([TB], dtype=tl.int64) + EMPTY, mask=(r >= count) & (r < T))
