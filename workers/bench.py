"""Decode benchmark: TPOT, launches, bytes and the roofline of the decode step, mode by mode.

    python -m lockserve.workers.bench --model llama-3.1-8b --context 131072 --fill synthetic \
        --modes dense:hbm locks:hbm locks:host --steps 128 --out docs/results/decode_llama8b_128k.json

A mode is "attention:tier" (dense|locks : hbm|host|host+nvme), or "locks:host-nocache" (every
selected page crosses PCIe each step: the floor the hot-page cache lifts). Each mode fills the
same requests - a real prompt prefilled by the engine (`--fill prompt`: the passkey prompt over
Paul Graham's essays, real page reuse) or random K/V written straight into the cache with
summaries built by the real code (`--fill synthetic`: honest bytes and times, unrealistic page
reuse) - decodes `--warmup` steps (graph captures happen there), then times `--steps` greedy
steps. Per mode: TPOT median / p90, tokens/s, the hot-cache hit rate and PCIe bytes per step
(the engine's counters), HBM bytes per step (weights + summaries + attended pages: a count, not
a measurement), the roofline (HBM bytes / the read bandwidth of a read-only kernel + PCIe bytes
/ the UVA gather bandwidth, both measured in the same run) and TPOT / roofline, and a profile of
one step: kernels on the device, launch calls on the host (runtime and driver API), calls that
block the host, and device time by kernel and by part of the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig

from .api import load
from .engine import Engine
from .engine.sampling import SamplingParams
from .passkey import build_passkey_prompt, passkey_found

MODES = ("dense:hbm", "locks:hbm", "locks:host", "locks:host-nocache", "locks:host+nvme", "dense:host")
# Calls that make the host wait for the device.
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
# Device time by part of the step, from kernel names (first match wins; "other" = the rest).
PARTS = (("attention", ("sparse_decode", "merge_splits", "flash", "attention")),
         ("scoring", ("locks_score", "score_pages", "share_average", "row_partials")),
         ("selection", ("selection_keys", "decode_slots", "topk", "radix", "sort", "gatherTopK")),
         ("transfer", ("gather_pages", "cache_", "scatter", "index", "cumsum", "masked")),
         ("weights", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitK")),
         ("norm_rope_act", ("rms_norm", "rope_write", "silu_mul", "add_rms")))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockserve.workers.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2), a preset, a .gguf or HF folder")
    p.add_argument("--context", type=int, default=131072, help="tokens of context per request")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--steps", type=int, default=128, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing (graph captures)")
    p.add_argument("--budget-tokens", type=int, default=2048, help="LOCKS budget per KV head")
    p.add_argument("--modes", nargs="+", default=["dense:hbm", "locks:hbm", "locks:host"])
    p.add_argument("--reference", default="locks:hbm", help="mode whose tokens the others are compared to")
    p.add_argument("--fill", choices=("auto", "prompt", "synthetic"), default="auto",
                   help="auto: synthetic for random-weight presets, the passkey prompt otherwise")
    p.add_argument("--hot-cache-pages", type=int, default=None,
                   help="default: 2x what one step selects over all layers (the working set)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--depth", type=float, default=0.5, help="passkey depth in the haystack")
    p.add_argument("--graphs", choices=("on", "off"), default="on",
                   help="replay decode steps from CUDA graphs")
    p.add_argument("--nvme-dir", default="/tmp/lockserve-bench-nvme")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host arena of host+nvme (default: half the KV)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"mode {mode!r} must be one of {', '.join(MODES)}")
    if args.steps < 1 or args.batch < 1 or args.context < 2:
        p.error("--steps and --batch must be >= 1 and --context >= 2")
    return args


# ---- engines and requests -------------------------------------------------------------------------


def make_engine(model, tokenizer, mode: str, args: argparse.Namespace) -> Engine:
    """An engine for one mode, sized for `batch` requests of context + warmup + steps tokens."""
    attention, _, tier = mode.partition(":")
    nocache = tier == "host-nocache"
    tier = "host" if nocache else tier
    total = args.context + args.warmup + args.steps + 16
    pages = math.ceil(total / 16) + 1
    kv_gib = args.batch * pages * model.config.num_layers * model.config.num_kv_heads * 16 * 2 * \
        model.config.head_dim * model.dtype.itemsize / 2**30
    mc = model.config
    selected = args.batch * mc.num_layers * mc.num_kv_heads * math.ceil(args.budget_tokens / 16)
    cache = CacheConfig(
        attention=attention, tier=tier, budget_tokens=args.budget_tokens,
        hot_cache_pages=0 if nocache else (args.hot_cache_pages or 2 * selected),
        host_capacity_gib=args.host_gib or (kv_gib / 2 if tier == "host+nvme" else kv_gib + 0.01),
        nvme_capacity_gib=kv_gib + 0.01, nvme_dir=args.nvme_dir if tier == "host+nvme" else None)
    sched = SchedulerConfig(max_num_seqs=args.batch, prefill_chunk=args.prefill_chunk,
                            max_num_batched_tokens=max(args.prefill_chunk, args.batch))
    return Engine(model, tokenizer, cache, sched, torch.device(args.device), max_pages=args.batch * pages,
                  max_model_len=total, use_graphs=args.graphs == "on" and None)


def start_requests(engine: Engine, prompts: list[list[int]], args, synthetic: bool) -> list[list[int]]:
    """Queue every request, fill its context (prefill or synthetic) and return each one's tokens
    so far (the first sampled token)."""
    # Room past the traced step: a request's last step also releases its pages (not a decode cost).
    params = SamplingParams(max_tokens=args.warmup + args.steps + 8, temperature=0.0, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        if synthetic:
            tokens[i].append(engine.fill_synthetic(f"r{i}", seed=i))
    while any(not t for t in tokens):  # prefill chunks; each request's last one samples
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.token_ids
    return tokens


def decode_steps(engine: Engine, tokens: list[list[int]], n: int, sync: bool = True) -> list[float]:
    """n steps; returns each step's wall time in ms (a step ends with the sampled-token readback;
    sync also waits for the write-backs of filled pages, which run on a side stream)."""
    wait = torch.cuda.synchronize if sync and engine.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.token_ids
        wait()
        times.append((time.perf_counter() - t) * 1e3)
    return times


# ---- one step's profile ----------------------------------------------------------------------------


def profile_step(engine: Engine, tokens: list[list[int]]) -> dict:
    """One decode step under torch.profiler: device kernels, host launch calls, blocking calls,
    and device time by kernel and by part of the step."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        decode_steps(engine, tokens, 1, sync=False)  # the profiler synchronises once at its end
    events = list(prof.events())
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.device_time)
    parts = {name: 0.0 for name, _ in PARTS} | {"other": 0.0}
    for name, times in by_kernel.items():
        parts[kernel_part(name)] += sum(times)
    top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "device_kernels": len(kernels),
        "device_kernels_per_layer": len(kernels) / engine.model.config.num_layers,
        "device_time_us": sum(e.device_time for e in kernels),
        "device_time_us_by_part": parts,
        "host_launch_calls": {n: host.count(n) for n in LAUNCHES if n in host},
        "blocking_calls": {n: host.count(n) for n in BLOCKING if n in host},
        "top_kernels": [{"name": n[:120], "count": len(t), "total_us": sum(t)} for n, t in top],
    }


def kernel_part(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k.lower() in low for k in keys):
            return part
    return "other"


# ---- bytes and ceilings ----------------------------------------------------------------------------


def step_bytes(engine: Engine, context: int, batch: int, pcie_bytes: float) -> dict:
    """Bytes one decode step reads from HBM (a count from the shapes) and moves over PCIe."""
    model, kv, cc = engine.model, engine.kv, engine.cache_config
    lay = kv.layout
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head is not None:  # the embedding is read row by row, the LM head whole
        params -= embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    pages = math.ceil(context / lay.page_size)
    attended = pages if cc.attention == "dense" else min(pages, engine.budget_pages)
    per_page = lay.num_layers * lay.num_kv_heads * lay.geometry.slot_bytes
    summaries = 0 if cc.attention == "dense" else batch * (pages - 1) * lay.num_layers * \
        lay.num_kv_heads * kv.summaries.bytes_per_page
    kv_bytes = batch * attended * per_page
    return {"weights": params, "summaries": summaries, "kv": kv_bytes, "hbm": params + summaries + kv_bytes,
            "pcie": pcie_bytes}


def measure_ceilings(device: torch.device) -> dict:
    """Read bandwidth of a read-only kernel (a sum over 4 GiB), the device copy, and the UVA gather
    of random 8 KiB pages from 2 GiB of registered host memory, in GB/s."""
    if device.type != "cuda":
        return {"read_gbps": None, "copy_gbps": None, "gather_gbps": None}
    from lockserve.offload.arena import PageGeometry
    from lockserve.offload.gather import gather_pages
    from lockserve.offload.host import HostArena

    read, copy = _hbm_rates(device)
    geo = PageGeometry(16, 128, torch.bfloat16)
    with HostArena.create(geo, 2**31 // geo.slot_bytes) as arena:
        arena.register_cuda()
        n = 16384
        src = torch.randint(0, arena.num_slots, (n,), device=device)
        dst = torch.empty((n, *geo.page_shape), dtype=geo.dtype, device=device)
        idx = torch.arange(n, device=device)
        ms = time_ms(lambda: gather_pages(arena.uva_pool(), src, dst, idx), device)
        gather = n * geo.slot_bytes / ms / 1e6
    return {"read_gbps": read, "copy_gbps": copy, "gather_gbps": gather}


def _hbm_rates(device: torch.device) -> tuple[float, float]:
    """(read, copy) GB/s: a float32-accumulating sum over 4 GiB of bf16, and a 4 GiB copy (read +
    written bytes)."""
    x = torch.randn(2**31, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    read = 4 * 2**30 / time_ms(lambda: x.sum(dtype=torch.float32), device) / 1e6
    return read, 8 * 2**30 / time_ms(lambda: y.copy_(x), device) / 1e6


def time_ms(fn, device: torch.device) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


# ---- one mode ----------------------------------------------------------------------------------


def run_mode(model, tokenizer, mode: str, prompts, args, synthetic: bool, ceilings: dict) -> dict:
    engine = make_engine(model, tokenizer, mode, args)
    t0 = time.perf_counter()
    tokens = start_requests(engine, prompts, args, synthetic)
    fill_s = time.perf_counter() - t0
    decode_steps(engine, tokens, args.warmup)
    before = engine.stats()
    ms = decode_steps(engine, tokens, args.steps)
    after = engine.stats()
    profile = profile_step(engine, tokens)
    counters = dict(engine.runner.counters)
    hits, misses = after["cache_hits"] - before["cache_hits"], after["cache_misses"] - before["cache_misses"]
    pcie = (after["bytes_moved"] - before["bytes_moved"]) / args.steps
    nbytes = step_bytes(engine, args.context + args.warmup + args.steps // 2, args.batch, pcie)
    engine.close()
    del engine
    gc.collect()  # the next mode needs this mode's pools and graphs back
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile, args)


def summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile, args) -> dict:
    med = statistics.median(ms)
    roof = None
    if ceilings["read_gbps"]:
        roof = nbytes["hbm"] / ceilings["read_gbps"] / 1e6 + nbytes["pcie"] / ceilings["gather_gbps"] / 1e6
    return {
        "mode": mode, "fill_s": fill_s, "tpot_ms_median": med, "tpot_ms_p90": percentile(ms, 0.9),
        "tpot_ms_min": min(ms), "tokens_per_s": args.batch * 1e3 / med,
        "hit_rate": hits / (hits + misses) if hits + misses else None, "misses_per_step": misses / args.steps,
        "bytes_per_step": nbytes, "roofline_ms": roof, "tpot_over_roofline": med / roof if roof else None,
        "runner": counters, "profile": profile, "step_ms": ms, "tokens": tokens,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the run -----------------------------------------------------------------------------------


def make_prompts(model, tokenizer, args, synthetic: bool) -> tuple[list[list[int]], str | None]:
    if synthetic:
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        ids = [torch.randint(0, vocab, (args.context,), generator=gen).tolist() for _ in range(args.batch)]
        return ids, None
    prompt = build_passkey_prompt(tokenizer, args.context, args.depth)
    return [prompt.prompt_ids] * args.batch, prompt.passkey


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    model, tokenizer = load(args.model, device, None, seed=0)
    synthetic = args.fill == "synthetic" or (args.fill == "auto" and not _is_real(args.model))
    total = args.context + args.warmup + args.steps + 16
    if model.config.max_position_embeddings < total:
        print(f"note: running {args.model} past its {model.config.max_position_embeddings} trained positions",
              file=sys.stderr)
        model.config = model.config.replace(max_position_embeddings=total)
    prompts, passkey = make_prompts(model, tokenizer, args, synthetic)
    ceilings = measure_ceilings(device)
    result = {"commit": source_commit(),
              "command": ["python", "-m", "lockserve.workers.bench", *(argv or sys.argv[1:])],
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "model": args.model, "dtype": str(model.dtype).removeprefix("torch."),
              "workload": "synthetic KV fill (random K/V, real summaries): honest bytes and times, "
                          "unrealistic page reuse" if synthetic else "real model decoding a real prompt",
              "context": args.context, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "budget_tokens": args.budget_tokens, "graphs": args.graphs, "ceilings": ceilings, "modes": {}}
    for mode in args.modes:
        r = run_mode(model, tokenizer, mode, prompts, args, synthetic, ceilings)
        if passkey is not None:
            r["passkey_found"] = passkey_found(tokenizer.decode(r["tokens"][0]), passkey)
        result["modes"][mode] = r
        print(table_row(r), flush=True)
    compare_tokens(result, args.reference)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


def source_commit() -> str | None:
    """The checkout's commit (git), or $LOCKSERVE_COMMIT where the tree was copied without .git."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if out is not None and out.returncode == 0:
        return out.stdout.strip()
    return os.environ.get("LOCKSERVE_COMMIT")


def _is_real(model: str) -> bool:
    return model == "default" or model.endswith(".gguf") or Path(model).is_dir()


def compare_tokens(result: dict, reference: str) -> None:
    ref = result["modes"].get(reference)
    for mode, r in result["modes"].items():
        if ref is None:
            r["same_tokens_as_reference"] = None
            continue
        pairs = [(a, b) for ra, rb in zip(r["tokens"], ref["tokens"], strict=True)
                 for a, b in zip(ra, rb, strict=False)]
        r["same_tokens_as_reference"] = r["tokens"] == ref["tokens"]
        r["token_agreement_with_reference"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        print(f"{mode:20s} tokens equal to {reference}: {r['same_tokens_as_reference']} "
              f"({r['token_agreement_with_reference']:.3f})")


def table_row(r: dict) -> str:
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
    roof = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.2f} ms (x{r['tpot_over_roofline']:.2f})"
    p = r["profile"]
    return (f"{r['mode']:20s} tpot {r['tpot_ms_median']:8.3f} ms (p90 {r['tpot_ms_p90']:.3f})  "
            f"roofline {roof}  "
            f"hit {hit}  pcie/step {r['bytes_per_step']['pcie'] / 2**20:7.2f} MiB  "
            f"kernels/step {p['device_kernels']}  blocking {sum(p['blocking_calls'].values())}")


if __name__ == "__main__":
    raise SystemExit(main())
