"""The Triton Jacobi eigensolver of the summary build vs torch.linalg.eigh, and a build with it vs
the torch build."""

from __future__ import annotations

import pytest
import torch
from lockserve.kernels import summary
from lockserve.kernels.summary import build_summaries
from lockserve.kernels.triton import eigh
from lockserve.kernels.triton.eigh import eigh_descending_triton

from tests.conftest import triton_devices


def grams(b: int, gen: torch.Generator) -> torch.Tensor:
    """[9, B, B] float64 Gram matrices of centred pages: full rank, rank B/2, rank 1 (repeated
    keys), zero, one key apart from the rest, and scales from 1e-6 to 1e6."""
    d = 64
    keys = torch.randn(9, b, d, generator=gen, dtype=torch.float64)
    keys[1, b // 2 :] = keys[1, : b // 2]
    keys[2] = keys[2, :1]
    keys[3] = 0.0
    keys[4, 1:] = keys[4, :1] + 1e-3 * torch.randn(b - 1, d, generator=gen, dtype=torch.float64)
    keys[5] *= 1e-6
    keys[6] *= 1e6
    dev = keys - keys.mean(dim=1, keepdim=True)
    return dev @ dev.transpose(1, 2)


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("b", [2, 8, 16, 32])
def test_jacobi_eigh_matches_torch(device, b):
    gram = grams(b, torch.Generator().manual_seed(b))
    w, v = eigh_descending_triton(gram.to(device))
    w, v = w.cpu(), v.cpu()
    want = torch.linalg.eigvalsh(gram).flip(-1)
    scale = gram.abs().amax((1, 2)) + 1e-300  # [N]
    eye = torch.eye(b, dtype=torch.float64)
    for n in range(gram.shape[0]):
        where = f"matrix {n}, B={b}"
        assert torch.all(w[n, :-1] >= w[n, 1:]), f"{where}: not descending: {w[n]}"
        assert (w[n] - want[n]).abs().max() <= 1e-12 * scale[n], f"{where}: {w[n]} vs {want[n]}"
        assert (v[n].T @ v[n] - eye).abs().max() <= 1e-12, f"{where}: eigenvectors not orthonormal"
        rebuilt = v[n] @ torch.diag(w[n]) @ v[n].T
        assert (rebuilt - gram[n]).abs().max() <= 1e-12 * scale[n], f"{where}: V diag(w) V^T != A"


@pytest.mark.parametrize("device", triton_devices())
def test_a_program_stops_at_convergence_with_the_bits_of_more_sweeps(device):
    """A sweep that rotates nothing ends the program's loop: any larger sweep limit gives the same
    bits. Too few sweeps (one) do not converge: the limit is what the loop obeys until then."""
    gram = torch.randn(8, 16, 40, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    gram = (gram @ gram.transpose(1, 2)).to(device)  # [8, 16, 16] full rank
    at_limit = eigh_descending_triton(gram, sweeps=eigh.SWEEPS)
    for got, want in zip(eigh_descending_triton(gram, sweeps=4 * eigh.SWEEPS), at_limit, strict=True):
        assert torch.equal(got, want)
    one_sweep = eigh_descending_triton(gram, sweeps=1)[0]
    assert not torch.allclose(one_sweep, at_limit[0], rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("device", triton_devices())
def test_programs_of_any_width_give_the_same_answer(device):
    """The interpreter runs up to 256 matrices a program, a GPU 8: grids of several programs, the
    last one part-full (9 matrices, 2 or 4 a program), give what one program of all of them
    gives."""
    gram = grams(4, torch.Generator().manual_seed(5)).to(device)
    one = eigh_descending_triton(gram, per_program=16)
    for per_program in (2, 4, eigh.MATRICES_PER_PROGRAM):
        several = eigh_descending_triton(gram, per_program=per_program)
        for got, want in zip(several, one, strict=True):
            assert torch.equal(got, want), per_program
    with pytest.raises(ValueError, match=r"per_program \(6\) must be a power of two"):
        eigh_descending_triton(gram, per_program=6)


@pytest.mark.parametrize("device", triton_devices())
def test_build_with_jacobi_gives_the_torch_builds_summaries(device):
    """Same centroids and tails, and the same rank-r page (coef @ basis^T): eigenvector signs may
    differ, and cancel there."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 5, 3, 16, 64, generator=gen)
    keys[0, 1, 2, 8:] = keys[0, 1, 2, :8]  # a rank-deficient page
    want = build_summaries(keys, 8, eigh="torch")
    got = build_summaries(keys.to(device), 8, eigh="jacobi")
    torch.testing.assert_close(got.mu.cpu(), want.mu)
    torch.testing.assert_close(got.tau.cpu(), want.tau, rtol=1e-5, atol=1e-4)
    page = lambda s: s.coef.cpu() @ s.basis.cpu().transpose(-1, -2)  # noqa: E731  [..., B, d]
    torch.testing.assert_close(page(got), page(want), rtol=1e-5, atol=1e-5)
    eye = torch.eye(8)
    gram = got.basis.cpu().transpose(-1, -2) @ got.basis.cpu()  # orthonormal where kept
    assert ((gram - eye).abs() * (gram.diagonal(dim1=-2, dim2=-1) > 0.5)[..., None]).max() < 1e-5


def test_refuses_what_it_cannot_solve():
    with pytest.raises(ValueError, match="power of two"):
        eigh_descending_triton(torch.zeros(2, 12, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        eigh_descending_triton(torch.zeros(2, 16, 16))
    with pytest.raises(ValueError, match=r"eigh \('lapack'\) must be one of \('auto', 'torch', 'jacobi'\)"):
        build_summaries(torch.zeros(1, 16, 8), 8, eigh="lapack")
    with pytest.raises(ValueError, match=r"eigh \('lapack'\) must be one of"):
        summary.LocksConfig(eigh="lapack")


def test_auto_solves_with_jacobi_on_cuda_and_torch_on_the_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert summary.DEFAULT_EIGH == summary.LocksConfig().eigh == "auto"
    assert summary.eigh_solver(16, cuda=True) == "jacobi"  # the default, for builds of any size
    assert summary.eigh_solver(16, cuda=True, eigh="torch") == "torch"
    assert summary.eigh_solver(12, cuda=True, eigh="auto") == "torch"  # the kernel pairs rows: 2^n
    assert summary.eigh_solver(12, cuda=True, eigh="jacobi") == "torch"
    assert summary.eigh_solver(16, cuda=False, eigh="auto") == "torch"
    assert summary.eigh_solver(16, cuda=False, eigh="jacobi") == "torch"  # no interpreter: no kernel
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert summary.eigh_solver(16, cuda=False, eigh="auto") == "torch"  # auto runs Jacobi on CUDA only
    assert summary.eigh_solver(16, cuda=False, eigh="jacobi") == "jacobi"


@pytest.mark.gpu
def test_auto_build_of_a_decode_steps_pages_is_capturable_on_cuda():
    """auto: the few pages of a decode step build with no host wait (a CUDA-graph capture succeeds,
    where torch.linalg.eigh's fails: test_jacobi_build_needs_no_host_wait_on_cuda). A failed
    capture is not repeated here: it leaves the CUDA generator unusable for the tests after it."""
    small = torch.randn(32, 8, 16, 64, device="cuda")  # 256 pages
    build_summaries(small, 8, eigh="auto")  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        build_summaries(small, 8, eigh="auto")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_summaries(small, 8, eigh="auto")
    graph.replay()
    eager = build_summaries(small, 8, eigh="auto")
    torch.testing.assert_close(captured.tau, eager.tau)


def test_engine_decodes_the_same_tokens_with_either_solver(tmp_path):
    """A page's summary with the other eigenvectors' signs quantises to the negated codes, so the
    scores, the selections and the tokens are the torch build's (tiny model, CPU; the Jacobi kernel
    runs in Triton's interpreter where TRITON_INTERPRET=1 is set, as in CI)."""
    import json

    from lockserve.cluster.measure.decode import bench

    tokens = {}
    for solver in ("torch", "jacobi"):  # "auto" is torch on the CPU (eigh_solver's test)
        out = tmp_path / f"{solver}.json"
        argv = ["--model", "tiny", "--device", "cpu", "--context", "200", "--steps", "4", "--warmup", "1",
                "--budget-tokens", "64", "--modes", "locks:hbm", "--summary-eigh", solver, "--out", str(out)]
        assert bench.main(argv) == 0
        tokens[solver] = json.loads(out.read_text())["modes"]["locks:hbm"]["tokens"]
    assert tokens["jacobi"] == tokens["torch"]


@pytest.mark.gpu
def test_jacobi_build_needs_no_host_wait_on_cuda():
    """A CUDA-graph capture fails on a host synchronisation: the build with torch.linalg.eigh cannot
    be captured, the build with the Jacobi kernel can, and its replay gives the eager build."""
    keys = torch.randn(32, 3, 16, 64, device="cuda")
    with pytest.raises(RuntimeError):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            build_summaries(keys, 8, eigh="torch")
    torch.cuda.synchronize()
    eager = build_summaries(keys, 8, eigh="jacobi")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = build_summaries(keys, 8, eigh="jacobi")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.coef @ captured.basis.transpose(-1, -2),
                               eager.coef @ eager.basis.transpose(-1, -2))
