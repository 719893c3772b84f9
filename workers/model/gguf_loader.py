"""Loading a GGUF file (llama.cpp's format): config from metadata, de-quantised weights, tokenizer.

Weights are de-quantised to float at load (``gguf.quants.dequantize``) and then cast to the model
dtype: the model always computes in bf16/fp32, the quantisation only shrinks the file.

llama.cpp's converter permutes the rows of Q and K of ``llama`` models (its RoPE pairs dimensions
(2i, 2i+1); Hugging Face pairs (i, i + d/2)). ``_unpermute`` undoes it so the weights match the
Hugging Face checkpoint they came from. ``qwen2``, ``qwen3`` and ``phi3`` files are not permuted.
Phi-3's fused projections stay fused (``attn_qkv``; ``ffn_up`` holds gate then up); its LongRoPE
factors are the ``rope_factors_long`` / ``rope_factors_short`` tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from lockserve.workers.model import rope
from lockserve.workers.model.gguf_reader import GgufFile
from lockserve.workers.model.model import ModelConfig
from lockserve.workers.model.tokenizer import BYTE_TO_CHAR, Tokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers

# general.architecture -> (Hugging Face architecture, are Q/K rows permuted in the file)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "phi3": ("Phi3ForCausalLM", False),
}
GGUF_ROPE_SCALINGS = ("none", "linear", "yarn")  # <arch>.rope.scaling.type (LongRoPE: by tensors)
_LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where an architecture's file names a tensor otherwise: Phi-3's ffn_up is the fused gate_up.
_ARCH_BLOCK_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"}}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_MISSING = object()


def open_gguf(path: str | Path) -> GgufFile:
    """Parse a GGUF file's header, metadata and tensor table; ValueError naming the file if it is
    not a complete GGUF file."""
    return GgufFile(path)


def metadata(reader: GgufFile, key: str, default=_MISSING):
    """One metadata value (int, float, str, bool or list); KeyError naming the key if absent."""
    if key in reader.metadata:
        return reader.metadata[key]
    if default is _MISSING:
        raise KeyError(f"metadata key {key!r} is missing")
    return default


def config_from_gguf(reader: GgufFile, source: str = "GGUF") -> ModelConfig:
    """A ModelConfig from the ``<arch>.*`` and ``tokenizer.ggml.*`` metadata."""
    arch = metadata(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: general.architecture ({arch!r}) is not supported; "
            f"supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    heads = metadata(reader, f"{arch}.attention.head_count")
    hidden = metadata(reader, f"{arch}.embedding_length")
    tokens = metadata(reader, "tokenizer.ggml.tokens", None)
    vocab = len(tokens) if tokens is not None else metadata(reader, f"{arch}.vocab_size")
    head_dim = metadata(reader, f"{arch}.attention.key_length", hidden // heads)
    context = metadata(reader, f"{arch}.context_length")
    scaling = _rope_scaling(reader, arch, context, source)
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=metadata(reader, f"{arch}.feed_forward_length"),
        num_layers=metadata(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=metadata(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=_rope_freq_factors(reader),
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=rope.max_context(context, scaling),
        partial_rotary_factor=metadata(reader, f"{arch}.rope.dimension_count", head_dim) / head_dim,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_stop_ids(reader),
        architecture=GGUF_ARCHITECTURES[arch][0],
    )


def _rope_freq_factors(reader: GgufFile) -> tuple[float, ...] | None:
    """llama.cpp stores llama3 rope scaling as a ``rope_freqs`` tensor of per-frequency divisors."""
    return _float_tensor(reader, "rope_freqs.weight")


def _float_tensor(reader: GgufFile, name: str) -> tuple[float, ...] | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1))
    return None


def _rope_scaling(reader: GgufFile, arch: str, context: int, source: str) -> dict | None:
    """rope_scaling as a config.json has it, from ``<arch>.rope.scaling.*`` and (LongRoPE) the
    ``rope_factors_long`` / ``rope_factors_short`` tensors; ValueError naming an unsupported type."""
    kind = metadata(reader, f"{arch}.rope.scaling.type", "none") or "none"
    original = metadata(reader, f"{arch}.rope.scaling.original_context_length", None)
    long, short = (_float_tensor(reader, name) for name in _LONGROPE_TENSORS)
    if long is not None and short is not None:
        scaling = {"rope_type": "longrope", "long_factor": list(long), "short_factor": list(short),
                   "original_max_position_embeddings": original or context}
        scaling["factor"] = context / scaling["original_max_position_embeddings"]
        attention_factor = metadata(reader, f"{arch}.rope.scaling.attn_factor", None)
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        return scaling
    if kind not in GGUF_ROPE_SCALINGS:
        raise ValueError(
            f"{source}: {arch}.rope.scaling.type ({kind!r}) is not supported; "
            f"supported: {list(GGUF_ROPE_SCALINGS)}"
        )
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": float(metadata(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = original or context
    return scaling


def _stop_ids(reader: GgufFile) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(v for k in keys if (v := metadata(reader, k, None)) is not None))


def gguf_weights(
    reader: GgufFile, config: ModelConfig, source: str = "GGUF"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight, de-quantised and un-permuted."""
    arch = metadata(reader, "general.architecture")
    permuted = GGUF_ARCHITECTURES[arch][1]
    for tensor in reader.tensors:
        if tensor.name in ("rope_freqs.weight", *_LONGROPE_TENSORS):
            continue  # read into the config
        name = hf_name(tensor.name, source, arch)
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.ggml_type)
        except Exception as error:
            raise ValueError(
                f"{source}: cannot de-quantise {tensor.name} ({tensor.ggml_type.name}): {error}"
            ) from error
        weight = torch.from_numpy(
            np.array(values, dtype=np.float32)
        )  # a copy: F32 tensors are read-only maps
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config.num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config.num_kv_heads)
        yield name, weight


def hf_name(gguf_name: str, source: str = "GGUF", arch: str = "llama") -> str:
    """Hugging Face parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ValueError for a name a Llama-family model lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {**_BLOCK_NAMES, **_ARCH_BLOCK_NAMES.get(arch, {})}
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ValueError(f"{source}: tensor {gguf_name!r} has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # weight: [H*d, ...] rows in llama.cpp order (per head: d/2 pairs (2i, 2i+1)) -> HF order
    # (per head: first halves then second halves). Inverse of convert_hf_to_gguf's `permute`.
    rows = weight.shape[0]
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.transpose(1, 2).reshape(weight.shape)


# tokenizer.ggml.pre -> the split regex of that vocabulary (transformers / llama.cpp use the same);
# anything else gets GPT-2's own byte-level regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf(reader: GgufFile, source: str = "GGUF") -> Tokenizer:
    """A byte-level BPE Tokenizer from ``tokenizer.ggml.*`` metadata (``tokenizer.ggml.model`` must be
    "gpt2"), built as transformers builds it so both give the same ids."""
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{source}: tokenizer.ggml.model ({kind!r}) is not supported; supported: 'gpt2'")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ")) for merge in metadata(reader, "tokenizer.ggml.merges")]
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {_byte_spelling(token, alphabet): index for index, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata(reader, "tokenizer.ggml.pre", None))
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, metadata(reader, "tokenizer.ggml.token_type", []), alphabet)
    bos = metadata(reader, "tokenizer.ggml.bos_token_id", None)
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=_stop_ids(reader),
        chat_template=metadata(reader, "tokenizer.chat_template", None),
        add_bos_by_default=bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        source=source,
    )


def _byte_spelling(token: str, alphabet: set[str]) -> str:
    # Tokens are stored in GPT-2's byte alphabet; a few files store raw text instead -> re-spell.
    if set(token) <= alphabet:
        return token
    return "".join(BYTE_TO_CHAR[byte] for byte in token.encode("utf-8"))


def _pre_tokenizer(pre: str | None):
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_special_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], token_types: list[int], alphabet: set[str]
) -> None:
    """CONTROL tokens become special added tokens (matched whole, skipped when decoding);
    USER_DEFINED ones plain added tokens. A CONTROL token outside the byte alphabet is a llama.cpp
    mislabel and is skipped, as transformers does."""
    control = [
        tokenizers.AddedToken(t, special=True, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    user = [
        tokenizers.AddedToken(t, special=False, normalized=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
