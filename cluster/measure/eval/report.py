"""The result files of `lockserve eval retrieval`: the summary (pure functions of the records),
JSON, CSV, markdown and PNG plots. All four are written from one summary, so they agree; the CSV
holds every record and `summarize` rebuilds the summary from it (tests check both ways).

Counting: a prompt's score is the fraction of its answer's numbers named; needles found = score x
the prompt's answers (a multivalue prompt has three needles, the others one). Carrier retention =
(layer, KV head, answer) triples where both the selector and the exact-LSE oracle at the same
budget selected a carrier page, over those where the oracle did.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from lockserve.cluster.measure.eval.names import NAMES

COUNTS = ("oracle", "both", "selected", "total", "forced")
CSV_FIELDS = ("task", "context", "prompt_tokens", "depth", "seed", "selector", "attention", "tier",
              "budget_tokens", "score", "needles", "answers", "completion", "agreement", "captured_mass",
              "oracle_mass", "carrier_retention", *(f"carrier_{c}" for c in COUNTS), "lse_mae", "spearman",
              "summary_payload_bytes", "summary_bytes", "seconds", "tokens")
SINK, RECENT, PAGE = 1, 2, 16  # the selection rule's defaults (configs CacheConfig)


# ---- summary -----------------------------------------------------------------------------------


def needles(record: dict) -> int:
    return round(record["score"] * len(record["answers"]))


def prompt_key(record: dict) -> tuple:
    return (record["task"], record["context"], record["depth"], record["seed"])


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def aggregate(records: list[dict], fullkv: dict[tuple, dict]) -> dict[str, Any]:
    """One cell: needles found (and FullKV's on the same prompts), carrier counts, means."""
    counts = {c: sum(r["carrier_counts"][c] for r in records) for c in COUNTS}
    refs = [fullkv[prompt_key(r)] for r in records if prompt_key(r) in fullkv]
    total = sum(len(r["answers"]) for r in records)
    return {
        "prompts": len(records), "needles": total, "found": sum(needles(r) for r in records),
        "fullkv_found": sum(needles(f) for f in refs),
        "accuracy": sum(needles(r) for r in records) / total if total else None,
        "carrier_counts": counts,
        "carrier_retention": counts["both"] / counts["oracle"] if counts["oracle"] else None,
        "captured_mass": _mean(r["captured_mass"] for r in records),
        "oracle_mass": _mean(r["oracle_mass"] for r in records),
        "lse_mae": _mean(r["lse_mae"] for r in records), "spearman": _mean(r["spearman"] for r in records),
        "agreement": _mean(r["agreement"] for r in records),
    }


def _cells(records: list[dict], fullkv: dict, *keys: str) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r)
    def order(item):  # numbers in numeric order, then names
        return tuple((0, x, "") if isinstance(x, int | float) else (1, 0, str(x)) for x in item[0])

    return [{**dict(zip(keys, k, strict=True)), **aggregate(v, fullkv)}
            for k, v in sorted(groups.items(), key=order)]


def selection_rule(budget: int, page_size: int = PAGE, sink: int = SINK, recent: int = RECENT) -> dict:
    """How the budget is spent: pages k = ceil(budget / B); sink and recent pages are forced (the
    recent ones are the last full page and the open page, which holds 1..B tokens), the rest are
    chosen by score."""
    pages = math.ceil(budget / page_size)
    return {"budget_tokens": budget, "pages": pages, "sink": sink, "recent": recent,
            "scored": pages - sink - recent, "scored_share": (pages - sink - recent) / pages}


def host_vs_hbm(records: list[dict]) -> list[dict]:
    """For every X:host selector, how many (prompt, budget) decodes gave exactly X's tokens."""
    tokens = {(r["selector"], prompt_key(r), r["budget_tokens"]): r["tokens"] for r in records}
    out = []
    for host in sorted({r["selector"] for r in records if r["selector"].endswith(":host")}):
        base = host.removesuffix(":host")
        pairs = [(t, tokens[(base, k, b)]) for (s, k, b), t in tokens.items()
                 if s == host and (base, k, b) in tokens]
        out.append({"selector": host, "reference": base, "compared": len(pairs),
                    "identical": sum(a == b for a, b in pairs)})
    return out


def checks(cells: list[dict], host: list[dict]) -> list[dict]:
    """The issue's three statements, judged from the cells (None where the run lacks the data)."""
    at = {(c["selector"], c["budget_tokens"]): c for c in cells}
    budgets = sorted({c["budget_tokens"] for c in cells})
    near = [(b, at[("locks", b)]["found"] - at[("locks", b)]["fullkv_found"]) for b in budgets
            if b >= 256 and ("locks", b) in at]
    ret = lambda s, b: at[(s, b)]["carrier_retention"] if (s, b) in at else None  # noqa: E731
    above = [(b, ret("locks", b), ret("quest", b), ret("centroid", b)) for b in budgets if b <= 512]
    above = [a for a in above if None not in a]
    return [
        {"claim": "LOCKS within one needle of FullKV at budgets >= 256",
         "detail": ", ".join(f"{b}: {d:+d}" for b, d in near),
         "met": all(abs(d) <= 1 for _, d in near) if near else None},
        {"claim": "LOCKS carrier retention above Quest's and the centroid's at every budget <= 512",
         "detail": ", ".join(f"{b}: {lk:.1%} vs {q:.1%} / {c:.1%}" for b, lk, q, c in above),
         "met": all(lk > q and lk > c for _, lk, q, c in above) if above else None},
        {"claim": "host identical to hbm",
         "detail": ", ".join(f"{h['selector']}: {h['identical']}/{h['compared']}" for h in host),
         "met": all(h["identical"] == h["compared"] for h in host) if host else None},
    ]


def ablation_tables(records: list[dict], fullkv: dict, grid: dict) -> dict[str, Any]:
    """bits x rank and group-rule cells on the ablation prompts only (LOCKS's default config is the
    "locks" records there: basis bits 4, rank 8, share-average)."""
    contexts = set(grid.get("ablation_contexts") or [])
    seeds = set(grid.get("ablation_seeds") or grid["seeds"])
    keep = [r for r in records if r["context"] in contexts and r["seed"] in seeds
            and r["budget_tokens"] in grid["ablation_budgets"]]
    cells, rules = [], []
    for r in keep:
        fields = _spec_fields(r["selector"])
        ablation = set(fields) <= {"basis_bits", "rank", "group_rule"}
        if r["attention"] != "locks" or r["tier"] != "hbm" or not ablation:
            continue
        rule = fields.get("group_rule", "share_average")
        if rule == "share_average":
            bits, rank = int(fields.get("basis_bits", 4)), int(fields.get("rank", 8))
            cells.append({**r, "basis_bits": bits, "rank": rank})
        if set(fields) <= {"group_rule"}:
            rules.append({**r, "group_rule": rule})
    if not grid.get("ablations"):
        return {"grid": [], "group_rules": []}
    return {"grid": _cells(cells, fullkv, "budget_tokens", "basis_bits", "rank"),
            "group_rules": _cells(rules, fullkv, "budget_tokens", "group_rule")}


def _spec_fields(label: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in label.split(",")[1:])


def summarize(header: dict, records: list[dict], fullkv_records: list[dict]) -> dict[str, Any]:
    fullkv = {prompt_key(f): f for f in fullkv_records}
    cells = _cells(records, fullkv, "selector", "budget_tokens")
    host = host_vs_hbm(records)
    bytes_ = {}
    for r in records:
        bytes_.setdefault(r["selector"], r["summary_bytes"])
    total = sum(len(f["answers"]) for f in fullkv_records)
    return {
        "cells": cells,
        "by_task": _cells(records, fullkv, "selector", "budget_tokens", "task"),
        "by_context": _cells(records, fullkv, "selector", "budget_tokens", "context"),
        "fullkv": {"prompts": len(fullkv_records), "needles": total,
                   "found": sum(needles(f) for f in fullkv_records)},
        "fullkv_by_context": {str(c): sum(needles(f) for f in fullkv_records if f["context"] == c)
                              for c in sorted({f["context"] for f in fullkv_records})},
        "host_vs_hbm": host, "checks": checks(cells, host), "summary_bytes": bytes_,
        "selection_rule": [selection_rule(b) for b in header["grid"]["budgets"]],
        "ablations": ablation_tables(records, fullkv, header["grid"]),
    }


# ---- files -------------------------------------------------------------------------------------


def write_all(stem: Path, header: dict, records: list[dict], fullkv: list[dict],
              plots: bool = False) -> list[Path]:
    """OUT.json, OUT.csv, OUT.md (and OUT_*.png when plots): everything from one summary."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    records, fullkv = [rounded(r) for r in records], [rounded(f) for f in fullkv]
    data = {**header, "summary": summarize(header, records, fullkv), "records": records, "fullkv": fullkv}
    paths = [_atomic(stem.with_suffix(".json"), json_text(data)),
             _atomic(stem.with_suffix(".csv"), csv_text(records, fullkv)),
             _atomic(stem.with_suffix(".md"), markdown(data, stem.name))]
    if plots:
        from lockserve.cluster.measure.eval import plots as eval_plots

        paths.extend(eval_plots.plot_all(stem, data))
    return paths


def rounded(record: dict) -> dict:
    """Floats to 6 significant digits (the files hold thousands of records; the summary is made
    from the rounded ones, so every file shows the same numbers)."""
    return {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in record.items()}


def json_text(data: dict) -> str:
    """The run as JSON: header and summary indented, then one record per line (compact: a run has
    thousands of records)."""
    rows = {k: data[k] for k in ("records", "fullkv")}
    head = json.dumps({k: v for k, v in data.items() if k not in rows}, indent=1)
    parts = [head[: head.rindex("}")].rstrip()]
    for key, items in rows.items():
        body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in items)
        parts.append(f',\n "{key}": [\n{body}\n ]' if items else f',\n "{key}": []')
    return "".join(parts) + "\n}\n"


def _atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def csv_row(r: dict) -> dict[str, Any]:
    counts = r.get("carrier_counts") or {}
    b = r.get("summary_bytes") or {}
    row = {k: r.get(k) for k in CSV_FIELDS}
    row.update({f"carrier_{c}": counts.get(c) for c in COUNTS})
    row.update(needles=needles(r), answers=" ".join(r["answers"]), tokens=" ".join(map(str, r["tokens"])),
               summary_payload_bytes=b.get("payload"), summary_bytes=b.get("total"))
    return row


def csv_text(records: list[dict], fullkv: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n", quoting=csv.QUOTE_NONNUMERIC)
    writer.writeheader()
    for r in [*fullkv, *records]:
        writer.writerow(csv_row(r))
    return out.getvalue()


def records_from_csv(text: str) -> tuple[list[dict], list[dict]]:
    """(records, fullkv) back from csv_text: the fields the summary reads."""
    num = lambda v, f=float: None if v == "" else f(v)  # noqa: E731
    records, fullkv = [], []
    for row in csv.DictReader(io.StringIO(text, newline="")):
        r = {"task": row["task"], "context": int(row["context"]), "depth": float(row["depth"]),
             "seed": int(row["seed"]), "selector": row["selector"], "score": float(row["score"]),
             "answers": row["answers"].split(), "tokens": [int(t) for t in row["tokens"].split()],
             "prompt_tokens": int(row["prompt_tokens"])}
        if row["selector"] == "fullkv":
            fullkv.append(r)
            continue
        r.update(attention=row["attention"], tier=row["tier"], budget_tokens=int(row["budget_tokens"]),
                 agreement=num(row["agreement"]), captured_mass=num(row["captured_mass"]),
                 oracle_mass=num(row["oracle_mass"]), lse_mae=num(row["lse_mae"]),
                 spearman=num(row["spearman"]), carrier_counts={c: int(row[f"carrier_{c}"]) for c in COUNTS},
                 summary_bytes={"payload": num(row["summary_payload_bytes"]),
                                "total": num(row["summary_bytes"])})
        records.append(r)
    return records, fullkv


# ---- markdown ----------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    line = lambda cells: "| " + " | ".join(cells) + " |"  # noqa: E731
    return [line(head), "|" + " --- |" * len(head), *map(line, rows)]


def _name(selector: str) -> str:
    return NAMES.get(selector, selector)


def markdown(data: dict, stem: str) -> str:
    s, grid = data["summary"], data["grid"]
    budgets = grid["budgets"]
    at = {(c["selector"], c["budget_tokens"]): c for c in s["cells"]}
    selectors = list(dict.fromkeys([*grid["selectors"], *(c["selector"] for c in s["cells"])]))
    main = [sel for sel in selectors if sel in grid["selectors"]]
    m = data["machine"]
    lines = [f"# Retrieval through the engine: {data['label']}", "",
             f"`{data['command']}`", "",
             f"Model {data['model']} ({data['model_config']['num_layers']} layers, "
             f"{data['model_config']['num_heads']} query / {data['model_config']['num_kv_heads']} KV heads, "
             f"d = {data['model_config']['head_dim']}, {data['dtype']}) on {m['device']}"
             + (f" ({m['gpu']})" if m.get("gpu") else
                f" ({m['cpu_count']} CPUs, {m['threads']} torch threads)")
             + f"; commit {data.get('commit') or '-'}; {data.get('seconds', 0) / 60:.0f} min. "
             f"Tasks {', '.join(grid['tasks'])}; contexts {', '.join(map(str, grid['contexts']))} tokens; "
             f"depths {', '.join(map(str, grid['depths']))}; seeds {', '.join(map(str, grid['seeds']))}: "
             f"{s['fullkv']['prompts']} prompts, {s['fullkv']['needles']} needles. Every prompt is prefilled "
             "once (dense) and decoded greedily by FullKV and, from that KV, by every selector at every "
             "budget (workers/retrieval.py). Plots: "
             + ", ".join(f"`{stem}_{p}.png`" for p in ("accuracy", "retention", "grid")) + ".", ""]
    lines += ["## Needles found (all prompts)", ""]
    fk = s["fullkv"]
    head = ["selector", *(f"{b}" for b in budgets)]
    rows = [[_name("fullkv"), *([f"{fk['found']}/{fk['needles']}"] * len(budgets))]]
    rows += [[_name(sel), *(f"{at[(sel, b)]['found']}/{at[(sel, b)]['needles']}" if (sel, b) in at else "-"
                             for b in budgets)] for sel in main]
    lines += _table(head, rows) + [""]
    lines += ["## Carrier-page retention at the first decode step (where the oracle keeps one)", ""]
    rows = [[_name(sel), *(_pct(at[(sel, b)]["carrier_retention"]) if (sel, b) in at else "-"
                           for b in budgets)] for sel in main]
    lines += _table(head, rows) + [""]
    lines += ["## Captured attention mass at the first decode step (mean over layers, heads, prompts)", ""]
    rows = [[_name(sel), *(_pct(at[(sel, b)]["captured_mass"]) if (sel, b) in at else "-" for b in budgets)]
            for sel in main]
    lines += _table(head, rows) + [""]
    lines += ["## Greedy agreement with FullKV (common prefix of the decoded tokens)", ""]
    rows = [[_name(sel), *(_pct(at[(sel, b)]["agreement"]) if (sel, b) in at else "-" for b in budgets)]
            for sel in main]
    lines += _table(head, rows) + [""]
    lines += _estimates(s, main, budgets)
    lines += _per_context(s, main, budgets)
    lines += _per_task(s, main, budgets, grid["tasks"])
    lines += ["## The issue's statements, judged from this run", ""]
    lines += [f"- {c['claim']}: **{_verdict(c['met'])}** ({c['detail'] or 'no data'})" for c in s["checks"]]
    lines += [""] + _rule(s) + _ablations(s, grid)
    return "\n".join(lines) + "\n"


def _verdict(met: bool | None) -> str:
    return "no data" if met is None else "met" if met else "not met"


def _estimates(s: dict, main: list[str], budgets: list[int]) -> list[str]:
    lines = ["## Page-score estimates at the first decode step, and summary bytes", "",
             "LSE error: mean |s_hat - s| of the page log-mass over the full pages; Spearman: rank "
             "correlation with the exact page log-masses (means over budgets; Quest's score is an upper "
             "bound, so its error is large by design). Bytes: per page of 16 tokens per (layer, KV head), "
             "payload / with scales.", ""]
    rows = []
    for sel in main:
        cells = [c for c in s["cells"] if c["selector"] == sel]
        b = s["summary_bytes"].get(sel, {})
        rows.append([_name(sel), _num(_mean(c["lse_mae"] for c in cells)),
                     _num(_mean(c["spearman"] for c in cells)),
                     f"{_num(b.get('payload'), '{:.0f}')} / {_num(b.get('total'), '{:.0f}')}"])
    return lines + _table(["selector", "LSE error", "Spearman", "bytes / page"], rows) + [""]


def _per_context(s: dict, main: list[str], budgets: list[int]) -> list[str]:
    at = {(c["selector"], c["budget_tokens"], c["context"]): c for c in s["by_context"]}
    contexts = sorted({c["context"] for c in s["by_context"]})
    lines = ["## By context: needles found / carrier retention", ""]
    rows = [[f"FullKV, {ctx}", *([str(s["fullkv_by_context"].get(str(ctx), "-"))] * len(budgets))]
            for ctx in contexts]
    for sel in main:
        for ctx in contexts:
            rows.append([f"{_name(sel)}, {ctx}", *(
                f"{at[(sel, b, ctx)]['found']} / {_pct(at[(sel, b, ctx)]['carrier_retention'])}"
                if (sel, b, ctx) in at else "-" for b in budgets)])
    return lines + _table(["selector, context", *map(str, budgets)], rows) + [""]


def _per_task(s: dict, main: list[str], budgets: list[int], tasks: list[str]) -> list[str]:
    at = {(c["selector"], c["budget_tokens"], c["task"]): c for c in s["by_task"]}
    lines = ["## By task: accuracy (FullKV on the same prompts in brackets)", ""]
    rows = []
    for sel in main:
        for task in tasks:
            cells = [at.get((sel, b, task)) for b in budgets]
            rows.append([f"{_name(sel)}, {task}", *(
                f"{_pct(c['accuracy'])} ({_pct(c['fullkv_found'] / c['needles'])})" if c else "-"
                for c in cells)])
    return lines + _table(["selector, task", *map(str, budgets)], rows) + [""]


def _rule(s: dict) -> list[str]:
    lines = ["## How the selection rule spends a budget", "",
             "k = ceil(budget / 16) pages per (sequence, KV head); the sink page and the two most recent "
             "pages (the last full page and the open page, which holds 1-16 tokens and has no summary) are "
             "always taken; the selector's scores choose the rest.", ""]
    rows = [[str(r["budget_tokens"]), str(r["pages"]), str(r["sink"] + r["recent"]), str(r["scored"]),
             _pct(r["scored_share"])] for r in s["selection_rule"]]
    return lines + _table(["budget (tokens)", "pages", "forced (sink + recent)", "chosen by score",
                           "share chosen by score"], rows) + [""]


def _ablations(s: dict, grid: dict) -> list[str]:
    ab = s["ablations"]
    if not ab["grid"]:
        return []
    lines = [f"## LOCKS ablations (contexts {', '.join(map(str, grid['ablation_contexts']))})", "",
             "Carrier retention / needles found, basis bits x rank (the shipped summary is int4, "
             "rank 8).", ""]
    ranks = sorted({c["rank"] for c in ab["grid"]})
    for b in sorted({c["budget_tokens"] for c in ab["grid"]}):
        at = {(c["basis_bits"], c["rank"]): c for c in ab["grid"] if c["budget_tokens"] == b}
        cell = lambda c: f"{_pct(c['carrier_retention'])} / {c['found']}" if c else "-"  # noqa: E731
        rows = [[f"{bits} bits" if bits < 16 else "bf16", *(cell(at.get((bits, r))) for r in ranks)]
                for bits in sorted({k[0] for k in at}, reverse=True)]
        lines += [f"Budget {b} tokens:", ""] + _table(["basis", *(f"rank {r}" for r in ranks)], rows) + [""]
    rules = ab["group_rules"]
    budgets = sorted({c["budget_tokens"] for c in rules})
    at = {(c["group_rule"], c["budget_tokens"]): c for c in rules}
    rows = [[rule, *(f"{_pct(at[(rule, b)]['carrier_retention'])} / {_pct(at[(rule, b)]['captured_mass'])} / "
                     f"{at[(rule, b)]['found']}" if (rule, b) in at else "-" for b in budgets)]
            for rule in ("share_average", "group_max", "group_mass")]
    lines += ["GQA group rule: carrier retention / captured mass / needles found.", ""]
    return lines + _table(["rule", *map(str, budgets)], rows) + [""]
