// cuda_stream: the M == 1 W2A8 GEMV of aipc::lowbit_linear in CUDA C (NVIDIA only), compiled at first
// use by NVRTC (torch.cuda._compile_kernel) with the macros below; see cuda_stream.py.
//
// One launch does the whole op. Each block issues its first weight loads, then quantizes the activation
// row into shared memory itself (absmax -> 127 / absmax, round half even: the pre-pass's codes bit for
// bit, and the 16-k code sums of the zero term), then its warps stream blocks of RW rows: lane l owns
// row l % RW and every J-th 16-byte unit of it (J = 32 / RW; a unit is 4 words of a 32-byte triton_k32
// chunk), so one warp load reads RW rows x J consecutive units and one group's scales of the RW rows are
// one contiguous load. Loads run D units ahead of the math; per unit and plane one dp4a.u32.s32 of the
// masked (unshifted) plane, 4^q times its dot, against the activation word of the same 4 k; per group
// s * (cmul * dot - z * xsum) in fp32; the J lanes of a row are summed by shuffles, y = sum * sx (+ bias).
//
// Macros: IN_KIND / SCALE_KIND (x, y and bias / scales and zeros: 0 fp32, 1 fp16, 2 bf16), G (32, 64,
// 128), RW (rows per warp: 1, 2, 4, 8, 16 or 32), D (units in flight per lane), U (16-byte units per row: Kp / 64),
// NWARPS, XV (x vectors of 8 per thread: ceil(Kp / 8 / (32 NWARPS))), HAS_ZEROS, HAS_BIAS, HAS_AMAX, VEC
// (x 16-byte aligned, K % 8 == 0), CMUL, ZERO (float literals); IN_KIND / SCALE_KIND and the 16-bit float
// conversions in cuda_common.cuh. No CUDA header is included.

#define J (32 / RW)
#define NU ((U + J - 1) / J)            // units per lane and row
#define NUP ((NU + D - 1) / D * D)      // padded to whole steps of D

__device__ __forceinline__ int dp4a_us(unsigned a, int b, int c) {  // unsigned bytes of a . signed bytes of b
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int quant(float v, float inv) {  // rne(fp32(v * inv)), clamped for a given absmax
  int q = __float2int_rn(__fmul_rn(v, inv));
#if HAS_AMAX
  q = min(max(q, -127), 127);
#endif
  return q;
}

#define GPU (128 / G)  // groups per 128-k chunk (a unit holds G / 32 planes of each)

// one step of a warp's stream: a 16-byte unit of codes and the scales (and zeros) of its groups, all
// loaded D steps ahead of their use; masked steps (past N, U or the last group) give zeros
struct Step {
  int4 w;
  float s[GPU];
#if HAS_ZEROS
  float z[GPU];
#endif
};

// step t: row block b = wb + (t / NUP) * wstride, unit slot i = t % NUP
__device__ __forceinline__ Step load_step(const int4* __restrict__ wq, const scale_t* __restrict__ sc,
                                          const scale_t* __restrict__ zp, int t, int T, int wb, int wstride,
                                          int r, int j, int N, int NG) {
  Step st;
  const int b = wb + (t / NUP) * wstride, i = t % NUP;
  const int n = b * RW + r, u = j + J * i;
  const bool ok = t < T && n < N && i < NU && u < U;
  st.w = ok ? __ldg(wq + (size_t)n * U + u) : make_int4(0, 0, 0, 0);
#pragma unroll
  for (int p = 0; p < GPU; ++p) {
    const int g = (u >> 1) * GPU + p;
    const bool gok = ok && g < NG;  // padding past the last group: codes and activations 0
    st.s[p] = gok ? scale_f(__ldg(sc + (size_t)g * N + n)) : 0.f;
#if HAS_ZEROS
    st.z[p] = gok ? scale_f(__ldg(zp + (size_t)g * N + n)) : 0.f;
#endif
  }
  return st;
}

extern "C" __global__ void __launch_bounds__(NWARPS * 32) lowbit_gemv_w2(
    const in_t* __restrict__ x, const float* __restrict__ amax_in, const int4* __restrict__ wq,
    const scale_t* __restrict__ sc, const scale_t* __restrict__ zp, const in_t* __restrict__ bias,
    in_t* __restrict__ y, int N, int K, int NG) {
  __shared__ int4 xw4[U * 4];   // int8 codes, k = 128 c + 32 q + 16 h + e at byte 16 (8 c + 2 q + h) + e
  __shared__ int4 xsu[U];       // per unit u = 2 c + h: the 4 planes' 16-code sums
  __shared__ float red[NWARPS];
  signed char* xq = reinterpret_cast<signed char*>(xw4);
  int* xs = reinterpret_cast<int*>(xsu);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int r = lane % RW, j = lane / RW;
  const int blocks = (N + RW - 1) / RW;
  const int wstride = gridDim.x * NWARPS;
  const int wb = blockIdx.x * NWARPS + warp;  // this warp's first row block
  const int nb = wb < blocks ? (blocks - wb + wstride - 1) / wstride : 0;
  const int T = nb * NUP;

  Step cur[D];
#pragma unroll
  for (int d = 0; d < D; ++d) cur[d] = load_step(wq, sc, zp, d, T, wb, wstride, r, j, N, NG);

  // ---- the activation pass (every block, x from L2): absmax, codes, 16-k sums
  constexpr int NT = NWARPS * 32;
#if VEC
  constexpr int HV = (int)sizeof(in_t) / 2;  // 16-byte loads per 8 elements: 1 (16-bit) or 2 (fp32)
  int4 raw[XV][HV];                          // kept raw (4 registers per 8 bf16) for the second pass
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < XV; ++i) {
    const int k = (tid + NT * i) * 8;
#pragma unroll
    for (int h = 0; h < HV; ++h) raw[i][h] = k < K ? reinterpret_cast<const int4*>(x + k)[h] : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int h = 0; h < HV; ++h) {
      const in_t* e = reinterpret_cast<const in_t*>(&raw[i][h]);
#pragma unroll
      for (int m = 0; m < 8 / HV; ++m) amax = fmaxf(amax, fabsf(in_f(e[m])));
    }
  }
#else
  float amax = 0.f;
  for (int k = tid; k < K; k += NT) amax = fmaxf(amax, fabsf(in_f(x[k])));
#endif
#if HAS_AMAX
  amax = amax_in[0];
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) red[warp] = amax;
  __syncthreads();
  amax = red[0];
#pragma unroll
  for (int i = 1; i < NWARPS; ++i) amax = fmaxf(amax, red[i]);
#endif
  const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
  const float sx = __fdiv_rn(amax, 127.f);
#if VEC
#pragma unroll
  for (int i = 0; i < XV; ++i) {  // 8 codes -> 8 bytes; the two halves of a 16-k run meet by a shuffle
    const int k = (tid + NT * i) * 8;
    int q[8], s8 = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      q[e] = quant(in_f(reinterpret_cast<const in_t*>(&raw[i][e / (8 / HV)])[e % (8 / HV)]), inv);
      s8 += q[e];
    }
    const int s16 = s8 + __shfl_xor_sync(0xffffffffu, s8, 1);
    if (k < U * 64) {
      int2 packed;
      packed.x = (q[0] & 255) | (q[1] & 255) << 8 | (q[2] & 255) << 16 | (q[3] & 255) << 24;
      packed.y = (q[4] & 255) | (q[5] & 255) << 8 | (q[6] & 255) << 16 | (q[7] & 255) << 24;
      *reinterpret_cast<int2*>(xq + k) = packed;
      if (!(tid & 1)) xs[((k >> 7) * 2 + ((k >> 4) & 1)) * 4 + ((k >> 5) & 3)] = s16;
    }
  }
#else
  for (int k = tid; k < U * 64; k += NT) xq[k] = (signed char)(k < K ? quant(in_f(x[k]), inv) : 0);
  __syncthreads();
  for (int m = tid; m < U * 4; m += NT) {  // m = 16-k run: k = 16 m
    int t = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) t = __dp4a(reinterpret_cast<const int*>(xq)[m * 4 + e], 0x01010101, t);
    const int k = m * 16;
    xs[((k >> 7) * 2 + ((k >> 4) & 1)) * 4 + ((k >> 5) & 3)] = t;
  }
#endif
  __syncthreads();

  // ---- the rows
  float acc = 0.f;
  for (int t0 = 0; t0 < T; t0 += D) {
    Step nxt[D];
#pragma unroll
    for (int d = 0; d < D; ++d) nxt[d] = load_step(wq, sc, zp, t0 + D + d, T, wb, wstride, r, j, N, NG);
    const int b = wb + (t0 / NUP) * wstride;
    const int n = b * RW + r;
#pragma unroll
    for (int d = 0; d < D; ++d) {  // no branch: a masked step has zero codes and scales
      const int u = min(j + J * ((t0 + d) % NUP), U - 1);
      const int c = u >> 1, h = u & 1;
      const int wv[4] = {cur[d].w.x, cur[d].w.y, cur[d].w.z, cur[d].w.w};
      const int4 xsum = xsu[u];
      int dq[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int4 xx = xw4[c * 8 + q * 2 + h];  // k = 128 c + 32 q + 16 h .. + 15
        const unsigned m = 0x03030303u << (2 * q);
        int t = dp4a_us(wv[0] & m, xx.x, 0);
        t = dp4a_us(wv[1] & m, xx.y, t);
        t = dp4a_us(wv[2] & m, xx.z, t);
        t = dp4a_us(wv[3] & m, xx.w, t);
        dq[q] = t >> (2 * q);  // exact: 4^q times the plane's dot
      }
      const int xsq[4] = {xsum.x, xsum.y, xsum.z, xsum.w};
#pragma unroll
      for (int p = 0; p < GPU; ++p) {  // the unit's groups: G / 32 planes each
        int dot = 0, xsg = 0;
#pragma unroll
        for (int q = p * (G / 32); q < (p + 1) * (G / 32); ++q) { dot += dq[q]; xsg += xsq[q]; }
#if HAS_ZEROS
        const float z_ = cur[d].z[p];
#else
        const float z_ = ZERO;
#endif
        acc = fmaf(cur[d].s[p], CMUL * (float)dot - z_ * (float)xsg, acc);
      }
    }
    if ((t0 + D) % NUP == 0) {  // the row block is done: its J lanes per row summed
      float v = acc;
#pragma unroll
      for (int o = RW; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (j == 0 && n < N) {
        float res = v * sx;
#if HAS_BIAS
        res += in_f(bias[n]);
#endif
        store_out(res, y + n);
      }
      acc = 0.f;
    }
#pragma unroll
    for (int d = 0; d < D; ++d) cur[d] = nxt[d];
  }
}
