"""DenseAttention: exact softmax attention over contiguous per-sequence K/V, the reference backend.

It is the ``dense`` baseline of the engine and the oracle the other backends are tested against,
so it favours being obviously right over being fast: one SDPA call per sequence per layer, a
Python loop over the sequences of the batch (it is never captured in a CUDA graph).

Use::

    attn = DenseAttention(num_layers)
    attn.begin_step(["a", "b"], [5, 1])          # seq "a" prefills 5 tokens, "b" decodes 1
    hidden = model(input_ids, positions, attn)    # the 6 tokens, "a"'s first, then "b"'s
    attn.free("a")

Invariant: the tokens a sequence gets in successive steps are its positions 0, 1, 2, ... in
order, so its cached length before a step is the position of its first new token.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from .layers import QKV


class _KVBuffer:
    """Growing K/V of one (sequence, layer): capacity doubles, so appends are amortised O(new)."""

    def __init__(self, like: Tensor):
        # like: [n, Hkv, d] — the first keys, which fix heads, dim, dtype and device
        self.k = torch.empty((max(16, like.shape[0]), *like.shape[1:]), dtype=like.dtype, device=like.device)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        # k, v: [n, Hkv, d] -> all keys and values so far, [length, Hkv, d] each
        needed = self.length + k.shape[0]
        if needed > self.k.shape[0]:
            capacity = max(needed, 2 * self.k.shape[0])
            self.k = _grow(self.k, capacity, self.length)
            self.v = _grow(self.v, capacity, self.length)
        self.k[self.length : needed] = k
        self.v[self.length : needed] = v
        self.length = needed
        return self.k[:needed], self.v[:needed]


def _grow(buffer: Tensor, capacity: int, length: int) -> Tensor:
    grown = torch.empty((capacity, *buffer.shape[1:]), dtype=buffer.dtype, device=buffer.device)
    grown[:length] = buffer[:length]
    return grown


class DenseAttention:
    """Implements ``AttentionFn`` (see ``lockserve.workers.model.model``) for ragged batches."""

    def __init__(self, num_layers: int):
        if num_layers <= 0:
            raise ValueError(f"num_layers ({num_layers}) must be > 0")
        self.num_layers = num_layers
        self._cache: dict[Hashable, list[_KVBuffer | None]] = {}
        self._step: list[tuple[Hashable, int]] = []

    def begin_step(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int]) -> None:
        """Declare the next forward's batch: the flat token axis holds ``num_new_tokens[i]`` tokens
        of ``seq_ids[i]``, in this order. New ids start empty sequences."""
        if len(seq_ids) != len(num_new_tokens):
            raise ValueError(
                f"seq_ids ({len(seq_ids)} items) and num_new_tokens ({len(num_new_tokens)} items) "
                "must have the same length"
            )
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids ({list(seq_ids)!r}) must not repeat a sequence")
        for seq_id, count in zip(seq_ids, num_new_tokens, strict=True):
            if count < 0:
                raise ValueError(f"num_new_tokens for sequence {seq_id!r} ({count}) must be >= 0")
            self._cache.setdefault(seq_id, [None] * self.num_layers)
        self._step = list(zip(seq_ids, num_new_tokens, strict=True))

    def __call__(self, layer: int, x: QKV) -> Tensor:
        # x: the layer's QKV (see lockserve.workers.model.layers) -> o: [T, Hq, d]
        q, k, v = x.split_rotated()  # [T, Hq, d], [T, Hkv, d] x 2, post-RoPE
        total = sum(count for _, count in self._step)
        if q.shape[0] != total:
            raise ValueError(f"attention got {q.shape[0]} tokens, begin_step declared {total}")
        out = torch.empty_like(q)
        start = 0
        for seq_id, count in self._step:
            if count:
                end = start + count
                out[start:end] = self._attend_one(seq_id, layer, q[start:end], k[start:end], v[start:end],
                                                  x.window)
                start = end
        return out

    def _attend_one(self, seq_id: Hashable, layer: int, q: Tensor, k: Tensor, v: Tensor,
                    window: int | None) -> Tensor:
        # q: [n, Hq, d]; k, v: [n, Hkv, d] -> [n, Hq, d]
        buffers = self._cache[seq_id]
        if buffers[layer] is None:
            buffers[layer] = _KVBuffer(k)
        keys, values = buffers[layer].append(k, v)  # [L, Hkv, d] each, L = cached + n
        return dense_attention(q, keys, values, window)

    def free(self, seq_id: Hashable) -> None:
        """Drop a finished sequence's K/V."""
        self._cache.pop(seq_id, None)

    def num_cached(self, seq_id: Hashable) -> int:
        """Tokens of ``seq_id`` held (in layer 0), 0 for an unknown sequence."""
        buffers = self._cache.get(seq_id)
        return 0 if buffers is None or buffers[0] is None else buffers[0].length

    def cached_kv(self, seq_id: Hashable, layer: int) -> tuple[Tensor, Tensor]:
        """The K and V held for one sequence and layer: [L, Hkv, d] each (views; do not keep)."""
        buffer = self._cache[seq_id][layer]
        if buffer is None:
            raise KeyError(f"sequence {seq_id!r} has no keys in layer {layer}")
        return buffer.k[: buffer.length], buffer.v[: buffer.length]


@torch.no_grad()
def generate_greedy(model, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids=frozenset()) -> list[int]:
    """Reference greedy decoding of one sequence with DenseAttention: one prefill, then one token per
    step. Returns the new ids (stopping after a stop id is produced). Reads each token on the host,
    so it is the oracle for engine tests, not a fast path."""
    device = model.device
    attn = DenseAttention(model.config.num_layers)
    tokens = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    positions = torch.arange(len(prompt_ids), device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        attn.begin_step([0], [tokens.shape[0]])
        hidden = model(tokens, positions, attn)  # [n, hidden]
        next_id = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        out.append(next_id)
        if next_id in stop_ids:
            break
        tokens = torch.tensor([next_id], device=device)
        positions = positions[-1:] + 1
    return out


def dense_attention(q: Tensor, keys: Tensor, values: Tensor, window: int | None = None) -> Tensor:
    """Exact causal attention of the last n tokens of one sequence over all its L keys.

    q: [n, Hq, d] (the queries of the sequence's last n tokens); keys, values: [L, Hkv, d], L >= n.
    Query i sits at position p = L - n + i and sees keys 0 .. p, or with a sliding ``window`` W
    only p - W + 1 .. p (transformers' sliding_window_overlay: kv > q - W). Returns [n, Hq, d].
    """
    n, num_heads, head_dim = q.shape
    length, num_kv_heads = keys.shape[0], keys.shape[1]
    group = num_heads // num_kv_heads
    k = (
        keys.transpose(0, 1).repeat_interleave(group, dim=0).float()
    )  # [Hq, L, d]; head h reads KV head h // G
    v = values.transpose(0, 1).repeat_interleave(group, dim=0).float()  # [Hq, L, d]
    # Plain float32 matmul + softmax: exact, and on the CPU much faster than SDPA with a mask at
    # these sizes.
    scores = torch.matmul(q.transpose(0, 1).float(), k.transpose(1, 2)) / head_dim**0.5  # [Hq, n, L]
    query_pos = torch.arange(length - n, length, device=q.device)[:, None]  # [n, 1]
    key_pos = torch.arange(length, device=q.device)[None, :]  # [1, L]
    hidden = key_pos > query_pos  # [n, L]
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hq, n, d]
    return o.transpose(0, 1).to(q.dtype)
