"""Page selection (Algorithm 2, lines 1 and 11-12): sink + recent pages always, top by group score.

Runs on the device with no host synchronisation: forced pages get +inf, padding -inf,
and one topk over the padded row picks the whole budget at once.
"""

from __future__ import annotations

import math

import torch


def budget_pages(budget_tokens: int, page_size: int) -> int:
    """Token budget -> page budget k (rounded up: the budget is a floor on attended tokens)."""
    if budget_tokens <= 0:
        raise ValueError(f"budget_tokens ({budget_tokens}) must be > 0")
    return math.ceil(budget_tokens / page_size)


def select_pages(
    scores: torch.Tensor,
    num_pages: torch.Tensor,
    k: int,
    sink_pages: int = 1,
    recent_pages: int = 2,
) -> torch.Tensor:
    """Choose k pages per (sequence, KV head).

    scores: [Bt, Hkv, P] float group scores (m_bar) for page positions 0..P-1; entries of
            forced or absent pages are ignored. P must be >= max(num_pages).
    num_pages: [Bt] int — all pages of each sequence, the open partial page included.
    Returns sel: [Bt, Hkv, k] int64 page indices, ascending, -1 padding. A sequence with
    <= k pages selects all of them (dense). Otherwise pages [0, sink_pages) and the last
    recent_pages pages are always selected (NOTE: the last page is usually the open partial
    page, which has no summary; the page before it is the last full page) and the remaining
    k - sink_pages - recent_pages slots go to the highest scores among the pages between.
    """
    bt, hkv, p = scores.shape
    if k < sink_pages + recent_pages + 1:
        raise ValueError(
            f"page budget k ({k}) must be > sink_pages ({sink_pages}) + recent_pages ({recent_pages})"
        )
    k_eff = min(k, p)
    pos = torch.arange(p, device=scores.device)[None, None, :]  # [1, 1, P]
    n = num_pages.to(scores.device).long()[:, None, None]  # [Bt, 1, 1]
    forced = (pos < sink_pages) | (pos >= n - recent_pages)
    key = torch.where(forced, torch.full_like(scores, float("inf")), scores.float())
    key = torch.where(torch.isnan(key), torch.zeros_like(key), key)
    # Valid candidates must outrank padding even when their score is -inf.
    key = torch.where(pos < n, key.clamp_min(torch.finfo(torch.float32).min), torch.full_like(key, -math.inf))
    top = torch.topk(key, k_eff, dim=-1)
    chosen = torch.isfinite(top.values) | (top.values > 0)  # forced (+inf) or a real page
    sel = torch.where(chosen, top.indices, torch.full_like(top.indices, -1))
    sel = torch.where(sel >= 0, sel, torch.full_like(sel, p + 1)).sort(dim=-1).values
    sel = torch.where(sel > p, torch.full_like(sel, -1), sel)
    if k_eff < k:
        sel = torch.cat([sel, sel.new_full((bt, hkv, k - k_eff), -1)], dim=-1)
    return sel
