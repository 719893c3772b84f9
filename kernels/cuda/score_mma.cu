// LOCKS scoring (Eq. 4) from quantised summaries on the tensor cores (sm_80+, tuned on the H200).
//
// Shipped summary format only: B = 16 keys per page, r = 8, basis int4 stored by rows in the
// fragment order of kernels/summary.py basis_d_order (one 16-byte load gives a lane its codes),
// coefficients and centroid int8, fp16 scales; q bf16; G <= 8 query heads per KV head. The
// launcher (kernels/cuda/score.py) checks all of that and compiles this file with NVRTC, defining
//   HEAD_DIM (32, 64, 96 or 128), GROUP (1..8), INDEX_T (int or long long: the table's type).
//
// One warp scores a run of `run` consecutive groups of 8 pages of one (sequence b, KV head h)
// for the G heads, two groups in flight: while it computes group j from shared memory, cp.async
// copies group j + 1's summaries (816 B a page at d = 128) into the other stage. Per group:
//   1. Per page: proj[g, c] = q_g . V_c on mma.m16n8k16 (A = q, rows g; B = basis codes,
//      columns c; K = d), scaled by the basis scales, split into bf16 hi + lo rows, then
//      dev[g, i] = sum_c proj[g, c] C[i, c] on mma.m16n8k8 (B = coefficient codes, columns i),
//      and the log-sum-exp over the 16 keys (Eq. 4 without the centroid term).
//   2. centre[p, g] = mu_p . q_g for the 8 pages on mma.m16n8k16 (A = centroid codes, rows p),
//      added last: lse_i(centre + x_i) = centre + lse_i(x_i).
//   3. s_hat, and (for the share-average) the group's max and sum exp per head.
// Codes are exact in bf16 and products are exact in the tensor cores (fp32 accumulation), so the
// only rounding beyond float32 is proj's hi + lo split (16 significant bits).
//
// Fragment maps (PTX ISA, mma.m16n8k16 / m16n8k8 with .row.col): lane = 4 * gid + tig;
// A regs hold (row gid | gid + 8, k pair), B regs (k pair, column gid), C (row gid | gid + 8,
// columns 2 tig, 2 tig + 1). The contraction index k of each 16-wide step kk maps to
// d = 16 kk + 4 tig + {0, 1} (k = 2 tig, 2 tig + 1) and + {2, 3} (k = 2 tig + 8, 2 tig + 9), so
// that a lane's four dimensions of q are one 8-byte load (the basis codes are stored in this
// order already).

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined (64 or 128)"
#endif
#ifndef GROUP
#error "GROUP must be defined (1..8)"
#endif
#ifndef INDEX_T
#define INDEX_T int
#endif
#ifndef PAGE_UNROLL
#define PAGE_UNROLL 2
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define PAGE_KEYS 16
#define RANK 8
#define PAGES 8     // pages per stage: a warp computes one stage while the next one loads
#define WARPS 4     // warps per block
#define KSTEPS (HEAD_DIM / 16)
// Shared-memory image of one page's summary (bytes): basis words, coef, mu, basis / coef scales.
#define OFF_COEF (HEAD_DIM * 4)
#define OFF_MU (OFF_COEF + PAGE_KEYS * RANK)
#define OFF_BSCALE (OFF_MU + HEAD_DIM)
#define OFF_CSCALE (OFF_BSCALE + RANK * 2)
#define PAGE_BYTES (OFF_CSCALE + PAGE_KEYS * 2)
#define STAGE_BYTES (PAGES * PAGE_BYTES)
#define WARP_BYTES (2 * STAGE_BYTES + PAGES * 8 * 4)  // two stages + lse [PAGES][8] float

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 128, "HEAD_DIM: a multiple of 32, at most 128");
static_assert(GROUP >= 1 && GROUP <= 8, "GROUP: 1..8");
static_assert(PAGE_BYTES % 16 == 0, "page image must keep 16-byte alignment");

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  // bytes = 0 zero-fills the destination without reading src
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void mma16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma1688(float* c, u32 a0, u32 a1, u32 b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// bf16x2 {lo, hi} of two floats
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
  return f;
}

// Pair m (nibbles m and m + 4) of a basis word as the bf16x2 {code, code}: the nibbles land in
// bits 0-3 and 16-19, then in the mantissa of 128.0 (0x4300 | (u ^ 8) = 136 + code, exact in
// bf16), and 136 is subtracted in bf16x2 (exact).
__device__ __forceinline__ u32 code_pair(u32 w, int m) {
  u32 r, out;
  // ((w >> 4m) & 0x000F000F) ^ 0x43084308 in one LOP3 (lut 0x6a = (a & b) ^ c)
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(r) : "r"(w >> (4 * m)), "n"(0x000F000F), "r"(0x43084308u));
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(out) : "r"(r), "r"(0x43084308u));
  return out;
}

__device__ __forceinline__ u32 load_opaque(const unsigned short* p) {
  u32 v;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

// Two signed int8 codes (bytes 0, 1 of v) as bf16x2 (exact).
__device__ __forceinline__ u32 int8_pair(u32 v) {
  return pack_bf16((float)(signed char)(v & 0xFF), (float)(signed char)((v >> 8) & 0xFF));
}

struct Page {
  const unsigned char* base;  // shared-memory image
};

// Eq. 4 without the centroid term, in log2 units (scaled by k2 = sm_scale * log2 e), for the
// lane's head row g = gid; valid in lanes with tig == 0.
__device__ __forceinline__ float page_lse2(const unsigned char* pg, const u32 (&qa)[KSTEPS][4],
                                           int gid, int tig, float k2) {
  // The lane's basis words: row c = gid, words tig * d / 32 .. (kernels/summary.py basis_d_order):
  // word j holds the operand pairs of steps 2j (pairs 0, 1) and 2j + 1 (pairs 2, 3).
  constexpr int WORDS = HEAD_DIM / 32;
  u32 w[WORDS];
  const u32* row = reinterpret_cast<const u32*>(pg) + gid * (HEAD_DIM / 8) + tig * WORDS;
  if constexpr (WORDS == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(row);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (WORDS == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(row);
    w[0] = v.x, w[1] = v.y;
  } else {
#pragma unroll
    for (int j = 0; j < WORDS; ++j) w[j] = row[j];
  }
  // Two accumulators (even and odd steps) halve the chain of dependent mma.
  float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const u32 word = w[kk >> 1];
    const int m = 2 * (kk & 1);
    mma16816(c[kk & 1], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], code_pair(word, m),
             code_pair(word, m + 1));
  }
  // c[0], c[1] = proj[g][2 tig], proj[g][2 tig + 1] in code units (c[2], c[3] repeat them).
  u32 bs = *reinterpret_cast<const u32*>(pg + OFF_BSCALE + 4 * tig);
  float x0 = (c[0][0] + c[1][0]) * half_to_float((u16)(bs & 0xFFFF));
  float x1 = (c[0][1] + c[1][1]) * half_to_float((u16)(bs >> 16));
  u32 hi = pack_bf16(x0, x1);
  float h0 = __uint_as_float(hi << 16), h1 = __uint_as_float(hi & 0xFFFF0000u);
  u32 lo = pack_bf16(x0 - h0, x1 - h1);
  // dev[g][i] for i = 2 tig, 2 tig + 1 (n-tile 0) and 8 + 2 tig, 9 + 2 tig (n-tile 1).
  const unsigned char* coef = pg + OFF_COEF;
  u32 cw0 = *reinterpret_cast<const u16*>(coef + gid * RANK + 2 * tig);
  u32 cw1 = *reinterpret_cast<const u16*>(coef + (gid + 8) * RANK + 2 * tig);
  float e0[4] = {0.f, 0.f, 0.f, 0.f}, e1[4] = {0.f, 0.f, 0.f, 0.f};
  mma1688(e0, hi, lo, int8_pair(cw0));
  mma1688(e1, hi, lo, int8_pair(cw1));
  u32 cs0 = *reinterpret_cast<const u32*>(pg + OFF_CSCALE + 4 * tig);
  u32 cs1 = *reinterpret_cast<const u32*>(pg + OFF_CSCALE + 16 + 4 * tig);
  float l0 = (e0[0] + e0[2]) * half_to_float((u16)(cs0 & 0xFFFF)) * k2;
  float l1 = (e0[1] + e0[3]) * half_to_float((u16)(cs0 >> 16)) * k2;
  float l2 = (e1[0] + e1[2]) * half_to_float((u16)(cs1 & 0xFFFF)) * k2;
  float l3 = (e1[1] + e1[3]) * half_to_float((u16)(cs1 >> 16)) * k2;
  float m = fmaxf(fmaxf(l0, l1), fmaxf(l2, l3));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  float s = fast_exp2(l0 - m) + fast_exp2(l1 - m) + fast_exp2(l2 - m) + fast_exp2(l3 - m);
  s += __shfl_xor_sync(0xffffffffu, s, 1);
  s += __shfl_xor_sync(0xffffffffu, s, 2);
  return m + fast_log2(s);
}

// centre[p][g] = mu_p . q_g (code units) for a stage's 8 pages: the lane holds page gid, heads
// 2 tig, 2 tig + 1 in c[0], c[1] (rows gid + 8 of A are zero).
__device__ __forceinline__ void centres(const unsigned char* stage, const u32 (&qa)[KSTEPS][4],
                                        int gid, int tig, float* c) {
  const unsigned char* mu = stage + gid * PAGE_BYTES + OFF_MU;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    u32 w = *reinterpret_cast<const u32*>(mu + 16 * kk + 4 * tig);
    mma16816(c, int8_pair(w), 0u, int8_pair(w >> 16), 0u, qa[kk][0], qa[kk][2]);
  }
}

struct Args {
  const unsigned short* __restrict__ q;  // [Bt, Hq, d] bf16, d contiguous
  const u32* basis;              // [N, Hkv, d] words
  const unsigned short* bscale;  // [N, Hkv, r] fp16
  const signed char* coef;       // [N, Hkv, B, r]
  const unsigned short* cscale;  // [N, Hkv, B] fp16
  const signed char* mu;         // [N, Hkv, d]
  const unsigned short* mscale;  // [N, Hkv] fp16
  const INDEX_T* table;          // [Bt, P], row stride st_b, unit column stride
  const INDEX_T* num_pages;      // [Bt]
  float* s_hat;                  // [Bt, Hkv, G, P] contiguous
  float* pmax;                   // [Bt, Hkv, G, NB] if partials
  float* psum;
  int P, NB, num_ids, hkv, sq_b, sq_h, st_b, partials;
};

// What a stage's compute needs to know of its copies: valid pages (bit p) and, in lane p < 8,
// page p's centroid scale.
struct Stage {
  u32 valid;
  float ms;
};

// A lane's share of copying one page (fixed for the kernel): 16 B of the basis at basis_src +
// row * 4d (lanes < d / 4), and one 16-byte chunk of the small fields: lanes 0-7 coef, then mu,
// then the basis scales (1 chunk) and the coef scales (2 chunks); later lanes copy no small field.
struct LaneCopy {
  const char* basis_src;
  const char* small_src;
  int small_stride;  // bytes per summary row
  u32 small_off;     // in the page image
  bool basis, small;
};

__device__ __forceinline__ LaneCopy lane_copy(const Args& a, int lane) {
  const int mu_end = 8 + HEAD_DIM / 16;
  LaneCopy c;
  c.basis_src = (const char*)a.basis + 16 * lane;
  c.basis = lane < HEAD_DIM / 4;
  c.small = lane <= mu_end + 2;
  if (lane < 8) {
    c.small_src = (const char*)a.coef + 16 * lane, c.small_stride = PAGE_KEYS * RANK;
    c.small_off = OFF_COEF + 16 * lane;
  } else if (lane < mu_end) {
    c.small_src = (const char*)a.mu + 16 * (lane - 8), c.small_stride = HEAD_DIM;
    c.small_off = OFF_MU + 16 * (lane - 8);
  } else if (lane == mu_end) {
    c.small_src = (const char*)a.bscale, c.small_stride = RANK * 2, c.small_off = OFF_BSCALE;
  } else {
    const int k = c.small ? lane - mu_end - 1 : 0;
    c.small_src = (const char*)a.cscale + 16 * k, c.small_stride = PAGE_KEYS * 2;
    c.small_off = OFF_CSCALE + 16 * k;
  }
  return c;
}

// Start copying group grp's 8 pages of head h into the stage at smem address dst (one commit
// group). Lane p < 8 resolves page p: ids outside [0, N) and positions past num_pages or P are
// not read (zero-filled) and score -inf.
__device__ __forceinline__ Stage issue_stage(const Args& a, const LaneCopy& lc, int b, int h, int grp,
                                             i64 n_b, u32 dst, int lane) {
  const int pos = grp * PAGES + (lane & (PAGES - 1));
  i64 id = 0;
  bool valid = false;
  if (lane < PAGES && pos < a.P && pos < n_b) {
    id = (i64)a.table[(i64)b * a.st_b + pos];
    valid = id >= 0 && id < a.num_ids;
  }
  Stage st;
  st.valid = __ballot_sync(0xffffffffu, valid) & ((1u << PAGES) - 1);
  const i64 row = valid ? id * a.hkv + h : 0;  // summary row (page id, head)
  st.ms = valid ? half_to_float(a.mscale[row]) : 0.f;
#pragma unroll
  for (int p = 0; p < PAGES; ++p) {
    const i64 r = __shfl_sync(0xffffffffu, row, p);
    const int bytes = ((st.valid >> p) & 1u) ? 16 : 0;
    const u32 page = dst + p * PAGE_BYTES;
    if (lc.basis) cp_async16(page + 16 * lane, lc.basis_src + r * (HEAD_DIM * 4), bytes);
    if (lc.small) cp_async16(page + lc.small_off, lc.small_src + r * lc.small_stride, bytes);
  }
  asm volatile("cp.async.commit_group;\n" ::);
  return st;
}

// Score a landed stage: s_hat for its pages and, if partials, the group's (max, sum exp).
__device__ __forceinline__ void compute_stage(const Args& a, const unsigned char* stage, Stage st,
                                              float* lse, const u32 (&qa)[KSTEPS][4], int b, int h,
                                              int grp, int gid, int tig, float sm_scale) {
  const float k2 = sm_scale * 1.4426950408889634f;
#pragma unroll PAGE_UNROLL
  for (int p = 0; p < PAGES; ++p) {  // pages interleaved: independent chains for the scheduler
    float l = page_lse2(stage + p * PAGE_BYTES, qa, gid, tig, k2);
    if (tig == 0) lse[p * 8 + gid] = l;
  }
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  centres(stage, qa, gid, tig, c);
  __syncwarp();
  // s_hat = lse + centre * mu_scale * sm_scale (natural-log units); lane: page gid, heads 2 tig + e
  const float msc = __shfl_sync(0xffffffffu, st.ms, gid);
  const bool ok = (st.valid >> gid) & 1u;
  const int pp = grp * PAGES + gid;
  const float neg_inf = -__int_as_float(0x7f800000);
  float out[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int g = 2 * tig + e;
    out[e] = ok ? lse[gid * 8 + g] * 0.6931471805599453f + c[e] * msc * sm_scale : neg_inf;
    if (g < GROUP && pp < a.P) a.s_hat[(((i64)b * a.hkv + h) * GROUP + g) * a.P + pp] = out[e];
  }
  __syncwarp();  // lse is rewritten by the next stage
  if (!a.partials) return;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float m = out[e];
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
    float s = __expf(out[e] - (m == neg_inf ? 0.f : m));
    s += __shfl_xor_sync(0xffffffffu, s, 4);
    s += __shfl_xor_sync(0xffffffffu, s, 8);
    s += __shfl_xor_sync(0xffffffffu, s, 16);
    const int g = 2 * tig + e;
    if (gid == 0 && g < GROUP) {
      const i64 o = (((i64)b * a.hkv + h) * GROUP + g) * a.NB + grp;
      a.pmax[o] = m;
      a.psum[o] = s;
    }
  }
}

// Grid (cdiv(cdiv(NB, run) * Hkv, WARPS), Bt): warp item = (run of groups, head), heads fastest so
// that neighbouring warps read neighbouring summary rows.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) locks_score_mma(
    const unsigned short* q, const u32* basis, const unsigned short* bscale, const signed char* coef,
    const unsigned short* cscale, const signed char* mu, const unsigned short* mscale,
    const INDEX_T* table, const INDEX_T* num_pages, float* s_hat, float* pmax, float* psum, int P,
    int NB, int num_ids, int hkv, int sq_b, int sq_h, int st_b, int partials, int run,
    double sm_scale_d) {
  const Args a = {q, basis, bscale, coef, cscale, mu, mscale, table, num_pages, s_hat, pmax, psum,
                  P, NB, num_ids, hkv, sq_b, sq_h, st_b, partials};
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int item = blockIdx.x * WARPS + warp;
  const int h = item % a.hkv, first = (item / a.hkv) * run;
  const int b = blockIdx.y;
  if (first >= a.NB) return;
  const int last = min(first + run, a.NB);
  unsigned char* stages = smem + warp * WARP_BYTES;
  float* lse = reinterpret_cast<float*>(stages + 2 * STAGE_BYTES);  // [PAGES][8]
  const u32 stages_addr = (u32)__cvta_generic_to_shared(stages);
  const i64 n_b = (i64)a.num_pages[b];
  const LaneCopy lc = lane_copy(a, lane);
  Stage cur = issue_stage(a, lc, b, h, first, n_b, stages_addr, lane);

  // q fragments of head row g = gid (zero for g >= G); also the B operand of the centres.
  u32 qa[KSTEPS][4];  // {q[g][d0, d1], the same, q[g][d2, d3], the same}
  const unsigned short* qg = a.q + (i64)b * a.sq_b + (i64)(h * GROUP + gid) * a.sq_h;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const bool row_ok = gid < GROUP;
    qa[kk][0] = row_ok ? *reinterpret_cast<const u32*>(qg + 16 * kk + 4 * tig) : 0u;
    qa[kk][2] = row_ok ? *reinterpret_cast<const u32*>(qg + 16 * kk + 4 * tig + 2) : 0u;
    // Rows g + 8 of A repeat rows g (C's rows g + 8 are then ignored): loaded again through
    // volatile asm so that they stay in the operand registers instead of being re-made each mma.
    qa[kk][1] = row_ok ? load_opaque(qg + 16 * kk + 4 * tig) : 0u;
    qa[kk][3] = row_ok ? load_opaque(qg + 16 * kk + 4 * tig + 2) : 0u;
  }
  const float sm_scale = (float)sm_scale_d;
  for (int grp = first; grp < last; ++grp) {
    const int s = (grp - first) & 1;
    Stage next = cur;
    if (grp + 1 < last) {
      next = issue_stage(a, lc, b, h, grp + 1, n_b, stages_addr + (s ^ 1) * STAGE_BYTES, lane);
      asm volatile("cp.async.wait_group 1;\n" ::);  // this stage's copies have landed
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncwarp();
    compute_stage(a, stages + s * STAGE_BYTES, cur, lse, qa, b, h, grp, gid, tig, sm_scale);
    cur = next;
  }
}
