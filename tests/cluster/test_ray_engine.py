"""start_engine on a local Ray instance (real Ray, real shared memory, the tiny preset model on CPU):
the store makes the arena and the worker attaches it, streams equal the in-process Engine's tokens,
concurrent requests keep their own tokens, user errors are 400s, a killed worker comes back on the
same segment, and close() unlinks the segments and stops the Ray it started. The prompts here fit
the 64-token budget (every page attended): test_ray_sparse.py sends pruned requests through Ray."""

from __future__ import annotations

import asyncio
import functools
import os
import secrets
import time

import openai
import pytest
import ray
import torch
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.engine_client import RequestError, RequestOptions, SamplingParams
from lockserve.cluster.runner import BackgroundServer
from lockserve.cluster.server import build_app
from lockserve.configs.loader import ConfigError
from lockserve.configs.schema import ServeConfig, ServerConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams as EngineSamplingParams
from lockserve.workers.model.loader import load_model
from ray.exceptions import RayActorError

pytestmark = pytest.mark.timeout(600)

CONFIG = ServeConfig(
    model={"source": "preset:tiny", "device": "cpu", "dtype": "float32", "cpu_threads": 2},
    cache={"tier": "host", "budget_tokens": 64, "host_capacity_gib": 0.02, "hot_cache_pages": 64},
    scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 96, "prefill_chunk": 48},
    ray={"cpu_only": True, "num_gpu_workers": 1, "namespace": f"lockserve-test-{secrets.token_hex(4)}"},
)
PROMPTS = [list(range(40, 77)), list(range(100, 103)), [65] * 20, list(range(200, 250))]  # 37, 3, 20, 50


@functools.cache
def reference(prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], str]:
    """(tokens, text) of the in-process Engine alone, greedy, same model and cache config."""
    model, tokenizer = load_model("preset:tiny", device="cpu", dtype=torch.float32)
    engine = Engine(model, tokenizer, CONFIG.cache, CONFIG.scheduler, "cpu", max_pages=64)
    engine.add_request("ref", list(prompt), EngineSamplingParams(temperature=0, max_tokens=max_tokens))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    engine.close()
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs)


@pytest.fixture(scope="module")
def engine():
    assert not ray.is_initialized(), "another test left Ray running"
    # Token authentication is Ray's default for a local instance (the token in ~/.ray/auth_token).
    client = start_engine(CONFIG)
    try:
        yield client
    finally:
        client.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


async def collect(engine, prompt, max_tokens: int, request_id: str):
    return [ev async for ev in engine.generate(prompt, greedy(max_tokens), RequestOptions(), request_id)]


def test_worker_attaches_the_segment_its_node_store_created(engine):
    [store], [worker] = engine.stores, engine.workers
    described, health = ray.get(store.describe.remote()), ray.get(worker.health.remote())
    region = described["regions"]["worker-0"]
    assert health["arena"] == region["arena"], "the worker's tier must read the store's segment"
    assert health["pid"] != described["pid"], "store and worker are separate processes"
    assert health["node_id"] == described["node_id"] == ray.get_runtime_context().get_node_id()
    # Ray would run the CPU worker's model on one thread (OMP_NUM_THREADS = its num_cpus, 1): the
    # worker applies model.cpu_threads (the default, the node's CPUs but one: cpu_worker_threads).
    assert health["torch_threads"] == CONFIG.model.cpu_threads == 2, health
    assert os.path.exists(os.path.join(described["shm_dir"], region["arena"]))
    stats = engine.refresh_stats()
    assert stats["bytes_per_tier"]["host"] == region["bytes"] == stats["store_bytes_reserved"]
    assert stats["workers_alive"] == 1 and stats["running"] == 0


def test_stream_equals_the_in_process_engine(engine):
    events = asyncio.run(collect(engine, PROMPTS[0], 6, "one"))
    tokens, text = reference(tuple(PROMPTS[0]), 6)
    assert [t for e in events for t in e.token_ids] == tokens
    assert "".join(e.text for e in events) == text
    assert len(events) == len(tokens), "one event per token: streamed step by step, not at the end"
    assert events[-1].finish_reason in ("stop", "length") and events[-1].completion_tokens == len(tokens)
    assert engine.tokenize("hi") == [256, 104, 105], "the front end tokenizes with the engine's tokenizer"


def test_concurrent_requests_get_their_own_tokens(engine):
    async def all_at_once():
        runs = [collect(engine, p, 4 + i, f"c{i}") for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*runs)

    results = asyncio.run(all_at_once())
    for i, (prompt, events) in enumerate(zip(PROMPTS, results, strict=True)):
        tokens, _ = reference(tuple(prompt), 4 + i)
        got = [t for e in events for t in e.token_ids]
        assert got == tokens, f"request c{i} ({len(prompt)}-token prompt)"
    stats = engine.refresh_stats()
    assert stats["running"] == 0 and stats["pages_used"] == 0


def test_user_errors_are_400s_naming_the_field(engine):
    with pytest.raises(RequestError) as err:
        engine.check_request(4000, greedy(200), RequestOptions())
    assert err.value.status == 400 and err.value.param == "prompt" and "4200 exceeds" in err.value.message
    with pytest.raises(RequestError) as err:
        engine.check_request(5, greedy(4), RequestOptions(tier="hbm"))
    assert err.value.param == "tier"
    with pytest.raises(RequestError) as err:
        asyncio.run(collect(engine, [5, 999], 3, "bad"))
    assert err.value.status == 400 and err.value.message.startswith("prompt_ids[1] (999) must be a token id")


def test_abort_stops_a_stream_and_frees_its_pages(engine):
    async def scenario():
        stream = engine.generate(PROMPTS[0], greedy(500), RequestOptions(), "long")
        first = await stream.__anext__()
        await engine.abort("long")
        rest = [ev async for ev in stream]
        return first, rest

    first, rest = asyncio.run(scenario())
    # Events already produced may still arrive; then the stream ends with no finish_reason.
    assert [e.finish_reason for e in [first, *rest]] == [None] * (1 + len(rest))
    assert len(rest) < 100, "the request must stop long before its 500 tokens"
    stats = engine.refresh_stats()
    assert stats["running"] == 0 and stats["pages_used"] == 0


def test_openai_client_over_http(engine):
    server_config = ServerConfig(port=0, log_level="warning")
    with BackgroundServer(build_app(engine, server_config), server_config) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        prompt_text = "".join(chr(t) for t in PROMPTS[2])  # byte-level tokenizer: BOS + these bytes
        completion = client.completions.create(model=engine.model_name, prompt=prompt_text, max_tokens=5,
                                               temperature=0)
    tokens, text = reference((256, *PROMPTS[2]), 5)
    assert completion.choices[0].text == text and completion.usage.completion_tokens == len(tokens)


def _health_of_new_process(worker, old_pid: int, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            health = ray.get(worker.health.remote(), timeout=30)
            if health["pid"] != old_pid:
                return health
        except RayActorError:  # restarting
            pass
        time.sleep(0.5)
    raise AssertionError(f"the GpuWorker did not come back within {timeout_s} s")


def test_killed_worker_restarts_on_the_same_segment(engine):
    [store], [worker] = engine.stores, engine.workers
    before, store_before = ray.get(worker.health.remote()), ray.get(store.describe.remote())
    segment = os.path.join(store_before["shm_dir"], before["arena"])
    ray.kill(worker, no_restart=False)
    assert ray.get(store.describe.remote()) == store_before, "the store and its regions outlive the worker"
    assert os.path.exists(segment)
    after = _health_of_new_process(worker, before["pid"])
    assert after["arena"] == before["arena"], "the restarted worker re-attaches its region"
    assert after["restarted"] and after["restart_delay_s"] == CONFIG.ray.restart_backoff_s
    deadline = time.monotonic() + 10
    while engine.health()["ready"] < 1 and time.monotonic() < deadline:  # the monitor's next probe
        time.sleep(0.1)
    assert engine.health()["ready"] == 1, engine.health()
    assert ray.get(store.describe.remote())["regions"] == store_before["regions"]
    events = asyncio.run(collect(engine, PROMPTS[1], 5, "after-restart"))
    assert [t for e in events for t in e.token_ids] == reference(tuple(PROMPTS[1]), 5)[0]


def test_a_model_that_cannot_load_is_a_config_error_and_leaves_nothing(engine):
    namespace = f"{CONFIG.ray.namespace}-bad"
    bad = CONFIG.model_copy(update={"model": CONFIG.model.model_copy(update={"source": "preset:nope"}),
                                    "ray": CONFIG.ray.model_copy(update={"namespace": namespace})})
    expected = r"^GpuWorker 0 could not start: ValueError: preset \('nope'\) is unknown"
    with pytest.raises(ConfigError, match=expected):
        start_engine(bad)  # Ray is already up (the module's engine): it is joined, not started
    assert ray.is_initialized(), "a failed start must not stop a Ray it did not start"

    def left():
        return [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace]

    deadline = time.monotonic() + 30
    while left() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left() == [], "the failed start's store and worker must be gone"


def test_close_unlinks_segments_and_stops_the_ray_it_started(engine):
    described = ray.get(engine.stores[0].describe.remote())
    segment = os.path.join(described["shm_dir"], described["regions"]["worker-0"]["arena"])
    engine.close()
    engine.close()
    assert not ray.is_initialized()
    assert not os.path.exists(segment)
