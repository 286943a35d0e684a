/* split.c - BF16 <-> (exponent, sign+mantissa) planes: the portable version and the dispatch. */
#include "zipmoe-impl.h"
#include "common/cpu.h"

void zipmoe_split_bf16_scalar(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm) {
    for (size_t i = 0; i < n; i++) {
        const uint16_t v = src[i];
        exp[i] = (uint8_t) (v >> 7);
        sm[i]  = (uint8_t) (((v >> 8) & 0x80) | (v & 0x7f));
    }
}

void zipmoe_split_sm_bf16_scalar(const uint16_t * src, size_t n, uint8_t * sm) {
    for (size_t i = 0; i < n; i++) {
        sm[i] = (uint8_t) (((src[i] >> 8) & 0x80) | (src[i] & 0x7f));
    }
}

void zipmoe_merge_bf16_scalar(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    for (size_t i = 0; i < n; i++) {
        dst[i] = (uint16_t) (((sm[i] & 0x80u) << 8) | ((unsigned) exp[i] << 7) | (sm[i] & 0x7fu));
    }
}

int zipmoe_simd_level(void) { return zipmoe_cpu_has_avx2() ? 1 : zipmoe_cpu_has_neon() ? 2 : 0; }

void zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm) {
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        zipmoe_split_bf16_avx2(src, n, exp, sm);
        return;
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        zipmoe_split_bf16_neon(src, n, exp, sm);
        return;
    }
#endif
    zipmoe_split_bf16_scalar(src, n, exp, sm);
}

void zipmoe_split_sm_bf16(const uint16_t * src, size_t n, uint8_t * sm) {
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        zipmoe_split_sm_bf16_avx2(src, n, sm);
        return;
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        zipmoe_split_sm_bf16_neon(src, n, sm);
        return;
    }
#endif
    zipmoe_split_sm_bf16_scalar(src, n, sm);
}

static void merge_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst, int cached) {
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        zipmoe_merge_bf16_avx2(exp, sm, n, dst, cached);
        return;
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        zipmoe_merge_bf16_neon(exp, sm, n, dst); /* (cached or not: normal stores, split_neon.c) */
        return;
    }
#endif
    (void) cached;
    zipmoe_merge_bf16_scalar(exp, sm, n, dst);
}

void zipmoe_merge_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) { merge_bf16(exp, sm, n, dst, 0); }

void zipmoe_merge_bf16_cached(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst) {
    merge_bf16(exp, sm, n, dst, 1);
}

void zipmoe_exponent_histogram(const uint16_t * src, size_t n, uint64_t hist[256]) {
    /* four sub-histograms hide the store-to-load latency of repeated symbols */
    uint32_t h[4][256];
    memset(h, 0, sizeof h);
    size_t i = 0;
    while (i < n) {
        /* flush before a 32-bit counter could overflow */
        const size_t end = (n - i > ((size_t) 1 << 30)) ? i + ((size_t) 1 << 30) : n;
        for (; i + 4 <= end; i += 4) {
            h[0][(src[i + 0] >> 7) & 0xff]++;
            h[1][(src[i + 1] >> 7) & 0xff]++;
            h[2][(src[i + 2] >> 7) & 0xff]++;
            h[3][(src[i + 3] >> 7) & 0xff]++;
        }
        for (; i < end; i++) {
            h[0][(src[i] >> 7) & 0xff]++;
        }
        for (int s = 0; s < 256; s++) {
            hist[s] += (uint64_t) h[0][s] + h[1][s] + h[2][s] + h[3][s];
        }
        memset(h, 0, sizeof h);
    }
}
