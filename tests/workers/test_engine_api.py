"""The offline Python API (`LLM`): generate, stream, chat, and the errors users meet first."""

from __future__ import annotations

import json

import pytest
from lockserve.workers.api import LLM
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import save_hf_folder
from lockserve.workers.model.presets import build_preset

from tests.workers.engine.test_engine import dense_reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", attention="dense", tier="hbm", device="cpu", kv_capacity_tokens=4096,
             max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32) as engine:
        yield engine


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_generate_matches_the_model_and_keeps_prompt_order(llm):
    prompts = ["The quick brown fox", "Hello", "A much longer prompt, " * 5]
    completions = llm.generate(prompts, GREEDY)
    for text, c in zip(prompts, completions, strict=True):
        ids = llm.tokenizer.encode(text)
        assert c.prompt_token_ids == ids
        assert c.token_ids == dense_reference(llm.model, ids, 10), text
        assert c.text == llm.tokenizer.decode(c.token_ids) and c.finish_reason == "length"
    assert llm.stats()["pages_used"] == 0


def test_stream_yields_the_generate_tokens_and_closing_aborts(llm):
    [full] = llm.generate("streaming", GREEDY)
    outs = list(llm.stream("streaming", GREEDY))
    assert [t for o in outs for t in o.token_ids] == full.token_ids and outs[-1].finished
    assert [o.finished for o in outs].count(True) == 1
    it = llm.stream("abandoned", SamplingParams(temperature=0, max_tokens=50))
    next(it)
    assert llm.stats()["running"] == 1
    it.close()
    assert llm.stats()["running"] == 0 and llm.stats()["pages_used"] == 0


def test_chat_template_and_token_id_prompts(llm):
    ids = llm.encode_chat([{"role": "user", "content": "hi"}])
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>user\nhi<|im_end|>")
    [by_ids] = llm.generate([ids], GREEDY)
    assert by_ids.token_ids == dense_reference(llm.model, ids, 10)


def test_a_bad_prompt_fails_the_whole_call_and_leaves_nothing_running(llm):
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        llm.generate(["fine", []], GREEDY)
    with pytest.raises(ValueError, match=r"params \(1 items\) must match prompts \(2 items\)"):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match=r"temperature \(-1\)"):
        llm.generate("x", {"temperature": -1})
    assert llm.stats()["running"] == 0 and llm.stats()["queue_len"] == 0
    assert llm.generate("still serving", GREEDY)[0].token_ids


def test_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['budget'\]"):
        LLM("tiny", device="cpu", budget=3)
    with pytest.raises(ValueError, match="budget_tokens"):
        LLM("tiny", device="cpu", budget_tokens=-3)
    with pytest.raises(ValueError, match=r"kv_capacity_tokens \(0\)"):
        LLM("tiny", device="cpu", kv_capacity_tokens=0)


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(ValueError, match="preset"):
        LLM("preset:no-such-preset", device="cpu")


def test_corrupt_weight_files_are_clear_errors(tmp_path):
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"GGUF" + b"\x00" * 13)
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad_gguf), device="cpu")
    folder = tmp_path / "hf"
    save_hf_folder(*build_preset("tiny"), folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LLM(str(folder), device="cpu")


def test_max_model_len_past_the_models_positions(caplog):
    """As for served workers: a larger max_model_len is an error naming both numbers, unless
    allow_long_max_model_len: then it runs the model past its positions, with a warning."""
    trained = build_preset("tiny", seed=0, device="cpu")[0].config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len \(100000\) is past .* \({trained} positions"):
        LLM("tiny", device="cpu", kv_capacity_tokens=4096, max_model_len=100_000)
    with caplog.at_level("WARNING", logger="lockserve.workers.api"):
        llm = LLM("tiny", device="cpu", kv_capacity_tokens=4096, max_model_len=100_000,
                  allow_long_max_model_len=True)
    assert trained < 100_000 and llm.engine.limits.max_model_len == 100_000
    assert f"past its {trained} trained positions" in caplog.text
    llm.close()


def test_a_folders_generation_config_gives_the_defaults_and_a_missing_template_is_said(tmp_path, caplog):
    """generation_config.json's temperature, top_p, top_k fill what a request leaves out; a model
    without a chat template is named at load and refuses chats (no ChatML fallback)."""
    folder = tmp_path / "hf"
    save_hf_folder(*build_preset("tiny"), folder)
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    (folder / "generation_config.json").write_text(json.dumps(defaults))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="lockserve.workers.model.loader"):
        llm = LLM(str(folder), device="cpu", kv_capacity_tokens=1024)
    try:
        assert f"{folder} has no chat template" in caplog.text
        assert llm.sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
        assert llm.sampling_params({"temperature": 0, "max_tokens": 3}) == SamplingParams(
            temperature=0, top_p=0.95, top_k=20, max_tokens=3)
        assert llm.sampling_params(GREEDY) is GREEDY  # as given
        with pytest.raises(ValueError, match="has no chat template"):
            llm.encode_chat([{"role": "user", "content": "hi"}])
        assert len(llm.generate("plain prompt", {"max_tokens": 4, "ignore_eos": True})[0].token_ids) == 4
    finally:
        llm.close()
    with LLM("tiny", device="cpu", kv_capacity_tokens=1024) as preset:  # presets carry no defaults
        assert preset.sampling_params() == SamplingParams()
