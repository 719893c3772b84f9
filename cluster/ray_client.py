"""`RayEngineClient`: the EngineClient the HTTP server uses, over the GpuWorker actors.

The front end holds the engine's tokenizer (fetched once from a worker, so tokenize/chat template
match the engine exactly) and its admission limits (`EngineLimits`), so tokenize,
apply_chat_template and check_request never leave the process. A request goes to the ready worker
with the fewest requests in flight from this client, as one Ray streaming call; its token events
come back as `async for ref in stream: event = await ref`. stats() returns a snapshot that is
refreshed in the background (never a blocking round trip on the caller's loop).

Liveness: `WorkerMonitor` probes every worker's health() from a thread every PROBE_INTERVAL_S. Ray
queues calls to an actor it is restarting, so a probe that has not answered within PROBE_TIMEOUT_S
marks the worker unavailable, as does a request that finds it dead; a later answer marks it ready
again. With no worker ready a request is refused at once with 503 + Retry-After (WorkerUnavailable),
and so is one whose worker died under it: its KV state died with the process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
import ray
from lockserve.cluster.engine_client import (
    EngineClient,
    PromptBounds,
    RequestError,
    RequestOptions,
    SamplingParams,
    TokenEvent,
    WorkerUnavailable,
)
from lockserve.cluster.errors import param_of
from lockserve.workers.engine import EngineLimits
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger(__name__)

STATS_REFRESH_S = 1.0  # a stats() snapshot older than this starts a refresh
PROBE_INTERVAL_S = 0.5  # the monitor asks every worker for health() this often
PROBE_TIMEOUT_S = 3.0  # no answer within this long: unavailable (restarting, or stuck)
RETRY_AFTER_S = 2  # what a 503 tells the client to wait (the openai client honours it)
SUMMED_STATS = ("queue_len", "running", "pages_used", "pages_capacity", "bytes_moved", "bytes_written",
                "cache_hits", "cache_misses", "steps", "prompt_tokens", "generated_tokens",
                "prefix_queries", "prefix_hits", "prefix_cached_tokens", "prefix_prompt_tokens",
                "prefix_pages", "prefix_idle_pages", "prefix_bytes", "prefix_evicted_pages")


AFFINITY_TOKENS = 1024  # a prompt this long goes where the last prompt with the same first tokens went
AFFINITY_SLACK = 1  # ... unless that worker has more requests in flight than the least loaded + this
AFFINITY_ENTRIES = 4096


class PrefixAffinity:
    """Which worker last took a prompt that starts with the same AFFINITY_TOKENS tokens: its prefix
    cache holds that prefix's pages (each worker's cache is its own), so a second question about
    a long document should go there. Bounded LRU of key -> worker index."""

    def __init__(self, tokens: int = AFFINITY_TOKENS, entries: int = AFFINITY_ENTRIES):
        self.tokens, self.entries = tokens, entries
        self._where: OrderedDict[bytes, int] = OrderedDict()

    def key(self, ids: list[int]) -> bytes | None:
        """The prompt's key, or None for a prompt shorter than the affinity's tokens (least loaded)."""
        if len(ids) < self.tokens:
            return None
        return hashlib.blake2b(struct.pack(f"<{self.tokens}q", *ids[: self.tokens]), digest_size=16).digest()

    def choose(self, key: bytes | None, ready: list[int], in_flight: list[int]) -> int:
        """The key's worker when it is ready and within AFFINITY_SLACK of the least loaded, else
        the least loaded ready worker (lowest index on ties); remembers the choice."""
        least = min(ready, key=lambda i: in_flight[i])
        chosen = least
        if key is not None:
            last = self._where.get(key)
            if last in ready and in_flight[last] <= in_flight[least] + AFFINITY_SLACK:
                chosen = last
            self._where[key] = chosen
            self._where.move_to_end(key)
            while len(self._where) > self.entries:
                self._where.popitem(last=False)
        return chosen


def engine_error(err: BaseException, worker: str) -> BaseException:
    """What a worker-side failure means to the caller: the user's ValueError -> RequestError 400
    (param named by the message); a dead worker -> WorkerUnavailable (503, retry); anything else
    -> RuntimeError (a 500: an engine bug)."""
    if isinstance(err, RayTaskError):
        cause = err.cause if err.cause is not None else err
        if isinstance(cause, ValueError):
            message = str(cause)
            return RequestError(400, message, param=param_of(message))
        return RuntimeError(f"GpuWorker {worker} failed: {type(cause).__name__}: {cause}")
    if isinstance(err, RayActorError):
        return WorkerUnavailable(
            f"GpuWorker {worker} died while serving this request ({_first_line(err)}); its KV state is "
            "lost. Ray restarts the worker: send the request again", RETRY_AFTER_S)
    return err


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:300]


def longest_token_chars(tokenizer) -> int:
    """Characters the longest token can cover: its UTF-8 bytes (>= its characters), special tokens
    included. A partial byte decodes to U+FFFD (3 bytes), which only overestimates: still a bound."""
    backend = tokenizer.backend
    size = backend.get_vocab_size(with_added_tokens=True)
    return max(len(backend.decode([i], skip_special_tokens=False).encode()) for i in range(size))


class WorkerMonitor:
    """Which workers can take a request now (see the module docstring). `ready(i)`, `mark_failed`,
    `summary()` are safe from any thread; the probing runs in a daemon thread until `stop()`."""

    def __init__(self, workers: list, interval_s: float = PROBE_INTERVAL_S,
                 timeout_s: float = PROBE_TIMEOUT_S):
        self._workers, self.interval_s, self.timeout_s = workers, interval_s, timeout_s
        self._lock = threading.Lock()
        self._ready = [True] * len(workers)  # bootstrap saw every worker answer before this
        self._reason: list[str | None] = [None] * len(workers)
        self._pid: list[int | None] = [None] * len(workers)
        self._pending: list[tuple[Any, float] | None] = [None] * len(workers)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockserve-worker-monitor", daemon=True)

    def start(self) -> WorkerMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def ready(self, index: int) -> bool:
        return self._ready[index]

    def mark_failed(self, index: int, reason: str) -> None:
        """A request found worker `index` dead: unavailable until a probe sent after now answers."""
        with self._lock:
            self._ready[index], self._reason[index], self._pending[index] = False, reason, None

    def summary(self) -> dict[str, Any]:
        with self._lock:
            workers = [{"ready": r, "pid": p, **({"reason": why} if why else {})}
                       for r, p, why in zip(self._ready, self._pid, self._reason, strict=True)]
        return {"ready": sum(w["ready"] for w in workers), "total": len(workers), "workers": workers}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # the monitor must outlive any one bad answer
                log.exception("worker health probe failed")

    def poll(self) -> None:
        """Send a probe to each worker without one pending; read the answers that came."""
        now = time.monotonic()
        for i, worker in enumerate(self._workers):
            with self._lock:
                pending = self._pending[i]
                if pending is None:
                    self._pending[i] = (worker.health.remote(), now)
                    continue
            ref, sent = pending
            done, _ = ray.wait([ref], timeout=0)
            if done:
                self._answered(i, ref)
            elif now - sent > self.timeout_s:
                with self._lock:  # keep waiting on the same probe: it answers once the worker is back
                    if self._pending[i] is pending:
                        self._ready[i] = False
                        self._reason[i] = f"no answer to a health probe for {now - sent:.0f} s (restarting?)"

    def _answered(self, i: int, ref) -> None:
        try:
            health = ray.get(ref, timeout=0)
            ready = bool(health.get("loop_alive"))
            reason = None if ready else "engine loop died"
            pid = health.get("pid")
        except Exception as err:  # RayActorError: dead, or died while answering
            ready, reason, pid = False, _first_line(err), None
        with self._lock:
            if self._pending[i] is None or self._pending[i][0] is not ref:
                return  # mark_failed dropped this probe: it may predate the failure
            self._pending[i] = None
            self._ready[i], self._reason[i] = ready, reason
            if pid is not None:
                self._pid[i] = pid


def merge_stats(per_worker: list[dict[str, Any]], stores: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot from the workers' and stores' stats: counters summed, ratios recomputed."""
    out: dict[str, Any] = {k: sum(s.get(k, 0) for s in per_worker) for k in SUMMED_STATS}
    lookups = out["cache_hits"] + out["cache_misses"]
    out["hit_rate"] = out["cache_hits"] / lookups if lookups else 0.0
    out["capacity_used"] = out["pages_used"] / out["pages_capacity"] if out["pages_capacity"] else 0.0
    prompts = out["prefix_prompt_tokens"]
    out["prefix_hit_rate"] = out["prefix_cached_tokens"] / prompts if prompts else 0.0
    tiers: dict[str, int] = {}
    for s in per_worker:
        for tier, nbytes in s.get("bytes_per_tier", {}).items():
            tiers[tier] = tiers.get(tier, 0) + nbytes
    out["bytes_per_tier"] = tiers
    out["workers_alive"] = len(per_worker)
    out["store_bytes_reserved"] = sum(s.get("bytes_reserved", 0) for s in stores)
    return out


class StatsCache:
    """A stats snapshot refreshed without blocking: `get` starts a refresh when the snapshot is
    older than `refresh_s` and picks up the answers of an earlier refresh once all have come."""

    def __init__(self, fetch: Callable[[], tuple[list, list]], refresh_s: float = STATS_REFRESH_S):
        self._fetch, self.refresh_s = fetch, refresh_s
        self._pending: tuple[list, list] | None = None
        self._snapshot: dict[str, Any] = {}
        self._stamp = float("-inf")
        self.workers_total = 0

    def refresh_now(self, timeout_s: float) -> dict[str, Any]:
        """A blocking refresh (start-up, tests)."""
        workers, stores = self._fetch()
        ray.wait(workers + stores, num_returns=len(workers + stores), timeout=timeout_s)
        self._pending = (workers, stores)
        self._harvest()
        return self._snapshot

    def get(self) -> dict[str, Any]:
        if self._pending is not None:
            workers, stores = self._pending
            refs = workers + stores
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                self._harvest()
        if self._pending is None and time.monotonic() - self._stamp > self.refresh_s:
            self._pending = self._fetch()
        return self._snapshot

    def _harvest(self) -> None:
        workers, stores = self._pending
        self._pending = None
        self.workers_total = len(workers)
        got_workers, got_stores = _gather(workers), _gather(stores)
        snapshot = merge_stats(got_workers, got_stores)
        snapshot["workers"] = len(workers)
        self._snapshot, self._stamp = snapshot, time.monotonic()


def _gather(refs: list) -> list[dict[str, Any]]:
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0))
        except Exception as err:  # a dead or restarting actor: counted out of workers_alive
            log.warning("stats call failed: %s", err)
    return out


class RayEngineClient(EngineClient):
    """EngineClient over GpuWorker actors (see the module docstring).

    workers: GpuWorker handles; stores: PageStoreActor handles (for stats); tokenizer and limits:
    from a worker; on_close: releases what bootstrap created (actors, a Ray it started);
    context_parallel: serves the requests whose pages do not fit one worker over ranks on several
    nodes (cluster/context_parallel.py; None: such requests are refused).
    """

    def __init__(self, model_name: str, workers: list, stores: list, tokenizer, limits: EngineLimits,
                 on_close: Callable[[], None] | None = None, sampling_defaults: dict | None = None,
                 context_parallel=None):
        if not workers:
            raise ValueError("workers is empty: a RayEngineClient needs at least one GpuWorker")
        self.model_name = model_name
        self.workers, self.stores = list(workers), list(stores)
        self.tokenizer, self.limits = tokenizer, limits
        self._on_close = on_close
        self._in_flight = [0] * len(self.workers)
        self._affinity = PrefixAffinity()
        self._where: dict[str, int] = {}  # live request id -> worker index
        self._stats = StatsCache(self._fetch_stats)
        self._bounds = PromptBounds(min(limits.max_model_len, limits.pages_capacity * limits.page_size),
                                    longest_token_chars(tokenizer))
        self._defaults = checked_defaults(sampling_defaults or {})
        self.monitor = WorkerMonitor(self.workers).start()
        self.context_parallel = context_parallel
        if context_parallel is not None:  # prompts up to what the ranks hold together pass the bounds
            cp = context_parallel.limits
            held = min(cp.max_model_len, cp.pages_capacity * cp.page_size)
            longest = max(self._bounds.context_tokens, held)
            self._bounds = PromptBounds(longest, self._bounds.max_chars_per_token)
        self._closed = False

    # ---- front-end-local calls ------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def tokenize_chat(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_bos=False)  # as Tokenizer.encode_chat

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages)
        except jinja2.TemplateError as err:
            raise ValueError(f"messages cannot be rendered with the model's chat template: {err}") from err

    def check_request(self, prompt_tokens: int, params: SamplingParams, options: RequestOptions) -> None:
        if self.sharded(prompt_tokens, params.max_tokens):
            self.context_parallel.check_request(prompt_tokens, params, options)
            return
        try:
            self.limits.check(prompt_tokens, params.max_tokens, **dataclasses.asdict(options))
        except ValueError as err:
            raise RequestError(400, str(err), param=param_of(str(err))) from None

    # ---- requests -------------------------------------------------------------------------------

    def prompt_bounds(self) -> PromptBounds:
        return self._bounds

    def sampling_defaults(self) -> dict[str, Any]:
        return dict(self._defaults)

    def sharded(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request goes to the context-parallel ranks: its pages do not fit one worker."""
        pages = -(-(prompt_tokens + max_tokens) // self.limits.page_size)
        return self.context_parallel is not None and pages > self.limits.pages_capacity

    def pick_worker(self, ids: list[int] | None = None) -> int:
        """Index of the ready worker with the fewest requests in flight (lowest index on ties), or
        for a long prompt the worker that took its first tokens last (PrefixAffinity);
        WorkerUnavailable (503) when no worker is ready."""
        ready = [i for i in range(len(self.workers)) if self.monitor.ready(i)]
        if not ready:
            states = "; ".join(f"GpuWorker {i}: {w.get('reason', 'not ready')}"
                               for i, w in enumerate(self.monitor.summary()["workers"]))
            raise WorkerUnavailable(f"no GpuWorker can take a request now ({states}); retry shortly",
                                    RETRY_AFTER_S)
        return self._affinity.choose(self._affinity.key(ids or []), ready, self._in_flight)

    def _failed(self, index: int, err: BaseException) -> BaseException:
        if isinstance(err, RayActorError):
            self.monitor.mark_failed(index, _first_line(err))
        return engine_error(err, str(index))

    async def generate(self, prompt: str | list[int], params: SamplingParams, options: RequestOptions,
                       request_id: str) -> AsyncIterator[TokenEvent]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._where:
            raise RequestError(400, f"request_id ({request_id!r}) is already in use", param="request_id")
        if self.sharded(len(ids), params.max_tokens):
            async for event in self.context_parallel.generate(ids, params, options, request_id):
                yield event
            return
        index = self.pick_worker(ids)
        worker = self.workers[index]
        self._in_flight[index] += 1
        self._where[request_id] = index
        finished = False
        try:
            stream = worker.generate.options(num_returns="streaming").remote(request_id, ids, params, options)
            async for ref in stream:
                try:
                    event = await ref
                except (RayTaskError, RayActorError) as err:
                    raise self._failed(index, err) from None
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        except RayActorError as err:  # the stream itself broke (worker died between events)
            raise self._failed(index, err) from None
        finally:
            self._in_flight[index] -= 1
            self._where.pop(request_id, None)
            if not finished:  # closed early or failed: the worker must drop it (no-op if gone)
                worker.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        if self.context_parallel is not None and await self.context_parallel.abort(request_id):
            return
        index = self._where.get(request_id)
        if index is None:
            return
        try:
            await self.workers[index].abort.remote(request_id)
        except (RayTaskError, RayActorError) as err:
            log.warning("abort of %s on GpuWorker %d failed: %s", request_id, index, err)

    # ---- introspection --------------------------------------------------------------------------

    def _fetch_stats(self) -> tuple[list, list]:
        return [w.stats.remote() for w in self.workers], [s.describe.remote() for s in self.stores]

    def stats(self) -> dict[str, Any]:
        snapshot = dict(self._stats.get())
        health = self.monitor.summary()
        if health["ready"] == 0:
            raise RuntimeError(f"no GpuWorker is ready (of {health['total']})")
        snapshot["workers_alive"] = health["ready"]  # liveness from the monitor, not the last stats
        if self.context_parallel is not None:
            snapshot.update(self.context_parallel.stats())
        return snapshot

    def health(self) -> dict[str, Any]:
        return self.monitor.summary()

    def refresh_stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Fetch a fresh snapshot now (blocking; for start-up and tests)."""
        return dict(self._stats.refresh_now(timeout_s))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.monitor.stop()
        if self._on_close is not None:
            self._on_close()


def checked_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """The model's sampling defaults that SamplingParams accepts; a bad value is dropped with a
    warning (it must not turn every request that leaves the field out into a 400)."""
    kept = {k: v for k, v in defaults.items() if k in ("temperature", "top_p", "top_k")}
    for key, value in list(kept.items()):
        try:
            SamplingParams(**{key: value})
        except ValueError as err:
            log.warning("ignoring the model's sampling default %s: %s", key, err)
            del kept[key]
    if kept and defaults.get("source"):
        kept["source"] = defaults["source"]
    return kept
