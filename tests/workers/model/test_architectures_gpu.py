"""The CUDA path of every architecture and RoPE scaling (Triton RoPE with passed-through pairs,
Triton RMSNorm over q/k heads, per-position dynamic NTK, CUDA-graph decode steps): float32 on the
GPU gives transformers' greedy tokens (transformers on the CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from tests.workers.model import hf_tiny
from tests.workers.model.hf_tiny import PROMPT, TINY
from tests.workers.model.test_architectures import ARCHITECTURES
from tests.workers.model.test_rope import CASES, _hf_config

GPU_MODES = [("dense", "hbm"), ("locks", "hbm"), ("locks", "host")]


def _case(name: str):
    """(transformers model, prompt, new tokens) of an architecture or a RoPE case."""
    if name in ARCHITECTURES:
        config_class, overrides = ARCHITECTURES[name]
        return hf_tiny.build_hf(config_class(**{**TINY, **overrides}), seed=len(name)), PROMPT, 20
    _, _, prompt_len, new = CASES[name]
    return hf_tiny.build_hf(_hf_config(name), seed=4), PROMPT[:prompt_len], new


@pytest.mark.gpu
@pytest.mark.parametrize("name", [*sorted(ARCHITECTURES), *(f"rope-{n}" for n in sorted(CASES))])
def test_cuda_float32_tokens_equal_transformers(name, tmp_path):
    hf, prompt, new = _case(name.removeprefix("rope-"))
    folder = hf_tiny.save_folder(hf, tmp_path / "model")
    expected = hf_tiny.hf_greedy(hf, prompt, new)
    for attention, tier in GPU_MODES:
        got = hf_tiny.our_greedy(folder, prompt, new, attention=attention, tier=tier, device="cuda",
                                 dtype=torch.float32)
        assert got == expected, f"{name} {attention}:{tier} on CUDA: {got} != transformers' {expected}"
