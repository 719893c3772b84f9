"""workers.engine.uploads.upload: the same tensor as torch.tensor, without blocking the host on CUDA."""

from __future__ import annotations

import pytest
import torch
from lockserve.workers.engine.uploads import upload


@pytest.mark.parametrize("values,dtype", [([3, 1, 4, 1, 5], None), ([0.5, -2.0], torch.float32),
                                           ([[1, 2], [3, 4]], torch.int64), ([], torch.int64)])
def test_upload_equals_torch_tensor_on_cpu(values, dtype):
    got = upload(values, dtype=dtype, device="cpu")
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu"
    assert torch.equal(got, want), f"upload({values}) gave {got}"


@pytest.mark.gpu
def test_upload_on_cuda_is_correct_and_does_not_synchronise():
    torch.cuda.synchronize()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):  # keep the stream busy so a blocking copy would have to wait
        busy = busy @ busy / 64
    values = list(range(1000))
    got = upload(values, dtype=torch.int64, device="cuda")
    assert not torch.cuda.current_stream().query(), "the upload waited for the queued work"
    assert torch.equal(got.cpu(), torch.tensor(values)), "uploaded values differ"
