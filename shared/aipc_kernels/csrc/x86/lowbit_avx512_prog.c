/*
 * The AVX-512 VNNI row-block kernels for the progressive form with per-token activations (lowbit_args.int_acc):
 * lowbit_avx512_tile.inc's tiles with the integer group epilogue (block_avx512_prog).
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"
#include "prefetch.h"

#define EPILOGUE512 prog_epilogue512
#define STORE512 prog_store512
#define BLOCK512_FN block_avx512_prog
#include "lowbit_avx512_tile.inc"
#endif /* AIPC_X86 */
