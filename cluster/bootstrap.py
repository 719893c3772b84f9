"""`start_engine(config)`: Ray up, one PageStoreActor per lockserve node, the GpuWorkers, a client.

    ray.init             config.ray.address (or RAY_ADDRESS, as inside `ray job submit`) joins a
                         cluster; neither starts a local instance: no dashboard, the node marked
                         with the lockserve_node resource, token authentication as Ray defaults it
                         (RAY_AUTH_MODE unset -> token, with the token in ~/.ray/auth_token).
    PageStoreActor       one per lockserve node (cluster/placement.py), named per node in
                         config.ray.namespace, pinned by a hard NodeAffinitySchedulingStrategy.
    GpuWorker            ray.num_gpu_workers of them ("auto": one per GPU), planned onto nodes (GPU:
                         one GPU each; CPU workers when ray.cpu_only or model.device is cpu), pinned
                         the same way. Joining a cluster whose GPU nodes have not joined yet, it
                         waits for them (ray.wait_for_gpus_s) instead of serving on CPUs.
    RayEngineClient      returned; its close() kills the actors and shuts down a Ray started here.

Restarts are Ray's (max_restarts=-1 on both actors: no cap): a crashed worker comes back on its
node after a backoff its node store hands out (NodeStore.note_start), and re-attaches its region;
a crashed store comes back empty, and workers keep the segments they have mapped. A worker that
crashes while the server starts fails the start instead (a crash loop is not a server).

Actors belong to the driver (not detached): when the front end exits, Ray ends them too.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field

import ray
from lockserve.cluster.context_parallel import ContextParallel
from lockserve.cluster.cp_placement import place_ranks, start_ranks
from lockserve.cluster.placement import (
    NodeInfo,
    gpus_short,
    lockserve_nodes,
    node_infos,
    plan_workers,
    worker_count,
    workers_per_node,
)
from lockserve.cluster.ray_client import RayEngineClient
from lockserve.configs.loader import ConfigError
from lockserve.configs.schema import AUTO, ModelConfig, RayConfig, ServeConfig
from lockserve.workers.actors import NODE_RESOURCE, GpuWorker, PageStoreActor, store_name
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger(__name__)

GIB = 1 << 30
MAX_RESTARTS = -1  # Ray restarts a crashed actor without limit (the worker backs off itself)
READY_TIMEOUT_S = 1800.0  # model load on a cold node (large checkpoints) can take many minutes
READY_POLL_S = 1.0
CLOSE_TIMEOUT_S = 30.0
GPU_WAIT_POLL_S = 5.0


@dataclass
class Deployment:
    """What start_engine created, so close() can undo exactly that."""

    namespace: str
    started_ray: bool
    stores: dict[str, object] = field(default_factory=dict)  # node id -> PageStoreActor
    workers: list = field(default_factory=list)  # GpuWorker handles, by rank
    cp_ranks: object = None  # context-parallel ranks (cluster/cp_placement.py RankSet)
    closed: bool = False

    def close(self) -> None:
        """Stop the workers, unlink the stores' segments, kill the actors, stop our Ray. Idempotent."""
        if self.closed or not ray.is_initialized():
            return
        self.closed = True
        if self.cp_ranks is not None:  # they map regions of the stores
            self.cp_ranks.close()
        # Stores first: unlinking a segment leaves the workers' mappings valid, and a front end
        # that is SIGKILLed soon after SIGTERM (`ray job stop` waits 3 s) then leaks nothing.
        _call_all([s.shutdown.remote() for s in self.stores.values()]
                  + [w.shutdown.remote() for w in self.workers], "actor shutdown")
        for actor in [*self.workers, *self.stores.values()]:
            ray.kill(actor, no_restart=True)
        if self.started_ray:
            ray.shutdown()


def _call_all(refs: list, what: str) -> None:
    for ref in refs:
        try:
            ray.get(ref, timeout=CLOSE_TIMEOUT_S)
        except Exception as err:  # a dead actor has nothing left to release
            log.warning("%s failed: %s", what, err)


def connect_ray(ray_config: RayConfig) -> bool:
    """Join the configured cluster or start a local instance; True if this call started Ray.

    An already initialised Ray (an embedding program, tests) is used as it is.
    """
    if ray.is_initialized():
        return False
    address = ray_config.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        ray.init(address=address, namespace=ray_config.namespace, log_to_driver=True)
        return False
    # NOTE: Ray's own ports listen on every interface whatever we pass (it rewrites a loopback
    # node address to the reachable one): token authentication, on by default for a local
    # instance since Ray 2.59, is what guards them. No dashboard: nothing else to expose.
    # address="local": always a new instance; without it ray.init joins whatever `ray start` left
    # running on this machine (and then refuses the resources argument).
    ray.init(address="local", namespace=ray_config.namespace, include_dashboard=False,
             resources={NODE_RESOURCE: 1})
    return True


def served_model_name(model: ModelConfig) -> str:
    """model.name, else derived from the source: "default" -> SmolLM2-135M-Instruct, a path -> its
    file or folder name without .gguf, "preset:tiny" as is."""
    if model.name:
        return model.name
    if model.source == "default":
        return "SmolLM2-135M-Instruct"
    if model.source.startswith("preset:"):
        return model.source
    return os.path.basename(os.path.normpath(model.source)).removesuffix(".gguf")


def start_stores(deployment: Deployment, node_ids: list[str], config: ServeConfig) -> None:
    """One PageStoreActor per node, named per node in the namespace, pinned to it."""
    gib = config.cache.host_capacity_gib
    if gib != AUTO and config.context_parallel.ranks:  # a node's rank takes its own region
        gib += config.context_parallel.host_capacity_gib
    capacity = None if gib == AUTO else int(gib * GIB)  # None: each store measures its node
    for node_id in node_ids:
        options = dict(name=store_name(node_id), namespace=deployment.namespace, max_restarts=MAX_RESTARTS,
                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        try:
            actor = PageStoreActor.options(**options).remote(capacity, config.cache.nvme_dir)
        except ValueError as err:  # the name is taken: another lockserve serves in this namespace
            raise ConfigError(
                f"ray.namespace ({deployment.namespace!r}) already holds a lockserve PageStoreActor on "
                f"node {node_id} ({err}); stop it or pick another namespace") from None
        deployment.stores[node_id] = actor


def use_cpu_workers(config: ServeConfig, nodes: list, local: bool = True) -> bool:
    """CPU workers when asked for, or when model.device is auto, no lockserve node has a GPU and
    Ray is a local instance (the embedded default on a laptop). On a cluster that is a mistake
    (a job submitted before its GPU nodes joined): ConfigError. model.device cuda insists on GPUs."""
    if config.ray.cpu_only or config.model.device == "cpu":
        return True
    if config.model.device == "auto" and not any(n.gpus for n in nodes):
        if not local:
            raise ConfigError(
                f"no GPU on the cluster's lockserve nodes ({_describe(nodes)}) after waiting "
                f"ray.wait_for_gpus_s ({config.ray.wait_for_gpus_s:g} s): check `ray status` for the GPU "
                "nodes, or set model.device: cpu to serve on CPU workers")
        print("lockserve: no GPU on this machine: serving on CPU workers (model.device: cuda would refuse)",
              file=sys.stderr, flush=True)
        return True
    return False


def _describe(nodes: list[NodeInfo]) -> str:
    return ", ".join(f"{n.address}: {n.gpus} GPU, {n.cpus} CPU" for n in nodes)


def wait_for_gpus(config: ServeConfig) -> list[NodeInfo]:
    """The lockserve nodes, once they offer the GPUs ray.num_gpu_workers needs (auto: one), or
    after ray.wait_for_gpus_s. Only on a joined cluster with GPU workers asked for: its GPU nodes
    may still be booting when the job starts."""
    nodes = lockserve_nodes(node_infos(ray.nodes()))
    if config.ray.cpu_only or config.model.device == "cpu":
        return nodes
    deadline, said = time.monotonic() + config.ray.wait_for_gpus_s, 0.0
    while gpus_short(nodes, config.ray.num_gpu_workers) and time.monotonic() < deadline:
        if time.monotonic() - said > 30:
            print(f"lockserve: waiting for GPU nodes to join (ray.num_gpu_workers "
                  f"{config.ray.num_gpu_workers}; now: {_describe(nodes)})", file=sys.stderr, flush=True)
            said = time.monotonic()
        time.sleep(GPU_WAIT_POLL_S)
        nodes = lockserve_nodes(node_infos(ray.nodes()))
    return nodes


def start_workers(deployment: Deployment, plan: list[str], config: ServeConfig, cpu: bool) -> None:
    """GpuWorker i on node plan[i], with its node's store and share of the node's host memory;
    cpu: the workers take no GPU."""
    per_node = workers_per_node(plan)
    for rank, node_id in enumerate(plan):
        options = dict(name=f"lockserve-worker-{rank}", namespace=deployment.namespace,
                       num_gpus=0 if cpu else 1, num_cpus=1, max_restarts=MAX_RESTARTS,
                       scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        deployment.workers.append(GpuWorker.options(**options).remote(
            config, f"worker-{rank}", deployment.namespace, 1.0 / per_node[node_id]))


def wait_ready(deployment: Deployment, timeout_s: float, plan: list[str] | None = None) -> None:
    """Block until every worker answers health(); a worker that failed to start raises here, and
    so does one that crashed while starting (Ray would restart it forever: a crash loop)."""
    deadline = time.monotonic() + timeout_s
    for rank, worker in enumerate(deployment.workers):
        ref = worker.health.remote()
        while True:
            try:
                ray.get(ref, timeout=READY_POLL_S)
                break
            except GetTimeoutError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"GpuWorker {rank} did not start within {timeout_s:.0f} s "
                                       "(resources taken? see `ray status`)") from None
                _check_not_crashing(deployment, rank, plan)
            except RayActorError as err:
                kind, message = init_failure(err)
                if kind in USER_ERRORS:
                    raise ConfigError(f"GpuWorker {rank} could not start: {kind}: {message}") from None
                raise RuntimeError(f"GpuWorker {rank} could not start: {_first_line(err)}") from None


def _check_not_crashing(deployment: Deployment, rank: int, plan: list[str] | None) -> None:
    store = deployment.stores.get(plan[rank]) if plan else None
    if store is None:
        return
    try:
        starts = ray.get(store.describe.remote(), timeout=10)["starts"].get(f"worker-{rank}", {})
    except Exception:  # the store itself is restarting: look again at the next poll
        return
    if starts.get("restarts", 0) > 0:
        raise RuntimeError(
            f"GpuWorker {rank} crashed while starting (Ray restarted it {starts['restarts']} times); "
            "often out of memory: lower cache.host_capacity_gib or scheduler.max_num_seqs; the worker's "
            "log is under /tmp/ray/session_latest/logs")


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"


USER_ERRORS = ("ValueError", "FileNotFoundError", "ConfigError")  # bad config, model or path


def init_failure(err: RayActorError) -> tuple[str | None, str]:
    """(exception type name, message) of the error an actor's constructor raised, else (None, "").

    Ray passes a constructor's exception back as text only (ActorDiedError keeps the message, not
    the exception), so this reads the traceback's last line, "<Type>: <message>".
    """
    if not err.actor_init_failed:
        return None, ""
    lines = [line for line in str(err).splitlines() if line.strip()]
    kind, sep, message = lines[-1].partition(": ") if lines else ("", "", "")
    name = kind.rsplit(".", 1)[-1]  # "lockserve.configs.loader.ConfigError" -> "ConfigError"
    if not sep or not name.isidentifier():
        return None, ""
    return name, message


def start_engine(config: ServeConfig, *, ready_timeout_s: float = READY_TIMEOUT_S) -> RayEngineClient:
    """Start (or join) Ray and the actors for `config`; the returned client serves requests.

    Raises ConfigError for what the user can fix (too few GPUs/CPUs for ray.num_gpu_workers, a
    model that cannot be loaded, a namespace in use); everything is cleaned up on failure.
    """
    deployment = Deployment(config.ray.namespace, connect_ray(config.ray))
    try:
        nodes = lockserve_nodes(node_infos(ray.nodes())) if deployment.started_ray else wait_for_gpus(config)
        cpu = use_cpu_workers(config, nodes, local=deployment.started_ray)
        if cpu and not config.ray.cpu_only:  # the workers read the decision from their config
            config = config.model_copy(update={"ray": config.ray.model_copy(update={"cpu_only": True})})
        if config.context_parallel.ranks:  # placed first: the workers get the GPUs and CPUs left
            deployment.cp_ranks = place_ranks(config, cpu, nodes, ready_timeout_s)
            nodes = deployment.cp_ranks.remaining(nodes)
        try:
            plan = plan_workers(nodes, worker_count(nodes, config.ray.num_gpu_workers, cpu), cpu)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        start_stores(deployment, [n.node_id for n in nodes], config)
        start_workers(deployment, plan, config, cpu)
        wait_ready(deployment, ready_timeout_s, plan)
        first = deployment.workers[0]
        tokenizer, limits, defaults = ray.get(
            [first.tokenizer.remote(), first.limits.remote(), first.sampling_defaults.remote()])
        stores = list(deployment.stores.values())
        cp = None
        if deployment.cp_ranks is not None:
            start_ranks(deployment.cp_ranks, config, deployment.namespace, cpu, ready_timeout_s)
            cp = ContextParallel(deployment.cp_ranks, tokenizer, config.scheduler.prefill_chunk)
        client = RayEngineClient(served_model_name(config.model), deployment.workers, stores, tokenizer,
                                 limits, on_close=deployment.close, sampling_defaults=defaults,
                                 context_parallel=cp)
        client.refresh_stats()
        _report_memory(deployment)
        return client
    except BaseException:
        deployment.close()
        raise


def _report_memory(deployment: Deployment) -> None:
    """One line per node: the host memory its workers reserved, and where the size came from."""
    for node_id, store in deployment.stores.items():
        described = ray.get(store.describe.remote(), timeout=CLOSE_TIMEOUT_S)
        if not described["regions"]:
            continue
        how = ("auto: a quarter of the memory available" if described["capacity_auto"]
               else "cache.host_capacity_gib")
        print(f"lockserve: node {node_id[:8]}: host arena {described['bytes_reserved'] / GIB:.2f} GiB "
              f"reserved for {len(described['regions'])} worker(s) (capacity "
              f"{described['capacity_bytes'] / GIB:.2f} GiB, {how})", file=sys.stderr, flush=True)
