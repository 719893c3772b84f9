"""RoPE scalings against transformers: the inverse frequencies and attention factors of
modeling_rope_utils, then tiny models of each scaling at positions past their original context
(set small), loaded through ``LLM(folder)`` and ``load_model(folder)``: greedy tokens equal to
transformers' ``generate``, logits within float32 tolerance. And the maximum context each config
reaches, and the errors past it (CPU)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from lockserve.workers.api import LLM
from lockserve.workers.model import rope
from lockserve.workers.model.loader import load_model, save_hf_folder
from lockserve.workers.model.model import ModelConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.conftest import assert_close
from tests.workers.model import hf_tiny
from tests.workers.model.hf_tiny import MODES, PROMPT, TINY

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ORIGINAL = 64  # original context of the scaled configs: PROMPT (320 tokens) runs far past it
_SHORT = [1.0 + 0.1 * i for i in range(12)]  # LongRoPE factors for a rotary dim of 24
_LONG = [1.0 + 2.0 * i for i in range(12)]

# name -> (transformers config class, overrides of TINY, prompt length, new tokens)
CASES = {
    "linear": (transformers.LlamaConfig, dict(
        max_position_embeddings=ORIGINAL, rope_parameters={"rope_type": "linear", "factor": 8.0}), 320, 20),
    # Qwen3 + YaRN, as Qwen3 and Qwen2.5 are served past 32K.
    "yarn": (transformers.Qwen3Config, dict(
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}),
        320, 20),
    # DeepSeek-style mscale / mscale_all_dim, untruncated correction range, a narrower beta_fast.
    "yarn-mscale": (transformers.LlamaConfig, dict(
        max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                         "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "truncate": False}), 320, 20),
    # YaRN over GLM's partial interleaved rotary: the attention factor on rotated pairs only.
    "glm-yarn": (transformers.GlmConfig, dict(
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                         "partial_rotary_factor": 0.5}), 320, 20),
    # Phi-4-mini's form: LongRoPE over a partial (0.75) rotary, original context outside rope_parameters.
    "longrope": (transformers.Phi3Config, dict(
        max_position_embeddings=2048, original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
        rope_parameters={"rope_type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}), 320, 20),
    "llama3": (transformers.LlamaConfig, dict(
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                         "rope_theta": 500000.0}), 320, 20),
    # Dynamic NTK: transformers' generate rotates the prompt with one base for its whole length;
    # a prompt inside the original context (224) and 40 new tokens past it are where the two
    # conventions agree (rope.dynamic_inv_freq); past it see test_dynamic_ntk_logits_past_the_original.
    "dynamic": (transformers.LlamaConfig, dict(
        max_position_embeddings=224, rope_parameters={"rope_type": "dynamic", "factor": 4.0}), 200, 40),
}


def _hf_config(name: str) -> transformers.PretrainedConfig:
    config_class, overrides, _, _ = CASES[name]
    params = {"rope_theta": 10000.0, **overrides["rope_parameters"]}
    return config_class(**{**TINY, **overrides, "rope_parameters": params})


_SAVED: dict[str, tuple] = {}


def _saved(name: str, tmp_path_factory) -> tuple:
    """(name, transformers model, folder, prompt, transformers' greedy tokens), built once."""
    if name not in _SAVED:
        _, _, prompt_len, new = CASES[name]
        hf = hf_tiny.build_hf(_hf_config(name), seed=4)
        folder = hf_tiny.save_folder(hf, tmp_path_factory.mktemp(name))
        prompt = PROMPT[:prompt_len]
        expected = hf_tiny.hf_greedy(hf, prompt, new)
        assert len(set(expected)) > 4, f"{name}: transformers' tokens {expected} are too uniform"
        _SAVED[name] = name, hf, folder, prompt, expected
    return _SAVED[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    return _saved(request.param, tmp_path_factory)


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_equal_transformers(name):
    hf_config = _hf_config(name)
    kind = hf_config.rope_parameters["rope_type"]
    expected, expected_factor = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"), seq_len=None)
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    # LongRoPE's short factors are transformers' choice without a sequence length.
    actual, factor = rope.rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(actual, expected), f"{name}: inverse frequencies\n{actual}\n{expected}"
    assert factor == pytest.approx(expected_factor, rel=1e-12), f"{name}: attention factor"
    if kind == "longrope":
        long, _ = ROPE_INIT_FUNCTIONS[kind](hf_config, torch.device("cpu"), seq_len=ORIGINAL + 1)
        ours, _ = rope.rope_inv_freq(config.rotary_dim, config.rope_theta, config.rope_scaling, True)
        assert torch.equal(ours, long), "longrope: long factors"
    if kind in ("yarn", "longrope"):
        assert factor > 1.0, f"{name}: an attention factor of {factor} tests nothing"


def test_dynamic_ntk_frequencies_equal_transformers_at_every_length():
    hf_config = _hf_config("dynamic")
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    positions = torch.tensor([0, 100, 222, 223, 224, 300, 895, 5000])
    ours = rope.dynamic_inv_freq(positions, config.rotary_dim, config.rope_theta, config.rope_scaling)
    init = ROPE_INIT_FUNCTIONS["dynamic"]
    for row, p in zip(ours, positions.tolist(), strict=True):
        theirs, _ = init(hf_config, torch.device("cpu"), seq_len=torch.tensor(p + 1))  # a decoded token's
        assert torch.equal(row, theirs), f"dynamic NTK at position {p}"
    plain, _ = rope.rope_inv_freq(config.rotary_dim, config.rope_theta, None)
    assert torch.equal(ours[2], plain) and not torch.equal(ours[4], plain), "scaled only past 224 positions"


def test_logits_equal_transformers(saved):
    name, hf, folder, prompt, _ = saved
    assert_close(hf_tiny.our_logits(folder, prompt), hf_tiny.hf_logits(hf, prompt),
                 f"{name}: logits of {len(prompt)} positions vs transformers")


@pytest.mark.parametrize(("attention", "tier"), MODES)
def test_greedy_tokens_equal_transformers(saved, attention, tier):
    name, _, folder, prompt, expected = saved
    got = hf_tiny.our_greedy(folder, prompt, len(expected), attention=attention, tier=tier)
    assert got == expected, f"{name} {attention}:{tier}: tokens {got} != transformers' {expected}"


def test_the_scaling_matters(saved, tmp_path):
    """The same folder with plain RoPE gives other logits past the original context: the
    comparisons above see the scaling."""
    name, _, folder, _, _ = saved
    plain = tmp_path / "plain"
    plain.mkdir()
    for file in folder.iterdir():
        (plain / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    params = config["rope_parameters"]
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": params["rope_theta"],
                                 "partial_rotary_factor": params.get("partial_rotary_factor", 1.0)}
    (plain / "config.json").write_text(json.dumps(config))
    difference = (hf_tiny.our_logits(plain, PROMPT) - hf_tiny.our_logits(folder, PROMPT)).abs().max()
    assert difference > 0.1, f"{name}: plain RoPE differs by only {difference:.3g}"


def test_save_hf_folder_keeps_the_scaling(saved, tmp_path):
    """Written back by save_hf_folder, transformers reads the same scaling (dynamic NTK's original
    context included) and gives the same logits past the original context."""
    name, hf, folder, prompt, _ = saved
    save_hf_folder(*load_model(folder), tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "again", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert_close(hf_tiny.hf_logits(again, prompt), hf_tiny.hf_logits(hf, prompt), f"{name} saved back")


def _hf_stepped_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[T, vocab]: transformers fed one token at a time (each rotated as a decoded token is)."""
    cache, rows = transformers.DynamicCache(config=model.config), []
    with torch.no_grad():
        for i, token in enumerate(ids):
            out = model(torch.tensor([[token]]), position_ids=torch.tensor([[i]]), past_key_values=cache,
                        use_cache=True)
            rows.append(out.logits[0, -1])
    return torch.stack(rows)


def test_dynamic_ntk_logits_past_the_original_context(tmp_path_factory):
    """Past the original context, each position rotated with the base of its own length, as
    transformers does for decoded tokens: ours in one forward, transformers token by token."""
    _, hf, folder, _, _ = _saved("dynamic", tmp_path_factory)
    ids = PROMPT[:300]  # 76 positions past the original 224
    assert_close(hf_tiny.our_logits(folder, ids), _hf_stepped_logits(hf, ids), "dynamic NTK past 224")


def test_max_context_from_the_config():
    base = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cases = [  # (config.json fields, maximum context)
        ({"max_position_embeddings": 32768, "rope_scaling": yarn}, 131072),  # Qwen2.5 past 32K
        ({"max_position_embeddings": 40960, "rope_scaling": yarn, "architectures": ["Qwen3ForCausalLM"]},
         131072),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}, 8192),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, 8192),
        ({"max_position_embeddings": 131072, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}}, 131072),
        ({"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
          "architectures": ["Phi3ForCausalLM"],
          "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, 131072),
        ({"max_position_embeddings": 32768}, 32768),
    ]
    for fields, expected in cases:
        config = ModelConfig.from_hf_config({**base, **fields})
        assert config.max_position_embeddings == expected, f"{fields}: {config.max_position_embeddings}"
    phi3 = ModelConfig.from_hf_config({**base, **cases[5][0]})
    assert phi3.rope_scaling["rope_type"] == "longrope" and phi3.rope_scaling["factor"] == 32.0
    assert rope.uses_long_factors(phi3.rope_scaling, phi3.max_position_embeddings)
    assert not rope.uses_long_factors(phi3.rope_scaling, 4096)


def test_max_model_len_past_the_maximum_context_is_an_error_unless_allowed(tmp_path_factory, caplog):
    folder = _saved("yarn", tmp_path_factory)[2]
    limit = ORIGINAL * 8  # YaRN's factor x the original context
    past = rf"max_model_len \(600\) is past the maximum context of .* \({limit} positions"
    with pytest.raises(ValueError, match=past):
        LLM(str(folder), device="cpu", max_model_len=600)
    with caplog.at_level(logging.WARNING, logger="lockserve.workers.api"):
        llm = LLM(str(folder), device="cpu", max_model_len=600, allow_long_max_model_len=True,
                  kv_capacity_tokens=1024)
    assert llm.engine.limits.max_model_len == 600 and f"past its {limit} trained positions" in caplog.text
    llm.close()
    with LLM(str(folder), device="cpu", kv_capacity_tokens=1024) as llm:
        assert llm.engine.limits.max_model_len == limit


def test_longrope_within_its_original_context_uses_the_short_factors(tmp_path_factory):
    """max_model_len inside the original context: short factors, as transformers uses them for a
    sequence that stays there."""
    _, hf, folder, _, _ = _saved("longrope", tmp_path_factory)
    prompt = PROMPT[:44]
    expected = hf_tiny.hf_greedy(hf, prompt, 20)  # 64 positions: all inside the original context
    assert hf_tiny.our_greedy(folder, prompt, 20, max_model_len=ORIGINAL) == expected
    assert hf_tiny.our_greedy(folder, prompt, 20) != expected, "long factors should change these tokens"


def test_unsupported_rope_type_names_it_and_the_supported_list(tmp_path_factory, tmp_path):
    folder = _saved("linear", tmp_path_factory)[2]
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "proportional"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    message = r"config\.json: rope_scaling\.rope_type \('proportional'\) is not supported; supported: \["
    with pytest.raises(ValueError, match=message) as error:
        load_model(bad)
    assert "'yarn'" in str(error.value) and "\n" not in str(error.value)
