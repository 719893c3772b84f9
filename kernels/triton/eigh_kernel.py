"""@triton.jit code of a batched symmetric eigensolver for the summary build's small Gram matrices
(kernels/triton/eigh.py launches it; torch.linalg.eigh is the reference).

Two-sided cyclic Jacobi on [B, B] float64 matrices, MB of them per program, all in registers. A
sweep is B - 1 rounds of the round-robin tournament: each round pairs every index with another
(disjoint pairs), rotates all B / 2 pairs at once (A <- J^T A J, V <- V J; J has two entries per
row and column, so each product is a gather and a multiply-add, no matmul) and zeroes their
off-diagonal entries. A pair whose entry is already negligible is not rotated, so converged sweeps
change nothing, and a program stops after its first sweep that rotates nothing (at most SWEEPS).
Nothing is checked on the host: unlike torch.linalg.eigh on CUDA, a launch never waits for the
device.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _partner(i, r, B: tl.constexpr):
    """i's partner in round r of the round-robin over B (even) indices: index 0 stays, indices
    1 .. B-1 are residues mod B - 1 (B - 1 as 0) and i pairs with j where i + j = 2r (mod B - 1);
    the one index paired with itself pairs with 0. [B] int32."""
    m: tl.constexpr = B - 1
    k = i % m
    pk = (2 * r - k + 2 * m) % m
    pj = tl.where(pk == 0, m, pk)
    zero_mate = tl.where(r == 0, m, r)
    return tl.where(i == 0, zero_mate, tl.where(pj == i, 0, pj))


@triton.jit
def jacobi_eigh_kernel(a_ptr, w_ptr, v_ptr, N, SWEEPS: tl.constexpr, B: tl.constexpr, MB: tl.constexpr):
    """Grid (cdiv(N, MB),). a: [N, B, B] float64 symmetric, contiguous; out w [N, B] eigenvalues
    descending (ties: the lower index first), v [N, B, B] their eigenvectors as columns."""
    m = tl.program_id(0) * MB + tl.arange(0, MB)  # [MB] matrices
    i = tl.arange(0, B)
    rows = i[None, :, None]  # [1, B, 1]
    cols = i[None, None, :]  # [1, 1, B]
    live = (m < N)[:, None, None]
    base = m.to(tl.int64)[:, None, None] * (B * B)
    a = tl.load(a_ptr + base + rows * B + cols, mask=live, other=0.0)  # [MB, B, B]
    v = tl.where(rows == cols, 1.0, 0.0).to(tl.float64) + tl.zeros([MB, B, B], dtype=tl.float64)
    sweep = 0
    rotated = 1  # rotations in the last sweep, any of the program's matrices
    # A sweep that rotates nothing changes nothing, nor would any sweep after it: stop there (the
    # same bits as running all SWEEPS). Random 16 x 16 Gram matrices still rotate in their 7th
    # sweep (eigh_sweep_h100.json: 2e-7 of error left after 6); better-conditioned pages stop earlier.
    while (sweep < SWEEPS) & (rotated > 0):
        rotated = 0
        sweep += 1
        for r in range(B - 1):
            p = _partner(i, r, B)  # [B]
            diag = tl.sum(tl.where(rows == cols, a, 0.0), axis=2)  # [MB, B]
            # a[i, p(i)] and a[p(i), i], averaged: rounding leaves A a little unsymmetric, and both
            # rows of a pair must compute the same rotation (else J is not orthogonal)
            apq = 0.5 * (tl.sum(tl.where(cols == p[None, :, None], a, 0.0), axis=2)
                         + tl.sum(tl.where(rows == p[None, None, :], a, 0.0), axis=1))
            dp = tl.gather(diag, tl.zeros([MB, B], dtype=tl.int32) + p[None, :], axis=1)  # diag[p(i)]
            first = (i < p)[None, :]  # i is the pair's lower index
            app = tl.where(first, diag, dp)
            aqq = tl.where(first, dp, diag)
            # tan of the angle that zeroes a_pq: t = sgn(theta) / (|theta| + sqrt(theta^2 + 1))
            small = tl.abs(apq) <= 1e-15 * tl.sqrt(tl.abs(app * aqq)) + 1e-300
            theta = (aqq - app) / tl.where(small, 1.0, 2.0 * apq)
            t = tl.where(theta >= 0, 1.0, -1.0) / (tl.abs(theta) + tl.sqrt(theta * theta + 1.0))
            t = tl.where(small, 0.0, t)
            rotated += tl.sum((~small).to(tl.int32))
            c = 1.0 / tl.sqrt(t * t + 1.0)  # [MB, B]
            # J[i, i] = c_i; J[p, q] = s, J[q, p] = -s for p < q: column j's other entry sits in
            # row p(j) and is s_j where p(j) < j, else -s_j.
            s = tl.where(first, -t * c, t * c)  # [MB, B]: J[p(j), j]
            mate_cols = tl.zeros([MB, B, B], dtype=tl.int32) + p[None, None, :]
            mate_rows = tl.zeros([MB, B, B], dtype=tl.int32) + p[None, :, None]
            a = a * c[:, None, :] + tl.gather(a, mate_cols, axis=2) * s[:, None, :]  # A J
            a = a * c[:, :, None] + tl.gather(a, mate_rows, axis=1) * s[:, :, None]  # J^T (A J)
            v = v * c[:, None, :] + tl.gather(v, mate_cols, axis=2) * s[:, None, :]  # V J
    w = tl.sum(tl.where(rows == cols, a, 0.0), axis=2)  # [MB, B]
    # Place of each eigenvalue in descending order: how many go before it.
    before = (w[:, None, :] > w[:, :, None]) | ((w[:, None, :] == w[:, :, None]) & (cols < rows))
    place = tl.sum(before.to(tl.int32), axis=2)  # [MB, B]
    out = m.to(tl.int64)[:, None] * B + place
    tl.store(w_ptr + out, w, mask=(m < N)[:, None])
    tl.store(v_ptr + base + rows * B + place[:, None, :], v, mask=live)
