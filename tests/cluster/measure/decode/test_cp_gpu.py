"""Context-parallel decode on CUDA (`pytest -m gpu`): the path on one GPU gives the engine's tokens,
two ranks on two GPUs (NCCL) give the one-GPU tokens, and decode steps replayed from CUDA graphs
(collectives captured) give the eager steps' tokens. Tiny model, synthetic cache fill."""

from __future__ import annotations

import json

import pytest
import torch
from lockserve.cluster.measure.decode import cp_bench

pytestmark = pytest.mark.gpu

ARGS = ["--model", "tiny-long", "--device", "cuda", "--context", "6001", "--steps", "6", "--warmup", "1",
        "--budget-tokens", "256", "--tier", "host"]


def run(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert cp_bench.main([*ARGS, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_one_gpu_rank_gives_the_engines_tokens(tmp_path):
    result = run(tmp_path, "solo", "--ranks", "1", "--compare")
    [rank] = result["per_rank"]
    assert result["same_tokens_as_engine"] is True, (rank["tokens"], [e["tokens"] for e in result["engine"]])
    assert rank["bytes_per_step"]["pcie"] > 0, "a host-tier request moves pages"
    assert rank["collectives_per_step"] == 3 * 3 and rank["collective_us_per_layer"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_over_nccl_give_the_one_gpu_tokens(tmp_path):
    solo = run(tmp_path, "solo", "--ranks", "1")
    pair = run(tmp_path, "pair", "--ranks", "2")
    first, second = pair["per_rank"]
    assert first["pages"][0] == 0 and second["pages"][0] == sum(first["pages"]), "contiguous shards"
    assert first["tokens"] == second["tokens"] == solo["per_rank"][0]["tokens"]
    assert first["collective_bytes_per_layer"] > 0


def test_graph_replays_give_the_eager_tokens(tmp_path):
    eager = run(tmp_path, "eager", "--ranks", "1")
    graphs = run(tmp_path, "graphs", "--ranks", "1", "--graphs", "on")
    [rank] = graphs["per_rank"]
    assert rank["graph_replays"] >= 6 and rank["graph_captures"] >= 1
    assert rank["tokens"] == eager["per_rank"][0]["tokens"]
    assert rank["collectives_per_step"] == 3 * 3, "replays count the captured collectives"
    assert rank["collective_graph_us_per_layer"] > 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
def test_two_gpus_replay_captured_nccl_collectives(tmp_path):
    solo = run(tmp_path, "solo", "--ranks", "1")
    pair = run(tmp_path, "pair", "--ranks", "2", "--graphs", "on")
    assert all(r["graph_replays"] >= 6 for r in pair["per_rank"])
    assert pair["per_rank"][0]["tokens"] == pair["per_rank"][1]["tokens"] == solo["per_rank"][0]["tokens"]
