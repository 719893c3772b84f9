"""start_engine on a GPU machine (marked gpu; runs on the lent H200): one GpuWorker per GPU, each
maps its node store's segment and registers it with CUDA (the zero-copy path), and streams the
same tokens as the in-process Engine on the same device."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import ray
import torch
from lockserve.cluster.bootstrap import start_engine
from lockserve.cluster.engine_client import RequestOptions, SamplingParams
from lockserve.configs.schema import ServeConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams as EngineSamplingParams
from lockserve.workers.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


def gpu_config() -> ServeConfig:
    return ServeConfig(
        model={"source": "preset:tiny", "device": "auto", "dtype": "bfloat16"},
        cache={"tier": "host", "budget_tokens": 64, "host_capacity_gib": 0.25, "hot_cache_pages": 256},
        scheduler={"max_num_seqs": 4, "max_num_batched_tokens": 96, "prefill_chunk": 48},
        ray={"num_gpu_workers": torch.cuda.device_count(), "namespace": f"lockserve-{secrets.token_hex(4)}"},
    )


def test_gpu_workers_register_their_store_segment_and_match_in_process():
    assert not ray.is_initialized(), "another test left Ray running"
    config = gpu_config()
    client = start_engine(config)
    try:
        healths = ray.get([w.health.remote() for w in client.workers])
        regions = {name: r for s in ray.get([s.describe.remote() for s in client.stores])
                   for name, r in s["regions"].items()}
        for rank, health in enumerate(healths):
            assert health["device"].startswith("cuda"), health
            assert health["arena"] == regions[f"worker-{rank}"]["arena"]
            assert health["arena_registered"], "the GPU must map the store's segment (cudaHostRegister)"
            assert health["warm_up_s"] > 0, "a GPU worker runs its warm-up request before it is ready"
        prompt = list(range(40, 77))

        async def run():
            params = SamplingParams(max_tokens=6, temperature=0.0)
            return [e async for e in client.generate(prompt, params, RequestOptions(), "g0")]

        events = asyncio.run(run())
    finally:
        client.close()
    model, tokenizer = load_model("preset:tiny", device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, tokenizer, config.cache, config.scheduler, "cuda", max_pages=64)
    engine.add_request("ref", prompt, EngineSamplingParams(temperature=0, max_tokens=6))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    engine.close()
    assert [t for e in events for t in e.token_ids] == tokens
