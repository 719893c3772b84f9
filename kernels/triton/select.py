"""Launcher of the decode selection: a chunked top-k and the slots (two launches, no sort).

    decode_selection_triton(scores, rows, k, sink, recent, hkv, page_size, where, radix_bits)
        -> DecodeSelection
    shard_chunk_topk_triton(s_hat, stats, first_page, num_settled, num_pages, k, sink, recent,
        radix_bits) -> (keys, columns): a context-parallel rank's candidates, one launch
    shard_candidates_triton(keys, columns, first_page, t, radix_bits) -> [Bt, Hkv, t] order keys: the
        rank's best t of those candidates (what crosses the network), one launch
    shard_select_triton(gathered, candidates, take, first_page, count, num_pages, sink, recent)
        -> [Bt, Hkv, sink + recent + t] positions: the rank's share of the global selection, one launch
    shard_slots_triton(sel, first_page, num_pages, tail_len, tail_loc, page_table, where, page_size)
        -> DecodeSelection of those positions in the rank's KV, one launch

Computes kernels/select.py decode_selection_ref exactly (same tie rule: the lower position wins;
ascending positions), whatever radix_bits (RADIX_BITS_CHOICES) the top-k's threshold search uses.
torch.topk took 44 us per layer at 8K pages on the H200 (one block per row).
"""

from __future__ import annotations

import torch
import triton

from ..score import PageScores
from ..select import EMPTY, NO_PAGE, DecodeRows, DecodeSelection, PoolAddress
from .checks import check_runnable, check_tensor, next_pow2
from .select_kernel import (
    chunk_topk_kernel,
    dense_slots_kernel,
    select_slots_kernel,
    shard_candidates_kernel,
    shard_select_kernel,
    shard_slots_kernel,
    shard_topk_kernel,
)

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_GRID_Y = 65535
SLOTS_BLOCK = 128
MIN_CHUNK, MAX_CHUNK, TARGET_CHUNKS = 1024, 4096, 16  # pages per chunk of the first top-k pass
SELECT_TILE = 8192  # elements of shard_select_kernel's compare tiles ([TB, GC], [WB, UC])
# Bits a pass of the top-k's threshold search fixes (select_kernel._take; the launchers'
# radix_bits): 1, the bisection (measured, the default), or 2, packed counts (not yet run on a
# GPU). A radix select with one [N, 2**bits] count a pass ran 2-4 x slower on the H200
# (select_radix_h200.json). Each value compiles its own kernels.
RADIX_BITS_CHOICES = (1, 2)
DEFAULT_RADIX_BITS = 1


def check_radix_bits(radix_bits: int) -> None:
    """ValueError unless radix_bits is one of RADIX_BITS_CHOICES."""
    if radix_bits not in RADIX_BITS_CHOICES:
        raise ValueError(f"radix_bits ({radix_bits!r}) must be one of {RADIX_BITS_CHOICES}")


def check_rows(rows: DecodeRows, device: torch.device) -> tuple[int, int]:
    """Bt and P of the decode rows; ValueError naming the tensor on a bad shape/dtype/device."""
    bt, p = check_tensor("rows.page_table", rows.page_table, (("Bt", None), ("P", None)), INDEX_DTYPES,
                         device)
    for name in ("num_pages", "budgets", "tail_len", "tail_loc"):
        t = getattr(rows, name)
        check_tensor(f"rows.{name}", t, (("Bt", bt),), INDEX_DTYPES, device)
        if t.stride(0) != 1:
            raise ValueError(f"rows.{name}: expected a contiguous tensor, got stride {t.stride()}")
    if p and rows.page_table.stride(1) != 1:
        raise ValueError(
            f"rows.page_table: expected contiguous rows, got strides {rows.page_table.stride()}")
    return bt, p


def decode_selection_triton(scores: PageScores | None, rows: DecodeRows, k: int, sink_pages: int,
                            recent_pages: int, num_kv_heads: int, page_size: int, where: PoolAddress,
                            radix_bits: int = DEFAULT_RADIX_BITS) -> DecodeSelection:
    """scores: s_hat [Bt, Hkv, G, P] and stats [Bt, Hkv, G, 2] (float32, contiguous), or None for
    every page (dense, k >= the pages). Two launches (chunk top-k, select + slots), one if dense.
    radix_bits: bits a pass of the threshold search fixes (RADIX_BITS_CHOICES)."""
    check_radix_bits(radix_bits)
    device = rows.page_table.device
    bt, _ = check_rows(rows, device)
    hkv = num_kv_heads
    if bt * hkv > MAX_GRID_Y:
        raise ValueError(f"rows: Bt * Hkv ({bt * hkv}) must be <= {MAX_GRID_Y}")
    if k < 1:
        raise ValueError(f"k ({k}) must be >= 1")
    check_runnable("rows.page_table", rows.page_table, select_slots_kernel)
    shape = (bt, hkv, k)
    out = tuple(torch.empty(shape, dtype=dt, device=device)
                for dt in (torch.int64, torch.int32, torch.int8, torch.int64))  # slots, lens, open, idx
    if bt:
        common = (rows.page_table.stride(0), where.layer_base, where.write_front, where.write_base)
        tables = (rows.num_pages, rows.tail_len, rows.tail_loc, rows.page_table)
        if scores is None:
            dense_slots_kernel[(triton.cdiv(k, SLOTS_BLOCK), bt * hkv)](
                *tables, *out, k, *common, HKV=hkv, PAGE=page_size, BLOCK=SLOTS_BLOCK)
        else:
            cand_key, cand_pos = _chunk_topk(scores, rows, k, sink_pages, recent_pages, hkv, radix_bits)
            c = cand_key.shape[-1]
            select_slots_kernel[(bt * hkv,)](
                cand_key, cand_pos, rows.budgets, *tables, *out, c, k, *common,
                HKV=hkv, PAGE=page_size, CB=next_pow2(c), KB=next_pow2(k), BITS=radix_bits,
                num_warps=_warps(next_pow2(c)))
    slots, lens, is_open, idx = out
    return DecodeSelection(slots, lens, is_open.view(torch.bool), idx)


def _chunk_topk(scores: PageScores, rows: DecodeRows, k: int, sink: int, recent: int, hkv: int,
                radix_bits: int):
    """The best k keys of every chunk of each row's pages: [Bt * Hkv, NC * k] keys and positions
    (radix_bits checked by the caller)."""
    bt = rows.num_pages.shape[0]
    dev = rows.page_table.device
    f32 = (torch.float32,)
    dims = (("Bt", bt), ("Hkv", hkv), ("G", None), ("P", None))
    _, _, g, p = check_tensor("scores.s_hat", scores.s_hat, dims, f32, dev)
    check_tensor("scores.stats", scores.stats, (("Bt", bt), ("Hkv", hkv), ("G", g), ("2", 2)), f32, dev)
    if not (scores.s_hat.is_contiguous() and scores.stats.is_contiguous()):
        raise ValueError("scores: s_hat and stats must be contiguous")
    ch, nc = _chunking(p, k)
    cand_key = torch.empty((bt * hkv, nc * k), dtype=torch.float32, device=dev)
    cand_pos = torch.empty((bt * hkv, nc * k), dtype=torch.int32, device=dev)
    chunk_topk_kernel[(nc, bt * hkv)](scores.s_hat, scores.stats, rows.num_pages, cand_key, cand_pos, p, k,
                                      nc, sink, recent, HKV=hkv, G=g, CH=ch, BITS=radix_bits,
                                      num_warps=_warps(ch))
    return cand_key, cand_pos


def _chunking(p: int, k: int) -> tuple[int, int]:
    """(pages per chunk, chunks) of the first top-k pass over P pages (a chunk holds >= k)."""
    ch = max(next_pow2(k), min(MAX_CHUNK, max(MIN_CHUNK, next_pow2(triton.cdiv(p, TARGET_CHUNKS)))))
    return ch, triton.cdiv(p, ch)


def shard_chunk_topk_triton(s_hat: torch.Tensor, stats: torch.Tensor, first_page: torch.Tensor,
                            num_settled: torch.Tensor, num_pages: torch.Tensor, k: int, sink_pages: int,
                            recent_pages: int, radix_bits: int = DEFAULT_RADIX_BITS
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A context-parallel rank's competing pages, each chunk's best k (kernels/select.py
    shard_chunk_topk_ref: the same keys; its best k over a row are among these). s_hat
    [Bt, Hkv, G, W] and stats [Bt, Hkv, G, 2] float32 contiguous; first_page, num_settled,
    num_pages: [Bt] int32/int64. Returns (keys [Bt, Hkv, NC * k] float32, columns int32), -inf / -1
    where a chunk has fewer than k. One launch. radix_bits: as decode_selection_triton."""
    check_radix_bits(radix_bits)
    dev = s_hat.device
    bt, hkv, g, w = check_tensor("s_hat", s_hat, (("Bt", None), ("Hkv", None), ("G", None), ("W", None)),
                                 (torch.float32,), dev)
    check_tensor("stats", stats, (("Bt", bt), ("Hkv", hkv), ("G", g), ("2", 2)), (torch.float32,), dev)
    for name, t in (("first_page", first_page), ("num_settled", num_settled), ("num_pages", num_pages)):
        check_tensor(name, t, (("Bt", bt),), INDEX_DTYPES, dev)
    if not (s_hat.is_contiguous() and stats.is_contiguous()):
        raise ValueError("s_hat and stats must be contiguous")
    if k < 1 or bt * hkv > MAX_GRID_Y:
        raise ValueError(f"k ({k}) must be >= 1 and Bt * Hkv ({bt * hkv}) <= {MAX_GRID_Y}")
    check_runnable("s_hat", s_hat, shard_topk_kernel)
    ch, nc = _chunking(max(w, 1), k)
    keys = torch.empty((bt, hkv, nc * k), dtype=torch.float32, device=dev)
    cols = torch.empty((bt, hkv, nc * k), dtype=torch.int32, device=dev)
    if bt:
        shard_topk_kernel[(nc, bt * hkv)](s_hat, stats, first_page, num_settled, num_pages, keys, cols, w, k,
                                          nc, sink_pages, recent_pages, HKV=hkv, G=g, CH=ch,
                                          BITS=radix_bits, num_warps=_warps(ch))
    return keys, cols


def shard_candidates_triton(keys: torch.Tensor, cols: torch.Tensor, first_page: torch.Tensor, t: int,
                            radix_bits: int = DEFAULT_RADIX_BITS) -> torch.Tensor:
    """kernels/select.py local_candidates in one launch (no sort), from shard_chunk_topk_triton's
    (keys [Bt, Hkv, C] float32, columns int32), contiguous; first_page [Bt]. Returns [Bt, Hkv, t]
    int64 order keys of the rank's best t, in ascending position order (the reference's are
    descending: the same set), EMPTY after them. radix_bits: as decode_selection_triton."""
    check_radix_bits(radix_bits)
    dev = keys.device
    bt, hkv, c = check_tensor("keys", keys, (("Bt", None), ("Hkv", None), ("C", None)), (torch.float32,), dev)
    check_tensor("cols", cols, (("Bt", bt), ("Hkv", hkv), ("C", c)), (torch.int32,), dev)
    check_tensor("first_page", first_page, (("Bt", bt),), INDEX_DTYPES, dev)
    if not (keys.is_contiguous() and cols.is_contiguous()):
        raise ValueError("keys and cols must be contiguous")
    if t < 1 or bt * hkv > MAX_GRID_Y:
        raise ValueError(f"t ({t}) must be >= 1 and Bt * Hkv ({bt * hkv}) <= {MAX_GRID_Y}")
    check_runnable("keys", keys, shard_candidates_kernel)
    out = torch.empty((bt, hkv, t), dtype=torch.int64, device=dev)
    if bt * hkv:
        cb = next_pow2(c)
        shard_candidates_kernel[(bt * hkv,)](keys, cols, first_page, out, c, t, EMPTY, NO_PAGE, HKV=hkv,
                                             CB=cb, TB=next_pow2(t), BITS=radix_bits, num_warps=_warps(cb))
    return out


def shard_select_triton(gathered: torch.Tensor, candidates: torch.Tensor, take: torch.Tensor,
                        first_page: torch.Tensor, count: torch.Tensor, num_pages: torch.Tensor,
                        sink_pages: int, recent_pages: int) -> torch.Tensor:
    """kernels/select.py shard_select_ref in one launch (no sort): gathered [R, Bt, Hkv, t] and
    candidates [Bt, Hkv, t] int64 order keys, contiguous; take, first_page, count, num_pages: [Bt]
    int32/int64. Returns [Bt, Hkv, sink + recent + t] int64 global positions ascending, -1 after."""
    dev = candidates.device
    bt, hkv, t = check_tensor("candidates", candidates, (("Bt", None), ("Hkv", None), ("t", None)),
                              (torch.int64,), dev)
    r = check_tensor("gathered", gathered, (("R", None), ("Bt", bt), ("Hkv", hkv), ("t", t)), (torch.int64,),
                     dev)[0]
    for name, x in (("take", take), ("first_page", first_page), ("count", count), ("num_pages", num_pages)):
        check_tensor(name, x, (("Bt", bt),), INDEX_DTYPES, dev)
    if not (gathered.is_contiguous() and candidates.is_contiguous()):
        raise ValueError("gathered and candidates must be contiguous")
    if r < 1 or t < 1 or sink_pages < 0 or recent_pages < 0:
        raise ValueError(f"R ({r}) and t ({t}) must be >= 1, sink_pages ({sink_pages}) and recent_pages "
                         f"({recent_pages}) >= 0")
    check_runnable("candidates", candidates, shard_select_kernel)
    width = sink_pages + recent_pages + t
    out = torch.empty((bt, hkv, width), dtype=torch.int64, device=dev)
    tb, wb = next_pow2(t), next_pow2(width)
    if bt * hkv:
        shard_select_kernel[(bt * hkv,)](
            gathered, candidates, take, first_page, count, num_pages, out, r, bt * hkv, t, EMPTY, NO_PAGE,
            SINK=sink_pages, RECENT=recent_pages, HKV=hkv, TB=tb, WB=wb,
            GC=max(16, min(next_pow2(r * t), SELECT_TILE // tb)), UC=max(16, SELECT_TILE // wb), num_warps=4,
        )  # fmt: skip
    return out


def shard_slots_triton(sel: torch.Tensor, first_page: torch.Tensor, num_pages: torch.Tensor,
                       tail_len: torch.Tensor, tail_loc: torch.Tensor, page_table: torch.Tensor,
                       where: PoolAddress, page_size: int) -> DecodeSelection:
    """kernels/select.py shard_slots_ref in one launch: sel [Bt, Hkv, K] int64 global positions
    (contiguous, -1 padding); first_page, num_pages, tail_len, tail_loc: [Bt] contiguous;
    page_table [Bt, P] with contiguous rows."""
    dev = sel.device
    bt, hkv, k = check_tensor("sel", sel, (("Bt", None), ("Hkv", None), ("K", None)), (torch.int64,), dev)
    check_tensor("page_table", page_table, (("Bt", bt), ("P", None)), INDEX_DTYPES, dev)
    for name, x in (("first_page", first_page), ("num_pages", num_pages), ("tail_len", tail_len),
                    ("tail_loc", tail_loc)):
        check_tensor(name, x, (("Bt", bt),), INDEX_DTYPES, dev)
        if x.stride(0) != 1:
            raise ValueError(f"{name}: expected a contiguous tensor, got stride {x.stride()}")
    if not sel.is_contiguous() or (page_table.shape[1] > 1 and page_table.stride(1) != 1):
        raise ValueError("sel must be contiguous and page_table's rows contiguous")
    if bt * hkv > MAX_GRID_Y:
        raise ValueError(f"sel: Bt * Hkv ({bt * hkv}) must be <= {MAX_GRID_Y}")
    check_runnable("sel", sel, shard_slots_kernel)
    out = tuple(torch.empty((bt, hkv, k), dtype=dt, device=dev)
                for dt in (torch.int64, torch.int32, torch.int8, torch.int64))  # slots, lens, open, idx
    if bt * hkv and k:
        shard_slots_kernel[(triton.cdiv(k, SLOTS_BLOCK), bt * hkv)](
            sel, first_page, num_pages, tail_len, tail_loc, page_table, *out, k, page_table.stride(0),
            where.layer_base, where.write_front, where.write_base, HKV=hkv, PAGE=page_size, BLOCK=SLOTS_BLOCK)
    slots, lens, is_open, idx = out
    return DecodeSelection(slots, lens, is_open.view(torch.bool), idx)


def _warps(elements: int) -> int:
    return 4 if elements <= 1024 else 8 if elements <= 4096 else 16
