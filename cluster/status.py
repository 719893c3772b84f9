"""``lockserve status``: a short table from a server's /health and /metrics."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    """{sample name: [(labels, value), ...]} of a Prometheus text exposition."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), s.value))
    return samples


def _value(samples: Samples, name: str) -> float | None:
    rows = samples.get(name)
    return sum(v for _, v in rows) if rows else None


def _mean_ms(samples: Samples, name: str) -> str:
    total, count = _value(samples, f"{name}_sum"), _value(samples, f"{name}_count")
    if not count:
        return "-"
    return f"{1000 * total / count:.1f} ms (n={int(count)})"


def _fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "%":
        return f"{100 * value:.1f}%"
    return f"{value:g}{unit}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _finished(samples: Samples) -> str:
    rows = samples.get("lockserve_requests_total", [])
    by_reason: dict[str, float] = {}
    for labels, v in rows:
        by_reason[labels.get("finish_reason", "?")] = by_reason.get(labels.get("finish_reason", "?"), 0) + v
    detail = ", ".join(f"{k} {int(v)}" for k, v in sorted(by_reason.items()))
    return f"{int(sum(by_reason.values()))}" + (f" ({detail})" if detail else "")


def render_status(url: str, health: Any, health_status: int, metrics_text: str) -> str:
    """The table printed by ``lockserve status``."""
    samples = parse_metrics(metrics_text)
    state = health.get("status", "?") if isinstance(health, dict) else f"HTTP {health_status}"
    model = health.get("model", "?") if isinstance(health, dict) else "?"
    ready = f"{health['ready']}/{health['total']}" if isinstance(health, dict) and "total" in health else "?"
    rows = [
        ("workers ready", ready),
        ("requests in progress", _fmt(_value(samples, "lockserve_requests_in_progress"))),
        ("queue length", _fmt(_value(samples, "lockserve_queue_length"))),
        ("running (engine)", _fmt(_value(samples, "lockserve_engine_running_requests"))),
        ("tokens/s", _fmt(_value(samples, "lockserve_generation_tokens_per_second"))),
        ("hot-cache hit rate", _fmt(_value(samples, "lockserve_hot_cache_hit_rate"), "%")),
        ("capacity used", _fmt(_value(samples, "lockserve_capacity_used"), "%")),
    ]
    for labels, v in samples.get("lockserve_kv_bytes", []):
        rows.append((f"KV bytes {labels.get('tier', '?')}", _bytes(v)))
    rows += [
        ("TTFT mean", _mean_ms(samples, "lockserve_time_to_first_token_seconds")),
        ("TPOT mean", _mean_ms(samples, "lockserve_time_per_output_token_seconds")),
        ("generated tokens", _fmt(_value(samples, "lockserve_generation_tokens_total"))),
        ("requests finished", _finished(samples)),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"lockserve at {url}: {state} (model {model})"]
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    return "\n".join(lines)
