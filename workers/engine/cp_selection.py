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
The pieces from the candidates on (order_keys, local_candidates, global_threshold .. and
shard_select_ref, the threshold and selection at once) live in kernels/select.py beside their
Triton kernels (kernels.ops.shard_candidates, shard_select, shard_slots: one launch a layer each);
this module re-exports them.
"""

from __future__ import annotations

import torch
from lockserve.kernels.select import (  # noqa: F401  (the protocol's pieces live with their kernels)
    EMPTY,
    NO_PAGE,
    at_or_above,
    global_threshold,
    key_positions,
    local_candidates,
    order_keys,
    shard_select_ref,
    shard_selection,
)


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


def all_local_pages(first_page: torch.Tensor, count: torch.Tensor, num_kv_heads: int, width: int
                    ) -> torch.Tensor:
    """Every existing page of a rank's range (a row within its budget, or dense attention):
    [Bt, Hkv, width] global positions ascending, -1 after them (width >= every count)."""
    cols = torch.arange(width, device=first_page.device)[None, :]
    sel = torch.where(cols < count.long()[:, None], first_page.long()[:, None] + cols, -1)
    return sel[:, None, :].expand(-1, num_kv_heads, width)
