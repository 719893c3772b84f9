"""The engine's attention backend: per-step metadata, its builder, and the per-layer impl.

Roles (as in vLLM's backends): `StepMetadata` is built once per step by `build_metadata`
(page tables, lengths, write locations: every host->device transfer of the step happens
there); `PagedAttention.__call__(layer, q, k, v)` runs once per layer with no host
synchronisation on tiers hbm and host (tier host+nvme must ask the store to promote spilled
pages: see kv_manager.SpilledPages).

A step's tokens are decode tokens first (one per decoding sequence), then prefill chunks.
Per layer:
1. every new token's K/V goes into its page in the write pool;
2. decode (mode dense or locks): select pages per (sequence, KV head) - all pages (dense, or
   locks when the budget covers the context) or sink + recent + top by LOCKS score from the
   summaries (locks) - then exact attention over them in two parts merged by log-sum-exp:
   the settled pages (resolved through the tier) and the open page (in the write pool);
3. prefill: dense causal attention of the chunk over all of its sequence's pages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lockserve.kernels import (
    dequantize_summaries,
    group_scores,
    merge_partials,
    ops,
    score_pages_ref,
    select_pages,
    sparse_decode_ref,
)
from torch.nn.attention.bias import causal_lower_right

from .kv_manager import KVManager, page_slots
from .scheduler import Batch, Chunk
from .uploads import upload

ATTENTION_MODES = ("dense", "locks")

# "auto": kernels.ops (Triton) on CUDA, the torch reference on CPU - the Triton interpreter is for
# kernel tests, far too slow for an engine. "ops": always kernels.ops (which itself runs Triton
# where it can, i.e. on CPU only under TRITON_INTERPRET=1). "reference": always the reference.
KERNEL_CHOICES = ("auto", "ops", "reference")


def use_ops(kernels: str, q: torch.Tensor) -> bool:
    return kernels == "ops" or (kernels == "auto" and q.is_cuda)


def sparse_decode(q, pool, slots, page_lens, kernels: str = "auto"):
    """q [Bt, Hq, d], pool [S, 2, B, d], slots / page_lens [Bt, Hkv, K] -> (o [Bt, Hq, d] f32, lse)."""
    if use_ops(kernels, q):
        return ops.sparse_decode(q, pool, slots, page_lens)
    return sparse_decode_ref(q, pool, slots, page_lens)


def score_and_group(q, table, page_table, num_pages, kernels: str = "auto") -> torch.Tensor:
    """LOCKS page scores (Eq. 4) grouped over GQA heads (Eq. 5) from a quantised table.

    q: [Bt, Hq, d]; table: QuantSummaries with leading dims [max_pages, Hkv]; page_table: [Bt, P];
    num_pages: [Bt] scored pages per row -> m_bar [Bt, Hkv, P] (0 beyond num_pages).
    """
    if use_ops(kernels, q):
        return ops.score_and_group(q, table, page_table, num_pages)[1]
    return group_scores(score_quantized_ref(q, table, page_table, num_pages))


def score_quantized_ref(q, table, page_table, num_pages) -> torch.Tensor:
    """score_pages_ref over dequantised summaries, dequantising only the rows the batch reads."""
    bt, p = page_table.shape
    rows = table.index(page_table.reshape(-1))  # leading dims [Bt * P, Hkv]
    local = torch.arange(bt * p, device=page_table.device).view(bt, p)
    return score_pages_ref(q, dequantize_summaries(rows), local, num_pages)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Exact causal attention of a sequence's last n tokens over all its L keys (L >= n).

    q: [n, Hq, d]; keys, values: [L, Hkv, d] -> o [n, Hq, d] in q's dtype; query i sits at
    position L - n + i. Memory-efficient SDPA kernels, never an [Hq, n, L] score matrix: on CUDA
    one call with a lower-right causal bias; on CPU (whose SDPA would materialise that bias) two
    flash calls, the cached prefix unmasked and the chunk causal, merged by log-sum-exp.
    """
    n, hq, _ = q.shape
    length, hkv = keys.shape[0], keys.shape[1]
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, d]
    kh = keys.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]  # [1, Hq, L, d]
    vh = values.transpose(0, 1).repeat_interleave(hq // hkv, dim=0)[None]
    if q.device.type == "cpu" and _cpu_flash is not None:
        o = _split_flash(qh, kh, vh, length - n)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, length))
    return o[0].transpose(0, 1).to(q.dtype)


_cpu_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _split_flash(qh, kh, vh, prefix: int) -> torch.Tensor:
    # qh: [1, Hq, n, d]; kh, vh: [1, Hq, prefix + n, d] -> [1, Hq, n, d]
    o_chunk, lse_chunk = _cpu_flash(qh, kh[:, :, prefix:], vh[:, :, prefix:], is_causal=True)[:2]
    if prefix == 0:
        return o_chunk
    o_prefix, lse_prefix = _cpu_flash(qh, kh[:, :, :prefix], vh[:, :, :prefix])[:2]
    o, _ = merge_partials(torch.stack([o_prefix, o_chunk]), torch.stack([lse_prefix, lse_chunk]))
    return o


@dataclass
class DecodeMeta:
    """Decode rows of one step (Bd sequences, one token each). Tensors on the device.

    page_table: [Bd, P] page ids of each sequence's pages (padding: the row's page 0).
    num_pages: [Bd] pages after this token, the open page included; num_settled = num_pages - 1
    (full pages: in the tier, summarised). tail_loc: [Bd] write-pool location of the open page;
    tail_len: [Bd, Hkv, 1] its tokens. base_sel: [Bd, Hkv, K] selection for rows that attend
    every page (-1 padding; all -1 for scored rows). scored: (page budget k, rows [n] or None for
    all rows) per group of rows that LOCKS must score.
    """

    page_table: torch.Tensor
    num_pages: torch.Tensor
    num_settled: torch.Tensor
    tail_loc: torch.Tensor
    tail_len: torch.Tensor
    base_sel: torch.Tensor
    scored: list[tuple[int, torch.Tensor | None]]


@dataclass
class PrefillMeta:
    """One prefill chunk: tokens [token_start, token_start + num_tokens) of the step; the sequence
    has `length` tokens after it. settled_pids: [S] its full pages before the chunk's first page;
    locs: [U] write-pool locations of the pages the chunk touches."""

    token_start: int
    num_tokens: int
    length: int
    settled_pids: torch.Tensor
    locs: torch.Tensor


@dataclass
class StepMetadata:
    """All per-step metadata. write_loc, write_off: [T] write-pool location and in-page offset of
    every new token (T = the step's tokens, decodes first)."""

    num_decode: int
    decode: DecodeMeta | None
    prefills: list[PrefillMeta]
    write_loc: torch.Tensor
    write_off: torch.Tensor


def build_metadata(batch: Batch, locs: list[list[int]], page_size: int, num_kv_heads: int,
                   device: torch.device) -> StepMetadata:
    """The step's metadata from the batch and each chunk's write-pool locations (KVManager.plan)."""
    write_loc, write_off = [], []
    for chunk, chunk_locs in zip(batch.chunks, locs, strict=True):
        first = chunk.start // page_size
        for t in range(chunk.start, chunk.end):
            write_loc.append(chunk_locs[t // page_size - first])
            write_off.append(t % page_size)
    nd = len(batch.decodes)
    decode = _decode_meta(batch.decodes, locs[:nd], page_size, num_kv_heads, device) if nd else None
    prefills, start = [], nd
    for chunk, chunk_locs in zip(batch.prefills, locs[nd:], strict=True):
        settled = pid_tensor(chunk.seq, device)[: chunk.start // page_size]
        prefills.append(PrefillMeta(start, chunk.num_tokens, chunk.end, settled,
                                    upload(chunk_locs, dtype=torch.int64, device=device)))
        start += chunk.num_tokens
    return StepMetadata(nd, decode, prefills, upload(write_loc, device=device),
                        upload(write_off, device=device))


def pid_tensor(seq, device: torch.device) -> torch.Tensor:
    """The sequence's page ids on the device, [len(pids)] int64, made once: pids are fixed from
    admission to the end, and a long context has tens of thousands of them."""
    if seq.pid_tensor is None:
        seq.pid_tensor = upload(seq.pids, dtype=torch.int64, device=device)
    return seq.pid_tensor


def _page_table(chunks: list[Chunk], num_pages: list[int], device: torch.device) -> torch.Tensor:
    """[Bd, P] page ids, P = max pages; a row's padding repeats its page 0 (a valid id)."""
    width = max(num_pages)
    rows = []
    for c, n in zip(chunks, num_pages, strict=True):
        pids = pid_tensor(c.seq, device)
        rows.append(pids[:n] if n == width else torch.cat([pids[:n], pids[:1].expand(width - n)]))
    return torch.stack(rows)


def _decode_meta(chunks: list[Chunk], locs: list[list[int]], page_size: int, num_kv_heads: int,
                 device: torch.device) -> DecodeMeta:
    num_pages = [math.ceil(c.end / page_size) for c in chunks]
    tail_len = [c.end - (n - 1) * page_size for c, n in zip(chunks, num_pages, strict=True)]
    # Rows whose budget covers their context attend every page: no scoring needed.
    groups: dict[int, list[int]] = {}
    for i, (c, n) in enumerate(zip(chunks, num_pages, strict=True)):
        k = c.seq.budget_pages
        if k is not None and n > k:
            groups.setdefault(k, []).append(i)
    scored_rows = {i for rows in groups.values() for i in rows}
    # K: every page of the unscored rows, k of the scored ones (<= the largest page budget).
    width = max([n for i, n in enumerate(num_pages) if i not in scored_rows] + list(groups))
    num_pages_t = upload(num_pages, device=device)
    # Every page of the unscored rows; scored rows start all -1 and get their selection per layer.
    visible = upload([0 if i in scored_rows else n for i, n in enumerate(num_pages)], device=device)
    cols = torch.arange(width, device=device)[None, :]
    all_pages = torch.where(cols < visible[:, None], cols, -1)  # [Bd, K]
    return DecodeMeta(
        page_table=_page_table(chunks, num_pages, device),
        num_pages=num_pages_t,
        num_settled=num_pages_t - 1,
        tail_loc=upload([chunk_locs[-1] for chunk_locs in locs], dtype=torch.int64, device=device),
        tail_len=upload(tail_len, device=device)[:, None, None].repeat(1, num_kv_heads, 1),
        base_sel=all_pages[:, None, :].expand(-1, num_kv_heads, -1).contiguous(),
        scored=[(k, None if len(rows) == len(chunks) else upload(rows, device=device))
                for k, rows in groups.items()],
    )


class PagedAttention:
    """Implements the model's AttentionFn over the engine's paged KV (see the module docstring).

    sink_pages / recent_pages: pages LOCKS always selects (recent_pages >= 1 keeps the open
    page, which has no summary yet, always selected). kernels: one of KERNEL_CHOICES.
    """

    def __init__(self, kv: KVManager, sink_pages: int = 1, recent_pages: int = 2, kernels: str = "auto"):
        if recent_pages < 1:
            raise ValueError(f"recent_pages ({recent_pages}) must be >= 1: the open page has no summary")
        if kernels not in KERNEL_CHOICES:
            raise ValueError(f"kernels ({kernels!r}) must be one of {KERNEL_CHOICES}")
        self.kv, self.sink_pages, self.recent_pages, self.kernels = kv, sink_pages, recent_pages, kernels
        self.meta: StepMetadata | None = None

    def bind(self, meta: StepMetadata) -> None:
        self.meta = meta

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, d]; k, v: [T, Hkv, d] -> o [T, Hq, d]
        meta = self.meta
        self._write(layer, k, v)
        out = []
        if meta.decode is not None:
            out.append(self._decode(layer, q[: meta.num_decode]).to(q.dtype))
        for p in meta.prefills:
            out.append(self._prefill(layer, q[p.token_start : p.token_start + p.num_tokens], p))
        return torch.cat(out) if len(out) > 1 else out[0]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [T, Hkv, d] into write-pool slots [T, Hkv] at offsets [T, 1]
        slots = page_slots(layer, self.kv.write_rows, self.meta.write_loc, self.kv.heads)
        off = self.meta.write_off[:, None]
        self.kv.write_pool[slots, 0, off] = k.to(self.kv.write_pool.dtype)
        self.kv.write_pool[slots, 1, off] = v.to(self.kv.write_pool.dtype)

    def select(self, layer: int, q: torch.Tensor, m: DecodeMeta) -> torch.Tensor:
        """Selected page indices [Bd, Hkv, K] (-1 padding), from q [Bd, Hq, d]."""
        if not m.scored:
            return m.base_sel
        m_bar = score_and_group(q, self.kv.summaries.layers[layer], m.page_table, m.num_settled, self.kernels)
        sel = m.base_sel.clone()
        width = sel.shape[-1]
        for k, rows in m.scored:
            if rows is None:
                chosen = select_pages(m_bar, m.num_pages, k, self.sink_pages, self.recent_pages)
                sel[:, :, :k] = chosen[..., :width]
            else:
                chosen = select_pages(m_bar[rows], m.num_pages[rows], k, self.sink_pages, self.recent_pages)
                sel[rows, :, :k] = chosen[..., :width]
        return sel

    def _decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        # q: [Bd, Hq, d] -> o [Bd, Hq, d] float32
        m, kv = self.meta.decode, self.kv
        sel = self.select(layer, q, m)  # [Bd, Hkv, K]
        settled = (sel >= 0) & (sel < m.num_settled[:, None, None])
        pid = m.page_table.gather(1, sel.clamp_min(0).flatten(1)).view_as(sel)
        # Padding entries read the row's page 0 (the sink, selected anyway) with length 0.
        pid = torch.where(settled, pid, m.page_table[:, :1, None])
        slots = (layer * kv.layout.max_pages + pid) * kv.layout.num_kv_heads + kv.heads[None, :, None]
        pool, idx = kv.gather_selected(slots.flatten())
        lens = settled.to(torch.int64) * kv.layout.page_size
        o_settled, lse_settled = sparse_decode(q, pool, idx.view_as(sel), lens, self.kernels)
        tail = page_slots(layer, kv.write_rows, m.tail_loc, kv.heads)[..., None]  # [Bd, Hkv, 1]
        o_open, lse_open = sparse_decode(q, kv.write_pool, tail, m.tail_len, self.kernels)
        o, _ = merge_partials(torch.stack([o_settled, o_open]), torch.stack([lse_settled, lse_open]))
        return o

    def _prefill(self, layer: int, q: torch.Tensor, p: PrefillMeta) -> torch.Tensor:
        # q: [n, Hq, d] -> o [n, Hq, d]: causal over the sequence's `p.length` tokens
        kv, lay = self.kv, self.kv.layout
        parts = []
        if p.settled_pids.numel():
            slots = page_slots(layer, lay.max_pages, p.settled_pids, kv.heads).flatten()
            parts.append(kv.settled.read(slots))
        open_slots = page_slots(layer, kv.write_rows, p.locs, kv.heads).flatten()
        parts.append(kv.write_pool.index_select(0, open_slots))
        pages = torch.cat(parts).view(-1, lay.num_kv_heads, 2, lay.page_size, lay.head_dim)
        kv_tokens = pages.permute(2, 0, 3, 1, 4).reshape(2, -1, lay.num_kv_heads, lay.head_dim)
        keys, values = kv_tokens[0, : p.length], kv_tokens[1, : p.length]  # [length, Hkv, d]
        return prefill_attention(q, keys.to(q.dtype), values.to(q.dtype))
