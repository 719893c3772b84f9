"""The Triton paged prefill attention (kernels/triton/prefill.py) vs its torch reference
(kernels/attention.py paged_prefill_ref), and the reference vs a brute-force causal softmax.

Ragged chunk and prefix lengths (a chunk that is the whole sequence, one query, lengths off the
page and block sizes), GQA groups of 1 to 16 (3 and 7 too), pages scattered in a pool of several
layers, one split and many (merged by log-sum-exp, with splits that a tile's causal bound leaves
empty). Tolerances are the pool dtype's (the kernel rounds probabilities to it before PV).
"""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.kernels import paged_prefill_ref

from tests.conftest import assert_close, triton_devices

DEVICES = triton_devices()
PAGE = 16

# (n, length, Hkv, G, d, dtype, num_splits)
CASES = [
    (1, 1, 1, 1, 16, torch.float32, None),
    (3, 3, 2, 1, 32, torch.float32, None),  # the chunk is the whole sequence
    (5, 37, 2, 3, 32, torch.float32, 2),
    (16, 300, 1, 4, 64, torch.bfloat16, None),
    (40, 130, 2, 8, 64, torch.float16, 3),
    (7, 200, 1, 16, 64, torch.bfloat16, 4),
    (33, 97, 3, 7, 64, torch.float32, 1),
    (2, 257, 4, 2, 128, torch.bfloat16, 5),  # more splits than the tile's last query reaches: empty ones
]


def case_inputs(case, device, seed: int = 0):
    """q [n, Hq, d], a pool of 3 layers x `rows` pages, the sequence's page locations (shuffled,
    fewer than rows) and the base of layer 2."""
    n, length, hkv, g, d, dtype, _ = case
    gen = torch.Generator().manual_seed(seed + n * 1000 + length)
    pages, rows, layer = -(-length // PAGE), -(-length // PAGE) + 5, 2
    pool = torch.randn(3 * rows * hkv + 3, 2, PAGE, d, generator=gen).to(dtype)
    locs = torch.randperm(rows, generator=gen)[:pages]
    q = torch.randn(n, hkv * g, d, generator=gen).to(dtype)
    return q.to(device), pool.to(device), locs.to(device), layer * rows


def brute_force(q, pool, locs, base, hkv, length):
    """One query, one head at a time: softmax over the keys its position sees."""
    n, hq, d = q.shape
    g = hq // hkv
    o, lse = torch.zeros(n, hq, d), torch.zeros(n, hq)
    for i in range(n):
        pos = length - n + i
        for head in range(hq):
            h = head // g
            slots = [(base + int(locs[t // PAGE])) * hkv + h for t in range(pos + 1)]
            keys = torch.stack([pool[slot, 0, t % PAGE] for t, slot in enumerate(slots)])
            vals = torch.stack([pool[slot, 1, t % PAGE] for t, slot in enumerate(slots)])
            logits = keys.double() @ q[i, head].double() / math.sqrt(d)
            lse[i, head] = torch.logsumexp(logits, 0).float()
            o[i, head] = (torch.softmax(logits, 0) @ vals.double()).float()
    return o, lse


@pytest.mark.parametrize("case", CASES[:5], ids=str)
def test_reference_is_causal_softmax_over_the_pages(case):
    q, pool, locs, base = case_inputs(case, "cpu")
    q, pool = q.float(), pool.float()
    o, lse = paged_prefill_ref(q, pool, locs, base, case[2], case[1])
    want_o, want_lse = brute_force(q, pool, locs, base, case[2], case[1])
    assert_close(o, want_o, "o")
    assert_close(lse, want_lse, "lse")


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_equals_the_reference(device, case):
    from lockserve.kernels.triton import paged_prefill_triton

    n, length, hkv, *_ = case
    q, pool, locs, base = case_inputs(case, device)
    o, lse = paged_prefill_triton(q, pool, locs, base, hkv, length, num_splits=case[-1])
    want_o, want_lse = paged_prefill_ref(q, pool, locs, base, hkv, length)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:2]
    assert_close(o.float(), want_o, f"o, case {case}", dtype=pool.dtype)
    assert_close(lse, want_lse, f"lse, case {case}", dtype=pool.dtype)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
def test_int32_locs_and_a_strided_pool_view(device):
    """int32 page locations, and the pool a view behind a front of other rows (the engine's write
    pool sits behind the hot cache's rows in one tensor)."""
    from lockserve.kernels.triton import paged_prefill_triton

    case = (9, 90, 2, 4, 32, torch.float32, 2)
    q, pool, locs, base = case_inputs(case, device)
    front = torch.zeros(11, *pool.shape[1:], dtype=pool.dtype, device=device)
    view = torch.cat([front, pool])[11:]
    o, lse = paged_prefill_triton(q, view, locs.to(torch.int32), base, 2, 90, num_splits=case[-1])
    want_o, want_lse = paged_prefill_ref(q, pool, locs, base, 2, 90)
    assert_close(o, want_o, "o")
    assert_close(lse, want_lse, "lse")


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("device", DEVICES)
def test_launcher_names_what_is_wrong(device):
    from lockserve.kernels.triton import paged_prefill_triton

    q, pool, locs, base = case_inputs((4, 40, 2, 2, 32, torch.float32, None), device)
    with pytest.raises(ValueError, match=r"query heads Hq \(4\) must be a multiple of num_kv_heads \(3\)"):
        paged_prefill_triton(q, pool, locs, base, 3, 40)
    with pytest.raises(ValueError, match=r"queries n \(4\) must be in \[1, length \(3\)\]"):
        paged_prefill_triton(q, pool, locs, base, 2, 3)
    with pytest.raises(ValueError, match=r"locs: 3 pages of 16 tokens hold fewer than length \(49\)"):
        paged_prefill_triton(q, pool, locs, base, 2, 49)
    with pytest.raises(ValueError, match=r"num_splits \(0\) must be in \[1, 256\]"):
        paged_prefill_triton(q, pool, locs, base, 2, 40, num_splits=0)
    with pytest.raises(ValueError, match=r"pool"):
        paged_prefill_triton(q, pool[..., :16], locs, base, 2, 40)


@pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
@pytest.mark.parametrize("device", DEVICES)
def test_a_query_row_has_the_same_bits_in_any_chunk(device):
    """The last 16 queries of a 48-query chunk, and a chunk of only those 16 (a warm request's tail
    against the cold request's last chunk): other tile sizes, the same splits, identical outputs.
    On the GPU bit for bit. The interpreter runs `tl.dot` through numpy's matmul, whose BLAS picks
    its kernel by the matrix's shape and the CPU's instruction set: on one machine (AMD EPYC, AVX2)
    two rows' float32 LSE differed in their last bit between the two tile sizes, where an earlier
    machine gave equal bits; so the CPU allows one float32 ulp on the LSE, one bf16 ulp on the output."""
    from lockserve.kernels import ops

    q, pool, locs, base = case_inputs((48, 3000, 2, 4, 64, torch.bfloat16, None), device)
    whole, whole_lse = ops.paged_prefill(q, pool, locs, base, 2, 3000, backend="triton")
    tail, tail_lse = ops.paged_prefill(q[-16:], pool, locs, base, 2, 3000, backend="triton")
    if device != "cpu":
        assert torch.equal(tail, whole[-16:]) and torch.equal(tail_lse, whole_lse[-16:])
        return
    ulp = lambda t: torch.finfo(t.dtype).eps * t.float().abs()  # noqa: E731 (one unit in the last place)
    assert bool(((tail_lse - whole_lse[-16:]).abs() <= ulp(whole_lse[-16:])).all())
    assert bool(((tail.float() - whole[-16:].float()).abs() <= ulp(whole[-16:])).all())
