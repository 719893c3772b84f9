"""`lockserve bench decode`: the decode benchmark (workers/bench.py) over a grid of modes,
contexts, batch sizes and LOCKS budgets, written as JSON, CSV, markdown and PNG plots.

Every point is one engine of one mode, filled with `batch` requests of `context` tokens and
decoded as `python -m lockserve.cluster.measure.decode.bench` does (same functions, same numbers): TPOT median
and p90, tokens/s, HBM bytes per step (a count: weights + summaries + attended pages) and PCIe
bytes per step (the engine's counters), the hot-cache hit rate (and per step), the roofline
(HBM bytes / read bandwidth + PCIe bytes / UVA gather bandwidth, both measured in the run) and
device time by part of one profiled step (weights, scoring, selection, transfer, attention, ...;
CUDA only). `dense:hbm` reads every page, so it runs once per (context, batch), not per budget.
A point whose KV cannot fit (an estimate from the shapes against the room this machine has) is
listed with the reason instead of being run; so is every point after --max-minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from lockserve.cluster.measure import plots
from lockserve.cluster.measure.decode import bench, engines
from lockserve.cluster.measure.decode.ceilings import measure_ceilings
from lockserve.cluster.measure.eval.passkey import passkey_found
from lockserve.cluster.measure.harness.sizes import GIB, MachineLimits, fmt_bytes, fmt_tokens, measure_limits
from lockserve.cluster.measure.harness.tables import (
    Column,
    commas,
    f1,
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
from lockserve.configs.schema import CacheConfig
from lockserve.kernels import LocksConfig
from lockserve.workers.engine.kv_manager import KVLayout, SummaryTable
from tqdm import tqdm

PARTS = ("weights", "scoring", "selection", "transfer", "attention", "norm_rope_act", "other")
MIB = 1 << 20
REFERENCE = "reference"  # the tokens = ref cell of the reference mode's own points

COLUMNS = (
    Column("mode", "mode"), Column("context", "context", tokens), Column("batch", "batch"),
    Column("budget_tokens", "budget", commas),
    Column("tpot_ms_median", "TPOT p50 (ms)", f2), Column("tpot_ms_p90", "p90 (ms)", f2),
    Column("tokens_per_s", "tok/s", commas), Column("hbm_mib_per_step", "HBM MiB/step", f1),
    Column("pcie_mib_per_step", "PCIe MiB/step", f2), Column("hit_rate", "hit rate", f3),
    Column("roofline_ms", "roofline (ms)", f2), Column("tpot_over_roofline", "x roofline", f2),
    *(Column(f"{p}_ms", p.replace("norm_rope_act", "norms etc."), f2) for p in PARTS),
    Column("same_tokens", "tokens = ref", lambda v: v if v == REFERENCE else yes_no(v)),
    Column("status", "status"),
)
EXTRA_COLUMNS = (Column("model", "model"), Column("workload", "workload"))
CSV_COLUMNS = EXTRA_COLUMNS + COLUMNS


@dataclass(frozen=True)
class Point:
    """One engine to run. budget_tokens None: dense (every page is read)."""

    mode: str
    context: int
    batch: int
    budget_tokens: int | None


def grid(modes, contexts, batches, budgets) -> list[Point]:
    """Context by context, batch by batch, every mode; dense once, LOCKS modes once per budget."""
    points = []
    for context in contexts:
        for batch in batches:
            for mode in modes:
                for budget in ([None] if mode.startswith("dense") else budgets):
                    points.append(Point(mode, context, batch, budget))
    return points


def check_arguments(args: argparse.Namespace) -> None:
    check_modes(args.modes)
    if args.steps < 1 or args.warmup < 0 or min(args.batches) < 1:
        raise UsageError(f"--steps ({args.steps}) and --batches ({args.batches}) must be >= 1, "
                         f"--warmup ({args.warmup}) >= 0")
    for budget in args.budgets:
        check_budget(budget)


def check_budget(budget: int) -> None:
    """A multiple of the page size, more than the sink and recent pages (CacheConfig's rule)."""
    try:
        CacheConfig(budget_tokens=budget)
    except ValueError as err:  # pydantic: "Value error, budget_tokens (40) must be ..."
        reason = err.errors()[0]["msg"].removeprefix("Value error, ") if hasattr(err, "errors") else err
        raise UsageError(f"budget ({budget}): {reason}") from None


# ---- what a point needs -------------------------------------------------------------------------


def summary_bytes_per_page(model) -> int:
    """Bytes of one page's LOCKS summary (one layer, one KV head) in the engine's table."""
    cc, mc = CacheConfig(), model.config
    layout = KVLayout(1, 1, mc.head_dim, cc.page_size, model.dtype, 16)
    locks = LocksConfig(page_size=cc.page_size, rank=cc.rank, basis_bits=cc.basis_bits)
    return SummaryTable(layout, locks, torch.device("cpu")).bytes_per_page


def footprint(model, mode: str, spec: engines.DecodeSpec, summary_bytes: int) -> dict[str, int]:
    """Bytes a point's engine holds on the device, in host memory and on NVMe: a count from the
    shapes (the page arena, summaries, hot cache), used only to skip points that cannot fit."""
    mc, sizing = model.config, engines.bench_sizing(model, mode, spec)
    slot = 2 * 16 * mc.head_dim * model.dtype.itemsize
    per_id = mc.num_layers * mc.num_kv_heads
    kv, summaries = sizing.max_pages * per_id * slot, sizing.max_pages * per_id * summary_bytes
    tier = engines.mode_parts(mode)[1]
    if tier == "hbm":
        return {"device": kv + summaries, "host": 0, "nvme": 0}
    cache = sizing.hot_cache_pages * slot
    if tier == "host":
        return {"device": summaries + cache, "host": kv, "nvme": 0}
    return {"device": summaries + cache, "host": int(sizing.host_gib * GIB),
            "nvme": int(sizing.nvme_gib * GIB)}


def does_not_fit(needs: dict[str, int], limits: MachineLimits) -> str | None:
    room = {"device": limits.device, "host": limits.host, "nvme": limits.nvme}
    for place, label in (("device", "device memory"), ("host", "host memory"), ("nvme", "NVMe space")):
        if needs[place] > room[place]:
            return f"skipped: KV needs {fmt_bytes(needs[place])} of {label}, room {fmt_bytes(room[place])}"
    return None


# ---- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> int:
    check_arguments(args)
    device = torch.device(args.device)  # the parse resolved "auto"
    points = grid(args.modes, args.contexts, args.batches, args.budgets)
    base = engines.DecodeSpec(steps=args.steps, warmup=args.warmup, hot_cache_pages=args.hot_cache_pages,
                            prefill_chunk=args.prefill_chunk, graphs=args.graphs, nvme_dir=args.nvme_dir,
                            host_gib=args.host_gib, device=str(device))
    model, tokenizer = engines.load_model(args.model, device, max(args.contexts) + base.max_tokens + 16)
    synthetic = engines.is_synthetic(args.fill, args.model)
    limits = measure_limits(device, args.nvme_dir, args.device_memory, args.host_memory, args.nvme_space)
    ceilings = measure_ceilings(device)
    result = {**bench.run_info(["lockserve", "bench", "decode", *argv], device, args.model, model, synthetic),
              "kind": "decode sweep", "steps": args.steps, "warmup": args.warmup, "reference": args.reference,
              "plot_budget": args.plot_budget,
              "grid": {"modes": args.modes, "contexts": args.contexts, "batches": args.batches,
                       "budgets": args.budgets},
              "limits": limits.as_dict(), "ceilings": ceilings, "rows": [], "points": []}
    summary_bytes, start, prompts = summary_bytes_per_page(model), time.monotonic(), (None, None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    for point in tqdm(points, desc="bench decode", unit="point", file=sys.stderr):
        spec = dataclasses.replace(base, context=point.context, batch=point.batch,
                                   budget_tokens=point.budget_tokens or max(args.budgets))
        status = does_not_fit(footprint(model, point.mode, spec, summary_bytes), limits)
        late = args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes
        if status is None and late:
            status = f"not run: --max-minutes ({args.max_minutes:g}) reached"
        measured = None
        if status is None:
            if prompts[0] != (point.context, point.batch):  # points come context by context, batch by batch
                prompts = ((point.context, point.batch),
                           *engines.make_prompts(model, tokenizer, point.context, point.batch, synthetic))
            try:
                measured = bench.run_mode(model, tokenizer, point.mode, prompts[1], spec, synthetic, ceilings)
            except Exception as err:  # one failed point must not lose the run's others
                status = engines.failed(err)
            else:
                compare_with_reference(result, point, measured, args.reference)
                if prompts[2] is not None:
                    text = tokenizer.decode(measured["tokens"][0])
                    measured["passkey_found"] = passkey_found(text, prompts[2])
        result["points"].append({**dataclasses.asdict(point), "status": status or "ok", "result": measured})
        result["rows"] = [point_row(p, result) for p in result["points"]]
        write_tables(result, args.out, args.name)
    write_tables(result, args.out, args.name, make_plots(result, args.out, args.name, args.plot_budget))
    return 0


def make_plots(result: dict, out: Path, name: str, budget: int | None = None) -> list[Path] | None:
    """The sweep's PNGs, or None (with a note) where matplotlib is missing."""
    if not plots.available():
        print(f"note: no matplotlib here: plots skipped; make them later with "
              f"lockserve report --replot {out / name}.json", file=sys.stderr)
        return None
    return plots.sweep_plots(result, out, name, budget or result.get("plot_budget"))


def compare_with_reference(result: dict, point: Point, measured: dict, reference: str) -> None:
    """same_tokens_as_reference (bench's field) of a point and of the points it is the reference
    of: the reference mode's run at the same (context, batch, budget), in either order of running.
    The reference's own point keeps None: a mode is never compared with itself."""
    if point.mode == reference:
        measured["same_tokens_as_reference"] = None
    for other in result["points"]:
        here = (other["context"], other["batch"], other["budget_tokens"]) == \
            (point.context, point.batch, point.budget_tokens)
        if not here or other["result"] is None:
            continue
        if other["mode"] == reference:
            measured["same_tokens_as_reference"] = measured["tokens"] == other["result"]["tokens"]
        elif point.mode == reference:
            other["result"]["same_tokens_as_reference"] = other["result"]["tokens"] == measured["tokens"]


def point_row(point: dict, result: dict) -> dict:
    """The flat row of one point (COLUMNS' keys); measurements None for a point not run."""
    r = point["result"] or {}
    nbytes = r.get("bytes_per_step") or {}
    profile = r.get("profile") or {}
    by_part = profile.get("device_time_us_by_part") if profile.get("device_kernels") else None
    workload = "synthetic" if "synthetic" in result["workload"] else "real prompt"
    row = {"model": result["model"], "workload": workload,
           "mode": point["mode"], "context": point["context"], "batch": point["batch"],
           "budget_tokens": point["budget_tokens"], "status": point["status"],
           "tpot_ms_median": r.get("tpot_ms_median"), "tpot_ms_p90": r.get("tpot_ms_p90"),
           "tokens_per_s": r.get("tokens_per_s"),
           "hbm_mib_per_step": nbytes["hbm"] / MIB if nbytes else None,
           "pcie_mib_per_step": nbytes["pcie"] / MIB if nbytes else None,
           "hit_rate": r.get("hit_rate"), "roofline_ms": r.get("roofline_ms"),
           "tpot_over_roofline": r.get("tpot_over_roofline"),
           "same_tokens": REFERENCE if point["mode"] == result["reference"] and r
           else r.get("same_tokens_as_reference")}
    for part in PARTS:
        row[f"{part}_ms"] = by_part[part] / 1e3 if by_part else None
    return row


# ---- outputs ------------------------------------------------------------------------------------


def write_tables(result: dict, out: Path, name: str, pngs: list[Path] | None = None) -> None:
    """NAME.json, NAME.csv and NAME.md from the same rows (rewritten after every point)."""
    if pngs is not None:
        result["plots"] = [p.name for p in pngs]
    write_json(out / f"{name}.json", result)
    write_csv(out / f"{name}.csv", CSV_COLUMNS, result["rows"])
    write_atomic(out / f"{name}.md", markdown(result))


def markdown(result: dict) -> str:
    c = result["ceilings"]
    lim = result["limits"]
    lines = [f"# Decode sweep: {result['model']} on {result['device']}", "", *run_header(result), ""]
    if c.get("read_gbps"):
        lines += [f"Roofline = HBM bytes / {c['read_gbps']:.0f} GB/s (read-only kernel) + PCIe bytes / "
                  f"{c['gather_gbps']:.1f} GB/s (UVA gather), both measured in this run.", ""]
    lines += [
        f"Each point: {result['warmup']} warm-up and {result['steps']} timed steps. HBM MiB/step is a count "
        "(weights + summaries + attended pages); PCIe MiB/step the engine's counter; time by part "
        "(weights ... other, ms) is the device time of one profiled step by kernel name (CUDA only). "
        f"Tokens = ref: the same tokens as {result['reference']} at the same context, batch and budget. "
        f"Room for KV: device {fmt_bytes(lim['device_bytes'])}, host {fmt_bytes(lim['host_bytes'])}, "
        f"NVMe {fmt_bytes(lim['nvme_bytes'])}.", "",
        markdown_table(COLUMNS, result["rows"]), ""]
    for png in result.get("plots", []):
        lines += [f"![{png}]({png})", ""]
    return "\n".join(lines)


def headline(result: dict, budget: int | None = None) -> str:
    """TPOT (ms) by mode and context at the smallest batch and one budget: the README's table."""
    rows = [r for r in result["rows"] if r["tpot_ms_median"] is not None]
    if not rows:
        return ""
    batch = min(r["batch"] for r in rows)
    budget = budget or plots.pick_budget(result)
    contexts = sorted({r["context"] for r in rows})
    modes = [m for m in result["grid"]["modes"] if any(r["mode"] == m for r in rows)]
    lines = ["| mode | " + " | ".join(fmt_tokens(c) for c in contexts) + " |",
             "|" + " --- |" * (len(contexts) + 1)]
    for mode in modes:
        cells = []
        for ctx in contexts:
            found = [r for r in rows if r["mode"] == mode and r["context"] == ctx and r["batch"] == batch
                     and r["budget_tokens"] in (budget, None)]
            cells.append(f"{found[0]['tpot_ms_median']:.2f}" if found else "-")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    caption = f"TPOT p50 (ms), batch {batch}, budget {budget:,} tokens (dense reads every page)"
    return caption + ":\n\n" + "\n".join(lines)
