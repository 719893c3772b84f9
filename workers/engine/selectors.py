"""Page selectors: what scores a decode layer's full pages, behind one interface.

A selector does two things:
(a) at commit, builds its per-page table from the post-RoPE keys of every page that filled:
    the KV manager calls `selector.table.store(pids, keys, owners)` (`kv.summaries` *is* that
    table; LOCKS's is the `SummaryTable` the engine always had);
(b) every decode step, scores one layer's full pages into a `PageScores`, so that the selection
    (sink and recent pages forced, the rest by share-averaged score, ties to the lower position),
    the tier reads and the attention run unchanged for every selector.

`cache.attention` names the selector (configs.schema.ATTENTION_MODES). Bytes per page are per
(layer, KV head) page of B = 16 tokens, summary payload / with scales (`selector.bytes()`):

| attention       | table per page                                     | d = 64          | d = 128         |
| --------------- | -------------------------------------------------- | --------------- | --------------- |
| locks           | rank-8 basis int4, coef + centroid int8 (Eq. 4)    | 448 / 498       | 768 / 818       |
| oracle          | every key (exact LSE; no summary: it reads the KV) | 2048 (bf16)     | 4096 (bf16)     |
| quest           | channel min / max envelope, bf16                   | 256             | 512             |
| centroid        | page mean, bf16                                    | 128             | 256             |
| shared_sequence | int8 coef on a per-sequence basis + int8 centroid  | 438, r 23 / 512 | 768, r 32 / 64  |
| shared_global   | int8 coef on one global basis + int8 centroid      | 448, r 24       | 768, r 40       |

(shared_sequence: rank r over a sequence of that many pages; its rank grows with the sequence.)

The shared bases' rank is the largest whose payload, with the bf16 basis amortised over the
pages that share it (a sequence of max_model_len tokens, or all pages), fits LOCKS's payload
(kernels.baselines.matched_rank); Quest and the centroid have a size fixed by d and run with
fewer bytes than LOCKS. The oracle reads every key of every page at every step: its "table" is
a copy of the keys (half the KV), and its cost is that of dense attention plus a selection; it
is the exact-LSE reference of the evaluation, not a way to save bytes.

When the bases are fitted: shared_sequence fits a sequence's basis on the pages of its first
commit (the first prefill chunk, or all of the prompt when a prompt's KV is filled at once) and
projects its later pages onto it; shared_global fits one basis per (layer, KV head) on the first
pages stored in the engine (its calibration) and keeps it. `group_rule` (cache.group_rule)
replaces Eq. 5's share-average by group_max or group_mass through `PageScores.from_group_scores`.

Only `locks` with the share-average is on the decode hot path: PagedAttention scores it from
`kv.summaries` itself (the CUDA / Triton kernels on a GPU) and is given no selector
(`builtin`). The others run torch reference code (kernels/baselines.py) on any device, are not
validated under CUDA-graph capture, and say why in `graph_blocker` (the runner then runs
their decode steps eagerly).
"""

from __future__ import annotations

import abc
import math

import torch
from lockserve.configs.schema import CacheConfig
from lockserve.kernels import LocksConfig, ops
from lockserve.kernels import baselines as bl
from lockserve.kernels.score import PageScores, group_scores, group_stats_ref

from .kv_manager import KVLayout, SummaryTable

# Basis bits the Triton score kernel reads (kernels/triton/score.py); a bf16 basis is scored by
# the torch reference on every device.
KERNEL_BASIS_BITS = (2, 4, 8)
EVAL_ONLY = "an evaluation selector (torch reference ops), not validated under CUDA-graph capture"


def finish_scores(s_hat: torch.Tensor, rule: str) -> PageScores:
    """s_hat [Bt, Hkv, G, P] (log-mass units, -inf padding) -> what the selection reads under a
    group rule: the scores and their normalisers for the share-average, else the rule's group
    scores as one head whose share-average equals them (PageScores.from_group_scores)."""
    if rule == "share_average":  # contiguous: the Triton selection kernels read them so on a GPU
        s_hat = s_hat.contiguous()
        return PageScores(s_hat, group_stats_ref(s_hat))
    return PageScores.from_group_scores(group_scores(s_hat, rule).contiguous())


class PageTable(abc.ABC):
    """Per-page data of a selector, one entry per (layer, page id, KV head).

    store(pids [M] int64, keys [L, M, Hkv, B, d] post-RoPE, owners [M] int64 or None): the pages
    pids filled; owners[i] is the first page id of page i's sequence (the per-sequence basis
    needs it; None: all pages belong to the sequence whose first page is pids[0]).
    """

    bytes_per_page: int  # with scales, per (layer, KV head) page

    @abc.abstractmethod
    def store(self, pids: torch.Tensor, keys: torch.Tensor, owners: torch.Tensor | None = None) -> None: ...


class PageSelector(abc.ABC):
    """One way to score pages (see the module docstring).

    table: what the KV manager stores into at commit (kv.summaries); builtin: PagedAttention's own
    LOCKS path computes exactly these scores (the engine then gives it no selector); graph_blocker:
    None when the decode step may be captured in a CUDA graph, else the reason it may not.
    """

    name: str
    table: PageTable
    builtin = False
    graph_blocker: str | None = EVAL_ONLY

    def __init__(self, cfg: CacheConfig, layout: KVLayout):
        self.cfg, self.layout = cfg, layout
        self.rule = cfg.group_rule

    @abc.abstractmethod
    def scores(self, layer: int, q: torch.Tensor, page_table: torch.Tensor, num_pages: torch.Tensor,
               backend: str = "torch") -> PageScores:
        """Scores of one decode layer's full pages. q: [Bt, Hq, d]; page_table: [Bt, P] page ids
        (entries at or past num_pages ignored); num_pages: [Bt] full pages per row; backend: the
        kernels.ops backend PagedAttention uses. Returns PageScores with s_hat [Bt, Hkv, G', P]
        (G' = G, or 1 under group_max / group_mass), -inf at padding."""

    @abc.abstractmethod
    def bytes(self) -> dict[str, float]:
        """Summary bytes per (layer, KV head) page: {"payload": ..., "total": ... (with scales)}."""


# ----------------------------------------------------------------------------- LOCKS


class LocksSelector(PageSelector):
    """LOCKS (Eq. 4) from the quantised summary table; any rank, basis bits and group rule."""

    name = "locks"

    def __init__(self, cfg: CacheConfig, layout: KVLayout, device: torch.device):
        super().__init__(cfg, layout)
        self.locks = LocksConfig(page_size=cfg.page_size, rank=cfg.rank, basis_bits=cfg.basis_bits,
                                 eigh=cfg.summary_eigh)
        self.table = SummaryTable(layout, self.locks, device)
        self.kernel_format = cfg.basis_bits in KERNEL_BASIS_BITS
        self.builtin = self.rule == "share_average" and self.kernel_format
        self.graph_blocker = None if self.builtin else (
            f"LOCKS with group_rule {self.rule!r} and basis_bits {cfg.basis_bits}: {EVAL_ONLY}")

    def scores(self, layer, q, page_table, num_pages, backend="torch"):
        if not self.kernel_format:
            backend = "torch"  # the Triton kernel reads 2, 4 or 8-bit bases only
        s = ops.score_stats(q, self.table.layers[layer], page_table, num_pages, backend=backend)
        return s if self.rule == "share_average" else finish_scores(s.s_hat, self.rule)

    def bytes(self):
        return {"payload": bl.locks_payload_bytes(self.layout.head_dim, self.locks),
                "total": self.table.bytes_per_page}


# ----------------------------------------------------------------------------- oracle


class KeyTable(PageTable):
    """Every key of every page, in the KV dtype: keys [L, max_pages, Hkv, B, d]."""

    def __init__(self, layout: KVLayout, device: torch.device):
        shape = (layout.num_layers, layout.max_pages, layout.num_kv_heads, layout.page_size, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.bytes_per_page = layout.page_size * layout.head_dim * layout.dtype.itemsize

    def store(self, pids, keys, owners=None):
        self.keys[:, pids] = keys.to(self.keys.dtype)


class OracleSelector(PageSelector):
    """The exact page log-mass s_j(q) = logsumexp_i q.k_i / sqrt(d) from every key (the exact-LSE
    oracle); the shared selection of Eq. 5 on exact masses."""

    name = "oracle"

    def __init__(self, cfg: CacheConfig, layout: KVLayout, device: torch.device):
        super().__init__(cfg, layout)
        self.table = KeyTable(layout, device)

    def scores(self, layer, q, page_table, num_pages, backend="torch"):
        return finish_scores(bl.score_exact(q, self.table.keys[layer], page_table, num_pages), self.rule)

    def bytes(self):
        b, d = self.layout.page_size, self.layout.head_dim
        return {"payload": bl.exact_bytes_per_page(b, d), "total": bl.exact_bytes_per_page(b, d)}


# ----------------------------------------------------------------------------- Quest, centroid


class EnvelopeTable(PageTable):
    """Quest's channel envelope (outward-rounded bf16): lo, hi [L, max_pages, Hkv, d]."""

    def __init__(self, layout: KVLayout, device: torch.device):
        shape = (layout.num_layers, layout.max_pages, layout.num_kv_heads, layout.head_dim)
        self.lo = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.hi = torch.zeros_like(self.lo)
        self.page_size = layout.page_size
        self.bytes_per_page = 2 * layout.head_dim * 2

    def store(self, pids, keys, owners=None):
        env = bl.build_quest(keys)
        self.lo[:, pids], self.hi[:, pids] = env.lo, env.hi

    def layer(self, layer: int) -> bl.QuestSummaries:
        return bl.QuestSummaries(self.lo[layer], self.hi[layer], self.page_size)


class QuestSelector(PageSelector):
    """Quest: the envelope's upper bound of each page's log-mass."""

    name = "quest"

    def __init__(self, cfg: CacheConfig, layout: KVLayout, device: torch.device):
        super().__init__(cfg, layout)
        self.table = EnvelopeTable(layout, device)

    def scores(self, layer, q, page_table, num_pages, backend="torch"):
        return finish_scores(bl.score_quest(q, self.table.layer(layer), page_table, num_pages), self.rule)

    def bytes(self):
        return {"payload": self.table.bytes_per_page, "total": self.table.bytes_per_page}


class CentroidTable(PageTable):
    """The page mean in bf16: mu [L, max_pages, Hkv, d]."""

    def __init__(self, layout: KVLayout, device: torch.device):
        shape = (layout.num_layers, layout.max_pages, layout.num_kv_heads, layout.head_dim)
        self.mu = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        self.page_size = layout.page_size
        self.bytes_per_page = layout.head_dim * 2

    def store(self, pids, keys, owners=None):
        self.mu[:, pids] = bl.build_centroid(keys).mu

    def layer(self, layer: int) -> bl.CentroidSummaries:
        return bl.CentroidSummaries(self.mu[layer], self.page_size)


class CentroidSelector(PageSelector):
    """Every key replaced by the page mean: q.mu / sqrt(d) + log B."""

    name = "centroid"

    def __init__(self, cfg: CacheConfig, layout: KVLayout, device: torch.device):
        super().__init__(cfg, layout)
        self.table = CentroidTable(layout, device)

    def scores(self, layer, q, page_table, num_pages, backend="torch"):
        return finish_scores(bl.score_centroid(q, self.table.layer(layer), page_table, num_pages), self.rule)

    def bytes(self):
        return {"payload": self.table.bytes_per_page, "total": self.table.bytes_per_page}


# ----------------------------------------------------------------------------- shared bases


class SharedBasisTable(PageTable):
    """Per-page centroid and coefficients on a shared basis W, rounded through int8 as stored
    (kernels.baselines.project_pages; kept as float32 here, counted at their stored size):
    mu [L, max_pages, Hkv, d], coef [L, max_pages, Hkv, B, rho]. per_sequence: one W per sequence
    (fitted on its first commit), else one W per (layer, KV head) fitted on the first pages stored.
    """

    def __init__(self, layout: KVLayout, device: torch.device, rank: int, per_sequence: bool):
        if not 1 <= rank <= layout.head_dim:
            raise ValueError(f"shared_rank ({rank}) must be in [1, head_dim ({layout.head_dim})]")
        lead = (layout.num_layers, layout.max_pages, layout.num_kv_heads)
        self.mu = torch.zeros((*lead, layout.head_dim), dtype=torch.float32, device=device)
        self.coef = torch.zeros((*lead, layout.page_size, rank), dtype=torch.float32, device=device)
        self.rank, self.per_sequence = rank, per_sequence
        self.bases: dict[int, torch.Tensor] = {}  # owner page id (-1: global) -> W [L, Hkv, d, rho] bf16
        self.bytes_per_page = layout.page_size * rank + layout.head_dim + 2 * (layout.page_size + 1)

    def store(self, pids, keys, owners=None):
        if owners is None:
            owners = pids[:1].expand_as(pids)
        groups = [(-1, torch.ones_like(pids, dtype=torch.bool))] if not self.per_sequence else [
            (o, owners == o) for o in owners.unique().tolist()]
        for owner, mine in groups:
            k = keys[:, mine]  # [L, m, Hkv, B, d]
            # A sequence's basis is fitted when its first page (the owner) is stored; the global one once.
            if owner not in self.bases or (self.per_sequence and bool((pids[mine] == owner).any())):
                self.bases[owner] = bl.fit_basis(k.transpose(1, 2), self.rank)  # [L, Hkv, d, rho]
            proj = bl.project_pages(k, self.bases[owner][:, None])
            self.mu[:, pids[mine]], self.coef[:, pids[mine]] = proj.mu, proj.coef

    def layer(self, layer: int) -> bl.SharedBasisSummaries:
        return bl.SharedBasisSummaries(self.mu[layer], self.coef[layer], coef_bits=8, centroid_bits=8)

    def basis(self, layer: int, page_table: torch.Tensor) -> torch.Tensor:
        """W of each row: [Bt, Hkv, d, rho] (per sequence: by the row's first page id, which reads
        the page table on the host) or [Hkv, d, rho] (global)."""
        if not self.per_sequence:
            return self.bases[-1][layer]
        owners = page_table[:, 0].tolist()
        missing = [o for o in owners if o not in self.bases]
        if missing:
            raise RuntimeError(f"no per-sequence basis for the sequences of first pages {missing}")
        return torch.stack([self.bases[o][layer] for o in owners])


class SharedBasisSelector(PageSelector):
    """Eq. 4 with a shared basis W in place of each page's own V_j: per sequence (ShadowKV-style,
    attention "shared_sequence") or global (Loki-style, "shared_global"), at matched bytes."""

    def __init__(self, cfg: CacheConfig, layout: KVLayout, device: torch.device, per_sequence: bool,
                 pages_per_sequence: int):
        super().__init__(cfg, layout)
        self.name = "shared_sequence" if per_sequence else "shared_global"
        self.pages_per_basis = pages_per_sequence if per_sequence else math.inf
        locks = LocksConfig(page_size=cfg.page_size, rank=cfg.rank, basis_bits=cfg.basis_bits)
        budget = bl.locks_payload_bytes(layout.head_dim, locks)
        d = layout.head_dim
        rank = cfg.shared_rank or bl.matched_rank(d, cfg.page_size, budget, self.pages_per_basis)
        self.table = SharedBasisTable(layout, device, rank, per_sequence)
        if per_sequence:
            self.graph_blocker = f"shared_sequence looks up each row's basis on the host; {EVAL_ONLY}"

    def scores(self, layer, q, page_table, num_pages, backend="torch"):
        if not self.table.bases:
            raise RuntimeError(f"{self.name}: no basis yet (no page has been stored)")
        tab = self.table
        basis = tab.basis(layer, page_table)
        s_hat = bl.score_shared_basis(q, tab.layer(layer), basis, page_table, num_pages)
        return finish_scores(s_hat, self.rule)

    def bytes(self):
        d, b = self.layout.head_dim, self.layout.page_size
        payload = bl.shared_basis_payload_bytes(d, b, self.table.rank, self.pages_per_basis)
        return {"payload": payload, "total": payload + 2 * (b + 1)}


# ----------------------------------------------------------------------------- factory


def make_selector(cfg: CacheConfig, layout: KVLayout, device: torch.device,
                  pages_per_sequence: int) -> PageSelector:
    """The selector `cfg.attention` names. "dense" keeps LOCKS's table (built, never scored: the
    engine's dense mode always had it). pages_per_sequence: pages of a max_model_len sequence (the
    per-sequence basis's amortisation, for the byte matching)."""
    kinds = {"locks": LocksSelector, "dense": LocksSelector, "oracle": OracleSelector,
             "quest": QuestSelector, "centroid": CentroidSelector}
    if cfg.attention in kinds:
        return kinds[cfg.attention](cfg, layout, device)
    if cfg.attention in ("shared_sequence", "shared_global"):
        per_sequence = cfg.attention == "shared_sequence"
        return SharedBasisSelector(cfg, layout, device, per_sequence, pages_per_sequence)
    raise ValueError(f"attention ({cfg.attention!r}) names no page selector")
