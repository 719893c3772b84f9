"""Public LOCKS ops with device dispatch: the CUDA / Triton kernels where they can run, else the
torch reference.

Every op takes backend="auto" | "cuda" | "triton" | "torch". "auto" runs the kernels on CUDA
tensors and the torch reference on CPU tensors; for scoring it takes the tensor-core CUDA kernel
when it reads the inputs (the shipped summary format, bf16 q: kernels/cuda/score.py) and Triton
otherwise. "cuda" forces the CUDA score kernel (attention has only Triton: "cuda" means Triton
there); "triton" forces the Triton kernels (on CPU that needs TRITON_INTERPRET=1 set before
import: Triton's interpreter, slow, for the kernel tests only). All paths compute the same
function with the same argument conventions (kernels/score.py, attention.py).
"""

from __future__ import annotations

import torch

from .attention import merge_partials, paged_prefill_ref, sparse_decode_ref
from .cuda import score_and_group_cuda, score_pages_cuda, score_unsupported
from .cuda.score import score_partials_cuda
from .fused import add_rms_norm_ref, rope_write_ref, silu_mul_ref
from .score import PageScores, group_scores, group_stats_ref, score_quantized_torch
from .select import (
    DecodeRows,
    DecodeSelection,
    PoolAddress,
    decode_selection_ref,
    local_candidates,
    shard_chunk_topk_ref,
    shard_select_ref,
    shard_slots_ref,
)
from .summary import QuantSummaries
from .triton import (
    add_rms_norm_triton,
    paged_prefill_triton,
    rope_write_triton,
    score_and_group_triton,
    score_pages_triton,
    share_average_triton,
    silu_mul_triton,
    sparse_decode_triton,
)
from .triton.checks import is_interpreted
from .triton.fused import check_add_rms_norm_inputs, check_rope_write_inputs, check_silu_mul_inputs
from .triton.score import check_score_inputs, group_stats_triton, score_stats_triton
from .triton.score_kernel import score_pages_kernel
from .triton.select import (
    DEFAULT_RADIX_BITS,
    check_radix_bits,
    decode_selection_triton,
    shard_candidates_triton,
    shard_chunk_topk_triton,
    shard_select_triton,
    shard_slots_triton,
)

__all__ = [
    "add_rms_norm",
    "decode_selection",
    "shard_candidates",
    "shard_chunk_topk",
    "shard_select",
    "shard_slots",
    "rope_write",
    "score_and_group",
    "score_pages",
    "score_stats",
    "share_average",
    "silu_mul",
    "paged_prefill",
    "sparse_decode",
    "uses_triton",
]


BACKENDS = ("auto", "cuda", "triton", "torch")


def uses_triton(t: torch.Tensor, backend: str = "auto") -> bool:
    """Whether ops on tensors like t run the kernels (CUDA or Triton) under `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend ({backend!r}) must be one of {BACKENDS}")
    if backend == "triton" and not t.is_cuda and not is_interpreted(score_pages_kernel):
        raise ValueError("backend 'triton' on CPU tensors needs TRITON_INTERPRET=1 set before import")
    if backend == "cuda" and not t.is_cuda:
        raise ValueError(f"backend 'cuda' needs CUDA tensors, got a tensor on {t.device}")
    return backend in ("triton", "cuda") or (backend == "auto" and t.is_cuda)


def _score_on_cuda(q, qsummaries, page_table, num_pages, backend: str) -> bool:
    """Whether scoring runs the CUDA kernel: "cuda" insists (ValueError with the reason when it
    can't), "auto" takes it when it can."""
    if backend not in ("auto", "cuda") or not q.is_cuda:
        return False
    check_score_inputs(q, qsummaries, page_table, num_pages)
    why = score_unsupported(q, qsummaries, page_table, num_pages)
    if why is not None and backend == "cuda":
        raise ValueError(f"backend 'cuda': {why}")
    return why is None


def score_pages(
    q: torch.Tensor,
    qsummaries: QuantSummaries,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """LOCKS page scores (Eq. 4) read straight from the quantised summary table.

    q: [Bt, Hq, d] float32/bf16/fp16, query head h reads KV head h // G;
    qsummaries: QuantSummaries with leading dims [N, Hkv] (N page ids);
    page_table: [Bt, P] int32/int64 page ids, entries at or past num_pages[b] ignored;
    num_pages: [Bt] int32/int64.
    Returns s_hat: [Bt, Hkv, G, P] float32, -inf at padding.
    """
    if uses_triton(q, backend):
        if _score_on_cuda(q, qsummaries, page_table, num_pages, backend):
            return score_pages_cuda(q, qsummaries, page_table, num_pages, check=False)
        return score_pages_triton(q, qsummaries, page_table, num_pages)
    return score_quantized_torch(q, qsummaries, page_table, num_pages)


def share_average(s_hat: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Share-average group score (Eq. 5): m_bar = mean_g softmax over pages of s_hat.

    s_hat: [..., G, P] float32 (-inf = padding) -> m_bar: [..., P] float32; a row with no finite
    score gives zeros.
    """
    if uses_triton(s_hat, backend):
        return share_average_triton(s_hat)
    return group_scores(s_hat, "share_average")


def score_and_group(
    q: torch.Tensor,
    qsummaries: QuantSummaries,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """score_pages then share_average, fused on the Triton path (the share-average reads only the
    scores and per-block partials, never the summaries again).

    Same arguments as score_pages. Returns (s_hat [Bt, Hkv, G, P], m_bar [Bt, Hkv, P]) float32.
    """
    if uses_triton(q, backend):
        if _score_on_cuda(q, qsummaries, page_table, num_pages, backend):
            return score_and_group_cuda(q, qsummaries, page_table, num_pages, check=False)
        return score_and_group_triton(q, qsummaries, page_table, num_pages)
    s_hat = score_quantized_torch(q, qsummaries, page_table, num_pages)
    return s_hat, group_scores(s_hat, "share_average")


def score_stats(
    q: torch.Tensor,
    qsummaries: QuantSummaries,
    page_table: torch.Tensor,
    num_pages: torch.Tensor,
    backend: str = "auto",
) -> PageScores:
    """Scores (Eq. 4) and each query head's softmax normaliser over the pages (max, sum exp):
    everything the selection needs (Eq. 5 follows from the two), and what devices holding parts
    of a sequence exchange to select as one. Arguments as score_pages; returns PageScores with
    s_hat [Bt, Hkv, G, P] and stats [Bt, Hkv, G, 2] float32."""
    if uses_triton(q, backend):
        if _score_on_cuda(q, qsummaries, page_table, num_pages, backend):
            s_hat, pmax, psum = score_partials_cuda(q, qsummaries, page_table, num_pages, check=False)
            return PageScores(s_hat, group_stats_triton(pmax, psum))
        return PageScores(*score_stats_triton(q, qsummaries, page_table, num_pages))
    s_hat = score_quantized_torch(q, qsummaries, page_table, num_pages)
    return PageScores(s_hat, group_stats_ref(s_hat))


def sparse_decode(
    q: torch.Tensor,
    pool: torch.Tensor,
    slots: torch.Tensor,
    page_lens: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    out_dtype: torch.dtype = torch.float32,
    first_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact decode attention over the selected pages of each (sequence, KV head).

    q: [Bt, Hq, d]; pool: [S, 2, B, d] bf16/fp16/fp32 (K then V of one page); slots: [Bt, Hkv, K]
    int32/int64 pool slots, -1 = padding; page_lens: [Bt, Hkv, K] valid tokens per selected page
    (0 for padding); scale defaults to 1/sqrt(d); first_start: None or [Bt, Hkv] tokens masked at
    the start of the first selected page (a sliding window beginning inside it).
    Returns o: [Bt, Hq, d] out_dtype (the float32 result rounded once), lse: [Bt, Hq] float32
    (o = 0, lse = -inf for an empty selection). All G query heads of a group attend the same pages.

    NOTE: the Triton kernel masks only the ends of pages. With first_start it attends every column
    but the first, the torch reference attends the first page alone with its start masked (one
    page per (row, KV head): a small gather), and the two merge by log-sum-exp; no host sync.
    """
    if not uses_triton(q, backend):
        o, lse = sparse_decode_ref(q, pool, slots, page_lens, scale, first_start)
        return o.to(out_dtype), lse
    if first_start is None:
        return sparse_decode_triton(q, pool, slots, page_lens, scale, out_dtype=out_dtype)
    first = torch.arange(slots.shape[-1], device=slots.device) == 0  # [K]
    rest = sparse_decode_triton(q, pool, slots, torch.where(first, 0, page_lens), scale)
    head = sparse_decode_ref(q, pool, slots[..., :1], page_lens[..., :1], scale, first_start)
    o, lse = merge_partials(torch.stack([rest[0], head[0]]), torch.stack([rest[1], head[1]]))
    return o.to(out_dtype), lse


def paged_prefill(
    q: torch.Tensor,
    pool: torch.Tensor,
    locs: torch.Tensor,
    base: int,
    num_kv_heads: int,
    length: int,
    scale: float | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a prefill chunk's n queries (the last n of `length` tokens) over the
    sequence's pages where they lie in `pool` (kernels/attention.py paged_prefill_ref: page p, KV
    head h, is slot (base + locs[p]) * num_kv_heads + h). q: [n, Hq, d] -> (o [n, Hq, d] in q's
    dtype, lse [n, Hq] float32). Triton: one launch and a merge, no gather of the prefix."""
    if not uses_triton(q, backend):
        o, lse = paged_prefill_ref(q, pool, locs, base, num_kv_heads, length, scale)
        return o.to(q.dtype), lse
    return paged_prefill_triton(q, pool, locs, base, num_kv_heads, length, scale)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    backend: str = "auto",
    *,
    y_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, one pass over the row.

    x: [T, H] float32/bf16/fp16; residual: [T, H] or None; weight: [H]; one dtype.
    Returns (y, new_residual) [T, H] in x's dtype: new_residual = x + residual (x itself when
    residual is None), y = weight * rms_normalised(new_residual) as workers/model/layers.py RMSNorm.
    Written into y_out / residual_out when given; residual_out=residual updates it in place.
    ("cuda" means Triton here.)
    """
    if uses_triton(x, backend):
        return add_rms_norm_triton(x, residual, weight, eps, y_out, residual_out)
    check_add_rms_norm_inputs(x, residual, weight, y_out, residual_out)
    return add_rms_norm_ref(x, residual, weight, eps, y_out, residual_out)


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    pool: torch.Tensor,
    write_loc: torch.Tensor,
    write_off: torch.Tensor,
    row_base: int,
    backend: str = "auto",
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE on q and k of the fused QKV projection; rotated k and v written into the KV pool.

    qkv: [T, (Hq + 2 Hkv) d]; cos, sin: [T, d/2] float32; pool: [S, 2, B, d]; write_loc,
    write_off: [T] int32/int64 (write_loc < 0: padding, not written); row_base: layer *
    rows_per_layer. Token t, KV head h goes to slot (row_base + write_loc[t]) * Hkv + h at page
    offset write_off[t]. Returns q_rot: [T, Hq, d] in qkv's dtype (into out when given).
    ("cuda" means Triton here.)
    """
    args = (qkv, cos, sin, num_heads, num_kv_heads, pool, write_loc, write_off, row_base)
    if uses_triton(qkv, backend):
        return rope_write_triton(*args, out)
    check_rope_write_inputs(*args, out)
    return rope_write_ref(*args, out)


def silu_mul(
    gate_up: torch.Tensor, backend: str = "auto", *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """SwiGLU's activation: gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I] in its dtype
    (into out when given). The kernel rounds once; the reference rounds silu(gate) first, as eager
    torch does. ("cuda" means Triton here.)"""
    if uses_triton(gate_up, backend):
        return silu_mul_triton(gate_up, out)
    check_silu_mul_inputs(gate_up, out)
    return silu_mul_ref(gate_up, out)


def decode_selection(
    scores: PageScores | None,
    rows: DecodeRows,
    k: int,
    sink_pages: int,
    recent_pages: int,
    num_kv_heads: int,
    page_size: int,
    where: PoolAddress,
    backend: str = "auto",
    radix_bits: int = DEFAULT_RADIX_BITS,
) -> DecodeSelection:
    """One decode layer's page selection with a budget per row, mapped to pool slots (what the
    attention reads). scores: PageScores (score_stats) or None (every page); see kernels/select.py
    decode_selection_ref. Triton: two launches (chunked top-k with Eq. 5 on the fly, select +
    slots), no sort. ("cuda" means Triton here.) radix_bits: bits a pass of the Triton top-k's
    threshold search fixes (triton/select.py RADIX_BITS_CHOICES; the same selection, checked on
    every backend)."""
    check_radix_bits(radix_bits)
    args = (scores, rows, k, sink_pages, recent_pages, num_kv_heads, page_size, where)
    if uses_triton(rows.page_table, backend):
        return decode_selection_triton(*args, radix_bits)
    return decode_selection_ref(*args)


def shard_chunk_topk(
    s_hat: torch.Tensor,
    stats: torch.Tensor,
    first_page: torch.Tensor,
    num_settled: torch.Tensor,
    num_pages: torch.Tensor,
    k: int,
    sink_pages: int,
    recent_pages: int,
    backend: str = "auto",
    radix_bits: int = DEFAULT_RADIX_BITS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-parallel rank's candidates for its best k pages: (keys float32, columns int32)
    [Bt, Hkv, C], -inf / -1 for none; see kernels/select.py shard_chunk_topk_ref (C = W, every
    competing page) and the Triton kernel (one launch, each chunk's best k). The rank's best k
    under (key desc, column asc) are the same from either. radix_bits: as decode_selection."""
    check_radix_bits(radix_bits)
    args = (s_hat, stats, first_page, num_settled, num_pages, k, sink_pages, recent_pages)
    if uses_triton(s_hat, backend):
        return shard_chunk_topk_triton(*args, radix_bits)
    return shard_chunk_topk_ref(*args)


def shard_candidates(keys: torch.Tensor, cols: torch.Tensor, first_page: torch.Tensor, t: int,
                     backend: str = "auto", radix_bits: int = DEFAULT_RADIX_BITS) -> torch.Tensor:
    """A context-parallel rank's best t candidates as order keys [Bt, Hkv, t] (kernels/select.py
    local_candidates; what crosses the network), from shard_chunk_topk's (keys, columns). The
    Triton kernel writes the same set in ascending position order, with no sort; the reference a
    top-k (descending). radix_bits: as decode_selection."""
    check_radix_bits(radix_bits)
    if uses_triton(keys, backend):
        return shard_candidates_triton(keys, cols, first_page, t, radix_bits)
    return local_candidates(keys, first_page, t, cols)


def shard_select(
    gathered: torch.Tensor,
    candidates: torch.Tensor,
    take: torch.Tensor,
    first_page: torch.Tensor,
    count: torch.Tensor,
    num_pages: torch.Tensor,
    sink_pages: int,
    recent_pages: int,
    backend: str = "auto",
) -> torch.Tensor:
    """A context-parallel rank's share of the global selection from every rank's candidates
    (kernels/select.py shard_select_ref: the threshold, then the rank's pages at or above it and
    its forced pages): [Bt, Hkv, sink + recent + t] global positions ascending, -1 after. The
    Triton kernel is one launch with no sort; the reference a dozen small ops and two sorts."""
    args = (gathered, candidates, take, first_page, count, num_pages, sink_pages, recent_pages)
    if uses_triton(candidates, backend):
        return shard_select_triton(*args)
    return shard_select_ref(*args)


def shard_slots(sel: torch.Tensor, first_page: torch.Tensor, num_pages: torch.Tensor, tail_len: torch.Tensor,
                tail_loc: torch.Tensor, page_table: torch.Tensor, where: PoolAddress, page_size: int,
                backend: str = "auto") -> DecodeSelection:
    """Where a context-parallel rank's selected pages (sel [Bt, Hkv, K] global positions, -1
    padding) are in its KV (kernels/select.py shard_slots_ref): slots, lens, is_open and the
    attention-pool index. The Triton kernel is one launch; the reference a dozen small ops."""
    args = (sel, first_page, num_pages, tail_len, tail_loc, page_table, where, page_size)
    if uses_triton(sel, backend):
        return shard_slots_triton(*args)
    return shard_slots_ref(*args)
