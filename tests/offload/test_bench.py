"""The benchmark script's logic, tiny, on CPU (its numbers mean nothing here; its code paths do)."""

from __future__ import annotations

import json

import pytest
from lockserve.offload import bench


def test_bench_runs_tiny_on_cpu(tmp_path):
    out = tmp_path / "results" / "gather.json"
    argv = [
        "--out", str(out), "--device", "cpu", "--pool-gib", "0.001", "--gather-pages", "1", "3",
        "--copy-mib", "1", "--steps", "6", "--streams", "2", "--pages-per-stream", "8", "--k", "3",
        "--cache-pages", "6", "12", "--churn", "0.5",
    ]  # fmt: skip
    bench.main(argv)
    report = json.loads(out.read_text())
    assert report["command"] == ["python", "-m", "lockserve.offload.bench", *argv]
    assert report["device"] == "cpu" and report["torch"] and report["started_utc"] == report["date"]
    assert [r["pages"] for r in report["uva_gather"]] == [1, 3]
    assert all(r["bytes_correct"] for r in report["uva_gather"])
    assert report["profiler"] == {"sync_like_calls": [], "runtime_calls": []}, report["profiler"]
    assert report["graph_capture"]["captured"] is None
    rows = report["hot_cache"]
    assert [r["cache_pages"] for r in rows] == [6, 12]
    for r in rows:
        assert r["hits"] + r["misses"] > 0 and 0.0 <= r["hit_rate"] <= 1.0
        assert r["bytes_moved_per_step_mean"] == r["misses"] * report["arena"]["slot_bytes"] / 6


def test_bench_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--device", "cpu", "--steps", "1"])
    assert "--steps (1) must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--device", "cpu", "--churn", "1.5"])
    assert "--churn values ([1.5]) must be in [0, 1]" in capsys.readouterr().err
