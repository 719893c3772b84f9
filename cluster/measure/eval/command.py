"""`lockserve eval retrieval`: retrieval accuracy and carrier-page retention vs budget, LOCKS
against the baselines, through the serving engine.

    lockserve eval retrieval --contexts 1024 2048 --budgets 64 256 --selectors locks quest \
        --out docs/results/retrieval_smollm2_ci

Every prompt (task x context x depth x seed, workers/needles.py) is prefilled once by a dense
engine and decoded greedily there (FullKV), then decoded at every budget by an engine of every
selector (workers/retrieval.py says how, and what is measured at the first decode step).
Ablations (--ablations: LOCKS basis bits x rank, and the GQA group rule) run on the prompts of
--ablation-contexts only. Writes OUT.json (command, machine, every record, the summary), OUT.csv
(one row per record), OUT.md (the summary as tables) and OUT_*.png, rewritten after every prompt;
--resume keeps the records of OUT.json and runs only what is missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockserve.cluster.measure.harness import flags, sizes
from lockserve.cluster.measure.harness.usage import EXIT_USER_ERROR, UsageError

DEFAULT_SELECTORS = ("locks", "oracle", "quest", "centroid", "shared_sequence", "shared_global", "locks:host")
DEFAULT_BUDGETS = (64, 128, 256, 512, 1024, 2048)
DEFAULT_TASKS = ("passkey", "multikey", "multivalue")
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)

HELP = """\
Selectors are written attention[:tier][,field=value...]: attention one of locks, oracle, quest,
centroid, shared_sequence, shared_global; tier hbm (default) or host; fields rank, basis_bits,
group_rule, shared_rank, sink_pages, recent_pages. FullKV (dense) runs for every prompt.
--ablations adds locks,basis_bits=B,rank=R for B in 16 8 4 2 and R in 2 4 8 16 (the default
locks is B 4, R 8) and locks,group_rule=group_max / group_mass.

Metrics per (prompt, selector, budget): task score (the fraction of the answer's numbers named,
greedy, cut at the first stop token); greedy agreement with FullKV (common prefix of the decoded
tokens); at the first decode step, per layer and KV head: captured exact attention mass, carrier
retention (a page holding an answer's digits selected, counted where the exact-LSE oracle at the
same budget selects one), LSE error and Spearman correlation of the selector's page scores.
"""


def parse_tokens(text: str) -> int | str:
    """1024, 4K (= 4096), 1M or "max" (the model's positions less room for the answer): the bench's
    token counts (harness/sizes.py), and max."""
    if text == "max":
        return text
    try:
        return sizes.parse_tokens(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or max)") from None


def add_parser(sub) -> None:
    """Add `eval retrieval` to the `lockserve` subparsers."""
    ev = sub.add_parser("eval", help="quality evaluations that write JSON, CSV, markdown and plots")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="{retrieval}")
    p = ev_sub.add_parser(
        "retrieval", help="needle retrieval accuracy and carrier-page retention vs budget, per selector",
        description="Needle retrieval (passkey, multikey, multivalue over Paul Graham's essays) through the "
                    "engine: FullKV, LOCKS and the baselines at each budget.",
        epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    flags.model(p, "default")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=DEFAULT_TASKS)
    p.add_argument("--contexts", nargs="+", type=parse_tokens, default=[1024, 2048, 4096, "max"],
                   metavar="TOKENS", help="prompt tokens: 1024, 4K or max (default 1024 2048 4096 max)")
    p.add_argument("--depths", nargs="+", type=float, default=list(DEFAULT_DEPTHS),
                   help="needle depths in the haystack (default 0.1 0.3 0.5 0.7 0.9)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="prompt seeds (default 0 1 2)")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS), metavar="TOKENS",
                   help="tokens per KV head per step (default 64 128 256 512 1024 2048)")
    p.add_argument("--selectors", nargs="+", default=list(DEFAULT_SELECTORS), metavar="SPEC",
                   help=f"selector specs (default: {' '.join(DEFAULT_SELECTORS)})")
    p.add_argument("--ablations", action="store_true", help="add the bits x rank grid and the group rules")
    p.add_argument("--ablation-contexts", nargs="+", type=parse_tokens, default=None, metavar="TOKENS",
                   help="contexts the ablations run at (default: the largest of --contexts)")
    p.add_argument("--ablation-seeds", nargs="+", type=int, default=None, metavar="SEED",
                   help="seeds the ablations run at (default: all of --seeds)")
    p.add_argument("--ablation-budgets", nargs="+", type=int, default=None, metavar="TOKENS",
                   help="budgets the ablations run at, among --budgets (default: all)")
    flags.device(p)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    flags.prefill_chunk(p, 2048, "the FullKV engine's")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--label", default=None, help="what the run is, for the titles (default: model on device)")
    p.add_argument("--resume", action="store_true", help="keep OUT.json's records and run only the rest")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new prompt after this many minutes (then --resume runs the rest)")
    p.add_argument("--out", type=Path, required=True, help="path stem: writes OUT.json, .csv, .md, _*.png")


def run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run the evaluation; user errors exit 2 with one line."""
    from lockserve.cluster.measure.eval.run import run_eval

    try:
        return run_eval(args, sys.argv[1:] if argv is None else argv)
    except UsageError as err:
        print(f"lockserve: error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


def main(argv: list[str] | None = None) -> int:
    """`python -m lockserve.cluster.measure.eval.command ...`: the same command where the serve extra
    (FastAPI, uvicorn) that `lockserve` imports is not installed, e.g. a GPU machine without network."""
    parser = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure.eval.command")
    add_parser(parser.add_subparsers(dest="command", required=True))
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(["eval", "retrieval", *argv])
    return run(args, ["eval", "retrieval", *argv])


if __name__ == "__main__":
    sys.exit(main())
