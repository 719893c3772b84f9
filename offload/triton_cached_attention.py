"""Sparse decode attention that looks its pages up in the hot-page cache itself (@triton.jit code
only; the launcher and its reference are in `cached_attention.py`).

One program of `cached_decode_kernel` attends one (sequence b, KV head h, split) as
`sparse_decode_kernel` does (kernels/triton/attention_kernel.py, same online softmax, same
partials), and does for each of its selected pages what `cache_lookup_kernel` does for one
request (triton_cache.py): probe the page's set; a hit is read from its cache way; a miss is
read from the arena over UVA straight into the attention's registers (no staging row), and is
then written into the way the LRU rule gives it (the same victim choice, so the same tables);
the open page (`is_open`; its slot must be -1, as the selection's is) is read from its pool
row. Each request's entry, kind and slot go to the cache's scratch; the commit (stamps,
counters, the step) runs in `merge_commit_kernel`, whose extra programs stamp while the others
merge the splits.

Request i of the call is page k of row (b, h): i = (b * HKV + h) * K + k, the order of the
selection flattened (the lookup's order, so misses rank alike in their sets).

Invariants the reads rely on (those of the lookup): the programs only READ tags and last, so
each sees the tables as they were before the call; a way that some request hits is never a
victim in the same call, so no program reads a way that another one is filling.
"""

import triton
import triton.language as tl
from lockserve.kernels.triton.attention_kernel import attend_block, merge_row, store_partial

from .triton_cache import (
    KIND_HIT,
    KIND_INSTALLED,
    KIND_PADDING,
    KIND_STAGED,
    LAST_MISSES,
    STEP,
    _probe,
    _scan_call,
    _victim_way,
    commit_block,
    set_of_slot,
)  # fmt: skip


@triton.jit
def _request(slots_ptr, open_ptr, tags_ptr, i, in_sel, ways, NUM_SETS, WAYS: tl.constexpr,
             WAYS_P2: tl.constexpr):
    """Request i (nothing where not in_sel): (slot, its set, the set's tags [WAYS_P2], hit,
    miss, open, the hit's way)."""
    is_open = tl.load(open_ptr + i, mask=in_sel, other=0) != 0
    slot = tl.load(slots_ptr + i, mask=in_sel, other=-1)  # int64, < 0 = nothing to look up
    my_set = set_of_slot(tl.maximum(slot, 0), NUM_SETS)
    tags, hit_way = _probe(tags_ptr, slot, my_set, ways, WAYS, WAYS_P2)
    hit = (slot >= 0) & (hit_way < WAYS_P2)
    return slot, my_set, tags, hit, (slot >= 0) & ~hit, is_open, hit_way


@triton.jit
def cached_decode_kernel(
    q_ptr, pool_ptr, src_ptr, slots_ptr, open_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr,
    tags_ptr, last_ptr, counters_ptr, call_ptr, entry_ptr, kind_ptr, tag_ptr,
    K, pages_per_split, sm_scale, M, NUM_SETS,
    sq_b, sq_h, sq_d, sp_s, sp_kv, sp_t, sp_d, ss_s, ss_kv, ss_t, sln_b, sln_h, sln_k,
    so_s, so_b, so_h, so_d, sl_s, sl_b, sl_h,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    B: tl.constexpr, BB: tl.constexpr, PAGES: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, WAYS: tl.constexpr, WAYS_P2: tl.constexpr,
    SCAN: tl.constexpr,
):
    """Grid (HKV * splits, Bt). slots [M] int64 arena slots (< 0: none), open [M] int8, rows [M]
    int64 (an open page's pool row), contiguous in request order; pool [R, 2, B, D] whose rows
    [0, NUM_SETS * WAYS) are the cache's ways; src [S, 2, B, D] the arena (contiguous, so its
    dim-3 stride is 1). o, lse: split partials as in sparse_decode_kernel."""
    pid = tl.program_id(0)
    h = pid % HKV
    split = pid // HKV
    b = tl.program_id(1)
    if (pid == 0) & (b == 0):  # no program of this launch reads `call` or LAST_MISSES
        tl.store(call_ptr, tl.load(counters_ptr + STEP))
        tl.store(counters_ptr + LAST_MISSES, 0)  # the commit adds this call's misses
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    head = (h * G + g).to(tl.int64)
    q_off = b.to(tl.int64) * sq_b + head[:, None] * sq_h + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(DOT)  # [GP, DP]
    top = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    ways = tl.arange(0, WAYS_P2)
    t = tl.arange(0, PAGES * BB)
    tok = t % BB
    page_of = t // BB  # [T]: which page of the iteration a token row belongs to
    in_page = tok < B
    dmask = (d < D)[None, :]
    first = (b.to(tl.int64) * HKV + h) * K  # request index of the row's page 0
    k_lo = split * pages_per_split
    k_hi = tl.minimum(k_lo + pages_per_split, K)
    for k0 in range(k_lo, k_hi, PAGES):
        # Where each page is read: pool_row (a hit's way or the open page's row) or host_slot.
        pool_row = tl.full((PAGES * BB,), -1, tl.int64)
        host_slot = tl.full((PAGES * BB,), -1, tl.int64)
        for p in tl.static_range(PAGES):
            i = first + k0 + p
            in_sel = k0 + p < k_hi
            slot, my_set, tags, hit, miss, is_open, hit_way = _request(
                slots_ptr, open_ptr, tags_ptr, i, in_sel, ways, NUM_SETS, WAYS, WAYS_P2)
            open_row = tl.load(rows_ptr + i, mask=in_sel & is_open, other=-1)
            row = tl.where(is_open, open_row, tl.where(hit, my_set * WAYS + hit_way, -1))
            pool_row = tl.where(page_of == p, row, pool_row)
            host_slot = tl.where(page_of == p, tl.where(miss, slot, -1), host_slot)
        k = k0 + page_of
        plen = tl.load(lens_ptr + b.to(tl.int64) * sln_b + h * sln_h + k * sln_k, mask=k < k_hi, other=0)
        valid = ((pool_row >= 0) | (host_slot >= 0)) & (tok < plen) & in_page
        prow = tl.maximum(pool_row, 0) * sp_s + tok * sp_t  # int64 [T]
        hrow = tl.maximum(host_slot, 0) * ss_s + tok * ss_t
        pmask = (valid & (pool_row >= 0))[:, None] & dmask
        hmask = ((host_slot >= 0) & in_page)[:, None] & dmask  # a miss's whole page: it is installed
        keys = tl.load(pool_ptr + prow[:, None] + d[None, :] * sp_d, mask=pmask, other=0.0)  # [T, DP]
        vals = tl.load(pool_ptr + sp_kv + prow[:, None] + d[None, :] * sp_d, mask=pmask, other=0.0)
        keys = tl.where(hmask, tl.load(src_ptr + hrow[:, None] + d[None, :], mask=hmask, other=0.0), keys)
        vals = tl.where(hmask, tl.load(src_ptr + ss_kv + hrow[:, None] + d[None, :], mask=hmask, other=0.0),
                        vals)
        # NOTE: a scheduling fence (as in cache_lookup_kernel): the PCIe reads are issued before
        # the scans below, so that the two overlap.
        tl.debug_barrier()
        install = tl.full((PAGES * BB,), -1, tl.int64)
        for p in tl.static_range(PAGES):
            i = first + k0 + p
            in_sel = k0 + p < k_hi
            slot, my_set, tags, hit, miss, is_open, hit_way = _request(
                slots_ptr, open_ptr, tags_ptr, i, in_sel, ways, NUM_SETS, WAYS, WAYS_P2)
            last = tl.load(last_ptr + my_set * WAYS + ways, mask=miss & (ways < WAYS), other=-1)
            taken, rank = _scan_call(slots_ptr, M, i, my_set, tags, ways, miss, NUM_SETS, WAYS_P2, SCAN)
            victim = _victim_way(last, taken, rank, ways, WAYS)
            installed = miss & (victim >= 0)
            entry = my_set * WAYS + tl.where(hit, hit_way, victim)
            install = tl.where(page_of == p, tl.where(installed, entry, -1), install)
            kind = tl.where(miss, tl.where(installed, KIND_INSTALLED, KIND_STAGED), KIND_PADDING)
            tl.store(entry_ptr + i, tl.where(hit | installed, entry, -1), mask=in_sel)
            tl.store(kind_ptr + i, tl.where(hit, KIND_HIT, kind).to(tl.int8), mask=in_sel)
            tl.store(tag_ptr + i, slot, mask=in_sel)
        irow = tl.maximum(install, 0) * sp_s + tok * sp_t
        imask = ((install >= 0) & in_page)[:, None] & dmask
        tl.store(pool_ptr + irow[:, None] + d[None, :] * sp_d, keys, mask=imask)
        tl.store(pool_ptr + sp_kv + irow[:, None] + d[None, :] * sp_d, vals, mask=imask)
        top, total, acc = attend_block(q, keys, vals, valid, top, total, acc, sm_scale, GP, PAGES * BB, DOT,
                                       UPCAST, IEEE)
    store_partial(o_ptr, lse_ptr, top, total, acc, split, b, head, g, d, so_s, so_b, so_h, so_d, sl_s, sl_b,
                  sl_h, G, D)


@triton.jit
def merge_commit_kernel(po_ptr, plse_ptr, o_ptr, lse_ptr, S, ROWS,
                        tag_ptr, entry_ptr, kind_ptr, tags_ptr, last_ptr, counters_ptr, call_ptr, M,
                        D: tl.constexpr, DP: tl.constexpr, SC: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (ROWS + cdiv(M, BLOCK),): programs below ROWS merge the splits of one query row
    (merge_splits_kernel), the others commit one block of the call each (cache_commit_kernel):
    the commit costs the step no launch and no time of its own."""
    pid = tl.program_id(0)
    if pid < ROWS:
        merge_row(po_ptr, plse_ptr, o_ptr, lse_ptr, pid.to(tl.int64), (pid * 0 + ROWS).to(tl.int64), S, D, DP,
                  SC)
    else:
        commit_block(pid - ROWS, tag_ptr, entry_ptr, kind_ptr, tags_ptr, last_ptr, counters_ptr, call_ptr, M,
                     BLOCK)
