"""The CUDA score kernel's own source, run on the CPU against the torch reference.

The GPU tests (test_cuda_score.py) run only on the lent H200; this test catches fragment-layout
and indexing mistakes before that. kernel_source (the text NVRTC compiles) is built with g++
against a small emulation of what it uses of CUDA: a warp is 32 threads that meet at every warp
collective (shuffle, ballot, __syncwarp, mma.sync); the mma helpers are replaced by host versions
written from the PTX ISA fragment tables of mma.m16n8k32 (s8) and mma.m16n8k16 (f16); cp.async
copies at once. Everything else (fragment packing, basis nibbles, index maps, the lse tile, the
epilogue and the share-average partials) is the kernel's code. The G <= 8 cases, already checked
on the GPU, check the emulation itself. Not covered: timing, the cp.async pipeline's waits,
register limits (test_cuda_source.py), approximate PTX math (exp2 / lg2 are exact here).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from lockserve.kernels.cuda import score as cuda_score

from tests.conftest import assert_close
from tests.kernels.test_triton_score import assert_scores, case_inputs, reference

GXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++ to build the emulated kernel")

# The helpers of score_mma.cu that are inline PTX; the emulation defines its own.
PTX_HELPERS = ("cp_async16", "imma16832", "fast_exp2", "fast_log2", "half_to_float", "and_xor",
               "mma16816_f16", "pack_f16", "int8_pair_f16", "cp_async4")

EMULATION = r"""
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unistd.h>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) __attribute__((aligned(n)))

struct uint2 { unsigned x, y; } __attribute__((aligned(8)));
struct uint4 { unsigned x, y, z, w; } __attribute__((aligned(16)));
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
unsigned char smem[1 << 18] __attribute__((aligned(16)));

// One warp: 32 threads; every collective is deposit -> barrier -> read -> barrier.
struct Warp {
  std::mutex m;
  std::condition_variable cv;
  int arrived = 0;
  unsigned long generation = 0;
  uint32_t slot[32][8];
  void sync() {
    std::unique_lock<std::mutex> lock(m);
    const unsigned long gen = generation;
    if (++arrived == 32) {
      arrived = 0, ++generation;
      cv.notify_all();
      return;
    }
    if (!cv.wait_for(lock, std::chrono::seconds(60), [&] { return generation != gen; })) {
      fprintf(stderr, "emulation: a warp collective waited 60 s (lanes diverged?)\n");
      _exit(3);
    }
  }
};
thread_local Warp* warp_;
thread_local int lane_;

static void full_mask(unsigned mask) {
  if (mask != 0xffffffffu) { fprintf(stderr, "emulation: partial warp mask %x\n", mask); _exit(4); }
}
static void deposit(const void* p, size_t n) { memcpy(warp_->slot[lane_], p, n); warp_->sync(); }
template <class T> static T shfl_from(T v, int src) {
  deposit(&v, sizeof v);
  T r;
  memcpy(&r, warp_->slot[src], sizeof r);
  warp_->sync();
  return r;
}
template <class T> T __shfl_sync(unsigned mask, T v, int src) {
  full_mask(mask);
  return shfl_from(v, src & 31);
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int x) {
  full_mask(mask);
  return shfl_from(v, (lane_ ^ x) & 31);
}
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned d) {
  full_mask(mask);
  const int src = lane_ + (int)d;
  return shfl_from(v, src < 32 ? src : lane_);
}
static unsigned __ballot_sync(unsigned mask, int pred) {
  full_mask(mask);
  const uint32_t mine = pred != 0;
  deposit(&mine, 4);
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= warp_->slot[l][0] << l;
  warp_->sync();
  return r;
}
static void __syncwarp() { warp_->sync(); }

static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline float __frcp_rn(float x) { return 1.0f / x; }
#define __expf(x) expf(x)  // glibc declares its own __expf
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}
static inline size_t __cvta_generic_to_shared(const void* p) { return (const unsigned char*)p - smem; }

typedef unsigned int u32;
typedef unsigned short u16;

static inline float half_to_float(u16 h) { _Float16 f; memcpy(&f, &h, 2); return (float)f; }
static inline u16 float_to_half(float x) {  // round to nearest even, as cvt.rn
  const _Float16 f = (_Float16)x;
  u16 h;
  memcpy(&h, &f, 2);
  return h;
}
static inline float fast_exp2(float x) { return exp2f(x); }
static inline float fast_log2(float x) { return log2f(x); }
static inline u32 and_xor(u32 x, u32 mask, u32 flip) { return (x & mask) ^ flip; }
static inline u32 pack_f16(float lo, float hi) {
  return (u32)float_to_half(lo) | ((u32)float_to_half(hi) << 16);
}
static inline u32 int8_pair_f16(u32 v) {  // sub.rn.f16x2 of the spread bytes, per half
  const u32 a = __byte_perm(v, 0u, 0x4140) ^ 0x64806480u, b = 0x64806480u;
  u32 r = 0;
  for (int e = 0; e < 2; ++e) {
    const float d = half_to_float((u16)(a >> (16 * e))) - half_to_float((u16)(b >> (16 * e)));
    r |= (u32)float_to_half(d) << (16 * e);
  }
  return r;
}
static inline void cp_async16(u32 dst, const void* src, int bytes) {
  if (bytes) memcpy(smem + dst, src, bytes);
  memset(smem + dst + bytes, 0, 16 - bytes);
}
static inline void cp_async4(u32 dst, const void* src, int bytes) {
  if (bytes) memcpy(smem + dst, src, bytes);
  memset(smem + dst + bytes, 0, 4 - bytes);
}

// PTX ISA, mma.m16n8k32 .s8 (.row.col), lane = 4 g + t: A regs 0..3 = (row g, k 4t + j),
// (g + 8, 4t + j), (g, 16 + 4t + j), (g + 8, 16 + 4t + j), byte j; B regs 0, 1 = (k 4t + j,
// col g), (k 16 + 4t + j, col g); C/D i = (row g + 8 (i >> 1), col 2t + (i & 1)).
static void imma16832(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  const u32 mine[6] = {a0, a1, a2, a3, b0, b1};
  deposit(mine, sizeof mine);
  int8_t A[16][32], B[32][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const u32* r = warp_->slot[l];
    for (int j = 0; j < 4; ++j) {
      A[g][4 * t + j] = (int8_t)(r[0] >> (8 * j));
      A[g + 8][4 * t + j] = (int8_t)(r[1] >> (8 * j));
      A[g][16 + 4 * t + j] = (int8_t)(r[2] >> (8 * j));
      A[g + 8][16 + 4 * t + j] = (int8_t)(r[3] >> (8 * j));
      B[4 * t + j][g] = (int8_t)(r[4] >> (8 * j));
      B[16 + 4 * t + j][g] = (int8_t)(r[5] >> (8 * j));
    }
  }
  warp_->sync();
  const int g = lane_ >> 2, t = lane_ & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    int acc = 0;
    for (int k = 0; k < 32; ++k) acc += (int)A[row][k] * (int)B[k][col];
    c[i] += acc;
  }
}

// PTX ISA, mma.m16n8k16 .f16 -> .f32: A regs 0..3 = (row g, k 2t + e), (g + 8, 2t + e),
// (g, 8 + 2t + e), (g + 8, 8 + 2t + e), half e; B regs 0, 1 = (k 2t + e, col g), (k 8 + 2t + e,
// col g); C/D as above.
static void mma16816_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  const u32 mine[6] = {a0, a1, a2, a3, b0, b1};
  deposit(mine, sizeof mine);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    const u32* r = warp_->slot[l];
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = half_to_float((u16)(r[0] >> (16 * e)));
      A[g + 8][2 * t + e] = half_to_float((u16)(r[1] >> (16 * e)));
      A[g][8 + 2 * t + e] = half_to_float((u16)(r[2] >> (16 * e)));
      A[g + 8][8 + 2 * t + e] = half_to_float((u16)(r[3] >> (16 * e)));
      B[2 * t + e][g] = half_to_float((u16)(r[4] >> (16 * e)));
      B[8 + 2 * t + e][g] = half_to_float((u16)(r[5] >> (16 * e)));
    }
  }
  warp_->sync();
  const int g = lane_ >> 2, t = lane_ & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];  // f16 products are exact in float
    c[i] += acc;
  }
}
"""

# Runs the grid warp by warp. Input file: int64 gx, gy, the launcher's shared bytes per block,
# the byte sizes of the 12 pointer arguments, the 9 int arguments, float64 sm_scale, then the 12
# buffers; the last three (s_hat, pmax, psum) are written back to the output file.
DRIVER = r"""
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "rb");
  int64_t head[3 + 12 + 9];
  double sm_scale;
  if (fread(head, 8, 24, f) != 24 || fread(&sm_scale, 8, 1, f) != 1) return 2;
  if (head[2] != (int64_t)WARPS * WARP_BYTES) {
    fprintf(stderr, "launcher shared_bytes %lld != WARPS x WARP_BYTES %lld\n", (long long)head[2],
            (long long)WARPS * WARP_BYTES);
    return 5;
  }
  const int64_t* size = head + 3;
  std::vector<std::vector<unsigned char>> buf(12);
  for (int i = 0; i < 12; ++i) {
    buf[i].resize(size[i] + 16);
    if (fread(buf[i].data(), 1, size[i], f) != (size_t)size[i]) return 2;
  }
  fclose(f);
  const int64_t* n = head + 15;
  void* p[12];
  for (int i = 0; i < 12; ++i) p[i] = buf[i].data();
  for (unsigned by = 0; by < (unsigned)head[1]; ++by)
    for (unsigned bx = 0; bx < (unsigned)head[0]; ++bx)
      for (int w = 0; w < WARPS; ++w) {
        Warp warp;
        std::vector<std::thread> lanes;
        for (int l = 0; l < 32; ++l)
          lanes.emplace_back([&, l] {
            threadIdx = {(unsigned)(32 * w + l), 0, 0};
            blockIdx = {bx, by, 0};
            warp_ = &warp, lane_ = l;
            locks_score_mma((const unsigned short*)p[0], (const u32*)p[1], (const unsigned short*)p[2],
                            (const signed char*)p[3], (const unsigned short*)p[4], (const signed char*)p[5],
                            (const unsigned short*)p[6], (const INDEX_T*)p[7], (const INDEX_T*)p[8],
                            (float*)p[9], (float*)p[10], (float*)p[11], n[0], n[1], n[2], n[3], n[4], n[5],
                            n[6], n[7], n[8], sm_scale);
          });
        for (auto& t : lanes) t.join();
      }
  FILE* o = fopen(argv[2], "wb");
  for (int i = 9; i < 12; ++i) fwrite(buf[i].data(), 1, size[i], o);
  fclose(o);
  return 0;
}
"""


def strip_function(source: str, name: str) -> str:
    """source without the definition of device function `name` (signature through its closing brace)."""
    start = re.search(rf"__device__ __forceinline__ [\w ]+\b{name}\(", source)
    assert start, f"{name} not found in score_mma.cu"
    depth, i = 0, source.index("{", start.end())
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        i += 1
        if depth == 0:
            return source[: start.start()] + source[i:]


def host_source(kernel: str) -> str:
    """kernel_source's text with its inline PTX replaced by the emulation."""
    for name in PTX_HELPERS:
        kernel = strip_function(kernel, name)
    commit = r'asm volatile\("cp\.async\.commit_group;\\n" ::\);'
    wait = r'asm volatile\("cp\.async\.wait_group %0;\\n" ::"n"\(STAGES - 1\)\);'
    kernel, commits = re.subn(commit, ";", kernel)
    kernel, waits = re.subn(wait, ";", kernel)
    assert (commits, waits) == (3, 1), f"cp.async statements changed: {commits} commits, {waits} waits"
    assert not re.search(r"\basm\b", kernel), "score_mma.cu has inline PTX the emulation does not cover"
    return EMULATION + kernel + DRIVER


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("emulated_score")


def build(build_dir: Path, d: int, group: int, index_dtype, q_dtype) -> Path:
    name = f"score_d{d}_g{group}_{str(index_dtype)[6:]}_{str(q_dtype)[6:]}"
    exe = build_dir / name
    if not exe.exists():
        src = build_dir / f"{name}.cpp"
        src.write_text(host_source(cuda_score.kernel_source(d, group, index_dtype, q_dtype)))
        cmd = [GXX, "-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing", "-w", str(src), "-o", str(exe)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, f"g++ failed:\n{done.stderr[-4000:]}"
    return exe


def run_emulated(exe: Path, q, qs, table, num_pages, run: int):
    """The launcher's arguments (kernel_tensors / kernel_scalars / grid_size) through the emulated
    kernel. Returns s_hat [Bt, Hkv, G, P], pmax and psum [Bt, Hkv, G, NB]."""
    bt, hq, d = q.shape
    hkv, p = qs.mu_scale.shape[1], table.shape[1]
    g, nb = hq // hkv, -(-p // cuda_score.PAGES_PER_STAGE)
    s_hat = torch.full((bt, hkv, g, p), float("nan"))
    pmax, psum = torch.full((bt, hkv, g, nb), float("nan")), torch.full((bt, hkv, g, nb), float("nan"))
    tensors = cuda_score.kernel_tensors(q, qs, table, num_pages.to(table.dtype), s_hat, pmax, psum)
    assert all(t.is_contiguous() for t in tensors)
    *ints, sm_scale = cuda_score.kernel_scalars(q, qs, table, partials=True, run=run)
    gx, gy, _ = cuda_score.grid_size(nb, hkv, bt, run)
    blobs = [t.view(torch.uint8).numpy().tobytes() for t in tensors]
    nbytes = [len(b) for b in blobs]
    header = struct.pack("<24qd", gx, gy, cuda_score.shared_bytes(d, g), *nbytes, *ints, sm_scale)
    inp, out = exe.with_suffix(".in"), exe.with_suffix(".out")
    inp.write_bytes(header + b"".join(blobs))
    done = subprocess.run([exe, inp, out], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"emulated kernel failed ({done.returncode}): {done.stderr[-2000:]}"
    flat = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.float32)
    parts = flat.split([s_hat.numel(), pmax.numel(), psum.numel()])
    return [x.view(t.shape) for x, t in zip(parts, (s_hat, pmax, psum), strict=True)]


def reference_partials(ref: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 8-page group: max and sum exp(s - max) of the reference scores (0 for an empty group)."""
    p = ref.shape[-1]
    padded = torch.full((*ref.shape[:-1], nb * cuda_score.PAGES_PER_STAGE), float("-inf"))
    padded[..., :p] = ref
    groups = padded.unflatten(-1, (nb, cuda_score.PAGES_PER_STAGE))
    m = groups.amax(-1)
    return m, torch.exp(groups - torch.where(torch.isfinite(m), m, 0)[..., None]).sum(-1)


# (Bt, Hkv, G, d, r, basis_bits, q dtype, P, num_pages), page-table dtype, stages per warp.
# G <= 8 rows check the emulation on paths the GPU has verified (PACK3, the q3 mma).
CASES = [
    ((2, 2, 16, 128, 8, 4, torch.bfloat16, 21, [21, 9]), torch.int32, 2),
    ((2, 1, 16, 64, 8, 4, torch.float16, 17, [17, 0]), torch.int64, 1),
    ((1, 2, 12, 32, 8, 4, torch.float16, 13, [13]), torch.int32, 1),
    ((2, 1, 9, 96, 8, 4, torch.bfloat16, 11, [5, 11]), torch.int64, 2),
    ((2, 2, 4, 128, 8, 4, torch.bfloat16, 19, [19, 6]), torch.int32, 2),
    ((1, 2, 7, 64, 8, 4, torch.float16, 10, [10]), torch.int64, 1),
]


def case_id(c) -> str:
    (bt, hkv, g, d, _, _, q_dtype, p, _), index_dtype, run = c
    return f"Bt{bt}-Hkv{hkv}-G{g}-d{d}-{str(q_dtype)[6:]}-P{p}-{str(index_dtype)[6:]}-run{run}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_emulated_cuda_kernel_matches_reference(build_dir, case):
    shape, index_dtype, run = case
    q, qs, table, num_pages = case_inputs(shape, "cpu", seed=41)
    table = table.to(index_dtype)
    exe = build(build_dir, shape[3], shape[2], index_dtype, shape[6])
    s_hat, pmax, psum = run_emulated(exe, q, qs, table, num_pages, run)
    ref = reference(q, qs, table, num_pages)
    assert_scores(s_hat, ref, f"emulated s_hat {case_id(case)}")
    m_ref, s_ref = reference_partials(ref, pmax.shape[-1])
    assert torch.equal(torch.isfinite(pmax), torch.isfinite(m_ref)), "emulated pmax: finite pattern differs"
    finite = torch.isfinite(m_ref)
    assert_close(pmax[finite], m_ref[finite], f"emulated pmax {case_id(case)}")
    assert_close(psum, s_ref, f"emulated psum {case_id(case)}")
