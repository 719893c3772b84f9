"""Metrics vs brute-force Python (scipy is not a dependency; ranks and Spearman are O(n^2) here)."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.cluster.measure.eval import metrics as mt
from lockserve.kernels import baselines as bl
from lockserve.kernels.summary import LocksConfig, build_summaries, quantize_summaries

from tests.conftest import assert_close


def brute_coverage(s: list[float], chosen: list[int]) -> float:
    live = [x for x in s if x != -math.inf]
    if not live:
        return 0.0
    z = sum(math.exp(x) for x in live)
    return sum(math.exp(s[j]) for j in set(chosen) if j >= 0) / z


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("g,p", [(1, 1), (3, 5), (7, 37), (8, 97)])
def test_coverage_matches_brute_force(g, p, per_head):
    gen = torch.Generator().manual_seed(g * p + per_head)
    s = 3 * torch.randn(3, 2, g, p, generator=gen, dtype=torch.float64)
    s[1, :, :, p // 2 + 1 :] = float("-inf")  # a shorter sequence
    s[2, 1] = float("-inf")  # no valid page
    k = min(p, 6)
    shape = (3, 2, g, k) if per_head else (3, 2, k)
    sel = torch.randint(-1, p, shape, generator=gen)
    cov = mt.head_coverage(s, sel)
    for b in range(3):
        for h in range(2):
            for gg in range(g):
                chosen = (sel[b, h, gg] if per_head else sel[b, h]).tolist()
                want = brute_coverage(s[b, h, gg].tolist(), chosen)
                assert cov[b, h, gg].item() == pytest.approx(want, abs=1e-6), f"({b},{h},{gg})"
    mean, worst = mt.captured_mass(s, sel)
    assert_close(mean, cov.mean(-1), "group mean")
    assert_close(worst, cov.amin(-1), "worst head")


def test_coverage_rejects_out_of_range_pages():
    with pytest.raises(ValueError, match="page index 5"):
        mt.head_coverage(torch.zeros(1, 1, 2, 5), torch.tensor([[[0, 5]]]))


def test_carrier_retained():
    sel = torch.tensor([[[0, 3, 7, -1], [0, 2, -1, -1]], [[1, 2, 5, 9], [0, 1, 2, 3]]])
    carrier = torch.tensor([[7], [3]])
    assert mt.carrier_retained(sel, carrier).tolist() == [[True, False], [False, True]]
    with pytest.raises(ValueError, match="carrier"):
        mt.carrier_retained(sel, torch.tensor([[-1], [0]]))


def test_logit_and_lse_mae_match_brute_force():
    gen = torch.Generator().manual_seed(7)
    q, keys = torch.randn(37, 3, 64, generator=gen), torch.randn(37, 16, 64, generator=gen)
    exact = mt.exact_logits(q, keys)
    for i in range(3):
        for j in range(16):
            assert exact[5, i, j].item() == pytest.approx((q[5, i] @ keys[5, j]).item() / 8, abs=1e-4)
    approx = exact + 0.1 * torch.randn(exact.shape, generator=gen)
    want = sum(abs(a - e) for a, e in zip(approx.flatten().tolist(), exact.flatten().tolist(), strict=True))
    assert mt.logit_mae(approx, exact).item() == pytest.approx(want / exact.numel(), rel=1e-5)
    s = torch.randn(2, 3, 97, generator=gen)
    s[0, :, 90:] = float("-inf")
    s_hat = s + torch.randn(s.shape, generator=gen)
    flat = zip(s_hat.flatten().tolist(), s.flatten().tolist(), strict=True)
    errs = [abs(a - e) for a, e in flat if e != -math.inf]
    assert mt.lse_mae(s_hat, s).item() == pytest.approx(sum(errs) / len(errs), rel=1e-5), "padding excluded"
    with pytest.raises(ValueError, match="shape"):
        mt.lse_mae(s_hat[..., :5], s)


def brute_ranks(xs: list[float]) -> list[float]:
    """Average ranks 1..n: rank_i = #(x_j < x_i) + (#(x_j == x_i) + 1) / 2."""
    return [sum(y < x for y in xs) + (sum(y == x for y in xs) + 1) / 2 for x in xs]


def brute_spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = brute_ranks(xs), brute_ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den > 0 else math.nan


@pytest.mark.parametrize("n", [1, 5, 37, 97])
def test_rank_average_with_ties_and_infinities(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(0, max(n // 3, 2), (4, n), generator=gen).float()
    x[0, : n // 2] = float("-inf")
    x[1, -1] = float("inf")
    got = mt.rank_average(x)
    for row in range(4):
        assert got[row].tolist() == brute_ranks(x[row].tolist()), f"row {row}"


@pytest.mark.parametrize("n", [5, 37, 97])
def test_spearman_matches_brute_force(n):
    gen = torch.Generator().manual_seed(100 + n)
    x = torch.randn(6, n, generator=gen)
    y = x + torch.randn(6, n, generator=gen)
    x[1] = torch.randint(0, 4, (n,), generator=gen).float()  # heavy ties
    y[2] = torch.randint(0, 3, (n,), generator=gen).float()
    got = mt.spearman(x, y)
    for row in range(6):
        want = brute_spearman(x[row].tolist(), y[row].tolist())
        assert got[row].item() == pytest.approx(want, abs=1e-5, nan_ok=True), f"row {row}"
    no_ties = 1 - 6 * ((mt.rank_average(x[0]) - mt.rank_average(y[0])) ** 2).sum() / (n * (n * n - 1))
    assert got[0].item() == pytest.approx(no_ties.item(), abs=1e-5), "classic formula without ties"


def test_spearman_ignores_padding_and_flags_degenerate_rows():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 37, generator=gen)
    y = x.exp()  # monotone -> 1
    x[0, 30:] = y[0, 30:] = float("-inf")  # padding, excluded by the default mask
    y[1] = -y[1]
    x[2, :] = 1.0  # constant -> NaN
    x[3, 1:] = y[3, 1:] = float("-inf")  # one valid entry -> NaN
    got = mt.spearman(x, y)
    assert got[0].item() == pytest.approx(1.0) and got[1].item() == pytest.approx(-1.0)
    assert torch.isnan(got[2]) and torch.isnan(got[3])
    valid = torch.zeros(4, 37, dtype=torch.bool)
    valid[:, :20] = True
    masked = mt.spearman(torch.randn(4, 37, generator=gen), torch.randn(4, 37, generator=gen), valid)
    assert masked.shape == (4,) and torch.isfinite(masked).all()


def test_summary_bytes_per_page_for_every_method():
    keys = torch.randn(5, 2, 16, 128, generator=torch.Generator().manual_seed(0))
    locks = quantize_summaries(build_summaries(keys, 8), LocksConfig())
    assert mt.summary_bytes_per_page(locks) == {"payload": 768, "total": 818}
    assert mt.summary_bytes_per_page(bl.build_quest(keys)) == {"payload": 512, "total": 512}
    assert mt.summary_bytes_per_page(bl.build_centroid(keys)) == {"payload": 256, "total": 256}
    shared = bl.project_pages(keys, torch.zeros(128, 40))
    assert mt.summary_bytes_per_page(shared) == {"payload": 768, "total": 768 + 34}
