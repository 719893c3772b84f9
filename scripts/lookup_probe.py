"""Where does the hot cache's lookup spend its time inside a decode graph? (A GPU diagnostic, not part
of the package.)

SmolLM2's decode step at 128K does one `lookup_and_fill` per layer: M = 384 requests (3 KV heads x
128 pages), about 8 of them misses, 4 KiB pages, a cache of 2 x the selected pages. Here a CUDA graph
of --layers such lookups is replayed over a sequence of selections in which --misses of each
layer's M slots change every step (new pages: misses), and timed by events around the replay.
Variants: the misses per lookup, the commit placement, the source (the registered host arena
under UVA, or a device copy of it: the miss path without PCIe), and a graph of padding-only lookups
(no request: the launch and the kernel's fixed cost). Under the "inline" commit the step advances
before each replay, outside its timing (as the engine does before its decode graph). `--floor`
adds the lookup launch with no commit at all (tables left as the warm-up committed them, the
misses drawn against that state each step): not a valid cache, the bound on what any commit
placement could save.

    python scripts/lookup_probe.py --out lookup_probe.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
from graph_timing import replay_times
from lockserve.offload import cache as cache_module
from lockserve.offload.arena import PageGeometry
from lockserve.offload.cache import HotPageCache
from lockserve.offload.host import HostArena

from lockserve.provenance import command_line, run_provenance


def selections(steps: int, layers: int, m: int, misses: int, slots_per_layer: int,
               device: torch.device, seed: int = 0) -> torch.Tensor:
    """[steps, layers, M] int64: distinct slots per lookup; `misses` of them new at each step."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(steps, layers, m, dtype=torch.int64)
    for layer in range(layers):
        base = layer * slots_per_layer
        order = torch.randperm(slots_per_layer, generator=g) + base  # fresh slots, in turn
        cur, nxt = order[:m].clone(), m
        for t in range(steps):
            if t and misses:
                pos = torch.randperm(m, generator=g)[:misses]
                cur[pos] = order[nxt: nxt + misses]
                nxt += misses
            out[t, layer] = cur
    return out.to(device)


def fresh_each_step(sels: torch.Tensor, warm: int, misses: int, slots_per_layer: int,
                    seed: int = 1) -> torch.Tensor:
    """sels with every step after `warm` differing from sels[warm - 1] in `misses` positions per
    layer (not cumulatively), the new slots never used in the warm-up: against tables frozen after
    it, `misses` misses a lookup (slots stay distinct)."""
    g = torch.Generator().manual_seed(seed)
    out = sels.clone().cpu()
    steps, layers, m = out.shape
    base = out[warm - 1]
    for layer in range(layers):
        unused = torch.ones(slots_per_layer, dtype=torch.bool)
        unused[out[:warm, layer].flatten() - layer * slots_per_layer] = False
        pool = unused.nonzero().flatten() + layer * slots_per_layer
        for t in range(warm, steps):
            cur = base[layer].clone()
            new = pool[torch.randperm(pool.numel(), generator=g)[:misses]]
            cur[torch.randperm(m, generator=g)[:misses]] = new
            out[t, layer] = cur
    return out.to(sels.device)


def run(cache: HotPageCache, src, sels: torch.Tensor, warm: int, floor: bool = False) -> float:
    """Median ms of one graph replay of len(layers) lookups over sels[warm:]. floor: the graph
    holds the lookup launches only (no commit: the tables stay as the warm-up left them)."""
    steps, layers, m = sels.shape
    static = sels[0].clone()
    for t in range(warm):  # eager: compile, fill the cache
        cache.advance_step()  # "inline": the layers of a step share it (elsewhere a no-op)
        for layer in range(layers):
            cache.lookup_and_fill(sels[t, layer], src)
    torch.cuda.synchronize()
    if floor:
        cache.commit = "launch"  # the lookup kernel without its fused ticket and commit ...
        cache._launch_commit = lambda m: None  # ... and without the commit launch
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for layer in range(layers):
            cache.lookup_and_fill(static[layer], src)

    def before(i: int) -> None:
        static.copy_(sels[warm + i])
        cache.advance_step()

    times = replay_times(g, steps - warm, before=before)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--m", type=int, default=384)
    p.add_argument("--misses", type=int, nargs="+", default=[0, 2, 8, 32])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--floor", action="store_true", help="add the no-commit lookup launch")
    p.add_argument("--commits", nargs="+", default=["fused", "launch", "inline"])
    p.add_argument("--sources", nargs="+", default=["host", "device"], choices=["host", "device"])
    p.add_argument("--scan", type=int, nargs="+", default=[cache_module._SCAN],
                   help="most slots a miss's scan reads a pass (offload/cache.py _SCAN), swept")
    p.add_argument("--capacity", type=int, default=None, help="cache pages (default: 2 x layers x m)")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    device = torch.device("cuda")
    geometry = PageGeometry(16, 64, torch.bfloat16)
    per_layer = 8192
    arena = HostArena.create(geometry, a.layers * per_layer, prefix="lookupprobe")
    arena.register_cuda()
    arena.pool.copy_(torch.randn(arena.pool.shape, dtype=torch.float32).to(geometry.dtype))
    sources = {"host": arena.uva_pool(), "device": arena.pool.to(device)}
    sources = {name: sources[name] for name in a.sources}
    shipped_scan = cache_module._SCAN
    capacity = a.capacity or 2 * a.layers * a.m
    rows = []
    for misses in a.misses:
        sels = selections(a.steps, a.layers, a.m, misses, per_layer, device)
        for (source, src), commit, scan in itertools.product(sources.items(), a.commits, a.scan):
            cache_module._SCAN = scan
            cache = HotPageCache(geometry, capacity, arena.num_slots, a.m, device)
            cache.commit = commit
            ms = run(cache, src, sels, a.warm)
            st = cache.stats()
            rows.append({"misses": misses, "source": source, "commit": commit, "scan": scan, "graph_ms": ms,
                         "us_per_lookup": 1000 * ms / a.layers,
                         "measured_misses_per_lookup": st.misses * a.m / max(st.requests, 1)})
            print(json.dumps(rows[-1]), flush=True)
        cache_module._SCAN = shipped_scan  # the floor and padding rows: the engine's width
        for source, src in sources.items():
            if a.floor:
                cache = HotPageCache(geometry, capacity, arena.num_slots, a.m, device)
                ms = run(cache, src, fresh_each_step(sels, a.warm, misses, per_layer), a.warm, floor=True)
                rows.append({"misses": misses, "source": source, "commit": "none (floor)", "graph_ms": ms,
                             "us_per_lookup": 1000 * ms / a.layers})
                print(json.dumps(rows[-1]), flush=True)
    pad = torch.full((a.steps, a.layers, a.m), -1, dtype=torch.int64, device=device)
    cache = HotPageCache(geometry, capacity, arena.num_slots, a.m, device)
    ms = run(cache, sources["host"], pad, a.warm)
    rows.append({"misses": None, "source": "padding only", "commit": "fused", "graph_ms": ms,
                 "us_per_lookup": 1000 * ms / a.layers})
    print(json.dumps(rows[-1]), flush=True)
    arena.close()
    with open(a.out, "w") as f:
        json.dump({**run_provenance(command_line("scripts/lookup_probe.py")), "layers": a.layers, "m": a.m,
                   "capacity": capacity, "page_bytes": geometry.slot_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
