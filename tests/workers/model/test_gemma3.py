"""Gemma-3 text (Gemma3ForCausalLM) against transformers: a tiny random model from
Gemma3TextConfig with interleaved sliding-window (64 tokens) and global layers, head_dim 256, MQA
or GQA, q/k norms, (1 + w) RMSNorms, scaled embeddings, query_pre_attn_scalar, sandwich norms,
GeGLU, local and global RoPE bases (linear scaling on the global layers only), tied embeddings and
a final logit softcap (tied embeddings: logits only, as their greedy tokens are one token
repeated in a tiny random model); a 320-token prompt, longer than the window. Through ``LLM(folder)`` (dense,
LOCKS at a budget above the context, hbm and host): transformers' greedy tokens; logits within
float32 tolerance; the sliding layers' decodes read only the window (counted from DecodeTrace)."""

from __future__ import annotations

import pytest
import torch
import transformers
from lockserve.workers.api import LLM
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import load_model, save_hf_folder

from tests.conftest import assert_close
from tests.workers.model import hf_tiny
from tests.workers.model.hf_tiny import MODES, PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW = 64
GEMMA = dict(head_dim=256, sliding_window=WINDOW, sliding_window_pattern=3, num_hidden_layers=3,
             query_pre_attn_scalar=192, tie_word_embeddings=False,
             rope_scaling={"rope_type": "linear", "factor": 4.0})
# name -> overrides of hf_tiny.TINY; layers 0 and 1 slide, layer 2 is global
CASES = {
    "gemma3-mqa": {**GEMMA, "num_key_value_heads": 1},
    "gemma3-gqa-softcap": {**GEMMA, "head_dim": 64, "final_logit_softcapping": 50.0,
                           "rope_local_base_freq": 500.0},
}


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """Float32 agreement at the logits' scale. NOTE: query_pre_attn_scalar (192, not head_dim) is
    folded into q (x sqrt(d / 192)) where transformers scales the scores: a few float32 ulps apart
    (2.4e-5 on logits of 32 at head_dim 256; exactly 0 with the scalar at head_dim), past
    assert_close's absolute 1e-5. Greedy choices are compared exactly below."""
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert err <= 2e-6 * scale, f"{msg}: max |diff| {err:.3g} on logits up to {scale:.3g}"
    assert torch.equal(got.argmax(-1), want.argmax(-1)), f"{msg}: a greedy choice differs"


def _config(name: str) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{**hf_tiny.TINY, **CASES[name]})


@pytest.fixture(scope="module", params=sorted(CASES))
def saved(request, tmp_path_factory):
    """(name, transformers model, its folder, transformers' greedy tokens after PROMPT)."""
    return hf_tiny.saved_case(request.param, _config(request.param), tmp_path_factory.mktemp(request.param),
                              11, PROMPT)


def test_config_reads_gemma3(saved):
    name, hf, folder, _ = saved
    config = load_model(folder)[0].config
    assert config.architecture == "Gemma3ForCausalLM" and config.arch.gemma
    assert config.layer_windows == (WINDOW, WINDOW, None), config.layer_windows
    assert config.rope_theta == 1e6 and config.rope_scaling["rope_type"] == "linear"
    assert config.local_rope_theta == (500.0 if "softcap" in name else 10000.0)
    assert config.query_pre_attn_scalar == 192 and not config.tie_word_embeddings
    assert config.max_position_embeddings == hf.config.max_position_embeddings


def test_logits_equal_transformers(saved):
    name, hf, folder, _ = saved
    assert_logits_close(hf_tiny.our_logits(folder, PROMPT), hf_tiny.hf_logits(hf, PROMPT),
                        f"{name}: prefill logits of {len(PROMPT)} tokens vs transformers")


@pytest.mark.parametrize(("attention", "tier"), MODES)
def test_greedy_tokens_equal_transformers(saved, attention, tier):
    name, _, folder, expected = saved
    got = hf_tiny.our_greedy(folder, PROMPT, attention=attention, tier=tier)
    assert got == expected, f"{name} {attention}:{tier}: tokens {got} != transformers' {expected}"


def test_sliding_layers_read_only_the_window(saved):
    """Every decode step (prompt 320 > window 64): each sliding layer attends exactly 64 keys on
    at most 5 pages of 16 per KV head (64 x 2 x head_dim x 4 bytes of K/V), the global layer every
    key; and no sliding layer is LOCKS-scored."""
    name, hf, folder, _ = saved
    llm = {"attention": "locks", "tier": "hbm", "budget_tokens": 1024, "kv_capacity_tokens": 2048,
           "device": "cpu"}
    traces = []
    with LLM(str(folder), **llm) as engine:
        engine.engine.attention.observer = lambda t: traces.append(
            (t.layer, t.window, t.scores is None, t.tokens_attended().clone(),
             (t.selection.lens > 0).sum(dim=-1).clone(), int(t.rows.num_pages[0])))
        engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    head_dim = hf.config.head_dim
    steps = [t for t in traces if t[0] == 0]
    assert len(steps) >= 7, f"{name}: {len(steps)} decode steps observed"
    for layer, window, unscored, tokens, pages, num_pages in traces:
        if layer < 2:
            assert window == WINDOW and unscored, f"{name}: layer {layer} was scored"
            assert bool((tokens == WINDOW).all()), f"{name}: layer {layer} attended {tokens.tolist()} keys"
            assert bool((pages <= 5).all()) and num_pages > 20, (pages.tolist(), num_pages)
            kv_bytes = int(tokens.sum()) * 2 * head_dim * 4
            assert kv_bytes == hf.config.num_key_value_heads * WINDOW * 2 * head_dim * 4
        else:
            assert window is None and bool((tokens >= len(PROMPT)).all()), f"{name}: global layer {tokens}"


def test_gemma_details_matter(saved):
    """Each Gemma-specific piece changes the logits when taken away: the window, the embedding
    scale, the query scalar, the local RoPE base (so the comparisons above see them)."""
    name, hf, folder, _ = saved
    expected = hf_tiny.hf_logits(hf, PROMPT)

    def off(change):
        model, _ = load_model(folder)
        change(model)
        return (hf_tiny.model_logits(model, PROMPT) - expected).abs().max()

    def no_window(model):
        for block in model.layers:
            block.self_attn.window = None

    def no_query_scalar(model):
        for block in model.layers:
            block.self_attn.query_scale = 1.0

    checks = {"window": no_window, "embed_scale": lambda m: setattr(m, "embed_scale", 1.0),
              "query_pre_attn_scalar": no_query_scalar,
              "local rope": lambda m: setattr(m, "local_rotary", None)}
    for what, change in checks.items():
        assert off(change) > 0.1, f"{name}: {what} made no difference"


def test_save_hf_folder_round_trips_through_transformers(saved, tmp_path):
    name, hf, folder, _ = saved
    model, tokenizer = load_model(folder)
    ours = model.hf_state_dict()
    theirs = hf.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
    save_hf_folder(model, tokenizer, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "again", dtype=torch.float32, attn_implementation="eager").eval()
    assert type(again) is type(hf) and again.config.layer_types == hf.config.layer_types
    ids = PROMPT[:200]
    assert_close(hf_tiny.hf_logits(again, ids), hf_tiny.hf_logits(hf, ids), f"{name} saved back")


def test_tied_embeddings_logits_equal_transformers(tmp_path):
    hf = hf_tiny.build_hf(transformers.Gemma3TextConfig(**{**hf_tiny.TINY, **CASES["gemma3-mqa"],
                                                           "tie_word_embeddings": True}), seed=5)
    folder = hf_tiny.save_folder(hf, tmp_path / "tied")
    model, _ = load_model(folder)
    assert model.lm_head is None and "lm_head.weight" not in model.hf_state_dict()
    assert_logits_close(hf_tiny.model_logits(model, PROMPT), hf_tiny.hf_logits(hf, PROMPT), "tied Gemma-3")


def test_refusals_name_the_field(tmp_path):
    for field, value in (("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)):
        config = {**_config("gemma3-mqa").to_dict(), field: value, "architectures": ["Gemma3ForCausalLM"]}
        with pytest.raises(ValueError, match=field):
            from lockserve.workers.model.model import ModelConfig

            ModelConfig.from_hf_config(config)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_float32_tokens_equal_transformers(name, tmp_path):
    """The CUDA path at head_dim 256: the CUDA score kernel reads d <= 128, so LOCKS scoring takes
    the Triton kernel (kernels.ops "auto"); decode the Triton attention kernel (with the window's
    first page through the reference); float32 prefill the masked reference (FlashAttention-2,
    d <= 256, serves bf16/fp16). Not yet run on a GPU."""
    hf = hf_tiny.build_hf(_config(name), seed=11)
    folder = hf_tiny.save_folder(hf, tmp_path / name)
    expected = hf_tiny.hf_greedy(hf, PROMPT)
    for attention, tier in [("dense", "hbm"), ("locks", "hbm"), ("locks", "host")]:
        got = hf_tiny.our_greedy(folder, PROMPT, attention=attention, tier=tier, device="cuda",
                                 dtype=torch.float32)
        assert got == expected, f"{name} {attention}:{tier} on CUDA: {got} != transformers' {expected}"
