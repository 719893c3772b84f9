"""Page selectors (engine/selectors.py) against the kernels/baselines.py references, the group-rule
adapter, byte accounting, and how the engine builds and runs them (tiny preset, CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.configs.schema import ATTENTION_MODES, BASIS_BITS, GROUP_RULES, CacheConfig, SchedulerConfig
from lockserve.kernels import LocksConfig, build_summaries, ops, quantize_summaries
from lockserve.kernels import baselines as bl
from lockserve.kernels.score import GROUP_RULES as KERNEL_GROUP_RULES
from lockserve.kernels.score import PageScores, group_scores
from lockserve.kernels.select import select_decode_pages
from lockserve.kernels.summary import BASIS_BITS as KERNEL_BASIS_BITS
from lockserve.workers.engine.engine import Engine, RequestOptions
from lockserve.workers.engine.kv_manager import KVLayout
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.engine.selectors import make_selector
from lockserve.workers.model.presets import build_preset

from tests.conftest import assert_close, triton_devices

L, HKV, G, D, B = 2, 3, 3, 64, 16


def layout(max_pages: int = 40) -> KVLayout:
    return KVLayout(L, HKV, D, B, torch.float32, max_pages)


def stored(attention: str, num_pages=(13, 7), seed=0, **cfg):
    """A selector with two sequences' pages stored (one store call, owners given), their keys
    [L, N, Hkv, B, d], page_table [2, P], num_pages [2] and q [2, Hq, d]."""
    gen = torch.Generator().manual_seed(seed)
    lay = layout()
    sel = make_selector(CacheConfig(attention=attention, **cfg), lay, torch.device("cpu"), 32)
    total = sum(num_pages)
    keys = torch.randn(L, total, HKV, B, D, generator=gen) + torch.randn(L, total, HKV, 1, D, generator=gen)
    pids = torch.randperm(lay.max_pages, generator=gen)[:total]
    first, second = pids[: num_pages[0]], pids[num_pages[0] :]
    owners = torch.cat([first[:1].expand(len(first)), second[:1].expand(len(second))])
    sel.table.store(pids, keys, owners)
    table = torch.full((2, max(num_pages) + 3), -1, dtype=torch.int32)
    table[0, : num_pages[0]] = pids[: num_pages[0]].int()
    table[1, : num_pages[1]] = pids[num_pages[0]:].int()
    q = 2 * torch.randn(2, HKV * G, D, generator=gen)
    full = torch.zeros(L, lay.max_pages, HKV, B, D)
    full[:, pids] = keys
    return sel, full, table, torch.tensor(num_pages), q


def test_config_choices_match_the_kernels():
    assert set(GROUP_RULES) == set(KERNEL_GROUP_RULES)
    assert set(BASIS_BITS) == set(KERNEL_BASIS_BITS)
    lay = layout()
    for attention in ATTENTION_MODES:  # every configurable attention names a selector
        assert make_selector(CacheConfig(attention=attention), lay, torch.device("cpu"), 8).table is not None


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("attention,reference", [
    ("oracle", lambda q, k, t, n: bl.score_exact(q, k, t, n)),
    ("quest", lambda q, k, t, n: bl.score_quest(q, bl.build_quest(k), t, n)),
    ("centroid", lambda q, k, t, n: bl.score_centroid(q, bl.build_centroid(k), t, n)),
])
def test_baseline_selectors_score_as_the_references(attention, reference, layer):
    sel, keys, table, n, q = stored(attention, seed=layer)
    got = sel.scores(layer, q, table, n)
    want = reference(q, keys[layer], table, n)
    assert got.s_hat.shape == (2, HKV, G, table.shape[1])
    assert got.s_hat.is_contiguous() and got.stats.is_contiguous()  # what the GPU selection kernels read
    assert_close(got.s_hat, want, f"{attention} layer {layer}")
    assert_close(got.share_average(), group_scores(want), f"{attention} share-average")


@pytest.mark.parametrize("bits,rank", [(4, 8), (16, 2), (2, 16), (8, 4)])
def test_locks_selector_scores_its_quantised_summaries(bits, rank):
    sel, keys, table, n, q = stored("locks", basis_bits=bits, rank=rank)
    assert sel.builtin == (bits != 16)  # the engine's own path reads every format but a bf16 basis on GPU
    cfg = LocksConfig(rank=rank, basis_bits=bits)
    qs = quantize_summaries(build_summaries(keys[1], rank), cfg)
    want = ops.score_stats(q, qs, table, n, backend="torch")
    got = sel.scores(1, q, table, n)
    assert_close(got.s_hat, want.s_hat, f"locks int{bits} r{rank}")
    assert sel.bytes() == {"payload": bl.locks_payload_bytes(D, cfg), "total": sel.table.bytes_per_page}


def test_sequence_basis_is_each_sequences_own_and_scores_as_the_reference():
    sel, keys, table, n, q = stored("shared_sequence", shared_rank=6)
    want_bases, want_table = bl.build_sequence_basis_table(keys[0].reshape(-1, HKV, B, D), table.long(), n, 6)
    for row in range(2):
        w = sel.table.bases[int(table[row, 0])][0].double()  # [Hkv, d, rho] of layer 0
        want = want_bases[row].double()
        assert_close(w @ w.transpose(-1, -2), want @ want.transpose(-1, -2), f"projector of sequence {row}",
                     torch.bfloat16)
    got = sel.scores(0, q, table, n)
    basis = torch.stack([sel.table.bases[int(table[r, 0])][0] for r in range(2)])
    want = bl.score_shared_basis(q, sel.table.layer(0), basis, table, n)
    assert_close(got.s_hat, want, "per-sequence basis scores")


def test_sequence_basis_is_refitted_when_a_sequence_reuses_a_first_page():
    sel, keys, table, n, q = stored("shared_sequence", shared_rank=4)
    owner = int(table[0, 0])
    before = sel.table.bases[owner].clone()
    pids = table[0, :3].long()  # the same first page, new content (a new sequence took the id)
    sel.table.store(pids, 3 * torch.randn(L, 3, HKV, B, D), torch.full_like(pids, owner))
    assert not torch.equal(before, sel.table.bases[owner])
    later = table[1, 1:3].long()  # pages of the other sequence, not its first: projected, no refit
    other = sel.table.bases[int(table[1, 0])].clone()
    sel.table.store(later, torch.randn(L, 2, HKV, B, D), torch.full_like(later, int(table[1, 0])))
    assert torch.equal(other, sel.table.bases[int(table[1, 0])])


def test_global_basis_is_fitted_once_on_the_first_pages():
    sel, keys, table, n, q = stored("shared_global", shared_rank=5)
    want = bl.fit_global_basis(keys[0, table[table >= 0].long()], 5)  # both sequences, layer 0
    got = sel.table.bases[-1][0]
    got, want = got.double(), want.double()
    assert_close(got @ got.transpose(-1, -2), want @ want.transpose(-1, -2), "global projector",
                 torch.bfloat16)
    first = sel.table.bases[-1].clone()
    sel.table.store(table[0, :2].long(), 5 * torch.randn(L, 2, HKV, B, D))
    assert torch.equal(first, sel.table.bases[-1]), "the calibrated basis is kept"
    want = bl.score_shared_basis(q, sel.table.layer(0), first[0], table, n)
    assert_close(sel.scores(0, q, table, n).s_hat, want, "global basis scores")


def test_shared_ranks_match_locks_payload():
    lay = layout()
    locks = bl.locks_payload_bytes(D, LocksConfig())  # 448 B at d = 64
    glob = make_selector(CacheConfig(attention="shared_global"), lay, torch.device("cpu"), 512)
    seq = make_selector(CacheConfig(attention="shared_sequence"), lay, torch.device("cpu"), 512)
    assert glob.table.rank == bl.matched_rank(D, B, locks) == 24
    assert seq.table.rank == bl.matched_rank(D, B, locks, 512) == 23
    for s in (glob, seq):
        one_more = bl.shared_basis_payload_bytes(D, B, s.table.rank + 1, s.pages_per_basis)
        assert s.bytes()["payload"] <= locks < one_more
    sizes = {a: make_selector(CacheConfig(attention=a), lay, torch.device("cpu"), 512).bytes()["total"]
             for a in ("locks", "oracle", "quest", "centroid")}
    assert sizes == {"locks": 498, "oracle": B * D * 2, "quest": 2 * D * 2, "centroid": D * 2}


@pytest.mark.parametrize("rule", ["group_max", "group_mass"])
def test_group_rules_select_by_their_group_scores(rule):
    sel, keys, table, n, q = stored("oracle", group_rule=rule)
    got = sel.scores(0, q, table, n)
    m_bar = group_scores(bl.score_exact(q, keys[0], table, n), rule)  # [2, Hkv, P]
    assert got.s_hat.shape[2] == 1 and got.s_hat.is_contiguous() and got.stats.is_contiguous()
    assert_close(got.share_average(), m_bar, f"{rule} through the adapter")
    pages = n + 1  # the open page after the full ones
    budgets = torch.tensor([6, 6])
    want = select_decode_pages(m_bar, pages, budgets, 6)
    assert torch.equal(select_decode_pages(got.share_average(), pages, budgets, 6), want)


def test_adapter_maps_zero_mass_to_zero():
    m = torch.tensor([[[0.0, 0.25, 0.75, 0.0]]])
    s = PageScores.from_group_scores(m)
    assert torch.isneginf(s.s_hat[..., 0]).all()
    assert torch.equal(s.share_average()[..., [0, 3]], torch.zeros(1, 1, 2))
    assert_close(s.share_average(), m, "share-average of the adapted scores")


# ---- in the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny", seed=0, device="cpu")


def engine(tiny, **cache) -> Engine:
    cc = CacheConfig(**{"tier": "hbm", "budget_tokens": 64, **cache})
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk=64)
    return Engine(*tiny, cc, sc, "cpu", max_pages=80)


@pytest.mark.parametrize("attention", [a for a in ATTENTION_MODES if a != "dense"])
def test_engine_scores_with_the_configured_selector(tiny, attention):
    torch.set_num_threads(1)
    eng = engine(tiny, attention=attention)
    assert eng.kv.summaries is eng.selector.table
    assert (eng.attention.selector is None) == (attention == "locks")  # LOCKS stays on the hot path
    calls = []
    if eng.attention.selector is not None:
        original = eng.selector.scores
        eng.selector.scores = lambda *a, **k: calls.append(a[0]) or original(*a, **k)
    eng.add_request("r", [(7 * i) % 256 for i in range(300)], SamplingParams(temperature=0, max_tokens=3))
    while eng.has_unfinished():
        eng.step()
    if attention != "locks":
        assert calls[: tiny[0].config.num_layers] == list(range(tiny[0].config.num_layers)), calls


def test_a_request_may_not_switch_to_another_selector(tiny):
    eng = engine(tiny, attention="quest")
    params = SamplingParams(max_tokens=2)
    assert eng.check_request(10, params, RequestOptions(attention="quest")) == 4
    assert eng.check_request(10, params, RequestOptions(attention="dense")) is None
    for other in ("locks", "oracle"):
        with pytest.raises(ValueError, match=rf"attention \('{other}'\)"):
            eng.check_request(10, params, RequestOptions(attention=other))


def test_eager_reason_names_the_device_on_cpu(tiny):
    eng = engine(tiny, attention="shared_sequence")
    assert eng.runner.eager_reason == "CUDA graphs need a CUDA device, not cpu"
    assert "host" in eng.selector.graph_blocker


@pytest.mark.gpu
def test_uncapturable_selector_decodes_eagerly_on_cuda():
    model, tok = build_preset("tiny", seed=0, device="cuda")
    cc = CacheConfig(attention="quest", tier="hbm", budget_tokens=64)
    sc = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk=64)
    eng = Engine(model, tok, cc, sc, "cuda", max_pages=40)
    assert not eng.runner.use_graphs and "evaluation selector" in eng.runner.eager_reason
    with pytest.raises(ValueError, match=r"use_graphs \(True\): "):
        Engine(model, tok, cc, sc, "cuda", max_pages=40, use_graphs=True)
    assert math.isfinite(len(eng.selector.bytes()))


def test_a_row_whose_budget_covers_its_pages_leaves_the_others_pruned(tiny):
    """Mixed budgets in one batch: the small-budget row decodes as it does alone."""
    ids = [(11 * i + 3) % 256 for i in range(400)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(requests):  # both prompts prefill in one step, so the rows decode together
        cc = CacheConfig(tier="hbm", budget_tokens=1024)
        sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=1024, prefill_chunk=512)
        eng = Engine(*tiny, cc, sc, "cpu", max_pages=80)
        for rid, budget in requests:
            eng.add_request(rid, ids, params, RequestOptions(budget_tokens=budget))
        out = {rid: [] for rid, _ in requests}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id].extend(o.token_ids)
        return out

    alone = run([("small", 64)])["small"]
    together = run([("small", 64), ("whole", 1024)])
    assert together["small"] == alone
    assert together["whole"] == run([("whole", 1024)])["whole"] != alone


@pytest.mark.parametrize("cache", [{"attention": "quest"}, {"attention": "locks", "group_rule": "group_max"},
                                   {"attention": "locks", "basis_bits": 16}])
@pytest.mark.parametrize("device", triton_devices())
def test_selectors_feed_the_selection_kernels(tiny, cache, device):
    """The Triton selection and attention kernels (what a GPU runs) read what the selectors return:
    the same tokens as the torch reference path."""
    model, tok = build_preset("tiny", seed=0, device=device)
    # 9 pages: a 4-page budget prunes. One chunk of over PAGED_PREFILL_MAX_QUERIES (128) tokens: the
    # prefill is not the paged Triton prefill (not what this tests; 100 tokens took it ~16 s of
    # Triton's interpreter), the decode steps are the selection kernels'.
    ids = [(13 * i + 5) % 256 for i in range(129)]
    out = {}
    for kernels in ("ops", "reference"):
        cc = CacheConfig(tier="hbm", budget_tokens=64, **cache)
        sc = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256, prefill_chunk=256)
        eng = Engine(model, tok, cc, sc, device, max_pages=20, kernels=kernels, use_graphs=False)
        eng.add_request("r", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        out[kernels] = [t for _ in range(3) for o in eng.step() for t in o.token_ids]
    assert out["ops"] == out["reference"], (cache, out)


def test_the_decode_bench_takes_every_selector_as_a_mode():
    from lockserve.cluster.measure.decode.bench import parse_args

    args = parse_args(["--modes", "quest:hbm", "shared_global:host", "locks:host-nocache", "--out", "x.json"])
    assert args.modes == ["quest:hbm", "shared_global:host", "locks:host-nocache"]
    with pytest.raises(SystemExit):
        parse_args(["--modes", "sparse:hbm", "--out", "x.json"])
