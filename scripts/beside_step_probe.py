"""Where a step's time goes while a long prefill runs beside a decoding request.

    python scripts/beside_step_probe.py --model llama-3.1-8b --context 131072 --chunk 256 \
        --out beside_probe.json

One engine (the prefill bench's sizing): a short request decodes, then a prompt of `--context`
random tokens is added. Every mixed step is split, with a device sync between parts, into
schedule, kv.plan, runner.execute, kv.commit and sample (so the parts add up to the wall time
of a synced step, which is what the decoder's TPOT is); the medians go to --out, for the first
steps and for the steps at a prefix of about 3/4 of the context. Then torch.profiler records a
few mixed steps: the top CUDA kernels and host ops by self time.
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
from lockserve.cluster.measure import commands  # noqa: E402
from lockserve.cluster.measure import prefill as prefill_bench  # noqa: E402
from lockserve.cluster.measure.decode import engines  # noqa: E402
from lockserve.workers.engine.sampling import SamplingParams  # noqa: E402
from lockserve.workers.engine.scheduler import Batch  # noqa: E402
from lockserve.workers.model.presets import build_preset  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402

PARTS = ("schedule", "plan", "execute", "commit", "sample")


def split_step(engine, batch: Batch | None = None) -> dict[str, float]:
    """Engine.step's body with a sync after each part: ms per part (batch: run this one instead of
    scheduling)."""
    sync, times, t = lambda: torch.cuda.synchronize(engine.device), {}, time.perf_counter()

    def mark(name):
        nonlocal t
        sync()
        now = time.perf_counter()
        times[name], t = 1e3 * (now - t), now

    batch = batch or engine.scheduler.schedule()
    batch = Batch(engine.runner.order(batch.decodes), batch.prefills)
    mark("schedule")
    nd = len(batch.decodes)
    planned = [engine.kv.plan(chunk, window=i >= nd) for i, chunk in enumerate(batch.chunks)]
    mark("plan")
    logits = engine.runner.execute(batch, planned)
    mark("execute")
    engine.kv.commit(list(zip(batch.chunks, planned, strict=True)))
    mark("commit")
    engine._counters["steps"] += 1
    engine._sample(batch, logits)
    mark("sample")
    times["total"] = sum(times.values())
    times["prefill_tokens"] = sum(c.num_tokens for c in batch.prefills)
    times["prefix"] = batch.prefills[0].start if batch.prefills else -1
    return times


def alternate_step(engine) -> dict[str, float]:
    """The scheduled step run as two: its decodes alone (a graph replay), then its prefill chunks
    alone (eager): ms of each and their sum (the decoder's TPOT under alternation)."""
    batch = engine.scheduler.schedule()
    dec = split_step(engine, Batch(batch.decodes, [])) if batch.decodes else {"total": 0.0}
    pre = split_step(engine, Batch([], batch.prefills)) if batch.prefills else {"total": 0.0, "prefix": -1}
    return {"decode": dec["total"], "prefill": pre["total"], "total": dec["total"] + pre["total"],
            "prefix": pre["prefix"]}


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--mode", default="locks:hbm")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=256, help="prefill tokens a step beside the decoder")
    ap.add_argument("--attention", type=int, default=None,
                    help="prefill attention work a step beside the decoder, query x key tokens "
                         "(scheduler.prefill_attention_decoding; default: no cap)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--alternate", action="store_true", help="run each step's decodes and prefills apart")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device("cuda")
    model, tokenizer = build_preset(args.model, device=device, dtype=torch.bfloat16)
    ns = commands.prefill_arguments(nvme_dir="/tmp/lockserve-probe", beside=True, beside_chunk=args.chunk,
                                    beside_attention=args.attention)
    spec = prefill_bench.spec_for(ns, args.context, device)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {**run_provenance(command_line("scripts/beside_step_probe.py"), device), "model": args.model,
           "mode": args.mode, "context": args.context, "chunk": args.chunk, "attention": args.attention}
    with engines.bench_engine(model, tokenizer, args.mode, spec) as engine:
        engine.warm_up()
        short = torch.randint(0, vocab, (1024,), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)
        engine.add_request("decoder", short, params)
        for _ in range(32):
            engine.step()
        alone = [split_step(engine) for _ in range(args.steps)]
        long = torch.randint(0, vocab, (args.context - 128,), generator=gen).tolist()
        engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        step = alternate_step if args.alternate else split_step
        first = [step(engine) for _ in range(args.steps)]
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA])
        with prof:
            for _ in range(args.profile_steps):
                step(engine)
        late, target = [], 3 * args.context // 4
        while engine.request_status("long") is not None:
            row = step(engine)
            if row["prefix"] >= target and len(late) < args.steps:
                late.append(row)
        out.update(alone=medians(alone), first=medians(first), late=medians(late) if late else None)
        events = prof.key_averages()
        cuda = sorted(events, key=lambda e: -e.self_device_time_total)[:25]
        host = sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]
        out["top_cuda_ms"] = [(e.key[:90], round(e.self_device_time_total / 1e3 / args.profile_steps, 3),
                               e.count // args.profile_steps) for e in cuda]
        out["top_host_ms"] = [(e.key[:90], round(e.self_cpu_time_total / 1e3 / args.profile_steps, 3),
                               e.count // args.profile_steps) for e in host]
        engine.abort("decoder")
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("alone", "first", "late")}, indent=1))
    for name in ("top_cuda_ms", "top_host_ms"):
        print(name)
        for r in out[name]:
            print("  ", r)


if __name__ == "__main__":
    main()
