"""Fused decode-step ops: the torch references against the model code they replace (bit for bit),
the Triton kernels against the references, dispatch, and argument checks.

Awkward sizes: T in {1, 3, 17}; H in {100, 576, 4096}; (Hq, Hkv, d) in {(9, 3, 64), (32, 8, 128),
(4, 4, 32)}. rope_write and the residual sum are bit-exact on every path (the kernels round
where the reference rounds and compile without FMA contraction); RMSNorm's y differs by the order
of the float32 sum of squares and silu_mul by rounding once (the reference rounds silu(gate)
first), so those compare with the output dtype's tolerance.
"""

from __future__ import annotations

import os

import pytest
import torch
from lockserve.kernels import add_rms_norm_ref, ops, rope_write_ref, rotate_half_ref, silu_mul_ref
from lockserve.kernels.triton import add_rms_norm_triton, rope_write_triton, silu_mul_triton
from lockserve.workers.model.layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rotary

from tests.conftest import assert_close, triton_devices

DEVICES = triton_devices()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
EPS = 1e-5
PAGE = 16
SENTINEL = 0xA5  # every byte of a poisoned pool


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def norm_inputs(t: int, h: int, dtype, device, seed: int):
    """x, residual [T, H] (x's rows strided: a slice of a wider tensor), weight [H]."""
    g = _gen(seed)
    x = (torch.randn(t, h + 7, generator=g) * 3)[:, :h].to(dtype)
    residual = torch.randn(t, h, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    return x.to(device), residual.to(device), weight.to(device)


def rope_tables(t: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, d/2] float32 from the model's RotaryEmbedding at scattered positions."""
    positions = torch.randint(0, 40_000, (t,), generator=_gen(seed))
    return RotaryEmbedding(d, 500_000.0, None)(positions)  # [T, d/2] each


def poisoned_pool(slots: int, d: int, dtype, device) -> torch.Tensor:
    """pool [S, 2, PAGE, d] whose every byte is SENTINEL."""
    size = torch.finfo(dtype).bits // 8
    raw = torch.full((slots, 2, PAGE, d * size), SENTINEL, dtype=torch.uint8, device=device)
    return raw.view(dtype)


def write_targets(t: int, pages: int, pad: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """write_loc, write_off [T] int64: distinct (page, offset) per token, -1 at `pad` rows."""
    cells = torch.randperm(pages * PAGE, generator=_gen(seed))[:t]
    loc, off = cells // PAGE, cells % PAGE
    loc[pad] = -1
    return loc, off


def written_mask(pool, loc, off, hkv: int, row_base: int) -> torch.Tensor:
    """[S, 2, PAGE] True where rope_write must write (from the contract, not the code)."""
    mask = torch.zeros(pool.shape[:3], dtype=torch.bool)
    for loc_t, off_t in zip(loc.tolist(), off.tolist(), strict=True):
        if loc_t >= 0:
            slots = (row_base + loc_t) * hkv + torch.arange(hkv)
            mask[slots, :, off_t] = True
    return mask


def pool_bytes(pool: torch.Tensor) -> torch.Tensor:
    return pool.cpu().view(torch.uint8)  # [S, 2, PAGE, d * element size]


# --- references against the formulas they replace -----------------------------------------------
# The model's layers now call these ops, so the references are checked against the Hugging Face
# formulas written out here (what workers/model/layers.py computed before the ops existed).


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("h", [100, 576])
def test_add_rms_norm_ref_is_the_hf_rmsnorm(dtype, h):
    x, residual, weight = norm_inputs(17, h, dtype, "cpu", seed=1)
    y, new_res = add_rms_norm_ref(x, residual, weight, EPS)
    assert torch.equal(new_res, x + residual), "new_residual must be exactly x + residual"
    assert torch.equal(y, hf_rms_norm(x + residual, weight)), "y must be exactly RMSNorm(x + residual)"
    y0, res0 = add_rms_norm_ref(x, None, weight, EPS)
    assert res0 is x, "without a residual, new_residual is x itself"
    assert torch.equal(y0, hf_rms_norm(x, weight)), "y must be exactly RMSNorm(x)"
    norm = RMSNorm(h, EPS, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(norm(x, residual)[0], y), "the model's RMSNorm is this op"


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32)], ids=lambda h: f"Hq{h[0]}-Hkv{h[1]}-d{h[2]}")
@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=["bf16", "fp32-into-bf16"])
def test_rope_write_ref_is_rotary_then_index_put(heads, dtypes):
    """q and the pool equal apply_rotary + the index_put writes of the paged cache (no padding)."""
    hq, hkv, d = heads
    t, layer, rows = 17, 2, 3
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=_gen(3)).to(dtypes[0])
    cos, sin = rope_tables(t, d, seed=4)
    loc, off = write_targets(t, rows, [], seed=5)
    pool = poisoned_pool((layer + 1) * rows * hkv, d, dtypes[1], "cpu")
    expected_pool = pool.clone()
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    rot_q = apply_rotary(q.view(t, hq, d), cos[:, None], sin[:, None])
    rot_k = apply_rotary(k.view(t, hkv, d), cos[:, None], sin[:, None])
    slots = (layer * rows + loc.long())[:, None] * hkv + torch.arange(hkv)  # [T, Hkv]
    expected_pool[slots, 0, off.long()[:, None]] = rot_k.to(dtypes[1])
    expected_pool[slots, 1, off.long()[:, None]] = v.view(t, hkv, d).to(dtypes[1])
    got_q = rope_write_ref(qkv, cos, sin, hq, hkv, pool, loc, off, layer * rows)
    assert torch.equal(got_q, rot_q), "q_rot must be exactly apply_rotary(q)"
    assert torch.equal(pool_bytes(pool), pool_bytes(expected_pool)), "pool must be exactly the index_put's"
    assert torch.equal(rotate_half_ref(q.view(t, hq, d), cos[:, None], sin[:, None]), rot_q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_mul_ref_is_silu_times_up(dtype):
    gate_up = torch.randn(17, 200, generator=_gen(7)).to(dtype)
    gate, up = gate_up.split(100, dim=-1)
    assert torch.equal(silu_mul_ref(gate_up), torch.nn.functional.silu(gate) * up)
    mlp = SwiGLU(48, 100, dtype=dtype)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2, generator=_gen(6))
    x = torch.randn(17, 48, generator=_gen(7)).to(dtype)
    with torch.no_grad():
        h = mlp.gate_up_proj(x)
        want = mlp.down_proj(torch.nn.functional.silu(h[:, :100]) * h[:, 100:])
        assert torch.equal(mlp(x), want), "the model's SwiGLU is down(silu(gate) * up)"


# --- Triton against the references -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("h", [576, 4096, 100])
@pytest.mark.parametrize("t", [1, 3, 17])
def test_add_rms_norm_triton_matches_reference(t, h, dtype, device):
    x, residual, weight = norm_inputs(t, h, dtype, device, seed=10 + t)
    ref_y, ref_res = add_rms_norm_ref(x, residual, weight, EPS)
    y_out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    y, new_res = add_rms_norm_triton(x, residual, weight, EPS, y_out=y_out)
    assert y is y_out
    assert torch.equal(new_res, ref_res), "new_residual must be exactly x + residual"
    assert_close(y, ref_y, f"y T={t} H={h}")
    y0, res0 = add_rms_norm_triton(x, None, weight, EPS)
    assert res0 is x
    assert_close(y0, add_rms_norm_ref(x, None, weight, EPS)[0], f"y without residual T={t} H={h}")


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_triton_updates_residual_in_place(device):
    x, residual, weight = norm_inputs(3, 576, torch.bfloat16, device, seed=20)
    ref_y, ref_res = add_rms_norm_ref(x, residual, weight, EPS)
    y, new_res = add_rms_norm_triton(x, residual, weight, EPS, residual_out=residual)
    assert new_res is residual and torch.equal(residual, ref_res)
    assert_close(y, ref_y, "y with the residual updated in place")
    copy = torch.empty_like(residual)
    _, res0 = add_rms_norm_triton(x, None, weight, EPS, residual_out=copy)
    assert res0 is copy and torch.equal(copy, x), "no residual: x is copied into residual_out"


# (Hq, Hkv, d), T, qkv dtype, pool dtype, index dtype, padding rows, row_base (in pages)
ROPE_CASES = [
    ((9, 3, 64), 17, torch.float32, torch.float32, torch.int32, [0, 5, 16], 3),
    ((9, 3, 64), 3, torch.bfloat16, torch.bfloat16, torch.int64, [1], 0),
    ((32, 8, 128), 17, torch.bfloat16, torch.bfloat16, torch.int32, [2, 3], 5),
    ((32, 8, 128), 1, torch.float32, torch.bfloat16, torch.int64, [], 7),
    ((4, 4, 32), 17, torch.float32, torch.bfloat16, torch.int64, [4, 9, 10, 11], 2),
    ((4, 4, 32), 3, torch.bfloat16, torch.float32, torch.int32, [], 1),
    ((4, 4, 32), 1, torch.bfloat16, torch.bfloat16, torch.int64, [0], 1),  # nothing written
]


def _rope_id(case) -> str:
    (hq, hkv, d), t, qd, pd, idx, pad, base = case
    names = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}
    return f"Hq{hq}-Hkv{hkv}-d{d}-T{t}-{names[qd]}-pool{names[pd]}-{names[idx]}-pad{len(pad)}-base{base}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ROPE_CASES, ids=_rope_id)
def test_rope_write_triton_matches_reference(case, device):
    (hq, hkv, d), t, qkv_dtype, pool_dtype, idx_dtype, pad, base_pages = case
    pages = t + 2
    row_base = base_pages * pages  # a few layers below this one
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=_gen(30 + t)) * 2).to(qkv_dtype).to(device)
    cos, sin = (c.to(device) for c in rope_tables(t, d, seed=31))
    loc, off = write_targets(t, pages, pad, seed=32)
    pool = poisoned_pool((row_base + pages + 1) * hkv, d, pool_dtype, device)
    ref_pool = pool.clone()
    ref_q = rope_write_ref(qkv, cos, sin, hq, hkv, ref_pool, loc.to(device), off.to(device), row_base)
    out = torch.full((t, hq, d), float("nan"), dtype=qkv_dtype, device=device)
    q = rope_write_triton(qkv, cos, sin, hq, hkv, pool, loc.to(idx_dtype).to(device),
                          off.to(idx_dtype).to(device), row_base, out=out)
    assert q is out and torch.equal(q, ref_q), "q_rot must be bit-exact"
    got, want = pool_bytes(pool), pool_bytes(ref_pool)
    written = written_mask(pool, loc, off, hkv, row_base)
    assert torch.equal(got[written], want[written]), "written k / v rows must be bit-exact"
    assert bool((got[~written] == SENTINEL).all()), "rows not written (padding, others) must be untouched"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 100), (3, 576), (17, 1500)], ids=lambda s: f"T{s[0]}-I{s[1]}")
def test_silu_mul_triton_matches_reference(shape, dtype, device):
    t, inter = shape
    gate_up = (torch.randn(t, 2 * inter + 5, generator=_gen(40)) * 3)[:, : 2 * inter].to(dtype).to(device)
    out = torch.full((t, inter), float("nan"), dtype=dtype, device=device)
    y = silu_mul_triton(gate_up, out=out)
    assert y is out
    assert_close(y, silu_mul_ref(gate_up), f"silu_mul T={t} I={inter}")


# --- dispatch ---------------------------------------------------------------------------------


def _kernel_backend(device) -> str:
    return "triton" if (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") else "torch"


def test_ops_dispatch_matches_references(device):
    backend = _kernel_backend(device)
    x, residual, weight = norm_inputs(3, 100, torch.bfloat16, device, seed=50)
    ref_y, ref_res = add_rms_norm_ref(x, residual, weight, EPS)
    for b in ("auto", "torch", backend):
        y, res = ops.add_rms_norm(x, residual, weight, EPS, backend=b)
        assert torch.equal(res, ref_res), b
        assert_close(y, ref_y, f"ops.add_rms_norm backend={b}")
        gu = torch.cat([x, residual], dim=-1)
        assert_close(ops.silu_mul(gu, backend=b), silu_mul_ref(gu), f"ops.silu_mul backend={b}")
    qkv = torch.randn(3, 15 * 32, generator=_gen(51)).to(device)
    cos, sin = (c.to(device) for c in rope_tables(3, 32, seed=52))
    loc, off = (i.to(device) for i in write_targets(3, 2, [1], seed=53))
    ref_pool = poisoned_pool(2 * 3, 32, torch.float32, device)
    ref_q = rope_write_ref(qkv, cos, sin, 9, 3, ref_pool, loc, off, 0)
    for b in ("auto", "torch", backend):
        pool = poisoned_pool(2 * 3, 32, torch.float32, device)
        q = ops.rope_write(qkv, cos, sin, 9, 3, pool, loc, off, 0, backend=b)
        assert torch.equal(q, ref_q) and torch.equal(pool_bytes(pool), pool_bytes(ref_pool)), b


# --- argument checks --------------------------------------------------------------------------


def test_add_rms_norm_rejects_bad_inputs():
    x, residual, weight = norm_inputs(3, 100, torch.float32, "cpu", seed=60)
    cases = [
        (dict(residual=residual.half()),
         r"residual: expected float32 \[T, H\] with T=3, H=100, got \(3, 100\) float16"),
        (dict(weight=weight[:99]), r"weight: expected float32 \[H\] with H=100, got \(99,\)"),
        (dict(x=x[None]), r"x: expected float32/bfloat16/float16 \[T, H\], got \(1, 3, 100\)"),
        (dict(x=x.t().contiguous().t()), r"x: expected unit stride in the last dim"),
        (dict(y_out=torch.empty(100, 3).t()), r"y_out: expected a contiguous float32 \(3, 100\)"),
        (dict(residual_out=torch.empty(3, 100, dtype=torch.float16)), r"residual_out: expected .* float32"),
        (dict(weight=weight.to("meta")), r"weight: expected a tensor on cpu .*, got meta"),
        (dict(y_out=residual, residual_out=residual), r"y_out: must not be the same buffer as residual_out"),
    ]
    for change, msg in cases:
        a = dict(x=x, residual=residual, weight=weight, y_out=None, residual_out=None) | change
        for fn in (add_rms_norm_triton, ops.add_rms_norm):
            with pytest.raises(ValueError, match=msg):
                fn(a["x"], a["residual"], a["weight"], EPS, y_out=a["y_out"], residual_out=a["residual_out"])


def test_rope_write_rejects_bad_inputs():
    qkv = torch.randn(3, 15 * 32)
    cos, sin = rope_tables(3, 32, seed=61)
    loc, off = write_targets(3, 2, [], seed=62)
    pool = torch.zeros(6, 2, PAGE, 32)
    good = dict(qkv=qkv, cos=cos, sin=sin, num_heads=9, num_kv_heads=3, pool=pool, write_loc=loc,
                write_off=off, row_base=0)
    cases = [
        (dict(num_heads=8), r"qkv: expected \[T, \(Hq \+ 2 Hkv\) d\] = \[T, 448\] with Hq=8, Hkv=3, d=32"),
        (dict(cos=cos[:, :8]), r"cos: expected float32 \[T, d/2\] with T=3, d/2=16, got \(3, 8\)"),
        (dict(sin=sin.double()), r"sin: expected float32 \[T, d/2\] .* float64"),
        (dict(pool=pool[:, :1]), r"pool: expected .* \[S, 2, B, d\] with 2=2, got \(6, 1, 16, 32\)"),
        (dict(pool=pool.to(torch.int32)), r"pool: expected float32/bfloat16/float16 .* int32"),
        (dict(write_loc=loc.to(torch.int16)), r"write_loc: expected int32/int64 \[T\] with T=3, got .*int16"),
        (dict(write_off=off[:2]), r"write_off: expected int32/int64 \[T\] with T=3, got \(2,\)"),
        (dict(row_base=-1), r"row_base \(-1\) must be >= 0"),
        (dict(row_base=2), r"row_base \(2\) must be >= 0 and its slots inside pool \(S=6\)"),
        (dict(write_off=off.to("meta")), r"write_off: expected a tensor on cpu .*, got meta"),
    ]
    for change, msg in cases:
        args = good | change
        for fn in (rope_write_triton, ops.rope_write):
            with pytest.raises(ValueError, match=msg):
                fn(**args)
    with pytest.raises(ValueError, match=r"out: expected a contiguous float32 \(3, 9, 32\)"):
        rope_write_triton(**good, out=torch.empty(3, 9, 32, dtype=torch.bfloat16))


def test_silu_mul_rejects_bad_inputs():
    for fn in (silu_mul_triton, ops.silu_mul):
        with pytest.raises(ValueError, match=r"gate_up: expected an even last dim 2I, got \(3, 7\)"):
            fn(torch.randn(3, 7))
        with pytest.raises(ValueError, match=r"gate_up: expected float32/bfloat16/float16 \[T, 2I\]"):
            fn(torch.randn(3, 8, dtype=torch.float64))
        msg = r"out: expected a contiguous float32 \(3, 4\) on cpu, got \(3, 5\)"
        with pytest.raises(ValueError, match=msg):
            fn(torch.randn(3, 8), out=torch.empty(3, 5))


# --- GPU only ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_rope_write_offsets_past_int32_on_gpu():
    """A bf16 pool of just over 2^32 elements (8 GiB), written at its last slots: their offsets
    need int64 (int32 maths would wrap them to the low slots, which must stay untouched)."""
    hq, hkv, d = 8, 2, 128
    page_elems = 2 * PAGE * d
    slots = 2**32 // page_elems + 2 * hkv
    pool = torch.zeros(slots, 2, PAGE, d, dtype=torch.bfloat16, device="cuda")
    qkv = torch.randn(2, (hq + 2 * hkv) * d, device="cuda", dtype=torch.bfloat16)
    cos, sin = (c.cuda() for c in rope_tables(2, d, seed=70))
    row_base = slots // hkv - 2  # this layer's rows end at the pool's end
    loc = torch.tensor([1, -1], device="cuda")
    off = torch.tensor([PAGE - 1, 0], device="cuda")
    q = rope_write_triton(qkv, cos, sin, hq, hkv, pool, loc, off, row_base)
    assert torch.equal(q, rotate_half_ref(qkv[:, : hq * d].view(2, hq, d), cos[:, None], sin[:, None]))
    k = rotate_half_ref(qkv[:1, hq * d : (hq + hkv) * d].view(1, hkv, d), cos[:1, None], sin[:1, None])
    top = (row_base + 1) * hkv
    assert torch.equal(pool[top : top + hkv, 0, PAGE - 1], k[0]), "k at the pool's last slots"
    assert torch.equal(pool[top : top + hkv, 1, PAGE - 1], qkv[0, (hq + hkv) * d :].view(hkv, d))
    assert int(pool.count_nonzero()) == int(k.count_nonzero() + qkv[0, (hq + hkv) * d :].count_nonzero()), (
        "nothing written anywhere else (int32 offsets would wrap to the low slots)"
    )
