"""Triton kernel: resolve one decode layer's selection through the host+nvme tier's two device
tables, in one launch (only @triton.jit code here; the torch reference and the launcher are
`spilled_resolve` in spilled.py).
"""

import triton
import triton.language as tl


@triton.jit
def spilled_resolve_kernel(
    slots_ptr,  # [M] int64 engine slots, -1 = nothing to read; non-negative entries distinct
    dev_ids_ptr,  # [num_slots] int64: engine slot -> store id, -1 = never written
    dev_host_ptr,  # [max_pages] int64: store id -> host slot, -1 = not in host memory
    missed_ptr,  # [num_slots] int8: set to 1 where a selected page is on NVMe
    touched_ptr,  # [max_pages] int64: store id -> the clock of the last forward that selected it
    clock_ptr,  # [] int64: forwards run (a device scalar, so a graph replay reads the current one)
    out_ptr,  # [M] int64 host slots, -1 where nothing is read or the page is on NVMe
    M,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < M
    slot = tl.load(slots_ptr + offs, mask=inside, other=-1)
    valid = slot >= 0
    ids = tl.load(dev_ids_ptr + tl.maximum(slot, 0), mask=valid, other=-1)
    written = ids >= 0
    host = tl.load(dev_host_ptr + tl.maximum(ids, 0), mask=written, other=-1)
    missing = written & (host < 0)
    # Distinct slots -> distinct ids: plain stores, no races.
    tl.store(missed_ptr + tl.maximum(slot, 0), tl.full([BLOCK], 1, tl.int8), mask=missing)
    clock = tl.load(clock_ptr)
    tl.store(touched_ptr + tl.maximum(ids, 0), tl.zeros([BLOCK], tl.int64) + clock, mask=written)
    tl.store(out_ptr + offs, tl.where(missing, -1, host), mask=inside)
