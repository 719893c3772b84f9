"""DenseAttention: exact attention against a brute-force loop, and ragged batches (prefill chunks and
decodes of several sequences in one step) against each sequence run alone."""

from __future__ import annotations

import pytest
import torch
from lockserve.workers.model.dense_attention import DenseAttention, dense_attention, generate_greedy
from lockserve.workers.model.layers import QKV
from lockserve.workers.model.presets import build_preset

from tests.conftest import assert_close


def brute_force_attention(q, keys, values):
    """q: [n, Hq, d]; keys, values: [L, Hkv, d] -> [n, Hq, d]; float64, one (query, head) at a time."""
    n, num_heads, dim = q.shape
    length, num_kv = keys.shape[:2]
    out = torch.zeros(n, num_heads, dim, dtype=torch.float64)
    for i in range(n):
        last_visible = length - n + i
        for h in range(num_heads):
            kv = h // (num_heads // num_kv)
            k, v = keys[: last_visible + 1, kv].double(), values[: last_visible + 1, kv].double()
            weights = torch.softmax(k @ q[i, h].double() / dim**0.5, dim=0)
            out[i, h] = weights @ v
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv,n,length", [(4, 4, 5, 5), (6, 2, 1, 37), (8, 2, 9, 54), (9, 3, 17, 17)]
)
def test_dense_attention_equals_brute_force(num_heads, num_kv, n, length):
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(n, num_heads, 24, generator=generator)
    keys = torch.randn(length, num_kv, 24, generator=generator) * 2
    values = torch.randn(length, num_kv, 24, generator=generator)
    expected = brute_force_attention(q, keys, values)
    assert_close(
        dense_attention(q, keys, values), expected.float(), f"Hq={num_heads} Hkv={num_kv} n={n} L={length}"
    )


def _run_alone(model, ids):
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step(["alone"], [len(ids)])
    return model(torch.tensor(ids), torch.arange(len(ids)), attn)  # [T, hidden]


def test_ragged_steps_equal_each_sequence_alone():
    model, _ = build_preset("tiny", seed=4)
    generator = torch.Generator().manual_seed(0)
    seqs = {
        name: torch.randint(0, 256, (length,), generator=generator).tolist()
        for name, length in (("a", 9), ("b", 13), ("c", 5))
    }
    # Each step: (seq, how many of its next tokens). Mixes prefill chunks, decodes, idle sequences.
    steps = [
        [("a", 7), ("b", 3)],
        [("b", 5), ("a", 1), ("c", 4)],
        [("a", 1), ("b", 1), ("c", 0)],
        [("c", 1), ("b", 4)],
    ]
    attn = DenseAttention(model.config.num_layers)
    done = dict.fromkeys(seqs, 0)
    outputs = {name: [] for name in seqs}
    for step in steps:
        ids, positions = [], []
        for name, count in step:
            ids += seqs[name][done[name] : done[name] + count]
            positions += range(done[name], done[name] + count)
        attn.begin_step([name for name, _ in step], [count for _, count in step])
        hidden = model(torch.tensor(ids), torch.tensor(positions), attn)
        start = 0
        for name, count in step:
            outputs[name].append(hidden[start : start + count])
            start += count
            done[name] += count
    assert done == {name: len(ids) for name, ids in seqs.items()}
    for name, ids in seqs.items():
        assert attn.num_cached(name) == len(ids)
        assert_close(torch.cat(outputs[name]), _run_alone(model, ids), f"sequence {name} in ragged steps")


def test_greedy_with_cache_equals_recomputing_everything():
    model, tokenizer = build_preset("tiny-qwen2", seed=9)
    prompt = tokenizer.encode("cache me")
    tokens = list(prompt)
    for _ in range(10):
        logits = model.compute_logits(_run_alone(model, tokens)[-1:])
        tokens.append(int(logits.argmax()))
    assert generate_greedy(model, prompt, 10) == tokens[len(prompt) :]


def test_cached_kv_and_free():
    model, _ = build_preset("tiny", seed=1)
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step([1, 2], [3, 40])  # 40 > the first buffer's 16 slots: the buffer grows
    model(torch.arange(43), torch.cat([torch.arange(3), torch.arange(40)]), attn)
    k, v = attn.cached_kv(2, layer=2)
    assert k.shape == v.shape == (40, model.config.num_kv_heads, model.config.head_dim)
    attn.free(1)
    assert attn.num_cached(1) == 0 and attn.num_cached(2) == 40


def test_bad_steps_are_named():
    attn = DenseAttention(2)
    with pytest.raises(ValueError, match=r"seq_ids \(2 items\) and num_new_tokens \(1 items\)"):
        attn.begin_step(["a", "b"], [1])
    with pytest.raises(ValueError, match=r"must not repeat a sequence"):
        attn.begin_step(["a", "a"], [1, 1])
    with pytest.raises(ValueError, match=r"num_new_tokens for sequence 'b' \(-1\) must be >= 0"):
        attn.begin_step(["a", "b"], [1, -1])
    attn.begin_step(["a"], [2])
    qkv = QKV(torch.zeros(3, 4 * 8), torch.ones(3, 4), torch.zeros(3, 4), 2, 1, 8)
    with pytest.raises(ValueError, match=r"attention got 3 tokens, begin_step declared 2"):
        attn(0, qkv)
    with pytest.raises(ValueError, match=r"num_layers \(0\) must be > 0"):
        DenseAttention(0)
