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

__all__ = ["to_device", "to_host", "upload"]


def upload(values, *, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; asynchronous (pinned staging) on CUDA."""
    return to_device(torch.tensor(values, dtype=dtype), torch.device(device))


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of t: from CUDA into pinned memory without a host wait (ordered on the current
    stream: read it on the host only after an event recorded later has completed); a clone on CPU."""
    if t.device.type != "cuda":
        return t.detach().clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
