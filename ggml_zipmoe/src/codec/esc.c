/* esc.c - the escape code over exponent bytes: a tensor's 3 commonest exponents get a 2-bit code, an escape
 * (code 3) is followed by a 3-bit code for the next 7, and a second escape (3-bit code 7) by the raw byte. Each
 * level lives in its own plane, so a decoder reads 64 primary codes at a time and places the escapes with one
 * expand instruction (esc_avx512.c), instead of walking one serial bit stream as Huffman must.
 *
 * Why: the Huffman decoder resolves ~1.4 exponents a cycle and is most of a warm (compressed in RAM) expert's
 * cost. Trained weights' exponents carry ~2.6 bits; this code spends ~2.9 (2-3% more bytes a compressed expert)
 * and decodes several times faster where AVX-512 VBMI2 is there. This file holds the tables, the encoder, the
 * portable decoder that the SIMD one is tested against, and the dispatch. */
#include "zipmoe-impl.h"
#include "common/cpu.h"

#include <stdlib.h>

static int cmp_count_desc(const uint64_t * hist, int a, int b) {
    return hist[a] != hist[b] ? hist[a] > hist[b] : a < b; /* 1: a before b */
}

int64_t zipmoe_esc_classes(const uint64_t hist[256], uint8_t classes[256]) {
    if (!hist || !classes) {
        return ZIPMOE_ERR_ARG;
    }
    memset(classes, 0, 256);
    int order[256];
    for (int s = 0; s < 256; s++) {
        order[s] = s;
    }
    /* the ten commonest by a partial selection sort: ties by symbol, so the table is a pure function of hist */
    const int picks = ZIPMOE_ESC_PRIMARY + ZIPMOE_ESC_SECONDARY;
    for (int i = 0; i < picks; i++) {
        int best = i;
        for (int j = i + 1; j < 256; j++) {
            if (cmp_count_desc(hist, order[j], order[best])) {
                best = j;
            }
        }
        const int t = order[i];
        order[i]    = order[best];
        order[best] = t;
        if (hist[order[i]]) {
            classes[order[i]] = (uint8_t) (i + 1);
        }
    }
    return ZIPMOE_OK;
}

int64_t zipmoe_esc_check_classes(const uint8_t classes[256]) {
    if (!classes) {
        return ZIPMOE_ERR_ARG;
    }
    unsigned seen = 0;
    for (int s = 0; s < 256; s++) {
        const unsigned c = classes[s];
        if (c > ZIPMOE_ESC_PRIMARY + ZIPMOE_ESC_SECONDARY || (c && (seen >> c & 1))) {
            return ZIPMOE_ERR_CORRUPT;
        }
        seen |= 1u << c;
    }
    return ZIPMOE_OK;
}

int64_t zipmoe_esc_init(zipmoe_esc * e, const uint8_t classes[256]) {
    const int64_t ok = zipmoe_esc_check_classes(classes);
    if (ok < 0) {
        return ok;
    }
    memset(e, 0, sizeof *e);
    memcpy(e->classes, classes, 256);
    for (int s = 0; s < 256; s++) {
        const unsigned c = classes[s];
        if (c >= 1 && c <= ZIPMOE_ESC_PRIMARY) {
            e->primary[c - 1] = (uint8_t) s;
        } else if (c > ZIPMOE_ESC_PRIMARY) {
            e->secondary[c - 1 - ZIPMOE_ESC_PRIMARY] = (uint8_t) s;
        }
    }
    return ZIPMOE_OK;
}

/* ---------------------------------------------------------------- layout */

/* header: u32 secondary codes, u32 raw bytes; then the primary plane (2 bits a value, LSB first), the secondary
 * plane (3 bits a code, LSB first) and the raw bytes, back to back */
static size_t primary_size(size_t n) { return (n + 3) / 4; }
static size_t secondary_size(size_t n_sec) { return (3 * n_sec + 7) / 8; }

size_t zipmoe_esc_bound(size_t n) { return ZIPMOE_ESC_HEADER + primary_size(n) + secondary_size(n) + n; }

int64_t zipmoe_esc_encode(const zipmoe_esc * e, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap) {
    size_t n_sec = 0, n_raw = 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned c = e->classes[exp[i]];
        n_sec += c == 0 || c > ZIPMOE_ESC_PRIMARY;
        n_raw += c == 0;
    }
    if (n_sec > UINT32_MAX) {
        return ZIPMOE_ERR_ARG;
    }
    const size_t p_size = primary_size(n), s_size = secondary_size(n_sec);
    const size_t total  = ZIPMOE_ESC_HEADER + p_size + s_size + n_raw;
    if (total > cap) {
        return ZIPMOE_ERR_DST_TOO_SMALL;
    }
    zipmoe_store32le(dst, (uint32_t) n_sec);
    zipmoe_store32le(dst + 4, (uint32_t) n_raw);
    uint8_t * p = dst + ZIPMOE_ESC_HEADER;
    uint8_t * s = p + p_size;
    uint8_t * r = s + s_size;
    memset(p, 0, p_size + s_size); /* padding bits stay zero: one encoding per input */
    size_t bit = 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned c    = e->classes[exp[i]];
        const unsigned code = c >= 1 && c <= ZIPMOE_ESC_PRIMARY ? c - 1 : 3;
        p[i >> 2] |= (uint8_t) (code << (2 * (i & 3)));
        if (code == 3) {
            const unsigned sec = c ? c - 1 - ZIPMOE_ESC_PRIMARY : 7;
            const unsigned sh  = bit & 7;
            s[bit >> 3] |= (uint8_t) (sec << sh);
            if (sh > 5) {
                s[(bit >> 3) + 1] |= (uint8_t) (sec >> (8 - sh));
            }
            bit += 3;
            if (sec == 7) {
                *r++ = exp[i];
            }
        }
    }
    return (int64_t) total;
}

/* ---------------------------------------------------------------- decode */

int64_t zipmoe_esc_parse(const uint8_t * code, size_t code_size, size_t n, zipmoe_esc_planes * pl) {
    if (code_size < ZIPMOE_ESC_HEADER) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const size_t n_sec = zipmoe_load32le(code), n_raw = zipmoe_load32le(code + 4);
    if (n_sec > n || n_raw > n_sec) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const size_t p_size = primary_size(n), s_size = secondary_size(n_sec);
    if (code_size != ZIPMOE_ESC_HEADER + p_size + s_size + n_raw) {
        return ZIPMOE_ERR_CORRUPT;
    }
    pl->primary   = code + ZIPMOE_ESC_HEADER;
    pl->secondary = pl->primary + p_size;
    pl->raw       = pl->secondary + s_size;
    pl->n_sec     = n_sec;
    pl->n_raw     = n_raw;
    pl->s_size    = s_size;
    return ZIPMOE_OK;
}

int64_t zipmoe_esc_decode_scalar(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp,
                                 size_t n) {
    /* A value at a time: 0.23 G exponents/s on Zen 4, 16x slower than Huffman's decoder (a branch-free version of
     * this loop measured the same). What is fast is the SIMD decoder; this one is its reference. */
    zipmoe_esc_planes pl;
    const int64_t     rc = zipmoe_esc_parse(code, code_size, n, &pl);
    if (rc < 0) {
        return rc;
    }
    size_t si = 0, ri = 0;
    for (size_t i = 0; i < n; i++) {
        const unsigned c = (pl.primary[i >> 2] >> (2 * (i & 3))) & 3;
        if (c < 3) {
            exp[i] = e->primary[c];
            continue;
        }
        if (si == pl.n_sec) {
            return ZIPMOE_ERR_CORRUPT;
        }
        const size_t   bit = 3 * si++, byte = bit >> 3;
        const unsigned two = pl.secondary[byte] | (byte + 1 < pl.s_size ? pl.secondary[byte + 1] << 8 : 0);
        const unsigned sec = (two >> (bit & 7)) & 7;
        if (sec < 7) {
            exp[i] = e->secondary[sec];
        } else {
            if (ri == pl.n_raw) {
                return ZIPMOE_ERR_CORRUPT;
            }
            exp[i] = pl.raw[ri++];
        }
    }
    return si == pl.n_sec && ri == pl.n_raw ? (int64_t) n : ZIPMOE_ERR_CORRUPT;
}

/* 2: AVX-512 BW + VBMI + VBMI2 (and BMI2); else 0. ZIPMOE_ESC_SIMD=0 turns it off (measurements, tests). An AVX2
 * decoder with pdep placing the escapes' codes ran at 2.1 G exponents/s against Huffman's 3.6 on Zen 4, so
 * there is none. */
static int detect_level(void) {
    if (!zipmoe_cpu_has_vbmi2()) {
        return 0;
    }
    zipmoe_runtime_config cfg;
    zipmoe_runtime_config_from_env(&cfg);
    return cfg.esc_simd ? 2 : 0;
}

static int cpu_level(void) {
    static int cached = -1; /* benign race: every thread computes the same value */
    if (cached < 0) {
        cached = detect_level();
    }
    return cached;
}

int zipmoe_esc_simd_level(void) { return cpu_level(); }

int64_t zipmoe_esc_decode_at(const zipmoe_esc * e, int level, const uint8_t * code, size_t code_size, uint8_t * exp,
                             size_t n, const uint8_t * warm, size_t warm_size) {
    if (level != 0 && level != cpu_level()) { /* the portable decoder, or this CPU's SIMD one */
        return ZIPMOE_ERR_UNSUPPORTED;
    }
#if defined(ZIPMOE_HAVE_AVX512)
    if (level == 2) {
        return zipmoe_esc_decode_avx512(e, code, code_size, exp, n, warm, warm ? warm_size : 0);
    }
#endif
    return zipmoe_esc_decode_scalar(e, code, code_size, exp, n);
}

int64_t zipmoe_esc_decode(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n,
                          const uint8_t * warm, size_t warm_size) {
    return zipmoe_esc_decode_at(e, cpu_level(), code, code_size, exp, n, warm, warm_size);
}
