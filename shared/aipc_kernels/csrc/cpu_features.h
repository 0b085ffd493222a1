/*
 * CPU feature queries of cpu_features.c that kernels use besides the ISA choice (aipc_get_isa): an
 * extension one ISA level does not imply. Not part of the C API (see aipc_native.h).
 */
#ifndef AIPC_CPU_FEATURES_H
#define AIPC_CPU_FEATURES_H

/* AVX512-BF16 (vdpbf16ps) on this CPU: bf16 dot products for the kernels that read bf16 activations. */
int cpu_has_avx512_bf16(void);

#endif /* AIPC_CPU_FEATURES_H */
