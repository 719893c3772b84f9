"""Prometheus metrics of one server instance, in a registry of its own.

Request-side metrics (TTFT, TPOT, token counters, token rate) are recorded by a
``RequestTracker`` per request. Engine-side gauges (queue length, hot-cache hit
rate, bytes per tier, capacity used, ...) are read from ``engine.stats()`` at
scrape time by a custom collector, so they are never stale and cost nothing
between scrapes. No global registry: two apps in one process never collide.
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from lockserve.cluster.engine_client import TokenEvent
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Long-context prefill can take minutes, so TTFT buckets reach far.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

# engine.stats() keys with a dedicated gauge: key -> (metric name, help).
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "queue_len": ("lockserve_queue_length", "Requests waiting for admission in the engine"),
    "running": ("lockserve_engine_running_requests", "Requests being prefilled or decoded"),
    "hit_rate": ("lockserve_hot_cache_hit_rate", "GPU hot-page cache hits / lookups, in [0, 1]"),
    "capacity_used": ("lockserve_capacity_used", "Fraction of KV page capacity in use, in [0, 1]"),
    "prefix_hit_rate": ("lockserve_prefix_hit_rate",
                        "Prompt tokens served from the prefix cache / prompt tokens admitted, in [0, 1]"),
    "prefix_cached_tokens": ("lockserve_prefix_cached_tokens", "Prompt tokens served from the prefix cache"),
    "prefix_bytes": ("lockserve_prefix_cache_bytes", "KV bytes of the pages the prefix cache holds (on the "
                     "engine's tier)"),
    "prefix_evicted_pages": ("lockserve_prefix_evicted_pages", "Page ids the prefix cache evicted"),
}
BYTES_PER_TIER = ("lockserve_kv_bytes", "Bytes of KV pages held per tier")


class TokenRate:
    """Generated tokens per second over a sliding window of ``window_s`` seconds."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"window_s ({window_s}) must be > 0")
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()  # (time, tokens), oldest first

    def add(self, tokens: int) -> None:
        self._events.append((self._clock(), tokens))
        self._trim()

    def rate(self) -> float:
        self._trim()
        return sum(n for _, n in self._events) / self.window_s

    def _trim(self) -> None:
        horizon = self._clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            self._events.popleft()


class EngineStatsCollector(Collector):
    """Turns one ``engine.stats()`` call per scrape into gauges; a failing call sets engine_up 0."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("lockserve_engine_up", "1 if engine.stats() answered at the last scrape")
        try:
            stats = self._stats()
        except Exception:  # a scrape must not fail because the engine is unhealthy
            log.exception("engine.stats() failed during a metrics scrape")
            up.add_metric([], 0.0)
            yield up
            return
        up.add_metric([], 1.0)
        yield up
        yield from _engine_families(stats)


def _engine_families(stats: dict[str, Any]) -> Iterator[Metric]:
    for key, value in stats.items():
        if key in ENGINE_GAUGES and _is_number(value):
            name, doc = ENGINE_GAUGES[key]
            yield GaugeMetricFamily(name, doc, value=float(value))
        elif key == "bytes_per_tier" and isinstance(value, dict):
            family = GaugeMetricFamily(*BYTES_PER_TIER, labels=["tier"])
            for tier, nbytes in value.items():
                if _is_number(nbytes):
                    family.add_metric([str(tier)], float(nbytes))
            yield family
        elif key not in ENGINE_GAUGES and _is_number(value):
            safe = re.sub(r"[^a-zA-Z0-9_]", "_", str(key))
            yield GaugeMetricFamily(
                f"lockserve_engine_{safe}", f"engine.stats()[{key!r}]", value=float(value)
            )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class ServerMetrics:
    """All metrics of one app. ``track(endpoint)`` starts a request; ``render()`` is the /metrics body."""

    def __init__(self, stats: Callable[[], dict[str, Any]], rate_window_s: float = 10.0):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "lockserve_time_to_first_token_seconds",
            "Request arrival to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "lockserve_time_per_output_token_seconds",
            "Time between output tokens after the first",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "lockserve_e2e_request_latency_seconds",
            "Request arrival to last token",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lockserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("lockserve_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter(
            "lockserve_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.in_progress = Gauge("lockserve_requests_in_progress", "Requests being served", registry=r)
        self.rejected = Counter(
            "lockserve_rejected_requests", "Requests answered with an error before generating", ["status"],
            registry=r,
        )  # fmt: skip
        self.token_rate = TokenRate(rate_window_s)
        Gauge(
            "lockserve_generation_tokens_per_second",
            "Generated tokens per second over the recent window",
            registry=r,
        ).set_function(self.token_rate.rate)
        r.register(EngineStatsCollector(stats))

    def track(self, endpoint: str, prompt_tokens: int, arrival: float | None = None) -> RequestTracker:
        """Start timing a request that arrived at ``arrival`` (time.monotonic(); None = now)."""
        self.prompt_tokens.inc(prompt_tokens)
        return RequestTracker(self, endpoint, start=arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Timing of one request: TTFT at the first event with tokens, TPOT per later token."""

    def __init__(
        self,
        metrics: ServerMetrics,
        endpoint: str,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
    ):
        self._m = metrics
        self._endpoint = endpoint
        self._clock = clock
        self._start = clock() if start is None else start
        self._last: float | None = None  # time of the previous event with tokens
        self._done = False
        metrics.in_progress.inc()

    def on_event(self, event: TokenEvent) -> None:
        n = len(event.token_ids)
        if n == 0:
            return
        t = self._clock()
        if self._last is None:
            self._m.ttft.observe(t - self._start)
        else:
            # An event may carry several tokens; each gets an equal share of the gap.
            for _ in range(n):
                self._m.tpot.observe((t - self._last) / n)
        self._last = t
        self._m.generation_tokens.inc(n)
        self._m.token_rate.add(n)

    def finish(self, finish_reason: str) -> None:
        """``finish_reason``: "stop", "length", "abort" (client left) or "error". Idempotent."""
        if self._done:
            return
        self._done = True
        self._m.in_progress.dec()
        self._m.e2e.observe(self._clock() - self._start)
        self._m.requests.labels(self._endpoint, finish_reason).inc()
