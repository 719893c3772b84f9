"""Every supported architecture beyond Llama against transformers' own implementation: a tiny
random model built from its transformers config class, saved as a Hugging Face folder, loaded
through ``LLM(folder)`` (dense, and LOCKS with a budget above the context, on hbm and host) and
``load_model(folder)``: greedy tokens equal to transformers' ``generate``, logits within float32
tolerance (CPU)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from lockserve.workers.model import weights
from lockserve.workers.model.architectures import SUPPORTED_ARCHITECTURES
from lockserve.workers.model.dense_attention import DenseAttention
from lockserve.workers.model.loader import load_model, save_hf_folder

from tests.conftest import assert_close
from tests.workers.model import hf_tiny
from tests.workers.model.hf_tiny import MODES, PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# name -> (transformers config class, overrides of hf_tiny.TINY); each names what it exercises.
ARCHITECTURES = {
    "qwen3": (transformers.Qwen3Config, {}),  # per-head q/k RMSNorm before RoPE, no biases
    "glm": (transformers.GlmConfig, {}),  # partial (0.5) interleaved rotary, QKV bias, fused gate_up
    "glm4": (transformers.Glm4Config, {}),  # GLM + post-attention and post-MLP norms
    "phi3": (transformers.Phi3Config, {}),  # fused qkv_proj and gate_up_proj in the checkpoint
    # Phi-4-mini's partial rotary (0.75) in the rotate-half layout, and an odd layer count.
    "phi3-partial": (transformers.Phi3Config, {"partial_rotary_factor": 0.75, "num_hidden_layers": 3}),
}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def saved(request, tmp_path_factory):
    """(name, transformers model, its folder, transformers' greedy tokens after PROMPT)."""
    config_class, overrides = ARCHITECTURES[request.param]
    config = config_class(**{**hf_tiny.TINY, **overrides})
    return hf_tiny.saved_case(request.param, config, tmp_path_factory.mktemp(request.param),
                              len(request.param), PROMPT)


def test_logits_equal_transformers(saved):
    name, hf, folder, _ = saved
    expected = hf_tiny.hf_logits(hf, PROMPT)  # [T, vocab]
    actual = hf_tiny.our_logits(folder, PROMPT)
    assert actual.shape == expected.shape
    assert_close(actual, expected, f"{name}: prefill logits of {len(PROMPT)} tokens vs transformers")


@pytest.mark.parametrize(("attention", "tier"), MODES)
def test_greedy_tokens_equal_transformers(saved, attention, tier):
    name, _, folder, expected = saved
    got = hf_tiny.our_greedy(folder, PROMPT, attention=attention, tier=tier)
    assert got == expected, f"{name} {attention}:{tier}: tokens {got} != transformers' {expected}"


def test_config_reads_what_each_architecture_departs_by(saved):
    name, hf, folder, _ = saved
    config = load_model(folder)[0].config
    assert config.architecture == type(hf).__name__
    rotary = {"glm": 16, "glm4": 16, "phi3-partial": 24}.get(name, 32)
    assert config.rotary_dim == rotary, f"{name}: rotary_dim {config.rotary_dim}, expected {rotary}"
    assert config.qkv_bias == name.startswith("glm") and not config.o_bias
    assert config.arch.qk_norm == (name == "qwen3") and config.arch.post_norms == (name == "glm4")


@pytest.mark.parametrize("name", ["glm", "phi3-partial"])
def test_glm_and_partial_rotary_layouts_matter(name, tmp_path, monkeypatch):
    """Loaded without the permutation into our rotary layout, the logits are far from transformers'
    (so the comparisons above see the layout)."""
    config_class, overrides = ARCHITECTURES[name]
    hf = hf_tiny.build_hf(config_class(**{**hf_tiny.TINY, **overrides}), seed=1)
    folder = hf_tiny.save_folder(hf, tmp_path / name)
    expected = hf_tiny.hf_logits(hf, PROMPT[:64])
    monkeypatch.setattr(weights, "head_dim_order", lambda *args: None)
    wrong = hf_tiny.our_logits(folder, PROMPT[:64])
    assert (wrong - expected).abs().max() > 0.1, f"{name}: the rotary layout made no difference"


def test_qwen3_qk_norm_and_glm4_post_norms_matter(tmp_path):
    """Norm weights set to one (an unweighted norm) change the logits: the weights are live."""
    cases = ((transformers.Qwen3Config, ("q_norm", "k_norm")),
             (transformers.Glm4Config, ("post_self_attn_layernorm", "post_mlp_layernorm")))
    for config_class, norms in cases:
        hf = hf_tiny.build_hf(config_class(**hf_tiny.TINY), seed=2)
        folder = hf_tiny.save_folder(hf, tmp_path / config_class.__name__)
        before = hf_tiny.our_logits(folder, PROMPT[:64])
        model, _ = load_model(folder)
        for name, param in model.named_parameters():
            if any(f".{norm}." in name for norm in norms):
                param.data.fill_(1.0)
        attn = DenseAttention(model.config.num_layers)
        attn.begin_step(["s"], [64])
        after = model.compute_logits(model(torch.tensor(PROMPT[:64]), torch.arange(64), attn))
        assert (after - before).abs().max() > 0.1, f"{config_class.__name__}: {norms} made no difference"


def test_hf_state_dict_gives_back_the_checkpoint(saved):
    """Our weights under transformers' names, un-permuted and (Phi-3, GLM's MLP) fused as stored."""
    name, hf, folder, _ = saved
    ours = load_model(folder)[0].hf_state_dict()
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith("inv_freq")}
    assert sorted(ours) == sorted(theirs), f"{name}: names differ"
    for key, tensor in theirs.items():
        assert torch.equal(ours[key], tensor), f"{name}: {key} differs"


def test_save_hf_folder_round_trips_through_transformers(saved, tmp_path):
    """Our model written back (config.json from to_hf_config, weights un-permuted) is the model
    transformers loads."""
    name, hf, folder, _ = saved
    model, tokenizer = load_model(folder)
    save_hf_folder(model, tokenizer, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "again", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(again) is type(hf)
    ids = PROMPT[:96]
    assert_close(hf_tiny.hf_logits(again, ids), hf_tiny.hf_logits(hf, ids), f"{name} saved back")


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path):
    config = {**transformers.Qwen3Config(**hf_tiny.TINY).to_dict(), "architectures": ["Gemma2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    named = r"config\.json: architectures \(\['Gemma2ForCausalLM'\]\) is not supported; supported: \["
    with pytest.raises(ValueError, match=named) as error:
        load_model(tmp_path)
    message = str(error.value)
    assert "\n" not in message and all(f"'{arch}'" in message for arch in SUPPORTED_ARCHITECTURES), message
