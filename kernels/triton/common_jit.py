"""@triton.jit helpers shared by the LOCKS kernels (device code only)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_acc(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with float32 accumulation.

    UPCAST: compute in float32 (exact for bf16/fp16 operands). NOTE: Triton's CPU interpreter
    multiplies the raw uint16 bits of bfloat16 operands in tl.dot, so under TRITON_INTERPRET=1
    the launchers pass UPCAST=True; on the GPU the operands go to the tensor cores as they are.
    IEEE: float32 operands without TF32 rounding.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_f32(x):
    """int8 or float payload -> float32. int8 goes through the 2^23 magic number: two integer ops
    and one FADD instead of an int->float conversion (a quarter-rate instruction on NVIDIA GPUs)."""
    if x.dtype == tl.int8:
        bits = (x.to(tl.int32) & 0xFF) ^ 0x4B000080  # 2^23 + (x + 128) as float32 bits
        return bits.to(tl.float32, bitcast=True) - 8388736.0  # 2^23 + 128
    else:
        return x.to(tl.float32)


@triton.jit
def neg_inf_safe(m):
    """Replace -inf by 0 so that exp(x - m) stays finite (0, not NaN) when every x is -inf."""
    return tl.where(m == float("-inf"), 0.0, m)
