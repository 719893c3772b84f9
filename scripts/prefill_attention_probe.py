"""Which attention kernel a prefill should run on this GPU: one layer of Llama-3.1-8B's attention
(32 query heads over 8 KV heads, d = 128, bf16) timed per torch backend, causal over a whole
prompt (the plain anchor's call) and a chunk over a long prefix (the engine's call).

    python scripts/prefill_attention_probe.py --tokens 32768 131072 --chunk 8192 --out probe.json

Backends: FlashAttention-2 through aten._flash_attention_forward (GQA native, bottom-right
causal: the engine's), SDPA with each backend forced (flash with enable_gqa, cuDNN and
memory-efficient with K/V repeated to the query heads), and cuDNN with enable_gqa where torch
takes it. TFLOP/s count the causal half: 4 * d * Hq * (keys each query sees).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lockserve.provenance import command_line, run_provenance

HQ, HKV, D = 32, 8, 128


def timed(fn, repeats: int = 5) -> float:
    """Median seconds of fn() on the current stream (CUDA events), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def flops(n: int, length: int) -> float:
    """Causal attention FLOPs of n queries at the end of `length` keys."""
    return 4 * D * HQ * (n * (length - n) + n * (n + 1) / 2)


def cases(n: int, length: int) -> dict:
    dev = "cuda"
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(length, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    square = n == length
    out = {}

    def fa2():
        return torch.ops.aten._flash_attention_forward(q[None], k[None], v[None], None, None, n, length, 0.0,
                                                       True, False)[0]

    out["aten_flash_gqa_bottom_right"] = fa2
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if square:
        kr, vr = kh.repeat_interleave(HQ // HKV, 1), vh.repeat_interleave(HQ // HKV, 1)
        for name, backend, kk, vv, gqa in (("sdpa_flash_gqa", SDPBackend.FLASH_ATTENTION, kh, vh, True),
                                           ("sdpa_cudnn_gqa", SDPBackend.CUDNN_ATTENTION, kh, vh, True),
                                           ("sdpa_cudnn_repeat", SDPBackend.CUDNN_ATTENTION, kr, vr, False),
                                           ("sdpa_default_repeat", None, kr, vr, False)):
            def call(backend=backend, kk=kk, vv=vv, gqa=gqa):
                if backend is None:
                    return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, enable_gqa=gqa)
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qh, kk, vv, is_causal=True, enable_gqa=gqa)
            out[name] = call
    else:
        kr, vr = kh.repeat_interleave(HQ // HKV, 1), vh.repeat_interleave(HQ // HKV, 1)
        pre = length - n

        def cudnn_split():
            # prefix unmasked + chunk causal (square), each with its LSE, merged
            a = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kr[:, :, :pre], vr[:, :, :pre], None,
                                                                   True, 0.0, False, False)
            b = torch.ops.aten._scaled_dot_product_cudnn_attention(qh, kr[:, :, pre:], vr[:, :, pre:], None,
                                                                   True, 0.0, True, False)
            return a[0], a[1], b[0], b[1]

        out["cudnn_split_repeat"] = cudnn_split
    return out


def first_calls(length: int, chunk: int) -> list[dict]:
    """cuDNN builds an execution plan per new shape: the first call of a chunk over each prefix a
    chunked prefill meets (and a short warm chunk) against a repeat of the same call."""
    rows = []
    shapes = ((chunk, chunk), (2 * chunk, chunk), (length - chunk, chunk), (length - 16, 16),
              (length - 48, 48))
    for pre, n in shapes:
        fn = cases(n, pre + n)["cudnn_split_repeat"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        rows.append({"case": "cudnn_first_call", "queries": n, "keys": pre + n, "first_ms": 1e3 * first,
                     "again_ms": 1e3 * (time.perf_counter() - t0)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--out", required=True)
    p.add_argument("--first-calls", action="store_true", help="also time cuDNN's first call at new shapes")
    args = p.parse_args(argv)
    rows = first_calls(max(args.tokens), args.chunk) if args.first_calls else []
    for length in args.tokens:
        for n in (length, args.chunk):
            for name, fn in cases(n, length).items():
                try:
                    s = timed(fn)
                    row = {"case": name, "queries": n, "keys": length, "ms": 1e3 * s,
                           "tflops": flops(n, length) / s / 1e12}
                except Exception as err:  # a backend that refuses the shape: say which and why
                    row = {"case": name, "queries": n, "keys": length,
                           "error": f"{type(err).__name__}: {err}"[:300]}
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
            torch.cuda.empty_cache()
    result = {**run_provenance(command_line("scripts/prefill_attention_probe.py", argv)),
              "cudnn": torch.backends.cudnn.version(), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
