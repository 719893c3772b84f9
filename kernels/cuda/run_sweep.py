"""Sweep of the CUDA score kernel's run length (stages each warp scores) on the GPU.

    python -m lockserve.kernels.cuda.run_sweep --out docs/results/score_run_sweep_h200.json

Per case (model shape, tokens, batch) and run: the device time of scoring and share-averaging
one layer (score_and_group_cuda), the median of a CUDA graph replaying it over eight distinct
layers' summaries (no layer finds the previous one's in L2, as in a decode step), and whether
the scores and share-averages equal run 1's bit for bit. Only the score kernel depends on the run;
the share-average is the same work in every column. Also the run that run_length picks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from lockserve.provenance import command_line, run_provenance

from ..bench import Plan, random_summaries, score_inputs
from .score import run_length, score_and_group_cuda

# (name, Hkv, G, d, tokens, batch): Llama-3.1-8B, GLM-4-9B and SmolLM2-135M shapes.
CASES = [("llama-3.1-8b", 8, 4, 128, 32 << 10, 1), ("llama-3.1-8b", 8, 4, 128, 128 << 10, 1),
         ("llama-3.1-8b", 8, 4, 128, 512 << 10, 1), ("llama-3.1-8b", 8, 4, 128, 32 << 10, 16),
         ("glm-4-9b", 2, 16, 128, 128 << 10, 1), ("glm-4-9b", 2, 16, 128, 1 << 20, 1),
         ("smollm2-135m", 3, 3, 64, 128 << 10, 1)]
RUNS = (1, 2, 3, 4, 6, 8, 12, 16)
LAYERS = 8


def sweep_case(name: str, hkv: int, g: int, d: int, tokens: int, batch: int, runs=RUNS,
               layers: int = LAYERS) -> dict:
    """One case: microseconds per layer and bit-equality with run 1, for each run."""
    import triton.testing

    dev = torch.device("cuda")
    plan = Plan(contexts=[tokens], score_batches=[batch], attention_batches=[1], hkv=hkv, g=g, d=d)
    q, first, table, num_pages = score_inputs(plan, tokens, batch, dev, seed=1)
    gen = torch.Generator(device=dev).manual_seed(2)
    tables = [first] + [random_summaries(table.numel(), plan, dev, gen) for _ in range(layers - 1)]
    groups = -(-table.shape[1] // 8) * hkv * batch
    row = {"model": name, "hkv": hkv, "g": g, "d": d, "tokens": tokens, "batch": batch,
           "summary_bytes_per_layer": table.numel() * hkv * first.bytes_per_page(), "groups": groups,
           "picked_run": run_length(groups, dev.index or 0), "us_per_layer": {}, "same_bits": {}}
    reference = score_and_group_cuda(q, first, table, num_pages, run=1)
    for run in runs:
        got = score_and_group_cuda(q, first, table, num_pages, run=run)
        row["same_bits"][run] = all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
        step = lambda run=run: [score_and_group_cuda(q, t, table, num_pages, check=False, run=run)  # noqa: E731
                                for t in tables]
        ms = triton.testing.do_bench_cudagraph(step, return_mode="median")
        row["us_per_layer"][run] = ms * 1e3 / layers
    row["best_run"] = min(row["us_per_layer"], key=row["us_per_layer"].get)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lockserve.kernels.cuda.run_sweep",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("run_sweep needs a CUDA GPU (the score kernel it sweeps is CUDA only)")
    rows = []
    for case in CASES:
        row = sweep_case(*case)
        picked, best = row["picked_run"], row["best_run"]
        us = row["us_per_layer"]
        print(f"{case[0]:14s} {case[4] >> 10:5d}K x{case[5]:<3d} picked run {picked:2d}: "
              f"{us.get(picked, float('nan')):7.2f} us   best run {best:2d}: {us[best]:7.2f} us", flush=True)
        rows.append(row)
    result = {**run_provenance(command_line("-m lockserve.kernels.cuda.run_sweep", argv)),
              "runs": list(RUNS), "cases": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
