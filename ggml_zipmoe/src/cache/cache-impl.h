/* cache-impl.h - what the expert cache's files (cache/) share and nothing outside them sees: the store, the
 * process-wide state of the cache and the internal calls between its files.
 *
 * A store serves one compressed expert tensor at run time under a memory budget: the BF16 memory the engine
 * reads, the tiers an expert can be in, the materialise protocol (materialize.c) and eviction (tiers.c).
 *
 * engine reads, the tiers an expert can be in, the materialise protocol and eviction.
 *
 * Tiers of an expert, best first: hot (decoded in the BF16 memory), warm (its whole compressed region in
 * RAM: only decoding is left), sm (its sign+mantissa plane in RAM: the exponent codes, a fifth of the
 * region, are read from disk) and cold (all read from disk around the page cache, O_DIRECT, or through it
 * and dropped from it, so that no memory is used that the budget does not count). Each tier has a limit in
 * bytes per store: the process's tier budgets (zipmoe_cache_configure) shared out in proportion to BF16 size, or slot
 * counts a planner set for the store (zipmoe_cache_set_slots). A tier change never re-reads what is
 * resident: warm -> sm shrinks the region, sm -> warm reads only the codes, hot -> sm takes the
 * sign+mantissa bytes from the decoded values. A hot expert's compressed copy is the first thing a full
 * tier gives up, so the tiers hold different experts when memory is short.
 *
 * Files, by job: config.c (budgets, rules, each store's limits), stats.c (counters, errors), buffers.c
 * (scratch, tier copies' mappings, the staging buffer), store.c (life cycle, huge pages), tiers.c (contest and
 * eviction), plan.c (an invocation's plan and reads), readahead.c (the next store's bytes), materialize.c (the
 * protocol), routing.c (what the planner reads), prefill.c, slots.c, reader.c, budget.c. Internal calls are
 * named cache_*; the library is built with hidden visibility, so none of them is exported. */
#ifndef ZIPMOE_CACHE_IMPL_H
#define ZIPMOE_CACHE_IMPL_H

#include "zipmoe-impl.h"
#include "zipmoe-cache.h"
#include "reader.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>

enum { RES_NONE = 0, RES_SM = 1, RES_FULL = 2 }; /* what of an expert's region is in RAM */

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
#ifndef MADV_COLD
#define MADV_COLD 20 /* Linux 5.4 */
#endif
#define HUGE_PAGE      ((uintptr_t) 2 << 20)
#define COLLAPSE_AFTER 16 /* invocations in a row on the fast path: the resident set has settled */
#define ROUTE_LOG      512 /* invocations whose routing a store remembers, for the planner's recency model */
#define ROUTE_RING     (ROUTE_LOG + 1) /* one more entry: the one a writer may be filling */

typedef struct {
    uint8_t * region;    /* RES_SM: the sign+mantissa plane; RES_FULL: the whole region; else NULL */
    uint8_t   res;       /* RES_* */
    uint8_t   hot;       /* decoded in dst, at its place */
    int64_t   place;     /* where in dst (in experts) its values lie or are being decoded, or -1 */
    uint32_t  routed;    /* tokens routed to it by the invocation in flight: pinned while non-zero */
    uint8_t   streamed;  /* the last plan left it warm for its caller to decode chunk by chunk: its compressed copy
                          * is pinned while it is routed (zipmoe_store_stream_chunk) */
    uint64_t  last_use;  /* policy metadata: tick of the last use, */
    uint64_t  uses;      /* uses (LFU) or tokens routed (token-weighted LFU), */
    uint64_t  admitted;  /* tick of becoming hot (FIFO), */
    uint64_t  admitted_res; /* of becoming warm or sm */
    uint64_t  activations; /* tokens routed, ever: what the planner reads */
    uint64_t  aged;      /* LFUDA (tiers.c): the store's age at the last use seen as of aged_use */
    uint64_t  aged_use;
} expert_state;

/* An expert's room in dst. Decoded experts need not sit at their own index: the op tells ggml_mul_mat_id where
 * each routed one lies (zipmoe_store_materialize's `where`), so that an expert evicted for a miss of the same
 * store hands its place, pages mapped, to the miss. */
typedef struct {
    int64_t expert; /* the expert whose values lie (or are being decoded) here, or -1: free */
    int64_t slot;   /* the memfd slot mapped over it (slots.c), or -1: anonymous pages */
} place_state;

typedef struct {
    int64_t   expert;
    uint8_t * sm;         /* the sign+mantissa plane in RAM, or NULL: it goes through scratch */
    uint8_t * codes;      /* chunk codes lie at codes + code_offset - codes_bias; NULL: scratch */
    uint64_t  codes_bias;
    uint8_t   read_sm;    /* the plane must be read from the file */
    uint8_t   read_codes; /* the codes must be read from the file */
    uint8_t   staged;     /* the reader thread reads them (into the region or the staging buffer) */
    uint8_t   prefetched; /* read ahead before the plan (readahead.c): nothing left to read */
    atomic_int_fast64_t chunks_left; /* an index store with a put: chunks still to decode before the expert is put */
} plan_item;

/* A buffer for bytes read ahead of a store's invocation, aligned for O_DIRECT; two in the process (the store
 * that decodes from one while the next store's bytes arrive in the other). */
typedef struct {
    uint8_t *             data;
    size_t                cap;
    struct zipmoe_store * owner; /* NULL: free */
} prefetch_buffer;

struct zipmoe_store {
    char               name[96];
    int                layer;   /* N of a "blk.N." name, or -1 */
    zipmoe_tensor *    tensor;  /* the index of a compressed tensor; NULL for a raw one */
    zipmoe_tensor_info info;    /* a raw store's: codec 0, chunks of whole rows (cache_raw_chunk) */
    int                raw;     /* the experts lie in the file as the engine reads them (a plain GGUF's): a decode
                                 * is a copy, and only the hot tier holds them (config.c) */
    uint64_t           row_bytes; /* raw: bytes of one row of an expert (ggml_row_size of its type) */
    zipmoe_raw_put_fn  raw_put;   /* raw: puts read rows into their place (zipmoe_store_set_raw_put); NULL: a copy */
    void *             raw_put_ctx;
    uint64_t           hot_size, sm_size; /* bytes of one expert decoded, of its sign+mantissa plane */
    uint64_t           mean_region;       /* of the compressed regions: converts warm slots to bytes */

    int        fd;          /* our own descriptor of the model file, -1 until bound */
    int        dfd;         /* the file opened with O_DIRECT, for read-ahead around the page cache; -1: none */
    uint64_t   data_offset; /* of the data companion in the file */
    uint16_t * dst;         /* decoded memory: n_expert experts of hot_size bytes, MAP_NORESERVE */
    size_t     dst_size;

    pthread_mutex_t mu;
    pthread_cond_t  cv;
    const void *    plan_key;  /* the invocation that owns the plan, NULL when none */
    int             plan_in;   /* threads of that invocation inside: the last one out publishes */
    int             plan_failed;
    int             last_failed; /* the last invocation failed: a late sibling of it fails too, planning nothing */
    uint64_t        plan_seq;  /* plans begun, ever: a turn's plan is done once plan_key is NULL or a later one began */
    _Atomic int64_t next_chunk; /* the next chunk of the plan to claim: expert j * n_chunks + chunk */
    uint64_t        plan_t0;
    _Atomic(const void *) last_key; /* the last plan's key and the g_open.op_seq it began at: a thread arriving */
    _Atomic uint64_t      last_seq; /* with both unchanged is a late sibling of that invocation           */
    int64_t         plan_n;
    uint64_t        plan_decoding; /* bytes of the plan's experts that are not hot: in g_stats.decoding_bytes until publish */
    plan_item *     plan;
    int             planning;   /* from cache_make_plan until publish: the plan's compressed regions are in use */
    int             plan_stream; /* the invocation's caller decodes warm experts itself (ZIPMOE_TURN_STREAM) */
    int             prefilling; /* zipmoe_cache_prefill routes its own batches: no counts, no routing log */
    zipmoe_read_job job;        /* the plan's reads, items parallel to plan */
    int             job_active; /* submitted to the reader, and the staging buffer held */
    zipmoe_read_job collapse_job; /* cache_collapse on the reader thread (work, no reads) */
    _Atomic int     collapse_queued;
    _Atomic int     streak;     /* invocations in a row on the fast path */
    uint64_t        plan_tick;  /* the tick of the last planned invocation: its routed experts used it last */
    uintptr_t       hp_base;    /* first 2 MiB boundary in dst */
    size_t          n_hp;
    uint8_t *       hp_done;    /* per 2 MiB page: collapsed (or tried) */
    _Atomic(struct zipmoe_store *) next_store; /* the store invoked after this one last time (the graph's order) */
    _Atomic uint8_t * hinted;   /* per expert: read-ahead hinted by the previous store's prompt invocation */
    prefetch_buffer * pf;       /* under mu: bytes the reader read ahead for the next invocation, or NULL; */
    int64_t *         pf_at;    /* per expert: where in pf its region's bytes from pf_from[e] on lie, or -1 */
    _Atomic uint8_t * predicted; /* per expert: the previous layer's guess at the next token's routing */
    _Atomic int       predicted_fresh; /* set by zipmoe_store_predict, cleared by the next invocation */
    _Atomic int       waiting;  /* threads of an invocation waiting for mu: a predicted read-ahead stops */
    _Atomic int       holds_pf; /* pf is set: an invocation on the fast path gives a guessed read-ahead back */
    int               pf_guessed; /* under mu: pf holds the experts the previous layer guessed */
    uint64_t *        pf_from;
    expert_state *  experts;
    place_state *   places;       /* n_expert of them: dst holds as many experts as the model has */
    uint64_t *       route_log;   /* ring of ROUTE_RING single-token invocations: a bitmask of the routed experts */
    int64_t          route_words; /* uint64 words per entry */
    _Atomic uint64_t route_n;     /* entries written, ever: entry i lies at i % ROUTE_RING */
    uint64_t        hot_used, warm_used, sm_used;
    uint64_t        hot_limit, warm_limit, sm_limit; /* refreshed when the configuration changes */
    int64_t         hot_slots;   /* under g_cfg.mu: its whole experts of the hot budget (cache_share_hot_slots); -1: none */
    int64_t         extra_slots; /* under g_cfg.mu: hot slots beyond its rule's in generation (rule_slots) */
    uint64_t        warm_share;  /* under g_cfg.mu: its whole regions of the warm budget (shared_warm); UINT64_MAX: none */
    _Atomic uint64_t cfg_gen;
    zipmoe_policy   policy;
    uint64_t        age;         /* LFUDA's (tiers.c): the highest key of an expert that left the cache */
    int             use_slots;   /* decode into memfd slots (slots.c): the hot tier cannot hold every expert */
    _Atomic int     fast_ok;     /* limits current and the last publish kept within them: a lock-free */
                                 /* fast path may serve invocations whose experts are all hot         */
    pthread_mutex_t err_mu;      /* the first decoding error not yet taken; per store, so that an engine */
    int64_t         err;         /* takes exactly the errors of the graph it computed (two models in one  */
    char            err_msg[256]; /* process must not see each other's)                               */
    zipmoe_store *  next;        /* in the list of open stores */
};

/* Where place p lies in dst; whether a hot expert's values are there. */
static inline uint16_t * place_addr(const zipmoe_store * s, int64_t p) {
    return (uint16_t *) ((uint8_t *) s->dst + (uint64_t) p * s->hot_size); /* (in bytes: a raw expert's may be odd) */
}

static inline int place_hot(const zipmoe_store * s, int64_t p) {
    const int64_t e = s->places[p].expert;
    return e >= 0 && s->experts[e].hot;
}

/* A planner's hot, warm and sm slot counts for the stores whose name begins with prefix (zipmoe_cache_set_slots). */
typedef struct {
    char    prefix[96];
    int64_t hot, warm, sm;
} slot_rule;

/* The cache's configuration: one per process, because one expert cache serves every store the loader opens (all
 * of a model's tensors, and of every model loaded) from one memory budget, set by the loader through the
 * zipmoe_cache_set_* calls. Fields without _Atomic are under mu. Defined in config.c. */
typedef struct {
    pthread_mutex_t  mu;
    uint64_t         hot_budget;  /* the hot tier's budget now: hot_batch or hot_tokens */
    uint64_t         hot_batch;   /* zipmoe_cache_configure's */
    uint64_t         hot_tokens;  /* zipmoe_cache_set_token_hot's, at least hot_batch */
    int              token_mode;  /* hot_budget is hot_tokens (zipmoe_cache_begin_graph) */
    _Atomic uint64_t read_room;   /* a prompt's read buffers' (zipmoe_cache_set_read_room) */
    int64_t          token_slots; /* the fewest hot slots a store has in generation, nothing held back; -1: none */
    uint64_t         step_room;   /* what generation's hot tier holds back for a multi-token step (begin_graph) */
    int              step_quiet;  /* token graphs in a row that needed less than step_room */
    uint64_t         rule_room;   /* zipmoe_cache_set_token_room's: what ruled stores hold in generation */
    uint64_t         reserve;     /* zipmoe_cache_set_reserve's: evicted experts' pages kept, outside token mode */
    int              token_warm;  /* token mode is generation's larger warm tier (no hot tier: warm_budget_now) */
    uint64_t         token_need;  /* then: the pages a step's misses decode into (routed x largest expert), held */
    uint64_t         token_pages; /* then: the pages the graph's own misses decode into, kept */
    uint64_t         warm_budget;
    uint64_t         sm_budget;
    zipmoe_policy    policy;
    slot_rule *      rules;       /* per-store slot counts, by name prefix (a planner's plan) */
    int              n_rules;
    _Atomic uint64_t gen;         /* bumped by every change: stores refresh their limits */
    _Atomic uint64_t bf16_total;  /* BF16 bytes of all open stores: the shares of the budgets */
    _Atomic int      direct_io;   /* zipmoe_cache_set_direct_io */
    _Atomic int      store_turns; /* zipmoe_cache_set_store_turns */
    _Atomic size_t   read_buffer; /* zipmoe_cache_set_read_buffer: what a read buffer keeps between uses */
} cache_config;
extern cache_config g_cfg;

/* The open stores and the clocks they share: process-wide, because trims, read-ahead and the graph's order span
 * every store of the process (one graph computes at a time). Defined in store.c. */
typedef struct {
    pthread_mutex_t         mu;           /* the list, for cross-layer trims */
    zipmoe_store *          list;
    _Atomic(zipmoe_store *) last_planned; /* the store that planned last: learns the graph's order */
    _Atomic uint64_t        tick;         /* the policies' clock: one tick an invocation */
    _Atomic uint64_t        op_seq;       /* invocations begun, of any store: tells a late sibling from a new one */
} cache_stores;
extern cache_stores g_open;

/* The counters of zipmoe_stats: process-wide, as zipmoe_stats reports the whole cache. Defined in stats.c. */
typedef struct {
    _Atomic uint64_t stores, hot_bytes, warm_bytes, sm_bytes, experts, chunks, bytes, ns, calls;
    _Atomic uint64_t hits_hot, hits_warm, hits_sm, misses, evictions; /* bytes read: the reader's */
    _Atomic uint64_t peak_hot, peak_resident, stall_ns, reading_calls;
    _Atomic uint64_t stage_cap_bytes, pf_cap_bytes[2]; /* the reader's buffers: zipmoe_stats' staging_bytes */
    _Atomic uint64_t read_ahead_bytes;
    _Atomic uint64_t decoding_bytes; /* planned experts not hot yet: their places' pages are in use */
    _Atomic uint64_t guessed_bytes, guesses_used;
    _Atomic uint64_t streamed;      /* routed warm experts left for the caller to decode in its cache */
    _Atomic uint64_t prefill_dummy; /* what a prefill's invocations count instead of the model's routing */
} cache_counters;
extern cache_counters g_stats;

/* What a read buffer keeps between uses (zipmoe_cache_set_read_buffer). */
#define STAGE_KEEP atomic_load(&g_cfg.read_buffer)

/* Engines change their thread count between calls (prompt vs generation), so scratch belongs to the
 * thread, not to an ith: a decoder workspace and room for one chunk read from disk. Freed at exit. */
typedef struct {
    zipmoe_workspace * ws;
    uint8_t *          buf;
    size_t             buf_size;
} thread_scratch;

enum { TIER_HOT, TIER_WARM, TIER_SM };
#define ANY_COPY INT64_MAX /* entrant id of a copy of a hot expert: it takes another copy's room on a tie */

/* slots.c: memfd slots that keep decoded experts' pages from one expert to the next */
void     zipmoe_slots_set_keep(uint64_t bytes);           /* free slots keep their pages up to this */
void     zipmoe_slots_trim(void);                         /* free slots' pages beyond it go back now */
uint64_t zipmoe_slots_kept(void);
int      zipmoe_slots_usable(const void * addr, size_t size); /* page-aligned, and memfds work */
int64_t  zipmoe_slots_attach(void * addr, size_t size);   /* a slot mapped over [addr, +size), or -1 */
int      zipmoe_slots_detach(void * addr, size_t size, int64_t slot); /* [addr, +size) empty again */

/* config.c */
void     cache_refresh_limits(zipmoe_store * s); /* under s->mu: the store's tier limits for the configuration */
void     cache_share_hot_slots(void);            /* under g_open.mu and g_cfg.mu: the open stores changed */

/* stats.c */
void cache_account(_Atomic uint64_t * tier, int64_t bytes); /* bytes into (negative: out of) a tier's total */
void cache_record_error(zipmoe_store * s, int64_t expert, int64_t status);

/* buffers.c */
thread_scratch * cache_thread_scratch(size_t chunk_n, size_t buf_size); /* this thread's, or NULL */
uint8_t * cache_region_alloc(uint64_t size);
void      cache_region_free(uint8_t * p, uint64_t size);
uint8_t * cache_region_resize(uint8_t * p, uint64_t old, uint64_t size);
size_t    cache_read_buffer_bound(size_t need, size_t largest);
size_t    cache_read_buffer_refit_limit(void);
void      cache_read_buffer_free(uint8_t ** data, size_t * cap);
void      cache_read_buffer_fit(uint8_t ** data, size_t * cap, size_t need);
uint64_t  cache_read_buffers_transient(void);
uint8_t * cache_staging_take(const zipmoe_store * s, size_t need);
void      cache_staging_trim(size_t need);
void      cache_staging_give(const zipmoe_store * s);
void      cache_trim_idle_read_buffers(void);

/* readahead.c */
void cache_prefetch_drop(zipmoe_store * s);          /* under s->mu: s's read-ahead buffer goes back */
void cache_prefetch_forget(const zipmoe_store * s);  /* s is being freed: no read-ahead for it any more */
void cache_prefetch_trim_idle(size_t bound);         /* idle read-ahead buffers larger than bound go back */
void cache_read_ahead_predicted(zipmoe_store * next, const zipmoe_store * prev);
/* job's `then` reads ahead s's experts that its next invocation will likely route to: those routed now in `like` (a
 * store of the same layer, which shares its router); with `predicted`, those the previous layer predicted
 * (zipmoe_store_predict); else every one not decoded (a prompt routes to most). s NULL: nothing after the reads. */
void cache_read_ahead_job(zipmoe_read_job * job, zipmoe_store * s, const zipmoe_store * like, int predicted);

/* store.c */
uint64_t cache_region_size(const zipmoe_store * s, int64_t e);
void     cache_expert_span(const zipmoe_store * s, int64_t e, zipmoe_expert_span * span); /* compressed or raw */
/* Bytes [*first, *first + *size) of a raw expert that chunk c covers: whole rows, the last chunk's maybe fewer. */
void     cache_raw_chunk(const zipmoe_store * s, int64_t c, uint64_t * first, uint64_t * size);
uint64_t cache_resident_size(const zipmoe_store * s, int64_t e, int res);
/* Huge pages for a store's settled decoded experts (run by the reader thread, or the prefill's); 0 when it stopped
 * early for reads waiting, to be submitted again. */
int      cache_collapse(zipmoe_store * s);
void     cache_own_pages(const zipmoe_store * s, int64_t p, uintptr_t * lo, uintptr_t * hi);

/* tiers.c */
uint64_t cache_entry_worth(const zipmoe_store * s, const expert_state * x);
int      cache_loses(uint64_t worth, int64_t e, uint64_t v_worth, int64_t v);
int64_t  cache_victim(const zipmoe_store * s, int tier, uint64_t * worth);
void     cache_drop_region(zipmoe_store * s, int64_t e);
void     cache_demote_warm(zipmoe_store * s, int64_t e);
int      cache_make_room(zipmoe_store * s, int tier, uint64_t need, uint64_t worth, int64_t entrant);
void     cache_forget_huge_pages(zipmoe_store * s, int64_t p);
void     cache_vacate_place(zipmoe_store * s, int64_t p);
int64_t  cache_evict_hot(zipmoe_store * s, int64_t e, int keep_pages);
void     cache_settle(zipmoe_store * s);
void     cache_trim_others(const zipmoe_store * s);

/* The O_DIRECT descriptor a store's reads go through, or -1 (through the page cache). -1 while every expert stays
 * decoded: zipmoe_store_bind then had the kernel read all of the store's bytes into the page cache, which a read
 * around it would fetch from the disk a second time (a Q4_K_M file at 150% read 1.8x its size). */
static inline int cache_direct_fd(const zipmoe_store * s) {
    return s->use_slots ? s->dfd : -1;
}

/* plan.c */
int     cache_read_cold(const zipmoe_store * s, uint64_t offset, void * buf, size_t size);
void    cache_advise(const zipmoe_store * s, uint64_t offset, uint64_t size, int advice);
int64_t cache_make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1);
void    cache_schedule_reads(zipmoe_store * s);
void    cache_map_plan(zipmoe_store * s);
void    cache_end_decoding(zipmoe_store * s);
size_t  cache_direct_pad(const zipmoe_store * s, uint64_t offset);
size_t  cache_direct_span(const zipmoe_store * s, uint64_t offset, uint64_t size);

/* routing.c */
void cache_log_route(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1);

#endif /* ZIPMOE_CACHE_IMPL_H */
