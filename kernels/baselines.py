"""Baseline page scorers for the quality tables, at matched summary bytes — torch only.

Every scorer keeps the contract of `score.score_pages_ref`: q: [Bt, Hq, d], a per-page table
with leading dims [num_page_ids, Hkv], page_table: [Bt, P] (-1 / entries past num_pages ignored),
num_pages: [Bt] -> page scores [Bt, Hkv, G, P] float32 in log-mass units (an estimate of the exact
page log-mass s_j(q) = logsumexp_i q.k_i / sqrt(d)), -inf at padding. So `group_scores` and
`select_pages` apply unchanged, and `metrics.lse_mae` compares every method on one scale.

Methods and their bytes per page (d = 128, B = 16; LOCKS r = 8, int4 basis, int8 coef/centroid
= 768 B payload, 818 B with fp16 scales):
  exact    the oracle, reads all keys: B * d * 2 = 4096 B (bf16 keys), no summary.
  quest    channel-wise min/max envelope in bf16: 2 * d * 2 = 512 B. The envelope's size is fixed
           by d, so Quest cannot be raised to 768 B without becoming another method; it runs at
           its native 512 B, i.e. with fewer bytes than LOCKS (the tables must say so).
  centroid page mean in bf16: d * 2 = 256 B (same reason: fixed size, fewer bytes than LOCKS).
  shared   per-sequence (ShadowKV-style) or global (Loki-style) basis W [d, rho]: each page stores
           int8 coefficients [B, rho] and an int8 centroid [d] (fp16 scales as LOCKS), the bf16
           basis is amortised over the pages that share it. rho is the largest rank whose
           amortised payload fits LOCKS's payload (`matched_rank`): 40 for a global basis,
           32 for a per-sequence bf16 basis over 64 pages. Matching is on payload; scales are
           close too (34 B against LOCKS's 50 B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from .score import exact_page_lse
from .select import select_pages
from .summary import LocksConfig, _symmetric_quant

# ----------------------------------------------------------------------------- shared plumbing


def _table_ids(page_table: torch.Tensor, num_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [Bt, P] int64 safe to index with, valid [Bt, P] bool)."""
    p = page_table.shape[1]
    valid = torch.arange(p, device=page_table.device)[None, :] < num_pages.to(page_table.device)[:, None]
    return torch.where(valid, page_table, torch.zeros_like(page_table)).long(), valid


def _group_queries(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """q: [Bt, Hq, d] -> [Bt, Hkv, G, d] float32 (query head h reads KV head h // G)."""
    bt, hq, d = q.shape
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    return q.float().reshape(bt, hkv, hq // hkv, d)


def _to_bhgp(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """scores: [Bt, P, Hkv, G] -> [Bt, Hkv, G, P] with -inf where valid [Bt, P] is False."""
    out = scores.float().permute(0, 2, 3, 1)
    return out.masked_fill(~valid[:, None, None, :], float("-inf"))


def _fields_index(obj, idx) -> dict:
    """Index every tensor field of a dataclass; other fields pass through."""
    out = {f.name: getattr(obj, f.name) for f in fields(obj)}
    return {k: (v[idx] if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def _per_page_bytes(t: torch.Tensor, lead_dims: int) -> int:
    return t.element_size() * math.prod(t.shape[lead_dims:])


# ----------------------------------------------------------------------------- exact oracle


def score_exact(
    q: torch.Tensor,
    keys: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    page_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The exact-LSE oracle (reads every key). keys: [num_page_ids, Hkv, B, d].

    page_lens: [Bt, P] valid tokens of each listed page (default: all B), so the oracle can also
    score the open partial page; a listed page with 0 valid tokens scores -inf.
    Returns [Bt, Hkv, G, P] float32, -inf at padding.
    """
    ids, valid = _table_ids(page_table, num_pages)
    qg = _group_queries(q, keys.shape[1])[:, None]  # [Bt, 1, Hkv, G, d]
    k = keys[ids]  # [Bt, P, Hkv, B, d]
    if page_lens is None:
        return _to_bhgp(exact_page_lse(qg, k), valid)
    logits = torch.einsum("xphgd,xphbd->xphgb", qg.expand(-1, k.shape[1], -1, -1, -1), k.float())
    logits = logits / math.sqrt(q.shape[-1])
    tok = torch.arange(k.shape[-2], device=q.device)
    live = tok[None, None, :] < page_lens.to(q.device)[..., None]  # [Bt, P, B]
    logits = logits.masked_fill(~live[:, :, None, None, :], float("-inf"))
    return _to_bhgp(torch.logsumexp(logits, dim=-1), valid)


def exact_bytes_per_page(page_size: int, d: int, element_size: int = 2) -> int:
    """Bytes the oracle reads per page: all B keys (bf16 by default)."""
    return page_size * d * element_size


# ----------------------------------------------------------------------------- Quest


@dataclass
class QuestSummaries:
    """Quest's channel envelope, rounded outward so the score stays an upper bound.

    lo, hi: [..., d] (bf16 by default): channel-wise min / max of the page's keys.
    """

    lo: torch.Tensor
    hi: torch.Tensor
    page_size: int

    def index(self, idx) -> QuestSummaries:
        return QuestSummaries(**_fields_index(self, idx))

    def payload_bytes_per_page(self) -> int:
        lead = self.lo.dim() - 1
        return _per_page_bytes(self.lo, lead) + _per_page_bytes(self.hi, lead)

    def bytes_per_page(self) -> int:
        return self.payload_bytes_per_page()  # no scales


def _round_outward(x: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """Cast x to dtype, stepping one ulp outward where rounding moved it inward."""
    r = x.to(dtype)
    if dtype == x.dtype:
        return r
    target = torch.full_like(r, float("-inf") if down else float("inf"))
    moved_in = r.float() > x if down else r.float() < x
    return torch.where(moved_in, torch.nextafter(r, target), r)


def build_quest(keys: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> QuestSummaries:
    """keys: [..., B, d] -> envelope lo, hi: [..., d] in dtype (outward-rounded)."""
    k = keys.float()
    lo = _round_outward(k.amin(dim=-2), dtype, down=True)
    hi = _round_outward(k.amax(dim=-2), dtype, down=False)
    return QuestSummaries(lo=lo, hi=hi, page_size=keys.shape[-2])


def quest_page_scores(q: torch.Tensor, s: QuestSummaries) -> torch.Tensor:
    """q: [..., G, d], envelope [..., d] -> [..., G]: sum_c max(q_c lo_c, q_c hi_c)/sqrt(d) + log B.

    An upper bound of the exact page log-mass: every logit <= the envelope bound, and a sum
    of B exponentials <= B times the largest.
    """
    qf = q.float()
    lo, hi = s.lo.float()[..., None, :], s.hi.float()[..., None, :]
    bound = torch.maximum(qf * lo, qf * hi).sum(dim=-1)
    return bound / math.sqrt(q.shape[-1]) + math.log(s.page_size)


def score_quest(
    q: torch.Tensor, quest: QuestSummaries, page_table: torch.Tensor, num_pages: torch.Tensor
) -> torch.Tensor:
    """Quest scores. quest: table with leading dims [num_page_ids, Hkv] -> [Bt, Hkv, G, P]."""
    ids, valid = _table_ids(page_table, num_pages)
    qg = _group_queries(q, quest.lo.shape[1])[:, None]  # [Bt, 1, Hkv, G, d]
    return _to_bhgp(quest_page_scores(qg, quest.index(ids)), valid)


# ----------------------------------------------------------------------------- page centroid


@dataclass
class CentroidSummaries:
    """The page mean. mu: [..., d] (bf16 by default)."""

    mu: torch.Tensor
    page_size: int

    def index(self, idx) -> CentroidSummaries:
        return CentroidSummaries(**_fields_index(self, idx))

    def payload_bytes_per_page(self) -> int:
        return _per_page_bytes(self.mu, self.mu.dim() - 1)

    def bytes_per_page(self) -> int:
        return self.payload_bytes_per_page()


def build_centroid(keys: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> CentroidSummaries:
    """keys: [..., B, d] -> mu: [..., d] in dtype."""
    return CentroidSummaries(mu=keys.float().mean(dim=-2).to(dtype), page_size=keys.shape[-2])


def score_centroid(
    q: torch.Tensor, cent: CentroidSummaries, page_table: torch.Tensor, num_pages: torch.Tensor
) -> torch.Tensor:
    """q.mu / sqrt(d) + log B (every key replaced by the mean). -> [Bt, Hkv, G, P]."""
    ids, valid = _table_ids(page_table, num_pages)
    qg = _group_queries(q, cent.mu.shape[1])[:, None]  # [Bt, 1, Hkv, G, d]
    mu = cent.index(ids).mu.float()[..., None, :]  # [Bt, P, Hkv, 1, d]
    scores = (qg * mu).sum(dim=-1) / math.sqrt(q.shape[-1]) + math.log(cent.page_size)
    return _to_bhgp(scores, valid)


# ----------------------------------------------------------------------------- shared bases


@dataclass
class SharedBasisSummaries:
    """Per-page part of a shared-basis summary (ShadowKV / Loki style).

    mu: [..., d] and coef: [..., B, rho] float32, already rounded through the stored formats
    (int8 with an fp16 scale per page / per key when the bits are 8). c_i = W^T (k_i - mu).
    The basis W lives outside the page table (per sequence or global) and is amortised.
    """

    mu: torch.Tensor
    coef: torch.Tensor
    coef_bits: int
    centroid_bits: int

    def index(self, idx) -> SharedBasisSummaries:
        return SharedBasisSummaries(**_fields_index(self, idx))

    def payload_bytes_per_page(self) -> int:
        b, rho = self.coef.shape[-2:]
        return (b * rho * self.coef_bits + self.mu.shape[-1] * self.centroid_bits) // 8

    def bytes_per_page(self) -> int:
        """Payload plus fp16 scales (one per key, one per page) where a part is int8."""
        scales = (self.coef.shape[-2] if self.coef_bits == 8 else 0) + (self.centroid_bits == 8)
        return self.payload_bytes_per_page() + 2 * scales


def _round_trip(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Quantise and dequantise exactly as LOCKS stores int8 parts (bf16 when bits = 16)."""
    if bits == 16:
        return x.bfloat16().float()
    if bits != 8:
        raise ValueError(f"bits ({bits}) must be 16 or 8")
    codes, scale = _symmetric_quant(x, bits, dim=dim)
    return codes.float() * scale.float().unsqueeze(dim)


def fit_basis(
    keys: torch.Tensor, rho: int, valid: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """PCA of within-page deviations. keys: [..., M, B, d], valid: [..., M] -> W [..., d, rho].

    The top-rho eigenvectors of sum_j D_j^T D_j over the valid pages: the rank-rho basis that
    minimises the total reconstruction error of the deviations a shared-basis scorer projects.
    """
    d = keys.shape[-1]
    if not 1 <= rho <= d:
        raise ValueError(f"rho ({rho}) must be in [1, d ({d})]")
    k = keys.float()
    dev = k - k.mean(dim=-2, keepdim=True)  # [..., M, B, d]
    if valid is not None:
        dev = dev * valid.to(dev.dtype)[..., None, None]
    cov = torch.einsum("...mbd,...mbe->...de", dev, dev).double()  # [..., d, d]
    _, vecs = torch.linalg.eigh(cov)
    return vecs.flip(-1)[..., :rho].to(dtype)


def fit_sequence_bases(
    keys: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor, rho: int
) -> torch.Tensor:
    """One basis per sequence and KV head (ShadowKV-style), from that sequence's listed pages.

    keys: [num_page_ids, Hkv, B, d] -> W [Bt, Hkv, d, rho] (bf16).
    """
    ids, valid = _table_ids(page_table, num_pages)
    k = keys[ids].transpose(1, 2)  # [Bt, Hkv, P, B, d]
    return fit_basis(k, rho, valid[:, None, :].expand(-1, k.shape[1], -1))


def fit_global_basis(calib_keys: torch.Tensor, rho: int) -> torch.Tensor:
    """One basis per KV head fitted once on calibration pages (Loki-style).

    calib_keys: [M, Hkv, B, d] -> W [Hkv, d, rho] (bf16).
    """
    return fit_basis(calib_keys.transpose(0, 1), rho)


def project_pages(
    keys: torch.Tensor, basis: torch.Tensor, coef_bits: int = 8, centroid_bits: int = 8
) -> SharedBasisSummaries:
    """keys: [..., B, d], basis: [..., d, rho] (broadcast over the page dims) -> per-page summaries."""
    k = keys.float()
    mu = k.mean(dim=-2)  # [..., d]
    coef = (k - mu[..., None, :]) @ basis.float()  # [..., B, rho]
    return SharedBasisSummaries(
        mu=_round_trip(mu, centroid_bits, dim=-1),
        coef=_round_trip(coef, coef_bits, dim=-1),
        coef_bits=coef_bits,
        centroid_bits=centroid_bits,
    )


def build_sequence_basis_table(
    keys: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor, rho: int
) -> tuple[torch.Tensor, SharedBasisSummaries]:
    """Fit each sequence's basis and project every listed page with it.

    keys: [num_page_ids, Hkv, B, d] -> (W [Bt, Hkv, d, rho], table with leading dims
    [num_page_ids, Hkv]). A page id must belong to one sequence; unlisted ids get zeros.
    """
    bases = fit_sequence_bases(keys, page_table, num_pages, rho)
    ids, valid = _table_ids(page_table, num_pages)
    listed = project_pages(keys[ids], bases[:, None])  # leading [Bt, P, Hkv]
    n, hkv, b, d = keys.shape
    mu = keys.new_zeros(n, hkv, d, dtype=torch.float32)
    coef = keys.new_zeros(n, hkv, b, rho, dtype=torch.float32)
    mu[ids[valid]] = listed.mu[valid]
    coef[ids[valid]] = listed.coef[valid]
    return bases, SharedBasisSummaries(mu, coef, listed.coef_bits, listed.centroid_bits)


def score_shared_basis(
    q: torch.Tensor,
    table: SharedBasisSummaries,
    basis: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
) -> torch.Tensor:
    """logsumexp_i (q.mu + (W^T q).c_i) / sqrt(d) — Eq. 4 with a shared W in place of V_j.

    basis: [Bt, Hkv, d, rho] (per sequence) or [Hkv, d, rho] (global). -> [Bt, Hkv, G, P].
    """
    ids, valid = _table_ids(page_table, num_pages)
    qg = _group_queries(q, table.mu.shape[1])  # [Bt, Hkv, G, d]
    w = basis.float()
    if w.dim() == 3:  # global: one basis per KV head for every sequence
        w = w.expand(qg.shape[0], -1, -1, -1)
    proj = torch.einsum("xhgd,xhdr->xhgr", qg, w)  # [Bt, Hkv, G, rho]
    s = table.index(ids)  # mu [Bt, P, Hkv, d], coef [Bt, P, Hkv, B, rho]
    centre = torch.einsum("xhgd,xphd->xphg", qg, s.mu)
    dev = torch.einsum("xhgr,xphbr->xphgb", proj, s.coef)
    logits = (centre[..., None] + dev) / math.sqrt(q.shape[-1])
    return _to_bhgp(torch.logsumexp(logits, dim=-1), valid)


# ----------------------------------------------------------------------------- byte matching


def locks_payload_bytes(d: int, cfg: LocksConfig) -> int:
    """LOCKS summary payload per page: basis [d, r], coefficients [B, r], centroid [d]."""
    bits = d * cfg.rank * cfg.basis_bits + cfg.page_size * cfg.rank * cfg.coef_bits
    return (bits + d * cfg.centroid_bits) // 8


def shared_basis_payload_bytes(
    d: int, page_size: int, rho: int, pages_per_basis: float = math.inf, basis_bytes: int = 2
) -> float:
    """Amortised payload per page of a shared-basis summary (int8 coef and centroid)."""
    return page_size * rho + d + d * rho * basis_bytes / pages_per_basis


def matched_rank(d: int, page_size: int, budget_bytes: float, pages_per_basis: float = math.inf) -> int:
    """Largest rho (<= d) whose amortised shared-basis payload fits budget_bytes."""
    cost = lambda r: shared_basis_payload_bytes(d, page_size, r, pages_per_basis)
    fits = [r for r in range(1, d + 1) if cost(r) <= budget_bytes]
    if not fits:
        raise ValueError(f"budget_bytes ({budget_bytes}) is below a rank-1 shared-basis summary")
    return fits[-1]


def matched_bytes_report(d: int, cfg: LocksConfig, pages_per_sequence: int) -> dict[str, dict]:
    """Bytes per page (payload) of every method at the sizes used for the quality tables."""
    budget = locks_payload_bytes(d, cfg)
    rho_seq = matched_rank(d, cfg.page_size, budget, pages_per_sequence)
    rho_glob = matched_rank(d, cfg.page_size, budget)
    return {
        "locks": {"bytes": budget, "rank": cfg.rank},
        "exact": {"bytes": exact_bytes_per_page(cfg.page_size, d)},
        "quest": {"bytes": 2 * d * 2},
        "centroid": {"bytes": d * 2},
        "shared_sequence": {
            "bytes": shared_basis_payload_bytes(d, cfg.page_size, rho_seq, pages_per_sequence),
            "rank": rho_seq,
        },
        "shared_global": {"bytes": shared_basis_payload_bytes(d, cfg.page_size, rho_glob), "rank": rho_glob},
    }


# ----------------------------------------------------------------------------- per-head oracle


def select_pages_per_head(
    s: torch.Tensor, num_pages: torch.Tensor, k: int, sink_pages: int = 1, recent_pages: int = 2
) -> torch.Tensor:
    """Each query head its own top-k (the ablation's upper reference; not a shared set).

    s: [Bt, Hkv, G, P] page scores -> sel [Bt, Hkv, G, k] (same conventions as select_pages).
    Ranking a head's own softmax shares equals ranking its scores, so s is used directly.
    """
    bt, hkv, g, p = s.shape
    sel = select_pages(s.reshape(bt, hkv * g, p), num_pages, k, sink_pages, recent_pages)
    return sel.reshape(bt, hkv, g, k)
