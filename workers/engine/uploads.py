"""Host lists to device tensors without blocking the host.

`torch.tensor(values, device="cuda")` copies from pageable memory, and PyTorch follows such a
copy with a stream synchronisation. The engine builds a step's metadata (token ids, positions,
page tables, lengths) from Python lists once per step: staged through pinned memory and copied
with non_blocking=True, those uploads leave the host free to queue the step's kernels, and the
step's only wait is the sampled-token readback at its end.
"""

from __future__ import annotations

import torch


def upload(values, *, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; asynchronous (pinned staging) on CUDA.

    NOTE: the pinned staging buffer comes from PyTorch's caching host allocator, which records
    the copy's stream and reuses the buffer only after the copy has finished.
    """
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without blocking the host (pinned staging on CUDA)."""
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
