"""@triton.jit code for the decode selection around torch.topk (kernels/select.py is the reference).

selection_keys_kernel: group scores -> top-k keys (+inf forced, -inf past the row's pages).
decode_slots_kernel: top-k result -> per selected entry the tier slot to look up, the valid token
count and the attention pool index (the open page's index in the write pool), in one pass.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def selection_keys_kernel(scores_ptr, num_pages_ptr, key_ptr, P, SINK, RECENT,
                          HKV: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(P, BLOCK), Bt * HKV). scores, key: [Bt * HKV, P] contiguous float32."""
    row = tl.program_id(1).to(tl.int64)
    pos = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(num_pages_ptr + row // HKV).to(tl.int32)
    in_row = pos < P
    s = tl.load(scores_ptr + row * P + pos, mask=in_row, other=0.0).to(tl.float32)
    s = tl.where(s != s, 0.0, s)  # NaN -> 0
    s = tl.maximum(s, -3.4028234663852886e38)  # a valid page outranks padding even at -inf
    key = tl.where((pos < SINK) | (pos >= n - RECENT), float("inf"), s)
    key = tl.where(pos < n, key, float("-inf"))
    tl.store(key_ptr + row * P + pos, key, mask=in_row)


@triton.jit
def decode_slots_kernel(
    top_idx_ptr, top_val_ptr, budgets_ptr, num_pages_ptr, tail_len_ptr, tail_loc_ptr, table_ptr,
    slots_ptr, lens_ptr, open_ptr, idx_ptr,
    KT, K, st_b, layer_base, write_front, write_base,
    HKV: tl.constexpr, PAGE: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (cdiv(K, BLOCK), Bt * HKV). top_idx, top_val: [Bt * HKV, KT] (topk of the keys; unused
    when DENSE: entry r is page r); outputs [Bt * HKV, K]: slots int64, lens int32, open int8,
    idx int64. table: [Bt, P] page ids, row stride st_b."""
    row = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = row // HKV
    h = row % HKV
    n = tl.load(num_pages_ptr + b).to(tl.int64)
    if DENSE:
        j = r.to(tl.int64)
        keep = j < n
    else:
        in_top = r < KT
        j = tl.load(top_idx_ptr + row * KT + r, mask=in_top, other=0).to(tl.int64)
        val = tl.load(top_val_ptr + row * KT + r, mask=in_top, other=float("-inf"))
        budget = tl.load(budgets_ptr + b).to(tl.int64)
        keep = in_top & (val > float("-inf")) & (r < budget)
    is_open = keep & (j == n - 1)
    settled = keep & (j != n - 1)
    page0 = tl.load(table_ptr + b * st_b).to(tl.int64)
    pid = tl.load(table_ptr + b * st_b + j, mask=settled, other=0).to(tl.int64)
    pid = tl.where(settled, pid, page0)
    slot = (layer_base + pid) * HKV + h
    tail_len = tl.load(tail_len_ptr + b).to(tl.int32)
    lens = tl.where(is_open, tail_len, tl.where(settled, PAGE, 0))
    tail_loc = tl.load(tail_loc_ptr + b).to(tl.int64)
    open_idx = write_front + (write_base + tail_loc) * HKV + h
    out = row * K + r
    in_k = r < K
    tl.store(slots_ptr + out, slot, mask=in_k)
    tl.store(lens_ptr + out, lens, mask=in_k)
    tl.store(open_ptr + out, is_open.to(tl.int8), mask=in_k)
    tl.store(idx_ptr + out, tl.where(is_open, open_idx, slot), mask=in_k)
