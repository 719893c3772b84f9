"""PNG plots of the decode sweep and the capacity experiment (matplotlib, headless "Agg").

Every figure's title names the model and the workload that produced it (synthetic KV fill or a
real model's decode), since page reuse, and so the hit rate and the host tiers' TPOT, differ.
matplotlib comes with the `bench` extra (pip install 'lockserve[bench]'); where it is missing (a GPU
machine without network), `lockserve report --replot FILE.json` makes the plots from the JSON later.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from lockserve.cluster.measure.harness.sizes import fmt_bytes, fmt_tokens


def available() -> bool:
    """matplotlib is importable. Without it the commands write JSON, CSV and markdown and say how
    to make the plots later from the JSON (`lockserve report --replot FILE.json`)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def workload_tag(result: dict) -> str:
    if "synthetic" in result["workload"]:
        return "random weights, synthetic KV: honest bytes and times, unrealistic page reuse"
    return "real model decode: real page reuse"


def _save(fig, path: Path, title: str, result: dict) -> Path:
    subtitle = f"{result['model']} on {result['device']} ({workload_tag(result)})"
    # ~13 characters of 9-point text per inch: wrap so a narrow figure does not clip its subtitle
    fig.suptitle(title + "\n" + textwrap.fill(subtitle, width=int(13 * fig.get_figwidth())), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _empty(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


# ---- decode sweep -------------------------------------------------------------------------------


def pick_budget(result: dict, wanted: int | None = None) -> int:
    budgets = result["grid"]["budgets"]
    if wanted in budgets:
        return wanted
    return 2048 if 2048 in budgets else max(budgets)


def _ran(result: dict) -> list[dict]:
    return [r for r in result["rows"] if r["tpot_ms_median"] is not None]


def _series(rows, mode, x_key, y_key, **where) -> tuple[list, list]:
    pts = sorted((r[x_key], r[y_key]) for r in rows if r["mode"] == mode and r[y_key] is not None
                 and all(r[k] in v for k, v in where.items()))
    return [p[0] for p in pts], [p[1] for p in pts]


def sweep_plots(result: dict, out: Path, name: str, budget: int | None = None) -> list[Path]:
    """NAME_tpot_vs_context, NAME_throughput_vs_batch, NAME_bytes_per_step, NAME_tpot_vs_budget and
    NAME_hit_rate PNGs; returns their paths. A plot along an axis the grid does not vary (one
    context, one batch or one budget) is left out: one point per line says nothing along it."""
    plt, rows = _pyplot(), _ran(result)
    budget = pick_budget(result, budget)
    batch = min((r["batch"] for r in rows), default=1)
    grid, modes = result["grid"], result["grid"]["modes"]
    at = {"budget_tokens": (budget, None)}
    ctx = max((r["context"] for r in rows), default=None)
    paths = []
    if len(grid["contexts"]) > 1:
        paths.append(_tpot_vs_context(plt, rows, modes, batch, at, out / f"{name}_tpot_vs_context.png",
                                      f"TPOT vs context, batch {batch}, budget {budget:,} tokens", result))
    if len(grid["batches"]) > 1:
        paths.append(_throughput_vs_batch(plt, rows, modes, at, out / f"{name}_throughput_vs_batch.png",
                                          f"Throughput vs batch, budget {budget:,} tokens", result))
    if len(grid["contexts"]) > 1:
        paths.append(_bytes_per_step(plt, rows, modes, batch, at, out / f"{name}_bytes_per_step.png",
                                     f"Bytes per decode step, batch {batch}, budget {budget:,} tokens",
                                     result))
    at_ctx = f"{fmt_tokens(ctx) if ctx else '-'} context"
    if len(grid["budgets"]) > 1:
        paths.append(_tpot_vs_budget(plt, rows, modes, ctx, batch, out / f"{name}_tpot_vs_budget.png",
                                     f"TPOT vs budget, {at_ctx}, batch {batch}", result))
    traces = [(p["mode"], p["result"]["hit_rate_by_step"]) for p in result["points"]
              if p["result"] and p["result"].get("hit_rate_by_step") and p["context"] == ctx
              and p["batch"] == batch and p["budget_tokens"] == budget]
    paths.append(_hit_rate(plt, traces, out / f"{name}_hit_rate.png", result,
                           f"Hot-cache hit rate per step, {at_ctx}, batch {batch}, budget {budget:,}"))
    return paths


def _tpot_vs_context(plt, rows, modes, batch, at, path: Path, title: str, result: dict) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in modes:
        x, y = _series(rows, mode, "context", "tpot_ms_median", batch=(batch,), **at)
        if x:
            ax.plot(x, y, marker="o", label=mode)
    _context_axis(ax)
    ax.set_ylabel("TPOT p50 (ms)")
    _legend(ax, rows)
    return _save(fig, path, title, result)


def _throughput_vs_batch(plt, rows, modes, at, path: Path, title: str, result: dict) -> Path:
    """One panel per context: tokens/s against batch, a line per mode."""
    contexts = sorted({r["context"] for r in rows}) or [None]
    fig, axes = plt.subplots(1, len(contexts), figsize=(3.2 * len(contexts) + 1, 3.8), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        for mode in modes:
            x, y = _series(rows, mode, "batch", "tokens_per_s", context=(ctx,), **at)
            if x:
                ax.plot(x, y, marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_int_formatter())
        ax.set_xlabel("batch")
        ax.set_title(f"{fmt_tokens(ctx) if ctx else '-'} context", fontsize=9)
    axes[0][0].set_ylabel("tokens/s")
    _legend(axes[0][0], rows)
    return _save(fig, path, title, result)


def _bytes_per_step(plt, rows, modes, batch, at, path: Path, title: str, result: dict) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "hbm_mib_per_step", "HBM MiB / step (count)"),
                           (axes[1], "pcie_mib_per_step", "PCIe MiB / step (measured)")):
        for mode in modes:
            x, y = _series(rows, mode, "context", key, batch=(batch,), **at)
            if x:
                ax.plot(x, y, marker="o", label=mode)
        _context_axis(ax)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    return _save(fig, path, title, result)


def _tpot_vs_budget(plt, rows, modes, ctx, batch, path: Path, title: str, result: dict) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode in modes:
        x, y = _series(rows, mode, "budget_tokens", "tpot_ms_median", context=(ctx,), batch=(batch,))
        if x and not mode.startswith("dense"):
            ax.plot(x, y, marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(_int_formatter())
    ax.set_xlabel("LOCKS budget (tokens per KV head)")
    ax.set_ylabel("TPOT p50 (ms)")
    _legend(ax, rows)
    return _save(fig, path, title, result)


def _legend(ax, rows) -> None:
    if rows:
        ax.legend(fontsize=7)
    else:
        _empty(ax, "no point ran")


def _context_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.xaxis.set_major_formatter(_tokens_formatter())


def _tokens_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: fmt_tokens(int(v)) if v >= 1 else "")


def _int_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _: f"{v:,.0f}")


def _hit_rate(plt, traces: list[tuple[str, list]], path: Path, result: dict, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    traces = [(label, rates) for label, rates in traces if any(r is not None for r in rates)]
    for label, rates in traces:
        steps = [i + 1 for i, r in enumerate(rates) if r is not None]
        ax.plot(steps, [r for r in rates if r is not None], label=label)
    if traces:
        ax.set_xlabel("timed decode step")
        ax.set_ylabel("hit rate")
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8)
    else:
        _empty(ax, "no host-tier point with a hot cache ran")
    return _save(fig, path, title, result)


# ---- capacity -----------------------------------------------------------------------------------


def capacity_plots(result: dict, out: Path, name: str) -> list[Path]:
    """NAME_capacity (admitted context and requests), NAME_sustained (TPOT and tok/s there) and
    NAME_hit_rate PNGs; returns their paths."""
    plt, rows = _pyplot(), result["rows"]
    budgets = sorted({r["hbm_budget"] for r in rows})
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    paths = []

    requests = f"requests of {fmt_tokens(result['context'])}"
    fig = _bar_panels(plt, rows, modes, budgets, [
        ("longest_context", "longest context admitted (tokens)", lambda v: fmt_tokens(int(v)), True),
        ("concurrent_requests", f"{requests} admitted together", lambda v: f"{v:.0f}", False)])
    paths.append(_save(fig, out / f"{name}_capacity.png", "Capacity at a fixed HBM budget for KV", result))

    fig = _bar_panels(plt, rows, modes, budgets, [
        ("longest_tpot_ms", "TPOT p50 at the longest context (ms)", lambda v: f"{v:.1f}", False),
        ("concurrent_tpot_ms", "TPOT p50 at the most requests (ms)", lambda v: f"{v:.1f}", False),
        ("concurrent_tokens_per_s", "tokens/s at the most requests", lambda v: f"{v:,.0f}", False)])
    paths.append(_save(fig, out / f"{name}_sustained.png", "Decode sustained at the admitted load", result))

    traces = [(f"{e['mode']} @ {fmt_bytes(e['hbm_budget'])}", e["longest"]["decode"]["hit_rate_by_step"])
              for e in result["entries"] if e.get("longest") and (e["longest"].get("decode") or {})
              .get("hit_rate_by_step")]
    paths.append(_hit_rate(plt, traces, out / f"{name}_hit_rate.png", result,
                           "Hot-cache hit rate per step at the longest context"))
    return paths


def _bar_panels(plt, rows, modes, budgets, panels):
    """One bar panel per (row key, y label, bar label, log scale) that some row has a value for
    (a run of one load draws no empty panels); every panel where none has."""
    shown = [p for p in panels if any(r.get(p[0]) for r in rows)] or panels
    fig, axes = plt.subplots(1, len(shown), figsize=(1 + 4.4 * len(shown), 4.4), squeeze=False)
    for ax, (key, ylabel, label, log) in zip(axes[0], shown, strict=True):
        _bars(ax, rows, modes, budgets, key, label)
        ax.set_ylabel(ylabel)
        if log and any(r.get(key) for r in rows):
            ax.set_yscale("log")
    return fig


def _bars(ax, rows, modes, budgets, key, label) -> None:
    width = 0.8 / max(len(budgets), 1)
    for j, budget in enumerate(budgets):
        xs, ys = [], []
        for i, mode in enumerate(modes):
            found = [r[key] for r in rows if r["mode"] == mode and r["hbm_budget"] == budget]
            if found and found[0] is not None:
                xs.append(i + (j - (len(budgets) - 1) / 2) * width)
                ys.append(found[0])
        bars = ax.bar(xs, ys, width, label=f"{fmt_bytes(budget)} for KV")
        ax.bar_label(bars, [label(y) for y in ys], fontsize=7)
    ax.set_xticks(range(len(modes)), modes, rotation=20, fontsize=8)
    ax.legend(fontsize=8)
