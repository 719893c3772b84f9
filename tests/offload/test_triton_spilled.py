"""The host+nvme tier's fused table walk against its torch reference (TRITON_INTERPRET=1 on CPU,
or CUDA)."""

from __future__ import annotations

import pytest
import torch
from lockserve.offload.spilled import spilled_resolve

from tests.conftest import triton_devices

DEVICES = triton_devices()
pytestmark = pytest.mark.skipif(not DEVICES, reason="needs TRITON_INTERPRET=1 or CUDA")


def tables(num_slots: int, max_pages: int, seed: int, device: str):
    """dev_ids: a third of the slots never written; dev_host: half the written ids on NVMe."""
    g = torch.Generator().manual_seed(seed)
    dev_ids = torch.randperm(max_pages, generator=g)[:num_slots]
    dev_ids[torch.rand(num_slots, generator=g) < 1 / 3] = -1
    dev_host = torch.randperm(4 * max_pages, generator=g)[:max_pages]
    dev_host[torch.rand(max_pages, generator=g) < 1 / 2] = -1
    return dev_ids.to(device), dev_host.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [1, 37, 600])
def test_fused_resolve_matches_reference(device, m):
    num_slots, max_pages = 1000, 1500
    dev_ids, dev_host = tables(num_slots, max_pages, seed=m, device=device)
    g = torch.Generator().manual_seed(100 + m)
    slots = torch.randperm(num_slots, generator=g)[:m]
    slots[torch.rand(m, generator=g) < 0.2] = -1  # padding, repeated
    slots = slots.to(device)
    clock = torch.tensor(7, dtype=torch.int64, device=device)
    state = {}
    for backend in ("torch", "triton"):
        missed = torch.zeros(num_slots + 1, dtype=torch.int8, device=device)
        touched = torch.full((max_pages + 1,), 3, dtype=torch.int64, device=device)
        out = spilled_resolve(slots, dev_ids, dev_host, missed, touched, clock, backend=backend)
        state[backend] = (out.cpu(), missed[:-1].cpu(), touched[:-1].cpu())
    ref, got = state["torch"], state["triton"]
    for r, t in zip(ref, got, strict=True):
        assert torch.equal(r, t)
    # and the reference does what its contract says
    out, missed, touched = ref
    cpu = slots.cpu()
    ids = torch.where(cpu >= 0, dev_ids.cpu()[cpu.clamp_min(0)], -1)
    host = torch.where(ids >= 0, dev_host.cpu()[ids.clamp_min(0)], -1)
    on_nvme = (ids >= 0) & (host < 0)
    assert torch.equal(out, torch.where(on_nvme, -1, host))
    assert set(torch.nonzero(missed).flatten().tolist()) == set(cpu[on_nvme].tolist())
    stamped = set(torch.nonzero(touched == 7).flatten().tolist())
    assert stamped == set(ids[ids >= 0].tolist()) and bool((touched[touched != 7] == 3).all())
