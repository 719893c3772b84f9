"""Decode attention over host-tier pages with the hot-cache lookup inside the attention launch.

    cached_sparse_decode(q, pool, cache, src, slots, is_open, rows, page_lens) -> (o, lse)

equals `cached_sparse_decode_ref`: the cache's `lookup_and_fill(slots, src, outside=(is_open,
rows))`, then sparse decode attention over `pool` at the rows it returns. The cache's tables,
counters and ways end the same; its staging rows are not written (a miss goes from the arena
straight to the attention and to its way).

Why: the lookup was its own launch between the selection and the attention, on the step's
critical path (9 us a layer on SmolLM2 at 128K, most of the gap between locks:host and
locks:hbm). Here the probe costs the attention one dependent load a page, a miss's PCIe read
overlaps the other pages' work, and the commit runs in the split merge's launch
(`triton_cached_attention.py`).
"""

from __future__ import annotations

import contextlib
import math

import torch
import triton
import triton.language as tl
from lockserve.kernels.attention import sparse_decode_ref
from lockserve.kernels.triton.attention import (
    MERGE_CHUNK,
    POOL_DTYPES,
    AttentionTuning,
    _check_inputs,
    int32_ids,
    partials,
    split_plan,
)  # fmt: skip
from lockserve.kernels.triton.checks import is_interpreted, next_pow2, output

from . import triton_cache
from .cache import _COMMIT_BLOCK, _SCAN, HotPageCache
from .gather import HostPool, Pool, check_pool
from .triton_cached_attention import cached_decode_kernel, merge_commit_kernel


def cached_sparse_decode_ref(q: torch.Tensor, pool: torch.Tensor, cache: HotPageCache, src: Pool,
                             slots: torch.Tensor, is_open: torch.Tensor, rows: torch.Tensor,
                             page_lens: torch.Tensor, scale: float | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup, then the attention at its rows (o, lse float32)."""
    found = cache.lookup_and_fill(slots.flatten(), src, outside=(is_open.flatten(), rows.flatten()))
    return sparse_decode_ref(q, pool, found.view_as(slots), page_lens, scale)


def _check_cache_inputs(pool, cache: HotPageCache, src, slots, is_open, rows, page_lens) -> None:
    shape = tuple(slots.shape)
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots: expected a contiguous int64 tensor, got {slots.dtype} with strides "
                         f"{slots.stride()}")
    for name, t, dtype in (("is_open", is_open, torch.bool), ("rows", rows, torch.int64)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {shape} {dtype} tensor, got {tuple(t.shape)} "
                             f"{t.dtype}")
    if slots.numel() > cache.max_selected:
        raise ValueError(f"slots: {slots.numel()} requested, more than the cache's max_selected "
                         f"({cache.max_selected})")
    if pool.data_ptr() != cache.pool.data_ptr() or pool.stride() != cache.pool.stride():
        raise ValueError("pool: its first rows must be the cache's pool (the cache's ways are pool rows)")
    check_pool("src", src, cache.geometry.page_shape, cache.geometry.dtype, cache.device)
    if isinstance(src, HostPool) and cache.device.type != "cuda":
        raise ValueError(f"src: a HostPool is read under UVA by a cuda cache, not one on {cache.device}")
    del page_lens  # checked with q by _check_inputs


def cached_sparse_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    cache: HotPageCache,
    src: Pool,
    slots: torch.Tensor,
    is_open: torch.Tensor,
    rows: torch.Tensor,
    page_lens: torch.Tensor,
    scale: float | None = None,
    tuning: AttentionTuning = AttentionTuning(),
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per sequence over its selected pages, looked up in `cache`.

    q: [Bt, Hq, d]; pool: [R, 2, B, d] whose first rows are `cache.pool` (the attention pool);
    src: the arena `[S, 2, B, d]` (a HostPool under UVA, or a tensor); slots: [Bt, Hkv, K]
    int64 arena slots, distinct, -1 where nothing is looked up (and -1 wherever is_open);
    is_open: [Bt, Hkv, K] bool, pages read from their pool row `rows` [Bt, Hkv, K] int64;
    page_lens: [Bt, Hkv, K] valid tokens (0 for padding). All contiguous; Bt * Hkv * K <=
    cache.max_selected. Returns o [Bt, Hq, d] out_dtype and lse [Bt, Hq] float32; advances the
    cache one step. The cache must run its Triton kernels (CUDA, or CPU with TRITON_INTERPRET=1).
    """
    if cache.backend != "triton":
        raise ValueError(f"cache: the cached attention runs the cache's Triton kernels, not its "
                         f"{cache.backend!r} backend (call cached_sparse_decode_ref)")
    bt, hq, hkv, d, page, k = _check_inputs(q, pool, slots, page_lens)
    _check_cache_inputs(pool, cache, src, slots, is_open, rows, page_lens)
    cache.join()
    page_lens = int32_ids(page_lens)
    o = output("o", None, (bt, hq, d), q.device, out_dtype)
    lse = output("lse", None, (bt, hq), q.device)
    m = slots.numel()
    if m == 0:
        o.zero_()
        return o, lse.fill_(float("-inf"))
    plan = split_plan(bt, hkv, k, page, tuning, q.device)
    part_o, part_lse = partials(o, lse, plan.splits)
    dot = POOL_DTYPES[pool.dtype]
    src_stride = (2 * page * d, page * d, d)  # the contiguous arena's [S, 2, B] strides
    ways_p2 = triton.next_power_of_2(cache.ways)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        cached_decode_kernel[(hkv * plan.splits, bt)](
            q, pool, src, slots, is_open.view(torch.int8), rows, page_lens, part_o, part_lse,
            cache._tags, cache._last, cache._counters, cache._call, cache._entry_of, cache._kind_of,
            cache._tag_of, k, plan.per_split, 1.0 / math.sqrt(d) if scale is None else float(scale), m,
            cache.num_sets, *q.stride(), *pool.stride(), *src_stride, *page_lens.stride(), *part_o.stride(),
            *part_lse.stride(),
            HKV=hkv, G=hq // hkv, GP=max(16, next_pow2(hq // hkv)), D=d, DP=max(16, next_pow2(d)), B=page,
            BB=plan.bb, PAGES=plan.pages, DOT=dot, UPCAST=is_interpreted(cached_decode_kernel),
            IEEE=dot == tl.float32, WAYS=cache.ways, WAYS_P2=ways_p2, SCAN=min(_SCAN, max(16, next_pow2(m))),
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
        )  # fmt: skip
        _merge_and_commit(cache, part_o, part_lse, o, lse, plan.splits, m)
    return o, lse


def _merge_and_commit(cache: HotPageCache, part_o, part_lse, o, lse, splits: int, m: int) -> None:
    """The split merge with the commit's programs beside it; one split: the commit alone."""
    blocks = triton.cdiv(m, _COMMIT_BLOCK)
    tables = (cache._tag_of, cache._entry_of, cache._kind_of, cache._tags, cache._last, cache._counters,
              cache._call, m)
    if splits == 1:
        triton_cache.cache_commit_kernel[(blocks,)](*tables, BLOCK=_COMMIT_BLOCK, num_warps=4)
        return
    rows, d = o.shape[0] * o.shape[1], o.shape[2]
    merge_commit_kernel[(rows + blocks,)](part_o, part_lse, o, lse, splits, rows, *tables, D=d,
                                          DP=next_pow2(d), SC=min(MERGE_CHUNK, next_pow2(splits)),
                                          BLOCK=_COMMIT_BLOCK)

