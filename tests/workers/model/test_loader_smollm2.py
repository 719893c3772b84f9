"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers loading the
same file: same tokenizer ids, same chat prompt, same greedy tokens. Loads each side once."""

from __future__ import annotations

import functools

import gguf
import pytest
import torch
import transformers  # the reference implementation (test extra; GGUF loading also needs accelerate)
from lockserve.workers.model.dense_attention import DenseAttention, generate_greedy
from lockserve.workers.model.loader import default_model_path, load_model

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
TEXTS = [
    "Hello, world!",
    "  Größe: naïve café — 日本語のテキスト 😀🎉",
    "def f(x):\n\treturn x ** 2  # 12345",
    "<|im_start|>user\nhi<|im_end|>\n",
    "Ça va? ¿Qué tal? Привет!",
]


@pytest.fixture(scope="module")
def ours():
    return load_model("default")


@pytest.fixture(scope="module")
def theirs():
    path = default_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # Test speed only: transformers parses the file twice and rebuilds gguf's tensor-name table once per
    # submodule (~400 times). Both are pure functions of their arguments, so memoising them changes no
    # result and saves ~10 s of CPU.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        patch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=4)(gguf.get_tensor_name_map))
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.eval(), tokenizer


def test_config_is_smollm2(ours):
    config = ours[0].config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert (config.hidden_size, config.vocab_size, config.tie_word_embeddings) == (576, 49152, True)
    assert config.rope_theta == 100000.0 and config.architecture == "LlamaForCausalLM"


def test_tokenizer_equals_transformers(ours, theirs):
    tokenizer, hf_tokenizer = ours[1], theirs[1]
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text
    prompt = tokenizer.apply_chat_template(MESSAGES)
    assert prompt == hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode_chat(MESSAGES) == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.stop_ids == {hf_tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_greedy_chat_tokens_equal_transformers(ours, theirs):
    model, tokenizer = ours
    ids = tokenizer.encode_chat(MESSAGES)
    with torch.no_grad():
        expected = theirs[0].generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    actual = generate_greedy(model, ids, 16, stop_ids=tokenizer.stop_ids)
    assert actual == expected.tolist(), (tokenizer.decode(actual), tokenizer.decode(expected.tolist()))
    assert "Paris" in tokenizer.decode(actual)


def test_prefill_logits_close_to_transformers(ours, theirs):
    model, tokenizer = ours
    ids = tokenizer.encode_chat(MESSAGES)
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step([0], [len(ids)])
    actual = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))
    with torch.no_grad():
        expected = theirs[0](torch.tensor([ids])).logits[0]
    # Same de-quantised float32 weights; only the summation order differs over 30 layers.
    torch.testing.assert_close(actual, expected, atol=2e-3, rtol=1e-4, msg="SmolLM2 prefill logits")
