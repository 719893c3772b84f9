"""How fast the NVMe tier moves a decode step's pages, by I/O thread count.

A diagnostic, not part of the package. host+nvme promotes and spills about a hundred 4 KiB pages
per decode step (SmolLM2 at 128K): reads at random NVMe slots, and writes that land on random
slots (the LIFO slot allocator before 2d68a6f) or on one stretch (the RunAllocator since). For
each I/O thread count this times NvmeTier.read of `--pages` random stored slots, and
NvmeTier.write of as many pages to random and to consecutive free slots; medians over
`--repeats` batches, in ms a batch and us a page.

    python scripts/nvme_io_probe.py --dir /tmp/nvme-probe --out nvme_io.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.offload.arena import PageGeometry  # noqa: E402
from lockserve.offload.nvme import NvmeTier  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def time_batches(tier: NvmeTier, pages: torch.Tensor, stored: int, free: range, repeats: int,
                 rng: random.Random) -> dict:
    """Medians (ms a batch) of a random read, a random write and a consecutive write."""
    n, reads, scattered, consecutive = pages.shape[0], [], [], []
    for r in range(repeats):
        want = rng.sample(range(stored), n)
        t = time.perf_counter()
        tier.read(want)
        reads.append(time.perf_counter() - t)
        for slots, out in ((rng.sample(free, n), scattered), (list(free[r * n : (r + 1) * n]), consecutive)):
            t = time.perf_counter()
            tier.write(slots, pages)
            out.append(time.perf_counter() - t)
            tier.discard(slots)
    named = {"read_random_ms": reads, "write_random_ms": scattered, "write_consecutive_ms": consecutive}
    return {name: statistics.median(v) * 1e3 for name, v in named.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default="/tmp/lockserve-nvme-probe")
    ap.add_argument("--pages", type=int, default=128, help="pages a batch (a decode step's promotions)")
    ap.add_argument("--stored", type=int, default=65536, help="pages written first, read back at random")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    geometry = PageGeometry(16, 64, torch.float16)  # SmolLM2's page: 4 KiB
    pages = torch.randn(args.pages, *geometry.page_shape).to(geometry.dtype)
    rows = []
    for threads in args.threads:
        path = os.path.join(args.dir, f"t{threads}")
        num_slots = args.stored + args.pages * (args.repeats + 1) * 4
        tier = NvmeTier(geometry, path, num_slots, io_threads=threads, verify_on_open=False)
        try:
            fill = torch.randn(4096, *geometry.page_shape).to(geometry.dtype)
            for start in range(0, args.stored, 4096):
                tier.write(list(range(start, min(start + 4096, args.stored))), fill[: args.stored - start])
            free = range(args.stored, num_slots)
            row = {"threads": threads, "direct_io": tier.direct_io,
                   **time_batches(tier, pages, args.stored, free, args.repeats, random.Random(threads))}
        finally:
            tier.close()
            shutil.rmtree(path, ignore_errors=True)
        for key in ("read_random", "write_random", "write_consecutive"):
            row[f"{key}_us_per_page"] = row[f"{key}_ms"] * 1e3 / args.pages
        rows.append(row)
        print(json.dumps(row))
    result = {**run_provenance(command_line("scripts/nvme_io_probe.py"), "cpu"), "cpu_count": os.cpu_count(),
              "pages": args.pages, "page_bytes": geometry.slot_bytes,
              "repeats": args.repeats, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
