"""Decode benchmark: resident vs offloaded KV on one long sequence, plus a trace of one step.

    python -m lockserve.workers.bench --model default --context 131072 --steps 256 \
        --modes dense:hbm locks:hbm locks:host --out docs/results/decode_h200.json

Each mode ("attention:tier") prefills the same passkey prompt (Paul Graham essays, the needle at
`--depth`), then decodes `--steps` greedy tokens. Per mode it reports prefill time, time per
output token, the hot-cache hit rate and bytes moved per step (from the engine's own
counters, read between steps), whether the passkey was found, and whether the tokens equal
those of the mode named by `--reference`. One decode step is traced with torch.profiler and
the CUDA runtime calls that block the host inside it are listed (the sampled token ids are
copied to the host once per step; nothing else should block).

NOTE: SmolLM2-135M was trained on 8K positions; `--context` beyond that runs it out of its
trained range (its answers degrade; the byte traffic and hit rates are still real).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig

from .api import load
from .engine import Engine
from .engine.sampling import SamplingParams
from .passkey import build_passkey_prompt, passkey_found

# Runtime calls that make the host wait for the device. cudaMemcpyAsync is not one of them by
# itself; PyTorch follows a copy from pageable host memory with cudaStreamSynchronize.
BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockserve.workers.bench", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2), a preset, a .gguf or HF folder")
    p.add_argument("--context", type=int, default=131072, help="prompt tokens")
    p.add_argument("--steps", type=int, default=256, help="decode steps (greedy tokens)")
    p.add_argument("--budget-tokens", type=int, default=2048, help="LOCKS budget per KV head")
    p.add_argument("--modes", nargs="+", default=["dense:hbm", "locks:hbm", "locks:host"])
    p.add_argument("--reference", default="locks:hbm", help="mode whose tokens the others are compared to")
    p.add_argument("--hot-cache-pages", type=int, default=65536)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--depth", type=float, default=0.5, help="passkey depth in the haystack")
    p.add_argument("--trace-step", type=int, default=64, help="which decode step to trace (0 = none)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for mode in args.modes:
        attention, _, tier = mode.partition(":")
        if attention not in ("dense", "locks") or tier not in ("hbm", "host"):
            p.error(f"mode {mode!r} must be attention:tier with attention dense|locks and tier hbm|host")
    return args


def make_engine(model, tokenizer, mode: str, args: argparse.Namespace) -> Engine:
    """An engine for one "attention:tier" mode, sized for one sequence of context + steps tokens."""
    attention, _, tier = mode.partition(":")
    total = args.context + args.steps + 64
    cache = CacheConfig(attention=attention, tier=tier, budget_tokens=args.budget_tokens,
                        hot_cache_pages=args.hot_cache_pages)
    sched = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=args.prefill_chunk,
                            prefill_chunk=args.prefill_chunk)
    return Engine(model, tokenizer, cache, sched, torch.device(args.device),
                  max_pages=math.ceil(total / cache.page_size) + 4, max_model_len=total)


def run_mode(model, tokenizer, mode: str, prompt, args: argparse.Namespace) -> dict:
    """Prefill, then decode step by step, reading the engine's counters between steps."""
    engine = make_engine(model, tokenizer, mode, args)
    params = SamplingParams(max_tokens=args.steps, temperature=0.0, ignore_eos=True)
    engine.add_request("bench", prompt.prompt_ids, params)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    tokens: list[int] = []
    while not tokens:  # prefill chunks; the last one samples the first token
        tokens += [t for out in engine.step() for t in out.token_ids]
    sync()
    prefill_s = time.perf_counter() - t0
    per_step, before, trace = [], engine.stats(), None
    for step in range(1, args.steps):
        if step == args.trace_step:
            trace = trace_one_step(engine, tokens)
            before = engine.stats()
            continue
        t = time.perf_counter()
        tokens += [t for out in engine.step() for t in out.token_ids]
        sync()
        ms = (time.perf_counter() - t) * 1e3
        after = engine.stats()
        per_step.append(step_record(step, ms, before, after))
        before = after
    engine.close()
    text = tokenizer.decode(tokens)
    return summarise(mode, prefill_s, per_step, tokens, text, prompt, trace)


def trace_one_step(engine: Engine, tokens: list[int]) -> dict:
    """One decode step under torch.profiler: the CUDA runtime calls inside it that block the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        tokens += [t for out in engine.step() for t in out.token_ids]
    names = [e.name for e in prof.events() if e.name.startswith("cuda")]
    blocking = [n for n in names if n in BLOCKING_CALLS]
    return {"blocking_calls": blocking, "num_blocking": len(blocking),
            "runtime_calls": {n: names.count(n) for n in sorted(set(names))}}


def step_record(step: int, ms: float, before: dict, after: dict) -> dict:
    hits = after["cache_hits"] - before["cache_hits"]
    misses = after["cache_misses"] - before["cache_misses"]
    return {"step": step, "ms": ms, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes_moved": after["bytes_moved"] - before["bytes_moved"]}


def summarise(mode, prefill_s, per_step, tokens, text, prompt, trace) -> dict:
    ms = [r["ms"] for r in per_step]
    rates = [r["hit_rate"] for r in per_step if r["hit_rate"] is not None]
    moved = [r["bytes_moved"] for r in per_step]
    return {
        "mode": mode, "prompt_tokens": len(prompt.prompt_ids), "prefill_s": prefill_s,
        "tpot_ms_median": statistics.median(ms), "tpot_ms_p90": sorted(ms)[int(0.9 * (len(ms) - 1))],
        "hit_rate_mean": statistics.fmean(rates) if rates else None,
        "hit_rate_after_step_16": statistics.fmean(rates[16:]) if len(rates) > 16 else None,
        "bytes_moved_per_step_mean": statistics.fmean(moved), "bytes_moved_per_step_max": max(moved),
        "passkey": prompt.passkey, "passkey_found": passkey_found(text, prompt.passkey),
        "completion_head": text[:120], "tokens": tokens, "trace": trace, "per_step": per_step,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    model, tokenizer = load(args.model, device, None, seed=0)
    total = args.context + args.steps + 64
    if model.config.max_position_embeddings < total:
        print(f"note: running {args.model} past its {model.config.max_position_embeddings} trained "
              f"positions (context {args.context})", file=sys.stderr)
        model.config = model.config.replace(max_position_embeddings=total)
    prompt = build_passkey_prompt(tokenizer, args.context, args.depth)
    result = {"command": ["python", "-m", "lockserve.workers.bench", *(argv or sys.argv[1:])],
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "context": args.context, "steps": args.steps,
              "budget_tokens": args.budget_tokens, "modes": {}}
    for mode in args.modes:
        result["modes"][mode] = run_mode(model, tokenizer, mode, prompt, args)
        print(table_row(result["modes"][mode]), flush=True)
    compare_tokens(result, args.reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


def compare_tokens(result: dict, reference: str) -> None:
    ref = result["modes"].get(reference)
    for mode, r in result["modes"].items():
        if ref is None:
            r["same_tokens_as_reference"] = None
            continue
        same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"], strict=False))
        r["same_tokens_as_reference"] = r["tokens"] == ref["tokens"]
        r["token_agreement_with_reference"] = same / max(len(ref["tokens"]), 1)
        print(f"{mode:12s} tokens equal to {reference}: {r['same_tokens_as_reference']} "
              f"({same}/{len(ref['tokens'])})")


def table_row(r: dict) -> str:
    hit = "-" if r["hit_rate_mean"] is None else f"{r['hit_rate_mean']:.3f}"
    blocking = "-" if r["trace"] is None else r["trace"]["num_blocking"]
    return (f"{r['mode']:12s} prefill {r['prefill_s']:7.2f}s  tpot {r['tpot_ms_median']:7.2f} ms  "
            f"hit {hit}  moved/step {r['bytes_moved_per_step_mean'] / 2**20:8.2f} MiB  "
            f"blocking calls in traced step {blocking}  passkey {r['passkey_found']}")


if __name__ == "__main__":
    raise SystemExit(main())
