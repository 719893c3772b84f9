"""LOCKS page summaries: build (Algorithm 1) and quantisation — the torch reference.

A page is B consecutive post-RoPE keys of one sequence, one layer, one KV head.
Its summary is the page's own rank-r eigenbasis of centred keys:

    mu = mean_i k_i                     centroid          [d]
    D  = stack(k_i - mu)                deviations        [B, d]
    D D^T = U S^2 U^T                   small Gram eig    [B, B] (descending)
    V  = D^T U_r S_r^-1                 orthonormal basis [d, r]
    C  = U_r S_r                        coefficients      [B, r]   (c_i = V^T delta_i)
    tau = sum_{k > r} sigma_k^2         spectral tail (diagnostic)

Summaries are batched over any leading dims: keys [..., B, d] give mu [..., d],
basis [..., d, r], coef [..., B, r], tau [...].
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields

import torch

# Components with sigma^2 below SIGMA2_FLOOR * (largest sigma^2 + 1e-30) are treated as
# absent: their basis column and coefficients are zero. This is what keeps rank-deficient
# pages (repeated keys, zero keys, B = 1) free of NaN.
SIGMA2_FLOOR = 1e-10
# torch.linalg.eigh on CUDA failed for one call of 65,536 16x16 matrices on the H200
# (CUSOLVER_STATUS_INTERNAL_ERROR); calls of <= 40,000 ran. Chunk below that.
EIGH_CHUNK = 32768
# The eigensolver of the build on CUDA tensors (LocksConfig.eigh, an argument of the build):
# "torch" (torch.linalg.eigh: it waits for the device to check its result, so a build after a
# decode step waits for the step), "jacobi" (kernels/triton/eigh.py: no host wait) or "auto", the
# default: jacobi at every size on CUDA (power-of-two pages). Measured on an H100 for one prefill
# chunk's 131,072 matrices: 20.6 ms against 34.8-40.9 ms for torch.linalg.eigh at any chunk, whose
# calls of EIGH_CHUNK matrices also take 23.8 GiB of workspace (eigh_sweep_h100.json); a 32K
# prefill 1.112 x plain against 1.151 x (prefill_llama8b_32k_eigh_{jacobi,torch}_h100.json). CPU
# tensors use torch.linalg.eigh, unless the choice is "jacobi" and Triton's interpreter runs the
# kernel.
EIGH_SOLVERS = ("auto", "torch", "jacobi")
DEFAULT_EIGH = "auto"
BASIS_BITS = (16, 8, 4, 2)


@dataclass
class LocksConfig:
    """Shape of a LOCKS summary and the eigensolver of its build. Shipped: B = 16, r = 8, basis
    int4, coef/centroid int8, eigh "auto"."""

    page_size: int = 16
    rank: int = 8
    basis_bits: int = 4
    coef_bits: int = 8
    centroid_bits: int = 8
    eigh: str = DEFAULT_EIGH  # the build's eigensolver on CUDA (EIGH_SOLVERS; see eigh_solver)

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size ({self.page_size}) must be >= 1")
        if not 1 <= self.rank <= self.page_size:
            raise ValueError(f"rank ({self.rank}) must be in [1, page_size ({self.page_size})]")
        if self.basis_bits not in BASIS_BITS:
            raise ValueError(f"basis_bits ({self.basis_bits}) must be one of {BASIS_BITS}")
        for name in ("coef_bits", "centroid_bits"):
            if getattr(self, name) not in (16, 8):
                raise ValueError(f"{name} ({getattr(self, name)}) must be 16 or 8")
        _check_eigh(self.eigh)


def take_rows(t: torch.Tensor, idx) -> torch.Tensor:
    """t[idx]: an integer tensor of page ids (any shape) through index_select, which on CPU is ~5x
    faster than advanced indexing; anything else (an int: a view) as t[idx]."""
    if isinstance(idx, torch.Tensor) and idx.dtype in (torch.int64, torch.int32):
        return t.index_select(0, idx.reshape(-1)).reshape(*idx.shape, *t.shape[1:])
    return t[idx]


@dataclass
class PageSummaries:
    """Unquantised summaries (float32). Leading dims [...] are the pages."""

    mu: torch.Tensor  # [..., d]
    basis: torch.Tensor  # [..., d, r]  orthonormal columns (zero where sigma ~ 0)
    coef: torch.Tensor  # [..., B, r]
    tau: torch.Tensor  # [...]         spectral tail, sum of dropped sigma^2

    def index(self, idx) -> PageSummaries:
        return PageSummaries(**{f.name: take_rows(getattr(self, f.name), idx) for f in fields(self)})


def _check_eigh(eigh: str) -> None:
    if eigh not in EIGH_SOLVERS:
        raise ValueError(f"eigh ({eigh!r}) must be one of {EIGH_SOLVERS}")


def eigh_solver(size: int, cuda: bool, eigh: str = DEFAULT_EIGH) -> str:
    """The solver that the choice `eigh` (EIGH_SOLVERS) takes for [size, size] matrices on CUDA
    tensors (cuda) or CPU ones: "jacobi" or "torch"."""
    _check_eigh(eigh)
    runs = cuda or (eigh == "jacobi" and os.environ.get("TRITON_INTERPRET") == "1")
    wanted = eigh == "jacobi" or (eigh == "auto" and cuda)
    power_of_two = size >= 2 and not size & (size - 1)  # the kernel's sweep pairs up the rows
    return "jacobi" if runs and wanted and power_of_two else "torch"


def _eigh_descending(gram: torch.Tensor, eigh: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of [N, B, B] symmetric matrices, eigenvalues descending (the solver
    eigh_solver picks for `eigh`; torch.linalg.eigh in chunks)."""
    b = gram.shape[-1]
    if eigh_solver(b, gram.is_cuda, eigh) == "jacobi":
        from .triton.eigh import eigh_descending_triton  # the Triton kernels load on first use

        return eigh_descending_triton(gram)
    evals, evecs = [], []
    for start in range(0, gram.shape[0], EIGH_CHUNK):
        w, u = torch.linalg.eigh(gram[start : start + EIGH_CHUNK])
        evals.append(w.flip(-1))
        evecs.append(u.flip(-1))
    if not evals:
        return gram.new_zeros(0, b), gram.new_zeros(0, b, b)
    return torch.cat(evals), torch.cat(evecs)


def build_summaries(keys: torch.Tensor, rank: int, eigh: str = DEFAULT_EIGH) -> PageSummaries:
    """Algorithm 1 on every page. keys: [..., B, d] (any float dtype) -> float32 summaries.
    eigh: the eigensolver choice (EIGH_SOLVERS; LocksConfig.eigh)."""
    if keys.dim() < 2:
        raise ValueError(f"keys must be [..., B, d], got shape {tuple(keys.shape)}")
    lead, (b, d) = keys.shape[:-2], keys.shape[-2:]
    if not 1 <= rank <= b:
        raise ValueError(f"rank ({rank}) must be in [1, page size ({b})]")
    k = keys.reshape(-1, b, d).float()  # [N, B, d]
    mu = k.mean(dim=1)  # [N, d]
    dev = k - mu[:, None, :]  # [N, B, d]
    # NOTE: the Gram matrix is formed in float64: float32 rounding noise (~1e-7 of the top
    # sigma^2) would survive SIGMA2_FLOOR and give rank-deficient pages non-orthonormal columns.
    dev64 = dev.double()
    gram = dev64 @ dev64.transpose(1, 2)  # [N, B, B]
    sigma2, u = _eigh_descending(gram, eigh)  # [N, B], [N, B, B]
    sigma2 = sigma2.clamp_min(0.0)
    keep = sigma2[:, :rank] > SIGMA2_FLOOR * (sigma2[:, :1] + 1e-30)  # [N, r]
    sigma = sigma2[:, :rank].sqrt()
    u_r = u[:, :, :rank] * keep[:, None, :]  # [N, B, r]
    inv_sigma = torch.where(keep, 1.0 / sigma.clamp_min(1e-30), torch.zeros_like(sigma))
    basis = (dev64.transpose(1, 2) @ u_r) * inv_sigma[:, None, :]  # [N, d, r]
    coef = u_r * sigma[:, None, :]  # [N, B, r]
    tau = sigma2[:, rank:].sum(dim=1)  # [N]
    return PageSummaries(
        mu=mu.reshape(*lead, d),
        basis=basis.float().reshape(*lead, d, rank),
        coef=coef.float().reshape(*lead, b, rank),
        tau=tau.float().reshape(lead),
    )


# ----------------------------------------------------------------------------- quantisation


@dataclass
class QuantSummaries:
    """Quantised summaries as stored in the GPU-resident table. Leading dims [...] are pages.

    basis_q: V^T by rows: [..., r, d * bits / 8] uint8 for 4/2 bits, int8 [..., r, d] for 8 bits,
             bfloat16 [..., r, d] for 16 bits. Row c holds component c's d codes in the order
             basis_d_order(d, bits) (packed low bits first, pack_bits); one scale per component.
    coef_q:  int8 [..., B, r], one scale per row (per key); bfloat16 when coef_bits = 16.
    mu_q:    int8 [..., d], one scale per page; bfloat16 when centroid_bits = 16.
    Scales are float16 (ones when the payload is bf16).
    """

    basis_q: torch.Tensor
    basis_scale: torch.Tensor  # [..., r]
    coef_q: torch.Tensor
    coef_scale: torch.Tensor  # [..., B]
    mu_q: torch.Tensor
    mu_scale: torch.Tensor  # [...]
    basis_bits: int

    def payload_bytes_per_page(self) -> int:
        """Bytes of one page's summary, payload only (scales excluded)."""
        return sum(_bytes_per_page(t, self.mu_scale.dim()) for t in (self.basis_q, self.coef_q, self.mu_q))

    def bytes_per_page(self) -> int:
        """Bytes of one page's summary including the quantisation scales."""
        lead = self.mu_scale.dim()
        scales = (self.basis_scale, self.coef_scale, self.mu_scale)
        return self.payload_bytes_per_page() + sum(_bytes_per_page(t, lead) for t in scales)

    def basis_codes(self) -> torch.Tensor:
        """The basis rows' codes [..., r, d] in storage order, unscaled (bf16 / int8 as stored,
        packed widths unpacked to int8)."""
        return self.basis_q if self.basis_bits in (16, 8) else unpack_bits(self.basis_q, self.basis_bits)

    def index(self, idx) -> QuantSummaries:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in out.items():
            if isinstance(value, torch.Tensor):
                out[name] = take_rows(value, idx)
        return QuantSummaries(**out)


def _bytes_per_page(t: torch.Tensor, lead_dims: int) -> int:
    per = t.element_size()
    for s in t.shape[lead_dims:]:
        per *= s
    return per


def _symmetric_quant(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric quantisation along `dim` -> (int codes as int8, fp16 scale)."""
    qmax = 2 ** (bits - 1) - 1
    amax = x.abs().amax(dim=dim, keepdim=True)
    scale = (amax / qmax).half().float()  # the stored scale is fp16: quantise with it
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round(x / safe), -qmax - 1, qmax).to(torch.int8)
    return codes, scale.squeeze(dim).half()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes [..., n] (int8, in [-2^(bits-1), 2^(bits-1))) -> uint8 [..., n*bits/8]."""
    per = 8 // bits
    mask = (1 << bits) - 1
    u = (codes.to(torch.int16) & mask).to(torch.uint8)
    u = u.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    out = torch.zeros(u.shape[:-1], dtype=torch.uint8, device=codes.device)
    for j in range(per):
        out |= u[..., j] << (j * bits)
    return out


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [..., m] -> signed int8 codes [..., m * 8 / bits]."""
    per = 8 // bits
    mask, half = (1 << bits) - 1, 1 << (bits - 1)
    u = torch.stack([(packed >> (j * bits)) & mask for j in range(per)], dim=-1)  # [..., m, per] uint8
    u = u.view(torch.int8)
    signed = (u ^ half) - half  # u in [0, 2^bits): two's complement sign extension, no compare
    return signed.reshape(*packed.shape[:-1], packed.shape[-1] * per)


@functools.lru_cache(maxsize=64)
def basis_d_order_on(d: int, bits: int, device: torch.device) -> torch.Tensor:
    """basis_d_order on `device`, made once: a build captured in a CUDA graph must not copy it from
    the host (a capture refuses a copy from pageable memory)."""
    return basis_d_order(d, bits).to(device)


@functools.lru_cache(maxsize=64)
def _basis_d_position_on(d: int, bits: int, device: torch.device) -> torch.Tensor:
    """The inverse of basis_d_order on `device`: the storage position of each dimension 0..d-1."""
    return torch.argsort(basis_d_order(d, bits)).to(device)


def basis_d_order(d: int, bits: int) -> torch.Tensor:
    """The dimension stored at each position of a basis row: int64 [d], a permutation of 0..d-1.

    int4 with d % 32 == 0 (the shipped case) uses the fragment order that the CUDA score kernel
    reads (kernels/cuda/score_mma.cu, integer mma.m16n8k32): 32-bit word w of a row serves lane
    tig = w // (d / 32) at step kk = w % (d / 32), the dimensions 32 kk + 8 tig + 0..7; byte b
    holds dimension 32 kk + 8 tig + b in its low nibble and + 4 + b in its high nibble, so
    word & 0x0F0F0F0F and (word >> 4) & 0x0F0F0F0F are the lane's two mma operand registers and
    one 16-byte load gives a lane all its codes. Otherwise: 0..d-1.
    """
    if bits != 4 or d % 32:
        return torch.arange(d)
    s = torch.arange(d)
    w, n = s // 8, s % 8  # word, nibble
    tig, kk = w // (d // 32), w % (d // 32)
    return 32 * kk + 8 * tig + 4 * (n % 2) + n // 2


def quantize_summaries(s: PageSummaries, cfg: LocksConfig) -> QuantSummaries:
    """Quantise basis (per-column scale), coefficients (per-row) and centroid (per-page)."""
    d = s.basis.shape[-2]
    per = 8 // cfg.basis_bits if cfg.basis_bits < 8 else 1
    if d % per:
        raise ValueError(f"head dim d ({d}) must be a multiple of {per} to pack {cfg.basis_bits}-bit codes")
    order = basis_d_order_on(d, cfg.basis_bits, s.basis.device)
    if cfg.basis_bits == 16:
        basis, basis_scale = _quant_or_bf16(s.basis, 16, dim=-2)
        basis_q = basis.transpose(-1, -2)[..., order].contiguous()
    else:
        codes, basis_scale = _symmetric_quant(s.basis, cfg.basis_bits, dim=-2)  # scale: [..., r]
        rows = codes.transpose(-1, -2)[..., order]  # [..., r, d] in storage order
        basis_q = rows.contiguous() if cfg.basis_bits == 8 else pack_bits(rows, cfg.basis_bits)
    coef_q, coef_scale = _quant_or_bf16(s.coef, cfg.coef_bits, dim=-1)  # scale: [..., B]
    mu_q, mu_scale = _quant_or_bf16(s.mu, cfg.centroid_bits, dim=-1)  # scale: [...]
    return QuantSummaries(basis_q, basis_scale, coef_q, coef_scale, mu_q, mu_scale, cfg.basis_bits)


def _quant_or_bf16(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if bits == 16:
        return x.bfloat16(), torch.ones_like(x.select(dim, 0), dtype=torch.float16)
    return _symmetric_quant(x, bits, dim=dim)


def dequantize_summaries(q: QuantSummaries, tau: torch.Tensor | None = None) -> PageSummaries:
    """Back to float32 (tau is not stored quantised; pass it through if known, else zeros)."""
    rows = q.basis_codes()  # [..., r, d]
    codes = rows[..., _basis_d_position_on(rows.shape[-1], q.basis_bits, rows.device)]  # back to d order
    basis = codes.float().transpose(-1, -2) * q.basis_scale.float()[..., None, :]
    coef = q.coef_q.float() * q.coef_scale.float()[..., None]
    mu = q.mu_q.float() * q.mu_scale.float()[..., None]
    if tau is None:
        tau = torch.zeros(q.mu_scale.shape, device=mu.device)
    return PageSummaries(mu=mu, basis=basis, coef=coef, tau=tau)
