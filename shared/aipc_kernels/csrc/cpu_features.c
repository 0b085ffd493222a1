/*
 * CPU features and the process-wide ISA choice: cpuid / xgetbv / the kernel's AMX permission, the best
 * ISA of this CPU, and the one the kernels use (the best unless aipc_set_isa overrode it). Every entry
 * point of the library runs the dispatch table's kernels for aipc_get_isa() (dispatch.h).
 */
#include "dispatch.h"
#include "lowbit_kernels.h"

#ifdef AIPC_X86
#include <cpuid.h>
#endif
#ifdef AIPC_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* AMX-INT8 on the CPU, enabled by the OS (XCR0 tile state) and permitted for this process. */
int amx_usable(void) {
    static int usable = -1;
    if (usable >= 0) return usable;
    unsigned eax, ebx, ecx, edx;
    usable = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 25))) return 0;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return 0;
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18); succeeds again if already granted */
    usable = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return usable;
}
#endif /* AIPC_AMX */

static int detect_isa(void) {
#ifdef AIPC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
#ifdef AIPC_AMX
        if (amx_usable()) return AIPC_ISA_AMX_INT8;
#endif
        return AIPC_ISA_AVX512_VNNI;
    }
    if (__builtin_cpu_supports("avxvnni") && __builtin_cpu_supports("avx2")) return AIPC_ISA_AVX_VNNI;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return AIPC_ISA_AVX2;
#endif
    return AIPC_ISA_SCALAR;
}

/* AVX512-BF16 (vdpbf16ps) on this CPU: an extension the ISA level does not imply. */
static int cpu_has_avx512_bf16(void) {
#ifdef AIPC_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

static int g_isa = -1;

/* Whether the kernels multiply bf16 by bf16 with vdpbf16ps under the current ISA (AVX-512 and AVX512-BF16). */
AIPC_API int aipc_bf16_dot_products(void) {
    return aipc_kernel_isa(AIPC_OP_DENSE_TILE) == AIPC_ISA_AVX512_VNNI && cpu_has_avx512_bf16();
}

/* Best ISA this CPU supports (the one used unless overridden). */
AIPC_API int aipc_best_isa(void) { return detect_isa(); }

/* ISA used by the kernels. */
AIPC_API int aipc_get_isa(void) {
    if (g_isa < 0) g_isa = detect_isa();
    return g_isa;
}

/* Forces an ISA (for tests and benchmarks); refuses one the CPU lacks. */
AIPC_API int aipc_set_isa(int isa) {
    if (isa < AIPC_ISA_SCALAR || isa > detect_isa()) return AIPC_ERR_ISA;
#ifdef AIPC_X86
    if (isa == AIPC_ISA_AVX_VNNI && !__builtin_cpu_supports("avxvnni")) return AIPC_ERR_ISA;
#endif
    g_isa = isa;
    return AIPC_OK;
}

