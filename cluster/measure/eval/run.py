"""The run behind `lockserve eval retrieval` (cluster/eval_retrieval.py): the grid of prompts and
selectors, the model, progress, resuming, and the result files after every prompt."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockserve.cluster.measure.eval.grid import ANSWER_ROOM, ablation_specs
from lockserve.cluster.measure.harness.usage import UsageError

from lockserve.provenance import run_provenance


@dataclass(frozen=True)
class PromptKey:
    task: str
    context: int
    depth: float
    seed: int

    @classmethod
    def of(cls, record: dict) -> PromptKey:
        return cls(record["task"], record["context"], record["depth"], record["seed"])


def resolve_contexts(values: list, limit: int) -> list[int]:
    """Token counts, "max" = the model's positions less ANSWER_ROOM; refuses what does not fit."""
    out = []
    for v in values:
        c = limit - ANSWER_ROOM if v == "max" else v
        if not 0 < c <= limit - ANSWER_ROOM:
            raise UsageError(f"--contexts: {v} must be in (0, {limit - ANSWER_ROOM}] (the model's "
                             f"{limit} positions less {ANSWER_ROOM} for the answer)")
        out.append(c)
    return sorted(set(out))


@dataclass(frozen=True)
class Plan:
    """The grid: prompts, the selectors every prompt runs, and the ablations (specs, the prompts
    they run on: contexts x seeds, and their budgets)."""

    prompts: list[PromptKey]
    specs: list[str]
    extra: list[str]
    abl_contexts: set[int]
    abl_seeds: set[int]
    abl_budgets: list[int]

    def specs_for(self, p: PromptKey) -> list[str]:
        ablated = p.context in self.abl_contexts and p.seed in self.abl_seeds
        return self.specs + (self.extra if ablated else [])


def plan(args: argparse.Namespace, limit: int) -> Plan:
    from lockserve.cluster.measure.eval.retrieval import parse_spec

    contexts = resolve_contexts(args.contexts, limit)
    for d in args.depths:
        if not 0 <= d <= 1:
            raise UsageError(f"--depths: {d} must be in [0, 1]")
    specs = list(dict.fromkeys(args.selectors))
    extra = [s for s in ablation_specs() if s not in specs] if args.ablations else []
    for text in specs + extra:
        try:
            parse_spec(text)
        except ValueError as err:
            raise UsageError(f"--selectors: {err}") from None
    abl = set(resolve_contexts(args.ablation_contexts, limit)) if args.ablation_contexts else {max(contexts)}
    if extra and not abl <= set(contexts):
        raise UsageError(f"--ablation-contexts {sorted(abl)} must be among --contexts {contexts}")
    abl_budgets = sorted(set(args.ablation_budgets or args.budgets))
    if not set(abl_budgets) <= set(args.budgets):
        raise UsageError(f"--ablation-budgets {abl_budgets} must be among --budgets "
                         f"{sorted(set(args.budgets))}")
    # Seeds outermost: a run stopped early still covers every context and task of the seeds it did.
    prompts = [PromptKey(t, c, d, s) for s in args.seeds for c in contexts for t in args.tasks
               for d in args.depths]
    return Plan(prompts, specs, extra, abl, set(args.ablation_seeds or args.seeds), abl_budgets)


def header(args: argparse.Namespace, argv: list[str], model, device, grid: Plan) -> dict[str, Any]:
    """What the result files say about the run besides its records."""
    cfg = model.config
    return {
        "kind": "retrieval_eval", **run_provenance("lockserve " + shlex.join(argv), device),
        "label": args.label or f"{args.model} on {device.type}", "model": args.model,
        "model_config": {k: getattr(cfg, k) for k in ("num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                       "max_position_embeddings")},
        "dtype": str(model.dtype), "machine": machine(device),
        "grid": {"tasks": args.tasks, "contexts": sorted({p.context for p in grid.prompts}),
                 "depths": args.depths, "seeds": args.seeds, "budgets": sorted(set(args.budgets)),
                 "selectors": grid.specs, "ablations": grid.extra,
                 "ablation_contexts": sorted(grid.abl_contexts), "ablation_seeds": sorted(grid.abl_seeds),
                 "ablation_budgets": grid.abl_budgets},
    }


def machine(device) -> dict[str, Any]:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def previous(path: Path, grid: Plan, budgets: set[int]) -> tuple[list[dict], list[dict], float]:
    """The records, FullKV records and seconds of an earlier run at path that belong to this grid
    (a run narrowed to fewer seeds or selectors drops the others)."""
    if not path.exists():
        return [], [], 0.0
    data = json.loads(path.read_text())
    wanted = {(p, s) for p in grid.prompts for s in grid.specs_for(p)}
    records = [r for r in data["records"]
               if (PromptKey.of(r), r["selector"]) in wanted and r["budget_tokens"] in budgets]
    fullkv = [f for f in data["fullkv"] if PromptKey.of(f) in set(grid.prompts)]
    return records, fullkv, data.get("seconds", 0.0)


def run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    import torch
    from lockserve.cluster.measure.eval import report as eval_report
    from lockserve.cluster.measure.eval.needles import build_needle_prompt
    from lockserve.cluster.measure.eval.retrieval import RetrievalRunner, parse_spec
    from lockserve.workers.api import load
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)  # the parse resolved "auto"
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    started = time.time()
    model, tokenizer = load(args.model, device, dtype, 0)
    grid = plan(args, model.config.max_position_embeddings)
    records, fullkv, earlier = previous(args.out.with_suffix(".json"), grid, set(args.budgets)) \
        if args.resume else ([], [], 0.0)
    done = {(PromptKey.of(r), r["selector"]) for r in records}
    head = header(args, argv, model, device, grid)
    work = [(p, [s for s in grid.specs_for(p) if (p, s) not in done]) for p in grid.prompts]
    work = [(p, todo) for p, todo in work if todo]
    longest = max(p.context for p in grid.prompts) + 64
    runner = RetrievalRunner(model, tokenizer, device, args.budgets, longest,
                             prefill_chunk=args.prefill_chunk, show_progress=True)
    bar = tqdm(total=sum(len(todo) for _, todo in work), desc="retrieval eval", unit="selector")
    try:
        for key, todo in work:
            if args.max_minutes is not None and time.time() - started > 60 * args.max_minutes:
                print(f"--max-minutes {args.max_minutes}: stopping; --resume runs the rest", flush=True)
                break
            bar.set_postfix_str(f"{key.task} {key.context} d{key.depth} s{key.seed}")
            prompt = build_needle_prompt(tokenizer, key.task, key.context, key.depth, key.seed)
            out = runner.run(prompt, [parse_spec(s) for s in todo], on_spec=lambda _: bar.update(1),
                             budgets={s: grid.abl_budgets for s in grid.extra})
            fullkv = [f for f in fullkv if PromptKey.of(f) != key] + [out["fullkv"]]
            records.extend(out["records"])
            head["seconds"] = earlier + time.time() - started
            eval_report.write_all(args.out, head, records, fullkv)
    finally:
        bar.close()
        runner.close()
    head["seconds"] = earlier + time.time() - started
    paths = eval_report.write_all(args.out, head, records, fullkv, plots=True)
    print("\n".join(str(p) for p in paths))
    return 0
