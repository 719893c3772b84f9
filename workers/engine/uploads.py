"""Host lists to device tensors without blocking the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch follows such a
copy with a stream synchronisation. The engine builds a step's metadata (token ids, positions,
page tables, lengths) from Python lists once per step: staged through pinned memory and copied
with non_blocking=True, those uploads leave the host free to queue the step's kernels, and the
step's only wait is the sampled-token readback at its end.
"""

from __future__ import annotations

import torch
from lockserve.offload.arena import to_device

__all__ = ["to_device", "upload"]


def upload(values, *, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; asynchronous (pinned staging) on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), torch.device(device))
