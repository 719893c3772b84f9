"""@triton.jit code of a prefill chunk's causal attention over its sequence's pages, where they lie
in the pool (no gather into a contiguous copy), split-K (kernels/triton/prefill.py launches it;
kernels/attention.py paged_prefill_ref is the reference).

One program attends one (KV head h, key split s, query tile): BLOCK_M rows of (query, head of the
group) pairs, row m = query m // G, query head h * G + m % G, so a tile reads each key once for
every head of the group (GQA native) and for several queries. Keys come BLOCK_N at a time: key j
is token j % B of page j // B, pool slot (base + locs[j // B]) * HKV + h. Each split leaves a
normalised partial (o, lse) per row; attention_kernel.merge_splits_kernel combines them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_jit import dot_acc, neg_inf_safe


# The lengths and the pool's base vary with every chunk: specialising on them (== 1, % 16) would
# compile a variant for each class on a user's first request of it; BLOCK_M is the only shape. So
# do the lse's strides (N x Hq and Hq: a chunk of 13 queries and one of 16 differ in class where Hq
# is not a multiple of 16); its stores are one value a row, which the class does not widen.
@triton.jit(do_not_specialize=["N", "L", "base", "keys_per_split", "sl_s", "sl_t"])
def paged_prefill_kernel(
    q_ptr, pool_ptr, locs_ptr, o_ptr, lse_ptr,
    N, L, base, keys_per_split, sm_scale,
    sq_t, sq_h, sq_d, sp_s, sp_kv, sp_t, sp_d, s_loc,
    so_s, so_t, so_h, so_d, sl_s, sl_t, sl_h,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (HKV * splits, cdiv(N * G, BLOCK_M)). q: [N, HKV * G, D]; o: [splits, N, HKV * G, D],
    lse: [splits, N, HKV * G] (strides given). Query i sits at position L - N + i and sees keys
    0 .. L - N + i. A row that sees no key of its split gets o = 0, lse = -inf."""
    pid = tl.program_id(0)
    h = pid % HKV
    split = pid // HKV
    tile = tl.program_id(1)
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m < N * G
    qi = (m // G).to(tl.int64)
    head = (h * G + m % G).to(tl.int64)
    qpos = L - N + qi  # [BLOCK_M]
    d = tl.arange(0, DP)
    d_ok = d < D
    q = tl.load(q_ptr + qi[:, None] * sq_t + head[:, None] * sq_h + d[None, :] * sq_d,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT)  # [BLOCK_M, DP]
    top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, DP), dtype=tl.float32)
    # The tile's last query sees keys up to L - N + its index: later keys of the split are skipped.
    last_query = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // G, N - 1)
    k_lo = split * keys_per_split
    k_hi = tl.minimum(tl.minimum(k_lo + keys_per_split, L), L - N + last_query + 1)
    for j0 in range(k_lo, k_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < k_hi
        loc = tl.load(locs_ptr + (j // B) * s_loc, mask=j_ok, other=0).to(tl.int64)
        # int64: slot * sp_s passes 2^31 elements once the pool holds more than 4 GiB of bf16.
        row = ((base + loc) * HKV + h) * sp_s + (j % B) * sp_t  # [BLOCK_N]
        kv_mask = j_ok[:, None] & d_ok[None, :]
        keys = tl.load(pool_ptr + row[:, None] + d[None, :] * sp_d, mask=kv_mask, other=0.0)  # [BLOCK_N, DP]
        vals = tl.load(pool_ptr + sp_kv + row[:, None] + d[None, :] * sp_d, mask=kv_mask, other=0.0)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        logits = dot_acc(q, tl.trans(keys.to(DOT)), zero, UPCAST, IEEE) * sm_scale  # [BLOCK_M, BLOCK_N]
        seen = j_ok[None, :] & (j[None, :] <= qpos[:, None])
        logits = tl.where(seen, logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe = neg_inf_safe(new_top)
        alpha = tl.exp(top - safe)
        p = tl.exp(logits - safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = dot_acc(p.to(DOT), vals.to(DOT), acc * alpha[:, None], UPCAST, IEEE)
        top = new_top
    lse = tl.where(total > 0, top + tl.log(tl.maximum(total, 1e-30)), float("-inf"))
    o = acc / tl.maximum(total, 1e-30)[:, None]
    sp = split.to(tl.int64)
    tl.store(o_ptr + sp * so_s + qi[:, None] * so_t + head[:, None] * so_h + d[None, :] * so_d,
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + sp * sl_s + qi * sl_t + head * sl_h, lse, mask=row_ok)
