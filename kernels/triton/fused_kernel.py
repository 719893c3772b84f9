"""@triton.jit code for the fused decode-step ops (launchers in fused.py, reference in
kernels/fused.py).

All maths is float32 with each value rounded to the storage dtype where the reference rounds it
(round_to); the launchers compile with fp contraction off, so products are not fused into FMAs
that the eager torch reference does not do. Row and slot offsets are int64. The scalar loads of
one token's write location are in bounds by the grid (one program per token).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """x rounded to dtype, to nearest even, through float32 (as torch converts bf16 <-> fp16).

    NOTE: Triton 3.6's CPU interpreter truncates float32 -> bfloat16 casts and reinterprets the
    bits of bfloat16 -> float16 casts; with EMULATE_RTNE (the launchers set it under
    TRITON_INTERPRET=1) the float32 bits are rounded first so that the cast is exact. NaN
    payloads are not preserved there.
    """
    y = x
    if x.dtype != dtype:
        y = x.to(tl.float32)
        if EMULATE_RTNE and dtype == tl.bfloat16:
            bits = y.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            y = bits.to(tl.float32, bitcast=True)
        y = y.to(dtype)
    return y


@triton.jit
def add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, H, eps,
    sx_t, sr_t, sy_t, sro_t,
    HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, BLOCK: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Grid (T,), one row each. x, residual, y, residual_out: [T, H] (unit column stride, row
    strides given); w: [H] contiguous. residual_out may alias residual or x: every element is read
    by the program that writes it, before it writes it."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + t * sx_t + cols, mask=mask, other=0.0)  # [BLOCK], x's dtype
    if HAS_RES:
        r = tl.load(res_ptr + t * sr_t + cols, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + r.to(tl.float32), x.dtype, EMULATE_RTNE)  # torch's x + residual
    if WRITE_RES:
        tl.store(res_out_ptr + t * sro_t + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(x32 * x32, axis=0), H * 1.0)
    inv_rms = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean_sq + eps))  # torch's CPU rsqrt: 1 / sqrt
    normed = round_to(x32 * inv_rms, x.dtype, EMULATE_RTNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(w * normed, y_ptr.dtype.element_ty, EMULATE_RTNE)
    tl.store(y_ptr + t * sy_t + cols, y, mask=mask)


@triton.jit
def _head_halves(row_ptr, head, head_ok, j, j_ok, D: tl.constexpr):
    """Both halves of heads `head` [HP] of one qkv row (head-major, unit stride): (x1, x2, mask),
    x1 = dims j [DHP] and x2 = dims D/2 + j, each [HP, DHP] in qkv's dtype."""
    off = head[:, None] * D + j[None, :]
    mask = head_ok[:, None] & j_ok[None, :]
    x1 = tl.load(row_ptr + off, mask=mask, other=0.0)
    x2 = tl.load(row_ptr + off + D // 2, mask=mask, other=0.0)
    return x1, x2, mask


@triton.jit
def _rotate(x1, x2, cos, sin, EMULATE_RTNE: tl.constexpr):
    """Rotate-half RoPE in float32, rounded back to x's dtype. x1, x2: [HP, DHP]; cos, sin: [1, DHP]."""
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    o1 = round_to(a * cos - b * sin, x1.dtype, EMULATE_RTNE)
    o2 = round_to(b * cos + a * sin, x1.dtype, EMULATE_RTNE)
    return o1, o2


@triton.jit
def rope_write_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, pool_ptr, loc_ptr, off_ptr, row_base,
    s_qkv, s_cos, s_sin, s_q, sp_s, sp_kv, sp_t, sp_d, s_loc, s_off,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    HQP: tl.constexpr, HKVP: tl.constexpr, DHP: tl.constexpr, EMULATE_RTNE: tl.constexpr,
):
    """Grid (T,), one token each. qkv: [T, (HQ + 2 HKV) D] (unit column stride); cos, sin:
    [T, D/2] float32 (unit column stride); q: [T, HQ, D] contiguous; pool: [S, 2, B, D] (strides
    given); loc, off: [T]. Writes q_rot, and rotated k / v into pool slot (row_base + loc) * HKV + h
    at page offset off when loc >= 0."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, DHP)
    j_ok = j < D // 2
    cos = tl.load(cos_ptr + t * s_cos + j, mask=j_ok, other=0.0)[None, :]  # [1, DHP]
    sin = tl.load(sin_ptr + t * s_sin + j, mask=j_ok, other=0.0)[None, :]
    row = qkv_ptr + t * s_qkv
    hq = tl.arange(0, HQP)
    q1, q2, q_mask = _head_halves(row, hq, hq < HQ, j, j_ok, D)
    q1, q2 = _rotate(q1, q2, cos, sin, EMULATE_RTNE)
    q_off = t * s_q + hq[:, None] * D + j[None, :]
    tl.store(q_ptr + q_off, q1, mask=q_mask)
    tl.store(q_ptr + q_off + D // 2, q2, mask=q_mask)

    loc = tl.load(loc_ptr + t * s_loc).to(tl.int64)
    page_off = tl.load(off_ptr + t * s_off).to(tl.int64)
    hk = tl.arange(0, HKVP)
    k1, k2, kv_mask = _head_halves(row, HQ + hk, hk < HKV, j, j_ok, D)
    v1, v2, _ = _head_halves(row, HQ + HKV + hk, hk < HKV, j, j_ok, D)
    k1, k2 = _rotate(k1, k2, cos, sin, EMULATE_RTNE)
    kv_mask = kv_mask & (loc >= 0)  # padding rows write nothing
    # int64: slot * sp_s passes 2^31 elements once the pool holds more than 4 GiB of bf16.
    slot = (row_base + tl.maximum(loc, 0)) * HKV + hk  # [HKVP] int64
    dst = pool_ptr + slot[:, None] * sp_s + page_off * sp_t + j[None, :] * sp_d  # [HKVP, DHP]
    hi = (D // 2) * sp_d
    pool_ty: tl.constexpr = pool_ptr.dtype.element_ty
    tl.store(dst, round_to(k1, pool_ty, EMULATE_RTNE), mask=kv_mask)
    tl.store(dst + hi, round_to(k2, pool_ty, EMULATE_RTNE), mask=kv_mask)
    tl.store(dst + sp_kv, round_to(v1, pool_ty, EMULATE_RTNE), mask=kv_mask)
    tl.store(dst + sp_kv + hi, round_to(v2, pool_ty, EMULATE_RTNE), mask=kv_mask)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, inter, s_gu, s_out, BLOCK: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)), I = inter. gate_up: [T, 2I], out: [T, I] (unit column strides,
    row strides given). out = silu(gate) * up in float32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + t * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * s_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * s_out + cols, round_to(y, out_ptr.dtype.element_ty, EMULATE_RTNE), mask=mask)
