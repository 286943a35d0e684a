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

/* checksum_avx2.c: only called when the CPU has AVX2 */
uint64_t zipmoe_checksum_avx2(const void * data, size_t size, uint64_t seed);
/* split.c: whether the CPU has AVX2, cached */
int zipmoe_cpu_has_avx2(void);

/* split_avx2.c: only called when the CPU has AVX2 */
void zipmoe_split_bf16_avx2(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void zipmoe_split_sm_bf16_avx2(const uint16_t * src, size_t n, uint8_t * sm);
/* cached: dst is a buffer about to be read (zipmoe_merge_bf16_cached); else large merges bypass the caches */
void zipmoe_merge_bf16_avx2(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst, int cached);

/* codec.c: zipmoe_chunk_decode_exponents, warming the bytes the caller reads next (zipmoe_huff_decode) */
int64_t zipmoe_decode_exp(const zipmoe_codec_ctx * c, zipmoe_workspace * ws, const void * code, size_t code_size,
                          uint8_t * exp, size_t n, const void * warm, size_t warm_size);
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

/* monotonic nanoseconds, for the stats and the reader's timings */
static inline uint64_t zipmoe_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

/* reader.c: reading a plan's compressed bytes on the reader thread (see reader.c). An item lists up to two
 * segments (offset from the data companion, size, destination); `ready` becomes 1 once they are read, -1 on an
 * error or a cancel. */
typedef struct {
    uint64_t  offset;
    uint64_t  size;
    uint8_t * dst;
    int       direct; /* dst lies in a buffer laid out for zipmoe_pread_direct: read around the page cache */
} zipmoe_read_seg;

typedef struct {
    zipmoe_read_seg seg[2];
    int             n_seg;
    _Atomic int     ready;
    /* in a job whose staging is a ring (ring_wraps): the item's bytes [ring_lo, ring_hi) of the staging buffer
     * (ring_hi 0: none), which the reader fills only once every earlier item there is released (decoded) */
    uint64_t        ring_lo, ring_hi;
    _Atomic int     released;
    _Atomic int64_t chunks_left; /* chunks of it not decoded yet; the last one releases it */
} zipmoe_read_item;

typedef struct zipmoe_read_job {
    int                      fd;
    int                      dfd;     /* the same file opened with O_DIRECT, or -1 */
    uint64_t                 base;    /* file offset of the data companion */
    int64_t                  n_items;
    zipmoe_read_item *       items;
    _Atomic int              cancel;
    int                      busy;    /* under mu: submitted and not finished */
    pthread_mutex_t          mu;
    pthread_cond_t           cv;
    struct zipmoe_store *    collapse; /* instead of reads: zipmoe_store_collapse(collapse) */
    struct zipmoe_store *    prefetch; /* after the reads: zipmoe_store_prefetch(prefetch, prefetch_like, */
    struct zipmoe_store *    prefetch_like; /* prefetch_predicted), or nothing when prefetch is NULL        */
    int                      prefetch_predicted;
    int                      ring_wraps; /* the staging buffer is smaller than the reads: items reuse its bytes */
    struct zipmoe_read_job * next;
} zipmoe_read_job;

int  zipmoe_reader_submit(zipmoe_read_job * job);              /* ZIPMOE_OK, or an error: read synchronously */
int  zipmoe_reader_wait_item(zipmoe_read_job * job, int64_t i); /* ZIPMOE_OK once item i is read */
void zipmoe_reader_finish(zipmoe_read_job * job, int cancel);   /* waits until the reader is done with job */
/* By the decoder of item i's last chunk in a ring job: its staged bytes may be read over. */
void zipmoe_reader_release_item(zipmoe_read_job * job, int64_t i);
/* A decode failed: the reader stops (the items left are marked failed), and nobody waits for releases. */
void zipmoe_reader_cancel(zipmoe_read_job * job);
int  zipmoe_pread_all(int fd, uint64_t offset, void * buf, size_t size);
/* Reading around the page cache (O_DIRECT): offsets, sizes and buffers aligned to this. */
#define ZIPMOE_DIRECT_ALIGN ((size_t) 4096)
/* pread on a descriptor opened with O_DIRECT: reads [offset, offset + size) of the file into buf, reading the
 * aligned span around it, so buf - offset % ZIPMOE_DIRECT_ALIGN must be aligned and the span's rounded-up end
 * must fit the buffer. ZIPMOE_ERR_ARG if the file system refused the alignment (EINVAL). */
int  zipmoe_pread_direct(int dfd, uint64_t offset, void * buf, size_t size);
/* Reads what no tier keeps: with zipmoe_pread_direct where dfd >= 0 and the file system takes it (buf laid out
 * for it), else through the page cache, dropping the pages after (the budget counts one copy). */
int  zipmoe_pread_uncached(int fd, int dfd, uint64_t offset, void * buf, size_t size);
int  zipmoe_reader_reads_waiting(void); /* a job of reads is queued: background work (collapse) should yield */
/* Waits until no read-ahead runs: one reads the store it fills and the store whose job it follows, both of which
 * a caller freeing a store (after its invocations returned) must outlive. */
void zipmoe_reader_wait_read_ahead(void);
/* slots.c: memfd slots that keep decoded experts' pages from one expert to the next */
void     zipmoe_slots_set_keep(uint64_t bytes);           /* free slots keep their pages up to this */
void     zipmoe_slots_trim(void);                         /* free slots' pages beyond it go back now */
uint64_t zipmoe_slots_kept(void);
int      zipmoe_slots_usable(const void * addr, size_t size); /* page-aligned, and memfds work */
int64_t  zipmoe_slots_attach(void * addr, size_t size);   /* a slot mapped over [addr, +size), or -1 */
int      zipmoe_slots_detach(void * addr, size_t size, int64_t slot); /* [addr, +size) empty again */
/* store.c: huge pages for a store's settled decoded experts (run by the reader thread, or the prefill's); 0 when
 * it stopped early for reads waiting, to be submitted again */
int zipmoe_store_collapse(struct zipmoe_store * s);
/* readahead.c: reads ahead a store's experts that its next invocation will likely route to (run by the reader thread):
 * those routed now in `like` (a store of the same layer, which shares its router); with `predicted`, those the
 * previous layer predicted (zipmoe_store_predict); else every one not decoded (a prompt routes to most) */
void zipmoe_store_prefetch(struct zipmoe_store * s, const struct zipmoe_store * like, int predicted);
/* stats.c: counts a read in zipmoe_stats */
void zipmoe_stats_add_read(uint64_t bytes, uint64_t ns);

#endif /* ZIPMOE_IMPL_H */
