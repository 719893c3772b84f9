"""Launchers for the tensor-core LOCKS score kernel (score_mma.cu, compiled at first use by NVRTC).

    score_unsupported(q, qs, page_table, num_pages)        -> None, or why this kernel can't run
    score_pages_cuda(q, qs, page_table, num_pages)         -> s_hat [Bt, Hkv, G, P]
    score_and_group_cuda(q, qs, page_table, num_pages)     -> (s_hat, m_bar [Bt, Hkv, P])

Same function and conventions as the Triton launchers (kernels/triton/score.py) for the shipped
summary format only: B = 16, r = 8, int4 basis (in the fragment order of basis_d_order), int8
coefficients and centroid, fp16 scales, contiguous tables, bf16 or fp16 q, G <= 16, d a multiple
of 32 up to 128, on an sm_80+ GPU. Anything else is the Triton kernel's (kernels/ops.py picks). The
share-average reuses the Triton kernel, fed by this kernel's per-stage (8 pages) (max, sum exp)
partials.

NVRTC ships with PyTorch's CUDA wheels (nvidia-cuda-nvrtc): torch.cuda._compile_kernel compiles
the source at first use (about a second), cached per (d, G, index dtype, q dtype, device);
launches go straight to cuLaunchKernel.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

from ..summary import QuantSummaries
from ..triton.checks import output
from ..triton.score import check_score_inputs, launch_share_average

SOURCE = Path(__file__).with_name("score_mma.cu")
PAGES_PER_STAGE = 8  # pages a warp scores at once (the kernel's PAGES)
STAGES = 2  # stages in flight per warp: it computes one while the others load
WARPS = 4
MIN_RUN, MAX_RUN = 2, 16  # stages per warp
MAX_GROUP = 16  # query heads per KV head: one head row per lane up to 8, two up to 16
Q_DTYPES = (torch.bfloat16, torch.float16)
MAX_GRID_Y = 65535
INT32_MAX = 2**31 - 1


def page_image_bytes(d: int) -> int:
    """Shared memory per page: basis words 4d, coef 16 x 8, mu d, basis scales 16, coef scales 32."""
    return 4 * d + 128 + d + 16 + 32


def lse_heads(group: int) -> int:
    """Heads per page in the kernel's lse tile (its LSE_ROW): 8, or 16 for G > 8."""
    return 8 if group <= 8 else 16


def page_unroll(group: int) -> int:
    """Pages whose instruction chains interleave (the kernel's PAGE_UNROLL): 4 for G <= 4, 2 for
    G 5..8 (a second q mma per page: 4 pages spilled registers), 1 for G 9..16 (three q mmas per
    page and twice the q fragments: 2 pages spill at d = 128 for some G with int64 tables)."""
    return 4 if group <= 4 else 2 if group <= 8 else 1


def shared_bytes(d: int, group: int) -> int:
    """Per block, for each of its WARPS warps: STAGES stages of page images, a [PAGES, lse_heads]
    float lse tile and per-stage info."""
    pages = PAGES_PER_STAGE
    lse = pages * lse_heads(group) * 4
    return WARPS * (STAGES * pages * page_image_bytes(d) + lse + STAGES * (pages + 4) * 4)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def run_length(groups: int, device_index: int) -> int:
    """Stages per warp: about one warp per resident slot (16 per SM), and at least two stages so
    that a warp's second copy overlaps its first compute. Swept on the H200 over runs of 1 to 16
    (docs/results/score_run_sweep_h200.json): this rule picks the fastest run at every swept
    point, 2K to 32K (stage, head) groups; the earlier rule (two warps per slot, at most 8 stages)
    was 32% slower at Llama's 128K and 17% at GLM-4's 1M (kernels/cuda/run_sweep.py)."""
    slots = _sm_count(device_index) * 16
    return max(MIN_RUN, min(MAX_RUN, round(groups / slots)))


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# The kernel's parameters in order: 12 pointers, 9 ints, the softmax scale as a double.
ARG_TYPES = [ctypes.c_void_p] * 12 + [ctypes.c_int] * 9 + [ctypes.c_double]


def _has_nvrtc_api() -> bool:
    """torch's private NVRTC wrapper and driver-library handle, which this launcher builds on."""
    import torch.cuda._utils as cuda_utils

    return hasattr(torch.cuda, "_compile_kernel") and hasattr(cuda_utils, "_get_gpu_runtime_library")


@functools.cache
def _libcuda():
    return torch.cuda._utils._get_gpu_runtime_library()


def _cu_launch(kernel, grid: tuple[int, int, int], block: int, smem: int, stream: int, args: list) -> None:
    """cuLaunchKernel with the arguments boxed once: torch's generic launcher costs ~0.2 ms of host
    time per call, longer than the kernel at short contexts."""
    values = [kind(a) for kind, a in zip(ARG_TYPES, args, strict=True)]
    boxed = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
    stream_handle = ctypes.c_void_p(stream)
    rc = _libcuda().cuLaunchKernel(kernel.func, *grid, block, 1, 1, smem, stream_handle, boxed, None)
    if rc != 0:
        raise RuntimeError(f"cuLaunchKernel of the CUDA score kernel failed: CUDA error {rc}")


def score_unsupported(q, qs: QuantSummaries, page_table: torch.Tensor, num_pages: torch.Tensor) -> str | None:
    """None when score_pages_cuda can run on these (already shape-checked) inputs, else the reason."""
    if not q.is_cuda:
        return f"q is on {q.device}, the CUDA kernel needs a GPU"
    if torch.version.cuda is None or torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs an NVIDIA GPU of compute capability 8.0 or newer (mma.sync bf16)"
    if not _has_nvrtc_api():
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC) to build it with"
    bt, hq, d = q.shape
    n, hkv = qs.mu_scale.shape
    _, _, page, rank = qs.coef_q.shape
    fmt = (qs.basis_bits, rank, page, qs.coef_q.dtype, qs.mu_q.dtype)
    if fmt != (4, 8, 16, torch.int8, torch.int8):
        return f"summary format (basis bits, r, B, coef, mu) = {fmt}; the kernel reads (4, 8, 16, int8, int8)"
    scales = (qs.basis_scale, qs.coef_scale, qs.mu_scale)
    if any(s.dtype != torch.float16 for s in scales):
        return "summary scales must be float16"
    if q.dtype not in Q_DTYPES:
        return f"q is {q.dtype}, the kernel reads bfloat16 or float16"
    if hq // hkv > MAX_GROUP:
        return f"G = {hq // hkv} query heads per KV head, the kernel reads at most {MAX_GROUP}"
    if d % 32 or d > 128:
        return f"d = {d}, the kernel reads a multiple of 32 up to 128"
    tables = (qs.basis_q, qs.coef_q, qs.mu_q, *scales)
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tables):
        return "summary tables must be contiguous and 16-byte aligned"
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        return f"q needs d contiguous, 16-byte aligned rows, got strides {q.stride()}"
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        return f"page_table needs contiguous rows, got strides {page_table.stride()}"
    if bt > MAX_GRID_Y or max(n * hkv, q.stride(0), page_table.stride(0)) > INT32_MAX:
        return "sizes past the kernel's 32-bit arguments"
    try:  # compiled here, once per shape, so that a failing NVRTC sends auto dispatch to Triton
        _kernel(d, hq // hkv, page_table.dtype, q.dtype, _device_index(q))
    except RuntimeError as err:
        return f"NVRTC could not build it: {str(err).splitlines()[0]}"
    return None


KERNEL_NAME = "locks_score_mma"
NVRTC_OPTIONS = ["-std=c++17"]


def kernel_source(d: int, group: int, index_dtype: torch.dtype, q_dtype: torch.dtype = torch.bfloat16) -> str:
    """score_mma.cu with the compile-time shape of one (d, G, page-table dtype, q dtype)."""
    if q_dtype not in Q_DTYPES:
        raise ValueError(f"q_dtype ({q_dtype}) must be one of {Q_DTYPES}")
    index_t = "long long" if index_dtype == torch.int64 else "int"
    values = dict(HEAD_DIM=d, GROUP=group, INDEX_T=index_t, Q_FP16=int(q_dtype == torch.float16),
                  PAGES=PAGES_PER_STAGE, STAGES=STAGES, PAGE_UNROLL=page_unroll(group))
    return "".join(f"#define {name} {value}\n" for name, value in values.items()) + SOURCE.read_text()


@functools.cache
def _kernel(d: int, group: int, index_dtype: torch.dtype, q_dtype: torch.dtype, device_index: int):
    """Compile score_mma.cu for one (d, G, index type, q type) on one device (NVRTC, about a second)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    with torch.cuda.device(device_index):
        kernel = torch.cuda._compile_kernel(kernel_source(d, group, index_dtype, q_dtype), KERNEL_NAME,
                                            compute_capability=f"{major}{minor}", nvcc_options=NVRTC_OPTIONS)
        kernel.set_shared_memory_config(shared_bytes(d, group))
    return kernel


def kernel_tensors(q, qs: QuantSummaries, page_table, num_pages, s_hat, pmax, psum) -> tuple:
    """The kernel's 12 pointer arguments, in order (num_pages in the page table's dtype)."""
    return (q, qs.basis_q, qs.basis_scale, qs.coef_q, qs.coef_scale, qs.mu_q, qs.mu_scale, page_table,
            num_pages, s_hat, pmax, psum)


def kernel_scalars(q, qs: QuantSummaries, page_table, partials: bool, run: int) -> list:
    """The kernel's 9 ints and the softmax scale, in order: P, NB (groups of 8 pages), N, Hkv, the
    strides of q and of the page table, partials, stages per warp, 1 / sqrt(d)."""
    n, hkv = qs.mu_scale.shape
    p = page_table.shape[1]
    nb = -(-p // PAGES_PER_STAGE)
    return [p, nb, n, hkv, q.stride(0), q.stride(1), page_table.stride(0), int(partials), run,
            1.0 / math.sqrt(q.shape[2])]


def grid_size(nb: int, hkv: int, bt: int, run: int) -> tuple[int, int, int]:
    """Blocks of WARPS warps, one warp per (run of `run` stages, KV head), heads fastest; y = sequence."""
    return (-(-(-(-nb // run) * hkv) // WARPS), bt, 1)


def _launch(q, qs: QuantSummaries, page_table, num_pages, s_hat, partials: bool, run: int | None = None):
    """Fill s_hat [Bt, Hkv, G, P]; if partials, return (pmax, psum) [Bt, Hkv, G, NB] (NB groups of
    8 pages) for the share-average. run: stages per warp (default run_length; any run >= 1 gives
    the same bits)."""
    bt, hq, d = q.shape
    hkv = qs.mu_scale.shape[1]
    g, p = hq // hkv, page_table.shape[1]
    nb = -(-p // PAGES_PER_STAGE)
    pmax = torch.empty(bt, hkv, g, nb if partials else 1, device=q.device, dtype=torch.float32)
    psum = torch.empty_like(pmax)
    num_pages = num_pages.to(page_table.dtype)
    device = _device_index(q)
    kernel = _kernel(d, g, page_table.dtype, q.dtype, device)
    run = run or run_length(nb * hkv * bt, device)
    tensors = kernel_tensors(q, qs, page_table, num_pages, s_hat, pmax, psum)
    args = [t.data_ptr() for t in tensors] + kernel_scalars(q, qs, page_table, partials, run)
    with torch.cuda.device(device):  # the launch uses the current context
        stream = torch.cuda.current_stream(device).cuda_stream
        _cu_launch(kernel, grid_size(nb, hkv, bt, run), 32 * WARPS, shared_bytes(d, g), stream, args)
    return pmax, psum


def _checked(q, qs, page_table, num_pages):
    check_score_inputs(q, qs, page_table, num_pages)
    why = score_unsupported(q, qs, page_table, num_pages)
    if why is not None:
        raise ValueError(f"the CUDA score kernel can't run these inputs: {why}")


def score_pages_cuda(q, qs: QuantSummaries, page_table, num_pages, out: torch.Tensor | None = None,
                     check: bool = True):
    """Eq. 4 from quantised summaries; arguments and result as score_pages_triton. check=False
    skips the argument checks (for a caller that ran check_score_inputs and score_unsupported)."""
    if check:
        _checked(q, qs, page_table, num_pages)
    hkv = qs.mu_scale.shape[1]
    s_hat = output("out", out, (q.shape[0], hkv, q.shape[1] // hkv, page_table.shape[1]), q.device)
    if s_hat.numel():
        _launch(q, qs, page_table, num_pages, s_hat, partials=False)
    return s_hat


def score_and_group_cuda(q, qs: QuantSummaries, page_table, num_pages,
                         out: tuple[torch.Tensor, torch.Tensor] | None = None, check: bool = True,
                         run: int | None = None):
    """Scores and their share-average (Eq. 5); arguments and results as score_and_group_triton;
    check as in score_pages_cuda; run as in _launch (for the run-length sweep)."""
    if check:
        _checked(q, qs, page_table, num_pages)
    bt, hkv, p = q.shape[0], qs.mu_scale.shape[1], page_table.shape[1]
    g = q.shape[1] // hkv
    s_out, m_out = out if out is not None else (None, None)
    s_hat = output("out[0] (s_hat)", s_out, (bt, hkv, g, p), q.device)
    m_bar = output("out[1] (m_bar)", m_out, (bt, hkv, p), q.device)
    if s_hat.numel():
        pmax, psum = _launch(q, qs, page_table, num_pages, s_hat, partials=True, run=run)
        launch_share_average(s_hat.view(bt * hkv, g, p), pmax.view(bt * hkv, g, -1),
                              psum.view(bt * hkv, g, -1), m_bar.view(bt * hkv, p))
    return s_hat, m_bar


def score_partials_cuda(q, qs: QuantSummaries, page_table, num_pages, check: bool = True):
    """Eq. 4 and the kernel's per-stage partials of each head's softmax over pages: (s_hat
    [Bt, Hkv, G, P], pmax, psum [Bt, Hkv, G, NB]) float32, NB stages of 8 pages (max and sum of
    exp(s - max) over the stage). Arguments as score_pages_cuda."""
    if check:
        _checked(q, qs, page_table, num_pages)
    hkv = qs.mu_scale.shape[1]
    g, nb = q.shape[1] // hkv, -(-page_table.shape[1] // PAGES_PER_STAGE)
    s_hat = output("s_hat", None, (q.shape[0], hkv, g, page_table.shape[1]), q.device)
    if not s_hat.numel():
        empty = torch.empty((q.shape[0], hkv, g, nb), device=q.device)
        return s_hat, empty.fill_(float("-inf")), torch.zeros_like(empty)
    return (s_hat, *_launch(q, qs, page_table, num_pages, s_hat, partials=True))
