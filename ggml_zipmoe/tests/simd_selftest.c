/* simd_selftest.c - every SIMD kernel this build has, against its portable oracle, and every codec on every chunk
 * shape. Built with -DZIPMOE_SELFTEST=ON (a static build of the library: it calls internal functions);
 * tools/dev/cross_arm64.sh runs it for AArch64 under qemu, where nothing else exercises the NEON kernels.
 *
 *   zipmoe-selftest                      all checks; exit status 0 when every one passed
 *   zipmoe-selftest bench KERNEL N REPS  run one kernel REPS times over N values (instruction counts under qemu's
 *                                        insn plugin, tools/dev/cross_arm64.sh insn); KERNEL: split-scalar,
 *                                        split-neon, merge-scalar, merge-neon, checksum-scalar, checksum-neon,
 *                                        esc-scalar, esc-simd (this CPU's SIMD decoder), huff
 *
 * Checks: every BF16 bit pattern splits and merges back, by each path; each SIMD kernel equals the portable one at
 * every length to 300 (and some long ones) and every alignment of every buffer, writing nothing past its output;
 * XXH3's SIMD builds equal its portable one at every length to 2100 and alignment; Huffman, escape and zstd chunks of
 * every shape decode to their input (ESC by every decoder level the CPU has, with the portable decoder's results and
 * errors); forged chunks are refused. */
#include "zipmoe-impl.h"
#include "common/cpu.h"

#include <stdio.h>
#include <stdlib.h>

static int failures = 0;
static int checks   = 0;

#define CHECK(cond, ...)                                        \
    do {                                                        \
        checks++;                                               \
        if (!(cond)) {                                          \
            if (failures++ < 20) {                              \
                fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
                fprintf(stderr, __VA_ARGS__);                   \
                fputc('\n', stderr);                            \
            }                                                   \
        }                                                       \
    } while (0)

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64*: reproducible, no libc state */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

static void * xmalloc(size_t n) {
    void * p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(2);
    }
    return p;
}

/* BF16 values shaped like trained weights: a sum of uniforms (near normal), scaled to ~0.02, truncated */
static uint16_t weight_like(void) {
    float x = 0;
    for (int k = 0; k < 4; k++) {
        x += (float) (rnd() >> 40) / (float) (1u << 24) - 0.5f;
    }
    x *= 0.03f;
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t) (u >> 16);
}

/* ---------------------------------------------------------------- split / merge */

typedef void (*split_fn)(const uint16_t *, size_t, uint8_t *, uint8_t *);
typedef void (*split_sm_fn)(const uint16_t *, size_t, uint8_t *);
typedef void (*merge_fn)(const uint8_t *, const uint8_t *, size_t, uint16_t *);

typedef struct {
    const char * name;
    split_fn     split;
    split_sm_fn  split_sm;
    merge_fn     merge;
} split_kernels;

#if defined(ZIPMOE_HAVE_AVX2)
static void merge_avx2_stream(const uint8_t * e, const uint8_t * s, size_t n, uint16_t * d) { zipmoe_merge_bf16_avx2(e, s, n, d, 0); }
#endif

/* the kernels to hold to the scalar ones: the dispatched ones always, each SIMD one where this CPU has it */
static int simd_kernels(split_kernels * k) {
    int n = 0;
    k[n++] = (split_kernels){ "dispatched", zipmoe_split_bf16, zipmoe_split_sm_bf16, zipmoe_merge_bf16 };
    k[n++] = (split_kernels){ "dispatched-cached", zipmoe_split_bf16, zipmoe_split_sm_bf16, zipmoe_merge_bf16_cached };
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        k[n++] = (split_kernels){ "avx2", zipmoe_split_bf16_avx2, zipmoe_split_sm_bf16_avx2, merge_avx2_stream };
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        k[n++] = (split_kernels){ "neon", zipmoe_split_bf16_neon, zipmoe_split_sm_bf16_neon, zipmoe_merge_bf16_neon };
    }
#endif
    return n;
}

static void test_every_bf16_pattern(void) {
    const size_t n   = 65536;
    uint16_t *   src = xmalloc(n * 2), *dst = xmalloc(n * 2);
    uint8_t *    e0 = xmalloc(n), *s0 = xmalloc(n), *e1 = xmalloc(n), *s1 = xmalloc(n);
    for (size_t i = 0; i < n; i++) {
        src[i] = (uint16_t) i;
    }
    zipmoe_split_bf16_scalar(src, n, e0, s0);
    int ok = 1;
    for (size_t i = 0; i < n; i++) { /* the planes' definition, bit by bit */
        ok &= e0[i] == ((i >> 7) & 0xff) && s0[i] == (((i >> 15) << 7) | (i & 0x7f));
    }
    CHECK(ok, "scalar split does not give exponent = bits 14..7, sm = bit 15 | bits 6..0");
    zipmoe_merge_bf16_scalar(e0, s0, n, dst);
    CHECK(memcmp(dst, src, n * 2) == 0, "scalar merge does not restore every bit pattern");

    split_kernels k[8];
    const int     nk = simd_kernels(k);
    for (int j = 0; j < nk; j++) {
        memset(e1, 0xa5, n);
        memset(s1, 0xa5, n);
        k[j].split(src, n, e1, s1);
        CHECK(memcmp(e1, e0, n) == 0 && memcmp(s1, s0, n) == 0, "%s split of every pattern != scalar", k[j].name);
        memset(s1, 0xa5, n);
        k[j].split_sm(src, n, s1);
        CHECK(memcmp(s1, s0, n) == 0, "%s sm split of every pattern != scalar", k[j].name);
        memset(dst, 0xa5, n * 2);
        k[j].merge(e0, s0, n, dst);
        CHECK(memcmp(dst, src, n * 2) == 0, "%s merge does not restore every bit pattern", k[j].name);
    }
    free(src); free(dst); free(e0); free(s0); free(e1); free(s1);
}

/* every length to 300 and some long ones; the values at every 2-byte offset 0..30 (alignments mod 32), the planes
 * at every byte offset 0..15; guard bytes around each output */
static void test_split_merge_lengths_alignments(void) {
    static const size_t longs[] = { 511, 512, 513, 1023, 4096 + 17, 65536 + 31 };
    enum { PAD = 64, GUARD = 0x5a };
    const size_t max = 65536 + 31;
    uint8_t *    src_b = xmalloc(2 * max + PAD), *dst_b = xmalloc(2 * max + PAD), *ref_b = xmalloc(2 * max + PAD);
    uint8_t *    e0 = xmalloc(max + PAD), *s0 = xmalloc(max + PAD), *e1 = xmalloc(max + PAD), *s1 = xmalloc(max + PAD);
    for (size_t i = 0; i < 2 * max + PAD; i++) {
        src_b[i] = (uint8_t) rnd();
    }
    split_kernels k[8];
    const int     nk = simd_kernels(k);
    for (size_t li = 0; li < 301 + sizeof longs / sizeof *longs; li++) {
        const size_t n = li <= 300 ? li : longs[li - 301];
        for (size_t a = 0; a < 16; a++) {
            const size_t     b   = (a * 7) % 16; /* the planes' offset: another one than the values' */
            const uint16_t * src = (const uint16_t *) (void *) (src_b + 2 * a);
            zipmoe_split_bf16_scalar(src, n, e0 + b, s0 + b);
            for (int j = 0; j < nk; j++) {
                memset(e1, GUARD, n + PAD);
                memset(s1, GUARD, n + PAD);
                k[j].split(src, n, e1 + b, s1 + b);
                int guard_ok = 1;
                for (size_t g = 0; g < b; g++) {
                    guard_ok &= e1[g] == GUARD && s1[g] == GUARD;
                }
                for (size_t g = n + b; g < n + PAD; g++) {
                    guard_ok &= e1[g] == GUARD && s1[g] == GUARD;
                }
                CHECK(memcmp(e1 + b, e0 + b, n) == 0 && memcmp(s1 + b, s0 + b, n) == 0,
                      "%s split != scalar at n=%zu, offsets %zu/%zu", k[j].name, n, a, b);
                CHECK(guard_ok, "%s split wrote outside its planes at n=%zu, offsets %zu/%zu", k[j].name, n, a, b);
                memset(s1, GUARD, n + PAD);
                k[j].split_sm(src, n, s1 + b);
                CHECK(memcmp(s1 + b, s0 + b, n) == 0 && s1[n + b] == GUARD && (b == 0 || s1[b - 1] == GUARD),
                      "%s sm split != scalar (or wrote outside) at n=%zu, offsets %zu/%zu", k[j].name, n, a, b);
            }
            /* merge from planes at offset b into an output at offset a */
            memset(ref_b, GUARD, 2 * n + PAD);
            zipmoe_merge_bf16_scalar(e0 + b, s0 + b, n, (uint16_t *) (void *) (ref_b + 2 * a));
            CHECK(memcmp(ref_b + 2 * a, src, 2 * n) == 0, "scalar merge(split) != input at n=%zu offset %zu", n, a);
            for (int j = 0; j < nk; j++) {
                memset(dst_b, GUARD, 2 * n + PAD);
                k[j].merge(e0 + b, s0 + b, n, (uint16_t *) (void *) (dst_b + 2 * a));
                CHECK(memcmp(dst_b, ref_b, 2 * n + PAD) == 0,
                      "%s merge != scalar (or wrote outside) at n=%zu, offsets %zu/%zu", k[j].name, n, b, a);
            }
        }
    }
    free(src_b); free(dst_b); free(ref_b); free(e0); free(s0); free(e1); free(s1);
}

/* ---------------------------------------------------------------- checksum */

typedef uint64_t (*checksum_fn)(const void *, size_t, uint64_t);

static void test_checksum(void) {
    struct {
        const char * name;
        checksum_fn  fn;
    } k[4];
    int nk = 0;
    k[nk++] = (__typeof__(k[0])){ "dispatched", zipmoe_checksum };
#if defined(ZIPMOE_HAVE_AVX2)
    if (zipmoe_cpu_has_avx2()) {
        k[nk++] = (__typeof__(k[0])){ "avx2", zipmoe_checksum_avx2 };
    }
#endif
#if defined(ZIPMOE_HAVE_NEON)
    if (zipmoe_cpu_has_neon()) {
        k[nk++] = (__typeof__(k[0])){ "neon", zipmoe_checksum_neon };
    }
#endif
    const size_t max = 1 << 17;
    uint8_t *    buf = xmalloc(max + 16);
    for (size_t i = 0; i < max + 16; i++) {
        buf[i] = (uint8_t) rnd();
    }
    /* XXH3 has paths for 0-16, 17-128, 129-240 bytes, then 64-byte stripes in 1 KiB blocks: every length to 2100
     * crosses each of them and two block ends */
    static const uint64_t seeds[] = { 0, 1, 0x9e3779b97f4a7c15ull };
    for (size_t n = 0; n <= 2100; n++) {
        for (size_t a = 0; a < 16; a += (n < 300 ? 1 : 5)) {
            for (size_t si = 0; si < (n < 300 ? 3u : 1u); si++) {
                const uint64_t ref = zipmoe_checksum_portable(buf + a, n, seeds[si]);
                for (int j = 0; j < nk; j++) {
                    CHECK(k[j].fn(buf + a, n, seeds[si]) == ref, "%s checksum != portable at n=%zu offset %zu seed %zu",
                          k[j].name, n, a, si);
                }
            }
        }
    }
    for (size_t n = 4096; n <= max; n = n * 2 + 13) {
        const uint64_t ref = zipmoe_checksum_portable(buf + 3, n, 7);
        for (int j = 0; j < nk; j++) {
            CHECK(k[j].fn(buf + 3, n, 7) == ref, "%s checksum != portable at n=%zu", k[j].name, n);
        }
    }
    /* a known value: XXH3-64 of the empty input with seed 0 (xxhash's own test vector) */
    CHECK(zipmoe_checksum_portable("", 0, 0) == 0x2D06800538D394C2ull, "portable XXH3 of \"\" is not the reference");
    free(buf);
}

/* ---------------------------------------------------------------- codecs */

typedef enum { DIST_WEIGHTS, DIST_ONE, DIST_ALL, DIST_FEW } dist;

static void fill(uint16_t * v, size_t n, dist d) {
    for (size_t i = 0; i < n; i++) {
        switch (d) {
        case DIST_WEIGHTS: v[i] = weight_like(); break;
        case DIST_ONE: v[i] = (uint16_t) (0x3c00 | (rnd() & 0x807f)); break; /* one exponent */
        case DIST_ALL: v[i] = (uint16_t) rnd(); break;                        /* all 256 exponents */
        case DIST_FEW: v[i] = (uint16_t) (((120 + rnd() % 5) << 7) | (rnd() & 0x807f)); break;
        }
    }
}

static const char * codec_name(zipmoe_codec c) {
    return c == ZIPMOE_CODEC_HUFF ? "huff" : c == ZIPMOE_CODEC_ESC ? "esc" : "zstd";
}

static zipmoe_codec_ctx * make_codec(zipmoe_codec codec, const uint16_t * src, size_t n) {
    uint64_t hist[256] = { 0 };
    zipmoe_exponent_histogram(src, n, hist);
    uint8_t table[256];
    if (codec == ZIPMOE_CODEC_HUFF) {
        CHECK(zipmoe_huff_lengths(hist, table) == ZIPMOE_OK, "huff lengths");
    } else if (codec == ZIPMOE_CODEC_ESC) {
        CHECK(zipmoe_esc_classes(hist, table) == ZIPMOE_OK, "esc classes");
    }
    zipmoe_codec_ctx * c = NULL;
    CHECK(zipmoe_codec_create(codec, 3, table, &c) == ZIPMOE_OK, "codec create");
    return c;
}

/* one chunk: encode, decode (checksummed), each ESC decoder level against the portable one, and forgeries */
static void check_chunk(zipmoe_codec codec, zipmoe_workspace * ws, const uint16_t * src, size_t n, uint8_t * code,
                        size_t cap, uint8_t * sm, uint8_t * exp, uint8_t * exp2, uint16_t * dst) {
    zipmoe_codec_ctx * c = make_codec(codec, src, n);
    if (!c) {
        return;
    }
    const char *  name = codec_name(codec);
    const int64_t size = zipmoe_chunk_encode(c, ws, src, n, code, cap);
    CHECK(size > 0 && (size_t) size <= zipmoe_chunk_bound(c, n), "%s encode of n=%zu: %lld", name, n, (long long) size);
    if (size <= 0) {
        zipmoe_codec_free(c);
        return;
    }
    zipmoe_split_sm_bf16_scalar(src, n, sm);
    const uint64_t sum = zipmoe_chunk_checksum(code, (size_t) size, sm, n);
    memset(dst, 0xa5, (n + 8) * 2);
    int64_t rc = zipmoe_chunk_decode(c, ws, code, (size_t) size, sm, n, 1, sum, dst);
    CHECK(rc == (int64_t) n && memcmp(dst, src, n * 2) == 0, "%s chunk of n=%zu does not decode to its input (%lld)",
          name, n, (long long) rc);
    CHECK(dst[n] == 0xa5a5, "%s decode wrote past n=%zu", name, n);

    if (codec == ZIPMOE_CODEC_ESC) {
        for (int level = 0; level <= zipmoe_esc_simd_level(); level++) {
            const int64_t lr = zipmoe_esc_decode_chunk_at(c, level, code, (size_t) size, exp, n);
            if (level != 0 && level != zipmoe_esc_simd_level()) {
                CHECK(lr == ZIPMOE_ERR_UNSUPPORTED, "esc level %d is not this CPU's but ran", level);
                continue;
            }
            zipmoe_split_bf16_scalar(src, n, exp2, sm);
            CHECK(lr == (int64_t) n && memcmp(exp, exp2, n) == 0, "esc level %d decode of n=%zu wrong", level, n);
        }
    }

    /* forgeries: a flipped bit anywhere and a truncated chunk fail the checksum; unchecked, the decoders give an
     * error or n values (never a crash, never more), and every ESC decoder gives the portable one's answer */
    for (int t = 0; t < 8; t++) {
        const size_t  bit = (size_t) (rnd() % ((uint64_t) size * 8));
        code[bit / 8] ^= (uint8_t) (1u << (bit % 8));
        rc = zipmoe_chunk_decode(c, ws, code, (size_t) size, sm, n, 1, sum, dst);
        CHECK(rc == ZIPMOE_ERR_CHECKSUM, "%s: a flipped bit %zu of n=%zu passed the checksum (%lld)", name, bit, n,
              (long long) rc);
        rc = zipmoe_chunk_decode(c, ws, code, (size_t) size, sm, n, 0, 0, dst);
        CHECK(rc == (int64_t) n || rc == ZIPMOE_ERR_CORRUPT || rc == ZIPMOE_ERR_CODEC,
              "%s: unchecked forged chunk gave %lld", name, (long long) rc);
        if (codec == ZIPMOE_CODEC_ESC && zipmoe_esc_simd_level() > 0) {
            const int64_t r0 = zipmoe_esc_decode_chunk_at(c, 0, code, (size_t) size, exp, n);
            const int64_t r1 = zipmoe_esc_decode_chunk_at(c, zipmoe_esc_simd_level(), code, (size_t) size, exp2, n);
            CHECK(r0 == r1 && (r0 < 0 || memcmp(exp, exp2, n) == 0), "esc: SIMD (%lld) and portable (%lld) decoders "
                  "disagree on a forged chunk of n=%zu", (long long) r1, (long long) r0, n);
        }
        code[bit / 8] ^= (uint8_t) (1u << (bit % 8));
    }
    if (size > 1) {
        rc = zipmoe_chunk_decode(c, ws, code, (size_t) size - 1, sm, n, 1, sum, dst);
        CHECK(rc == ZIPMOE_ERR_CHECKSUM, "%s: a truncated chunk of n=%zu passed the checksum", name, n);
        rc = zipmoe_chunk_decode(c, ws, code, (size_t) size - 1, sm, n, 0, 0, dst);
        CHECK(rc == (int64_t) n || rc < 0, "%s: unchecked truncated chunk gave %lld", name, (long long) rc);
        if (codec == ZIPMOE_CODEC_ESC) { /* its sizes are exact: a byte short is always corrupt */
            CHECK(rc == ZIPMOE_ERR_CORRUPT, "esc: a truncated chunk of n=%zu was not refused (%lld)", n, (long long) rc);
        }
    }
    if (codec == ZIPMOE_CODEC_HUFF && size >= ZIPMOE_HUFF_HEADER) { /* a stream size past the chunk's end */
        uint8_t saved[4];
        memcpy(saved, code, 4);
        zipmoe_store32le(code, (uint32_t) size);
        rc = zipmoe_chunk_decode(c, ws, code, (size_t) size, sm, n, 0, 0, dst);
        CHECK(rc == ZIPMOE_ERR_CORRUPT, "huff: a stream size past the chunk was not refused (%lld)", (long long) rc);
        memcpy(code, saved, 4);
    }
    zipmoe_codec_free(c);
}

static void test_codecs(void) {
    static const size_t longs[] = { 511, 512, 1000, 4095, 4096, 4097, 16384 + 5, 65536 };
    const size_t        max     = 65536;
    zipmoe_workspace *  ws      = zipmoe_workspace_create(max);
    CHECK(ws != NULL, "workspace");
    uint16_t * src = xmalloc((max + 8) * 2), *dst = xmalloc((max + 8) * 2);
    uint8_t *  sm = xmalloc(max), *exp = xmalloc(max + 64), *exp2 = xmalloc(max + 64);
    const size_t cap  = 4 * max + 4096;
    uint8_t *    code = xmalloc(cap);
    static const zipmoe_codec codecs[] = { ZIPMOE_CODEC_HUFF, ZIPMOE_CODEC_ESC, ZIPMOE_CODEC_ZSTD };
    for (size_t ci = 0; ci < 3; ci++) {
        for (int d = DIST_WEIGHTS; d <= DIST_FEW; d++) {
            for (size_t li = 1; li < 201 + sizeof longs / sizeof *longs; li++) {
                const size_t n = li <= 200 ? li : longs[li - 201];
                fill(src, n, (dist) d);
                check_chunk(codecs[ci], ws, src, n, code, cap, sm, exp, exp2, dst);
            }
        }
    }
    zipmoe_workspace_free(ws);
    free(src); free(dst); free(sm); free(exp); free(exp2); free(code);
}

/* ---------------------------------------------------------------- bench (instruction counts) */

static int bench(const char * kernel, size_t n, long reps) {
    uint16_t * src = xmalloc(n * 2), *dst = xmalloc(n * 2);
    uint8_t *  exp = xmalloc(n + 64), *sm = xmalloc(n);
    fill(src, n, DIST_WEIGHTS);
    zipmoe_split_bf16_scalar(src, n, exp, sm);
    zipmoe_workspace * ws   = zipmoe_workspace_create(n);
    const size_t       cap  = 4 * n + 4096;
    uint8_t *          code = xmalloc(cap);
    const int          esc  = strncmp(kernel, "esc-", 4) == 0, huff = strcmp(kernel, "huff") == 0;
    zipmoe_codec_ctx * c    = esc || huff ? make_codec(esc ? ZIPMOE_CODEC_ESC : ZIPMOE_CODEC_HUFF, src, n) : NULL;
    const int64_t      size = c ? zipmoe_chunk_encode(c, ws, src, n, code, cap) : 0;
    uint64_t           sink = 0;
    int                known = 1;
    for (long r = 0; r < reps; r++) {
        if (!strcmp(kernel, "split-scalar")) {
            zipmoe_split_bf16_scalar(src, n, exp, sm);
        } else if (!strcmp(kernel, "merge-scalar")) {
            zipmoe_merge_bf16_scalar(exp, sm, n, dst);
        } else if (!strcmp(kernel, "checksum-scalar")) {
            sink += zipmoe_checksum_portable(sm, n, sink);
        } else if (!strcmp(kernel, "esc-scalar")) {
            sink += (uint64_t) zipmoe_esc_decode_chunk_at(c, 0, code, (size_t) size, exp, n);
        } else if (!strcmp(kernel, "esc-simd")) {
            sink += (uint64_t) zipmoe_esc_decode_chunk_at(c, zipmoe_esc_simd_level(), code, (size_t) size, exp, n);
        } else if (huff) {
            sink += (uint64_t) zipmoe_chunk_decode_exponents(c, ws, code, (size_t) size, exp, n);
#if defined(ZIPMOE_HAVE_NEON)
        } else if (!strcmp(kernel, "split-neon")) {
            zipmoe_split_bf16_neon(src, n, exp, sm);
        } else if (!strcmp(kernel, "merge-neon")) {
            zipmoe_merge_bf16_neon(exp, sm, n, dst);
        } else if (!strcmp(kernel, "checksum-neon")) {
            sink += zipmoe_checksum_neon(sm, n, sink);
#endif
        } else {
            known = 0;
            break;
        }
    }
    if (!known) {
        fprintf(stderr, "zipmoe-selftest: unknown kernel %s for this build\n", kernel);
        return 2;
    }
    printf("%s n=%zu reps=%ld code=%lld sink=%llu out=%u\n", kernel, n, reps, (long long) size,
           (unsigned long long) sink, (unsigned) dst[n / 2] + exp[n / 3] + sm[n / 5]);
    zipmoe_codec_free(c);
    zipmoe_workspace_free(ws);
    free(src); free(dst); free(exp); free(sm); free(code);
    return 0;
}

int main(int argc, char ** argv) {
    if (argc >= 2 && !strcmp(argv[1], "bench")) {
        if (argc != 5) {
            fprintf(stderr, "usage: %s bench KERNEL N REPS\n", argv[0]);
            return 2;
        }
        return bench(argv[2], (size_t) strtoull(argv[3], NULL, 10), strtol(argv[4], NULL, 10));
    }
    if (argc != 1) {
        fprintf(stderr, "usage: %s [bench KERNEL N REPS]\n", argv[0]);
        return 2;
    }
    printf("zipmoe-selftest: simd level %d (0 portable, 1 AVX2, 2 NEON), esc simd level %d, neon %d, avx2 %d\n",
           zipmoe_simd_level(), zipmoe_esc_simd_level(), zipmoe_cpu_has_neon(), zipmoe_cpu_has_avx2());
    test_every_bf16_pattern();
    test_split_merge_lengths_alignments();
    test_checksum();
    test_codecs();
    printf("zipmoe-selftest: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
