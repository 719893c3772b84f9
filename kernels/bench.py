"""Benchmark of the LOCKS kernels (Triton, and the CUDA score kernel) against the HBM copy ceiling.

    python -m lockserve.kernels.bench --out docs/results/kernels_h200.json
    python -m lockserve.kernels.bench --dry-run            # print the plan and byte counts only
    TRITON_INTERPRET=1 python -m lockserve.kernels.bench --tiny --device cpu --out /tmp/k.json

Llama-3.1-8B shapes (Hkv 8, G 4, d 128, B 16, r 8, int4 basis) at 128K, 512K and 1M tokens per
sequence, one layer. Sections, each recorded even when another fails:
  copy       device-to-device copy of 2 GiB: the ceiling (bytes read + written per second)
  sweep      a few launch configurations of each kernel at the largest size; the best is used
  score      score kernel, and score + share-average, from quantised summaries; achieved GB/s of
             the Triton kernel (score, score_and_group) and of the tensor-core CUDA kernel
             (score_cuda, score_and_group_cuda) where it reads the format (GPU only)
  attention  sparse decode over a 2,048-token budget (batch 1 and 64) and dense attention over
             the whole context (same kernel selecting every page, and torch SDPA) for comparison
  build      summary build rate (chunked eigh reference path), pages/s
  check      max abs error against the torch reference at every size
Times are triton.testing.do_bench medians (it flushes L2 before every timed call), except the
score section's, which replay a CUDA graph of the call (do_bench_cudagraph: device time, no L2
flush; the CUDA score rows also carry ms_with_launch, the do_bench time of the plain call). On CPU
(the interpreter, --tiny) they are the wall clock of one call and mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import triton
import triton.testing

from lockserve.provenance import command_line, run_provenance

from .attention import sparse_decode_ref
from .cuda import score_and_group_cuda, score_pages_cuda, score_unsupported
from .score import group_scores, score_quantized_torch
from .summary import LocksConfig, QuantSummaries, build_summaries, quantize_summaries
from .timing import median_ms
from .triton import (
    AttentionTuning,
    ScoreTuning,
    score_and_group_triton,
    score_pages_triton,
    sparse_decode_triton,
)

SECTIONS = ("copy", "score", "attention", "dense", "build")
TARGET_SCORE = 0.70  # of the copy ceiling
TARGET_ATTENTION = 0.60
# block_d is unused since the score kernel loads whole basis rows; 64 pages x 4 warps is the default.
SCORE_SWEEP = [ScoreTuning(64, 64, 4), ScoreTuning(32, 64, 4), ScoreTuning(128, 64, 4),
               ScoreTuning(64, 64, 8), ScoreTuning(16, 64, 4)]
ATTENTION_SWEEP = [AttentionTuning(4, None, None, 4, 3), AttentionTuning(8, None, None, 4, 3),
                   AttentionTuning(4, None, None, 8, 3), AttentionTuning(2, None, None, 4, 4),
                   AttentionTuning(8, None, None, 8, 2)]


@dataclass
class Plan:
    """What to measure. contexts: tokens per sequence; batches per kernel."""

    contexts: list[int]
    score_batches: list[int]
    attention_batches: list[int]
    budget_tokens: int = 2048
    hkv: int = 8
    g: int = 4
    d: int = 128
    page: int = 16
    rank: int = 8
    basis_bits: int = 4
    copy_bytes: int = 2 << 30
    dense_max_bytes: int = 40 << 30  # skip dense attention whose KV is larger than this
    sweep: bool = True
    check_pages: int = 4096  # pages per row compared with the reference
    sections: tuple[str, ...] = SECTIONS


@dataclass
class Results:
    command: list[str]
    commit: str | None
    device: str
    torch: str
    triton: str
    date: str
    plan: dict
    copy: dict = field(default_factory=dict)
    sweep: dict = field(default_factory=dict)
    score: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    dense: list = field(default_factory=list)
    build: dict = field(default_factory=dict)
    check: list = field(default_factory=list)
    targets: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)


def make_plan(args) -> Plan:
    sections = tuple(args.only.split(",")) if args.only else SECTIONS
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"--only: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.tiny:
        return Plan(contexts=[256, 512], score_batches=[1, 2], attention_batches=[1, 2], budget_tokens=64,
                    hkv=2, g=4, d=64, copy_bytes=1 << 20, sweep=args.sweep, check_pages=64, sections=sections)
    return Plan(contexts=[128 << 10, 512 << 10, 1 << 20], score_batches=[1, 8], attention_batches=[1, 64],
                sweep=args.sweep, sections=sections)


# ----------------------------------------------------------------------------- timing, bytes


def rate(nbytes: int, ms: float, ceiling_gbps: float | None) -> dict:
    gbps = nbytes / (ms * 1e-3) / 1e9
    ratio = gbps / ceiling_gbps if ceiling_gbps else None
    return {"bytes": nbytes, "ms": ms, "GBps": gbps, "ratio_to_copy": ratio}


@contextmanager
def section(results: Results, name: str):
    """Record a failing section in results.errors and carry on with the next one."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - a benchmark section must not stop the others
        results.errors.append({"section": name, "error": repr(err), "traceback": traceback.format_exc()})
        print(f"[{name}] FAILED: {err!r}", file=sys.stderr)
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def measure_copy(plan: Plan, device: torch.device) -> dict:
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device)
    return rate(2 * plan.copy_bytes, ms, None) | {"what": "device-to-device copy, bytes read + written"}


# ----------------------------------------------------------------------------- inputs


def random_summaries(n_ids: int, plan: Plan, device: torch.device, gen: torch.Generator) -> QuantSummaries:
    """A quantised table [n_ids, Hkv] of random codes with plausible scales (scoring cost does not
    depend on the values; the reference check uses the same table)."""
    h, d, b, r = plan.hkv, plan.d, plan.page, plan.rank

    def codes(*shape, dtype=torch.int8, lo=-128, hi=128):
        return torch.randint(lo, hi, shape, generator=gen, device=device, dtype=dtype)

    def scales(*shape, size):
        return (torch.rand(shape, generator=gen, device=device) * size + size / 4).half()

    return QuantSummaries(
        basis_q=codes(n_ids, h, r, d * plan.basis_bits // 8, dtype=torch.uint8, lo=0, hi=256),
        basis_scale=scales(n_ids, h, r, size=0.05),
        coef_q=codes(n_ids, h, b, r),
        coef_scale=scales(n_ids, h, b, size=0.1),
        mu_q=codes(n_ids, h, d),
        mu_scale=scales(n_ids, h, size=0.02),
        basis_bits=plan.basis_bits,
    )


def score_inputs(plan: Plan, tokens: int, batch: int, device: torch.device, seed: int):
    """q [Bt, Hq, d] bf16, summaries for Bt sequences of `tokens` tokens, page_table [Bt, P]
    (sequence b owns ids b*P .. b*P+P-1, in order, as pages are allocated while it grows)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    p = tokens // plan.page
    qs = random_summaries(batch * p, plan, device, gen)
    q = torch.randn(batch, plan.hkv * plan.g, plan.d, generator=gen, device=device).bfloat16()
    table = torch.arange(batch * p, device=device, dtype=torch.int32).view(batch, p)
    num_pages = torch.full((batch,), p, device=device, dtype=torch.int32)
    return q, qs, table, num_pages


def score_bytes(q, qs: QuantSummaries, table, grouped: bool) -> int:
    bt, p = table.shape
    hkv, g = qs.mu_scale.shape[1], q.shape[1] // qs.mu_scale.shape[1]
    read = bt * p * (hkv * qs.bytes_per_page() + table.element_size()) + q.numel() * q.element_size()
    out = bt * hkv * g * p * 4  # s_hat written
    if grouped:
        out += bt * hkv * g * p * 4 + bt * hkv * p * 4  # s_hat read again, m_bar written
    return read + out


def make_pool(num_slots: int, plan: Plan, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """pool [S, 2, B, d] bf16, filled in chunks (one randn over > 2^31 elements is avoided)."""
    pool = torch.empty(num_slots, 2, plan.page, plan.d, dtype=torch.bfloat16, device=device)
    step = 1 << 16
    for start in range(0, num_slots, step):
        chunk = pool[start : start + step]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device))
    return pool


def selection(plan: Plan, batch: int, k: int, num_slots: int, device: torch.device, gen: torch.Generator):
    """slots [Bt, Hkv, K] random distinct slots per row, page_lens all full."""
    keys = torch.rand(batch * plan.hkv, num_slots, generator=gen, device=device)
    slots = keys.topk(k, dim=-1).indices.view(batch, plan.hkv, k).to(torch.int32)
    lens = torch.full_like(slots, plan.page)
    return slots, lens


# ----------------------------------------------------------------------------- sections


def sweep_score(plan: Plan, device: torch.device, ceiling: float | None) -> tuple[ScoreTuning, list]:
    """Time each score configuration at the largest context, batch 1; return the fastest."""
    q, qs, table, num_pages = score_inputs(plan, plan.contexts[-1], 1, device, seed=1)
    nbytes = score_bytes(q, qs, table, grouped=False)
    rows = []
    for tuning in SCORE_SWEEP if plan.sweep else SCORE_SWEEP[:1]:
        ms = median_ms(lambda t=tuning: score_pages_triton(q, qs, table, num_pages, t), device)
        rows.append(asdict(tuning) | rate(nbytes, ms, ceiling))
    best = min(range(len(rows)), key=lambda i: rows[i]["ms"])
    return (SCORE_SWEEP[best], rows)


def sweep_attention(plan: Plan, device, ceiling: float | None, pool) -> tuple[AttentionTuning, list]:
    """Time each attention configuration at the largest batch and the shipped budget."""
    gen = torch.Generator(device=device).manual_seed(2)
    k = plan.budget_tokens // plan.page
    batch = plan.attention_batches[-1]
    slots, lens = selection(plan, batch, k, pool.shape[0], device, gen)
    q = torch.randn(batch, plan.hkv * plan.g, plan.d, generator=gen, device=device).bfloat16()
    nbytes = attention_bytes(q, pool, slots)
    rows = []
    for tuning in ATTENTION_SWEEP if plan.sweep else ATTENTION_SWEEP[:1]:
        ms = median_ms(lambda t=tuning: sparse_decode_triton(q, pool, slots, lens, tuning=t), device)
        rows.append(asdict(tuning) | rate(nbytes, ms, ceiling))
    best = min(range(len(rows)), key=lambda i: rows[i]["ms"])
    return (ATTENTION_SWEEP[best], rows)


def bench_score(plan: Plan, device, ceiling, tuning: ScoreTuning, results: Results) -> None:
    """Score and score + share-average at every context and batch; check against the reference."""
    for tokens in plan.contexts:
        for batch in plan.score_batches:
            row, check = score_row(plan, tokens, batch, device, ceiling, tuning)
            results.score.append(row)
            results.check.append(check)


def score_row(plan: Plan, tokens: int, batch: int, device, ceiling, tuning: ScoreTuning) -> tuple[dict, dict]:
    q, qs, table, num_pages = score_inputs(plan, tokens, batch, device, seed=tokens + batch)
    row = {"tokens": tokens, "batch": batch, "pages_per_head": table.shape[1],
           "summary_bytes_per_page_head": qs.bytes_per_page()}
    ms = median_ms(lambda: score_pages_triton(q, qs, table, num_pages, tuning), device, graph=True)
    row["score"] = rate(score_bytes(q, qs, table, False), ms, ceiling)
    ms = median_ms(lambda: score_and_group_triton(q, qs, table, num_pages, tuning), device, graph=True)
    row["score_and_group"] = rate(score_bytes(q, qs, table, True), ms, ceiling)
    check = check_score(plan, q, qs, table, num_pages, tuning) | {"tokens": tokens, "batch": batch}
    if score_unsupported(q, qs, table, num_pages) is None:
        ms = median_ms(lambda: score_pages_cuda(q, qs, table, num_pages), device, graph=True)
        row["score_cuda"] = rate(score_bytes(q, qs, table, False), ms, ceiling)
        # the same call timed with its host side (NVRTC kernel launched through ctypes)
        call = lambda: score_pages_cuda(q, qs, table, num_pages)  # noqa: E731
        row["score_cuda"]["ms_with_launch"] = median_ms(call, device)
        ms = median_ms(lambda: score_and_group_cuda(q, qs, table, num_pages), device, graph=True)
        row["score_and_group_cuda"] = rate(score_bytes(q, qs, table, True), ms, ceiling)
        cuda = check_score(plan, q, qs, table, num_pages, tuning, score_and_group_cuda)
        check["cuda"] = cuda
    return row, check


def check_score(plan: Plan, q, qs, table, num_pages, tuning, kernel=None) -> dict:
    """Max abs errors: s_hat (first sequence, first check_pages pages) vs the torch reference,
    m_bar vs the reference share-average of the kernel's own s_hat. kernel: the CUDA
    score_and_group, else the Triton one with `tuning`."""
    if kernel is None:
        s_hat, m_bar = score_and_group_triton(q, qs, table, num_pages, tuning)
    else:
        s_hat, m_bar = kernel(q, qs, table, num_pages)
    n = min(plan.check_pages, table.shape[1])
    sub_pages = torch.full_like(num_pages[:1], n)
    ref = score_quantized_torch(q[:1], qs, table[:1, :n], sub_pages)
    return {"kernel": "score", "s_hat_max_abs_err": (s_hat[:1, ..., :n] - ref).abs().max().item(),
            "s_hat_max_abs": ref.abs().max().item(),
            "m_bar_max_abs_err": (m_bar - group_scores(s_hat, "share_average")).abs().max().item()}


def attention_bytes(q, pool, slots) -> int:
    page_bytes = pool[0].numel() * pool.element_size()
    out = q.shape[0] * q.shape[1] * (q.shape[2] + 1) * 4
    return int((slots >= 0).sum().item()) * page_bytes + q.numel() * q.element_size() + out


def bench_attention(plan: Plan, device, ceiling, tuning: AttentionTuning, pool, results: Results) -> None:
    """Sparse attention at the budget for every batch (the context only sets how far apart the
    selected slots lie in the pool); check a few sequences against the reference."""
    gen = torch.Generator(device=device).manual_seed(3)
    for batch in plan.attention_batches:
        row, check = attention_row(plan, batch, device, ceiling, tuning, pool, gen)
        results.attention.append(row)
        results.check.append(check)


def attention_row(plan: Plan, batch: int, device, ceiling, tuning, pool, gen) -> tuple[dict, dict]:
    slots, lens = selection(plan, batch, plan.budget_tokens // plan.page, pool.shape[0], device, gen)
    q = torch.randn(batch, plan.hkv * plan.g, plan.d, generator=gen, device=device).bfloat16()
    ms = median_ms(lambda: sparse_decode_triton(q, pool, slots, lens, tuning=tuning), device)
    row = {"budget_tokens": plan.budget_tokens, "batch": batch, "pool_slots": pool.shape[0]}
    row |= rate(attention_bytes(q, pool, slots), ms, ceiling)
    o, lse = sparse_decode_triton(q, pool, slots, lens, tuning=tuning)
    few = slice(0, min(batch, 4))
    ro, rl = sparse_decode_ref(q[few], pool, slots[few], lens[few])
    check = {"kernel": "attention", "batch": batch, "o_max_abs_err": (o[few] - ro).abs().max().item(),
             "lse_max_abs_err": (lse[few] - rl).abs().max().item()}
    return row, check


def bench_dense(plan: Plan, device, ceiling, tuning: AttentionTuning, pool, results: Results) -> None:
    """Attention over every page of the context, batch 1: the same kernel selecting all pages
    (slots of head h are contiguous) and torch SDPA on [1, H, T, d] bf16."""
    for tokens in plan.contexts:
        p = tokens // plan.page
        if p * plan.hkv <= pool.shape[0] and 2 * tokens * plan.hkv * plan.d * 2 <= plan.dense_max_bytes:
            results.dense.append(dense_row(plan, tokens, device, ceiling, tuning, pool))


def dense_row(plan: Plan, tokens: int, device, ceiling, tuning, pool) -> dict:
    p = tokens // plan.page
    slots = torch.arange(p * plan.hkv, device=device, dtype=torch.int32).view(1, plan.hkv, p)
    lens = torch.full_like(slots, plan.page)
    q = torch.randn(1, plan.hkv * plan.g, plan.d, device=device).bfloat16()
    ms = median_ms(lambda: sparse_decode_triton(q, pool, slots, lens, tuning=tuning), device)
    row = {"tokens": tokens, "batch": 1}
    row["triton_all_pages"] = rate(attention_bytes(q, pool, slots), ms, ceiling)
    try:
        row["sdpa"] = dense_sdpa(plan, q, pool, p, ceiling, device)
    except Exception as err:  # noqa: BLE001 - SDPA support varies by build; record and go on
        row["sdpa"] = {"error": repr(err)}
    return row


def dense_sdpa(plan: Plan, q, pool, p: int, ceiling, device) -> dict:
    """torch SDPA over the same keys and values laid out [1, Hkv, T, d] (GQA by enable_gqa)."""
    kv = pool[: p * plan.hkv].view(plan.hkv, p, 2, plan.page, plan.d)
    keys = kv[:, :, 0].reshape(1, plan.hkv, p * plan.page, plan.d).contiguous()
    vals = kv[:, :, 1].reshape(1, plan.hkv, p * plan.page, plan.d).contiguous()
    q4 = q[:, :, None, :]  # [1, Hq, 1, d]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ms = median_ms(lambda: sdpa(q4, keys, vals, enable_gqa=True), device)
    return rate(2 * keys.numel() * keys.element_size(), ms, ceiling)


def bench_build(plan: Plan, device) -> dict:
    """Reference build (chunked eigh) + quantisation rate on one layer at the largest context."""
    n = plan.contexts[-1] // plan.page * plan.hkv
    keys = torch.randn(n, plan.page, plan.d, device=device).bfloat16()
    cfg = LocksConfig(page_size=plan.page, rank=plan.rank, basis_bits=plan.basis_bits)
    build_summaries(keys[: min(n, 4096)], plan.rank)  # warm-up (cuSOLVER handles, allocator)
    sync(device)
    start = time.perf_counter()
    s = build_summaries(keys, plan.rank)
    sync(device)
    built = time.perf_counter() - start
    quantize_summaries(s, cfg)
    sync(device)
    total = time.perf_counter() - start
    return {"pages": n, "build_s": built, "build_pages_per_s": n / built,
            "build_and_quantize_pages_per_s": n / total, "path": "torch reference (chunked eigh)"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- report


def evaluate_targets(results: Results) -> dict:
    """Score: every row at the largest context must reach TARGET_SCORE of the copy ceiling, with
    the faster of the Triton and CUDA kernels (the dispatch runs CUDA where it can).
    Attention: every row with batch >= 16 (batch 1 moves a few MB: launch-bound by design)."""
    largest = max((r["tokens"] for r in results.score), default=None)
    score = [best_score_ratio(r) for r in results.score if r["tokens"] == largest]
    attention = [r["ratio_to_copy"] for r in results.attention if r["batch"] >= 16]

    def verdict(ratios, target):
        if not ratios or any(x is None for x in ratios):
            return {"target": target, "pass": None, "ratios": ratios}
        return {"target": target, "pass": min(ratios) >= target, "ratios": ratios}

    return {"score_kernel": verdict(score, TARGET_SCORE),
            "attention_kernel": verdict(attention, TARGET_ATTENTION)}


def best_score_ratio(row: dict) -> float | None:
    ratios = [row[k]["ratio_to_copy"] for k in ("score", "score_cuda") if k in row]
    return None if not ratios or any(x is None for x in ratios) else max(ratios)


def print_table(results: Results) -> None:
    print(f"\n{results.device} | copy ceiling {results.copy.get('GBps', float('nan')):.0f} GB/s")
    print(f"{'kernel':<22}{'tokens':>9}{'batch':>7}{'ms':>10}{'GB/s':>9}{'of copy':>9}")
    rows = []
    for r in results.score:
        rows.append(("score", r["tokens"], r["batch"], r["score"]))
        rows.append(("score+share_average", r["tokens"], r["batch"], r["score_and_group"]))
        if "score_cuda" in r:
            rows.append(("score (cuda)", r["tokens"], r["batch"], r["score_cuda"]))
            rows.append(("score+share_avg (cuda)", r["tokens"], r["batch"], r["score_and_group_cuda"]))
    rows += [("sparse attention", r["budget_tokens"], r["batch"], r) for r in results.attention]
    for r in results.dense:
        rows.append(("dense (triton)", r["tokens"], 1, r["triton_all_pages"]))
        if "ms" in r["sdpa"]:
            rows.append(("dense (sdpa)", r["tokens"], 1, r["sdpa"]))
    for name, tokens, batch, m in rows:
        ratio = m["ratio_to_copy"]
        print(f"{name:<22}{tokens:>9}{batch:>7}{m['ms']:>10.4f}{m['GBps']:>9.0f}"
              f"{'' if ratio is None else f'{ratio:>8.0%}':>9}")
    if results.build:
        print(f"summary build: {results.build['build_pages_per_s'] / 1e6:.2f} M pages/s (reference path)")
    for name, v in results.targets.items():
        print(f"target {name}: >= {v['target']:.0%} -> {v['pass']}")
    for e in results.errors:
        print(f"section {e['section']} failed: {e['error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m lockserve.kernels.bench",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    ap.add_argument("--device", default=None, help="torch device (default: current CUDA device, else cpu)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, a smoke test (CPU: TRITON_INTERPRET=1)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and byte counts, run nothing")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="use the default launch configs")
    ap.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(SECTIONS)}")
    return ap.parse_args(argv)


def pick_device(name: str | None) -> torch.device:
    if name is not None:
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device(torch.cuda.current_device())
    return torch.device("cpu")


def dry_run(plan: Plan) -> None:
    print(json.dumps(asdict(plan), indent=1))
    summary_bytes = QuantSummaries.bytes_per_page(random_summaries(1, plan, torch.device("cpu"),
                                                                   torch.Generator().manual_seed(0)))
    for tokens in plan.contexts:
        p = tokens // plan.page
        print(f"{tokens:>8} tokens: {p} pages/head, summaries {p * plan.hkv * summary_bytes / 2**20:.1f} MiB "
              f"per sequence per layer ({summary_bytes} B per page-head)")
    k = plan.budget_tokens // plan.page
    for batch in plan.attention_batches:
        mib = batch * plan.hkv * k * 2 * plan.page * plan.d * 2 / 2**20
        print(f"attention batch {batch}: {k} pages per head, {mib:.1f} MiB of selected KV per step")


def run(plan: Plan, device: torch.device, results: Results) -> None:
    ceiling, todo = None, plan.sections
    with section(results, "copy"):
        results.copy = measure_copy(plan, device)
        ceiling = results.copy["GBps"]
    score_tuning, attention_tuning = ScoreTuning(), AttentionTuning()
    if "score" in todo:
        with section(results, "sweep_score"):
            score_tuning, results.sweep["score"] = sweep_score(plan, device, ceiling)
        with section(results, "score"):
            bench_score(plan, device, ceiling, score_tuning, results)
    if "attention" in todo or "dense" in todo:
        attention_tuning = run_attention(plan, device, ceiling, results)
    if "build" in todo:
        with section(results, "build"):
            results.build = bench_build(plan, device)
    results.sweep["chosen"] = {"score": asdict(score_tuning), "attention": asdict(attention_tuning)}
    results.targets = evaluate_targets(results)


def run_attention(plan: Plan, device, ceiling, results: Results) -> AttentionTuning:
    """The pool holds one layer of the largest context (4 GiB at 1M tokens: > 2^31 elements)."""
    tuning, pool = AttentionTuning(), None
    with section(results, "pool"):
        gen = torch.Generator(device=device).manual_seed(4)
        pool = make_pool(plan.contexts[-1] // plan.page * plan.hkv, plan, device, gen)
    if pool is None:
        return tuning
    if "attention" in plan.sections:
        with section(results, "sweep_attention"):
            tuning, results.sweep["attention"] = sweep_attention(plan, device, ceiling, pool)
        with section(results, "attention"):
            bench_attention(plan, device, ceiling, tuning, pool, results)
    if "dense" in plan.sections:
        with section(results, "dense"):
            bench_dense(plan, device, ceiling, tuning, pool, results)
    return tuning


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        dry_run(plan)
        return 0
    device = pick_device(args.device)
    info = run_provenance(command_line("-m lockserve.kernels.bench", argv), device)
    if device.type == "cpu":
        info["device"] = "cpu (Triton interpreter)"  # Triton runs on the CPU only interpreted
    results = Results(**info, triton=triton.__version__, plan=asdict(plan))
    started = time.perf_counter()
    run(plan, device, results)
    results.plan["wall_s"] = time.perf_counter() - started
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(asdict(results), indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
