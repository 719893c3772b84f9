"""Context-parallel decode benchmark: TPOT, bytes per step and collective time per layer of one
request sharded over ranks, against the plain engine on one device.

    python -m lockserve.cluster.measure.decode.cp_bench --model glm-4-9b-chat-1m --context 1048576 \
        --tier host --ranks 1 --steps 64 --compare --out docs/results/cp_glm4_1m_1rank.json

The request's context is a synthetic cache fill (random K/V from one seed, summarised by the real
code: KVManager.fill_random by page index, so any split over ranks holds the cache one engine's
fill_synthetic makes), labelled so in the result: honest bytes and times, unrealistic page reuse.
--ranks 1 runs the rank in this process (its collectives are copies: the result is the overhead
of the context-parallel path itself, eager, against the engine's replayed graph); --ranks N starts
N processes, rank i on cuda:i (NCCL) or the CPU (gloo), each with the whole model. --compare also
runs the engine (graphs on and off) on the same cache and checks the tokens are the same.
--graphs on replays the ranks' decode steps from CUDA graphs (collectives captured too); every
run on CUDA also times the three collectives of every layer replayed from one graph
(collective_graph_us_per_layer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp
from lockserve.cluster.measure.decode.bench import percentile, run_info
from lockserve.cluster.measure.decode.ceilings import step_bytes
from lockserve.cluster.measure.decode.engines import (
    DecodeSpec,
    EngineSizing,
    bench_sizing,
    decode_steps,
    free_device_memory,
    load_model,
    make_engine,
    make_prompts,
    start_requests,
)
from lockserve.cluster.measure.decode.step_profile import profile_call
from lockserve.cluster.measure.harness import flags
from lockserve.workers.engine.context_parallel import ShardEngine, ShardSpec
from lockserve.workers.engine.cp_group import GroupHost, RankGroup
from lockserve.workers.engine.sampling import SamplingParams

PAGE = 16  # tokens per page of the bench's engines (bench_sizing's)
SEED = 0  # the synthetic fill of request 0 (bench.start_requests uses the request's index)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lockserve.cluster.measure.decode.cp_bench",
                                description=__doc__.split("\n")[0])
    flags.model(p, "glm-4-9b-chat-1m")
    p.add_argument("--context", type=int, default=1 << 20, help="tokens of context (synthetic fill)")
    p.add_argument("--ranks", type=int, default=1, help="ranks the request is sharded over (processes)")
    p.add_argument("--tier", choices=("hbm", "host"), default="host")
    flags.steps(p, 64, warmup=4)
    flags.budget_tokens(p)
    flags.hot_cache_pages(p)
    p.add_argument("--compare", action="store_true", help="also the engine on one device (ranks 1 only)")
    flags.graphs(p, "off", "the ranks' decode steps (collectives included; CUDA only)")
    flags.device(p)
    flags.out(p, "the result file (JSON)")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.steps < 1 or args.context < 2:
        p.error("--ranks and --steps must be >= 1 and --context >= 2")
    if args.compare and args.ranks != 1:
        p.error("--compare needs --ranks 1 (the engine runs in this process)")
    if args.graphs == "on" and not args.device.startswith("cuda"):
        p.error(f"--graphs on needs a CUDA device, not {args.device!r}")
    return args


def bench_spec(args: argparse.Namespace) -> DecodeSpec:
    return DecodeSpec(context=args.context, steps=args.steps, warmup=args.warmup,
                      budget_tokens=args.budget_tokens, hot_cache_pages=args.hot_cache_pages, graphs="off",
                      device=args.device)


def shard_ranges(total_pages: int, first_new_page: int, ranks: int) -> list[tuple[int, int]]:
    """(first page, pages) of each rank: even ranges, but the last one starts no later than
    first_new_page (it takes every new token)."""
    step = total_pages / ranks if ranks == 1 else min(total_pages / ranks, first_new_page / (ranks - 1))
    starts = [int(i * step) for i in range(ranks)] + [total_pages]
    return [(starts[i], starts[i + 1] - starts[i]) for i in range(ranks)]


def rank_sizing(model, mode: str, spec: DecodeSpec, pages: int) -> EngineSizing:
    """The bench's engine sized for one rank's pages, not the whole request's (with two ranks at 1M
    tokens of the Llama-3.1-8B shape, whole-request arenas would ask 2 x 128 GiB of host memory)."""
    full = bench_sizing(model, mode, spec)
    share = (pages + 1) / full.max_pages
    return dataclasses.replace(full, max_pages=pages + 1, host_gib=full.host_gib * share + 0.01,
                               nvme_gib=full.nvme_gib * share + 0.01)


def measure_rank(rank: int, args: argparse.Namespace, address: tuple[str, int] | None) -> dict:
    """One rank: its share of the synthetic cache, then warmup + steps decode steps, timed."""
    spec = bench_spec(args)
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per rank; an index always (set_device refuses a bare "cuda")
        device = torch.device("cuda", rank if args.ranks > 1 else (device.index or 0))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    spec = dataclasses.replace(spec, device=str(device))
    model, tokenizer = load_model(args.model, device, args.context + spec.max_tokens + 16)
    [prompt], _ = make_prompts(model, tokenizer, args.context, 1, synthetic=True)
    mode = f"locks:{args.tier}"
    total = math.ceil((args.context + spec.max_tokens) / PAGE)
    first, count = shard_ranges(total, args.context // PAGE, args.ranks)[rank]
    engine = make_engine(model, tokenizer, mode, spec, rank_sizing(model, mode, spec, count))
    ranks = ShardEngine(engine, use_graphs=args.graphs == "on")
    if engine.kv.layout.page_size != PAGE:
        raise RuntimeError(f"the engine's pages hold {engine.kv.layout.page_size} tokens, not {PAGE}")
    if args.ranks == 1:
        group = RankGroup.solo(device)
    else:
        group = RankGroup.connect(address, rank, args.ranks, device, 600.0, "127.0.0.1", prefix="bench")
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    ranks.open(ShardSpec("r0", rank, args.ranks, first, count, total, engine.budget_pages), group, params)
    begin = time.perf_counter()
    ranks.fill_synthetic("r0", args.context, SEED)
    fill_s = time.perf_counter() - begin
    tokens, ms = [prompt[-1]], []
    moved = engine.kv.stats().bytes_moved
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            moved, hits = engine.kv.stats().bytes_moved, engine.stats()
            group.drain_times()
            before = dataclasses.replace(group.times["decode"])
        begin = time.perf_counter()
        token = ranks.decode("r0", tokens[-1], args.context + len(tokens) - 1)
        tokens.append(share_token(group, token, device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms.append((time.perf_counter() - begin) * 1e3)
    # a copy: the traced step below adds to the live counters
    after, stats = dataclasses.replace(group.drain_times()["decode"]), engine.stats()
    # One more step on every rank (its collectives need them all), traced on rank 0: where a rank's
    # step goes, kernel by kernel.
    def traced_step() -> None:
        tokens.append(share_token(group, ranks.decode("r0", tokens[-1], args.context + len(tokens) - 1),
                                  device))

    profile = profile_call(traced_step, device, model.config.num_layers) if rank == 0 else traced_step()
    graph_us = graph_collective_us(group, model.config, engine.budget_pages - ranks.attention.sink_pages
                                   - ranks.attention.recent_pages, device)
    pcie = (engine.kv.stats().bytes_moved - moved) / args.steps
    lookups = stats["cache_hits"] + stats["cache_misses"] - hits["cache_hits"] - hits["cache_misses"]
    layers = model.config.num_layers
    timed = ms[args.warmup :]
    result = {
        "rank": rank, "pages": [first, count], "fill_s": fill_s, "tpot_ms_median": statistics.median(timed),
        "tpot_ms_p90": percentile(timed, 0.9), "step_ms": timed,
        "hit_rate": (stats["cache_hits"] - hits["cache_hits"]) / lookups if lookups else None,
        "bytes_per_step": step_bytes(engine, count * PAGE, 1, pcie),
        "collectives_per_step": (after.calls - before.calls) / args.steps,
        "collective_bytes_per_layer": (after.bytes_sent - before.bytes_sent) / (args.steps * layers),
        # eager steps: CUDA events around each collective (waiting for the slowest rank included);
        # graph replays issue collectives no event times (0 here): see collective_graph_us_per_layer
        "collective_us_per_layer": (after.seconds - before.seconds) / (args.steps * layers) * 1e6,
        "collective_graph_us_per_layer": graph_us, "graph_replays": ranks.totals["graph_replays"],
        "graph_captures": ranks.totals["graph_captures"],
        "tokens": tokens[: args.warmup + args.steps + 1], "dtype": str(model.dtype), "profile": profile,
    }
    ranks.close("r0")
    engine.close()
    return result


def graph_collective_us(group: RankGroup, config, candidates: int, device: torch.device,
                        replays: int = 20) -> float | None:
    """Microseconds per layer of one decode layer's three collectives (normalisers [1, Hkv, G, 2]
    float32, candidates [1, Hkv, T] int64, partials [1, Hq, d + 1] float32) for every layer,
    replayed from one CUDA graph: what the collectives cost inside a captured step (None off CUDA).
    Every rank must call it at the same point (it issues collectives)."""
    if device.type != "cuda":
        return None
    hkv, hq, d, layers = config.num_kv_heads, config.num_heads, config.head_dim, config.num_layers
    f32 = dict(dtype=torch.float32, device=device)
    tensors = [torch.zeros(1, hkv, hq // hkv, 2, **f32), torch.zeros(1, hkv, max(candidates, 1),
               dtype=torch.int64, device=device), torch.zeros(1, hq, d + 1, **f32)]
    group.phase = "control"

    def step():
        for _ in range(layers):
            for t in tensors:
                group.all_gather(t)

    step()  # eager first: the communicator is up before the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    group.capturing = True
    try:
        with torch.cuda.graph(graph):
            step()
    finally:
        group.capturing = False
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * layers)


def _rank_process(rank: int, args: argparse.Namespace, address: tuple[str, int], results) -> None:
    if args.device == "cpu":  # ranks share the machine's cores: one thread each, no oversubscription
        torch.set_num_threads(1)
    results.put(measure_rank(rank, args, address))


def share_token(group: RankGroup, token: int | None, device: torch.device) -> int:
    """Rank 0's sampled token on every rank (the coordinator's job in serving; here one collective
    outside the forward, counted apart as "control")."""
    if group.size == 1:
        return token
    group.phase = "control"
    t = torch.tensor([-1 if token is None else token], dtype=torch.int64, device=device)
    return int(group.all_gather(t)[0, 0])


def run_ranks(args: argparse.Namespace) -> list[dict]:
    if args.ranks == 1:
        if args.device == "cpu":
            torch.set_num_threads(1)  # as each of several rank processes runs: comparable
        return [measure_rank(0, args, None)]
    host = GroupHost.start("127.0.0.1", 600.0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_process, args=(i, args, host.address, results))
             for i in range(args.ranks)]
    for proc in procs:
        proc.start()
    out = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"a rank process exited with {proc.exitcode}")
    return sorted(out, key=lambda r: r["rank"])


def run_engine(args: argparse.Namespace, graphs: str) -> dict:
    """The same request in the plain engine on one device (its decode step replayed from CUDA graphs
    when graphs is "on" and the device allows)."""
    spec = dataclasses.replace(bench_spec(args), graphs=graphs)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, device, args.context + spec.max_tokens + 16)
    prompts, _ = make_prompts(model, tokenizer, args.context, 1, synthetic=True)
    free_device_memory()
    engine = make_engine(model, tokenizer, f"locks:{args.tier}", spec)
    try:
        tokens = start_requests(engine, prompts, spec, synthetic=True)
        decode_steps(engine, tokens, args.warmup)
        ms = decode_steps(engine, tokens, args.steps)
    finally:
        engine.close()
    return {"graphs": graphs, "tpot_ms_median": statistics.median(ms), "tpot_ms_p90": percentile(ms, 0.9),
            "step_ms": ms, "tokens": tokens[0]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    ranks = run_ranks(args)
    command = ["python", "-m", "lockserve.cluster.measure.decode.cp_bench", *(argv or sys.argv[1:])]
    result = {**run_info(command, device, args.model, SimpleNamespace(dtype=ranks[0]["dtype"]), True),
              "context": args.context, "tier": args.tier, "ranks": args.ranks, "steps": args.steps,
              "warmup": args.warmup, "budget_tokens": args.budget_tokens,
              "tpot_ms_median": max(r["tpot_ms_median"] for r in ranks),
              "graphs": args.graphs,
              "collective_us_per_layer": max(r["collective_us_per_layer"] for r in ranks),
              "collective_graph_us_per_layer": ranks[0]["collective_graph_us_per_layer"],
              "per_rank": ranks}
    if args.compare:
        result["engine"] = [run_engine(args, "on"), run_engine(args, "off")]
        n = len(ranks[0]["tokens"])
        result["same_tokens_as_engine"] = all(e["tokens"][:n] == ranks[0]["tokens"] for e in result["engine"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_rank", "engine")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
