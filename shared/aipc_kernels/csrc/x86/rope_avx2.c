/*
 * The rotary embedding's row loops (rope.h) compiled for AVX2 (x86-64-v3: AVX2, FMA, F16C): the dispatch table's entry for that ISA.
 */
#include "rope.h"
#if defined(__x86_64__) || defined(_M_X64)
ROPE_ROWS_INSTANCE(rope_rows_avx2, __attribute__((target("arch=x86-64-v3"))))
#endif
