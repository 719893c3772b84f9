"""Decode benchmark: TPOT, launches, bytes and the roofline of the decode step, mode by mode.

    python -m lockserve.cluster.measure.decode.bench --model llama-3.1-8b --context 131072 --fill synthetic \
        --modes dense:hbm locks:hbm locks:host --steps 128 --out docs/results/decode_llama8b_128k.json

A mode is "attention:tier" (dense|locks : hbm|host|host+nvme), "locks:host-nocache" (every
selected page crosses PCIe each step: the floor the hot-page cache lifts), "locks:host+nvme-inline"
(host+nvme with its spills inline in the allocation, cache.nvme_spill_behind off),
"locks:host+nvme-twice" (cached pages spill with a write beside their prefix records,
cache.nvme_saved_spills off) or "locks:host+nvme-nowait" (allocations spill around queued prefix
saves instead of waiting for them, cache.nvme_wait_for_saves off; the decode benches turn prefix
reuse off, so there both are host+nvme). Each mode fills the same requests - a real prompt
prefilled by the engine (`--fill prompt`: the passkey prompt over
Paul Graham's essays, real page reuse) or random K/V written straight into the cache with
summaries built by the real code (`--fill synthetic`: honest bytes and times, unrealistic page
reuse) - decodes `--warmup` steps (graph captures happen there), then times `--steps` greedy
steps. Per mode: TPOT median / p90, tokens/s, the hot-cache hit rate and PCIe bytes per step
(the engine's counters), HBM bytes per step (weights + summaries + attended pages: a count, not
a measurement), the roofline (HBM bytes / the read bandwidth of a read-only kernel + PCIe bytes
/ the UVA gather bandwidth, both measured in the same run) and TPOT / roofline, and a profile of
one step: kernels on the device, launch calls on the host (runtime and driver API), calls that
block the host, device time by kernel and by part of the step, and the idle gaps between the
step's kernels (by the kernel that waited); with graphs, the device span of a replay
(`graph_span_ms`: TPOT minus it is the step outside the graph) and where the step's wall time goes
on the host around the replay (`host_ms`). `--repeat N` runs the modes N
times in turn and pools each mode's steps: ratios between modes that hold against the machine's
drift (a small model's TPOT moved 15% between runs minutes apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lockserve.cluster.measure.decode.ceilings import measure_ceilings, step_bytes
from lockserve.cluster.measure.decode.engines import (
    MODE_TIERS,
    MODES,
    DecodeSpec,
    HitRateRecorder,
    bench_engine,
    decode_steps,
    hot_cache,
    is_synthetic,
    load_model,
    make_prompts,
    start_requests,
    valid_mode,
)
from lockserve.cluster.measure.decode.step_profile import profile_step
from lockserve.cluster.measure.eval.passkey import passkey_found
from lockserve.cluster.measure.harness import flags
from lockserve.configs.schema import (
    ATTENTION_MODES,
    RADIX_BITS,
    CacheConfig,
)
from lockserve.offload.cache import COMMITS
from lockserve.workers.engine import Engine

from lockserve.provenance import command_line, run_provenance

DEFAULT_REFERENCE = "locks:hbm"  # the mode whose tokens the others are compared with, where it runs
NO_REFERENCE = "none"
SPAN_STEPS = 5  # steps after the traced one whose graph replays are timed on the device (graph_span_ms)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure.decode.bench",
                                description=__doc__.split("\n")[0])
    flags.model(p, "default")
    p.add_argument("--context", type=int, default=131072, help="tokens of context per request")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    flags.steps(p, 128, warmup=8)
    flags.budget_tokens(p)
    p.add_argument("--modes", nargs="+", default=["dense:hbm", "locks:hbm", "locks:host"])
    p.add_argument("--reference", default=None,
                   help="mode whose tokens the others are compared to; its own row carries no comparison "
                        f"(default: {DEFAULT_REFERENCE} where it runs beside another mode; "
                        f"'{NO_REFERENCE}': compare nothing)")
    flags.fill(p)
    flags.hot_cache_pages(p)
    flags.prefill_chunk(p, 4096, "fills the passkey prompt of real models")
    p.add_argument("--prefill-window", type=int, default=131072,
                   help="host tiers: tokens of a prefilling request kept on the GPU "
                        "(cache.prefill_window_tokens)")
    p.add_argument("--prefix-reuse", action="store_true", help="reuse cached prompt pages (default: cold)")
    p.add_argument("--prefill-chunk-decoding", type=int, default=None,
                   help="prompt tokens a step while other requests decode (default: no cap)")
    p.add_argument("--prefill-attention-decoding", type=int, default=None,
                   help="prefill attention work a step while other requests decode, query x key tokens "
                        "(default: no cap)")
    p.add_argument("--prefill-layers-decoding", type=int, default=None,
                   help="layers of a prompt chunk's forward a step while other requests decode (default: "
                        "the whole forward)")
    p.add_argument("--depth", type=float, default=0.5, help="passkey depth in the haystack")
    flags.graphs(p)
    flags.nvme_dir(p)
    flags.host_gib(p)
    p.add_argument("--nvme-lookahead", type=int, default=2,
                   help="host+nvme: promote what a selection at this multiple of the budget takes, "
                        "ahead of the next step (0: off; default 2, the config's default)")
    p.add_argument("--nvme-io-threads", type=int, default=4,
                   help="host+nvme: threads for NVMe page reads and writes (default 4, the config's default)")
    p.add_argument("--cache-commit", choices=COMMITS, default=None,
                   help="where the hot cache's commit runs (cache.hot_cache_commit; default: the "
                        "config's, 'inline')")
    p.add_argument("--radix-bits", type=int, choices=RADIX_BITS, default=CacheConfig().select_radix_bits,
                   help="bits a pass of the selection's threshold search fixes: 1 bisects, 2 fixes two "
                        "(cache.select_radix_bits; default: the config's, 1)")
    flags.summary_eigh(p)
    p.add_argument("--repeat", type=int, default=1,
                   help="run the modes this many times in turn (A B C A B C ...); a mode's TPOT pools "
                        "its runs' steps, so ratios between modes hold against drift (repeat_tpot_ms: "
                        "each run's median)")
    p.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                   help="run each mode (and each repeat) in a fresh process: on the H200 a mode run after "
                        "another in one process ran 0.1-0.3 ms a step slower on SmolLM2 (what the first "
                        "left behind: CUPTI after its profile, and graphs captured later replay slower; "
                        "docs/notes/decode_step.md); auto: on where the device is CUDA and there is more "
                        "than one run")
    flags.device(p)
    flags.out(p, "the result file (JSON)")
    args = p.parse_args(argv)
    for mode in args.modes:
        if not valid_mode(mode):
            p.error(f"mode {mode!r} must be attention:tier, attention one of {', '.join(ATTENTION_MODES)} "
                    f"and tier one of {', '.join(MODE_TIERS)} (e.g. {', '.join(MODES)})")
    if args.steps < 1 or args.batch < 1 or args.context < 2 or args.repeat < 1:
        p.error("--steps, --batch and --repeat must be >= 1 and --context >= 2")
    try:
        args.reference = resolve_reference(args.modes, args.reference)
    except ValueError as err:
        p.error(str(err))
    return args


def resolve_reference(modes: list[str], reference: str | None) -> str | None:
    """The mode the others' tokens are compared with, or None (no comparison). Named, it must run
    beside another mode: a run whose only mode is its reference would publish a mode compared with
    itself. Not named: DEFAULT_REFERENCE where it runs beside another mode, else None."""
    others = set(modes) - {reference}
    if reference is None:
        return DEFAULT_REFERENCE if DEFAULT_REFERENCE in modes and len(set(modes)) > 1 else None
    if reference == NO_REFERENCE:
        return None
    if reference not in modes:
        raise ValueError(f"--reference ({reference}) must be one of --modes ({' '.join(modes)}), "
                         f"or '{NO_REFERENCE}'")
    if not others:
        other = DEFAULT_REFERENCE if reference != DEFAULT_REFERENCE else "locks:host"
        raise ValueError(f"--modes ({' '.join(modes)}) holds only the --reference mode ({reference}): its "
                         f"tokens would be compared with themselves; add the mode to compare "
                         f"(e.g. --modes {other} {reference}) or pass --reference {NO_REFERENCE}")
    return reference


# ---- one mode ----------------------------------------------------------------------------------


def run_mode(model, tokenizer, mode: str, prompts, spec: DecodeSpec, synthetic: bool, ceilings: dict) -> dict:
    """One mode's engine: fill the requests' contexts, then measure_decode."""
    with bench_engine(model, tokenizer, mode, spec) as engine:
        t0 = time.perf_counter()
        tokens = start_requests(engine, prompts, spec, synthetic)
        return measure_decode(engine, mode, tokens, time.perf_counter() - t0, spec, ceilings)


def measure_decode(engine: Engine, mode: str, tokens: list[list[int]], fill_s: float, spec: DecodeSpec,
                   ceilings: dict) -> dict:
    """Decode the engine's running requests (their contexts filled, `tokens` their ids so far):
    spec.warmup steps, spec.steps timed ones (each step's hot-cache hit rate recorded where there
    is a hot cache), one profiled; the mode's result (summarise). The context for the bytes is
    spec.context, the batch len(tokens)."""
    decode_steps(engine, tokens, spec.warmup)
    before = engine.stats()
    cc, hot = engine.cache_config, hot_cache(engine)
    cached = cc.tier != "hbm" and cc.attention != "dense" and hot is not None
    recorder = HitRateRecorder(hot, spec.steps) if cached else None
    ms = decode_steps(engine, tokens, spec.steps, after_step=recorder)
    after = engine.stats()
    span = replay_timing(engine, tokens, SPAN_STEPS)  # before the profiler, as the timed steps
    profile = profile_step(engine, tokens) | span
    counters = dict(engine.runner.counters)
    if engine.kv.settle_graphs is not None:  # the summary builds of filled pages (engine/settle.py)
        counters.update(engine.kv.settle_graphs.counters)
    hits, misses = after["cache_hits"] - before["cache_hits"], after["cache_misses"] - before["cache_misses"]
    pcie = (after["bytes_moved"] - before["bytes_moved"]) / spec.steps
    nbytes = step_bytes(engine, spec.context + spec.warmup + spec.steps // 2, len(tokens), pcie)
    result = summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile,
                       len(tokens), spec.steps)
    result["hit_rate_by_step"] = recorder.rates() if recorder is not None else None
    result["nvme"] = nvme_counters(before, after, spec.steps)
    result["cache_commit"] = None if hot is None else hot.commit
    return result


def replay_timing(engine: Engine, tokens: list[list[int]], steps: int) -> dict:
    """Over `steps` steps, medians of: `graph_span_ms`, the device time of one decode graph replay,
    first kernel to last (CUDA events recorded around it): TPOT minus this is the step's time
    outside the graph, this minus the kernels' summed time (profile.device_time_us) the gaps
    between the graph's kernels; and `host_ms`, where the step's wall time goes on the host:
    before_replay (the scheduler, the plan, the staged upload), replay_call (inside graph.replay,
    the graph's launch) and after_replay (the sampler, the readback's wait for the device, the
    bookkeeping after it and the bench's device sync). None for both where no step replayed."""
    rows = replay_steps(engine, tokens, steps)
    if not rows:
        return {"graph_span_ms": None, "host_ms": None}
    names = ("before_replay", "replay_call", "after_replay")
    return {"graph_span_ms": statistics.median(r["span"] for r in rows),
            "host_ms": {n: statistics.median(r[n] for r in rows) for n in names}}


def replay_steps(engine: Engine, tokens: list[list[int]], steps: int) -> list[dict]:
    """`steps` steps with CUDA events around each graph replay; per replayed step (ms): `wall`, its
    host time `before_replay`, `replay_call` and `after_replay`, and the graph's device `span`.
    Empty where no step replayed (no graphs, or every step captured)."""
    if not engine.runner.use_graphs:
        return []
    graphs = engine.runner.graphs
    graphs.replay_events, marks = [], []
    try:
        decode_steps(engine, tokens, steps, marks=marks)
    finally:
        events, graphs.replay_events = graphs.replay_events, None
    if not events:
        return []
    torch.cuda.synchronize(engine.device)
    # Each replay's step is the one whose wall time holds its call (a step that captured instead
    # has no replay).
    return [{"wall": (t1 - t0) * 1e3, "before_replay": (called - t0) * 1e3,
             "replay_call": (returned - called) * 1e3, "after_replay": (t1 - returned) * 1e3,
             "span": start.elapsed_time(end)}
            for start, end, called, returned in events for t0, t1 in marks if t0 <= called <= t1]


def nvme_counters(before: dict, after: dict, steps: int) -> dict | None:
    """host+nvme: the spill tier's counters over the timed steps, per step (missed_pages: selected
    pages found on NVMe; step_reruns: forwards run again after promoting them; steps_missed: steps
    that reran; sync_steps: steps that fell back to promoting layer by layer; spilled / promoted
    pages), and the pages spilled in all (spilled_pages_total); None on other tiers."""
    keys = [k for k in after if k.startswith("nvme_")]
    if not keys:
        return None
    out = {k.removeprefix("nvme_"): (after[k] - before.get(k, 0)) / steps for k in keys}
    out["spilled_pages_total"] = after["nvme_spilled_pages"]
    return out


def summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile, batch: int,
              steps: int) -> dict:
    med = statistics.median(ms)
    roof = None
    if ceilings["read_gbps"]:
        roof = nbytes["hbm"] / ceilings["read_gbps"] / 1e6 + nbytes["pcie"] / ceilings["gather_gbps"] / 1e6
    return {
        "mode": mode, "fill_s": fill_s, "tpot_ms_median": med, "tpot_ms_p90": percentile(ms, 0.9),
        # the mean counts the steps a median hides: page settles, a graph's one-time capture
        "tpot_ms_mean": statistics.fmean(ms), "tpot_ms_min": min(ms), "tokens_per_s": batch * 1e3 / med,
        "hit_rate": hits / (hits + misses) if hits + misses else None, "misses_per_step": misses / steps,
        "bytes_per_step": nbytes, "roofline_ms": roof, "tpot_over_roofline": med / roof if roof else None,
        "runner": counters, "profile": profile, "step_ms": ms, "tokens": tokens,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the run -----------------------------------------------------------------------------------

WORKLOADS = {
    True: "synthetic KV fill (random K/V, real summaries): honest bytes and times, unrealistic page reuse",
    False: "real model decoding a real prompt",
}


def run_info(command: list[str], device: torch.device, model_name: str, model, synthetic: bool) -> dict:
    """What every result file records about its run: its provenance (lockserve.provenance), model,
    dtype and workload."""
    return {**run_provenance(command, device), "model": model_name,
            "dtype": str(model.dtype).removeprefix("torch."), "workload": WORKLOADS[synthetic]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if isolated(args):
        result = isolated_runs(argv, args)
        compare_tokens(result, args.reference)
        return write_result(args.out, result)
    spec = DecodeSpec.from_args(args)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, device, args.context + args.warmup + args.steps + 16)
    synthetic = is_synthetic(args.fill, args.model)
    prompts, passkey = make_prompts(model, tokenizer, args.context, args.batch, synthetic, args.depth)
    ceilings = measure_ceilings(device)
    command = command_line("-m lockserve.cluster.measure.decode.bench", argv)
    result = {**run_info(command, device, args.model, model, synthetic),
              "context": args.context, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "budget_tokens": args.budget_tokens, "graphs": args.graphs,
              "radix_bits": spec.radix_bits, "summary_eigh": spec.summary_eigh, "ceilings": ceilings,
              "modes": {}}
    for run in range(args.repeat):
        for mode in args.modes:
            r = run_mode(model, tokenizer, mode, prompts, spec, synthetic, ceilings)
            if passkey is not None:
                r["passkey_found"] = passkey_found(tokenizer.decode(r["tokens"][0]), passkey)
            which = f"  (run {run + 1} of {args.repeat})" if args.repeat > 1 else ""
            print(table_row(r) + which, flush=True)
            add_run(result["modes"], mode, r, args.batch)
    compare_tokens(result, args.reference)
    return write_result(args.out, result | {"isolated": False})


def write_result(out: Path, result: dict) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


def isolated(args: argparse.Namespace) -> bool:
    if args.isolate != "auto":
        return args.isolate == "on"
    return args.device.startswith("cuda") and len(args.modes) * args.repeat > 1


def isolated_runs(argv: list[str], args: argparse.Namespace) -> dict:
    """Each run of each mode in a fresh `python -m lockserve.cluster.measure.decode.bench` process (the same
    flags, then --modes MODE --repeat 1 --isolate off and a scratch --out: later flags win),
    merged as one process merges its runs; the command recorded is this one."""
    result: dict | None = None
    command = command_line("-m lockserve.cluster.measure.decode.bench", argv)
    with tempfile.TemporaryDirectory(prefix="lockserve-bench-") as tmp:
        for run in range(args.repeat):
            for i, mode in enumerate(args.modes):
                out = Path(tmp) / f"run{run}-mode{i}.json"
                cmd = [sys.executable, "-m", "lockserve.cluster.measure.decode.bench", *argv, "--modes", mode,
                       "--reference", NO_REFERENCE, "--repeat", "1", "--isolate", "off", "--out", str(out)]
                code = subprocess.run(cmd).returncode
                if code:
                    raise SystemExit(f"bench: the process for {mode} (run {run + 1}) failed with exit {code}")
                child = json.loads(out.read_text())
                if result is None:
                    result = child | {"command": command, "modes": {}, "isolated": True}
                add_run(result["modes"], mode, child["modes"][mode], args.batch)
    return result


def add_run(modes: dict, mode: str, r: dict, batch: int) -> None:
    """A mode's first run becomes its result (with repeat_tpot_ms, repeat_same_tokens); a later
    one is pooled into it (pool_repeat)."""
    if mode in modes:
        pool_repeat(modes[mode], r, batch)
    else:
        modes[mode] = r | {"repeat_tpot_ms": [r["tpot_ms_median"]], "repeat_same_tokens": True}


def pool_repeat(first: dict, again: dict, batch: int) -> None:
    """Fold a repeated run of a mode into its first run's result: the timed steps pooled and the
    TPOT figures taken over them; the profile and counters stay the first run's. Each run's
    median goes to repeat_tpot_ms; repeat_same_tokens says whether every run decoded the same."""
    ms = first["step_ms"] = first["step_ms"] + again["step_ms"]
    med = statistics.median(ms)
    first.update(tpot_ms_median=med, tpot_ms_p90=percentile(ms, 0.9), tpot_ms_mean=statistics.fmean(ms),
                 tpot_ms_min=min(ms), tokens_per_s=batch * 1e3 / med)
    if first["roofline_ms"]:
        first["tpot_over_roofline"] = med / first["roofline_ms"]
    first["repeat_tpot_ms"].append(again["tpot_ms_median"])
    first["repeat_same_tokens"] = first["repeat_same_tokens"] and again["tokens"] == first["tokens"]


def compare_tokens(result: dict, reference: str | None) -> None:
    """result["reference"] = reference; each other mode's same_tokens_as_reference and
    token_agreement_with_reference against it. The reference's own row, and every row where
    reference is None, carries None: a mode is never compared with itself."""
    result["reference"] = reference
    ref = result["modes"].get(reference) if reference is not None else None
    for mode, r in result["modes"].items():
        if ref is None or mode == reference:
            r["same_tokens_as_reference"] = None
            r["token_agreement_with_reference"] = None
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
    return (f"{r['mode']:20s} tpot {r['tpot_ms_median']:8.3f} ms (p90 {r['tpot_ms_p90']:.3f}, "
            f"mean {r['tpot_ms_mean']:.3f})  "
            f"roofline {roof}  "
            f"hit {hit}  pcie/step {r['bytes_per_step']['pcie'] / 2**20:7.2f} MiB  "
            f"kernels/step {p['device_kernels']}  blocking {sum(p['blocking_calls'].values())}"
            + ("" if p.get("graph_span_ms") is None else
               f"  graph {p['graph_span_ms']:.3f} ms (kernels {p['device_time_us'] / 1e3:.3f}, "
               f"gaps {p['kernel_gaps_us'] / 1e3:.3f})  host before/in/after replay "
               + "/".join(f"{v:.3f}" for v in p["host_ms"].values()) + " ms")
            + ("" if not r.get("nvme") else f"  nvme reruns/step {r['nvme']['step_reruns']:.2f} "
               f"missed pages/step {r['nvme']['missed_pages']:.0f}"))


if __name__ == "__main__":
    raise SystemExit(main())
