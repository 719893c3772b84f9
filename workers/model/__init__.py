"""lockserve.workers.model: a Llama-family decoder in plain torch and what loads it.

model.py (`CausalLM`, `ModelConfig`, the `AttentionFn` protocol the engine implements) is built
from layers.py, with architectures.py (where Qwen3, GLM-4, Phi-3 ... depart from Llama) and
rope.py (every RoPE scaling, the rotary layouts); weights.py maps Hugging Face tensor names onto
it; loader.py (`load_model`) reads a Hugging Face folder, a GGUF file (gguf_loader.py over
gguf_reader.py) or a random-weight preset (presets.py); tokenizer.py turns text into ids and
back; dense_attention.py is the exact reference attention.
"""

from .dense_attention import DenseAttention, generate_greedy
from .loader import load_model, save_hf_folder
from .model import AttentionFn, CausalLM, ModelConfig, default_dtype
from .presets import PRESETS, build_preset
from .tokenizer import Tokenizer

__all__ = [
    "PRESETS",
    "AttentionFn",
    "CausalLM",
    "DenseAttention",
    "ModelConfig",
    "Tokenizer",
    "build_preset",
    "default_dtype",
    "generate_greedy",
    "load_model",
    "save_hf_folder",
]
