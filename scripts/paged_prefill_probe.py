"""A short prefill chunk over a long prefix, one layer of Llama-3.1-8B (32 query heads over 8 KV
heads, d = 128, bf16): the paged kernel (kernels/triton/prefill.py: pages read where they lie)
against the engine's gather path (workers/engine/attention.py prefill_kv + prefill_attention: the
prefix gathered into a contiguous copy, then FA2 / cuDNN), in one process; and, where torch has
cuDNN's attention, the gather path with cuDNN at every chunk size (`cudnn_ms`: the engine sends
only chunks of CUDNN_MIN_QUERIES or more there; this asks whether short chunks, a step beside
decoding requests, would run faster through it: its key blocks and causal chunk, merged).

    python scripts/paged_prefill_probe.py --queries 16 64 256 1023 --prefix 8192 32768 131072 \
        --out paged_prefill_probe.json

Pages are scattered in a pool the size of the prefix (a shuffled page table). Per point: median
ms of each path (CUDA events, after a warm-up), the bytes the prefix's K/V hold and the
bandwidth that reading them once at that time would be, and the two outputs' largest difference.

--tune: the paged kernel alone at every point under each PrefillTuning of a grid (keys per
iteration, pipeline stages, warps, programs per SM); a launch that does not fit is recorded as
refused, with its error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.kernels.triton import paged_prefill_triton  # noqa: E402
from lockserve.kernels.triton.prefill import PrefillTuning  # noqa: E402
from lockserve.workers.engine import attention as engine_attention  # noqa: E402
from lockserve.workers.engine.attention import prefill_attention  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16


def timed_ms(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gathered(pool, locs, length):
    """The prefix's K/V as the engine gathers them: the pages (one copy), laid out per token (a
    second): [2, length, Hkv, d]."""
    pages = pool.index_select(0, (locs[:, None] * HKV + torch.arange(HKV, device=pool.device)).flatten())
    return pages.view(-1, HKV, 2, PAGE, D).permute(2, 0, 3, 1, 4).reshape(2, -1, HKV, D)[:, :length]


def gather_path(q, pool, locs, length):
    """What the engine did for every chunk: gather, then prefill_attention."""
    kv = gathered(pool, locs, length)
    return prefill_attention(q, kv[0], kv[1])


def cudnn_path(q, pool, locs, length):
    """The gather, then cuDNN's key blocks and causal chunk at any chunk size."""
    kv = gathered(pool, locs, length)
    return engine_attention._cudnn_prefill(q, kv[0], kv[1], min_queries=1)


def point(n: int, prefix: int, gen: torch.Generator) -> dict:
    length = prefix + n
    pages = -(-length // PAGE)
    pool = torch.randn(pages * HKV, 2, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    locs = torch.randperm(pages, generator=gen, device="cuda")
    q = torch.randn(n, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    paged = paged_prefill_triton(q, pool, locs, 0, HKV, length)[0]
    via_gather = gather_path(q, pool, locs, length)
    paged_ms = timed_ms(lambda: paged_prefill_triton(q, pool, locs, 0, HKV, length))
    gather_ms = timed_ms(lambda: gather_path(q, pool, locs, length))
    kv_bytes = length * HKV * D * 2 * 2
    flops = 4 * D * HQ * (n * prefix + n * (n + 1) / 2)
    row = {"queries": n, "prefix": prefix, "paged_ms": paged_ms, "gather_ms": gather_ms,
           "gather_over_paged": gather_ms / paged_ms, "kv_mib": kv_bytes / 2**20,
           "paged_read_gb_s": kv_bytes / paged_ms / 1e6, "paged_tflops": flops / paged_ms / 1e9,
           "max_abs_diff": (paged.float() - via_gather.float()).abs().max().item()}
    if engine_attention._cuda_cudnn is not None:
        via_cudnn = cudnn_path(q, pool, locs, length)  # also its plans' first calls, before the timing
        cudnn_ms = timed_ms(lambda: cudnn_path(q, pool, locs, length))
        row.update(cudnn_ms=cudnn_ms, cudnn_over_paged=cudnn_ms / paged_ms,
                   cudnn_tflops=flops / cudnn_ms / 1e9,
                   cudnn_max_abs_diff=(paged.float() - via_cudnn.float()).abs().max().item())
    return row


TUNE_GRID = [PrefillTuning(block_n, stages, warps, per_sm) for block_n in (64, 128) for stages in (2, 3, 4)
             for warps in (4, 8) for per_sm in (4, 8)]


def tune_point(n: int, prefix: int, gen: torch.Generator) -> dict:
    """The paged kernel's median ms under each tuning of TUNE_GRID at one point."""
    length = prefix + n
    pages = -(-length // PAGE)
    pool = torch.randn(pages * HKV, 2, PAGE, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    locs = torch.randperm(pages, generator=gen, device="cuda")
    q = torch.randn(n, HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    kv_bytes = length * HKV * D * 2 * 2
    runs = []
    for tuning in TUNE_GRID:
        knobs = {"block_n": tuning.block_n, "num_stages": tuning.num_stages, "num_warps": tuning.num_warps,
                 "programs_per_sm": tuning.programs_per_sm}
        try:
            ms = timed_ms(lambda t=tuning: paged_prefill_triton(q, pool, locs, 0, HKV, length, tuning=t))
        except Exception as err:  # noqa: BLE001 - a tuning that does not fit (shared memory) is a result
            runs.append({**knobs, "refused": f"{type(err).__name__}: {str(err)[:200]}"})
            continue
        runs.append({**knobs, "ms": ms, "read_gb_s": kv_bytes / ms / 1e6})
    fits = [r for r in runs if "ms" in r]
    return {"queries": n, "prefix": prefix, "kv_mib": kv_bytes / 2**20, "runs": runs,
            "best": min(fits, key=lambda r: r["ms"]) if fits else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queries", type=int, nargs="+", default=[16, 64, 256, 1023])
    ap.add_argument("--prefix", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tune", action="store_true", help="sweep the paged kernel's PrefillTuning grid")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for prefix in args.prefix:
        for n in args.queries:
            rows.append(tune_point(n, prefix, gen) if args.tune else point(n, prefix, gen))
            shown = (rows[-1]["best"] or {}) if args.tune else rows[-1]
            print(json.dumps({"queries": n, "prefix": prefix,
                              **{k: round(v, 3) if isinstance(v, float) else v for k, v in shown.items()}}),
                  flush=True)
            torch.cuda.empty_cache()
    result = {**run_provenance(command_line("scripts/paged_prefill_probe.py", argv)),
              "shape": {"Hq": HQ, "Hkv": HKV, "d": D, "page": PAGE, "dtype": "bfloat16"},
              "default_tuning": vars(PrefillTuning()) if args.tune else None, "points": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
