"""Triton sparse paged decode attention vs the torch reference (sparse_decode_ref, attention_ref).

Selections have padding (-1 slots), partial pages, empty rows; groups are not powers of two;
the split-K merge runs with 1, 2, 3, 150 (three steps of its loop) and automatic splits. The
kernel rounds probabilities to the pool dtype before PV (as flash attention does), so tolerances
are the pool dtype's.
"""

from __future__ import annotations

import math

import pytest
import torch
from lockserve.kernels import attention_ref, sparse_decode_ref
from lockserve.kernels.triton import AttentionTuning, sparse_decode_triton
from lockserve.kernels.triton.attention import VIEW_IDS_MAX_PAGES, int32_ids

from tests.conftest import assert_close, triton_devices

DEVICES = triton_devices()
pytestmark = [
    pytest.mark.skipif(not DEVICES, reason="needs CUDA or TRITON_INTERPRET=1"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]
PAGE = 16

# (Bt, Hkv, G, d, K, pool dtype, q dtype, num_splits, slot dtype)
CASES = [
    (1, 1, 1, 64, 1, torch.float32, torch.float32, None, torch.int32),
    (3, 2, 3, 64, 5, torch.bfloat16, torch.bfloat16, None, torch.int64),
    (3, 1, 7, 128, 9, torch.float16, torch.float32, 3, torch.int32),
    (2, 2, 8, 128, 13, torch.bfloat16, torch.bfloat16, 2, torch.int64),
    (5, 1, 4, 64, 6, torch.float32, torch.bfloat16, 1, torch.int32),
    # The engine's case (SmolLM2 shapes): int64 ids whose strides are multiples of 16; Triton 3.6
    # failed to compile the kernel for it on sm_90 until the launcher narrowed ids to int32.
    (1, 3, 3, 64, 32, torch.bfloat16, torch.bfloat16, None, torch.int64),
]


def make_selection(bt: int, hkv: int, k: int, num_slots: int, gen: torch.Generator, slot_dtype):
    """slots [Bt, Hkv, K] (distinct per row, -1 padding at the end), page_lens [Bt, Hkv, K]
    (full pages, a partial last page, 0 for padding). Row (min(1, Bt-1), 0) selects nothing."""
    perms = [torch.randperm(num_slots, generator=gen)[:k] for _ in range(bt * hkv)]
    slots = torch.stack(perms).view(bt, hkv, k)
    used = torch.randint(1, k + 1, (bt, hkv), generator=gen)
    used[min(1, bt - 1), 0] = 0
    pos = torch.arange(k)[None, None, :]
    lens = torch.full((bt, hkv, k), PAGE, dtype=torch.int32)
    last = torch.randint(1, PAGE + 1, (bt, hkv, 1), generator=gen, dtype=torch.int32)
    lens = torch.where(pos == used[..., None] - 1, last, lens)
    lens = torch.where(pos < used[..., None], lens, torch.zeros_like(lens))
    slots = torch.where(pos < used[..., None], slots, torch.full_like(slots, -1))
    return slots.to(slot_dtype), lens


def case_inputs(case, device: str, seed: int):
    bt, hkv, g, d, k, pool_dtype, q_dtype, _, slot_dtype = case
    gen = torch.Generator().manual_seed(seed)
    num_slots = 2 * k + 11
    pool = (torch.randn(num_slots, 2, PAGE, d, generator=gen) * 1.5).to(pool_dtype)
    q = (torch.randn(bt, hkv * g, d, generator=gen) * 1.5).to(q_dtype)
    slots, lens = make_selection(bt, hkv, k, num_slots, gen, slot_dtype)
    return q.to(device), pool.to(device), slots.to(device), lens.to(device)


def assert_attention(o, lse, ro, rl, dtype, what: str) -> None:
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite), f"{what}: lse finite pattern differs"
    assert_close(lse[finite], rl[finite], f"{what}: lse", dtype=dtype)
    assert_close(o, ro, f"{what}: o", dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Bt{c[0]}-Hkv{c[1]}-G{c[2]}-d{c[3]}-K{c[4]}-s{c[7]}")
def test_sparse_decode_matches_reference(case, device):
    q, pool, slots, lens = case_inputs(case, device, seed=17)
    bt, hq, d = q.shape
    nan = float("nan")
    out = (torch.full((bt, hq, d), nan, device=device), torch.full((bt, hq), nan, device=device))
    tuning = AttentionTuning(pages=2, num_splits=case[7])
    o, lse = sparse_decode_triton(q, pool, slots, lens, tuning=tuning, out=out)
    assert o.data_ptr() == out[0].data_ptr() and lse.data_ptr() == out[1].data_ptr()
    ro, rl = sparse_decode_ref(q, pool, slots, lens)
    assert_attention(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), case[5], f"{case}")
    empty = slice(min(1, bt - 1), min(1, bt - 1) + 1)
    assert torch.all(o[empty, : hq // slots.shape[1]] == 0), "empty selection must give o = 0"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "merged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_out_dtype_is_the_float32_result_rounded_once(device, splits, dtype):
    """o in the model's dtype is cast in the store (the attention kernel's with one split, the
    merge's otherwise): the same bits as the float32 result cast afterwards, lse unchanged."""
    q, pool, slots, lens = case_inputs(CASES[3], device, seed=23)
    tuning = AttentionTuning(pages=2, num_splits=splits)
    o32, lse32 = sparse_decode_triton(q, pool, slots, lens, tuning=tuning)
    o, lse = sparse_decode_triton(q, pool, slots, lens, tuning=tuning, out_dtype=dtype)
    assert o.dtype == dtype and lse.dtype == torch.float32 and torch.equal(lse, lse32)
    if device == "cpu" and dtype == torch.bfloat16:
        # The interpreter truncates float32 -> bf16 (triton/runtime/interpreter.py, _convert_float);
        # a GPU rounds to nearest even. Within one bf16 step of the float32 result:
        assert torch.all((o.float() - o32).abs() <= o32.abs() * 2.0**-7), "more than one bf16 step off"
        return
    assert torch.equal(o, o32.to(dtype))


def test_int32_ids_reads_int64_ids_in_place():
    ids = torch.tensor([[[5, -1, 2**31 - 1], [0, 7, -1]]], dtype=torch.int64)  # [1, 2, 3]
    got = int32_ids(ids)
    assert got.dtype == torch.int32 and torch.equal(got, ids.to(torch.int32))
    assert got.untyped_storage().data_ptr() == ids.untyped_storage().data_ptr(), "a view, not a copy"
    strided = ids.transpose(1, 2)  # last dimension not contiguous: cast
    assert torch.equal(int32_ids(strided), strided.to(torch.int32))
    assert int32_ids(ids[..., :0]).shape == (1, 2, 0)
    long = torch.arange(VIEW_IDS_MAX_PAGES + 1, dtype=torch.int64)[None]  # a long dense row: cast
    got = int32_ids(long)
    assert torch.equal(got, long.to(torch.int32)) and got.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_more_splits_than_one_merge_step(device):
    """150 splits of 2 full pages each: the merge's loop takes 64 at a time (three steps), and
    every step holds pages, so a lost or doubled step changes o and lse."""
    gen = torch.Generator().manual_seed(5)
    k, d = 300, 64
    pool = torch.randn(k + 7, 2, PAGE, d, generator=gen).to(torch.bfloat16)
    q = (torch.randn(1, 2, d, generator=gen) * 2).to(torch.bfloat16)
    slots = torch.randperm(k + 7, generator=gen)[:k].view(1, 1, k)
    lens = torch.full((1, 1, k), PAGE, dtype=torch.int32)
    lens[0, 0, -1] = 5
    q, pool, slots, lens = (t.to(device) for t in (q, pool, slots, lens))
    o, lse = sparse_decode_triton(q, pool, slots, lens, tuning=AttentionTuning(pages=2, num_splits=150))
    ro, rl = sparse_decode_ref(q, pool, slots, lens)
    assert_attention(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), torch.bfloat16, "150 splits")


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_decode_scale_and_default_tuning(device):
    q, pool, slots, lens = case_inputs(CASES[1], device, seed=4)
    o, lse = sparse_decode_triton(q, pool, slots, lens, scale=0.3)
    ro, rl = sparse_decode_ref(q, pool, slots, lens, scale=0.3)
    assert_attention(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), torch.bfloat16, "scale 0.3")


@pytest.mark.parametrize("device", DEVICES)
def test_full_selection_equals_dense_attention(device):
    """Selecting every page of a sequence (the last one partial) is dense attention."""
    hkv, g, d, t = 2, 3, 64, 5 * PAGE + 7
    gen = torch.Generator().manual_seed(8)
    keys, values = torch.randn(t, hkv, d, generator=gen), torch.randn(t, hkv, d, generator=gen)
    q = torch.randn(hkv * g, d, generator=gen)
    n_pages = math.ceil(t / PAGE)
    pad = n_pages * PAGE - t
    kv = torch.stack([keys, values])  # [2, T, Hkv, d]
    kv = torch.cat([kv, kv.new_zeros(2, pad, hkv, d)], dim=1).view(2, n_pages, PAGE, hkv, d)
    pool = kv.permute(3, 1, 0, 2, 4).reshape(hkv * n_pages, 2, PAGE, d)  # slot = h * n_pages + j
    slots = (torch.arange(hkv)[:, None] * n_pages + torch.arange(n_pages)[None, :])[None]
    lens = torch.full((1, hkv, n_pages), PAGE, dtype=torch.int32)
    lens[..., -1] = PAGE - pad
    o, lse = sparse_decode_triton(q[None].to(device), pool.to(device), slots.to(device), lens.to(device))
    ro, rl = attention_ref(q, keys, values)
    assert_attention(o[0].cpu(), lse[0].cpu(), ro, rl, torch.float32, "full selection vs dense")


def test_sparse_decode_rejects_bad_arguments():
    dev = DEVICES[0]
    q, pool, slots, lens = case_inputs(CASES[1], dev, seed=2)
    msg = r"slots: expected int32/int64 \[Bt, Hkv, K\] with Bt=3, got \(3, 2, 5\) int16"
    with pytest.raises(ValueError, match=msg):
        sparse_decode_triton(q, pool, slots.to(torch.int16), lens)
    msg = r"pool: expected .* \[S, 2, B, d\] with 2=2, d=64, got \(21, 2, 16, 32\) bfloat16"
    with pytest.raises(ValueError, match=msg):
        sparse_decode_triton(q, pool[..., :32], slots, lens)
    msg = r"page_lens: expected int32/int64 \[Bt, Hkv, K\] with Bt=3, Hkv=2, K=5"
    with pytest.raises(ValueError, match=msg):
        sparse_decode_triton(q, pool, slots, lens[..., :4])
    with pytest.raises(ValueError, match=r"num_splits \(0\) must be in \[1, 256\]"):
        sparse_decode_triton(q, pool, slots, lens, tuning=AttentionTuning(num_splits=0))


@pytest.mark.gpu
def test_sparse_decode_serving_shapes_on_gpu():
    """Llama-3.1-8B geometry at a 2,048-token budget, batch 16, bf16, automatic splits."""
    case = (16, 8, 4, 128, 128, torch.bfloat16, torch.bfloat16, None, torch.int32)
    q, pool, slots, lens = case_inputs(case, "cuda", seed=5)
    o, lse = sparse_decode_triton(q, pool, slots, lens)
    ro, rl = sparse_decode_ref(q, pool, slots, lens)
    assert_attention(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), torch.bfloat16, "serving shapes")


@pytest.mark.gpu
def test_sparse_decode_pool_beyond_int32_offsets():
    """Pool of > 2^31 elements (4.3 GB of bf16); selected slots sit near its end."""
    d, hkv, g, k = 128, 2, 4, 12
    num_slots = (1 << 31) // (2 * PAGE * d) + 1024
    pool = torch.empty(num_slots, 2, PAGE, d, dtype=torch.bfloat16, device="cuda")
    assert pool.numel() > 2**31
    gen = torch.Generator().manual_seed(6)
    slots, lens = make_selection(2, hkv, k, 1000, gen, torch.int64)
    slots = torch.where(slots >= 0, num_slots - 1 - slots, slots).cuda()
    used = slots[slots >= 0].unique()
    pool[0].zero_()  # the reference gathers slot 0 for padding (then masks it): keep it finite
    pool[used] = torch.randn(len(used), 2, PAGE, d, device="cuda").to(torch.bfloat16)
    q = torch.randn(2, hkv * g, d, device="cuda", dtype=torch.bfloat16)
    o, lse = sparse_decode_triton(q, pool, slots, lens.cuda())
    ro, rl = sparse_decode_ref(q, pool, slots, lens.cuda())
    assert_attention(o.cpu(), lse.cpu(), ro.cpu(), rl.cpu(), torch.bfloat16, "pool past 2^31 elements")
