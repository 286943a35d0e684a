/* esc_avx512.c - the escape code's decoder, 64 exponents a step (AVX-512 BW + VBMI + VBMI2); compiled for them
 * and called only after a CPU check (esc.c). Per step: the 64 primary codes are cut out of 16 bytes with one
 * multishift; the escapes' 3-bit codes (as many as the step has escapes) are cut out of the secondary plane the
 * same way and expanded into the escaped lanes; the second escapes' raw bytes are loaded and expanded likewise.
 * Every load is masked to its plane's bytes, so nothing past the chunk is touched; the counts are checked before
 * each step uses them, so a corrupt chunk stops with an error, never reads out of bounds. */
#include "zipmoe-impl.h"

#include <immintrin.h>

static inline __mmask64 low_mask(size_t k) { return k >= 64 ? ~(__mmask64) 0 : _bzhi_u64(~0ull, (unsigned) k); }

int64_t zipmoe_esc_decode_avx512(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp,
                                 size_t n, const uint8_t * warm, size_t warm_size) {
    zipmoe_esc_planes pl;
    const int64_t     rc = zipmoe_esc_parse(code, code_size, n, &pl);
    if (rc < 0) {
        return rc;
    }
    const __m512i primary   = _mm512_loadu_si512(e->primary);
    const __m512i secondary = _mm512_loadu_si512(e->secondary);
    /* qword L of the primary step gathers bytes 2L, 2L+1 (codes 8L..8L+7); of the secondary, bytes 3L..3L+7 */
    const __m512i p_gather = _mm512_set_epi64(0x0f0e0f0e0f0e0f0e, 0x0d0c0d0c0d0c0d0c, 0x0b0a0b0a0b0a0b0a,
                                              0x0908090809080908, 0x0706070607060706, 0x0504050405040504,
                                              0x0302030203020302, 0x0100010001000100);
    const __m512i s_gather = _mm512_set_epi64(0x1c1b1a1918171615, 0x1918171615141312, 0x161514131211100f,
                                              0x131211100f0e0d0c, 0x100f0e0d0c0b0a09, 0x0d0c0b0a09080706,
                                              0x0a09080706050403, 0x0706050403020100);
    const __m512i p_shift  = _mm512_set1_epi64(0x0e0c0a0806040200);
    const __m512i s_shift  = _mm512_set1_epi64(0x15120f0c09060300);
    const __m512i three    = _mm512_set1_epi8(3);
    const __m512i seven    = _mm512_set1_epi8(7);

    size_t si = 0, ri = 0; /* secondary codes and raw bytes used */
    for (size_t i = 0; i < n; i += 64) {
        if (i < warm_size) { /* the caller's next input, a line a step: in L2 by the end of the chunk */
            _mm_prefetch((const char *) warm + i, _MM_HINT_T1);
        }
        const size_t    left  = n - i;
        const __mmask64 lanes = low_mask(left);
        const __m512i   pbytes =
            _mm512_maskz_loadu_epi8(low_mask(left >= 64 ? 16 : (left + 3) / 4), pl.primary + i / 4);
        const __m512i   pcodes = _mm512_and_si512(
            _mm512_multishift_epi64_epi8(p_shift, _mm512_permutexvar_epi8(p_gather, pbytes)), three);
        __m512i         out = _mm512_permutexvar_epi8(pcodes, primary);
        /* no branch on whether a step has escapes or raw bytes: about half the steps of trained weights have a raw
         * byte, at random, and a mispredicted branch cost more than the masked work (a zero mask loads nothing) */
        const __mmask64 esc = _mm512_mask_cmpeq_epi8_mask(lanes, pcodes, three);
        const size_t    cnt = (size_t) _mm_popcnt_u64(esc);
        if (cnt > pl.n_sec - si) {
            return ZIPMOE_ERR_CORRUPT;
        }
        /* the step's codes begin at bit 3 * si: load from its byte, shift by the rest */
        const size_t    bit    = 3 * si, byte = bit >> 3;
        const size_t    avail  = pl.s_size - byte;
        const __m512i   sbytes = _mm512_maskz_loadu_epi8(low_mask(avail < 32 ? avail : 32), pl.secondary + byte);
        const __m512i   shift  = _mm512_add_epi8(s_shift, _mm512_set1_epi8((char) (bit & 7)));
        const __m512i   fields = _mm512_and_si512(
            _mm512_multishift_epi64_epi8(shift, _mm512_permutexvar_epi8(s_gather, sbytes)), seven);
        const __m512i   scodes = _mm512_maskz_expand_epi8(esc, fields);
        out                    = _mm512_mask_permutexvar_epi8(out, esc, scodes, secondary);
        const __mmask64 raw    = _mm512_mask_cmpeq_epi8_mask(esc, scodes, seven);
        const size_t    rcnt   = (size_t) _mm_popcnt_u64(raw);
        si += cnt;
        if (rcnt > pl.n_raw - ri) {
            return ZIPMOE_ERR_CORRUPT;
        }
        out = _mm512_mask_expand_epi8(out, raw, _mm512_maskz_loadu_epi8(low_mask(rcnt), pl.raw + ri));
        ri += rcnt;
        _mm512_mask_storeu_epi8(exp + i, lanes, out);
    }
    return si == pl.n_sec && ri == pl.n_raw ? (int64_t) n : ZIPMOE_ERR_CORRUPT;
}
