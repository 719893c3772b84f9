"""Exact attention over selected pages, and merging partial results — the torch reference.

Pages live in a pool `[S, 2, B, d]` (K then V of one page of one (layer, KV head), so a
selected page is one contiguous read). A decode step attends, per (sequence, KV head), the
pages listed in `slots: [Bt, Hkv, K]` (pool slots, -1 = padding); `page_lens: [Bt, Hkv, K]`
says how many tokens of each page are valid (B for full pages, fewer for the open page).
All G query heads of a group attend the same pages. Outputs are float32.
"""

from __future__ import annotations

import math

import torch

from .summary import take_rows


def page_lengths(sel: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """Valid tokens of each selected page. sel: [Bt, Hkv, K] page indices (-1 pad); seq_lens: [Bt]."""
    start = sel.clamp_min(0) * page_size
    n = (seq_lens.to(sel.device)[:, None, None] - start).clamp(0, page_size)
    return torch.where(sel >= 0, n, torch.zeros_like(n))


def sparse_decode_ref(
    q: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    page_lens: torch.Tensor,
    scale: float | None = None,
    first_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode query per sequence over its selected pages.

    q: [Bt, Hq, d]; pool: [S, 2, B, d]; slots, page_lens: [Bt, Hkv, K]; first_start: None or
    [Bt, Hkv] int: tokens at the start of the first selected page (column 0) that are masked (a
    sliding window that begins inside that page), so its tokens first_start .. page_lens - 1 count.
    Returns o: [Bt, Hq, d] float32 and lse: [Bt, Hq] float32 (natural log of the softmax
    denominator of the scaled logits; -inf and o = 0 where no token was selected).
    """
    bt, hq, d = q.shape
    _, hkv, kp = slots.shape
    g = hq // hkv
    b = pool.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = take_rows(pool, slots.clamp_min(0)).float()  # [Bt, Hkv, K, 2, B, d]
    keys = pages[..., 0, :, :].reshape(bt, hkv, kp * b, d)  # [Bt, Hkv, K*B, d]
    vals = pages[..., 1, :, :].reshape(bt, hkv, kp * b, d)
    tok = torch.arange(b, device=q.device)
    valid = tok[None, None, None, :] < page_lens[..., None]  # [Bt, Hkv, K, B]
    if first_start is not None:
        first = torch.arange(kp, device=q.device)[None, None, :, None] == 0  # [1, 1, K, 1]
        valid &= ~(first & (tok[None, None, None, :] < first_start.to(q.device)[..., None, None]))
    valid = valid.reshape(bt, hkv, 1, kp * b)
    qg = q.float().reshape(bt, hkv, g, d)
    logits = (qg @ keys.transpose(-1, -2)) * scale  # [Bt, Hkv, G, K*B]
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [Bt, Hkv, G]
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = p @ vals  # [Bt, Hkv, G, d]
    return o.reshape(bt, hq, d), lse.reshape(bt, hq)


def attention_ref(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense decode attention of one sequence.

    q: [Hq, d]; keys, values: [T, Hkv, d] -> o [Hq, d], lse [Hq] (float32).
    """
    hq, d = q.shape
    hkv = keys.shape[1]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.float().reshape(hkv, g, d)
    logits = torch.einsum("hgd,thd->hgt", qg, keys.float()) * scale  # [Hkv, G, T]
    lse = torch.logsumexp(logits, dim=-1)
    o = torch.einsum("hgt,thd->hgd", torch.softmax(logits, dim=-1), values.float())
    return o.reshape(hq, d), lse.reshape(hq)


def merge_partials(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge n partial attentions over disjoint key sets by log-sum-exp.

    o: [n, ..., d]; lse: [n, ...] -> (o [..., d], lse [...]). Partials with lse = -inf (empty)
    contribute nothing; if all are empty the result is o = 0, lse = -inf.
    """
    total = torch.logsumexp(lse.float(), dim=0)  # [...]
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w = torch.exp(lse.float() - safe[None])  # [n, ...]
    # NOTE: an empty partial may hold anything in o (0/0 = NaN from a kernel); w = 0 must win.
    w = w[..., None]  # [n, ..., 1]
    contrib = torch.where(w > 0, w * o.float(), torch.zeros_like(o, dtype=torch.float32))
    return contrib.sum(dim=0), total


def paged_prefill_ref(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    base: int,
    num_kv_heads: int,
    length: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a sequence's last n tokens over its first `length` tokens, read from
    pages where they lie (a prefill chunk over its prefix).

    q: [n, Hq, d], query i at position length - n + i (it sees keys 0 .. length - n + i);
    pool: [S, 2, B, d]; locs: [>= ceil(length / B)] page locations: page p of the sequence, KV
    head h, is pool slot (base + locs[p]) * Hkv + h (workers/engine/kv_manager.py page_slots with
    base = layer * rows per layer). Returns o [n, Hq, d] and lse [n, Hq], float32.
    """
    n, hq, d = q.shape
    b, g = pool.shape[2], hq // num_kv_heads
    if not 1 <= n <= length:
        raise ValueError(f"q: queries n ({n}) must be in [1, length ({length})]")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    pages = -(-length // b)
    heads = torch.arange(num_kv_heads, device=locs.device)
    slots = (base + locs[:pages].long())[:, None] * num_kv_heads + heads  # [P, Hkv]
    kv = pool[slots].float().permute(2, 0, 3, 1, 4).reshape(2, pages * b, num_kv_heads, d)[:, :length]
    keys, vals = kv[0].repeat_interleave(g, dim=1), kv[1].repeat_interleave(g, dim=1)  # [L, Hq, d]
    logits = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale  # [Hq, n, L]
    query_pos = length - n + torch.arange(n, device=q.device)  # [n]
    seen = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]  # [n, L]
    logits = logits.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [Hq, n]
    o = torch.einsum("hnl,lhd->nhd", torch.softmax(logits, dim=-1), vals)
    return o, lse.transpose(0, 1)
