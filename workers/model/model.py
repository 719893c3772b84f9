"""A Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Mistral) in plain torch, with pluggable attention.

The model owns no KV cache: every layer hands its post-RoPE q, k, v for the new tokens of the
step to an ``AttentionFn`` that the engine supplies, and gets the attention output back. The
attention backend (dense, LOCKS, offloaded...) decides where K/V live.

    hidden = model(input_ids, positions, attn)     # [T] , [T]  -> [T, hidden] (after the final norm)
    logits = model.compute_logits(hidden[last])    # [N, hidden] -> [N, vocab] float32
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from lockserve.workers.model.layers import (
    QKV,
    AttentionBlock,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
)
from lockserve.workers.model.weights import WeightFiller, hf_state_dict
from torch import Tensor, nn

# Hugging Face architecture name -> whether q/k/v projections carry a bias by default.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


class AttentionFn(Protocol):
    """The attention a model layer calls; the engine implements it and owns the KV cache.

    ``attn(layer, x) -> o``

    - ``layer``: decoder layer index, 0 .. num_layers-1, called in order once per layer per step.
    - ``x``: a ``QKV`` — the fused q/k/v projection of the T new tokens of this step, before RoPE,
      with the step's RoPE angles (tokens of several sequences flattened; the backend knows the
      per-sequence split). The backend applies RoPE (``x.split_rotated()``, or fused with its
      K/V write) and keeps k and v.
    - returns ``o``: [T, Hq, d], same dtype as q: softmax(q K^T / sqrt(d)) V over each token's own
      sequence, causal (a token sees the cached tokens of its sequence and the new ones up to itself).
    - GQA: query head h reads KV head h // (Hq // Hkv).
    """

    def __call__(self, layer: int, x: QKV) -> Tensor: ...


@dataclass
class ModelConfig:
    """Shape and constants of a Llama-family decoder (plain data; validated in __post_init__)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or {"rope_type": "llama3", "factor", ...}
    # Per-frequency divisors [head_dim // 2] applied after rope_scaling (llama.cpp's rope_freqs tensor).
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Mistral v0.1 trains with a 4096-token window; attention backends here attend to every token.
    sliding_window: int | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} ({value!r}) must be a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim ({self.head_dim}) must be even for RoPE")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture ({self.architecture!r}) is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        self.eos_token_ids = tuple(self.eos_token_ids)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (old ``rope_theta``/``rope_scaling`` keys or
        the newer ``rope_parameters``). Raises ValueError naming an unsupported architecture."""
        architectures = hf.get("architectures") or [_arch_from_model_type(hf.get("model_type"))]
        architecture = architectures[0]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architectures ({architectures!r}) is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [key for key in _HF_REQUIRED if key not in hf]
        if missing:
            raise ValueError(f"missing fields: {', '.join(missing)}")
        rope_theta, rope_scaling = _hf_rope(hf)
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("attention_bias", SUPPORTED_ARCHITECTURES[architecture])),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            architecture=architecture,
            sliding_window=hf.get("sliding_window") if hf.get("use_sliding_window", True) else None,
        )

    def to_hf_config(self) -> dict:
        """The ``config.json`` dict Hugging Face transformers reads for this model."""
        model_type = {
            "LlamaForCausalLM": "llama",
            "MistralForCausalLM": "mistral",
            "Qwen2ForCausalLM": "qwen2",
        }[self.architecture]
        eos = list(self.eos_token_ids)
        hf = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "torch_dtype": "float32",
        }
        if model_type == "llama":
            hf["attention_bias"] = self.qkv_bias
        return hf


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _arch_from_model_type(model_type: str | None) -> str:
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    return names.get(model_type, f"<model_type {model_type!r}>")


def _hf_rope(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config.json spelling."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    merged = {**params, **scaling}
    if "type" in merged and "rope_type" not in merged:  # the oldest spelling
        merged["rope_type"] = merged.pop("type")
    if merged.get("rope_type", "default") == "default":
        return theta, None
    return theta, merged


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.self_attn = AttentionBlock(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias, device, dtype
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, device, dtype)

    def forward(self, layer: int, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor],
                attn: AttentionFn) -> tuple[Tensor, Tensor]:
        # x: [T, hidden] the previous layer's output; residual: [T, hidden] the stream before it
        # (None in the first layer) -> (this layer's output, the stream before it). The residual
        # adds ride in the norms: one kernel each on CUDA.
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(layer, h, rope, attn), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Llama-family decoder. Weights are left uninitialised: fill them with ``load_hf_weights``
    (loaders) or ``init_random`` (presets).

    Parameter names follow Hugging Face except the fused ``qkv_proj`` and ``gate_up_proj``;
    ``load_hf_weights`` takes Hugging Face names and fills the fused rows.
    """

    def __init__(
        self, config: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype or default_dtype(device)
        # Parameters are allocated uninitialised (torch.empty): loaders and presets fill every one.
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device, self.dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, device, self.dtype) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, self.dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, device, self.dtype)
        )
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device=device)
        if config.rope_freq_factors is not None:
            self.rotary.scale_frequencies(torch.tensor(config.rope_freq_factors, dtype=torch.float32))
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """input_ids: [T] int64/int32, positions: [T] int64/int32 (absolute position of each token in its
        sequence) -> hidden [T, hidden] after the final norm. No host synchronisation."""
        x = F.embedding(input_ids, self.embed_tokens.weight)  # [T, hidden]
        rope = self.rotary(positions)  # (cos, sin), [T, d/2] each
        residual = None
        for index, layer in enumerate(self.layers):
            x, residual = layer(index, x, residual, rope, attn)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, hidden] (rows of ``forward``'s output) -> logits [N, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_hf_weights(self, weights: Iterable[tuple[str, Tensor]], source: str = "weights") -> None:
        """Copy Hugging Face-named tensors in (any dtype/device; cast here). Every parameter must be
        given exactly once; an unknown name, a wrong shape or a missing weight raises ValueError
        naming it and ``source``."""
        filler = WeightFiller(self, source)
        for name, tensor in weights:
            filler.fill(name, tensor)
        filler.check_complete()

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The weights under Hugging Face names (fused projections split back; views, no copies)."""
        return hf_state_dict(self)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on an accelerator, float32 on the CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
