"""`lockserve bench prefill`: real prefills through the engine beside a plain torch prefill of the
same shape, measured in the same run, written as JSON, CSV, markdown and a PNG.

Per context: the plain anchor (`plain_prefill`: embedding-free [RMSNorm, QKV, flash SDPA causal,
O, SwiGLU] x layers, one shot) once; then per mode one engine (prefix reuse on): a warm-up
request (kernels compile), then
- cold: a prompt of `context` random tokens and `--question` more, prefilled from nothing
  (time to its first token = its prefill; TFLOP/s over the plain stack's FLOPs);
- warm: the same prompt again (every full page of it cached but the last) and the same document
  with another question (the document's pages cached): time to first token, cached tokens, and
  whether the repeat's greedy tokens equal the cold request's;
- with --time-limit S: the cold prefill is timed step by step (each step synchronised; batch 1,
  so step i is the prompt's chunk i) and stopped past S seconds; its TTFT is then the measured
  steps plus the rest predicted by `extrapolate` (a fit of step time against prefix length), and
  the row's status says how many chunks were measured. For prompts that outlive a device's call.
- beside (with --beside): a short request decoding alone, then again while a prefill of
  `context` tokens runs beside it: its TPOT p50 / p99 in both.
- restart (with --restart, host+nvme modes): the engine waits for its prefix saves (timed) and
  closes; a new engine opens over the same nvme_dir and the cold request's prompt is sent again:
  its TTFT (the document's pages read back from NVMe), cached tokens, and whether its tokens equal
  the cold request's.
The engine's PCIe counter (host tiers) counts decode reads only (hot-cache misses, or direct reads
without a cache): a measured request's figure is its decode steps' bytes; a prefill's own reads of
pages that left its window, and a warm request's read of its cached prefix, are not counted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from lockserve.cluster.measure import plots
from lockserve.cluster.measure.decode import bench, engines
from lockserve.cluster.measure.harness.tables import (
    Column,
    commas,
    f2,
    f3,
    markdown_table,
    run_header,
    tokens,
    write_atomic,
    write_csv,
    write_json,
    yes_no,
)
from lockserve.cluster.measure.harness.usage import UsageError, check_modes
from lockserve.cluster.measure.plain_prefill import prefill_flops, time_plain_prefill
from lockserve.workers.engine.attention import prefill_backend
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from tqdm import tqdm

MIB = 1 << 20
DEFAULT_MODES = ("locks:hbm", "locks:host", "locks:host+nvme")
GREEDY_TOKENS = 8  # tokens each measured request generates (compared cold against warm)
BESIDE_WARMUP = 16  # decode steps of the beside request before its TPOT is timed

COLUMNS = (
    Column("mode", "mode"), Column("context", "context", tokens), Column("status", "status"),
    Column("prefill_s", "prefill (s)", f2), Column("tflops", "TFLOP/s", f2),
    Column("plain_s", "plain (s)", f2), Column("x_plain", "x plain", f3),
    Column("x_hbm", "x locks:hbm", f3),
    Column("host_share", "host / step", f3),
    Column("pcie_mib", "decode PCIe MiB", f2),
    Column("warm_ttft_s", "warm TTFT (s)", f3), Column("cached_tokens", "cached", tokens),
    Column("new_question_ttft_s", "new question TTFT (s)", f3),
    Column("warm_same_tokens", "warm = cold tokens", yes_no),
    Column("tpot_alone_p99_ms", "TPOT alone p99 (ms)", f2),
    Column("tpot_beside_p99_ms", "TPOT beside prefill p99 (ms)", f2),
    Column("tpot_x_alone", "x alone", f2),
    Column("prefill_beside_s", "prompt beside (s)", f2), Column("beside_steps", "steps beside", commas),
)
RESTART_COLUMNS = (  # shown where a row has them (--restart)
    Column("restart_ttft_s", "TTFT after restart (s)", f3),
    Column("restart_cached", "cached after restart", tokens),
    Column("restart_same_tokens", "restart = cold tokens", yes_no),
)


def window_tokens(args, context: int) -> int:
    """The host tiers' prefill window: --prefill-window, or the whole request (document, question
    and its tokens)."""
    whole = context + args.question + 64
    return whole if args.prefill_window is None else min(args.prefill_window, whole)


def spec_for(args, context: int, device: torch.device) -> engines.DecodeSpec:
    # Room for the document, two questions and their tokens (the warm requests reuse the document's
    # pages: one request's room holds them all); batch 2 only for the beside run, as a 512K
    # document's two requests of GLM-4-9B-Chat-1M's shape (80 GiB of host arena) outgrow /dev/shm.
    room = context + 2 * (args.question + 64)
    return engines.DecodeSpec(context=room, batch=2 if args.beside else 1, steps=1, warmup=0,
                            prefill_chunk=args.prefill_chunk, nvme_dir=args.nvme_dir, device=str(device),
                            host_gib=args.host_gib, summary_eigh=args.summary_eigh,
                            prefill_window=window_tokens(args, context), prefix_reuse=True,
                            prefill_chunk_decoding=args.beside_chunk,
                            prefill_attention_decoding=args.beside_attention,
                            prefill_layers_decoding=args.beside_layers)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_request(engine: Engine, rid: str, prompt: list[int], max_tokens: int = GREEDY_TOKENS,
                  limit_s: float | None = None, chunk: int | None = None) -> dict:
    """One request alone, run to its end: TTFT (s), its greedy tokens, cached prompt tokens, the
    PCIe MiB its decode steps read (the engine's counter: decode reads only). With limit_s (and the
    prefill's chunk): its prefill timed step by step ("steps_s", each step synchronised; of it
    "steps_host_s", until `step` returned; "steps_stats", per step what the engine's tier counters
    gained: `step_counters`) and, once past limit_s seconds without a token, stopped: "ttft_s" is
    then `extrapolate`'s prediction ("extrapolated"), and it has no tokens."""
    moved = engine.stats()["bytes_moved"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(engine.device)
    start = last = time.perf_counter()
    engine.add_request(rid, prompt, params)
    steps, host_s, per_step, ttft, out_tokens, cached = [], [], [], None, [], 0
    before = step_counters(engine) if limit_s is not None else {}
    while engine.has_unfinished():
        outs = engine.step()
        if limit_s is not None and ttft is None:
            host_s.append(time.perf_counter() - last)
            sync(engine.device)
            steps.append(time.perf_counter() - last)
            now = step_counters(engine)
            per_step.append({k: v - before[k] for k, v in now.items() if v != before[k]})
            before = now
            last = time.perf_counter()
        for out in outs:
            ttft = time.perf_counter() - start if ttft is None else ttft
            out_tokens += out.token_ids
            cached = out.num_cached_tokens
        if limit_s is not None and ttft is None and time.perf_counter() - start > limit_s:
            engine.abort(rid)
            guess = extrapolate(steps, chunk, len(prompt))
            return {"ttft_s": guess["ttft_s"], "tokens": None, "cached_tokens": 0, "pcie_mib": None,
                    "steps_s": steps, "steps_host_s": host_s, "steps_stats": per_step, "extrapolated": guess}
    out = {"ttft_s": ttft, "tokens": out_tokens, "cached_tokens": cached,
           "pcie_mib": (engine.stats()["bytes_moved"] - moved) / MIB}
    if limit_s is None:
        return out
    return {**out, "steps_s": steps, "steps_host_s": host_s, "steps_stats": per_step}


STEP_COUNTERS = ("nvme_", "prefix_disk_", "bytes_written")  # what steps_stats follows (prefixes)


def step_counters(engine: Engine) -> dict[str, float]:
    """The engine's numeric tier and prefix-store counters (names starting with STEP_COUNTERS),
    seconds included: where a slow prefill step's time went (syncs the device)."""
    return {k: v for k, v in engine.stats().items()
            if k.startswith(STEP_COUNTERS) and isinstance(v, int | float) and not isinstance(v, bool)}


def extrapolate(steps_s: list[float], chunk: int, prompt_tokens: int) -> dict:
    """The whole prefill's time from its first steps: step i prefills tokens [i * chunk, ...) of
    prompt_tokens, and costs its c_i tokens times (a + b x the prefix they attend on average,
    s_i + c_i / 2): the linear layers' cost a token, and attention's a key. a and b are a least-
    squares fit over the measured steps but the first (it also pays first-call costs; all of them
    when fewer than three); the steps not measured are predicted. fit_max_error: the fit's
    largest relative error on the steps it fitted."""
    n = -(-prompt_tokens // chunk)
    if not 1 <= len(steps_s) < n:
        raise ValueError(f"extrapolate: {len(steps_s)} steps measured of {n}; need 1 to {n - 1}")
    sizes = [min(chunk, prompt_tokens - i * chunk) for i in range(n)]
    x = [i * chunk + c / 2 for i, c in enumerate(sizes)]  # the prefix a token attends, on average
    fit = list(range(1 if len(steps_s) >= 3 else 0, len(steps_s)))
    ys = [steps_s[i] / sizes[i] for i in fit]  # seconds a token
    xs = [x[i] for i in fit]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((v - mx) ** 2 for v in xs)
    b = sum((u - mx) * (v - my) for u, v in zip(xs, ys, strict=True)) / var if var else 0.0
    a = my - b * mx
    predict = [sizes[i] * (a + b * x[i]) for i in range(n)]
    error = max(abs(predict[i] - steps_s[i]) / steps_s[i] for i in fit)
    measured, rest = sum(steps_s), sum(predict[len(steps_s):])
    return {"steps": n, "measured_steps": len(steps_s), "measured_s": measured, "predicted_s": rest,
            "ttft_s": measured + rest, "s_per_token": a, "s_per_token_key": b, "fit_max_error": error}


def extrapolated_status(guess: dict) -> str:
    """A row's status for an `extrapolate`d prefill: chunks measured, and how well the fit matched
    them (it checks nothing below four: the first is left out, and two points fit any line)."""
    fit = (f"fit within {guess['fit_max_error']:.1%}" if guess["measured_steps"] >= 4
           else "too few steps to check the fit")
    return f"extrapolated: {guess['measured_steps']} of {guess['steps']} chunks measured ({fit})"


def beside(engine: Engine, args, prompt: list[int], gen: torch.Generator) -> dict:
    """TPOT of a short request decoding alone, then while a prefill of `prompt` runs beside it."""
    vocab = engine.model.config.vocab_size
    short = torch.randint(0, vocab, (args.beside_context,), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - len(short), ignore_eos=True)
    alone, with_prefill = [], []
    engine.add_request("decoder", short, params)
    last, skipped = None, 0
    while skipped < BESIDE_WARMUP:  # its first decode steps capture graphs for their widths
        if any(o.request_id == "decoder" for o in engine.step()):
            skipped += 1
    while len(alone) < args.beside_steps:
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "decoder" for o in outs):
            if last is not None:
                alone.append(1e3 * (now - last))
            last = now
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    started, steps, ended = time.perf_counter(), 0, []
    while engine.request_status("long") is not None:
        steps += 1
        outs = engine.step()
        now = time.perf_counter()
        if any(o.request_id == "decoder" for o in outs):
            with_prefill.append(1e3 * (now - last))
            ended.append(engine.runner.inflight is None)
            last = now
    prefill_s = time.perf_counter() - started
    engine.abort("decoder")
    return {"tpot_alone_ms": percentiles(alone), "tpot_beside_ms": percentiles(with_prefill),
            "tpot_beside_split_ms": split_by_end(with_prefill, ended),
            "beside_steps": len(with_prefill), "prefill_beside_s": prefill_s, "prefill_beside_steps": steps}


def split_by_end(tpot_ms: list[float], ended: list[bool]) -> dict:
    """The beside TPOT of the steps that ended a prompt chunk's forward (its last layers, the
    chunk's commit: summaries, sharing) and of those that ran a part of it only
    (scheduler.prefill_layers_decoding), so a p99 says which kind of step sets it."""
    return {"ended": percentiles([t for t, e in zip(tpot_ms, ended, strict=True) if e]),
            "part": percentiles([t for t, e in zip(tpot_ms, ended, strict=True) if not e])}


def percentiles(values: list[float]) -> dict:
    """p50, p99 (None without steps) and the steps themselves (ms), so a reader can see the
    distribution."""
    if not values:
        return {"p50": None, "p99": None, "n": 0, "steps_ms": []}
    return {"p50": bench.percentile(values, 0.5), "p99": bench.percentile(values, 0.99), "n": len(values),
            "steps_ms": [round(v, 3) for v in values]}


def run_mode(model, tokenizer, mode: str, context: int, args, device: torch.device) -> dict:
    spec = spec_for(args, context, device)
    gen = torch.Generator().manual_seed(context)
    vocab = model.config.vocab_size
    doc = torch.randint(0, vocab, (context,), generator=gen).tolist()
    q1, q2 = (torch.randint(0, vocab, (args.question,), generator=gen).tolist() for _ in range(2))
    with engines.run_dir(spec, mode) as nvme:  # None but on host+nvme
        out = first_engine(model, tokenizer, mode, spec, nvme, args, doc, (q1, q2), gen)
        if "saves_drained_s" in out:  # --restart, and the cold prefill ran to its end
            out["restart"] = restarted(model, tokenizer, mode, spec, nvme, doc + q1, out["cold"]["tokens"])
    return out


def first_engine(model, tokenizer, mode: str, spec: engines.DecodeSpec, nvme: str | None, args,
                 doc: list[int], questions: tuple[list[int], list[int]], gen: torch.Generator) -> dict:
    """The mode's engine: cold, warm and beside requests; with --restart (host+nvme), its prefix
    saves waited for ("saves_drained_s") before it closes."""
    q1, q2 = questions
    with engines.bench_engine(model, tokenizer, mode, spec, nvme_dir=nvme) as engine:
        engine.warm_up()
        cold = timed_request(engine, "cold", doc + q1, limit_s=args.time_limit, chunk=args.prefill_chunk)
        out = {"mode": mode, "context": len(doc), "prompt_tokens": len(doc) + len(q1),
               "prefill_s": cold["ttft_s"], "cold": cold}
        if "extrapolated" in cold:  # stopped: nothing cached to warm up from, no tokens to compare
            out["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, int | float | str)}
            return out
        if not args.no_warm:
            out["warm"] = timed_request(engine, "warm", doc + q1)
            out["new_question"] = timed_request(engine, "new-question", doc + q2)
            out["warm_same_tokens"] = out["warm"]["tokens"] == cold["tokens"]
        if args.beside:
            fresh = torch.randint(0, model.config.vocab_size, (len(doc),), generator=gen).tolist()
            out["beside"] = beside(engine, args, fresh, gen)  # nothing of `fresh` is cached
        out["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, int | float | str)}
        if args.restart and nvme is not None:
            started = time.perf_counter()
            engine.prefix_disk.drain()  # close() waits only close_drain_s; a restart needs them all
            out["saves_drained_s"] = time.perf_counter() - started
    return out


def restarted(model, tokenizer, mode: str, spec: engines.DecodeSpec, nvme: str, prompt: list[int],
              cold_tokens: list[int]) -> dict:
    """`prompt` on a new engine over nvme, the directory of the closed engine that prefilled it:
    the engine's opening (seconds: its pools and the prefix manifest), then the request's TTFT,
    cached tokens and whether its greedy tokens equal the cold request's."""
    started = time.perf_counter()
    with engines.bench_engine(model, tokenizer, mode, spec, nvme_dir=nvme) as engine:
        opened = time.perf_counter() - started
        engine.warm_up()
        out = timed_request(engine, "restart", prompt)
        out["stats"] = {k: v for k, v in engine.stats().items() if isinstance(v, int | float | str)}
    return {**out, "open_s": opened, "same_tokens": out["tokens"] == cold_tokens}


def row(point: dict, plain: dict | None, model) -> dict:
    r = point.get("result") or {}
    cold_s = r.get("prefill_s")
    flops = prefill_flops(model.config, r["prompt_tokens"]) if r else None
    out = {"mode": point["mode"], "context": point["context"], "status": point["status"],
           "prefill_s": cold_s, "tflops": flops / cold_s / 1e12 if cold_s else None,
           "plain_s": plain["seconds"] if plain else None,
           "x_plain": cold_s / plain["seconds"] if plain and cold_s else None,
           "pcie_mib": r.get("cold", {}).get("pcie_mib"), "host_share": host_share(r.get("cold", {}))}
    if "warm" in r:
        out.update(warm_ttft_s=r["warm"]["ttft_s"], cached_tokens=r["warm"]["cached_tokens"],
                   new_question_ttft_s=r["new_question"]["ttft_s"], warm_same_tokens=r["warm_same_tokens"])
    if "restart" in r:
        out.update(restart_ttft_s=r["restart"]["ttft_s"], restart_cached=r["restart"]["cached_tokens"],
                   restart_same_tokens=r["restart"]["same_tokens"])
    if "beside" in r:
        b = r["beside"]
        alone, beside = b["tpot_alone_ms"]["p99"], b["tpot_beside_ms"]["p99"]
        out.update(tpot_alone_p99_ms=alone, tpot_beside_p99_ms=beside,
                   tpot_x_alone=beside / alone if alone and beside is not None else None,
                   prefill_beside_s=b["prefill_beside_s"], beside_steps=b["prefill_beside_steps"])
    return out


def host_share(cold: dict) -> float | None:
    """Of the cold prefill's step time, the share until `step` returned (--time-limit's per-step
    timing; None without it): 1 where every step waits for its own forward, lower where the host
    queues the forward and returns while it runs."""
    steps, host = cold.get("steps_s"), cold.get("steps_host_s")
    return sum(host) / sum(steps) if steps and host and sum(steps) > 0 else None


def run(args: argparse.Namespace, argv: list[str]) -> int:
    check_modes(args.modes)
    if args.prefill_chunk < 1 or args.question < 1:
        raise UsageError(f"--prefill-chunk ({args.prefill_chunk}) and --question ({args.question}) "
                         "must be >= 1")
    if args.time_limit is not None and (args.time_limit <= 0 or args.beside):
        raise UsageError(f"--time-limit ({args.time_limit}) must be > 0 seconds, and is for the cold "
                         "prefill alone (not with --beside)")
    if args.restart and not any(engines.mode_parts(m)[1] == "host+nvme" for m in args.modes):
        raise UsageError(f"--restart reopens a host+nvme engine over its nvme_dir; --modes "
                         f"{' '.join(args.modes)} has no host+nvme mode")
    device = torch.device(args.device)  # the parse resolved "auto"
    positions = max(args.contexts) + args.question + 64 + 16
    model, tokenizer = engines.load_model(args.model, device, positions)
    result = {**bench.run_info(["lockserve", "bench", "prefill", *argv], device, args.model, model, True),
              "kind": "prefill bench", "question_tokens": args.question,
              "workload": "real prefill of random tokens (cold, then warm requests sharing the document)",
              "prefill_chunk": args.prefill_chunk, "beside_chunk": args.beside_chunk,
              "beside_attention": args.beside_attention, "beside_layers": args.beside_layers,
              "summary_eigh": args.summary_eigh,
              "time_limit_s": args.time_limit, "prefill_window": args.prefill_window, "restart": args.restart,
              "plain": {}, "points": [], "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    for context in args.contexts:
        plain = None
        if not args.no_plain:
            plain = time_plain_prefill(model.config, context + args.question, device, model.dtype)
            result["plain"][str(context)] = plain
        for mode in tqdm(args.modes, desc=f"bench prefill {context}", unit="mode", file=sys.stderr):
            try:
                measured, status = run_mode(model, tokenizer, mode, context, args, device), "ok"
                if "extrapolated" in measured["cold"]:
                    status = extrapolated_status(measured["cold"]["extrapolated"])
            except Exception as err:  # one failed point must not lose the run's others
                measured, status = None, engines.failed(err)
            point = {"mode": mode, "context": context, "status": status, "result": measured}
            result["points"].append(point)
            result["rows"].append(row(point, plain, model))
            write_tables(result, args.out, args.name)
    result["prefill_attention"] = prefill_backend(device)  # after a prefill: what it ran
    write_tables(result, args.out, args.name, make_plot(result, args.out, args.name))
    return 0


def with_hbm_ratios(rows: list[dict]) -> None:
    """Each row's prefill over locks:hbm's at the same context in the same run ("x_hbm": the host
    tiers' targets are stated against it); None on the hbm row itself (no mode is its own
    reference) and where the run has no hbm prefill."""
    hbm = {r["context"]: r["prefill_s"] for r in rows if r["mode"] == "locks:hbm" and r["prefill_s"]}
    for r in rows:
        base = hbm.get(r["context"]) if r["mode"] != "locks:hbm" else None
        r["x_hbm"] = r["prefill_s"] / base if base and r["prefill_s"] else None


def write_tables(result: dict, out: Path, name: str, png: Path | None = None) -> None:
    with_hbm_ratios(result["rows"])
    columns = COLUMNS + (RESTART_COLUMNS if any("restart_ttft_s" in r for r in result["rows"]) else ())
    write_json(out / f"{name}.json", result)
    write_csv(out / f"{name}.csv", columns, result["rows"])
    lines = [f"# {result['kind']}", "", *run_header(result), "", markdown_table(columns, result["rows"])]
    if png is not None:
        lines += ["", f"![prefill]({png.name})"]
    write_atomic(out / f"{name}.md", "\n".join(lines) + "\n")


def make_plot(result: dict, out: Path, name: str) -> Path | None:
    """Prefill seconds per context: a bar per mode beside the plain anchor (None without matplotlib)."""
    if not plots.available():
        return None
    plt = plots._pyplot()
    rows = [r for r in result["rows"] if r["prefill_s"]]
    contexts = sorted({r["context"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    series = [("plain torch", {int(c): p["seconds"] for c, p in result["plain"].items()})]
    series += [(m, {r["context"]: r["prefill_s"] for r in rows if r["mode"] == m}) for m in modes]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(series)
    for i, (label, by_context) in enumerate(series):
        xs = [j + i * width for j, c in enumerate(contexts) if c in by_context]
        ax.bar(xs, [by_context[c] for c in contexts if c in by_context], width, label=label,
               color="black" if label == "plain torch" else None)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))], [f"{c // 1024}K" for c in contexts])
    ax.set_xlabel("prompt tokens (document)")
    ax.set_ylabel("prefill = time to first token (s)")
    ax.legend(fontsize=8)
    fig.suptitle(f"Cold prefill, engine vs plain torch\n{result['model']} on {result['device']} "
                 f"(random weights, real prefill), commit {result['commit']}", fontsize=9)
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
