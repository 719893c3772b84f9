"""Summary build (Algorithm 1) and quantisation against brute-force linear algebra."""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.kernels import summary
from lockserve.kernels.score import page_logits
from lockserve.kernels.summary import (
    LocksConfig,
    build_summaries,
    dequantize_summaries,
    pack_bits,
    quantize_summaries,
    unpack_bits,
)

from tests.conftest import assert_close


def low_rank_pages(gen, n: int, b: int, d: int, m: int, noise: float = 0.0) -> torch.Tensor:
    """Pages whose deviations live in a random rank-m subspace (plus optional noise). -> [n, b, d]."""
    mu = torch.randn(n, 1, d, generator=gen) * 2
    w = torch.linalg.qr(torch.randn(n, d, m, generator=gen)).Q  # [n, d, m]
    coef = torch.randn(n, b, m, generator=gen) * 3
    keys = mu + coef @ w.transpose(1, 2)
    return keys + noise * torch.randn(n, b, d, generator=gen)


def exact(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q: [n, G, d], keys: [n, B, d] -> [n, G, B] float64 logits."""
    return (q.double() @ keys.double().transpose(1, 2)) / math.sqrt(q.shape[-1])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b,r,m", [(16, 8, 1), (16, 8, 5), (16, 8, 8), (16, 16, 15), (5, 4, 4), (1, 1, 1)])
def test_rank_covering_deviations_gives_exact_logits(d, b, r, m):
    gen = torch.Generator().manual_seed(1000 * d + 10 * b + m)
    m = min(m, max(b - 1, 1))  # centred deviations of b keys have rank <= b - 1
    keys = low_rank_pages(gen, 37, b, d, m)
    s = build_summaries(keys, r)
    q = torch.randn(37, 3, d, generator=gen)
    assert_close(page_logits(q, s).double(), exact(q, keys), f"logits d={d} b={b} r={r} m={m}", torch.float32)
    assert s.tau.abs().max() < 1e-3 * keys.pow(2).sum(dim=(1, 2)).max(), "tau of a covered page must be ~0"


def test_rank_equal_page_size_is_exact_for_generic_keys():
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(97, 16, 128, generator=gen)
    s = build_summaries(keys, 16)
    q = torch.randn(97, 8, 128, generator=gen)
    assert_close(page_logits(q, s).double(), exact(q, keys), "r = B", torch.float32)
    assert_close(s.tau, torch.zeros(97), "tau at r = B")


@pytest.mark.parametrize("d,r", [(64, 4), (128, 8)])
def test_basis_orthonormal_and_coef_is_projection(d, r):
    gen = torch.Generator().manual_seed(d + r)
    keys = torch.randn(37, 16, d, generator=gen) * torch.linspace(0.1, 3, d)
    s = build_summaries(keys, r)
    gram = s.basis.transpose(-1, -2) @ s.basis  # [n, r, r]
    assert_close(gram, torch.eye(r).expand_as(gram), "V^T V = I", torch.float32)
    dev = keys - keys.mean(dim=1, keepdim=True)
    assert_close(s.coef, dev @ s.basis, "coef = V^T delta (rows)", torch.float32)
    assert_close(s.mu, keys.mean(dim=1), "mu")


@pytest.mark.parametrize("m", [1, 2, 5])
def test_basis_orthonormal_on_rank_deficient_pages(m):
    """Columns are unit vectors or exactly zero (sigma ~ 0), and mutually orthogonal.

    Fails while build_summaries forms the Gram matrix in float32: its rounding noise
    (~1e-7 of the largest sigma^2) sits far above SIGMA2_FLOOR (1e-10), so noise components
    are kept and their columns D^T u / sigma have arbitrary norms.
    """
    gen = torch.Generator().manual_seed(40 + m)
    keys = low_rank_pages(gen, 97, 16, 128, m)
    s = build_summaries(keys, 8)
    norms = s.basis.norm(dim=1)  # [n, r]
    unit_or_zero = ((norms - 1).abs() < 1e-4) | (norms == 0)
    assert unit_or_zero.all(), f"column norms not in {{0, 1}}: {norms[~unit_or_zero][:5].tolist()}"
    gram = s.basis.transpose(-1, -2) @ s.basis
    expect = torch.diag_embed((norms > 0.5).float())
    assert_close(gram, expect, f"V^T V = diag(kept) for rank-{m} pages", torch.float32)
    assert (norms > 0.5).sum(dim=1).eq(m).all(), f"rank-{m} pages must keep exactly {m} columns"


@pytest.mark.parametrize("r", [2, 4, 8])
def test_tau_is_dropped_energy(r):
    gen = torch.Generator().manual_seed(r)
    keys = low_rank_pages(gen, 37, 16, 64, 6, noise=0.3)
    s = build_summaries(keys, r)
    dev = (keys - keys.mean(dim=1, keepdim=True)).double()
    sig2 = torch.linalg.svdvals(dev).pow(2)  # [n, min(B, d)] descending
    assert_close(s.tau.double(), sig2[:, r:].sum(dim=1), "tau = sum of dropped sigma^2", torch.float32)
    resid = dev - s.coef.double() @ s.basis.double().transpose(1, 2)
    assert_close(resid.pow(2).sum(dim=(1, 2)), s.tau.double(), "tau = ||D - C V^T||_F^2", torch.float32)


def degenerate_pages(d: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(d)
    one = torch.randn(d, generator=gen)
    two = torch.randn(2, d, generator=gen)
    return {
        "all_equal": one.expand(3, 16, d).clone(),
        "zero": torch.zeros(3, 16, d),
        "duplicated": two.repeat(1, 8, 1).reshape(1, 16, d).expand(3, 16, d).clone(),
        "one_distinct": torch.cat([one.expand(3, 15, d), two[:1].expand(3, 1, d)], dim=1),
    }


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["all_equal", "zero", "duplicated", "one_distinct"])
def test_rank_deficient_pages_no_nan_and_exact(d, name):
    keys = degenerate_pages(d)[name]
    q = torch.randn(3, 7, d, generator=torch.Generator().manual_seed(1))
    for r in (1, 8, 16):
        s = build_summaries(keys, r)
        for f in ("mu", "basis", "coef", "tau"):
            assert torch.isfinite(getattr(s, f)).all(), f"{name} r={r}: {f} has NaN/inf"
        assert_close(page_logits(q, s).double(), exact(q, keys), f"{name} r={r}", torch.float32)
        qs = dequantize_summaries(quantize_summaries(s, LocksConfig(rank=r, basis_bits=16 if r == 1 else 4)))
        assert torch.isfinite(page_logits(q, qs)).all(), f"{name} r={r}: quantised logits not finite"


def test_single_token_pages():
    keys = torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(3))
    s = build_summaries(keys, 1)
    assert not s.basis.any() and not s.coef.any(), "B = 1 pages have no deviation"
    q = torch.randn(5, 3, 64)
    assert_close(page_logits(q, s).double(), exact(q, keys), "B = 1", torch.float32)


def test_eigh_chunking_matches_unchunked(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    keys = low_rank_pages(gen, 97, 16, 64, 12, noise=0.1).reshape(97, 1, 16, 64)
    whole = build_summaries(keys, 8)
    monkeypatch.setattr(summary, "EIGH_CHUNK", 5)
    chunked = build_summaries(keys, 8)
    assert_close(chunked.tau, whole.tau, "tau chunked")
    recon = lambda s: s.coef @ s.basis.transpose(-1, -2)  # sign-invariant [.., B, d]
    assert_close(recon(chunked), recon(whole), "C V^T chunked")
    empty = build_summaries(torch.zeros(0, 16, 64), 8)
    assert empty.basis.shape == (0, 64, 8) and empty.tau.shape == (0,)


def test_quantised_basis_error_shrinks_with_bits():
    gen = torch.Generator().manual_seed(5)
    keys = low_rank_pages(gen, 97, 16, 128, 10, noise=0.2)
    s = build_summaries(keys, 8)
    q = torch.randn(97, 4, 128, generator=gen)
    ref = page_logits(q, s)
    basis_err, logit_err = [], []
    for bits in (2, 4, 8, 16):
        cfg = LocksConfig(basis_bits=bits, coef_bits=16, centroid_bits=16)
        d = dequantize_summaries(quantize_summaries(s, cfg))
        basis_err.append((d.basis - s.basis).abs().mean().item())
        logit_err.append((page_logits(q, d) - ref).abs().mean().item())
    pairs = lambda xs: zip(xs, xs[1:], strict=False)
    assert all(a > 1.5 * b for a, b in pairs(basis_err)), f"basis errors by bits 2/4/8/16: {basis_err}"
    assert all(a > b for a, b in pairs(logit_err)), f"logit errors by bits 2/4/8/16: {logit_err}"
    d8 = dequantize_summaries(quantize_summaries(s, LocksConfig(basis_bits=16)))  # coef/mu int8
    assert ((d8.coef - s.coef).abs() <= s.coef.abs().amax(-1, keepdim=True) / 127 * 0.51 + 1e-6).all()
    assert ((d8.mu - s.mu).abs() <= s.mu.abs().amax(-1, keepdim=True) / 127 * 0.51 + 1e-6).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_round_trip_all_codes(bits):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    per = 8 // bits
    every = torch.arange(lo, hi, dtype=torch.int8)
    codes = torch.cat([every.repeat(per), torch.randint(lo, hi, (7 * per * 3,), dtype=torch.int8)])
    codes = codes[: codes.numel() // (per * 3) * per * 3].reshape(3, -1)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, codes.shape[1] // per)
    assert torch.equal(unpack_bits(packed, bits), codes), f"{bits}-bit round trip"


def test_pack_bits_layout_low_bits_first():
    codes = torch.tensor([[1, -2, 0, -1]], dtype=torch.int8)  # int4 nibbles 0x1, 0xE, 0x0, 0xF
    assert pack_bits(codes, 4).tolist() == [[0xE1, 0xF0]]


def test_shipped_payload_is_768_bytes_and_about_a_tenth_of_kv():
    keys = torch.randn(5, 2, 16, 128, generator=torch.Generator().manual_seed(2))
    q = quantize_summaries(build_summaries(keys, 8), LocksConfig())
    assert q.payload_bytes_per_page() == 768, "512 (int4 basis) + 128 (int8 coef) + 128 (int8 centroid)"
    assert q.bytes_per_page() == 768 + 2 * 8 + 2 * 16 + 2, "fp16 scales: 8 columns, 16 rows, 1 page"
    kv_bytes = 2 * 16 * 128 * 2
    assert 0.09 < q.payload_bytes_per_page() / kv_bytes < 0.095, "payload ~9.4% of the page's K+V"
    assert 0.095 < q.bytes_per_page() / kv_bytes < 0.105, "with scales ~1/10 of the page's K+V"


@pytest.mark.parametrize("kwargs,field", [
    ({"rank": 0}, "rank"), ({"rank": 17}, "rank"), ({"page_size": 0}, "page_size"),
    ({"basis_bits": 3}, "basis_bits"), ({"coef_bits": 4}, "coef_bits"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LocksConfig(**kwargs)


def test_build_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank"):
        build_summaries(torch.zeros(2, 4, 8), 5)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_int4_basis_rows_are_in_the_cuda_kernels_fragment_order(d):
    """What score_mma.cu assumes of a stored int4 basis row: lane (c, tig) finds its codes in
    words tig * d/32 .. of row c; at step kk, byte b of word kk holds the codes of dimensions
    32 kk + 8 tig + b (low nibble) and + 4 + b (high nibble): its two mma operand registers."""
    gen = torch.Generator().manual_seed(d)
    s = build_summaries(torch.randn(3, 16, d, generator=gen), 8)
    q = quantize_summaries(s, LocksConfig())
    codes = torch.round(s.basis / q.basis_scale.float()[:, None, :]).clamp(-8, 7).to(torch.int64)  # [3, d, r]
    words = q.basis_q.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [3, r, d / 8]
    steps = d // 32
    for c in range(8):
        for tig in range(4):
            for kk in range(steps):
                word = words[:, c, tig * steps + kk]
                for b in range(4):
                    lo, hi = (word >> (8 * b)) & 0xF, (word >> (8 * b + 4)) & 0xF
                    dim = 32 * kk + 8 * tig + b
                    assert torch.equal(lo - ((lo & 8) << 1), codes[:, dim, c]), (c, tig, kk, b)
                    assert torch.equal(hi - ((hi & 8) << 1), codes[:, dim + 4, c]), (c, tig, kk, b)
    assert torch.equal(summary.basis_d_order(d, 4).sort().values, torch.arange(d))
    assert torch.equal(summary.basis_d_order(48, 4), torch.arange(48)), "d % 32 != 0: plain order"
