"""Retrieval quality through the engine: needle prompts decoded under page selectors and budgets.

    runner = RetrievalRunner(model, tokenizer, device, budgets=[64, 128, 256])
    result = runner.run(prompt, [parse_spec("locks"), parse_spec("quest")])   # a NeedlePrompt

Per prompt, a dense engine (FullKV, tier hbm) prefills the prompt once and decodes it greedily:
the reference answer. Its KV right after the prefill (Engine.export_prefill) then stands in for
the prefill of one request per budget in an engine of each selector spec (Engine.fill_prefilled:
prefill attention is dense in every mode, so that is the KV and first token the engine's own
prefill computes, bit for bit); those requests decode together, greedily, as many tokens as
FullKV. The first decode step runs with an observer on the engine's attention
(PagedAttention.observer): per layer and row it reads the selected pages and, from the exact
keys of every page, computes

    captured mass     the exact softmax mass of the query heads inside the selected pages
                      (kernels.metrics.head_coverage), averaged over heads and layers;
    oracle            the exact-LSE oracle's selection at the same budget: the engine's own rule
                      (sink and recent pages forced, then the best share-averages) on exact page
                      log-masses;
    carrier retention per answer, layer and KV head where the oracle selects a page holding the
                      answer's digits: whether the selector selects one too (counts are kept);
    LSE error         mean |s_hat - s| of the selector's page log-mass estimates over the full
                      pages, and their Spearman correlation with the exact ones (selectors whose
                      scores are per query head: not under group_max / group_mass).

The observer reads every key of every page of every layer at that step (like the oracle
itself): an evaluation cost, paid once per prompt and selector.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from lockserve.cluster.measure.eval.metrics import head_coverage, lse_mae, spearman
from lockserve.cluster.measure.eval.needles import NeedlePrompt, answer_score, haystack_window
from lockserve.configs.loader import readable_reason
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.kernels import baselines as bl
from lockserve.kernels.score import PageScores, group_stats_ref
from lockserve.kernels.select import select_decode_pages
from lockserve.workers.engine.attention import DecodeTrace
from lockserve.workers.engine.engine import Engine, PrefilledKV, RequestOptions
from lockserve.workers.engine.kv_manager import page_slots
from lockserve.workers.engine.sampling import SamplingParams
from pydantic import ValidationError

# CacheConfig fields a selector spec may set (the rest is the evaluation's: budgets, tier sizes).
SPEC_FIELDS = ("rank", "basis_bits", "group_rule", "shared_rank", "sink_pages", "recent_pages")
SPEC_TIERS = ("hbm", "host")
CALIBRATION_SEED = 10_000  # the haystack window shared_global's basis is fitted on (no needles)


# ---- selector specs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectorSpec:
    """One engine configuration under evaluation, written `attention[:tier][,field=value...]`, e.g.
    "locks", "locks:host", "quest", "locks,basis_bits=2,rank=4", "locks,group_rule=group_max"."""

    label: str
    attention: str
    tier: str = "hbm"
    fields: tuple[tuple[str, Any], ...] = ()

    def cache_config(self, budget_tokens: int, **extra) -> CacheConfig:
        return CacheConfig(attention=self.attention, tier=self.tier, budget_tokens=budget_tokens,
                           **dict(self.fields), **extra)


def parse_spec(text: str) -> SelectorSpec:
    """A SelectorSpec from its text; ValueError naming the spec and the bad part."""
    head, *assigns = [part.strip() for part in text.split(",")]
    attention, _, tier = head.partition(":")
    tier = tier or "hbm"
    if tier not in SPEC_TIERS:
        raise ValueError(f"selector {text!r}: tier ({tier!r}) must be one of {', '.join(SPEC_TIERS)}")
    fields = {}
    for assign in assigns:
        key, sep, value = assign.partition("=")
        if not sep or key not in SPEC_FIELDS:
            raise ValueError(f"selector {text!r}: {assign!r} must be field=value, field one of "
                             f"{', '.join(SPEC_FIELDS)}")
        fields[key] = yaml.safe_load(value)
    spec = SelectorSpec(text, attention, tier, tuple(sorted(fields.items())))
    if attention == "dense":
        raise ValueError(f"selector {text!r}: dense is the FullKV reference every run has")
    try:
        spec.cache_config(512)
    except ValidationError as err:
        where = lambda e: ".".join(map(str, e["loc"])) or "cache"  # noqa: E731
        reasons = "; ".join(f"{where(e)} ({e.get('input')!r}) {readable_reason(e)}" for e in err.errors())
        raise ValueError(f"selector {text!r}: {reasons}") from None
    return spec


# ---- the first decode step ---------------------------------------------------------------------


@dataclass
class RowProbe:
    """Sums over the layers of one row's first decode step (see the module docstring)."""

    carriers: list[set[int]]
    layers: int = 0
    mass: float = 0.0
    oracle_mass: float = 0.0
    lse_err: list[float] = field(default_factory=list)
    rank_corr: list[float] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {"oracle": 0, "both": 0, "selected": 0, "total": 0,
                                                             "forced": 0})

    def result(self) -> dict[str, Any]:
        c = self.counts
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        layers = self.layers or None  # None: the row never decoded (its first token was a stop token)
        return {"captured_mass": layers and self.mass / layers,
                "oracle_mass": layers and self.oracle_mass / layers,
                "carrier_retention": c["both"] / c["oracle"] if c["oracle"] else None,
                "carrier_counts": dict(c), "lse_mae": mean(self.lse_err), "spearman": mean(self.rank_corr)}


class FirstStepProbe:
    """PagedAttention observer for one decode step of `engine` (built with use_graphs False).
    carriers: request id -> the carrier page positions of each answer (NeedlePrompt.carrier_pages)."""

    def __init__(self, engine: Engine, carriers: dict[str, list[set[int]]]):
        self.engine = engine
        self.rows = {rid: RowProbe(pages) for rid, pages in carriers.items()}

    def __call__(self, trace: DecodeTrace) -> None:
        for b, seq in enumerate(self.engine.runner.state.seqs[: trace.q.shape[0]]):
            if seq.request_id in self.rows:
                self._row(trace, b, self.rows[seq.request_id])

    def _row(self, t: DecodeTrace, b: int, probe: RowProbe) -> None:
        cc = self.engine.cache_config
        n, ns = int(t.rows.num_pages[b]), int(t.num_settled[b])
        pids = t.rows.page_table[b, :n].long()
        pos = self._positions(t, b, pids)  # [Hkv, K]
        s_exact = self._exact(t, b, pids, ns)  # [1, Hkv, G, n]
        s_full = s_exact[..., :ns]
        m_bar = F.pad(PageScores(s_full, group_stats_ref(s_full)).share_average(), (0, n - ns))
        oracle = select_decode_pages(m_bar, t.rows.num_pages[b : b + 1], t.rows.budgets[b : b + 1],
                                     pos.shape[-1], cc.sink_pages, cc.recent_pages)[0]  # [Hkv, K]
        probe.layers += 1
        probe.mass += float(head_coverage(s_exact, pos[None]).mean())
        probe.oracle_mass += float(head_coverage(s_exact, oracle[None]).mean())
        for pages in probe.carriers:
            self._count(probe.counts, pages, pos, oracle, n, cc)
        if t.scores is not None and t.scores.s_hat.shape[2] == s_exact.shape[2] and ns:
            s_hat = t.scores.s_hat[b : b + 1, :, :, :ns].float()
            probe.lse_err.append(float(lse_mae(s_hat, s_full)))
            rho = spearman(s_hat, s_full)
            if bool(torch.isfinite(rho).any()):
                probe.rank_corr.append(float(rho[torch.isfinite(rho)].mean()))

    def _positions(self, t: DecodeTrace, b: int, pids: torch.Tensor) -> torch.Tensor:
        """Page positions [Hkv, K] of row b's selection (-1 padding): tier slots back to page ids,
        page ids back to positions in the row's page table; the open page is the last position."""
        lay = self.engine.kv.layout
        inv = torch.full((lay.max_pages,), -1, dtype=torch.long, device=pids.device)
        inv[pids] = torch.arange(pids.numel(), device=pids.device)
        slots, is_open = t.selection.slots[b], t.selection.is_open[b]
        pid = (slots // lay.num_kv_heads - t.layer * lay.max_pages).clamp(0, lay.max_pages - 1)
        return torch.where(is_open, pids.numel() - 1, torch.where(slots >= 0, inv[pid], -1))

    def _exact(self, t: DecodeTrace, b: int, pids: torch.Tensor, ns: int) -> torch.Tensor:
        """Exact page log-masses of every page of row b, the open page's live tokens included:
        [1, Hkv, G, n] (the full pages' keys from the tier, the open page's from the attention pool)."""
        kv = self.engine.kv
        lay = kv.layout
        sel = t.selection
        open_idx = torch.where(sel.is_open[b], sel.idx[b], 0).sum(dim=-1)  # [Hkv]: one open entry per head
        parts = [kv.attn_pool[open_idx][None, :, 0]]  # [1, Hkv, B, d]
        if ns:
            slots = page_slots(t.layer, lay.max_pages, pids[:ns], kv.heads).flatten()
            parts.insert(0, kv.settled.read(slots).view(ns, lay.num_kv_heads, 2, lay.page_size,
                                                        lay.head_dim)[:, :, 0])
        keys = torch.cat(parts)  # [n, Hkv, B, d]
        n = keys.shape[0]
        lens = torch.full((1, n), lay.page_size, dtype=torch.long, device=keys.device)
        lens[0, -1] = int(t.rows.tail_len[b])
        table = torch.arange(n, device=keys.device)[None]
        count = torch.tensor([n], device=keys.device)
        return bl.score_exact(t.q[b : b + 1], keys, table, count, page_lens=lens)

    @staticmethod
    def _count(counts: dict[str, int], pages: set[int], pos: torch.Tensor, oracle: torch.Tensor, n: int,
               cc: CacheConfig) -> None:
        """Carrier counts of one answer at one layer, per KV head."""
        mask = torch.zeros(n + 1, dtype=torch.bool, device=pos.device)
        mask[[p for p in pages if p < n]] = True
        has = lambda sel: mask[torch.where(sel >= 0, sel, n)].any(dim=-1)  # noqa: E731  [Hkv]
        mine, best = has(pos), has(oracle)
        counts["oracle"] += int(best.sum())
        counts["both"] += int((mine & best).sum())
        counts["selected"] += int(mine.sum())
        counts["total"] += mine.numel()
        if any(p < cc.sink_pages or p >= n - cc.recent_pages for p in pages):
            counts["forced"] += mine.numel()


# ---- engines and runs --------------------------------------------------------------------------


def greedy(max_tokens: int, ignore_eos: bool = False) -> SamplingParams:
    """Greedy decoding. FullKV ignores stop tokens (a stop at the first token must not end the
    request before its KV is exported; its answer is cut at the first stop token later)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def cut_at_stop(tokens: Sequence[int], stop_ids) -> list[int]:
    """Tokens before the first stop token."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return list(tokens[:i])
    return list(tokens)


def agreement(tokens: Sequence[int], reference: Sequence[int]) -> float:
    """Greedy agreement: the length of the common prefix of the decoded tokens (the first token,
    sampled by the shared dense prefill, excluded) over the reference's decoded tokens."""
    a, r = tokens[1:], reference[1:]
    if not r:
        return 1.0
    same = next((i for i, (x, y) in enumerate(zip(a, r, strict=False)) if x != y), min(len(a), len(r)))
    return same / len(r)


def drain(engine: Engine, tokens: dict[str, list[int]]) -> None:
    """Step the engine until every request has finished, appending each request's new tokens."""
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)


class RetrievalRunner:
    """Runs prompts through a FullKV engine and one engine per selector spec (module docstring).

    budgets: token budgets (one request each, decoded together); max_prompt_tokens: the longest
    prompt (sizes the FullKV engine); prefill_chunk: the FullKV engine's prefill chunk.
    """

    def __init__(self, model, tokenizer, device: torch.device, budgets: Sequence[int],
                 max_prompt_tokens: int, prefill_chunk: int = 2048, calibration_tokens: int = 2048,
                 show_progress: bool = False):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.budgets = sorted(set(budgets))
        for b in self.budgets:
            CacheConfig(budget_tokens=b)  # a budget the engine accepts (multiple of B, > forced pages)
        self.page_size = CacheConfig().page_size
        longest = max(max_prompt_tokens, calibration_tokens) + 64
        chunk = min(prefill_chunk, longest)
        self.dense = Engine(model, tokenizer, CacheConfig(attention="dense", tier="hbm"),
                            SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk,
                                            prefill_chunk=chunk),
                            self.device, max_pages=math.ceil(longest / self.page_size) + 1,
                            max_model_len=longest, use_graphs=False, show_progress=show_progress)
        self.calibration_tokens = calibration_tokens
        self._calibration: PrefilledKV | None = None
        self._ids = 0

    def close(self) -> None:
        self.dense.close()

    def _rid(self, what: str) -> str:
        self._ids += 1
        return f"{what}-{self._ids}"

    def fullkv(self, prompt_ids: list[int], max_tokens: int) -> tuple[PrefilledKV, list[int]]:
        """Prefill and greedily decode on the dense engine: (the KV after the prefill, the tokens)."""
        rid = self._rid("fullkv")
        self.dense.add_request(rid, prompt_ids, greedy(max_tokens, ignore_eos=True))
        tokens: dict[str, list[int]] = {rid: []}
        prefilled = None
        while prefilled is None:
            for out in self.dense.step():
                tokens[out.request_id].extend(out.token_ids)
            if tokens[rid]:
                prefilled = self.dense.export_prefill(rid)
        drain(self.dense, tokens)
        return prefilled, tokens[rid]

    def calibration(self) -> PrefilledKV:
        """The KV of a window of the essays without needles (shared_global fits its basis on it)."""
        if self._calibration is None:
            text = haystack_window(self.tokenizer, self.calibration_tokens, CALIBRATION_SEED)
            ids = self.tokenizer.encode(text, add_bos=False)[: self.calibration_tokens]
            self._calibration = self.fullkv(ids, 2)[0]
        return self._calibration

    def engine(self, spec: SelectorSpec, max_len: int, budgets: Sequence[int]) -> Engine:
        """An engine for spec: one row per budget of sequences up to max_len tokens, eager steps."""
        mc, b = self.model.config, self.page_size
        rows = len(budgets)
        calibrate = spec.attention == "shared_global"
        longest = max(max_len, self.calibration_tokens + 2) if calibrate else max_len
        pages = rows * math.ceil(max_len / b) + (math.ceil(longest / b) if calibrate else 0) + 1
        selected = rows * mc.num_kv_heads * math.ceil(max(budgets) / b)
        cache = spec.cache_config(max(budgets), hot_cache_pages=2 * selected)
        sched = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=max(rows, b), prefill_chunk=b)
        engine = Engine(self.model, self.tokenizer, cache, sched, self.device, max_pages=pages,
                        max_model_len=longest, use_graphs=False)
        if calibrate:
            rid = self._rid("calibration")
            prefilled = self.calibration()
            engine.add_request(rid, list(prefilled.prompt_ids), greedy(2))
            engine.fill_prefilled(rid, prefilled)
            engine.abort(rid)
        return engine

    def run(self, prompt: NeedlePrompt, specs: Sequence[SelectorSpec], on_spec=None,
            budgets: dict[str, Sequence[int]] | None = None) -> dict[str, Any]:
        """FullKV, then every spec at every budget: {"fullkv": record, "records": [...]}. on_spec:
        called with each spec's label after it ran (progress); budgets: a spec label's own budgets
        (a subset of the runner's; default all of them)."""
        start = time.perf_counter()
        prefilled, reference = self.fullkv(prompt.prompt_ids, prompt.max_tokens)
        text = self.tokenizer.decode(cut_at_stop(reference, self.tokenizer.stop_ids))
        fullkv = {**prompt_fields(prompt), "selector": "fullkv", "score": answer_score(prompt, text),
                  "completion": text, "tokens": reference, "seconds": time.perf_counter() - start}
        records = []
        for spec in specs:
            records.extend(self.run_spec(spec, prompt, prefilled, reference, (budgets or {}).get(spec.label)))
            if on_spec is not None:
                on_spec(spec.label)
        return {"fullkv": fullkv, "records": records}

    def run_spec(self, spec: SelectorSpec, prompt: NeedlePrompt, prefilled: PrefilledKV,
                 reference: list[int], budgets: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """Decode the prompt at every budget (default the runner's) under spec; a record per budget."""
        budgets = sorted(budgets or self.budgets)
        if not set(budgets) <= set(self.budgets):
            raise ValueError(f"budgets ({budgets}) must be among the runner's ({self.budgets})")
        start = time.perf_counter()
        engine = self.engine(spec, len(prompt.prompt_ids) + prompt.max_tokens, budgets)
        try:
            rids = {b: self._rid(f"{spec.attention}-{b}") for b in budgets}
            tokens: dict[str, list[int]] = {}
            for b, rid in rids.items():
                engine.add_request(rid, prompt.prompt_ids, greedy(prompt.max_tokens),
                                   RequestOptions(budget_tokens=b))
                tokens[rid] = list(engine.fill_prefilled(rid, prefilled).token_ids)
            carriers = prompt.carrier_pages(self.page_size)
            probe = FirstStepProbe(engine, {rid: carriers for rid in rids.values()})
            engine.attention.observer = probe
            try:
                for out in engine.step():
                    tokens[out.request_id].extend(out.token_ids)
            finally:
                engine.attention.observer = None
            drain(engine, tokens)
            selector_bytes = engine.selector.bytes()
        finally:
            engine.close()
        seconds = time.perf_counter() - start
        return [self._record(spec, prompt, b, tokens[rid], reference, probe.rows[rid], selector_bytes,
                             seconds) for b, rid in rids.items()]

    def _record(self, spec, prompt, budget, tokens, reference, probe, selector_bytes, seconds) -> dict:
        stop = self.tokenizer.stop_ids
        text = self.tokenizer.decode(cut_at_stop(tokens, stop))
        same = agreement(cut_at_stop(tokens, stop), cut_at_stop(reference, stop))
        return {**prompt_fields(prompt), "selector": spec.label, "attention": spec.attention,
                "tier": spec.tier, "budget_tokens": budget, "score": answer_score(prompt, text),
                "completion": text, "tokens": tokens, "agreement": same,
                "summary_bytes": selector_bytes, **probe.result(), "seconds": seconds}


def prompt_fields(prompt: NeedlePrompt) -> dict[str, Any]:
    return {"task": prompt.task, "context": prompt.context, "prompt_tokens": len(prompt.prompt_ids),
            "depth": prompt.depth, "seed": prompt.seed, "answers": list(prompt.answers)}
