"""What bounds a prefix save on this machine: the memory passes, the checksums or the disk.

A diagnostic, not part of the package. The prefix store's writer (workers/engine/prefix_disk.py)
builds a save's records in two passes over their bytes (a gather from the host arena, a copy into
the record), checksums every record (zlib.crc32 on the store's I/O threads) and writes the
segment in parts (pwrite, a writeback hint per part, one fsync). At 32K on an H100 it took
1.09-1.29 s for a 1.19 GB save, and a host+nvme prefill waits for it. This times each of those
passes alone over `--gib` of random bytes, in GB/s:

- gather: index_select of page rows in a random order (the arena read), one thread as the writer;
- copy: the gathered rows into a wider record buffer (the second pass), already touched, and into
  a new one (each 4 KiB page of it then faults in as it is written: what the writer paid for a
  new buffer a part before db54347);
- crc32: one thread, and `--threads` threads at once (zlib lets go of the GIL);
- write: the bytes to one new file in 64 MiB parts, pwrite then fsync, from one thread and from
  `--threads` threads (each its own parts of the file), with and without the writeback hint
  (posix_fadvise DONTNEED per part, as offload/prefix_store.py does).

    python scripts/save_floor_probe.py --dir /tmp/lockserve-save-probe --out save_floor.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.provenance import command_line, run_provenance  # noqa: E402

PART = 64 << 20  # bytes a write part
PAGE = 2 << 20  # bytes a page row of the gather (an 8B page's K/V over its layers: 2 MiB)


def gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def write_file(path: str, data: torch.Tensor, threads: int, hint: bool) -> float:
    """Seconds to write data (uint8 [parts, PART]) to a new file at path and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def part(i: int) -> None:
        view, done, offset = memoryview(data[i].numpy()).cast("B"), 0, i * PART
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
        if hint:
            os.posix_fadvise(fd, offset, PART, os.POSIX_FADV_DONTNEED)

    try:
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(part, range(data.shape[0])))
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/lockserve-save-probe")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=4, help="the store's I/O threads (write_depth)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    parts = max(1, int(args.gib * (1 << 30)) // PART)
    nbytes = parts * PART
    gen = torch.Generator().manual_seed(0)
    arena = torch.randint(0, 256, (nbytes // PAGE, PAGE), dtype=torch.uint8, generator=gen)
    order = torch.randperm(arena.shape[0], generator=gen)
    out = {**run_provenance(command_line("scripts/save_floor_probe.py"), None), "bytes": nbytes,
           "threads": args.threads, "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    gathered = arena.index_select(0, order)  # warm the pages once
    out["gather_gbps"] = gbps(nbytes, timed(lambda: torch.index_select(arena, 0, order, out=gathered)))
    record = torch.empty((arena.shape[0], PAGE + 4096), dtype=torch.uint8)
    record[:, :PAGE] = gathered
    out["copy_gbps"] = gbps(nbytes, timed(lambda: record[:, :PAGE].copy_(gathered)))
    fresh = timed(lambda: torch.empty_like(record)[:, :PAGE].copy_(gathered))
    out["copy_new_buffer_gbps"] = gbps(nbytes, fresh)
    rows = list(gathered.view(parts, PART))
    out["crc32_1_thread_gbps"] = gbps(nbytes, timed(lambda: [zlib.crc32(r.numpy()) for r in rows]))
    with ThreadPoolExecutor(args.threads) as pool:
        out[f"crc32_{args.threads}_threads_gbps"] = gbps(
            nbytes, timed(lambda: list(pool.map(lambda r: zlib.crc32(r.numpy()), rows))))
    os.makedirs(args.dir, exist_ok=True)
    try:
        data = gathered.view(parts, PART)
        for threads in (1, args.threads):
            for hint in (False, True):
                seconds = write_file(os.path.join(args.dir, "probe.bin"), data, threads, hint)
                out[f"write_{threads}_threads_{'hint' if hint else 'nohint'}_gbps"] = gbps(nbytes, seconds)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
