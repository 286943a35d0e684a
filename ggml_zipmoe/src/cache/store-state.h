/* store-state.h - what a store is: the state of one compressed expert tensor served at run time, which every layer
 * of the cache reads. The layers' own state and internal calls are declared in io.h, tiers.h and cache-impl.h, each
 * including the one below it (the layering: docs/architecture.md, "The native library").
 *
 * A store serves one compressed expert tensor at run time under a memory budget: the BF16 memory the engine
 * reads, the tiers an expert can be in, the materialise protocol (materialize.c) and eviction (tiers.c).
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
 * Internal calls are named cache_*; the library is built with hidden visibility, so none of them is exported. */
#ifndef ZIPMOE_CACHE_STORE_STATE_H
#define ZIPMOE_CACHE_STORE_STATE_H

#include "zipmoe-impl.h"
#include "zipmoe-cache.h"
#include "reader.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

enum { RES_NONE = 0, RES_SM = 1, RES_FULL = 2 }; /* what of an expert's region is in RAM */

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
    uint64_t  prior;     /* the counting policies' head start from the model's popularity in earlier runs, in the
                          * scores' units (zipmoe_store_set_prior, tiers.c); 0: none */
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
    int32_t *         ahead_order; /* under mu: the order the read-ahead takes experts in, by prior (the most used
                                    * first; cache_prior_order), by id without one (zipmoe_store_set_prior sets it) */
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

#endif /* ZIPMOE_CACHE_STORE_STATE_H */
