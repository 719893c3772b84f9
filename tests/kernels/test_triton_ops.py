"""lockserve.kernels.ops: device dispatch (Triton on CUDA / under the interpreter, else torch) and
the reference fallback path, both against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch
from lockserve.kernels import dequantize_summaries, group_scores, ops, score_pages_ref, sparse_decode_ref
from lockserve.kernels.score import score_quantized_torch

from tests.conftest import assert_close
from tests.kernels.test_triton_attention import CASES as ATTENTION_CASES
from tests.kernels.test_triton_attention import case_inputs as attention_inputs
from tests.kernels.test_triton_score import CASES as SCORE_CASES
from tests.kernels.test_triton_score import assert_scores
from tests.kernels.test_triton_score import case_inputs as score_inputs

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_dispatch_follows_device_and_backend():
    cpu = torch.zeros(1)
    assert not ops.uses_triton(cpu), "auto runs the torch reference on CPU tensors"
    assert not ops.uses_triton(cpu, "torch")
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert ops.uses_triton(cpu, "triton")
    else:
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            ops.uses_triton(cpu, "triton")
    with pytest.raises(ValueError, match="backend"):
        ops.uses_triton(cpu, "cuda")
    if torch.cuda.is_available():
        assert ops.uses_triton(cpu.cuda()) and not ops.uses_triton(cpu.cuda(), "torch")


def _backend(device) -> str:
    """The kernels themselves: on CPU through the interpreter, where CI runs them."""
    return "triton" if (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1") else "torch"


def test_score_and_group_op_matches_reference(device):
    q, qs, table, num_pages = score_inputs(SCORE_CASES[1], str(device), seed=31)
    backend = _backend(device)
    s_hat, m_bar = ops.score_and_group(q, qs, table, num_pages, backend=backend)
    ref = score_pages_ref(q, dequantize_summaries(qs), table, num_pages)
    assert_scores(s_hat.cpu(), ref.cpu(), "ops.score_and_group s_hat")
    assert_close(m_bar.cpu(), group_scores(ref, "share_average").cpu(), "ops.score_and_group m_bar")
    s_only = ops.score_pages(q, qs, table, num_pages, backend=backend)
    assert_scores(s_only.cpu(), ref.cpu(), "ops.score_pages")
    m_ref = group_scores(ref, "share_average").cpu()
    assert_close(ops.share_average(ref, backend=backend).cpu(), m_ref, "ops.share_average")


@pytest.mark.parametrize("case", [*SCORE_CASES, (2, 2, 4, 64, 8, 16, torch.float32, 9, [9, 4])],
                         ids=lambda c: "Bt{}-Hkv{}-G{}-d{}-r{}-b{}-{}-P{}".format(*c))
def test_the_torch_path_scores_from_the_quantised_table_as_the_reference(case):
    """The CPU path (basis left in storage order, q permuted, only the named pages read) against
    the reference on the dequantised table, for every basis width, padding and G."""
    q, qs, table, num_pages = score_inputs(case, "cpu", seed=32)
    expected = score_pages_ref(q, dequantize_summaries(qs), table, num_pages)
    assert_scores(score_quantized_torch(q, qs, table, num_pages), expected, "torch path")
    assert_scores(ops.score_pages(q, qs, table, num_pages, backend="torch"), expected, "ops torch")


def test_sparse_decode_op_matches_reference(device):
    case = ATTENTION_CASES[1]
    q, pool, slots, lens = attention_inputs(case, str(device), seed=33)
    o, lse = ops.sparse_decode(q, pool, slots, lens, backend=_backend(device))
    ro, rl = sparse_decode_ref(q, pool, slots, lens)
    assert_close(o.cpu(), ro.cpu(), "ops.sparse_decode o", dtype=case[5])
    finite = torch.isfinite(rl)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close(lse[finite].cpu(), rl[finite].cpu(), "ops.sparse_decode lse", dtype=case[5])
