"""Launcher of the decode selection: keys kernel, torch.topk, slots kernel (three launches).

    decode_selection_triton(scores, rows, k, sink, recent, hkv, page_size, where) -> DecodeSelection

Computes kernels/select.py decode_selection_ref with the same conventions, except that the
order of the selected entries within a row may differ where keys tie (the set is the same).
"""

from __future__ import annotations

import torch
import triton

from ..select import DecodeRows, DecodeSelection, PoolAddress
from .checks import check_runnable, check_tensor
from .select_kernel import decode_slots_kernel, selection_keys_kernel

INDEX_DTYPES = (torch.int32, torch.int64)
MAX_GRID_Y = 65535
KEYS_BLOCK = 1024
SLOTS_BLOCK = 128


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


def selection_keys_triton(scores: torch.Tensor, num_pages: torch.Tensor, sink: int,
                          recent: int) -> torch.Tensor:
    """kernels/select.py selection_keys. scores: [Bt, Hkv, P] float32 contiguous -> [Bt, Hkv, P]."""
    bt, hkv, p = check_tensor("scores", scores, (("Bt", None), ("Hkv", None), ("P", None)), (torch.float32,))
    if not scores.is_contiguous():
        raise ValueError(f"scores: expected a contiguous tensor, got strides {scores.stride()}")
    check_tensor("num_pages", num_pages, (("Bt", bt),), INDEX_DTYPES, scores.device)
    check_runnable("scores", scores, selection_keys_kernel)
    if bt * hkv > MAX_GRID_Y:
        raise ValueError(f"scores: Bt * Hkv ({bt * hkv}) must be <= {MAX_GRID_Y}")
    key = torch.empty_like(scores)
    if key.numel():
        grid = (triton.cdiv(p, KEYS_BLOCK), bt * hkv)
        selection_keys_kernel[grid](scores, num_pages, key, p, sink, recent, HKV=hkv, BLOCK=KEYS_BLOCK)
    return key


def decode_selection_triton(scores: torch.Tensor | None, rows: DecodeRows, k: int, sink_pages: int,
                            recent_pages: int, num_kv_heads: int, page_size: int,
                            where: PoolAddress) -> DecodeSelection:
    """scores: [Bt, Hkv, P'] float32 group scores, or None for every page (dense, k >= pages)."""
    device = rows.page_table.device
    bt, _ = check_rows(rows, device)
    hkv = num_kv_heads
    if bt * hkv > MAX_GRID_Y:
        raise ValueError(f"rows: Bt * Hkv ({bt * hkv}) must be <= {MAX_GRID_Y}")
    if scores is None:
        top_idx = top_val = rows.num_pages  # unused (DENSE)
        kt = 0
    else:
        check_tensor("scores", scores, (("Bt", bt), ("Hkv", hkv), ("P", None)), (torch.float32,), device)
        key = selection_keys_triton(scores, rows.num_pages, sink_pages, recent_pages)
        top_val, top_idx = torch.topk(key, min(k, key.shape[-1]), dim=-1)
        kt = top_idx.shape[-1]
    check_runnable("rows.page_table", rows.page_table, decode_slots_kernel)
    shape = (bt, hkv, k)
    slots = torch.empty(shape, dtype=torch.int64, device=device)
    lens = torch.empty(shape, dtype=torch.int32, device=device)
    is_open = torch.empty(shape, dtype=torch.int8, device=device)
    idx = torch.empty(shape, dtype=torch.int64, device=device)
    if slots.numel():
        grid = (triton.cdiv(k, SLOTS_BLOCK), bt * hkv)
        decode_slots_kernel[grid](
            top_idx, top_val, rows.budgets, rows.num_pages, rows.tail_len, rows.tail_loc, rows.page_table,
            slots, lens, is_open, idx, kt, k, rows.page_table.stride(0),
            where.layer_base, where.write_front, where.write_base,
            HKV=hkv, PAGE=page_size, DENSE=scores is None, BLOCK=SLOTS_BLOCK,
        )
    return DecodeSelection(slots, lens, is_open.view(torch.bool), idx)
