// cuda_mma: the 1 < M <= 64 W2A8 linear of aipc::lowbit_linear on the int8 tensor cores (mma.sync
// m16n8k32, NVIDIA sm_80+), compiled at first use by NVRTC (torch.cuda._compile_kernel) with the macros
// below; see cuda_mma.py.
//
// The activation pass (Triton, activation.quantize_rows with perm) has written int8 codes xq [M, Kp] in
// this kernel's order (in each 128 k, k = 32 q + 8 t + i at 32 t + 8 q + i), per-token scales sx [M] and
// 32-k code sums xs [M, Kp / 32]. A block owns NT tiles of 8 weight rows (an mma's n; tile t's column j is
// row n0 + NT j + t, so a lane's C columns are 2 NT consecutive rows: their group scales are one vector
// load) and MT tiles of 16 tokens (its m); its NW warps take the block's chunks (128 k, 32 bytes of a row)
// in turn, and program_id.y the split's chunk range (SPLIT_K). Per chunk a lane (g, t') loads, D chunks
// ahead of the math, bytes 8 t' .. 8 t' + 7 of each of its rows (the B fragments of the 4 bit-planes),
// their group scales (and zeros), the A fragments of the same k (32 contiguous bytes per token row: the
// mma's k order is the bytes' order, so the dot is the same sum) and the tokens' 32-k sums. Per plane one
// mma of the masked codes (u8) against the activation codes (s8) per (token tile, row tile), accumulated
// over the group from the bits of 1.5 * 2**23 (the int32 -> fp32 conversion is one subtract); per group
// s * (CMUL * dot - z * xsum) in fp32. The NW warps' sums meet in shared memory (fixed order), times sx;
// with SPLIT_K > 1 each split writes its partial and the last of a row block (an atomic ticket per row
// block in the stream's ticket buffer) adds them in split order, adds the bias, stores y and re-arms the
// ticket.
//
// Macros: IN_KIND / SCALE_KIND (cuda_common.cuh), G (32, 64, 128), NT, MT, NW, D, SPLIT (SPLIT_K),
// HAS_ZEROS, HAS_BIAS, CMUL, ZERO (float literals), PROG. N % 8 == 0. No CUDA header is included.
// PROG: the progressive two-level form (lowbit/progressive.py): int8 group scales s1 (sc, SCALE_KIND 3) and
// mins m (zp, HAS_ZEROS), one fp32 scale per row (s0p); per group s1 * dot + m * xsum (integers below 2**24:
// exact in fp32), times the row's s0 at the end. NT >= 2 (a lane's 2 NT int8 values are whole words).

#if SCALE_KIND == 0  // 32-bit words of a lane's 2 NT scales (zeros)
#define SW (2 * NT)
#elif SCALE_KIND == 3
#define SW (NT / 2)
#else
#define SW NT
#endif

// the scale of the lane's row r from its words
__device__ __forceinline__ float scale_of(const unsigned (&w)[SW], int r) {
#if SCALE_KIND == 0
  return __uint_as_float(w[r]);
#elif SCALE_KIND == 3
  return (float)(signed char)((w[r >> 2] >> (8 * (r & 3))) & 0xffu);
#else
  return h2f((unsigned short)(w[r >> 1] >> (16 * (r & 1))), SCALE_KIND);
#endif
}
// SW words from p (aligned to their size, 16 bytes at most per load), or zeros
__device__ __forceinline__ void load_words(unsigned (&w)[SW], const scale_t* p, bool ok) {
  const unsigned* q = reinterpret_cast<const unsigned*>(p);
#if SW >= 4
#pragma unroll
  for (int v = 0; v < SW / 4; ++v) {
    const uint4 u = ok ? __ldg(reinterpret_cast<const uint4*>(q) + v) : make_uint4(0u, 0u, 0u, 0u);
    w[4 * v] = u.x; w[4 * v + 1] = u.y; w[4 * v + 2] = u.z; w[4 * v + 3] = u.w;
  }
#elif SW == 2
  const uint2 u = ok ? __ldg(reinterpret_cast<const uint2*>(q)) : make_uint2(0u, 0u);
  w[0] = u.x; w[1] = u.y;
#else
  w[0] = ok ? __ldg(q) : 0u;
#endif
}
__device__ __forceinline__ float ld_cg(const float* p) {  // another block's partial: past the L1
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
// d = a (s8, 16 x 32) . b (u8, 32 x 8) + d; a0 / a1: the 8 bytes of token rows g / g + 8
__device__ __forceinline__ void mma(int (&d)[4], unsigned a0x, unsigned a0y, unsigned a1x, unsigned a1y,
                                    unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0x), "r"(a1x), "r"(a0y), "r"(a1y), "r"(b0), "r"(b1));
}

#define GP (G / 32)    // planes per group
#define GPU (4 / GP)   // groups per chunk
#define MAGIC 0x4B400000

// one chunk of a warp's stream, loaded D chunks ahead of its use; a masked chunk (past the warp's range)
// has zero codes and scales
struct Step {
  uint2 w[NT];             // row n0 + NT g + t: bytes 8 t' .. 8 t' + 7 of the chunk (t' = lane % 4)
  unsigned s[GPU][SW];     // per group: the scales of rows n0 + 2 NT t' .. + 2 NT - 1 (the C columns)
#if HAS_ZEROS
  unsigned z[GPU][SW];
#endif
  uint4 a[MT][2][2];       // token rows 16 mt + g (+ 8): the lane's 32 bytes (planes 0-1, 2-3)
  int4 xs[MT][2];          // their 4 planes' 32-k code sums
};

// the weight side of chunk c: codes, scales (and zeros) of the block's rows
__device__ __forceinline__ void load_weights(Step& st, const unsigned char* __restrict__ wq, const scale_t* __restrict__ sc,
                                             const scale_t* __restrict__ zp, int c, bool ok, int n0, int g, int tq,
                                             int N, int Kp, int NG) {
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int n = n0 + NT * g + t;
    st.w[t] = ok && n < N ? __ldg(reinterpret_cast<const uint2*>(wq + (size_t)n * (Kp / 4) + 32 * c + 8 * tq))
                          : make_uint2(0u, 0u);
  }
  const int nc = n0 + 2 * NT * tq;  // N % 8 == 0: the lane's rows are all in range or all out
#pragma unroll
  for (int p = 0; p < GPU; ++p) {
    const int gi = c * GPU + p;
    const bool gok = ok && nc < N && gi < NG;  // padding past the last group: codes and activations 0
    load_words(st.s[p], sc + (size_t)gi * N + nc, gok);
#if HAS_ZEROS
    load_words(st.z[p], zp + (size_t)gi * N + nc, gok);
#endif
  }
}

// the activation side of chunk c: the lane's codes and 32-k sums of its token rows
__device__ __forceinline__ void load_acts(Step& st, const unsigned char* __restrict__ xq, const int* __restrict__ xsum,
                                          int c, int g, int tq, int M, int Kp) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = min(16 * mt + 8 * h + g, M - 1);  // rows past M: row M - 1 again, dropped at the store
      const uint4* row = reinterpret_cast<const uint4*>(xq + (size_t)m * Kp + 128 * c + 32 * tq);
      st.a[mt][h][0] = __ldg(row);
      st.a[mt][h][1] = __ldg(row + 1);
      st.xs[mt][h] = __ldg(reinterpret_cast<const int4*>(xsum + (size_t)m * (Kp / 32) + 4 * c));
    }
}

// one chunk's math: per plane the mmas of the masked codes, per group the scaled fp32 sums into out
__device__ __forceinline__ void chunk_math(float (&out)[MT][NT][4], const Step& st) {
  int acc[MT][NT][4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (q % GP == 0) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[mt][t][i] = MAGIC;
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const unsigned b0 = (st.w[t].x >> (2 * q)) & 0x03030303u, b1 = (st.w[t].y >> (2 * q)) & 0x03030303u;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4& lo = st.a[mt][0][q >> 1];
        const uint4& hi = st.a[mt][1][q >> 1];
        if (q & 1) mma(acc[mt][t], lo.z, lo.w, hi.z, hi.w, b0, b1);
        else mma(acc[mt][t], lo.x, lo.y, hi.x, hi.y, b0, b1);
      }
    }
    if ((q + 1) % GP == 0) {  // the group's end: s * (CMUL * dot - z * xsum)
      const int p = q / GP;
      float xg[MT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int v[4] = {st.xs[mt][h].x, st.xs[mt][h].y, st.xs[mt][h].z, st.xs[mt][h].w};
          int sum = 0;
#pragma unroll
          for (int e = p * GP; e < (p + 1) * GP; ++e) sum += v[e];
          xg[mt][h] = (float)sum;
        }
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        const float s0 = scale_of(st.s[p], t), s1 = scale_of(st.s[p], NT + t);  // columns 2 t', 2 t' + 1
#if HAS_ZEROS
        const float z0 = scale_of(st.z[p], t), z1 = scale_of(st.z[p], NT + t);
#else
        const float z0 = ZERO, z1 = ZERO;
#endif
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const float f0 = __int_as_float(acc[mt][t][0]) - 12582912.f, f1 = __int_as_float(acc[mt][t][1]) - 12582912.f;
          const float f2 = __int_as_float(acc[mt][t][2]) - 12582912.f, f3 = __int_as_float(acc[mt][t][3]) - 12582912.f;
#if PROG  // s1 * dot + m * xsum (the scales s1, the zeros m)
          out[mt][t][0] += fmaf(s0, f0, z0 * xg[mt][0]);
          out[mt][t][1] += fmaf(s1, f1, z1 * xg[mt][0]);
          out[mt][t][2] += fmaf(s0, f2, z0 * xg[mt][1]);
          out[mt][t][3] += fmaf(s1, f3, z1 * xg[mt][1]);
#else
          out[mt][t][0] = fmaf(s0, fmaf(CMUL, f0, -z0 * xg[mt][0]), out[mt][t][0]);
          out[mt][t][1] = fmaf(s1, fmaf(CMUL, f1, -z1 * xg[mt][0]), out[mt][t][1]);
          out[mt][t][2] = fmaf(s0, fmaf(CMUL, f2, -z0 * xg[mt][1]), out[mt][t][2]);
          out[mt][t][3] = fmaf(s1, fmaf(CMUL, f3, -z1 * xg[mt][1]), out[mt][t][3]);
#endif
        }
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(NW * 32) lowbit_mma_w2(
    const unsigned char* __restrict__ xq, const float* __restrict__ sx, const int* __restrict__ xsum,
    const unsigned char* __restrict__ wq, const scale_t* __restrict__ sc, const scale_t* __restrict__ zp,
    const in_t* __restrict__ bias, in_t* __restrict__ y, float* __restrict__ ws, int* __restrict__ lock,
    const float* __restrict__ s0p, int M, int N, int Kp, int NG, int CPS) {
  constexpr int F = MT * NT * 4;  // a lane's C values
  __shared__ float red[NW][F][32];
  __shared__ int last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int n0 = blockIdx.x * (8 * NT);
  const int c0 = blockIdx.y * CPS, c1 = min(c0 + CPS, Kp / 128);
  const int T = c1 - c0 > warp ? (c1 - c0 - warp + NW - 1) / NW : 0;  // this warp's chunks: c0 + warp + NW i

  float out[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) out[mt][t][i] = 0.f;

  Step cur[D];  // a masked chunk (past the warp's range) reads chunk 0's activations and no weights
#pragma unroll
  for (int d = 0; d < D; ++d) {
    const int cn = d < T ? c0 + warp + NW * d : 0;
    load_weights(cur[d], wq, sc, zp, cn, d < T, n0, g, tq, N, Kp, NG);
    load_acts(cur[d], xq, xsum, cn, g, tq, M, Kp);
  }

  for (int t0 = 0; t0 < T; t0 += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      chunk_math(out, cur[d]);
      const int tn = t0 + d + D, cn = tn < T ? c0 + warp + NW * tn : 0;
      load_weights(cur[d], wq, sc, zp, cn, tn < T, n0, g, tq, N, Kp, NG);
      load_acts(cur[d], xq, xsum, cn, g, tq, M, Kp);
    }
  }

  // ---- the warps' sums (fixed order), times sx; stored, or this split's partial and the ticket
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) red[warp][(mt * NT + t) * 4 + i][lane] = out[mt][t][i];
  __syncthreads();
  for (int e = tid; e < F * 32; e += NW * 32) {  // e = value f of lane l: token m, row n
    const int f = e >> 5, l = e & 31;
    const int mt = f / (NT * 4), t = (f / 4) % NT, i = f % 4;
    const int m = 16 * mt + (l >> 2) + 8 * (i >> 1), n = n0 + 2 * NT * (l & 3) + NT * (i & 1) + t;
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) v += red[w][f][l];
    if (m < M && n < N) {
#if PROG
      v *= s0p[n];
#endif
      v *= sx[m];
#if SPLIT == 1
#if HAS_BIAS
      v += in_f(bias[n]);
#endif
      store_out(v, y + (size_t)m * N + n);
#else
      ws[((size_t)blockIdx.y * M + m) * N + n] = v;
#endif
    }
  }
#if SPLIT > 1
  __threadfence();  // this split's partials are visible device-wide before its ticket
  __syncthreads();
  if (tid == 0) last = atomicAdd(lock + blockIdx.x, 1) == SPLIT - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int e = tid; e < F * 32; e += NW * 32) {
    const int f = e >> 5, l = e & 31;
    const int mt = f / (NT * 4), t = (f / 4) % NT, i = f % 4;
    const int m = 16 * mt + (l >> 2) + 8 * (i >> 1), n = n0 + 2 * NT * (l & 3) + NT * (i & 1) + t;
    if (m < M && n < N) {
      float v = 0.f;
#pragma unroll
      for (int s = 0; s < SPLIT; ++s) v += ld_cg(ws + ((size_t)s * M + m) * N + n);
#if HAS_BIAS
      v += in_f(bias[n]);
#endif
      store_out(v, y + (size_t)m * N + n);
    }
  }
  if (tid == 0) atomicExch(lock + blockIdx.x, 0);
#endif
}
