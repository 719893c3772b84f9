"""Decode benchmark: TPOT, launches, bytes and the roofline of the decode step, mode by mode.

    python -m lockserve.cluster.measure.decode.bench --model llama-3.1-8b --context 131072 --fill synthetic \
        --modes dense:hbm locks:hbm locks:host --steps 128 --out docs/results/decode_llama8b_128k.json

A mode is "attention:tier" (dense|locks : hbm|host|host+nvme), or "locks:host-nocache" (every
selected page crosses PCIe each step: the floor the hot-page cache lifts). Each mode fills the
same requests - a real prompt prefilled by the engine (`--fill prompt`: the passkey prompt over
Paul Graham's essays, real page reuse) or random K/V written straight into the cache with
summaries built by the real code (`--fill synthetic`: honest bytes and times, unrealistic page
reuse) - decodes `--warmup` steps (graph captures happen there), then times `--steps` greedy
steps. Per mode: TPOT median / p90, tokens/s, the hot-cache hit rate and PCIe bytes per step
(the engine's counters), HBM bytes per step (weights + summaries + attended pages: a count, not
a measurement), the roofline (HBM bytes / the read bandwidth of a read-only kernel + PCIe bytes
/ the UVA gather bandwidth, both measured in the same run) and TPOT / roofline, and a profile of
one step: kernels on the device, launch calls on the host (runtime and driver API), calls that
block the host, device time by kernel and by part of the step, and the idle gaps between the
step's kernels (by the kernel that waited); with graphs, the device span of a replay
(`graph_span_ms`: TPOT minus it is the step outside the graph) and where the step's wall time goes
on the host around the replay (`host_ms`). `--repeat N` runs the modes N
times in turn and pools each mode's steps: ratios between modes that hold against the machine's
drift (a small model's TPOT moved 15% between runs minutes apart).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from lockserve.cluster.measure.eval.passkey import build_passkey_prompt, passkey_found
from lockserve.configs.schema import (
    ATTENTION_MODES,
    RADIX_BITS,
    SUMMARY_EIGH,
    TIERS,
    CacheConfig,
    SchedulerConfig,
)
from lockserve.kernels.timing import median_ms
from lockserve.offload.cache import COMMITS
from lockserve.workers.api import load
from lockserve.workers.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import extend_positions

from lockserve.provenance import command_line, run_provenance

MODES = ("dense:hbm", "locks:hbm", "locks:host", "locks:host-nocache", "locks:host+nvme", "dense:host")
MODE_TIERS = (*TIERS, "host-nocache")
DEFAULT_REFERENCE = "locks:hbm"  # the mode whose tokens the others are compared with, where it runs
NO_REFERENCE = "none"
# Calls that make the host wait for the device.
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
SPAN_STEPS = 5  # steps after the traced one whose graph replays are timed on the device (graph_span_ms)
# Device time by part of the step, from kernel names (first match wins; "other" = the rest).
PARTS = (("attention", ("sparse_decode", "merge_splits", "flash", "attention")),
         ("scoring", ("locks_score", "score_pages", "share_average", "row_partials")),
         ("selection", ("selection_keys", "decode_slots", "topk", "radix", "sort", "gatherTopK")),
         ("transfer", ("gather_pages", "cache_", "scatter", "index", "cumsum", "masked")),
         ("weights", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitK")),
         ("norm_rope_act", ("rms_norm", "rope_write", "silu_mul", "add_rms")))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure.decode.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="default (SmolLM2), a preset, a .gguf or HF folder")
    p.add_argument("--context", type=int, default=131072, help="tokens of context per request")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--steps", type=int, default=128, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=8, help="decode steps before timing (graph captures)")
    p.add_argument("--budget-tokens", type=int, default=2048, help="LOCKS budget per KV head")
    p.add_argument("--modes", nargs="+", default=["dense:hbm", "locks:hbm", "locks:host"])
    p.add_argument("--reference", default=None,
                   help="mode whose tokens the others are compared to; its own row carries no comparison "
                        f"(default: {DEFAULT_REFERENCE} where it runs beside another mode; "
                        f"'{NO_REFERENCE}': compare nothing)")
    p.add_argument("--fill", choices=("auto", "prompt", "synthetic"), default="auto",
                   help="auto: synthetic for random-weight presets, the passkey prompt otherwise")
    p.add_argument("--hot-cache-pages", type=int, default=None,
                   help="default: 2x what one step selects over all layers (the working set)")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--prefill-window", type=int, default=131072,
                   help="host tiers: tokens of a prefilling request kept on the GPU "
                        "(cache.prefill_window_tokens)")
    p.add_argument("--prefix-reuse", action="store_true", help="reuse cached prompt pages (default: cold)")
    p.add_argument("--prefill-chunk-decoding", type=int, default=None,
                   help="prompt tokens a step while other requests decode (default: no cap)")
    p.add_argument("--prefill-attention-decoding", type=int, default=None,
                   help="prefill attention work a step while other requests decode, query x key tokens "
                        "(default: no cap)")
    p.add_argument("--depth", type=float, default=0.5, help="passkey depth in the haystack")
    p.add_argument("--graphs", choices=("on", "off"), default="on",
                   help="replay decode steps from CUDA graphs")
    p.add_argument("--nvme-dir", default="/tmp/lockserve-bench-nvme")
    p.add_argument("--host-gib", type=float, default=None,
                   help="host arena of host+nvme (default: half the KV)")
    p.add_argument("--nvme-lookahead", type=int, default=2,
                   help="host+nvme: promote what a selection at this multiple of the budget takes, "
                        "ahead of the next step (0: off; default 2, the config's default)")
    p.add_argument("--nvme-io-threads", type=int, default=4,
                   help="host+nvme: threads for NVMe page reads and writes (default 4, the config's default)")
    p.add_argument("--cache-commit", choices=COMMITS, default=None,
                   help="where the hot cache's commit runs (cache.hot_cache_commit; default: the "
                        "config's, 'inline')")
    p.add_argument("--radix-bits", type=int, choices=RADIX_BITS, default=CacheConfig().select_radix_bits,
                   help="bits a pass of the selection's threshold search fixes: 1 bisects, 2 fixes two "
                        "(cache.select_radix_bits; default: the config's, 1)")
    p.add_argument("--summary-eigh", choices=SUMMARY_EIGH, default=CacheConfig().summary_eigh,
                   help="the summary build's eigensolver on CUDA: torch (torch.linalg.eigh, waits for the "
                        "device), jacobi (a Triton kernel, no host wait) or auto (jacobi for a decode "
                        "step's few pages, torch for larger builds) (cache.summary_eigh; default: the "
                        "config's, auto)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the modes this many times in turn (A B C A B C ...); a mode's TPOT pools "
                        "its runs' steps, so ratios between modes hold against drift (repeat_tpot_ms: "
                        "each run's median)")
    p.add_argument("--isolate", choices=("auto", "on", "off"), default="auto",
                   help="run each mode (and each repeat) in a fresh process: on the H200 a mode run after "
                        "another in one process ran 0.1-0.3 ms a step slower on SmolLM2 (what the first "
                        "left behind: CUPTI after its profile, and graphs captured later replay slower; "
                        "docs/notes/decode_step.md); auto: on where the device is CUDA and there is more "
                        "than one run")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    for mode in args.modes:
        if not valid_mode(mode):
            p.error(f"mode {mode!r} must be attention:tier, attention one of {', '.join(ATTENTION_MODES)} "
                    f"and tier one of {', '.join(MODE_TIERS)} (e.g. {', '.join(MODES)})")
    if args.steps < 1 or args.batch < 1 or args.context < 2 or args.repeat < 1:
        p.error("--steps, --batch and --repeat must be >= 1 and --context >= 2")
    try:
        args.reference = resolve_reference(args.modes, args.reference)
    except ValueError as err:
        p.error(str(err))
    return args


def resolve_reference(modes: list[str], reference: str | None) -> str | None:
    """The mode the others' tokens are compared with, or None (no comparison). Named, it must run
    beside another mode: a run whose only mode is its reference would publish a mode compared with
    itself. Not named: DEFAULT_REFERENCE where it runs beside another mode, else None."""
    others = set(modes) - {reference}
    if reference is None:
        return DEFAULT_REFERENCE if DEFAULT_REFERENCE in modes and len(set(modes)) > 1 else None
    if reference == NO_REFERENCE:
        return None
    if reference not in modes:
        raise ValueError(f"--reference ({reference}) must be one of --modes ({' '.join(modes)}), "
                         f"or '{NO_REFERENCE}'")
    if not others:
        other = DEFAULT_REFERENCE if reference != DEFAULT_REFERENCE else "locks:host"
        raise ValueError(f"--modes ({' '.join(modes)}) holds only the --reference mode ({reference}): its "
                         f"tokens would be compared with themselves; add the mode to compare "
                         f"(e.g. --modes {other} {reference}) or pass --reference {NO_REFERENCE}")
    return reference


# ---- engines and requests -------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSpec:
    """One decode measurement: the bench's flags less model, modes and output (see parse_args).
    Each request gets max_tokens = warmup + steps + 8: room for the traced step, the SPAN_STEPS
    after it and one more (a request's last step also releases its pages, not a decode cost)."""

    context: int = 131072
    batch: int = 1
    steps: int = 128
    warmup: int = 8
    budget_tokens: int = 2048
    hot_cache_pages: int | None = None
    prefill_chunk: int = 4096
    graphs: str = "on"
    nvme_dir: str = "/tmp/lockserve-bench-nvme"
    host_gib: float | None = None
    nvme_lookahead: int = 2
    nvme_io_threads: int = 4
    cache_commit: str | None = None
    device: str = "cpu"
    prefill_window: int = 131072  # host tiers: tokens of a prefilling request kept on the GPU
    prefix_reuse: bool = False  # decode benches prefill cold; the prefill bench turns it on
    prefill_chunk_decoding: int | None = None  # prompt tokens a step while others decode (None: no cap)
    prefill_attention_decoding: int | None = None  # prefill attention work a step while others decode
    radix_bits: int = 1  # cache.select_radix_bits
    summary_eigh: str = "auto"  # cache.summary_eigh

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DecodeSpec:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    @property
    def max_tokens(self) -> int:
        return self.warmup + self.steps + 8


@dataclass(frozen=True)
class EngineSizing:
    """How big one mode's engine is. max_pages: page ids of KV capacity; max_num_seqs: sequences
    decoding together; max_model_len: cap on prompt + max_tokens; hot_cache_pages: 0 = no cache;
    host_gib: the host arena (tier host: it must hold max_pages ids; host+nvme: the part above
    NVMe); nvme_gib: NVMe space of host+nvme."""

    max_pages: int
    max_num_seqs: int
    max_model_len: int
    hot_cache_pages: int
    host_gib: float
    nvme_gib: float


def valid_mode(mode: str) -> bool:
    """A mode is attention:tier, the attention any page selector (configs ATTENTION_MODES: the
    evaluation selectors decode eagerly, engine/selectors.py)."""
    attention, _, tier = mode.partition(":")
    return attention in ATTENTION_MODES and tier in MODE_TIERS


def mode_parts(mode: str) -> tuple[str, str, bool]:
    """(attention, tier, hot cache off) of a mode: "locks:host-nocache" is tier host without a cache."""
    attention, _, tier = mode.partition(":")
    nocache = tier == "host-nocache"
    return attention, "host" if nocache else tier, nocache


def bench_sizing(model, mode: str, spec: DecodeSpec) -> EngineSizing:
    """The bench's engine: room for exactly `batch` requests of context + warmup + steps tokens; a
    hot cache of 2x what one step selects over all layers (the working set); host+nvme's host
    arena half the KV (or spec.host_gib)."""
    mc, (_, tier, nocache) = model.config, mode_parts(mode)
    total = spec.context + spec.warmup + spec.steps + 16
    pages = math.ceil(total / 16) + 1
    kv_gib = spec.batch * pages * mc.num_layers * mc.num_kv_heads * 16 * 2 * mc.head_dim * \
        model.dtype.itemsize / 2**30
    selected = spec.batch * mc.num_layers * mc.num_kv_heads * math.ceil(spec.budget_tokens / 16)
    return EngineSizing(
        max_pages=spec.batch * pages, max_num_seqs=spec.batch, max_model_len=total,
        hot_cache_pages=0 if nocache else (spec.hot_cache_pages or 2 * selected),
        host_gib=spec.host_gib or (kv_gib / 2 if tier == "host+nvme" else kv_gib + 0.01),
        nvme_gib=kv_gib + 0.01)


def make_engine(model, tokenizer, mode: str, spec: DecodeSpec, sizing: EngineSizing | None = None,
                nvme_dir: str | None = None) -> Engine:
    """An engine for one mode, sized by `sizing` (default: bench_sizing). nvme_dir: host+nvme's
    spill directory (default spec.nvme_dir; bench_engine gives each engine a fresh one)."""
    sizing = sizing or bench_sizing(model, mode, spec)
    attention, tier, _ = mode_parts(mode)
    cache = CacheConfig(
        attention=attention, tier=tier, budget_tokens=spec.budget_tokens,
        hot_cache_pages=sizing.hot_cache_pages, host_capacity_gib=sizing.host_gib,
        nvme_capacity_gib=sizing.nvme_gib, nvme_lookahead=spec.nvme_lookahead,
        nvme_io_threads=spec.nvme_io_threads, prefill_window_tokens=spec.prefill_window,
        prefix_reuse=spec.prefix_reuse, hot_cache_commit=spec.cache_commit or CacheConfig().hot_cache_commit,
        select_radix_bits=spec.radix_bits, summary_eigh=spec.summary_eigh,
        nvme_dir=(nvme_dir or spec.nvme_dir) if tier == "host+nvme" else None)
    sched = SchedulerConfig(max_num_seqs=sizing.max_num_seqs, prefill_chunk=spec.prefill_chunk,
                            max_num_batched_tokens=max(spec.prefill_chunk, sizing.max_num_seqs),
                            prefill_chunk_decoding=spec.prefill_chunk_decoding,
                            prefill_attention_decoding=spec.prefill_attention_decoding)
    engine = Engine(model, tokenizer, cache, sched, torch.device(spec.device), max_pages=sizing.max_pages,
                    max_model_len=sizing.max_model_len, use_graphs=spec.graphs == "on" and None,
                    show_progress=True)  # bars on long prefills and synthetic fills (minutes at 1M)
    return engine


def hot_cache(engine: Engine):
    """The engine's hot-page cache (offload/cache.py HotPageCache), or None."""
    return getattr(engine.kv.settled, "cache", None)


@contextlib.contextmanager
def bench_engine(model, tokenizer, mode: str, spec: DecodeSpec,
                 sizing: EngineSizing | None = None) -> Iterator[Engine]:
    """make_engine, closed on exit. Host+nvme gets a fresh directory under spec.nvme_dir, removed
    on exit: a run never opens another run's manifest. The previous engine's pools and graphs are
    freed first (the caller must hold no reference to it)."""
    free_device_memory()
    nvme = None
    if mode_parts(mode)[1] == "host+nvme":
        os.makedirs(spec.nvme_dir, exist_ok=True)
        nvme = tempfile.mkdtemp(prefix="run-", dir=spec.nvme_dir)
    try:
        engine = make_engine(model, tokenizer, mode, spec, sizing, nvme)
        try:
            yield engine
        finally:
            engine.close()
    finally:
        if nvme is not None:
            shutil.rmtree(nvme, ignore_errors=True)


def free_device_memory() -> None:
    """Collect dropped engines and hand their cached blocks back (CUDA; a no-op without it)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def start_requests(engine: Engine, prompts: list[list[int]], spec: DecodeSpec,
                   synthetic: bool) -> list[list[int]]:
    """Queue every request, fill its context (prefill or synthetic) and return each one's tokens
    so far (the first sampled token)."""
    # Room past the traced step: a request's last step also releases its pages (not a decode cost).
    params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params)
        if synthetic:
            tokens[i].append(engine.fill_synthetic(f"r{i}", seed=i))
    while any(not t for t in tokens):  # prefill chunks; each request's last one samples
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.token_ids
    return tokens


def decode_steps(engine: Engine, tokens: list[list[int]], n: int, sync: bool = True,
                 after_step: Callable[[], None] | None = None, marks: list | None = None) -> list[float]:
    """n steps; returns each step's wall time in ms (a step ends with the sampled-token readback;
    sync also waits for the write-backs of filled pages, which run on a side stream).
    after_step runs after each step's time is taken (outside it); marks, if a list, gets each
    step's (start, end) perf_counter."""
    wait = torch.cuda.synchronize if sync and engine.device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        for out in engine.step():
            tokens[int(out.request_id[1:])] += out.token_ids
        wait()
        end = time.perf_counter()
        times.append((end - t) * 1e3)
        if marks is not None:
            marks.append((t, end))
        if after_step is not None:
            after_step()
    return times


class HitRateRecorder:
    """after_step callback: each step's hot-cache hit rate (`rates()`, None for a step that
    looked nothing up). After each step the cache's (hits, misses) are copied into a device
    history, with no host wait and no host work between the timed steps (reading the engine's
    stats there made every host step do more than an hbm one); `rates()` reads it once."""

    def __init__(self, cache, steps: int):
        self.cache, self.taken = cache, 1
        self.history = torch.zeros(steps + 1, 2, dtype=torch.int64, device=cache.device)  # [steps + 1, 2]
        cache.copy_hits_misses(self.history[0])

    def __call__(self) -> None:
        if self.taken < self.history.shape[0]:  # steps past the history are not recorded
            self.cache.copy_hits_misses(self.history[self.taken])
            self.taken += 1

    def rates(self) -> list[float | None]:
        counts = self.history[: self.taken].tolist()
        out = []
        for (h0, m0), (h1, m1) in zip(counts, counts[1:], strict=False):  # consecutive pairs
            dh, dm = h1 - h0, m1 - m0
            out.append(dh / (dh + dm) if dh + dm else None)
        return out


# ---- one step's profile ----------------------------------------------------------------------------


def profile_step(engine: Engine, tokens: list[list[int]]) -> dict:
    """One decode step under torch.profiler (profile_call)."""
    # the profiler synchronises once at its end
    return profile_call(lambda: decode_steps(engine, tokens, 1, sync=False), engine.device,
                        engine.model.config.num_layers)


def profile_call(fn: Callable[[], object], device: torch.device, num_layers: int) -> dict:
    """fn() (one decode step) under torch.profiler: device kernels, host launch calls, blocking
    calls, device time by kernel and by part of the step, and the gaps between the kernels."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto leaves CUPTI attached after a trace unless TEARDOWN_CUPTI=1 (pytorch/pytorch#144455):
    # every step after the first profiled one then ran slower, here whole modes (0.3 ms a step on
    # SmolLM2 at 128K, scripts/profiler_aftereffect.py). Teardown works with CUDA graphs since CUDA
    # 12.6; a caller's own setting wins.
    os.environ.setdefault("TEARDOWN_CUPTI", "1")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
    events = list(prof.events())
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    by_kernel: dict[str, list[float]] = {}
    for e in kernels:
        by_kernel.setdefault(e.name, []).append(e.device_time)
    parts = {name: 0.0 for name, _ in PARTS} | {"other": 0.0}
    for name, times in by_kernel.items():
        parts[kernel_part(name)] += sum(times)
    top = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "device_kernels": len(kernels),
        "device_kernels_per_layer": len(kernels) / num_layers,
        "device_time_us": sum(e.device_time for e in kernels),
        "device_time_us_by_part": parts,
        "host_launch_calls": {n: host.count(n) for n in LAUNCHES if n in host},
        "blocking_calls": {n: host.count(n) for n in BLOCKING if n in host},
        "top_kernels": [{"name": n[:120], "count": len(t), "total_us": sum(t)} for n, t in top],
        **kernel_gaps([(e.time_range.start, e.time_range.end, e.name) for e in kernels]),
    }


def kernel_gaps(spans: list[tuple[float, float, str]], top: int = 12) -> dict:
    """Idle device time between consecutive kernels of the traced step (spans: (start, end, name)
    in us, one stream): the total from the first kernel's start to the last's end less the kernels,
    and the gaps summed by the kernel that waited (the next one), largest first. A gap is where
    the device had nothing to run: a launch not yet issued, a dependency, a graph node's latency."""
    spans = sorted(spans)
    by_next: dict[str, list[float]] = {}
    busy_until = spans[0][1] if spans else 0.0
    for start, end, name in spans[1:]:
        if start > busy_until:
            by_next.setdefault(name, []).append(start - busy_until)
        busy_until = max(busy_until, end)
    worst = sorted(by_next.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernel_gaps_us": sum(sum(g) for g in by_next.values()),
        "top_gaps": [{"before": n[:120], "count": len(g), "total_us": sum(g)} for n, g in worst],
    }


def kernel_part(name: str) -> str:
    low = name.lower()
    for part, keys in PARTS:
        if any(k.lower() in low for k in keys):
            return part
    return "other"


# ---- bytes and ceilings ----------------------------------------------------------------------------


def step_bytes(engine: Engine, context: int, batch: int, pcie_bytes: float) -> dict:
    """Bytes one decode step reads from HBM (a count from the shapes) and moves over PCIe."""
    model, kv, cc = engine.model, engine.kv, engine.cache_config
    lay = kv.layout
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if model.lm_head is not None:  # the embedding is read row by row, the LM head whole
        params -= embed.numel() * embed.element_size() - batch * embed[0].numel() * embed.element_size()
    pages = math.ceil(context / lay.page_size)
    attended = pages if cc.attention == "dense" else min(pages, engine.budget_pages)
    per_page = lay.num_layers * lay.num_kv_heads * lay.geometry.slot_bytes
    summaries = 0 if cc.attention == "dense" else batch * (pages - 1) * lay.num_layers * \
        lay.num_kv_heads * kv.summaries.bytes_per_page
    kv_bytes = batch * attended * per_page
    return {"weights": params, "summaries": summaries, "kv": kv_bytes, "hbm": params + summaries + kv_bytes,
            "pcie": pcie_bytes}


def measure_ceilings(device: torch.device) -> dict:
    """Read bandwidth of a read-only kernel (a sum over 4 GiB), the device copy, and the UVA gather
    of random 8 KiB pages from 2 GiB of registered host memory, in GB/s."""
    if device.type != "cuda":
        return {"read_gbps": None, "copy_gbps": None, "gather_gbps": None}
    from lockserve.offload.arena import PageGeometry
    from lockserve.offload.gather import gather_pages
    from lockserve.offload.host import HostArena

    read, copy = _hbm_rates(device)
    geo = PageGeometry(16, 128, torch.bfloat16)
    with HostArena.create(geo, 2**31 // geo.slot_bytes) as arena:
        arena.register_cuda()
        n = 16384
        src = torch.randint(0, arena.num_slots, (n,), device=device)
        dst = torch.empty((n, *geo.page_shape), dtype=geo.dtype, device=device)
        idx = torch.arange(n, device=device)
        ms = median_ms(lambda: gather_pages(arena.uva_pool(), src, dst, idx), device, warmup=50, rep=200)
        gather = n * geo.slot_bytes / ms / 1e6
    return {"read_gbps": read, "copy_gbps": copy, "gather_gbps": gather}


def _hbm_rates(device: torch.device) -> tuple[float, float]:
    """(read, copy) GB/s: a float32-accumulating sum over 4 GiB of bf16, and a 4 GiB copy (read +
    written bytes)."""
    x = torch.randn(2**31, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    read = 4 * 2**30 / median_ms(lambda: x.sum(dtype=torch.float32), device, warmup=50, rep=200) / 1e6
    return read, 8 * 2**30 / median_ms(lambda: y.copy_(x), device, warmup=50, rep=200) / 1e6


# ---- one mode ----------------------------------------------------------------------------------


def run_mode(model, tokenizer, mode: str, prompts, spec: DecodeSpec, synthetic: bool, ceilings: dict) -> dict:
    """One mode's engine: fill the requests' contexts, then measure_decode."""
    with bench_engine(model, tokenizer, mode, spec) as engine:
        t0 = time.perf_counter()
        tokens = start_requests(engine, prompts, spec, synthetic)
        return measure_decode(engine, mode, tokens, time.perf_counter() - t0, spec, ceilings)


def measure_decode(engine: Engine, mode: str, tokens: list[list[int]], fill_s: float, spec: DecodeSpec,
                   ceilings: dict) -> dict:
    """Decode the engine's running requests (their contexts filled, `tokens` their ids so far):
    spec.warmup steps, spec.steps timed ones (each step's hot-cache hit rate recorded where there
    is a hot cache), one profiled; the mode's result (summarise). The context for the bytes is
    spec.context, the batch len(tokens)."""
    decode_steps(engine, tokens, spec.warmup)
    before = engine.stats()
    cc, hot = engine.cache_config, hot_cache(engine)
    cached = cc.tier != "hbm" and cc.attention != "dense" and hot is not None
    recorder = HitRateRecorder(hot, spec.steps) if cached else None
    ms = decode_steps(engine, tokens, spec.steps, after_step=recorder)
    after = engine.stats()
    span = replay_timing(engine, tokens, SPAN_STEPS)  # before the profiler, as the timed steps
    profile = profile_step(engine, tokens) | span
    counters = dict(engine.runner.counters)
    if engine.kv.settle_graphs is not None:  # the summary builds of filled pages (engine/settle.py)
        counters.update(engine.kv.settle_graphs.counters)
    hits, misses = after["cache_hits"] - before["cache_hits"], after["cache_misses"] - before["cache_misses"]
    pcie = (after["bytes_moved"] - before["bytes_moved"]) / spec.steps
    nbytes = step_bytes(engine, spec.context + spec.warmup + spec.steps // 2, len(tokens), pcie)
    result = summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile,
                       len(tokens), spec.steps)
    result["hit_rate_by_step"] = recorder.rates() if recorder is not None else None
    result["nvme"] = nvme_counters(before, after, spec.steps)
    result["cache_commit"] = None if hot is None else hot.commit
    return result


def replay_timing(engine: Engine, tokens: list[list[int]], steps: int) -> dict:
    """Over `steps` steps, medians of: `graph_span_ms`, the device time of one decode graph replay,
    first kernel to last (CUDA events recorded around it): TPOT minus this is the step's time
    outside the graph, this minus the kernels' summed time (profile.device_time_us) the gaps
    between the graph's kernels; and `host_ms`, where the step's wall time goes on the host:
    before_replay (the scheduler, the plan, the staged upload), replay_call (inside graph.replay,
    the graph's launch) and after_replay (the sampler, the readback's wait for the device, the
    bookkeeping after it and the bench's device sync). None for both where no step replayed."""
    rows = replay_steps(engine, tokens, steps)
    if not rows:
        return {"graph_span_ms": None, "host_ms": None}
    names = ("before_replay", "replay_call", "after_replay")
    return {"graph_span_ms": statistics.median(r["span"] for r in rows),
            "host_ms": {n: statistics.median(r[n] for r in rows) for n in names}}


def replay_steps(engine: Engine, tokens: list[list[int]], steps: int) -> list[dict]:
    """`steps` steps with CUDA events around each graph replay; per replayed step (ms): `wall`, its
    host time `before_replay`, `replay_call` and `after_replay`, and the graph's device `span`.
    Empty where no step replayed (no graphs, or every step captured)."""
    runner = engine.runner
    if not runner.use_graphs:
        return []
    runner.replay_events, marks = [], []
    try:
        decode_steps(engine, tokens, steps, marks=marks)
    finally:
        events, runner.replay_events = runner.replay_events, None
    if not events:
        return []
    torch.cuda.synchronize(engine.device)
    # Each replay's step is the one whose wall time holds its call (a step that captured instead
    # has no replay).
    return [{"wall": (t1 - t0) * 1e3, "before_replay": (called - t0) * 1e3,
             "replay_call": (returned - called) * 1e3, "after_replay": (t1 - returned) * 1e3,
             "span": start.elapsed_time(end)}
            for start, end, called, returned in events for t0, t1 in marks if t0 <= called <= t1]


def nvme_counters(before: dict, after: dict, steps: int) -> dict | None:
    """host+nvme: the spill tier's counters over the timed steps, per step (missed_pages: selected
    pages found on NVMe; step_reruns: forwards run again after promoting them; steps_missed: steps
    that reran; sync_steps: steps that fell back to promoting layer by layer; spilled / promoted
    pages), and the pages spilled in all (spilled_pages_total); None on other tiers."""
    keys = [k for k in after if k.startswith("nvme_")]
    if not keys:
        return None
    out = {k.removeprefix("nvme_"): (after[k] - before.get(k, 0)) / steps for k in keys}
    out["spilled_pages_total"] = after["nvme_spilled_pages"]
    return out


def summarise(mode, ms, fill_s, nbytes, ceilings, hits, misses, tokens, counters, profile, batch: int,
              steps: int) -> dict:
    med = statistics.median(ms)
    roof = None
    if ceilings["read_gbps"]:
        roof = nbytes["hbm"] / ceilings["read_gbps"] / 1e6 + nbytes["pcie"] / ceilings["gather_gbps"] / 1e6
    return {
        "mode": mode, "fill_s": fill_s, "tpot_ms_median": med, "tpot_ms_p90": percentile(ms, 0.9),
        # the mean counts the steps a median hides: page settles, a graph's one-time capture
        "tpot_ms_mean": statistics.fmean(ms), "tpot_ms_min": min(ms), "tokens_per_s": batch * 1e3 / med,
        "hit_rate": hits / (hits + misses) if hits + misses else None, "misses_per_step": misses / steps,
        "bytes_per_step": nbytes, "roofline_ms": roof, "tpot_over_roofline": med / roof if roof else None,
        "runner": counters, "profile": profile, "step_ms": ms, "tokens": tokens,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# ---- the run -----------------------------------------------------------------------------------

WORKLOADS = {
    True: "synthetic KV fill (random K/V, real summaries): honest bytes and times, unrealistic page reuse",
    False: "real model decoding a real prompt",
}


def is_synthetic(fill: str, model: str) -> bool:
    """--fill auto: synthetic for random-weight presets, the passkey prompt for real models."""
    return fill == "synthetic" or (fill == "auto" and not _is_real(model))


def load_model(name: str, device: torch.device, positions: int):
    """(model, tokenizer) of a preset, .gguf or HF folder, its positions extended to `positions`
    (a note on stderr when that runs a model past what it was trained on)."""
    model, tokenizer = load(name, device, None, seed=0)
    trained = extend_positions(model, positions)
    if trained is not None:
        print(f"note: running {name} past its {trained} trained positions", file=sys.stderr)
    return model, tokenizer


def make_prompts(model, tokenizer, context: int, batch: int, synthetic: bool,
                 depth: float = 0.5) -> tuple[list[list[int]], str | None]:
    """`batch` prompts of `context` tokens (random ids when synthetic, else the passkey prompt at
    `depth`) and the passkey (None when synthetic)."""
    if synthetic:
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.vocab_size
        ids = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in range(batch)]
        return ids, None
    prompt = build_passkey_prompt(tokenizer, context, depth)
    return [prompt.prompt_ids] * batch, prompt.passkey


def run_info(command: list[str], device: torch.device, model_name: str, model, synthetic: bool) -> dict:
    """What every result file records about its run: its provenance (lockserve.provenance), model,
    dtype and workload."""
    return {**run_provenance(command, device), "model": model_name,
            "dtype": str(model.dtype).removeprefix("torch."), "workload": WORKLOADS[synthetic]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if isolated(args):
        result = isolated_runs(argv, args)
        compare_tokens(result, args.reference)
        return write_result(args.out, result)
    spec = DecodeSpec.from_args(args)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, device, args.context + args.warmup + args.steps + 16)
    synthetic = is_synthetic(args.fill, args.model)
    prompts, passkey = make_prompts(model, tokenizer, args.context, args.batch, synthetic, args.depth)
    ceilings = measure_ceilings(device)
    command = command_line("-m lockserve.cluster.measure.decode.bench", argv)
    result = {**run_info(command, device, args.model, model, synthetic),
              "context": args.context, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
              "budget_tokens": args.budget_tokens, "graphs": args.graphs,
              "radix_bits": spec.radix_bits, "summary_eigh": spec.summary_eigh, "ceilings": ceilings,
              "modes": {}}
    for run in range(args.repeat):
        for mode in args.modes:
            r = run_mode(model, tokenizer, mode, prompts, spec, synthetic, ceilings)
            if passkey is not None:
                r["passkey_found"] = passkey_found(tokenizer.decode(r["tokens"][0]), passkey)
            which = f"  (run {run + 1} of {args.repeat})" if args.repeat > 1 else ""
            print(table_row(r) + which, flush=True)
            add_run(result["modes"], mode, r, args.batch)
    compare_tokens(result, args.reference)
    return write_result(args.out, result | {"isolated": False})


def write_result(out: Path, result: dict) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


def isolated(args: argparse.Namespace) -> bool:
    if args.isolate != "auto":
        return args.isolate == "on"
    return args.device.startswith("cuda") and len(args.modes) * args.repeat > 1


def isolated_runs(argv: list[str], args: argparse.Namespace) -> dict:
    """Each run of each mode in a fresh `python -m lockserve.cluster.measure.decode.bench` process (the same
    flags, then --modes MODE --repeat 1 --isolate off and a scratch --out: later flags win),
    merged as one process merges its runs; the command recorded is this one."""
    result: dict | None = None
    command = command_line("-m lockserve.cluster.measure.decode.bench", argv)
    with tempfile.TemporaryDirectory(prefix="lockserve-bench-") as tmp:
        for run in range(args.repeat):
            for i, mode in enumerate(args.modes):
                out = Path(tmp) / f"run{run}-mode{i}.json"
                cmd = [sys.executable, "-m", "lockserve.cluster.measure.decode.bench", *argv, "--modes", mode,
                       "--reference", NO_REFERENCE, "--repeat", "1", "--isolate", "off", "--out", str(out)]
                code = subprocess.run(cmd).returncode
                if code:
                    raise SystemExit(f"bench: the process for {mode} (run {run + 1}) failed with exit {code}")
                child = json.loads(out.read_text())
                if result is None:
                    result = child | {"command": command, "modes": {}, "isolated": True}
                add_run(result["modes"], mode, child["modes"][mode], args.batch)
    return result


def add_run(modes: dict, mode: str, r: dict, batch: int) -> None:
    """A mode's first run becomes its result (with repeat_tpot_ms, repeat_same_tokens); a later
    one is pooled into it (pool_repeat)."""
    if mode in modes:
        pool_repeat(modes[mode], r, batch)
    else:
        modes[mode] = r | {"repeat_tpot_ms": [r["tpot_ms_median"]], "repeat_same_tokens": True}


def pool_repeat(first: dict, again: dict, batch: int) -> None:
    """Fold a repeated run of a mode into its first run's result: the timed steps pooled and the
    TPOT figures taken over them; the profile and counters stay the first run's. Each run's
    median goes to repeat_tpot_ms; repeat_same_tokens says whether every run decoded the same."""
    ms = first["step_ms"] = first["step_ms"] + again["step_ms"]
    med = statistics.median(ms)
    first.update(tpot_ms_median=med, tpot_ms_p90=percentile(ms, 0.9), tpot_ms_mean=statistics.fmean(ms),
                 tpot_ms_min=min(ms), tokens_per_s=batch * 1e3 / med)
    if first["roofline_ms"]:
        first["tpot_over_roofline"] = med / first["roofline_ms"]
    first["repeat_tpot_ms"].append(again["tpot_ms_median"])
    first["repeat_same_tokens"] = first["repeat_same_tokens"] and again["tokens"] == first["tokens"]


def _is_real(model: str) -> bool:
    return model == "default" or model.endswith(".gguf") or Path(model).is_dir()


def compare_tokens(result: dict, reference: str | None) -> None:
    """result["reference"] = reference; each other mode's same_tokens_as_reference and
    token_agreement_with_reference against it. The reference's own row, and every row where
    reference is None, carries None: a mode is never compared with itself."""
    result["reference"] = reference
    ref = result["modes"].get(reference) if reference is not None else None
    for mode, r in result["modes"].items():
        if ref is None or mode == reference:
            r["same_tokens_as_reference"] = None
            r["token_agreement_with_reference"] = None
            continue
        pairs = [(a, b) for ra, rb in zip(r["tokens"], ref["tokens"], strict=True)
                 for a, b in zip(ra, rb, strict=False)]
        r["same_tokens_as_reference"] = r["tokens"] == ref["tokens"]
        r["token_agreement_with_reference"] = sum(a == b for a, b in pairs) / max(len(pairs), 1)
        print(f"{mode:20s} tokens equal to {reference}: {r['same_tokens_as_reference']} "
              f"({r['token_agreement_with_reference']:.3f})")


def table_row(r: dict) -> str:
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}"
    roof = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.2f} ms (x{r['tpot_over_roofline']:.2f})"
    p = r["profile"]
    return (f"{r['mode']:20s} tpot {r['tpot_ms_median']:8.3f} ms (p90 {r['tpot_ms_p90']:.3f}, "
            f"mean {r['tpot_ms_mean']:.3f})  "
            f"roofline {roof}  "
            f"hit {hit}  pcie/step {r['bytes_per_step']['pcie'] / 2**20:7.2f} MiB  "
            f"kernels/step {p['device_kernels']}  blocking {sum(p['blocking_calls'].values())}"
            + ("" if p.get("graph_span_ms") is None else
               f"  graph {p['graph_span_ms']:.3f} ms (kernels {p['device_time_us'] / 1e3:.3f}, "
               f"gaps {p['kernel_gaps_us'] / 1e3:.3f})  host before/in/after replay "
               + "/".join(f"{v:.3f}" for v in p["host_ms"].values()) + " ms")
            + ("" if not r.get("nvme") else f"  nvme reruns/step {r['nvme']['step_reruns']:.2f} "
               f"missed pages/step {r['nvme']['missed_pages']:.0f}"))


if __name__ == "__main__":
    raise SystemExit(main())
