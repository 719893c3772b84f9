"""Time the decode selection (chunk top-k + select/slots) per chunking or per radix width on a
GPU, from a CUDA graph.

    python scripts/select_chunk_sweep.py --out select_chunks.json
    python scripts/select_chunk_sweep.py --vary radix --out select_radix.json

The first pass of kernels/triton/select.py splits each row's pages into chunks of
max(k, clamp(P / TARGET_CHUNKS, MIN_CHUNK, MAX_CHUNK)) pages: few chunks leave most SMs idle
(GLM-4-9B at 1M tokens: 2 rows x 16 chunks = 32 programs), many give the second pass more
candidates. This measures both passes per setting at the decode shapes of the benchmarks.
`--vary radix` keeps the shipped chunking and varies radix_bits, the bits a pass of the top-k's
threshold search fixes (32 / bits serial passes of one block reduction each).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from lockserve.kernels.score import PageScores  # noqa: E402
from lockserve.kernels.select import DecodeRows, PoolAddress  # noqa: E402
from lockserve.kernels.triton import select as tsel  # noqa: E402

from lockserve.provenance import command_line, run_provenance  # noqa: E402

# (name, Bt, Hkv, G, pages, k)
SHAPES = [("glm4-1m", 1, 2, 16, 65536, 128), ("llama8b-128k", 1, 8, 4, 8192, 128),
          ("llama8b-512k", 1, 8, 4, 32768, 128), ("smollm2-128k", 1, 3, 3, 8192, 128),
          ("llama8b-16x32k", 16, 8, 4, 2048, 128)]
# (MIN_CHUNK, MAX_CHUNK, TARGET_CHUNKS); the first is the shipped setting
SETTINGS = [(1024, 4096, 16), (1024, 2048, 32), (512, 2048, 64), (1024, 1024, 64), (512, 1024, 128),
            (256, 512, 256), (512, 512, 128)]
# the shipped setting first
RADIX = [tsel.DEFAULT_RADIX_BITS] + [b for b in tsel.RADIX_BITS_CHOICES if b != tsel.DEFAULT_RADIX_BITS]


def inputs(bt, hkv, g, p, device):
    gen = torch.Generator(device=device).manual_seed(0)
    s_hat = torch.randn(bt, hkv, g, p, device=device, generator=gen)
    mx = s_hat.amax(-1)
    stats = torch.stack([mx, torch.exp(s_hat - mx[..., None]).sum(-1)], -1).contiguous()
    rows = DecodeRows(torch.arange(bt * p, device=device, dtype=torch.int32).view(bt, p),
                      torch.full((bt,), p, device=device, dtype=torch.int32),
                      torch.full((bt,), 128, device=device, dtype=torch.int32),
                      torch.full((bt,), 5, device=device, dtype=torch.int32),
                      torch.arange(bt, device=device, dtype=torch.int32))
    return PageScores(s_hat, stats), rows


def time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vary", choices=("chunking", "radix"), default="chunking")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows_out = []
    for name, bt, hkv, g, p, k in SHAPES:
        scores, rows = inputs(bt, hkv, g, p, dev)
        where = PoolAddress(0, 0, 0)
        ref = None
        for setting in (SETTINGS if args.vary == "chunking" else RADIX):
            bits = tsel.DEFAULT_RADIX_BITS
            if args.vary == "chunking":
                # a probe of the launcher's private chunking constants
                tsel.MIN_CHUNK, tsel.MAX_CHUNK, tsel.TARGET_CHUNKS = setting
            else:
                bits = setting
            run = functools.partial(tsel.decode_selection_triton, scores, rows, k, 1, 2, hkv, 16, where, bits)
            sel = run()
            same = ref is None or torch.equal(sel.slots, ref.slots)
            ref = ref or sel
            total = time_us(run)
            topk = time_us(functools.partial(tsel._chunk_topk, scores, rows, k, 1, 2, hkv, bits))
            row = dict(shape=name, setting=setting, total_us=round(total, 2), chunk_topk_us=round(topk, 2),
                       same_selection=same)
            print(row, flush=True)
            rows_out.append(row)
    head = {**run_provenance(command_line("scripts/select_chunk_sweep.py")), "vary": args.vary}
    args.out.write_text(json.dumps({**head, "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
