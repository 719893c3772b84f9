"""Where a replayed decode step's wall time goes, step by step, in one process.

    python scripts/step_split_probe.py --model MODEL.gguf --context 131072 --mode locks:host \
        --steps 128 --phases plain events plain --out split.json

The bench times its steps (TPOT) in one phase and splits a few other steps around the graph
replay in another (`replay_timing`, 5 steps). This runs phases of `--steps` steps each, in the
order given, on one engine:
  plain:   the bench's timed steps (on a tier with a hot cache, its per-step hit-rate record);
  norec:   the same without the record;
  events:  CUDA events around each replay: each step's wall time, its host time before the
           replay call, the call, the rest (sampler, readback, sync), and the graph's device span,
           all from the same step (so wall - span is that step's time outside the graph).
Medians (and p10 / p90 of the wall) per phase go to --out as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.cluster.measure.decode import bench, engines  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def plain_phase(engine, tokens: list[list[int]], steps: int, record: bool) -> dict:
    hot = engines.hot_cache(engine)
    cached = record and hot is not None and engine.cache_config.tier != "hbm"
    recorder = engines.HitRateRecorder(hot, steps) if cached else None
    ms = engines.decode_steps(engine, tokens, steps, after_step=recorder)
    return {"wall_ms": statistics.median(ms), "wall_p10": bench.percentile(ms, 0.1),
            "wall_p90": bench.percentile(ms, 0.9),
            "hit_rate_recorded": recorder is not None}


def events_phase(engine, tokens: list[list[int]], steps: int) -> dict:
    rows = bench.replay_steps(engine, tokens, steps)  # per replayed step: wall, host parts, span
    for r in rows:
        r["outside"] = r["wall"] - r["span"]
    out = {f"{k}_ms": statistics.median(r[k] for r in rows) for k in rows[0]}
    walls = [r["wall"] for r in rows]
    out["wall_p10"], out["wall_p90"] = bench.percentile(walls, 0.1), bench.percentile(walls, 0.9)
    out["replayed_steps"] = len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", default="locks:host")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--phases", nargs="+", default=["plain", "events", "plain"],
                    choices=["plain", "norec", "events"])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    spec = engines.DecodeSpec(context=args.context, steps=len(args.phases) * args.steps, warmup=args.warmup,
                            device="cuda")
    model, tokenizer = engines.load_model(args.model, torch.device("cuda"), args.context + spec.max_tokens)
    synthetic = engines.is_synthetic("auto", args.model)
    prompts, _ = engines.make_prompts(model, tokenizer, args.context, 1, synthetic)
    phases = []
    with engines.bench_engine(model, tokenizer, args.mode, spec) as engine:
        tokens = engines.start_requests(engine, prompts, spec, synthetic)
        engines.decode_steps(engine, tokens, args.warmup)
        for name in args.phases:
            if name == "events":
                phases.append({"phase": name} | events_phase(engine, tokens, args.steps))
            else:
                phases.append({"phase": name} | plain_phase(engine, tokens, args.steps, name == "plain"))
    result = {**run_provenance(command_line("scripts/step_split_probe.py")), "mode": args.mode,
              "context": args.context, "phases": phases}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for p in phases:
        print(args.mode, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()}))


if __name__ == "__main__":
    main()
