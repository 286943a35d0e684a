/* split_avx2.c - AVX2 split/merge; compiled with -mavx2, called only after a CPU check. */
#include "zipmoe-impl.h"

#include <immintrin.h>

/* 16 values -> their sign+mantissa bytes, one per 16-bit lane */
static inline __m256i sm_lanes(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 8), _mm256_set1_epi16(0x0080)),
                           _mm256_and_si256(v, _mm256_set1_epi16(0x007f)));
}

/* two vectors of 16-bit lanes -> 32 bytes in order (packus works per 128-bit lane: a 64-bit permute fixes it) */
static inline __m256i pack_lanes(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(a, b), 0xd8);
}

void zipmoe_split_bf16_avx2(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm) {
    const __m256i lo8 = _mm256_set1_epi16(0x00ff);
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *) (src + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *) (src + i + 16));
        const __m256i e = pack_lanes(_mm256_and_si256(_mm256_srli_epi16(a, 7), lo8),
                                     _mm256_and_si256(_mm256_srli_epi16(b, 7), lo8));
        _mm256_storeu_si256((__m256i *) (exp + i), e);
        _mm256_storeu_si256((__m256i *) (sm + i), pack_lanes(sm_lanes(a), sm_lanes(b)));
    }
    zipmoe_split_bf16_scalar(src + i, n - i, exp + i, sm + i);
}

void zipmoe_split_sm_bf16_avx2(const uint16_t * src, size_t n, uint8_t * sm) {
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m256i a = _mm256_loadu_si256((const __m256i *) (src + i));
        const __m256i b = _mm256_loadu_si256((const __m256i *) (src + i + 16));
        _mm256_storeu_si256((__m256i *) (sm + i), pack_lanes(sm_lanes(a), sm_lanes(b)));
    }
    zipmoe_split_sm_bf16_scalar(src + i, n - i, sm + i);
}

/* 32 values: low byte = mantissa | exponent bit 0 << 7, high byte = sign | exponent >> 1; then the two bytes of
 * each value interleaved (values 0..15 in v[0], 16..31 in v[1]). */
static inline void merge_lanes(const uint8_t * exp, const uint8_t * sm, __m256i v[2]) {
    const __m256i m7f = _mm256_set1_epi8(0x7f);
    const __m256i m80 = _mm256_set1_epi8((char) 0x80);
    const __m256i e   = _mm256_loadu_si256((const __m256i *) exp);
    const __m256i s   = _mm256_loadu_si256((const __m256i *) sm);
    const __m256i lo  = _mm256_or_si256(_mm256_and_si256(s, m7f), _mm256_and_si256(_mm256_slli_epi16(e, 7), m80));
    const __m256i hi  = _mm256_or_si256(_mm256_and_si256(s, m80), _mm256_and_si256(_mm256_srli_epi16(e, 1), m7f));
    const __m256i a   = _mm256_unpacklo_epi8(lo, hi); /* values 0..7 and 16..23 */
    const __m256i b   = _mm256_unpackhi_epi8(lo, hi); /* values 8..15 and 24..31 */
    v[0]              = _mm256_permute2x128_si256(a, b, 0x20);
    v[1]              = _mm256_permute2x128_si256(a, b, 0x31);
}

/* Large outputs (a chunk of an expert, 128 KiB) are written around the caches: a decoded expert lands in memory no
 * cache holds (an evicted expert's place), and a normal store would first read every line it writes. Measured at
 * 75% of the 2.8g model, reads from RAM: 51.0-51.7 against 53.1-53.3 ms a token. */
#define MERGE_STREAM_BYTES (64u << 10)

void zipmoe_merge_bf16_avx2(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst, int cached) {
    size_t  i = 0;
    __m256i v[2];
    if (!cached && n * sizeof *dst >= MERGE_STREAM_BYTES) {
        i = (32 - (uintptr_t) dst % 32) % 32 / sizeof *dst; /* the values before dst's first 32-byte boundary */
        zipmoe_merge_bf16_scalar(exp, sm, i, dst);
        for (; i + 32 <= n; i += 32) {
            merge_lanes(exp + i, sm + i, v);
            _mm256_stream_si256((__m256i *) (dst + i), v[0]);
            _mm256_stream_si256((__m256i *) (dst + i + 16), v[1]);
        }
        _mm_sfence(); /* (streamed stores are weakly ordered: visible before whoever reads them next) */
    }
    for (; i + 32 <= n; i += 32) {
        merge_lanes(exp + i, sm + i, v);
        _mm256_storeu_si256((__m256i *) (dst + i), v[0]);
        _mm256_storeu_si256((__m256i *) (dst + i + 16), v[1]);
    }
    zipmoe_merge_bf16_scalar(exp + i, sm + i, n - i, dst + i);
}
