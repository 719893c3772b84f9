"""Engines and requests of a measurement: the modes ("attention:tier"), a mode's engine sized for
the run, the model and its prompts, filling requests and timing decode steps. The decode, prefill
and capacity benches and the probes in scripts/ build their engines here."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from lockserve.cluster.measure.eval.passkey import build_passkey_prompt
from lockserve.configs.schema import (
    ATTENTION_MODES,
    TIERS,
    CacheConfig,
    SchedulerConfig,
)
from lockserve.workers.api import load
from lockserve.workers.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import extend_positions

MODES = ("dense:hbm", "locks:hbm", "locks:host", "locks:host-nocache", "locks:host+nvme",
         "locks:host+nvme-inline", "locks:host+nvme-twice", "locks:host+nvme-nowait", "dense:host")
MODE_TIERS = (*TIERS, "host-nocache", "host+nvme-inline", "host+nvme-twice", "host+nvme-nowait")
_BASE_TIER = {"host-nocache": "host",
              **{f"host+nvme-{way}": "host+nvme" for way in ("inline", "twice", "nowait")}}


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
    prefill_layers_decoding: int | None = None  # layers of a chunk's forward a step while others decode
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
    """(attention, tier, hot cache off) of a mode: "locks:host-nocache" is tier host without a cache;
    "locks:host+nvme-inline" tier host+nvme with its spills inline (cache.nvme_spill_behind off);
    "locks:host+nvme-twice" tier host+nvme whose cached pages spill with a write of their own beside
    their prefix records (cache.nvme_saved_spills off); "locks:host+nvme-nowait" tier host+nvme whose
    allocations spill pages with a write around queued prefix saves rather than wait for them
    (cache.nvme_wait_for_saves off; on by default)."""
    attention, _, tier = mode.partition(":")
    return attention, _BASE_TIER.get(tier, tier), tier == "host-nocache"


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
        nvme_io_threads=spec.nvme_io_threads, nvme_spill_behind=not mode.endswith("+nvme-inline"),
        nvme_saved_spills=not mode.endswith("+nvme-twice"),
        nvme_wait_for_saves=False if mode.endswith("+nvme-nowait") else None,
        prefill_window_tokens=spec.prefill_window,
        prefix_reuse=spec.prefix_reuse, hot_cache_commit=spec.cache_commit or CacheConfig().hot_cache_commit,
        select_radix_bits=spec.radix_bits, summary_eigh=spec.summary_eigh,
        nvme_dir=(nvme_dir or spec.nvme_dir) if tier == "host+nvme" else None)
    sched = SchedulerConfig(max_num_seqs=sizing.max_num_seqs, prefill_chunk=spec.prefill_chunk,
                            max_num_batched_tokens=max(spec.prefill_chunk, sizing.max_num_seqs),
                            prefill_chunk_decoding=spec.prefill_chunk_decoding,
                            prefill_attention_decoding=spec.prefill_attention_decoding,
                            prefill_layers_decoding=spec.prefill_layers_decoding)
    engine = Engine(model, tokenizer, cache, sched, torch.device(spec.device), max_pages=sizing.max_pages,
                    max_model_len=sizing.max_model_len, use_graphs=spec.graphs == "on" and None,
                    show_progress=True)  # bars on long prefills and synthetic fills (minutes at 1M)
    return engine


def hot_cache(engine: Engine):
    """The engine's hot-page cache (offload/cache.py HotPageCache), or None."""
    return getattr(engine.kv.settled, "cache", None)


@contextlib.contextmanager
def run_dir(spec: DecodeSpec, mode: str) -> Iterator[str | None]:
    """A fresh directory under spec.nvme_dir for a host+nvme mode (None for the other tiers),
    removed on exit: a run never opens another run's manifest."""
    if mode_parts(mode)[1] != "host+nvme":
        yield None
        return
    os.makedirs(spec.nvme_dir, exist_ok=True)
    path = tempfile.mkdtemp(prefix="run-", dir=spec.nvme_dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def bench_engine(model, tokenizer, mode: str, spec: DecodeSpec, sizing: EngineSizing | None = None,
                 nvme_dir: str | None = None) -> Iterator[Engine]:
    """make_engine, closed on exit. Host+nvme: in nvme_dir, kept (a restarted engine opens the
    directory of the one before it), or else a fresh `run_dir`. The previous engine's pools and
    graphs are freed first (the caller must hold no reference to it)."""
    free_device_memory()
    with contextlib.ExitStack() as stack:
        if nvme_dir is None:
            nvme_dir = stack.enter_context(run_dir(spec, mode))
        engine = make_engine(model, tokenizer, mode, spec, sizing, nvme_dir)
        try:
            yield engine
        finally:
            engine.close()


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


def is_synthetic(fill: str, model: str) -> bool:
    """--fill auto: synthetic for random-weight presets, the passkey prompt for real models."""
    return fill == "synthetic" or (fill == "auto" and not _is_real(model))


def _is_real(model: str) -> bool:
    return model == "default" or model.endswith(".gguf") or Path(model).is_dir()


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


def failed(err: BaseException) -> str:
    """A point's status after an error: one line (a CUDA error's message runs to five); the
    traceback goes to stderr and the device's memory is freed for the next point."""
    traceback.print_exception(err, file=sys.stderr)
    free_device_memory()
    return f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
