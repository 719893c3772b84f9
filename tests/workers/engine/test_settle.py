"""Settle graphs (engine/settle.py): the summary build of the pages a decode step fills, replayed
from CUDA graphs. On CPU the engine settles eagerly; on CUDA (the lent H200) replayed settles
write the table an eager engine writes, bit for bit."""

from __future__ import annotations

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.settle import MAX_CAPTURED_MATRICES, SettleGraphs, captures
from lockserve.workers.model.presets import build_preset

from tests.workers.engine.test_engine import SMALL_BUDGET, greedy, prompt, run

# Five sequences that fill pages at different positions: settles of one and of several pages.
REQUESTS = {str(i): (prompt(n, 3 * i), greedy(40)) for i, n in enumerate((300, 150, 40, 220, 90))}


def _engine(device: str, tier: str, graphs: bool | None, dtype=torch.float32, eigh: str = "auto") -> Engine:
    model = build_preset("tiny", seed=0, device=device, dtype=dtype)
    cc = CacheConfig(tier=tier, budget_tokens=SMALL_BUDGET, hot_cache_pages=128,
                     host_capacity_gib=64 * 4096 / 2**30, summary_eigh=eigh)
    # Every prompt prefills in the first two steps (its last page a chunk of its own) and all five
    # then decode together: no step mixes prefill chunks with decode rows. Such a step runs one
    # forward without graphs and, with them, the rows' replayed graph beside a forward of the
    # chunks (runner.py): other GEMM shapes, other K/V bits, so other summaries from equal settles.
    sc = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=1024, prefill_chunk=320)
    return Engine(*model, cc, sc, device, max_pages=200, use_graphs=graphs)


def test_cpu_engines_settle_eagerly_and_graphs_refuse_the_cpu():
    engine = _engine("cpu", "hbm", None)
    assert engine.kv.settle_graphs is None
    engine.close()
    with pytest.raises(ValueError, match="settle graphs need a CUDA device, not cpu"):
        SettleGraphs(lambda pids, locs: None, 4, 6, 16, torch.device("cpu"))


def test_a_decode_steps_few_pages_replay_and_larger_or_torch_settles_build_eagerly():
    per_page = 32 * 8  # Llama-3.1-8B: layers x KV heads
    most = MAX_CAPTURED_MATRICES // per_page
    assert most == 4
    assert captures(1, per_page, 16, "auto") and captures(most, per_page, 16, "jacobi")
    assert not captures(most + 1, per_page, 16, "auto")  # a batch's settle: eager, still no host wait
    assert not captures(1, per_page, 16, "torch")  # torch.linalg.eigh waits on the host
    assert not captures(1, per_page, 12, "auto")  # the kernel pairs rows: pages of 2^n tokens


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["hbm", "host"])
def test_replayed_settles_write_the_eager_engines_table(tier):
    engines = {graphs: _engine("cuda", tier, graphs) for graphs in (False, True)}
    assert engines[False].kv.settle_graphs is None
    tokens = {graphs: run(engine, REQUESTS) for graphs, engine in engines.items()}
    assert tokens[True] == tokens[False]
    counters = engines[True].kv.settle_graphs.counters
    assert counters["settle_replays"] > 5 and counters["settle_captures"] >= 2, counters
    assert engines[True].stats()["split_steps"] == 0, "a step mixed prefill chunks with decode rows"
    eager, replayed = engines[False].kv.summaries.table, engines[True].kv.summaries.table
    for name in ("basis_q", "basis_scale", "coef_q", "coef_scale", "mu_q", "mu_scale"):
        assert torch.equal(getattr(replayed, name), getattr(eager, name)), f"{tier}: {name} differs"
    for engine in engines.values():
        engine.close()


@pytest.mark.gpu
def test_settles_the_jacobi_rule_leaves_to_torch_run_eagerly():
    """With cache.summary_eigh torch no settle replays (torch.linalg.eigh waits on the host)."""
    engine = _engine("cuda", "hbm", True, eigh="torch")
    assert engine.kv.summaries.cfg.eigh == "torch"
    run(engine, {"a": (prompt(100), greedy(40))})
    assert engine.kv.settle_graphs.counters == {"settle_replays": 0, "settle_captures": 0}
    engine.close()
