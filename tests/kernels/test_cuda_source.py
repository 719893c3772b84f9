"""The CUDA score kernel compiles, on any machine, for every shape the launcher sends it.

GPU tests (test_cuda_score.py) run only on the lent H200, so this CPU test guards the source in
CI: NVRTC (the nvidia-cuda-nvrtc wheel of the test extra) compiles kernel_source for sm_90 and
sm_80, and Triton's cuobjdump reads the cubin's resource usage: no local memory (register spills
or stack arrays) and at most 128 registers, which the four 128-thread blocks per SM need. The
cases cover both layouts of the q operand (one head row per lane for G <= 8, two for G = 9..16,
the tightest on registers), PACK3 (G <= 4), both page-table types and both q dtypes.
test_cuda_emulated.py runs the same source on the CPU against the reference.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import torch
from lockserve.kernels.cuda import score as cuda_score

BF16, FP16 = torch.bfloat16, torch.float16
# (d, G, page-table dtype, q dtype)
CASES = [(128, 4, torch.int32, BF16), (128, 8, torch.int64, BF16), (64, 3, torch.int32, BF16),
         (32, 1, torch.int64, BF16), (96, 7, torch.int32, BF16), (128, 5, torch.int32, BF16),
         (128, 4, torch.int32, FP16), (128, 8, torch.int64, FP16),
         (128, 16, torch.int32, BF16), (128, 16, torch.int64, BF16), (128, 16, torch.int64, FP16),
         (128, 12, torch.int64, BF16), (128, 9, torch.int32, FP16), (96, 16, torch.int64, BF16),
         (64, 16, torch.int32, BF16), (64, 11, torch.int32, FP16), (32, 13, torch.int64, FP16)]
H200_SHARED_PER_SM = 228 * 1024  # bytes; the driver reserves 1 KB of it per block


def nvrtc_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        lib = Path(root) / "cu13" / "lib"
        if (lib / "libnvrtc.so.13").exists():
            return lib
    return None


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.fixture(scope="module")
def nvrtc():
    lib = nvrtc_dir()
    if lib is None:
        pytest.skip("nvidia-cuda-nvrtc (the test extra) is not installed")
    builtins = sorted(lib.glob("libnvrtc-builtins.so.13*"))[0]
    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by name
    return ctypes.CDLL(str(lib / "libnvrtc.so.13"))


def compile_cubin(nvrtc, source: str, arch: str) -> bytes:
    prog = ctypes.c_void_p()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"score_mma.cu", 0, None, None) == 0
    options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in cuda_score.NVRTC_OPTIONS)]
    result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    assert result == 0, f"NVRTC failed ({arch}):\n{log.value.decode()}"
    nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    return cubin.raw


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("d, group, index_dtype, q_dtype", CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_score_kernel_compiles_without_spills(nvrtc, tmp_path, d, group, index_dtype, q_dtype, arch):
    cubin = tmp_path / "score.cubin"
    cubin.write_bytes(compile_cubin(nvrtc, cuda_score.kernel_source(d, group, index_dtype, q_dtype), arch))
    dump = subprocess.run([cuobjdump(), "-res-usage", cubin], capture_output=True, text=True, check=True)
    usage = dump.stdout
    line = next(ln for ln in usage.splitlines() if "REG:" in ln)
    regs, local, stack = (int(re.search(rf"{key}:(\d+)", line).group(1)) for key in ("REG", "LOCAL", "STACK"))
    assert local == 0 and stack == 0, f"spills to local memory: {line.strip()}"
    assert regs <= 128, f"{regs} registers: four 128-thread blocks per SM need <= 128 ({line.strip()})"
    assert cuda_score.KERNEL_NAME in usage


@pytest.mark.parametrize("group", [1, 8, 9, 16])
def test_four_blocks_fit_the_h200_shared_memory(group):
    """The launch bounds ask for four blocks per SM; the G > 8 lse tile is twice as wide."""
    per_block = cuda_score.shared_bytes(128, group) + 1024
    assert 4 * per_block <= H200_SHARED_PER_SM, f"G = {group}: 4 x {per_block} B > {H200_SHARED_PER_SM} B"


def test_kernel_source_defines_the_launch_shape():
    source = cuda_score.kernel_source(128, 16, torch.int64, torch.float16)
    for define in ("HEAD_DIM 128", "GROUP 16", "INDEX_T long long", "Q_FP16 1", "PAGE_UNROLL 1"):
        assert f"#define {define}\n" in source
    assert "#define Q_FP16 0\n" in cuda_score.kernel_source(64, 4, torch.int32)
    with pytest.raises(ValueError, match=r"q_dtype \(torch.float32\) must be one of"):
        cuda_score.kernel_source(64, 4, torch.int32, torch.float32)
