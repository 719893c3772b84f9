"""The engine on CUDA (run on the lent H200): the CPU claims again, with device tensors, the
hot-page cache on the GPU and UVA reads of the host arena."""

from __future__ import annotations

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.kernels import ops
from lockserve.workers.engine.engine import Engine
from lockserve.workers.model.presets import build_preset

from tests.workers.engine.test_engine import SMALL_BUDGET, dense_reference, greedy, prompt, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_cuda():
    return build_preset("tiny", seed=0, device="cuda", dtype=torch.float32)


def cuda_engine(tiny_cuda, tmp_path, **cache):
    if cache.get("tier") == "host+nvme":
        cache["nvme_dir"] = str(tmp_path / "nvme")
    cc = CacheConfig(**{"hot_cache_pages": 128, "host_capacity_gib": 64 * 4096 / 2**30, **cache})
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32)
    return Engine(*tiny_cuda, cc, sc, "cuda", max_pages=200)


def test_dense_matches_dense_attention_on_cuda(tiny_cuda, tmp_path):
    engine = cuda_engine(tiny_cuda, tmp_path, tier="hbm", attention="dense")
    got = run(engine, {"a": (prompt(117), greedy(12))})
    assert got["a"] == dense_reference(tiny_cuda[0], prompt(117), 12)
    engine.close()


@pytest.mark.parametrize("tier", ["host", "host+nvme"])
def test_offloaded_equals_resident_on_cuda(tiny_cuda, tier, tmp_path):
    requests = {str(i): (prompt(n, 7 * i), greedy(10)) for i, n in enumerate((300, 150, 40))}
    resident = run(cuda_engine(tiny_cuda, tmp_path, tier="hbm", budget_tokens=SMALL_BUDGET), requests)
    engine = cuda_engine(tiny_cuda, tmp_path, tier=tier, budget_tokens=SMALL_BUDGET)
    assert run(engine, requests) == resident
    assert engine.stats()["cache_hits"] > 0
    engine.close()


def test_bf16_engine_scores_with_the_cuda_kernel(tmp_path, monkeypatch):
    """In bf16, as it serves, the engine's LOCKS scoring goes to the CUDA score kernel (the tiny
    preset, G = 2 and d = 32, is a shape it reads), and the host tier still gives the resident
    tier's tokens."""
    model = build_preset("tiny", seed=0, device="cuda", dtype=torch.bfloat16)
    calls, fallbacks = [], []
    cuda_kernel, triton_kernel = ops.score_partials_cuda, ops.score_stats_triton
    monkeypatch.setattr(ops, "score_partials_cuda", lambda *a, **k: calls.append(1) or cuda_kernel(*a, **k))
    monkeypatch.setattr(ops, "score_stats_triton",
                        lambda *a, **k: fallbacks.append(1) or triton_kernel(*a, **k))
    requests = {str(i): (prompt(n, 5 * i), greedy(10)) for i, n in enumerate((300, 150, 40))}
    resident = run(cuda_engine(model, tmp_path, tier="hbm", budget_tokens=SMALL_BUDGET), requests)
    assert calls and not fallbacks, f"CUDA kernel: {len(calls)} calls, Triton: {len(fallbacks)}"
    engine = cuda_engine(model, tmp_path, tier="host", budget_tokens=SMALL_BUDGET)
    assert run(engine, requests) == resident
    engine.close()


GRAPH_REQUESTS = {str(i): (prompt(n, 3 * i), greedy(24)) for i, n in enumerate((300, 150, 40, 220, 90))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tier,attention", [("hbm", "locks"), ("host", "locks"), ("hbm", "dense")])
def test_graph_replays_give_the_eager_tokens(tmp_path, dtype, tier, attention):
    """Decode steps replayed from CUDA graphs (batch buckets, null rows, width buckets) give exactly
    the tokens of eager steps with exact shapes, and host gives hbm's."""
    model = build_preset("tiny", seed=0, device="cuda", dtype=dtype)
    engines = {}
    for graphs in (False, True):
        cc = CacheConfig(tier=tier, attention=attention, budget_tokens=SMALL_BUDGET, hot_cache_pages=128,
                         host_capacity_gib=64 * 4096 / 2**30)
        sc = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64, prefill_chunk=32)
        engines[graphs] = Engine(*model, cc, sc, "cuda", max_pages=200, use_graphs=graphs)
        engines[graphs].runner.min_width = 8  # short prompts still cross width buckets
    eager = run(engines[False], GRAPH_REQUESTS)
    graphs = run(engines[True], GRAPH_REQUESTS)
    assert graphs == eager
    counters = engines[True].runner.counters
    assert counters["graph_replays"] > 10 and counters["graph_captures"] >= 3, counters
    assert engines[False].runner.counters["graph_replays"] == 0
    for engine in engines.values():
        engine.close()


def test_graph_replays_on_host_give_the_resident_tokens(tmp_path):
    model = build_preset("tiny", seed=0, device="cuda", dtype=torch.bfloat16)
    out = {}
    for tier in ("hbm", "host"):
        cc = CacheConfig(tier=tier, budget_tokens=SMALL_BUDGET, hot_cache_pages=128,
                         host_capacity_gib=64 * 4096 / 2**30)
        sc = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=64, prefill_chunk=32)
        engine = Engine(*model, cc, sc, "cuda", max_pages=200)
        assert engine.runner.use_graphs
        out[tier] = run(engine, GRAPH_REQUESTS)
        assert engine.runner.counters["graph_replays"] > 0
        engine.close()
    assert out["host"] == out["hbm"]


@pytest.mark.parametrize("tier", ["hbm", "host", "host+nvme"])
def test_a_prompt_spread_over_steps_beside_graph_replays_gives_the_same_tokens(tmp_path, tier):
    """scheduler.prefill_layers_decoding with CUDA graphs (bf16, as it serves): beside a decoding
    request whose steps replay graphs, a chunk's forward runs a layer a step; the prompt's tokens
    equal those of whole-forward steps, and the decoder's while the two engines replay the same
    graph keys (test_runner.py checks every token on CPU with pad_decode). NOTE: the prompt joins
    the decode rows 12 steps later with the layers spread, and a replay of 2 rows need not give a
    row the bits of a replay of 1 (another GEMM shape)."""
    from tests.workers.engine.test_runner import beside

    model = build_preset("tiny", seed=0, device="cuda", dtype=torch.bfloat16)
    out = {}
    for layers in (None, 1):
        cc = CacheConfig(tier=tier, budget_tokens=SMALL_BUDGET, hot_cache_pages=128,
                         host_capacity_gib=64 * 4096 / 2**30,
                         nvme_dir=str(tmp_path / f"nvme{layers}") if tier == "host+nvme" else None)
        sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk=32,
                             prefill_layers_decoding=layers)
        engine = Engine(*model, cc, sc, "cuda", max_pages=200)
        assert engine.runner.use_graphs
        out[layers], steps = beside(engine, 40)
        parts = engine.runner.counters["prefill_parts"]
        assert (parts >= 18 and sum(i for i, _ in steps) == 12) if layers else parts == 0, (parts, steps)
        assert engine.runner.counters["graph_replays"] > 0
        engine.close()
    assert out[1]["p"] == out[None]["p"] and len(out[1]["p"]) == 6
    assert out[1]["d"][:7] == out[None]["d"][:7]  # until the prompt decodes beside it, in either
