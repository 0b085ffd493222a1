/*
 * The rotary embedding's row loops (rope.h) compiled for AVX-512 (x86-64-v4: F, BW, CD, DQ, VL): the dispatch table's entry for that ISA.
 */
#include "rope.h"
#if defined(__x86_64__) || defined(_M_X64)
ROPE_ROWS_INSTANCE(rope_rows_avx512, __attribute__((target("arch=x86-64-v4"))))
#endif
