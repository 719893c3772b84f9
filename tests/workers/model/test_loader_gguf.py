"""GGUF loading on tiny files written here the way llama.cpp's converter writes them (Q/K rows
permuted for llama, Q8_0 blocks, a byte-level BPE vocabulary with merges), checked against
transformers' own GGUF loader and tokenizer."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import pytest
import tokenizers
import torch
import transformers  # the reference implementation (test extra; GGUF loading also needs accelerate)
from lockserve.workers.model.dense_attention import DenseAttention, generate_greedy
from lockserve.workers.model.gguf_loader import hf_name, open_gguf
from lockserve.workers.model.loader import load_model, save_hf_folder
from lockserve.workers.model.model import CausalLM
from lockserve.workers.model.presets import build_preset, init_random, preset_config
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.conftest import assert_close

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Pack my box with five dozen liquor jugs!",
    "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich. 日本語のテキスト。",
    "def main():\n    return 42  # numbers 1234567890\n",
]
TEXTS = [
    "The quick brown fox",
    "  leading spaces and\ttabs\n\nnewlines",
    "Zwölf Boxkämpfer 日本 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "numbers 1234567 and symbols !?#",
]


def _trained_vocabulary() -> tuple[list[str], list[str], list[int]]:
    """(tokens by id, merges "a b", llama.cpp token types) of a small byte-level BPE trained here."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]  # 3 = CONTROL, 1 = NORMAL
    return tokens, merges, types


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF "rotate half" rows -> llama.cpp interleaved pairs.
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _gguf_name(hf: str) -> str:
    inverse = {hf_name(g): g for g in ("token_embd.weight", "output_norm.weight", "output.weight")}
    if hf in inverse:
        return inverse[hf]
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.qkv_proj": "attn_qkv",  # Phi-3, fused
        "self_attn.q_norm": "attn_q_norm",  # Qwen3
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate then up
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[part]}.{kind}"


def _llama3_freq_factors(config) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, for rope_scaling llama3.
    s = config.rope_scaling
    freqs = 1.0 / (
        config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim)
    )
    low_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    high_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def _write_rope_scaling(writer: gguf.GGUFWriter, c) -> None:
    # As convert_hf_to_gguf.py writes each: llama3 as a rope_freqs tensor, YaRN and linear as
    # rope.scaling.* keys, LongRoPE (Phi-3) as two factor tensors with the original context.
    kind = (c.rope_scaling or {}).get("rope_type")
    if kind == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_freq_factors(c))
    elif kind in ("yarn", "linear"):
        types = {"yarn": gguf.RopeScalingType.YARN, "linear": gguf.RopeScalingType.LINEAR}
        writer.add_rope_scaling_type(types[kind])
        writer.add_rope_scaling_factor(c.rope_scaling["factor"])
        if kind == "yarn":
            writer.add_rope_scaling_orig_ctx_len(c.rope_scaling["original_max_position_embeddings"])
    elif kind == "longrope":
        s = c.rope_scaling
        writer.add_rope_scaling_orig_ctx_len(s["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(s["factor"]) / math.log(
            s["original_max_position_embeddings"])))
        writer.add_tensor("rope_factors_long.weight", np.array(s["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(s["short_factor"], dtype=np.float32))


def write_gguf(path, model: CausalLM, vocabulary, arch: str, quantize: bool, add_bos: bool = False) -> None:
    """Write ``model`` as llama.cpp's converter would: metadata, tokenizer, tensors."""
    c = model.config
    tokens, merges, types = vocabulary
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.rotary_dim)
    if c.head_dim * c.num_heads != c.hidden_size:
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    writer.add_vocab_size(c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)
    _write_rope_scaling(writer, c)
    for name, tensor in model.hf_state_dict().items():
        data = tensor.float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, c.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, c.num_kv_heads)
        if quantize and data.ndim == 2:
            writer.add_tensor(
                _gguf_name(name),
                gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(_gguf_name(name), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def vocabulary():
    return _trained_vocabulary()


def _tiny(preset: str, vocabulary, seed: int = 11, **changes) -> CausalLM:
    model = CausalLM(preset_config(preset).replace(vocab_size=len(vocabulary[0]), **changes))
    init_random(model, seed)
    return model


def _prefill_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step([0], [len(ids)])
    return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))  # [T, vocab]


@pytest.mark.parametrize(
    "preset,arch,quantize,changes",
    [
        ("tiny", "llama", True, {}),
        ("tiny-qwen2", "qwen2", False, {}),
        # q/k norms; transformers' Qwen3 GGUF config takes head_dim 128 whatever the file says.
        ("tiny", "qwen3", False, {"architecture": "Qwen3ForCausalLM", "head_dim": 128}),
        ("tiny", "phi3", True, {"architecture": "Phi3ForCausalLM"}),  # fused attn_qkv and ffn_up
    ],
)
def test_gguf_model_equals_transformers_gguf_loader(tmp_path, vocabulary, preset, arch, quantize, changes):
    # transformers reads no attention.key_length for these GGUFs: head_dim must be hidden / heads.
    source = _tiny(preset, vocabulary, **{"head_dim": 16, **changes})
    path = tmp_path / f"{preset}.gguf"
    write_gguf(path, source, vocabulary, arch, quantize)
    ours, tokenizer = load_model(path)
    assert ours.config.architecture == source.config.architecture
    assert ours.config.tie_word_embeddings == source.config.tie_word_embeddings
    assert ours.config.qkv_bias == source.config.qkv_bias
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = tokenizer.encode(TEXTS[0] + " " + TEXTS[2])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
        hf_tokens = hf.generate(
            torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert_close(
        _prefill_logits(ours, ids), expected, f"{preset} GGUF ({'Q8_0' if quantize else 'F32'}) logits"
    )
    assert generate_greedy(ours, ids, 12) == hf_tokens
    if not quantize:  # F32 file: the weights are the source's, bit for bit, after un-permuting
        for name, tensor in source.hf_state_dict().items():
            assert torch.equal(ours.hf_state_dict()[name], tensor), name


def test_gguf_tokenizer_equals_transformers(tmp_path, vocabulary):
    path = tmp_path / "tok.gguf"
    write_gguf(path, _tiny("tiny", vocabulary), vocabulary, "llama", quantize=False, add_bos=True)
    ours = load_model(path)[1]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.add_bos_by_default
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, add_bos=False) == theirs(text, add_special_tokens=False)["input_ids"], text
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Größe? 😀"}]
    prompt = ours.apply_chat_template(messages)
    assert prompt == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(messages) == theirs(prompt, add_special_tokens=False)["input_ids"]
    assert ours.stop_ids == {vocabulary[0].index("<|im_end|>")}


def test_gguf_llama3_rope_freqs_match_the_hf_checkpoint(tmp_path, vocabulary):
    """llama.cpp stores llama3 scaling as a rope_freqs tensor; loading it must give the same model as
    the Hugging Face folder (itself checked against transformers in test_model.py)."""
    source = _tiny("tiny-llama3", vocabulary)
    write_gguf(tmp_path / "l3.gguf", source, vocabulary, "llama", quantize=False)
    save_hf_folder(source, build_preset("tiny")[1], tmp_path / "hf")
    from_gguf = load_model(tmp_path / "l3.gguf")[0]
    from_hf = load_model(tmp_path / "hf")[0]
    assert from_gguf.config.rope_freq_factors is not None
    assert_close(
        from_gguf.rotary.inv_freq, from_hf.rotary.inv_freq, "inv_freq from rope_freqs vs llama3 config"
    )
    ids = list(range(3, 90))  # past the original context (64) of the preset
    assert_close(_prefill_logits(from_gguf, ids), _prefill_logits(from_hf, ids), "llama3 GGUF vs HF folder")


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
_LONGROPE = {"rope_type": "longrope", "factor": 16.0, "original_max_position_embeddings": 32,
             "short_factor": [1.0 + 0.1 * i for i in range(12)],
             "long_factor": [1.0 + 2.0 * i for i in range(12)]}


@pytest.mark.parametrize("arch,changes", [
    # Qwen3 + YaRN past an original context of 32 positions.
    ("qwen3", {"architecture": "Qwen3ForCausalLM", "max_position_embeddings": 32, "rope_scaling": _YARN}),
    # Phi-4-mini's form: LongRoPE over a partial (0.75) rotary.
    ("phi3", {"architecture": "Phi3ForCausalLM", "partial_rotary_factor": 0.75,
              "max_position_embeddings": 512, "rope_scaling": _LONGROPE}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 32}),
])
def test_gguf_rope_scalings_match_the_hf_folder(tmp_path, vocabulary, arch, changes):
    """YaRN, linear and LongRoPE as convert_hf_to_gguf.py writes them load to the model of the
    Hugging Face folder (itself checked against transformers in test_rope.py), past the original
    context; head_dim 32 so the partial rotary has room."""
    source = _tiny("tiny", vocabulary, **changes)
    write_gguf(tmp_path / "m.gguf", source, vocabulary, arch, quantize=False)
    save_hf_folder(source, build_preset("tiny")[1], tmp_path / "hf")
    from_gguf, from_hf = load_model(tmp_path / "m.gguf")[0], load_model(tmp_path / "hf")[0]
    assert from_gguf.config.rope_scaling["rope_type"] == changes["rope_scaling"]["rope_type"]
    assert from_gguf.config.rotary_dim == from_hf.config.rotary_dim == source.config.rotary_dim
    assert from_gguf.config.max_position_embeddings == from_hf.config.max_position_embeddings >= 128
    ids = list(range(3, 120))  # past the original context of 32
    assert_close(_prefill_logits(from_gguf, ids), _prefill_logits(from_hf, ids), f"{arch} GGUF vs HF folder")
    plain = CausalLM(from_hf.config.replace(rope_scaling=None))
    plain.load_hf_weights(from_hf.hf_state_dict().items())
    assert (_prefill_logits(plain, ids) - _prefill_logits(from_gguf, ids)).abs().max() > 0.1, "scaling unused"


def test_gguf_unsupported_rope_scaling_is_named(tmp_path, vocabulary):
    path = tmp_path / "odd.gguf"
    source = _tiny("tiny", vocabulary, rope_scaling={"rope_type": "linear", "factor": 4.0})
    write_gguf(path, source, vocabulary, "llama", quantize=False)
    path.write_bytes(path.read_bytes().replace(b"linear", b"NTKrpe"))  # same length: still well-formed
    message = r"odd\.gguf: llama\.rope\.scaling\.type \('NTKrpe'\) is not supported; supported: \['none', "
    with pytest.raises(ValueError, match=message):
        load_model(path)


def test_gguf_unsupported_architecture_is_named(tmp_path, vocabulary):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, _tiny("tiny", vocabulary), vocabulary, "falcon", quantize=False)
    with pytest.raises(
        ValueError, match=r"falcon\.gguf: general\.architecture \('falcon'\) is not supported"
    ):
        load_model(path)


def test_truncated_gguf_names_the_file(tmp_path, vocabulary):
    path = tmp_path / "whole.gguf"
    write_gguf(path, _tiny("tiny", vocabulary), vocabulary, "llama", quantize=True)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    assert open_gguf(path).tensors
    with pytest.raises(ValueError, match=r"cut\.gguf: not a valid or complete GGUF file"):
        load_model(cut)
