/* cpu.c - CPU feature detection for the kernel dispatch (cpu.h). The kernels live in files of their own compiled
 * for their instruction set, and run only after a check here, so one binary runs on any x86-64 or AArch64. */
#include "common/cpu.h"

#if defined(__aarch64__) && defined(__linux__) && defined(ZIPMOE_HAVE_NEON)
#    include <sys/auxv.h>
#    ifndef HWCAP_ASIMD
#        define HWCAP_ASIMD (1 << 1) /* linux/arch/arm64/include/uapi/asm/hwcap.h */
#    endif
#endif

/* Each answer is probed once and cached: every thread computes the same value, so the race to store it is
 * benign. */
#define CPU_ANSWER(name, probe)            \
    int name(void) {                       \
        static int cached = -1;            \
        if (cached < 0) {                  \
            cached = (probe) ? 1 : 0;      \
        }                                  \
        return cached;                     \
    }

#if defined(__x86_64__) && defined(ZIPMOE_HAVE_AVX2)
CPU_ANSWER(zipmoe_cpu_has_avx2, (__builtin_cpu_init(), __builtin_cpu_supports("avx2")))
#else
int zipmoe_cpu_has_avx2(void) { return 0; }
#endif

#if defined(__x86_64__) && defined(ZIPMOE_HAVE_AVX512)
CPU_ANSWER(zipmoe_cpu_has_vbmi2, (__builtin_cpu_init(), __builtin_cpu_supports("avx512bw") &&
                                  __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2") &&
                                  __builtin_cpu_supports("bmi2")))
#else
int zipmoe_cpu_has_vbmi2(void) { return 0; }
#endif

/* (Linux's hardware capabilities; another OS runs the portable code) */
#if defined(__aarch64__) && defined(__linux__) && defined(ZIPMOE_HAVE_NEON)
CPU_ANSWER(zipmoe_cpu_has_neon, getauxval(AT_HWCAP) & HWCAP_ASIMD)
#else
int zipmoe_cpu_has_neon(void) { return 0; }
#endif
