/* cpu.h - what this CPU can run of the library's SIMD kernels, detected once, in one place (cpu.c). Each answer
 * is 0 where the library was built without those kernels, so callers dispatch on it alone. */
#ifndef ZIPMOE_CPU_H
#define ZIPMOE_CPU_H

int zipmoe_cpu_has_avx2(void);   /* AVX2: split/merge (split_avx2.c) and XXH3 (checksum_avx2.c) */
int zipmoe_cpu_has_vbmi2(void);  /* AVX-512 BW + VBMI + VBMI2 and BMI2: the ESC decoder (esc_avx512.c) */
/* AArch64 Advanced SIMD (NEON): split/merge (split_neon.c) and XXH3 (checksum_neon.c).
 * Architecturally part of ARMv8-A, yet read from the kernel's hardware capabilities (HWCAP_ASIMD)
 * like the others: a kernel or an emulator may run a core without it. */
int zipmoe_cpu_has_neon(void);

#endif /* ZIPMOE_CPU_H */
