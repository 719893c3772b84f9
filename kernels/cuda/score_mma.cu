// LOCKS scoring (Eq. 4) from quantised summaries on the tensor cores (sm_80+, tuned on the H200).
//
// Shipped summary format only: B = 16 keys per page, r = 8, basis int4 stored by rows in the
// fragment order of kernels/summary.py basis_d_order (one 16-byte load gives a lane its codes),
// coefficients and centroid int8, fp16 scales; q bf16 or fp16; G <= 16 query heads per KV head.
// The launcher (kernels/cuda/score.py) checks all of that and compiles this file with NVRTC,
// defining
//   HEAD_DIM (32, 64, 96 or 128), GROUP (1..16), INDEX_T (int or long long: the table's type),
//   Q_FP16 (0: q bf16, 1: q fp16), PAGES (8), STAGES (2), PAGE_UNROLL (4, 2 or 1).
//
// One warp scores a run of `run` consecutive stages of PAGES pages of one (sequence b, KV head h)
// for the G heads, STAGES stages in flight: while it computes stage j from shared memory,
// cp.async copies stage j + 1's summaries (816 B a page at d = 128) into another buffer, and the
// page ids of stage j + 2 are read. Per stage:
//   1. Per page (PAGE_UNROLL pages interleaved): proj[g, c] = q_g . V_c on integer mma.m16n8k32
//      (A = q as int8 splits; B = basis codes + 8, columns c; K = d), times the basis scales,
//      split into fp16 hi + lo; dev[g, i] = sum_c proj[g, c] C[i, c] on mma.m16n8k16 (k 0..7 hi,
//      k 8..15 lo, B = the coefficient codes twice, columns i); the log-sum-exp over the 16 keys
//      (Eq. 4 without the centroid term).
//   2. centre[p, g] = mu_p . q_g for the stage's pages on mma.m16n8k32 (A = centroid codes, rows
//      p; B = the q splits). It is added last: lse_i(centre + x_i) = centre + lse_i(x_i).
//   3. s_hat, and (for the share-average) the stage's max and sum exp per head.
// q is split per head g as q ~ s1 q1 + s2 q2 + s3 q3 (int8, s_{k+1} = s_k / 254: the error is
// ~2^-24 of max |q_g|; two splits failed the float32 tolerance); integer products are exact and
// the codes' +8 offset is removed exactly in int32, so the rounding beyond float32 is proj's
// fp16 hi + lo split (22 significant bits) before the coefficient mma. bf16 and fp16 q differ
// only in the conversion to float before the split.
//
// Fragment maps (PTX ISA, mma .row.col; lane = 4 gid + tig): m16n8k32 s8: A a0 / a2 = row gid,
// k 4 tig .. + 3 / k 16 + 4 tig .. + 3, a1 / a3 the same for row gid + 8; B b0 / b1 = column gid,
// the same k; C c0, c1 = row gid, columns 2 tig, 2 tig + 1, c2, c3 = row gid + 8. Step kk's k maps
// to d = 32 kk + 8 tig + {0..3} (b0) and + {4..7} (b1): a lane's 8 dimensions are contiguous.
// m16n8k16 f16: A a0a1 = row gid, k 2 tig, 2 tig + 1, a2a3 = row gid + 8, a4a5 / a6a7 = k + 8;
// B b0b1 = k 2 tig, 2 tig + 1, b2b3 = k + 8, column gid.
// G <= 8 (one head row per lane, ROWS = 1, QFrags): rows of the q operand g = q1 of head g,
// g + 8 = q2; q3 has its own mma, or for G <= 4 rides in rows 4..7 (PACK3). The coefficient mma
// repeats head g on rows g and g + 8; the centre mma has pages on rows, heads on columns.
// G = 9..16 (two head rows per lane, ROWS = 2, QFrags16): rows gid and gid + 8, each in the
// G <= 8 layout; per page and step three mmas share the basis operands (q1 / q2 of heads 0..7,
// the same of heads 8..15, q3 of head g on row g and of head g + 8 on row g + 8), and the
// coefficient mma takes head g on row g and head g + 8 on row g + 8, so it costs what it costs
// for G <= 8. To fit 128 registers (at PAGE_UNROLL 1) the basis codes enter signed and times 16
// (no +8 offset, no row sums kept), and the centre mma is transposed: A = the q fragments (heads
// on rows), B = the centroid codes (pages on columns), 3 mmas per step for all 16 heads, each row
// scaled by its own lane's scales.

#ifndef HEAD_DIM
#error "HEAD_DIM must be defined (32, 64, 96 or 128)"
#endif
#ifndef GROUP
#error "GROUP must be defined (1..16)"
#endif
#ifndef Q_FP16
#define Q_FP16 0
#endif
#ifndef INDEX_T
#define INDEX_T int
#endif
#ifndef PAGE_UNROLL
#define PAGE_UNROLL 4
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#define PAGE_KEYS 16
#define RANK 8
#ifndef PAGES
#define PAGES 8     // pages per stage (8 or 4)
#endif
#ifndef STAGES
#define STAGES 2    // stages in flight per warp: it computes one while the others load
#endif
#define WARPS 4     // warps per block
#define KSTEPS (HEAD_DIM / 32)
// Shared-memory image of one page's summary (bytes): basis words, coef, mu, basis / coef scales.
#define OFF_COEF (HEAD_DIM * 4)
#define OFF_MU (OFF_COEF + PAGE_KEYS * RANK)
#define OFF_BSCALE (OFF_MU + HEAD_DIM)
#define OFF_CSCALE (OFF_BSCALE + RANK * 2)
#define PAGE_BYTES (OFF_CSCALE + PAGE_KEYS * 2)
#define STAGE_BYTES (PAGES * PAGE_BYTES)
#define ROWS (GROUP > 8 ? 2 : 1)                      // head rows per lane: gid (and gid + 8)
#define LSE_ROW (8 * ROWS)                            // heads per page in the lse tile
#define LSE_BYTES (PAGES * LSE_ROW * 4)               // lse [PAGES][LSE_ROW] float
#define INFO_BYTES (STAGES * (PAGES + 4) * 4)           // per stage: ms [PAGES] float, valid u32, pad
#define WARP_BYTES (STAGES * STAGE_BYTES + LSE_BYTES + INFO_BYTES)

static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 128, "HEAD_DIM: a multiple of 32, at most 128");
static_assert(GROUP >= 1 && GROUP <= 16, "GROUP: 1..16");
static_assert(PAGE_BYTES % 16 == 0, "page image must keep 16-byte alignment");
static_assert(PAGES == 4 || PAGES == 8, "PAGES: 4 or 8 (the centre mma has 8 rows per lane group)");
static_assert(PAGES % PAGE_UNROLL == 0, "PAGE_UNROLL must divide PAGES");

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
  // bytes = 0 zero-fills the destination without reading src
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void imma16832(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
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

__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

// An element of q (bf16, or fp16 where Q_FP16) as float, exactly.
__device__ __forceinline__ float q_to_float(u16 h) { return Q_FP16 ? half_to_float(h) : bf16_to_float(h); }

// (x & mask) ^ flip in one LOP3 (lut 0x6a = (a & b) ^ c)
__device__ __forceinline__ u32 and_xor(u32 x, u32 mask, u32 flip) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(r) : "r"(x), "r"(mask), "r"(flip));
  return r;
}

__device__ __forceinline__ void mma16816_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// fp16x2 {lo, hi} of two floats
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Two signed int8 codes (bytes 0, 1 of v) as fp16x2, exactly: each byte ^ 0x80 (= code + 128) in
// the mantissa of 1024.0, then 1152 subtracted.
__device__ __forceinline__ u32 int8_pair_f16(u32 v) {
  const u32 spread = __byte_perm(v, 0u, 0x4140);  // byte 0 -> bits 0-7, byte 1 -> bits 16-23
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(spread ^ 0x64806480u), "r"(0x64806480u));
  return r;
}

// Four signed bytes from four ints in [-128, 127].
__device__ __forceinline__ u32 pack_s8(int a, int b, int c, int d) {
  return (u32)(a & 0xFF) | ((u32)(b & 0xFF) << 8) | ((u32)(c & 0xFF) << 16) | ((u32)(d & 0xFF) << 24);
}

// The lane's view of its q row g = gid: int8 A fragments of the splits (qa[kk] = {q1 d0..3,
// q2 d0..3, q1 d4..7, q2 d4..7} of step kk, q3[kk] = {q3 d0..3, q3 d4..7}), the row's scales and
// sums over d (to remove the +8 offset of the basis codes), and the scales of the heads of the
// lane's C columns in the centre mma (2 tig + e).
// PACK3 (G <= 4): the third split rides in the spare A rows 4..7 (lanes gid + 4 hold q3 of head
// gid in their a0 / a2), so one mma per step serves all three; otherwise q3 has its own mma.
constexpr bool PACK3 = GROUP <= 4;

struct QFrags {
  u32 qa[KSTEPS][4];
  u32 q3[KSTEPS][2];
  float row_s[3];  // times k2 = sm_scale * log2 e: proj comes out in log2 logit units
  int row_sum[3];
  float s[3][2];
};

__device__ __forceinline__ QFrags load_q(const unsigned short* qg, bool row_ok, int gid, int tig, float k2) {
  float v[KSTEPS][8];
  float amax = 0.f;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    const uint4 w = row_ok ? *reinterpret_cast<const uint4*>(qg + 32 * kk + 8 * tig) : make_uint4(0, 0, 0, 0);
    const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      v[kk][e] = q_to_float((u16)(words[e >> 1] >> (16 * (e & 1))));
      amax = fmaxf(amax, fabsf(v[kk][e]));
    }
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  float scale[3];
  scale[0] = amax > 0.f ? amax * (1.f / 127.f) : 1.f;
  scale[1] = scale[0] * (1.f / 254.f);
  scale[2] = scale[1] * (1.f / 254.f);
  QFrags f;
  int sum[3] = {0, 0, 0};
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    int qk[3][8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float rest = v[kk][e];
#pragma unroll
      for (int k = 0; k < 3; ++k) {  // each split takes the rounding remainder of the previous
        qk[k][e] = max(-127, min(127, __float2int_rn(rest * __frcp_rn(scale[k]))));
        rest -= qk[k][e] * scale[k];
        sum[k] += qk[k][e];
      }
    }
    const u32 lo[3] = {pack_s8(qk[0][0], qk[0][1], qk[0][2], qk[0][3]), pack_s8(qk[1][0], qk[1][1], qk[1][2], qk[1][3]),
                       pack_s8(qk[2][0], qk[2][1], qk[2][2], qk[2][3])};
    const u32 hi[3] = {pack_s8(qk[0][4], qk[0][5], qk[0][6], qk[0][7]), pack_s8(qk[1][4], qk[1][5], qk[1][6], qk[1][7]),
                       pack_s8(qk[2][4], qk[2][5], qk[2][6], qk[2][7])};
    const bool third = PACK3 && gid >= 4;  // rows 4..7: q3 of head gid - 4; rows 12..15: zero
    f.qa[kk][0] = third ? lo[2] : lo[0];
    f.qa[kk][1] = third ? 0u : lo[1];
    f.qa[kk][2] = third ? hi[2] : hi[0];
    f.qa[kk][3] = third ? 0u : hi[1];
    f.q3[kk][0] = lo[2];
    f.q3[kk][1] = hi[2];
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 1);
    sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], 2);
    f.row_s[k] = scale[k] * k2, f.row_sum[k] = sum[k];
    // Row g's scales live in lanes 4 g + *; this lane's centre columns are heads 2 tig + e.
#pragma unroll
    for (int e = 0; e < 2; ++e) f.s[k][e] = __shfl_sync(0xffffffffu, scale[k], 4 * (2 * tig + e));
  }
  return f;
}

// G = 9..16: the lane's two head rows, gid and gid + 8 (r = 0, 1), in the layout of QFrags
// (PACK3 is false for G > 4): qa[r] as QFrags.qa; q3[kk] = {row gid d0..3, row gid + 8 d0..3,
// row gid d4..7, row gid + 8 d4..7} of the third split, the A operand of one mma for both rows.
// Registers are what G = 16 runs short of: the basis codes enter its mmas signed and times 16
// (their nibbles in the high halves of bytes), so no row sums are kept, and the centre mma is
// transposed, so no other heads' scales are.
struct QFrags16 {
  u32 qa[2][KSTEPS][4];
  u32 q3[KSTEPS][4];
  float row_s16[2][3];  // QFrags.row_s / 16
};

template <int R>
struct QFragsOf {
  typedef QFrags type;
};
template <>
struct QFragsOf<2> {
  typedef QFrags16 type;
};
typedef QFragsOf<ROWS>::type QF;  // the q fragments of this GROUP

// The lane's basis words of NP pages: row c = gid, words tig * d / 32 .. (kernels/summary.py
// basis_d_order); word kk holds codes d = 32 kk + 8 tig + b (low nibble of byte b) and + 4 + b
// (high nibble).
template <int NP>
__device__ __forceinline__ void basis_words(const unsigned char* const (&pg)[NP], int gid, int tig,
                                            u32 (&w)[NP][KSTEPS]) {
#pragma unroll
  for (int u = 0; u < NP; ++u) {
    const u32* row = reinterpret_cast<const u32*>(pg[u]) + gid * (HEAD_DIM / 8) + tig * KSTEPS;
    if constexpr (KSTEPS == 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(row);
      w[u][0] = v.x, w[u][1] = v.y, w[u][2] = v.z, w[u][3] = v.w;
    } else if constexpr (KSTEPS == 2) {
      const uint2 v = *reinterpret_cast<const uint2*>(row);
      w[u][0] = v.x, w[u][1] = v.y;
    } else {
#pragma unroll
      for (int j = 0; j < KSTEPS; ++j) w[u][j] = row[j];
    }
  }
}

// x as fp16x2 hi + lo (hi + lo = x to 22 significant bits).
__device__ __forceinline__ void split_hi_lo(const float (&x)[2], u32& hi, u32& lo) {
  hi = pack_f16(x[0], x[1]);
  lo = pack_f16(x[0] - half_to_float((u16)(hi & 0xFFFF)), x[1] - half_to_float((u16)(hi >> 16)));
}

// proj[g][2 tig + e] of a lane's head row (scales row_s, sums row_sum) from the split products
// (c1, c2, c3: q1, q2, q3 . V at columns 2 tig + e, codes + 8) = sum_k s_k (C_k - 8 sum_d q_k)
// (the +8 removed exactly in int32), times the basis scales bs (fp16x2 of columns 2 tig,
// 2 tig + 1); then split into fp16x2 hi + lo.
__device__ __forceinline__ void proj_hi_lo(const float (&row_s)[3], const int (&row_sum)[3], const int (&c1)[2],
                                           const int (&c2)[2], const int (&c3)[2], u32 bs, u32& hi, u32& lo) {
  float x[2];
#pragma unroll
  for (int e = 0; e < 2; ++e)
    x[e] = (row_s[0] * (float)(c1[e] - 8 * row_sum[0]) + row_s[1] * (float)(c2[e] - 8 * row_sum[1]) +
            row_s[2] * (float)(c3[e] - 8 * row_sum[2])) *
           half_to_float((u16)(bs >> (16 * e)));
  split_hi_lo(x, hi, lo);
}

// log2-sum-exp over a head row's 16 keys: 4 in the lane (l[n]), 4 lanes (tig) of the row's quad;
// N independent rows at once.
template <int N>
__device__ __forceinline__ void quad_lse2(const float (&l)[N][4], float (&lse)[N]) {
  float m[N], sum[N];
#pragma unroll
  for (int u = 0; u < N; ++u) m[u] = fmaxf(fmaxf(l[u][0], l[u][1]), fmaxf(l[u][2], l[u][3]));
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1)
#pragma unroll
    for (int u = 0; u < N; ++u) m[u] = fmaxf(m[u], __shfl_xor_sync(0xffffffffu, m[u], x));
#pragma unroll
  for (int u = 0; u < N; ++u)
    sum[u] = fast_exp2(l[u][0] - m[u]) + fast_exp2(l[u][1] - m[u]) + fast_exp2(l[u][2] - m[u]) +
             fast_exp2(l[u][3] - m[u]);
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1)
#pragma unroll
    for (int u = 0; u < N; ++u) sum[u] += __shfl_xor_sync(0xffffffffu, sum[u], x);
#pragma unroll
  for (int u = 0; u < N; ++u) lse[u] = m[u] + fast_log2(sum[u]);
}

// dev[row][i] = sum_c (hi + lo)[row][c] C[i][c] on m16n8k16 for page pg: k 0..7 carry hi, k 8..15
// lo (A rows gid: hi0 / lo0, rows gid + 8: hi8 / lo8), against the coefficient pair twice
// (C[i][2 tig], C[i][2 tig + 1] for columns i = gid of n-tile 0, gid + 8 of n-tile 1); times the
// key scales. l0 = row gid's keys 2 tig, 2 tig + 1, 8 + 2 tig, 9 + 2 tig; l8 the same of row gid + 8.
__device__ __forceinline__ void key_logits(const unsigned char* pg, int gid, int tig, u32 hi0, u32 hi8, u32 lo0,
                                           u32 lo8, float (&l0)[4], float (&l8)[4]) {
  const unsigned char* coef = pg + OFF_COEF;
  const u32 cp0 = int8_pair_f16(*reinterpret_cast<const u16*>(coef + gid * RANK + 2 * tig));
  const u32 cp1 = int8_pair_f16(*reinterpret_cast<const u16*>(coef + (gid + 8) * RANK + 2 * tig));
  float e0[4] = {0.f, 0.f, 0.f, 0.f}, e1[4] = {0.f, 0.f, 0.f, 0.f};
  mma16816_f16(e0, hi0, hi8, lo0, lo8, cp0, cp0);
  mma16816_f16(e1, hi0, hi8, lo0, lo8, cp1, cp1);
  const u32 cs0 = *reinterpret_cast<const u32*>(pg + OFF_CSCALE + 4 * tig);
  const u32 cs1 = *reinterpret_cast<const u32*>(pg + OFF_CSCALE + 16 + 4 * tig);
  l0[0] = e0[0] * half_to_float((u16)(cs0 & 0xFFFF));
  l0[1] = e0[1] * half_to_float((u16)(cs0 >> 16));
  l0[2] = e1[0] * half_to_float((u16)(cs1 & 0xFFFF));
  l0[3] = e1[1] * half_to_float((u16)(cs1 >> 16));
  l8[0] = e0[2] * half_to_float((u16)(cs0 & 0xFFFF));
  l8[1] = e0[3] * half_to_float((u16)(cs0 >> 16));
  l8[2] = e1[2] * half_to_float((u16)(cs1 & 0xFFFF));
  l8[3] = e1[3] * half_to_float((u16)(cs1 >> 16));
}

// Eq. 4 without the centroid term, in log2 units, for NP pages at once (their independent
// chains interleave), for the lane's head row g = gid (the same in every lane of the row's quad).
// row_s already carries k2 = sm_scale * log2 e.
template <int NP>
__device__ __forceinline__ void pages_lse2(const unsigned char* const (&pg)[NP], const QFrags& qf, int gid,
                                           int tig, float (&lse)[NP]) {
  u32 w[NP][KSTEPS];
  basis_words<NP>(pg, gid, tig, w);
  // Codes + 8 in [0, 16) as unsigned bytes. c12: q1 (rows g) and q2 (rows g + 8); c3: q3.
  int c12[NP][4], c3[NP][4];
#pragma unroll
  for (int u = 0; u < NP; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) c12[u][e] = 0, c3[u][e] = 0;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int u = 0; u < NP; ++u) {
      const u32 b0 = and_xor(w[u][kk], 0x0F0F0F0Fu, 0x08080808u);
      const u32 b1 = and_xor(w[u][kk] >> 4, 0x0F0F0F0Fu, 0x08080808u);
      imma16832(c12[u], qf.qa[kk][0], qf.qa[kk][1], qf.qa[kk][2], qf.qa[kk][3], b0, b1);
      if constexpr (!PACK3) imma16832(c3[u], qf.q3[kk][0], 0u, qf.q3[kk][1], 0u, b0, b1);
    }
  }
  float l[NP][4];
#pragma unroll
  for (int u = 0; u < NP; ++u) {
    if constexpr (PACK3) {  // q3's rows are lane + 16's rows g
      c3[u][0] = __shfl_down_sync(0xffffffffu, c12[u][0], 16);
      c3[u][1] = __shfl_down_sync(0xffffffffu, c12[u][1], 16);
    }
    u32 hi, lo;
    proj_hi_lo(qf.row_s, qf.row_sum, {c12[u][0], c12[u][1]}, {c12[u][2], c12[u][3]}, {c3[u][0], c3[u][1]},
               *reinterpret_cast<const u32*>(pg[u] + OFF_BSCALE + 4 * tig), hi, lo);
    // rows gid + 8 repeat row gid (their l8 is not used)
    float l8[4];
    key_logits(pg[u], gid, tig, hi, hi, lo, lo, l[u], l8);
  }
  quad_lse2<NP>(l, lse);
}

// The same for G = 9..16, for the lane's head rows gid (lse[2 u]) and gid + 8 (lse[2 u + 1]).
// The basis operands are 16 x the signed codes: (w << 4) & 0xF0F0F0F0 puts the low nibbles
// (d + 0..3) in the high halves of the bytes, w & 0xF0F0F0F0 the high nibbles (d + 4..7); the
// sums (at most 128 x 127 x d < 2^24 in magnitude) are exact in int32 and in float, and row_s16
// takes the 16 back out exactly, so x is bit for bit that of the +8 offset form.
template <int NP>
__device__ __forceinline__ void pages_lse2(const unsigned char* const (&pg)[NP], const QFrags16& qf, int gid,
                                           int tig, float (&lse)[2 * NP]) {
  u32 w[NP][KSTEPS];
  basis_words<NP>(pg, gid, tig, w);
  // c0: q1 (rows g) and q2 (rows g + 8) of head g; c8: the same of head g + 8; c3: q3 of head g
  // (rows g) and of head g + 8 (rows g + 8).
  int c0[NP][4], c8[NP][4], c3[NP][4];
#pragma unroll
  for (int u = 0; u < NP; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) c0[u][e] = 0, c8[u][e] = 0, c3[u][e] = 0;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int u = 0; u < NP; ++u) {
      const u32 b0 = (w[u][kk] << 4) & 0xF0F0F0F0u;
      const u32 b1 = w[u][kk] & 0xF0F0F0F0u;
      imma16832(c0[u], qf.qa[0][kk][0], qf.qa[0][kk][1], qf.qa[0][kk][2], qf.qa[0][kk][3], b0, b1);
      imma16832(c8[u], qf.qa[1][kk][0], qf.qa[1][kk][1], qf.qa[1][kk][2], qf.qa[1][kk][3], b0, b1);
      imma16832(c3[u], qf.q3[kk][0], qf.q3[kk][1], qf.q3[kk][2], qf.q3[kk][3], b0, b1);
    }
  }
  float l[2 * NP][4];
#pragma unroll
  for (int u = 0; u < NP; ++u) {
    const u32 bs = *reinterpret_cast<const u32*>(pg[u] + OFF_BSCALE + 4 * tig);
    u32 hi[2], lo[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int(&c12)[4] = r ? c8[u] : c0[u];
      const float(&rs)[3] = qf.row_s16[r];
      float x[2];
#pragma unroll
      for (int e = 0; e < 2; ++e)
        x[e] = (rs[0] * (float)c12[e] + rs[1] * (float)c12[e + 2] + rs[2] * (float)c3[u][2 * r + e]) *
               half_to_float((u16)(bs >> (16 * e)));
      split_hi_lo(x, hi[r], lo[r]);
    }
    key_logits(pg[u], gid, tig, hi[0], hi[1], lo[0], lo[1], l[2 * u], l[2 * u + 1]);
  }
  quad_lse2<2 * NP>(l, lse);
}

// centre[p][g] = mu_p . q_g for a stage's 8 pages (A = centroid codes, rows p = gid; rows gid + 8
// zero), B = the q splits (column g = gid: the lane's own A fragments of q). The lane gets page
// gid, heads 2 tig + e in c[e].
__device__ __forceinline__ void centres(const unsigned char* stage, const QFrags& qf, int gid, int tig,
                                        float* c) {
  const bool has = gid < PAGES;  // rows past the stage's pages stay zero
  const unsigned char* mu = stage + (gid % PAGES) * PAGE_BYTES + OFF_MU;
  int c1[4] = {0, 0, 0, 0}, c2[4] = {0, 0, 0, 0}, c3[4] = {0, 0, 0, 0};
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    uint2 w = *reinterpret_cast<const uint2*>(mu + 32 * kk + 8 * tig);  // d 32 kk + 8 tig ..
    if (!has) w = make_uint2(0u, 0u);
    imma16832(c1, w.x, 0u, w.y, 0u, qf.qa[kk][0], qf.qa[kk][2]);
    imma16832(c2, w.x, 0u, w.y, 0u, qf.qa[kk][1], qf.qa[kk][3]);
    if constexpr (!PACK3) imma16832(c3, w.x, 0u, w.y, 0u, qf.q3[kk][0], qf.q3[kk][1]);
  }
  if constexpr (PACK3) {  // columns 4 + 2 tig + e (lane tig + 2) hold q3 of heads 2 tig + e
    c3[0] = __shfl_xor_sync(0xffffffffu, c1[0], 2);
    c3[1] = __shfl_xor_sync(0xffffffffu, c1[1], 2);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e)
    c[e] = qf.s[0][e] * (float)c1[e] + qf.s[1][e] * (float)c2[e] + qf.s[2][e] * (float)c3[e];
}

// centre[g][p] for G = 9..16, transposed: A = the lane's q fragments (rows: heads, as in
// pages_lse2), B = the centroid codes (column p = page gid's codes, rows past the stage's pages
// zero), so one mma per 32 dimensions and 16 heads per split, and each row needs only its own
// scales. The lane gets heads gid + 8 r, pages 2 tig + e in c[r][e], in log2 units / 16 (row_s16).
__device__ __forceinline__ void centres(const unsigned char* stage, const QFrags16& qf, int gid, int tig,
                                        float (&c)[2][2]) {
  const bool has = gid < PAGES;
  const unsigned char* mu = stage + (gid % PAGES) * PAGE_BYTES + OFF_MU;
  int c0[4] = {0, 0, 0, 0}, c8[4] = {0, 0, 0, 0}, c3[4] = {0, 0, 0, 0};
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
    uint2 w = *reinterpret_cast<const uint2*>(mu + 32 * kk + 8 * tig);  // d 32 kk + 8 tig ..
    if (!has) w = make_uint2(0u, 0u);
    imma16832(c0, qf.qa[0][kk][0], qf.qa[0][kk][1], qf.qa[0][kk][2], qf.qa[0][kk][3], w.x, w.y);
    imma16832(c8, qf.qa[1][kk][0], qf.qa[1][kk][1], qf.qa[1][kk][2], qf.qa[1][kk][3], w.x, w.y);
    imma16832(c3, qf.q3[kk][0], qf.q3[kk][1], qf.q3[kk][2], qf.q3[kk][3], w.x, w.y);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int(&c12)[4] = r ? c8 : c0;
    const float(&rs)[3] = qf.row_s16[r];
#pragma unroll
    for (int e = 0; e < 2; ++e)
      c[r][e] = rs[0] * (float)c12[e] + rs[1] * (float)c12[e + 2] + rs[2] * (float)c3[2 * r + e];
  }
}

struct Args {
  const unsigned short* q;       // [Bt, Hq, d] bf16 or fp16 (Q_FP16), d contiguous
  const u32* basis;              // [N, Hkv, r, d / 8] words (fragment order)
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

// q of the lane's head rows of (sequence b, KV head h).
__device__ __forceinline__ void load_rows(QFrags& f, const Args& a, int b, int h, int gid, int tig,
                                          double sm_scale_d) {
  const int head = PACK3 ? (gid & 3) : gid;  // PACK3: rows 4..7 repeat heads 0..3 (their q3)
  f = load_q(a.q + (i64)b * a.sq_b + (i64)(h * GROUP + head) * a.sq_h, head < GROUP, gid, tig,
             (float)sm_scale_d * 1.4426950408889634f);
}

__device__ __forceinline__ void load_rows(QFrags16& f, const Args& a, int b, int h, int gid, int tig,
                                          double sm_scale_d) {
  const unsigned short* row = a.q + (i64)b * a.sq_b + (i64)(h * GROUP + gid) * a.sq_h;
  const float k2 = (float)sm_scale_d * 1.4426950408889634f;
  const QFrags r0 = load_q(row, gid < GROUP, gid, tig, k2);
  const QFrags r1 = load_q(row + 8 * (i64)a.sq_h, gid + 8 < GROUP, gid, tig, k2);  // no read past head G - 1
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f.qa[0][kk][i] = r0.qa[kk][i], f.qa[1][kk][i] = r1.qa[kk][i];
    f.q3[kk][0] = r0.q3[kk][0], f.q3[kk][1] = r1.q3[kk][0];
    f.q3[kk][2] = r0.q3[kk][1], f.q3[kk][3] = r1.q3[kk][1];
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) f.row_s16[0][k] = r0.row_s[k] * 0.0625f, f.row_s16[1][k] = r1.row_s[k] * 0.0625f;
}

// What a stage's compute needs to know of its copies, kept in shared memory beside the stages:
// valid pages (bit p) and each page's centroid scale.
struct StageInfo {
  u32 ms_word[PAGES];  // the aligned 4 bytes holding page p's fp16 centroid scale
  u32 valid;           // bit p: page p is valid
  u32 odd;             // bit p: the scale is the word's upper half
  u32 pad[2];
};

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// Lane p < PAGES: the summary row (page id * Hkv + h) of page p of group grp, or -1 where the
// page is padding or its id is outside [0, N) (it scores -inf). Loaded a stage ahead of its use.
__device__ __forceinline__ i64 stage_row(const Args& a, int b, int h, int grp, i64 n_b, int lane) {
  const int pos = grp * PAGES + (lane & (PAGES - 1));
  if (lane >= PAGES || pos >= a.P || pos >= n_b) return -1;
  const i64 id = (i64)a.table[(i64)b * a.st_b + pos];
  return id >= 0 && id < a.num_ids ? id * a.hkv + h : -1;
}

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

// Start copying a group's pages (rows from stage_row) into the stage at smem address dst and its
// info (one commit group). Invalid pages are not read (zero-filled) and score -inf.
__device__ __forceinline__ void issue_stage(const LaneCopy& lc, const unsigned short* mscale, i64 row, u32 dst,
                                            StageInfo* info, int lane) {
  const bool valid = row >= 0;
  const u32 valid_mask = __ballot_sync(0xffffffffu, valid) & ((1u << PAGES) - 1);
  const u32 odd_mask = __ballot_sync(0xffffffffu, valid && (row & 1)) & ((1u << PAGES) - 1);
  if (lane == 0) info->valid = valid_mask, info->odd = odd_mask;
  const i64 r_ok = valid ? row : 0;
  if (lane < PAGES)
    cp_async4((u32)__cvta_generic_to_shared(&info->ms_word[lane]), mscale + (r_ok & ~1ll), valid ? 4 : 0);
#pragma unroll
  for (int p = 0; p < PAGES; ++p) {
    const i64 r = __shfl_sync(0xffffffffu, r_ok, p);
    const int bytes = ((valid_mask >> p) & 1u) ? 16 : 0;
    const u32 page = dst + p * PAGE_BYTES;
    if (lc.basis) cp_async16(page + 16 * lane, lc.basis_src + r * (HEAD_DIM * 4), bytes);
    if (lc.small) cp_async16(page + lc.small_off, lc.small_src + r * lc.small_stride, bytes);
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Score a landed stage: s_hat for its pages and, if partials, the group's (max, sum exp).
__device__ __forceinline__ void compute_stage(const Args& a, const unsigned char* stage, const StageInfo* st,
                                              float* lse, const QFrags& qa, int b, int h,
                                              int grp, int gid, int tig, float sm_scale) {
#pragma unroll
  for (int p = 0; p < PAGES; p += PAGE_UNROLL) {
    const unsigned char* pg[PAGE_UNROLL];
#pragma unroll
    for (int u = 0; u < PAGE_UNROLL; ++u) pg[u] = stage + (p + u) * PAGE_BYTES;
    float l[PAGE_UNROLL];
    pages_lse2<PAGE_UNROLL>(pg, qa, gid, tig, l);
#pragma unroll
    for (int u = 0; u < PAGE_UNROLL; ++u)
      if (tig == 0) lse[(p + u) * 8 + gid] = l[u];
  }
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  centres(stage, qa, gid, tig, c);
  __syncwarp();
  // s_hat = lse + centre * mu_scale * sm_scale (natural-log units); lane: page gid, heads 2 tig + e
  const bool ok = gid < PAGES && ((st->valid >> gid) & 1u);
  const u32 word = st->ms_word[gid % PAGES];
  const float msc = half_to_float((u16)(((st->odd >> gid) & 1u) ? word >> 16 : word & 0xFFFF));
  const int pp = grp * PAGES + gid;
  const float neg_inf = -__int_as_float(0x7f800000);
  float out[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int g = 2 * tig + e;
    out[e] = ok ? lse[(gid % PAGES) * 8 + g] * 0.6931471805599453f + c[e] * msc * sm_scale : neg_inf;
    if (gid < PAGES && g < GROUP && pp < a.P) a.s_hat[(((i64)b * a.hkv + h) * GROUP + g) * a.P + pp] = out[e];
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

// The same for G = 9..16. lse [PAGES][16]; the lane's centres and outputs are heads gid + 8 r of
// pages 2 tig + e (the transposed centre mma).
__device__ __forceinline__ void compute_stage(const Args& a, const unsigned char* stage, const StageInfo* st,
                                              float* lse, const QFrags16& qa, int b, int h,
                                              int grp, int gid, int tig, float /* sm_scale: in row_s16 */) {
#pragma unroll
  for (int p = 0; p < PAGES; p += PAGE_UNROLL) {
    const unsigned char* pg[PAGE_UNROLL];
#pragma unroll
    for (int u = 0; u < PAGE_UNROLL; ++u) pg[u] = stage + (p + u) * PAGE_BYTES;
    float l[2 * PAGE_UNROLL];
    pages_lse2<PAGE_UNROLL>(pg, qa, gid, tig, l);
#pragma unroll
    for (int u = 0; u < PAGE_UNROLL; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (tig == 0) lse[(p + u) * LSE_ROW + gid + 8 * r] = l[2 * u + r];
  }
  float c[2][2];
  centres(stage, qa, gid, tig, c);
  __syncwarp();
  // s_hat = (lse + centre * 16 mu_scale) ln 2 (centre carries sm_scale log2 e / 16)
  const float neg_inf = -__int_as_float(0x7f800000);
  float out[2][2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int p = 2 * tig + e;
    const bool ok = p < PAGES && ((st->valid >> p) & 1u);
    const u32 word = st->ms_word[p % PAGES];
    const float msc16 = 16.f * half_to_float((u16)(((st->odd >> p) & 1u) ? word >> 16 : word & 0xFFFF));
    const int pp = grp * PAGES + p;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int g = gid + 8 * r;
      out[r][e] = ok ? (lse[(p % PAGES) * LSE_ROW + g] + c[r][e] * msc16) * 0.6931471805599453f : neg_inf;
      if (p < PAGES && g < GROUP && pp < a.P)
        a.s_hat[(((i64)b * a.hkv + h) * GROUP + g) * a.P + pp] = out[r][e];
    }
  }
  __syncwarp();  // lse is rewritten by the next stage
  if (!a.partials) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {  // over the stage's pages: 2 in the lane, 4 lanes (tig)
    float m = fmaxf(out[r][0], out[r][1]);
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    const float m0 = m == neg_inf ? 0.f : m;
    float s = __expf(out[r][0] - m0) + __expf(out[r][1] - m0);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    const int g = gid + 8 * r;
    if (tig == 0 && g < GROUP) {
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
  float* lse = reinterpret_cast<float*>(stages + STAGES * STAGE_BYTES);  // [PAGES][LSE_ROW]
  StageInfo* info = reinterpret_cast<StageInfo*>(stages + STAGES * STAGE_BYTES + LSE_BYTES);
  const u32 stages_addr = (u32)__cvta_generic_to_shared(stages);
  const i64 n_b = (i64)a.num_pages[b];
  const LaneCopy lc = lane_copy(a, lane);
  const int count = last - first;
  // Prologue: the first STAGES - 1 stages (an empty commit group where there is none, so that
  // wait_group(STAGES - 1) below always means "stage j has landed").
#pragma unroll
  for (int j = 0; j < STAGES - 1; ++j) {
    if (j < count)
      issue_stage(lc, a.mscale, stage_row(a, b, h, first + j, n_b, lane), stages_addr + j * STAGE_BYTES,
                  info + j, lane);
    else
      asm volatile("cp.async.commit_group;\n" ::);
  }
  i64 row_ahead = stage_row(a, b, h, first + STAGES - 1, n_b, lane);  // the next stage to issue

  // q of head rows g = gid (and gid + 8) as int8 splits (zero rows for g >= G).
  QF qa;
  load_rows(qa, a, b, h, gid, tig, sm_scale_d);  // row_s carry k2 = sm_scale * log2 e
  const float sm_scale = (float)sm_scale_d;
  for (int j = 0; j < count; ++j) {
    const int ahead = j + STAGES - 1;  // its slot was computed in iteration j - 1
    if (ahead < count) {
      const int slot = ahead % STAGES;
      issue_stage(lc, a.mscale, row_ahead, stages_addr + slot * STAGE_BYTES, info + slot, lane);
      if (ahead + 1 < count) row_ahead = stage_row(a, b, h, first + ahead + 1, n_b, lane);  // lands meanwhile
    } else {
      asm volatile("cp.async.commit_group;\n" ::);
    }
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
    __syncwarp();
    const int slot = j % STAGES;
    compute_stage(a, stages + slot * STAGE_BYTES, info + slot, lse, qa, b, h, first + j, gid, tig, sm_scale);
  }
}
