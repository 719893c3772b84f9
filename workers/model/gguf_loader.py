"""Loading a GGUF file (llama.cpp's format): config from metadata, de-quantised weights, tokenizer.

Weights are de-quantised to float at load (``gguf.quants.dequantize``) and then cast to the model
dtype: the model always computes in bf16/fp32, the quantisation only shrinks the file.

llama.cpp's converter permutes the rows of Q and K of ``llama`` models (its RoPE pairs dimensions
(2i, 2i+1); Hugging Face pairs (i, i + d/2)). ``_unpermute`` undoes it so the weights match the
Hugging Face checkpoint they came from. ``qwen2`` files are not permuted.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
from lockserve.workers.model.gguf_reader import GgufFile
from lockserve.workers.model.model import ModelConfig
from lockserve.workers.model.tokenizer import BYTE_TO_CHAR, Tokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers

# general.architecture -> (Hugging Face architecture, are Q/K rows permuted in the file)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

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
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
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
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=metadata(reader, f"{arch}.feed_forward_length"),
        num_layers=metadata(reader, f"{arch}.block_count"),
        num_heads=heads,
        num_kv_heads=metadata(reader, f"{arch}.attention.head_count_kv", heads),
        head_dim=metadata(reader, f"{arch}.attention.key_length", hidden // heads),
        rope_theta=float(metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(reader, arch, source),
        rms_norm_eps=float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=metadata(reader, f"{arch}.context_length"),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=metadata(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_stop_ids(reader),
        architecture=GGUF_ARCHITECTURES[arch][0],
    )


def _rope_freq_factors(reader: GgufFile, arch: str, source: str) -> tuple[float, ...] | None:
    """llama.cpp stores llama3 rope scaling as a ``rope_freqs`` tensor of per-frequency divisors."""
    scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", ""):
        raise ValueError(f"{source}: {arch}.rope.scaling.type ({scaling!r}) is not supported")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return tuple(float(x) for x in np.asarray(tensor.data, dtype=np.float32).reshape(-1))
    return None


def _stop_ids(reader: GgufFile) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    return tuple(dict.fromkeys(v for k in keys if (v := metadata(reader, k, None)) is not None))


def gguf_weights(
    reader: GgufFile, config: ModelConfig, source: str = "GGUF"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every weight, de-quantised and un-permuted."""
    permuted = GGUF_ARCHITECTURES[metadata(reader, "general.architecture")][1]
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # read into the config
        name = hf_name(tensor.name, source)
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


def hf_name(gguf_name: str, source: str = "GGUF") -> str:
    """Hugging Face parameter name of a GGUF tensor name (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ValueError for a name a Llama-family model lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"{source}: tensor {gguf_name!r} has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


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
