"""A context-parallel rank's attention backend: its own pages of the sequence, merged with the other ranks'.

Every rank runs the same tokens through the whole model; only attention is split. Per layer:
1. RoPE on q and k; each new token's K/V into its page, on the rank that owns the page (the
   others pass write location -1: not written).
2. decode (one token per row):
     scores of the rank's full pages and their per-head (max, sum exp)    kernels.ops.score_stats
     all-gather the (max, sum exp); merge -> the global normalisers      collective 1
     the rank's best T pages under (m_bar desc, position asc)
     all-gather the candidates; the T-th best is the global threshold    collective 2
     attend the rank's pages at or above it, and its forced pages        kernels.ops.sparse_decode
     all-gather (o, lse); merge by log-sum-exp in rank order              collective 3
   (cp_selection.py says why this selection equals single-node LOCKS.) A row within its budget
   attends every page: no scoring, no collectives 1-2.
3. prefill (a chunk of one sequence): causal attention of the chunk over the rank's own tokens
   (`partial_attention`), all-gathered and merged by log-sum-exp.
Merging in rank order makes every rank compute the same bits, so all ranks carry the same hidden
states and the same next token. No host synchronisation in the decode path and fixed shapes per
(rows, width, candidates), so it can be captured in a CUDA graph (collectives included, on NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lockserve.kernels import merge_partials, ops
from lockserve.kernels.select import DecodeSelection, PoolAddress
from lockserve.kernels.triton.select import DEFAULT_RADIX_BITS, check_radix_bits
from lockserve.workers.model.layers import QKV

from .attention import PrefillMeta, _cpu_flash, prefill_kv
from .cp_group import RankGroup
from .cp_selection import (
    all_local_pages,
    merge_stats,
)
from .kv_manager import KVManager

ATTENTION_BLOCK = 4096  # keys per block of the reference partial attention (off CPU)


@dataclass(frozen=True)
class ShardRows:
    """A rank's view of its decode rows, [Bt] int64 device tensors unless said: page_table [Bt, W]
    int32 the rank's page ids (column j = the sequence's page first_page + j); count: pages of the
    range that exist (full, plus the open page on the rank that holds it); num_settled: full pages
    of the range (scored); num_pages: the sequence's pages, open page included; budgets: LOCKS
    page budgets; tail_len, tail_loc: the open page's tokens and write-pool location (-1 on
    ranks without it)."""

    page_table: torch.Tensor
    first_page: torch.Tensor
    count: torch.Tensor
    num_settled: torch.Tensor
    num_pages: torch.Tensor
    budgets: torch.Tensor
    tail_len: torch.Tensor
    tail_loc: torch.Tensor


@dataclass(frozen=True)
class ShardPrefill:
    """A prefill chunk on one rank: queries at global positions q_start.. ; the rank's tokens start
    at global position key_start; meta: where its tokens visible to the chunk live (None: none)."""

    q_start: int
    key_start: int
    meta: PrefillMeta | None


@dataclass(frozen=True)
class ShardStep:
    """What one forward on a rank attends: write_loc, write_off [T] (where each token's K/V goes, -1
    = another rank's token); decode rows (rows, scored, candidates t, selection width) or a prefill
    chunk."""

    write_loc: torch.Tensor
    write_off: torch.Tensor
    rows: ShardRows | None = None
    scored: bool = False
    candidates: int = 0
    width: int = 0
    prefill: ShardPrefill | None = None


def attention_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, causal: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention with its log-sum-exp. q: [n, Hq, d]; keys, values: [L, Hkv, d] (L >= 1);
    causal: query i sees keys 0..i (top-left). Returns o [n, Hq, d] float32, lse [n, Hq] float32
    (natural log; -inf and o = 0 for a query that sees no key)."""
    if q.device.type == "cpu" and _cpu_flash is not None:
        hq, hkv = q.shape[1], keys.shape[1]
        qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
        kh = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
        vh = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
        o, lse = _cpu_flash(qh, kh, vh, is_causal=causal)[:2]
        return o[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()
    return _blocked_attention_lse(q, keys, values, causal)


def _blocked_attention_lse(q, keys, values, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [n, Hq, d]; keys, values: [L, Hkv, d] -> ([n, Hq, d], [n, Hq]); blocks of keys merged by LSE
    n, hq, d = q.shape
    hkv = keys.shape[1]
    qg = q.float().reshape(n, hkv, hq // hkv, d) * d**-0.5
    rows = torch.arange(n, device=q.device)[:, None, None, None]
    outs, lses = [], []
    for start in range(0, keys.shape[0], ATTENTION_BLOCK):
        k = keys[start : start + ATTENTION_BLOCK].float()
        logits = torch.einsum("nhgd,bhd->nhgb", qg, k)  # [n, Hkv, G, b]
        if causal:
            cols = start + torch.arange(k.shape[0], device=q.device)
            logits = logits.masked_fill(cols > rows, float("-inf"))
        lse = torch.logsumexp(logits, dim=-1)
        p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        outs.append(torch.einsum("nhgb,bhd->nhgd", p, values[start : start + ATTENTION_BLOCK].float()))
        lses.append(lse)
    o, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    return o.reshape(n, hq, d), lse.reshape(n, hq)


def partial_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_start: int, key_start: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of queries at positions q_start.. over the keys at key_start.. (one rank's
    tokens of the sequence, none past the chunk), as a partial to merge by log-sum-exp.

    q: [n, Hq, d]; keys, values: [L, Hkv, d], key_start + L <= q_start + n. Keys before q_start are
    visible to every query, the chunk's own keys causally. Returns o [n, Hq, d] and lse [n, Hq]
    float32 (o = 0, lse = -inf for a query that sees none of these keys)."""
    n, hq, d = q.shape
    length = keys.shape[0]
    prefix = min(max(q_start - key_start, 0), length)  # keys before the chunk
    outs, lses = [], []
    if prefix:
        o, lse = attention_lse(q, keys[:prefix], values[:prefix], causal=False)
        outs.append(o)
        lses.append(lse)
    if length > prefix:
        skip = key_start + prefix - q_start  # queries before the rank's first key in the chunk see none
        o, lse = attention_lse(q[skip:], keys[prefix:], values[prefix:], causal=True)
        outs.append(torch.cat([o.new_zeros(skip, hq, d), o]))
        lses.append(torch.cat([lse.new_full((skip, hq), float("-inf")), lse]))
    if not outs:
        empty = q.new_full((n, hq), float("-inf"), dtype=torch.float32)
        return q.new_zeros(n, hq, d, dtype=torch.float32), empty
    if len(outs) == 1:
        return outs[0], lses[0]
    return merge_partials(torch.stack(outs), torch.stack(lses))


class ShardAttention:
    """The AttentionFn of a context-parallel rank (see the module docstring).

    kv: the rank's KVManager; sink_pages, recent_pages, radix_bits: as PagedAttention; backend:
    kernels.ops backend ("torch" for the reference). `bind` sets the step, the request's group
    and, for tests, a trace list that receives each decode layer's selection ([Bt, Hkv, width]
    global positions).
    """

    def __init__(self, kv: KVManager, sink_pages: int, recent_pages: int, backend: str,
                 radix_bits: int = DEFAULT_RADIX_BITS):
        check_radix_bits(radix_bits)
        self.kv, self.sink_pages, self.recent_pages, self.backend = kv, sink_pages, recent_pages, backend
        self.radix_bits = radix_bits
        self.step: ShardStep | None = None
        self.group: RankGroup | None = None
        self.trace: list | None = None

    def bind(self, step: ShardStep, group: RankGroup, trace: list | None = None) -> None:
        self.step, self.group, self.trace = step, group, trace

    def __call__(self, layer: int, x: QKV) -> torch.Tensor:
        # x: the layer's fused projection before RoPE -> o [T, Hq, d]
        if x.window is not None:  # NOTE: refused, not ignored: every key would be attended
            raise NotImplementedError(f"context parallelism does not support sliding-window layers "
                                      f"(layer {layer}, window {x.window})")
        step, kv = self.step, self.kv
        q = ops.rope_write(x.qkv, x.cos, x.sin, x.num_heads, x.num_kv_heads, kv.write_pool, step.write_loc,
                           step.write_off, layer * kv.write_rows, backend=self.backend)  # [T, Hq, d]
        o = self._decode(layer, q) if step.rows is not None else self._prefill(layer, q)
        return o.to(q.dtype)

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        # q: [Bt, Hq, d] -> o [Bt, Hq, d] float32 over every rank's selected pages
        step, rows = self.step, self.step.rows
        if step.scored:
            sel = self._select(layer, q)
        else:
            sel = all_local_pages(rows.first_page, rows.count, self.kv.layout.num_kv_heads, step.width)
        if self.trace is not None:
            self.trace.append(sel.cpu())
        selection = self._slots(layer, sel)
        idx = self.kv.resolve(selection)  # [Bt, Hkv, width] attention-pool rows
        o, lse = ops.sparse_decode(q, self.kv.attn_pool, idx, selection.lens, backend=self.backend)
        return self._merge(o, lse)

    def _select(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """The rank's share of the global LOCKS selection: [Bt, Hkv, width] global positions."""
        step, rows, group = self.step, self.step.rows, self.group
        table = self.kv.summaries.layers[layer]
        scores = ops.score_stats(q, table, rows.page_table, rows.num_settled, backend=self.backend)
        stats = merge_stats(group.all_gather(scores.stats))  # [Bt, Hkv, G, 2] global normalisers
        # Triton: one launch, each chunk's best t
        keys, cols = ops.shard_chunk_topk(scores.s_hat, stats, rows.first_page, rows.num_settled,
                                          rows.num_pages, step.candidates, self.sink_pages, self.recent_pages,
                                          backend=self.backend, radix_bits=self.radix_bits)
        # [Bt, Hkv, t] int64 order keys: the rank's best t (Triton: one launch)
        candidates = ops.shard_candidates(keys, cols, rows.first_page, step.candidates, backend=self.backend,
                                          radix_bits=self.radix_bits)
        take = rows.budgets - self.sink_pages - self.recent_pages
        # the global threshold and this rank's pages at or above it (Triton: one launch, no sort)
        return ops.shard_select(group.all_gather(candidates), candidates, take, rows.first_page, rows.count,
                                rows.num_pages, self.sink_pages, self.recent_pages, backend=self.backend)

    def _slots(self, layer: int, sel: torch.Tensor) -> DecodeSelection:
        """Where the selected pages (global positions [Bt, Hkv, K], -1 padding) are in this rank's KV."""
        rows, kv, lay = self.step.rows, self.kv, self.kv.layout
        where = PoolAddress(layer * lay.max_pages, kv.write_front, layer * kv.write_rows)
        # kernels/select.py shard_slots_ref (Triton: one launch)
        return ops.shard_slots(sel.contiguous(), rows.first_page, rows.num_pages, rows.tail_len,
                               rows.tail_loc, rows.page_table, where, lay.page_size, backend=self.backend)

    def _prefill(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        # q: [n, Hq, d] -> o [n, Hq, d] float32, causal over every rank's tokens
        p = self.step.prefill
        if p.meta is None:
            o = q.new_zeros(q.shape, dtype=torch.float32)
            lse = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        else:
            keys, values = prefill_kv(self.kv, layer, p.meta)
            o, lse = partial_attention(q, keys.to(q.dtype), values.to(q.dtype), p.q_start, p.key_start)
        return self._merge(o, lse)

    def _merge(self, o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """All ranks' partials (o [T, Hq, d], lse [T, Hq]) merged by log-sum-exp in rank order."""
        gathered = self.group.all_gather(torch.cat([o.float(), lse.float()[..., None]], dim=-1))
        merged, _ = merge_partials(gathered[..., :-1], gathered[..., -1])
        return merged
