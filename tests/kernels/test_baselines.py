"""Baseline scorers vs brute-force loops, byte matching, and the synthetic needle task."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.cluster.measure.eval.metrics import carrier_retained, head_coverage
from lockserve.kernels import baselines as bl
from lockserve.kernels.score import exact_page_lse, group_scores, score_pages_ref
from lockserve.kernels.select import select_pages
from lockserve.kernels.summary import LocksConfig, build_summaries, dequantize_summaries, quantize_summaries

from tests.conftest import assert_close


def ragged_table(gen, num_pages: list[int], hkv: int, g: int, d: int, b: int = 16):
    """Key table [N, Hkv, B, d] with shuffled page ids, page_table [Bt, P] (-1 pad), q [Bt, Hq, d]."""
    total = sum(num_pages) + 3  # a few ids no sequence owns
    keys = torch.randn(total, hkv, b, d, generator=gen) + 0.5 * torch.randn(total, hkv, 1, d, generator=gen)
    perm = torch.randperm(total, generator=gen)
    table = torch.full((len(num_pages), max(num_pages) + 2), -1, dtype=torch.long)
    used = 0
    for i, n in enumerate(num_pages):
        table[i, :n] = perm[used : used + n]
        used += n
    q = 1.5 * torch.randn(len(num_pages), hkv * g, d, generator=gen)
    return keys, table, torch.tensor(num_pages), q


def loop_scores(q, table, num_pages, hkv, page_score) -> torch.Tensor:
    """Reference layout [Bt, Hkv, G, P] filled by page_score(b, h, qvec [d], page_id) in a loop."""
    bt, hq, _ = q.shape
    g = hq // hkv
    out = torch.full((bt, hkv, g, table.shape[1]), float("-inf"), dtype=torch.float64)
    for b in range(bt):
        for j in range(int(num_pages[b])):
            for h in range(hkv):
                for gg in range(g):
                    out[b, h, gg, j] = page_score(b, h, q[b, h * g + gg].double(), int(table[b, j]))
    return out


SHAPES = [([1], 1, 1, 64), ([5, 37], 2, 3, 64), ([37, 1, 5], 1, 7, 128), ([12, 9], 2, 8, 128)]


@pytest.mark.parametrize("num_pages,hkv,g,d", SHAPES)
def test_exact_oracle_matches_loop_and_exact_page_lse(num_pages, hkv, g, d):
    gen = torch.Generator().manual_seed(sum(num_pages) + g)
    keys, table, n, q = ragged_table(gen, num_pages, hkv, g, d)
    got = bl.score_exact(q, keys, table, n)
    brute = lambda b, h, qv, j: torch.logsumexp(keys[j, h].double() @ qv / math.sqrt(d), 0)
    want = loop_scores(q, table, n, hkv, brute)
    assert_close(got.double(), want, "oracle vs loop", torch.float32)
    direct = exact_page_lse(q.reshape(len(num_pages), 1, hkv, g, d), keys[table.clamp_min(0)])
    valid = torch.arange(table.shape[1])[None] < n[:, None]
    assert_close(got.permute(0, 3, 1, 2)[valid], direct[valid], "oracle == exact_page_lse")


def test_exact_oracle_with_partial_pages():
    gen = torch.Generator().manual_seed(1)
    keys, table, n, q = ragged_table(gen, [5, 3], 2, 3, 64)
    lens = torch.tensor([[16, 16, 16, 16, 7, 0, 0], [16, 16, 1, 0, 0, 0, 0]])
    got = bl.score_exact(q, keys, table, n, page_lens=lens)
    slot_of = lambda b, j: int((table[b] == j).nonzero()[0, 0])  # position of page id j in row b
    brute = lambda b, h, qv, j: torch.logsumexp(keys[j, h, : lens[b, slot_of(b, j)]].double() @ qv / 8.0, 0)
    want = loop_scores(q, table, n, 2, brute)
    assert_close(got.double(), want, "oracle with partial pages", torch.float32)


@pytest.mark.parametrize("num_pages,hkv,g,d", SHAPES)
def test_quest_matches_loop_and_bounds_the_exact_lse(num_pages, hkv, g, d):
    gen = torch.Generator().manual_seed(sum(num_pages) * 3 + g)
    keys, table, n, q = ragged_table(gen, num_pages, hkv, g, d)
    quest = bl.build_quest(keys)
    k_min, k_max = keys.amin(dim=2), keys.amax(dim=2)  # [N, Hkv, d]
    assert (quest.lo.float() <= k_min).all() and (quest.hi.float() >= k_max).all(), "outward rounding"
    ulp = 2.0**-7 * torch.maximum(k_min.abs(), k_max.abs()) + 1e-30
    assert ((k_min - quest.lo.float()) <= ulp).all() and ((quest.hi.float() - k_max) <= ulp).all()

    def brute(b, h, qv, j):
        lo, hi = quest.lo[j, h].double(), quest.hi[j, h].double()
        return torch.maximum(qv * lo, qv * hi).sum() / math.sqrt(d) + math.log(16)

    got = bl.score_quest(q, quest, table, n)
    assert_close(got.double(), loop_scores(q, table, n, hkv, brute), "Quest vs loop", torch.float32)
    exact = bl.score_exact(q, keys, table, n)
    live = torch.isfinite(exact)
    assert (got[live] >= exact[live] - 1e-4).all(), "Quest's score is an upper bound of the page log-mass"


@pytest.mark.parametrize("num_pages,hkv,g,d", SHAPES)
def test_centroid_matches_loop(num_pages, hkv, g, d):
    gen = torch.Generator().manual_seed(sum(num_pages) * 5 + g)
    keys, table, n, q = ragged_table(gen, num_pages, hkv, g, d)
    cent = bl.build_centroid(keys)
    assert_close(cent.mu.float(), keys.mean(dim=2), "bf16 centroid", torch.bfloat16)
    brute = lambda b, h, qv, j: qv @ cent.mu[j, h].double() / math.sqrt(d) + math.log(16)
    got = bl.score_centroid(q, cent, table, n)
    assert_close(got.double(), loop_scores(q, table, n, hkv, brute), "centroid vs loop", torch.float32)


def brute_pca(pages: torch.Tensor, rho: int) -> torch.Tensor:
    """pages [M, B, d] -> projector onto the top-rho eigvecs of the summed within-page scatter."""
    d = pages.shape[-1]
    cov = torch.zeros(d, d, dtype=torch.float64)
    for page in pages.double():
        dev = page - page.mean(0)
        for row in dev:
            cov += torch.outer(row, row)
    vecs = torch.linalg.eigh(cov).eigenvectors[:, -rho:]
    return vecs @ vecs.T


@pytest.mark.parametrize("num_pages,hkv,g,d", SHAPES[1:])
def test_sequence_bases_match_per_sequence_pca_and_scores_match_loop(num_pages, hkv, g, d):
    gen = torch.Generator().manual_seed(sum(num_pages) * 7 + g)
    keys, table, n, q = ragged_table(gen, num_pages, hkv, g, d)
    rho = 6
    bases, tab = bl.build_sequence_basis_table(keys, table, n, rho)
    assert bases.shape == (len(num_pages), hkv, d, rho) and bases.dtype == torch.bfloat16
    for b, nb in enumerate(num_pages):
        for h in range(hkv):
            w = bases[b, h].double()
            eye = torch.eye(rho, dtype=torch.float64)
            assert_close(w.T @ w, eye, f"orthonormal W ({b},{h})", torch.bfloat16)
            if nb * 15 >= rho + 2:  # enough deviations for a well-separated subspace
                want = brute_pca(keys[table[b, :nb], h], rho)
                assert_close(w @ w.T, want, f"W = PCA of sequence {b} head {h}", torch.bfloat16)

    for b, nb in enumerate(num_pages):  # each listed page projected with its own sequence's W
        for j in table[b, :nb].tolist():
            dev = keys[j] - keys[j].mean(dim=1, keepdim=True)  # [Hkv, B, d]
            want = dev @ bases[b].float()  # [Hkv, B, rho]
            step = want.abs().amax(-1, keepdim=True) / 127
            assert ((tab.coef[j] - want).abs() <= 0.51 * step + 1e-5).all(), f"coef of page {j} (seq {b})"
    unlisted = sorted(set(range(keys.shape[0])) - set(table[table >= 0].tolist()))
    assert not tab.coef[unlisted].any() and not tab.mu[unlisted].any(), "unlisted ids stay zero"

    def brute(b, h, qv, j):
        w = bases[b, h].double()
        mu, coef = tab.mu[j, h].double(), tab.coef[j, h].double()
        logits = [(qv @ mu + (w.T @ qv) @ coef[i]) / math.sqrt(d) for i in range(16)]
        return torch.logsumexp(torch.stack(logits), 0)

    got = bl.score_shared_basis(q, tab, bases, table, n)
    assert_close(got.double(), loop_scores(q, table, n, hkv, brute), "shared basis vs loop", torch.float32)


def test_global_basis_is_pca_of_calibration_and_full_rank_is_exact():
    gen = torch.Generator().manual_seed(17)
    calib = torch.randn(40, 2, 16, 64, generator=gen) * torch.linspace(0.2, 2, 64)
    w = bl.fit_global_basis(calib, 10)
    assert w.shape == (2, 64, 10)
    for h in range(2):
        assert_close(w[h].double() @ w[h].double().T, brute_pca(calib[:, h], 10), f"head {h}", torch.bfloat16)
    keys, table, n, q = ragged_table(gen, [5, 37], 2, 3, 64)
    full = torch.eye(64).expand(2, 64, 64)  # rho = d, exact basis
    tab = bl.project_pages(keys, full[None], coef_bits=16, centroid_bits=16)
    got = bl.score_shared_basis(q, tab, full, table, n)
    assert_close(got, bl.score_exact(q, keys, table, n), "rho = d, bf16 parts ~ exact", torch.bfloat16)


def test_project_pages_quantises_like_locks():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(37, 16, 128, generator=gen)
    w = torch.linalg.qr(torch.randn(128, 40, generator=gen)).Q
    s = bl.project_pages(keys, w)
    coef = (keys - keys.mean(1, keepdim=True)) @ w
    step = coef.abs().amax(-1, keepdim=True) / 127
    assert ((s.coef - coef).abs() <= 0.51 * step + 1e-6).all(), "int8 coef, one scale per key"
    mu = keys.mean(1)
    assert ((s.mu - mu).abs() <= 0.51 * mu.abs().amax(-1, keepdim=True) / 127 + 1e-6).all(), "int8 centroid"
    with pytest.raises(ValueError, match="bits"):
        bl.project_pages(keys, w, coef_bits=4)


def test_bytes_per_page_are_matched_to_locks():
    cfg = LocksConfig()
    report = bl.matched_bytes_report(128, cfg, pages_per_sequence=64)
    keys = torch.randn(3, 2, 16, 128, generator=torch.Generator().manual_seed(0))
    locks = quantize_summaries(build_summaries(keys, 8), cfg)
    assert report["locks"]["bytes"] == locks.payload_bytes_per_page() == 768
    assert report["quest"]["bytes"] == bl.build_quest(keys).payload_bytes_per_page() == 512
    assert report["centroid"]["bytes"] == bl.build_centroid(keys).payload_bytes_per_page() == 256
    assert report["exact"]["bytes"] == 16 * 128 * 2
    for name, per in (("shared_global", math.inf), ("shared_sequence", 64)):
        rho = report[name]["rank"]
        assert report[name]["bytes"] <= 768 < bl.shared_basis_payload_bytes(128, 16, rho + 1, per), name
        tab = bl.project_pages(keys, torch.zeros(128, rho))
        assert tab.payload_bytes_per_page() == 16 * rho + 128, "int8 coef [B, rho] + int8 centroid [d]"
        assert tab.bytes_per_page() == 16 * rho + 128 + 2 * 17, "fp16 scales: one per key, one per page"
    assert report["shared_global"]["rank"] == 40 and report["shared_sequence"]["rank"] == 32
    for d in (64, 128):
        for r, bits in ((8, 4), (4, 2), (16, 8)):
            c = LocksConfig(rank=r, basis_bits=bits)
            q = quantize_summaries(build_summaries(torch.randn(2, 16, d), r), c)
            assert bl.locks_payload_bytes(d, c) == q.payload_bytes_per_page(), f"d={d} r={r} bits={bits}"
    with pytest.raises(ValueError, match="budget_bytes"):
        bl.matched_rank(128, 16, 100.0)


def test_per_head_oracle_selection():
    gen = torch.Generator().manual_seed(4)
    keys, table, n, q = ragged_table(gen, [37, 97, 5], 2, 7, 64)
    s = bl.score_exact(q, keys, table, n)
    per_head = bl.select_pages_per_head(s, n, k=6)
    assert per_head.shape == (3, 2, 7, 6)
    for gg in range(7):
        assert torch.equal(per_head[:, :, gg], select_pages(s[:, :, gg], n, 6)), f"head {gg} own top-k"
    shared = select_pages(group_scores(s), n, 6)
    own, common = head_coverage(s, per_head), head_coverage(s, shared)
    assert (own >= common - 1e-6).all(), "a head's own top-k covers at least what the shared set does"
    assert (own > common + 1e-3).any(), "per-head selection must differ somewhere"


def test_bad_inputs_raise():
    keys = torch.randn(4, 2, 16, 64)
    with pytest.raises(ValueError, match="query heads"):
        bl.score_centroid(torch.randn(1, 3, 64), bl.build_centroid(keys), torch.zeros(1, 2, dtype=torch.long),
                          torch.tensor([2]))
    with pytest.raises(ValueError, match="rho"):
        bl.fit_basis(keys, 0)


# ----------------------------------------------------------------------------- needle task


def needle_trial(gen, w_glob: torch.Tensor, p: int = 64, hkv: int = 2, g: int = 4, d: int = 128):
    """4 sequences of p random pages; one key of one middle page per sequence is pushed along the
    group's query direction (the needle). Returns {method: scores [Bt, Hkv, G, P]}, carrier [Bt]."""
    bt, b = 4, 16
    keys = torch.randn(bt * p, hkv, b, d, generator=gen)
    table, n = torch.arange(bt * p).reshape(bt, p), torch.full((bt,), p)
    direction = torch.randn(bt, hkv, 1, d, generator=gen)
    q = (direction + 0.3 * torch.randn(bt, hkv, g, d, generator=gen)).reshape(bt, hkv * g, d)
    carrier = torch.randint(1, p - 2, (bt,), generator=gen)  # never a forced page
    token = torch.randint(0, b, (bt,), generator=gen)
    unit = direction[:, :, 0] / direction[:, :, 0].norm(dim=-1, keepdim=True)  # [Bt, Hkv, d]
    keys[table[torch.arange(bt), carrier], :, token] += 6.25 * unit
    locks = dequantize_summaries(quantize_summaries(build_summaries(keys, 8), LocksConfig()))
    rho_seq = bl.matched_rank(d, b, 768, pages_per_basis=p)
    bases, seq_tab = bl.build_sequence_basis_table(keys, table, n, rho_seq)
    scores = {
        "exact": bl.score_exact(q, keys, table, n),
        "locks": score_pages_ref(q, locks, table, n),
        "quest": bl.score_quest(q, bl.build_quest(keys), table, n),
        "centroid": bl.score_centroid(q, bl.build_centroid(keys), table, n),
        "shared_sequence": bl.score_shared_basis(q, seq_tab, bases, table, n),
        "shared_global": bl.score_shared_basis(q, bl.project_pages(keys, w_glob[None]), w_glob, table, n),
    }
    return scores, carrier, n


def test_needle_carrier_retention_locks_at_least_as_good_as_baselines():
    gen = torch.Generator().manual_seed(12345)
    calib = torch.randn(256, 2, 16, 128, generator=gen)  # same distribution as the test keys
    w_glob = bl.fit_global_basis(calib, bl.matched_rank(128, 16, 768))
    hits: dict[str, list[float]] = {}
    for _ in range(12):
        scores, carrier, n = needle_trial(gen, w_glob)
        for name, s in scores.items():
            sel = select_pages(group_scores(s), n, k=4)  # sink + 2 recent + 1 free page
            hits.setdefault(name, []).append(carrier_retained(sel, carrier[:, None]).float().mean().item())
    rate = {name: sum(v) / len(v) for name, v in hits.items()}
    assert rate["exact"] >= 0.97, f"the needle must be findable: {rate}"
    assert rate["locks"] >= 0.9, f"LOCKS retention too low: {rate}"
    for name in ("quest", "centroid", "shared_sequence", "shared_global"):
        assert rate["locks"] >= rate[name] + 0.15, f"LOCKS vs {name} at matched bytes: {rate}"
