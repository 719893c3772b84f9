"""Does a CUDA graph replay slower once more graphs exist in the process? (A GPU diagnostic, not part
of the package.)

A graph of --kernels small kernels (G0) is timed alone, then again after each batch of extra graphs
(--extra kernels each) is captured and replayed once, up to --max-extra graphs; then the extra
graphs are freed and G0 is timed again.

    python scripts/graph_count_probe.py --out graph_count_probe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch
from graph_timing import replay_times

from lockserve.provenance import command_line, run_provenance


def capture(kernels: int, x: torch.Tensor) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            x.add_(1.0)
    g.replay()
    torch.cuda.synchronize()
    return g


def span_ms(g: torch.cuda.CUDAGraph, reps: int) -> float:
    return statistics.median(replay_times(g, reps))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=431)
    p.add_argument("--extra", type=int, default=100)
    p.add_argument("--max-extra", type=int, default=40)
    p.add_argument("--step", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    x = torch.zeros(4096, device="cuda")
    x.add_(1.0)
    g0 = capture(a.kernels, x)
    rows = []

    def measure(extra_graphs: int) -> None:
        ms = span_ms(g0, a.reps)
        rows.append({"extra_graphs": extra_graphs, "extra_nodes": extra_graphs * a.extra, "g0_ms": ms,
                     "g0_us_per_kernel": 1000 * ms / a.kernels})
        print(json.dumps(rows[-1]), flush=True)

    measure(0)
    extra = []
    while len(extra) < a.max_extra:
        extra += [capture(a.extra, x) for _ in range(a.step)]
        measure(len(extra))
    del extra
    gc.collect()
    torch.cuda.synchronize()
    measure(0)
    with open(a.out, "w") as f:
        json.dump({**run_provenance(command_line("scripts/graph_count_probe.py")), "kernels": a.kernels,
                   "extra_kernels": a.extra, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
