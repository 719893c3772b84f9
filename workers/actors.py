"""The Ray actors of a lockserve node: `PageStoreActor` (host memory) and `GpuWorker` (the engine).

    PageStoreActor  one per node, CPU only. Owns the node's shared-memory arenas (one region per
                    GpuWorker, sized for that worker's KV layout) and the NVMe directory. Regions
                    are keyed by the worker's key, so a GpuWorker that Ray restarts asks again and
                    gets the same segment back: KV memory outlives GPU worker restarts.
    GpuWorker       one per GPU (num_gpus=1), or a CPU worker (num_gpus=0). Loads the model,
                    attaches its region of the node's arena, and runs the engine loop (continuous
                    batching) in a background thread. `generate` is a Ray streaming generator that
                    yields one token-event dict per engine step that produced output.

Ray carries control and token streams only: one streaming call per request, a few calls per
request for abort/stats; KV pages never cross Ray (the worker maps the arena itself).
Placement (which node each actor runs on) is bootstrap's job (`lockserve.cluster.bootstrap`);
the plain classes `NodeStore` and `EngineWorker` are the actors' bodies and also run without Ray.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import ray
import torch
from lockserve.configs.schema import AUTO, CacheConfig, ModelConfig, ServeCacheConfig, ServeConfig
from lockserve.offload.arena import PageGeometry
from lockserve.offload.host import DEFAULT_SHM_DIR, HostArena, HostArenaSpec, remove_stale_segments
from lockserve.workers.engine import Engine, EngineLimits, RequestOptions, TokenEvent
from lockserve.workers.engine.kv_manager import kv_pages
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.memory import NodeMemory
from lockserve.workers.model.loader import fit_positions, load_model
from lockserve.workers.sampling_defaults import sampling_defaults

log = logging.getLogger(__name__)

GIB = 1 << 30
HBM_AUTO_FRACTION = 0.5  # tier hbm, cache.host_capacity_gib auto: this much of the free GPU memory
# The custom resource the cluster files give every node lockserve may use (see cluster/placement.py).
NODE_RESOURCE = "lockserve_node"
STORE_NAME_PREFIX = "lockserve-pagestore-"

Sink = Callable[[Any], None]  # receives TokenEvents, then None (aborted) or an exception


def store_name(node_id: str) -> str:
    """Ray actor name of a node's PageStoreActor (unique per node within a namespace)."""
    return f"{STORE_NAME_PREFIX}{node_id}"


def current_node_id() -> str | None:
    """Hex id of the Ray node this process runs on; None outside Ray."""
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


# ---- the node's host memory ---------------------------------------------------------------------


class NodeStore:
    """A node's KV host memory: one shared-memory region per GpuWorker, at most capacity_bytes
    (None: `auto`, a share of what the node has free now, workers/memory.py).

    Regions are HostArena segments created (and owned) here; a worker attaches one by its
    HostArenaSpec. Asking again for a key with the same shape returns the same segment (a
    restarted worker re-attaches); a different shape for a live key is a ValueError.
    `shutdown` unlinks every segment; a store killed before that leaves segments that the next
    `HostArena.create` on this node removes (their owner pid is dead).
    """

    def __init__(self, capacity_bytes: int | None, nvme_dir: str | None = None,
                 shm_dir: str = DEFAULT_SHM_DIR):
        self.memory = NodeMemory.measure(shm_dir)
        self.capacity_auto = capacity_bytes is None
        if capacity_bytes is None:  # cache.host_capacity_gib auto: what this node has free now
            capacity_bytes = self.memory.auto_capacity()
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) must be > 0")
        self.capacity_bytes, self.nvme_dir, self.shm_dir = capacity_bytes, nvme_dir, shm_dir
        self._regions: dict[str, HostArena] = {}
        self._starts: dict[str, WorkerStarts] = {}

    def region(self, key: str, geometry: dict, num_slots: int) -> HostArenaSpec:
        """The arena of worker `key`: num_slots pages of `geometry` (PageGeometry.to_dict())."""
        geo = PageGeometry.from_dict(geometry)
        arena = self._regions.get(key)
        if arena is not None:
            if arena.num_slots != num_slots or arena.geometry != geo:
                raise ValueError(f"region {key!r} exists with {arena.num_slots} slots of {arena.geometry}; "
                                 f"asked for {num_slots} slots of {geo}")
            return arena.spec()
        need = num_slots * geo.slot_bytes
        used = self.bytes_reserved()
        if used + need > self.capacity_bytes:
            how = f"auto: {self.memory.describe()}" if self.capacity_auto else "cache.host_capacity_gib"
            raise ValueError(
                f"region {key!r} needs {need} bytes but the node's host capacity ({self.capacity_bytes} "
                f"bytes, {how}) has {self.capacity_bytes - used} left")
        self._regions[key] = HostArena.create(geo, num_slots, shm_dir=self.shm_dir)
        return self._regions[key].spec()

    def free_region(self, key: str) -> bool:
        """Unlink worker `key`'s segment; False if it had none."""
        arena = self._regions.pop(key, None)
        if arena is not None:
            arena.close()
        return arena is not None

    def nvme_dir_for(self, key: str) -> str:
        """Worker `key`'s spill directory under the node's nvme_dir (created; stable across restarts)."""
        if self.nvme_dir is None:
            raise ValueError("cache.nvme_dir is not set, so this node has no NVMe directory")
        path = os.path.join(self.nvme_dir, key)
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # owner-only whatever the umask or an older directory said
        return path

    def bytes_reserved(self) -> int:
        return sum(a.num_slots * a.geometry.slot_bytes for a in self._regions.values())

    def describe(self) -> dict[str, Any]:
        """Plain data for metrics: node, capacity, and every region's segment and size."""
        return {
            "node_id": current_node_id(),
            "pid": os.getpid(),
            "capacity_bytes": self.capacity_bytes,
            "capacity_auto": self.capacity_auto,
            "memory_available": self.memory.available,
            "bytes_reserved": self.bytes_reserved(),
            "starts": {k: vars(v).copy() for k, v in self._starts.items()},
            "nvme_dir": self.nvme_dir,
            "shm_dir": self.shm_dir,
            "regions": {k: {"arena": a.name, "num_slots": a.num_slots,
                            "bytes": a.num_slots * a.geometry.slot_bytes} for k, a in self._regions.items()},
        }

    def note_start(self, key: str, restarted: bool, backoff_s: float, backoff_max_s: float) -> float:
        """Record that worker `key` starts; returns how long it should wait first (seconds).

        A restart waits backoff_s, doubled for every restart since the worker last ran for longer
        than backoff_max_s, capped at backoff_max_s: a worker that crashes at once (out of memory,
        a bad GPU) does not spin, and one that crashed after running a while is back quickly.
        """
        starts = self._starts.setdefault(key, WorkerStarts())
        now = time.monotonic()
        if restarted:
            starts.restarts += 1
            stable = starts.last_start is not None and now - starts.last_start > backoff_max_s
            starts.streak = 0 if stable else starts.streak + 1
            starts.last_delay_s = min(backoff_s * 2 ** max(starts.streak - 1, 0), backoff_max_s)
        starts.last_start = now + starts.last_delay_s if restarted else now
        return starts.last_delay_s if restarted else 0.0

    def shutdown(self) -> None:
        """Unlink every region's segment, and those a killed predecessor of this store left (their
        owner pid is dead; a worker may still map one: its mapping stays valid). Idempotent."""
        for key in list(self._regions):
            self.free_region(key)
        remove_stale_segments(shm_dir=self.shm_dir)


class WorkerStarts:
    """A worker's start history in its node store (plain data for describe())."""

    def __init__(self) -> None:
        self.restarts = 0  # crashes Ray restarted it from
        self.streak = 0  # restarts since it last ran longer than the backoff cap
        self.last_delay_s = 0.0
        self.last_start: float | None = None  # time.monotonic() of the store


# ---- the engine loop ----------------------------------------------------------------------------


def _notify(sink: Sink, item) -> bool:
    """Hand an item to a request's consumer; False when its event loop has closed (gone)."""
    try:
        sink(item)
    except RuntimeError:
        return False
    return True


class EngineLoop:
    """Runs an Engine in one background thread: commands in, steps while anything is unfinished.

    The engine is not thread-safe, so every call on it (admit, abort, stats, step) runs on the
    loop's thread; other threads `submit` callables and get a concurrent Future. Each live
    request has a sink: its token events, then nothing more once an event has a finish_reason,
    or None when it is aborted, or an exception when a step fails (every live request gets it;
    the loop keeps serving new requests and `error` keeps the last failure).
    """

    def __init__(self, engine: Engine, name: str = "lockserve-engine"):
        self.engine = engine
        self.error: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        return future

    # -- run on the loop's thread (through submit) --

    def admit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
              options: RequestOptions, sink: Sink) -> None:
        """Queue a request; ValueError (engine unchanged) for bad input."""
        self.engine.add_request(request_id, prompt_ids, params, options)
        self._sinks[request_id] = sink

    def abort(self, request_id: str) -> bool:
        sink = self._sinks.pop(request_id, None)
        found = self.engine.abort(request_id)
        if sink is not None:
            _notify(sink, None)
        return found

    def num_live(self) -> int:
        return len(self._sinks)

    # -- the thread --

    def _run(self) -> None:
        while not self._stopping:
            self._run_commands(block=not self.engine.has_unfinished())
            if self.engine.has_unfinished() and not self._stopping:
                self._step()

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # the caller gets it; the loop goes on
                    future.set_exception(err)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as err:
            self.error = f"{type(err).__name__}: {err}"
            log.exception("engine step failed; failing %d live requests", len(self._sinks))
            self._fail_all(RuntimeError(f"engine step failed: {self.error}"))
            return
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if not _notify(sink, TokenEvent.of(out)):
                log.warning("request %s lost its consumer; aborting it", out.request_id)
                self.abort(out.request_id)
            elif out.finished:
                del self._sinks[out.request_id]

    def _fail_all(self, error: Exception) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already broken; the sink must still hear
                log.exception("abort of %s after a failed step", request_id)
            _notify(sink, error)
        self._sinks.clear()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Abort what is live, stop the thread (after the current step). Idempotent."""
        if self.alive:
            self.submit(lambda: [self.abort(rid) for rid in list(self._sinks)]).result(timeout_s)
        self._stopping = True
        self._commands.put((lambda: None, concurrent.futures.Future()))  # wake a blocked get
        self._thread.join(timeout_s)


# ---- the GPU worker -----------------------------------------------------------------------------


def worker_device(model_device: str, cpu_only: bool) -> torch.device:
    """The device a worker runs on: cpu when cpu_only or asked, else the GPU Ray assigned (auto)."""
    if cpu_only or model_device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"model.device ({model_device!r}) needs a CUDA device, but this worker sees none "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    # Ray sets CUDA_VISIBLE_DEVICES to the worker's GPU: the first visible device is ours.
    return torch.device(model_device) if model_device != "auto" else torch.device("cuda", 0)


def cpu_worker_threads(configured: int | None, host_share: float) -> int:
    """torch's intra-op threads for a worker on CPU: `configured`, else its share (host_share) of
    its Ray node's CPUs but one, at least one and at most the cores this process may run on. Ray
    sets OMP_NUM_THREADS to an actor's num_cpus (1 for a worker), which would leave the model on
    one core of a large node.

    NOTE: one core stays with the node's other processes (the HTTP front end, Ray's raylet): a
    step's threads wait for each other, so one preempted thread stalls them all. SmolLM2 served on
    2 cores decoded at 434 ms a token on two threads, 215 ms on one (in process: 238 ms on two)."""
    if configured is not None:
        return configured
    cores = len(os.sched_getaffinity(0))
    node = current_node_id()
    here = [n for n in ray.nodes() if n["NodeID"] == node] if node is not None else []
    cpus = here[0].get("Resources", {}).get("CPU", cores) if here else cores
    return max(1, min(cores, int((cpus - 1) * host_share)))


def worker_model(config: ModelConfig, device: torch.device):
    """(model, tokenizer) as a worker serves them: config.dtype, and config.max_model_len positions
    (past the model's maximum context: a ValueError naming both, unless
    config.allow_long_max_model_len, then with a warning)."""
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    model, tokenizer = load_model(config.source, device=device, dtype=dtype)
    trained = fit_positions(model, config.max_model_len, config.allow_long_max_model_len, config.source,
                            section="model.")
    if trained is not None:
        log.warning("model.max_model_len (%d) runs %s past its %d trained positions "
                    "(model.allow_long_max_model_len)", config.max_model_len, config.source, trained)
    return model, tokenizer


def worker_cache(cache: CacheConfig, host_share: float, node_capacity: int | None = None) -> CacheConfig:
    """A worker's CacheConfig: workers sharing a node split its host (and NVMe) capacity.
    node_capacity: the node's host capacity in bytes, required when cache.host_capacity_gib is
    "auto" (the node store measured it)."""
    if isinstance(cache, ServeCacheConfig):
        gib = cache.host_capacity_gib
        if gib == AUTO:
            if node_capacity is None:
                raise ValueError("cache.host_capacity_gib is 'auto' but no node capacity was measured")
            gib = node_capacity / GIB
        cache = cache.resolved(gib)
    if cache.tier == "hbm" or host_share == 1.0:
        return cache
    return cache.model_copy(update={"host_capacity_gib": cache.host_capacity_gib * host_share,
                                    "nvme_capacity_gib": cache.nvme_capacity_gib * host_share})


def auto_capacity(cache: CacheConfig, device: torch.device, store) -> int | None:
    """The node's capacity in bytes for cache.host_capacity_gib "auto" (None when it is a number):
    the node store's measure on the host tiers, the device's free memory on tier hbm."""
    if getattr(cache, "host_capacity_gib", None) != AUTO:
        return None
    if cache.tier == "hbm" and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(HBM_AUTO_FRACTION * free)
    if store is not None:
        return _wait(store.describe.remote())["capacity_bytes"]
    return NodeMemory.measure(DEFAULT_SHM_DIR).auto_capacity()


def node_store(namespace: str, timeout_s: float = 60.0):
    """The PageStoreActor of the node this process runs on (found by name: no handle to pass).

    A store that Ray is restarting keeps its name, so a lookup that fails is retried for a while:
    a worker restarting at the same time as its store must not die for good.
    """
    node_id = current_node_id()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get_actor(store_name(node_id), namespace=namespace)
        except ValueError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no PageStoreActor {store_name(node_id)!r} in namespace {namespace!r}: "
                    "bootstrap starts one on every lockserve node before the workers") from None
            time.sleep(0.5)


def was_restarted() -> bool:
    """True in an actor that Ray restarted after a crash (False outside Ray)."""
    if not ray.is_initialized():
        return False
    with warnings.catch_warnings():  # Ray 2.60 warns about its own use of a deprecated attribute
        warnings.simplefilter("ignore")
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def _wait(ref, timeout_s: float = 300.0):
    # Blocking is right here: the constructor runs before the actor serves anything, and
    # ray.get would only warn about blocking an async actor's (still idle) event loop.
    return ref.future().result(timeout_s)


class EngineWorker:
    """A GpuWorker's body: model + engine (+ its node's arena region) + engine loop.

    config: the serving config; key: this worker's stable name (its region in the node store);
    store_namespace: where the node's PageStoreActor is named (None: no store, the engine makes
    its own arena, as without Ray); host_share: the fraction of the node's host capacity this
    worker may use (1 / workers on the node).
    """

    def __init__(self, config: ServeConfig, key: str, store_namespace: str | None = None,
                 host_share: float = 1.0, seed: int = 0):
        self.key = key
        self.restarted = was_restarted()
        store = None if store_namespace is None else node_store(store_namespace)
        self.restart_delay_s = 0.0
        if store is not None:
            self.restart_delay_s = _wait(store.note_start.remote(
                key, self.restarted, config.ray.restart_backoff_s, config.ray.restart_backoff_max_s))
            time.sleep(self.restart_delay_s)  # backoff: a crash loop must not spin
        self.device = worker_device(config.model.device, config.ray.cpu_only)
        if self.device.type == "cpu":
            torch.set_num_threads(cpu_worker_threads(config.model.cpu_threads, host_share))
        model, self._tokenizer = worker_model(config.model, self.device)
        self._sampling_defaults = sampling_defaults(config.model.source)
        cache = worker_cache(config.cache, host_share, auto_capacity(config.cache, self.device, store))
        mc = model.config
        max_model_len = min(mc.max_position_embeddings,
                            config.model.max_model_len or mc.max_position_embeddings)
        max_pages = kv_pages(mc, cache, config.scheduler.max_num_seqs, max_model_len, model.dtype)
        arena = None
        if cache.tier == "host" and store is not None:
            geometry = PageGeometry(cache.page_size, mc.head_dim, model.dtype)
            num_slots = mc.num_layers * max_pages * mc.num_kv_heads
            arena = _wait(store.region.remote(key, geometry.to_dict(), num_slots))
        elif cache.tier == "host+nvme" and store is not None:
            cache = cache.model_copy(update={"nvme_dir": _wait(store.nvme_dir_for.remote(key))})
        engine = Engine(model, self._tokenizer, cache, config.scheduler, self.device, max_pages=max_pages,
                        max_model_len=config.model.max_model_len, seed=seed, host_arena=arena,
                        kernels=config.model.kernels)
        self._limits = engine.limits
        self.recovered_pages = engine.recovered_pages  # freed by the engine as it opened
        # On a GPU the first request would wait for kernel compiles and graph captures: run one now,
        # before the worker reports ready (on CPU there is nothing to capture).
        self.warm_up_s = engine.warm_up() if self.device.type == "cuda" else 0.0
        self.loop = EngineLoop(engine, name=f"lockserve-engine-{key}")

    # ---- requests -------------------------------------------------------------------------------

    @ray.method(num_returns="streaming")
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       options: RequestOptions):
        """Stream TokenEvents for one request; the last has a finish_reason. params and options
        come as the client validated them (Ray carries the objects). ValueError naming the field
        for a request the engine refuses. Ends without a final event when the request is aborted;
        a consumer that stops early aborts it."""
        if not isinstance(params, SamplingParams) or not isinstance(options, RequestOptions):
            raise TypeError(f"params ({type(params).__name__}) and options ({type(options).__name__}) "
                            "must be SamplingParams and RequestOptions")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(item) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        await asyncio.wrap_future(
            self.loop.submit(lambda: self.loop.admit(request_id, prompt_ids, params, options, sink)))
        done = False
        try:
            while not done:
                item = await events.get()
                if item is None:  # aborted
                    done = True
                    return
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finish_reason is not None
                yield item
        finally:
            if not done:  # the consumer went away (or this task was cancelled)
                self.loop.submit(lambda: self.loop.abort(request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop a request and free its pages; False for an unknown or finished id."""
        return await asyncio.wrap_future(self.loop.submit(lambda: self.loop.abort(request_id)))

    def check_request(self, prompt_tokens: int, max_tokens: int, options: dict | None = None) -> None:
        """ValueError (message starts with the field) if the engine would refuse such a request."""
        self._limits.check(prompt_tokens, max_tokens, **(options or {}))

    # ---- introspection ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """The engine's stats (see Engine.stats) plus this worker's key, node and arena."""
        engine_stats = await asyncio.wrap_future(self.loop.submit(self.loop.engine.stats))
        return {**engine_stats, **self.health()}

    def health(self) -> dict[str, Any]:
        """Cheap liveness: key, node, pid, device, torch's threads, the attention kernels' backend
        (torch, triton or auto: PagedAttention.backend), arena segment (and whether CUDA maps it),
        loop alive, last step failure, the start-up warm-up's seconds (0 on CPU)."""
        arena = self._arena()
        return {"key": self.key, "node_id": current_node_id(), "pid": os.getpid(),
                "device": str(self.device), "torch_threads": torch.get_num_threads(),
                "attention_backend": self.loop.engine.attention.backend,
                "arena": getattr(arena, "name", None),
                "arena_bytes": int(getattr(arena, "bytes_resident", 0) or 0),
                "arena_registered": bool(getattr(arena, "is_registered", False)),
                "loop_alive": self.loop.alive, "error": self.loop.error,
                "restarted": self.restarted, "restart_delay_s": self.restart_delay_s,
                "recovered_pages": self.recovered_pages, "warm_up_s": self.warm_up_s}

    def _arena(self):
        """The shared-memory HostArena the engine's tier reads (None on tier hbm)."""
        return getattr(self.loop.engine.kv.settled, "arena", None)

    def limits(self) -> EngineLimits:
        return self._limits

    def sampling_defaults(self) -> dict[str, Any]:
        """The model's own sampling defaults (workers/sampling_defaults.py); {} when it has none."""
        return dict(self._sampling_defaults)

    def tokenizer(self):
        """The engine's Tokenizer (picklable), so the front end tokenizes exactly as the engine."""
        return self._tokenizer

    def shutdown(self) -> None:
        """Stop the loop and release the engine (detaches the arena; the store still owns it)."""
        self.loop.stop()
        self.loop.engine.close()


# The actors. Resources and placement are given at creation (lockserve.cluster.bootstrap).
PageStoreActor = ray.remote(num_cpus=0)(NodeStore)
GpuWorker = ray.remote(EngineWorker)
