"""What does a locks:host run leave behind that slows a locks:hbm graph in the same process? (A GPU
diagnostic, not part of the package.)

One locks:hbm engine (E1) stays alive while --stages run in turn around it; E1's decode graph span
and TPOT are measured after each (what a stage makes stays alive to the end):
  arena            a registered host arena of the host run's size (closed after the measure)
  alloc            --alloc-gib of device memory allocated and written
  empty_cache      gc and torch.cuda.empty_cache()
  graph1 / graphs  one CUDA graph of one small kernel / --graphs graphs of 400, captured, replayed
  newkernel        a torch kernel not run before in the process, run eagerly (no capture)
  newtriton        a Triton kernel compiled and run eagerly (no capture)
  recapture        E1's decode and settle graphs dropped, captured again by its next steps
  recapture_decode the same, its decode graphs only
  graph1_shared    graph1 captured in E1's runner's memory pool
  sidestream       a small kernel on a new side stream, joined (no capture)
  second           an engine of mode --second built and prefilled (second_built), decoded (its own
                   span: second; E1 after: second_decoded), closed and freed (second_closed)
  fresh            a new locks:hbm engine (fresh_hbm), then E1 again (first_again)

    python scripts/order_effect_probe.py --model default --context 131072 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from lockserve.cluster.measure.decode import bench, engines
from lockserve.offload.host import HostArena

from lockserve.provenance import command_line, run_provenance


def measure(engine, tokens: list[list[int]], steps: int) -> dict:
    ms = engines.decode_steps(engine, tokens, steps)
    span = bench.replay_timing(engine, tokens, bench.SPAN_STEPS)
    return {"tpot_ms_median": statistics.median(ms), "graph_span_ms": span["graph_span_ms"]}


def arena_like(engine) -> HostArena:
    """A registered arena as large as the engine's KV would need on the host tier."""
    layout = engine.kv.layout
    a = HostArena.create(layout.geometry, layout.num_slots, prefix="orderprobe")
    a.register_cuda()
    return a


def dummy_graph(device: torch.device, kernels: int, pool=None) -> torch.cuda.CUDAGraph:
    """A captured and replayed graph of `kernels` small kernels."""
    x = torch.zeros(4096, device=device)
    x.add_(1.0)  # warm outside the capture
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        for _ in range(kernels):
            x.add_(1.0)
    g.replay()
    torch.cuda.synchronize(device)
    return g


def new_triton_kernel(device: torch.device) -> torch.Tensor:
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_fill(out, value, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + offs, tl.zeros([BLOCK], dtype=tl.float32) + value)

    out = torch.empty(4096, device=device)
    _probe_fill[(4,)](out, 3.0, BLOCK=1024)
    torch.cuda.synchronize(device)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--first", default="locks:hbm", help="the mode of E1")
    p.add_argument("--main-stream-writes", action="store_true",
                   help="E1's host write-backs on the current stream instead of a side stream")
    p.add_argument("--second", default="locks:host", help="the mode of E2 (locks:host: the order effect)")
    p.add_argument("--alloc-gib", type=float, default=8.0)
    p.add_argument("--graphs", type=int, default=4)
    p.add_argument("--stages", nargs="+", default=["arena", "alloc", "empty_cache", "graph1", "graphs",
                                                    "second", "fresh"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    per = args.steps + bench.SPAN_STEPS + 1
    spec = engines.DecodeSpec(context=args.context, steps=12 * per, warmup=8, device="cuda")
    device = torch.device("cuda")
    model, tokenizer = engines.load_model(args.model, device, spec.context + spec.max_tokens + 16)
    synthetic = engines.is_synthetic("auto", args.model)
    prompts, _ = engines.make_prompts(model, tokenizer, args.context, 1, synthetic, 0.5)
    rows: dict[str, dict] = {}
    run_stages(args, model, tokenizer, prompts, spec, synthetic, device, rows)
    out = {**run_provenance(command_line("scripts/order_effect_probe.py", argv), device), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    return 0


def run_stages(args, model, tokenizer, prompts, spec, synthetic, device, rows: dict) -> None:
    def record(name: str, engine, tokens) -> None:
        rows[name] = measure(engine, tokens, args.steps)
        print(f"{name:14s} tpot {rows[name]['tpot_ms_median']:.3f} ms, span "
              f"{rows[name]['graph_span_ms']:.3f} ms", flush=True)

    e1 = engines.make_engine(model, tokenizer, args.first, spec)
    if args.main_stream_writes and getattr(e1.kv.settled, "_side", None) is not None:
        e1.kv.settled._side = torch.cuda.current_stream(device)  # write-backs in the stream's order
    t1 = engines.start_requests(e1, prompts, spec, synthetic)
    engines.decode_steps(e1, t1, spec.warmup)
    record("first", e1, t1)
    kept = []  # what a stage leaves behind stays alive to the end
    for stage in args.stages:
        if stage == "arena":
            arena = arena_like(e1)
            record("arena", e1, t1)
            arena.close()
        elif stage == "alloc":
            kept.append(torch.ones(int(args.alloc_gib * 2**30), dtype=torch.uint8, device=device))
            record("alloc", e1, t1)
        elif stage == "empty_cache":
            engines.free_device_memory()
            record("empty_cache", e1, t1)
        elif stage in ("graph1", "graphs"):
            kept += [dummy_graph(device, 1 if stage == "graph1" else 400)
                     for _ in range(1 if stage == "graph1" else args.graphs)]
            record(stage, e1, t1)
        elif stage == "newkernel":  # a torch kernel this process has not run yet, no capture
            kept.append(torch.arange(4096, device=device, dtype=torch.float64).cumsum(0).sin())
            torch.cuda.synchronize(device)
            record("newkernel", e1, t1)
        elif stage == "newtriton":  # a Triton kernel compiled and run now, no capture
            kept.append(new_triton_kernel(device))
            record("newtriton", e1, t1)
        elif stage in ("recapture", "recapture_decode"):  # E1's graphs dropped, captured again
            # Fresh pools: a pool whose graphs were all freed cannot be captured into again.
            e1.runner.graphs.drop_all()
            if stage == "recapture" and e1.kv.settle_graphs is not None:
                e1.kv.settle_graphs.graphs.drop_all()
            engines.free_device_memory()
            engines.decode_steps(e1, t1, 2 * e1.kv.layout.page_size)  # through a settle
            record(stage, e1, t1)
        elif stage == "graph1_shared":  # one small graph in E1's runner's memory pool
            kept.append(dummy_graph(device, 1, pool=e1.runner._pool))
            record(stage, e1, t1)
        elif stage == "sidestream":  # a small kernel on a new side stream, joined (no capture)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                kept.append(torch.ones(4096, device=device) * 2.0)
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            kept.append(side)
            record(stage, e1, t1)
        elif stage == "second":
            e2 = engines.make_engine(model, tokenizer, args.second, spec)
            t2 = engines.start_requests(e2, prompts, spec, synthetic)
            record("second_built", e1, t1)
            engines.decode_steps(e2, t2, spec.warmup)
            record("second", e2, t2)
            record("second_decoded", e1, t1)
            e2.close()
            del e2
            engines.free_device_memory()
            record("second_closed", e1, t1)
        elif stage == "fresh":
            e3 = engines.make_engine(model, tokenizer, "locks:hbm", spec)
            t3 = engines.start_requests(e3, prompts, spec, synthetic)
            engines.decode_steps(e3, t3, spec.warmup)
            record("fresh_hbm", e3, t3)
            record("first_again", e1, t1)
            e3.close()
        else:
            raise SystemExit(f"unknown stage {stage!r}")
    e1.close()
    del kept


if __name__ == "__main__":
    sys.exit(main())
