"""Shared test fixtures: devices, tolerances per dtype, the gpu marker."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

# Tolerances per dtype, in one place (STYLE rule 5). Values are (atol, rtol).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-8),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "", dtype=None) -> None:
    """assert_close with this project's per-dtype tolerances and a message."""
    atol, rtol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(
        actual, expected.to(actual.dtype), atol=atol, rtol=rtol, msg=lambda m: f"{msg}\n{m}" if msg else m
    )


@pytest.fixture
def one_thread():
    """torch on one thread for the test (modules opt in with usefixtures): tiny ops on a shared
    2-core machine spend more on thread start-up than on work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SelectionRecorder:
    """Row 0's selection of every scored decode layer (kernels.select.select_decode_pages), as
    [KV head] sorted page positions, in call order (record_selections)."""

    def __init__(self):
        self.layers: list[list[list[int]]] = []

    def by_step(self, num_layers: int) -> list[list[list[list[int]]]]:
        """[step][layer][KV head] sorted page positions."""
        return [self.layers[i : i + num_layers] for i in range(0, len(self.layers), num_layers)]


@contextlib.contextmanager
def record_selections():
    """Record the engine's LOCKS selections inside the block (SelectionRecorder)."""
    import lockserve.kernels.select as kernel_select

    recorder, original = SelectionRecorder(), kernel_select.select_decode_pages

    def record(scores, num_pages, budgets, k, sink_pages=1, recent_pages=2):
        sel = original(scores, num_pages, budgets, k, sink_pages, recent_pages)
        if scores is not None:
            recorder.layers.append([sorted(p for p in head.tolist() if p >= 0) for head in sel[0]])
        return sel

    kernel_select.select_decode_pages = record
    try:
        yield recorder
    finally:
        kernel_select.select_decode_pages = original


def has_cuda() -> bool:
    return torch.cuda.is_available()


def triton_devices() -> list[str]:
    """Devices on which the Triton kernels can run here: CUDA, or CPU under TRITON_INTERPRET=1."""
    devices = []
    if os.environ.get("TRITON_INTERPRET") == "1":
        devices.append("cpu")
    if has_cuda():
        devices.append("cuda")
    return devices


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `pytest -m gpu` on the H200 must see them
def pytest_collection_modifyitems(config, items):
    # A test parametrized over triton_devices() runs its "cuda" case only where CUDA is: that case is
    # a GPU test (without the marker, the H200's `pytest -m gpu` deselected it).
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is not None and str(spec.params.get("device", "")).startswith("cuda"):
            item.add_marker(pytest.mark.gpu)
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); runs on the lent H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if has_cuda() else "cpu")


# The tests use small tensors: torch's intra-op threads only contend on a 2-core CI machine
# (one test went from 4 s to 38 s under load with the default thread count).
torch.set_num_threads(1)
