/* io.h - the expert cache's lowest layer, its I/O: a store's bytes in the model file (file.c), the reader thread
 * (reader.h), the memory bytes are read and decoded into (buffers.c: scratch, the compressed tiers' mappings, the
 * read buffers and the staging buffer; slots.c: memfd slots for decoded experts), the read-ahead of the next store
 * (readahead.c), and the counters every layer adds to (counters.c). It reads the stores' state (store-state.h) and
 * knows none of the tiers' rules: the layers above (tiers.h, then cache-impl.h) call into it, never the reverse. */
#ifndef ZIPMOE_CACHE_IO_H
#define ZIPMOE_CACHE_IO_H

#include "store-state.h"

/* The counters of zipmoe_stats: process-wide, as zipmoe_stats reports the whole cache. Defined in counters.c. */
typedef struct {
    _Atomic uint64_t stores, hot_bytes, warm_bytes, sm_bytes, experts, chunks, bytes, ns, calls;
    _Atomic uint64_t hits_hot, hits_warm, hits_sm, misses, evictions; /* bytes read: the reader's */
    _Atomic uint64_t peak_hot, peak_resident, stall_ns, reading_calls;
    _Atomic uint64_t stage_cap_bytes, pf_cap_bytes[2]; /* the reader's buffers: zipmoe_stats' staging_bytes */
    _Atomic uint64_t read_ahead_bytes;
    _Atomic uint64_t decoding_bytes; /* planned experts not hot yet: their places' pages are in use */
    _Atomic uint64_t guessed_bytes, guesses_used;
    _Atomic uint64_t ahead_used;    /* experts decoded from bytes read ahead (guessed or not) */
    _Atomic uint64_t streamed;      /* routed warm experts left for the caller to decode in its cache */
    _Atomic uint64_t prefill_dummy; /* what a prefill's invocations count instead of the model's routing */
} cache_counters;
extern cache_counters g_stats;

/* What a read buffer keeps between uses (zipmoe_cache_set_read_buffer). */
#define STAGE_KEEP cache_read_buffer_keep()

/* Engines change their thread count between calls (prompt vs generation), so scratch belongs to the
 * thread, not to an ith: a decoder workspace and room for one chunk read from disk. Freed at exit. */
typedef struct {
    zipmoe_workspace * ws;
    uint8_t *          buf;
    size_t             buf_size;
} thread_scratch;

/* counters.c */
void cache_account(_Atomic uint64_t * tier, int64_t bytes); /* bytes into (negative: out of) a tier's total */

/* slots.c: memfd slots that keep decoded experts' pages from one expert to the next */
void     zipmoe_slots_set_keep(uint64_t bytes);           /* free slots keep their pages up to this */
void     zipmoe_slots_trim(void);                         /* free slots' pages beyond it go back now */
uint64_t zipmoe_slots_kept(void);
int      zipmoe_slots_usable(const void * addr, size_t size); /* page-aligned, and memfds work */
int64_t  zipmoe_slots_attach(void * addr, size_t size);   /* a slot mapped over [addr, +size), or -1 */
int      zipmoe_slots_detach(void * addr, size_t size, int64_t slot); /* [addr, +size) empty again */

/* file.c */
void     cache_expert_span(const zipmoe_store * s, int64_t e, zipmoe_expert_span * span); /* compressed or raw */
/* Bytes [*first, *first + *size) of a raw expert that chunk c covers: whole rows, the last chunk's maybe fewer. */
void     cache_raw_chunk(const zipmoe_store * s, int64_t c, uint64_t * first, uint64_t * size);
uint64_t cache_region_size(const zipmoe_store * s, int64_t e);
int      cache_read_cold(const zipmoe_store * s, uint64_t offset, void * buf, size_t size);
void     cache_advise(const zipmoe_store * s, uint64_t offset, uint64_t size, int advice);
size_t   cache_direct_pad(const zipmoe_store * s, uint64_t offset);
size_t   cache_direct_span(const zipmoe_store * s, uint64_t offset, uint64_t size);

/* The O_DIRECT descriptor a store's reads go through, or -1 (through the page cache). -1 while every expert stays
 * decoded: zipmoe_store_bind then had the kernel read all of the store's bytes into the page cache, which a read
 * around it would fetch from the disk a second time (a Q4_K_M file at 150% read 1.8x its size). */
static inline int cache_direct_fd(const zipmoe_store * s) {
    return s->use_slots ? s->dfd : -1;
}

/* buffers.c */
thread_scratch * cache_thread_scratch(size_t chunk_n, size_t buf_size); /* this thread's, or NULL */
uint8_t * cache_region_alloc(uint64_t size);
void      cache_region_free(uint8_t * p, uint64_t size);
uint8_t * cache_region_resize(uint8_t * p, uint64_t old, uint64_t size);
void      cache_read_buffers_set_room(uint64_t bytes);   /* a prompt's read buffers' bound; UINT64_MAX: none */
void      cache_read_buffers_set_token_mode(int tokens); /* generation's budgets are in force (config.c) */
size_t    cache_read_buffer_keep(void);
size_t    cache_read_buffer_bound(size_t need, size_t largest);
size_t    cache_read_buffer_refit_limit(void);
void      cache_read_buffer_free(uint8_t ** data, size_t * cap);
void      cache_read_buffer_fit(uint8_t ** data, size_t * cap, size_t need);
uint64_t  cache_read_buffers_transient(void);
uint8_t * cache_staging_take(const zipmoe_store * s, size_t need);
void      cache_staging_trim(size_t need);
void      cache_staging_trim_idle(size_t bound);
void      cache_staging_give(const zipmoe_store * s);

/* readahead.c */
void cache_prefetch_drop(zipmoe_store * s);          /* under s->mu: s's read-ahead buffer goes back */
void cache_prefetch_forget(const zipmoe_store * s);  /* s is being freed: no read-ahead for it any more */
void cache_prefetch_trim_idle(size_t bound);         /* idle read-ahead buffers larger than bound go back */
void cache_read_ahead_predicted(zipmoe_store * next, const zipmoe_store * prev);
/* job's `then` reads ahead s's experts that its next invocation will likely route to: those routed now in `like` (a
 * store of the same layer, which shares its router); with `predicted`, those the previous layer predicted
 * (zipmoe_store_predict); else every one not decoded (a prompt routes to most). s NULL: nothing after the reads. */
void cache_read_ahead_job(zipmoe_read_job * job, zipmoe_store * s, const zipmoe_store * like, int predicted);

#endif /* ZIPMOE_CACHE_IO_H */
