// What the NVRTC kernels (cuda_stream.cu, cuda_mma.cu) share, put after their macros and before their
// source by cuda_build.py. Macros: IN_KIND / SCALE_KIND (x, y and bias / scales and zeros: 0 fp32, 1 fp16,
// 2 bf16). No CUDA header is included (NVRTC needs no toolkit): 16-bit floats are stored as unsigned
// short, converted by PTX.

template <int kind> struct Kind { typedef unsigned short T; };
template <> struct Kind<0> { typedef float T; };
template <> struct Kind<3> { typedef signed char T; };  // int8 group scales (cuda_mma's PROG)
typedef typename Kind<IN_KIND>::T in_t;
typedef typename Kind<SCALE_KIND>::T scale_t;

// a 16-bit float of kind 1 (fp16) or 2 (bf16) as fp32
__device__ __forceinline__ float h2f(unsigned short v, int kind) {
  if (kind == 2) return __int_as_float(((unsigned)v) << 16);  // bf16: the high half of an fp32
  float f;
  asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
  return f;
}
__device__ __forceinline__ float in_f(unsigned short v) { return h2f(v, IN_KIND); }
__device__ __forceinline__ float in_f(float v) { return v; }
__device__ __forceinline__ float scale_f(unsigned short v) { return h2f(v, SCALE_KIND); }
__device__ __forceinline__ float scale_f(float v) { return v; }

// y's element from fp32, rounded to nearest even
__device__ __forceinline__ void store_out(float v, in_t* p) {
#if IN_KIND == 0
  *p = v;
#else
  unsigned short h;
#if IN_KIND == 1
  asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(v));
#else
  asm("{ .reg .b16 t; cvt.rn.bf16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(v));
#endif
  *p = h;
#endif
}

