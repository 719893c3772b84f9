"""Where a step's time goes while a long prefill runs beside a decoding request.

    python scripts/beside_step_probe.py --model llama-3.1-8b --context 131072 --chunk 256 \
        --out beside_probe.json

One engine (the prefill bench's sizing): a short request decodes, then a prompt of `--context`
random tokens is added. Every mixed step is split, with a device sync between parts, into
schedule, kv.plan, runner.execute, kv.commit and sample (so the parts add up to the wall time
of a synced step, which is what the decoder's TPOT is); the medians go to --out, for the first
steps and for the steps at a prefix of about 3/4 of the context. `execute_host` is the part of
`execute` until it returned, before its sync: near `execute` where the step's launches are the
bound (host-bound), well under it where the GPU is. Then torch.profiler records a few mixed
steps: the top CUDA kernels and host ops by self time; with --cprofile N, cProfile N more: the
Python functions by their own time (`top_python_ms`), which the torch profiler does not show
(a Triton launcher's argument binding, the engine's planning).

`busy` answers whether the steps beside the prompt are bound by the host or by the GPU, as the
server runs them (Engine.step, --layers of a chunk's forward a step, --attention's cap): at the
late prefix, --busy-steps steps under torch.profiler, timed together with one sync at the end:
ms a step, and the GPU's busy ms a step (the union of its kernels' and copies' intervals). A share
near 1 is GPU-bound; well under 1, the GPU waits for the host. On the CPU the share is None.

    python scripts/beside_step_probe.py --device cpu --model tiny --context 1024 --chunk 64 --decoder 64 400 \
        --steps 2 --profile-steps 1 --cprofile 2 --out x.json
runs it on the CPU (no sync, so execute_host is execute: a check of the script, not a figure).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.cluster.measure import commands  # noqa: E402
from lockserve.cluster.measure import prefill as prefill_bench  # noqa: E402
from lockserve.cluster.measure.decode import engines  # noqa: E402
from lockserve.cluster.measure.harness.sizes import parse_tokens  # noqa: E402
from lockserve.workers.engine.sampling import SamplingParams  # noqa: E402
from lockserve.workers.engine.scheduler import Batch  # noqa: E402
from lockserve.workers.model.presets import build_preset  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402

PARTS = ("schedule", "plan", "execute", "commit", "sample")


def split_step(engine, batch: Batch | None = None) -> dict[str, float]:
    """Engine.step's body with a sync after each part: ms per part (batch: run this one instead of
    scheduling)."""
    sync, times, t = lambda: prefill_bench.sync(engine.device), {}, time.perf_counter()

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
    host = 1e3 * (time.perf_counter() - t)
    mark("execute")
    engine.kv.commit(list(zip(batch.chunks, planned, strict=True)))
    mark("commit")
    engine._counters["steps"] += 1
    engine._sample(batch, logits)
    mark("sample")
    times["total"] = sum(times.values())
    times["execute_host"] = host
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


def busy(engine, steps: int, device: torch.device) -> dict:
    """`steps` engine steps under torch.profiler, then more until no chunk's forward is between
    parts (so the split steps after it start at a forward's first layer): ms a step, the GPU's busy
    ms a step and their ratio (None on the CPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prefill_bench.sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        prefill_bench.sync(device)
        wall_ms = 1e3 * (time.perf_counter() - t) / steps
    while engine.runner.inflight is not None:
        engine.step()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy_ms = union_us(spans) / 1e3 / steps
    out = {"steps": steps, "ms_per_step": wall_ms, "gpu_busy_ms_per_step": busy_ms if spans else None,
           "busy_share": busy_ms / wall_ms if spans else None}
    if device.type == "cuda" and not spans:  # say so: a missing share must not read as a measured one
        out["error"] = "the profile held no CUDA kernel or copy events: no busy share"
    return out


def union_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of sorted (start, end) intervals (overlapping kernels count once)."""
    total, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def python_top(profile: cProfile.Profile, steps: int, n: int = 30) -> list[tuple[str, float, int]]:
    """The n functions with the most own time in profile: (file:line function, ms a step, calls a
    step); built-ins (torch's C++ ops among them) as cProfile names them."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, own s, cum s, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    return [(f"{Path(f).name}:{line} {name}"[:90], round(1e3 * own / steps, 3), calls // steps)
            for (f, line, name), (calls, _, own, _, _) in rows]


def medians(rows: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {"steps": len(rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--mode", default="locks:hbm")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=256, help="prefill tokens a step beside the decoder")
    ap.add_argument("--attention", type=parse_tokens, default=None,
                    help="prefill attention work of a step's chunks beside the decoder, query x key tokens "
                         "(scheduler.prefill_attention_decoding; default: no cap)")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers of a chunk's forward a step beside the decoder in the busy phase "
                         "(scheduler.prefill_layers_decoding; default: the whole forward)")
    ap.add_argument("--busy-steps", type=int, default=16,
                    help="engine steps of the busy phase at the late prefix (0: none)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--alternate", action="store_true", help="run each step's decodes and prefills apart")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also N mixed steps under cProfile: the Python functions by own time")
    ap.add_argument("--decoder", type=int, nargs=2, default=(1024, 4096), metavar=("PROMPT", "TOKENS"),
                    help="the decoding request's prompt and its tokens (default 1024 4096; they must "
                         "outlast the prefill)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu to check the script (default cuda)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, tokenizer = build_preset(args.model, device=device, dtype=torch.bfloat16)
    ns = commands.prefill_arguments(nvme_dir="/tmp/lockserve-probe", beside=True, beside_chunk=args.chunk,
                                    beside_attention=args.attention, beside_layers=args.layers)
    spec = prefill_bench.spec_for(ns, args.context, device)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = {**run_provenance(command_line("scripts/beside_step_probe.py"), device), "model": args.model,
           "mode": args.mode, "context": args.context, "chunk": args.chunk, "attention": args.attention,
           "layers": args.layers}
    with engines.bench_engine(model, tokenizer, args.mode, spec) as engine:
        engine.warm_up()
        short = torch.randint(0, vocab, (args.decoder[0],), generator=gen).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=args.decoder[1], ignore_eos=True)
        engine.add_request("decoder", short, params)
        for _ in range(32):
            engine.step()
        alone = [split_step(engine) for _ in range(args.steps)]
        long = torch.randint(0, vocab, (args.context - 128,), generator=gen).tolist()
        engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        step = alternate_step if args.alternate else split_step
        first = [step(engine) for _ in range(args.steps)]
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities)
        with prof:
            for _ in range(args.profile_steps):
                step(engine)
        if args.cprofile:
            python = cProfile.Profile()
            python.enable()
            for _ in range(args.cprofile):
                step(engine)
            python.disable()
            out["top_python_ms"] = python_top(python, args.cprofile)
        late, target = [], 3 * args.context // 4
        while engine.request_status("long") is not None:
            row = step(engine)
            if row["prefix"] >= target and len(late) < args.steps:
                late.append(row)
            if row["prefix"] >= target and args.busy_steps and "busy" not in out:
                prefix = row["prefix"] + int(row["prefill_tokens"])  # where the busy steps' chunk starts
                out["busy"] = busy(engine, args.busy_steps, device) | {"prefix": prefix}
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
    print(json.dumps({k: out.get(k) for k in ("alone", "first", "late", "busy")}, indent=1))
    for name in ("top_cuda_ms", "top_host_ms", "top_python_ms")[: 2 + bool(args.cprofile)]:
        print(name)
        for r in out[name]:
            print("  ", r)


if __name__ == "__main__":
    main()
