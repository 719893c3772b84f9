"""Argument checks shared by the Triton launchers.

Every launcher validates shape, dtype, device and the strides its kernel relies on before it
launches, and raises ValueError naming the argument, what was expected and what was given:
    ValueError("page_table: expected int32/int64 [Bt, P] with Bt=3, got (4, 7) int16")
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

Dim = tuple[str, "int | None"]  # (label, required size or None for "any")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensor(
    name: str,
    t: torch.Tensor,
    dims: Sequence[Dim],
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
) -> tuple[int, ...]:
    """Raise ValueError unless t has len(dims) dims of the required sizes, one of dtypes, on device.

    Returns t's shape so that callers can bind the free sizes.
    """
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    ok_shape = t.dim() == len(dims) and all(s is None or t.shape[i] == s for i, (_, s) in enumerate(dims))
    if not ok_shape or t.dtype not in dtypes:
        fixed = [f"{label}={size}" for label, size in dims if size is not None]
        want = "/".join(dtype_name(d) for d in dtypes)
        labels = ", ".join(label for label, _ in dims)
        with_ = f" with {', '.join(fixed)}" if fixed else ""
        raise ValueError(
            f"{name}: expected {want} [{labels}]{with_}, got {tuple(t.shape)} {dtype_name(t.dtype)}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (with the other inputs), got {t.device}")
    return tuple(t.shape)


def check_runnable(name: str, t: torch.Tensor, kernel) -> None:
    """Triton runs CUDA tensors compiled, CPU tensors only in interpreter mode (TRITON_INTERPRET=1)."""
    if t.is_cuda or (t.device.type == "cpu" and is_interpreted(kernel)):
        return
    raise ValueError(
        f"{name}: the Triton kernels need CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set "
        f"before lockserve.kernels.triton is imported; got a tensor on {t.device}"
    )


def is_interpreted(kernel) -> bool:
    """Whether a @triton.jit function was created in interpreter mode (fixed at import time)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """Raise ValueError unless t's last dim has stride 1 (rows contiguous; other strides free)."""
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected unit stride in the last dim, got strides {t.stride()}")


def check_output(
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> None:
    """`output`'s checks of a caller-given buffer, allocating nothing (None passes): for the
    launchers' argument checks, which run before every launch."""
    if out is not None:
        output(name, out, shape, device, dtype)


def output(
    name: str,
    out: torch.Tensor | None,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A caller-given output buffer (checked: dtype, contiguous, shape, device) or a new one."""
    if out is None:
        return torch.empty(shape, device=device, dtype=dtype)
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != tuple(shape)
        or out.dtype != dtype
        or not out.is_contiguous()
        or out.device != device
    ):
        got = type(out).__name__
        if isinstance(out, torch.Tensor):
            got = f"{tuple(out.shape)} {dtype_name(out.dtype)} on {out.device}"
            got += "" if out.is_contiguous() else f" with strides {out.stride()}"
        raise ValueError(
            f"{name}: expected a contiguous {dtype_name(dtype)} {tuple(shape)} on {device}, got {got}"
        )
    return out
