"""start_engine on a simulated cluster (ray.cluster_utils.Cluster): a head without the
lockserve_node resource and three marked nodes. One PageStoreActor per marked node (none on the
head), each worker on its planned node attached to its own node's segment, requests spread."""

from __future__ import annotations

import asyncio
import os
import secrets

import pytest
import ray
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.engine_client import RequestOptions, SamplingParams, WorkerUnavailable
from lockserve.cluster.placement import lockserve_nodes, node_infos, plan_workers
from lockserve.configs.schema import ServeConfig
from ray.cluster_utils import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NUM_NODES = 3


@pytest.fixture(scope="module")
def cluster():
    assert not ray.is_initialized(), "another test left Ray running"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        tags = {}
        for i in range(NUM_NODES):
            node = cluster.add_node(num_cpus=1, resources={"lockserve_node": 1, f"test_node_{i}": 1})
            tags[node.node_id] = i
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        yield cluster, tags
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def engine(cluster):
    config = ServeConfig(
        model={"source": "preset:tiny", "device": "cpu", "dtype": "float32"},
        cache={"tier": "host", "budget_tokens": 64, "host_capacity_gib": 0.02, "hot_cache_pages": 64},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 96, "prefill_chunk": 48},
        ray={"cpu_only": True, "num_gpu_workers": NUM_NODES,
             "namespace": f"lockserve-test-{secrets.token_hex(4)}"},
    )
    client = start_engine(config)
    try:
        yield client
    finally:
        client.close()


def test_one_store_per_marked_node_and_workers_on_their_planned_nodes(cluster, engine):
    _, tags = cluster
    stores = ray.get([s.describe.remote() for s in engine.stores])
    store_nodes = [s["node_id"] for s in stores]
    assert sorted(store_nodes) == sorted(tags), "one store on each marked node, none on the head"
    plan = plan_workers(lockserve_nodes(node_infos(ray.nodes())), NUM_NODES, cpu_only=True)
    assert sorted(plan) == sorted(tags), "three CPU workers spread over the three marked nodes"
    healths = ray.get([w.health.remote() for w in engine.workers])
    assert [h["node_id"] for h in healths] == plan
    assert [h["torch_threads"] for h in healths] == [1] * NUM_NODES, "one CPU per simulated node"
    by_node = {s["node_id"]: s for s in stores}
    for rank, health in enumerate(healths):
        region = by_node[health["node_id"]]["regions"][f"worker-{rank}"]
        assert health["arena"] == region["arena"], f"worker {rank} must attach its own node's segment"
        assert os.path.exists(os.path.join(by_node[health["node_id"]]["shm_dir"], health["arena"]))
    assert len({h["arena"] for h in healths}) == NUM_NODES


def test_concurrent_requests_spread_over_the_workers(engine):
    params = SamplingParams(max_tokens=4, temperature=0.0)

    async def run_all():
        async def one(i):
            return [e async for e in engine.generate([70 + i] * 9, params, RequestOptions(), f"m{i}")]
        return await asyncio.gather(*(one(i) for i in range(NUM_NODES)))

    results = asyncio.run(run_all())
    assert all(r[-1].finish_reason in ("stop", "length") for r in results)
    per_worker = ray.get([w.stats.remote() for w in engine.workers])
    assert [s["generated_tokens"] > 0 for s in per_worker] == [True] * NUM_NODES, \
        "least-loaded routing must give each idle worker one of three concurrent requests"
    assert engine.refresh_stats()["workers_alive"] == NUM_NODES


def test_a_dead_worker_stops_getting_requests(engine):
    ray.kill(engine.workers[2], no_restart=True)
    params = SamplingParams(max_tokens=3, temperature=0.0)

    async def round_of_three(tag: str):
        async def one(i):
            try:
                return [e async for e in engine.generate([80 + i] * 5, params, RequestOptions(), f"{tag}{i}")]
            except WorkerUnavailable as err:
                return err
        return await asyncio.gather(*(one(i) for i in range(NUM_NODES)))

    first = asyncio.run(round_of_three("d"))
    failed = [r for r in first if isinstance(r, WorkerUnavailable)]
    assert len(failed) == 1 and "GpuWorker 2 died" in str(failed[0]), first
    assert failed[0].status == 503 and failed[0].retry_after > 0, "a dead worker is a 503 to retry"
    second = asyncio.run(round_of_three("e"))
    assert all(isinstance(r, list) and r[-1].finish_reason for r in second), \
        "the dead worker must be skipped while the live ones serve"


def test_close_unlinks_every_nodes_segment(engine):
    stores = ray.get([s.describe.remote() for s in engine.stores])
    paths = [os.path.join(s["shm_dir"], r["arena"]) for s in stores for r in s["regions"].values()]
    assert len(paths) == NUM_NODES
    engine.close()
    assert ray.is_initialized(), "close() must not stop a Ray it did not start"
    assert [p for p in paths if os.path.exists(p)] == []
