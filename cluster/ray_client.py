"""`RayEngineClient`: the EngineClient the HTTP server uses, over the GpuWorker actors.

The front end holds the engine's tokenizer (fetched once from a worker, so tokenize/chat template
match the engine exactly) and its admission limits (`EngineLimits`), so tokenize,
apply_chat_template and check_request never leave the process. A request goes to the worker
with the fewest requests in flight from this client, as one Ray streaming call; its token events
come back as `async for ref in stream: event = await ref`. stats() returns a snapshot that is
refreshed in the background (never a blocking round trip on the caller's loop).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import jinja2
import ray
from lockserve.cluster.engine_client import (
    EngineClient,
    RequestError,
    RequestOptions,
    SamplingParams,
    TokenEvent,
)
from lockserve.cluster.errors import param_of
from lockserve.workers.engine import EngineLimits
from ray.exceptions import RayActorError, RayTaskError

log = logging.getLogger(__name__)

STATS_REFRESH_S = 1.0  # a stats() snapshot older than this starts a refresh
# A worker whose actor failed (dead, restarting) gets no new requests for this long: a dead
# worker fails fast, so without it least-loaded routing would send it every request.
UNAVAILABLE_BACKOFF_S = 10.0
SUMMED_STATS = ("queue_len", "running", "pages_used", "pages_capacity", "bytes_moved", "bytes_written",
                "cache_hits", "cache_misses", "steps", "prompt_tokens", "generated_tokens")


def engine_error(err: BaseException, worker: str) -> BaseException:
    """What a worker-side failure means to the caller: the user's ValueError -> RequestError 400
    (param named by the message); a dead worker or anything else -> RuntimeError (a 500)."""
    if isinstance(err, RayTaskError):
        cause = err.cause if err.cause is not None else err
        if isinstance(cause, ValueError):
            message = str(cause)
            return RequestError(400, message, param=param_of(message))
        return RuntimeError(f"GpuWorker {worker} failed: {type(cause).__name__}: {cause}")
    if isinstance(err, RayActorError):
        return RuntimeError(f"GpuWorker {worker} is unavailable: {err}")
    return err


def merge_stats(per_worker: list[dict[str, Any]], stores: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot from the workers' and stores' stats: counters summed, ratios recomputed."""
    out: dict[str, Any] = {k: sum(s.get(k, 0) for s in per_worker) for k in SUMMED_STATS}
    lookups = out["cache_hits"] + out["cache_misses"]
    out["hit_rate"] = out["cache_hits"] / lookups if lookups else 0.0
    out["capacity_used"] = out["pages_used"] / out["pages_capacity"] if out["pages_capacity"] else 0.0
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
    from a worker; on_close: releases what bootstrap created (actors, a Ray it started).
    """

    def __init__(self, model_name: str, workers: list, stores: list, tokenizer, limits: EngineLimits,
                 on_close: Callable[[], None] | None = None):
        if not workers:
            raise ValueError("workers is empty: a RayEngineClient needs at least one GpuWorker")
        self.model_name = model_name
        self.workers, self.stores = list(workers), list(stores)
        self.tokenizer, self.limits = tokenizer, limits
        self._on_close = on_close
        self._in_flight = [0] * len(self.workers)
        self._unavailable_until = [float("-inf")] * len(self.workers)
        self._where: dict[str, int] = {}  # live request id -> worker index
        self._stats = StatsCache(self._fetch_stats)
        self._closed = False

    # ---- front-end-local calls ------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages)
        except jinja2.TemplateError as err:
            raise ValueError(f"messages cannot be rendered with the model's chat template: {err}") from err

    def check_request(self, prompt_tokens: int, params: SamplingParams, options: RequestOptions) -> None:
        try:
            self.limits.check(prompt_tokens, params.max_tokens, **dataclasses.asdict(options))
        except ValueError as err:
            raise RequestError(400, str(err), param=param_of(str(err))) from None

    # ---- requests -------------------------------------------------------------------------------

    def pick_worker(self) -> int:
        """Index of the worker with the fewest requests in flight (lowest index on ties), among
        those not backing off after an actor failure (all of them if every one is)."""
        now = time.monotonic()
        ready = [i for i in range(len(self.workers)) if self._unavailable_until[i] <= now]
        return min(ready or range(len(self.workers)), key=lambda i: self._in_flight[i])

    def _failed(self, index: int, err: BaseException) -> BaseException:
        if isinstance(err, RayActorError):
            self._unavailable_until[index] = time.monotonic() + UNAVAILABLE_BACKOFF_S
        return engine_error(err, str(index))

    async def generate(self, prompt: str | list[int], params: SamplingParams, options: RequestOptions,
                       request_id: str) -> AsyncIterator[TokenEvent]:
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if request_id in self._where:
            raise RequestError(400, f"request_id ({request_id!r}) is already in use", param="request_id")
        index = self.pick_worker()
        worker = self.workers[index]
        self._in_flight[index] += 1
        self._where[request_id] = index
        finished = False
        try:
            stream = worker.generate.options(num_returns="streaming").remote(
                request_id, ids, dataclasses.asdict(params), dataclasses.asdict(options))
            async for ref in stream:
                try:
                    event = await ref
                except (RayTaskError, RayActorError) as err:
                    raise self._failed(index, err) from None
                finished = event["finish_reason"] is not None
                yield TokenEvent(**event)
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
        snapshot = self._stats.get()
        if snapshot and snapshot.get("workers_alive", 0) == 0:
            raise RuntimeError(f"no GpuWorker answered (of {len(self.workers)})")
        return dict(snapshot)

    def refresh_stats(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Fetch a fresh snapshot now (blocking; for start-up and tests)."""
        return dict(self._stats.refresh_now(timeout_s))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._on_close is not None:
            self._on_close()
