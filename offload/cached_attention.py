"""Decode attention over host-tier pages that finds them in the hot cache itself.

    cached_sparse_decode(q, pool, cache, src, slots, is_open, rows, page_lens, fill) -> (o, lse)

equals `cached_sparse_decode_ref`: attention over each selected page read from where it is (a
hit from its cache way, a miss from the arena, the open page from its pool row), the slots
written to `fill`. It changes nothing of the cache: after the forward, `cache.fill` of every
layer's list stamps the hits and installs the misses (HostSource does both).

Why: the lookup was its own launch between the selection and the attention, on the step's
critical path: 8.6 us a layer on SmolLM2 at 128K (the probe, a miss's copy to a staging row, the
victim choice and the commit), most of the gap between locks:host and locks:hbm. Here a probe
costs the attention one dependent load, and a miss's PCIe read overlaps the other pages' work.
The price: a miss crosses PCIe twice (the attention's read, the fill's copy), so this suits
steps that mostly hit (a real model's decode), not random selections.
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
from lockserve.kernels.triton.attention_kernel import merge_splits_kernel
from lockserve.kernels.triton.checks import is_interpreted, next_pow2, output

from .cache import HotPageCache, slot_sets
from .gather import HostPool, Pool, check_pool
from .triton_cached_attention import cached_decode_kernel


def cached_sparse_decode_ref(q: torch.Tensor, pool: torch.Tensor, cache: HotPageCache, src: Pool,
                             slots: torch.Tensor, is_open: torch.Tensor, rows: torch.Tensor,
                             page_lens: torch.Tensor, fill: torch.Tensor, scale: float | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages gathered where they are (src a tensor), then the reference attention (o, lse
    float32); the slots copied to fill."""
    flat = slots.flatten()
    sets = slot_sets(flat.clamp(min=0), cache.num_sets)
    match = (cache.tags[sets] == flat[:, None]) & (flat >= 0)[:, None]
    way = sets * cache.ways + match.to(torch.int8).argmax(1)
    # A hit: its way; a miss: the arena's page, placed after the pool; open: its pool row.
    where = torch.where(match.any(1), way, pool.shape[0] + flat)
    found = torch.where(is_open.flatten(), rows.flatten(), where)
    pages = torch.cat([pool, src.to(pool.device)])
    fill[: flat.numel()] = flat
    return sparse_decode_ref(q, pages, found.view_as(slots), page_lens, scale)


def _check_cache_inputs(pool, cache: HotPageCache, src, slots, is_open, rows, fill) -> None:
    shape = tuple(slots.shape)
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slots: expected a contiguous int64 tensor, got {slots.dtype} with strides "
                         f"{slots.stride()}")
    for name, t, dtype in (("is_open", is_open, torch.bool), ("rows", rows, torch.int64)):
        if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous {shape} {dtype} tensor, got {tuple(t.shape)} "
                             f"{t.dtype}")
    if fill.dtype != torch.int64 or fill.dim() != 1 or fill.numel() < slots.numel() or fill.stride(0) != 1:
        raise ValueError(f"fill: expected a 1-D int64 tensor of >= {slots.numel()} elements, got "
                         f"{tuple(fill.shape)} {fill.dtype}")
    if pool.data_ptr() != cache.pool.data_ptr() or pool.stride() != cache.pool.stride():
        raise ValueError("pool: its first rows must be the cache's pool (the cache's ways are pool rows)")
    check_pool("src", src, cache.geometry.page_shape, cache.geometry.dtype, cache.device)
    if isinstance(src, HostPool) and cache.device.type != "cuda":
        raise ValueError(f"src: a HostPool is read under UVA by a cuda cache, not one on {cache.device}")


def cached_sparse_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    cache: HotPageCache,
    src: Pool,
    slots: torch.Tensor,
    is_open: torch.Tensor,
    rows: torch.Tensor,
    page_lens: torch.Tensor,
    fill: torch.Tensor,
    scale: float | None = None,
    tuning: AttentionTuning = AttentionTuning(),
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per sequence over its selected pages, found in `cache`.

    q: [Bt, Hq, d]; pool: [R, 2, B, d] whose first rows are `cache.pool` (the attention pool);
    src: the arena `[S, 2, B, d]` (a HostPool under UVA, or a tensor); slots: [Bt, Hkv, K]
    int64 arena slots, distinct, -1 where nothing is looked up (and wherever is_open); is_open:
    [Bt, Hkv, K] bool, pages read from their pool row `rows` [Bt, Hkv, K] int64; page_lens:
    [Bt, Hkv, K] valid tokens (0 for padding); fill: int64 [>= Bt * Hkv * K], gets the slots
    (flattened). All contiguous. Returns o [Bt, Hq, d] out_dtype and lse [Bt, Hq] float32. On
    CUDA, or CPU with TRITON_INTERPRET=1.
    """
    bt, hq, hkv, d, page, k = _check_inputs(q, pool, slots, page_lens)
    _check_cache_inputs(pool, cache, src, slots, is_open, rows, fill)
    cache.join()  # its tables are read
    page_lens = int32_ids(page_lens)
    o = output("o", None, (bt, hq, d), q.device, out_dtype)
    lse = output("lse", None, (bt, hq), q.device)
    if slots.numel() == 0:
        o.zero_()
        return o, lse.fill_(float("-inf"))
    plan = split_plan(bt, hkv, k, page, tuning, q.device)
    part_o, part_lse = partials(o, lse, plan.splits)
    dot = POOL_DTYPES[pool.dtype]
    src_stride = (2 * page * d, page * d, d)  # the contiguous arena's [S, 2, B] strides
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        cached_decode_kernel[(hkv * plan.splits, bt)](
            q, pool, src, slots, is_open.view(torch.int8), rows, page_lens, part_o, part_lse, cache._tags,
            fill, k, plan.per_split, 1.0 / math.sqrt(d) if scale is None else float(scale), cache.num_sets,
            *q.stride(), *pool.stride(), *src_stride, *page_lens.stride(), *part_o.stride(),
            *part_lse.stride(),
            HKV=hkv, G=hq // hkv, GP=max(16, next_pow2(hq // hkv)), D=d, DP=max(16, next_pow2(d)), B=page,
            BB=plan.bb, PAGES=plan.pages, DOT=dot, UPCAST=is_interpreted(cached_decode_kernel),
            IEEE=dot == tl.float32, WAYS=cache.ways, WAYS_P2=triton.next_power_of_2(cache.ways),
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
        )  # fmt: skip
        if plan.splits > 1:
            merge_splits_kernel[(bt * hq,)](part_o, part_lse, o, lse, plan.splits, D=d, DP=next_pow2(d),
                                            SC=min(MERGE_CHUNK, next_pow2(plan.splits)))
    return o, lse
