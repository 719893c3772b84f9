"""Sparse decode attention that finds its pages in the hot-page cache itself (@triton.jit code
only; the launcher and its reference are in `cached_attention.py`).

One program of `cached_decode_kernel` attends one (sequence b, KV head h, split) as
`sparse_decode_kernel` does (kernels/triton/attention_kernel.py: the same online softmax and
partials), but finds each selected page itself: it probes the page's set in the cache's tags
(as `cache_lookup_kernel` does, triton_cache.py) and reads a hit from its way, a miss from the
arena in place (over UVA for a host arena), the open page (`is_open`) from its pool row. It
writes nothing of the cache: it appends the slots it looked up to the forward's fill list, and
after the forward one `HotPageCache.fill` of that list stamps the hits and installs the misses.

Invariant: the cache's tables and ways do not change during a forward (the fill runs after its
last layer), so every layer's probe sees them as the previous fill left them, and a way read
here holds the page its tag names.
"""

import triton
import triton.language as tl
from lockserve.kernels.triton.attention_kernel import attend_block, store_partial

from .triton_cache import set_of_slot


@triton.jit
def _find_pages(slots_ptr, open_ptr, rows_ptr, tags_ptr, fill_ptr, i, in_sel, NUM_SETS,
                WAYS: tl.constexpr, WAYS_P2: tl.constexpr):
    """Requests i [PAGES] (nothing where not in_sel): (pool row [PAGES], -1 = not in the pool;
    arena slot to read [PAGES], -1 = none). Appends each request's slot to the fill list."""
    is_open = tl.load(open_ptr + i, mask=in_sel, other=0) != 0
    slot = tl.load(slots_ptr + i, mask=in_sel, other=-1)  # int64 [PAGES], < 0 = nothing to look up
    tl.store(fill_ptr + i, slot, mask=in_sel)
    my_set = set_of_slot(tl.maximum(slot, 0), NUM_SETS)  # [PAGES]
    ways = tl.arange(0, WAYS_P2)
    real = (slot >= 0)[:, None] & (ways < WAYS)[None, :]
    tags = tl.load(tags_ptr + my_set[:, None] * WAYS + ways[None, :], mask=real, other=-1)  # [PAGES, WAYS_P2]
    # The lowest way holding the slot (as the lookup's probe); WAYS_P2 when none.
    way = tl.min(tl.where(real & (tags == slot[:, None]), ways[None, :], WAYS_P2), axis=1)
    hit = (slot >= 0) & (way < WAYS_P2)
    open_row = tl.load(rows_ptr + i, mask=in_sel & is_open, other=-1)
    row = tl.where(is_open, open_row, tl.where(hit, my_set * WAYS + way, -1))
    return row, tl.where((slot >= 0) & ~hit, slot, -1)


@triton.jit
def _per_token(x, PAGES: tl.constexpr, BB: tl.constexpr):
    """[PAGES] -> [PAGES * BB]: each page's value on its BB token rows (row t is page t // BB)."""
    return tl.reshape(tl.broadcast_to(x[:, None], (PAGES, BB)), (PAGES * BB,))


@triton.jit
def cached_decode_kernel(
    q_ptr, pool_ptr, src_ptr, slots_ptr, open_ptr, rows_ptr, lens_ptr, o_ptr, lse_ptr, tags_ptr, fill_ptr,
    K, pages_per_split, sm_scale, NUM_SETS,
    sq_b, sq_h, sq_d, sp_s, sp_kv, sp_t, sp_d, ss_s, ss_kv, ss_t, sln_b, sln_h, sln_k,
    so_s, so_b, so_h, so_d, sl_s, sl_b, sl_h,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    B: tl.constexpr, BB: tl.constexpr, PAGES: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, WAYS: tl.constexpr, WAYS_P2: tl.constexpr,
):
    """Grid (HKV * splits, Bt). slots [M] int64 arena slots (< 0: none), open [M] int8, rows [M]
    int64 (an open page's pool row), contiguous in request order: request i = (b * HKV + h) * K
    + k; fill [M] int64 out: the slots (the fill list's part for this layer). pool [R, 2, B, D]:
    rows [0, NUM_SETS * WAYS) are the cache's ways; src [S, 2, B, D]: the arena (unit stride in
    d). o, lse: split partials as in sparse_decode_kernel."""
    pid = tl.program_id(0)
    h = pid % HKV
    split = pid // HKV
    b = tl.program_id(1)
    g = tl.arange(0, GP)
    d = tl.arange(0, DP)
    head = (h * G + g).to(tl.int64)
    q_off = b.to(tl.int64) * sq_b + head[:, None] * sq_h + d[None, :] * sq_d
    q = tl.load(q_ptr + q_off, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(DOT)  # [GP, DP]
    top = tl.full((GP,), float("-inf"), tl.float32)
    total = tl.zeros((GP,), dtype=tl.float32)
    acc = tl.zeros((GP, DP), dtype=tl.float32)
    tok = tl.arange(0, PAGES * BB) % BB
    pages = tl.arange(0, PAGES)
    dmask = (d < D)[None, :]
    first = (b.to(tl.int64) * HKV + h) * K  # request index of the row's page 0
    k_lo = split * pages_per_split
    k_hi = tl.minimum(k_lo + pages_per_split, K)
    for k0 in range(k_lo, k_hi, PAGES):
        k = k0 + pages
        row, host = _find_pages(slots_ptr, open_ptr, rows_ptr, tags_ptr, fill_ptr, first + k, k < k_hi,
                                NUM_SETS, WAYS, WAYS_P2)
        plen = tl.load(lens_ptr + b.to(tl.int64) * sln_b + h * sln_h + k * sln_k, mask=k < k_hi, other=0)
        row, host, plen = _per_token(row, PAGES, BB), _per_token(host, PAGES, BB), _per_token(plen, PAGES, BB)
        valid = ((row >= 0) | (host >= 0)) & (tok < plen) & (tok < B)
        # int64 offsets: a pool or arena of more than 4 GiB of bf16 passes 2^31 elements.
        prow = tl.maximum(row, 0) * sp_s + tok * sp_t  # [T]
        hrow = tl.maximum(host, 0) * ss_s + tok * ss_t
        pmask = (valid & (row >= 0))[:, None] & dmask
        hmask = (valid & (host >= 0))[:, None] & dmask
        keys = tl.load(pool_ptr + prow[:, None] + d[None, :] * sp_d, mask=pmask, other=0.0)  # [T, DP]
        vals = tl.load(pool_ptr + sp_kv + prow[:, None] + d[None, :] * sp_d, mask=pmask, other=0.0)
        keys = tl.where(hmask, tl.load(src_ptr + hrow[:, None] + d[None, :], mask=hmask, other=0.0), keys)
        vals = tl.where(hmask, tl.load(src_ptr + ss_kv + hrow[:, None] + d[None, :], mask=hmask, other=0.0),
                        vals)
        top, total, acc = attend_block(q, keys, vals, valid, top, total, acc, sm_scale, GP, PAGES * BB, DOT,
                                       UPCAST, IEEE)
    store_partial(o_ptr, lse_ptr, top, total, acc, split, b, head, g, d, so_s, so_b, so_h, so_d, sl_s, sl_b,
                  sl_h, G, D)
