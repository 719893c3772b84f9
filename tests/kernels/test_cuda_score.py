"""The tensor-core CUDA score kernel (kernels/cuda/score_mma.cu) vs the torch reference.

It reads only the shipped summary format (B 16, r 8, int4 basis, int8 coef / mu, fp16 scales)
with bf16 or fp16 q and G <= 16, so the cases vary what it does read: G = 1, 3, 4, 7, 8 (one
head row per lane) and 9, 12, 16 (two: GLM-4-9B has Hkv 2, G 16, d 128), d = 32, 64, 96 and 128,
page counts off its 8-page stages, ragged rows (an empty one) with garbage ids past num_pages,
both q dtypes, int32 and int64 page tables. Everything else must be refused with the reason, and
the dispatch (kernels/ops.py) must send it to Triton. The GPU cases run on the lent H200;
test_cuda_emulated.py runs the kernel's source on the CPU.
"""

from __future__ import annotations

import pytest
import torch
from lockserve.kernels import group_scores, ops
from lockserve.kernels.cuda import score_and_group_cuda, score_pages_cuda, score_unsupported

from tests.conftest import assert_close
from tests.kernels.test_triton_score import assert_scores, case_inputs, reference

BF16, FP16 = torch.bfloat16, torch.float16
# (Bt, Hkv, G, d, r, basis_bits, q dtype, P, num_pages)
CASES = [
    (1, 1, 1, 64, 8, 4, BF16, 1, [1]),
    (3, 2, 3, 64, 8, 4, BF16, 37, [37, 0, 21]),
    (4, 1, 7, 128, 8, 4, BF16, 33, [33, 0, 12, 30]),
    (2, 3, 8, 128, 8, 4, BF16, 97, [97, 40]),
    (3, 8, 4, 128, 8, 4, BF16, 1000, [1000, 16, 999]),
    # fp16 q on both layouts
    (3, 2, 4, 128, 8, 4, FP16, 37, [37, 0, 21]),
    (2, 3, 8, 64, 8, 4, FP16, 97, [97, 40]),
    # G = 9..16: two head rows per lane
    (3, 2, 16, 128, 8, 4, BF16, 1000, [1000, 16, 999]),
    (4, 2, 16, 128, 8, 4, FP16, 33, [33, 0, 12, 30]),
    (3, 1, 16, 64, 8, 4, BF16, 37, [37, 0, 21]),
    (2, 3, 12, 128, 8, 4, BF16, 97, [97, 40]),
    (3, 2, 12, 96, 8, 4, FP16, 21, [5, 21, 0]),
    (2, 4, 9, 128, 8, 4, BF16, 50, [50, 49]),
    (2, 1, 9, 32, 8, 4, FP16, 17, [17, 1]),
]


def case_id(c) -> str:
    return f"Bt{c[0]}-Hkv{c[1]}-G{c[2]}-d{c[3]}-{str(c[6])[6:]}-P{c[7]}"


@pytest.mark.gpu
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cuda_score_matches_reference(case, index_dtype):
    q, qs, table, num_pages = case_inputs(case, "cuda", seed=31)
    table, num_pages = table.to(index_dtype), num_pages.to(index_dtype)
    assert score_unsupported(q, qs, table, num_pages) is None
    s_hat, m_bar = score_and_group_cuda(q, qs, table, num_pages)
    ref = reference(q, qs, table, num_pages)
    assert_scores(s_hat.cpu(), ref.cpu(), f"s_hat {case}")
    assert_close(m_bar.cpu(), group_scores(ref, "share_average").cpu(), f"m_bar {case}")
    assert torch.equal(score_pages_cuda(q, qs, table, num_pages), s_hat)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[3], CASES[8]], ids=case_id)
def test_cuda_score_is_what_auto_dispatch_runs(case):
    q, qs, table, num_pages = case_inputs(case, "cuda", seed=5)
    assert torch.equal(ops.score_pages(q, qs, table, num_pages), score_pages_cuda(q, qs, table, num_pages))
    s_hat, m_bar = ops.score_and_group(q, qs, table, num_pages, backend="cuda")
    assert torch.equal(s_hat, score_pages_cuda(q, qs, table, num_pages))


@pytest.mark.gpu
@pytest.mark.parametrize("change, reason", [
    ("q_fp32", "q is torch.float32"),
    ("int8_basis", "summary format"),
    ("group_17", "G = 17 query heads per KV head, the kernel reads at most 16"),
    ("d_80", "d = 80"),
])
def test_cuda_score_refuses_other_inputs_and_auto_falls_back(change, reason):
    case = (2, 1, 17 if change == "group_17" else 4, 80 if change == "d_80" else 128, 8,
            8 if change == "int8_basis" else 4, torch.float32 if change == "q_fp32" else BF16, 20, [20, 7])
    q, qs, table, num_pages = case_inputs(case, "cuda", seed=2)
    assert reason in score_unsupported(q, qs, table, num_pages)
    with pytest.raises(ValueError, match="can't run these inputs"):
        score_pages_cuda(q, qs, table, num_pages)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        ops.score_pages(q, qs, table, num_pages, backend="cuda")
    assert_scores(ops.score_pages(q, qs, table, num_pages).cpu(),
                  reference(q, qs, table, num_pages).cpu(), f"auto fallback {change}")


def test_cuda_score_refuses_cpu_tensors_with_the_reason():
    q, qs, table, num_pages = case_inputs(CASES[1], "cpu", seed=1)
    assert "needs a GPU" in score_unsupported(q, qs, table, num_pages)
    with pytest.raises(ValueError, match="backend 'cuda' needs CUDA tensors"):
        ops.score_pages(q, qs, table, num_pages, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [CASES[4], CASES[7]], ids=case_id)
def test_cuda_score_gives_the_same_bits_at_every_run_length(case):
    """A warp's run of stages changes which warp scores a page, never how: runs 1..16, past the
    ragged rows' page counts, all give run 1's bits."""
    q, qs, table, num_pages = case_inputs(case, "cuda", seed=9)
    first = score_and_group_cuda(q, qs, table, num_pages, run=1)
    for run in (2, 3, 5, 16, 200):
        got = score_and_group_cuda(q, qs, table, num_pages, run=run)
        assert all(torch.equal(a, b) for a, b in zip(got, first, strict=True)), f"run {run}"


@pytest.mark.gpu
def test_run_sweep_writes_every_run_of_a_case(tmp_path):
    from lockserve.kernels.cuda.run_sweep import sweep_case

    row = sweep_case("tiny", 2, 4, 64, 4096, 2, runs=(1, 2, 4), layers=2)
    assert set(row["us_per_layer"]) == {1, 2, 4} and all(t > 0 for t in row["us_per_layer"].values())
    assert all(row["same_bits"].values()) and row["best_run"] in (1, 2, 4)


@pytest.mark.parametrize("groups, run", [(1, 2), (2048, 2), (3072, 2), (8192, 4), (16384, 8), (32768, 16),
                                         (1 << 20, 16)])
def test_run_length_is_about_one_warp_per_resident_slot(monkeypatch, groups, run):
    """The rule swept on the H200 (132 SMs, 16 warps each): groups / slots rounded, 2 to 16."""
    from lockserve.kernels.cuda import score

    monkeypatch.setattr(score, "_sm_count", lambda device_index: 132)
    assert score.run_length(groups, 0) == run
