/* tiers.h - the expert cache's middle layer, above its I/O (io.h) and below the materialise protocol (cache-impl.h):
 * the configuration and each store's limits (config.c; budget.c's split), the open stores (stores.c), the routing
 * log (routing.c), the pages of decoded experts (pages.c), the tiers and eviction (tiers.c), the policies' prior
 * (prior.c) and an invocation's plan (plan.c). */
#ifndef ZIPMOE_CACHE_TIERS_H
#define ZIPMOE_CACHE_TIERS_H

#include "io.h"

enum { TIER_HOT, TIER_WARM, TIER_SM };
/* The counting policies' scores count a use as USE_WEIGHT (tiers.c), so that a prior (prior.c) can be worth a fraction
 * of one; without a prior every score is its count times USE_WEIGHT, the same order as the counts. */
#define USE_WEIGHT 256
#define ANY_COPY INT64_MAX /* entrant id of a copy of a hot expert: it takes another copy's room on a tie */

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
    int              token_mode;  /* hot_budget is hot_tokens (zipmoe_cache_begin_graph); the read buffers are told */
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
} cache_config;
extern cache_config g_cfg;

/* The open stores and the clocks they share: process-wide, because trims, read-ahead and the graph's order span
 * every store of the process (one graph computes at a time). Defined in stores.c. */
typedef struct {
    pthread_mutex_t         mu;           /* the list, for cross-layer trims */
    zipmoe_store *          list;
    _Atomic(zipmoe_store *) last_planned; /* the store that planned last: learns the graph's order */
    _Atomic uint64_t        tick;         /* the policies' clock: one tick an invocation */
    _Atomic uint64_t        op_seq;       /* invocations begun, of any store: tells a late sibling from a new one */
} cache_stores;
extern cache_stores g_open;

/* config.c */
void     cache_refresh_limits(zipmoe_store * s); /* under s->mu: the store's tier limits for the configuration */
void     cache_share_hot_slots(void);            /* under g_open.mu and g_cfg.mu: the open stores changed */
int      cache_begin_budgets(int64_t routed, int step); /* under g_open.mu: a graph's budgets; 1: a smaller one */

/* routing.c */
void cache_log_route(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1);

/* pages.c */
void     cache_own_pages(const zipmoe_store * s, int64_t p, uintptr_t * lo, uintptr_t * hi);
void     cache_forget_huge_pages(zipmoe_store * s, int64_t p);
void     cache_vacate_place(zipmoe_store * s, int64_t p);
/* Huge pages for a store's settled decoded experts (run by the reader thread, or the prefill's); 0 when it stopped
 * early for reads waiting, to be submitted again. */
int      cache_collapse(zipmoe_store * s);

/* tiers.c */
uint64_t cache_resident_size(const zipmoe_store * s, int64_t e, int res);
uint64_t cache_entry_worth(const zipmoe_store * s, const expert_state * x);
int      cache_loses(uint64_t worth, int64_t e, uint64_t v_worth, int64_t v);
int64_t  cache_victim(const zipmoe_store * s, int tier, uint64_t * worth);
void     cache_drop_region(zipmoe_store * s, int64_t e);
void     cache_demote_warm(zipmoe_store * s, int64_t e);
int      cache_make_room(zipmoe_store * s, int tier, uint64_t need, uint64_t worth, int64_t entrant);
int64_t  cache_evict_hot(zipmoe_store * s, int64_t e, int keep_pages);
void     cache_settle(zipmoe_store * s);
void     cache_trim_others(const zipmoe_store * s);

/* prior.c */
void     cache_prior_order(const zipmoe_store * s, int32_t * order);

/* plan.c */
int64_t cache_make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1);
void    cache_schedule_reads(zipmoe_store * s);
void    cache_map_plan(zipmoe_store * s);
void    cache_end_decoding(zipmoe_store * s);

#endif /* ZIPMOE_CACHE_TIERS_H */
