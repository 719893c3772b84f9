"""Exact LOCKS page selection over a sequence whose pages are split across ranks (context parallel).

Each rank holds a contiguous range of the sequence's pages `[first_page, first_page + count)` and
scores its own full pages from their summaries. Single-node LOCKS (kernels/select.py) keeps, per
(row, KV head), the sink pages and the recent pages, then the best T = budget - sink - recent of
the other pages by the share-averaged score m_bar (Eq. 5), ties to the lower position. Split:

1. normalisers (`merge_stats`): m_bar needs each query head's softmax normaliser over *all*
   pages, (max, sum exp). The ranks all-gather their local (max, sum exp) and every rank merges
   the gathered tensor in rank order: the max exactly, the sum as sum_r sum_r exp(max_r - max).
   Every rank computes the same numbers from the same tensor, so each page's key (computed by its
   owner alone) compares with the other ranks' keys as if all were computed on one device.
   Each rank then keys its own pages (kernels/select.py competing_keys; kernels.ops.shard_chunk_topk
   computes them and keeps each chunk's best T in one Triton launch on the GPU).
2. threshold (`local_candidates`, `global_threshold`): each rank's best T pages under the strict
   total order (key desc, global position asc). A page among the global best T is among its own
   rank's best T, so the T-th best of the all-gathered candidates under the same order is the
   global threshold; every rank computes it from the same gathered tensor.
3. selection (`shard_selection`): a rank keeps its candidates at or above the threshold under that
   order, and its forced pages by global position (the sink lives on the first rank, the open page
   on the last, the last full page on whichever rank holds it).
Given the same keys, the selected set is exactly single-node LOCKS's, ties included.

What crosses the network per layer and row: (max, sum exp) per query head (Hq x 8 bytes), then T
candidates per KV head (Hkv x T x 8 bytes: `order_keys`, the score's bits and the position in one
int64 that orders as the selection does, so a top-k and one sort replace stable sorts).
Why two exchanges and not one: the global weights of the G heads in m_bar
(exp(max_g) / sum_g) are unknown before the first; under unknown weights a rank's best T pages
can be any page that fewer than T pages beat in every head, a set of no fixed size.
All functions are torch code without host synchronisation and with fixed shapes (graph capturable).
"""

from __future__ import annotations

import math

import torch

NO_PAGE = (1 << 31) - 1  # the position of an empty candidate slot (sorts after every page)


def merge_stats(gathered: torch.Tensor) -> torch.Tensor:
    """The global softmax normaliser of each query head from the ranks' local ones.

    gathered: [R, ..., 2] per-rank (max, sum exp(s - max)) (kernels.score.group_stats_ref; max
    -inf and sum 0 for a rank without a scored page) -> [..., 2] float32. Merged in rank order
    (a fixed order: every rank gets the same bits); one rank gives its own stats back exactly.
    """
    top = gathered[..., 0].amax(dim=0)  # [...]
    safe = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.zeros_like(top)
    for r in range(gathered.shape[0]):
        total = total + gathered[r, ..., 1] * torch.exp(gathered[r, ..., 0] - safe)
    return torch.stack([top, total], dim=-1)


def order_keys(values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One int64 per page that orders as (value desc, position asc): larger is better.

    values: float32 (-inf allowed, no NaN); positions: int64 in [0, NO_PAGE]. The high 32 bits are
    the value's bits made monotonic as a signed integer (negative floats: the 31 low bits flipped;
    -0.0 is made +0.0 first, as a float comparison sees them equal), the low 32 bits NO_PAGE -
    position. Distinct positions give distinct keys: no tie is left to break."""
    bits = (values.float() + 0.0).contiguous().view(torch.int32).long()  # + 0.0: -0.0 -> +0.0
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (mono << 32) | (NO_PAGE - positions.long())


def key_positions(keys: torch.Tensor) -> torch.Tensor:
    """The positions order_keys packed into keys (int64)."""
    return NO_PAGE - (keys & 0xFFFFFFFF)


EMPTY = int(order_keys(torch.tensor([-math.inf]), torch.tensor([NO_PAGE]))[0])  # no page: below all


def local_candidates(keys: torch.Tensor, first_page: torch.Tensor, t: int,
                     cols: torch.Tensor | None = None) -> torch.Tensor:
    """A rank's best t pages under (key desc, global position asc), as order_keys.

    keys: [Bt, Hkv, C] (competing_keys; -inf = not competing); first_page: [Bt]; cols: each key's
    column in the rank's range ([Bt, Hkv, C], -1 = none: kernels.ops.shard_chunk_topk), default
    0 .. C - 1. Returns [Bt, Hkv, t] int64 descending; EMPTY past the competing pages (what
    crosses the network).
    """
    if cols is None:
        cols = torch.arange(keys.shape[-1], device=keys.device)[None, None, :]
    ranked = order_keys(keys, first_page.long()[:, None, None] + cols.long())
    ranked = torch.where((keys > -math.inf) & (cols >= 0), ranked, EMPTY)
    if ranked.shape[-1] < t:
        pad = ranked.new_full((*ranked.shape[:-1], t - ranked.shape[-1]), EMPTY)
        ranked = torch.cat([ranked, pad], dim=-1)
    return ranked.topk(t, dim=-1).values  # distinct keys: the order needs no stable sort


def global_threshold(candidates: torch.Tensor, take: torch.Tensor) -> torch.Tensor:
    """The take-th best candidate of all ranks: candidates [R, Bt, Hkv, t] (the all-gathered
    local_candidates), take [Bt] pages the row chooses by score (>= 1) -> [Bt, Hkv] int64 key;
    EMPTY when fewer than `take` candidates exist (then every candidate is kept)."""
    r, bt, hkv, t = candidates.shape
    merged = candidates.permute(1, 2, 0, 3).reshape(bt, hkv, r * t)
    ranked = merged.sort(dim=-1, descending=True).values
    at = (take.long() - 1).clamp(0, r * t - 1).view(bt, 1, 1).expand(bt, hkv, 1)
    return ranked.gather(-1, at)[..., 0]


def at_or_above(candidates: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Candidates [Bt, Hkv, t] at or above the threshold [Bt, Hkv] (order_keys: value desc,
    position asc), empty slots excluded."""
    return (candidates >= threshold[..., None]) & (candidates > EMPTY)


def shard_selection(candidates: torch.Tensor, threshold: torch.Tensor, first_page: torch.Tensor,
                    count: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, recent_pages: int
                    ) -> torch.Tensor:
    """Global positions of the pages this rank attends: its candidates at or above the threshold
    and its forced pages. candidates: [Bt, Hkv, t] (local_candidates); threshold: [Bt, Hkv];
    first_page, count (pages of the range that exist), num_pages: [Bt].
    Returns [Bt, Hkv, sink + recent + t] int64, ascending, -1 after the pages."""
    bt, hkv, _ = candidates.shape
    big = NO_PAGE
    chosen = torch.where(at_or_above(candidates, threshold), key_positions(candidates), big)
    n = num_pages.long()[:, None]
    dev = candidates.device
    fixed = torch.cat([torch.arange(sink_pages, device=dev)[None, :].expand(bt, sink_pages),
                       n - recent_pages + torch.arange(recent_pages, device=dev)[None, :]], dim=-1)
    first = first_page.long()[:, None]
    mine = (fixed >= first) & (fixed < first + count.long()[:, None]) & (fixed >= 0) & (fixed < n)
    forced = torch.where(mine, fixed, big)[:, None, :].expand(bt, hkv, fixed.shape[-1])
    sel = torch.cat([forced, chosen], dim=-1).sort(dim=-1).values
    return torch.where(sel == big, -1, sel)


def all_local_pages(first_page: torch.Tensor, count: torch.Tensor, num_kv_heads: int, width: int
                    ) -> torch.Tensor:
    """Every existing page of a rank's range (a row within its budget, or dense attention):
    [Bt, Hkv, width] global positions ascending, -1 after them (width >= every count)."""
    cols = torch.arange(width, device=first_page.device)[None, :]
    sel = torch.where(cols < count.long()[:, None], first_page.long()[:, None] + cols, -1)
    return sel[:, None, :].expand(-1, num_kv_heads, width)
