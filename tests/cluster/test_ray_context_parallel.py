"""One request over three simulated nodes (ray.cluster_utils.Cluster, real gloo, real HTTP).

start_engine with context_parallel.ranks 3: one CpRank per marked node beside its GpuWorker and
page store. A request of ~28K tokens is sharded over the three ranks and gives exactly the greedy
tokens, and at every decode layer exactly the selected pages, of the same request in one Engine;
a request that does not fit one worker is served over HTTP by several ranks; removing a node
mid-request ends that request with an error naming the node, and a new request on the other nodes
succeeds. The long requests use a synthetic cache fill (random K/V from one seed, summarised by
the real code: Engine.fill_synthetic) in place of their prefill; the HTTP request prefills for real.
"""

from __future__ import annotations

import asyncio
import secrets

import openai
import pytest
import ray
import torch
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.engine_client import RequestError, RequestOptions, SamplingParams
from lockserve.cluster.runner import BackgroundServer
from lockserve.cluster.server import build_app
from lockserve.configs.schema import ServeConfig, ServerConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.model.loader import load_model
from ray.cluster_utils import Cluster

from tests.conftest import record_selections

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_NODES = 3
PAGE_BYTES = 3 * 2 * 2 * 16 * 32 * 4  # one page id of tiny-long in float32: layers x KV heads x K,V x B x d
CONFIG = ServeConfig(
    model={"source": "preset:tiny-long", "device": "cpu", "dtype": "float32"},
    cache={"tier": "host", "budget_tokens": 128, "host_capacity_gib": 64 * PAGE_BYTES / 2**30,
           "hot_cache_pages": 64},
    scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 256, "prefill_chunk": 256},
    ray={"cpu_only": True, "num_gpu_workers": NUM_NODES,
         "namespace": f"lockserve-test-{secrets.token_hex(4)}"},
    context_parallel={"ranks": NUM_NODES, "host_capacity_gib": 700 * PAGE_BYTES / 2**30, "max_requests": 2,
                      "timeout_s": 60},
)
_G = torch.Generator().manual_seed(5)
LONG = torch.randint(0, 256, (28_000,), generator=_G).tolist()  # 1,750 pages: more than two ranks hold
SEED = 11


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test left Ray running"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes = {}
        for _ in range(NUM_NODES):
            node = cluster.add_node(num_cpus=2, resources={"lockserve_node": 1})
            nodes[node.node_id] = node
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def engine(cluster):
    client = start_engine(CONFIG)
    try:
        yield client
    finally:
        client.close()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def reference(prompt: list[int], params: SamplingParams, synthetic_seed: int | None = None):
    """(tokens, text, selections) of the request in one in-process Engine of the same config:
    selections [step][layer][KV head] -> sorted page positions of every scored decode layer."""
    model, tokenizer = load_model("preset:tiny-long", device="cpu", dtype=torch.float32)
    engine = Engine(model, tokenizer, CONFIG.cache.model_copy(update={"host_capacity_gib": 1.0}),
                    CONFIG.scheduler, "cpu", max_pages=2_000)
    text = []
    with record_selections() as recorded:
        try:
            engine.add_request("ref", prompt, params)
            tokens = [engine.fill_synthetic("ref", seed=synthetic_seed)] if synthetic_seed is not None else []
            while engine.has_unfinished():
                for out in engine.step():
                    tokens += out.token_ids
                    text.append(out.text)
        finally:
            engine.close()
    return tokens, "".join(text), recorded.by_step(model.config.num_layers)


async def _collect(engine, prompt, params, request_id, **kw):
    stream = engine.context_parallel.generate(prompt, params, RequestOptions(), request_id, **kw)
    return [ev async for ev in stream]


def test_one_rank_per_node_each_on_its_nodes_store(cluster, engine):
    _, nodes = cluster
    ranks = engine.context_parallel.ranks
    assert sorted(r.node_id for r in ranks) == sorted(nodes), "STRICT_SPREAD: one rank on each marked node"
    stores = {s["node_id"]: s for s in ray.get([s.describe.remote() for s in engine.stores])}
    for r in ranks:
        region = stores[r.node_id]["regions"][f"cp-rank-{r.index}"]
        assert region["num_slots"] == 3 * r.capacity_pages * 2, "the rank's KV: a region of its node's store"
    assert engine.stats()["cp_ranks_alive"] == NUM_NODES


def test_a_request_over_three_ranks_equals_one_engine(engine):
    params = greedy(8)
    trace: dict = {}
    events = asyncio.run(_collect(engine, LONG, params, "long", synthetic_seed=SEED, trace=trace))
    tokens = [t for ev in events for t in ev.token_ids]
    want, want_text, want_selections = reference(LONG, params, SEED)
    assert len(trace["ranks"]) == NUM_NODES, trace["ranks"]
    assert [first for _, first, _ in trace["ranks"]][0] == 0 and events[-1].finish_reason == "length"
    assert tokens == want and "".join(ev.text for ev in events) == want_text
    assert len(trace["selections"]) == len(want_selections) == 7 and trace["selections"] == want_selections, \
        "every decode layer must select exactly the pages one engine selects"
    per_layer = [rep["collectives"]["decode"] for rep in trace["reports"]]
    assert all(c["calls"] == 7 * 3 * 3 for c in per_layer), "three collectives per decode layer"


def test_openai_request_larger_than_one_worker_is_served_by_several_ranks(engine):
    prompt = torch.randint(32, 127, (1_500,), generator=torch.Generator().manual_seed(2)).tolist()
    ids = [256, *prompt]  # BOS + bytes: the byte-level tokenizer
    probe, _, _ = reference(ids, SamplingParams(temperature=0, max_tokens=6))
    stop = [t for i, t in enumerate(probe) if i >= 2 and t not in probe[:i]][:1]  # ends it after a few
    # 1,501 + 10,000 tokens = 720 pages: more than a worker (64) or one rank (700) holds
    tokens, text, _ = reference(ids, SamplingParams(temperature=0, max_tokens=10_000, stop_token_ids=stop))
    before = engine.stats()["cp_requests"]
    server_config = ServerConfig(port=0, log_level="warning", max_tokens_limit=10_000)
    with BackgroundServer(build_app(engine, server_config), server_config) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model=engine.model_name, prompt="".join(map(chr, prompt)),
                                               max_tokens=10_000, temperature=0,
                                               extra_body={"stop_token_ids": stop})
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].text == text
    assert completion.usage.completion_tokens == len(tokens)
    assert engine.stats()["cp_requests"] == before + 1
    used = [s for s in asyncio.run(engine.context_parallel.rank_stats()) if s["prefill_chunks"]]
    assert len(used) >= 2, "the request must have been sharded over several ranks"


def test_a_request_the_ranks_cannot_hold_is_refused_naming_pages_and_nodes(engine):
    with pytest.raises(RequestError) as refused:  # (28,000 + 20,000) / 16 pages; 3 x 700 are free
        engine.check_request(28_000, SamplingParams(max_tokens=20_000), RequestOptions())
    message = refused.value.message
    assert refused.value.status == 400 and refused.value.param == "prompt", message
    assert "needs 3000 KV pages" in message and "700 pages on node" in message, message
    assert all(r.node_id[:12] in message for r in engine.context_parallel.ranks), message


def test_an_aborted_request_stops_and_frees_its_pages_on_every_rank(engine):
    cp = engine.context_parallel

    async def scenario():
        stream = cp.generate(LONG, greedy(300), RequestOptions(), "aborted", synthetic_seed=SEED)
        first = await anext(stream)
        await engine.abort("aborted")  # the client routes it to the coordinator
        return first, [ev async for ev in stream]

    first, rest = asyncio.run(scenario())
    assert [ev.finish_reason for ev in [first, *rest]] == [None] * (1 + len(rest)) and len(rest) <= 1
    assert cp.stats()["cp_pages_reserved"] == 0 and cp.stats()["cp_requests_running"] == 0
    ranks = asyncio.run(cp.rank_stats())
    assert [(r["free_pages"], r["requests"]) for r in ranks] == [(700, 0)] * NUM_NODES


def test_a_removed_node_ends_its_request_and_the_others_serve(cluster, engine):
    cluster_, nodes = cluster
    cp = engine.context_parallel

    async def scenario():
        stream = cp.generate(LONG, greedy(500), RequestOptions(), "doomed", synthetic_seed=SEED)
        first = [await anext(stream), await anext(stream)]
        victim = cp.ranks[1]  # a rank the request uses (all three do)
        await asyncio.to_thread(cluster_.remove_node, nodes[victim.node_id])
        with pytest.raises(RuntimeError) as failed:
            async for _ in stream:
                pass
        return first, victim, str(failed.value)

    first, victim, message = asyncio.run(scenario())
    assert all(ev.finish_reason is None for ev in first)
    assert victim.node_id in message and "its node failed" in message, message
    assert engine.stats()["cp_ranks_alive"] == NUM_NODES - 1
    events = asyncio.run(_collect(engine, LONG[:14_000], greedy(4), "after", synthetic_seed=SEED))
    assert events[-1].finish_reason == "length" and sum(len(ev.token_ids) for ev in events) == 4
