"""LOCKS pruning through Ray and HTTP: prompts of 8 to 16 times the budget on a local Ray instance
(the tiny preset on a CPU worker, tier host in real shared memory) behind the real HTTP server,
against the in-process Engine at the same budget: the same greedy tokens.

That a request was pruned, not attended densely, is counted, not assumed. On tier host every full
page a decode step attends is looked up in the hot-page cache once per layer and KV head (the open
page is read from the write pool), so the worker's cache_hits + cache_misses over a request are
the full pages its decode steps attended. Over Ray and HTTP that count equals the in-process
engine's and falls far short of the context's full pages; the in-process engine's recorded
selections hold the budget's pages of the context at every step and layer; its tokens differ from
dense attention's. A control engine whose budget covers the context looks up every full page: the
count tells a pruned request from a dense one. One request runs the Triton kernels (Triton's
interpreter, `model.kernels: ops`) in the worker, through Ray and HTTP, against the in-process
engine on the pure-torch reference kernels.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import secrets
from dataclasses import dataclass

import httpx
import openai
import pytest
import ray
import torch
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.engine_client import RequestOptions, SamplingParams
from lockserve.cluster.runner import BackgroundServer
from lockserve.cluster.server import build_app
from lockserve.configs.schema import ServeConfig
from lockserve.workers.actors import NODE_RESOURCE
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams as EngineSamplingParams
from lockserve.workers.model.loader import load_model

from tests.conftest import record_selections

pytestmark = pytest.mark.timeout(600)

PAGE, BUDGET = 16, 128  # 8 pages: the sink, 2 recent (the open page one of them), 5 by LOCKS score
CONFIG = ServeConfig(
    model={"source": "preset:tiny", "device": "cpu", "dtype": "float32"},
    cache={"tier": "host", "page_size": PAGE, "budget_tokens": BUDGET, "host_capacity_gib": 0.05,
           "hot_cache_pages": 256},
    scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 512, "prefill_chunk": 256},
    server={"port": 0, "log_level": "warning"},
    ray={"cpu_only": True, "num_gpu_workers": 1, "namespace": f"lockserve-sparse-{secrets.token_hex(4)}"},
)
MAX_TOKENS = 16
DOC = [(i * 37 + 11) % 250 for i in range(1000)]  # 62 full pages and an open one: 8 x the budget
OTHER = [(i * 53 + 5) % 240 for i in range(700)]
SHORT = list(range(60, 100))  # 40 tokens: inside the budget, every page attended
TEXT = "".join(chr(97 + (i * 7 + i // 26) % 26) for i in range(1100))  # BOS + 1,100 bytes


@functools.cache
def tiny():
    return load_model("preset:tiny", device="cpu", dtype=torch.float32)


@dataclass(frozen=True)
class Run:
    """One greedy request on an in-process Engine. page_reads: the full pages its decode steps
    attended, summed over layers and KV heads (hot-cache lookups); selections: [step][layer][KV
    head] the page positions LOCKS selected (scored steps; the torch kernels only)."""

    tokens: list[int]
    text: str
    page_reads: int
    selections: list[list[list[list[int]]]]


def page_reads(stats: dict) -> int:
    return stats["cache_hits"] + stats["cache_misses"]


def run_alone(engine: Engine, prompt: list[int], max_tokens: int = MAX_TOKENS,
              options: RequestOptions | None = None) -> Run:
    """One greedy request on `engine`, alone; closes the engine."""
    params = EngineSamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with record_selections() as recorder:
        engine.add_request("ref", prompt, params, options)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
    reads = page_reads(engine.stats())
    engine.close()
    return Run([t for o in outs for t in o.token_ids], "".join(o.text for o in outs), reads,
               recorder.by_step(engine.model.config.num_layers))


@functools.cache
def in_process(prompt: tuple[int, ...], attention: str = "locks", budget_tokens: int | None = None,
               request_budget: int | None = None) -> Run:
    """The in-process Engine alone (no Ray, no loop), greedy over MAX_TOKENS, with CONFIG's model,
    cache and scheduler but `attention`; budget_tokens: the engine's budget (None: CONFIG's);
    request_budget: the request's (RequestOptions.budget_tokens)."""
    model, tokenizer = tiny()
    cache = CONFIG.cache.resolved(CONFIG.cache.host_capacity_gib).model_copy(update={
        "attention": attention, "budget_tokens": budget_tokens or BUDGET,
        "hot_cache_pages": 1024})  # room for a budget past the context (the control)
    engine = Engine(model, tokenizer, cache, CONFIG.scheduler, "cpu")
    return run_alone(engine, list(prompt), options=RequestOptions(budget_tokens=request_budget))


def context_page_reads(prompt_len: int, page: int = PAGE, max_tokens: int = MAX_TOKENS) -> int:
    """Full pages a decode that attends every page reads, over layers and KV heads: decode step j
    (1..max_tokens - 1; the first token is the prefill's) holds prompt_len + j - 1 tokens before its
    own, of which (prompt_len + j - 1) // page are in full pages."""
    mc = tiny()[0].config
    full = sum((prompt_len + j - 1) // page for j in range(1, max_tokens))
    return full * mc.num_layers * mc.num_kv_heads


def pruned_page_reads(budget_tokens: int, page: int = PAGE, max_tokens: int = MAX_TOKENS) -> int:
    """Full pages a LOCKS decode reads when the context exceeds the budget: the budget's pages but
    the open one, per step, layer and KV head."""
    mc = tiny()[0].config
    return (budget_tokens // page - 1) * (max_tokens - 1) * mc.num_layers * mc.num_kv_heads


@pytest.fixture(scope="module")
def local_ray():
    assert not ray.is_initialized(), "another test left Ray running"
    ray.init(address="local", include_dashboard=False, num_cpus=4, resources={NODE_RESOURCE: 1})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def engine(local_ray):
    client = start_engine(CONFIG)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(build_app(engine, CONFIG.server), CONFIG.server) as running:
        yield running


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


async def collect(engine, prompt, request_id: str, options: RequestOptions | None = None):
    return [ev async for ev in engine.generate(prompt, greedy(), options or RequestOptions(), request_id)]


def served_reads(engine, run) -> tuple[object, int]:
    """run()'s result and the full pages the worker's decode steps attended meanwhile."""
    before = page_reads(engine.refresh_stats())
    result = run()
    return result, page_reads(engine.refresh_stats()) - before


# ----- the count, in process ----------------------------------------------------------------------


def test_the_page_count_tells_a_pruned_request_from_a_dense_one():
    """Control for the tests below: with a budget that covers the context, LOCKS attends every
    page, looks up every full page (the dense count) and gives dense attention's tokens; at the
    budget it looks up 7 of every step's 62-63 full pages and its tokens part from dense's."""
    covering = PAGE * (math.ceil((len(DOC) + MAX_TOKENS) / PAGE) + 1)
    whole, dense = in_process(tuple(DOC), budget_tokens=covering), in_process(tuple(DOC), attention="dense")
    assert whole.page_reads == context_page_reads(len(DOC)), "a budget past the context reads every page"
    assert whole.tokens == dense.tokens
    pruned = in_process(tuple(DOC))
    assert pruned.page_reads == pruned_page_reads(BUDGET) < context_page_reads(len(DOC)) / 8
    assert pruned.tokens != dense.tokens, "pruning must change these tokens, or equal tokens show nothing"
    budget_pages, mc = BUDGET // PAGE, tiny()[0].config
    assert len(pruned.selections) == MAX_TOKENS - 1
    for step, layers in enumerate(pruned.selections):
        assert len(layers) == mc.num_layers
        for heads in layers:
            context_pages = (len(DOC) + step) // PAGE + 1
            assert [len(h) for h in heads] == [budget_pages] * mc.num_kv_heads, (step, heads)
            assert all(h[0] == 0 and h[-1] == context_pages - 1 for h in heads), "the sink and the open page"
    assert any(a != b for layers in pruned.selections for a, b in layers), "KV heads choose their own pages"


# ----- Ray -----------------------------------------------------------------------------------------


def test_a_pruned_ray_stream_equals_the_in_process_engine(engine):
    events, reads = served_reads(engine, lambda: asyncio.run(collect(engine, DOC, "doc")))
    expected = in_process(tuple(DOC))
    assert [t for e in events for t in e.token_ids] == expected.tokens
    assert "".join(e.text for e in events) == expected.text
    assert reads == expected.page_reads == pruned_page_reads(BUDGET), "the worker's decode read the budget"
    assert reads < context_page_reads(len(DOC)) / 8
    assert expected.tokens != in_process(tuple(DOC), attention="dense").tokens


def test_pruned_and_unpruned_requests_batched_over_ray_keep_their_own_tokens(engine):
    """Three rows decoded together: one pruned at the engine's budget, one at a request budget of
    64 tokens, one inside its budget (every page); each gets its tokens alone in process."""
    cases = [("doc", DOC, None), ("other-64", OTHER, 64), ("short", SHORT, None)]

    async def all_at_once():
        return await asyncio.gather(*(collect(engine, p, rid, RequestOptions(budget_tokens=b))
                                      for rid, p, b in cases))

    results, reads = served_reads(engine, lambda: asyncio.run(all_at_once()))
    expected = [in_process(tuple(p), request_budget=b) for _, p, b in cases]
    for (rid, prompt, _), events, want in zip(cases, results, expected, strict=True):
        assert [t for e in events for t in e.token_ids] == want.tokens, f"{rid} ({len(prompt)} tokens)"
    assert expected[1].page_reads == pruned_page_reads(64) < context_page_reads(len(OTHER)) / 10
    assert expected[2].page_reads == context_page_reads(len(SHORT)), "inside its budget: every page"
    assert reads == sum(w.page_reads for w in expected)
    assert expected[1].tokens != in_process(tuple(OTHER)).tokens, "the request budget took effect"


# ----- HTTP ----------------------------------------------------------------------------------------


def sse_text(response) -> tuple[str, dict]:
    """The streamed completion text and the usage of an SSE response."""
    text, usage = "", None
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            text += "".join(c["text"] for c in event["choices"])
            usage = event.get("usage") or usage
    return text, usage


def test_a_pruned_sse_stream_equals_the_in_process_engine(server, engine):
    ids = tiny()[1].encode(TEXT)
    body = {"model": engine.model_name, "prompt": TEXT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    def stream():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            return sse_text(r)

    (text, usage), reads = served_reads(engine, stream)
    expected = in_process(tuple(ids))
    assert len(ids) == 1101 and usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == MAX_TOKENS
    assert text == expected.text
    assert reads == expected.page_reads == pruned_page_reads(BUDGET) < context_page_reads(len(ids)) / 8
    assert expected.tokens != in_process(tuple(ids), attention="dense").tokens


def test_a_request_budget_over_http_prunes_as_in_process(server, engine):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        out, reads = served_reads(engine, lambda: client.completions.create(
            model=engine.model_name, prompt=DOC, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "budget_tokens": 64}))
    expected = in_process(tuple(DOC), request_budget=64)
    assert out.choices[0].text == expected.text and out.usage.completion_tokens == MAX_TOKENS
    assert reads == expected.page_reads == pruned_page_reads(64) < context_page_reads(len(DOC)) / 16
    assert expected.tokens != in_process(tuple(DOC)).tokens, "64 tokens must not select what 128 do"


# ----- the Triton kernels in the worker (interpreter) --------------------------------------------

# Triton's interpreter runs a program per token and layer in the fused RoPE write (~10 ms each on a
# CI core): a prompt of 192 tokens in pages of 8, 4 x a budget of 6 pages, over 6 tokens.
TRITON_PAGE, TRITON_BUDGET, TRITON_TOKENS = 8, 48, 6
TRITON_PROMPT = [(i * 29 + 3) % 250 for i in range(192)]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU need TRITON_INTERPRET=1 (make test sets it)")
def test_the_triton_kernels_serve_a_pruned_request_through_ray_and_http(local_ray):
    config = CONFIG.model_copy(deep=True)
    config.model.kernels = "ops"
    config.cache.page_size, config.cache.budget_tokens = TRITON_PAGE, TRITON_BUDGET
    config.ray.namespace = CONFIG.ray.namespace + "-triton"
    served = start_engine(config)
    try:
        [health] = [ray.get(w.health.remote(), timeout=30) for w in served.workers]
        assert health["attention_backend"] == "triton", health
        with BackgroundServer(build_app(served, config.server), config.server) as server:
            body = {"model": served.model_name, "prompt": TRITON_PROMPT, "max_tokens": TRITON_TOKENS,
                    "temperature": 0, "ignore_eos": True}
            r, reads = served_reads(served, lambda: httpx.post(server.url + "/v1/completions", json=body,
                                                               timeout=300))
        assert r.status_code == 200, r.text
    finally:
        served.close()
    expected = _in_process_reference(config)
    assert r.json()["choices"][0]["text"] == expected.text
    assert reads == expected.page_reads == pruned_page_reads(TRITON_BUDGET, TRITON_PAGE, TRITON_TOKENS)
    assert reads < context_page_reads(len(TRITON_PROMPT), TRITON_PAGE, TRITON_TOKENS) / 3


def _in_process_reference(config: ServeConfig) -> Run:
    """TRITON_PROMPT on an in-process Engine with config's cache and the pure-torch reference
    kernels: the worker's Triton kernels must select the same pages and give the same tokens. (The
    reference, not the Triton kernels again in process: that took ~30 s of interpreter per run.)"""
    model, tokenizer = tiny()
    engine = Engine(model, tokenizer, config.cache.resolved(0.05), config.scheduler, "cpu",
                    kernels="reference")
    assert engine.attention.backend == "torch"
    return run_alone(engine, TRITON_PROMPT, TRITON_TOKENS)
