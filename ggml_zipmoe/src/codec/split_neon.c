/* split_neon.c - AArch64 NEON split/merge; called only after a CPU check (cpu.h). A BF16 value's two bytes are
 * its planes' bytes with one bit moved: the low byte holds the mantissa and the exponent's lowest bit, the high
 * byte the sign and the exponent's other seven. vld2/vst2 (de)interleave the bytes of 16 values in one
 * instruction, and the shift-and-insert instructions (sli, sri) move the bit, so a value costs under an
 * instruction where the scalar loop spends about ten. */
#include "zipmoe-impl.h"

#include <arm_neon.h>

/* 16 values' low and high bytes -> their exponent bytes (hi << 1 | lo >> 7) and sign+mantissa bytes
 * (hi's bit 7, lo's bits 6..0) */
static inline uint8x16_t exp_bytes(uint8x16x2_t v) { return vsriq_n_u8(vshlq_n_u8(v.val[1], 1), v.val[0], 7); }
static inline uint8x16_t sm_bytes(uint8x16x2_t v) { return vbslq_u8(vdupq_n_u8(0x80), v.val[1], v.val[0]); }

void zipmoe_split_bf16_neon(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const uint8x16x2_t a = vld2q_u8((const uint8_t *) (src + i));
        const uint8x16x2_t b = vld2q_u8((const uint8_t *) (src + i + 16));
        vst1q_u8(exp + i, exp_bytes(a));
        vst1q_u8(exp + i + 16, exp_bytes(b));
        vst1q_u8(sm + i, sm_bytes(a));
        vst1q_u8(sm + i + 16, sm_bytes(b));
    }
    zipmoe_split_bf16_scalar(src + i, n - i, exp + i, sm + i);
}

void zipmoe_split_sm_bf16_neon(const uint16_t * src, size_t n, uint8_t * sm) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        vst1q_u8(sm + i, sm_bytes(vld2q_u8((const uint8_t *) (src + i))));
        vst1q_u8(sm + i + 16, sm_bytes(vld2q_u8((const uint8_t *) (src + i + 16))));
    }
    zipmoe_split_sm_bf16_scalar(src + i, n - i, sm + i);
}

/* 16 values: low byte = sign+mantissa's bits 6..0 under the exponent's bit 0 (sli), high byte = the sign over the
 * exponent's bits 7..1 (sri) */
static inline uint8x16x2_t merge_bytes(const uint8_t * exp, const uint8_t * sm) {
    const uint8x16_t e = vld1q_u8(exp);
    const uint8x16_t s = vld1q_u8(sm);
    uint8x16x2_t     v;
    v.val[0] = vsliq_n_u8(s, e, 7);
    v.val[1] = vsriq_n_u8(s, e, 1);
    return v;
}

/* Normal stores at every size: ARMv8's non-temporal store (stnp) is a hint that cores treat differently, and the
 * cache bypass that pays on x86 (split_avx2.c) has not been measured on an ARM core. */
void zipmoe_merge_bf16_neon(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        vst2q_u8((uint8_t *) (dst + i), merge_bytes(exp + i, sm + i));
        vst2q_u8((uint8_t *) (dst + i + 16), merge_bytes(exp + i + 16, sm + i + 16));
    }
    zipmoe_merge_bf16_scalar(exp + i, sm + i, n - i, dst + i);
}
