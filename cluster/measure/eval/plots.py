"""PNG plots of `lockserve eval retrieval` (matplotlib, headless "Agg"; the `bench` extra).

    OUT_accuracy.png   needles found vs budget per selector, all tasks and each task; FullKV dashed
    OUT_retention.png  carrier-page retention vs budget (the paper's Fig. 1b) and captured mass
    OUT_grid.png       LOCKS basis bits x rank (carrier retention) and the GQA group rules

Every figure comes from the summary in OUT.json (eval/report.py), so it shows the numbers
the tables show. Without matplotlib nothing is drawn and the run says so.
"""

from __future__ import annotations

from pathlib import Path

from lockserve.cluster.measure.eval.names import NAMES

STYLE = {"locks": ("tab:green", "o", "-"), "locks:host": ("tab:olive", "x", ":"),
         "oracle": ("black", "s", "--"), "quest": ("tab:red", "v", "-"), "centroid": ("tab:orange", "^", "-"),
         "shared_sequence": ("tab:blue", "D", "-"), "shared_global": ("tab:purple", "P", "-")}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_all(stem: Path, data: dict) -> list[Path]:
    if not available():
        print("matplotlib is missing (pip install 'lockserve[bench]'): no plots; the JSON has every number")
        return []
    paths = [accuracy(stem, data), retention(stem, data)]
    if data["summary"]["ablations"]["grid"]:
        paths.append(grid(stem, data))
    return paths


def _lines(ax, cells, key, selectors, budgets, scale=100.0):
    for sel in selectors:
        pts = [(c["budget_tokens"], c[key]) for c in cells if c["selector"] == sel and c[key] is not None]
        if not pts:
            continue
        color, marker, line = STYLE.get(sel, (None, ".", "-"))
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, [scale * y for y in ys], marker=marker, linestyle=line, color=color,
                label=NAMES.get(sel, sel))
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per KV head)")
    ax.grid(alpha=0.3)


def _legend(fig, ax) -> None:
    """One legend under the panels (it would hide lines inside one)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # a run without data draws no lines
        fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=7, frameon=False)


def _save(fig, path: Path, title: str, data: dict) -> Path:
    fig.suptitle(f"{title}\n{data['label']}: {data['summary']['fullkv']['prompts']} prompts", fontsize=9)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def accuracy(stem: Path, data: dict) -> Path:
    plt, s, grid_ = _pyplot(), data["summary"], data["grid"]
    tasks = grid_["tasks"]
    fig, axes = plt.subplots(1, len(tasks) + 1, figsize=(4.2 * (len(tasks) + 1), 4.4), squeeze=False,
                             layout="constrained")
    panels = [("all tasks", s["cells"])] + [(t, [c for c in s["by_task"] if c["task"] == t]) for t in tasks]
    for ax, (title, cells) in zip(axes[0], panels, strict=True):
        _lines(ax, cells, "accuracy", grid_["selectors"], grid_["budgets"])
        ref = [c for c in cells if c["selector"] == "locks"] or cells
        if ref:
            ax.axhline(100 * ref[0]["fullkv_found"] / ref[0]["needles"], color="gray", linestyle="--",
                       label=NAMES["fullkv"])
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("needles found (%)")
        ax.set_ylim(-3, 103)
    _legend(fig, axes[0][0])
    return _save(fig, stem.with_name(stem.name + "_accuracy.png"), "Retrieval accuracy vs budget", data)


def retention(stem: Path, data: dict) -> Path:
    plt, s, grid_ = _pyplot(), data["summary"], data["grid"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.8), layout="constrained")
    _lines(ax1, s["cells"], "carrier_retention", grid_["selectors"], grid_["budgets"])
    ax1.set_ylabel("carrier pages kept where the oracle keeps one (%)")
    ax1.set_title("carrier-page retention, first decode step", fontsize=9)
    ax1.set_ylim(-3, 103)
    _lines(ax2, s["cells"], "captured_mass", grid_["selectors"], grid_["budgets"])
    ax2.set_ylabel("exact attention mass in the selected pages (%)")
    ax2.set_title("captured attention mass, first decode step", fontsize=9)
    _legend(fig, ax1)
    path = stem.with_name(stem.name + "_retention.png")
    return _save(fig, path, "Carrier retention and captured mass", data)


def grid(stem: Path, data: dict) -> Path:
    plt, ab = _pyplot(), data["summary"]["ablations"]
    budgets = sorted({c["budget_tokens"] for c in ab["grid"]})
    bits = sorted({c["basis_bits"] for c in ab["grid"]}, reverse=True)
    ranks = sorted({c["rank"] for c in ab["grid"]})
    fig, axes = plt.subplots(1, len(budgets) + 1, figsize=(4.0 * (len(budgets) + 1), 4.2), squeeze=False,
                             layout="constrained")
    for ax, b in zip(axes[0], budgets, strict=False):
        at = {(c["basis_bits"], c["rank"]): c["carrier_retention"] for c in ab["grid"]
              if c["budget_tokens"] == b and c["carrier_retention"] is not None}
        vals = [[100 * at[(bt, r)] if (bt, r) in at else float("nan") for r in ranks] for bt in bits]
        im = ax.imshow(vals, vmin=0, vmax=100, cmap="viridis")
        for i, row in enumerate(vals):
            for j, v in enumerate(row):
                label = "-" if v != v else f"{v:.0f}"  # NaN: no oracle-kept carrier to count
                ax.text(j, i, label, ha="center", va="center", color="white", fontsize=8)
        ax.set_xticks(range(len(ranks)), [f"r {r}" for r in ranks])
        ax.set_yticks(range(len(bits)), ["bf16" if x == 16 else f"int{x}" for x in bits])
        ax.set_title(f"carrier retention (%), budget {b}", fontsize=9)
    fig.colorbar(im, ax=axes[0][: len(budgets)].tolist(), shrink=0.8)
    ax = axes[0][-1]
    for rule, color in (("share_average", "tab:green"), ("group_max", "tab:red"), ("group_mass", "tab:blue")):
        pts = sorted((c["budget_tokens"], c["carrier_retention"]) for c in ab["group_rules"]
                     if c["group_rule"] == rule and c["carrier_retention"] is not None)
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, [100 * y for y in ys], marker="o", color=color, label=rule)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_ylim(-3, 103)
    ax.set_title("GQA group rule: carrier retention (%)", fontsize=9)
    ax.set_xlabel("budget (tokens per KV head)")
    _legend(fig, ax)
    path = stem.with_name(stem.name + "_grid.png")
    fig.suptitle(f"LOCKS ablations\n{data['label']}", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
