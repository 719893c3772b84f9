"""Sparse attention over selected pages vs dense attention and brute-force loops."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from lockserve.kernels.attention import attention_ref, merge_partials, page_lengths, sparse_decode_ref
from lockserve.kernels.select import select_pages

from tests.conftest import assert_close


@dataclass
class RaggedBatch:
    """A decode batch laid out like the serving path: pages of B tokens in a shuffled slot pool."""

    q: torch.Tensor  # [Bt, Hq, d]
    keys: list[torch.Tensor]  # per sequence [T_b, Hkv, d]
    values: list[torch.Tensor]  # per sequence [T_b, Hkv, d]
    pool: torch.Tensor  # [S, 2, B, d]
    slot_table: torch.Tensor  # [Bt, Hkv, P] pool slot of page j of (b, h); -1 past the last page
    seq_lens: torch.Tensor  # [Bt]
    num_pages: torch.Tensor  # [Bt] pages incl. the open partial one

    def slots(self, sel: torch.Tensor) -> torch.Tensor:
        """Page indices sel [Bt, Hkv, K] (-1 pad) -> pool slots [Bt, Hkv, K] (-1 pad)."""
        s = torch.gather(self.slot_table, 2, sel.clamp_min(0))
        return torch.where(sel >= 0, s, torch.full_like(s, -1))


def ragged_batch(gen, seq_lens, hkv: int, g: int, d: int, b: int = 16, scale: float = 1.0) -> RaggedBatch:
    """Random keys/values; slots beyond a sequence's end hold huge garbage that must be masked."""
    bt = len(seq_lens)
    pages = [math.ceil(t / b) for t in seq_lens]
    total = sum(pages) * hkv
    pool = 1e4 * torch.randn(total, 2, b, d, generator=gen)
    perm = torch.randperm(total, generator=gen)
    slot_table = torch.full((bt, hkv, max(pages)), -1, dtype=torch.long)
    keys, values, used = [], [], 0
    for i, t in enumerate(seq_lens):
        k = scale * torch.randn(t, hkv, d, generator=gen)
        v = torch.randn(t, hkv, d, generator=gen)
        for h in range(hkv):
            for j in range(pages[i]):
                slot = perm[used].item()
                used += 1
                slot_table[i, h, j] = slot
                n = min(b, t - j * b)
                pool[slot, 0, :n] = k[j * b : j * b + n, h]
                pool[slot, 1, :n] = v[j * b : j * b + n, h]
        keys.append(k)
        values.append(v)
    q = torch.randn(bt, hkv * g, d, generator=gen)
    return RaggedBatch(q, keys, values, pool, slot_table, torch.tensor(seq_lens), torch.tensor(pages))


def dense(batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    outs = [attention_ref(batch.q[i], batch.keys[i], batch.values[i]) for i in range(len(batch.keys))]
    return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])


def sparse(batch: RaggedBatch, sel: torch.Tensor, b: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    lens = page_lengths(sel, batch.seq_lens, b)
    return sparse_decode_ref(batch.q, batch.pool, batch.slots(sel), lens)


@pytest.mark.parametrize("seq_lens,hkv,g,d", [
    ([1], 1, 1, 64),
    ([16, 33, 80], 2, 3, 64),
    ([593, 17, 1552, 70], 2, 7, 128),
    ([5 * 16, 37 * 16 - 3], 1, 8, 128),
])
def test_budget_covering_every_page_equals_dense(seq_lens, hkv, g, d):
    gen = torch.Generator().manual_seed(sum(seq_lens) + g)
    batch = ragged_batch(gen, seq_lens, hkv, g, d)
    p = batch.slot_table.shape[2]
    scores = torch.rand(len(seq_lens), hkv, p, generator=gen)
    sel = select_pages(scores, batch.num_pages, k=max(p, 4) + 3)
    o, lse = sparse(batch, sel)
    o_ref, lse_ref = dense(batch)
    assert_close(o, o_ref, "o full budget vs dense")
    assert_close(lse, lse_ref, "lse full budget vs dense")


def test_attention_ref_matches_loops():
    gen = torch.Generator().manual_seed(3)
    t, hkv, g, d = 37, 3, 2, 64
    q = torch.randn(hkv * g, d, generator=gen)
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    o, lse = attention_ref(q, k, v)
    for h in range(hkv * g):
        logits = torch.tensor([q[h].double() @ k[i, h // g].double() / math.sqrt(d) for i in range(t)])
        w = torch.softmax(logits, 0)
        assert_close(o[h].double(), (w[:, None] * v[:, h // g].double()).sum(0), f"o head {h}", torch.float32)
        assert_close(lse[h].double(), torch.logsumexp(logits, 0), f"lse head {h}", torch.float32)


def test_page_lengths_brute_force():
    sel = torch.tensor([[[0, 2, 3, -1]], [[1, 4, -1, -1]]])
    seq_lens = torch.tensor([50, 65])
    want = [[[min(16, max(0, 50 - 16 * j)) if j >= 0 else 0 for j in row] for row in sel[0].tolist()],
            [[min(16, max(0, 65 - 16 * j)) if j >= 0 else 0 for j in row] for row in sel[1].tolist()]]
    assert page_lengths(sel, seq_lens, 16).tolist() == want


def test_sparse_subset_matches_dense_on_the_subset():
    gen = torch.Generator().manual_seed(9)
    batch = ragged_batch(gen, [97, 45], 2, 3, 64)
    sel = torch.tensor([[[1, 4, -1], [0, 6, -1]], [[2, -1, -1], [0, 1, 2]]])
    o, lse = sparse(batch, sel)
    for i in range(2):
        for h in range(2):
            pages = [j for j in sel[i, h].tolist() if j >= 0]
            idx = torch.cat([torch.arange(16 * j, min(16 * j + 16, batch.seq_lens[i].item())) for j in pages])
            k, v = batch.keys[i][idx, h : h + 1], batch.values[i][idx, h : h + 1]
            o_ref, lse_ref = attention_ref(batch.q[i, 3 * h : 3 * h + 3], k, v)
            assert_close(o[i, 3 * h : 3 * h + 3], o_ref, f"o seq {i} head {h}")
            assert_close(lse[i, 3 * h : 3 * h + 3], lse_ref, f"lse seq {i} head {h}")


def test_no_selected_token_gives_zero_output_and_minus_inf():
    gen = torch.Generator().manual_seed(4)
    batch = ragged_batch(gen, [40], 1, 2, 64)
    o, lse = sparse(batch, torch.full((1, 1, 3), -1))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("splits", [[5, 32], [1, 1, 35], [37]])
def test_merge_partials_of_a_split_equals_the_whole(splits):
    gen = torch.Generator().manual_seed(len(splits))
    t, hkv, g, d = sum(splits), 2, 3, 64
    q = torch.randn(hkv * g, d, generator=gen)
    k, v = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    parts, start = [], 0
    for n in splits:
        parts.append(attention_ref(q, k[start : start + n], v[start : start + n]))
        start += n
    o, lse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    o_ref, lse_ref = attention_ref(q, k, v)
    assert_close(o, o_ref, "merged o")
    assert_close(lse, lse_ref, "merged lse")


def test_merge_partials_with_empty_partials():
    gen = torch.Generator().manual_seed(8)
    o1, l1 = torch.randn(4, 64, generator=gen), torch.randn(4, generator=gen)
    empty_o, empty_l = torch.zeros(4, 64), torch.full((4,), float("-inf"))
    o, lse = merge_partials(torch.stack([empty_o, o1, empty_o]), torch.stack([empty_l, l1, empty_l]))
    assert_close(o, o1, "an empty partial contributes nothing")
    assert_close(lse, l1, "lse unchanged by empty partials")
    o, lse = merge_partials(torch.stack([empty_o, empty_o]), torch.stack([empty_l, empty_l]))
    assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all(), "all empty -> o = 0, lse = -inf"


def test_merge_partials_ignores_whatever_an_empty_partial_holds():
    """An empty partial (lse = -inf) contributes nothing, even if its o is not zero — a kernel
    that divides 0 by 0 for a rank with no selected token hands back NaN there.

    Fails while merge_partials multiplies w = 0 by o = NaN (0 * NaN = NaN).
    """
    gen = torch.Generator().manual_seed(10)
    o1, l1 = torch.randn(3, 64, generator=gen), torch.randn(3, generator=gen)
    for junk in (1e30, float("nan")):
        lse_in = torch.stack([l1, torch.full((3,), -math.inf)])
        o, lse = merge_partials(torch.stack([o1, torch.full((3, 64), junk)]), lse_in)
        assert_close(o, o1, f"empty partial holding {junk}")
        assert_close(lse, l1, f"lse with an empty partial holding {junk}")
