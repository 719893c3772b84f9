"""Quality metrics for page selectors — torch only, no scipy.

Conventions follow `score.py`: exact page log-masses s: [Bt, Hkv, G, P] (from
`baselines.score_exact`, -inf at padding), a shared selection sel: [Bt, Hkv, k] or a per-head
one [Bt, Hkv, G, k] (page indices, -1 padding, as `select_pages` returns).
"""

from __future__ import annotations

import math

import torch
from lockserve.kernels.score import _safe_softmax


def head_coverage(s_exact: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """gamma_S(q_g): fraction of each query head's exact softmax mass inside the selected pages.

    s_exact: [Bt, Hkv, G, P]; sel: [Bt, Hkv, k] (shared by the group) or [Bt, Hkv, G, k].
    Returns [Bt, Hkv, G] float32 in [0, 1] (0 for a head with no valid page).
    """
    share = _safe_softmax(s_exact.float())  # [Bt, Hkv, G, P]
    if sel.dim() == 3:
        sel = sel[:, :, None, :].expand(-1, -1, share.shape[2], -1)
    if sel.shape[:3] != share.shape[:3]:
        raise ValueError(f"sel shape {tuple(sel.shape)} does not match s_exact {tuple(s_exact.shape)}")
    p = share.shape[-1]
    if (sel >= p).any():
        raise ValueError(f"sel holds page index {int(sel.max())} >= P ({p})")
    # -1 padding lands in an extra column that is dropped.
    idx = torch.where(sel >= 0, sel, torch.full_like(sel, p)).long()
    taken = share.new_zeros(*share.shape[:-1], p + 1, dtype=torch.bool).scatter_(-1, idx, True)
    return (share * taken[..., :p]).sum(dim=-1)


def captured_mass(s_exact: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-average and worst-head coverage. -> (mean [Bt, Hkv], worst [Bt, Hkv])."""
    cov = head_coverage(s_exact, sel)
    return cov.mean(dim=-1), cov.amin(dim=-1)


def carrier_retained(sel: torch.Tensor, carrier: torch.Tensor) -> torch.Tensor:
    """Is the carrier page (the one holding the needle) selected?

    sel: [..., k] page indices (-1 padding); carrier: int page index broadcastable to sel[..., 0]
    (e.g. [Bt, 1] for sel [Bt, Hkv, k]). Returns bool [...].
    """
    carrier = torch.as_tensor(carrier, device=sel.device)
    if (carrier < 0).any():
        raise ValueError(f"carrier page indices must be >= 0, got min {int(carrier.min())}")
    return (sel == carrier[..., None]).any(dim=-1)


def exact_logits(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per-token exact logits q.k_i / sqrt(d). q: [..., G, d], keys: [..., B, d] -> [..., G, B]."""
    return torch.einsum("...gd,...bd->...gb", q.float(), keys.float()) / math.sqrt(q.shape[-1])


def _finite_mae(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    if approx.shape != exact.shape:
        raise ValueError(f"approx shape {tuple(approx.shape)} != exact shape {tuple(exact.shape)}")
    live = torch.isfinite(exact)
    err = (approx.float() - exact.float()).abs()
    return torch.where(live, err, torch.zeros_like(err)).sum() / live.sum().clamp_min(1)


def logit_mae(approx: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Mean |reconstructed - exact| per-token logit over entries where exact is finite. -> scalar."""
    return _finite_mae(approx, exact)


def lse_mae(s_hat: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Mean |s_hat - s| page log-mass error over valid pages (s finite). -> scalar."""
    return _finite_mae(s_hat, s)


def rank_average(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n along the last dim, ties get the average of their ranks. x: [..., n] -> float.

    NaN entries rank after everything and never tie (each NaN is its own group).
    """
    n = x.shape[-1]
    vals, order = torch.sort(x.float(), dim=-1)  # NaN sorts last
    idx = torch.arange(n, device=x.device).expand_as(vals)
    starts = torch.ones_like(vals, dtype=torch.bool)
    starts[..., 1:] = vals[..., 1:] != vals[..., :-1]
    ends = torch.ones_like(starts)
    ends[..., :-1] = starts[..., 1:]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    last = torch.where(ends, idx, torch.full_like(idx, n)).flip(-1).cummin(dim=-1).values.flip(-1)
    avg = (first + last).double() / 2 + 1
    return torch.empty_like(avg).scatter_(-1, order, avg)


def spearman(x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Spearman rank correlation along the last dim (Pearson of tie-averaged ranks).

    x, y: [..., n]; valid: [..., n] bool (default: both finite). Only valid entries are ranked.
    Returns [...] float32; NaN where fewer than 2 valid entries or either side is constant.
    """
    if x.shape != y.shape:
        raise ValueError(f"x shape {tuple(x.shape)} != y shape {tuple(y.shape)}")
    if valid is None:
        valid = torch.isfinite(x) & torch.isfinite(y)
    nan = torch.full_like(x, float("nan"), dtype=torch.float32)
    rx = rank_average(torch.where(valid, x.float(), nan))  # invalid entries rank last, unused
    ry = rank_average(torch.where(valid, y.float(), nan))
    w = valid.double()
    cnt = w.sum(dim=-1, keepdim=True)
    dx = (rx - (rx * w).sum(-1, keepdim=True) / cnt) * w
    dy = (ry - (ry * w).sum(-1, keepdim=True) / cnt) * w
    num = (dx * dy).sum(-1)
    den = ((dx * dx).sum(-1) * (dy * dy).sum(-1)).sqrt()
    out = num / den
    return torch.where((cnt.squeeze(-1) >= 2) & (den > 0), out, torch.full_like(out, float("nan"))).float()


def summary_bytes_per_page(summaries) -> dict[str, int]:
    """Bytes per page of a summary table: {'payload': ..., 'total': ... (with scales)}.

    Works for LOCKS `QuantSummaries` and the baselines' summary classes (all expose
    payload_bytes_per_page() and bytes_per_page()).
    """
    return {"payload": int(summaries.payload_bytes_per_page()), "total": int(summaries.bytes_per_page())}
