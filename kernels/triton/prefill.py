"""Launcher of a prefill chunk's causal attention over its pages where they lie: validate, choose
the split, launch, merge.

    paged_prefill_triton(q, pool, locs, base, num_kv_heads, length, scale=None)
        -> (o [n, Hq, d] in q's dtype, lse [n, Hq] float32)

Computes kernels/attention.py paged_prefill_ref. The engine's prefill gathers a chunk's prefix into
a contiguous [L, Hkv, d] copy for the flash kernels (two copies of 2 x L x Hkv x d elements a
layer); for short chunks over a long prefix (a prefill step beside decoding requests, a warm
request's tail) those copies cost more than the attention, which reads the same bytes once here.
QK^T and PV run in the pool's dtype with float32 accumulation (float32 pools without TF32), the
probabilities rounded to that dtype before PV as in flash attention: compare with the pool
dtype's tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attention import MAX_SPLITS, MERGE_CHUNK, POOL_DTYPES, Q_DTYPES
from .attention_kernel import merge_splits_kernel
from .checks import check_runnable, check_tensor, is_interpreted, next_pow2
from .prefill_kernel import paged_prefill_kernel

BLOCK_N = 64  # keys per loop iteration (4 pages of 16)
MAX_BLOCK_M = 128  # (query, head) rows per tile
MAX_TILES = 65535  # the grid's second dimension


@dataclass(frozen=True)
class PrefillTuning:
    """The paged prefill's launch knobs (scripts/paged_prefill_probe.py --tune sweeps them).
    block_n: keys per loop iteration (a power of two >= 16); num_warps None: 8 for a 128 x 128
    query tile, else 4."""

    block_n: int = BLOCK_N
    num_stages: int = 2
    num_warps: int | None = None
    programs_per_sm: int = 4


def _check_inputs(q, pool, locs, num_kv_heads: int, length: int) -> tuple[int, int, int, int]:
    n, hq, d = check_tensor("q", q, (("n", None), ("Hq", None), ("d", None)), Q_DTYPES)
    _, _, page, _ = check_tensor("pool", pool, (("S", None), ("2", 2), ("B", None), ("d", d)),
                                 tuple(POOL_DTYPES), q.device)
    (num_locs,) = check_tensor("locs", locs, (("P", None),), (torch.int32, torch.int64), q.device)
    if num_kv_heads < 1 or hq % num_kv_heads:
        raise ValueError(f"q: query heads Hq ({hq}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if not 1 <= n <= length:
        raise ValueError(f"q: queries n ({n}) must be in [1, length ({length})]")
    if num_locs * page < length:
        raise ValueError(f"locs: {num_locs} pages of {page} tokens hold fewer than length ({length}) tokens")
    check_runnable("q", q, paged_prefill_kernel)
    return n, hq, d, page


def _splits(hkv: int, length: int, device: torch.device, num_splits: int | None,
            block_n: int = BLOCK_N, programs_per_sm: int = 4) -> tuple[int, int]:
    """(splits, keys per split, a multiple of block_n): num_splits if given (at most one split per
    block_n keys), else about programs_per_sm programs per SM for one query tile (as many on the
    CPU).

    NOTE: the choice depends on the KV heads and the length only, never on how many queries came
    in the chunk: a query row's partials, and so its bits, are the same whichever chunk holds it
    (a warm request's tail of a page computes what the cold request's last chunk computed)."""
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits ({num_splits}) must be in [1, {MAX_SPLITS}]")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    want = num_splits or triton.cdiv(programs_per_sm * sms, hkv)
    want = max(1, min(want, triton.cdiv(length, block_n), MAX_SPLITS))
    per_split = block_n * triton.cdiv(triton.cdiv(length, want), block_n)
    return triton.cdiv(length, per_split), per_split


def paged_prefill_triton(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    base: int,
    num_kv_heads: int,
    length: int,
    scale: float | None = None,
    num_splits: int | None = None,
    tuning: PrefillTuning = PrefillTuning(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of the last n of `length` tokens over all of them, from their pages.

    q: [n, Hq, d] float32/bf16/fp16, query i at position length - n + i; pool: [S, 2, B, d]
    bf16/fp16/fp32 (K then V of a page; any strides); locs: [>= ceil(length / B)] int32/int64:
    page p of the sequence, KV head h, is pool slot (base + locs[p]) * num_kv_heads + h. Returns o
    [n, Hq, d] in q's dtype and lse [n, Hq] float32. num_splits: key splits (None: enough for
    about tuning.programs_per_sm programs per SM), merged by log-sum-exp. tuning: the launch's
    knobs (the same outputs, within rounding, for any).
    """
    n, hq, d, page = _check_inputs(q, pool, locs, num_kv_heads, length)
    g = hq // num_kv_heads
    block_m = min(MAX_BLOCK_M, max(16, next_pow2(n * g)))
    tiles = triton.cdiv(n * g, block_m)
    if tiles > MAX_TILES:
        raise ValueError(f"q: n x G ({n} x {g}) needs {tiles} query tiles, more than {MAX_TILES}")
    splits, per_split = _splits(num_kv_heads, length, q.device, num_splits, tuning.block_n,
                                 tuning.programs_per_sm)
    o = torch.empty(n, hq, d, device=q.device, dtype=q.dtype)
    lse = torch.empty(n, hq, device=q.device, dtype=torch.float32)
    if splits == 1:
        part_o, part_lse = o[None], lse[None]  # one split: the partial is the answer
    else:
        part_o = torch.empty(splits, n, hq, d, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(splits, n, hq, device=q.device, dtype=torch.float32)
    dot = POOL_DTYPES[pool.dtype]
    paged_prefill_kernel[(num_kv_heads * splits, tiles)](
        q, pool, locs, part_o, part_lse, n, length, base, per_split,
        1.0 / math.sqrt(d) if scale is None else float(scale),
        *q.stride(), *pool.stride(), locs.stride(0), *part_o.stride(), *part_lse.stride(),
        HKV=num_kv_heads, G=g, D=d, DP=max(16, next_pow2(d)), B=page, BLOCK_M=block_m, BLOCK_N=tuning.block_n,
        DOT=dot, UPCAST=is_interpreted(paged_prefill_kernel), IEEE=dot == tl.float32,
        num_warps=tuning.num_warps or (8 if block_m * max(16, next_pow2(d)) >= 128 * 128 else 4),
        num_stages=tuning.num_stages,
    )
    if splits > 1:
        merge_splits_kernel[(n * hq,)](part_o, part_lse, o, lse, splits, D=d, DP=next_pow2(d),
                                       SC=min(MERGE_CHUNK, next_pow2(splits)))
    return o, lse
