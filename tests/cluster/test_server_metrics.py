"""/metrics and /health: Prometheus text that parses, with values that match what was served."""

from __future__ import annotations

import httpx
import openai
import pytest
from lockserve.cluster.engine_client import TokenEvent
from lockserve.cluster.metrics import RequestTracker, ServerMetrics, TokenRate
from prometheus_client.parser import text_string_to_metric_families

from tests.cluster.echo_engine import EchoEngine, start_server


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted label items: value}} of one /metrics scrape."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def one(samples, name, **labels) -> float:
    assert name in samples, f"{name} missing from /metrics; have {sorted(samples)}"
    return samples[name][tuple(sorted(labels.items()))]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_metrics_after_traffic_match_what_was_served():
    engine = EchoEngine()
    engine.stats_values = {
        "queue_len": 3,
        "hit_rate": 0.625,
        "capacity_used": 0.25,
        "bytes_per_tier": {"hbm": 4096, "host": 1 << 20},
        "nvme_spilled_pages": 7,  # a counter the real engine reports on tier host+nvme
    }
    with start_server(engine) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="x") as client:
        outs = [
            client.completions.create(model="echo-test", prompt=p, max_tokens=50) for p in ("abc", "hello!")
        ]
        outs.append(client.completions.create(model="echo-test", prompt="truncate me", max_tokens=4))
        for p in ("chat one", "chat two"):
            stream = client.chat.completions.create(
                model="echo-test", messages=[{"role": "user", "content": p}], max_tokens=50, stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
            outs.append([c for c in stream][-1])
        samples = scrape(server.url)

    completion = sum(o.usage.completion_tokens for o in outs)
    prompt = sum(o.usage.prompt_tokens for o in outs)
    assert completion == engine.tokens_emitted
    assert one(samples, "lockserve_generation_tokens_total") == completion
    assert one(samples, "lockserve_prompt_tokens_total") == prompt
    assert one(samples, "lockserve_time_to_first_token_seconds_count") == 5
    assert one(samples, "lockserve_time_per_output_token_seconds_count") == completion - 5
    assert one(samples, "lockserve_e2e_request_latency_seconds_count") == 5
    assert 0 < one(samples, "lockserve_time_to_first_token_seconds_sum") < 5
    assert one(samples, "lockserve_generation_tokens_per_second") == pytest.approx(completion / 10.0)
    assert one(samples, "lockserve_requests_total", endpoint="completions", finish_reason="stop") == 2
    assert one(samples, "lockserve_requests_total", endpoint="completions", finish_reason="length") == 1
    assert one(samples, "lockserve_requests_total", endpoint="chat", finish_reason="stop") == 2
    assert one(samples, "lockserve_requests_in_progress") == 0
    # engine gauges mirror engine.stats() at scrape time
    assert one(samples, "lockserve_engine_up") == 1
    assert one(samples, "lockserve_queue_length") == 3
    assert one(samples, "lockserve_engine_running_requests") == 0
    assert one(samples, "lockserve_hot_cache_hit_rate") == 0.625
    assert one(samples, "lockserve_capacity_used") == 0.25
    assert one(samples, "lockserve_kv_bytes", tier="hbm") == 4096
    assert one(samples, "lockserve_kv_bytes", tier="host") == 1 << 20
    assert one(samples, "lockserve_engine_nvme_spilled_pages") == 7


def test_rejected_requests_are_counted_by_status():
    with start_server(EchoEngine(capacity=100)) as server:
        url = server.url + "/v1/completions"
        httpx.post(url, json={"prompt": "x", "max_tokens": -1})
        httpx.post(url, json={"prompt": "x", "model": "nope"})
        httpx.post(url, json={"prompt": "x" * 200, "max_tokens": 1})  # engine.check_request refuses
        samples = scrape(server.url)
    assert one(samples, "lockserve_rejected_requests_total", status="400") == 2
    assert one(samples, "lockserve_rejected_requests_total", status="404") == 1
    assert one(samples, "lockserve_requests_in_progress") == 0
    assert one(samples, "lockserve_prompt_tokens_total") == 0, "rejected prompts are not admitted"


def test_histogram_buckets_are_cumulative():
    engine = EchoEngine()
    with start_server(engine) as server, openai.OpenAI(base_url=server.url + "/v1", api_key="x") as client:
        for n in (3, 9, 27):
            client.completions.create(model="echo-test", prompt="z" * n, max_tokens=n)
        samples = scrape(server.url)
    for name in ("lockserve_time_to_first_token_seconds", "lockserve_time_per_output_token_seconds"):
        buckets = sorted(
            ((float(dict(labels)["le"]), v) for labels, v in samples[name + "_bucket"].items()),
            key=lambda x: x[0],
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts), f"{name} buckets are not cumulative: {buckets}"
        assert buckets[-1] == (float("inf"), one(samples, name + "_count"))
    assert one(samples, "lockserve_time_per_output_token_seconds_count") == (3 - 1) + (9 - 1) + (27 - 1)


def test_engine_stats_failure_is_reported_not_raised():
    engine = EchoEngine()
    with start_server(engine) as server:
        engine.stats_error = RuntimeError("worker actor died")
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "worker actor died" in health.json()["error"]
        samples = scrape(server.url)
        assert one(samples, "lockserve_engine_up") == 0 and "lockserve_queue_length" not in samples
        engine.stats_error = None
        assert httpx.get(server.url + "/health").status_code == 200
        assert one(scrape(server.url), "lockserve_engine_up") == 1


def test_two_apps_keep_separate_registries():
    a, b = EchoEngine(), EchoEngine()
    with start_server(a) as sa, start_server(b) as sb:
        httpx.post(sa.url + "/v1/completions", json={"prompt": "four", "max_tokens": 10})
        assert one(scrape(sa.url), "lockserve_generation_tokens_total") == 4
        assert one(scrape(sb.url), "lockserve_generation_tokens_total") == 0


def test_engine_call_failure_is_a_500_and_the_server_keeps_serving():
    class BrokenCheck(EchoEngine):
        def check_request(self, prompt_tokens, params, options):
            raise RuntimeError("admission actor unreachable")

    with start_server(BrokenCheck()) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 500 and "admission actor unreachable" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/v1/models").status_code == 200


def test_tracker_times_ttft_and_tpot_exactly():
    clock = FakeClock()
    metrics = ServerMetrics(lambda: {})
    tracker = RequestTracker(metrics, "completions", clock=clock)
    clock.t += 0.5
    tracker.on_event(TokenEvent("a", [1], None, 4, 1))
    clock.t += 0.2
    tracker.on_event(TokenEvent("b", [2], None, 4, 2))
    clock.t += 0.3
    tracker.on_event(TokenEvent("", [], None, 4, 2))  # no tokens: no timing
    tracker.on_event(TokenEvent("cde", [3, 4, 5], "length", 4, 5))
    tracker.finish("length")
    tracker.finish("length")  # idempotent
    value = metrics.registry.get_sample_value
    assert value("lockserve_time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value("lockserve_time_to_first_token_seconds_count") == 1
    assert value("lockserve_time_per_output_token_seconds_count") == 4  # 1 + 3 tokens after the first
    assert value("lockserve_time_per_output_token_seconds_sum") == pytest.approx(0.2 + 3 * 0.1)
    assert value("lockserve_e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert value("lockserve_requests_total", {"endpoint": "completions", "finish_reason": "length"}) == 1
    assert value("lockserve_requests_in_progress") == 0


def test_token_rate_window():
    clock = FakeClock()
    rate = TokenRate(window_s=4.0, clock=clock)
    rate.add(8)
    clock.t += 2
    rate.add(4)
    assert rate.rate() == pytest.approx(12 / 4)
    clock.t += 3  # the first add is now 5 s old
    assert rate.rate() == pytest.approx(4 / 4)
    with pytest.raises(ValueError, match=r"window_s \(0\) must be > 0"):
        TokenRate(window_s=0)
