"""The facts the reading note proves (Eq. 1, Eq. 7, Theorem 1, Corollary 3, Proposition 1),
checked on the torch reference with fresh random inputs, unquantised summaries unless stated."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from lockserve.cluster.measure.eval.metrics import head_coverage
from lockserve.kernels.attention import attention_ref, page_lengths, sparse_decode_ref
from lockserve.kernels.baselines import project_pages, score_exact, score_shared_basis
from lockserve.kernels.score import exact_page_lse, group_scores, page_logits, score_pages_ref
from lockserve.kernels.select import select_pages
from lockserve.kernels.summary import LocksConfig, build_summaries, dequantize_summaries, quantize_summaries

from tests.conftest import assert_close
from tests.kernels.test_attention_ref import ragged_batch


def noisy_low_rank(gen, p: int, b: int, d: int, m: int, noise: float, spread: float = 1.5) -> torch.Tensor:
    """p pages [p, b, d]: centroid + rank-m deviations + isotropic noise (so r < rank(D) matters)."""
    mu = 0.5 * torch.randn(p, 1, d, generator=gen)
    w = torch.linalg.qr(torch.randn(p, d, m, generator=gen)).Q  # [p, d, m]
    dev = spread * torch.randn(p, b, m, generator=gen) @ w.transpose(1, 2)
    return mu + dev + noise * torch.randn(p, b, d, generator=gen)


def lse_pair(q: torch.Tensor, keys: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [G, d], keys: [P, B, d] -> (s_hat, s): [G, P] from unquantised rank-r summaries."""
    qp = q[None].expand(keys.shape[0], -1, -1)  # [P, G, d]
    s_hat = page_logits(qp, build_summaries(keys, r)).logsumexp(dim=-1)
    return s_hat.T, exact_page_lse(qp, keys).T


# ----------------------------------------------------------------------------- Eq. 1


@pytest.mark.parametrize("seed", range(4))
def test_eq1_output_error_identity(seed):
    """o - o_S = eps (v_bar_Sc - v_bar_S), eps = 1 - gamma_S(q), for random selections S."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [[80, 17, 593], [1552, 33], [37 * 16 - 5], [97 * 16, 20, 65, 250]][seed]
    hkv, g = 2, [1, 3, 7, 8][seed]
    batch = ragged_batch(gen, seq_lens, hkv, g, d=64 if seed % 2 else 128, scale=2.0)
    n = batch.num_pages
    p = int(n.max())
    member = torch.rand(len(seq_lens), hkv, p, generator=gen) < 0.4
    member &= torch.arange(p)[None, None, :] < n[:, None, None]
    member[:, :, 0] = True  # keep S non-empty
    member[torch.arange(len(seq_lens)), :, n - 1] = False  # and its complement too, where n > 1
    as_sel = lambda m: torch.where(m, torch.arange(p).expand_as(m), torch.full_like(m, -1, dtype=torch.long))
    outs = {}
    for name, m in (("S", member), ("Sc", ~member & (torch.arange(p)[None, None, :] < n[:, None, None]))):
        sel = as_sel(m)
        lens = page_lengths(sel, batch.seq_lens, 16)
        outs[name] = sparse_decode_ref(batch.q, batch.pool, batch.slots(sel), lens)
    dense = [attention_ref(batch.q[i], batch.keys[i], batch.values[i]) for i in range(len(seq_lens))]
    o, lse = torch.stack([x[0] for x in dense]), torch.stack([x[1] for x in dense])
    (o_s, lse_s), (o_sc, _) = outs["S"], outs["Sc"]
    eps = 1 - torch.exp(lse_s - lse)  # [Bt, Hq]
    one_page = (n == 1)[:, None, None]
    o_sc = torch.where(one_page, o_s, o_sc)  # empty complement: eps = 0 and the identity is o = o_S
    assert_close(o - o_s, eps[..., None] * (o_sc - o_s), "Eq. 1")
    assert (eps > 1e-3).any(), "selections must drop real mass for the identity to bite"


# ----------------------------------------------------------------------------- Eq. 7


@pytest.mark.parametrize("d,r", [(64, 2), (64, 4), (128, 8)])
def test_eq7_spectral_tail_bounds_lse_error(d, r):
    """|s_hat - s| <= ||q_perp|| sqrt(tau) / sqrt(d) per page and query, q_perp outside span(V_j)."""
    gen = torch.Generator().manual_seed(d + r)
    ratios = []
    for noise in (0.05, 0.2, 0.6):
        keys = torch.cat([noisy_low_rank(gen, 61, 16, d, m=r + 2, noise=noise), spiked_pages(gen, 36, d, r)])
        s = build_summaries(keys, r)
        q = adversarial_queries(2 * torch.randn(97, 7, d, generator=gen), keys, s)
        err = (page_logits(q, s).logsumexp(-1) - exact_page_lse(q, keys)).abs()  # [P, G]
        proj = q @ s.basis  # [P, G, r]
        q_perp = (q.pow(2).sum(-1) - proj.pow(2).sum(-1)).clamp_min(0).sqrt()
        bound = q_perp * s.tau.sqrt()[:, None] / math.sqrt(d)
        worst = (err - bound).max().item()
        assert (err <= bound * (1 + 1e-4) + 1e-5).all(), f"Eq. 7 violated, noise={noise}: by {worst}"
        ratios.append((err / bound).max().item())
    assert max(ratios) > 0.5, f"bound never approached (max err/bound {ratios}); the test would be toothless"


def spiked_pages(gen, p: int, d: int, r: int) -> torch.Tensor:
    """Rank-r deviations plus a small out-of-subspace spike on one key: the dropped energy sits
    almost all on that key, the case where Eq. 7 is nearly tight. -> [p, 16, d]"""
    keys = noisy_low_rank(gen, p, 16, d, m=r, noise=0.0, spread=6.0)
    spike = torch.randn(p, d, generator=gen)
    keys[:, 5] += 0.5 * spike / spike.norm(dim=-1, keepdim=True)
    return keys


def adversarial_queries(q: torch.Tensor, keys: torch.Tensor, s) -> torch.Tensor:
    """Half of the queries aim at one key's residual (the direction the basis dropped), plus
    that key itself, so the LSE is dominated by a badly reconstructed logit."""
    dev = keys - keys.mean(dim=1, keepdim=True)
    resid = dev - s.coef @ s.basis.transpose(1, 2)  # [P, B, d]
    worst = resid.norm(dim=-1).argmax(dim=-1)  # [P]
    r_i = resid[torch.arange(keys.shape[0]), worst]  # [P, d]
    d_i = dev[torch.arange(keys.shape[0]), worst]
    aim = 8 * r_i / r_i.norm(dim=-1, keepdim=True).clamp_min(1e-12) + 0.5 * d_i
    g = q.shape[1]
    return torch.cat([q[:, : g // 2], aim[:, None, :].expand(-1, g - g // 2, -1)], dim=1)


# ----------------------------------------------------------------------------- Theorem 1


def group_coverage(s: torch.Tensor, sel: torch.Tensor) -> float:
    """Group-average exact coverage. s: [G, P] exact log-masses; sel: [k] page indices."""
    return head_coverage(s[None, None], sel[None, None]).mean().item()


def select(s: torch.Tensor, k: int, sink: int, recent: int) -> torch.Tensor:
    """s: [G, P] -> shared selection [k] by the share-average rule (Eq. 5)."""
    p = s.shape[1]
    return select_pages(group_scores(s[None, None]), torch.tensor([p]), k, sink, recent)[0, 0]


def theorem1_trial(gen, trial: int) -> tuple[float, float, float, bool]:
    """One random instance -> (coverage of S_hat, coverage of S*, eta, selections differ)."""
    p, g = (5, 37, 97)[trial % 3], (1, 3, 7, 8)[trial % 4]
    noise = 0.02 + 0.4 * torch.rand(1, generator=gen).item()
    if trial % 2:  # adversarial-ish: pages that are noisy copies of one page, so masses nearly tie
        base = noisy_low_rank(gen, 1, 16, 64, m=6, noise=noise)
        keys = base + 0.3 * noisy_low_rank(gen, p, 16, 64, m=6, noise=noise)
    else:
        keys = noisy_low_rank(gen, p, 16, 64, m=6, noise=noise)
    q = 1.5 * torch.randn(g, 64, generator=gen)
    s_hat, s = lse_pair(q, keys, r=4)
    eta = (s_hat - s).abs().max().item()
    sink, recent = ((0, 0), (1, 2))[trial % 5 == 0]
    k = max(sink + recent + 1, p // 6)
    sel_hat, sel_star = select(s_hat, k, sink, recent), select(s, k, sink, recent)
    return group_coverage(s, sel_hat), group_coverage(s, sel_star), eta, not torch.equal(sel_hat, sel_star)


def test_theorem1_retention_bound():
    """The share-average top-k from s_hat keeps >= e^{-4 eta} of the exact selection's coverage."""
    gen = torch.Generator().manual_seed(2026)
    trials = [theorem1_trial(gen, t) for t in range(120)]
    for t, (cov_hat, cov_star, eta, _) in enumerate(trials):
        bound = math.exp(-4 * eta) * cov_star
        assert cov_hat >= bound - 1e-6, f"trial {t}: coverage {cov_hat} < e^-4eta * {cov_star} (eta={eta})"
        assert cov_hat <= cov_star + 1e-6, f"trial {t}: the exact selection must be optimal (Corollary 3)"
    informative = [c for c in trials if math.exp(-4 * c[2]) > 0.3]
    assert len(informative) > 0.4 * len(trials), f"bound vacuous too often ({len(informative)}/{len(trials)})"
    assert sum(c[3] for c in informative) > 10, "too few trials where s_hat changed the selection"


def test_eq9_end_to_end_output_bound():
    """mean_g ||o_S - o|| <= 2 R (1 - e^{-4 eta} gamma*) with R = max ||v_i||.

    (The reading note prints 2R(1 - e^{-4 eta}) gamma*, which is false at eta = 0 whenever
    gamma* < 1; this is the form that follows from Eq. 1 and Theorem 1.)
    """
    gen = torch.Generator().manual_seed(99)
    for trial in range(30):
        p, g = (5, 37, 97)[trial % 3], (1, 3, 7, 8)[trial % 4]
        keys = noisy_low_rank(gen, p, 16, 64, m=6, noise=0.1)
        vals = torch.randn(p, 16, 64, generator=gen)
        q = 1.5 * torch.randn(g, 64, generator=gen)
        s_hat, s = lse_pair(q, keys, r=4)
        eta = (s_hat - s).abs().max().item()
        k = max(1, p // 5)
        sel_hat, sel_star = select(s_hat, k, 0, 0), select(s, k, 0, 0)
        chosen = sel_hat[sel_hat >= 0]
        o_s, _ = attention_ref(q, keys[chosen].reshape(-1, 1, 64), vals[chosen].reshape(-1, 1, 64))
        o, _ = attention_ref(q, keys.reshape(-1, 1, 64), vals.reshape(-1, 1, 64))
        err = (o_s - o).norm(dim=-1).mean().item()
        r_max = vals.norm(dim=-1).max().item()
        bound = 2 * r_max * (1 - math.exp(-4 * eta) * group_coverage(s, sel_star))
        assert err <= bound + 1e-5, f"trial {trial}: mean ||o_S - o|| {err} > {bound}"


# ----------------------------------------------------------------------------- Corollary 3


@pytest.mark.parametrize("g", [1, 3, 7, 8])
def test_corollary3_share_average_maximises_group_coverage(g):
    """Among all shared k-subsets, the share-average top-k has the largest group-average coverage."""
    gen = torch.Generator().manual_seed(g)
    for _ in range(5):
        p, k = 9, 3
        s = 3 * torch.randn(g, p, generator=gen)
        best = max(group_coverage(s, torch.tensor(c)) for c in itertools.combinations(range(p), k))
        got = group_coverage(s, select(s, k, 0, 0))
        assert got == pytest.approx(best, abs=1e-6), "share_average top-k is the optimum"
        for rule in ("group_max", "group_mass"):
            other = select_pages(group_scores(s[None, None], rule), torch.tensor([p]), k, 0, 0)[0, 0]
            assert group_coverage(s, other) <= best + 1e-6, rule


# ----------------------------------------------------------------------------- Proposition 1


def blind_edit(gen, d: int, rho: int, m: int):
    """A fixed shared W [d, rho], a page P (rank-m deviations) and unit u orthogonal to span(W)."""
    w = torch.linalg.qr(torch.randn(d, rho, generator=gen, dtype=torch.float64)).Q
    keys = noisy_low_rank(gen, 1, 16, d, m=m, noise=0.0)[0].double()  # [B, d]
    u = torch.randn(d, generator=gen, dtype=torch.float64)
    u = u - w @ (w.T @ u)
    return w, keys, u / u.norm()


def edited(keys: torch.Tensor, u: torch.Tensor, c: float) -> torch.Tensor:
    """P' = P with +c u on key 3 and -c u on key 11 (same centroid, same W^T k_i)."""
    out = keys.clone()
    out[3] += c * u
    out[11] -= c * u
    return out


def shared_score(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """q: [G, d], keys: [B, d], W: [d, rho] -> [G], through the baseline's table and scorer."""
    table = project_pages(keys.float()[None, None], w.float()[None, None])  # leading [1 page, 1 head]
    one = torch.zeros(1, 1, dtype=torch.long)
    return score_shared_basis(q[None].float(), table, w.float()[None], one, torch.tensor([1]))[0, 0, :, 0]


@pytest.mark.parametrize("d,rho", [(64, 40), (128, 32), (128, 127)])
def test_proposition1_shared_basis_is_blind_per_page_basis_is_not(d, rho):
    gen = torch.Generator().manual_seed(d + rho)
    w, keys, u = blind_edit(gen, d, rho, m=3)
    q = torch.randn(3, d, generator=gen, dtype=torch.float64)
    q = q + (2 - q @ u)[:, None] * u  # q.u = 2 > 0 for every head
    base_shared = shared_score(q, keys, w)
    base_exact = exact_page_lse(q, keys)
    gaps = []
    for c in (1.0, 4.0, 16.0, 64.0):
        k2 = edited(keys, u, c)
        assert torch.allclose(k2 @ w, keys @ w, atol=1e-9) and torch.allclose(k2.mean(0), keys.mean(0))
        shared = shared_score(q, k2, w)
        ex = exact_page_lse(q, k2)
        assert_close(shared, base_shared, f"shared-basis score must not move (c={c})", torch.float32)
        gaps.append((ex - base_exact).min().item())
        locks = page_logits(q.float(), build_summaries(k2.float(), 8)).logsumexp(-1)  # rank(D') <= 4 <= r
        assert_close(locks.double(), ex, f"LOCKS tracks the edit (c={c})", torch.float32)
    # The shipped int4/int8 summary follows most of the shift (the shared basis follows none of it).
    quant = dequantize_summaries(quantize_summaries(build_summaries(k2.float(), 8), LocksConfig()))
    q_err = (page_logits(q.float(), quant).logsumexp(-1).double() - ex).abs().max().item()
    assert q_err < 0.25 * gaps[-1], f"int4 LOCKS error {q_err} vs exact shift {gaps[-1]} (c={c})"
    assert gaps[-1] > 5 and all(a < b for a, b in itertools.pairwise(gaps)), f"exact LSE must grow: {gaps}"


def test_proposition1_through_the_batched_scorers():
    """Same fact through score_pages_ref / score_exact on a table holding P and P' side by side."""
    gen = torch.Generator().manual_seed(5)
    d, rho = 64, 16
    w, keys, u = blind_edit(gen, d, rho, m=2)
    table = torch.stack([keys, edited(keys, u, 60.0)]).float()[:, None]  # [2 pages, 1 head, B, d]
    q = torch.randn(1, 4, d, generator=gen, dtype=torch.float64)
    q = (q + (1.5 - q @ u)[..., None] * u).float()
    pt, n = torch.tensor([[0, 1]]), torch.tensor([2])
    ex = score_exact(q, table, pt, n)[0, 0]  # [G, 2]
    shared = score_shared_basis(q, project_pages(table, w.float()[None, None]), w.float()[None], pt, n)[0, 0]
    locks = score_pages_ref(q, build_summaries(table, 8), pt, n)[0, 0]
    assert (ex[:, 1] - ex[:, 0]).min() > 5, "the edit must move the exact log-mass"
    assert_close(shared[:, 1], shared[:, 0], "shared basis: P and P' indistinguishable", torch.float32)
    assert_close(locks, ex, "per-page basis: exact on both pages")
