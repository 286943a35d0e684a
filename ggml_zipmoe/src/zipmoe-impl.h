/* zipmoe-impl.h - what the library's own files share and nothing outside it sees. */
#ifndef ZIPMOE_IMPL_H
#define ZIPMOE_IMPL_H

#include "zipmoe.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* Decode table index width: at least the longest code; a wider table resolves more symbols per
 * lookup. 12 bits (32 KiB of entries) measured ~4% faster than 11 and stays in L1. */
#define ZIPMOE_HUFF_TABLE_BITS 12
#define ZIPMOE_HUFF_TABLE_SIZE (1u << ZIPMOE_HUFF_TABLE_BITS)
/* Streams per chunk (part of the format). Four fit x86-64's registers; eight spilled and ran slower. */
#define ZIPMOE_HUFF_STREAMS 4
#define ZIPMOE_HUFF_HEADER     (4 * (ZIPMOE_HUFF_STREAMS - 1))
/* Slack after the exponent scratch: a margin only (the decoders write exactly n bytes, which callers of
 * zipmoe_chunk_decode_exponents and zipmoe_store_stream_exponents rely on). */
#define ZIPMOE_SCRATCH_SLACK   64

/* Huffman tables, built once per tensor and shared read-only by all threads. */
typedef struct {
    uint8_t  lengths[256];
    uint16_t codes[256];                    /* bit-reversed canonical codes, ready for LSB-first output */
    uint64_t dtable[ZIPMOE_HUFF_TABLE_SIZE]; /* multi-symbol decode entries, see huff.c */
    uint16_t single[ZIPMOE_HUFF_TABLE_SIZE]; /* one symbol | its length << 8, for stream tails */
} zipmoe_huff;

/* Escape-code tables (esc.c): the symbol of each primary and secondary code, padded for a 64-byte permute. */
#define ZIPMOE_ESC_HEADER 8
typedef struct {
    uint8_t classes[256];
    uint8_t primary[64];
    uint8_t secondary[64];
} zipmoe_esc;

struct zipmoe_codec_ctx {
    zipmoe_codec codec;
    int          level;
    int32_t      ggml_type; /* of the chunks it codes */
    int32_t      layout;    /* zipmoe_layout of ggml_type */
    zipmoe_huff  huff; /* HUFF only */
    zipmoe_esc   esc;  /* ESC only */
};

struct zipmoe_workspace {
    size_t   chunk_n;
    uint8_t *exp;      /* chunk_n + slack: one chunk's exponent plane */
    uint8_t *sm;       /* chunk_n: sign+mantissa scratch for zipmoe_chunk_encode */
    void    *zstd_d;   /* ZSTD_DCtx, created with the workspace (decode is the hot path) */
    void    *zstd_c;   /* ZSTD_CCtx, created on first encode */
};

/* huff.c */
int64_t zipmoe_huff_init(zipmoe_huff * h, const uint8_t lengths[256]);
size_t  zipmoe_huff_bound(size_t n);
int64_t zipmoe_huff_encode(const zipmoe_huff * h, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap);
/* warm (or NULL): warm_size bytes the caller reads next (a chunk's sign+mantissa plane), prefetched into L2 while the
 * codes decode: that plane's read from memory then overlaps the decoder's arithmetic instead of following it */
int64_t zipmoe_huff_decode(const zipmoe_huff * h, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n,
                           const void * warm, size_t warm_size);

/* esc.c */
typedef struct {
    const uint8_t * primary, * secondary, * raw;
    size_t          n_sec, n_raw, s_size;
} zipmoe_esc_planes;
int64_t zipmoe_esc_init(zipmoe_esc * e, const uint8_t classes[256]);
size_t  zipmoe_esc_bound(size_t n);
int64_t zipmoe_esc_encode(const zipmoe_esc * e, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap);
/* a chunk's planes, its sizes checked against n and code_size */
int64_t zipmoe_esc_parse(const uint8_t * code, size_t code_size, size_t n, zipmoe_esc_planes * pl);
int64_t zipmoe_esc_decode_scalar(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp,
                                 size_t n);
/* warm: as zipmoe_huff_decode's */
int64_t zipmoe_esc_decode(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n,
                          const uint8_t * warm, size_t warm_size);
/* the decoder of SIMD level `level` (zipmoe_esc_simd_level's numbers); ZIPMOE_ERR_UNSUPPORTED above this CPU's */
int64_t zipmoe_esc_decode_at(const zipmoe_esc * e, int level, const uint8_t * code, size_t code_size, uint8_t * exp,
                             size_t n, const uint8_t * warm, size_t warm_size);
/* esc_avx512.c: only called when the CPU has AVX-512 BW, VBMI and VBMI2 */
int64_t zipmoe_esc_decode_avx512(const zipmoe_esc * e, const uint8_t * code, size_t code_size, uint8_t * exp,
                                 size_t n, const uint8_t * warm, size_t warm_size);

/* zstd.c */
size_t  zipmoe_zstd_bound(size_t n);
int64_t zipmoe_zstd_encode(zipmoe_workspace * ws, int level, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap);
int64_t zipmoe_zstd_decode(zipmoe_workspace * ws, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n);
void *  zipmoe_zstd_dctx_create(void);
void    zipmoe_zstd_dctx_free(void * dctx);
void    zipmoe_zstd_cctx_free(void * cctx);

/* raw.c: the RAW codec, the bytes themselves (a chunk of n units is n bytes) */
size_t  zipmoe_raw_bound(size_t n);
int64_t zipmoe_raw_encode(const uint8_t * src, size_t n, uint8_t * dst, size_t cap);
int64_t zipmoe_raw_decode(const uint8_t * code, size_t code_size, uint8_t * dst, size_t n);

/* checksum_avx2.c: only called when the CPU has AVX2 */
uint64_t zipmoe_checksum_avx2(const void * data, size_t size, uint64_t seed);

/* split_avx2.c: only called when the CPU has AVX2 */
void zipmoe_split_bf16_avx2(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void zipmoe_split_sm_bf16_avx2(const uint16_t * src, size_t n, uint8_t * sm);
/* cached: dst is a buffer about to be read (zipmoe_merge_bf16_cached); else large merges bypass the caches */
void zipmoe_merge_bf16_avx2(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst, int cached);

/* split_neon.c, checksum_neon.c: only called when the CPU has NEON (AArch64 Advanced SIMD) */
void     zipmoe_split_bf16_neon(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void     zipmoe_split_sm_bf16_neon(const uint16_t * src, size_t n, uint8_t * sm);
void     zipmoe_merge_bf16_neon(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);
uint64_t zipmoe_checksum_neon(const void * data, size_t size, uint64_t seed);
/* checksum.c: XXH3-64's portable build, the oracle of the SIMD ones */
uint64_t zipmoe_checksum_portable(const void * data, size_t size, uint64_t seed);

/* codec.c: zipmoe_chunk_decode_exponents, warming the bytes the caller reads next (zipmoe_huff_decode) */
int64_t zipmoe_decode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const void * code, size_t code_size,
                          uint8_t * exp, size_t n, const void * warm, size_t warm_size);
/* codec.c: the chunk checksum over both planes (docs/FORMAT.md) */
uint64_t zipmoe_chunk_checksum(const void * code, size_t code_size, const uint8_t * sm, size_t n);
/* codec.c: encodes an exponent plane with the codec; the chunk format of docs/FORMAT.md */
int64_t zipmoe_encode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const uint8_t * exp, size_t n, void * dst, size_t cap);

/* tensor.c: where chunk c of expert e lies: its code from the start of the expert's region, its size,
 * its checksum, its first unit and its number of units (values of split types, bytes of byte-layout ones). e and
 * c must be in range. */
typedef struct {
    uint64_t code_offset;
    uint64_t code_size;
    uint64_t checksum;
    int64_t  first;
    int64_t  n;
} zipmoe_chunk_ref;
void zipmoe_tensor_chunk(const zipmoe_tensor * t, int64_t e, int64_t c, zipmoe_chunk_ref * ref);

static inline uint64_t zipmoe_load64le(const uint8_t * p) {
    uint64_t v;
    memcpy(&v, p, sizeof v); /* little-endian hosts only: checked in CMake */
    return v;
}

static inline uint32_t zipmoe_load32le(const uint8_t * p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void zipmoe_store32le(uint8_t * p, uint32_t v) { memcpy(p, &v, sizeof v); }

static inline size_t zipmoe_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* Reading around the page cache (O_DIRECT): offsets, sizes and buffers aligned to this. */
#define ZIPMOE_DIRECT_ALIGN ((size_t) 4096)

/* monotonic nanoseconds, for the stats and the reader's timings */
static inline uint64_t zipmoe_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

#endif /* ZIPMOE_IMPL_H */
