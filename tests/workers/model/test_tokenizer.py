"""Tokenizer against transformers' tokenizer on the same Hugging Face folder, chat templates, and the
streaming detokenizer."""

from __future__ import annotations

import json

import jinja2
import pytest
import tokenizers
import transformers  # the reference implementation (test extra; GGUF loading also needs accelerate)
from lockserve.workers.model.tokenizer import Tokenizer, byte_level_tokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
# A Llama-3-style template: uses bos_token, loop.first, raise_exception and a trimmed-whitespace block.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role ' + message['role']) }}{% endif %}\n"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CORPUS = [
    "Hello world, hello tokens! " * 4,
    "Ünïcödé text: naïve café, 日本語, emoji 😀🎉.",
    "  indented\n\tcode = 1234 + 5678\n",
    "The end of the text.",
]
TEXTS = [
    "Hello world",
    "naïve café 😀 日本語",
    "  two spaces\n\nand\ttab",
    "<|eot_id|>special<|begin_of_text|>",
    "digits 123456789",
    "",
]


def _trained_backend() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def _write_folder(folder, post_processor_bos: bool, config_add_bos: bool | None) -> None:
    backend = _trained_backend()
    if post_processor_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", backend.token_to_id("<|begin_of_text|>"))],
        )
    backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot_id|>", "special": True},
        "chat_template": LLAMA3_TEMPLATE,
    }
    if config_add_bos is not None:
        config["add_bos_token"] = config_add_bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("post_processor_bos,config_add_bos", [(True, None), (False, None), (False, True)])
def test_hf_folder_ids_equal_transformers(tmp_path, post_processor_bos, config_add_bos):
    _write_folder(tmp_path, post_processor_bos, config_add_bos)
    ours = Tokenizer.from_hf_folder(tmp_path, eos_token_ids=[1])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        plain = ours.encode(text, add_bos=False)
        assert plain == theirs(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(plain) == theirs.decode(plain, skip_special_tokens=True), text
        assert ours.decode(plain, skip_special_tokens=False) == theirs.decode(plain), text
    assert ours.eos_token_id == ours.backend.token_to_id("<|eot_id|>")
    assert ours.stop_ids == {ours.eos_token_id, 1}


def test_chat_template_equals_transformers(tmp_path):
    _write_folder(tmp_path, post_processor_bos=True, config_add_bos=None)
    ours = Tokenizer.from_hf_folder(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Café? 😀"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "日本語"},
    ]
    for add_generation_prompt in (True, False):
        prompt = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert prompt == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    expected_ids = theirs.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ours.encode_chat(messages) == list(expected_ids)
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_from_jinja_file_wins(tmp_path):
    _write_folder(tmp_path, post_processor_bos=False, config_add_bos=None)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"


def test_missing_tokenizer_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_hf_folder(tmp_path)


STREAM_TEXTS = [
    "plain ascii words",
    "naïve café 😀🎉 日本語のテキスト",
    "  leading spaces\n\n\ttabs ",
    "🇫🇷 flag + 👩‍👩‍👧",
]


@pytest.mark.parametrize("kind", ["bytes", "trained"])
def test_streaming_never_emits_broken_utf8(kind):
    tokenizer = (
        byte_level_tokenizer()
        if kind == "bytes"
        else Tokenizer(_trained_backend(), bos_token_id=0, eos_token_ids=[2])
    )
    for text in STREAM_TEXTS:
        ids = tokenizer.encode(text, add_bos=False)
        stream = tokenizer.detokenizer(prompt_ids=tokenizer.encode("Prompt:", add_bos=False))
        deltas = [stream.push(i) for i in ids]
        deltas.append(stream.flush())
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas), deltas
        if kind == "bytes" and "😀" in text:  # a 4-byte character arrives as one delta, after its last byte
            assert "😀" in deltas and deltas.count("") >= 3


def test_streaming_flushes_an_incomplete_tail():
    tokenizer = byte_level_tokenizer()
    stream = tokenizer.detokenizer()
    assert stream.push(ord("a")) == "a"
    assert stream.push(0xF0) == "" and stream.push(0x9F) == ""  # 2 of the 4 bytes of an emoji
    assert stream.flush() == "\ufffd"  # what decode gives for the incomplete tail, emitted at the end


def test_byte_level_tokenizer_round_trips():
    tokenizer = byte_level_tokenizer()
    text = "Größe ✓ 😀 \x00\x7f <|im_start|>"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id == 256
    assert ids[1:4] == list(b"Gr") + [0xC3]
    assert ids[-1] == 258  # <|im_start|> is one special token
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>" + text
    assert tokenizer.stop_ids == {257, 259} and tokenizer.vocab_size == 260
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_model_without_a_chat_template_refuses_chats_and_says_so(tmp_path, caplog):
    """No ChatML (or any) fallback: transformers refuses too."""
    _write_folder(tmp_path, post_processor_bos=False, config_add_bos=None)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert ours.chat_template is None
    with pytest.raises(ValueError, match=rf"{tmp_path} has no chat template .* send a plain prompt"):
        ours.apply_chat_template([{"role": "user", "content": "x"}])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="chat_template"):
        theirs.apply_chat_template([{"role": "user", "content": "x"}])
    assert ours.encode("plain prompts still work") == theirs("plain prompts still work")["input_ids"]
