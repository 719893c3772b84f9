"""`lockserve experiment capacity`: at a fixed HBM budget for KV, how much context and how many
requests each mode admits, and the TPOT and throughput sustained there.

accounting.ACCOUNTING is the rule, quoted in the command's help and in every summary it writes:
`plan` sizes an engine from the budget through two probe engines, `run_load` builds it, finds
the load it admits (`longest_admitted`, `admit_concurrent`) and decodes that load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from lockserve.cluster.measure import plots
from lockserve.cluster.measure.accounting import ACCOUNTING, LOADS
from lockserve.cluster.measure.decode import bench, engines
from lockserve.cluster.measure.decode.ceilings import measure_ceilings
from lockserve.cluster.measure.decode.sweep import check_budget
from lockserve.cluster.measure.harness.sizes import (
    GIB,
    MachineLimits,
    disk_usage_bytes,
    fmt_bytes,
    fmt_tokens,
    measure_limits,
)
from lockserve.cluster.measure.harness.tables import (
    Column,
    commas,
    f1,
    f2,
    f3,
    markdown_table,
    run_header,
    size,
    tokens,
    write_atomic,
    write_csv,
    write_json,
)
from lockserve.cluster.measure.harness.usage import UsageError, check_modes
from lockserve.kernels import budget_pages
from lockserve.workers.engine.sampling import SamplingParams
from tqdm import tqdm

PROBE_IDS, PROBE_STEP = 16, 1024
SIZE_MARGIN = 1 / 1024  # of the budget, kept free when sizing from the probes (see plan)

BUDGET = Column("hbm_budget", "HBM for KV", size)
COLUMNS = (
    BUDGET, Column("mode", "mode"),
    Column("longest_context", "longest context", tokens),
    Column("longest_x_resident", "x resident", f1), Column("longest_limited_by", "limited by"),
    Column("concurrent_requests", "requests of C", commas),
    Column("concurrent_x_resident", "x resident", f1), Column("concurrent_limited_by", "limited by"),
    Column("hbm_used", "HBM used", size), Column("host_used", "host memory", size),
    Column("nvme_used", "NVMe", size), Column("status", "status"),
)
SUSTAINED = (
    BUDGET, Column("mode", "mode"),
    Column("longest_context", "longest context", tokens),
    Column("longest_tpot_ms", "TPOT p50 (ms)", f2), Column("longest_tpot_p90_ms", "p90 (ms)", f2),
    Column("longest_x_roofline", "x roofline", f2), Column("longest_hit_rate", "hit rate", f3),
    Column("concurrent_requests", "requests of C", commas),
    Column("concurrent_tpot_ms", "TPOT p50 (ms)", f2), Column("concurrent_tpot_p90_ms", "p90 (ms)", f2),
    Column("concurrent_x_roofline", "x roofline", f2),
    Column("concurrent_tokens_per_s", "tok/s", commas), Column("concurrent_hit_rate", "hit rate", f3),
)
# What "x roofline" means, under every table that shows it.
ROOFLINE_NOTE = ("x roofline: TPOT over the step's roofline, HBM bytes over the read bandwidth plus PCIe "
                 "bytes over the gather bandwidth, both measured in the run (workers/bench.py); NVMe "
                 "reads are not in it. The decode-step targets at a million tokens ask for <= 2 x.")
ROW_COLUMNS = tuple({c.key: c for c in (
    Column("model", "model"), Column("workload", "workload"), Column("context", "C", tokens), *COLUMNS,
    *SUSTAINED, Column("longest_tokens_per_s", "tok/s", commas),
    Column("longest_page_ids", "page ids", commas),
    Column("concurrent_page_ids", "page ids", commas))}.values())
ACCOUNT_COLUMNS = (
    BUDGET, Column("mode", "mode"), Column("load", "load"), Column("page_ids", "page ids", commas),
    Column("device_fixed", "device, fixed", size), Column("device_per_id", "device / page id", size),
    Column("device_used", "device used", size), Column("device_peak", "device peak", size),
    Column("kv_per_id", "K+V / page id", size),
    Column("hot_cache_pages", "hot cache pages", commas), Column("host_reserved", "host arena", size),
    Column("nvme_reserved", "NVMe reserved", size), Column("nvme_disk", "NVMe on disk", size),
    Column("limited_by", "limited by"),
)


def check_arguments(args: argparse.Namespace) -> None:
    check_modes(args.modes)
    check_budget(args.budget_tokens)
    if not 0 <= args.hot_cache_share < 1 or not 0 < args.nvme_host_share <= 1:
        raise UsageError(f"--hot-cache-share ({args.hot_cache_share}) must be in [0, 1) and "
                         f"--nvme-host-share ({args.nvme_host_share}) in (0, 1]")
    if args.fill == "prompt" and list(args.loads) != ["longest"]:
        raise UsageError("--fill prompt fills the longest load only (a concurrent load's prompts would "
                         "each be prefilled while the earlier ones decode): pass --loads longest")
    if args.max_batch < 1 or args.steps < 1 or args.warmup < 0:
        raise UsageError(f"--max-batch ({args.max_batch}) and --steps ({args.steps}) must be >= 1")


# ---- sizing an engine from the budget ------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One engine's size: page ids, what bounds them, and the accounting behind it."""

    mode: str
    load: str
    budget: int  # HBM bytes for KV
    page_ids: int
    limited_by: str
    sizing: engines.EngineSizing
    device_fixed: float
    device_per_id: float
    kv_per_id: int  # bytes of K+V of one page id (host memory or NVMe)
    host_reserved: int
    nvme_reserved: int


class Setup:
    """What every engine of a run shares: model, spec, limits, flags."""

    def __init__(self, args, model, tokenizer, limits: MachineLimits, ceilings: dict):
        self.args, self.model, self.tokenizer = args, model, tokenizer
        self.limits, self.ceilings = limits, ceilings
        self.synthetic = args.fill == "synthetic"  # else the passkey prompt, prefilled
        self.device = torch.device(args.device)
        self.spec = engines.DecodeSpec(context=args.context, batch=1, steps=args.steps, warmup=args.warmup,
                                     budget_tokens=args.budget_tokens, prefill_chunk=args.prefill_chunk,
                                     graphs=args.graphs, nvme_dir=args.nvme_dir, device=str(self.device),
                                     prefill_window=0)  # no HBM beyond the budget's accounting
        mc = model.config
        self.kv_per_id = mc.num_layers * mc.num_kv_heads * 2 * 16 * mc.head_dim * model.dtype.itemsize
        self.slot_bytes = 2 * 16 * mc.head_dim * model.dtype.itemsize

    def shape(self, load: str, page_ids: int) -> tuple[int, int]:
        """(max_num_seqs, max_model_len) of a load's engine. The longest context's engine allows more
        positions than its page ids hold, so only they bound a prompt; past a budget's pages, so
        every probe stages a full selection (its page table grows with the ids: linear)."""
        if load == "longest":
            return 1, 16 * (page_ids + budget_pages(self.args.budget_tokens, 16) + 16)
        return self.args.max_batch, self.args.context + self.spec.max_tokens

    def hot_cache_pages(self, mode: str, budget: int, seqs: int) -> int:
        _, tier, nocache = engines.mode_parts(mode)
        if tier == "hbm" or nocache:
            return 0
        one_layer = seqs * self.model.config.num_kv_heads * budget_pages(self.args.budget_tokens, 16)
        return max(int(self.args.hot_cache_share * budget) // self.slot_bytes, one_layer)

    def sizing(self, mode: str, load: str, budget: int, page_ids: int, host_bytes: int | None = None,
               nvme_bytes: int | None = None):
        """host_bytes / nvme_bytes: the host arena and NVMe space of host+nvme (default: each the
        whole KV)."""
        seqs, max_len = self.shape(load, page_ids)
        kv = page_ids * self.kv_per_id
        return engines.EngineSizing(max_pages=page_ids, max_num_seqs=seqs, max_model_len=max_len,
                                  hot_cache_pages=self.hot_cache_pages(mode, budget, seqs),
                                  host_gib=(host_bytes or kv) / GIB + 1e-3,
                                  nvme_gib=(nvme_bytes or kv) / GIB + 1e-3)


@contextlib.contextmanager
def built(setup: Setup, mode: str, sizing: engines.EngineSizing):
    """(engine, device bytes it allocated when built, a function giving the peak device bytes
    since then: graphs, workspace and activations included; None off CUDA) for one mode and size."""
    engines.free_device_memory()
    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device) if cuda else 0
    with engines.bench_engine(setup.model, setup.tokenizer, mode, setup.spec, sizing) as engine:
        used = torch.cuda.memory_allocated(setup.device) - before if cuda else kv_tensor_bytes(engine)
        yield engine, used, (lambda: torch.cuda.max_memory_allocated(setup.device) - before) if cuda else None


def kv_tensor_bytes(engine) -> int:
    """Bytes of the engine's KV tensors on its device, each storage once: the KV manager's pools,
    the summaries, the page source's and the hot cache's tables, the decode rows (the CPU
    stand-in for torch.cuda.memory_allocated)."""
    kv = engine.kv
    cache, arena = getattr(kv.settled, "cache", None), getattr(kv.settled, "arena", None)
    # The host arena is host memory, also where the "device" is the CPU: never counted.
    seen, total = ({arena.pool.untyped_storage().data_ptr()} if arena is not None else set()), 0
    for obj in (kv, kv.summaries.table, kv.settled, cache, engine.runner.state):
        for value in (vars(obj).values() if obj is not None else ()):
            if isinstance(value, torch.Tensor) and value.device == engine.device:
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total


def plan(setup: Setup, mode: str, load: str, budget: int) -> Plan:
    """The most page ids the budget (and host memory / NVMe space) allows, from two probe engines."""
    used = []
    for ids in (PROBE_IDS, PROBE_IDS + PROBE_STEP):
        with built(setup, mode, setup.sizing(mode, load, budget, ids)) as (_, nbytes, _):
            used.append(nbytes)
    per_id = (used[1] - used[0]) / PROBE_STEP
    if per_id <= 0:
        raise RuntimeError(f"{mode}: probe engines of {PROBE_IDS} and {PROBE_IDS + PROBE_STEP} page ids "
                           f"allocated {used[0]} and {used[1]} device bytes: no cost per page id")
    fixed = used[0] - per_id * PROBE_IDS
    # A margin for the allocator's rounding, which the two probes' line does not see (at 16 GiB it
    # came out 1.3 MB short on the H200): a rebuild of a host tier's engine costs a minute or more.
    by_device = int((budget - fixed - budget * SIZE_MARGIN) // per_id) // 16 * 16
    tier = engines.mode_parts(mode)[1]
    bounds = {"HBM budget": by_device}
    if tier == "host":
        bounds["host memory"] = setup.limits.host // setup.kv_per_id
    elif tier == "host+nvme":  # a page is in host memory or on NVMe: the two add up
        bounds["host memory + NVMe space"] = (setup.limits.host + setup.limits.nvme) // setup.kv_per_id
    limited_by = min(bounds, key=bounds.get)
    return sized(setup, mode, load, budget, max(0, bounds[limited_by]), limited_by, fixed, per_id)


def sized(setup: Setup, mode: str, load: str, budget: int, ids: int, limited_by: str, fixed: float,
          per_id: float) -> Plan:
    """The plan of an engine of `ids` page ids: its sizing and the host memory / NVMe it reserves."""
    tier = engines.mode_parts(mode)[1]
    kv = ids * setup.kv_per_id
    host, nvme = {"hbm": (0, 0), "host": (kv, 0)}.get(tier, (None, None))
    if tier == "host+nvme":  # --nvme-host-share of the KV in host memory, more where NVMe lacks room
        share = max(int(setup.args.nvme_host_share * kv), kv - setup.limits.nvme, 2 * setup.kv_per_id)
        host = min(setup.limits.host, share)
        nvme = max(kv - host, setup.kv_per_id)
    sizing = setup.sizing(mode, load, budget, ids, host, nvme)
    return Plan(mode, load, budget, ids, limited_by, sizing, fixed, per_id, setup.kv_per_id, host, nvme)


# ---- admission and decode ------------------------------------------------------------------------


def longest_admitted(engine, max_tokens: int) -> tuple[int, str]:
    """The largest prompt Engine.check_request accepts, and its refusal of one token more."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def ok(n: int) -> bool:
        try:
            engine.check_request(n, params)
            return True
        except ValueError:
            return False

    lo, hi = 0, engine.limits.pages_capacity * engine.limits.page_size + 1  # ok(lo) or lo == 0; not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    try:
        engine.check_request(lo + 1, params)
        refusal = ""
    except ValueError as err:
        refusal = str(err)
    return lo, refusal


def admit_concurrent(engine, prompt: list[int], most: int,
                     max_tokens: int) -> tuple[list[list[int]], str, float]:
    """Queue requests of `prompt` one by one, each filled (Engine.fill_synthetic admits it through
    the scheduler), until the engine refuses one or `most` run. (tokens so far per admitted
    request, why no more were admitted, fill seconds)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens, t0 = [], time.perf_counter()
    for i in range(most):
        try:
            engine.add_request(f"r{i}", prompt, params)
        except ValueError as err:
            return tokens, f"refused: {err}", time.perf_counter() - t0
        try:
            tokens.append([engine.fill_synthetic(f"r{i}", seed=i)])
        except RuntimeError:
            stats = engine.stats()
            engine.abort(f"r{i}")
            need = math.ceil((len(prompt) + max_tokens) / engine.limits.page_size)
            free = stats["pages_capacity"] - stats["pages_used"]
            return tokens, (f"KV page ids: request {i + 1} needs {need:,}, {free:,} of "
                            f"{stats['pages_capacity']:,} free"), time.perf_counter() - t0
    return tokens, f"max_num_seqs (--max-batch {most})", time.perf_counter() - t0


FIT_ATTEMPTS = 3  # builds of one load's engine, each shrunk by the previous one's overshoot


def run_load(setup: Setup, p: Plan, bar: tqdm) -> dict:
    """Build the planned engine, find its admitted load, decode it; the load's record."""
    record = {"page_ids": p.page_ids, "limited_by": p.limited_by, "device_fixed_bytes": p.device_fixed,
              "device_bytes_per_id": p.device_per_id, "kv_bytes_per_id": p.kv_per_id,
              "hot_cache_pages": p.sizing.hot_cache_pages, "host_reserved_bytes": p.host_reserved,
              "nvme_reserved_bytes": p.nvme_reserved, "decode": None}
    if p.page_ids < 1:
        return {**record, "admitted": 0, "why": f"no page id fits: the fixed device bytes "
                f"({fmt_bytes(p.device_fixed)}) leave no room in {fmt_bytes(p.budget)}"}
    for _ in range(FIT_ATTEMPTS):
        with built(setup, p.mode, p.sizing) as (engine, used, peak):
            if used <= p.budget:
                record.update(page_ids=p.page_ids, hot_cache_pages=p.sizing.hot_cache_pages,
                              host_reserved_bytes=p.host_reserved, nvme_reserved_bytes=p.nvme_reserved)
                return measure_load(setup, p, engine, used, peak, bar, record)
        # the probes' linear model is off by allocator rounding: shrink by the overshoot and rebuild
        over = math.ceil((used - p.budget) / p.device_per_id)
        record.setdefault("shrunk_from", p.page_ids)
        p = sized(setup, p.mode, p.load, p.budget, max(0, p.page_ids - (over + 16) // 16 * 16), p.limited_by,
                  p.device_fixed, p.device_per_id)
    raise RuntimeError(f"{p.mode}: an engine of {p.page_ids} page ids still allocated {used} device bytes, "
                       f"over the budget ({p.budget}), after {FIT_ATTEMPTS} builds shrunk by the overshoot")


def measure_load(setup: Setup, p: Plan, engine, used: int, peak, bar: tqdm, record: dict) -> dict:
    """The record of a built engine that fits: its admitted load and that load's decode."""
    record["device_used_bytes"] = used
    bar.set_postfix_str(f"{p.mode} {p.load}: admit and fill")
    admit = admit_longest if p.load == "longest" else admit_many
    admitted, why, tokens, context, fill_s = admit(setup, engine)
    # decoded_context: each decoded request's prompt tokens (the passkey prompt comes out a few
    # tokens short of the admitted length it was asked for)
    # fill_steps: engine steps the fill ran (prefill chunks; none for a synthetic fill)
    record.update(admitted=admitted, why=why, decoded_context=context if tokens else None,
                  fill_steps=engine.stats()["steps"])
    if tokens:
        bar.set_postfix_str(f"{p.mode} {p.load}: decode")
        spec = dataclasses.replace(setup.spec, context=context, batch=len(tokens))
        record["decode"] = bench.measure_decode(engine, p.mode, tokens, fill_s, spec, setup.ceilings)
        record["decode"].pop("tokens")
    record["device_peak_bytes"] = peak() if peak is not None else None
    record["tier_bytes"] = engine.stats()["bytes_per_tier"]
    record["nvme_disk_bytes"] = disk_usage_bytes(engine.cache_config.nvme_dir)
    return record


def admit_longest(setup: Setup, engine) -> tuple[int, str, list[list[int]], int, float]:
    """(admitted tokens, refusal of one more, tokens so far of the filled request (none with
    --no-decode), its prompt's tokens, fill seconds). --fill prompt prefills the passkey prompt
    of about the admitted length (at most it), else the context is filled synthetically."""
    n, why = longest_admitted(engine, setup.spec.max_tokens)
    if not n or setup.args.no_decode:
        return n, why, [], n, 0.0
    try:
        prompts, _ = engines.make_prompts(setup.model, setup.tokenizer, n, 1, setup.synthetic)
    except ValueError as err:  # the haystack is finite: a capacity past it cannot be prefilled
        raise ValueError(f"--fill prompt: no passkey prompt of the {n:,} tokens admitted ({err}); "
                         f"a smaller --hbm-budget admits less") from err
    t0 = time.perf_counter()
    tokens = engines.start_requests(engine, prompts, setup.spec, setup.synthetic)
    return n, why, tokens, len(prompts[0]), time.perf_counter() - t0


def admit_many(setup: Setup, engine) -> tuple[int, str, list[list[int]], int, float]:
    """(admitted requests of --context tokens, why no more, their tokens so far (none with
    --no-decode), the context, fill seconds)."""
    prompt = engines.make_prompts(setup.model, setup.tokenizer, setup.args.context, 1, True)[0][0]
    tokens, why, fill_s = admit_concurrent(engine, prompt, setup.args.max_batch, setup.spec.max_tokens)
    return len(tokens), why, [] if setup.args.no_decode else tokens, setup.args.context, fill_s


# ---- the run ------------------------------------------------------------------------------------


def run(args: argparse.Namespace, argv: list[str]) -> int:
    check_arguments(args)
    device = torch.device(args.device)
    model, tokenizer = engines.load_model(args.model, device, 1 << 26)
    limits = measure_limits(device, args.nvme_dir, None, args.host_memory, args.nvme_space)
    setup = Setup(args, model, tokenizer, limits, measure_ceilings(device))
    command = ["lockserve", "experiment", "capacity", *argv]
    result = {**bench.run_info(command, device, args.model, model, setup.synthetic),
              "kind": "capacity", "context": args.context, "budget_tokens": args.budget_tokens,
              "max_batch": args.max_batch, "hot_cache_share": args.hot_cache_share,
              "nvme_host_share": args.nvme_host_share, "steps": args.steps, "warmup": args.warmup,
              "accounting": ACCOUNTING, "limits": limits.as_dict(), "ceilings": setup.ceilings,
              "entries": [], "rows": [], "accounting_rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    jobs = [(b, m) for b in args.hbm_budget for m in args.modes]
    with tqdm(jobs, desc="experiment capacity", unit="mode", file=sys.stderr) as bar:
        for budget, mode in bar:
            entry = {"hbm_budget": budget, "mode": mode, "status": "ok"}
            result["entries"].append(entry)
            if args.max_minutes is not None and time.monotonic() - start > 60 * args.max_minutes:
                entry["status"] = f"not run: --max-minutes ({args.max_minutes:g}) reached"
            else:
                for load in args.loads:
                    bar.set_postfix_str(f"{mode} {load}: probe")
                    # On disk until the load ends: a run killed inside it keeps the loads before.
                    entry["status"] = f"incomplete: stopped in the {load} load"
                    try:
                        entry[load] = run_load(setup, plan(setup, mode, load, budget), bar)
                        entry["status"] = "ok"
                    except Exception as err:  # one failed mode must not lose the others
                        entry["status"] = f"{load} {engines.failed(err)}"
                        break
                    finally:
                        refresh_rows(result)
                        write_outputs(result, args.out, args.name)
            refresh_rows(result)
            write_outputs(result, args.out, args.name)
    write_outputs(result, args.out, args.name, make_plots(result, args.out, args.name))
    return 0


def make_plots(result: dict, out: Path, name: str) -> list[Path] | None:
    """The run's PNGs, or None (with a note) where matplotlib is missing."""
    if not plots.available():
        print(f"note: no matplotlib here: plots skipped; make them later with "
              f"lockserve report --replot {out / name}.json", file=sys.stderr)
        return None
    return plots.capacity_plots(result, out, name)


def refresh_rows(result: dict) -> None:
    result["rows"] = [entry_row(e, result) for e in result["entries"]]
    result["accounting_rows"] = [accounting_row(e, load) for e in result["entries"] for load in LOADS
                                 if e.get(load)]


def _resident(result: dict, budget: int, load: str) -> int | None:
    for mode in ("locks:hbm", "dense:hbm"):
        for e in result["entries"]:
            if e["mode"] == mode and e["hbm_budget"] == budget and e.get(load):
                return e[load]["admitted"]
    return None


def entry_row(e: dict, result: dict) -> dict:
    workload = "synthetic" if "synthetic" in result["workload"] else "real prompt"
    row = {"model": result["model"], "workload": workload, "context": result["context"],
           "hbm_budget": e["hbm_budget"], "mode": e["mode"], "status": e["status"]}
    used = {"hbm_used": [], "host_used": [], "nvme_used": []}
    for load in LOADS:
        rec = e.get(load) or {}
        d = rec.get("decode") or {}
        admitted = rec.get("admitted")
        resident = _resident(result, e["hbm_budget"], load)
        row[f"{load}_{'context' if load == 'longest' else 'requests'}"] = admitted
        row[f"{load}_x_resident"] = admitted / resident if admitted is not None and resident else None
        row[f"{load}_limited_by"] = None
        if rec:
            row[f"{load}_limited_by"] = rec["limited_by"] if load == "longest" else _why(rec)
            used["hbm_used"].append(rec.get("device_used_bytes") or 0)
            used["host_used"].append(rec["host_reserved_bytes"])
            used["nvme_used"].append(rec.get("nvme_disk_bytes") or 0)
        row[f"{load}_page_ids"] = rec.get("page_ids")
        row[f"{load}_tpot_ms"] = d.get("tpot_ms_median")
        row[f"{load}_tpot_p90_ms"] = d.get("tpot_ms_p90")
        row[f"{load}_x_roofline"] = d.get("tpot_over_roofline")
        row[f"{load}_tokens_per_s"] = d.get("tokens_per_s")
        row[f"{load}_hit_rate"] = d.get("hit_rate")
    for key, values in used.items():
        row[key] = max(values) if values else None
    return row


def _why(rec: dict) -> str:
    why = rec.get("why", "")
    return why.split(":")[0] if why else rec.get("limited_by")


def accounting_row(e: dict, load: str) -> dict:
    rec = e[load]
    return {"hbm_budget": e["hbm_budget"], "mode": e["mode"], "load": load, "page_ids": rec["page_ids"],
            "device_fixed": rec["device_fixed_bytes"], "device_per_id": rec["device_bytes_per_id"],
            "device_used": rec.get("device_used_bytes"), "device_peak": rec.get("device_peak_bytes"),
            "kv_per_id": rec["kv_bytes_per_id"],
            "hot_cache_pages": rec["hot_cache_pages"], "host_reserved": rec["host_reserved_bytes"],
            "nvme_reserved": rec["nvme_reserved_bytes"], "nvme_disk": rec.get("nvme_disk_bytes"),
            "limited_by": rec["limited_by"]}


def write_outputs(result: dict, out: Path, name: str, pngs: list[Path] | None = None) -> None:
    """NAME.json, NAME.csv (one row per budget and mode), NAME_accounting.csv and NAME.md."""
    if pngs is not None:
        result["plots"] = [p.name for p in pngs]
    write_json(out / f"{name}.json", result)
    write_csv(out / f"{name}.csv", ROW_COLUMNS, result["rows"])
    write_csv(out / f"{name}_accounting.csv", ACCOUNT_COLUMNS, result["accounting_rows"])
    write_atomic(out / f"{name}.md", markdown(result))


def markdown(result: dict) -> str:
    lim = result["limits"]
    lines = [f"# Capacity: {result['model']} on {result['device']}", "", *run_header(result), "",
             f"C = {fmt_tokens(result['context'])} tokens per request; LOCKS budget "
             f"{result['budget_tokens']:,} tokens; at most {result['max_batch']} requests together; "
             f"{result['warmup']} warm-up and {result['steps']} timed steps per load. Room on this machine: "
             f"host memory {fmt_bytes(lim['host_bytes'])}, NVMe {fmt_bytes(lim['nvme_bytes'])}. "
             "x resident: over the resident mode (locks:hbm, else dense:hbm) at the same budget.", "",
             "## Admitted", "", markdown_table(COLUMNS, result["rows"]), "",
             "## Sustained at that load", "", markdown_table(SUSTAINED, result["rows"]), "",
             ROOFLINE_NOTE, "",
             "## Accounting", "", result["accounting"], "",
             markdown_table(ACCOUNT_COLUMNS, result["accounting_rows"]), ""]
    for png in result.get("plots", []):
        lines += [f"![{png}]({png})", ""]
    return "\n".join(lines)


def headline(result: dict) -> str:
    """The README's capacity table: admitted context and requests, TPOT there (and the longest
    context's over its roofline), per budget and mode."""
    by_key = {c.key: c for c in (*COLUMNS, *SUSTAINED)}
    keys = ("hbm_budget", "mode", "longest_context", "longest_x_resident", "longest_tpot_ms",
            "longest_x_roofline", "concurrent_requests", "concurrent_x_resident", "concurrent_tpot_ms",
            "concurrent_tokens_per_s", "host_used", "nvme_used")
    return markdown_table([by_key[k] for k in keys], result["rows"])
