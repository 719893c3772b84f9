"""One decode step under the profiler: kernels on the device, launch and blocking calls on the host,
device time by part of the step, and the idle gaps between the step's kernels."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from lockserve.cluster.measure.decode.engines import decode_steps
from lockserve.workers.engine import Engine

# Calls that make the host wait for the device.
BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")
# Device time by part of the step, from kernel names (first match wins; "other" = the rest).
PARTS = (("attention", ("sparse_decode", "merge_splits", "flash", "attention")),
         ("scoring", ("locks_score", "score_pages", "share_average", "row_partials")),
         ("selection", ("selection_keys", "decode_slots", "topk", "radix", "sort", "gatherTopK")),
         ("transfer", ("gather_pages", "cache_", "scatter", "index", "cumsum", "masked")),
         ("weights", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90", "cublas", "splitK")),
         ("norm_rope_act", ("rms_norm", "rope_write", "silu_mul", "add_rms")))


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
