/*
 * The codes of aipc_native.h by name, for the Python loader (aipc_kernels.core.native checks its tables
 * against these at load) and its error messages: the one place a status is worded.
 */
#include <stddef.h>

#include "aipc_native.h"

AIPC_API int aipc_abi_version(void) { return AIPC_ABI_VERSION; }

AIPC_API const char *aipc_status_message(int status) {
    switch ((aipc_status)status) {
    case AIPC_OK: return "ok";
    case AIPC_ERR_BITS: return "bits must be 1, 2, 4 or 8";
    case AIPC_ERR_SHAPE:
        return "bad shape (lowbit_linear: K must be a multiple of the chunk: 32 for 1 bit, 16 for 2 bits, 8 for 4 bits, 4 for 8 bits; "
               "segment_sdpa: sizes must be positive, N a multiple of B and Hq of Hkv)";
    case AIPC_ERR_GROUP: return "bad group size (must divide K and be a multiple of the chunk; at most 65536 for 8 bits, 8192 for 4 bits with stored zeros)";
    case AIPC_ERR_DTYPE: return "unsupported dtype";
    case AIPC_ERR_ISA: return "ISA not supported by this CPU";
    case AIPC_ERR_NOMEM: return "out of memory";
    case AIPC_ERR_CODEBOOK:
        return "bad code book constants (cmul must be finite and positive, zero finite, or NaN for per-group zeros; "
               "4 and 8 bits: cmul 1 and an integer zero within the codes; 8 bits: a fixed zero)";
    case AIPC_ERR_ZEROS: return "zeros missing: the code book stores a zero point per group (zero=NaN) but zeros is None";
    case AIPC_ERR_NULL: return "a tensor pointer is NULL";
    case AIPC_ERR_THREADS: return "nthreads out of range (0 for OpenMP's default, up to 4096)";
    case AIPC_ERR_PATH: return "path entry out of range [0, N)";
    case AIPC_ERR_AMAX:
        return "act_amax (per-token activation absmax) needs per-token activation scales (act_group == K)";
    case AIPC_ERR_DEQUANT: return "dequant must be 0 (e0m4: bit operations) or 1 (int: conversion)";
    case AIPC_ERR_SUPERS:
        return "two-level scales (int8 scales): supers (float32 super-block scales) required, the super-block a "
               "power-of-two number of groups dividing K, and no stored zero points (the progressive form: the min "
               "form with zero 0 and cmul 1, one super-block a row, K <= 131072); other scales take no supers";
    }
    return "unknown status";
}

AIPC_API const char *aipc_dtype_name(int dt) {
    static const char *const names[AIPC_DT_COUNT] = {
        [AIPC_DT_F32] = "float32", [AIPC_DT_BF16] = "bfloat16", [AIPC_DT_F16] = "float16"};
    return dt >= 0 && dt < AIPC_DT_COUNT ? names[dt] : NULL;
}

AIPC_API const char *aipc_isa_name(int isa) {
    static const char *const names[AIPC_ISA_COUNT] = {
        [AIPC_ISA_SCALAR] = "scalar", [AIPC_ISA_AVX2] = "avx2", [AIPC_ISA_AVX_VNNI] = "avx_vnni",
        [AIPC_ISA_AVX512_VNNI] = "avx512_vnni", [AIPC_ISA_AMX_INT8] = "amx_int8"};
    return isa >= 0 && isa < AIPC_ISA_COUNT ? names[isa] : NULL;
}
