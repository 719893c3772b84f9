"""What differs between the supported Hugging Face architectures, in one table.

All of them are the same pre-norm decoder (RMSNorm, GQA attention with RoPE, SwiGLU) built by
model.py; an ``Architecture`` names the few places where one departs from Llama.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face ``architectures`` entry.

    model_type: config.json's ``model_type``. qkv_bias: q/k/v biases when config.json has no
    ``attention_bias``. o_bias_follows_qkv: o_proj has a bias exactly when q/k/v do (transformers'
    Llama and Qwen3 read ``attention_bias`` for all four). qk_norm: per-head RMSNorm of q and k
    before RoPE (Qwen3). post_norms: RMSNorm of the attention and MLP outputs before their residual
    adds (GLM-4-0414). rope_interleaved: rotary pairs (2i, 2i + 1) (GLM). partial_rotary_factor:
    the share of each head that is rotated when config.json names none. fused_in_checkpoint: our
    fused parameters ("qkv_proj", "gate_up_proj") that checkpoints store fused too (Phi-3, GLM).
    window_layers: which layers config.json's ``sliding_window`` applies to, as transformers reads
    it: "" none (the architecture has no sliding window), "all" every layer (Mistral, Phi-3), "qwen"
    only with ``use_sliding_window``, the layers ``layer_types`` names "sliding_attention" (by
    default those at or past ``max_window_layers``), "layer_types" the layers ``layer_types`` names
    "sliding_attention" (by default all but every ``sliding_window_pattern``-th: Gemma-3).
    gemma: Gemma-3's block: (1 + w) RMSNorms, embeddings scaled by sqrt(hidden) in the model
    dtype, pre and post norms around attention and MLP (sandwich), GeGLU (gelu_pytorch_tanh),
    query_pre_attn_scalar, a separate RoPE base for the sliding layers (rope_local_base_freq).
    """

    model_type: str
    qkv_bias: bool = False
    o_bias_follows_qkv: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    rope_interleaved: bool = False
    partial_rotary_factor: float = 1.0
    fused_in_checkpoint: tuple[str, ...] = ()
    window_layers: str = ""
    gemma: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture("llama", o_bias_follows_qkv=True),
    "MistralForCausalLM": Architecture("mistral", window_layers="all"),
    "Qwen2ForCausalLM": Architecture("qwen2", qkv_bias=True, window_layers="qwen"),
    "Qwen3ForCausalLM": Architecture(
        "qwen3", o_bias_follows_qkv=True, qk_norm=True, window_layers="qwen"
    ),
    # GLM-4-9B-Chat / -Chat-1M in transformers' form (THUDM's ChatGLM remote-code folders are not).
    "GlmForCausalLM": Architecture(
        "glm", qkv_bias=True, rope_interleaved=True, partial_rotary_factor=0.5,
        fused_in_checkpoint=("gate_up_proj",),
    ),
    "Glm4ForCausalLM": Architecture(
        "glm4", qkv_bias=True, post_norms=True, rope_interleaved=True, partial_rotary_factor=0.5,
        fused_in_checkpoint=("gate_up_proj",),
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma3_text", qk_norm=True, o_bias_follows_qkv=True, window_layers="layer_types", gemma=True
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3", fused_in_checkpoint=("qkv_proj", "gate_up_proj"), window_layers="all"
    ),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHITECTURES))


def architecture_for_model_type(model_type: str | None) -> str:
    """The architecture of a config.json that names only its ``model_type``."""
    for name, arch in ARCHITECTURES.items():
        if arch.model_type == model_type:
            return name
    return f"<model_type {model_type!r}>"
