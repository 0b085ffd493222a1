// cuda_gemm: the M > 16 W2A8 linear of aipc::lowbit_linear on the int8 tensor cores (mma.sync m16n8k32,
// NVIDIA sm_80+), a tiled GEMM with a cp.async ring in shared memory (the form of the int8 GEMM torch._int_mm
// runs on the H100); compiled at first use by NVRTC with the macros below; see cuda_gemm.py.
//
// Inputs: the activation pass's int8 codes xq [M, Kp] in k order, per-token scales sx [M], 32-k code sums
// xs [M, Kp / 32]. A block owns BM tokens x BN weight rows; its WM x WN warps each MT 16-token tiles x NT 8-row tiles (tile t's
// column j is row 8 t + j of the warp's rows). Per 128-k chunk, STAGES - 1 chunks ahead of the math, the
// block copies (cp.async, 16 bytes each) the BM token rows' 128 code bytes (16-byte segments XOR-swizzled
// by the row, so ldmatrix meets no bank conflict), the BN rows' 32 code bytes (byte j: the codes of k = j +
// 32 q, plane q at bits 2 q; a lane's B fragment of plane q is bytes 4 t' .. and 16 + 4 t' .., shifted), the chunk's
// group scales (and, with stored zeros, the zeros and the tokens' four 32-k sums). Per plane one mma of the
// codes as the int8 levels CA * c - CB (the code book's fixed zero point folded in, as Triton's `group`)
// against the activation codes per (token tile, row tile), accumulated over the group from the bits of
// 1.5 * 2**23 (the int32 -> fp32 conversion is one subtract); per group that FADD and one FFMA per output
// with the scale times FMUL (stored zeros: one FFMA more, - s * z * xsum). No split of K; the epilogue multiplies by sx, adds
// the bias and stores y.
//
// Macros: IN_KIND / SCALE_KIND (cuda_common.cuh), G (32, 64, 128), BM, BN, WM, WN, STAGES, HAS_ZEROS,
// HAS_BIAS, CA, CB (integers: cmul * c - zero == FMUL * (CA * c - CB)), FMUL (a float literal). N % 8 == 0,
// Kp % 128 == 0. No CUDA header is included.

#define NW (WM * WN)
#define MT (BM / (16 * WM))  // a warp's 16-token tiles
#define NT (BN / (8 * WN))   // a warp's 8-row tiles
#define GP (G / 32)          // planes per group
#define GPU (4 / GP)         // groups per chunk
#define MAGIC 0x4B400000
#define SSZ ((int)sizeof(scale_t))
// one stage of the ring, in bytes: token codes, weight codes, scales, (zeros,) token sums
#define A_BYTES (BM * 128)
#define B_BYTES (BN * 32)
#define S_BYTES (GPU * BN * SSZ)
#if HAS_ZEROS
#define Z_BYTES S_BYTES
#define X_BYTES (BM * 16)
#else
#define Z_BYTES 0
#define X_BYTES 0
#endif
#define STAGE_BYTES (A_BYTES + B_BYTES + S_BYTES + Z_BYTES + X_BYTES)

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int n>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(n));
}
// d = a (s8, 16 x 32, ldmatrix's four registers) . b (s8, 32 x 8) + d
__device__ __forceinline__ void mma(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// d = a . b + c (c: the same value for the four accumulators: a group's start)
__device__ __forceinline__ void mma_from(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, int c) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c));
}
// the A fragment of a 16 x 32 int8 tile: lane l gives the address of row l % 16's 16 bytes (k 0-15, or with
// l >= 16 k 16-31)
__device__ __forceinline__ void ldsm_x4(unsigned (&a)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}
// the scale (zero) of a row from the stage's 16-bit or 32-bit values
__device__ __forceinline__ float stage_scale(const unsigned char* s, int i) {
  return scale_f(reinterpret_cast<const scale_t*>(s)[i]);
}
// plane q of four code bytes as the int8 levels CA * c - CB (the bias add never carries: CA * c + 128 - CB
// stays within a byte)
__device__ __forceinline__ unsigned levels(unsigned w, int q) {
  unsigned t = (w >> (2 * q)) & 0x03030303u;
#if CA != 1
  t *= CA;
#endif
#if CB != 0
  t = (t + 0x01010101u * (128 - CB)) ^ 0x80808080u;
#endif
  return t;
}

// A thread's share of a stage's copies, addressed once: rows past M / N repeat the last row (dropped at
// the store), groups past the last one repeat it (their codes and activations are 0 past K)
#define THREADS (NW * 32)
#define NA ((BM * 8 + THREADS - 1) / THREADS)    // 16-byte copies of token codes per thread
#define NB ((BN * 2 + THREADS - 1) / THREADS)    // of weight codes
#define SEG (BN * SSZ / 16)                      // 16-byte segments of a group's scales (N % 8 == 0: whole)
#define NS ((GPU * SEG + THREADS - 1) / THREADS)  // of scales (and zeros)
#define NX ((BM + THREADS - 1) / THREADS)         // of token sums
struct Loader {
  const unsigned char* a[NA];
  const unsigned char* b[NB];
  const scale_t* s[NS];  // the segment's row offset; the group's is added per chunk
  int sp[NS];            // the segment's group within the chunk
#if HAS_ZEROS
  const scale_t* z[NS];
  const int* x[NX];
#endif
};

__device__ __forceinline__ void make_loader(Loader& L, const unsigned char* __restrict__ xq, const int* __restrict__ xsum,
                                            const unsigned char* __restrict__ wq, const scale_t* __restrict__ sc,
                                            const scale_t* __restrict__ zp, int m0, int n0, int M, int N, int Kp, int tid) {
#pragma unroll
  for (int j = 0; j < NA; ++j) {
    const int i = min(tid + j * THREADS, BM * 8 - 1), r = i >> 3, s = i & 7;
    L.a[j] = xq + (size_t)min(m0 + r, M - 1) * Kp + 16 * s;
  }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int i = min(tid + j * THREADS, BN * 2 - 1), r = i >> 1, s = i & 1;
    L.b[j] = wq + (size_t)min(n0 + r, N - 1) * (Kp / 4) + 16 * s;
  }
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const int i = min(tid + j * THREADS, GPU * SEG - 1), s = i % SEG, n = min(n0 + (16 / SSZ) * s, N - 16 / SSZ);
    L.sp[j] = i / SEG;
    L.s[j] = sc + n;
#if HAS_ZEROS
    L.z[j] = zp + n;
#endif
  }
#if HAS_ZEROS
#pragma unroll
  for (int j = 0; j < NX; ++j) L.x[j] = xsum + (size_t)min(m0 + min(tid + j * THREADS, BM - 1), M - 1) * (Kp / 32);
#endif
}

// chunk c into the stage at shared address st
__device__ __forceinline__ void load_stage(unsigned st, const Loader& L, int c, int N, int NG, int tid) {
#pragma unroll
  for (int j = 0; j < NA; ++j) {
    const int i = tid + j * THREADS, r = i >> 3, s = i & 7;
    if (BM * 8 % THREADS == 0 || i < BM * 8) cp16(st + r * 128 + ((s ^ (r & 7)) << 4), L.a[j] + 128 * c);
  }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const int i = tid + j * THREADS;
    if (BN * 2 % THREADS == 0 || i < BN * 2) cp16(st + A_BYTES + i * 16, L.b[j] + 32 * c);
  }
#pragma unroll
  for (int j = 0; j < NS; ++j) {
    const int i = tid + j * THREADS;
    if (GPU * SEG % THREADS == 0 || i < GPU * SEG) {
      const size_t at = (size_t)min(c * GPU + L.sp[j], NG - 1) * N;
      cp16(st + A_BYTES + B_BYTES + i * 16, L.s[j] + at);
#if HAS_ZEROS
      cp16(st + A_BYTES + B_BYTES + S_BYTES + i * 16, L.z[j] + at);
#endif
    }
  }
#if HAS_ZEROS
#pragma unroll
  for (int j = 0; j < NX; ++j) {
    const int i = tid + j * THREADS;
    if (BM % THREADS == 0 || i < BM) cp16(st + A_BYTES + B_BYTES + S_BYTES + Z_BYTES + i * 16, L.x[j] + 4 * c);
  }
#endif
}

// group p of the stage at st: its planes' mmas from the bits of 1.5 * 2**23, then FMUL s * dot (- s * z *
// xsum) into out, one FADD and one FFMA per output (and one FFMA more)
__device__ __forceinline__ void group_math(float (&out)[MT][NT][4], const unsigned (&w)[NT][2], const unsigned char* st,
                                           int wm, int wn, int lane, int p) {
  const unsigned char* Ss = st + A_BYTES + B_BYTES;
  const unsigned as = smem_u32(st);
  const int lr = wm * (16 * MT) + (lane & 15);  // the token row whose 16 bytes this lane's address gives ldmatrix
  int acc[MT][NT][4];
#pragma unroll
  for (int j = 0; j < GP; ++j) {
    const int q = p * GP + j;
    unsigned a[MT][4];  // plane q of token rows 16 mt + g (+ 8): the mma's A fragment
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int r = lr + 16 * mt, seg = 2 * q + (lane >> 4);
      ldsm_x4(a[mt], as + r * 128 + ((seg ^ (r & 7)) << 4));
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const unsigned b0 = levels(w[t][0], q), b1 = levels(w[t][1], q);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if (j == 0) mma_from(acc[mt][t], a[mt], b0, b1, MAGIC);
        else mma(acc[mt][t], a[mt], b0, b1);
      }
    }
  }
#if HAS_ZEROS
  const unsigned char* Xs = Ss + S_BYTES + Z_BYTES;
  float xg[MT][2];  // the group's activation code sums of token rows g, g + 8 of each token tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int4 v4 = *reinterpret_cast<const int4*>(Xs + (wm * (16 * MT) + 16 * mt + 8 * h + (lane >> 2)) * 16);
      const int v[4] = {v4.x, v4.y, v4.z, v4.w};
      int xs = 0;
#pragma unroll
      for (int e = p * GP; e < (p + 1) * GP; ++e) xs += v[e];
      xg[mt][h] = (float)xs;
    }
#endif
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int n = p * BN + wn * (8 * NT) + 8 * t + 2 * (lane & 3);  // columns 2 t', 2 t' + 1
    const float r[2] = {stage_scale(Ss, n), stage_scale(Ss, n + 1)};
    const float s[2] = {r[0] * FMUL, r[1] * FMUL};
#if HAS_ZEROS
    const float z[2] = {-r[0] * stage_scale(Ss + S_BYTES, n), -r[1] * stage_scale(Ss + S_BYTES, n + 1)};
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        out[mt][t][i] = fmaf(s[i & 1], __int_as_float(acc[mt][t][i]) - 12582912.f, out[mt][t][i]);
#if HAS_ZEROS
        out[mt][t][i] = fmaf(z[i & 1], xg[mt][i >> 1], out[mt][t][i]);
#endif
      }
  }
}

// one chunk's math for the warp (wm, wn): its weight bytes, then group by group
__device__ __forceinline__ void chunk_math(float (&out)[MT][NT][4], const unsigned char* st, int wm, int wn, int lane) {
  const unsigned char* Bs = st + A_BYTES;
  unsigned w[NT][2];  // row 8 t + g of the warp's: bytes 4 t' .. 4 t' + 3 and 16 + 4 t' .. (positions k, k + 16 of each plane)
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const unsigned char* row = Bs + (wn * (8 * NT) + 8 * t + (lane >> 2)) * 32 + 4 * (lane & 3);
    w[t][0] = *reinterpret_cast<const unsigned*>(row);
    w[t][1] = *reinterpret_cast<const unsigned*>(row + 16);
  }
#pragma unroll
  for (int p = 0; p < GPU; ++p) group_math(out, w, st, wm, wn, lane, p);
}

extern "C" __global__ void __launch_bounds__(NW * 32) lowbit_gemm_w2(
    const unsigned char* __restrict__ xq, const float* __restrict__ sx, const int* __restrict__ xsum,
    const unsigned char* __restrict__ wq, const scale_t* __restrict__ sc, const scale_t* __restrict__ zp,
    const in_t* __restrict__ bias, in_t* __restrict__ y, int M, int N, int Kp, int NG) {
  extern __shared__ __align__(16) unsigned char ring[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3, wm = warp / WN, wn = warp % WN;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, C = Kp / 128;

  float out[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[mt][t][i] = 0.f;

  Loader L;
  make_loader(L, xq, xsum, wq, sc, zp, m0, n0, M, N, Kp, tid);
  const unsigned base = smem_u32(ring);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < C) load_stage(base + s * STAGE_BYTES, L, s, N, NG, tid);
    cp_commit();
  }
  for (int c = 0; c < C; ++c) {
    cp_wait<STAGES - 2>();  // chunk c is in its stage (this thread's copies) ...
    __syncthreads();        // ... every thread's, and no warp still reads the stage refilled next
    const int cn = c + STAGES - 1;
    if (cn < C) load_stage(base + (cn % STAGES) * STAGE_BYTES, L, cn, N, NG, tid);
    cp_commit();
    chunk_math(out, ring + (c % STAGES) * STAGE_BYTES, wm, wn, lane);
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * (16 * MT) + 16 * mt + 8 * h + g;
      if (m >= M) continue;
      const float s = sx[m];
#pragma unroll
      for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = n0 + wn * (8 * NT) + 8 * t + 2 * tq + j;
          if (n < N) {
            float v = out[mt][t][2 * h + j] * s;
#if HAS_BIAS
            v += in_f(bias[n]);
#endif
            store_out(v, y + (size_t)m * N + n);
          }
        }
    }
}
