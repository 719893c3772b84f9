"""Benchmark: UVA gather of random pages from the host arena, the pinned-copy ceiling, and the
hot-page cache over a synthetic decode; proves the cache step has no host synchronisation.

    python -m lockserve.offload.bench --out docs/results/offload_gather.json

On a GPU: the arena is a shared-memory segment registered with CUDA (mapped), read by
the Triton kernel zero-copy; times are medians of triton.testing.do_bench / CUDA events;
one `lookup_and_fill` is captured in a CUDA graph (capture fails on a host sync) and
replayed against an eager twin; torch.profiler lists any synchronising runtime calls.
`--device cpu` runs the same logic tiny and slow (TRITON_INTERPRET=1 for the kernel),
to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch
import triton
from lockserve.kernels.timing import median_ms

from lockserve.provenance import command_line, run_provenance

from .arena import KV_DTYPES, PageGeometry, resolve_device
from .cache import HotPageCache
from .gather import gather_pages
from .host import DEFAULT_SHM_DIR, HostArena

# Runtime/driver calls that block the host: any *Synchronize, and the synchronous copies.
BLOCKING_COPIES = {"cudaMemcpy", "cudaMemcpy2D", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuMemcpy"}
STEP_LABEL = "offload.lookup_and_fill"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    accel = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    p = argparse.ArgumentParser(
        prog="python -m lockserve.offload.bench", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", required=True, help="JSON file to write (parent folders are created)")
    p.add_argument(
        "--device", default=str(accel) if accel else None, help="torch device (default: the accelerator)"
    )
    p.add_argument("--pool-gib", type=float, default=8.0, help="host arena size in GiB")
    p.add_argument("--shm-dir", default=DEFAULT_SHM_DIR, help="where the shared-memory segment is made")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(KV_DTYPES))
    p.add_argument("--gather-pages", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--copy-mib", type=int, default=1024, help="pinned host->device copy size")
    p.add_argument("--steps", type=int, default=256, help="decode steps of the synthetic selection")
    p.add_argument("--streams", type=int, default=256, help="(layer, KV head) streams selecting pages")
    p.add_argument("--pages-per-stream", type=int, default=1024, help="context pages of each stream")
    p.add_argument(
        "--k", type=int, default=32, help="pages selected per stream per step (sink + recent + k-2)"
    )
    p.add_argument(
        "--churn", type=float, nargs="+", default=[0.05, 0.2], help="fraction of top picks replaced per step"
    )
    p.add_argument("--cache-pages", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.device is None:
        p.error("no accelerator found: pass --device cpu to check the script")
    if args.steps < 2:
        p.error(f"--steps ({args.steps}) must be >= 2")
    if args.k < 3 or args.pages_per_stream < args.steps // 16 + 3:
        p.error(
            f"--k ({args.k}) must be >= 3 and --pages-per-stream ({args.pages_per_stream}) >= steps/16 + 3"
        )
    if not all(0.0 <= c <= 1.0 for c in args.churn):
        p.error(f"--churn values ({args.churn}) must be in [0, 1]")


def make_arena(args, geometry: PageGeometry, device: torch.device):
    """The shared-memory arena (registered on CUDA) and the source the kernel reads from."""
    want = max(int(args.pool_gib * 2**30), args.streams * args.pages_per_stream * geometry.slot_bytes)
    fs = os.statvfs(args.shm_dir)
    room = int(fs.f_bavail * fs.f_frsize * 0.9)  # a container's /dev/shm may be small: fit, and say so
    if want > room:
        print(
            f"note: {args.shm_dir} has room for {room / 2**30:.2f} GiB; the arena is cut to that",
            file=sys.stderr,
        )
    needed = args.streams * args.pages_per_stream * geometry.slot_bytes
    if min(want, room) < needed:
        raise SystemExit(f"{args.shm_dir} has {room} bytes free; the synthetic decode needs {needed}")
    arena = HostArena.create(geometry, min(want, room) // geometry.slot_bytes, shm_dir=args.shm_dir)
    if device.type == "cuda":
        t0 = time.perf_counter()
        arena.register_cuda()
        return arena, arena.uva_pool(), time.perf_counter() - t0
    return arena, arena.pool, 0.0


def _backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def bench_uva_gather(arena, src, device, page_counts, timer) -> list[dict]:
    """GB/s of gathering n random pages from the host arena into a device buffer; bytes verified."""
    g = torch.Generator().manual_seed(1)
    sb, rows, backend = arena.geometry.slot_bytes, [], _backend(device)
    for n in page_counts:
        src_idx = torch.randperm(arena.num_slots, generator=g)[:n]
        pages = torch.randint(-128, 127, (n, sb), dtype=torch.int8, generator=g)
        arena.write(src_idx, pages.view(arena.geometry.dtype).view(n, *arena.geometry.page_shape))
        dst = torch.empty((n, *arena.geometry.page_shape), dtype=arena.geometry.dtype, device=device)
        si, di = src_idx.to(device), torch.arange(n, device=device)
        fn = lambda: gather_pages(src, si, dst, di, backend=backend)  # noqa: B023 (used in this iteration)
        fn()
        correct = torch.equal(dst.cpu().view(torch.int8).view(n, sb), pages)
        ms = timer(fn)
        rows.append(
            {"pages": n, "bytes": n * sb, "ms": ms, "GB_per_s": n * sb / ms / 1e6, "bytes_correct": correct}
        )
    return rows


def bench_pinned_copy(device: torch.device, mib: int, timer) -> dict:
    """The ceiling: one contiguous pinned host -> device copy."""
    nbytes = mib << 20
    pin = device.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = timer(lambda: dst.copy_(src, non_blocking=True))
    return {"bytes": nbytes, "ms": ms, "GB_per_s": nbytes / ms / 1e6, "pinned": pin}


def synthetic_selections(args: argparse.Namespace, churn: float) -> torch.Tensor:
    """`[steps, streams * k]` int64 arena slots, modelled on LOCKS decode.

    Each stream (one layer, one KV head) owns pages_per_stream consecutive slots and
    selects the sink page, the newest page (it advances every 16 steps: 16 tokens a
    page) and k-2 top pages, a fraction `churn` of which is replaced each step. A page
    picked twice in one step is requested once: the repeats become -1 (padding), as the
    cache wants distinct slots per lookup.
    """
    g = torch.Generator().manual_seed(args.seed)
    s, k, pps = args.streams, args.k, args.pages_per_stream
    first_recent = pps - args.steps // 16 - 1
    chosen = torch.randint(1, first_recent, (s, k - 2), generator=g)
    base = (torch.arange(s) * pps)[:, None]
    out = []
    for t in range(args.steps):
        recent = first_recent + t // 16
        fresh = torch.randint(1, recent, (s, k - 2), generator=g)
        chosen = torch.where(torch.rand(s, k - 2, generator=g) < churn, fresh, chosen)
        sel = torch.cat([torch.zeros(s, 1, dtype=torch.int64), torch.full((s, 1), recent), chosen], 1)
        out.append(_pad_repeats(sel + base).flatten())
    return torch.stack(out)


def _pad_repeats(sel: torch.Tensor) -> torch.Tensor:
    """`[s, k]` with every repeat of a value within a row replaced by -1 (values >= 0)."""
    values, order = sel.sort(dim=1, stable=True)
    repeat = torch.zeros_like(values, dtype=torch.bool)
    repeat[:, 1:] = values[:, 1:] == values[:, :-1]
    return sel.scatter(1, order, torch.where(repeat, -1, values))


def bench_hot_cache(arena, src, selections: torch.Tensor, capacity: int, device: torch.device) -> dict:
    """Hit rate, bytes moved per step and time per lookup_and_fill over the selection sequence."""
    steps, m = selections.shape
    cache = _make_cache(arena, capacity, m, device)
    sels = selections.to(device)
    misses = torch.zeros(steps, dtype=torch.int64, device=device)
    times = _run_steps(cache, src, sels, misses, device)
    st = cache.stats()
    per_step = (misses * arena.geometry.slot_bytes).tolist()
    half = per_step[steps // 2 :]
    return {
        "cache_pages": capacity, "cache_entries": cache.capacity, "ways": cache.ways,
        "selected_per_step": m, "hit_rate": st.hit_rate,
        "hits": st.hits, "misses": st.misses, "not_installed": st.not_installed,
        "bytes_moved_per_step_mean": st.bytes_moved / steps,
        "bytes_moved_per_step_second_half_mean": sum(half) / len(half),
        "bytes_all_miss_per_step": st.requests / steps * arena.geometry.slot_bytes,
        "step_ms_median": statistics.median(times), "step_ms_p90": statistics.quantiles(times, n=10)[-1],
    }  # fmt: skip


def _make_cache(arena, capacity: int, max_selected: int, device: torch.device) -> HotPageCache:
    backend = _backend(device)
    gather = functools.partial(gather_pages, backend=backend)
    return HotPageCache(
        arena.geometry, capacity, arena.num_slots, max_selected, device, gather, backend=backend
    )


def _run_steps(cache, src, sels, misses, device) -> list[float]:
    """Run every step; per-step misses are copied aside on the device (no sync in the loop)."""
    if device.type != "cuda":
        times = []
        for t in range(sels.shape[0]):
            t0 = time.perf_counter()
            cache.lookup_and_fill(sels[t], src)
            times.append((time.perf_counter() - t0) * 1e3)
            misses[t] = cache.last_step_misses
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in sels]
    for t, (start, end) in enumerate(events):
        start.record()
        cache.lookup_and_fill(sels[t], src)
        end.record()
        misses[t] = cache.last_step_misses
    torch.cuda.synchronize(device)
    return [start.elapsed_time(end) for start, end in events]


def profile_sync_calls(arena, src, selections: torch.Tensor, capacity: int, device) -> dict:
    """Runtime API calls torch.profiler sees inside one eager, warm lookup_and_fill."""
    from torch.profiler import ProfilerActivity, profile, record_function

    steps, m = selections.shape
    cache = _make_cache(arena, capacity, m, device)
    sels = selections.to(device)
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    cache.lookup_and_fill(sels[0], src)  # compile and warm
    if on_cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        with record_function(STEP_LABEL):
            cache.lookup_and_fill(sels[1], src)
    if on_cuda:
        torch.cuda.synchronize(device)
    events = prof.events()
    step = next(e for e in events if e.name == STEP_LABEL)
    inside = [
        e.name for e in events
        if e.name.startswith("cu") and step.time_range.start <= e.time_range.start <= step.time_range.end
    ]  # fmt: skip
    names = sorted(set(inside))
    blocking = [n for n in names if "Synchronize" in n or n in BLOCKING_COPIES]
    return {"sync_like_calls": blocking, "runtime_calls": names}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: random page bytes read as bf16 hold NaNs, which torch.equal calls unequal."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def graph_capture_check(arena, src, selections: torch.Tensor, capacity: int, device) -> dict:
    """Capture one lookup_and_fill in a CUDA graph, replay it over the sequence, compare to eager."""
    steps, m = selections.shape
    sels = selections.to(device)
    graphed, eager = (_make_cache(arena, capacity, m, device) for _ in range(2))
    static = sels[0].clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, allocator settles
        for cache in (graphed, eager):
            cache.lookup_and_fill(static, src)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = graphed.lookup_and_fill(static, src)
    except RuntimeError as e:
        return {"captured": False, "error": str(e)}
    for t in range(steps):
        static.copy_(sels[t])
        graph.replay()
        eager_idx = eager.lookup_and_fill(sels[t], src)
    torch.cuda.synchronize(device)
    g, e = graphed.stats(), eager.stats()
    last = sels[-1]
    valid = last >= 0  # padding entries point at some row: not compared
    want = arena.pool[last[valid].cpu()]
    return {
        "captured": True, "replays": steps,
        "same_hits_misses_as_eager": (g.hits, g.misses) == (e.hits, e.misses),
        "same_idx_as_eager": torch.equal(out, eager_idx),
        "graph_bytes_correct": _same_bytes(graphed.pool[out[valid]].cpu(), want),
        "eager_bytes_correct": _same_bytes(eager.pool[eager_idx[valid]].cpu(), want),
        "hit_rate": g.hit_rate,
    }  # fmt: skip


def run(args) -> dict:
    device = resolve_device(args.device)
    geometry = PageGeometry(16, args.head_dim, KV_DTYPES[args.dtype])
    timer = functools.partial(median_ms, device=device, warmup=10, rep=50, cpu_calls=3)
    arena, src, register_s = make_arena(args, geometry, device)
    result = {"arena": {"name": arena.name, "bytes": arena.bytes_resident, "requested_gib": args.pool_gib,
                        "slot_bytes": geometry.slot_bytes,
                        "num_slots": arena.num_slots, "cuda_register_s": register_s}}  # fmt: skip
    try:
        result["uva_gather"] = bench_uva_gather(arena, src, device, args.gather_pages, timer)
        result["pinned_copy"] = bench_pinned_copy(device, args.copy_mib, timer)
        result["hot_cache"] = []
        for churn in args.churn:
            sels = synthetic_selections(args, churn)
            for capacity in args.cache_pages:
                row = bench_hot_cache(arena, src, sels, capacity, device)
                result["hot_cache"].append({"churn": churn, **row})
        sels = synthetic_selections(args, args.churn[0])
        checks = [("profiler", profile_sync_calls)]
        if device.type == "cuda":
            checks.insert(0, ("graph_capture", graph_capture_check))
        else:
            result["graph_capture"] = {"captured": None, "reason": "CUDA graphs need a CUDA device"}
        for key, check in checks:
            try:
                result[key] = check(arena, src, sels, min(args.cache_pages), device)
            except Exception as e:  # recorded, not hidden: the JSON says what failed
                result[key] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        arena.close()
    return result


def _environment(info: dict, device: torch.device) -> dict:
    """The "environment" block of older files: the provenance's torch and GPU, triton and python."""
    env = {"torch": info["torch"], "triton": triton.__version__, "python": platform.python_version()}
    if device.type == "cuda":
        env["gpu"] = info["device"]
    return env


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    info = run_provenance(command_line("-m lockserve.offload.bench", argv), device)
    # started_utc and environment: where files written before lockserve.provenance hold the date,
    # torch and GPU (readers of those files look there)
    report = {**info, "started_utc": info["date"], "args": {k: v for k, v in vars(args).items()},
              "environment": _environment(info, device), **run(args)}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({k: report[k] for k in ("uva_gather", "pinned_copy", "graph_capture")}, indent=2))
    return report


if __name__ == "__main__":
    main()
