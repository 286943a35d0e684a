/* zipmoe-impl.h - what the library's own files share and nothing outside it sees. */
#ifndef ZIPMOE_IMPL_H
#define ZIPMOE_IMPL_H

#include "zipmoe.h"

#include <stdint.h>
#include <string.h>

/* Decode table index width: at least the longest code; a wider table resolves more symbols per
 * lookup. 12 bits (32 KiB of entries) measured ~4% faster than 11 and stays in L1. */
#define ZIPMOE_HUFF_TABLE_BITS 12
#define ZIPMOE_HUFF_TABLE_SIZE (1u << ZIPMOE_HUFF_TABLE_BITS)
/* Streams per chunk (part of the format). Four fit x86-64's registers; eight spilled and ran slower. */
#define ZIPMOE_HUFF_STREAMS 4
#define ZIPMOE_HUFF_HEADER     (4 * (ZIPMOE_HUFF_STREAMS - 1))
/* Slack after the exponent scratch so the multi-symbol decoder may store 4 bytes at a time. */
#define ZIPMOE_SCRATCH_SLACK   64

/* Huffman tables, built once per tensor and shared read-only by all threads. */
typedef struct {
    uint8_t  lengths[256];
    uint16_t codes[256];                    /* bit-reversed canonical codes, ready for LSB-first output */
    uint64_t dtable[ZIPMOE_HUFF_TABLE_SIZE]; /* multi-symbol decode entries, see huff.c */
    uint16_t single[ZIPMOE_HUFF_TABLE_SIZE]; /* one symbol | its length << 8, for stream tails */
} zipmoe_huff;

struct zipmoe_codec_ctx {
    zipmoe_codec codec;
    int          level;
    zipmoe_huff  huff; /* HUFF only */
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
int64_t zipmoe_huff_decode(const zipmoe_huff * h, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n);

/* zstd.c */
size_t  zipmoe_zstd_bound(size_t n);
int64_t zipmoe_zstd_encode(zipmoe_workspace * ws, int level, const uint8_t * exp, size_t n, uint8_t * dst, size_t cap);
int64_t zipmoe_zstd_decode(zipmoe_workspace * ws, const uint8_t * code, size_t code_size, uint8_t * exp, size_t n);
void *  zipmoe_zstd_dctx_create(void);
void    zipmoe_zstd_dctx_free(void * dctx);
void    zipmoe_zstd_cctx_free(void * cctx);

/* checksum_avx2.c: only called when the CPU has AVX2 */
uint64_t zipmoe_checksum_avx2(const void * data, size_t size, uint64_t seed);
/* split.c: whether the CPU has AVX2, cached */
int zipmoe_cpu_has_avx2(void);

/* split_avx2.c: only called when the CPU has AVX2 */
void zipmoe_split_bf16_avx2(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void zipmoe_merge_bf16_avx2(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);

/* codec.c: the chunk checksum over both planes (docs/FORMAT.md) */
uint64_t zipmoe_chunk_checksum(const void * code, size_t code_size, const uint8_t * sm, size_t n);
/* codec.c: encodes an exponent plane with the codec; the chunk format of docs/FORMAT.md */
int64_t zipmoe_encode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const uint8_t * exp, size_t n, void * dst, size_t cap);

/* tensor.c: where chunk c of expert e lies: its code from the start of the expert's region, its size,
 * its checksum, its first value and its number of values. e and c must be in range. */
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

#endif /* ZIPMOE_IMPL_H */
