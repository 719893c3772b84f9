"""Context-parallel ranks on the CPU: the exact distributed selection, the partial attention, and
ranks (threads of this process, a real gloo group) against one Engine on the tiny preset.

References: kernels/select.py's select_decode_pages on the whole row (the single-node rule), a
materialised causal softmax, and the Engine itself (tokens and each decode layer's selected pages).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import lockserve.kernels.select as kernel_select
import pytest
import torch
import torch.distributed as dist
from lockserve.configs.schema import CacheConfig, SchedulerConfig
from lockserve.kernels.score import group_stats_ref
from lockserve.workers.engine import cp_attention, cp_selection
from lockserve.workers.engine.context_parallel import ShardEngine, ShardSpec
from lockserve.workers.engine.cp_group import RankGroup
from lockserve.workers.engine.engine import Engine
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.presets import build_preset

from tests.conftest import assert_close, record_selections, triton_devices

PAGE = 16


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny-long", seed=0, device="cpu")


# ---- the selection, given the keys ----------------------------------------------------------------


def distributed_select(m_bar, n, budget, bounds, sink=1, recent=2):
    """The rank-side protocol on one row: m_bar [1, Hkv, P] split at page bounds -> the union of the
    ranks' selections, [Hkv] sorted lists (what all ranks attend together)."""
    t = budget - sink - recent
    num_pages = torch.tensor([n])
    parts = []
    for first, end in zip(bounds[:-1], bounds[1:], strict=True):
        first_t = torch.tensor([first])
        settled = torch.tensor([max(0, min(n - 1, end) - first)])
        keys = kernel_select.competing_keys(m_bar[..., first:end], first_t, settled, num_pages, sink, recent)
        parts.append((first_t, torch.tensor([max(0, min(n, end) - first)]),
                      cp_selection.local_candidates(keys, first_t, t)))
    thr = cp_selection.global_threshold(torch.stack([p[2] for p in parts]), torch.tensor([t]))
    heads = [[] for _ in range(m_bar.shape[1])]
    for first_t, count, cands in parts:
        sel = cp_selection.shard_selection(cands, thr, first_t, count, num_pages, sink, recent)
        for h, row in enumerate(sel[0]):
            heads[h] += [x for x in row.tolist() if x >= 0]
    return [sorted(h) for h in heads]


def single_select(m_bar, n, budget, sink=1, recent=2):
    n, budgets = torch.tensor([n]), torch.tensor([budget])
    sel = kernel_select.select_decode_pages(m_bar, n, budgets, budget, sink, recent)
    return [sorted(x for x in row.tolist() if x >= 0) for row in sel[0]]


# Rank bounds over a row of 53 pages (the open page is 52): uneven ranges, a rank that holds only the
# open page (the last full page then lives on the rank before), a one-page rank, a single rank.
BOUNDS = [[0, 53], [0, 20, 53], [0, 1, 2, 30, 52, 53], [0, 17, 18, 41, 53], [0, 51, 53]]


@pytest.mark.parametrize("bounds", BOUNDS, ids=lambda b: f"{len(b) - 1}ranks")
@pytest.mark.parametrize("budget", [4, 9, 23])
def test_distributed_selection_equals_single_node_ties_included(bounds, budget):
    g = torch.Generator().manual_seed(len(bounds) * 100 + budget)
    m_bar = torch.randint(0, 4, (1, 3, 53), generator=g).float() / 8  # four values: ties everywhere
    m_bar[0, 2] = 0.25  # one KV head where every page ties
    assert distributed_select(m_bar, 53, budget, bounds) == single_select(m_bar, 53, budget)


def test_a_threshold_without_the_position_tie_break_is_caught(monkeypatch):
    """The same protocol with the threshold compared on the value alone keeps every page tied with
    it: the check above must see the difference (else it could not fail)."""
    m_bar = torch.full((1, 1, 53), 0.5)
    m_bar[0, 0, 10:20] = 0.75
    bounds = [0, 20, 53]
    assert distributed_select(m_bar, 53, 14, bounds) == single_select(m_bar, 53, 14)
    value_alone = lambda cands, thr: ((cands >> 32) >= (thr >> 32)[..., None]) & (cands > cp_selection.EMPTY)  # noqa: E731
    monkeypatch.setattr(kernel_select, "at_or_above", value_alone)  # where shard_selection finds it
    assert distributed_select(m_bar, 53, 14, bounds) != single_select(m_bar, 53, 14)


def test_rows_within_their_budget_take_every_page_of_the_rank():
    sel = cp_selection.all_local_pages(torch.tensor([5, 0]), torch.tensor([3, 1]), 2, 4)
    assert sel.tolist() == [[[5, 6, 7, -1]] * 2, [[0, -1, -1, -1]] * 2]


@pytest.mark.parametrize("device", triton_devices())
def test_the_kernels_chunk_candidates_give_the_ranks_best_t(device):
    """ShardAttention's candidates from the Triton path (each chunk's best t, one launch) and from
    the torch path (every competing page) are the same pages in the same order, over two ranks of
    a 2,600-page row (three chunks on the first) with ties, the sink on one and the recent pages
    on the other."""
    from lockserve.kernels import ops

    g = torch.Generator().manual_seed(11)
    hkv, grp, t = 2, 3, 40
    s_hat = torch.randint(0, 50, (2, hkv, grp, 2600), generator=g).float() * 0.01  # ties everywhere
    stats = group_stats_ref(s_hat)
    first, settled, n = torch.tensor([0, 2100]), torch.tensor([2600, 499]), torch.tensor([2700, 2600])
    got = []
    for backend, dev in (("torch", "cpu"), ("triton", device)):
        args = [x.to(dev) for x in (s_hat, stats, first, settled, n)]
        keys, cols = ops.shard_chunk_topk(*args, t, 1, 2, backend=backend)
        got.append(cp_selection.local_candidates(keys, args[2], t, cols).cpu())
    assert got[1].shape == (2, hkv, t)
    assert torch.equal(cp_selection.key_positions(got[1]), cp_selection.key_positions(got[0]))


def test_order_keys_order_as_value_desc_then_position_asc():
    """The candidates' int64 keys sort exactly as the selection's (value desc, position asc), over
    negative, zero (both signs), subnormal, huge and -inf values, and give their positions back."""
    g = torch.Generator().manual_seed(5)
    pool = torch.tensor([-math.inf, -3e38, -1.5, -1e-40, -0.0, 0.0, 1e-40, 0.125, 0.5, 3e38])
    values = pool[torch.randint(0, pool.numel(), (400,), generator=g)]
    positions = torch.randperm(1 << 20, generator=g)[:400] * 2047  # distinct, up to about 2^31
    positions[0] = cp_selection.NO_PAGE
    keys = cp_selection.order_keys(values, positions)
    want = sorted(range(400), key=lambda i: (-float(values[i]), int(positions[i])))
    assert keys.argsort(descending=True).tolist() == want
    assert torch.equal(cp_selection.key_positions(keys), positions)
    real = keys[values > -math.inf]
    assert bool((real > cp_selection.EMPTY).all()), "a page with a score ranks above an empty slot"


# ---- the normalisers ------------------------------------------------------------------------------


def test_merged_normalisers_equal_the_whole_rows():
    g = torch.Generator().manual_seed(3)
    s_hat = torch.randn(2, 3, 4, 61, generator=g) * 4
    s_hat[1, :, :, 40:] = -math.inf  # padding
    whole = group_stats_ref(s_hat)
    one = cp_selection.merge_stats(whole[None])
    assert torch.equal(one, whole), "one rank must give its own normalisers back bit for bit"
    for bounds in ([0, 30, 61], [0, 1, 45, 46, 61], [0, 40, 61]):  # [40, 61) of row 1: no score at all
        ranges = zip(bounds[:-1], bounds[1:], strict=True)
        parts = torch.stack([group_stats_ref(s_hat[..., a:b]) for a, b in ranges])
        merged = cp_selection.merge_stats(parts)
        assert torch.equal(merged[..., 0], whole[..., 0]), "the max merges exactly"
        assert_close(merged[..., 1], whole[..., 1], f"sum exp over ranks {bounds}")


# ---- the partial prefill attention ----------------------------------------------------------------


def causal_reference(q, keys, values, q_start, key_start):
    """Materialised: query i (position q_start + i) over key j (position key_start + j <= it)."""
    logits = torch.einsum("nhd,lhd->hnl", q.double(), keys.double().repeat_interleave(2, dim=1))
    logits = logits / math.sqrt(q.shape[-1])
    key_pos, q_pos = key_start + torch.arange(keys.shape[0]), q_start + torch.arange(q.shape[0])
    visible = key_pos[None, :] <= q_pos[:, None]
    logits = logits.masked_fill(~visible[None], -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, 0)[..., None])
    o = torch.einsum("hnl,lhd->nhd", p, values.double().repeat_interleave(2, dim=1))
    return o.float(), lse.T.float()


# (q_start, key_start, keys): keys before the chunk only; the chunk's own only; both; a rank whose
# range starts inside the chunk; one that ends inside it; a rank past the chunk (no key).
CASES = [(50, 0, 50), (50, 50, 9), (50, 13, 46), (50, 57, 5), (50, 20, 37), (50, 64, 0)]


@pytest.mark.parametrize("blocked", [False, True], ids=["cpu-flash", "blocked"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-k{c[1]}+{c[2]}")
def test_partial_attention_equals_a_materialised_causal_softmax(case, blocked, monkeypatch):
    q_start, key_start, length = case
    g = torch.Generator().manual_seed(length)
    q = torch.randn(17, 4, 32, generator=g)
    keys, values = torch.randn(length, 2, 32, generator=g), torch.randn(length, 2, 32, generator=g)
    if blocked:
        monkeypatch.setattr(cp_attention, "_cpu_flash", None)
        monkeypatch.setattr(cp_attention, "ATTENTION_BLOCK", 7)
    o, lse = cp_attention.partial_attention(q, keys, values, q_start, key_start)
    want_o, want_lse = causal_reference(q, keys, values, q_start, key_start)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), "queries that see no key: lse -inf"
    assert_close(lse[torch.isfinite(lse)], want_lse[torch.isfinite(want_lse)], "lse")
    assert_close(o, want_o, "o (0 where no key is seen)")


# ---- ranks against one engine ---------------------------------------------------------------------


def make_engine(tiny, tier: str, chunk: int, max_pages: int = 400) -> Engine:
    cache = CacheConfig(tier=tier, budget_tokens=128, hot_cache_pages=64, host_capacity_gib=0.01)
    scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=chunk, prefill_chunk=chunk)
    return Engine(*tiny, cache, scheduler, "cpu", max_pages=max_pages)


def one_engine(tiny, tier, chunk, prompt, params, seed=None):
    """(tokens, selections [step][layer][KV head]) of the request in one Engine."""
    with record_selections() as recorded:
        engine = make_engine(tiny, tier, chunk)
        engine.add_request("r", prompt, params)
        tokens = [engine.fill_synthetic("r", seed)] if seed is not None else []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() for t in out.token_ids]
    return tokens, recorded.by_step(tiny[0].config.num_layers)


def sharded(tiny, tier, chunk, prompt, params, bounds, seed=None):
    """(tokens, selections, per-rank reports) of the request over ranks with these page bounds
    (threads of this process in one gloo group); the calls a coordinator makes."""
    size, total = len(bounds) - 1, bounds[-1]
    store = dist.HashStore()
    ranks = [ShardEngine(make_engine(tiny, tier, chunk)) for _ in range(size)]
    specs = [ShardSpec("r", i, size, bounds[i], bounds[i + 1] - bounds[i], total, 8) for i in range(size)]
    with ThreadPoolExecutor(size) as pool:
        def every(fn):
            return list(pool.map(fn, range(size)))

        every(lambda i: ranks[i].open(specs[i], RankGroup.local(store, i, size), params, trace=True))
        if seed is not None:
            every(lambda i: ranks[i].fill_synthetic("r", len(prompt), seed))
            tokens = [prompt[-1]]
        else:
            for start in range(0, len(prompt), chunk):
                part = prompt[start : start + chunk]
                last = start + len(part) == len(prompt)
                tokens = every(lambda i, s=start, p=part, e=last: ranks[i].prefill("r", s, p, e))[:1]
        while len(tokens) < params.max_tokens:
            position = len(prompt) + len(tokens) - 1
            tokens += every(lambda i, t=tokens[-1], p=position: ranks[i].decode("r", t, p))[:1]
        reports = every(lambda i: ranks[i].close("r"))
    assert all(r.free_pages == r.capacity_pages for r in ranks), "close frees every page"
    selections = []
    for step in zip(*(rep["trace"] for rep in reports), strict=True):
        selections.append([[sorted(p for sel in layer for p in sel[0, h].tolist() if p >= 0)
                            for h in range(layer[0].shape[1])] for layer in zip(*step, strict=True)])
    return tokens, [s for s in selections if s], reports


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("tier", ["hbm", "host"])
@pytest.mark.parametrize("bounds", [[0, 95], [0, 31, 95], [0, 19, 50, 94, 95]],
                         ids=["1rank", "2ranks", "4ranks-open-page-alone"])
def test_prefill_and_decode_over_ranks_equal_one_engine(tiny, tier, bounds):
    """1,504 prompt tokens = 94 full pages (the first decode token opens page 94, which the last
    rank of the 4-rank split holds alone: the last full page is then on the rank before); chunks of
    40 tokens cross page and rank boundaries."""
    prompt = torch.randint(0, 256, (1504,), generator=torch.Generator().manual_seed(1)).tolist()
    want, want_sel = one_engine(tiny, tier, 40, prompt, GREEDY)
    tokens, selections, reports = sharded(tiny, tier, 40, prompt, GREEDY, bounds)
    assert tokens == want
    assert len(selections) == len(want_sel) == 7 and selections == want_sel
    calls = [rep["collectives"]["decode"]["calls"] for rep in reports]
    assert calls == [7 * 3 * 3] * (len(bounds) - 1), "three collectives per decode layer, on every rank"


def test_synthetic_cache_over_ranks_equals_one_engines(tiny):
    prompt = torch.randint(0, 256, (3001,), generator=torch.Generator().manual_seed(2)).tolist()
    want, want_sel = one_engine(tiny, "host", 64, prompt, GREEDY, seed=4)
    tokens, selections, _ = sharded(tiny, "host", 64, prompt, GREEDY, [0, 70, 130, 188], seed=4)
    assert tokens == want and want_sel and selections == want_sel


def test_shard_spec_refuses_ranges_that_break_the_layout():
    ShardSpec("r", 0, 2, 0, 10, 30, 8)
    ShardSpec("r", 1, 2, 10, 20, 30, 8)
    with pytest.raises(ValueError, match="only the last rank"):
        ShardSpec("r", 0, 2, 0, 30, 30, 8)
    with pytest.raises(ValueError, match="non-empty range"):
        ShardSpec("r", 1, 2, 10, 0, 30, 8)
    with pytest.raises(ValueError, match=r"rank \(2\) must be in"):
        ShardSpec("r", 2, 2, 10, 20, 30, 8)


def test_a_step_that_fails_on_one_rank_fails_the_others_at_once(tiny):
    """Rank 1 refuses a step (a wrong position); rank 0, already waiting in the step's first
    collective, must fail within seconds, not after the group's timeout (60 s here)."""
    store = dist.HashStore()
    ranks = [ShardEngine(make_engine(tiny, "hbm", 64)) for _ in range(2)]
    specs = [ShardSpec("r", 0, 2, 0, 10, 20, 4), ShardSpec("r", 1, 2, 10, 10, 20, 4)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: ranks[i].open(specs[i], RankGroup.local(store, i, 2), GREEDY), range(2)))
        list(pool.map(lambda i: ranks[i].fill_synthetic("r", 200, 1), range(2)))
        begin = time.monotonic()
        good = pool.submit(ranks[0].decode, "r", 5, 200)
        bad = pool.submit(ranks[1].decode, "r", 5, 201)
        with pytest.raises(ValueError, match="201"):
            bad.result()
        with pytest.raises(RuntimeError):
            good.result()
        assert time.monotonic() - begin < 10
    assert [r.close("r")["rank"] for r in ranks] == [0, 1] and ranks[0].free_pages == ranks[0].capacity_pages


def test_one_rank_writes_one_engines_kv_bit_for_bit(tiny):
    """With one rank both merges are exact (its own normaliser, its own partial) and prefill runs
    the engine's two flash calls: every K/V the model writes (layers past the first depend on the
    attention outputs before them) equals one engine's, bit for bit."""
    prompt = torch.randint(0, 256, (700,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine = make_engine(tiny, "hbm", 48)
    engine.add_request("r", prompt, params)
    tokens = []
    while len(tokens) < 5:  # stop before the last step, which frees the pages
        tokens += [t for out in engine.step() for t in out.token_ids]
    rank = ShardEngine(make_engine(tiny, "hbm", 48))
    total = math.ceil((700 + 6) / PAGE)
    rank.open(ShardSpec("r", 0, 1, 0, total, total, 8), RankGroup.solo(torch.device("cpu")), params)
    # the engine's chunks: 48 tokens, the tail from its last reusable page on its own (scheduler)
    starts = sorted({*range(0, 700, 48), 699 // PAGE * PAGE})
    ends = [*starts[1:], 700]
    got = [rank.prefill("r", s, prompt[s:e], e == 700) for s, e in zip(starts, ends, strict=True)][-1:]
    while len(got) < 5:
        got.append(rank.decode("r", got[-1], 700 + len(got) - 1))
    assert got == tokens
    assert torch.equal(rank.kv.write_pool, engine.kv.write_pool), "the K/V of every layer, bit for bit"
    for name, value in vars(rank.kv.summaries.table).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(engine.kv.summaries.table, name)), f"summaries: {name}"
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["hbm", "host"])
def test_a_rank_replays_decode_steps_from_graphs_with_the_eager_tokens(tier):
    """One rank on CUDA (a solo group): decode steps replayed from graphs (keyed by the runner's
    GraphKey and ownership) give the eager rank's tokens, and a replay charges the collectives
    its capture recorded."""
    model = build_preset("tiny-long", seed=0, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for graphs in (False, True):
        cache = CacheConfig(tier=tier, budget_tokens=128, hot_cache_pages=64, host_capacity_gib=0.01)
        scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk=64)
        rank = ShardEngine(Engine(*model, cache, scheduler, "cuda", max_pages=400), use_graphs=graphs)
        rank.open(ShardSpec("r", 0, 1, 0, 200, 200, 8), RankGroup.solo(torch.device("cuda")), params)
        rank.fill_synthetic("r", 3001, 4)
        tokens = [7]  # the last prompt token, as `sharded` decodes after a synthetic fill
        while len(tokens) < params.max_tokens:
            tokens.append(rank.decode("r", tokens[-1], 3001 + len(tokens) - 1))
        report = rank.close("r")
        runs[graphs] = tokens, report["collectives"]["decode"]["calls"], rank.stats()
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1] > 0, "a replay charges its capture's collectives"
    stats = runs[True][2]
    assert stats["graph_captures"] >= 1 and stats["graph_replays"] >= 10
    assert runs[False][2]["graph_replays"] == 0
