"""Triton score kernels (Eq. 4 from quantised summaries, Eq. 5 share-average) vs the torch reference.

CPU runs need TRITON_INTERPRET=1 (CI sets it); CUDA runs when a GPU is present. Shapes are
awkward on purpose: page counts off the block size, ragged batches with empty rows, groups that
are not powers of two, both head dims, ranks 4 and 8, int4 and int8 bases, all three q dtypes.
"""

from __future__ import annotations

import pytest
import torch
from lockserve.kernels import (
    LocksConfig,
    QuantSummaries,
    build_summaries,
    dequantize_summaries,
    group_scores,
    quantize_summaries,
    score_pages_ref,
)
from lockserve.kernels.triton import score_and_group_triton, score_pages_triton, share_average_triton

from tests.conftest import assert_close, triton_devices

DEVICES = triton_devices()
pytestmark = [
    pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1"),
    # Triton's interpreter converts 1-element arrays to int (numpy deprecation, harmless here)
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

# (Bt, Hkv, G, d, r, basis_bits, q dtype, P, num_pages or None for random)
CASES = [
    (1, 1, 1, 64, 8, 4, torch.float32, 1, [1]),
    (3, 2, 3, 64, 4, 4, torch.bfloat16, 5, [5, 0, 3]),
    (4, 1, 7, 128, 8, 4, torch.float16, 37, [37, 0, 12, 30]),
    (2, 1, 8, 64, 8, 8, torch.float32, 97, [97, 40]),
    (3, 1, 4, 128, 8, 4, torch.bfloat16, 16, [16, 16, 9]),
]


def make_table(n_ids: int, hkv: int, d: int, r: int, bits: int, gen: torch.Generator) -> QuantSummaries:
    """A quantised summary table [n_ids, Hkv] from random keys with a per-page spread of scales."""
    spread = 0.5 + 2 * torch.rand(n_ids, hkv, 1, 1, generator=gen)
    keys = torch.randn(n_ids, hkv, 16, d, generator=gen) * spread
    keys = keys + torch.randn(n_ids, hkv, 1, d, generator=gen)  # a centroid away from zero
    return quantize_summaries(build_summaries(keys, r), LocksConfig(rank=r, basis_bits=bits))


def make_batch(bt: int, p: int, num: list[int], n_ids: int, gen: torch.Generator):
    """page_table [Bt, P] int32 with garbage (-1 or out-of-range ids) past num_pages, num_pages [Bt]."""
    table = torch.randint(0, n_ids, (bt, p), generator=gen, dtype=torch.int32)
    num_pages = torch.tensor(num, dtype=torch.int32)
    pos = torch.arange(p)[None, :]
    garbage = torch.where(pos % 2 == 0, -1, n_ids + 5)
    table = torch.where(pos < num_pages[:, None], table, garbage.to(torch.int32))
    return table, num_pages


def to_device(qs: QuantSummaries, device: str) -> QuantSummaries:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(qs).items()}
    return QuantSummaries(**fields)


def case_inputs(case, device: str, seed: int):
    bt, hkv, g, d, r, bits, q_dtype, p, num = case
    gen = torch.Generator().manual_seed(seed)
    n_ids = 3 * p + 7
    qs = make_table(n_ids, hkv, d, r, bits, gen)
    q = (torch.randn(bt, hkv * g, d, generator=gen) * 1.5).to(q_dtype)
    table, num_pages = make_batch(bt, p, num, n_ids, gen)
    return q.to(device), to_device(qs, device), table.to(device), num_pages.to(device)


def reference(q, qs, table, num_pages) -> torch.Tensor:
    return score_pages_ref(q, dequantize_summaries(qs), table, num_pages)


def assert_scores(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """-inf exactly where the reference has it, float32 tolerance elsewhere."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), f"{what}: finite pattern differs from reference"
    assert_close(actual[finite], expected[finite], what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "Bt{}-Hkv{}-G{}-d{}-r{}-b{}-{}-P{}".format(*c))
def test_score_pages_matches_reference(case, device):
    q, qs, table, num_pages = case_inputs(case, device, seed=11)
    out = torch.full((q.shape[0], qs.mu_scale.shape[1], q.shape[1] // qs.mu_scale.shape[1], table.shape[1]),
                     float("nan"), device=device)
    s_hat = score_pages_triton(q, qs, table, num_pages, out=out)
    assert s_hat.data_ptr() == out.data_ptr()
    assert_scores(s_hat.cpu(), reference(q, qs, table, num_pages).cpu(), f"s_hat {case}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [CASES[1], CASES[3]], ids=lambda c: f"Bt{c[0]}-G{c[2]}-P{c[7]}")
def test_score_and_group_matches_reference(case, device):
    q, qs, table, num_pages = case_inputs(case, device, seed=23)
    bt, hkv, g, p = q.shape[0], qs.mu_scale.shape[1], q.shape[1] // qs.mu_scale.shape[1], table.shape[1]
    out = (torch.full((bt, hkv, g, p), float("nan"), device=device),
           torch.full((bt, hkv, p), float("nan"), device=device))
    s_hat, m_bar = score_and_group_triton(q, qs, table, num_pages, out=out)
    ref = reference(q, qs, table, num_pages).cpu()
    assert_scores(s_hat.cpu(), ref, f"s_hat {case}")
    assert_close(m_bar.cpu(), group_scores(ref, "share_average"), f"m_bar {case}")
    # Rows with num_pages = 0 have no mass; others sum to 1 over their pages.
    sums = m_bar.cpu().sum(-1)
    expect = (num_pages.cpu() > 0).float()[:, None].expand_as(sums)
    assert_close(sums, expect, "m_bar row sums")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 37), (3, 7, 97), (1, 8, 1500)], ids=str)
def test_share_average_matches_reference(shape, device):
    lead, g, p = shape
    gen = torch.Generator().manual_seed(5 + p)
    s_hat = torch.randn(lead, 2, g, p, generator=gen) * 4
    pad = torch.rand(lead, 2, 1, p, generator=gen) < 0.3
    s_hat = s_hat.masked_fill(pad, float("-inf"))
    s_hat[0, 1] = float("-inf")  # a row with no valid page -> zeros
    out = torch.full((lead, 2, p), float("nan"), device=device)
    m_bar = share_average_triton(s_hat.to(device), out=out)
    expected = group_scores(s_hat, "share_average")
    assert_close(m_bar.cpu(), expected, f"m_bar {shape}")
    assert torch.all(m_bar[0, 1] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_score_with_int64_indices_and_strided_q(device):
    """int64 page table / num_pages and a q that is a non-contiguous view."""
    q, qs, table, num_pages = case_inputs(CASES[1], device, seed=3)
    q_wide = torch.zeros(q.shape[0], q.shape[1], 2 * q.shape[2], dtype=q.dtype, device=device)
    q_wide[..., ::2] = q
    s_hat = score_pages_triton(q_wide[..., ::2], qs, table.long(), num_pages.long())
    assert_scores(s_hat.cpu(), reference(q, qs, table, num_pages).cpu(), "strided q, int64 ids")


def test_score_rejects_bad_arguments():
    q, qs, table, num_pages = case_inputs(CASES[1], DEVICES[0], seed=1)
    msg = r"page_table: expected int32/int64 \[Bt, P\] with Bt=3, got \(3, 5\) int16"
    with pytest.raises(ValueError, match=msg):
        score_pages_triton(q, qs, table.to(torch.int16), num_pages)
    with pytest.raises(ValueError, match=r"num_pages: expected int32/int64 \[Bt\] with Bt=3, got \(2,\)"):
        score_pages_triton(q, qs, table, num_pages[:2])
    msg = r"q: query heads Hq \(5\) must be a multiple of the KV heads Hkv \(2\)"
    with pytest.raises(ValueError, match=msg):
        score_pages_triton(q[:, :5], qs, table, num_pages)
    with pytest.raises(ValueError, match=r"qs.mu_q: expected int8/bfloat16 \[N, Hkv, d\] with .*d=64"):
        score_pages_triton(q, QuantSummaries(**{**vars(qs), "mu_q": qs.mu_q[..., :32]}), table, num_pages)
    with pytest.raises(ValueError, match=r"out: expected a contiguous float32 \(3, 2, 3, 5\)"):
        score_pages_triton(q, qs, table, num_pages, out=torch.empty(3, 2, 3, 4, device=DEVICES[0]))


@pytest.mark.gpu
def test_score_llama_shapes_on_gpu():
    """Llama-3.1-8B geometry (Hkv 8, G 4, d 128, r 8, int4), a few thousand pages, ragged batch."""
    case = (3, 8, 4, 128, 8, 4, torch.bfloat16, 4099, [4099, 17, 2500])
    q, qs, table, num_pages = case_inputs(case, "cuda", seed=99)
    s_hat, m_bar = score_and_group_triton(q, qs, table, num_pages)
    ref = reference(q, qs, table, num_pages)
    assert_scores(s_hat.cpu(), ref.cpu(), "s_hat llama shapes")
    assert_close(m_bar.cpu(), group_scores(ref, "share_average").cpu(), "m_bar llama shapes")


@pytest.mark.gpu
def test_score_table_beyond_int32_offsets():
    """A summary table whose element offsets pass 2^31 (ids near the end of a 2.1M-page table)."""
    n_ids, hkv, d, r = (1 << 21) + 64, 8, 128, 8
    dev = "cuda"
    table_q = QuantSummaries(
        basis_q=torch.zeros(n_ids, hkv, r, d // 2, dtype=torch.uint8, device=dev),
        basis_scale=torch.zeros(n_ids, hkv, r, dtype=torch.float16, device=dev),
        coef_q=torch.zeros(n_ids, hkv, 16, r, dtype=torch.int8, device=dev),
        coef_scale=torch.zeros(n_ids, hkv, 16, dtype=torch.float16, device=dev),
        mu_q=torch.zeros(n_ids, hkv, d, dtype=torch.int8, device=dev),
        mu_scale=torch.zeros(n_ids, hkv, dtype=torch.float16, device=dev),
        basis_bits=4,
    )
    gen = torch.Generator().manual_seed(7)
    small = make_table(40, hkv, d, r, 4, gen)
    ids = torch.arange(n_ids - 40, n_ids, device=dev)
    for name, value in vars(small).items():
        if isinstance(value, torch.Tensor):
            getattr(table_q, name)[ids] = value.to(dev)
    q = torch.randn(2, hkv * 4, d, generator=gen).to(dev, torch.bfloat16)
    page_table = torch.stack([ids, ids.flip(0)]).to(torch.int32)
    num_pages = torch.tensor([40, 33], dtype=torch.int32, device=dev)
    s_hat = score_pages_triton(q, table_q, page_table, num_pages)
    local = torch.stack([torch.arange(40), torch.arange(40).flip(0)]).to(dev)
    expected = reference(q, to_device(small, dev), local, num_pages)
    assert_scores(s_hat.cpu(), expected.cpu(), "s_hat past 2^31 elements")
