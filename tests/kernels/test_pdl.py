"""When kernels may use programmatic dependent launch (kernels/triton/pdl.py). The PDL launch itself
runs on the GPU: tests/offload/test_gpu.py::test_a_lookup_launched_early_waits_for_the_slots."""

from __future__ import annotations

import pytest
import torch
from lockserve.kernels.triton import pdl


def test_no_pdl_off_a_cuda_device():
    assert not pdl.pdl_enabled(torch.device("cpu"))


@pytest.mark.parametrize("env", [{"LOCKSERVE_PDL": "0"}, {"TRITON_INTERPRET": "1"}])
def test_turned_off_or_interpreted_cuda_launches_have_no_pdl(monkeypatch, env):
    """Decided before the device is asked for its capability: no CUDA needed to say no."""
    monkeypatch.setattr(pdl, "_capability_major", lambda index: pytest.fail("asked the device"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


@pytest.mark.parametrize("major,want", [(8, False), (9, True), (10, True)])
def test_pdl_needs_compute_capability_9(monkeypatch, major, want):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("LOCKSERVE_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capability_major", lambda index: major)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) is want


def test_launch_options_only_when_enabled():
    assert pdl.pdl_launch_options(True) == {"launch_pdl": True}
    assert pdl.pdl_launch_options(False) == {}
