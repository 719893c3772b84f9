"""LOCKS scoring (Eq. 4) and the GQA group rules (Eq. 5) — the torch reference.

Batches are padded: a sequence's full pages are listed in a page table row
`page_table: [Bt, P]` (page ids into the layer's summary table, -1 = padding),
and the number of scored pages per row is `num_pages: [Bt]`.
Query heads are grouped: query head h reads KV head h // G (Hq = Hkv * G).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .summary import PageSummaries, QuantSummaries, basis_d_order_on

GROUP_RULES = ("share_average", "group_max", "group_mass")


def page_logits(q: torch.Tensor, s: PageSummaries) -> torch.Tensor:
    """Reconstructed per-token logits of each page. q: [..., G, d], s: [..., *] -> [..., G, B].

    q's leading dims broadcast against the summaries' page dims; the group dim G sits in front
    of d. logit_i = (q.mu + (V^T q).c_i) / sqrt(d).
    """
    d = q.shape[-1]
    proj = torch.einsum("...gd,...dr->...gr", q.float(), s.basis)  # [..., G, r]
    centre = torch.einsum("...gd,...d->...g", q.float(), s.mu)  # [..., G]
    dev = torch.einsum("...gr,...br->...gb", proj, s.coef)  # [..., G, B]
    return (centre[..., None] + dev) / math.sqrt(d)


def _table_rows(q: torch.Tensor, hkv: int, page_table: torch.Tensor, num_pages: torch.Tensor):
    """(G, valid [Bt, P] bool, ids [Bt, P] int64) of a scoring call: the query heads per KV head
    (a ValueError unless Hq is a multiple of Hkv), which table entries count, and the page ids
    with padding pointed at page 0 (read, then masked)."""
    hq = q.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    valid = torch.arange(page_table.shape[1], device=q.device)[None, :] < num_pages[:, None]  # [Bt, P]
    ids = torch.where(valid, page_table, torch.zeros_like(page_table)).long()
    return hq // hkv, valid, ids


def score_pages_ref(
    q: torch.Tensor, summaries: PageSummaries, page_table: torch.Tensor, num_pages: torch.Tensor
) -> torch.Tensor:
    """Eq. 4 for every page of every sequence, from summaries alone.

    q: [Bt, Hq, d]; summaries: table with leading dims [num_page_ids, Hkv];
    page_table: [Bt, P] int (page ids; entries at or past num_pages[b] are ignored);
    num_pages: [Bt]. Returns s_hat: [Bt, Hkv, G, P] float32, -inf at padding.
    """
    bt, hq, d = q.shape
    g, valid, ids = _table_rows(q, summaries.mu.shape[1], page_table, num_pages)
    hkv = hq // g
    s = summaries.index(ids)  # leading dims [Bt, P, Hkv]
    qg = q.reshape(bt, 1, hkv, g, d)  # broadcast over P
    logits = page_logits(qg, s)  # [Bt, P, Hkv, G, B]
    s_hat = torch.logsumexp(logits, dim=-1).permute(0, 2, 3, 1)  # [Bt, Hkv, G, P]
    return s_hat.masked_fill(~valid[:, None, None, :], float("-inf"))


def score_quantized_torch(
    q: torch.Tensor, qs: QuantSummaries, page_table: torch.Tensor, num_pages: torch.Tensor
) -> torch.Tensor:
    """score_pages_ref(q, dequantize_summaries(qs), page_table, num_pages) in torch without
    dequantising the table: the CPU path. Same arguments and result (float32 rounding aside).

    Only the pages the table names are read (O(Bt P), not O(N)); the basis stays in its storage
    order (q is permuted instead: q.v = q[order].v[order]) and every product is a batched matmul
    over contiguous operands, with no einsum permutation copying the basis.
    """
    bt, hq, d = q.shape
    g, valid, ids = _table_rows(q, qs.mu_q.shape[1], page_table, num_pages)
    hkv, p = hq // g, page_table.shape[1]
    s = qs.index(ids.reshape(-1))  # leading dims [Bt P, Hkv]
    # Codes unscaled: a basis column's scale multiplies its projection, a coefficient row's scale
    # its logit, after the products (a few elements each instead of the whole basis).
    rows = s.basis_codes().float()  # [Bt P, Hkv, r, d], storage order along d
    coef = s.coef_q.float()  # [Bt P, Hkv, B, r]
    mu = s.mu_q.float() * s.mu_scale.float()[..., None]  # [Bt P, Hkv, d]
    qf = q.float()
    qo = qf[..., basis_d_order_on(d, s.basis_bits, q.device)]  # q in the basis's storage order

    def per_page(x: torch.Tensor) -> torch.Tensor:  # [Bt, Hq, d] -> [Bt P, Hkv, G, d]
        return x.reshape(bt, 1, hkv, g, d).expand(bt, p, hkv, g, d).reshape(bt * p, hkv, g, d)

    qd, qo = per_page(qf), per_page(qo)
    proj = torch.matmul(qo, rows.transpose(-1, -2)) * s.basis_scale.float()[..., None, :]  # [Bt P, Hkv, G, r]
    centre = torch.matmul(qd, mu[..., None])  # [Bt P, Hkv, G, 1]
    dev = torch.matmul(proj, coef.transpose(-1, -2)) * s.coef_scale.float()[..., None, :]  # [Bt P, Hkv, G, B]
    logits = (centre + dev) / math.sqrt(d)
    s_hat = torch.logsumexp(logits, dim=-1).reshape(bt, p, hkv, g).permute(0, 2, 3, 1)  # [Bt, Hkv, G, P]
    return s_hat.masked_fill(~valid[:, None, None, :], float("-inf"))


def exact_page_lse(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The exact page log-mass s_j(q) = logsumexp_i(q.k_i / sqrt(d)) (the oracle).

    q: [..., G, d]; keys: [..., B, d] -> [..., G].
    """
    logits = torch.einsum("...gd,...bd->...gb", q.float(), keys.float()) / math.sqrt(q.shape[-1])
    return torch.logsumexp(logits, dim=-1)


def group_scores(s_hat: torch.Tensor, rule: str = "share_average") -> torch.Tensor:
    """Combine the G query heads of a group into one page score. s_hat: [..., G, P] -> [..., P].

    share_average (Eq. 5): m_bar_j = mean_g softmax_j(s_hat_gj) — the shipped rule.
    group_max: max_g softmax_j(s_hat_gj). group_mass: softmax_j(logsumexp_g s_hat_gj).
    -inf entries (padding) get mass 0. A row with no valid page gives zeros.
    """
    if rule not in GROUP_RULES:
        raise ValueError(f"group rule ({rule!r}) must be one of {GROUP_RULES}")
    if rule == "group_mass":
        return _safe_softmax(torch.logsumexp(s_hat, dim=-2))
    m = _safe_softmax(s_hat)  # [..., G, P]
    return m.mean(dim=-2) if rule == "share_average" else m.amax(dim=-2)


def _safe_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim that maps an all -inf row to zeros instead of NaN."""
    top = x.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(x - top)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-30)


def group_stats_ref(s_hat: torch.Tensor) -> torch.Tensor:
    """The softmax normaliser of each query head over pages, as (max, sum of exp(s - max)).

    s_hat: [..., G, P] (-inf = padding) -> stats [..., G, 2] float32 (max -inf and sum 0 for a
    row without a finite score). Eq. 5 needs only these two numbers per head besides the scores,
    so pages split across devices can be normalised together by merging them (log-sum-exp).
    """
    top = s_hat.float().amax(dim=-1)  # [..., G]
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp(s_hat.float() - safe[..., None]).sum(dim=-1)
    return torch.stack([top, total], dim=-1)


def share_average_from_stats(s_hat: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Eq. 5 given the normalisers: m_bar = mean_g exp(s_hat_g - max_g) / sum_g. s_hat: [..., G, P];
    stats: [..., G, 2] (group_stats_ref) -> [..., P] float32; zeros where a head has no score."""
    top, total = stats[..., 0], stats[..., 1]
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    m = torch.exp(s_hat.float() - safe[..., None]) / total.clamp_min(1e-30)[..., None]
    return m.mean(dim=-2)


@dataclass(frozen=True)
class PageScores:
    """What the selection reads: s_hat [Bt, Hkv, G, P] (Eq. 4) and each head's softmax normaliser
    over the pages, stats [Bt, Hkv, G, 2] (group_stats_ref); m_bar (Eq. 5) follows from the two."""

    s_hat: torch.Tensor
    stats: torch.Tensor

    def share_average(self) -> torch.Tensor:
        return share_average_from_stats(self.s_hat, self.stats)

    @classmethod
    def from_group_scores(cls, m_bar: torch.Tensor) -> PageScores:
        """Scores whose share-average is exactly m_bar: [Bt, Hkv, P] group scores of any rule
        (group_scores) become one head, s_hat = log m_bar [Bt, Hkv, 1, P], with the normaliser
        (max 0, sum 1). So the selection, which ranks share-averages, ranks m_bar itself; a page
        with m_bar 0 (padding) gets log 0 = -inf and mass exp(-inf) = 0 again."""
        s_hat = torch.log(m_bar.float())[..., None, :]
        stats = torch.zeros((*s_hat.shape[:-1], 2), dtype=torch.float32, device=m_bar.device)
        stats[..., 1] = 1.0
        return cls(s_hat, stats)
