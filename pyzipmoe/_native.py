"""The one cffi module: declarations of the public headers in ggml_zipmoe/include (zipmoe.h, zipmoe-cache.h,
zipmoe-integrity.h, zipmoe-ledger.h; tests/native/test_native_api.py holds them to the headers) and the loaded library.

ABI mode (dlopen) keeps the Python package free of a compile step of its own: the shared library is
built once by CMake (tools/setup.sh) and found here. cffi releases the GIL during every call, so
Python threads decode and encode in parallel.
"""

from __future__ import annotations

import os
from pathlib import Path

import cffi

from .errors import NativeLibraryError
from .paths import ZIPMOE_LIB_NAME as LIB_NAME
from .paths import bin_dir

CDEF = """
typedef enum {
    ZIPMOE_OK = 0, ZIPMOE_ERR_ARG = -1, ZIPMOE_ERR_CORRUPT = -2, ZIPMOE_ERR_CHECKSUM = -3,
    ZIPMOE_ERR_NOMEM = -4, ZIPMOE_ERR_UNSUPPORTED = -5, ZIPMOE_ERR_DST_TOO_SMALL = -6,
    ZIPMOE_ERR_CODEC = -7, ZIPMOE_ERR_IO = -8
} zipmoe_status;
typedef enum { ZIPMOE_CODEC_ZSTD = 1, ZIPMOE_CODEC_HUFF = 2, ZIPMOE_CODEC_ESC = 3, ZIPMOE_CODEC_RAW = 4 } zipmoe_codec;
typedef enum { ZIPMOE_LAYOUT_SPLIT16 = 1, ZIPMOE_LAYOUT_BYTES = 2 } zipmoe_layout;
typedef struct {
    int32_t layout;
    int32_t blck_size;
    int32_t type_size;
} zipmoe_type_info;
int64_t zipmoe_type_layout(int32_t ggml_type, zipmoe_type_info * out);

const char * zipmoe_status_str(int64_t status);
#define ZIPMOE_SIZE_MAX 1152921504606846976
int64_t zipmoe_parse_size(const char * text, uint64_t * out);
int64_t zipmoe_parse_budget(const char * text, uint64_t total, uint64_t * out);
int zipmoe_budget_is_auto(const char * text);
int zipmoe_budget_valid(const char * text);
int64_t zipmoe_size_text(uint64_t bytes, char * buf, size_t size);
typedef struct {
    uint64_t total;
    uint64_t available;
    int32_t  has_cgroup;
    uint64_t cgroup_limit;
    uint64_t cgroup_usage;
    uint64_t cgroup_reclaimable;
    uint64_t cgroup_file_cache;
} zipmoe_memory_reading;
int64_t zipmoe_memory_read(const char * cgroup_root, const char * proc_self, const char * meminfo,
                           zipmoe_memory_reading * out);
uint64_t zipmoe_memory_margin(const zipmoe_memory_reading * r);
uint64_t zipmoe_auto_budget(const zipmoe_memory_reading * r, uint64_t model_bytes, uint64_t held);
const char * zipmoe_openmp_spincount(void);
int zipmoe_simd_level(void);

void zipmoe_split_bf16(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void zipmoe_merge_bf16(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);
void zipmoe_split_bf16_scalar(const uint16_t * src, size_t n, uint8_t * exp, uint8_t * sm);
void zipmoe_split_sm_bf16(const uint16_t * src, size_t n, uint8_t * sm);
void zipmoe_split_sm_bf16_scalar(const uint16_t * src, size_t n, uint8_t * sm);
void zipmoe_merge_bf16_scalar(const uint8_t * exp, const uint8_t * sm, size_t n, uint16_t * dst);
void zipmoe_exponent_histogram(const uint16_t * src, size_t n, uint64_t hist[256]);
uint64_t zipmoe_checksum(const void * data, size_t size, uint64_t seed);

int64_t zipmoe_huff_lengths(const uint64_t hist[256], uint8_t lengths[256]);
int64_t zipmoe_huff_check_lengths(const uint8_t lengths[256]);
int64_t zipmoe_esc_classes(const uint64_t hist[256], uint8_t classes[256]);
int64_t zipmoe_esc_check_classes(const uint8_t classes[256]);
int     zipmoe_esc_simd_level(void);

typedef struct zipmoe_codec_ctx zipmoe_codec_ctx;
int64_t zipmoe_codec_create(zipmoe_codec codec, int level, const uint8_t lengths[256], zipmoe_codec_ctx ** out);
int64_t zipmoe_codec_create_typed(zipmoe_codec codec, int level, const uint8_t lengths[256], int32_t ggml_type,
                                  zipmoe_codec_ctx ** out);
void    zipmoe_codec_free(zipmoe_codec_ctx * c);

typedef struct zipmoe_workspace zipmoe_workspace;
zipmoe_workspace * zipmoe_workspace_create(size_t chunk_n);
void               zipmoe_workspace_free(zipmoe_workspace * ws);

size_t  zipmoe_chunk_bound(const zipmoe_codec_ctx * c, size_t n);
int64_t zipmoe_chunk_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                            const void * src, size_t n, void * dst, size_t cap);
int64_t zipmoe_chunk_decode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                            const void * code, size_t code_size, const uint8_t * sm, size_t n,
                            int checksum_check, uint64_t checksum, void * dst);
int64_t zipmoe_chunk_decode_exponents(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                                      const void * code, size_t code_size, uint8_t * exp, size_t n);
int64_t zipmoe_esc_decode_chunk_at(const zipmoe_codec_ctx * c, int level, const void * code, size_t code_size,
                                   uint8_t * exp, size_t n);

typedef struct zipmoe_tensor zipmoe_tensor;
typedef struct {
    int32_t  codec;
    int32_t  level;
    int32_t  ggml_type;
    int64_t  ne[4];
    int64_t  n_expert;
    int64_t  n_per_expert;
    int64_t  chunk_n;
    int64_t  n_chunks;
    uint64_t data_size;
    int32_t  layout;
    int64_t  n_units;
    int64_t  expert_size;
} zipmoe_tensor_info;
typedef struct {
    uint64_t offset;
    uint64_t size;
    uint64_t exp_offset;
} zipmoe_expert_span;

int64_t zipmoe_tensor_open(const void * index, size_t index_size, uint64_t data_size, zipmoe_tensor ** out);
int64_t zipmoe_tensor_index_size(const void * header, size_t header_size, uint64_t data_size, uint64_t * index_size);
void    zipmoe_tensor_free(zipmoe_tensor * t);
void    zipmoe_tensor_get_info(const zipmoe_tensor * t, zipmoe_tensor_info * info);
int64_t zipmoe_tensor_expert_span(const zipmoe_tensor * t, int64_t expert, zipmoe_expert_span * span);
const zipmoe_codec_ctx * zipmoe_tensor_codec(const zipmoe_tensor * t);
int64_t zipmoe_tensor_decode_expert(const zipmoe_tensor * t, zipmoe_workspace * ws, int64_t expert,
                                    const void * region, size_t region_size, void * dst, int ith, int nth);

typedef struct zipmoe_store zipmoe_store;
typedef enum {
    ZIPMOE_POLICY_TOKEN_LFU = 0, ZIPMOE_POLICY_LRU = 1, ZIPMOE_POLICY_LFU = 2, ZIPMOE_POLICY_FIFO = 3,
    ZIPMOE_POLICY_LFUDA = 4
} zipmoe_policy;
int64_t zipmoe_cache_configure(uint64_t hot_bytes, uint64_t warm_bytes, uint64_t sm_bytes, zipmoe_policy policy);
const char * zipmoe_policy_name(size_t index);
int64_t zipmoe_policy_parse(const char * name, zipmoe_policy * out);
int64_t zipmoe_policy_names(char * buf, size_t size);
typedef int64_t (*zipmoe_plan_rule_fn)(void * arg, int32_t layer, int64_t hot, int64_t warm, int64_t sm);
int64_t zipmoe_plan_parse(const char * text, zipmoe_plan_rule_fn fn, void * arg);
const char * zipmoe_plan_problem(int64_t rc);
int64_t zipmoe_cache_set_slots(const char * prefix, int64_t hot, int64_t warm, int64_t sm);
void    zipmoe_cache_set_reserve(uint64_t bytes);
void    zipmoe_cache_set_token_hot(uint64_t hot_bytes);
void    zipmoe_cache_set_token_room(uint64_t bytes);
void    zipmoe_cache_begin_graph(int64_t routed);
void    zipmoe_cache_begin_step(int64_t routed);
void    zipmoe_cache_set_direct_io(int enabled);
void    zipmoe_cache_set_read_buffer(uint64_t bytes);
void    zipmoe_cache_set_read_room(uint64_t bytes);
typedef struct { uint64_t bf16_bytes; uint64_t n_expert; uint64_t compressed_bytes; } zipmoe_store_size;
typedef struct { uint64_t hot, warm, sm; uint64_t in_flight; uint64_t reads; uint64_t token_hot; } zipmoe_budget_split;
int64_t zipmoe_budget_split_tiers(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers, double hot_share,
                                  double sm_share, zipmoe_budget_split * out);
double  zipmoe_budget_default_hot_share(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers,
                                        int warm_fast, double sm_share);
#define ZIPMOE_EMBD_BATCH_ROWS 2048
uint64_t zipmoe_budget_embd_charge(uint64_t embd_bytes, uint64_t row_bytes, uint64_t page);
typedef struct { uint64_t other; uint64_t embd_charged; uint64_t in_flight; uint64_t experts; uint64_t minimum; }
    zipmoe_budget_need;
int64_t zipmoe_budget_need_of(const zipmoe_store_size * stores, size_t n_stores, uint64_t other_bytes,
                              uint64_t embd_bytes, uint64_t embd_row_bytes, uint64_t page, zipmoe_budget_need * out);
int64_t zipmoe_budget_check(uint64_t budget, const zipmoe_budget_need * need, uint64_t embd_bytes,
                            const char * said, char * msg, size_t msg_size);
int64_t zipmoe_cache_apply_split(const zipmoe_budget_split * split, zipmoe_policy policy);
int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
                          zipmoe_store ** out);
int64_t zipmoe_store_open_raw(const char * name, int32_t ggml_type, const int64_t ne[4], uint64_t row_bytes,
                              zipmoe_store ** out);
typedef void (*zipmoe_raw_put_fn)(void * ctx, void * dst, const void * src, int64_t n_rows);
int64_t zipmoe_store_set_raw_put(zipmoe_store * s, zipmoe_raw_put_fn fn, void * ctx, int64_t row_align);
void    zipmoe_store_free(zipmoe_store * s);
void    zipmoe_store_get_info(const zipmoe_store * s, zipmoe_tensor_info * info);
int     zipmoe_store_is_raw(const zipmoe_store * s);
const zipmoe_tensor * zipmoe_store_tensor(const zipmoe_store * s);
int64_t zipmoe_store_bind(zipmoe_store * s, int fd, uint64_t data_offset, void ** dst, size_t * dst_size);
int64_t zipmoe_store_predict(zipmoe_store * s, const int32_t * experts, int64_t n);
int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                 int64_t ne1, size_t nb0, size_t nb1, int32_t * where, int ith, int nth);
typedef struct {
    int     (*idle)(void * ctx);
    void *  idle_ctx;
    int64_t plan_n;
    const void * plan;
    uint64_t seq;
    int32_t ring;
    int32_t fast;
} zipmoe_turn;
#define ZIPMOE_TURN_STREAM 1
int64_t zipmoe_store_materialize_begin(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                       int64_t ne1, size_t nb0, size_t nb1, int32_t * where, uint8_t * pending,
                                       int flags, int ith, int nth, zipmoe_turn * turn);
int64_t zipmoe_store_materialize_end(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0,
                                     int64_t ne1, size_t nb0, size_t nb1);
int64_t zipmoe_store_materialize_wait(zipmoe_store * s, const zipmoe_turn * turn);
int64_t zipmoe_store_stream_chunk(zipmoe_store * s, int64_t e, int64_t c, uint16_t * out);
int64_t zipmoe_store_stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp, const uint8_t ** sm);
int64_t zipmoe_store_place(zipmoe_store * s, int64_t e);
void    zipmoe_cache_set_store_turns(int enabled);
int64_t zipmoe_store_activations(zipmoe_store * s, uint64_t * counts, int64_t n);
int64_t zipmoe_cache_activations(const char * prefix, uint64_t * counts, int64_t n);
int64_t zipmoe_cache_routing(const char * prefix, uint64_t * masks, int64_t words, int64_t max_tokens);
int64_t zipmoe_store_set_prior(zipmoe_store * s, const uint64_t * counts, int64_t n_expert);
int64_t zipmoe_prior_parse(const void * data, size_t size, uint32_t * n_layer, uint32_t * n_expert);
int64_t zipmoe_cache_seed_prior(zipmoe_store * const * stores, int64_t n_stores, const void * data, size_t size,
                                char * msg, size_t msg_size);
int64_t zipmoe_prior_record(zipmoe_store * const * stores, int64_t n_stores, const char * path, char * msg,
                            size_t msg_size);
int64_t zipmoe_store_take_error(zipmoe_store * s, char * msg, size_t msg_size);
typedef struct {
    uint64_t stores;
    uint64_t hot_bytes;
    uint64_t warm_bytes;
    uint64_t peak_hot_bytes;
    uint64_t experts_decoded;
    uint64_t chunks_decoded;
    uint64_t bytes_decoded;
    uint64_t decode_ns;
    uint64_t materialize_calls;
    uint64_t hits_hot;
    uint64_t hits_warm;
    uint64_t misses;
    uint64_t bytes_read;
    uint64_t read_ns;
    uint64_t evictions;
    uint64_t sm_bytes;
    uint64_t hits_sm;
    uint64_t stall_ns;
    uint64_t peak_resident_bytes;
    uint64_t staging_bytes;
    uint64_t pool_bytes;
    uint64_t reading_calls;
    uint64_t bytes_read_ahead;
    uint64_t bytes_read_guessed;
    uint64_t guesses_used;
    uint64_t staging_transient_bytes;
    uint64_t decoding_bytes;
    uint64_t experts_streamed;
    uint64_t ahead_used;
} zipmoe_stats;
typedef struct {
    uint64_t experts;
    uint64_t failed;
    uint64_t ns;
} zipmoe_prefill_stats;
int64_t zipmoe_cache_prefill(zipmoe_store * const * stores, int64_t n_stores, int n_threads, zipmoe_prefill_stats * out);
void zipmoe_stats_get(zipmoe_stats * out);
void zipmoe_stats_reset(void);
typedef struct {
    uint64_t graphs;
    uint64_t tokens;
    uint64_t wall_ns;
    uint64_t compute_ns;
    uint64_t decode_ns;
    uint64_t read_wait_ns;
    uint64_t thread_wait_ns;
    uint64_t other_ns;
    uint64_t between_ns;
} zipmoe_ledger;
void zipmoe_ledger_get(zipmoe_ledger * out);

size_t  zipmoe_expert_region_bound(const zipmoe_codec_ctx * c, int64_t n_units, int64_t chunk_n);
int64_t zipmoe_expert_encode(const zipmoe_codec_ctx * c, zipmoe_workspace * ws,
                             const void * src, int64_t n_units, int64_t chunk_n,
                             void * region, size_t cap, uint64_t * chunk_ends, uint64_t * checksums);
"""


def library_candidates() -> list[Path]:
    """Where the shared library may be, most specific first: ``$ZIPMOE_LIB``, then the build's ``bin/``."""
    found = []
    if os.environ.get("ZIPMOE_LIB"):
        found.append(Path(os.environ["ZIPMOE_LIB"]))
    found.append(bin_dir() / LIB_NAME)
    return found


def _load() -> tuple[cffi.FFI, object]:
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    tried = library_candidates()
    for path in tried:
        if path.is_file():
            return ffi, ffi.dlopen(str(path))
    raise NativeLibraryError(
        f"{LIB_NAME} not found (looked in {', '.join(map(str, tried))}); "
        "build it with `bash tools/setup.sh` or point ZIPMOE_LIB at it"
    )


ffi, lib = _load()
