"""What the summary build of one prefill chunk costs with each eigensolver choice.

    python scripts/eigh_sweep.py --out eigh_sweep.json

The build is `build_summaries` (kernels/summary.py) on keys of one prefill chunk's pages at a
model's shape ([L, pages, Hkv, B, d]: 8,192 tokens of Llama-3.1-8B are 512 pages, 131,072 16 x 16
Gram matrices). Rows:
- torch.linalg.eigh in calls of EIGH_CHUNK matrices, for each --chunks value (the module constant
  is set for the row, then restored);
- the Triton Jacobi kernel, one launch over all matrices.
Per row: the median and min wall time of --repeats builds (each synchronised, after one warm-up
build), and the peak of GPU memory the build allocated above what was allocated before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.kernels import summary  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def timed_build(keys: torch.Tensor, rank: int, eigh: str, repeats: int) -> dict:
    """Wall times of `repeats` builds (one warm-up first) and the build's peak extra memory."""
    summary.build_summaries(keys, rank, eigh)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        summary.build_summaries(keys, rank, eigh)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - before
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "min_ms": round(min(times) * 1e3, 2),
            "peak_extra_gib": round(peak / 2**30, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="Llama-3.1-8B: 32")
    ap.add_argument("--kv-heads", type=int, default=8, help="Llama-3.1-8B: 8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=512, help="pages a build holds (8,192 tokens: 512)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = summary.LocksConfig()
    gen = torch.Generator(device="cuda").manual_seed(0)
    keys = torch.randn(args.layers, args.pages, args.kv_heads, cfg.page_size, args.head_dim,
                       generator=gen, device="cuda", dtype=torch.bfloat16)  # [L, M, Hkv, B, d]
    matrices = args.layers * args.pages * args.kv_heads
    result = {**run_provenance(command_line("scripts/eigh_sweep.py"), "cuda"), "kind": "eigh sweep",
              "matrices": matrices, "shape": list(keys.shape), "rows": []}
    saved = summary.EIGH_CHUNK
    try:
        for chunk in args.chunks:
            summary.EIGH_CHUNK = chunk
            timing = timed_build(keys, cfg.rank, "torch", args.repeats)
            row = {"solver": "torch", "eigh_chunk": chunk, **timing}
            result["rows"].append(row)
            print(row, flush=True)
    finally:
        summary.EIGH_CHUNK = saved
    row = {"solver": "jacobi", "eigh_chunk": None, **timed_build(keys, cfg.rank, "jacobi", args.repeats)}
    result["rows"].append(row)
    print(row, flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
