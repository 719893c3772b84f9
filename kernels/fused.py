"""Fused decode-step ops — the torch reference (the ground truth the Triton kernels are tested
against, and the CPU path of lockserve.kernels.ops).

    add_rms_norm_ref(x, residual, weight, eps)                         -> (y, new_residual)
    rope_write_ref(qkv, cos, sin, Hq, Hkv, pool, write_loc, write_off, row_base) -> q_rot
    silu_mul_ref(gate_up)                                              -> silu(gate) * up

Each reproduces, bit for bit, the unfused model code it replaces (workers/model/layers.py
RMSNorm, apply_rotary, SwiGLU and workers/engine/attention.py PagedAttention._write): same
operations in the same order and dtypes. Arguments are not validated here; lockserve.kernels.ops validates
them for both paths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rms_norm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    y_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x's dtype; x itself when residual is None), then
    y = weight * rms_normalised(new_residual) with the mean of squares in float32.

    x: [T, H]; residual: [T, H] or None; weight: [H] (one dtype). Returns (y [T, H],
    new_residual [T, H]), written into y_out / residual_out when given (residual_out may be
    residual or x itself: elementwise, so in place is safe).
    """
    if residual is not None:
        new_residual = torch.add(x, residual, out=residual_out) if residual_out is not None else x + residual
    else:
        new_residual = residual_out.copy_(x) if residual_out is not None else x
    r32 = new_residual.float()
    r32 = r32 * torch.rsqrt(r32.pow(2).mean(-1, keepdim=True) + eps)
    normed = r32.to(x.dtype)
    y = torch.mul(weight, normed, out=y_out) if y_out is not None else weight * normed
    return y, new_residual


def rotate_half_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the "rotate half" layout: x [T, H, d]; cos, sin [T, 1, d/2] float32 -> [T, H, d] in
    x's dtype, maths in float32 (dimension i pairs with i + d/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_write_ref(
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
    """Rotate q and k, write rotated k and v of every token into its page of the KV pool.

    qkv: [T, (Hq + 2 Hkv) d] (q heads, then k heads, then v heads); cos, sin: [T, d/2] float32;
    pool: [S, 2, B, d] (K then V; k, v cast to its dtype); write_loc: [T] page location of each
    token, negative = not written (padding); write_off: [T] offset in the page; row_base: first
    pool row of the layer (layer * rows_per_layer). Token t, KV head h goes to slot
    (row_base + write_loc[t]) * Hkv + h (int64). Returns q_rot: [T, Hq, d] in qkv's dtype (into out).
    """
    tokens, d = qkv.shape[0], pool.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, d/2]
    q = rotate_half_ref(q.view(tokens, num_heads, d), cos, sin)  # [T, Hq, d]
    k = rotate_half_ref(k.view(tokens, num_kv_heads, d), cos, sin)  # [T, Hkv, d]
    v = v.view(tokens, num_kv_heads, d)  # [T, Hkv, d]
    keep = write_loc >= 0  # [T]; NOTE: boolean indexing syncs with the host (reference only)
    heads = torch.arange(num_kv_heads, device=pool.device)
    slots = (row_base + write_loc[keep].long())[:, None] * num_kv_heads + heads  # [T', Hkv] int64
    off = write_off[keep].long()[:, None]  # [T', 1]
    pool[slots, 0, off] = k[keep].to(pool.dtype)
    pool[slots, 1, off] = v[keep].to(pool.dtype)
    return out.copy_(q) if out is not None else q


def silu_mul_ref(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's activation: gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I], each op
    rounded to the input dtype as in eager torch (into out when given)."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out) if out is not None else F.silu(gate) * up
