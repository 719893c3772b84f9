"""Building blocks of a Llama-family decoder: RMSNorm, RoPE, the attention projections, SwiGLU.

Every tensor here is token-major and flat over the batch: ``[T, ...]`` where T counts the new
tokens of all sequences in a step. Nothing in these forwards reads a tensor value on the host
(no ``.item()``, no branch on data), so a whole decoder step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lockserve.kernels import ops
from lockserve.workers.model import rope
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
    the CPU. unit_offset: the checkpoint stores weight - 1 (Gemma's (1 + w) norms); the stored
    tensor is kept as it is (hf_state_dict gives it back bitwise) and 1 + w is formed per call.
    NOTE: Gemma multiplies in float32 before rounding, we round the normalised row to the model
    dtype first (as for Llama): equal in float32, within a rounding in bf16."""

    def __init__(self, hidden_size: int, eps: float, device=None, dtype=None, unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps, self.unit_offset = eps, unit_offset

    def forward(self, x: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
        # x, residual: [T, hidden] -> (y, r = x + residual (x when residual is None)), same dtype
        weight = self.weight + 1.0 if self.unit_offset else self.weight
        return ops.add_rms_norm(x, residual, weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position, in the "rotate half" layout over the whole head (see rope.py
    for how other checkpoint layouts map onto it).

    Angles are recomputed from ``positions`` every call, so there is no table to outgrow. They are
    float32 products as in Hugging Face and vLLM: positions are exact up to 2^24, and the angle of
    the fastest frequency carries an absolute error of up to ulp(position) / 2 (0.03 rad at 1M).

    rotary_dim (default head_dim): dimensions the checkpoint rotates; the other frequencies are 0.
    long_factors: LongRoPE's factor set (rope.uses_long_factors).
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None, device=None, *,
                 rotary_dim: int | None = None, long_factors: bool = False):
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.rope_theta, self.rope_scaling = rope_theta, rope_scaling
        self.dynamic = rope.rope_type(rope_scaling) == "dynamic"
        inv_freq, attention_factor = rope.rope_inv_freq(
            self.rotary_dim, rope_theta, rope_scaling, long_factors
        )
        self.passed = head_dim // 2 - self.rotary_dim // 2  # frequencies of passed-through pairs
        # Float32 master copies on the CPU: Module.to(dtype) / to_empty() would otherwise cast or wipe
        # the buffers, and frequencies must stay float32 whatever the model dtype (see _apply).
        self._inv_freq_master = F.pad(inv_freq, (0, self.passed))  # [d/2] float32
        # cos and sin are multiplied by the attention factor on rotated pairs only (None: all 1).
        scale = F.pad(torch.full((self.rotary_dim // 2,), attention_factor), (0, self.passed), value=1.0)
        self._scale_master = None if attention_factor == 1.0 else scale  # [d/2] float32
        self.register_buffer("inv_freq", self._inv_freq_master.to(device), persistent=False)
        self.scale = None if self._scale_master is None else self._scale_master.to(device)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq_master.to(self.inv_freq.device)
        if self._scale_master is not None:
            self.scale = self._scale_master.to(self.inv_freq.device)
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
        if self.dynamic:
            inv_freq = rope.dynamic_inv_freq(positions, self.rotary_dim, self.rope_theta, self.rope_scaling)
            inv_freq = F.pad(inv_freq, (0, self.passed))  # [T, d/2]
        else:
            inv_freq = self.inv_freq[None, :]  # [1, d/2]
        freqs = positions.float()[:, None] * inv_freq  # [T, d/2]
        if self.scale is None:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.scale, freqs.sin() * self.scale


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
    v heads); cos, sin: [T, d/2] float32; window: the layer's sliding window W (a token at
    position p attends keys (p - W, p]), None on a layer that attends every key."""

    qkv: Tensor
    cos: Tensor
    sin: Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None = None

    def split_rotated(self) -> tuple[Tensor, Tensor, Tensor]:
        """(q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]), RoPE applied to q and k."""
        t, d = self.qkv.shape[0], self.head_dim
        q, k, v = self.qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        cos, sin = self.cos[:, None, :], self.sin[:, None, :]
        q = apply_rotary(q.view(t, self.num_heads, d), cos, sin)
        k = apply_rotary(k.view(t, self.num_kv_heads, d), cos, sin)
        return q, k, v.view(t, self.num_kv_heads, d)


class AttentionBlock(nn.Module):
    """Fused QKV projection, optional per-head q/k RMSNorm (Qwen3: before RoPE), the pluggable
    attention (which applies RoPE), and the output projection."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        device=None,
        dtype=None,
        *,
        qk_norm_eps: float | None = None,
        o_bias: bool = False,
        window: int | None = None,
        norm_unit_offset: bool = False,
        query_scale: float = 1.0,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window = window  # the layer's sliding window (QKV.window), None: every key
        # q is multiplied by query_scale after its norm (Gemma's query_pre_attn_scalar: scores
        # q . k / sqrt(scalar) = (c q) . k / sqrt(d) with c = sqrt(d / scalar)); RoPE is linear.
        self.query_scale = query_scale
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        # Rows: [q (Hq*d) | k (Hkv*d) | v (Hkv*d)]; one GEMM instead of three.
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, device, dtype)
        self.o_proj = Linear(self.q_size, hidden, o_bias, device, dtype)
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, device, dtype, norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, device, dtype, norm_unit_offset)

    def forward(self, layer: int, x: Tensor, rope: tuple[Tensor, Tensor], attn: AttentionFn) -> Tensor:
        # x: [T, hidden]; rope: (cos, sin) [T, d/2] each -> [T, hidden]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) d]
        if self.q_norm is not None:
            qkv = self._norm_qk(qkv)
        x_qkv = QKV(qkv, *rope, self.num_heads, self.num_kv_heads, self.head_dim, self.window)
        o = attn(layer, x_qkv)  # [T, Hq, d]
        return self.o_proj(o.reshape(x.shape[0], self.q_size))

    def _norm_qk(self, qkv: Tensor) -> Tensor:
        # qkv: [T, (Hq + 2 Hkv) d] -> the same with every q and k head RMS-normalised over d
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t * self.num_heads, d))[0].view(t, self.q_size)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        k = self.k_norm(k.reshape(t * self.num_kv_heads, d))[0].view(t, self.kv_size)
        return torch.cat((q, k, v), dim=-1)


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one GEMM; act silu (one kernel), or
    gelu_pytorch_tanh (Gemma's GeGLU: F.gelu(approximate="tanh"), plain torch)."""

    ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

    def __init__(self, hidden: int, intermediate: int, device=None, dtype=None, activation: str = "silu"):
        super().__init__()
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"hidden activation ({activation!r}) is not supported; supported: "
                             f"{list(self.ACTIVATIONS)}")
        self.intermediate, self.activation = intermediate, activation
        # Rows: [gate (I) | up (I)]
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, device, dtype)
        self.down_proj = Linear(intermediate, hidden, False, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.activation == "silu":
            return self.down_proj(ops.silu_mul(gate_up))  # silu(gate) * up: one kernel
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)
