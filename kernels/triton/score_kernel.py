"""@triton.jit code for LOCKS scoring (Eq. 4) from quantised summaries, and the share-average (Eq. 5).

One program scores BLOCK_P pages of one (sequence b, KV head h) for all G query heads of the group:

    proj[g, p, c]  = basis_scale[p, c] * sum_d q[g, d] * basis_code[p, d, c]     (tensor cores)
    centre[g, p]   = mu_scale[p] * sum_d q[g, d] * mu_code[p, d]
    logit[g, p, i] = (centre[g, p] + sum_c proj[g, p, c] * coef[p, i, c]) / sqrt(d)
    s_hat[g, p]    = logsumexp_i logit[g, p, i]

The basis codes of BLOCK_P pages form one [d, BLOCK_P * r] operand, so the projection is a
single tl.dot of the [GP, d] query tile (G rows, zero-padded to GP >= 16) with it. The int4 codes
are turned into bf16/fp16 by a magic-number bitcast, which represents code + BIAS exactly; the
launcher's BIAS * sum_d q[g, d] correction removes the offset after the dot (no per-element
subtraction, no int->float conversion). Scores also leave per-block (max, sum exp) partials so
that the share-average never re-reads summaries.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_jit import dot_acc, neg_inf_safe, to_f32


@triton.jit
def _page_ids(table_ptr, npages_ptr, b, blk, P, num_ids, st_b, st_p, BLOCK_P: tl.constexpr):
    """Page positions p [BLOCK_P], their summary ids (int64, 0 where invalid) and validity."""
    p = blk * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.load(npages_ptr + b)
    in_row = (p < n) & (p < P)
    ids = tl.load(table_ptr + b.to(tl.int64) * st_b + p.to(tl.int64) * st_p, mask=in_row, other=0)
    ids = ids.to(tl.int64)
    # NOTE: ids outside [0, num_ids) score -inf instead of reading out of bounds.
    valid = in_row & (ids >= 0) & (ids < num_ids)
    return p, tl.where(valid, ids, 0), valid


@triton.jit
def _q_chunk(q_ptr, b, h, d0, sq_b, sq_h, sq_d, G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """q rows of the group [ROWS, BLOCK_D] float32 (rows >= G and columns >= D are zero)."""
    g = tl.arange(0, ROWS)
    d = d0 + tl.arange(0, BLOCK_D)
    ptr = q_ptr + b.to(tl.int64) * sq_b + (h * G + g)[:, None].to(tl.int64) * sq_h + d[None, :] * sq_d
    return tl.load(ptr, mask=(g < G)[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _basis_codes(words_ptr, ids, valid, h, d0, sw_n, sw_h, sw_d, sw_w,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, R: tl.constexpr,
                 W: tl.constexpr, VPW: tl.constexpr, BITS: tl.constexpr, MAG_SHIFT: tl.constexpr,
                 MAG_XOR: tl.constexpr, DOT: tl.constexpr):
    """Basis codes of BLOCK_P pages, rows d0.. of d: [BLOCK_D, BLOCK_P * R] in the dot dtype.

    Column p * R + c holds page p's code for component c, plus the launcher's BIAS when BITS < 8.
    A row of one page is W words of VPW codes each, low bits first (the pack_bits layout).
    """
    d = d0 + tl.arange(0, BLOCK_D)
    w = tl.arange(0, W)
    off = ids[None, :, None] * sw_n + h * sw_h + d[:, None, None] * sw_d + w[None, None, :] * sw_w
    mask = valid[None, :, None] & (d < D)[:, None, None]
    words = tl.load(words_ptr + off, mask=mask, other=0).to(tl.int32)  # [BLOCK_D, BLOCK_P, W]
    shifts = tl.arange(0, VPW) * BITS
    field = (words[:, :, :, None] >> shifts[None, None, None, :]) & ((1 << BITS) - 1)
    if BITS == 8:
        # signed int8, exact in bf16/fp16 (via float32: the interpreter mis-converts int -> bf16)
        codes = ((field ^ 0x80) - 0x80).to(tl.float32).to(DOT)
    else:
        # (field ^ half) is code + 2^(BITS-1) in [0, 16); shifted into the mantissa of 16.0 it
        # reads as 16 + code + 2^(BITS-1) = code + BIAS, exactly, in bf16 (shift 3) or fp16 (6).
        bits = (field << MAG_SHIFT) ^ MAG_XOR
        codes = bits.to(tl.int16).to(DOT, bitcast=True)
    return tl.reshape(codes, (BLOCK_D, BLOCK_P * R))


@triton.jit
def _project_and_centre(q_ptr, words_ptr, mu_ptr, ids, valid, b, h,
                        sq_b, sq_h, sq_d, sw_n, sw_h, sw_d, sw_w, smu_n, smu_h, smu_d,
                        G: tl.constexpr, G2: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                        DP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                        R: tl.constexpr, W: tl.constexpr, VPW: tl.constexpr, BITS: tl.constexpr,
                        MAG_SHIFT: tl.constexpr, MAG_XOR: tl.constexpr, BIAS: tl.constexpr,
                        SPLITS: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """proj in code units [G2, BLOCK_P, R] and centre in mu-code units [G2, BLOCK_P] (float32)."""
    acc = tl.zeros((GP, BLOCK_P * R), dtype=tl.float32)
    q_sum = tl.zeros((GP,), dtype=tl.float32)
    centre = tl.zeros((G2, BLOCK_P), dtype=tl.float32)
    for d0 in tl.static_range(0, DP, BLOCK_D):
        codes = _basis_codes(words_ptr, ids, valid, h, d0, sw_n, sw_h, sw_d, sw_w, D, BLOCK_D,
                             BLOCK_P, R, W, VPW, BITS, MAG_SHIFT, MAG_XOR, DOT)
        qf = _q_chunk(q_ptr, b, h, d0, sq_b, sq_h, sq_d, G, D, GP, BLOCK_D)  # [GP, BLOCK_D]
        q_hi = qf.to(DOT)
        acc = dot_acc(q_hi, codes, acc, UPCAST, False)
        if SPLITS == 3:  # float32 q: hi + mid + lo bf16 parts carry all 24 mantissa bits
            rest = qf - q_hi.to(tl.float32)
            q_mid = rest.to(DOT)
            acc = dot_acc(q_mid, codes, acc, UPCAST, False)
            acc = dot_acc((rest - q_mid.to(tl.float32)).to(DOT), codes, acc, UPCAST, False)
        q_sum += tl.sum(qf, axis=1)
        d = d0 + tl.arange(0, BLOCK_D)
        mu_off = ids[:, None] * smu_n + h * smu_h + d[None, :] * smu_d
        mu = to_f32(tl.load(mu_ptr + mu_off, mask=valid[:, None] & (d < D)[None, :], other=0))
        qg = _q_chunk(q_ptr, b, h, d0, sq_b, sq_h, sq_d, G, D, G2, BLOCK_D)  # [G2, BLOCK_D]
        centre += tl.sum(qg[:, None, :] * mu[None, :, :], axis=2)
    acc = acc - BIAS * q_sum[:, None]
    # Rows >= G of the query tile are zero, so summing GP // G2 row blocks keeps rows 0..G2-1.
    proj = tl.sum(tl.reshape(acc, (GP // G2, G2, BLOCK_P * R)), axis=0)
    return tl.reshape(proj, (G2, BLOCK_P, R)), centre


@triton.jit
def _page_lse(proj, centre, ids, valid, h, bs_ptr, coef_ptr, cs_ptr, ms_ptr, sm_scale,
              sbs_n, sbs_h, sbs_r, sc_n, sc_h, sc_b, sc_r, scs_n, scs_h, scs_b, sms_n, sms_h,
              B: tl.constexpr, BB: tl.constexpr, BLOCK_P: tl.constexpr, R: tl.constexpr):
    """s_hat [G2, BLOCK_P] from proj [G2, BLOCK_P, R] and centre [G2, BLOCK_P] (code units)."""
    c = tl.arange(0, R)
    i = tl.arange(0, BB)
    bscale = tl.load(bs_ptr + ids[:, None] * sbs_n + h * sbs_h + c[None, :] * sbs_r,
                     mask=valid[:, None], other=0.0).to(tl.float32)  # [BLOCK_P, R]
    coef_off = ids[:, None, None] * sc_n + h * sc_h + i[None, :, None] * sc_b + c[None, None, :] * sc_r
    coef_mask = valid[:, None, None] & (i < B)[None, :, None]
    coef = to_f32(tl.load(coef_ptr + coef_off, mask=coef_mask, other=0))  # [BLOCK_P, BB, R]
    cscale = tl.load(cs_ptr + ids[:, None] * scs_n + h * scs_h + i[None, :] * scs_b,
                     mask=valid[:, None] & (i < B)[None, :], other=0.0).to(tl.float32)  # [BLOCK_P, BB]
    mscale = tl.load(ms_ptr + ids * sms_n + h * sms_h, mask=valid, other=0.0).to(tl.float32)
    proj = proj * bscale[None, :, :]
    dev = tl.sum(proj[:, :, None, :] * coef[None, :, :, :], axis=3) * cscale[None, :, :]
    logits = (centre * mscale[None, :])[:, :, None] + dev  # [G2, BLOCK_P, BB]
    logits = tl.where((i < B)[None, None, :], logits * sm_scale, float("-inf"))
    top = tl.max(logits, axis=2)
    lse = top + tl.log(tl.sum(tl.exp(logits - top[:, :, None]), axis=2))
    return tl.where(valid[None, :], lse, float("-inf"))


@triton.jit
def score_pages_kernel(
    q_ptr, words_ptr, bs_ptr, coef_ptr, cs_ptr, mu_ptr, ms_ptr, table_ptr, npages_ptr,
    s_hat_ptr, pmax_ptr, psum_ptr,
    P, NB, num_ids, sm_scale,
    sq_b, sq_h, sq_d, sw_n, sw_h, sw_d, sw_w, sbs_n, sbs_h, sbs_r,
    sc_n, sc_h, sc_b, sc_r, scs_n, scs_h, scs_b, smu_n, smu_h, smu_d, sms_n, sms_h, st_b, st_p,
    HKV: tl.constexpr, G: tl.constexpr, G2: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, BLOCK_D: tl.constexpr, B: tl.constexpr, BB: tl.constexpr, R: tl.constexpr,
    W: tl.constexpr, VPW: tl.constexpr, BITS: tl.constexpr, MAG_SHIFT: tl.constexpr,
    MAG_XOR: tl.constexpr, BIAS: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_P: tl.constexpr, PARTIALS: tl.constexpr,
):
    """Grid (cdiv(P, BLOCK_P) * HKV, Bt); heads vary fastest so neighbouring programs read
    neighbouring summary bytes. Writes s_hat [Bt, HKV, G, P] (contiguous) and, if PARTIALS,
    pmax/psum [Bt, HKV, G, NB]: the max and sum exp(s - max) of this block's scores."""
    pid = tl.program_id(0)
    h = pid % HKV
    blk = pid // HKV
    b = tl.program_id(1)
    p, ids, valid = _page_ids(table_ptr, npages_ptr, b, blk, P, num_ids, st_b, st_p, BLOCK_P)
    proj, centre = _project_and_centre(
        q_ptr, words_ptr, mu_ptr, ids, valid, b, h, sq_b, sq_h, sq_d, sw_n, sw_h, sw_d, sw_w,
        smu_n, smu_h, smu_d, G, G2, GP, D, DP, BLOCK_D, BLOCK_P, R, W, VPW, BITS, MAG_SHIFT,
        MAG_XOR, BIAS, SPLITS, DOT, UPCAST)
    s = _page_lse(proj, centre, ids, valid, h, bs_ptr, coef_ptr, cs_ptr, ms_ptr, sm_scale,
                  sbs_n, sbs_h, sbs_r, sc_n, sc_h, sc_b, sc_r, scs_n, scs_h, scs_b, sms_n, sms_h,
                  B, BB, BLOCK_P, R)  # [G2, BLOCK_P]
    g = tl.arange(0, G2)
    row = (b.to(tl.int64) * HKV + h) * G + g  # [G2] row of s_hat viewed as [Bt * HKV * G, P]
    tl.store(s_hat_ptr + row[:, None] * P + p[None, :], s, mask=(g < G)[:, None] & (p < P)[None, :])
    if PARTIALS:
        top = tl.max(s, axis=1)
        total = tl.sum(tl.exp(s - neg_inf_safe(top)[:, None]), axis=1)
        tl.store(pmax_ptr + row * NB + blk, top, mask=g < G)
        tl.store(psum_ptr + row * NB + blk, total, mask=g < G)


@triton.jit
def row_partials_kernel(s_ptr, pmax_ptr, psum_ptr, P, NB, ss_r, ss_g, ss_p,
                        G: tl.constexpr, G2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-block (max, sum exp) of s [ROWS, G, P] -> pmax/psum [ROWS, G, NB]. Grid (NB, ROWS)."""
    blk = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G2)
    p = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask = (g < G)[:, None] & (p < P)[None, :]
    s = tl.load(s_ptr + r * ss_r + g[:, None] * ss_g + p[None, :].to(tl.int64) * ss_p, mask=mask,
                other=float("-inf")).to(tl.float32)
    top = tl.max(s, axis=1)
    total = tl.sum(tl.exp(s - neg_inf_safe(top)[:, None]), axis=1)
    tl.store(pmax_ptr + (r * G + g) * NB + blk, top, mask=g < G)
    tl.store(psum_ptr + (r * G + g) * NB + blk, total, mask=g < G)


@triton.jit
def share_average_kernel(s_ptr, pmax_ptr, psum_ptr, m_ptr, P, NB, SPAN, ss_r, ss_g, ss_p,
                         G: tl.constexpr, G2: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_NB: tl.constexpr):
    """m_bar[r, p] = mean_g exp(s[r, g, p] - M[r, g]) / Z[r, g] (Eq. 5), where (M, Z) merge the
    block partials. Grid (cdiv(P, SPAN), ROWS), SPAN a multiple of BLOCK_M: each program merges
    the partials once and then normalises SPAN pages; m_bar [ROWS, P] contiguous. A row whose
    scores are all -inf gets zeros (as the reference's safe softmax)."""
    blk = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, G2)
    top = tl.full((G2,), float("-inf"), tl.float32)
    total = tl.zeros((G2,), dtype=tl.float32)
    for j0 in range(0, NB, BLOCK_NB):
        j = j0 + tl.arange(0, BLOCK_NB)
        mask = (g < G)[:, None] & (j < NB)[None, :]
        off = (r * G + g)[:, None] * NB + j[None, :]
        pm = tl.load(pmax_ptr + off, mask=mask, other=float("-inf"))
        ps = tl.load(psum_ptr + off, mask=mask, other=0.0)
        new_top = tl.maximum(top, tl.max(pm, axis=1))
        safe = neg_inf_safe(new_top)
        total = total * tl.exp(top - safe) + tl.sum(ps * tl.exp(pm - safe[:, None]), axis=1)
        top = new_top
    safe = neg_inf_safe(top)
    inv_total = 1.0 / tl.maximum(total, 1e-30)
    for p0 in range(blk * SPAN, tl.minimum(blk * SPAN + SPAN, P), BLOCK_M):
        p = p0 + tl.arange(0, BLOCK_M)
        mask = (g < G)[:, None] & (p < P)[None, :]
        s = tl.load(s_ptr + r * ss_r + g[:, None] * ss_g + p[None, :].to(tl.int64) * ss_p, mask=mask,
                    other=float("-inf")).to(tl.float32)
        m = tl.exp(s - safe[:, None]) * inv_total[:, None]
        tl.store(m_ptr + r * P + p, tl.sum(m, axis=0) / G, mask=p < P)
