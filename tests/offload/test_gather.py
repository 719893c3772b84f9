"""Triton page gather against the torch reference (TRITON_INTERPRET=1 on CPU, or CUDA)."""

from __future__ import annotations

import mmap

import pytest
import torch
from lockserve.offload.arena import PageGeometry
from lockserve.offload.gather import (
    HostPool,
    gather_pages,
    gather_pages_reference,
    gather_pages_triton,
)

from tests.conftest import triton_devices
from tests.offload.conftest import bits

DEVICES = triton_devices()
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")


def pages(n: int, d: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, 2, 16, d), generator=g).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("n", [1, 7, 97])
def test_triton_gather_matches_reference(device, dtype, d, n):
    src = pages(131, d, dtype, seed=n + d, device=device)
    dst, ref = (torch.zeros(113, 2, 16, d, dtype=dtype, device=device) for _ in range(2))
    g = torch.Generator().manual_seed(n)
    src_idx = torch.randint(0, 131, (n,), generator=g).to(device)  # repeats allowed on the source side
    # distinct destinations, always including the last row of dst
    dst_idx = torch.cat([torch.randperm(112, generator=g)[: n - 1], torch.tensor([112])])
    dst_idx = dst_idx[torch.randperm(n, generator=g)].to(device)
    src_idx[0] = 130  # the last row of src
    gather_pages_triton(src, src_idx, dst, dst_idx)
    gather_pages_reference(src, src_idx, ref, dst_idx)
    assert torch.equal(bits(dst), bits(ref)), f"{dtype} d={d} n={n}"
    assert torch.equal(bits(dst[dst_idx]), bits(src[src_idx]))


@pytest.mark.parametrize("device", DEVICES)
def test_negative_dst_index_skips_the_page(device):
    src = pages(10, 64, torch.float16, seed=1, device=device)
    dst = torch.full((6, 2, 16, 64), 7.0, dtype=torch.float16, device=device)
    src_idx = torch.tensor([1, 2, 3, 4], device=device)
    dst_idx = torch.tensor([0, -1, 5, -1], device=device)
    expected = dst.clone()
    expected[[0, 5]] = src[[1, 3]]
    gather_pages_triton(src, src_idx, dst, dst_idx)
    assert torch.equal(dst, expected)
    ref = torch.full_like(dst, 7.0)
    gather_pages_reference(src, src_idx, ref, dst_idx)
    assert torch.equal(ref, expected)


def sparse_pool(tmp_path, num_pages: int, geometry: PageGeometry):
    """A pool of num_pages backed by a sparse file: only touched pages take memory or disk."""
    nbytes = num_pages * geometry.slot_bytes
    with open(tmp_path / "sparse-pool.bin", "w+b") as f:
        f.truncate(nbytes)
        mm = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED)
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    return flat.view(geometry.dtype).view(num_pages, *geometry.page_shape)


@pytest.mark.skipif("cpu" not in DEVICES, reason="the sparse host pool is a CPU tensor")
def test_offsets_past_2_pow_31_words(tmp_path):
    """Rows whose word offset slot * 2048 exceeds 2**31 (a pool over 8 GiB): int64 maths needed."""
    geometry = PageGeometry(16, 128, torch.bfloat16)  # 2048 32-bit words per page
    num_pages = (2**31) // 2048 + 4096  # 8 GiB + 32 MiB of address space, a few pages touched
    pool = sparse_pool(tmp_path, num_pages, geometry)
    far = torch.tensor([num_pages - 1, num_pages - 3, 2**31 // 2048 + 1, 5])
    pool[far] = pages(4, 128, torch.bfloat16, seed=7)
    dst = torch.zeros(6, 2, 16, 128, dtype=torch.bfloat16)
    gather_pages_triton(pool, far, dst, torch.tensor([5, 0, 2, 3]))
    assert torch.equal(bits(dst[[5, 0, 2, 3]]), bits(pool[far]))
    # and the other direction: scatter into the far rows
    new = pages(2, 128, torch.bfloat16, seed=8)
    gather_pages_triton(new, torch.tensor([0, 1]), pool, torch.tensor([num_pages - 2, 2**31 // 2048]))
    assert torch.equal(bits(pool[[num_pages - 2, 2**31 // 2048]]), bits(new))


@pytest.mark.parametrize("device", DEVICES)
def test_launcher_names_expected_and_actual(device):
    src = pages(8, 64, torch.float16, seed=0, device=device)
    dst = torch.zeros(8, 2, 16, 64, dtype=torch.float16, device=device)
    idx = torch.arange(3, device=device)
    with pytest.raises(ValueError, match=r"dst: expected dtype torch.float16, got torch.float32"):
        gather_pages_triton(src, idx, dst.float(), idx)
    with pytest.raises(ValueError, match=r"dst: expected shape \(S, 2, 16, 64\), got \(4, 2, 16, 32\)"):
        gather_pages_triton(src, idx, torch.zeros(4, 2, 16, 32, dtype=torch.float16, device=device), idx)
    with pytest.raises(ValueError, match=r"src_idx: expected a 1-D int64 tensor, got \(3,\) torch.int32"):
        gather_pages_triton(src, idx.int(), dst, idx)
    with pytest.raises(ValueError, match=r"dst_idx: expected shape \(3,\), got \(2,\)"):
        gather_pages_triton(src, idx, dst, idx[:2])
    with pytest.raises(ValueError, match="src: expected a contiguous pool"):
        gather_pages_triton(src.transpose(2, 3), idx, dst.transpose(2, 3).contiguous().transpose(2, 3), idx)
    with pytest.raises(ValueError, match="backend"):
        gather_pages(src, idx, dst, idx, backend="cuda")


def test_host_pool_needs_a_cuda_peer():
    src = HostPool(4096, (8, 2, 16, 64), torch.float16)
    dst = torch.zeros(8, 2, 16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="HostPool"):
        gather_pages(src, torch.arange(2), dst, torch.arange(2), backend="torch")
    if "cpu" in DEVICES:
        with pytest.raises(ValueError, match="a HostPool needs a cuda peer tensor, got cpu"):
            gather_pages_triton(src, torch.arange(2), dst, torch.arange(2))
