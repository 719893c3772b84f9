"""The decode forwards that CUDA graphs capture have no host synchronisation (checked on the CPU).

A capture fails on the first op that waits on the device, and on CUDA that is only found on a GPU.
Here the same code runs on the CPU with the kernels CUDA runs (Triton in TRITON_INTERPRET=1, the
hot-page cache's Triton backend) under tests/host_syncs.py, which records every op and tensor
method that would wait: the engine runner's decode forward on every tier, and the
context-parallel rank's decode forward as it is captured (`group.capturing`).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.offload.factory import make_tier
from lockserve.workers.engine import kv_manager
from lockserve.workers.engine.context_parallel import ShardEngine, ShardSpec
from lockserve.workers.engine.cp_attention import ShardAttention
from lockserve.workers.engine.cp_group import RankGroup
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.presets import build_preset

from tests.host_syncs import host_syncs

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs TRITON_INTERPRET=1: the CUDA path's kernels on the CPU")
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # one decode step each


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0, device="cpu")


@pytest.fixture
def triton_tiers(monkeypatch):
    """Engines built here read the host arena through the cache's Triton kernels, as on CUDA."""
    monkeypatch.setattr(kv_manager, "make_tier", functools.partial(make_tier, gather_backend="triton"))


def engine(tiny, tier: str, tmp_path, max_pages: int = 40, kernels: str = "ops") -> Engine:
    cache = CacheConfig(tier=tier, budget_tokens=64, hot_cache_pages=128, host_capacity_gib=64 * 4096 / 2**30,
                        nvme_dir=str(tmp_path / "nvme") if tier == "host+nvme" else None)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=128, prefill_chunk=128)
    return Engine(*tiny, cache, sched, "cpu", max_pages=max_pages, kernels=kernels)


@pytest.mark.parametrize("make, sync", [
    (lambda t: t.sum().item(), True),
    (lambda t: bool(t.any()), True),
    (lambda t: int(t.max()), True),
    (lambda t: t.tolist(), True),
    (lambda t: t.cpu(), True),
    (lambda t: t.nonzero(), True),
    (lambda t: t[t > 2], True),
    (lambda t: torch.unique(t), True),
    (lambda t: t.repeat_interleave(t), True),
    (lambda t: torch.equal(t, t), True),
    (lambda t: (t + 1).clamp_min(0).index_select(0, t.flip(0)), False),
    (lambda t: t[t.flip(0)] * torch.where(t > 2, t, -1), False),
    (lambda t: t.repeat_interleave(t, output_size=10), False),
], ids=["item", "bool", "int", "tolist", "cpu", "nonzero", "bool-index", "unique", "repeat_interleave",
        "equal", "gather", "int-index-where", "repeat_interleave-sized"])
def test_the_guard_sees_every_kind_of_host_sync(make, sync):
    with host_syncs() as found:
        make(torch.arange(5))
    assert bool(found) == sync, found.report() or "nothing recorded"


@pytest.mark.parametrize("tier", ["hbm", "host", "host+nvme"])
def test_the_runners_decode_forward_has_no_host_sync(tiny, tier, tmp_path, triton_tiers):
    eng = engine(tiny, tier, tmp_path)
    assert (tier != "hbm") == getattr(eng.kv.settled, "_fold_outside", False), "cached tiers fold"
    eng.runner.pad_decode = True  # decode-only steps take the captured function, run eagerly
    forward, calls = eng.runner._forward_decode, []

    def guarded(key):
        with host_syncs() as found:
            logits = forward(key)
        calls.append(found)
        return logits

    eng.runner._forward_decode = guarded
    for i in range(2):  # pruned rows (budget 64 tokens: 4 pages) of two lengths; a synthetic prefill
        eng.add_request(f"r{i}", list(range(90 + 37 * i)), GREEDY)
        eng.fill_synthetic(f"r{i}", seed=i)
    while eng.has_unfinished():
        eng.step()
    reruns = eng.kv.settled.counters().get("nvme_step_reruns")
    eng.close()
    assert tier != "host+nvme" or reruns, "pages spilled and a forward ran again (its reruns are checked too)"
    assert len(calls) >= GREEDY.max_tokens - 1, "every step decodes through the captured function"
    assert eng.runner.last_padded is not None and eng.runner.last_padded[1].scored, "scored rows"
    bad = [found.report() for found in calls if found]
    assert not bad, f"{tier}: host syncs in the decode forward a graph captures:\n{bad[0]}"


@pytest.mark.parametrize("tier", ["hbm"])  # the tiers' reads are the runner test's
def test_a_context_parallel_ranks_decode_forward_has_no_host_sync(tiny, tier, tmp_path, triton_tiers,
                                                                  monkeypatch):
    """One rank (the Triton interpreter cannot run ranks in threads): its collectives are copies,
    and the rest of the per-layer path (scores and normalisers, candidate keys, the threshold, the
    selected slots, sparse attention, the merges) is the one every rank runs."""
    forward, calls = ShardEngine._model_forward, []

    def guarded(self, shard, step, ids, positions, phase):
        if phase != "decode":
            return forward(self, shard, step, ids, positions, phase)
        shard.group.capturing = True  # as ShardEngine._capture runs it
        try:
            with host_syncs() as found:
                hidden = forward(self, shard, step, ids, positions, phase)
        finally:
            shard.group.capturing = False
        calls.append(found)
        return hidden

    monkeypatch.setattr(ShardEngine, "_model_forward", guarded)
    rank, total, context = ShardEngine(engine(tiny, tier, tmp_path, max_pages=60)), 60, 701
    rank.open(ShardSpec("r", 0, 1, 0, total, total, 8), RankGroup.solo(torch.device("cpu")), GREEDY)
    rank.fill_synthetic("r", context, 4)  # 43 full pages against a budget of 4: scored
    tokens = [7]
    while len(tokens) < GREEDY.max_tokens:
        tokens.append(rank.decode("r", tokens[-1], context + len(tokens) - 1))
    rank.close("r")
    assert len(calls) == GREEDY.max_tokens - 1
    bad = [found.report() for found in calls if found]
    assert not bad, f"{tier}: host syncs in the decode forward a graph captures:\n{bad[0]}"


def test_a_rank_on_the_triton_kernels_selects_and_decodes_as_the_reference(tiny, tmp_path, monkeypatch):
    """The rank's decode path as CUDA runs it (score, candidates, threshold and selection, slots,
    attention: Triton, interpreted) gives the torch reference's selected pages and their slots,
    lengths, open flags and pool indices at every layer and step, and its greedy tokens. (One rank:
    its candidates are the global ones, so the threshold keeps them all; the kernel tests cover
    several ranks.)"""
    slots_of, seen = ShardAttention._slots, []

    def recorded(self, layer, sel):
        out = slots_of(self, layer, sel)
        seen.append([sel.tolist()] + [getattr(out, f).tolist() for f in ("slots", "lens", "is_open", "idx")])
        return out

    monkeypatch.setattr(ShardAttention, "_slots", recorded)
    got = {}
    for kernels in ("ops", "reference"):
        seen.clear()
        rank = ShardEngine(engine(tiny, "hbm", tmp_path, max_pages=60, kernels=kernels))
        rank.open(ShardSpec("r", 0, 1, 0, 60, 60, 8), RankGroup.solo(torch.device("cpu")), GREEDY)
        rank.fill_synthetic("r", 701, 4)  # 43 full pages against a budget of 8: scored
        tokens = [7]
        while len(tokens) < GREEDY.max_tokens:
            tokens.append(rank.decode("r", tokens[-1], 701 + len(tokens) - 1))
        rank.close("r")
        got[kernels] = (tokens, list(seen))
    assert len(got["ops"][1]) == (GREEDY.max_tokens - 1) * tiny[0].config.num_layers
    assert got["ops"][1] == got["reference"][1], "selections and their slots, layer by layer"
    assert got["ops"][0] == got["reference"][0]
