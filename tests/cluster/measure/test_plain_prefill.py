"""The plain torch prefill anchor (cluster.bench.plain_prefill) on the CPU: its FLOP count against hand
sums, its attention against an explicit softmax with K/V repeated per group, the sliced stack
against the unsliced one, and a timed run of the tiny preset."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lockserve.cluster.measure import plain_prefill
from lockserve.cluster.measure.plain_prefill import (
    PlainPrefill,
    causal_gqa_attention,
    prefill_flops,
    rope_cos_sin,
    time_plain_prefill,
)
from lockserve.workers.model.model import ModelConfig
from lockserve.workers.model.presets import PRESETS

from tests.conftest import assert_close

# D = 8, I = 12, L = 2, Hq = 4, Hkv = 2, d = 4.
SMALL = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=4)


def test_prefill_flops_small_config_by_hand():
    # weights per layer: qkv 8 * (4 + 2 * 2) * 4 = 256, o 4 * 4 * 8 = 128, mlp 3 * 8 * 12 = 288 -> 672
    # linear 2 * 5 * 672 * 2 = 13440; attention 4 * 4 * 4 * (5 * 6 / 2) * 2 = 1920
    assert prefill_flops(SMALL, 5) == 13440 + 1920, f"got {prefill_flops(SMALL, 5)}"
    # prefix 3: every one of the 5 queries sees 3 more keys: 4 * 4 * 4 * 15 * 2 = 1920 more
    assert prefill_flops(SMALL, 5, prefix=3) == 13440 + 1920 + 1920, f"got {prefill_flops(SMALL, 5, 3)}"
    assert prefill_flops(SMALL, 0, prefix=7) == 0.0


def test_prefill_flops_llama_8b_at_128k():
    flops = prefill_flops(PRESETS["llama-3.1-8b"], 131072)
    assert math.isclose(flops, 6.33e15, rel_tol=0.01), f"Llama-3.1-8B at 131072 tokens: {flops:.4e}"


@pytest.mark.parametrize("tokens, prefix", [(1, 1), (37, 1000), (4096, 131072)])
def test_prefix_adds_only_attention_over_cached_keys(tokens, prefix):
    cfg = PRESETS["llama-3.1-8b"]
    extra = prefill_flops(cfg, tokens, prefix) - prefill_flops(cfg, tokens, 0)
    expected = 4 * cfg.head_dim * cfg.num_heads * tokens * prefix * cfg.num_layers
    assert extra == expected, f"tokens {tokens}, prefix {prefix}: extra {extra} != {expected}"


def test_prefill_flops_rejects_negative_counts():
    with pytest.raises(ValueError, match=r"tokens \(-1\)"):
        prefill_flops(SMALL, -1)


def naive_causal_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v with K/V repeated per group; q [T, Hq, d], k/v [T, Hkv, d]."""
    tokens, heads, d = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [T, Hq, d]
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [Hq, T, T]
    future = torch.ones(tokens, tokens, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)  # [T, Hq, d]


@pytest.mark.parametrize("tokens", [1, 37, 97])
def test_attention_of_a_tiny_layer_equals_naive(tokens):
    cfg = PRESETS["tiny"]
    stack = PlainPrefill(cfg, "cpu", torch.float32, seed=3)
    x = stack.random_hidden(tokens, seed=4)  # [T, hidden]
    cos, sin = rope_cos_sin(tokens, cfg.head_dim, cfg.rope_theta, x.device, x.dtype)
    q, k, v = stack.attention_inputs(stack.layers[0], x, cos, sin)
    assert q.shape == (tokens, cfg.num_heads, cfg.head_dim), f"q {tuple(q.shape)}"
    assert k.shape == v.shape == (tokens, cfg.num_kv_heads, cfg.head_dim), f"k {tuple(k.shape)}"
    out = causal_gqa_attention(q, k, v)
    assert_close(out, naive_causal_gqa(q, k, v), f"tiny layer 0 attention, T = {tokens}")


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (6, 3), (5, 5)])
def test_attention_grouping_equals_naive(heads, kv_heads):
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    q = torch.randn(54, heads, 16, generator=generator)
    k, v = (torch.randn(54, kv_heads, 16, generator=generator) for _ in range(2))
    assert_close(causal_gqa_attention(q, k, v), naive_causal_gqa(q, k, v), f"Hq {heads}, Hkv {kv_heads}")


def test_attention_rejects_mismatched_heads():
    q, k = torch.zeros(8, 4, 16), torch.zeros(8, 3, 16)
    with pytest.raises(ValueError, match=r"\(8, 4, 16\), \(8, 3, 16\)"):
        causal_gqa_attention(q, k, k)


def test_sliced_stack_equals_one_slice():
    cfg = PRESETS["tiny"]
    sliced = PlainPrefill(cfg, "cpu", torch.float32, seed=1, slice_tokens=16)
    whole = PlainPrefill(cfg, "cpu", torch.float32, seed=1)
    hidden = whole.random_hidden(50, seed=2)
    out = sliced(hidden)
    assert out.shape == hidden.shape and torch.isfinite(out).all(), f"out {tuple(out.shape)}"
    assert not torch.equal(out, hidden), "the stack left its input unchanged"
    assert_close(out, whole(hidden), "slices of 16 tokens (50 tokens) vs one slice")


def test_time_plain_prefill_tiny_on_cpu():
    result = time_plain_prefill(PRESETS["tiny"], 64, "cpu", torch.float32, repeats=2)
    assert result["tokens"] == 64
    assert len(result["seconds_all"]) == 2, f"seconds_all {result['seconds_all']}"
    assert result["seconds"] == min(result["seconds_all"]) > 0, f"seconds {result['seconds_all']}"
    assert result["flops"] == prefill_flops(PRESETS["tiny"], 64)
    assert result["tflops"] == pytest.approx(result["flops"] / result["seconds"] / 1e12)
    assert result["tflops"] > 0, f"tflops {result['tflops']}"


def test_a_long_prefill_is_timed_once_after_a_one_slice_warm_up(monkeypatch):
    runs = []
    real = plain_prefill._timed_run
    monkeypatch.setattr(plain_prefill, "_timed_run", lambda stack, hidden: runs.append(len(hidden)) or
                        real(stack, hidden))
    monkeypatch.setattr(plain_prefill, "SLICE_TOKENS", 16)
    monkeypatch.setattr(plain_prefill, "LONG_TOKENS", 40)
    result = time_plain_prefill(PRESETS["tiny"], 64, "cpu", torch.float32, repeats=2)
    assert runs == [16, 64] and result["warmup_tokens"] == 16 and len(result["seconds_all"]) == 1
    runs.clear()
    result = time_plain_prefill(PRESETS["tiny"], 40, "cpu", torch.float32, repeats=2)  # not past it
    assert runs == [40, 40, 40] and result["warmup_tokens"] == 40 and len(result["seconds_all"]) == 2


def test_main_prints_a_line_per_count_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plain.json"
    argv = ["--model", "tiny", "--tokens", "8", "33", "--device", "cpu", "--repeats", "1", "--out", str(out)]
    assert plain_prefill.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["tokens=8", "tokens=33"], f"printed {lines}"
    results = json.loads(out.read_text())["results"]
    assert [r["tokens"] for r in results] == [8, 33], f"JSON {results}"
