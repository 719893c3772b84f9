"""A Llama-family decoder (Llama 2/3.x, Qwen2/2.5, Qwen3, Mistral, GLM-4, Phi-3/4, and Gemma-3's
sandwich-norm block) in plain torch, with pluggable attention and per-layer sliding windows.
architectures.py says where each departs from Llama; rope.py holds RoPE.

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
from lockserve.workers.model import rope
from lockserve.workers.model.architectures import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    Architecture,
    architecture_for_model_type,
)
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


class AttentionFn(Protocol):
    """The attention a model layer calls; the engine implements it and owns the KV cache.

    ``attn(layer, x) -> o``

    - ``layer``: decoder layer index, 0 .. num_layers-1, called in order once per layer per step.
    - ``x``: a ``QKV`` — the fused q/k/v projection of the T new tokens of this step, before RoPE,
      with the step's RoPE angles (tokens of several sequences flattened; the backend knows the
      per-sequence split). The backend applies RoPE (``x.split_rotated()``, or fused with its
      K/V write) and keeps k and v.
    - returns ``o``: [T, Hq, d], same dtype as q: softmax(q K^T / sqrt(d)) V over each token's own
      sequence, causal (a token sees the cached tokens of its sequence and the new ones up to itself);
      on a sliding-window layer (``x.window`` = W, not None) a token at position p sees only the
      keys at positions (p - W, p].
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
    # None or {"rope_type": one of rope.ROPE_TYPES, "factor", ...} (rope.check_scaling's keys).
    rope_scaling: dict | None = None
    # Per-frequency divisors [head_dim // 2] applied after rope_scaling (llama.cpp's rope_freqs tensor).
    rope_freq_factors: tuple[float, ...] | None = None
    rms_norm_eps: float = 1e-5
    # Positions the model serves: from a config.json, its max_position_embeddings or the context its
    # rope scaling reaches where that is more (rope.max_context).
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    # Share of each head that RoPE rotates (GLM-4: 0.5); the rest passes through.
    partial_rotary_factor: float = 1.0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"
    # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window, Phi-3-mini): a query at
    # position p attends the keys at (p - sliding_window, p], as transformers' mask has it, on the
    # layers sliding_layers names (every layer when it is None); None: no window anywhere.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    # Gemma-3 (Architecture.gemma): the RoPE base of the sliding layers (rope_local_base_freq, no
    # scaling; rope_theta and rope_scaling are the global layers'), None: one RoPE for all layers;
    # attention scores scaled by 1 / sqrt(query_pre_attn_scalar) (None: 1 / sqrt(head_dim));
    # logits softcapped to final_logit_softcapping * tanh(logits / it) (None: not).
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    hidden_activation: str = "silu"

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
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture ({self.architecture!r}) is not supported; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"ModelConfig.partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                f"({self.head_dim}) = {self.rotary_dim} must be an even number of dimensions in [2, head_dim]"
            )
        rope.check_scaling(self.rope_scaling, self.rotary_dim)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self._check_window()

    def _check_window(self) -> None:
        window, layers = self.sliding_window, self.sliding_layers
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ValueError(f"ModelConfig.sliding_window ({window!r}) must be a positive int or None")
        if layers is not None:
            self.sliding_layers = tuple(layers)
            bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(
                    f"ModelConfig.sliding_layers names layers {bad} outside 0 .. {self.num_layers - 1}"
                )

    def layer_window(self, layer: int) -> int | None:
        """Keys a query of ``layer`` attends back from itself (itself included), None: every key."""
        layers = self.sliding_layers
        if self.sliding_window is None or (layers is not None and layer not in layers):
            return None
        return self.sliding_window

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """``layer_window`` of every layer."""
        return tuple(self.layer_window(i) for i in range(self.num_layers))

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        """Dimensions of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_config(cls, hf: dict) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict (old ``rope_theta``/``rope_scaling`` keys or
        the newer ``rope_parameters``). Raises ValueError naming an unsupported architecture or
        rope type (with the supported lists) or a missing field."""
        architectures = hf.get("architectures") or [architecture_for_model_type(hf.get("model_type"))]
        architecture = architectures[0]
        if architecture not in ARCHITECTURES:
            raise ValueError(
                f"architectures ({architectures!r}) is not supported; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        arch = ARCHITECTURES[architecture]
        missing = [key for key in _HF_REQUIRED if key not in hf]
        if missing:
            raise ValueError(f"missing fields: {', '.join(missing)}")
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        gemma = _hf_gemma(hf) if arch.gemma else {}
        rope_theta, rope_scaling, partial = _hf_rope(gemma.pop("global_rope", hf), architecture)
        positions = hf.get("max_position_embeddings", 4096)
        # Gemma-3 states its scaled context as max_position_embeddings (as llama3 checkpoints do).
        context = positions if arch.gemma else rope.max_context(positions, rope_scaling)
        qkv_bias = bool(arch.qkv_bias if hf.get("attention_bias") is None else hf["attention_bias"])
        eos = hf.get("eos_token_id")
        window, sliding_layers = _hf_window(hf, arch)
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=context,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and arch.o_bias_follows_qkv,
            partial_rotary_factor=float(partial),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            architecture=architecture,
            sliding_window=window,
            sliding_layers=sliding_layers,
            **gemma,
        )

    def to_hf_config(self) -> dict:
        """The ``config.json`` dict Hugging Face transformers reads for this model."""
        eos = list(self.eos_token_ids)
        scaling = self.rope_scaling
        positions = self.max_position_embeddings
        if rope.rope_type(scaling) == "dynamic":  # transformers reads the original context there
            positions = scaling["original_max_position_embeddings"]
        hf = {
            "architectures": [self.architecture],
            "model_type": self.arch.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": positions,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "pad_token_id": None,  # else GLM's and Phi-3's config classes give ids past small vocabularies
            "torch_dtype": "float32",
        }
        if self.arch.o_bias_follows_qkv or self.qkv_bias != self.arch.qkv_bias:
            hf["attention_bias"] = self.qkv_bias
        if scaling is not None and "original_max_position_embeddings" in scaling:
            hf["original_max_position_embeddings"] = scaling["original_max_position_embeddings"]
        hf.update(self._hf_window_fields())
        if self.arch.gemma:
            self._hf_gemma_fields(hf)
        return hf

    def _hf_gemma_fields(self, hf: dict) -> None:
        # Gemma3TextConfig: RoPE per layer type, the window on layer_types, its own activation key.
        full = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        local = {"rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}
        for key in ("rope_theta", "rope_scaling", "partial_rotary_factor", "hidden_act"):
            hf.pop(key, None)
        hf.update(
            rope_parameters={"full_attention": full, "sliding_attention": local},
            sliding_window=self.sliding_window,
            layer_types=["full_attention" if w is None else "sliding_attention" for w in self.layer_windows],
            query_pre_attn_scalar=self.query_pre_attn_scalar or self.head_dim,
            final_logit_softcapping=self.final_logit_softcapping,
            attn_logit_softcapping=None,
            hidden_activation=self.hidden_activation,
            attention_bias=self.qkv_bias,
        )

    def _hf_window_fields(self) -> dict:
        rule = self.arch.window_layers
        if not rule:
            return {}
        # NOTE: always written: MistralConfig defaults to a 4096-token window when the key is absent.
        fields = {"sliding_window": self.sliding_window}
        if rule == "qwen" and self.sliding_window is not None:
            windows = self.layer_windows
            fields["use_sliding_window"] = True
            fields["layer_types"] = ["full_attention" if w is None else "sliding_attention" for w in windows]
        return fields


_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' Phi3Config has original_max_position_embeddings = 4096 when config.json omits it.
_PHI3_ORIGINAL_POSITIONS = 4096


def _hf_window(hf: dict, arch: Architecture) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, sliding_layers) as transformers applies config.json's window
    (Architecture.window_layers): Mistral and Phi-3 on every layer when ``sliding_window`` is set
    (their models ignore ``layer_types``); Qwen2/Qwen3 only with ``use_sliding_window``, on the
    layers ``layer_types`` names "sliding_attention", by default those at or past
    ``max_window_layers`` (28)."""
    window = hf.get("sliding_window")
    if not arch.window_layers or window is None:
        return None, None
    if arch.window_layers == "all":
        return int(window), None
    if arch.window_layers == "layer_types":  # Gemma3TextConfig's default: every 6th layer global
        pattern, layers = hf.get("sliding_window_pattern") or 6, hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        return int(window), tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if not hf.get("use_sliding_window", False):
        return None, None
    first = hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])
    ]
    return int(window), tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


_GEMMA_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig's


def _hf_gemma(hf: dict) -> dict:
    """Gemma-3's ModelConfig fields from config.json, and under "global_rope" the config dict
    _hf_rope reads for the global layers. RoPE: ``rope_parameters`` per layer type
    (transformers 5) or rope_theta / rope_scaling (global) and rope_local_base_freq (older).
    ValueError for what transformers' Gemma3 does differently from us or not at all: bidirectional
    attention, attention-logit softcapping (its attention never applies it), a scaled local RoPE."""
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (true) is not supported: decoding is causal")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping ({hf['attn_logit_softcapping']}) is not supported (transformers' "
            "Gemma-3 attention does not apply it either)")
    params = hf.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.sliding_attention.rope_type ({local['rope_type']!r}) is not "
                         "supported: the sliding layers' RoPE is unscaled")
    if full:
        full.setdefault("rope_theta", _GEMMA_THETA["full_attention"])
        global_rope = {**hf, "rope_parameters": full, "rope_scaling": None}
    else:
        global_rope = {**hf, "rope_theta": hf.get("rope_theta") or _GEMMA_THETA["full_attention"]}
    local_theta = (local.get("rope_theta") or hf.get("rope_local_base_freq")
                   or _GEMMA_THETA["sliding_attention"])
    return {
        "global_rope": global_rope,
        "local_rope_theta": float(local_theta),
        "query_pre_attn_scalar": hf.get("query_pre_attn_scalar") or 256,  # int in Gemma3TextConfig
        "final_logit_softcapping": hf.get("final_logit_softcapping"),
        "hidden_activation": hf.get("hidden_activation") or "gelu_pytorch_tanh",
    }


def _hf_rope(hf: dict, architecture: str) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling, partial_rotary_factor) from either config.json spelling, with the
    defaults transformers derives filled in (factor, original_max_position_embeddings), so the
    scaling does not change when max_position_embeddings is later moved (CausalLM.set_max_positions)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    merged = {**params, **scaling}
    merged.pop("rope_theta", None)
    partial = merged.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor")
    partial = partial or ARCHITECTURES[architecture].partial_rotary_factor
    kind = merged.pop("type", None) or merged.get("rope_type") or "default"
    if kind == "su" or (kind == "yarn" and architecture == "Phi3ForCausalLM"):
        kind = "longrope"  # older Phi-3 spellings, as transformers reads them
    merged["rope_type"] = kind
    if kind == "default":
        return theta, None, partial
    positions = hf.get("max_position_embeddings", 4096)
    if kind == "dynamic":  # transformers stretches max_position_embeddings itself
        merged["original_max_position_embeddings"] = positions
    elif kind in ("llama3", "yarn", "longrope"):
        top = hf.get("original_max_position_embeddings")
        if top is None and architecture == "Phi3ForCausalLM":
            top = _PHI3_ORIGINAL_POSITIONS
        original = top or merged.get("original_max_position_embeddings") or positions
        merged["original_max_position_embeddings"] = original
    if kind in ("yarn", "longrope") and merged.get("factor") is None:
        merged["factor"] = positions / merged["original_max_position_embeddings"]
    return theta, merged, partial


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.self_attn = AttentionBlock(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias, device, dtype,
            qk_norm_eps=c.rms_norm_eps if c.arch.qk_norm else None, o_bias=c.o_bias,
            window=c.layer_window(layer),
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, device, dtype)
        self.post_self_attn_layernorm = self.post_mlp_layernorm = None
        if c.arch.post_norms:
            self.post_self_attn_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
            self.post_mlp_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)

    def forward(self, layer: int, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor],
                attn: AttentionFn) -> tuple[Tensor, Tensor]:
        # x: [T, hidden] the previous layer's output; residual: [T, hidden] the stream before it
        # (None in the first layer) -> (this layer's output, the stream before it). The residual
        # adds ride in the norms: one kernel each on CUDA.
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(layer, h, rope, attn)
        if self.post_self_attn_layernorm is not None:
            h = self.post_self_attn_layernorm(h)[0]
        h, residual = self.post_attention_layernorm(h, residual)
        h = self.mlp(h)
        if self.post_mlp_layernorm is not None:
            h = self.post_mlp_layernorm(h)[0]
        return h, residual


class SandwichDecoderLayer(nn.Module):
    """Gemma-3's block: RMSNorm before and after both attention and MLP, (1 + w) norms, GeGLU."""

    def __init__(self, config: ModelConfig, layer: int, device=None, dtype=None):
        super().__init__()
        c, eps = config, config.rms_norm_eps

        def norm(size: int = c.hidden_size) -> RMSNorm:
            return RMSNorm(size, eps, device, dtype, unit_offset=True)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        scalar = c.query_pre_attn_scalar or c.head_dim
        self.self_attn = AttentionBlock(
            c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.qkv_bias, device, dtype,
            qk_norm_eps=eps, o_bias=c.o_bias, window=c.layer_window(layer), norm_unit_offset=True,
            query_scale=(c.head_dim / scalar) ** 0.5,
        )
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size, device, dtype, activation=c.hidden_activation)

    def forward(self, layer: int, x: Tensor, residual: Tensor | None, rope: tuple[Tensor, Tensor],
                attn: AttentionFn) -> tuple[Tensor, Tensor]:
        # as DecoderLayer.forward: x is the previous layer's output before its residual add
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(layer, h, rope, attn))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


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
        block = SandwichDecoderLayer if config.arch.gemma else DecoderLayer
        self.layers = nn.ModuleList(
            block(config, layer, device, self.dtype) for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, self.dtype,
                            unit_offset=config.arch.gemma)
        # Gemma scales the embeddings by sqrt(hidden) rounded to the model dtype (as transformers:
        # a float32 scalar cast to the weights' dtype); 1.0 elsewhere.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5).to(self.dtype)) if config.arch.gemma \
            else 1.0
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, False, device, self.dtype)
        )
        self.rotary, self.local_rotary = _rotary(config, device), _local_rotary(config, device)
        self.requires_grad_(False)

    def set_max_positions(self, positions: int) -> None:
        """Serve ``positions`` positions (config.max_position_embeddings): LongRoPE picks its factor
        set from that count (rope.uses_long_factors), so the rotary is rebuilt. Call it before an
        engine is built over the model."""
        self.config = self.config.replace(max_position_embeddings=positions)
        self.rotary = _rotary(self.config, self.device)
        self.local_rotary = _local_rotary(self.config, self.device)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: Tensor, positions: Tensor, attn: AttentionFn) -> Tensor:
        """input_ids: [T] int64/int32, positions: [T] int64/int32 (absolute position of each token in its
        sequence) -> hidden [T, hidden] after the final norm. No host synchronisation."""
        x, ropes = self.embed(input_ids), self.ropes(positions)
        x, residual = self.run_layers(x, None, ropes, attn, 0, len(self.layers))
        return self.final_norm(x, residual)

    # `forward` in parts, for a forward spread over several engine steps (layers a step):
    #   x, ropes = embed(ids), ropes(positions); x, res = run_layers(x, None, ropes, attn, 0, k) ...
    #   hidden = final_norm(x, res). The same ops as forward, so the same bits.

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids: [T] -> the first layer's input [T, hidden]."""
        x = F.embedding(input_ids, self.embed_tokens.weight)  # [T, hidden]
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def ropes(self, positions: Tensor) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """positions: [T] -> ((cos, sin) of the global layers, (cos, sin) of the sliding ones), [T, d/2]
        each (Gemma-3's sliding layers rotate at their own base; elsewhere the same pair twice)."""
        rope = self.rotary(positions)
        return rope, rope if self.local_rotary is None else self.local_rotary(positions)

    def run_layers(self, x: Tensor, residual: Tensor | None, ropes: tuple, attn: AttentionFn, start: int,
                   end: int) -> tuple[Tensor, Tensor | None]:
        """Layers start .. end - 1: x [T, hidden] the output of layer start - 1 (the embeddings at 0),
        residual the stream before it (None at 0) -> the same after layer end - 1."""
        windows = self.config.layer_windows
        for index in range(start, end):
            rope = ropes[0] if windows[index] is None else ropes[1]
            x, residual = self.layers[index](index, x, residual, rope, attn)
        return x, residual

    def final_norm(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The last layer's output and the stream before it -> hidden [T, hidden]."""
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, hidden] (rows of ``forward``'s output) -> logits [N, vocab] float32."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

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


def _rotary(config: ModelConfig, device) -> RotaryEmbedding:
    c = config
    rotary = RotaryEmbedding(
        c.head_dim, c.rope_theta, c.rope_scaling, device=device, rotary_dim=c.rotary_dim,
        long_factors=rope.uses_long_factors(c.rope_scaling, c.max_position_embeddings),
    )
    if c.rope_freq_factors is not None:
        rotary.scale_frequencies(torch.tensor(c.rope_freq_factors, dtype=torch.float32))
    return rotary


def _local_rotary(config: ModelConfig, device) -> RotaryEmbedding | None:
    """The sliding layers' RoPE where it differs (Gemma-3: local_rope_theta, unscaled), else None."""
    if config.local_rope_theta is None:
        return None
    return RotaryEmbedding(config.head_dim, config.local_rope_theta, None, device=device,
                           rotary_dim=config.rotary_dim)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on an accelerator, float32 on the CPU."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
