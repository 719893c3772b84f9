"""The experiment commands of `lockserve`, as argparse parsers and one dispatcher:

    lockserve bench decode        the decode benchmark over modes x contexts x batches x budgets
    lockserve bench prefill       real prefills per mode beside a plain torch prefill; warm TTFT
    lockserve experiment capacity resident vs offloaded KV at a fixed HBM budget
    lockserve report              the README's measured section from the result files

Building the parsers imports nothing heavy; a command imports its module when it runs. Errors a
user can fix (bad flags, a budget too small, a missing extra) print one line
`lockserve: error: ...` and exit with status 2, as the other commands do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockserve.cluster.measure.accounting import ACCOUNTING, LOADS
from lockserve.cluster.measure.harness import flags
from lockserve.cluster.measure.harness.sizes import GIB, parse_bytes, parse_tokens
from lockserve.cluster.measure.harness.usage import EXIT_USER_ERROR, UsageError
from lockserve.configs.schema import SchedulerConfig

COMMANDS = ("bench", "experiment", "report")

DEFAULT_MODES = ("dense:hbm", "locks:hbm", "locks:host", "locks:host-nocache", "locks:host+nvme")
DEFAULT_CONTEXTS = (32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20)
DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_BUDGETS = (512, 1024, 2048, 4096)

DECODE_HELP = """\
Each point is one engine of one mode (attention:tier; locks:host-nocache is tier host without the
hot-page cache: every selected page crosses PCIe, the floor the cache lifts) holding `batch`
requests of `context` tokens, decoded as `python -m lockserve.cluster.measure.decode.bench` does:
TPOT median and p90, tokens/s, HBM bytes per step (a count: weights + summaries + attended pages),
PCIe bytes per step and the hot-cache hit rate (the engine's counters; also per step), the
roofline (HBM bytes / read bandwidth + PCIe bytes / UVA gather bandwidth, measured in the same
run) and device time by part of one profiled step (CUDA). dense:hbm reads every page: it runs once
per (context, batch).
Points whose KV cannot fit this machine are listed with the reason. Random-weight presets decode a
synthetic cache (honest bytes and times, unrealistic page reuse); real models decode the passkey
prompt (real page reuse); every table and plot says which. Writes OUT/NAME.json, .csv, .md and
NAME_*.png, rewritten after every point.
"""


PREFILL_HELP = """\
Per context the plain anchor (embedding-free [RMSNorm, QKV, flash SDPA causal, O, SwiGLU] x layers
in one shot, random weights of the model's shape) runs once; then per mode one engine: a warm-up
request, a cold request (the document and a question: its time to first token is its prefill),
the same request again (warm: every full page of it is cached but the last) and the document
with another question. TFLOP/s count the plain stack's FLOPs (no embedding, no LM head). With
--beside, a short request decodes alone and then while a prefill of the context runs beside it.
"""

REPORT_HELP = """\
Renders the measured results in FOLDER (decode bench files decode_*.json, decode sweeps and
capacity runs, by their "kind") as markdown: headline tables, plot links, the decode targets.
With --readme (once per page), rewrites the blocks of that page between the lines
    <!-- lockserve report: begin -->            (the results log, docs/results/README.md)
    <!-- lockserve report: end -->
or "<!-- lockserve report headline: begin -->" (README.md's table) and "... audit: ..." (the
stale files, docs/results/AUDIT.md), and leaves everything else byte for byte. --check only says
whether a block is stale, and whether a page outside FOLDER cites a measured figure ("12.66 ms",
"1.16 x") that no result file holds (exit 1); without --readme it checks README.md,
docs/results/README.md and docs/results/AUDIT.md.
--replot FILE.json makes a run's plots from its JSON (where the run had no matplotlib) and
rewrites its CSV and markdown to list them.
"""


def add_parsers(sub) -> None:
    """Add `bench`, `experiment` and `report` to the `lockserve` subparsers."""
    raw = argparse.RawDescriptionHelpFormatter
    bench = sub.add_parser("bench", help="benchmarks that write JSON, CSV, markdown and plots")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="{decode,prefill}")
    add_decode_arguments(bench_sub.add_parser(
        "decode", help="decode TPOT, throughput, bytes and roofline over modes, contexts, batches, budgets",
        description="The decode benchmark over a grid of modes, contexts, batch sizes and budgets.",
        epilog=DECODE_HELP, formatter_class=raw))
    add_prefill_arguments(bench_sub.add_parser(
        "prefill", help="real prefill time and TFLOP/s per mode beside a plain torch prefill; warm TTFT",
        description="Real prefills through the engine per mode and context, beside a plain torch prefill "
                    "of the same shape measured in the same run; warm requests sharing the prompt; the "
                    "TPOT of a decoding request while a prefill runs beside it.",
        epilog=PREFILL_HELP, formatter_class=raw))
    experiment = sub.add_parser("experiment", help="experiments that write JSON, CSV, markdown and plots")
    exp_sub = experiment.add_subparsers(dest="experiment_command", required=True, metavar="{capacity}")
    add_capacity_arguments(exp_sub.add_parser(
        "capacity", help="context and requests admitted at a fixed HBM budget for KV, per mode",
        description="Resident vs offloaded KV at a fixed HBM budget: the longest context and the most "
                    "requests each mode admits, the TPOT and throughput sustained there, and the host "
                    "memory and NVMe each mode uses.", epilog=ACCOUNTING, formatter_class=raw))
    report = sub.add_parser("report", help="the README's measured section from the result files",
                            description=REPORT_HELP, formatter_class=raw)
    report.add_argument("folder", type=Path, nargs="?", default=Path("docs/results"))
    report.add_argument("--readme", type=Path, action="append",
                        help="rewrite this page's marked blocks (else print the results log); repeatable")
    report.add_argument("--check", action="store_true",
                        help="exit 1 if a marked block is stale or a page cites a figure no file holds")
    report.add_argument("--replot", type=Path, nargs="+", metavar="FILE.json",
                        help="make these runs' PNG plots from their JSON, then rewrite their tables")


def _common(p: argparse.ArgumentParser, nvme_dir: str, name: str) -> None:
    flags.model(p, "llama-3.1-8b")
    flags.modes(p, DEFAULT_MODES)
    flags.graphs(p)
    flags.nvme_dir(p, nvme_dir)
    p.add_argument("--host-memory", type=parse_bytes, default=None,
                   help="room for host arenas (default: min(available memory, free /dev/shm) x 0.9)")
    p.add_argument("--nvme-space", type=parse_bytes, default=None,
                   help="room for NVMe pages (default: free disk under --nvme-dir x 0.9)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start nothing new after this many minutes (the rest are listed as not run)")
    flags.device(p)
    flags.out(p, "folder for NAME.json, .csv, .md and NAME_*.png")
    flags.name(p, name)


def add_prefill_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `bench prefill` (lockserve.cluster.measure.prefill)."""
    flags.model(p, "llama-3.1-8b")
    flags.modes(p, DEFAULT_MODES)
    p.add_argument("--contexts", nargs="+", type=parse_tokens, default=[32768, 131072], metavar="N",
                   help="prompt tokens (32K, 128K, 1M allowed; default 32K 128K)")
    flags.prefill_chunk(p, 8192, "the chunk the prefill figures are measured at")
    p.add_argument("--question", type=int, default=48, help="tokens after the document (default 48)")
    p.add_argument("--no-warm", action="store_true", help="cold prefills only")
    p.add_argument("--no-plain", action="store_true", help="skip the plain torch anchor")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop a cold prefill past S seconds and extrapolate the rest from its measured "
                        "steps (the row says how many; for prompts that outlive a time-limited machine; "
                        "default: none, every prefill runs to its end)")
    p.add_argument("--restart", action="store_true",
                   help="host+nvme modes: after the warm requests, wait for the prefix saves, close the "
                        "engine and send the cold request's prompt to a new engine over the same nvme_dir "
                        "(its TTFT: the document read back from NVMe)")
    p.add_argument("--beside", action="store_true",
                   help="also the TPOT of a decoding request alone and while a prefill runs beside it")
    p.add_argument("--beside-context", type=parse_tokens, default=4096,
                   help="the decoding request's prompt (default 4K)")
    p.add_argument("--beside-steps", type=int, default=64, help="its decode steps alone (default 64)")
    # The beside run's defaults are the server's (configs/schema.py SchedulerConfig): it measures
    # what is served unless told otherwise; "none" turns a cap off.
    served = {name: SchedulerConfig.model_fields[name].default
              for name in ("prefill_chunk_decoding", "prefill_attention_decoding", "prefill_layers_decoding")}
    p.add_argument("--beside-chunk", type=_or_none(int), default=served["prefill_chunk_decoding"],
                   help="scheduler.prefill_chunk_decoding: prompt tokens a step while a request decodes "
                        f"(none: the prefill's own chunk; default {served['prefill_chunk_decoding']}, "
                        "the server's)")
    p.add_argument("--beside-attention", type=_or_none(parse_tokens),
                   default=served["prefill_attention_decoding"],
                   help="scheduler.prefill_attention_decoding: prefill attention work of a step's chunks "
                        "(their whole forward) while a request decodes, query x key tokens (8M: 64 tokens "
                        "a chunk at a 128K prefix; none: no cap; default the server's, 8M)")
    p.add_argument("--beside-layers", type=_or_none(int), default=served["prefill_layers_decoding"],
                   help="scheduler.prefill_layers_decoding: layers of a prompt chunk's forward a step while "
                        "a request decodes (the chunk then spans several steps; none: all of them; default "
                        f"{served['prefill_layers_decoding']}, the server's)")
    p.add_argument("--prefill-window", type=parse_tokens, default=None, metavar="N",
                   help="cache.prefill_window_tokens on the host tiers: prompt tokens whose KV stays on the "
                        "GPU while it prefills; a smaller window fits a longer prompt on a smaller card, "
                        "its chunks reading older pages back over PCIe (default: the whole prompt)")
    flags.nvme_dir(p)
    flags.host_gib(p)
    flags.summary_eigh(p)
    flags.device(p)
    flags.out(p, "folder for NAME.json, .csv, .md and NAME.png")
    flags.name(p, "prefill")


def _or_none(parse):
    """An argparse type: "none" -> None, anything else through parse."""
    def parsed(text: str):
        return None if text.lower() == "none" else parse(text)
    parsed.__name__ = getattr(parse, "__name__", "value")  # argparse names the type in its errors
    return parsed


def prefill_arguments(**overrides) -> argparse.Namespace:
    """`bench prefill`'s arguments at the parser's defaults, with overrides: for scripts that build
    the bench's engine (prefill.spec_for) without its command line."""
    parser = argparse.ArgumentParser()
    add_prefill_arguments(parser)
    args = parser.parse_args(["--out", "."])
    unknown = sorted(set(overrides) - set(vars(args)))
    if unknown:
        raise ValueError(f"prefill_arguments: bench prefill has no argument {unknown}")
    return argparse.Namespace(**{**vars(args), **overrides})


def add_decode_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, flags.NVME_DIR, "sweep")
    p.add_argument("--contexts", nargs="+", type=parse_tokens, default=list(DEFAULT_CONTEXTS),
                   metavar="TOKENS", help="tokens of context per request (default 32K 128K 256K 512K 1M)")
    p.add_argument("--batches", nargs="+", type=int, default=list(DEFAULT_BATCHES), metavar="N",
                   help="requests decoding together (default 1 4 16 64)")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS), metavar="TOKENS",
                   help="LOCKS budgets, tokens per KV head per step (default 512 1024 2048 4096)")
    flags.steps(p, 64, warmup=4)
    flags.fill(p)
    p.add_argument("--reference", default="locks:hbm", help="mode whose tokens the others are compared to")
    flags.hot_cache_pages(p)
    flags.prefill_chunk(p, 4096, "fills the passkey prompt of real models")
    flags.host_gib(p)
    p.add_argument("--device-memory", type=parse_bytes, default=None,
                   help="room for KV on the device (default: free memory after loading the model x 0.9)")
    p.add_argument("--plot-budget", type=int, default=None,
                   help="budget of the plots (default 2048 or the largest)")


def add_capacity_arguments(p: argparse.ArgumentParser) -> None:
    _common(p, "/tmp/lockserve-capacity-nvme", "capacity")
    p.add_argument("--hbm-budget", nargs="+", type=parse_bytes, default=[16 * GIB, 64 * GIB], metavar="SIZE",
                   help="HBM budgets for KV (default 16GiB 64GiB)")
    p.add_argument("--context", type=parse_tokens, default=32 << 10,
                   help="context of each request for the concurrency question (default 32K)")
    flags.budget_tokens(p)
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoding together (default 64)")
    p.add_argument("--hot-cache-share", type=float, default=0.125,
                   help="share of the HBM budget for the hot-page cache on host tiers (default 0.125)")
    p.add_argument("--nvme-host-share", type=float, default=0.5,
                   help="host+nvme: share of its KV the host arena holds, the rest on NVMe (default 0.5)")
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS),
                   help="admitted loads to find and decode (default: longest concurrent)")
    p.add_argument("--no-decode", action="store_true", help="admission only: no fill, no decode")
    p.add_argument("--fill", choices=("synthetic", "prompt"), default="synthetic",
                   help="synthetic: random K/V and real summaries; prompt: prefill the passkey "
                        "prompt (a real model's page reuse; --loads longest only; on host+nvme every "
                        "prefill chunk reads the spilled earlier pages off disk, so a long prompt takes "
                        "minutes: a larger --prefill-chunk divides that) (default synthetic)")
    flags.steps(p, 32, warmup=4)
    flags.prefill_chunk(p, 512, "sizes the write pool, whose HBM the budget pays for")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Run `bench decode`, `experiment capacity` or `report`; user errors exit 2 with one line."""
    try:
        if args.command == "report":
            from lockserve.cluster.measure.report import run as run_report

            return run_report(args)
        if args.command == "bench" and args.bench_command == "prefill":
            from lockserve.cluster.measure.prefill import run as run_prefill

            return run_prefill(args, _after(argv, "prefill"))
        if args.command == "bench":
            from lockserve.cluster.measure.decode.sweep import run as run_sweep

            return run_sweep(args, _after(argv, "decode"))
        from lockserve.cluster.measure.capacity import run as run_capacity

        return run_capacity(args, _after(argv, "capacity"))
    except UsageError as err:
        print(f"lockserve: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


def _after(argv: list[str], word: str) -> list[str]:
    """The flags after the subcommand word, as the result files record the command."""
    return argv[argv.index(word) + 1:] if word in argv else argv
