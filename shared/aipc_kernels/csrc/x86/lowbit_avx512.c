/*
 * AVX-512 VNNI kernels of the low-bit linear layer: decode (one token: gemv512_2b / gemv512_1b /
 * gemv512_4b / gemv512_6b / gemv512_8b), batches below up_min_m tokens (tile_otf512, tile_otf6_512: up-convert
 * on the fly, a tile of otf_m tokens shares each plane), and from up_min_m tokens on each row block
 * up-converted once and reused by every token tile (tile_up512).
 */
#include "lowbit_kernels.h"
#ifdef AIPC_X86
#include "lowbit_avx512.h"
#include "prefetch.h"

#define EPILOGUE512 group_epilogue512
#define EPILOGUE512_FIXED group_epilogue512_fixed
#define STORE512 store512
#define BLOCK512_FN block_avx512
#include "lowbit_avx512_tile.inc"
#endif /* AIPC_X86 */
