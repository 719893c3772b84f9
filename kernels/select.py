"""Page selection (Algorithm 2, lines 1 and 11-12): sink + recent pages always, top by group score.

Runs on the device with no host synchronisation: forced pages get +inf, padding -inf,
and one topk over the padded row picks the whole budget at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .score import PageScores, share_average_from_stats


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
    if k < sink_pages + recent_pages + 1:
        raise ValueError(
            f"page budget k ({k}) must be > sink_pages ({sink_pages}) + recent_pages ({recent_pages})"
        )
    budgets = torch.full_like(num_pages, k, device=scores.device)
    return select_decode_pages(scores, num_pages, budgets, k, sink_pages, recent_pages)


def selection_keys(scores: torch.Tensor, num_pages: torch.Tensor, sink_pages: int = 1,
                   recent_pages: int = 2) -> torch.Tensor:
    """Top-k keys of the selection rule: +inf for forced pages (the sink and the recent pages),
    -inf past each row's pages, the group score (never below float32's lowest, NaN -> 0) between.

    scores: [Bt, Hkv, P] float group scores (m_bar); num_pages: [Bt] all pages of each sequence,
    the open page included. Returns [Bt, Hkv, P] float32.
    """
    p = scores.shape[-1]
    pos = torch.arange(p, device=scores.device)[None, None, :]  # [1, 1, P]
    n = num_pages.to(scores.device).long()[:, None, None]  # [Bt, 1, 1]
    key = torch.nan_to_num(scores.float(), nan=0.0).clamp_min(torch.finfo(torch.float32).min)
    key = torch.where((pos < sink_pages) | (pos >= n - recent_pages), math.inf, key)
    return torch.where(pos < n, key, -math.inf)


def select_decode_pages(
    scores: torch.Tensor | None,
    num_pages: torch.Tensor,
    budgets: torch.Tensor,
    k: int,
    sink_pages: int = 1,
    recent_pages: int = 2,
) -> torch.Tensor:
    """The selection rule with a page budget per row, in one fixed-width result (what a replayed
    CUDA graph needs: the width k is fixed, the budgets are data).

    scores: [Bt, Hkv, P] group scores, or None to take every page (dense; needs k >= the pages);
    num_pages: [Bt]; budgets: [Bt] pages per row (> sink_pages + recent_pages); k >= the budgets
    that matter (a row with fewer pages than its budget takes all of them).
    Returns sel: [Bt, Hkv, k] int64 page positions, ascending, -1 padding after them. A row takes
    min(budget, num_pages) pages: the forced ones, then the best by score; among equal keys the
    lower position wins (a stable sort: the kernels follow the same rule).
    """
    bt = num_pages.shape[0]
    if scores is None:
        cols = torch.arange(k, device=num_pages.device)[None, :]  # [1, k]
        sel = torch.where(cols < num_pages[:, None].long(), cols, -1)  # [Bt, k]
        return sel[:, None, :].expand(bt, 1, k)
    key = selection_keys(scores, num_pages, sink_pages, recent_pages)  # [Bt, Hkv, P]
    order = torch.sort(key, dim=-1, descending=True, stable=True)
    top_val, top_idx = order.values[..., :k], order.indices[..., :k]  # forced (+inf) first
    rank = torch.arange(top_idx.shape[-1], device=key.device)[None, None, :]
    keep = (top_val > -math.inf) & (rank < budgets.to(key.device).long()[:, None, None])
    big = key.shape[-1] + 1
    sel = torch.where(keep, top_idx, big).sort(dim=-1).values  # ascending, padding last
    sel = torch.where(sel == big, -1, sel)
    if sel.shape[-1] < k:
        sel = torch.cat([sel, sel.new_full((*sel.shape[:-1], k - sel.shape[-1]), -1)], dim=-1)
    return sel


def decode_page_slots(
    sel: torch.Tensor,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    tail_len: torch.Tensor,
    layer_base: int,
    num_kv_heads: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the selected pages of one decode layer live.

    sel: [Bt, H, K] page positions (-1 padding; H = 1 broadcasts to every KV head);
    page_table: [Bt, P] page ids; num_pages: [Bt] (position num_pages - 1 is the open page);
    tail_len: [Bt] tokens in the open page; layer_base: layer * page ids per layer of the pool.
    Returns, each [Bt, Hkv, K]:
      slots int64: pool slot (layer_base + page_table[b, j]) * Hkv + h of every full (settled)
        page, -1 for the open page and for padding (nothing to look up in the tier: the full
        pages of one (row, head) are distinct, so a cache lookup needs no dedupe);
      lens int32: valid tokens, page_size for full pages, tail_len for the open page, 0 padding;
      is_open bool: the entry is the open page (it lives in the write pool, not in the tier).
    """
    bt, _, k = sel.shape
    sel = sel.expand(bt, num_kv_heads, k)
    n = num_pages.to(sel.device).long()[:, None, None]  # [Bt, 1, 1]
    is_open = sel == n - 1
    settled = (sel >= 0) & ~is_open
    pid = page_table.long().gather(1, sel.clamp_min(0).reshape(bt, -1)).view(bt, num_kv_heads, k)
    heads = torch.arange(num_kv_heads, device=sel.device)[None, :, None]
    slots = torch.where(settled, (layer_base + pid) * num_kv_heads + heads, -1)
    tail = tail_len.to(sel.device)[:, None, None].to(torch.int32)
    lens = torch.where(is_open, tail, torch.where(settled, page_size, 0)).to(torch.int32)
    return slots, lens, is_open


@dataclass(frozen=True)
class DecodeRows:
    """Per-row state of a batch of decode rows, on the device (views of a runner's persistent
    tensors). page_table: [Bt, P] page ids; num_pages, budgets, tail_len, tail_loc: [Bt] (all
    pages incl. the open one; page budget; tokens in the open page; its write-pool location)."""

    page_table: torch.Tensor
    num_pages: torch.Tensor
    budgets: torch.Tensor
    tail_len: torch.Tensor
    tail_loc: torch.Tensor


@dataclass(frozen=True)
class PoolAddress:
    """Where one layer's pages are: tier slot = (layer_base + page id) * Hkv + h; the open page
    is read at pool index write_front + (write_base + tail_loc) * Hkv + h."""

    layer_base: int
    write_front: int
    write_base: int


@dataclass(frozen=True)
class DecodeSelection:
    """What one decode layer attends, each [Bt, Hkv, K]: slots (int64 tier slots of the full pages
    to resolve, -1 elsewhere), lens (int32 valid tokens), is_open (bool), idx (int64 attention-pool
    index: the open page's, else the slot; -1 = padding, never read). first_start: None, or
    [Bt, Hkv] int32 tokens of the first selected page that lie before a sliding window (masked:
    that page's tokens first_start .. lens - 1 are attended)."""

    slots: torch.Tensor
    lens: torch.Tensor
    is_open: torch.Tensor
    idx: torch.Tensor
    first_start: torch.Tensor | None = None


def decode_selection_ref(scores: PageScores | None, rows: DecodeRows, k: int, sink_pages: int,
                         recent_pages: int, num_kv_heads: int, page_size: int,
                         where: PoolAddress) -> DecodeSelection:
    """select_decode_pages on the share-averaged scores (None: every page), then
    decode_page_slots, and the open page's pool index."""
    m_bar = None if scores is None else scores.share_average()
    sel = select_decode_pages(m_bar, rows.num_pages, rows.budgets, k, sink_pages, recent_pages)
    slots, lens, is_open = decode_page_slots(sel, rows.page_table, rows.num_pages, rows.tail_len,
                                             where.layer_base, num_kv_heads, page_size)
    return DecodeSelection(slots, lens, is_open, _pool_index(slots, is_open, rows, where))


def _pool_index(slots: torch.Tensor, is_open: torch.Tensor, rows: DecodeRows, where: PoolAddress
                ) -> torch.Tensor:
    # slots, is_open: [Bt, Hkv, K] -> attention-pool index: the open page's in the write pool, else
    # the slot
    num_kv_heads = slots.shape[1]
    heads = torch.arange(num_kv_heads, device=slots.device)[None, :, None]
    tail_loc = rows.tail_loc.long()[:, None, None]
    open_idx = where.write_front + (where.write_base + tail_loc) * num_kv_heads + heads
    return torch.where(is_open, open_idx, slots)


def window_width(window: int, page_size: int) -> int:
    """Pages that `window` consecutive tokens can overlap: 1 + ceil((window - 1) / page_size)."""
    return (window + page_size - 2) // page_size + 1


def window_selection(rows: DecodeRows, window: int, num_kv_heads: int, page_size: int,
                     where: PoolAddress) -> DecodeSelection:
    """What a sliding-window layer's decode query attends: exactly the keys at positions
    (p - window, p] of its row (p: the row's last token, in the open page), i.e. every page that
    overlaps them, with the tokens of the first one before the window masked (first_start). No
    scores, no budget: the width window_width(window, page_size) is fixed and the positions are
    data, so the selection runs in a replayed CUDA graph (no host synchronisation).

    rows: DecodeRows (num_pages counts the open page, tail_len its tokens); returns a
    DecodeSelection of [Bt, Hkv, window_width] with first_start [Bt, Hkv] int32.
    """
    bt, b = rows.num_pages.shape[0], page_size
    n = rows.num_pages.long()
    length = (n - 1) * b + rows.tail_len.long()  # [Bt] tokens, the query's own included
    start = (length - window).clamp_min(0)  # [Bt] first key in the window
    cols = torch.arange(window_width(window, b), device=n.device)[None, :]
    sel = (start // b)[:, None] + cols  # [Bt, W'] page positions
    sel = torch.where(sel < n[:, None], sel, -1)[:, None, :]  # [Bt, 1, W'], -1 past the open page
    slots, lens, is_open = decode_page_slots(sel, rows.page_table, rows.num_pages, rows.tail_len,
                                             where.layer_base, num_kv_heads, page_size)
    first_start = (start % b).to(torch.int32)[:, None].expand(bt, num_kv_heads)
    return DecodeSelection(slots, lens, is_open, _pool_index(slots, is_open, rows, where), first_start)


# ---- one rank of a context-parallel sequence (workers/engine/cp_selection.py) --------------------


def forced_mask(gpos: torch.Tensor, num_pages: torch.Tensor, sink_pages: int, recent_pages: int
                ) -> torch.Tensor:
    """Pages every selection keeps, by global position: the sink and the recent pages.
    gpos: [Bt, ..., W] global positions; num_pages: [Bt] -> bool like gpos."""
    n = num_pages.long().view(-1, *([1] * (gpos.dim() - 1)))
    return (gpos < sink_pages) | (gpos >= n - recent_pages)


def competing_keys(m_bar: torch.Tensor, first_page: torch.Tensor, num_settled: torch.Tensor,
                   num_pages: torch.Tensor, sink_pages: int, recent_pages: int) -> torch.Tensor:
    """Selection keys of a rank's pages: m_bar [Bt, Hkv, W] share-averaged under the global
    normalisers (column j = global page first_page + j); first_page, num_settled (full pages of
    the rank's range, the scored ones), num_pages (the sequence's, open page included): [Bt].
    Returns [Bt, Hkv, W] float32: m_bar (NaN -> 0, at least float32's lowest: as selection_keys)
    for the pages that compete for the budget, -inf for forced and unscored pages."""
    cols = torch.arange(m_bar.shape[-1], device=m_bar.device)[None, None, :]
    gpos = first_page.long()[:, None, None] + cols
    competes = (cols < num_settled.long()[:, None, None]) & ~forced_mask(gpos, num_pages, sink_pages,
                                                                          recent_pages)
    key = torch.nan_to_num(m_bar.float(), nan=0.0).clamp_min(torch.finfo(torch.float32).min)
    return torch.where(competes, key, -math.inf)


def shard_chunk_topk_ref(s_hat: torch.Tensor, stats: torch.Tensor, first_page: torch.Tensor,
                         num_settled: torch.Tensor, num_pages: torch.Tensor, k: int, sink_pages: int,
                         recent_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-parallel rank's pages that compete for the budget, as (keys, columns): s_hat
    [Bt, Hkv, G, W] scores and stats [Bt, Hkv, G, 2] the global normalisers. Returns keys
    [Bt, Hkv, W] float32 (competing_keys) and columns [Bt, Hkv, W] int32, -inf / -1 for pages
    that do not compete. The Triton kernel returns each chunk's best k instead (a superset of the
    row's best k under (key desc, column asc)); k is unused here."""
    del k
    keys = competing_keys(share_average_from_stats(s_hat, stats), first_page, num_settled, num_pages,
                          sink_pages, recent_pages)
    cols = torch.arange(keys.shape[-1], device=keys.device, dtype=torch.int32).expand_as(keys)
    return keys, torch.where(keys > -math.inf, cols, -1)


# The exchange's order keys, the threshold and the rank's share of the selection (the Triton
# kernels shard_candidates / shard_select / shard_slots compute the same, kernels/triton/select.py).

NO_PAGE = (1 << 31) - 1  # the position of an empty candidate slot (sorts after every page)


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


def shard_slots_ref(sel: torch.Tensor, first_page: torch.Tensor, num_pages: torch.Tensor,
                    tail_len: torch.Tensor, tail_loc: torch.Tensor, page_table: torch.Tensor,
                    where: PoolAddress, page_size: int) -> DecodeSelection:
    """Where a context-parallel rank's selected pages are in its KV: sel [Bt, Hkv, K] global
    positions (-1 padding) -> decode_page_slots over the rank's local pages (global page g is local
    g - first_page; local page max(num_pages - first_page, 1) - 1 is the open page: past the range
    on ranks without it, so none is taken for open there), and the open page's pool index."""
    hkv = sel.shape[1]
    local = torch.where(sel >= 0, sel - first_page.long()[:, None, None], -1)
    local_pages = (num_pages.long() - first_page.long()).clamp_min(1)
    slots, lens, is_open = decode_page_slots(local, page_table, local_pages, tail_len, where.layer_base, hkv,
                                             page_size)
    heads = torch.arange(hkv, device=sel.device)[None, :, None]
    open_idx = where.write_front + (where.write_base + tail_loc.long()[:, None, None]) * hkv + heads
    return DecodeSelection(slots, lens, is_open, torch.where(is_open, open_idx, slots))


def shard_select_ref(gathered: torch.Tensor, candidates: torch.Tensor, take: torch.Tensor,
                     first_page: torch.Tensor, count: torch.Tensor, num_pages: torch.Tensor, sink_pages: int,
                     recent_pages: int) -> torch.Tensor:
    """What a rank attends, from every rank's candidates: gathered [R, Bt, Hkv, t] (all ranks'
    local_candidates), candidates [Bt, Hkv, t] (this rank's, one of them), take [Bt] -> [Bt, Hkv,
    sink + recent + t] global positions ascending, -1 after them (global_threshold, then
    shard_selection; the Triton kernel does both in one launch)."""
    threshold = global_threshold(gathered, take)
    return shard_selection(candidates, threshold, first_page, count, num_pages, sink_pages, recent_pages)
