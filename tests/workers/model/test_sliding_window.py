"""Sliding-window attention as transformers applies it, against transformers itself: Mistral and
Phi-3 (a window on every layer), Qwen2 and Qwen3 (``use_sliding_window``: only the layers past
``max_window_layers``). Tiny random models with a 64-token window and a 320-token prompt, so
every layer that slides drops most of the context; loaded through ``LLM(folder)`` (dense, and LOCKS
with a budget above the context, on hbm and host) and ``load_model``: greedy tokens equal to
transformers' ``generate``, logits within float32 tolerance (CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from lockserve.workers.model.loader import load_model, save_hf_folder

from tests.conftest import assert_close
from tests.workers.model import hf_tiny
from tests.workers.model.hf_tiny import MODES, PROMPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW = 64
QWEN_WINDOW = {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}
# name -> (config class, overrides of hf_tiny.TINY, the layers that slide)
MODELS = {
    "mistral": (transformers.MistralConfig, {"sliding_window": WINDOW}, (0, 1)),
    "phi3": (transformers.Phi3Config, {"sliding_window": WINDOW}, (0, 1)),
    "qwen2": (transformers.Qwen2Config, QWEN_WINDOW, (1,)),
    "qwen3": (transformers.Qwen3Config, QWEN_WINDOW, (1,)),
}


ALL_SLIDE = sorted(name for name, (_, _, sliding) in MODELS.items() if sliding == (0, 1))


def build_case(name: str, tmp_path_factory) -> tuple:
    """(name, transformers model, its folder, transformers' greedy tokens after PROMPT)."""
    config_class, overrides, _ = MODELS[name]
    config = config_class(**{**hf_tiny.TINY, **overrides})
    return hf_tiny.saved_case(name, config, tmp_path_factory.mktemp(name), 7 + len(name), PROMPT)


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    return build_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=ALL_SLIDE)
def all_slide(request, tmp_path_factory):
    """A case whose every layer slides (no global layer for LOCKS to select on)."""
    return build_case(request.param, tmp_path_factory)


def test_config_reads_the_window_and_its_layers(saved):
    name, _, folder, _ = saved
    windows = load_model(folder)[0].config.layer_windows
    sliding = MODELS[name][2]
    assert windows == tuple(WINDOW if i in sliding else None for i in range(2)), f"{name}: {windows}"


def test_logits_equal_transformers(saved):
    name, hf, folder, _ = saved
    assert_close(hf_tiny.our_logits(folder, PROMPT), hf_tiny.hf_logits(hf, PROMPT),
                 f"{name}: prefill logits of {len(PROMPT)} tokens, window {WINDOW}, vs transformers")


@pytest.mark.parametrize(("attention", "tier"), MODES)
def test_greedy_tokens_equal_transformers(saved, attention, tier):
    name, _, folder, expected = saved
    got = hf_tiny.our_greedy(folder, PROMPT, attention=attention, tier=tier)
    assert got == expected, f"{name} {attention}:{tier}: tokens {got} != transformers' {expected}"


def test_the_window_changes_the_logits(saved):
    """Without the window (every key attended) the logits are far from transformers': the
    comparisons above see the window."""
    name, hf, folder, _ = saved
    model, _ = load_model(folder)
    for block in model.layers:
        block.self_attn.window = None
    wrong = hf_tiny.model_logits(model, PROMPT)
    assert (wrong - hf_tiny.hf_logits(hf, PROMPT)).abs().max() > 0.1, f"{name}: the window made no difference"


def test_save_hf_folder_keeps_the_window(saved, tmp_path):
    """Written back, transformers reads the same window on the same layers."""
    name, hf, folder, _ = saved
    model, tokenizer = load_model(folder)
    save_hf_folder(model, tokenizer, tmp_path / "again")
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "again", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert again.config.sliding_window == WINDOW
    ids = PROMPT[:200]
    assert_close(hf_tiny.hf_logits(again, ids), hf_tiny.hf_logits(hf, ids), f"{name} saved back")


def test_qwen_window_needs_use_sliding_window(tmp_path):
    """Qwen2.5's published configs set sliding_window with use_sliding_window false: no window."""
    config = transformers.Qwen2Config(**hf_tiny.TINY, use_sliding_window=False, sliding_window=WINDOW)
    config.sliding_window = WINDOW  # as on the Hub (the config class itself clears it)
    hf = hf_tiny.build_hf(config, seed=3)
    folder = hf_tiny.save_folder(hf, tmp_path / "qwen2")
    assert load_model(folder)[0].config.layer_windows == (None, None)


@pytest.mark.parametrize("tier", ["hbm", "host"])
def test_locks_never_selects_on_window_layers(all_slide, tier):
    """LOCKS at a budget below the window (64 tokens: 4 pages, the window spans 5): a model whose
    every layer slides still gives transformers' tokens (no layer is selected from), and on host
    the decode read buffer is sized for the window, not the budget (one sequence at a time)."""
    name, _, folder, expected = all_slide
    got = hf_tiny.our_greedy(folder, PROMPT, attention="locks", tier=tier, budget_tokens=64, max_num_seqs=1)
    assert got == expected, f"{name} locks:{tier} at 64 tokens: {got} != transformers' {expected}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(MODELS))
def test_cuda_float32_tokens_equal_transformers(name, tmp_path):
    """The CUDA path of a window layer (the Triton kernel over the window's pages merged with the
    reference's masked first page, in replayed CUDA graphs): transformers' tokens (not yet run on
    a GPU)."""
    config_class, overrides, _ = MODELS[name]
    hf = hf_tiny.build_hf(config_class(**{**hf_tiny.TINY, **overrides}), seed=7 + len(name))
    folder = hf_tiny.save_folder(hf, tmp_path / name)
    expected = hf_tiny.hf_greedy(hf, PROMPT)
    for attention, tier in [("dense", "hbm"), ("locks", "hbm"), ("locks", "host")]:
        got = hf_tiny.our_greedy(folder, PROMPT, attention=attention, tier=tier, device="cuda",
                                 dtype=torch.float32)
        assert got == expected, f"{name} {attention}:{tier} on CUDA: {got} != transformers' {expected}"
