"""`python -m lockserve.cluster.measure.decode.cp_bench` on the CPU (tiny model, one rank in this process):
the fields its result file holds, and the context-parallel path's tokens equal the engine's."""

from __future__ import annotations

import json

import pytest
import torch
from lockserve.cluster.measure.decode import cp_bench
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.workers.engine import Engine
from lockserve.workers.engine.context_parallel import ShardEngine
from lockserve.workers.model.presets import build_preset


def test_cp_bench_writes_tpot_bytes_and_collective_time(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # torch paths of the cache: seconds, not minutes
    out = tmp_path / "cp.json"
    argv = ["--model", "tiny-long", "--device", "cpu", "--context", "1001", "--steps", "3", "--warmup", "1",
            "--budget-tokens", "64", "--compare", "--out", str(out)]
    assert cp_bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"][-len(argv):] == argv and "synthetic" in result["workload"]
    [rank] = result["per_rank"]
    for key in ("tpot_ms_median", "tpot_ms_p90", "step_ms", "hit_rate", "bytes_per_step",
                "collectives_per_step", "collective_bytes_per_layer", "collective_us_per_layer", "tokens"):
        assert key in rank, key
    assert rank["collectives_per_step"] == 3 * 3, "three collectives per layer, three layers"
    assert rank["bytes_per_step"]["pcie"] > 0 and len(rank["step_ms"]) == 3
    assert [e["graphs"] for e in result["engine"]] == ["on", "off"]
    assert result["same_tokens_as_engine"] is True
    profile = rank["profile"]  # one more step, traced (on the CPU: no device kernels, host ops only)
    assert profile["device_kernels"] == 0 and profile["device_kernels_per_layer"] == 0


def test_shard_ranges_put_every_new_token_on_the_last_rank():
    assert cp_bench.shard_ranges(100, 90, 1) == [(0, 100)]
    assert cp_bench.shard_ranges(100, 90, 4) == [(0, 25), (25, 25), (50, 25), (75, 25)]
    assert cp_bench.shard_ranges(100, 30, 3) == [(0, 15), (15, 15), (30, 70)]


def test_graphs_need_a_cuda_device(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cp_bench.parse_args(["--device", "cpu", "--graphs", "on", "--out", str(tmp_path / "x.json")])
    assert "--graphs on needs a CUDA device" in capsys.readouterr().err


def test_a_rank_refuses_graphs_off_cuda():
    model, tokenizer = build_preset("tiny", seed=0, device="cpu")
    engine = Engine(model, tokenizer, CacheConfig(attention="locks", tier="hbm", budget_tokens=64),
                    SchedulerConfig(max_num_seqs=1), torch.device("cpu"), max_pages=64)
    try:
        with pytest.raises(ValueError, match=r"use_graphs \(True\) needs a CUDA device"):
            ShardEngine(engine, use_graphs=True)
        assert ShardEngine(engine).use_graphs is False
    finally:
        engine.close()


def test_each_rank_sizes_its_engine_for_its_own_pages(tmp_path):
    """Two ranks at 1M tokens of the 8B shape must not each ask for the whole request's arena."""
    args = cp_bench.parse_args(["--model", "tiny-long", "--device", "cpu", "--context", "100000",
                                "--out", str(tmp_path / "x.json")])
    model, _ = build_preset("tiny-long", seed=0, device="cpu")
    spec = cp_bench.bench_spec(args)
    full = cp_bench.bench_sizing(model, "locks:host", spec)
    half = cp_bench.rank_sizing(model, "locks:host", spec, full.max_pages // 2)
    assert half.max_pages == full.max_pages // 2 + 1 and half.max_model_len == full.max_model_len
    assert full.host_gib / 2 - 0.01 < half.host_gib <= full.host_gib / 2 + 0.011  # + 0.01 GiB of slack
