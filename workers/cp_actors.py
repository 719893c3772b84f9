"""The Ray actor of a context-parallel rank: `CpRank` (one per node, placed by the coordinator).

    CpRank   the whole model and a ShardEngine (workers/engine/context_parallel.py): this rank's share
             of the pages of every request sharded over it, in a region of its node's page store
             (tier host), the GPU (hbm) or its own NVMe directory (host+nvme). Per sharded request
             it joins a torch.distributed group with the request's other ranks (gloo on CPU, NCCL
             on GPU; rendezvous through a TCP store on rank 0, on a port the OS picks).

A sync actor of max_concurrency 1: its calls run one at a time, in the order they arrive, so a rank
blocked in a collective answers nothing else. The coordinator (lockserve.cluster.context_parallel)
therefore calls every rank of a request for each step and never interleaves two requests' steps
on ranks they share. Ray carries control (tokens, positions, page ranges); KV pages never leave
the node, and per decode layer only the few KB of the three collectives cross the network.
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig, ServeConfig
from lockserve.offload.arena import PageGeometry

from .actors import current_node_id, node_store, worker_device
from .engine import Engine, EngineLimits
from .engine.context_parallel import ShardEngine, ShardSpec
from .engine.cp_group import GroupHost, RankGroup
from .engine.kv_manager import kv_pages
from .engine.sampling import SamplingParams
from .model.loader import load_model


def rank_cache(config: ServeConfig) -> CacheConfig:
    """A rank's CacheConfig: the serving cache with context_parallel.host_capacity_gib as its KV size."""
    fields = config.cache.model_dump()
    fields["host_capacity_gib"] = config.context_parallel.host_capacity_gib
    return CacheConfig(**fields)


def rank_engine(config: ServeConfig, key: str, store_namespace: str | None, device: torch.device,
                seed: int = 0) -> Engine:
    """The Engine a rank reuses (model, KV manager, page ids), sized by config.context_parallel."""
    cp = config.context_parallel
    dtype = None if config.model.dtype == "auto" else getattr(torch, config.model.dtype)
    model, tokenizer = load_model(config.model.source, device=device, dtype=dtype)
    cache, mc = rank_cache(config), model.config
    max_model_len = min(mc.max_position_embeddings, config.model.max_model_len or mc.max_position_embeddings)
    max_pages = kv_pages(mc, cache, cp.max_requests, max_model_len, model.dtype)
    store = None if store_namespace is None else node_store(store_namespace)
    arena = None
    if cache.tier == "host" and store is not None:
        geometry = PageGeometry(cache.page_size, mc.head_dim, model.dtype)
        num_slots = mc.num_layers * max_pages * mc.num_kv_heads
        arena = ray.get(store.region.remote(key, geometry.to_dict(), num_slots))
    elif cache.tier == "host+nvme" and store is not None:
        cache = cache.model_copy(update={"nvme_dir": ray.get(store.nvme_dir_for.remote(key))})
    chunk = config.scheduler.prefill_chunk
    # NOTE: the caps beside decoding requests stay off here, as before they became defaults: their
    # smaller steps (a collective a layer each) were never measured over ranks.
    scheduler = SchedulerConfig(max_num_seqs=cp.max_requests,
                                max_num_batched_tokens=max(chunk, cp.max_requests), prefill_chunk=chunk,
                                prefill_chunk_decoding=None, prefill_attention_decoding=None,
                                prefill_layers_decoding=None)
    return Engine(model, tokenizer, cache, scheduler, device, max_pages=max_pages,
                  max_model_len=config.model.max_model_len, seed=seed, host_arena=arena, use_graphs=False)


class RankWorker:
    """A CpRank's body (see the module docstring); also runs without Ray (store_namespace None)."""

    def __init__(self, config: ServeConfig, key: str, store_namespace: str | None = None, seed: int = 0):
        self.key, self.timeout_s = key, config.context_parallel.timeout_s
        self.device = worker_device(config.model.device, config.ray.cpu_only)
        self.ranks = ShardEngine(rank_engine(config, key, store_namespace, self.device, seed))
        self.node_ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._hosts: dict[str, GroupHost] = {}

    def describe(self) -> dict[str, Any]:
        """Plain data: key, node, address, pid, device, KV pages (capacity, free), page size."""
        return {"key": self.key, "node_id": current_node_id(), "address": self.node_ip, "pid": os.getpid(),
                "device": str(self.device), "capacity_pages": self.ranks.capacity_pages,
                "free_pages": self.ranks.free_pages, "page_size": self.ranks.page_size,
                "max_requests": self.ranks.max_requests}

    def limits(self) -> EngineLimits:
        """The rank engine's admission limits (its pages_capacity is this rank's alone)."""
        return self.ranks.engine.limits

    # ---- a request's group ----------------------------------------------------------------------

    def host_group(self, request_id: str) -> tuple[str, int]:
        """On a request's rank 0: start its rendezvous; returns (address, port) for every rank's open."""
        self._hosts[request_id] = GroupHost.start(self.node_ip, self.timeout_s)
        return self._hosts[request_id].address

    def open(self, spec: ShardSpec, address: tuple[str, int], params: dict | None = None, seed: int = 0,
             trace: bool = False) -> None:
        """Join the request's group (blocks until all its ranks have) and reserve this rank's pages."""
        host = self._hosts.get(spec.request_id) if spec.rank == 0 else None
        group = RankGroup.connect(address, spec.rank, spec.size, self.device, self.timeout_s, self.node_ip,
                                  store=None if host is None else host.store, prefix=spec.request_id)
        try:
            self.ranks.open(spec, group, SamplingParams(**params) if params else None, seed, trace)
        except BaseException:
            group.close()
            self._hosts.pop(spec.request_id, None)
            raise

    def close(self, request_id: str) -> dict[str, Any] | None:
        """Free the request's pages here; its report (ShardEngine.close), None if it was not open."""
        self._hosts.pop(request_id, None)
        return self.ranks.close(request_id)

    # ---- steps (every rank of the request, in the same order) -------------------------------------

    def fill_synthetic(self, request_id: str, num_tokens: int, seed: int = 0) -> None:
        self.ranks.fill_synthetic(request_id, num_tokens, seed)

    def prefill(self, request_id: str, start: int, token_ids: list[int], sample_last: bool) -> int | None:
        return self.ranks.prefill(request_id, start, token_ids, sample_last)

    def decode(self, request_id: str, token: int, position: int) -> int | None:
        return self.ranks.decode(request_id, token, position)

    # ---- introspection and shutdown -----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {"key": self.key, "node_id": current_node_id(), **self.ranks.stats()}

    def shutdown(self) -> None:
        """Close every request and release the tier (the store keeps its region). Idempotent."""
        for request_id in list(self.ranks.shards):
            self.close(request_id)
        self.ranks.engine.close()


# Resources and placement are given at creation (lockserve.cluster.context_parallel.start_ranks).
CpRank = ray.remote(RankWorker)
