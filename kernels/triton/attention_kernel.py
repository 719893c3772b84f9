"""@triton.jit code for sparse paged decode attention (flash-decoding with split-K).

One program attends one (sequence b, KV head h, split s): the selected pages k in
[s * pages_per_split, (s + 1) * pages_per_split) of slots[b, h], PAGES pages (PAGES * BB token
rows) per iteration, with an online softmax, for all G query heads of the group at once (the
query tile has GP >= 16 rows, rows >= G zero, so QK^T and PV are tensor-core dots). Each split
leaves a normalised partial (o, lse); merge_splits_kernel combines them by log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_jit import dot_acc, neg_inf_safe


@triton.jit
def _page_rows(slots_ptr, lens_ptr, b, h, k0, k_hi, ssl_b, ssl_h, ssl_k, sln_b, sln_h, sln_k,
               B: tl.constexpr, BB: tl.constexpr, PAGES: tl.constexpr):
    """Token rows of pages k0..k0+PAGES-1: slot [T] (int64, 0 where invalid), token in page [T],
    validity [T], with T = PAGES * BB. A slot of -1 is never read, whatever its length says."""
    t = tl.arange(0, PAGES * BB)
    k = k0 + t // BB
    tok = t % BB
    in_sel = k < k_hi
    b64 = b.to(tl.int64)
    slot = tl.load(slots_ptr + b64 * ssl_b + h * ssl_h + k * ssl_k, mask=in_sel, other=-1).to(tl.int64)
    plen = tl.load(lens_ptr + b64 * sln_b + h * sln_h + k * sln_k, mask=in_sel, other=0)
    valid = in_sel & (slot >= 0) & (tok < plen) & (tok < B)
    return tl.where(valid, slot, 0), tok, valid


@triton.jit
def sparse_decode_kernel(
    q_ptr, pool_ptr, slots_ptr, lens_ptr, o_ptr, lse_ptr,
    K, pages_per_split, sm_scale,
    sq_b, sq_h, sq_d, sp_s, sp_kv, sp_t, sp_d, ssl_b, ssl_h, ssl_k, sln_b, sln_h, sln_k,
    so_s, so_b, so_h, so_d, sl_s, sl_b, sl_h,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    B: tl.constexpr, BB: tl.constexpr, PAGES: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Grid (HKV * splits, Bt). o: [splits, Bt, Hq, D], lse: [splits, Bt, Hq] (strides given);
    a split with no valid token writes o = 0, lse = -inf."""
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
    k_lo = split * pages_per_split
    k_hi = tl.minimum(k_lo + pages_per_split, K)
    for k0 in range(k_lo, k_hi, PAGES):
        slot, tok, valid = _page_rows(slots_ptr, lens_ptr, b, h, k0, k_hi, ssl_b, ssl_h, ssl_k,
                                      sln_b, sln_h, sln_k, B, BB, PAGES)
        # int64: slot * sp_s exceeds 2^31 elements once the pool holds more than 4 GiB of bf16.
        row = slot * sp_s + tok * sp_t  # [T]
        kv_mask = valid[:, None] & (d < D)[None, :]
        keys = tl.load(pool_ptr + row[:, None] + d[None, :] * sp_d, mask=kv_mask, other=0.0)  # [T, DP]
        vals = tl.load(pool_ptr + sp_kv + row[:, None] + d[None, :] * sp_d, mask=kv_mask, other=0.0)
        zero = tl.zeros((GP, PAGES * BB), dtype=tl.float32)
        logits = dot_acc(q, tl.trans(keys.to(DOT)), zero, UPCAST, IEEE) * sm_scale  # [GP, T]
        logits = tl.where(valid[None, :], logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, axis=1))
        safe = neg_inf_safe(new_top)
        alpha = tl.exp(top - safe)
        p = tl.exp(logits - safe[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = dot_acc(p.to(DOT), vals.to(DOT), acc * alpha[:, None], UPCAST, IEEE)
        top = new_top
    lse = tl.where(total > 0, top + tl.log(tl.maximum(total, 1e-30)), float("-inf"))
    o = acc / tl.maximum(total, 1e-30)[:, None]
    o_off = split.to(tl.int64) * so_s + b.to(tl.int64) * so_b + head[:, None] * so_h + d[None, :] * so_d
    tl.store(o_ptr + o_off, o.to(o_ptr.dtype.element_ty), mask=(g < G)[:, None] & (d < D)[None, :])
    l_off = split.to(tl.int64) * sl_s + b.to(tl.int64) * sl_b + head * sl_h
    tl.store(lse_ptr + l_off, lse, mask=g < G)


# NOTE: S is not specialised (Triton would compile a variant for S == 1 and one for S % 16 == 0): the
# split count follows the prompt's length: a 32K prompt's tail (65 splits, where the warm-up had met
# 64) took 0.79 s in the first request on a fresh H100, by the launcher's arithmetic this compile.
# SC is the only variant.
@triton.jit(do_not_specialize=["S"])
def merge_splits_kernel(po_ptr, plse_ptr, o_ptr, lse_ptr, S, D: tl.constexpr, DP: tl.constexpr,
                        SC: tl.constexpr):
    """Merge S partials per query row by log-sum-exp. po: [S, ROWS, D], plse: [S, ROWS],
    o: [ROWS, D] (its store casts to o's dtype), lse: [ROWS] (all contiguous). Grid (ROWS,).
    All-empty rows give o = 0, -inf.
    Two passes over the splits, SC at a time (the register tile stays [SC, DP] for any S): the
    largest lse, then the weighted sum."""
    r = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0).to(tl.int64)
    c = tl.arange(0, SC)
    d = tl.arange(0, DP)
    tops = tl.full([SC], float("-inf"), tl.float32)  # running max per lane
    for s0 in range(0, S, SC):
        s = s0 + c
        tops = tl.maximum(tops, tl.load(plse_ptr + s * rows + r, mask=s < S, other=float("-inf")))
    top = neg_inf_safe(tl.max(tops, axis=0))
    totals = tl.zeros([SC], tl.float32)
    acc = tl.zeros([DP], tl.float32)
    for s0 in range(0, S, SC):
        s = s0 + c
        w = tl.exp(tl.load(plse_ptr + s * rows + r, mask=s < S, other=float("-inf")) - top)  # [SC]
        po = tl.load(po_ptr + (s[:, None] * rows + r) * D + d[None, :],
                     mask=(s < S)[:, None] & (d < D)[None, :], other=0.0)  # [SC, DP]
        totals += w
        acc += tl.sum(w[:, None] * po, axis=0)
    total = tl.sum(totals, axis=0)
    o = acc / tl.maximum(total, 1e-30)
    tl.store(o_ptr + r * D + d, o.to(o_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + r, tl.where(total > 0, top + tl.log(tl.maximum(total, 1e-30)), float("-inf")))
