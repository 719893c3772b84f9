"""Where a decode step's host time goes: cProfile over the bench's decode steps, one mode.

    python scripts/host_step_profile.py --model llama-3.1-8b --context 32768 --mode locks:hbm \
        --out host_profile.json

Builds the mode's engine as `python -m lockserve.cluster.measure.decode.bench` does (synthetic fill for the
random-weight presets), decodes --warmup steps (graph captures), then profiles --steps steps and
writes the functions with the most own time and the most cumulative time, per step, with the
steps' wall times; before them, unprofiled, the medians of the graph span and of the host's split
around the replay over as many steps (`unprofiled`: the bench's replay_timing). A replayed step's
host work is what runs around `graph.replay` (the bench's profile.host_ms splits it); this says
which Python and which torch calls it is.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.cluster.measure.decode import bench, engines  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def top(stats: pstats.Stats, key: int, steps: int, n: int) -> list[dict]:
    """The n functions with the largest stats column `key` (2: own time, 3: cumulative), us a step."""
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][key])[:n]
    return [{"function": f"{Path(file).name}:{line}({name})", "calls_per_step": calls / steps,
             "own_us_per_step": own / steps * 1e6, "cumulative_us_per_step": cum / steps * 1e6}
            for (file, line, name), (_, calls, own, cum, _) in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--mode", default="locks:hbm")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    # room for both passes: the unprofiled split's steps, then the profiled ones
    spec = engines.DecodeSpec(context=args.context, steps=2 * args.steps, warmup=args.warmup,
                            device=args.device)
    device = torch.device(args.device)
    model, tokenizer = engines.load_model(args.model, device, args.context + spec.max_tokens)
    synthetic = engines.is_synthetic("auto", args.model)
    prompts, _ = engines.make_prompts(model, tokenizer, args.context, 1, synthetic)
    with engines.bench_engine(model, tokenizer, args.mode, spec) as engine:
        tokens = engines.start_requests(engine, prompts, spec, synthetic)
        engines.decode_steps(engine, tokens, args.warmup)
        split = bench.replay_timing(engine, tokens, args.steps)  # unprofiled: medians over the steps
        profiler = cProfile.Profile()
        profiler.enable()
        ms = engines.decode_steps(engine, tokens, args.steps)
        profiler.disable()
    stats = pstats.Stats(profiler)
    result = {**run_provenance(command_line("scripts/host_step_profile.py"), device),
              "model": args.model, "mode": args.mode, "context": args.context, "steps": args.steps,
              "step_ms_median": statistics.median(ms), "cpu_count": os.cpu_count(), "unprofiled": split,
              "by_own_time": top(stats, 2, args.steps, args.top),
              "by_cumulative_time": top(stats, 3, args.steps, args.top)}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"step {result['step_ms_median']:.3f} ms (profiled); unprofiled {json.dumps(split)}")
    for row in result["by_own_time"][:args.top]:
        print(f"{row['own_us_per_step']:8.1f} us own {row['cumulative_us_per_step']:8.1f} us cum "
              f"{row['calls_per_step']:6.1f} calls  {row['function']}")


if __name__ == "__main__":
    main()
