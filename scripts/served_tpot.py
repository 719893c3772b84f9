"""What an OpenAI client sees per token from the served stack, against the engine's own step.

    python scripts/served_tpot.py OUT.json [--config F] [--set KEY=VALUE ...]
        [--prompt-tokens 32768] [--max-tokens 128] [--requests 3]

Starts Ray and the workers of the config in this process (lockserve.cluster.bootstrap, as
`lockserve serve` does), serves the HTTP app on 127.0.0.1 (a free port) and streams --requests
completions of one passkey prompt, one after another, over real HTTP (greedy, ignore_eos), timing
every server-sent event at the client. The first request is the warm-up (it captures the decode
graphs) and is reported but not summarised. Then it stops the server and Ray and decodes the same
prompt twice with an in-process Engine built as a worker builds it, timing the second run.

Per request: TTFT and the time per output token after the first (client clock); the engine's:
prefill time and time per output token. Also whether the served text equals the engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.measure.eval.passkey import build_passkey_prompt
from lockserve.cluster.runner import BackgroundServer, resolve_server_config
from lockserve.cluster.server import build_app
from lockserve.configs import load_config, parse_override
from lockserve.workers.actors import auto_capacity, worker_cache, worker_device, worker_model
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.kv_manager import kv_pages
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.loader import load_model

from lockserve.provenance import command_line, run_provenance


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="JSON file to write")
    p.add_argument("--config", help="YAML config (default: the packaged serve.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config field")
    p.add_argument("--prompt-tokens", type=int, default=32768)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=3, help="served requests, the first a warm-up (>= 2)")
    args = p.parse_args(argv)
    if args.requests < 2 or args.max_tokens < 2 or args.prompt_tokens < 64:
        p.error("--requests and --max-tokens must be >= 2, --prompt-tokens >= 64")
    return args


def per_token_ms(times: list[float]) -> float:
    """Mean time between output tokens after the first, in ms. times: each token's arrival [s]."""
    return 1e3 * (times[-1] - times[0]) / (len(times) - 1)


async def stream_once(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streamed completion: TTFT, each event's arrival, the text, the completion's tokens."""
    sent, arrivals, text, usage = time.perf_counter(), [], [], None
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"POST /v1/completions: {resp.status_code} {(await resp.aread()).decode()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                    text.append(choice["text"])
    tokens = usage["completion_tokens"] if usage else len(arrivals)
    # An event may carry several tokens: the decode's time is spread over the tokens after the first.
    decode_ms = 1e3 * (arrivals[-1] - arrivals[0]) / max(tokens - 1, 1)
    return {"ttft_ms": 1e3 * (arrivals[0] - sent), "tpot_ms": decode_ms, "events": len(arrivals),
            "completion_tokens": tokens, "text": "".join(text)}


def served(config, prompt_ids: list[int], args) -> tuple[list[dict], dict]:
    """Stream args.requests completions through Ray and HTTP; (per request, the server's metrics)."""
    engine = start_engine(config)
    try:
        server = resolve_server_config(config.server.model_copy(
            update={"host": "127.0.0.1", "port": 0, "log_level": "warning"}))
        key = server.api_key.get_secret_value() if server.api_key else None
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with BackgroundServer(build_app(engine, server), server) as srv:
            body = {"model": engine.model_name, "prompt": prompt_ids, "max_tokens": args.max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}

            async def run() -> list[dict]:
                async with httpx.AsyncClient(timeout=600, headers=headers) as client:
                    return [await stream_once(client, srv.url, body) for _ in range(args.requests)]

            results = asyncio.run(run())
            metrics = httpx.get(srv.url + "/metrics", timeout=30, headers=headers).text
    finally:
        engine.close()
    return results, server_tpot(metrics)


def server_tpot(metrics: str) -> dict:
    """The server's own time-per-output-token histogram: its mean over every request, in ms."""
    values = {}
    for line in metrics.splitlines():
        for key in ("sum", "count"):
            if line.startswith(f"lockserve_time_per_output_token_seconds_{key} "):
                values[key] = float(line.split()[-1])
    if not values.get("count"):
        return {"tpot_ms_mean": None, "count": 0}
    return {"tpot_ms_mean": 1e3 * values["sum"] / values["count"], "count": int(values["count"])}


def in_process(config, prompt_ids: list[int], args) -> dict:
    """The same prompt decoded twice by an Engine built as a worker builds one; the second timed."""
    device = worker_device(config.model.device, config.ray.cpu_only)
    model, tokenizer = worker_model(config.model, device)
    cache = worker_cache(config.cache, 1.0, auto_capacity(config.cache, device, None))
    mc = model.config
    max_len = min(mc.max_position_embeddings, config.model.max_model_len or mc.max_position_embeddings)
    engine = Engine(model, tokenizer, cache, config.scheduler, device,
                    max_pages=kv_pages(mc, cache, config.scheduler.max_num_seqs, max_len, model.dtype),
                    max_model_len=config.model.max_model_len)
    try:
        runs = [decode_in_process(engine, f"ref{i}", prompt_ids, args.max_tokens) for i in range(2)]
    finally:
        engine.close()
    timed = runs[1]
    return {**{k: v for k, v in timed.items() if k != "ids"}, "text": tokenizer.decode(timed["ids"]),
            "device": str(device)}


def decode_in_process(engine: Engine, rid: str, prompt_ids: list[int], n: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(rid, prompt_ids, params)
    ids, times = [], []
    while engine.has_unfinished():
        for out in engine.step():
            ids += out.token_ids
            times += [time.perf_counter()] * len(out.token_ids)
    return {"prefill_ms": 1e3 * (times[0] - start), "tpot_ms": per_token_ms(times), "ids": ids}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = load_config(args.config, dict(parse_override(item) for item in args.set))
    _, tokenizer = load_model(config.model.source, device=torch.device("cpu"))
    prompt = build_passkey_prompt(tokenizer, args.prompt_tokens, 0.5)
    requests, server = served(config, prompt.prompt_ids, args)
    engine = in_process(config, prompt.prompt_ids, args)
    timed = requests[1:]
    out = {
        **run_provenance(command_line("scripts/served_tpot.py", argv), engine["device"]),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "model": config.model.source, "tier": config.cache.tier, "attention": config.cache.attention,
        "budget_tokens": config.cache.budget_tokens, "prompt_tokens": len(prompt.prompt_ids),
        "max_tokens": args.max_tokens,
        "served": {"requests": requests, "warmup_requests": 1,
                   "ttft_ms_median": statistics.median(r["ttft_ms"] for r in timed),
                   "tpot_ms_median": statistics.median(r["tpot_ms"] for r in timed),
                   "server_histogram": server},
        "engine": engine,
    }
    out["served_over_engine_tpot"] = out["served"]["tpot_ms_median"] / engine["tpot_ms"]
    out["same_text_as_engine"] = all(r["text"] == engine["text"] for r in requests)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    s = out["served"]
    print(f"served: TTFT {s['ttft_ms_median']:.1f} ms, {s['tpot_ms_median']:.3f} ms/token; engine: prefill "
          f"{engine['prefill_ms']:.1f} ms, {engine['tpot_ms']:.3f} ms/token; ratio "
          f"{out['served_over_engine_tpot']:.2f}; same text: {out['same_text_as_engine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
