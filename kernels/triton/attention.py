"""Launcher for sparse paged decode attention: validate, choose the split, launch, merge.

    sparse_decode_triton(q, pool, slots, page_lens, scale=None) -> (o [Bt, Hq, d], lse [Bt, Hq])

Computes sparse_decode_ref (kernels/attention.py) with the same conventions. QK^T and PV run in
the pool's dtype with float32 accumulation (float32 pools without TF32); the probabilities are
rounded to that dtype before PV, as in flash attention, so compare with the pool dtype's
tolerance.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention_kernel import merge_splits_kernel, sparse_decode_kernel
from .checks import check_runnable, check_tensor, is_interpreted, next_pow2, output

POOL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 256  # a batch-1 row of few KV heads needs ~4 programs per SM (SmolLM2: 3 heads)
MERGE_CHUNK = 64  # splits per step of the merge's loop
MAX_GRID_Y = 65535


@dataclass(frozen=True)
class AttentionTuning:
    """Launch knobs (the benchmark sweeps them). pages: pages per loop iteration; num_splits:
    None picks enough splits to give about target_programs programs; num_stages: loads in flight."""

    pages: int = 4
    num_splits: int | None = None
    target_programs: int | None = None  # None: 4 per SM on CUDA
    num_warps: int = 4
    num_stages: int = 3


def _check_inputs(q, pool, slots, page_lens) -> tuple[int, int, int, int, int, int]:
    bt, hq, d = check_tensor("q", q, (("Bt", None), ("Hq", None), ("d", None)), Q_DTYPES)
    dev = q.device
    _, two, page, _ = check_tensor("pool", pool, (("S", None), ("2", 2), ("B", None), ("d", d)),
                                   tuple(POOL_DTYPES), dev)
    _, hkv, k = check_tensor("slots", slots, (("Bt", bt), ("Hkv", None), ("K", None)), INDEX_DTYPES, dev)
    check_tensor("page_lens", page_lens, (("Bt", bt), ("Hkv", hkv), ("K", k)), INDEX_DTYPES, dev)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: query heads Hq ({hq}) must be a multiple of the KV heads Hkv ({hkv})")
    if bt > MAX_GRID_Y:
        raise ValueError(f"q: batch Bt ({bt}) must be <= {MAX_GRID_Y} for the attention grid")
    check_runnable("q", q, sparse_decode_kernel)
    return bt, hq, hkv, d, page, k


# Rows of at most this many pages read int64 ids in place (int32_ids); longer rows get a cast. On
# the H200 (Llama-3.1-8B shape, dense attention over every page) the view's strided id loads took
# the attention of a step from 4.2 to 5.8 ms at batch 1 x 8,192 pages a row (128K) and from 15.9
# to 21.8 ms at 1 x 32,768 (512K), but from 20.5 to 18.9 ms at 16 x 2,048 (16 x 32K); LOCKS rows
# (128 pages) lost nothing and saved the cast's launch. The rule is set by those points only.
VIEW_IDS_MAX_PAGES = 4096


def int32_ids(ids: torch.Tensor) -> torch.Tensor:
    """ids as int32 (each in [-1, 2^31)): int64 ids with a contiguous last dimension of at most
    VIEW_IDS_MAX_PAGES are read in place, through a view of their low words (little-endian: -1's
    low word is -1), which saves a cast launch per call; anything else is cast."""
    if ids.dtype == torch.int32:
        return ids
    short = ids.dim() > 0 and ids.shape[-1] <= VIEW_IDS_MAX_PAGES
    if ids.dtype == torch.int64 and sys.byteorder == "little" and ids.numel() and ids.stride(-1) == 1 \
            and short:
        return ids.view(torch.int32)[..., ::2]  # [..., K], strides doubled, the last one 2
    return ids.to(torch.int32)


def _num_splits(bt: int, hkv: int, k: int, pages: int, tuning: AttentionTuning, device) -> int:
    if tuning.num_splits is not None:
        if not 1 <= tuning.num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits ({tuning.num_splits}) must be in [1, {MAX_SPLITS}]")
        return tuning.num_splits
    target = tuning.target_programs
    if target is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        target = 4 * sms
    want = triton.cdiv(target, bt * hkv)
    return max(1, min(want, triton.cdiv(k, pages), MAX_SPLITS))


def sparse_decode_triton(
    q: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    page_lens: torch.Tensor,
    scale: float | None = None,
    tuning: AttentionTuning = AttentionTuning(),
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per sequence over its selected pages.

    q: [Bt, Hq, d] float32/bf16/fp16 (cast to the pool dtype for QK^T); pool: [S, 2, B, d]
    bf16/fp16/fp32 (K then V of a page; any strides); slots: [Bt, Hkv, K] int32/int64 pool slots,
    -1 = padding (never read); page_lens: [Bt, Hkv, K] valid tokens of each selected page.
    Returns o [Bt, Hq, d] out_dtype (float32, or the model's dtype: the cast of the float32 result
    happens in the kernel's store, one launch fewer than casting after) and lse [Bt, Hq] float32
    (o = 0, lse = -inf where nothing valid), written into out = (o, lse) if given.
    """
    bt, hq, hkv, d, page, k = _check_inputs(q, pool, slots, page_lens)
    # NOTE: Triton 3.6 fails to compile this kernel (RemoveLayoutConversions, an arith.select with
    # mismatched layouts) for int64 slots whose strides are multiples of 16, as the engine's are;
    # int32 compiles in every case. Slot ids fit: 2^31 pages of one pool would be >= 8 TiB.
    slots, page_lens = int32_ids(slots), int32_ids(page_lens)
    o_out, lse_out = out if out is not None else (None, None)
    o = output("out[0] (o)", o_out, (bt, hq, d), q.device, out_dtype)
    lse = output("out[1] (lse)", lse_out, (bt, hq), q.device)
    if bt == 0 or hq == 0:
        return o, lse
    bb = next_pow2(page)
    pages = max(next_pow2(tuning.pages), triton.cdiv(16, bb))  # >= 16 token rows per dot
    splits = _num_splits(bt, hkv, k, pages, tuning, q.device)
    per_split = pages * triton.cdiv(triton.cdiv(max(k, 1), splits), pages)
    splits = max(1, triton.cdiv(k, per_split))
    if splits == 1:
        part_o, part_lse = o[None], lse[None]  # one split: the partial is the answer
    else:
        part_o = torch.empty(splits, bt, hq, d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(splits, bt, hq, device=q.device, dtype=torch.float32)
    g = hq // hkv
    dot = POOL_DTYPES[pool.dtype]
    sparse_decode_kernel[(hkv * splits, bt)](
        q, pool, slots, page_lens, part_o, part_lse, k, per_split,
        1.0 / math.sqrt(d) if scale is None else float(scale),
        *q.stride(), pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3),
        *slots.stride(), *page_lens.stride(), *part_o.stride(), *part_lse.stride(),
        HKV=hkv, G=g, GP=max(16, next_pow2(g)), D=d, DP=max(16, next_pow2(d)), B=page, BB=bb,
        PAGES=pages, DOT=dot, UPCAST=is_interpreted(sparse_decode_kernel), IEEE=dot == tl.float32,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if splits > 1:
        merge_splits_kernel[(bt * hq,)](part_o, part_lse, o, lse, splits, D=d, DP=next_pow2(d),
                                        SC=min(MERGE_CHUNK, next_pow2(splits)))
    return o, lse
