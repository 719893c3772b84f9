"""What the summary build of one prefill chunk costs with each eigensolver choice.

    python scripts/eigh_sweep.py --out eigh_sweep.json

The build is `build_summaries` (kernels/summary.py) on keys of one prefill chunk's pages at a
model's shape ([L, pages, Hkv, B, d]: 8,192 tokens of Llama-3.1-8B are 512 pages, 131,072 16 x 16
Gram matrices). Rows: the build with each eigensolver (torch: torch.linalg.eigh in calls of
EIGH_CHUNK matrices; jacobi: the Triton kernel as shipped). Solvers: the eigensolvers alone on the
same Gram matrices, torch.linalg.eigh in calls of each --chunks size and the Jacobi kernel at each
--sweeps and --per-program (matrices a program), with its largest error against
torch.linalg.eigh: eigenvalues (relative to the matrix's largest) and the residual |A v - w v| of
its top-8 eigenvectors (relative to the largest eigenvalue). Each: the median and min wall time of
--repeats calls (each synchronised, after one warm-up) and the peak of GPU memory a call allocated
above what was allocated before it.
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
from lockserve.kernels.triton.eigh import eigh_descending_triton  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> dict:
    """Median and min wall time (ms) of `repeats` synchronised calls of fn, after one warm-up, and
    the peak GPU memory (GiB) a call allocated above what was allocated before them."""
    fn()
    sync()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - before if cuda else 0
    return {"median_ms": round(statistics.median(times) * 1e3, 2), "min_ms": round(min(times) * 1e3, 2),
            "peak_extra_gib": round(peak / 2**30, 3)}


def chunked_torch_eigh(gram: torch.Tensor, chunk: int) -> None:
    for part in gram.split(chunk):
        torch.linalg.eigh(part)


def jacobi_error(gram: torch.Tensor, w: torch.Tensor, v: torch.Tensor, rank: int) -> dict:
    """Largest errors over the matrices, relative to each one's largest eigenvalue."""
    ref = torch.cat([torch.linalg.eigh(part)[0] for part in gram.split(summary.EIGH_CHUNK)]).flip(-1)
    scale = ref[:, :1].abs().clamp_min(1e-30)  # [N, 1]
    top = v[:, :, :rank]  # [N, B, r]
    residual = (gram @ top - top * w[:, None, :rank]).norm(dim=1)  # [N, r]
    return {"eigenvalue_error": float(((w - ref).abs() / scale).max()),
            "residual_error": float((residual / scale).max())}


def solver_rows(keys: torch.Tensor, args) -> list[dict]:
    """The eigensolvers alone on the build's Gram matrices."""
    b, d = keys.shape[-2:]
    dev = keys.reshape(-1, b, d).double()
    dev = dev - dev.mean(dim=1, keepdim=True)
    gram = (dev @ dev.transpose(1, 2)).contiguous()  # [N, B, B] float64
    del dev
    rows = [{"solver": "torch", "eigh_chunk": c,
             **timed(lambda c=c: chunked_torch_eigh(gram, c), args.repeats)} for c in args.chunks]
    for sweeps in args.sweeps:
        for mb in args.per_program:
            solve = lambda s=sweeps, m=mb: eigh_descending_triton(gram, s, m)  # noqa: E731
            row = {"solver": "jacobi", "sweeps": sweeps, "per_program": mb, **timed(solve, args.repeats),
                   **jacobi_error(gram, *solve(), summary.LocksConfig().rank)}
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32, help="Llama-3.1-8B: 32")
    ap.add_argument("--kv-heads", type=int, default=8, help="Llama-3.1-8B: 8")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=512, help="pages a build holds (8,192 tokens: 512)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--sweeps", type=int, nargs="+", default=[4, 5, 6, 8, 10])
    ap.add_argument("--per-program", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cfg = summary.LocksConfig()
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run (TRITON_INTERPRET=1)
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(args.layers, args.pages, args.kv_heads, cfg.page_size, args.head_dim,
                       generator=gen, device=device, dtype=torch.bfloat16)  # [L, M, Hkv, B, d]
    matrices = args.layers * args.pages * args.kv_heads
    result = {**run_provenance(command_line("scripts/eigh_sweep.py"), device), "kind": "eigh sweep",
              "matrices": matrices, "shape": list(keys.shape), "rows": []}
    for eigh in ("torch", "jacobi"):
        build = lambda e=eigh: summary.build_summaries(keys, cfg.rank, e)  # noqa: E731
        row = {"solver": eigh, "eigh_chunk": summary.EIGH_CHUNK if eigh == "torch" else None,
               **timed(build, args.repeats)}
        result["rows"].append(row)
        print(row, flush=True)
    result["solvers"] = solver_rows(keys, args)
    for row in result["solvers"]:
        print(row, flush=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
