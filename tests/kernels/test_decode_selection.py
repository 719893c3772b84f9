"""Decode selection with per-row budgets (what the CUDA-graph step runs) vs brute force, and the
Triton launcher (keys kernel + topk + slots kernel) vs the torch reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from lockserve.kernels.score import PageScores, group_scores, group_stats_ref, share_average_from_stats
from lockserve.kernels.select import (
    DecodeRows,
    PoolAddress,
    decode_selection_ref,
    select_decode_pages,
)
from lockserve.kernels.triton.select_kernel import _ordered, _take, _threshold_bisect, _threshold_radix2

from tests.conftest import assert_close, triton_devices
from tests.kernels.test_select import brute_select

PAGE = 16
HKV = 3


def make_rows(num_pages: list[int], budgets: list[int], p: int, gen, device="cpu", dtype=torch.int32):
    bt = len(num_pages)
    table = torch.randperm(max(10_000, bt * p), generator=gen)[: bt * p].view(bt, p)  # distinct page ids
    tail_len = torch.randint(1, PAGE + 1, (bt,), generator=gen)
    tail_loc = torch.randint(0, 50, (bt,), generator=gen)
    to = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
    n, k = to(torch.tensor(num_pages)), to(torch.tensor(budgets))
    return DecodeRows(to(table), n, k, to(tail_len), to(tail_loc))


G = 3


def page_scores(bt: int, p: int, gen, device="cpu", ties: bool = False) -> PageScores:
    """s_hat [Bt, Hkv, G, P] whose share-averaged order is unambiguous (neighbours 1% apart, so
    float32 rounding of exp cannot reorder them), optionally with blocks of exact ties."""
    order = torch.stack([torch.randperm(p, generator=gen) for _ in range(bt * HKV)]).view(bt, HKV, 1, p)
    s_hat = order.float() * 0.01 + torch.arange(G).float()[None, None, :, None]  # [Bt, Hkv, G, P]
    if ties:
        s_hat[-1, -1, :, ::3] = 0.5  # equal keys: the lower position wins, in both implementations
    s_hat[:, :, :, -1] = float("-inf")  # a padding column
    return PageScores(s_hat.to(device), group_stats_ref(s_hat).to(device))


CASES = [([1], [4]), ([5], [4]), ([37, 3, 97], [8, 8, 8]), ([97, 40, 12, 2], [6, 40, 5, 9]), ([300], [130]),
         ([5000, 2100], [130, 9])]  # several chunks of the first top-k pass


@pytest.mark.parametrize("num_pages,budgets", CASES)
def test_selected_sets_follow_the_rule_with_a_budget_per_row(num_pages, budgets):
    gen = torch.Generator().manual_seed(sum(num_pages))
    p = max(num_pages) + 5
    scores = torch.rand(len(num_pages), HKV, p, generator=gen)
    scores[:, :, -5:] = 1e9  # garbage past every row's pages: never picked
    k = max(budgets)
    sel = select_decode_pages(scores, torch.tensor(num_pages), torch.tensor(budgets), k)
    assert sel.shape == (len(num_pages), HKV, k)
    for b, (n, budget) in enumerate(zip(num_pages, budgets, strict=True)):
        for h in range(HKV):
            row = sel[b, h].tolist()
            got = [j for j in row if j >= 0]
            assert row[: len(got)] == got, f"({b},{h}) padding must trail: {row}"
            want = brute_select(scores[b, h].tolist(), n, budget, 1, 2)
            assert sorted(got) == want, f"({b},{h}) n={n} budget={budget}: {sorted(got)} != {want}"


def test_dense_selection_takes_every_page_in_order():
    sel = select_decode_pages(None, torch.tensor([3, 7]), torch.tensor([0, 0]), 8)
    assert sel[0, 0].tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    assert sel[1, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, -1]


@pytest.mark.parametrize("dense", [False, True])
def test_slots_lens_and_open_page_index(dense):
    gen = torch.Generator().manual_seed(3)
    num_pages, budgets = [9, 1, 30], [5, 5, 5]
    rows = make_rows(num_pages, budgets, 32, gen)
    where = PoolAddress(layer_base=2 * 10_000, write_front=100, write_base=4 * 50)
    k = 32 if dense else 5
    scores = None if dense else page_scores(3, 32, gen)
    got = decode_selection_ref(scores, rows, k, 1, 2, HKV, PAGE, where)
    m_bar = None if dense else scores.share_average()
    sel = select_decode_pages(m_bar, rows.num_pages, rows.budgets, k).expand(3, HKV, k)
    for b in range(3):
        n = num_pages[b]
        for h in range(HKV):
            for r in range(k):
                j = int(sel[b, h, r])
                slot, ln = int(got.slots[b, h, r]), int(got.lens[b, h, r])
                if j < 0:
                    assert (slot, ln, bool(got.is_open[b, h, r]), int(got.idx[b, h, r])) == (-1, 0, False, -1)
                elif j == n - 1:
                    assert bool(got.is_open[b, h, r]) and ln == int(rows.tail_len[b]) and slot == -1
                    want = where.write_front + (where.write_base + int(rows.tail_loc[b])) * HKV + h
                    assert int(got.idx[b, h, r]) == want
                else:
                    assert slot == (where.layer_base + int(rows.page_table[b, j])) * HKV + h and ln == PAGE
                    assert int(got.idx[b, h, r]) == slot and not bool(got.is_open[b, h, r])


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_pages,budgets", CASES)
@pytest.mark.parametrize("bits", [1, 2])  # triton/select.py RADIX_BITS_CHOICES
def test_triton_equals_the_reference(device, dense, index_dtype, num_pages, budgets, bits):
    from lockserve.kernels.triton.select import decode_selection_triton

    gen = torch.Generator().manual_seed(7 + len(num_pages))
    p = max(num_pages) + 2
    rows = make_rows(num_pages, budgets, p, gen, device, index_dtype)
    scores = None if dense else page_scores(len(num_pages), p, gen, device, ties=True)
    k = p if dense else max(budgets)
    where = PoolAddress(layer_base=3 * 10_000, write_front=7, write_base=50)
    want = decode_selection_ref(scores, rows, k, 1, 2, HKV, PAGE, where)
    got = decode_selection_triton(scores, rows, k, 1, 2, HKV, PAGE, where, radix_bits=bits)
    for name in ("slots", "lens", "is_open", "idx"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name} differs:\n{a}\n{b}"


@triton.jit
def take_probe(key_ptr, valid_ptr, take_ptr, count_ptr, N, K, CB: tl.constexpr, BITS: tl.constexpr):
    """One block around select_kernel._take: take[i] = 1 where key i is kept, count = its size."""
    i = tl.arange(0, CB)
    key = tl.load(key_ptr + i, mask=i < N, other=0.0)
    valid = (tl.load(valid_ptr + i, mask=i < N, other=0) != 0) & (i < N)
    take, count = _take(_ordered(key), valid, K, BITS)
    tl.store(take_ptr + i, take.to(tl.int8), mask=i < N)
    tl.store(count_ptr, count)


def take_ref(key: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
    """The min(k, valid) largest keys by _ordered's order (-0.0 below +0.0), the lower index first
    among equal keys, as a bool mask."""
    bits = key.view(torch.int32).long()
    order = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    idx = torch.arange(key.numel())
    rank = sorted(idx[valid].tolist(), key=lambda i: (-int(order[i]), i))[:k]
    take = torch.zeros(key.numel(), dtype=torch.bool)
    take[rank] = True
    return take


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("bits", [1, 2])
def test_radix_take_keeps_the_largest_keys_for_every_digit_width(device, bits):
    gen = torch.Generator().manual_seed(bits)
    n = 300
    cases = {
        "mixed signs and infinities": torch.randn(n, generator=gen) * 1e3,
        "ties": torch.randint(0, 4, (n,), generator=gen).float() - 1.5,
        "one value": torch.full((n,), 0.25),
        "neighbours one ulp apart": torch.where(torch.rand(n, generator=gen) < 0.5, 1.0,
                                                torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))),
    }
    cases["mixed signs and infinities"][:20:3] = float("inf")
    cases["mixed signs and infinities"][1:20:3] = float("-inf")
    cases["mixed signs and infinities"][2:20:3] = -0.0
    for name, key in cases.items():
        valid = torch.rand(n, generator=gen) < 0.8
        for k in (0, 1, 7, 128, 240, 400):  # 400 > the valid keys
            take = torch.zeros(n, dtype=torch.int8, device=device)
            count = torch.zeros(1, dtype=torch.int32, device=device)
            take_probe[(1,)](key.to(device), valid.to(torch.int8).to(device), take, count, n, k, CB=512,
                             BITS=bits)
            want = take_ref(key, valid, k)
            assert torch.equal(take.cpu().bool(), want), f"{name}, k={k}"
            assert int(count) == min(k, int(valid.sum())), f"{name}, k={k}"


@triton.jit
def passes_probe(key_ptr, out_ptr, N, K, CB: tl.constexpr, BITS: tl.constexpr):
    """The threshold search's pass count over N keys, all valid, need = min(K, N)."""
    i = tl.arange(0, CB)
    valid = i < N
    key = _ordered(tl.load(key_ptr + i, mask=valid, other=0.0)).to(tl.int64)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    need = tl.minimum(K, n_valid)
    if BITS == 1:
        _, _, passes = _threshold_bisect(key, valid, need)
    else:
        _, _, passes = _threshold_radix2(key, valid, need, n_valid)
    tl.store(out_ptr, passes)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("bits", [1, 2])
def test_threshold_search_stops_early_on_distinct_keys_and_not_on_a_boundary_tie(device, bits):
    """Distinct float scores end the search once the bound separates the need-th key from the next
    (the selection's latency is its serial passes); a tie across the boundary keeps all 32 / bits."""
    gen = torch.Generator().manual_seed(7)
    full = 32 // bits
    out = torch.zeros(1, dtype=torch.int32, device=device)

    def passes(key: torch.Tensor, k: int) -> int:
        cb = triton.next_power_of_2(key.numel())
        passes_probe[(1,)](key.to(device), out, key.numel(), k, CB=cb, BITS=bits)
        return int(out)

    scores = torch.softmax(torch.randn(1024, generator=gen) * 3, 0)  # share-averaged page scores
    got = [passes(scores, k) for k in (1, 128, 500)]
    assert max(got) <= full - 6, f"passes {got} of at most {full}: the search did not stop early"
    tied = torch.cat([torch.full((8,), 0.5), torch.rand(100, generator=gen) * 0.4])  # 8 equal best
    assert passes(tied, 4) == full, "a tie across the boundary must fix every bit"
    # Every key needed: the bisection's first count (mid 0, below every positive score) ends it;
    # the radix search needs no pass.
    assert passes(scores, 1024) == (1 if bits == 1 else 0)


def test_triton_refuses_bad_rows():
    from lockserve.kernels.triton.select import decode_selection_triton

    rows = make_rows([3], [4], 4, torch.Generator().manual_seed(0))
    bad = DecodeRows(rows.page_table, rows.num_pages.to(torch.float32), rows.budgets, rows.tail_len,
                     rows.tail_loc)
    with pytest.raises(ValueError, match="rows.num_pages"):
        decode_selection_triton(None, bad, 4, 1, 2, HKV, PAGE, PoolAddress(0, 0, 0))


def test_triton_launchers_refuse_a_radix_width_they_have_no_kernel_for():
    from lockserve.kernels.triton.select import (
        decode_selection_triton,
        shard_candidates_triton,
        shard_chunk_topk_triton,
    )

    rows = make_rows([3], [4], 4, torch.Generator().manual_seed(0))
    scores = page_scores(1, 4, torch.Generator().manual_seed(1))
    n = torch.tensor([3])
    keys, cols = torch.zeros(1, HKV, 4), torch.zeros(1, HKV, 4, dtype=torch.int32)
    launches = [lambda b: decode_selection_triton(scores, rows, 4, 1, 2, HKV, PAGE, PoolAddress(0, 0, 0), b),
                lambda b: shard_chunk_topk_triton(scores.s_hat, scores.stats, n * 0, n, n, 4, 1, 2, b),
                lambda b: shard_candidates_triton(keys, cols, n * 0, 4, b)]
    for launch in launches:
        for bits in (0, 4):
            with pytest.raises(ValueError, match=rf"radix_bits \({bits}\) must be one of \(1, 2\)"):
                launch(bits)


def test_share_average_from_stats_is_eq5():
    gen = torch.Generator().manual_seed(11)
    s_hat = torch.randn(2, HKV, G, 40, generator=gen)
    s_hat[0, 1, :, 30:] = float("-inf")
    s_hat[1, 0] = float("-inf")  # a row without a score: zeros
    m_bar = share_average_from_stats(s_hat, group_stats_ref(s_hat))
    torch.testing.assert_close(m_bar, group_scores(s_hat, "share_average"), rtol=1e-6, atol=1e-7)
    assert torch.equal(m_bar[1, 0], torch.zeros(40))


@pytest.mark.parametrize("device", triton_devices())
def test_group_stats_from_block_partials(device):
    """The stats kernel merges per-block (max, sum exp) partials into the row's (max, sum exp)."""
    from lockserve.kernels.triton.score import group_stats_triton

    gen = torch.Generator().manual_seed(12)
    s_hat = torch.randn(2, HKV, G, 8 * 37, generator=gen) * 5
    s_hat[0, 0, 0, 100:] = float("-inf")
    s_hat[1, 2, 1] = float("-inf")
    blocks = s_hat.view(2, HKV, G, 37, 8)
    pmax = blocks.amax(-1)
    psum = torch.exp(blocks - torch.where(torch.isfinite(pmax), pmax, 0)[..., None]).sum(-1)
    got = group_stats_triton(pmax.contiguous().to(device), psum.contiguous().to(device)).cpu()
    want = group_stats_ref(s_hat)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


def best_columns(keys: torch.Tensor, cols: torch.Tensor, k: int) -> list[list[int]]:
    """Per (row, head): the columns of the best k entries under (key desc, column asc)."""
    out = []
    for kr, cr in zip(keys.flatten(0, 1).tolist(), cols.flatten(0, 1).tolist(), strict=True):
        entries = sorted((-key, col) for key, col in zip(kr, cr, strict=True) if col >= 0)
        out.append([col for _, col in entries[:k]])
    return out


# (columns W of the rank, [(first_page, num_settled, num_pages) per row], k): a first rank (the sink
# in its range), a last rank (the recent pages and the open page), a middle one; k past the pages
# that compete; several chunks of the kernel's first pass.
SHARD_CASES = [(37, [(0, 37, 90), (53, 36, 90), (20, 37, 200)], 5),
               (37, [(0, 37, 90), (53, 36, 90)], 50),
               (2500, [(0, 2500, 6000), (3500, 2499, 6000)], 40)]


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("w,rows,k", SHARD_CASES, ids=lambda c: str(c)[:20])
def test_shard_chunk_topk_triton_keeps_the_references_best(device, w, rows, k):
    from lockserve.kernels.select import shard_chunk_topk_ref
    from lockserve.kernels.triton.select import shard_chunk_topk_triton

    gen = torch.Generator().manual_seed(w + k)
    scores = page_scores(len(rows), w, gen, ties=True)
    s_hat = scores.s_hat.clone()
    s_hat[0, 0, 0, 5] = float("nan")  # a NaN score keys as 0, in both
    first, settled, n = (torch.tensor(col) for col in zip(*rows, strict=True))
    args = (s_hat, scores.stats, first, settled, n, k, 1, 2)
    ref_keys, ref_cols = shard_chunk_topk_ref(*args)
    got_keys, got_cols = shard_chunk_topk_triton(*(a.to(device) if torch.is_tensor(a) else a for a in args))
    assert got_cols.dtype == torch.int32 and got_keys.shape[-1] % k == 0
    want = best_columns(ref_keys, ref_cols, k)
    assert best_columns(got_keys.cpu(), got_cols.cpu(), k) == want
    got_keys, got_cols = got_keys.cpu(), got_cols.cpu()
    picked = got_cols >= 0
    at = ref_keys.gather(-1, got_cols.long().clamp_min(0))
    assert_close(got_keys[picked], at[picked], "candidate keys")


def shard_candidates(ranges, n, t, bt, hkv, seed):
    """Every rank's local candidates as the protocol makes them: order keys of random (tied) values
    over pages of the rank's range, best t descending, EMPTY after them. ranges: [(first, count)]."""
    from lockserve.kernels.select import EMPTY, order_keys

    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(ranges), bt, hkv, t), EMPTY, dtype=torch.int64)
    for r, (first, count) in enumerate(ranges):
        for b in range(bt):
            for h in range(hkv):
                m = int(torch.randint(0, min(count, 2 * t) + 1, (), generator=g))  # competing pages
                pos = first + torch.randperm(count, generator=g)[:m]
                vals = torch.randint(0, 4, (m,), generator=g).float() / 4  # ties on the value
                keys = order_keys(vals, pos).sort(descending=True).values[:t]
                out[r, b, h, : keys.numel()] = keys
    return out


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("ranges,n,t,sink,recent", [
    ([(0, 40), (40, 33)], 73, 5, 1, 2),  # two ranks, the sink on one, the recent pages on the other
    ([(0, 3), (3, 60), (63, 2)], 65, 37, 1, 2),  # t not a power of two; a rank of a few pages
    ([(0, 20)], 20, 16, 2, 1),  # one rank
    ([(0, 1), (1, 1)], 2, 3, 1, 2),  # n < sink + recent: forced pages repeat, as the reference keeps them
])
def test_shard_select_triton_equals_the_reference(device, ranges, n, t, sink, recent):
    """Threshold and selection in one launch == global_threshold + shard_selection, for every rank,
    with takes below, at and above the candidates there are (ties on the value everywhere)."""
    from lockserve.kernels.select import shard_select_ref
    from lockserve.kernels.triton.select import shard_select_triton

    bt, hkv = 4, 3
    gathered = shard_candidates(ranges, n, t, bt, hkv, seed=n + t)
    take = torch.tensor([1, t // 2 + 1, t, 3 * t])
    num_pages = torch.full((bt,), n)
    for r, (first, count) in enumerate(ranges):
        args = (gathered, gathered[r].contiguous(), take, torch.full((bt,), first), torch.full((bt,), count),
                num_pages, sink, recent)
        want = shard_select_ref(*args)
        got = shard_select_triton(*(a.to(device) if torch.is_tensor(a) else a for a in args))
        assert got.shape == want.shape == (bt, hkv, sink + recent + t)
        assert torch.equal(got.cpu(), want), f"rank {r}"
        assert (want >= 0).any(), "the case selects something"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("first,n,open_here", [(0, 40, False), (37, 64, True), (5, 6, True)])
def test_shard_slots_triton_equals_the_reference(device, first, n, open_here):
    """A rank's selected positions -> slots, lens, open flags and pool indices, in one launch ==
    the reference (the open page on the rank that holds it, padding, a one-page rank)."""
    from lockserve.kernels.select import PoolAddress, shard_slots_ref
    from lockserve.kernels.triton.select import shard_slots_triton

    g = torch.Generator().manual_seed(first + n)
    bt, hkv, k, width = 2, 3, 21, 40
    count = n - first if open_here else min(20, n - first)
    sel = torch.full((bt, hkv, k), -1, dtype=torch.int64)
    for b in range(bt):
        for h in range(hkv):
            m = int(torch.randint(1, min(count, k) + 1, (), generator=g))
            sel[b, h, :m] = (first + torch.randperm(count, generator=g)[:m]).sort().values
    num_pages = torch.tensor([n, n])
    rows = (torch.tensor([first, first]), num_pages, torch.tensor([7, 3]),
            torch.tensor([4, 9]) if open_here else torch.tensor([-1, -1]),
            torch.randint(0, 500, (bt, width), generator=g, dtype=torch.int32))
    where = PoolAddress(layer_base=3 * 512, write_front=1000, write_base=3 * 16)
    want = shard_slots_ref(sel, *rows, where, 16)
    got = shard_slots_triton(sel.to(device), *(r.to(device) for r in rows), where, 16)
    for name in ("slots", "lens", "is_open", "idx"):
        w, o = getattr(want, name), getattr(got, name).cpu()
        assert o.dtype == w.dtype and torch.equal(o, w), name
    assert want.is_open.any() == open_here and (want.lens == 16).any() == (count > 1), "the case's pages"


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("w,t", [(2600, 40), (300, 125), (30, 64)])  # 3 chunks; t not a power of 2; t > pages
def test_shard_candidates_triton_equals_the_reference_as_a_set(device, w, t):
    """A rank's best t from the chunks' candidates, as order keys, in one launch == local_candidates
    (whose order is descending; the kernel's is by position: the same keys), ties and -0.0 included."""
    from lockserve.kernels.select import EMPTY, local_candidates
    from lockserve.kernels.triton.select import shard_candidates_triton, shard_chunk_topk_triton

    g = torch.Generator().manual_seed(w + t)
    hkv, grp = 2, 3
    s_hat = torch.randint(0, 30, (2, hkv, grp, w), generator=g).float() * 0.01  # ties everywhere
    stats = group_stats_ref(s_hat)
    first, settled, n = torch.tensor([0, 500]), torch.tensor([w, w - 7]), torch.tensor([w + 3, w + 500])
    keys, cols = shard_chunk_topk_triton(*(x.to(device) for x in (s_hat, stats, first, settled, n)), t, 1, 2)
    keys[0, 0, :3] = -0.0  # -0.0 compares as +0.0 (order_keys), the position breaking the tie
    want = local_candidates(keys.cpu(), first, t, cols.cpu())
    got = shard_candidates_triton(keys, cols, first.to(device), t).cpu()
    assert got.shape == want.shape == (2, hkv, t)
    assert torch.equal(got.sort(dim=-1, descending=True).values, want)
    assert (want == EMPTY).any() == (t > w - 3), "padding exactly when fewer pages compete than t"
