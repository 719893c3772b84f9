"""Launcher of the batched Jacobi eigensolver (eigh_kernel.py) for the summary build.

    eigh_descending_triton(gram [N, B, B] float64) -> (eigenvalues [N, B] descending,
                                                       eigenvectors [N, B, B] as columns)

torch.linalg.eigh is the reference (the same eigenvalues; eigenvectors up to sign, and up to a
rotation inside a repeated eigenvalue's space). On CUDA torch.linalg.eigh waits for the device to
check its result; this does not, so a summary build after a decode step launches behind the step
instead of waiting for it.
"""

from __future__ import annotations

import torch
import triton

from .checks import check_runnable, check_tensor
from .eigh_kernel import jacobi_eigh_kernel

# The sweep limit: random 16 x 16 Gram matrices are left 5e-6 off after 5 sweeps, 2e-7 after 6,
# 8e-15 after 10 (eigh_sweep_h100.json); a program stops sooner once a sweep rotates nothing.
SWEEPS = 10
# On a GPU: [8, B, B] float64 a program (H100, 131,072 matrices: 20.6 ms, 49.3 at 4; eigh_sweep_h100.json)
MATRICES_PER_PROGRAM = 8
# Under TRITON_INTERPRET=1 (a CPU tensor) programs run one after another, each op a numpy call on
# the program's block: more matrices a program make fewer, larger calls. The same kernel; its
# matrices are independent, so the results are the same.
INTERPRETED_MATRICES_PER_PROGRAM = 256


def eigh_descending_triton(gram: torch.Tensor, sweeps: int = SWEEPS,
                           per_program: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """gram: [N, B, B] float64 symmetric (only its values are read, both triangles), B a power of
    two >= 2. Returns (w [N, B] float64 descending, v [N, B, B] float64, column k w[:, k]'s).
    per_program: matrices a program, a power of two (None: MATRICES_PER_PROGRAM on a GPU, up to
    INTERPRETED_MATRICES_PER_PROGRAM in the interpreter); the same results at any."""
    n, b, _ = check_tensor("gram", gram, (("N", None), ("B", None), ("B", None)), (torch.float64,))
    if gram.shape[2] != b or b < 2 or b & (b - 1):
        raise ValueError(f"gram: expected square [N, B, B] matrices with B a power of two >= 2, got "
                         f"{tuple(gram.shape)}")
    if sweeps < 1:
        raise ValueError(f"sweeps ({sweeps}) must be >= 1")
    if per_program is not None and (per_program < 1 or per_program & (per_program - 1)):
        raise ValueError(f"per_program ({per_program}) must be a power of two >= 1")
    check_runnable("gram", gram, jacobi_eigh_kernel)
    gram = gram.contiguous()
    w = torch.empty((n, b), dtype=torch.float64, device=gram.device)
    v = torch.empty((n, b, b), dtype=torch.float64, device=gram.device)
    if n:
        mb = MATRICES_PER_PROGRAM if per_program is None else per_program
        if per_program is None and not gram.is_cuda:
            mb = min(INTERPRETED_MATRICES_PER_PROGRAM, max(mb, triton.next_power_of_2(n)))
        jacobi_eigh_kernel[(triton.cdiv(n, mb),)](gram, w, v, n, SWEEPS=sweeps, B=b, MB=mb, num_warps=4)
    return w, v
