"""Copy selected pages between pools: `dst[dst_idx[i]] = src[src_idx[i]]`.

Two implementations of one contract:
- `gather_pages_reference`: index_select / index_copy_ (CPU, tests);
- `gather_pages_triton`: the Triton kernel, page by page with 16-byte vector
  loads; `src` or `dst` may be a host pool registered with CUDA (a `HostPool`),
  read or written zero-copy under UVA. Under TRITON_INTERPRET=1 it runs on CPU tensors.

Contract shared by both: pools are contiguous `[S, 2, B, d]` (or `HostPool`s of
that shape) of one dtype; `src_idx`, `dst_idx` are `[n]` int64; an entry with
`dst_idx[i] < 0` is skipped (fixed-size launches with data-dependent work need
no host sync); non-negative `dst_idx` entries are distinct; every `src_idx[i]`
of a kept entry is in range (not checked on the device: that would sync).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton

from .triton_gather import gather_pages_kernel

_WORD = torch.int32
_MAX_BLOCK = 2048  # words per program: 8 KiB, one bf16 d=128 page
_NUM_WARPS = 4


@dataclass(frozen=True)
class HostPool:
    """A pool `[S, 2, B, d]` in host memory registered with CUDA (mapped), seen as a pointer.

    Triton takes any object with `data_ptr()` and `dtype` as a pointer argument;
    under UVA the host address is valid on the device.
    """

    ptr: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.ptr

    def is_contiguous(self) -> bool:
        return True

    def dim(self) -> int:
        return len(self.shape)


Pool = torch.Tensor | HostPool


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def gather_pages_reference(
    src: Pool, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Torch reference: copies src[src_idx[i]] -> dst[dst_idx[i]] for dst_idx[i] >= 0."""
    # src: [S, 2, B, d]; dst: [D, 2, B, d]; src_idx, dst_idx: [n] int64
    if isinstance(src, HostPool):
        raise ValueError("gather_pages_reference: src must be a tensor, got a HostPool (use the Triton path)")
    keep = dst_idx >= 0
    if not bool(keep.all()):  # a host sync on CUDA: the reference is not the hot path
        src_idx, dst_idx = src_idx[keep], dst_idx[keep]
    pages = src.index_select(0, src_idx.to(src.device))
    dst.index_copy_(0, dst_idx.to(dst.device), pages.to(dst.device))


def _describe(x: Pool) -> str:
    if isinstance(x, HostPool):
        return f"HostPool{tuple(x.shape)} {x.dtype}"
    return f"{tuple(x.shape)} {x.dtype} on {x.device}"


def check_pool(name: str, x: Pool, page_shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(x, (torch.Tensor, HostPool)):
        raise ValueError(f"{name}: expected a tensor or HostPool, got {type(x).__name__}")
    if len(x.shape) != 4 or tuple(x.shape[1:]) != page_shape:
        raise ValueError(
            f"{name}: expected shape (S, {', '.join(map(str, page_shape))}), got {tuple(x.shape)}"
        )
    if x.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {x.dtype}")
    if isinstance(x, torch.Tensor):
        if not x.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous pool, got strides {x.stride()}")
        if x.device != device:
            raise ValueError(f"{name}: expected device {device}, got {x.device}")


def _check_index(name: str, idx: torch.Tensor, n: int, device: torch.device) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.dim() != 1:
        got = f"{tuple(idx.shape)} {idx.dtype}" if isinstance(idx, torch.Tensor) else type(idx).__name__
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {got}")
    if idx.numel() != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(idx.shape)}")
    if idx.device != device or idx.stride(0) != 1:
        raise ValueError(
            f"{name}: expected a contiguous tensor on {device}, got {idx.device} stride {idx.stride()}"
        )


def _kernel_device(src: Pool, dst: Pool) -> torch.device:
    tensors = [x for x in (src, dst) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("gather_pages_triton: src and dst are both HostPools; one must be a device tensor")
    return tensors[0].device


def word_view(x: Pool, page_words: int):
    """The pool viewed as `[S, page_words]` 32-bit words (same memory)."""
    if isinstance(x, HostPool):
        return HostPool(x.ptr, (x.shape[0], page_words), _WORD)
    return x.view(x.shape[0], -1).view(_WORD)


def gather_pages_triton(src: Pool, src_idx: torch.Tensor, dst: Pool, dst_idx: torch.Tensor) -> None:
    """Triton gather (see the module docstring for the contract); validates, then launches."""
    # src: [S, 2, B, d]; dst: [D, 2, B, d]; src_idx, dst_idx: [n] int64
    device = _kernel_device(src, dst)
    if device.type == "cpu" and not _interpreting():
        raise ValueError("gather_pages_triton: CPU tensors need TRITON_INTERPRET=1 (or use the reference)")
    if isinstance(src, HostPool) or isinstance(dst, HostPool):
        if device.type != "cuda":
            raise ValueError(f"gather_pages_triton: a HostPool needs a cuda peer tensor, got {device}")
    page_shape = tuple(src.shape[1:])  # dst must match src's page shape and dtype
    check_pool("src", src, page_shape, src.dtype, device)
    check_pool("dst", dst, page_shape, src.dtype, device)
    n = src_idx.numel() if isinstance(src_idx, torch.Tensor) else -1
    _check_index("src_idx", src_idx, n, device)
    _check_index("dst_idx", dst_idx, n, device)
    page_bytes = src.dtype.itemsize * page_shape[0] * page_shape[1] * page_shape[2]
    if page_bytes % 16:
        raise ValueError(f"page bytes ({page_bytes}) must be a multiple of 16 for vector loads")
    if n == 0:
        return
    page_words = page_bytes // _WORD.itemsize
    block = min(triton.next_power_of_2(page_words), _MAX_BLOCK)
    grid = (n, triton.cdiv(page_words, block))
    # Launch on the tensors' GPU, whatever the current device is.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _launch(src, dst, src_idx, dst_idx, page_words, block, grid)


def _launch(src, dst, src_idx, dst_idx, page_words: int, block: int, grid: tuple) -> None:
    gather_pages_kernel[grid](
        word_view(src, page_words),
        word_view(dst, page_words),
        src_idx,
        dst_idx,
        PAGE_WORDS=page_words,
        BLOCK=block,
        num_warps=_NUM_WARPS,
    )


def gather_pages(
    src: Pool, src_idx: torch.Tensor, dst: Pool, dst_idx: torch.Tensor, backend: str = "auto"
) -> None:
    """Copy src[src_idx[i]] -> dst[dst_idx[i]] (skip dst_idx[i] < 0).

    backend: "triton", "torch" (the reference), or "auto": Triton when a CUDA
    tensor or a HostPool is involved, the reference on CPU.
    """
    if backend == "auto":
        on_cuda = any(isinstance(x, HostPool) or x.device.type == "cuda" for x in (src, dst))
        backend = "triton" if on_cuda else "torch"
    if backend == "triton":
        gather_pages_triton(src, src_idx, dst, dst_idx)
    elif backend == "torch":
        gather_pages_reference(src, src_idx, dst, dst_idx)
    else:
        raise ValueError(f"backend ({backend!r}) must be 'auto', 'triton' or 'torch'")
