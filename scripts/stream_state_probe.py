"""Which kernels does the slower replay state slow? (A GPU diagnostic, not part of the package.)

docs/notes/decode_step.md: after a kernel runs on a second stream, or a graph is captured later,
the decode step's graph replays about 0.33 us slower per kernel, while a graph of small torch
kernels does not change. Here three graphs of --kernels kernels each (Triton, torch elementwise,
cuBLAS), all captured before any replay, are timed before and after each stage, in turn: a graph captured
after them (capture), then a kernel on a new side stream (sidestream).

    python scripts/stream_state_probe.py --out stream_state_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from graph_timing import replay_times

from lockserve.provenance import command_line, run_provenance


@triton.jit
def _scale(x, y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y + offs, tl.load(x + offs, mask=mask) * 1.0001, mask=mask)


def captured(body, kernels: int) -> torch.cuda.CUDAGraph:
    body()  # warm outside the capture (Triton compiles, cuBLAS picks its kernel)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            body()
    torch.cuda.synchronize()
    return g  # not replayed: every graph is captured before the first replay


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=400)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    n = 1 << 16
    x, y = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
    w, m = torch.randn(256, 256, device="cuda"), torch.randn(64, 256, device="cuda")
    out = torch.empty(64, 256, device="cuda")
    graphs = {
        "triton": captured(lambda: _scale[(triton.cdiv(n, 1024),)](x, y, n, BLOCK=1024), a.kernels),
        "torch_elementwise": captured(lambda: y.copy_(x).mul_(1.0001), a.kernels // 2),
        "cublas": captured(lambda: torch.mm(m, w, out=out), a.kernels),
    }
    kernels = {"triton": a.kernels, "torch_elementwise": a.kernels // 2 * 2, "cublas": a.kernels}
    rows = []

    def measure(stage: str) -> None:
        for name, g in graphs.items():
            ms = statistics.median(replay_times(g, a.reps))
            rows.append({"stage": stage, "graph": name, "ms": ms, "us_per_kernel": 1000 * ms / kernels[name]})
            print(json.dumps(rows[-1]), flush=True)

    measure("first")
    later = captured(lambda: x.add_(0.0), 1)
    measure("capture")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        z = x * 2.0
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    measure("sidestream")
    del later, z
    with open(a.out, "w") as f:
        json.dump({**run_provenance(command_line("scripts/stream_state_probe.py")), "kernels": kernels,
                   "reps": a.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
