"""Page selection and the GQA group rules vs brute-force Python references."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.kernels.score import group_scores
from lockserve.kernels.select import budget_pages, select_pages

from tests.conftest import assert_close


def brute_select(scores: list[float], n: int, k: int, sink: int, recent: int) -> list[int]:
    """The rule in plain Python: all pages if n <= k, else forced pages + best of the rest."""
    if n <= k:
        return list(range(n))
    forced = set(range(min(sink, n))) | set(range(max(n - recent, 0), n))
    rest = sorted((j for j in range(n) if j not in forced), key=lambda j: -scores[j])
    return sorted(forced | set(rest[: k - len(forced)]))


def check_against_brute(scores, num_pages, k, sink, recent):
    sel = select_pages(scores, num_pages, k, sink, recent)
    bt, hkv, _ = scores.shape
    assert sel.shape == (bt, hkv, k) and sel.dtype == torch.int64
    for b in range(bt):
        n = int(num_pages[b])
        for h in range(hkv):
            row = sel[b, h].tolist()
            got = [j for j in row if j >= 0]
            assert row == got + [-1] * (k - len(got)), f"({b},{h}) -1 padding must trail: {row}"
            assert got == sorted(got) and len(set(got)) == len(got), f"({b},{h}) ascending, unique: {got}"
            assert len(got) == min(k, n), f"({b},{h}) {len(got)} pages, expected min(k={k}, n={n})"
            want = brute_select(scores[b, h].tolist(), n, k, sink, recent)
            assert got == want, f"({b},{h}) n={n} k={k} sink={sink} recent={recent}: {got} != {want}"


@pytest.mark.parametrize("num_pages", [[1], [5], [37], [97], [1, 5, 37, 97], [97, 4, 12]])
@pytest.mark.parametrize("k,sink,recent", [(4, 1, 2), (8, 1, 2), (5, 0, 0), (6, 2, 1), (40, 1, 2)])
def test_select_matches_brute_force(num_pages, k, sink, recent):
    gen = torch.Generator().manual_seed(len(num_pages) * 100 + k)
    n = torch.tensor(num_pages)
    p = max(num_pages) + 3  # padding columns beyond every sequence
    scores = torch.rand(len(num_pages), 3, p, generator=gen)
    scores[:, :, -3:] = 1e9  # padding holds garbage that must never be picked
    check_against_brute(scores, n, k, sink, recent)


def test_forced_pages_win_over_any_score():
    scores = torch.zeros(1, 1, 20)
    scores[0, 0, 1:18] = torch.arange(17, 0, -1).float()  # pages 1.. best; sink/recent scored lowest
    scores[0, 0, 0] = scores[0, 0, 18] = scores[0, 0, 19] = -1e30
    sel = select_pages(scores, torch.tensor([20]), k=5)[0, 0].tolist()
    assert sel == [0, 1, 2, 18, 19]


def test_minus_inf_and_nan_candidates_still_fill_the_budget():
    scores = torch.full((1, 2, 9), float("-inf"))
    scores[0, 1, 3] = float("nan")
    sel = select_pages(scores, torch.tensor([9]), k=6)
    assert (sel >= 0).sum(-1).tolist() == [[6, 6]], "a valid page is always better than padding"


def test_ties_pick_the_right_count_and_never_a_worse_page():
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 3, (2, 2, 37), generator=gen).float()
    n, k = torch.tensor([37, 30]), 9
    sel = select_pages(scores, n, k)
    for b in range(2):
        for h in range(2):
            got = set(sel[b, h][sel[b, h] >= 0].tolist())
            nb = int(n[b])
            free = set(range(1, nb - 2))
            picked, left = got & free, free - got
            assert len(got) == k and {0, nb - 2, nb - 1} <= got
            assert min(scores[b, h, j] for j in picked) >= max(scores[b, h, j] for j in left)


@pytest.mark.parametrize("k,sink,recent", [(3, 1, 2), (0, 0, 0), (2, 2, 0)])
def test_bad_budget_raises_naming_k(k, sink, recent):
    with pytest.raises(ValueError, match=rf"k \({k}\)"):
        select_pages(torch.zeros(1, 1, 10), torch.tensor([10]), k, sink, recent)


def test_zero_page_rows_select_nothing():
    sel = select_pages(torch.rand(2, 3, 6), torch.tensor([0, 6]), k=4)
    assert (sel[0] == -1).all() and (sel[1] >= 0).sum(-1).eq(4).all()


def test_budget_pages():
    assert [budget_pages(t, 16) for t in (1, 16, 17, 2048)] == [1, 1, 2, 128]
    with pytest.raises(ValueError, match=r"budget_tokens \(-3\)"):
        budget_pages(-3, 16)


def brute_group(s: list[list[float]], rule: str) -> list[float]:
    """s[g][j] -> per-page score by the rule, with -inf pages given mass 0."""
    def softmax(row):
        live = [x for x in row if x != -math.inf]
        if not live:
            return [0.0] * len(row)
        top = max(live)
        e = [math.exp(x - top) if x != -math.inf else 0.0 for x in row]
        return [x / sum(e) for x in e]

    if rule == "group_mass":
        pooled = []
        for j in range(len(s[0])):
            col = [row[j] for row in s if row[j] != -math.inf]
            pooled.append(math.log(sum(math.exp(x) for x in col)) if col else -math.inf)
        return softmax(pooled)
    shares = [softmax(row) for row in s]
    cols = list(zip(*shares, strict=True))
    return [sum(c) / len(c) if rule == "share_average" else max(c) for c in cols]


@pytest.mark.parametrize("g", [1, 3, 7, 8])
@pytest.mark.parametrize("rule", ["share_average", "group_max", "group_mass"])
def test_group_rules_match_brute_force(g, rule):
    gen = torch.Generator().manual_seed(g)
    s = 3 * torch.randn(2, 2, g, 37, generator=gen, dtype=torch.float64)
    s[0, 1, :, 30:] = float("-inf")  # padding
    s[1, 0] = float("-inf")  # a row with no valid page
    got = group_scores(s, rule)
    assert got.shape == (2, 2, 37) and not torch.isnan(got).any()
    want = [[brute_group(s[b, h].tolist(), rule) for h in range(2)] for b in range(2)]
    want = torch.tensor(want, dtype=torch.float64)
    assert_close(got, want, f"rule {rule}, G={g}")
    assert not got[1, 0].any(), "all-padding row -> zeros"


def test_bad_group_rule_raises():
    with pytest.raises(ValueError, match="group rule"):
        group_scores(torch.zeros(1, 2, 3), "vote")
