"""Launchers for the fused decode-step kernels: validate, pick block sizes, launch.

    add_rms_norm_triton(x, residual, weight, eps)                     -> (y, new_residual) [T, H]
    rope_write_triton(qkv, cos, sin, Hq, Hkv, pool, write_loc, write_off, row_base) -> q_rot [T, Hq, d]
    silu_mul_triton(gate_up)                                          -> [T, I]

They compute kernels/fused.py's references with the same conventions. rope_write and the
residual sum are bit-exact; RMSNorm differs from the reference only by the order of the float32
sum of squares, silu_mul by rounding once (the reference rounds silu(gate) to the input dtype
before the product) and by exp's last bits.
"""

from __future__ import annotations

import torch
import triton

from .checks import (
    check_output,
    check_runnable,
    check_tensor,
    check_unit_stride,
    is_interpreted,
    next_pow2,
    output,
)
from .fused_kernel import add_rms_norm_kernel, rope_write_kernel, silu_mul_kernel

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HIDDEN = 32768  # one row per program: BLOCK = next_pow2(H) values in registers
MAX_GRID_Y = 65535  # CUDA limit of the second grid dimension
SILU_BLOCK = 1024
# NOTE: eager torch never contracts a * b - c into an FMA; the kernels must not either to match it.
NO_FMA = {"enable_fp_fusion": False}


def _warps(elements: int) -> int:
    return max(1, min(16, elements // 256))


def check_add_rms_norm_inputs(x, residual, weight, y_out=None, residual_out=None) -> tuple[int, int]:
    """ValueError unless add_rms_norm's arguments fit (see add_rms_norm_triton). Returns (T, H)."""
    t, h = check_tensor("x", x, (("T", None), ("H", None)), FLOAT_DTYPES)
    dev, dt = x.device, (x.dtype,)
    if residual is not None:
        check_tensor("residual", residual, (("T", t), ("H", h)), dt, dev)
        check_unit_stride("residual", residual)
    check_tensor("weight", weight, (("H", h),), dt, dev)
    check_unit_stride("x", x)
    check_unit_stride("weight", weight)
    if h > MAX_HIDDEN:
        raise ValueError(f"x: hidden size H ({h}) must be <= {MAX_HIDDEN}")
    check_output("y_out", y_out, (t, h), dev, x.dtype)
    check_output("residual_out", residual_out, (t, h), dev, x.dtype)
    if y_out is not None and residual_out is not None and y_out.data_ptr() == residual_out.data_ptr():
        raise ValueError("y_out: must not be the same buffer as residual_out")
    return t, h


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    y_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual rounded to x's dtype (x itself when residual is None), then
    y = weight * rms_normalised(new_residual) (float32 maths), one program per row.

    x: [T, H] float32/bf16/fp16 (unit column stride); residual: [T, H] or None; weight: [H]; all
    one dtype. Returns (y, new_residual), each [T, H] in x's dtype, written into y_out /
    residual_out (contiguous) when given. residual_out may be residual itself (or x): the sum is
    then written in place. With residual None and residual_out given, x is copied into it.
    """
    t, h = check_add_rms_norm_inputs(x, residual, weight, y_out, residual_out)
    check_runnable("x", x, add_rms_norm_kernel)
    y = output("y_out", y_out, (t, h), x.device, x.dtype)
    new_residual = residual_out
    if new_residual is None:
        new_residual = x if residual is None else torch.empty_like(y)
    if t == 0:
        return y, new_residual
    block = next_pow2(h)
    res = residual if residual is not None else x  # never read when HAS_RES is False
    add_rms_norm_kernel[(t,)](
        x, res, weight, y, new_residual, h, float(eps),
        x.stride(0), res.stride(0), y.stride(0), new_residual.stride(0),
        HAS_RES=residual is not None, WRITE_RES=new_residual is not x, BLOCK=block,
        EMULATE_RTNE=is_interpreted(add_rms_norm_kernel), num_warps=_warps(block), **NO_FMA,
    )
    return y, new_residual


def check_rope_write_inputs(qkv, cos, sin, num_heads, num_kv_heads, pool, write_loc, write_off, row_base,
                            out=None) -> tuple[int, int]:
    """ValueError unless rope_write's arguments fit (see rope_write_triton). Returns (T, d)."""
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads ({num_heads}) and num_kv_heads ({num_kv_heads}) must be >= 1")
    t, _ = check_tensor("qkv", qkv, (("T", None), ("(Hq + 2 Hkv) d", None)), FLOAT_DTYPES)
    dev = qkv.device
    pool_dims = (("S", None), ("2", 2), ("B", None), ("d", None))
    s, _, _, d = check_tensor("pool", pool, pool_dims, FLOAT_DTYPES, dev)
    if d % 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d:
        raise ValueError(
            f"qkv: expected [T, (Hq + 2 Hkv) d] = [T, {(num_heads + 2 * num_kv_heads) * d}] with Hq="
            f"{num_heads}, Hkv={num_kv_heads}, d={d} (even), got {tuple(qkv.shape)}"
        )
    for name, cs in (("cos", cos), ("sin", sin)):
        check_tensor(name, cs, (("T", t), ("d/2", d // 2)), (torch.float32,), dev)
        check_unit_stride(name, cs)
    check_tensor("write_loc", write_loc, (("T", t),), INDEX_DTYPES, dev)
    check_tensor("write_off", write_off, (("T", t),), INDEX_DTYPES, dev)
    check_unit_stride("qkv", qkv)
    if not isinstance(row_base, int) or not 0 <= row_base * num_kv_heads < s:
        raise ValueError(f"row_base ({row_base}) must be >= 0 and its slots inside pool (S={s})")
    check_output("out", out, (t, num_heads, d), dev, qkv.dtype)
    return t, d


def rope_write_triton(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    pool: torch.Tensor,
    write_loc: torch.Tensor,
    write_off: torch.Tensor,
    row_base: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on q and k of the fused QKV projection, and rotated k / v written into the KV pool.

    qkv: [T, (Hq + 2 Hkv) d] float32/bf16/fp16 (q heads, k heads, v heads; unit column stride);
    cos, sin: [T, d/2] float32; pool: [S, 2, B, d] float32/bf16/fp16, any strides (k, v cast to
    its dtype); write_loc: [T] int32/int64 page location, negative = padding (nothing written);
    write_off: [T] int32/int64 offset in the page, in [0, B) (not checked: it lives on the device);
    row_base: layer * rows_per_layer. Token t, KV head h goes to pool slot
    (row_base + write_loc[t]) * Hkv + h, computed in int64; the caller keeps it below S.
    Returns q_rot: [T, Hq, d] in qkv's dtype, written into out (contiguous) when given.
    """
    t, d = check_rope_write_inputs(qkv, cos, sin, num_heads, num_kv_heads, pool, write_loc, write_off,
                                   row_base, out)
    check_runnable("qkv", qkv, rope_write_kernel)
    q = output("out", out, (t, num_heads, d), qkv.device, qkv.dtype)
    if t == 0:
        return q
    hq, hkv, dh = next_pow2(num_heads), next_pow2(num_kv_heads), next_pow2(d // 2)
    rope_write_kernel[(t,)](
        qkv, cos, sin, q, pool, write_loc, write_off, int(row_base),
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), *pool.stride(),
        write_loc.stride(0), write_off.stride(0),
        HQ=num_heads, HKV=num_kv_heads, D=d, HQP=hq, HKVP=hkv, DHP=dh,
        EMULATE_RTNE=is_interpreted(rope_write_kernel), num_warps=_warps(hq * dh), **NO_FMA,
    )
    return q


def check_silu_mul_inputs(gate_up, out=None) -> tuple[int, int]:
    """ValueError unless silu_mul's arguments fit (see silu_mul_triton). Returns (T, I)."""
    t, two_i = check_tensor("gate_up", gate_up, (("T", None), ("2I", None)), FLOAT_DTYPES)
    if two_i % 2:
        raise ValueError(f"gate_up: expected an even last dim 2I, got {tuple(gate_up.shape)}")
    check_unit_stride("gate_up", gate_up)
    if triton.cdiv(two_i // 2, SILU_BLOCK) > MAX_GRID_Y:
        raise ValueError(f"gate_up: intermediate size I ({two_i // 2}) must be <= {MAX_GRID_Y * SILU_BLOCK}")
    check_output("out", out, (t, two_i // 2), gate_up.device, gate_up.dtype)
    return t, two_i // 2


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation: gate_up [T, 2I] float32/bf16/fp16 (gate, then up; unit column
    stride) -> silu(gate) * up [T, I] in its dtype, float32 maths rounded once (into out when
    given, contiguous)."""
    t, inter = check_silu_mul_inputs(gate_up, out)
    check_runnable("gate_up", gate_up, silu_mul_kernel)
    y = output("out", out, (t, inter), gate_up.device, gate_up.dtype)
    if t == 0 or inter == 0:
        return y
    block = min(SILU_BLOCK, next_pow2(inter))
    silu_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, y, inter, gate_up.stride(0), y.stride(0), BLOCK=block,
        EMULATE_RTNE=is_interpreted(silu_mul_kernel), num_warps=_warps(block), **NO_FMA,
    )
    return y
