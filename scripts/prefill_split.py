"""Where a real prefill's time goes, per mode: step wall times, GPU kernels, host functions.

    python scripts/prefill_split.py --context 32768 --modes locks:hbm locks:host+nvme --out split.json

Per mode one engine built as `lockserve bench prefill` builds it (prefix reuse on, chunk 8,192),
`warm_up`, then three cold prompts of random tokens (nothing of one cached for the next):
- `first`: timed step by step (each step synchronised; its prompt tokens and seconds);
- `second`: the same, to show what a process's first prefill pays that a later one does not;
- `profiled`: under torch.profiler (GPU kernels summed by name) and cProfile (the engine
  thread's functions by cumulative time), whose wall time the profilers inflate.
Beside them the plain anchor of the same shape, once, in the same process.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.cluster.measure import commands  # noqa: E402
from lockserve.cluster.measure import prefill as prefill_bench  # noqa: E402
from lockserve.cluster.measure.decode import engines  # noqa: E402
from lockserve.cluster.measure.plain_prefill import time_plain_prefill  # noqa: E402
from lockserve.workers.engine.sampling import SamplingParams  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402


def stepped_prefill(engine, rid: str, prompt: list[int]) -> dict:
    """One request to its first token, each step synchronised: [(prompt tokens done, s)]."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prefill_bench.sync(engine.device)
    start = time.perf_counter()
    engine.add_request(rid, prompt, params)
    steps, last = [], start
    while engine.has_unfinished():
        engine.step()
        prefill_bench.sync(engine.device)
        now = time.perf_counter()
        steps.append(round(now - last, 4))
        last = now
    return {"seconds": last - start, "step_s": steps}


def gpu_kernels(prof, n: int) -> list[dict]:
    """The n kernels with the most device time over the profiled request (ms, calls)."""
    rows = [e for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda e: -e.device_time_total)
    return [{"name": e.key[:120], "ms": round(e.device_time_total / 1e3, 3), "calls": e.count}
            for e in rows[:n]]


def host_functions(profiler: cProfile.Profile, n: int) -> list[dict]:
    """The n lockserve functions with the most cumulative time on the engine's thread (ms)."""
    stats = pstats.Stats(profiler).stats
    rows = [((file, line, name), cum, calls) for (file, line, name), (_, calls, _, cum, _) in stats.items()
            if "lockserve" in file or "/workers/" in file or "/offload/" in file or "/kernels/" in file]
    rows.sort(key=lambda r: -r[1])
    return [{"function": f"{Path(f).name}:{ln}({name})", "ms": round(cum * 1e3, 2), "calls": calls}
            for (f, ln, name), cum, calls in rows[:n]]


def split_mode(model, tokenizer, mode: str, args, device: torch.device) -> dict:
    ns = commands.prefill_arguments(prefill_chunk=args.prefill_chunk, nvme_dir=args.nvme_dir)
    spec = prefill_bench.spec_for(ns, args.context, device)
    gen = torch.Generator().manual_seed(args.context)
    vocab = model.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.context + 48,), generator=gen).tolist() for _ in range(3)]
    out = {"mode": mode}
    with engines.bench_engine(model, tokenizer, mode, spec) as engine:
        start = time.perf_counter()
        engine.warm_up()
        out["warm_up_s"] = time.perf_counter() - start
        out["first"] = stepped_prefill(engine, "first", prompts[0])
        out["second"] = stepped_prefill(engine, "second", prompts[1])
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        host = cProfile.Profile()
        with profile(activities=activities) as prof:
            host.enable()
            out["profiled"] = stepped_prefill(engine, "profiled", prompts[2])
            host.disable()
        out["gpu_kernels"] = gpu_kernels(prof, args.top)
        out["gpu_ms_total"] = round(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3, 2)
        out["host_functions"] = host_functions(host, args.top)
        out["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, int | float)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--modes", nargs="+", default=["locks:hbm", "locks:host+nvme"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--nvme-dir", default="/tmp/lockserve-bench-nvme")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    device = torch.device(args.device)
    model, tokenizer = engines.load_model(args.model, device, args.context + 48 + 80)
    result = {**run_provenance(command_line("scripts/prefill_split.py"), device),
              "kind": "prefill split probe", "model": args.model,
              "context": args.context, "prefill_chunk": args.prefill_chunk,
              "plain_s": time_plain_prefill(model.config, args.context + 48, device, model.dtype)["seconds"],
              "modes": []}
    for mode in args.modes:
        result["modes"].append(split_mode(model, tokenizer, mode, args, device))
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        m = result["modes"][-1]
        print(f"{mode}: plain {result['plain_s']:.3f} s; first {m['first']['seconds']:.3f} s "
              f"{m['first']['step_s']}; second {m['second']['seconds']:.3f} s {m['second']['step_s']}; "
              f"profiled {m['profiled']['seconds']:.3f} s, GPU {m['gpu_ms_total']} ms", flush=True)
        for k in m["gpu_kernels"][:12]:
            print(f"  gpu {k['ms']:9.2f} ms {k['calls']:6d}  {k['name']}")
        for f in m["host_functions"][:20]:
            print(f"  host {f['ms']:9.2f} ms {f['calls']:6d}  {f['function']}")


if __name__ == "__main__":
    main()
