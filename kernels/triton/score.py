"""Launchers for the LOCKS score kernels: validate, pick block sizes, launch.

    score_pages_triton(q, qs, page_table, num_pages)     -> s_hat [Bt, Hkv, G, P]
    share_average_triton(s_hat)                           -> m_bar [..., P]
    score_and_group_triton(q, qs, page_table, num_pages)  -> (s_hat, m_bar [Bt, Hkv, P])

They compute exactly score_pages_ref(q, dequantize_summaries(qs), page_table, num_pages) and
group_scores(s_hat, "share_average") (kernels/score.py), with the same argument conventions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..summary import QuantSummaries, basis_d_order
from .checks import check_runnable, check_tensor, is_interpreted, next_pow2, output
from .score_kernel import group_stats_kernel, row_partials_kernel, score_pages_kernel, share_average_kernel

INDEX_DTYPES = (torch.int32, torch.int64)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_GRID_Y = 65535  # CUDA limit of the second grid dimension (the batch)


@dataclass(frozen=True)
class ScoreTuning:
    """Launch knobs of the score kernel (the benchmark sweeps them). block_p: pages per program,
    a power of two (None: 64, the fastest measured on the H200; docs/notes/score_kernel.md);
    block_d: unused since the kernel projects all of d in one dot per component (kept so that
    recorded configurations still construct); num_warps: 4 lets 64 pages run as one warpgroup
    tensor-core tile."""

    block_p: int | None = None
    block_d: int = 64
    num_warps: int = 4


@dataclass(frozen=True)
class _Geometry:
    bt: int
    hkv: int
    g: int
    d: int
    page: int  # B, tokens per page
    rank: int
    p: int  # padded pages per row (page_table columns)
    num_ids: int


def check_score_inputs(q, qs, page_table, num_pages) -> _Geometry:
    bt, hq, d = check_tensor("q", q, (("Bt", None), ("Hq", None), ("d", None)), Q_DTYPES)
    dev = q.device
    n, hkv = check_tensor("qs.mu_scale", qs.mu_scale, (("N", None), ("Hkv", None)), SCALE_DTYPES, dev)
    if hq % hkv:
        raise ValueError(f"q: query heads Hq ({hq}) must be a multiple of the KV heads Hkv ({hkv})")
    _, _, page, rank = check_tensor(
        "qs.coef_q", qs.coef_q, (("N", n), ("Hkv", hkv), ("B", None), ("r", None)),
        (torch.int8, torch.bfloat16), dev)
    check_tensor("qs.coef_scale", qs.coef_scale, (("N", n), ("Hkv", hkv), ("B", page)), SCALE_DTYPES, dev)
    check_tensor("qs.mu_q", qs.mu_q, (("N", n), ("Hkv", hkv), ("d", d)), (torch.int8, torch.bfloat16), dev)
    check_tensor("qs.basis_scale", qs.basis_scale, (("N", n), ("Hkv", hkv), ("r", rank)), SCALE_DTYPES, dev)
    if qs.basis_bits not in (2, 4, 8):
        raise ValueError(f"qs.basis_bits ({qs.basis_bits}): the Triton score kernel reads 2, 4 or 8 bits")
    if rank & (rank - 1):
        raise ValueError(f"qs: rank r ({rank}) must be a power of two for the Triton score kernel")
    packed = d * qs.basis_bits // 8
    basis_dtype = (torch.int8,) if qs.basis_bits == 8 else (torch.uint8,)
    check_tensor("qs.basis_q", qs.basis_q, (("N", n), ("Hkv", hkv), ("r", rank), ("d*bits/8", packed)),
                 basis_dtype, dev)
    _, p = check_tensor("page_table", page_table, (("Bt", bt), ("P", None)), INDEX_DTYPES, dev)
    check_tensor("num_pages", num_pages, (("Bt", bt),), INDEX_DTYPES, dev)
    if bt > MAX_GRID_Y:
        raise ValueError(f"q: batch Bt ({bt}) must be <= {MAX_GRID_Y} for the score kernel's grid")
    _check_row_strides(qs, rank)
    check_runnable("q", q, score_pages_kernel)
    return _Geometry(bt, hkv, hq // hkv, d, page, rank, p, n)


def _basis_words(basis_q: torch.Tensor) -> torch.Tensor:
    """View each row of packed codes [N, Hkv, r, bytes] as whole int32/int16/int8 words."""
    row_bytes = basis_q.shape[-1] * basis_q.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.int8
    try:
        return basis_q.view(word)
    except RuntimeError as err:
        raise ValueError(
            f"qs.basis_q: expected rows of {row_bytes} contiguous bytes aligned to "
            f"{torch.empty(0, dtype=word).element_size()}, got strides {basis_q.stride()}"
        ) from err


def _check_row_strides(qs: QuantSummaries, rank: int) -> None:
    """The kernel loads a page's r coefficient codes (one key) and r basis scales as one vector, so
    their row strides must be multiples of r (true of any table with contiguous rows)."""
    for name, t, dim in (("qs.coef_q", qs.coef_q, 1), ("qs.coef_q", qs.coef_q, 2),
                         ("qs.basis_scale", qs.basis_scale, 1)):
        if t.stride(dim) % rank or t.stride(-1) != 1:
            raise ValueError(f"{name}: expected strides with the last dim contiguous and dim {dim} a "
                             f"multiple of r ({rank}), got {t.stride()}")


@functools.cache
def _positions(d: int, bits: int, device: torch.device) -> torch.Tensor:
    """int32 [d]: where dimension d sits in a stored basis row (the inverse of basis_d_order)."""
    order = basis_d_order(d, bits)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(d)
    return pos.to(device=device, dtype=torch.int32)


def _code_constants(q_dtype: torch.dtype, bits: int) -> dict:
    """Dot dtype, float32-q split count and the magic-number constants of the code conversion."""
    dot = tl.float16 if q_dtype == torch.float16 else tl.bfloat16
    splits = 3 if q_dtype == torch.float32 else 1
    if bits == 8:
        return dict(DOT=dot, SPLITS=splits, MAG_SHIFT=0, MAG_XOR=0, BIAS=0.0)
    half = 1 << (bits - 1)
    shift, base = (6, 0x4C00) if dot == tl.float16 else (3, 0x4180)  # 16.0 in fp16 / bf16
    return dict(DOT=dot, SPLITS=splits, MAG_SHIFT=shift, MAG_XOR=(half << shift) | base, BIAS=16.0 + half)


def _launch_score(q, qs, page_table, num_pages, geo: _Geometry, tuning: ScoreTuning, partials: bool,
                  s_hat: torch.Tensor):
    """Fill s_hat [Bt, Hkv, G, P] float32; if partials, return (pmax, psum) [Bt, Hkv, G, NB]."""
    g2 = next_pow2(geo.g)
    block_p = tuning.block_p or 64
    if block_p < 1 or block_p & (block_p - 1):
        raise ValueError(f"block_p ({block_p}) must be a power of two")
    dp = max(16, next_pow2(geo.d))
    nb = triton.cdiv(geo.p, block_p)
    pmax = torch.empty(geo.bt, geo.hkv, geo.g, nb if partials else 1, device=q.device, dtype=torch.float32)
    psum = torch.empty_like(pmax)
    words = _basis_words(qs.basis_q)
    vpw = words.element_size() * 8 // qs.basis_bits
    score_pages_kernel[(nb * geo.hkv, geo.bt)](
        q, words, _positions(geo.d, qs.basis_bits, q.device), qs.basis_scale, qs.coef_q, qs.coef_scale,
        qs.mu_q, qs.mu_scale, page_table, num_pages,
        s_hat, pmax, psum, geo.p, nb, geo.num_ids, 1.0 / math.sqrt(geo.d),
        *q.stride(), *words.stride(), *qs.basis_scale.stride(), *qs.coef_q.stride(),
        *qs.coef_scale.stride(), *qs.mu_q.stride(), *qs.mu_scale.stride(), *page_table.stride(),
        HKV=geo.hkv, G=geo.g, G2=g2, GP=max(16, g2), D=geo.d, DP=dp,
        B=geo.page, BB=next_pow2(geo.page), R=geo.rank, VPW=vpw, BITS=qs.basis_bits,
        **_code_constants(q.dtype, qs.basis_bits), UPCAST=is_interpreted(score_pages_kernel),
        BLOCK_P=block_p, BLOCK_M=max(16, block_p), PARTIALS=partials, num_warps=tuning.num_warps,
    )
    return pmax, psum


def score_pages_triton(
    q: torch.Tensor, qs: QuantSummaries, page_table: torch.Tensor, num_pages: torch.Tensor,
    tuning: ScoreTuning = ScoreTuning(),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. 4 from quantised summaries. q: [Bt, Hq, d] float32/bf16/fp16; qs: table with leading
    dims [N, Hkv]; page_table: [Bt, P] int32/int64 ids (entries at or past num_pages[b] ignored;
    ids outside [0, N) score -inf); num_pages: [Bt]. Returns s_hat [Bt, Hkv, G, P] float32
    (written into out if given)."""
    geo = check_score_inputs(q, qs, page_table, num_pages)
    s_hat = output("out", out, (geo.bt, geo.hkv, geo.g, geo.p), q.device)
    if s_hat.numel():
        _launch_score(q, qs, page_table, num_pages, geo, tuning, False, s_hat)
    return s_hat


def score_and_group_triton(
    q: torch.Tensor, qs: QuantSummaries, page_table: torch.Tensor, num_pages: torch.Tensor,
    tuning: ScoreTuning = ScoreTuning(),
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores and their share-average in two kernels; the second reads only s_hat and the score
    kernel's per-block partials, never the summaries. Returns s_hat [Bt, Hkv, G, P] and
    m_bar [Bt, Hkv, P] float32 (= group_scores(s_hat, "share_average")), into out if given."""
    geo = check_score_inputs(q, qs, page_table, num_pages)
    s_out, m_out = out if out is not None else (None, None)
    s_hat = output("out[0] (s_hat)", s_out, (geo.bt, geo.hkv, geo.g, geo.p), q.device)
    m_bar = output("out[1] (m_bar)", m_out, (geo.bt, geo.hkv, geo.p), q.device)
    if s_hat.numel():
        pmax, psum = _launch_score(q, qs, page_table, num_pages, geo, tuning, True, s_hat)
        rows = s_hat.view(geo.bt * geo.hkv, geo.g, geo.p)  # [Bt * Hkv, G, P]
        launch_share_average(rows, pmax, psum, m_bar.view(geo.bt * geo.hkv, geo.p))
    return s_hat, m_bar


def share_average_triton(s_hat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 5: m_bar = mean_g softmax_P(s_hat). s_hat: [..., G, P] float32 (-inf = padding) ->
    m_bar [..., P] float32 (into out if given); a row with no finite score gets zeros."""
    if s_hat.dim() < 2:
        raise ValueError(f"s_hat: expected float32 [..., G, P], got {tuple(s_hat.shape)}")
    *lead, g, p = s_hat.shape
    rows = s_hat.reshape(-1, g, p)  # [ROWS, G, P]
    check_tensor("s_hat", rows, (("ROWS", None), ("G", g), ("P", p)), (torch.float32,))
    check_runnable("s_hat", s_hat, share_average_kernel)
    m_bar = output("out", out, (*lead, p), s_hat.device)
    if rows.numel() == 0:
        return m_bar.zero_()
    if rows.shape[0] > MAX_GRID_Y:
        raise ValueError(f"s_hat: rows prod(...) ({rows.shape[0]}) must be <= {MAX_GRID_Y}")
    g2 = next_pow2(g)
    block_m = max(16, 1024 // g2)
    nb = triton.cdiv(p, block_m)
    pmax = torch.empty(rows.shape[0], g, nb, device=s_hat.device, dtype=torch.float32)
    psum = torch.empty_like(pmax)
    row_partials_kernel[(nb, rows.shape[0])](
        rows, pmax, psum, p, nb, *rows.stride(), G=g, G2=g2, BLOCK_M=block_m
    )
    launch_share_average(rows, pmax, psum, m_bar.view(rows.shape[0], p))
    return m_bar


def launch_share_average(rows: torch.Tensor, pmax: torch.Tensor, psum: torch.Tensor, m_bar: torch.Tensor):
    """rows: s_hat [ROWS, G, P]; pmax, psum: [ROWS, G, NB]; fills m_bar [ROWS, P]."""
    n_rows, g, p = rows.shape
    if n_rows > MAX_GRID_Y:
        raise ValueError(f"share-average rows Bt * Hkv ({n_rows}) must be <= {MAX_GRID_Y}")
    g2 = next_pow2(g)
    block_m = max(16, 1024 // g2)
    # Every program re-reads all NB partials of its row (from L2), so give each a long span of
    # pages: about 256 programs fill an H200 (132 SMs) while the re-reads stay a few MB.
    span = block_m * max(1, triton.cdiv(triton.cdiv(p * n_rows, 256), block_m))
    share_average_kernel[(triton.cdiv(p, span), n_rows)](
        rows, pmax, psum, m_bar, p, pmax.shape[-1], span, *rows.stride(),
        G=g, G2=g2, BLOCK_M=block_m, BLOCK_NB=max(16, 512 // g2),
    )


def group_stats_triton(pmax: torch.Tensor, psum: torch.Tensor) -> torch.Tensor:
    """Merge a score kernel's per-block partials into each head's softmax normaliser.
    pmax, psum: [..., G, NB] float32 contiguous -> stats [..., G, 2] = (max, sum of exp(s - max))
    (kernels/score.py group_stats_ref of the scores the partials came from)."""
    check_runnable("pmax", pmax, group_stats_kernel)
    if pmax.shape != psum.shape or pmax.dtype != torch.float32 or psum.dtype != torch.float32 \
            or not (pmax.is_contiguous() and psum.is_contiguous()):
        raise ValueError(f"pmax, psum: expected contiguous float32 tensors of one shape, got "
                         f"{tuple(pmax.shape)} {pmax.dtype}, {tuple(psum.shape)} {psum.dtype}")
    stats = torch.empty((*pmax.shape[:-1], 2), device=pmax.device, dtype=torch.float32)
    rows, nb = stats.numel() // 2, pmax.shape[-1]
    if rows:
        group_stats_kernel[(rows,)](pmax, psum, stats, nb, BLOCK=min(1024, next_pow2(nb)))
    return stats


def score_stats_triton(q: torch.Tensor, qs: QuantSummaries, page_table: torch.Tensor, num_pages: torch.Tensor,
                       tuning: ScoreTuning = ScoreTuning()) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores (Eq. 4) and each head's softmax normaliser over the pages: (s_hat [Bt, Hkv, G, P],
    stats [Bt, Hkv, G, 2]) float32; arguments as score_pages_triton."""
    geo = check_score_inputs(q, qs, page_table, num_pages)
    s_hat = output("s_hat", None, (geo.bt, geo.hkv, geo.g, geo.p), q.device)
    if not s_hat.numel():
        return s_hat, torch.zeros((geo.bt, geo.hkv, geo.g, 2), device=q.device)
    pmax, psum = _launch_score(q, qs, page_table, num_pages, geo, tuning, True, s_hat)
    return s_hat, group_stats_triton(pmax, psum)
