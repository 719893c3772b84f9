"""@triton.jit code for LOCKS scoring (Eq. 4) from quantised summaries, and the share-average (Eq. 5).

One program scores BLOCK_P pages of one (sequence b, KV head h) for all G query heads of the group:

    proj[p, g, c]  = basis_scale[p, c] * sum_d basis_code[p, d, c] * q[g, d]     (tensor cores)
    centre[p, g]   = mu_scale[p] * sum_d mu_code[p, d] * q[g, d]                 (tensor cores)
    logit[p, g, i] = (centre[p, g] + coef_scale[p, i] * sum_c proj[p, g, c] * coef_code[p, i, c]) / sqrt(d)
    s_hat[g, p]    = logsumexp_i logit[p, g, i]

The basis is stored by rows (component c's d codes, in the order basis_d_order gives: the CUDA
kernel's fragment order for int4). Component c loads its row's words once per dimension d (word
pos[d] // VPW, field pos[d] % VPW, where pos inverts the storage order), unpacks the [BLOCK_M, d]
tile and multiplies it with q^T [d, GP] in one tl.dot (the G heads zero-padded to GP >= 16
columns). The other summary bytes of the tile are loaded before any arithmetic. The int4 codes
become bf16/fp16 by a magic-number bitcast that represents code + BIAS exactly; subtracting
BIAS * sum_d q[g, d] after the dot removes the offset. The coefficient stage runs per component on
[BLOCK_M, G2, BB] tiles (no 4-D temporaries). Scores also leave per-block (max, sum exp) partials
so that the share-average never re-reads summaries.
BLOCK_M = max(BLOCK_P, 16) rows per tile; rows past BLOCK_P are padding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common_jit import dot_acc, neg_inf_safe, to_f32

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _page_ids(table_ptr, npages_ptr, b, blk, P, num_ids, st_b, st_p, BLOCK_P: tl.constexpr,
              BLOCK_M: tl.constexpr):
    """Page positions p [BLOCK_M], their summary ids (int64, 0 where invalid) and validity.
    Rows >= BLOCK_P (a tile has >= 16 rows for the tensor cores) get p = P: outside the row."""
    m = tl.arange(0, BLOCK_M)
    p = tl.where(m < BLOCK_P, blk * BLOCK_P + m, P)
    n = tl.load(npages_ptr + b)
    in_row = (p < n) & (p < P)
    ids = tl.load(table_ptr + b.to(tl.int64) * st_b + p.to(tl.int64) * st_p, mask=in_row, other=0)
    ids = ids.to(tl.int64)
    # NOTE: ids outside [0, num_ids) score -inf instead of reading out of bounds.
    valid = in_row & (ids >= 0) & (ids < num_ids)
    return p, tl.where(valid, ids, 0), valid


@triton.jit
def _q_columns(q_ptr, b, h, sq_b, sq_h, sq_d, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
               DP: tl.constexpr):
    """q^T of the group [DP, GP] float32 (rows >= D and columns >= G are zero)."""
    d = tl.arange(0, DP)
    g = tl.arange(0, GP)
    ptr = q_ptr + b.to(tl.int64) * sq_b + (h * G + g)[None, :].to(tl.int64) * sq_h + d[:, None] * sq_d
    return tl.load(ptr, mask=(d < D)[:, None] & (g < G)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _dot_q(x, qf, SPLITS: tl.constexpr, DOT: tl.constexpr, UPCAST: tl.constexpr):
    """x [BLOCK_M, DP] (exact in DOT) @ qf [DP, GP] float32 -> [BLOCK_M, GP] float32.
    SPLITS == 3: float32 q as hi + mid + lo DOT parts, which carry all 24 mantissa bits."""
    q_hi = qf.to(DOT)
    acc = dot_acc(x, q_hi, tl.zeros((x.shape[0], qf.shape[1]), dtype=tl.float32), UPCAST, False)
    if SPLITS == 3:
        rest = qf - q_hi.to(tl.float32)
        q_mid = rest.to(DOT)
        acc = dot_acc(x, q_mid, acc, UPCAST, False)
        acc = dot_acc(x, (rest - q_mid.to(tl.float32)).to(DOT), acc, UPCAST, False)
    return acc


@triton.jit
def _fold_heads(acc, G2: tl.constexpr):
    """[BLOCK_M, GP] -> [BLOCK_M, G2]: columns >= G are zero, so summing the GP // G2 column
    blocks keeps columns 0..G2-1."""
    bp: tl.constexpr = acc.shape[0]
    gp: tl.constexpr = acc.shape[1]
    return tl.sum(tl.reshape(acc, (bp, gp // G2, G2)), axis=1)


@triton.jit
def _unpack(words, shift, BITS: tl.constexpr, MAG_SHIFT: tl.constexpr, MAG_XOR: tl.constexpr,
            DOT: tl.constexpr):
    """The field at bit `shift` [DP] of every word [BLOCK_M, DP] int32 as DOT codes (+ BIAS when
    BITS < 8)."""
    field = (words >> shift[None, :]) & ((1 << BITS) - 1)
    if BITS == 8:
        # signed int8, exact in bf16/fp16 (via float32: the interpreter mis-converts int -> bf16)
        return ((field ^ 0x80) - 0x80).to(tl.float32).to(DOT)
    else:
        # (field ^ half) is code + 2^(BITS-1) in [0, 16); shifted into the mantissa of 16.0 it
        # reads as 16 + code + 2^(BITS-1) = code + BIAS, exactly, in bf16 (shift 3) or fp16 (6).
        return ((field << MAG_SHIFT) ^ MAG_XOR).to(tl.int16).to(DOT, bitcast=True)


@triton.jit
def _pick(x, k: tl.constexpr):
    """x[:, :, k] of x [M, N, K]: a register select when each thread holds whole rows of K (the
    loads below are vectorised along K), so the sum folds away."""
    kk = tl.arange(0, x.shape[2])
    return tl.sum(tl.where((kk == k)[None, None, :], x, tl.zeros_like(x)), axis=2)


@triton.jit
def _component_words(words_ptr, ids, valid, h, c, word_of_d, sw_n, sw_h, sw_c, sw_w, D: tl.constexpr,
                     DP: tl.constexpr):
    """[BLOCK_M, DP] int32: for each page and dimension d, the word of row c holding d's code."""
    d = tl.arange(0, DP)
    row = ids * sw_n + h * sw_h + c * sw_c  # [M] first word of component c's row
    mask = valid[:, None] & (d < D)[None, :]
    return tl.load(words_ptr + row[:, None] + word_of_d[None, :] * sw_w, mask=mask, other=0).to(tl.int32)


@triton.jit
def _load_tile(bs_ptr, coef_ptr, cs_ptr, mu_ptr, ms_ptr, ids, valid, h,
               sbs_n, sbs_h, sbs_r, sc_n, sc_h, sc_b, sc_r, scs_n, scs_h,
               scs_b, smu_n, smu_h, smu_d, sms_n, sms_h, D: tl.constexpr, DP: tl.constexpr,
               B: tl.constexpr, BB: tl.constexpr, R: tl.constexpr):
    """The tile's summary bytes but the basis, loaded before any arithmetic: mu [M, DP],
    coef [M, BB, R] (raw codes), basis_scale [M, R], coef_scale [M, BB], mu_scale [M] (float32)."""
    d = tl.arange(0, DP)
    i = tl.arange(0, BB)
    c = tl.arange(0, R)
    m_d = valid[:, None] & (d < D)[None, :]
    m_i = valid[:, None] & (i < B)[None, :]
    mu = tl.load(mu_ptr + ids[:, None] * smu_n + h * smu_h + d[None, :] * smu_d, mask=m_d, other=0)
    # NOTE: row strides are multiples of R (the launcher checks): written as (s // R) * R so that
    # the compiler can load each row of R codes or scales as one vector.
    coef_row = (ids * sc_n + h * (sc_h // R) * R)[:, None, None] + i[None, :, None] * ((sc_b // R) * R)
    coef = tl.load(coef_ptr + coef_row + c[None, None, :] * sc_r, mask=m_i[:, :, None], other=0)
    bscale = tl.load(bs_ptr + (ids * sbs_n + h * (sbs_h // R) * R)[:, None] + c[None, :] * sbs_r,
                     mask=valid[:, None], other=0.0).to(tl.float32)
    cscale = tl.load(cs_ptr + (ids * scs_n + h * scs_h)[:, None] + i[None, :] * scs_b, mask=m_i,
                     other=0.0).to(tl.float32)
    mscale = tl.load(ms_ptr + ids * sms_n + h * sms_h, mask=valid, other=0.0).to(tl.float32)
    return mu, coef, bscale, cscale, mscale


@triton.jit
def _page_lse(dev, centre, cscale, valid, sm_scale, B: tl.constexpr, BB: tl.constexpr):
    """s_hat [M, G2] from dev [M, G2, BB] (coefficient-code units), centre [M, G2] and
    coef_scale [M, BB]."""
    i = tl.arange(0, BB)
    # logits in log2 units: exp2 / log2 are the native instructions
    scale = sm_scale * LOG2E
    logits = (centre[:, :, None] + dev * cscale[:, None, :]) * scale  # [M, G2, BB]
    logits = tl.where((i < B)[None, None, :], logits, float("-inf"))
    top = tl.max(logits, axis=2)
    lse = (top + tl.log2(tl.sum(tl.exp2(logits - top[:, :, None]), axis=2))) / LOG2E
    return tl.where(valid[:, None], lse, float("-inf"))


@triton.jit
def score_pages_kernel(
    q_ptr, words_ptr, pos_ptr, bs_ptr, coef_ptr, cs_ptr, mu_ptr, ms_ptr, table_ptr, npages_ptr,
    s_hat_ptr, pmax_ptr, psum_ptr,
    P, NB, num_ids, sm_scale,
    sq_b, sq_h, sq_d, sw_n, sw_h, sw_c, sw_w, sbs_n, sbs_h, sbs_r,
    sc_n, sc_h, sc_b, sc_r, scs_n, scs_h, scs_b, smu_n, smu_h, smu_d, sms_n, sms_h, st_b, st_p,
    HKV: tl.constexpr, G: tl.constexpr, G2: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, B: tl.constexpr, BB: tl.constexpr, R: tl.constexpr,
    VPW: tl.constexpr, BITS: tl.constexpr, MAG_SHIFT: tl.constexpr,
    MAG_XOR: tl.constexpr, BIAS: tl.constexpr, SPLITS: tl.constexpr, DOT: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, PARTIALS: tl.constexpr,
):
    """Grid (cdiv(P, BLOCK_P) * HKV, Bt); heads vary fastest so neighbouring programs read
    neighbouring summary bytes. Writes s_hat [Bt, HKV, G, P] (contiguous) and, if PARTIALS,
    pmax/psum [Bt, HKV, G, NB]: the max and sum exp(s - max) of this block's scores. pos [DP]
    int32: the storage position of each dimension in a basis row."""
    pid = tl.program_id(0)
    h = pid % HKV
    blk = pid // HKV
    b = tl.program_id(1)
    p, ids, valid = _page_ids(table_ptr, npages_ptr, b, blk, P, num_ids, st_b, st_p, BLOCK_P, BLOCK_M)
    qf = _q_columns(q_ptr, b, h, sq_b, sq_h, sq_d, G, GP, D, DP)  # [DP, GP]
    mu, coef, bscale, cscale, mscale = _load_tile(
        bs_ptr, coef_ptr, cs_ptr, mu_ptr, ms_ptr, ids, valid, h,
        sbs_n, sbs_h, sbs_r, sc_n, sc_h, sc_b, sc_r, scs_n, scs_h, scs_b, smu_n, smu_h, smu_d,
        sms_n, sms_h, D, DP, B, BB, R)
    dd = tl.arange(0, DP)
    pos = tl.load(pos_ptr + dd, mask=dd < D, other=0)  # [DP] storage position of d
    word_of_d = pos // VPW
    shift = (pos % VPW) * BITS
    q_bias = BIAS * tl.sum(qf, axis=0)  # [GP]: what the codes' offset adds to each column
    dev = tl.zeros((BLOCK_M, G2, BB), dtype=tl.float32)
    for c in tl.static_range(R):
        words = _component_words(words_ptr, ids, valid, h, c, word_of_d, sw_n, sw_h, sw_c, sw_w, D, DP)
        codes = _unpack(words, shift, BITS, MAG_SHIFT, MAG_XOR, DOT)  # [BLOCK_M, DP]
        proj = _fold_heads(_dot_q(codes, qf, SPLITS, DOT, UPCAST) - q_bias[None, :], G2)
        proj = proj * _pick(bscale[:, None, :], c)  # [BLOCK_M, G2]
        coef_c = to_f32(_pick(coef, c))  # [BLOCK_M, BB]
        dev += proj[:, :, None] * coef_c[:, None, :]
    mu_dot = _dot_q(to_f32(mu).to(DOT), qf, SPLITS, DOT, UPCAST)  # int8/bf16 codes are exact in DOT
    centre = _fold_heads(mu_dot, G2) * mscale[:, None]  # [BLOCK_M, G2]
    s = _page_lse(dev, centre, cscale, valid, sm_scale, B, BB)  # [BLOCK_M, G2]
    g = tl.arange(0, G2)
    out_row = (b.to(tl.int64) * HKV + h) * G + g  # [G2] row of s_hat viewed as [Bt * HKV * G, P]
    tl.store(s_hat_ptr + out_row[None, :] * P + p[:, None], s, mask=(g < G)[None, :] & (p < P)[:, None])
    if PARTIALS:
        top = tl.max(s, axis=0)
        total = tl.sum(tl.exp(s - neg_inf_safe(top)[None, :]), axis=0)
        tl.store(pmax_ptr + out_row * NB + blk, top, mask=g < G)
        tl.store(psum_ptr + out_row * NB + blk, total, mask=g < G)


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


@triton.jit
def group_stats_kernel(pmax_ptr, psum_ptr, stats_ptr, NB, BLOCK: tl.constexpr):
    """Grid (ROWS,), a row per (sequence, KV head, query head): stats[row] = (M, Z) with
    M = max_nb pmax and Z = sum_nb psum exp(pmax - M), from the score kernel's per-block partials
    pmax, psum [ROWS, NB] (contiguous); (-inf, 0) for a row without a finite score."""
    r = tl.program_id(0).to(tl.int64)
    top = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), dtype=tl.float32)
    for j0 in range(0, NB, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        pm = tl.load(pmax_ptr + r * NB + j, mask=j < NB, other=float("-inf"))
        ps = tl.load(psum_ptr + r * NB + j, mask=j < NB, other=0.0)
        new_top = tl.maximum(top, tl.max(pm, axis=0))
        safe = neg_inf_safe(new_top)
        total = total * tl.exp(top - safe) + tl.sum(ps * tl.exp(pm - safe), axis=0)
        top = new_top
    tl.store(stats_ptr + r * 2, top)
    tl.store(stats_ptr + r * 2 + 1, total)
