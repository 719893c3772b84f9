"""Does one torch.profiler step slow the decode steps that follow it? (A GPU diagnostic.)

For each mode, in one engine: warm-up steps, N timed steps and the graph replay's span (A), one
step under torch.profiler (the bench's profile_step), then N timed steps and the span again
(B). The bench profiles every mode after timing it, so a lasting after-effect falls on every mode
but the first of a run. Kineto keeps CUPTI attached after a trace unless TEARDOWN_CUPTI=1, which
the bench's profile_call now sets unless the caller set it; run this with TEARDOWN_CUPTI=0 to see
the after-effect, without it to see it gone.

    TEARDOWN_CUPTI=0 python scripts/profiler_aftereffect.py --model default --context 131072 \
        --modes locks:hbm locks:host --out profiler_aftereffect.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
from lockserve.cluster.measure.decode import bench, engines, step_profile

from lockserve.provenance import command_line, run_provenance


def measure(engine, tokens: list[list[int]], steps: int) -> dict:
    ms = engines.decode_steps(engine, tokens, steps)
    span = bench.replay_timing(engine, tokens, bench.SPAN_STEPS)
    return {"tpot_ms_median": statistics.median(ms), "graph_span_ms": span["graph_span_ms"],
            "host_ms": span["host_ms"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--modes", nargs="+", default=["locks:hbm", "locks:host"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    rounds = 2  # each mode: A, profile, B; then A, profile, B again in the same engine
    spans = 2 * rounds * (bench.SPAN_STEPS + 1)
    spec = engines.DecodeSpec(context=args.context, steps=2 * rounds * args.steps + spans, warmup=8,
                            device="cuda")
    device = torch.device("cuda")
    model, tokenizer = engines.load_model(args.model, device, spec.context + spec.max_tokens + 16)
    synthetic = engines.is_synthetic("auto", args.model)
    prompts, _ = engines.make_prompts(model, tokenizer, args.context, 1, synthetic, 0.5)
    out = {**run_provenance(command_line("scripts/profiler_aftereffect.py", argv), device),
           "teardown_cupti": os.environ.get("TEARDOWN_CUPTI", "(unset: the bench sets 1)"), "modes": {}}
    for mode in args.modes:
        with engines.bench_engine(model, tokenizer, mode, spec) as engine:
            tokens = engines.start_requests(engine, prompts, spec, synthetic)
            engines.decode_steps(engine, tokens, spec.warmup)
            runs = []
            for _ in range(rounds):
                before = measure(engine, tokens, args.steps)
                step_profile.profile_step(engine, tokens)
                runs.append({"before_profile": before, "after_profile": measure(engine, tokens, args.steps)})
            out["modes"][mode] = runs
            for r in runs:
                b, a = r["before_profile"], r["after_profile"]
                print(f"{mode:12s} tpot {b['tpot_ms_median']:.3f} -> {a['tpot_ms_median']:.3f} ms, span "
                      f"{b['graph_span_ms']:.3f} -> {a['graph_span_ms']:.3f} ms", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
