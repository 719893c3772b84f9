"""Shared by the offload tests: a shared-memory prefix per test, and bitwise page views."""

from __future__ import annotations

import os
import secrets

import pytest
import torch
from lockserve.offload.host import DEFAULT_SHM_DIR


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bytes of x: page comparisons must be bitwise (random bf16/fp16 bytes hold NaNs)."""
    return x.contiguous().view(torch.uint8)


@pytest.fixture
def prefix():
    """A prefix of this test's own, so concurrent runs never touch each other's segments."""
    p = f"lockserve-test-{secrets.token_hex(4)}"
    yield p
    for name in os.listdir(DEFAULT_SHM_DIR):
        if name.startswith(p + "."):
            os.unlink(os.path.join(DEFAULT_SHM_DIR, name))
