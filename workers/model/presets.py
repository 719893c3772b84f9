"""Shape presets with seeded random weights: ``tiny`` variants for tests, real model shapes for
benchmarks (the attention and memory traffic of Llama-3.1-8B without its weights).

Random-weight models use the byte-level tokenizer (``byte_level_tokenizer``): ids 0..255 are
bytes, then <|begin_of_text|> (256), <|end_of_text|> (257), <|im_start|> (258), <|im_end|> (259).
Their configs name those ids as BOS/EOS, whatever the real model's vocabulary says.
"""

from __future__ import annotations

import math

import torch
from lockserve.workers.model.model import CausalLM, ModelConfig, default_dtype
from lockserve.workers.model.tokenizer import Tokenizer, byte_level_tokenizer

_BYTE_BOS, _BYTE_EOS = 256, (257, 259)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_TINY = ModelConfig(
    vocab_size=288,
    hidden_size=64,
    intermediate_size=160,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    bos_token_id=_BYTE_BOS,
    eos_token_ids=_BYTE_EOS,
)

# GLM-4-9B-Chat-1M's published config.json: 40 layers, 32 q heads over 4 KV groups
# (multi_query_group_num 4, G = 8), kv_channels 128, ffn 13696, QKV bias, rope base
# 10000 * rope_ratio 10000 = 1e8, seq_length 1048576, RoPE on half of each head (interleaved).
# The model the LOCKS paper timed at 1M.
_GLM4_9B_CHAT_1M = ModelConfig(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=13696,
    num_layers=40,
    num_heads=32,
    num_kv_heads=4,
    head_dim=128,
    rope_theta=10000.0 * 10000,
    rms_norm_eps=1.5625e-07,
    max_position_embeddings=1048576,
    qkv_bias=True,
    partial_rotary_factor=0.5,
    architecture="GlmForCausalLM",
    bos_token_id=_BYTE_BOS,
    eos_token_ids=_BYTE_EOS,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # Qwen2 path: q/k/v biases, tied embeddings, a large rope base.
    "tiny-qwen2": _TINY.replace(
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    ),
    # llama3 rope scaling with a short original context, so all three frequency bands occur at d = 32.
    "tiny-llama3": _TINY.replace(
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 64},
    ),
    # tiny with 128K positions: context-parallel tests over tens of thousands of tokens.
    "tiny-long": _TINY.replace(max_position_embeddings=1 << 17),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        bos_token_id=_BYTE_BOS,
        eos_token_ids=_BYTE_EOS,
    ),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        bos_token_id=_BYTE_BOS,
        eos_token_ids=_BYTE_EOS,
    ),
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        qkv_bias=True,
        architecture="Qwen2ForCausalLM",
        bos_token_id=_BYTE_BOS,
        eos_token_ids=_BYTE_EOS,
    ),
    "glm-4-9b-chat-1m": _GLM4_9B_CHAT_1M,
    # GLM-4-9B-Chat (the 128K model): as above with multi_query_group_num 2 (G = 16),
    # rope_ratio 500 (base 5e6), seq_length 131072.
    "glm-4-9b-chat": _GLM4_9B_CHAT_1M.replace(num_kv_heads=2, rope_theta=10000.0 * 500,
                                              max_position_embeddings=131072),
    # Qwen3-8B's published config.json (36 layers, 32 q heads over 8 KV heads, d = 128, no QKV
    # bias, per-head q/k RMSNorm, rope base 1e6, 40960 positions; the model card's YaRN x4 takes
    # it to 128K).
    "qwen3-8b": ModelConfig(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        architecture="Qwen3ForCausalLM",
        bos_token_id=_BYTE_BOS,
        eos_token_ids=_BYTE_EOS,
    ),
    # Gemma-3-12B's published text_config: 48 layers, 16 q heads over 8 KV heads, head_dim 256,
    # 5 sliding-window layers (window 1024, RoPE base 1e4) to 1 global (base 1e6, linear x8),
    # query_pre_attn_scalar 256, GeGLU (gelu_pytorch_tanh), tied embeddings, 131072 positions.
    "gemma-3-12b": ModelConfig(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_layers=48,
        num_heads=16,
        num_kv_heads=8,
        head_dim=256,
        rope_theta=1e6,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        architecture="Gemma3ForCausalLM",
        sliding_window=1024,
        sliding_layers=tuple(i for i in range(48) if i % 6 != 5),
        local_rope_theta=1e4,
        query_pre_attn_scalar=256.0,
        hidden_activation="gelu_pytorch_tanh",
        bos_token_id=_BYTE_BOS,
        eos_token_ids=_BYTE_EOS,
    ),
}


# Presets renamed because their old name misled: old name -> what to use instead.
_RENAMED = {
    "glm-4-9b-1m-shape": "glm-4-9b-chat-1m (GLM-4-9B-Chat-1M's published geometry: 4 KV heads, "
    "rope base 1e8) or glm-4-9b-chat (2 KV heads, 128K); the old preset had 2 KV heads at 1M",
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset; ValueError listing the presets for an unknown name."""
    if name in _RENAMED:
        raise ValueError(f"preset ({name!r}) was removed; use {_RENAMED[name]}")
    if name not in PRESETS:
        raise ValueError(f"preset ({name!r}) is unknown; presets: {sorted(PRESETS)}")
    return PRESETS[name]


def build_preset(
    name: str, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[CausalLM, Tokenizer]:
    """A preset model with seeded random weights, and the byte-level tokenizer.
    Same name, seed, device type and dtype -> the same weights."""
    model = CausalLM(preset_config(name), device, dtype or default_dtype(device))
    init_random(model, seed)
    return model, byte_level_tokenizer()


@torch.no_grad()
def init_random(model: CausalLM, seed: int) -> None:
    """Fill every parameter with seeded Gaussian noise scaled so activations stay O(1) at any depth.

    Residual-branch outputs (o_proj, down_proj) are scaled by 1/sqrt(num_layers) so the residual
    stream's variance grows by at most ~2 over the whole stack; norm weights are 1 +- 0.1 so a
    swapped norm shows up in tests; a tied embedding is shrunk so logits stay near unit scale.
    """
    config = model.config
    generator = torch.Generator(device=model.device).manual_seed(seed)
    depth = 1.0 / math.sqrt(config.num_layers)
    for name, param in model.named_parameters():
        fan_in = param.shape[-1]
        if name.endswith("norm.weight"):
            _fill(param, generator, 0.1, mean=0.0 if config.arch.gemma else 1.0)
        elif name == "embed_tokens.weight":
            _fill(param, generator, config.hidden_size**-0.25 if config.tie_word_embeddings else 1.0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            _fill(param, generator, depth / math.sqrt(fan_in))
        elif name.endswith(".bias"):
            _fill(param, generator, 0.3)
        else:  # qkv, gate_up, lm_head
            _fill(param, generator, 1.0 / math.sqrt(fan_in))


def _fill(param: torch.Tensor, generator: torch.Generator, std: float, mean: float = 0.0) -> None:
    param.copy_(
        torch.randn(param.shape, generator=generator, device=param.device, dtype=torch.float32)
        .mul_(std)
        .add_(mean)
    )
