"""`lockserve bench decode`, `lockserve experiment capacity` and `lockserve report` end to end on the
CPU with the tiny random-weight model: every output file exists, JSON, CSV and markdown hold the
same rows and numbers, the PNGs are PNGs, the capacity admission is the engine's, and the report
rewrites only the README's marked section.

The commands run with TRITON_INTERPRET unset: the hot cache and the gather then take their torch
paths (the Triton kernels' interpreter runs are tested in tests/offload and tests/kernels), which
keeps each command to seconds.
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from lockserve.cluster.cli import main
from lockserve.cluster.measure import capacity, plots, report
from lockserve.cluster.measure.decode import bench, sweep
from lockserve.cluster.measure.harness.sizes import parse_bytes, parse_tokens
from lockserve.cluster.measure.harness.tables import csv_value, parse_markdown_table

REPO = Path(__file__).resolve().parents[3]
MODES = ["dense:hbm", "locks:hbm", "locks:host", "locks:host-nocache", "locks:host+nvme"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def no_interpreter():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory, no_interpreter):
    """`lockserve bench decode` once: (its output folder, exit code)."""
    out, nvme = tmp_path_factory.mktemp("sweep"), tmp_path_factory.mktemp("nvme")
    code = main(["bench", "decode", "--model", "tiny", "--device", "cpu", "--modes", *MODES,
                 "--contexts", "256", "400", "--batches", "1", "--budgets", "64", "96", "--steps", "3",
                 "--warmup", "1", "--nvme-dir", str(nvme), "--out", str(out)])
    return out, code


@pytest.fixture(scope="module")
def capacity_run(tmp_path_factory, no_interpreter):
    """`lockserve experiment capacity` once: (its output folder, exit code)."""
    out, nvme = tmp_path_factory.mktemp("capacity"), tmp_path_factory.mktemp("nvme")
    code = main(["experiment", "capacity", "--model", "tiny", "--device", "cpu", "--hbm-budget", "3MiB",
                 "--modes", *MODES, "--context", "300", "--budget-tokens", "64", "--max-batch", "6",
                 "--steps", "3", "--warmup", "1", "--prefill-chunk", "64", "--nvme-dir", str(nvme),
                 "--out", str(out)])
    return out, code


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert data[12:16] == b"IHDR" and width > 100 and height > 100, f"{path.name}: {width} x {height}"


def assert_files_agree(rows: list[dict], csv_path: Path, md_lines: list[str], tables) -> None:
    """CSV cells are the JSON values written back exactly; every markdown table shows each row's
    values as its columns format them, in the same order."""
    assert rows, "no rows"
    written = read_csv(csv_path)
    assert len(written) == len(rows)
    for row, line in zip(rows, written, strict=True):
        for key, cell in line.items():
            assert cell == csv_value(row.get(key)), f"{csv_path.name} {key}: {cell!r} vs {row.get(key)!r}"
            if isinstance(row.get(key), float):
                assert float(cell) == row[key]
    for columns in tables:
        header = "| " + " | ".join(c.title for c in columns) + " |"
        start = md_lines.index(header)
        cells = parse_markdown_table(md_lines[start:start + 2 + len(rows)])
        assert cells == [[c.cell(row.get(c.key)).replace("\\|", "|") for c in columns] for row in rows]


# ---- bench decode -------------------------------------------------------------------------------


def test_bench_decode_writes_json_csv_markdown_and_plots_that_agree(sweep_run):
    out, code = sweep_run
    assert code == 0
    result = json.loads((out / "sweep.json").read_text())
    # dense once per (context, batch); LOCKS modes once per budget: 2 contexts x (1 + 4 x 2)
    assert len(result["rows"]) == 2 * (1 + 4 * 2) == len(result["points"])
    assert all(r["status"] == "ok" for r in result["rows"])
    md = (out / "sweep.md").read_text().splitlines()
    assert_files_agree(result["rows"], out / "sweep.csv", md, [sweep.COLUMNS])
    assert "synthetic" in md[2], "the summary names its workload"
    # one batch in the grid: no throughput-vs-batch plot (its lines would be single points)
    assert result["plots"] == ["sweep_tpot_vs_context.png", "sweep_bytes_per_step.png",
                               "sweep_tpot_vs_budget.png", "sweep_hit_rate.png"]
    for png in result["plots"]:
        assert_png(out / png)
        assert f"![{png}]({png})" in md


def test_sweep_plots_draw_an_axis_only_where_the_grid_varies_it(sweep_run, tmp_path):
    result = json.loads((sweep_run[0] / "sweep.json").read_text())
    two_batches = {**result, "grid": {**result["grid"], "batches": [1, 2]},
                   "rows": result["rows"] + [{**r, "batch": 2} for r in result["rows"]]}
    names = [p.name for p in plots.sweep_plots(two_batches, tmp_path, "two")]
    assert names == ["two_tpot_vs_context.png", "two_throughput_vs_batch.png", "two_bytes_per_step.png",
                     "two_tpot_vs_budget.png", "two_hit_rate.png"]
    for name in names:
        assert_png(tmp_path / name)
    budget = result["grid"]["budgets"][0]
    one_budget = {**result, "grid": {**result["grid"], "budgets": [budget]},
                  "rows": [r for r in result["rows"] if r["budget_tokens"] in (budget, None)]}
    names = [p.name for p in plots.sweep_plots(one_budget, tmp_path, "one")]
    assert names == ["one_tpot_vs_context.png", "one_bytes_per_step.png", "one_hit_rate.png"]
    context = result["grid"]["contexts"][0]
    one_context = {**result, "grid": {**result["grid"], "contexts": [context]},
                   "rows": [r for r in result["rows"] if r["context"] == context]}
    names = [p.name for p in plots.sweep_plots(one_context, tmp_path, "ctx")]
    assert names == ["ctx_tpot_vs_budget.png", "ctx_hit_rate.png"]


def test_bench_decode_rows_are_the_bench_results(sweep_run):
    out, _ = sweep_run
    result = json.loads((out / "sweep.json").read_text())
    for point, row in zip(result["points"], result["rows"], strict=True):
        r = point["result"]
        assert row["tpot_ms_median"] == r["tpot_ms_median"] and row["tokens_per_s"] == r["tokens_per_s"]
        assert row["pcie_mib_per_step"] == r["bytes_per_step"]["pcie"] / 2**20
        steps = r["hit_rate_by_step"]
        if point["mode"] in ("locks:host", "locks:host+nvme"):
            assert len(steps) == result["steps"] and all(0 <= h <= 1 for h in steps), point["mode"]
            assert 0 <= row["hit_rate"] <= 1
        else:
            assert row["hit_rate"] is None and steps is None, point["mode"]
        if point["mode"] == "dense:hbm":
            assert row["same_tokens"] is None and row["budget_tokens"] is None
        elif point["mode"] == result["reference"]:  # never compared with itself
            assert row["same_tokens"] == sweep.REFERENCE and r["same_tokens_as_reference"] is None
        else:  # where the bytes live never changes the math
            assert row["same_tokens"] is True, (point["mode"], point["context"], point["budget_tokens"])


# ---- experiment capacity ------------------------------------------------------------------------


def test_capacity_writes_json_csv_markdown_and_plots_that_agree(capacity_run):
    out, code = capacity_run
    assert code == 0
    result = json.loads((out / "capacity.json").read_text())
    assert [r["mode"] for r in result["rows"]] == MODES
    md = (out / "capacity.md").read_text().splitlines()
    assert_files_agree(result["rows"], out / "capacity.csv", md, [capacity.COLUMNS, capacity.SUSTAINED])
    assert_files_agree(result["accounting_rows"], out / "capacity_accounting.csv", md,
                       [capacity.ACCOUNT_COLUMNS])
    assert "synthetic" in md[2] and result["accounting"].splitlines()[0] in md
    for entry, row in zip(result["entries"], result["rows"], strict=True):
        for load in ("longest", "concurrent"):
            decode = (entry.get(load) or {}).get("decode") or {}
            assert row[f"{load}_x_roofline"] == decode.get("tpot_over_roofline"), (row["mode"], load)
    assert capacity.ROOFLINE_NOTE in md
    assert result["plots"] == ["capacity_capacity.png", "capacity_sustained.png", "capacity_hit_rate.png"]
    for png in result["plots"]:
        assert_png(out / png)


def test_capacity_plots_draw_a_panel_only_for_a_load_that_ran(capacity_run):
    result = json.loads((capacity_run[0] / "capacity.json").read_text())
    modes, budgets = [r["mode"] for r in result["rows"]], [result["rows"][0]["hbm_budget"]]
    panels = [("longest_context", "tokens", str, True), ("concurrent_requests", "requests", str, False)]
    plt = plots._pyplot()
    both = plots._bar_panels(plt, result["rows"], modes, budgets, panels)
    longest_only = [{**r, "concurrent_requests": None} for r in result["rows"]]
    one = plots._bar_panels(plt, longest_only, modes, budgets, panels)
    assert [ax.get_ylabel() for ax in both.axes] == ["tokens", "requests"]
    assert [ax.get_ylabel() for ax in one.axes] == ["tokens"]
    assert len(one.axes[0].patches) == len(modes), "a bar per mode"
    plt.close("all")


def test_capacity_admission_is_the_engines_and_fits_the_budget(capacity_run):
    out, _ = capacity_run
    result = json.loads((out / "capacity.json").read_text())
    budget = parse_bytes("3MiB")
    rows = {r["mode"]: r for r in result["rows"]}
    for entry in result["entries"]:
        longest, many = entry["longest"], entry["concurrent"]
        for rec in (longest, many):
            assert 0 < rec["device_used_bytes"] <= budget, entry["mode"]
            assert rec["fill_steps"] == 0, "a synthetic fill runs no engine step"
            assert rec["decode"]["tpot_ms_median"] > 0
        # the largest prompt admitted, and the engine's own refusal of one token more
        max_tokens = result["warmup"] + result["steps"] + 8
        assert math.ceil((longest["admitted"] + max_tokens) / 16) == longest["page_ids"]
        assert "more than the engine's capacity" in longest["why"]
        need = math.ceil((result["context"] + max_tokens) / 16)
        if many["why"].startswith("max_num_seqs"):
            assert many["admitted"] == result["max_batch"]
        else:
            assert many["admitted"] == many["page_ids"] // need, entry["mode"]
    resident = rows["locks:hbm"]["longest_context"]
    assert rows["dense:hbm"]["longest_context"] == resident  # dense:hbm allocates summaries too
    for mode in ("locks:host", "locks:host-nocache", "locks:host+nvme"):
        assert rows[mode]["longest_context"] > 4 * resident, mode
        assert rows[mode]["longest_x_resident"] == rows[mode]["longest_context"] / resident
    assert rows["locks:host+nvme"]["nvme_used"] > 0, "host+nvme spilled pages to disk"


def test_capacity_prompt_fill_prefills_the_real_model_at_its_admitted_length(tmp_path, no_interpreter):
    """--fill prompt: the embedded SmolLM2 prefills the passkey prompt of each mode's longest
    admitted context and decodes it (real page reuse); every output names that workload."""
    code = main(["experiment", "capacity", "--model", "default", "--device", "cpu", "--hbm-budget", "34MiB",
                 "--budget-tokens", "256", "--modes", "locks:hbm", "locks:host", "--loads", "longest",
                 "--fill", "prompt", "--steps", "4", "--warmup", "1", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert result["workload"] == bench.WORKLOADS[False]
    assert {r["workload"] for r in result["rows"]} == {"real prompt"}
    assert f"Workload: **{bench.WORKLOADS[False]}**." in (tmp_path / "capacity.md").read_text()
    longest = {e["mode"]: e["longest"] for e in result["entries"]}
    for mode, rec in longest.items():
        assert rec["admitted"] - 64 < rec["decoded_context"] <= rec["admitted"], mode
        # prefilled by the engine, 512 tokens a step (a synthetic fill runs no step), then decoded
        assert rec["fill_steps"] == math.ceil(rec["decoded_context"] / 512), mode
        assert rec["decode"]["tpot_ms_median"] > 0
    assert longest["locks:host"]["admitted"] > 2 * longest["locks:hbm"]["admitted"]
    assert longest["locks:host"]["decode"]["hit_rate"] is not None


def test_capacity_prompt_fill_past_the_haystack_says_so(tmp_path, monkeypatch, no_interpreter):
    """An admitted context longer than the haystack cannot be prefilled: the mode's status names
    the admitted length and the way out, and the run goes on."""
    from lockserve.cluster.measure.eval import passkey

    monkeypatch.setattr(passkey, "haystack_text", lambda: "A short haystack. " * 20)
    code = main(["experiment", "capacity", "--model", "default", "--device", "cpu", "--hbm-budget", "34MiB",
                 "--budget-tokens", "256", "--modes", "locks:hbm", "--loads", "longest", "--fill", "prompt",
                 "--out", str(tmp_path)])
    assert code == 0
    [entry] = json.loads((tmp_path / "capacity.json").read_text())["entries"]
    assert entry["status"].startswith("longest failed: ValueError: --fill prompt: no passkey prompt of the ")
    assert "a smaller --hbm-budget admits less" in entry["status"]


def test_capacity_prompt_fill_refuses_the_concurrent_load(tmp_path, capsys):
    code = main(["experiment", "capacity", "--model", "default", "--device", "cpu", "--fill", "prompt",
                 "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockserve: error: --fill prompt fills the longest load only") and "\n" not in err
    assert not list(tmp_path.iterdir()), "nothing written"


def test_capacity_refuses_a_budget_the_engine_cannot_serve(tmp_path, capsys):
    code = main(["experiment", "capacity", "--model", "tiny", "--device", "cpu", "--budget-tokens", "40",
                 "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lockserve: error: budget (40)") and "\n" not in err


# ---- report -------------------------------------------------------------------------------------


def readme_with_markers(path: Path) -> tuple[str, str]:
    """A page with hand-typed text between its report markers, written to path: (the text before
    the begin marker, the text after the end marker). Its hand text cites no measured figure."""
    head, tail = "# A page\n\nHand-written text before the block.\n\n", "\n\nAnd after it: 1,024 tokens.\n"
    path.write_text(f"{head}{report.BEGIN}\nhand-typed text that the report replaces\n{report.END}{tail}")
    return head, tail


def test_report_rewrites_only_the_marked_section(sweep_run, capacity_run, tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    shutil.copytree(sweep_run[0], results)
    shutil.copytree(capacity_run[0], results, dirs_exist_ok=True)
    shutil.copy(REPO / "docs" / "results" / "decode_llama8b_128k.json", results)
    readme = tmp_path / "README.md"
    before, after = readme_with_markers(readme)
    args = ["report", "--readme", str(readme), str(results)]
    assert main([*args, "--check"]) == 1, "stale before the first run"
    assert main(args) == 0
    text = readme.read_text()
    assert text.startswith(before + report.BEGIN + "\n") and text.endswith(report.END + after)
    section = text[len(before + report.BEGIN + "\n"):-len(report.END + after)]
    assert section == report.render(results, tmp_path)
    assert "hand-typed" not in section
    for png in ["capacity_capacity.png", "sweep_tpot_vs_context.png"]:
        assert f"](docs/results/{png})" in section and (results / png).is_file()
    assert "| locks:host+nvme |" in section and "decode_llama8b_128k.json" in section
    [ref_row] = [line for line in section.splitlines()
                 if line.startswith("| `decode_llama8b_128k.json`") and "| locks:hbm |" in line]
    assert ref_row.endswith("| reference |"), "the reference mode is never shown as compared with itself"
    assert main([*args, "--check"]) == 0 and main(args) == 0 and readme.read_text() == text
    capsys.readouterr()
    (tmp_path / "NOMARK.md").write_text("# no markers here\n")
    assert main(["report", "--readme", str(tmp_path / "NOMARK.md"), str(results)]) == 2
    assert "needs exactly one line <!-- lockserve report: begin -->" in capsys.readouterr().err


def test_replot_makes_a_runs_plots_from_its_json(capacity_run, tmp_path):
    out, _ = capacity_run
    for name in ("capacity.json", "capacity.csv", "capacity_accounting.csv", "capacity.md"):
        shutil.copy(out / name, tmp_path)
    result = json.loads((tmp_path / "capacity.json").read_text())
    assert not list(tmp_path.glob("*.png"))
    assert main(["report", "--replot", str(tmp_path / "capacity.json")]) == 0
    for png in result["plots"]:
        assert_png(tmp_path / png)
    assert (tmp_path / "capacity.md").read_text() == (out / "capacity.md").read_text()


def test_the_committed_results_render():
    section = report.render(REPO / "docs" / "results", REPO / "docs" / "results")
    assert "decode_llama8b_512k.json" in section and "| target | measured | file | |" in section


def test_the_committed_pages_are_current_and_their_figures_have_files(capsys):
    """What CI's `lockserve report --check` says of the repository: every generated block is
    current and README.md cites no measured figure that no result file holds."""
    results = REPO / "docs" / "results"
    pages = [REPO / "README.md", results / "README.md", results / "AUDIT.md"]
    argv = ["report", "--check", *(a for page in pages for a in ("--readme", str(page))),
            str(results)]
    assert main(argv) == 0, capsys.readouterr().out


# ---- small pieces -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [("16GiB", 16 << 30), ("0.5MiB", 1 << 19), ("4096", 4096),
                                         ("2 TiB", 2 << 40)])
def test_sizes_parse(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text, value", [("32K", 32768), ("1M", 1 << 20), ("1000", 1000)])
def test_token_counts_parse(text, value):
    assert parse_tokens(text) == value


@pytest.mark.parametrize("text", ["16GB", "-1MiB", "0", "1.5", "K"])
def test_bad_sizes_and_counts_are_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text) if text != "1.5" else parse_tokens(text)


def test_grid_runs_dense_once_per_context_and_batch():
    points = sweep.grid(["dense:hbm", "locks:host"], [1024, 2048], [1, 4], [64, 128, 256])
    assert len(points) == 2 * 2 * (1 + 3)
    assert [p.budget_tokens for p in points[:4]] == [None, 64, 128, 256]


def test_the_experiments_run_without_the_serve_extra():
    """A GPU machine without network may lack FastAPI / uvicorn / httpx / Ray: the experiment
    commands import none of them (python -m lockserve.cluster.measure)."""
    modules = ["lockserve.cluster.measure.__main__", "lockserve.cluster.measure.capacity",
               "lockserve.cluster.measure.report"]
    code = (f"import sys, {', '.join(modules)}; "
            "print(sorted(n for n in ('fastapi', 'uvicorn', 'httpx', 'ray') if n in sys.modules))")
    run = dict(capture_output=True, text=True, timeout=120, check=True)
    assert subprocess.run([sys.executable, "-c", code], **run).stdout.strip() == "[]"
    command = [sys.executable, "-m", "lockserve.cluster.measure", "experiment", "capacity", "--help"]
    help_text = subprocess.run(command, **run).stdout
    assert "How the budget is spent" in help_text


def test_capacity_shrinks_an_engine_the_probes_oversized(tmp_path, monkeypatch, no_interpreter):
    """The probes' linear model can be off by allocator rounding (on the H200 by 1.3 MB at 16 GiB):
    an engine built over the budget is rebuilt smaller by its overshoot, never reported over it."""
    real = capacity.plan

    def oversized(setup, mode, load, budget):
        p = real(setup, mode, load, budget)
        return capacity.sized(setup, mode, load, budget, p.page_ids + 64, p.limited_by, p.device_fixed,
                              p.device_per_id)

    monkeypatch.setattr(capacity, "plan", oversized)
    code = main(["experiment", "capacity", "--model", "tiny", "--device", "cpu", "--hbm-budget", "3MiB",
                 "--modes", "locks:host-nocache", "--context", "300", "--budget-tokens", "64", "--max-batch",
                 "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)])
    assert code == 0
    [entry] = json.loads((tmp_path / "capacity.json").read_text())["entries"]
    for rec in (entry["longest"], entry["concurrent"]):
        assert rec["shrunk_from"] > rec["page_ids"] and rec["device_used_bytes"] <= parse_bytes("3MiB")


def test_capacity_killed_inside_a_load_keeps_the_loads_before(tmp_path, monkeypatch, no_interpreter):
    """A run stopped inside a mode (a device call's time limit: the process is interrupted) keeps
    that mode's finished loads on disk, marked incomplete, where it used to write a mode only
    when all its loads ended."""
    real, calls = capacity.run_load, []

    def interrupted_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # not an error of the mode: nothing catches it
        return real(*args, **kw)

    monkeypatch.setattr(capacity, "run_load", interrupted_second)
    with pytest.raises(KeyboardInterrupt):
        main(["experiment", "capacity", "--model", "tiny", "--device", "cpu", "--hbm-budget", "3MiB",
              "--modes", "locks:hbm", "--context", "300", "--budget-tokens", "64", "--max-batch", "6",
              "--steps", "2", "--warmup", "1", "--prefill-chunk", "64", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "capacity.json").read_text())
    (entry,) = result["entries"]
    assert entry["status"] == "incomplete: stopped in the concurrent load"
    assert entry["longest"]["admitted"] > 0 and "concurrent" not in entry
    (row,) = result["rows"]
    assert row["longest_context"] == entry["longest"]["admitted"] and row["longest_tpot_ms"] > 0
    assert "incomplete: stopped in the concurrent load" in (tmp_path / "capacity.md").read_text()


def test_capacity_of_host_nvme_is_host_memory_and_nvme_together(tmp_path):
    """With room for 10 page ids in host memory and 20 on NVMe (the tiny model's id is 24 KiB),
    host+nvme admits the 30 together, in a host arena and NVMe space that add up to its KV."""
    per_id = 3 * 2 * 2 * 16 * 32 * 4  # layers x KV heads x (K, V) x B x d x fp32
    code = main(["experiment", "capacity", "--model", "tiny", "--device", "cpu", "--hbm-budget", "3MiB",
                 "--modes", "locks:hbm", "locks:host+nvme", "--context", "64", "--budget-tokens", "64",
                 "--max-batch", "2", "--steps", "2", "--warmup", "1", "--prefill-chunk", "64",
                 "--host-memory", str(10 * per_id), "--nvme-space", str(20 * per_id),
                 "--nvme-dir", str(tmp_path / "nvme"), "--out", str(tmp_path / "out")])
    assert code == 0
    result = json.loads((tmp_path / "out" / "capacity.json").read_text())
    entry = next(e for e in result["entries"] if e["mode"] == "locks:host+nvme")
    longest = entry["longest"]
    assert longest["limited_by"] == "host memory + NVMe space" and longest["page_ids"] == 30, longest
    assert longest["host_reserved_bytes"] == 10 * per_id and longest["nvme_reserved_bytes"] == 20 * per_id
    assert longest["decode"]["tpot_ms_median"] > 0


def test_capacity_rows_carry_each_loads_tpot_over_its_roofline():
    """A GPU run's decode results hold tpot_over_roofline (None on the CPU, where there is no
    roofline): the rows, the sustained table and the README's headline show it per load."""
    decode = {"tpot_ms_median": 18.4, "tpot_ms_p90": 19.0, "tpot_over_roofline": 1.52, "tokens_per_s": 54.3,
              "hit_rate": 0.03}
    load = {"admitted": 1_141_732, "limited_by": "HBM budget", "page_ids": 71_358, "decode": decode,
            "host_reserved_bytes": 0, "device_used_bytes": 1}
    entry = {"hbm_budget": 2**34, "mode": "locks:host", "status": "ok", "longest": load,
             "concurrent": load | {"decode": decode | {"tpot_over_roofline": 1.11}, "why": "host memory"}}
    result = {"model": "llama-3.1-8b", "workload": bench.WORKLOADS[True], "context": 32768,
              "entries": [entry]}
    row = capacity.entry_row(entry, result)
    result["rows"] = [row]
    assert (row["longest_x_roofline"], row["concurrent_x_roofline"]) == (1.52, 1.11)
    assert "| 1.52 |" in capacity.headline(result) and "| 1.11 |" not in capacity.headline(result)
    assert "| 1.11 |" in capacity.markdown_table(capacity.SUSTAINED, result["rows"])
