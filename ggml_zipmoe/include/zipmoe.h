/*
 * zipmoe.h - the public header of the zipmoe native library: the codec and the file format (stable).
 *
 * Lossless compression of BF16 Mixture-of-Experts weights. A BF16 value is split into its
 * exponent byte (low entropy, entropy coded in independently decodable chunks) and its
 * sign+mantissa byte (stored raw). Decoding gives back the original bits, always. F16 experts split the same
 * bits the same way (measured best, docs/FORMAT.md); experts of other types (F32, quantized blocks) are stored
 * raw, chunked and checksummed like the others.
 *
 * Conventions (as in zstd and ggml):
 *  - every function that can fail returns an int64_t: >= 0 is a size or success, < 0 is a
 *    zipmoe_status; zipmoe_status_str() names it;
 *  - all sizes are explicit, in bytes unless the name says "n" (a count of BF16 values);
 *  - the caller owns every buffer it passes; objects returned by the _create and _open functions are owned by
 *    the caller and released with the matching _free function;
 *  - nothing here allocates in a decode call: scratch memory lives in a zipmoe_workspace.
 * The file layout these functions read and write is specified in docs/FORMAT.md.
 *
 * The library's other public headers, one concern each, include this one: zipmoe-cache.h (the expert cache an
 * engine serves experts from at run time: stores, budgets, statistics) and
 * zipmoe-integrity.h (a loader's whole-file check). This header does not include them.
 */
#ifndef ZIPMOE_H
#define ZIPMOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#    define ZIPMOE_API __declspec(dllexport)
#else
#    define ZIPMOE_API __attribute__((visibility("default")))
#endif

#define ZIPMOE_VERSION_MAJOR 0
#define ZIPMOE_VERSION_MINOR 1
#define ZIPMOE_FORMAT_VERSION 2 /* zipmoe.version: 1 for files of BF16 experts only, 2 with other types */

/* ---------------------------------------------------------------- status codes */

typedef enum {
    ZIPMOE_OK               =  0,
    ZIPMOE_ERR_ARG          = -1, /* invalid argument (NULL, zero-sized where not allowed, ...) */
    ZIPMOE_ERR_CORRUPT      = -2, /* input violates the format: sizes, offsets, code tables      */
    ZIPMOE_ERR_CHECKSUM     = -3, /* a chunk's bytes do not match its recorded checksum          */
    ZIPMOE_ERR_NOMEM        = -4, /* an allocation failed (only *_create / *_open allocate)      */
    ZIPMOE_ERR_UNSUPPORTED  = -5, /* unknown codec, format version or tensor type                */
    ZIPMOE_ERR_DST_TOO_SMALL = -6, /* the output buffer cannot hold the result                   */
    ZIPMOE_ERR_CODEC        = -7, /* the underlying codec (zstd) reported an error               */
    ZIPMOE_ERR_IO           = -8, /* reading the model file failed                                  */
} zipmoe_status;

ZIPMOE_API const char * zipmoe_status_str(int64_t status);

/* ---------------------------------------------------------------- sizes */

/* The largest size zipmoe_parse_size accepts: 1 EiB, far above any memory or file it describes, and low enough
 * that sums of a few sizes cannot overflow 64 bits. */
#define ZIPMOE_SIZE_MAX ((uint64_t) 1 << 60)

/* Bytes from a size: optional surrounding white space, a decimal number (digits, optionally '.' and digits; no sign,
 * no exponent) and an optional unit, case-insensitive: b, k, kb, kib, m, mb, mib, g, gb, gib, t, tb, tib, all
 * binary (k = 1024). A fraction is rounded down to whole bytes ("0.5k" = 512). ZIPMOE_OK and *out set, or
 * ZIPMOE_ERR_ARG (*out untouched) for anything else, or more than ZIPMOE_SIZE_MAX. "60%" and "auto" are not
 * sizes: their callers resolve them. */
ZIPMOE_API int64_t zipmoe_parse_size(const char * text, uint64_t * out);

/* Bytes from a memory budget: a size (zipmoe_parse_size), or a percentage of total ("60%", "12.5 %": at most 100 and
 * four fraction digits), rounded down. ZIPMOE_OK and *out set, or ZIPMOE_ERR_ARG (*out untouched). "auto" is not a
 * budget here: it depends on the memory available, which its callers read. */
ZIPMOE_API int64_t zipmoe_parse_budget(const char * text, uint64_t total, uint64_t * out);

/* Whether text is "auto" (any case, optionally surrounded by white space): the budget zipmoe_auto_budget computes. */
ZIPMOE_API int zipmoe_budget_is_auto(const char * text);

/* Whether text is a memory budget as --memory-budget takes it: "auto", or what zipmoe_parse_budget reads. */
ZIPMOE_API int zipmoe_budget_valid(const char * text);

/* A size for people, in the largest binary unit below 1024 of it: "512 B", "3.1 MiB", ... "1024.0 PiB" (as
 * pyzipmoe's human_size writes every size), into buf[size], NUL-terminated. The length written, or
 * ZIPMOE_ERR_DST_TOO_SMALL (buf holds as much as fits; 16 bytes always suffice), or ZIPMOE_ERR_ARG. */
ZIPMOE_API int64_t zipmoe_size_text(uint64_t bytes, char * buf, size_t size);

/* ---------------------------------------------------------------- the memory available (`auto`) */

/* How much memory this process may use, read at one moment (common/memory.c), in bytes: the machine's
 * (/proc/meminfo) and the binding limit of its cgroup hierarchy, v1 or v2, the ancestor with the least room left.
 * pyzipmoe.runtime.memory reads the same files into its MemoryReading. */
typedef struct {
    uint64_t total;              /* MemTotal */
    uint64_t available;          /* MemAvailable: what the kernel could hand out without swapping */
    int32_t  has_cgroup;         /* 1: a memory-limited cgroup binds and the next four are its readings */
    uint64_t cgroup_limit;       /* its limit (memory.max, memory.limit_in_bytes) */
    uint64_t cgroup_usage;       /* its charged memory, page cache included */
    uint64_t cgroup_reclaimable; /* its inactive file cache, at most its usage */
    uint64_t cgroup_file_cache;  /* all its file cache, active and inactive, at most its usage */
} zipmoe_memory_reading;

/* Reads the memory now. cgroup_root (default /sys/fs/cgroup), proc_self (default /proc/self, for its cgroup file)
 * and meminfo (default /proc/meminfo) may be NULL; tests point them at fake trees. A cgroup file that is missing,
 * unreadable or garbled counts as no limit there. ZIPMOE_OK, or ZIPMOE_ERR_IO if meminfo cannot be read. */
ZIPMOE_API int64_t zipmoe_memory_read(const char * cgroup_root, const char * proc_self, const char * meminfo,
                                      zipmoe_memory_reading * out);

/* What `auto` leaves free: 3% of the memory limit (the machine's, or the cgroup's if smaller), at least 32 MiB. */
ZIPMOE_API uint64_t zipmoe_memory_margin(const zipmoe_memory_reading * r);

/* The budget of `--memory-budget auto`, never negative:
 *     auto      = min(model_bytes, available + held - margin)
 *     available = min(MemAvailable, cgroup limit - (cgroup usage - its file cache))   (tightest ancestor)
 *     margin    = zipmoe_memory_margin
 * held: what the runtime holds already (0 for a process's first model); model_bytes: the model's whole budget
 * (every expert decoded), UINT64_MAX for no cap. pyzipmoe.runtime.memory.auto_budget is the same formula. */
ZIPMOE_API uint64_t zipmoe_auto_budget(const zipmoe_memory_reading * r, uint64_t model_bytes, uint64_t held);

/* ---------------------------------------------------------------- the runtime configuration */

/* The ZIPMOE_* environment variables the native code reads (bare llama.cpp programs are configured through them;
 * pyzipmoe sets the same), read once by zipmoe_runtime_config_from_env. Text fields point into the environment:
 * the value, or NULL where the variable is unset or empty, valid until the variable changes; their users check
 * them and name them in their errors. Switches are 0 or 1. */
typedef struct {
    const char * memory_budget; /* ZIPMOE_MEMORY_BUDGET: bytes the model may keep resident (a size, "60%" of
                                 * physical memory, or "auto": zipmoe_auto_budget at load): its weights that are
                                 * not experts, the experts of one expert tensor in flight, a prompt's read
                                 * buffers and the cache tiers, which get the rest
                                 * (and, in generation, the room of the two before); unset: unbounded */
    const char * hot_share;     /* ZIPMOE_HOT_SHARE: the tiers' fraction for decoded experts (default:
                                 * zipmoe_budget_default_hot_share, 0 where nearly every expert fits compressed but
                                 * not decoded and the escape code's SIMD decoder makes a warm hit cheap, else 1) */
    const char * sm_share;      /* ZIPMOE_SM_SHARE: the fraction for sign+mantissa planes (default 0); whole
                                 * compressed experts get the rest */
    const char * plan;          /* ZIPMOE_PLAN: slots per tier per layer from `zipmoe plan`, instead of the shares:
                                 * "<layer>:<hot>,<warm>,<sm>;..." */
    const char * cache_policy;  /* ZIPMOE_CACHE_POLICY: lfuda (default, LFU with dynamic ageing), tlfu, lru, lfu, fifo */
    const char * cache;         /* ZIPMOE_CACHE: "none": decode on every use (measurements, tests); "unbounded" */
    const char * direct_io;     /* ZIPMOE_DIRECT_IO: "0": read the model file through the page cache (dropping what
                                 * was read) instead of around it with O_DIRECT (default "1", where the file system
                                 * has it) */
    const char * read_buffer;   /* ZIPMOE_READ_BUFFER: what each read buffer keeps between uses (default 16MiB; a
                                 * prompt's read-ahead above it waits for the other buffer instead of taking a second
                                 * large one) */
    const char * predict;       /* ZIPMOE_PREDICT: "1": in generation, the next layer's router runs on this layer's
                                 * input and the experts it picks are read ahead (default "0": on the synthetic models
                                 * it read 10% more and served under a tenth of the misses, with no speed difference
                                 * to measure) */
    int prefill;   /* ZIPMOE_PREFILL != "0": fill the tiers at load, as llama.cpp's read-ahead and warm-up fill the
                    * page cache for a plain model, so that the first tokens do not wait */
    int fused;     /* ZIPMOE_FUSED != "0": in generation and short batches (up to 64 routed slots, top-k x tokens) one
                    * node computes the matmul's rows, those of decoded experts while the others are read; "0": a node
                    * that materialises and then ggml_mul_mat_id, as a long batch does */
    int stream;    /* ZIPMOE_STREAM != "0": the fused node decodes a routed warm expert into each thread's cache, a few
                    * chunks at a time, computing their rows there; "0": into a place, as a long batch does */
    int esc_simd;  /* ZIPMOE_ESC_SIMD != "0": the escape code's SIMD decoder where the CPU has it (measurements,
                    * tests turn it off) */
    int integrity; /* ZIPMOE_INTEGRITY != "skip": the loader checks a zipmoe GGUF's metadata and dense tensors
                    * against its integrity record (skip: loads it unchecked, with a warning) */
    const char * control; /* ZIPMOE_CONTROL: the control file of a supervisor (`zipmoe run` / `zipmoe serve`, which
                           * alone set it) through which the budget follows the memory available; unset: fixed */
    const char * prior;   /* ZIPMOE_PRIOR: a prior file (docs/FORMAT.md, "Priors"): the model's expert popularity in
                           * earlier runs, which the eviction policy and the fill at load start from; a file of another
                           * model, or a damaged one, fails the load */
    const char * prior_record; /* ZIPMOE_PRIOR_RECORD: where the model's unload writes its run's expert uses as a prior
                                * file (zipmoe_prior_record), for the supervisor to merge into the kept prior; unset:
                                * none */
} zipmoe_runtime_config;

ZIPMOE_API void zipmoe_runtime_config_from_env(zipmoe_runtime_config * cfg);

/* The GOMP_SPINCOUNT that processes running zipmoe under a budget give OpenMP unless GOMP_SPINCOUNT or
 * OMP_WAIT_POLICY is set already ("2000"): zipmoe's llama.cpp programs (which set it and execute themselves again,
 * as libgomp reads it only as it loads), and pyzipmoe for itself and the programs it starts. ggml's threads meet at
 * a barrier after every operation of the graph, and libgomp lets a waiting thread spin about 300000 rounds: with as
 * many threads as cores (llama-cli's default) that spinning starved zipmoe's reader thread and the kernel's reads.
 * On 2 cores, llama-completion -t 2 generated 7.4-8.4 tokens/s at a 75% budget and 13.1 at 93%; with 2000 rounds
 * 13.1-13.7 and 23.3, and the same 62 tokens/s when everything fits. */
ZIPMOE_API const char * zipmoe_openmp_spincount(void);

/* ---------------------------------------------------------------- codecs */

typedef enum {
    ZIPMOE_CODEC_ZSTD = 1, /* zstd on the exponent plane, level configurable (the paper's codec) */
    ZIPMOE_CODEC_HUFF = 2, /* canonical Huffman, per-tensor table, 4 streams per chunk, decoded
                              several symbols per table lookup (zipmoe's fast codec) */
    ZIPMOE_CODEC_ESC  = 3, /* escape code, per-tensor classes: 2 bits for the 3 commonest exponents, 3 more
                              for the next 7, a raw byte for the rest, each level in its own plane; ~0.3 bits
                              more than Huffman, decoded 64 exponents a SIMD step (AVX-512 VBMI2) */
    ZIPMOE_CODEC_RAW  = 4, /* the bytes themselves: the codec of byte-layout types (F32, quantized blocks), whose
                              bytes an order-0 coder shrinks too little to pay for decoding them */
} zipmoe_codec;

/* ---------------------------------------------------------------- expert types */

/* How an expert of a ggml type is stored. SPLIT16 (BF16, F16): n values, each split into a code byte (entropy
 * coded) and a raw byte; an expert's "units" are its values. BYTES (F32 and every block-quantized type): the
 * expert's bytes, in chunks of whole bytes, codec RAW; its units are bytes. */
typedef enum {
    ZIPMOE_LAYOUT_SPLIT16 = 1,
    ZIPMOE_LAYOUT_BYTES   = 2,
} zipmoe_layout;

typedef struct {
    int32_t layout;    /* zipmoe_layout */
    int32_t blck_size; /* values per block (1 for F32, F16, BF16) */
    int32_t type_size; /* bytes per block */
} zipmoe_type_info;

/* The layout of ggml type `ggml_type` (GGML_TYPE_* numbers): OK, or ZIPMOE_ERR_UNSUPPORTED for a type zipmoe does
 * not store (integers, F64, llama.cpp's intermediate Q8_1/Q8_K, unknown numbers). */
ZIPMOE_API int64_t zipmoe_type_layout(int32_t ggml_type, zipmoe_type_info * out);

#define ZIPMOE_ESC_PRIMARY   3 /* exponents with a 2-bit code */
#define ZIPMOE_ESC_SECONDARY 7 /* exponents with an escape and a 3-bit code */

#define ZIPMOE_HUFF_MAX_BITS 11        /* longest Huffman code; also the decode table's index width */
#define ZIPMOE_CHUNK_MAX     (1u << 24) /* largest chunk, in values */

/* Which split/merge kernel runs: 0 = portable scalar, 1 = AVX2, 2 = NEON (AArch64). */
ZIPMOE_API int zipmoe_simd_level(void);

/* ---------------------------------------------------------------- split / merge */

/* bf16 -> exponent plane (bits 14..7) and sign+mantissa plane (bit 15 -> bit 7, bits 6..0). The same functions
 * split and merge F16 (code byte: its 5 exponent bits and 3 top mantissa bits; raw byte: sign and 7 mantissa bits),
 * the split measured closest to F16's order-0 entropy (docs/FORMAT.md). */
ZIPMOE_API void zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
/* Large outputs (64 KiB and more) are written around the caches: a decoded expert lands in memory no cache holds. */
ZIPMOE_API void zipmoe_merge_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);
/* The same with normal stores at any size, for output read right after (a streamed row, a chunk). */
ZIPMOE_API void zipmoe_merge_bf16_cached(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);
/* The sign+mantissa plane alone: what a decoded expert keeps when it leaves the hot tier for the sm one. */
ZIPMOE_API void zipmoe_split_sm_bf16(const uint16_t * src, size_t n, uint8_t * sm);
/* The portable reference versions the SIMD ones are tested against. */
ZIPMOE_API void zipmoe_split_bf16_scalar(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
ZIPMOE_API void zipmoe_split_sm_bf16_scalar(const uint16_t * src, size_t n, uint8_t * sm);
ZIPMOE_API void zipmoe_merge_bf16_scalar(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);

/* Histogram of the exponent bytes of n BF16 values, added to hist[256]. */
ZIPMOE_API void zipmoe_exponent_histogram(const uint16_t * src, size_t n, uint64_t hist[256]);

/* ---------------------------------------------------------------- checksums */

/* XXH3-64 with a seed. Chunk checksum = zipmoe_checksum(sm, n, zipmoe_checksum(exp_code, size, 0)). */
ZIPMOE_API uint64_t zipmoe_checksum(const void * data, size_t size, uint64_t seed);

/* ---------------------------------------------------------------- Huffman tables */

/* Code lengths (0 = symbol absent, else 1..ZIPMOE_HUFF_MAX_BITS) from a histogram. Returns OK or
 * ZIPMOE_ERR_ARG for an empty histogram. A single present symbol gets length 1. */
ZIPMOE_API int64_t zipmoe_huff_lengths(const uint64_t hist[256], uint8_t lengths[256]);
/* Validates code lengths: every length <= ZIPMOE_HUFF_MAX_BITS and the Kraft sum exactly 1
 * (or a single symbol of length 1). Returns OK or ZIPMOE_ERR_CORRUPT. */
ZIPMOE_API int64_t zipmoe_huff_check_lengths(const uint8_t lengths[256]);

/* ---------------------------------------------------------------- escape-code classes */

/* Escape-code classes from a histogram: classes[s] = 1..3 for the three commonest exponents (2-bit code
 * classes[s] - 1), 4..10 for the next seven (an escape, then 3-bit code classes[s] - 4), 0 for the rest (two
 * escapes, then the byte). Ties go to the smaller exponent. ZIPMOE_ERR_ARG for NULL. */
ZIPMOE_API int64_t zipmoe_esc_classes(const uint64_t hist[256], uint8_t classes[256]);
/* Validates classes: each value 0..10, and 1..10 each at most once. Returns OK or ZIPMOE_ERR_CORRUPT. */
ZIPMOE_API int64_t zipmoe_esc_check_classes(const uint8_t classes[256]);
/* Which escape-code decoder runs: 0 = portable scalar (several times slower than Huffman's), 2 = AVX-512 VBMI2
 * (3.5x faster than Huffman's). ZIPMOE_ESC_SIMD=0 in the environment turns the SIMD one off (measurements). */
ZIPMOE_API int     zipmoe_esc_simd_level(void);

/* ---------------------------------------------------------------- chunk codec */

/* A codec instance: the codec, its level, for HUFF the code table (encode and decode forms), and the type whose
 * chunks it codes. Immutable after creation, so one instance can be shared by any number of threads. */
typedef struct zipmoe_codec_ctx zipmoe_codec_ctx;

/* lengths: the code lengths for HUFF, the classes for ESC (zipmoe_esc_classes); ignored for ZSTD and RAW.
 * A codec for BF16 chunks. */
ZIPMOE_API int64_t zipmoe_codec_create(zipmoe_codec codec, int level, const uint8_t lengths[256],
                                       zipmoe_codec_ctx ** out);
/* The same for chunks of ggml type `ggml_type`: ZSTD, HUFF and ESC for SPLIT16 types, RAW for BYTES types;
 * ZIPMOE_ERR_UNSUPPORTED for another pairing or type. */
ZIPMOE_API int64_t zipmoe_codec_create_typed(zipmoe_codec codec, int level, const uint8_t lengths[256],
                                             int32_t ggml_type, zipmoe_codec_ctx ** out);
ZIPMOE_API void    zipmoe_codec_free(zipmoe_codec_ctx * c);

/* Per-thread scratch: the exponent plane of one chunk and zstd contexts. One per thread. */
typedef struct zipmoe_workspace zipmoe_workspace;

ZIPMOE_API zipmoe_workspace * zipmoe_workspace_create(size_t chunk_n);
ZIPMOE_API void               zipmoe_workspace_free(zipmoe_workspace * ws);

/* Largest encoded size of a chunk of n units (values of SPLIT16 types, bytes of BYTES types). */
ZIPMOE_API size_t  zipmoe_chunk_bound(const zipmoe_codec_ctx * c, size_t n);

/* Encodes the code plane of n units (src: n BF16/F16 values, or n bytes of a BYTES type) into dst[cap]. Returns
 * the size written. */
ZIPMOE_API int64_t zipmoe_chunk_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                       const void * src, size_t n, void * dst, size_t cap);

/* Decodes one chunk: code[code_size] holds the code bytes of n units whose raw (sign+mantissa) bytes are sm[n]
 * (SPLIT16; BYTES types have none: sm is ignored); writes exactly n values (n bytes for BYTES types) to dst and
 * nothing else. If checksum_check is non-zero the chunk's checksum is compared first (ZIPMOE_ERR_CHECKSUM on
 * mismatch). */
ZIPMOE_API int64_t zipmoe_chunk_decode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                       const void * code, size_t code_size,
                                       const uint8_t * sm, size_t n,
                                       int checksum_check, uint64_t checksum, void * dst);

/* Decodes only the exponent plane of a chunk into exp[n] (no checksum, no merge): for benchmarks
 * that compare the entropy coders alone, and for callers that merge themselves. */
ZIPMOE_API int64_t zipmoe_chunk_decode_exponents(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                                 const void * code, size_t code_size, uint8_t * exp, size_t n);
/* The same for an ESC codec with the decoder of SIMD level `level` (0 = the portable one, which the others are
 * tested against: same results, same errors); ZIPMOE_ERR_UNSUPPORTED for a level this CPU lacks, ZIPMOE_ERR_ARG
 * for another codec. */
ZIPMOE_API int64_t zipmoe_esc_decode_chunk_at(const zipmoe_codec_ctx * c, int level, const void * code,
                                              size_t code_size, uint8_t * exp, size_t n);

/* ---------------------------------------------------------------- compressed expert tensors */

/* An expert tensor as stored in a zipmoe GGUF: its index (the <base>.zipmoe_index companion,
 * int64 little-endian, docs/FORMAT.md) validated against the size of its data companion. */
typedef struct zipmoe_tensor zipmoe_tensor;

typedef struct {
    int32_t  codec;          /* zipmoe_codec */
    int32_t  level;
    int32_t  ggml_type;      /* type of the original tensor; 30 = GGML_TYPE_BF16, 1 = F16, ... */
    int64_t  ne[4];          /* original shape, ne[2] = number of experts */
    int64_t  n_expert;
    int64_t  n_per_expert;   /* values in one expert = ne[0] * ne[1] */
    int64_t  chunk_n;        /* units per chunk (the last chunk of an expert may be shorter) */
    int64_t  n_chunks;       /* chunks per expert */
    uint64_t data_size;      /* size of the data companion */
    int32_t  layout;         /* zipmoe_layout of ggml_type */
    int64_t  n_units;        /* units in one expert: n_per_expert (SPLIT16), expert_size (BYTES) */
    int64_t  expert_size;    /* bytes of one decoded expert: 2 * n_per_expert, or ggml's row size * ne[1] */
} zipmoe_tensor_info;

typedef struct {
    uint64_t offset;         /* of the expert's region, from the start of the data companion */
    uint64_t size;           /* of the region: sm plane, padding, exponent chunks */
    uint64_t exp_offset;     /* of the first code chunk, from the start of the region (0 for BYTES types) */
} zipmoe_expert_span;

/* Parses and validates an index (index_size bytes) for a data companion of data_size bytes.
 * Every offset, size and count is checked before anything reads through it. */
ZIPMOE_API int64_t zipmoe_tensor_open(const void * index, size_t index_size, uint64_t data_size,
                                      zipmoe_tensor ** out);
/* The size in bytes an index must have, from its header alone (its first 384 bytes, validated as
 * zipmoe_tensor_open validates them, for a data companion of data_size bytes): a loader reads the header, checks
 * that the companion holds this many bytes, and only then reads the rest. */
ZIPMOE_API int64_t zipmoe_tensor_index_size(const void * header, size_t header_size, uint64_t data_size,
                                            uint64_t * index_size);
ZIPMOE_API void    zipmoe_tensor_free(zipmoe_tensor * t);
ZIPMOE_API void    zipmoe_tensor_get_info(const zipmoe_tensor * t, zipmoe_tensor_info * info);
ZIPMOE_API int64_t zipmoe_tensor_expert_span(const zipmoe_tensor * t, int64_t expert, zipmoe_expert_span * span);
ZIPMOE_API const zipmoe_codec_ctx * zipmoe_tensor_codec(const zipmoe_tensor * t);

/* Decodes expert `expert` from its region (region_size bytes, as read from the data companion at
 * span.offset) into dst (info.expert_size bytes: the expert's original bytes). Chunks are shared out among nth
 * callers:
 * the caller with index ith (0 <= ith < nth) decodes chunks ith, ith + nth, ...; so nth threads
 * calling with ith = 0..nth-1 decode the whole expert, each with its own workspace. Checksums are
 * always verified. Returns the number of chunks this call decoded, or an error. */
ZIPMOE_API int64_t zipmoe_tensor_decode_expert(const zipmoe_tensor * t, zipmoe_workspace * ws,
                                               int64_t expert, const void * region, size_t region_size,
                                               void * dst, int ith, int nth);

/* Encoding one expert (used by the converter): the region is laid out as docs/FORMAT.md says. n_units and chunk_n
 * count units of the codec's type (values, or bytes for BYTES types). chunk_ends[n_chunks] and checksums[n_chunks]
 * receive the chunk table. Returns the region size. */
ZIPMOE_API size_t  zipmoe_expert_region_bound(const zipmoe_codec_ctx * c, int64_t n_units, int64_t chunk_n);
ZIPMOE_API int64_t zipmoe_expert_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                        const void * src, int64_t n_units, int64_t chunk_n,
                                        void * region, size_t cap,
                                        uint64_t * chunk_ends, uint64_t * checksums);

#ifdef __cplusplus
}
#endif

#endif /* ZIPMOE_H */
