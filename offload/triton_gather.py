"""Triton kernel: copy whole KV pages between pools (only @triton.jit code here).

The launcher (`gather.py`) views every pool as 32-bit words, so the kernel is
dtype-agnostic and a page is PAGE_WORDS contiguous words.
"""

import triton
import triton.language as tl


@triton.jit
def gather_pages_kernel(
    src_ptr,  # [S, PAGE_WORDS] words; a device tensor or a host pool mapped under UVA
    dst_ptr,  # [D, PAGE_WORDS] words
    src_idx_ptr,  # [n] int64
    dst_idx_ptr,  # [n] int64; a negative entry skips that page
    PAGE_WORDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    # int64 row offsets: slot * PAGE_WORDS passes 2**31 for pools over 8 GiB.
    src_row = tl.load(src_idx_ptr + pid).to(tl.int64)
    dst_row = tl.load(dst_idx_ptr + pid).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    # PAGE_WORDS is a multiple of 4 (16 bytes), so each thread's 4 words are one vector load.
    offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
    mask = (offs < PAGE_WORDS) & (dst_row >= 0)
    vals = tl.load(src_ptr + src_row * PAGE_WORDS + offs, mask=mask)
    tl.store(dst_ptr + dst_row * PAGE_WORDS + offs, vals, mask=mask)
