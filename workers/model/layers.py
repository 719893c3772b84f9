"""Building blocks of a Llama-family decoder: RMSNorm, RoPE, the attention projections, SwiGLU.

Every tensor here is token-major and flat over the batch: ``[T, ...]`` where T counts the new
tokens of all sequences in a step. Nothing in these forwards reads a tensor value on the host
(no ``.item()``, no branch on data), so a whole decoder step can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lockserve.kernels import ops
from torch import Tensor, nn

if TYPE_CHECKING:
    from lockserve.workers.model.model import AttentionFn


class Linear(nn.Module):
    """y = x W^T (+ b). Allocated uninitialised: a loader or ``init_random`` fills it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, in] -> [T, out]
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token id -> row of ``weight`` [vocab, hidden]. Allocated uninitialised."""

    def __init__(self, vocab_size: int, hidden_size: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [T] int64 -> [T, hidden]
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """y = weight * r / rms(r) with r = x + residual, the mean of squares taken in float32 (as
    Hugging Face does). One kernel on CUDA (kernels.ops.add_rms_norm), the same maths in torch on
    the CPU."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # x, residual: [T, hidden] -> (y, r = x + residual (x when residual is None)), same dtype
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> Tensor:
    """Inverse frequencies [head_dim // 2] (float32) for RoPE, with optional llama3 scaling.

    ``rope_scaling`` is None, ``{"rope_type": "default"}`` or the llama3 form
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``; the arithmetic follows Hugging Face's
    ``_compute_llama3_parameters`` step for step so the two agree bit for bit.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)  # [d/2]
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_scaling)
    raise ValueError(
        f"rope_scaling.rope_type ({rope_type!r}) is not supported; expected 'default' or 'llama3'"
    )


def _llama3_scaled(inv_freq: Tensor, scaling: dict) -> Tensor:
    # inv_freq: [d/2] float32 -> [d/2]. Long wavelengths are divided by `factor`, short ones kept,
    # the band between them interpolated smoothly.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, in the "rotate half" layout of Hugging Face checkpoints.

    Angles are recomputed from ``positions`` every call, so there is no table to outgrow. They are
    float32 products as in Hugging Face and vLLM: positions are exact up to 2^24, and the angle of
    the fastest frequency carries an absolute error of up to ulp(position) / 2 (0.03 rad at 1M).
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, device=None):
        super().__init__()
        # A float32 master copy on the CPU: Module.to(dtype) / to_empty() would otherwise cast or wipe
        # the buffer, and frequencies must stay float32 whatever the model dtype (see _apply).
        self._inv_freq_master = rope_inv_freq(head_dim, rope_theta, rope_scaling)  # [d/2] float32
        self.register_buffer("inv_freq", self._inv_freq_master.to(device), persistent=False)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_master.to(self.inv_freq.device)
        return self

    def scale_frequencies(self, freq_factors: Tensor) -> None:
        """Divide each frequency by a factor (llama.cpp's ``rope_freqs`` tensor, llama3 scaling)."""
        # freq_factors: [d/2]
        if freq_factors.shape != self._inv_freq_master.shape:
            raise ValueError(
                f"rope freq factors: expected shape {tuple(self._inv_freq_master.shape)}, "
                f"got {tuple(freq_factors.shape)}"
            )
        self._inv_freq_master = self._inv_freq_master / freq_factors.detach().float().cpu()
        self.inv_freq = self._inv_freq_master.to(self.inv_freq.device)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions: [T] int -> (cos, sin), each [T, d/2] float32; computed once per step and
        shared by every layer (``QKV``)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d/2]
        return freqs.cos(), freqs.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate q or k: x [T, H, d]; cos, sin [T, 1, d/2] float32 -> [T, H, d] in x's dtype (maths in
    float32). Pairs dimension i with i + d/2 ("rotate half"). kernels.ops.rope_write is the same
    maths fused with the K/V write."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@dataclass(frozen=True)
class QKV:
    """One layer's fused q/k/v projection of the step's new tokens, before RoPE, with the step's
    RoPE angles: what an AttentionFn gets. qkv: [T, (Hq + 2 Hkv) d] (rows: q heads, k heads,
    v heads); cos, sin: [T, d/2] float32."""

    qkv: Tensor
    cos: Tensor
    sin: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def split_rotated(self) -> tuple[Tensor, Tensor, Tensor]:
        """(q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]), RoPE applied to q and k."""
        t, d = self.qkv.shape[0], self.head_dim
        q, k, v = self.qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]
        q = apply_rotary(q.view(t, self.num_heads, d), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, d), cos, sin)
        return q, k, v.view(t, self.num_kv_heads, d)


class AttentionBlock(nn.Module):
    """Fused QKV projection, RoPE, the pluggable attention, and the output projection."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Rows: [q (Hq*d) | k (Hkv*d) | v (Hkv*d)]; one GEMM instead of three.
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, device, dtype)
        self.o_proj = Linear(self.q_size, hidden, False, device, dtype)

    def forward(self, layer: int, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn) -> Tensor:
        # x: [T, hidden]; rope: (cos, sin) [T, d/2] each -> [T, hidden]
        qkv = QKV(self.qkv_proj(x), *rope, self.num_heads, self.num_kv_heads, self.head_dim)
        o = attn(layer, qkv)  # [T, Hq, d]
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one GEMM."""

    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None):
        super().__init__()
        self.intermediate = intermediate
        # Rows: [gate (I) | up (I)]
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, device, dtype)
        self.down_proj = Linear(intermediate, hidden, False, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # silu(gate) * up: one kernel
