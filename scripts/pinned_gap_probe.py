"""Does registered (pinned, mapped) host memory slow a CUDA graph's kernel-to-kernel gaps?

A diagnostic, not part of the package. It captures a graph of small kernels (no kernel touches
host memory), times its replays, then times them again while host memory of various sizes and
kinds is pinned: a shared-memory mapping registered with cudaHostRegister (what the host arena
does), the same after a kernel read it through UVA, torch's pinned allocator, and an anonymous
mapping with transparent huge pages. Each state is timed between two baselines.

    python scripts/pinned_gap_probe.py --gib 3 --out probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import tempfile

import torch
from graph_timing import replay_times

from lockserve.provenance import command_line, run_provenance

MAPPED = 2  # cudaHostRegisterMapped
MADV_HUGEPAGE = 14


def build_graph(kernels: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    x = torch.zeros(4096, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    m = torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):  # warm the kernels outside the capture
            x.add_(1.0)
            m = torch.tanh(m @ w)
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=s):
            for i in range(kernels // 2):
                x.add_(1.0)
                m = torch.tanh(m @ w) if i % 2 else m @ w
    torch.cuda.synchronize()
    return g, x


def time_replays(g: torch.cuda.CUDAGraph, reps: int) -> dict:
    """Median and min over `reps` replays, each timed by events around it (ms)."""
    times = replay_times(g, reps)
    return {"median_ms": statistics.median(times), "min_ms": min(times)}


def register(ptr: int, nbytes: int) -> None:
    rc = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, MAPPED)
    if int(getattr(rc, "value", rc)) != 0:
        raise RuntimeError(f"cudaHostRegister returned {rc}")


def unregister(ptr: int) -> None:
    rc = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(getattr(rc, "value", rc)) != 0:
        raise RuntimeError(f"cudaHostUnregister returned {rc}")


def shm_mapping(nbytes: int) -> tuple[mmap.mmap, str]:
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="gapprobe-")
    os.posix_fallocate(fd, 0, nbytes)
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
    os.close(fd)
    return mm, path


def address(mm: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def uva_touch(ptr: int, nbytes: int, write: bool = False) -> None:
    """A device kernel reads (or writes) 1 MiB spread over the mapping through UVA (as the hot cache
    reads and the write-backs write)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _read(src, out, stride, BLOCK: tl.constexpr, WRITE: tl.constexpr):
        i = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        if WRITE:
            tl.store(src + i * stride + offs, tl.load(out + i * BLOCK + offs))
        else:
            tl.store(out + i * BLOCK + offs, tl.load(src + i * stride + offs))

    class _Ptr:
        def __init__(self, p):
            self.p = p
            self.dtype = torch.int32

        def data_ptr(self):
            return self.p

    rows, block = 256, 1024
    out = torch.empty(rows * block, dtype=torch.int32, device="cuda")
    _read[(rows,)](_Ptr(ptr), out, (nbytes // 4 - block) // rows, BLOCK=block, WRITE=write)
    torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, nargs="+", default=[0.0625, 3.0])
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    g, _ = build_graph(a.kernels)
    time_replays(g, 50)
    rows = []

    def measure(state: str, **extra) -> None:
        r = {"state": state, **extra, **time_replays(g, a.reps)}
        r["us_per_kernel"] = 1000 * r["median_ms"] / a.kernels
        rows.append(r)
        print(json.dumps(r), flush=True)

    measure("baseline")
    for gib in a.gib:
        n = int(gib * 2**30) // 4096 * 4096
        mm, path = shm_mapping(n)
        ptr = address(mm)
        measure("shm mapped, not registered", gib=gib)
        register(ptr, n)
        measure("shm registered", gib=gib)
        uva_touch(ptr, n)
        measure("shm registered, read by a kernel", gib=gib)
        uva_touch(ptr, n, write=True)
        measure("shm registered, written by a kernel", gib=gib)
        unregister(ptr)
        measure("shm unregistered", gib=gib)
        del ptr
        mm.close()
        os.unlink(path)
        t = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        measure("torch pinned", gib=gib)
        del t
        torch._C._host_emptyCache()
        measure("torch pinned freed", gib=gib)
        anon = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        anon.madvise(MADV_HUGEPAGE)
        anon.write(b"\0" * 0)  # pages are touched by the registration
        ptr = address(anon)
        register(ptr, n)
        measure("anonymous THP registered", gib=gib)
        uva_touch(ptr, n)
        measure("anonymous THP registered, read by a kernel", gib=gib)
        unregister(ptr)
        del ptr
        anon.close()
        measure("baseline again", gib=gib)
    with open(a.out, "w") as f:
        json.dump({**run_provenance(command_line("scripts/pinned_gap_probe.py")), "kernels": a.kernels,
                   "reps": a.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
