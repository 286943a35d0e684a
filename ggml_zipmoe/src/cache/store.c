/* store.c - serving one compressed expert tensor at run time under a memory budget: the BF16 memory the
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
 * The protocol, for an engine that calls an op on all of its threads with no barrier inside the op
 * (ggml's custom ops): the first thread of an invocation plans (routed experts that are not hot, and
 * what is read from RAM or disk, which the reader thread starts reading); the threads that join claim
 * the plan's chunks one by one and decode them; the last thread to leave publishes (hot), evicts down to
 * the limits and releases the plan. A decoded expert lies at a place in the BF16 memory, not always its own
 * index (a miss takes the place of the expert evicted for it, pages and all), and each thread writes where
 * the routed experts lie for its share of the rows, which the engine's matmul reads as its ids. No thread
 * waits for a sibling, every chunk is decoded exactly once, and the engine's barrier after the op makes the
 * decoded bytes visible to the matmul. Threads need not agree on taking the lock-free fast path (a
 * configuration change may land between their checks): those that join the plan finish it between them,
 * and a thread arriving after it was published finds its experts decoded. The experts routed by the
 * invocation are never evicted by it: the matmul that reads them has not run yet. They stay pinned until the
 * store's next invocation, or until another store plans (the engine runs each op's matmul before the next
 * expert tensor's op), which bounds the decoded working set beyond the limits to one store's routed experts.
 * A second invocation on the same store (another graph) waits until the first has released its plan. */
#define _GNU_SOURCE
#include "zipmoe-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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
    uint8_t   prefetched; /* read ahead before the plan (zipmoe_store_prefetch): nothing left to read */
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
    zipmoe_tensor *    tensor;
    zipmoe_tensor_info info;
    uint64_t           hot_size, sm_size; /* bytes of one expert decoded, of its sign+mantissa plane */
    uint64_t           mean_region;       /* of the compressed regions: converts warm slots to bytes */

    int        fd;          /* our own descriptor of the model file, -1 until bound */
    int        dfd;         /* the file opened with O_DIRECT, for read-ahead around the page cache; -1: none */
    uint64_t   data_offset; /* of the data companion in the file */
    uint16_t * dst;         /* BF16 memory: n_expert * n_per_expert values, MAP_NORESERVE */
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
    _Atomic(const void *) last_key; /* the last plan's key and the g_op_seq it began at: a thread arriving */
    _Atomic uint64_t      last_seq; /* with both unchanged is a late sibling of that invocation           */
    int64_t         plan_n;
    uint64_t        plan_decoding; /* bytes of the plan's experts that are not hot: in g_decoding_bytes until publish */
    plan_item *     plan;
    int             planning;   /* from make_plan until publish: the plan's compressed regions are in use */
    int             plan_stream; /* the invocation's caller decodes warm experts itself (ZIPMOE_TURN_STREAM) */
    int             prefilling; /* zipmoe_cache_prefill routes its own batches: no counts, no routing log */
    zipmoe_read_job job;        /* the plan's reads, items parallel to plan */
    int             job_active; /* submitted to the reader, and the staging buffer held */
    zipmoe_read_job collapse_job; /* zipmoe_store_collapse on the reader thread */
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
    int64_t         hot_slots;   /* under g_cfg_mu: its whole experts of the hot budget (share_hot_slots); -1: none */
    int64_t         extra_slots; /* under g_cfg_mu: hot slots beyond its rule's in generation (rule_slots) */
    uint64_t        warm_share;  /* under g_cfg_mu: its whole regions of the warm budget (shared_warm); UINT64_MAX: none */
    _Atomic uint64_t cfg_gen;
    zipmoe_policy   policy;
    int             use_slots;   /* decode into memfd slots (slots.c): the hot tier cannot hold every expert */
    _Atomic int     fast_ok;     /* limits current and the last publish kept within them: a lock-free */
                                 /* fast path may serve invocations whose experts are all hot         */
    pthread_mutex_t err_mu;      /* the first decoding error not yet taken; per store, so that an engine */
    int64_t         err;         /* takes exactly the errors of the graph it computed (two models in one  */
    char            err_msg[256]; /* process must not see each other's)                               */
    zipmoe_store *  next;        /* in the list of open stores */
};

/* Where place p lies in dst; whether a hot expert's values are there. */
static uint16_t * place_addr(const zipmoe_store * s, int64_t p) { return s->dst + p * s->info.n_per_expert; }

static int place_hot(const zipmoe_store * s, int64_t p) {
    const int64_t e = s->places[p].expert;
    return e >= 0 && s->experts[e].hot;
}

/* ---------------------------------------------------------------- the process's budget */

typedef struct {
    char    prefix[96];
    int64_t hot, warm, sm;
} slot_rule;

#define MAX_SLOT_RULES 4096

static pthread_mutex_t  g_cfg_mu      = PTHREAD_MUTEX_INITIALIZER;
static uint64_t         g_hot_budget  = UINT64_MAX; /* the hot tier's budget now: g_hot_batch or g_hot_tokens */
static uint64_t         g_hot_batch   = UINT64_MAX; /* zipmoe_cache_configure's */
static uint64_t         g_hot_tokens  = UINT64_MAX; /* zipmoe_cache_set_token_hot's, at least g_hot_batch */
static int              g_token_mode;  /* g_hot_budget is g_hot_tokens (zipmoe_cache_begin_graph) */
static _Atomic uint64_t g_read_room = UINT64_MAX; /* a prompt's read buffers' (zipmoe_cache_set_read_room) */
static int64_t          g_token_slots = -1; /* the fewest hot slots a store has in generation; -1: no token mode */
static uint64_t         g_rule_room;   /* zipmoe_cache_set_token_room's: what ruled stores hold in generation */
static uint64_t         g_reserve;     /* zipmoe_cache_set_reserve's: evicted experts' pages kept, outside token mode */
static int              g_token_warm;  /* token mode is generation's larger warm tier (no hot tier: warm_budget_now) */
static uint64_t         g_token_need;  /* then: the pages a token's misses decode into, kept (routed x largest expert) */
static uint64_t         g_warm_budget = 0;
static uint64_t         g_sm_budget   = 0;
static zipmoe_policy    g_policy      = ZIPMOE_POLICY_TOKEN_LFU;
static slot_rule *      g_rules;      /* per-store slot counts, by name prefix (a planner's plan) */
static int              g_n_rules;
static _Atomic uint64_t g_cfg_gen = 1; /* bumped by every change: stores refresh their limits */
static _Atomic uint64_t g_bf16_total;  /* BF16 bytes of all open stores: the shares of the budgets */
static _Atomic uint64_t g_tick;
static _Atomic uint64_t g_op_seq; /* invocations begun, of any store: tells a late sibling from a new invocation */

static pthread_mutex_t g_list_mu = PTHREAD_MUTEX_INITIALIZER; /* the open stores, for cross-layer trims */
static zipmoe_store *  g_list;
static _Atomic(zipmoe_store *) g_last_planned; /* the store that planned last: learns the graph's order */

/* A store's share of a budget, in proportion to its BF16 size. */
static uint64_t quota(const zipmoe_store * s, uint64_t budget) {
    if (budget == UINT64_MAX) {
        return UINT64_MAX;
    }
    const uint64_t total = atomic_load(&g_bf16_total);
    const uint64_t mine  = (uint64_t) s->info.n_expert * s->hot_size;
    return total ? (uint64_t) ((double) budget * (double) mine / (double) total) : 0;
}

/* Under g_cfg_mu: the planner's rule for a store (the longest matching prefix), or NULL. */
static const slot_rule * find_rule(const char * name) {
    const slot_rule * rule = NULL;
    size_t            best = 0;
    for (int i = 0; i < g_n_rules; i++) {
        const size_t len = strlen(g_rules[i].prefix);
        if (len >= best && strncmp(name, g_rules[i].prefix, len) == 0) {
            rule = &g_rules[i];
            best = len;
        }
    }
    return rule;
}

static uint64_t add_sat(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

static uint64_t slots_bytes(int64_t slots, uint64_t size) {
    return (uint64_t) slots > UINT64_MAX / (size ? size : 1) ? UINT64_MAX : (uint64_t) slots * size;
}

/* Under g_list_mu and g_cfg_mu (in that order): each store that no rule sets gets the whole experts of its share
 * of a hot budget, and what its share holds beyond them goes on to the next store in the list. Rounded down store
 * by store, every share would leave up to one expert's bytes unused: 0.97 of an expert on each of the 24 stores of
 * the 2.8g model at 75%, whose LFU caches of 20 slots miss 10% more often than of 21 (its routing log, simulated).
 * The total stays within the budget. Sets the stores' hot_slots when `set`; returns the fewest slots of a store it
 * shares to, or -1 when it shares to none. */
static int64_t shared_slots(uint64_t budget, int set) {
    uint64_t carry  = 0;
    int64_t  fewest = -1;
    for (zipmoe_store * o = g_list; o; o = o->next) {
        if (set) {
            o->hot_slots = -1;
        }
        if (budget == UINT64_MAX || o->hot_size == 0 || find_rule(o->name)) {
            continue;
        }
        const uint64_t share = quota(o, budget) + carry;
        const uint64_t slots = share / o->hot_size < (uint64_t) o->info.n_expert ? share / o->hot_size
                                                                                 : (uint64_t) o->info.n_expert;
        if (set) {
            o->hot_slots = (int64_t) slots;
        }
        fewest = fewest < 0 || (int64_t) slots < fewest ? (int64_t) slots : fewest;
        carry  = share - slots * o->hot_size;
    }
    return fewest;
}

/* Under g_list_mu and g_cfg_mu: generation's room beside a planner's rules (zipmoe_cache_set_token_room, less the
 * bytes the rules' slots take) shared out as extra hot slots among the stores, in whole experts carried from store
 * to store as shared_slots does; in token mode they are the stores' extra_slots (`set`; 0 otherwise). Only when
 * every store has a rule without an sm tier (place_plan does not evict first there). Returns the fewest hot slots
 * a store then has in generation, or -1 when the rules get no room. */
static int64_t rule_slots(int set) {
    uint64_t rules = 0;
    int      every = g_list != NULL && g_rule_room > 0;
    for (zipmoe_store * o = g_list; o; o = o->next) {
        const slot_rule * rule = find_rule(o->name);
        if (set) {
            o->extra_slots = 0;
        }
        every = every && rule && rule->sm == 0;
        if (rule) { /* (saturating: absurd slot counts must not wrap into room) */
            rules = add_sat(rules, add_sat(slots_bytes(rule->hot, o->hot_size), slots_bytes(rule->warm, o->mean_region)));
        }
    }
    if (!every || rules >= g_rule_room) {
        return -1;
    }
    const uint64_t room   = g_rule_room - rules;
    uint64_t       carry  = 0;
    int64_t        fewest = -1;
    for (zipmoe_store * o = g_list; o; o = o->next) {
        const slot_rule * rule  = find_rule(o->name);
        const int64_t     free  = o->info.n_expert - rule->hot - rule->warm; /* an expert in one tier at a time */
        const uint64_t    share = quota(o, room) + carry;
        const uint64_t    fit   = o->hot_size ? share / o->hot_size : 0;
        const int64_t     extra = free <= 0 ? 0 : fit < (uint64_t) free ? (int64_t) fit : free;
        if (set && g_token_mode) {
            o->extra_slots = extra;
        }
        fewest = fewest < 0 || rule->hot + extra < fewest ? rule->hot + extra : fewest;
        carry  = share - (uint64_t) extra * o->hot_size;
    }
    return fewest;
}

static uint64_t warm_budget_now(void);

/* Under g_list_mu and g_cfg_mu: each store that no rule sets gets the whole regions (of its mean size) of its share
 * of the warm budget, or all of its regions, and what its share holds beyond them goes on to the next store, as
 * shared_slots does for the hot tier. At 75% of the 2.8g model, warm-only, each store's share fell half a region
 * short of its experts, and each kept one fewer: 24 missing where the budget lacked 6. */
static void shared_warm(uint64_t budget) {
    uint64_t carry = 0;
    for (zipmoe_store * o = g_list; o; o = o->next) {
        o->warm_share = UINT64_MAX;
        if (budget == UINT64_MAX || o->mean_region == 0 || find_rule(o->name)) {
            continue;
        }
        const uint64_t share = quota(o, budget) + carry;
        const uint64_t all   = o->info.data_size;
        o->warm_share        = share >= all ? all : share / o->mean_region * o->mean_region;
        carry                = share - o->warm_share;
    }
}

/* Under g_list_mu and g_cfg_mu, whenever the budget, the rules or the open stores change: the hot slots of the
 * budget in force, and the fewest a store would have in generation's; the warm tier's shares. Every store
 * refreshes its limits at its next invocation (g_cfg_gen). */
static void share_hot_slots(void) {
    shared_slots(g_hot_budget, 1);
    shared_warm(warm_budget_now());
    const int64_t ruled = rule_slots(1);
    if (g_n_rules > 0) {
        g_token_slots = ruled;
    } else {
        g_token_slots = g_sm_budget == 0 && g_hot_tokens != UINT64_MAX && g_hot_tokens > g_hot_batch
                            ? shared_slots(g_hot_tokens, 0)
                            : -1;
    }
    atomic_fetch_add(&g_cfg_gen, 1);
}

/* Under g_list_mu and g_cfg_mu: the tier budgets, generation's hot budget (tokens, at least hot) and the policy. */
static void set_budgets(uint64_t hot, uint64_t tokens, uint64_t warm, uint64_t sm, zipmoe_policy policy) {
    g_hot_batch   = hot;
    g_hot_tokens  = tokens > hot ? tokens : hot;
    g_hot_budget  = g_token_mode ? g_hot_tokens : g_hot_batch; /* (begin_graph decides again at the next graph) */
    g_warm_budget = warm;
    g_sm_budget   = sm;
    g_policy      = policy;
}

int64_t zipmoe_cache_configure(uint64_t hot_bytes, uint64_t warm_bytes, uint64_t sm_bytes, zipmoe_policy policy) {
    if (policy < ZIPMOE_POLICY_TOKEN_LFU || policy > ZIPMOE_POLICY_FIFO) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    /* (zipmoe_cache_set_token_hot gives generation more; until then, in token mode, the tier is hot_bytes, and the
     * next graph's zipmoe_cache_begin_graph leaves token mode, trimming every store down to it) */
    set_budgets(hot_bytes, hot_bytes, warm_bytes, sm_bytes, policy);
    share_hot_slots();
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
    return ZIPMOE_OK;
}

/* Under g_cfg_mu: whether generation may lend the allowance for the tensor in flight to the warm tier: every expert
 * kept compressed, none decoded (nor sign+mantissa planes, nor a planner's rules), so that a prompt's every
 * routed expert is decoded anew into that allowance, a token's few only. */
static int warm_tokens_possible(void) {
    return g_hot_batch == 0 && g_sm_budget == 0 && g_n_rules == 0 && g_warm_budget > 0 && g_warm_budget != UINT64_MAX;
}

/* Under g_cfg_mu: the warm tier's budget in force. In generation without a hot tier it also holds the allowance for
 * the tensor in flight beyond what a token's misses decode into: at 75% of the 2.8g model that is 84 of its 96 MiB,
 * the last 6% of the compressed experts, whose misses (3 a token) stalled a warm-only token 12 of its 68 ms. */
static uint64_t warm_budget_now(void) {
    return g_token_mode && g_token_warm && warm_tokens_possible() && g_reserve > g_token_need
               ? g_warm_budget + (g_reserve - g_token_need)
               : g_warm_budget;
}

/* Evicted experts' pages are kept for a batch's decodes beyond the limits; in token mode a miss takes its victim's
 * place instead, and the room the reserve would keep is generation's hot tier's: pages kept there would come on
 * top of a full tier (after a shrink in generation, by up to the whole reserve). Generation's warm tier keeps the
 * pages of a token's misses, and the rest go back at once: the tier grows into them. */
static void keep_reserve(void) {
    zipmoe_slots_set_keep(!g_token_mode ? g_reserve : g_token_warm ? g_token_need : 0);
    if (g_token_mode && g_token_warm) {
        zipmoe_slots_trim();
    }
}

void zipmoe_cache_set_reserve(uint64_t bytes) {
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    g_reserve = bytes;
    keep_reserve();
    share_hot_slots(); /* (generation's warm shares hold the reserve beyond a token's pages) */
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
}

void zipmoe_cache_set_token_hot(uint64_t hot_bytes) {
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    g_hot_tokens = hot_bytes > g_hot_batch ? hot_bytes : g_hot_batch;
    if (g_token_mode) {
        g_hot_budget = g_hot_tokens;
    }
    share_hot_slots();
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
}

void zipmoe_cache_set_token_room(uint64_t bytes) {
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    g_rule_room = bytes;
    share_hot_slots();
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
}

uint64_t zipmoe_cache_rules_bytes(void) {
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    uint64_t bytes = 0;
    for (const zipmoe_store * o = g_list; o; o = o->next) {
        const slot_rule * rule = find_rule(o->name);
        if (rule) { /* (saturating, as rule_slots) */
            bytes = add_sat(bytes, add_sat(slots_bytes(rule->hot, o->hot_size), add_sat(slots_bytes(rule->warm, o->mean_region),
                                                                                   slots_bytes(rule->sm, o->sm_size))));
        }
    }
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
    return bytes;
}

static void trim_idle_read_buffers(void);

int64_t zipmoe_cache_apply_split(const zipmoe_budget_split * split, zipmoe_policy policy) {
    if (!split || policy < ZIPMOE_POLICY_TOKEN_LFU || policy > ZIPMOE_POLICY_FIFO) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    g_n_rules   = 0;
    g_rule_room = 0;
    set_budgets(split->hot, split->token_hot, split->warm, split->sm, policy);
    g_reserve = split->in_flight;
    /* (a split that leaves no read room reads nothing beyond its fill, every expert decoded, or keeps no hot tier:
     * its buffers are not bounded, as before there was a room) */
    atomic_store(&g_read_room, split->reads ? split->reads : UINT64_MAX);
    keep_reserve();
    share_hot_slots();
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
    trim_idle_read_buffers(); /* (it takes g_cfg_mu) */
    return ZIPMOE_OK;
}

static _Atomic int g_direct_io = 1;

void zipmoe_cache_set_direct_io(int enabled) { atomic_store(&g_direct_io, enabled != 0); }

int64_t zipmoe_cache_set_slots(const char * prefix, int64_t hot, int64_t warm, int64_t sm) {
    pthread_mutex_lock(&g_list_mu);
    pthread_mutex_lock(&g_cfg_mu);
    int64_t rc = ZIPMOE_OK;
    if (!prefix) {
        g_n_rules   = 0;
        g_rule_room = 0; /* (the room was the rules') */
    } else if (strlen(prefix) >= sizeof g_rules[0].prefix || hot < 0 || warm < 0 || sm < 0) {
        rc = ZIPMOE_ERR_ARG;
    } else {
        int i = 0;
        while (i < g_n_rules && strcmp(g_rules[i].prefix, prefix) != 0) {
            i++;
        }
        if (i == g_n_rules) {
            if (!g_rules) {
                g_rules = calloc(MAX_SLOT_RULES, sizeof *g_rules);
            }
            if (!g_rules || g_n_rules == MAX_SLOT_RULES) {
                rc = g_rules ? ZIPMOE_ERR_ARG : ZIPMOE_ERR_NOMEM;
            } else {
                g_n_rules++;
            }
        }
        if (rc == ZIPMOE_OK) {
            snprintf(g_rules[i].prefix, sizeof g_rules[i].prefix, "%s", prefix);
            g_rules[i].hot  = hot;
            g_rules[i].warm = warm;
            g_rules[i].sm   = sm;
        }
    }
    share_hot_slots();
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
    return rc;
}

/* Under s->mu: the store's tier limits for the current configuration. */
static void refresh_limits(zipmoe_store * s) {
    pthread_mutex_lock(&g_cfg_mu);
    const slot_rule * rule = find_rule(s->name);
    if (rule) {
        s->hot_limit  = slots_bytes(rule->hot + s->extra_slots, s->hot_size);
        s->warm_limit = slots_bytes(rule->warm, s->mean_region);
        s->sm_limit   = slots_bytes(rule->sm, s->sm_size);
    } else {
        s->hot_limit  = s->hot_slots >= 0 ? slots_bytes(s->hot_slots, s->hot_size) : quota(s, g_hot_budget);
        s->warm_limit = s->warm_share != UINT64_MAX ? s->warm_share : quota(s, warm_budget_now());
        s->sm_limit   = quota(s, g_sm_budget);
    }
    s->policy  = g_policy;
    /* slots pay when experts come and go; an unbounded hot tier keeps anonymous pages, which may become huge */
    s->use_slots = s->hot_limit < (uint64_t) s->info.n_expert * s->hot_size;
    s->cfg_gen = atomic_load(&g_cfg_gen);
    pthread_mutex_unlock(&g_cfg_mu);
}

/* ---------------------------------------------------------------- statistics and errors */

static _Atomic uint64_t g_stores, g_hot_bytes, g_warm_bytes, g_sm_bytes, g_experts, g_chunks, g_bytes, g_ns, g_calls;
static _Atomic uint64_t g_hits_hot, g_hits_warm, g_hits_sm, g_misses, g_read_bytes, g_read_ns, g_evictions;
static _Atomic uint64_t g_peak_hot, g_peak_resident, g_stall_ns, g_reading_calls;
static _Atomic uint64_t g_stage_cap_bytes, g_pf_cap_bytes[2]; /* the reader's buffers: zipmoe_stats' staging_bytes */
static uint64_t read_buffers_transient(void);
static _Atomic uint64_t g_read_ahead_bytes;
static _Atomic uint64_t g_decoding_bytes; /* planned experts not hot yet: their places' pages are in use */
static _Atomic uint64_t g_guessed_bytes, g_guesses_used;
static _Atomic uint64_t g_streamed; /* routed warm experts left for the caller to decode in its cache */
static _Atomic uint64_t g_prefill_dummy; /* what a prefill's invocations count instead of the model's routing */

void zipmoe_stats_add_read(uint64_t bytes, uint64_t ns) {
    atomic_fetch_add(&g_read_bytes, bytes);
    atomic_fetch_add(&g_read_ns, ns);
}

void zipmoe_stats_get(zipmoe_stats * out) {
    out->stores              = atomic_load(&g_stores);
    out->hot_bytes           = atomic_load(&g_hot_bytes);
    out->warm_bytes          = atomic_load(&g_warm_bytes);
    out->peak_hot_bytes      = atomic_load(&g_peak_hot);
    out->experts_decoded     = atomic_load(&g_experts);
    out->chunks_decoded      = atomic_load(&g_chunks);
    out->bytes_decoded       = atomic_load(&g_bytes);
    out->decode_ns           = atomic_load(&g_ns);
    out->materialize_calls   = atomic_load(&g_calls);
    out->hits_hot            = atomic_load(&g_hits_hot);
    out->hits_warm           = atomic_load(&g_hits_warm);
    out->misses              = atomic_load(&g_misses);
    out->bytes_read          = atomic_load(&g_read_bytes);
    out->read_ns             = atomic_load(&g_read_ns);
    out->evictions           = atomic_load(&g_evictions);
    out->sm_bytes            = atomic_load(&g_sm_bytes);
    out->hits_sm             = atomic_load(&g_hits_sm);
    out->stall_ns            = atomic_load(&g_stall_ns);
    out->peak_resident_bytes = atomic_load(&g_peak_resident);
    out->staging_bytes = atomic_load(&g_stage_cap_bytes) + atomic_load(&g_pf_cap_bytes[0]) + atomic_load(&g_pf_cap_bytes[1]);
    out->pool_bytes          = zipmoe_slots_kept();
    out->reading_calls       = atomic_load(&g_reading_calls);
    out->bytes_read_ahead    = atomic_load(&g_read_ahead_bytes);
    out->bytes_read_guessed  = atomic_load(&g_guessed_bytes);
    out->guesses_used        = atomic_load(&g_guesses_used);
    out->staging_transient_bytes = read_buffers_transient();
    out->decoding_bytes          = atomic_load(&g_decoding_bytes);
    out->experts_streamed        = atomic_load(&g_streamed);
}

void zipmoe_stats_reset(void) {
    _Atomic uint64_t * counters[] = { &g_experts, &g_chunks, &g_bytes, &g_ns, &g_calls, &g_hits_hot, &g_hits_warm,
                                      &g_hits_sm, &g_misses, &g_read_bytes, &g_read_ns, &g_evictions, &g_stall_ns,
                                      &g_reading_calls, &g_read_ahead_bytes, &g_guessed_bytes, &g_guesses_used,
                                      &g_streamed };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        atomic_store(counters[i], 0);
    }
    atomic_store(&g_peak_hot, atomic_load(&g_hot_bytes));
    atomic_store(&g_peak_resident, atomic_load(&g_hot_bytes) + atomic_load(&g_warm_bytes) + atomic_load(&g_sm_bytes));
}

static void raise_peak(_Atomic uint64_t * peak, uint64_t now) {
    uint64_t p = atomic_load(peak);
    while (now > p && !atomic_compare_exchange_weak(peak, &p, now)) {
    }
}

/* Counts bytes into (or, negative, out of) a tier's process-wide total and the peaks. */
static void account(_Atomic uint64_t * tier, int64_t bytes) {
    const uint64_t now = atomic_fetch_add(tier, (uint64_t) bytes) + (uint64_t) bytes;
    if (bytes > 0) {
        if (tier == &g_hot_bytes) {
            raise_peak(&g_peak_hot, now);
        }
        raise_peak(&g_peak_resident, atomic_load(&g_hot_bytes) + atomic_load(&g_warm_bytes) + atomic_load(&g_sm_bytes));
    }
}

static void record_error(zipmoe_store * s, int64_t expert, int64_t status) {
    pthread_mutex_lock(&s->err_mu);
    if (s->err == ZIPMOE_OK) {
        s->err = status;
        snprintf(s->err_msg, sizeof s->err_msg, "zipmoe: %s, expert %lld: %s", s->name, (long long) expert,
                 zipmoe_status_str(status));
    }
    pthread_mutex_unlock(&s->err_mu);
}

int64_t zipmoe_store_take_error(zipmoe_store * s, char * msg, size_t msg_size) {
    if (!s) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->err_mu);
    const int64_t status = s->err;
    if (msg && msg_size) {
        snprintf(msg, msg_size, "%s", status ? s->err_msg : "");
    }
    s->err = ZIPMOE_OK;
    pthread_mutex_unlock(&s->err_mu);
    return status;
}

/* ---------------------------------------------------------------- per-thread scratch */

/* Engines change their thread count between calls (prompt vs generation), so scratch belongs to the
 * thread, not to an ith: a decoder workspace and room for one chunk read from disk. Freed at exit. */
typedef struct {
    zipmoe_workspace * ws;
    uint8_t *          buf;
    size_t             buf_size;
} thread_scratch;

static pthread_key_t  g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void * p) {
    thread_scratch * ts = (thread_scratch *) p;
    zipmoe_workspace_free(ts->ws);
    free(ts->buf);
    free(ts);
}

static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_destroy); }

static thread_scratch * thread_scratch_get(size_t chunk_n, size_t buf_size) {
    pthread_once(&g_scratch_once, scratch_key_init);
    thread_scratch * ts = (thread_scratch *) pthread_getspecific(g_scratch_key);
    if (!ts) {
        ts = calloc(1, sizeof *ts);
        if (!ts) {
            return NULL;
        }
        pthread_setspecific(g_scratch_key, ts);
    }
    if (!ts->ws || ts->ws->chunk_n < chunk_n) {
        zipmoe_workspace_free(ts->ws);
        ts->ws = zipmoe_workspace_create(chunk_n);
    }
    if (ts->buf_size < buf_size) {
        free(ts->buf);
        ts->buf      = malloc(buf_size);
        ts->buf_size = ts->buf ? buf_size : 0;
    }
    return ts->ws && ts->buf ? ts : NULL;
}

/* ---------------------------------------------------------------- read-ahead buffers */

/* Bytes the reader reads ahead for the store invoked next (zipmoe_store_prefetch) go to one of two buffers
 * rather than through the page cache: a hint (POSIX_FADV_WILLNEED) left the kernel to allocate, charge, copy
 * and drop every page again, and with the hints for the store after, that was half of a budgeted run's CPU
 * time on 2 cores. With O_DIRECT the disk writes straight into the buffer. Kept between invocations (a prompt
 * reads tens of MiB a store, and fresh pages are zeroed), given back once a need fits STAGE_KEEP again. */
static _Atomic size_t g_read_buffer = (size_t) 16 << 20; /* zipmoe_cache_set_read_buffer */
#define STAGE_KEEP atomic_load(&g_read_buffer)

void zipmoe_cache_set_read_buffer(uint64_t bytes) {
    atomic_store(&g_read_buffer, bytes < ZIPMOE_DIRECT_ALIGN ? ZIPMOE_DIRECT_ALIGN : (size_t) bytes);
}

static int in_token_mode(void) {
    pthread_mutex_lock(&g_cfg_mu);
    const int tokens = g_token_mode;
    pthread_mutex_unlock(&g_cfg_mu);
    return tokens;
}

/* The most a large read buffer (the staging buffer, a prompt's read-ahead) may take for reads of `need` bytes, of
 * which `largest` is the largest single read: half the read room in a batch (the other half is the other buffer's),
 * what a buffer keeps in generation (whose hot tier holds the room), never less than one read. */
static size_t read_buffer_bound(size_t need, size_t largest) {
    const uint64_t room  = atomic_load(&g_read_room);
    size_t         bound = STAGE_KEEP;
    if (room == UINT64_MAX) {
        return need;
    }
    if (!in_token_mode() && room / 2 > bound) {
        bound = (size_t) (room / 2) & ~(ZIPMOE_DIRECT_ALIGN - 1);
    }
    bound = bound > largest ? bound : largest;
    return need < bound ? need : bound;
}

/* A buffer larger than this was grown under a larger read room than a batch has now: it is given back (or
 * refitted) when idle. Not in generation, whose reads of experts larger than what a buffer keeps would regrow it
 * every token. */
static size_t read_buffer_refit_limit(void) { return in_token_mode() ? SIZE_MAX : read_buffer_bound(SIZE_MAX, 0); }

/* A compressed tier's copy of an expert (its region, or its sign+mantissa plane) and a read buffer are mappings
 * of their own, so that what is given up goes back to the system at once (page-aligned, as O_DIRECT wants). From
 * malloc, the ~2 MB blocks that threads free and allocate in turn stayed in glibc's heaps: with a warm tier at 75% of the 2.8g model the process grew
 * ~400 MB past its budget and the page cache of the other weights thrashed (19 GB read for 32 tokens). */
static uint8_t * region_alloc(uint64_t size) {
    /* not populated: the pages fault in where the bytes are written (mostly the reader's pread), not under s->mu */
    void * p = mmap(NULL, (size_t) size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (uint8_t *) p;
}

static void region_free(uint8_t * p, uint64_t size) {
    if (p) {
        munmap(p, (size_t) size);
    }
}

/* What the read buffers hold beyond what each keeps between uses (zipmoe_stats' staging_transient_bytes). */
static uint64_t read_buffers_transient(void) {
    const uint64_t keep  = STAGE_KEEP;
    uint64_t       total = 0;
    const uint64_t caps[] = { atomic_load(&g_stage_cap_bytes), atomic_load(&g_pf_cap_bytes[0]),
                              atomic_load(&g_pf_cap_bytes[1]) };
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
        total += caps[i] > keep ? caps[i] - keep : 0;
    }
    return total;
}

static void read_buffer_free(uint8_t ** data, size_t * cap) {
    region_free(*data, *cap);
    *data = NULL;
    *cap  = 0;
}

/* Makes *data (a read buffer, aligned for O_DIRECT) fit need: grown when smaller, given back when a need fits
 * STAGE_KEEP again after a prompt's larger one; never smaller than STAGE_KEEP, so that generation does not
 * regrow it (and fault in fresh pages) for every larger token. *cap is 0 if the allocation failed. */
static void read_buffer_fit(uint8_t ** data, size_t * cap, size_t need) {
    /* (a buffer a larger read room let grow is refitted once the room is smaller) */
    if (*cap >= need && !(*cap > STAGE_KEEP && need <= STAGE_KEEP) && *cap <= read_buffer_refit_limit()) {
        return;
    }
    read_buffer_free(data, cap);
    const size_t size = need > STAGE_KEEP ? need : STAGE_KEEP;
    *data             = region_alloc(size);
    *cap              = *data ? size : 0;
}

static pthread_mutex_t g_pf_mu = PTHREAD_MUTEX_INITIALIZER;
static prefetch_buffer g_pf[2];
/* A prompt's read-ahead (tens of MiB) waits for the other buffer instead of taking a second large one: under a
 * cgroup limit the page cache of the weights that are not experts made room for it (pp512 at 40%: 244 against
 * 280 tokens/s with 150 MB more room). It is started when the store decoding from the other buffer is done, which
 * still leaves its matmul to overlap. */
static struct zipmoe_store * g_pf_deferred; /* under g_pf_mu */
static zipmoe_read_job g_ahead_job = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

static int open_direct(int fd) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    return open(path, O_RDONLY | O_DIRECT | O_CLOEXEC); /* -1 where the file system has no O_DIRECT: buffered */
}

/* Under g_pf_mu: the reader reads ahead for s (all its experts not in RAM, or those guessed) after what it is doing
 * now, with a job that reads nothing itself; nothing if that job is still queued. */
static void submit_read_ahead(zipmoe_store * s, int predicted) {
    pthread_mutex_lock(&g_ahead_job.mu);
    const int busy = g_ahead_job.busy;
    pthread_mutex_unlock(&g_ahead_job.mu);
    if (!busy) {
        g_ahead_job.n_items            = 0;
        g_ahead_job.prefetch           = s;
        g_ahead_job.prefetch_like      = NULL;
        g_ahead_job.prefetch_predicted = predicted;
        zipmoe_reader_submit(&g_ahead_job);
    }
}

/* Under s->mu: gives s's read-ahead buffer back, unused or used up. */
static void prefetch_drop(zipmoe_store * s) {
    if (!s->pf) {
        return;
    }
    const size_t bound = read_buffer_refit_limit();
    pthread_mutex_lock(&g_pf_mu);
    s->pf->owner = NULL;
    if (s->pf->cap > bound) { /* grown under a larger read room than there is now */
        read_buffer_free(&s->pf->data, &s->pf->cap);
        atomic_store(&g_pf_cap_bytes[s->pf - g_pf], 0);
    }
    zipmoe_store * deferred = g_pf_deferred;
    g_pf_deferred           = NULL;
    if (deferred) {
        submit_read_ahead(deferred, 0);
    }
    pthread_mutex_unlock(&g_pf_mu);
    s->pf = NULL;
    atomic_store(&s->holds_pf, 0);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        s->pf_at[e] = -1;
    }
}

/* A free buffer of at least need bytes for s, or NULL: both taken (the caller hints instead), or a large need while
 * the other buffer is in use (*deferred: read ahead when it is given back). */
static prefetch_buffer * prefetch_take(zipmoe_store * s, size_t need, int * deferred) {
    pthread_mutex_lock(&g_pf_mu);
    *deferred = 0;
    if (need > STAGE_KEEP && (g_pf[0].owner || g_pf[1].owner)) {
        g_pf_deferred = s;
        *deferred     = 1;
        pthread_mutex_unlock(&g_pf_mu);
        return NULL;
    }
    prefetch_buffer * b = NULL;
    for (int i = 0; i < 2; i++) {
        if (!g_pf[i].owner && (!b || (b->cap < need && g_pf[i].cap > b->cap))) {
            b = &g_pf[i];
        }
    }
    if (b) {
        read_buffer_fit(&b->data, &b->cap, need);
        atomic_store(&g_pf_cap_bytes[b - g_pf], b->cap);
    }
    if (b && b->data) {
        b->owner = s;
    } else {
        b = NULL;
    }
    pthread_mutex_unlock(&g_pf_mu);
    return b;
}

/* ---------------------------------------------------------------- life cycle */

static int layer_of(const char * name) {
    int layer = -1, n = 0;
    return sscanf(name, "blk.%d.%n", &layer, &n) == 1 && n > 0 ? layer : -1;
}

int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
                          zipmoe_store ** out) {
    if (!name || !out) {
        return ZIPMOE_ERR_ARG;
    }
    *out = NULL;
    zipmoe_store * s = calloc(1, sizeof *s);
    if (!s) {
        return ZIPMOE_ERR_NOMEM;
    }
    snprintf(s->name, sizeof s->name, "%s", name);
    s->layer = layer_of(name);
    s->fd    = -1;
    s->dfd   = -1;
    s->dst   = MAP_FAILED;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->err_mu, NULL);
    int64_t rc = zipmoe_tensor_open(index, index_size, data_size, &s->tensor);
    if (rc < 0) {
        zipmoe_store_free(s);
        return rc;
    }
    zipmoe_tensor_get_info(s->tensor, &s->info);
    s->hot_size    = (uint64_t) s->info.n_per_expert * 2;
    s->hot_slots   = -1; /* until share_hot_slots, once it is in the list */
    s->warm_share  = UINT64_MAX;
    s->sm_size     = (uint64_t) s->info.n_per_expert;
    s->mean_region = s->info.n_expert ? (s->info.data_size + (uint64_t) s->info.n_expert - 1) / (uint64_t) s->info.n_expert : 0;
    s->plan      = calloc((size_t) s->info.n_expert, sizeof *s->plan);
    s->job.items = calloc((size_t) s->info.n_expert, sizeof *s->job.items);
    s->hinted    = calloc((size_t) s->info.n_expert, sizeof *s->hinted);
    s->pf_at     = malloc((size_t) s->info.n_expert * sizeof *s->pf_at);
    s->pf_from   = calloc((size_t) s->info.n_expert, sizeof *s->pf_from);
    s->predicted = calloc((size_t) s->info.n_expert, sizeof *s->predicted);
    s->experts   = calloc((size_t) s->info.n_expert, sizeof *s->experts);
    s->places    = calloc((size_t) s->info.n_expert, sizeof *s->places);
    s->route_words = (s->info.n_expert + 63) / 64;
    s->route_log   = calloc((size_t) (ROUTE_RING * s->route_words), sizeof *s->route_log);
    pthread_mutex_init(&s->job.mu, NULL);
    pthread_cond_init(&s->job.cv, NULL);
    pthread_mutex_init(&s->collapse_job.mu, NULL);
    pthread_cond_init(&s->collapse_job.cv, NULL);
    s->collapse_job.collapse = s;
    if (!s->plan || !s->experts || !s->places || !s->job.items || !s->hinted || !s->route_log || !s->pf_at || !s->pf_from ||
        !s->predicted) {
        zipmoe_store_free(s);
        return ZIPMOE_ERR_NOMEM;
    }
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        s->experts[e].place = -1;
        s->places[e]        = (place_state) { .expert = -1, .slot = -1 };
        s->pf_at[e]         = -1;
    }
    atomic_fetch_add(&g_stores, 1);
    atomic_fetch_add(&g_bf16_total, (uint64_t) s->info.n_expert * s->hot_size);
    pthread_mutex_lock(&g_list_mu);
    s->next = g_list;
    g_list  = s;
    pthread_mutex_lock(&g_cfg_mu);
    share_hot_slots(); /* the shares of every store changed */
    pthread_mutex_unlock(&g_cfg_mu);
    pthread_mutex_unlock(&g_list_mu);
    *out = s;
    return ZIPMOE_OK;
}

static uint64_t region_size(const zipmoe_store * s, int64_t e) {
    zipmoe_expert_span span;
    zipmoe_tensor_expert_span(s->tensor, e, &span);
    return span.size;
}

/* The region at p, of old bytes, with size bytes, the first min(old, size) kept; NULL (p unchanged) if it
 * cannot. Shrinking unmaps the tail in place. */
static uint8_t * region_resize(uint8_t * p, uint64_t old, uint64_t size) {
    void * q = mremap(p, (size_t) old, (size_t) size, MREMAP_MAYMOVE);
    return q == MAP_FAILED ? NULL : (uint8_t *) q;
}

/* The bytes of e's copy in a compressed tier (res: RES_SM or RES_FULL). */
static uint64_t resident_size(const zipmoe_store * s, int64_t e, int res) {
    return res == RES_FULL ? region_size(s, e) : res == RES_SM ? s->sm_size : 0;
}

void zipmoe_store_free(zipmoe_store * s) {
    if (!s) {
        return;
    }
    zipmoe_reader_finish(&s->collapse_job, 0); /* not while the reader works on it */
    if (s->experts) {
        pthread_mutex_lock(&g_list_mu);
        for (zipmoe_store ** p = &g_list; *p; p = &(*p)->next) {
            if (*p == s) {
                *p = s->next;
                break;
            }
        }
        for (zipmoe_store * o = g_list; o; o = o->next) { /* nobody prefetches for it any more */
            zipmoe_store * me = s;
            atomic_compare_exchange_strong(&o->next_store, &me, NULL);
        }
        zipmoe_store * me = s;
        atomic_compare_exchange_strong(&g_last_planned, &me, NULL);
        pthread_mutex_unlock(&g_list_mu);
        pthread_mutex_lock(&g_pf_mu);
        if (g_pf_deferred == s) {
            g_pf_deferred = NULL;
        }
        const int ahead_for_me = g_ahead_job.prefetch == s; /* (set under g_pf_mu) */
        pthread_mutex_unlock(&g_pf_mu);
        if (ahead_for_me) {
            zipmoe_reader_finish(&g_ahead_job, 1);
        }
        zipmoe_reader_wait_read_ahead(); /* one that began before nobody could start it any more */
        atomic_fetch_sub(&g_stores, 1);
        atomic_fetch_sub(&g_bf16_total, (uint64_t) s->info.n_expert * s->hot_size);
        pthread_mutex_lock(&g_list_mu);
        pthread_mutex_lock(&g_cfg_mu);
        share_hot_slots(); /* the others' shares grew */
        pthread_mutex_unlock(&g_cfg_mu);
        pthread_mutex_unlock(&g_list_mu);
        atomic_fetch_sub(&g_hot_bytes, s->hot_used);
        atomic_fetch_sub(&g_warm_bytes, s->warm_used);
        atomic_fetch_sub(&g_sm_bytes, s->sm_used);
        for (int64_t e = 0; e < s->info.n_expert; e++) {
            region_free(s->experts[e].region, resident_size(s, e, s->experts[e].res));
            if (s->places && s->places[e].slot >= 0) { /* the slot, and its pages, to the next store */
                zipmoe_slots_detach(place_addr(s, e), (size_t) s->hot_size, s->places[e].slot);
            }
        }
    }
    if (s->pf_at) {
        prefetch_drop(s);
    }
    if (s->fd >= 0) {
        close(s->fd);
    }
    if (s->dfd >= 0) {
        close(s->dfd);
    }
    if (s->dst != MAP_FAILED) {
        munmap(s->dst, s->dst_size);
    }
    zipmoe_tensor_free(s->tensor);
    free(s->plan);
    free(s->job.items);
    free((void *) s->hinted);
    free(s->pf_at);
    free(s->pf_from);
    free((void *) s->predicted);
    free(s->experts);
    free(s->places);
    free(s->route_log);
    free(s->hp_done);
    pthread_mutex_destroy(&s->job.mu);
    pthread_cond_destroy(&s->job.cv);
    pthread_mutex_destroy(&s->collapse_job.mu);
    pthread_cond_destroy(&s->collapse_job.cv);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->err_mu);
    free(s);
}

const zipmoe_tensor * zipmoe_store_tensor(const zipmoe_store * s) { return s->tensor; }

int64_t zipmoe_store_bind(zipmoe_store * s, int fd, uint64_t data_offset, void ** dst, size_t * dst_size) {
    if (!s || fd < 0 || !dst || !dst_size || s->fd >= 0) {
        return ZIPMOE_ERR_ARG;
    }
    struct stat st;
    const uint64_t size = s->info.data_size;
    if (fstat(fd, &st) != 0 || data_offset > (uint64_t) st.st_size || size > (uint64_t) st.st_size - data_offset) {
        return ZIPMOE_ERR_CORRUPT; /* the data companion does not lie inside the file */
    }
    /* our own descriptor: the engine may close its own after loading */
    s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (s->fd < 0) {
        return ZIPMOE_ERR_IO;
    }
    s->data_offset = data_offset;
    s->dfd         = atomic_load(&g_direct_io) ? open_direct(s->fd) : -1;
    /* Virtual only: a page costs memory once an expert is decoded into it. */
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    s->dst_size = zipmoe_align_up((size_t) s->info.n_expert * (size_t) s->hot_size, page);
    s->dst      = mmap(NULL, s->dst_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s->dst == MAP_FAILED) {
        close(s->fd);
        s->fd = -1;
        return ZIPMOE_ERR_NOMEM;
    }
    refresh_limits(s);
    if (s->hot_limit >= (uint64_t) s->info.n_expert * s->hot_size) {
        /* every expert will stay decoded, so every byte will be read: the kernel may as well read it all now, at
         * the disk's sequential speed and while the model loads and computes; the reader then copies from the page
         * cache (and drops it). Not under a smaller budget, where the page cache would hold what the tiers do not. */
        posix_fadvise(s->fd, (off_t) data_offset, (off_t) size, POSIX_FADV_WILLNEED);
    }
    /* the 2 MiB pages wholly inside the reservation, which zipmoe_store_collapse may make huge */
    s->hp_base = zipmoe_align_up((uintptr_t) s->dst, HUGE_PAGE);
    s->n_hp    = (uintptr_t) s->dst + s->dst_size > s->hp_base ? ((uintptr_t) s->dst + s->dst_size - s->hp_base) / HUGE_PAGE : 0;
    s->hp_done = calloc(s->n_hp + 1, 1);
    if (!s->hp_done) {
        munmap(s->dst, s->dst_size);
        s->dst = MAP_FAILED;
        close(s->fd);
        s->fd = -1;
        return ZIPMOE_ERR_NOMEM;
    }
    *dst      = s->dst;
    *dst_size = s->dst_size;
    return ZIPMOE_OK;
}

/* By the prefill's threads once they filled a store whose hot tier holds every expert (after MADV_HUGEPAGE, so
 * usually nothing is left to do), or by the reader thread once the store's resident set has settled
 * (COLLAPSE_AFTER invocations in a row found every routed expert decoded): each 2 MiB page that holds only
 * decoded experts becomes one huge page. The matmuls read whole experts, and huge pages spare them TLB misses
 * (generation went from 0.90x to 0.98x of BF16 with them). Not at the first touch during generation: a huge page
 * fault compacts memory and made cold starts 2.5x slower; nor for a page shared with an expert that is not
 * decoded, whose bytes the budget does not count. */
static void forget_huge_pages(zipmoe_store * s, int64_t p);

/* The small pages that lie wholly in place p: [*lo, *hi) (empty where *hi <= *lo). */
static void own_pages(const zipmoe_store * s, int64_t p, uintptr_t * lo, uintptr_t * hi) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) place_addr(s, p);
    *lo                   = zipmoe_align_up(begin, page);
    *hi                   = (begin + s->hot_size) & ~(uintptr_t) (page - 1);
}

int zipmoe_store_collapse(zipmoe_store * s) {
    const uintptr_t dst0 = (uintptr_t) s->dst;
    for (size_t i = 0; i < s->n_hp; i++) {
        if (zipmoe_reader_reads_waiting()) {
            return 0; /* a token waits on reads: they go first, the rest of this later */
        }
        /* the lock only to choose: collapsing takes milliseconds a page, and the store's invocations must not
         * wait for it (an expert evicted meanwhile: see below) */
        pthread_mutex_lock(&s->mu);
        const uintptr_t lo = s->hp_base + i * HUGE_PAGE;
        const int64_t   p0 = (int64_t) ((lo - dst0) / s->hot_size);
        const int64_t   p1 = (int64_t) ((lo + HUGE_PAGE - 1 - dst0) / s->hot_size);
        int             hot = !s->hp_done[i] && p1 < s->info.n_expert;
        for (int64_t p = p0; hot && p <= p1; p++) {
            hot = place_hot(s, p);
        }
        if (hot) {
            s->hp_done[i] = 1;
        }
        pthread_mutex_unlock(&s->mu);
        if (!hot) {
            continue;
        }
        madvise((void *) lo, HUGE_PAGE, MADV_COLLAPSE); /* a failure (no THP here) leaves small pages */
        /* MADV_COLLAPSE fills a hole with zeroed pages (6.18: 3/4 of each 2 MiB page unmapped came back whole), so
         * a place vacated since the choice would hold memory the budget no longer counts: its pages go again, the
         * huge page split first. The page may be huge now whatever an eviction meanwhile found (and cleared
         * hp_done for), so it counts as huge. A place taken by a miss meanwhile is the miss's; so are the small
         * pages a free place shares with its neighbours, which a decode in flight may be writing (vacate_place
         * would take them where the neighbour is not hot yet). */
        pthread_mutex_lock(&s->mu);
        s->hp_done[i] = 1;
        for (int64_t p = p0; p <= p1; p++) {
            if (s->places[p].expert < 0 && s->places[p].slot < 0) {
                uintptr_t from, to;
                own_pages(s, p, &from, &to);
                forget_huge_pages(s, p);
                if (to > from) {
                    madvise((void *) from, to - from, MADV_DONTNEED);
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    atomic_store(&s->collapse_queued, 0);
    return 1;
}

/* ---------------------------------------------------------------- tiers and eviction */

enum { TIER_HOT, TIER_WARM, TIER_SM };

static int in_tier(const expert_state * x, int tier) {
    switch (tier) {
        case TIER_HOT:  return x->hot;
        case TIER_WARM: return x->res == RES_FULL;
        default:        return x->res == RES_SM;
    }
}

/* What an expert is worth keeping under the policy; higher stays. */
static uint64_t score(const expert_state * x, zipmoe_policy policy, int tier) {
    switch (policy) {
        case ZIPMOE_POLICY_LRU:       return x->last_use;
        case ZIPMOE_POLICY_FIFO:      return tier == TIER_HOT ? x->admitted : x->admitted_res;
        case ZIPMOE_POLICY_LFU:
        case ZIPMOE_POLICY_TOKEN_LFU: return x->uses;
    }
    return 0;
}

/* What an expert about to enter a compressed tier offers in the contest with its residents: FIFO lets
 * the newest in, the others compare scores. */
static uint64_t entry_worth(const expert_state * x, zipmoe_policy policy) {
    return policy == ZIPMOE_POLICY_FIFO ? UINT64_MAX : score(x, policy, TIER_WARM);
}

/* Whether an entrant (worth, id e) loses its contest with a resident (v_worth, id v): scores, then ids, as
 * victim() orders experts (the lowest id of the lowest score goes first). One total order for every contest keeps
 * the tiers one stack, as the planner models them (tests/test_store.py). */
static int loses(uint64_t worth, int64_t e, uint64_t v_worth, int64_t v) {
    return v_worth > worth || (v_worth == worth && v > e);
}

#define ANY_COPY INT64_MAX /* entrant id of a copy of a hot expert: it takes another copy's room on a tie */

/* Under s->mu: the unpinned expert of the tier to give up first, or -1. In the compressed tiers that is
 * a copy of a hot expert (worth nothing while it is hot), else the lowest score. *worth: its score (0
 * for such a copy). */
static int64_t victim(const zipmoe_store * s, int tier, uint64_t * worth) {
    int64_t  best       = -1;
    uint64_t best_score = UINT64_MAX;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        const expert_state * x = &s->experts[e];
        /* a routed expert is pinned: decoded, the op's matmul reads it; in a compressed tier, while a plan
         * decodes from it (publish and trims come after), or its caller streams it (until the next plan) */
        if ((x->routed && (tier == TIER_HOT || s->planning || x->streamed)) || !in_tier(x, tier)) {
            continue;
        }
        const uint64_t sc = tier != TIER_HOT && x->hot ? 0 : score(x, s->policy, tier);
        if (best < 0 || sc < best_score) {
            best       = e;
            best_score = sc;
        }
    }
    if (worth) {
        *worth = best_score;
    }
    return best;
}

static void drop_region(zipmoe_store * s, int64_t e) {
    expert_state * x = &s->experts[e];
    if (x->res == RES_FULL) {
        const uint64_t size = region_size(s, e);
        s->warm_used -= size;
        account(&g_warm_bytes, -(int64_t) size);
    } else if (x->res == RES_SM) {
        s->sm_used -= s->sm_size;
        account(&g_sm_bytes, -(int64_t) s->sm_size);
    }
    region_free(x->region, resident_size(s, e, x->res));
    x->region = NULL;
    x->res    = RES_NONE;
}

static int make_room(zipmoe_store * s, int tier, uint64_t need, uint64_t worth, int64_t entrant);

/* Under s->mu: warm expert e gives up its codes and keeps its sign+mantissa plane if the sm tier takes
 * it; else all. No byte is read again. */
static void demote_warm(zipmoe_store * s, int64_t e) {
    expert_state * x     = &s->experts[e];
    const uint64_t worth  = entry_worth(x, s->policy);
    uint8_t *      region = x->region;
    x->region = NULL; /* out of every tier while make_room looks for victims */
    x->res    = RES_NONE;
    const uint64_t size = region_size(s, e);
    s->warm_used -= size;
    account(&g_warm_bytes, -(int64_t) size);
    uint8_t * sm = NULL;
    if (!x->hot && make_room(s, TIER_SM, s->sm_size, worth, e) &&
        (sm = region_resize(region, size, s->sm_size)) != NULL) { /* the plane comes first in a region */
        x->region = sm;
        x->res    = RES_SM;
        x->admitted_res = atomic_load(&g_tick);
        s->sm_used += s->sm_size;
        account(&g_sm_bytes, (int64_t) s->sm_size);
        return;
    }
    region_free(region, size);
}

/* Under s->mu: makes need bytes free in a compressed tier for expert `entrant` by giving up experts that
 * rank below it (worth, then id: loses(); warm ones are demoted to sm). Whether the bytes fit now. */
static int make_room(zipmoe_store * s, int tier, uint64_t need, uint64_t worth, int64_t entrant) {
    const uint64_t limit = tier == TIER_WARM ? s->warm_limit : s->sm_limit;
    uint64_t *     used  = tier == TIER_WARM ? &s->warm_used : &s->sm_used;
    if (need > limit) {
        return 0;
    }
    while (*used + need > limit) {
        uint64_t      v_worth;
        const int64_t v = victim(s, tier, &v_worth);
        if (v < 0 || loses(worth, entrant, v_worth, v)) {
            return 0;
        }
        if (tier == TIER_WARM) {
            demote_warm(s, v);
        } else {
            drop_region(s, v);
        }
    }
    return 1;
}

/* Under s->mu, before place p's pages are given back or replaced (a slot's mmap): its 2 MiB pages known to be huge
 * are split first. A huge page partly unmapped stays whole, charged to the process's cgroup though no longer
 * resident, until the kernel's deferred split runs under memory pressure: after a budget shrank a store that held
 * every expert in huge pages, test_lowered_cgroup_limit_while_generating found ~22 MiB more in its cgroup than the
 * process's pages (a probe: 64 MiB of huge pages with 3/4 of each unmapped stayed charged whole, by MADV_DONTNEED
 * as by a slot's MAP_FIXED). MADV_COLD on part of a huge page splits it (Linux 5.4 on; elsewhere it does nothing);
 * on the place's own pages, so that hot neighbours keep their standing with the kernel. */
static void forget_huge_pages(zipmoe_store * s, int64_t p) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) place_addr(s, p), end = begin + s->hot_size;
    for (uintptr_t hp = begin & ~(HUGE_PAGE - 1); hp < end; hp += HUGE_PAGE) {
        if (hp < s->hp_base || (hp - s->hp_base) / HUGE_PAGE >= s->n_hp || !s->hp_done[(hp - s->hp_base) / HUGE_PAGE]) {
            continue;
        }
        s->hp_done[(hp - s->hp_base) / HUGE_PAGE] = 0;
        const uintptr_t lo = zipmoe_align_up(begin > hp ? begin : hp, page);
        const uintptr_t hi = (end < hp + HUGE_PAGE ? end : hp + HUGE_PAGE) & ~(uintptr_t) (page - 1);
        if (hi > lo && hi - lo < HUGE_PAGE) { /* (all of it: unmapped whole, it is freed whole) */
            madvise((void *) lo, hi - lo, MADV_COLD);
        }
    }
}

/* Under s->mu: place p's pages go back (its slot to the pool, or its anonymous pages to the system: pages it
 * shares with a hot neighbour stay), and the place is free. */
static void vacate_place(zipmoe_store * s, int64_t p) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const size_t    bytes = (size_t) s->hot_size;
    place_state *   at    = &s->places[p];
    const uintptr_t begin = (uintptr_t) place_addr(s, p);
    forget_huge_pages(s, p); /* (splits them while they are mapped) */
    uintptr_t lo, hi;
    own_pages(s, p, &lo, &hi);
    if (p > 0 && !place_hot(s, p - 1) && (begin & (page - 1)) && begin - (begin & (page - 1)) >= (uintptr_t) s->dst) {
        lo = begin & ~(uintptr_t) (page - 1); /* the shared first page holds nothing hot */
    }
    if (at->slot >= 0 && zipmoe_slots_detach((void *) begin, bytes, at->slot)) {
        at->slot = -1; /* its pages serve the next expert decoded */
    } else if (hi > lo) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
    at->expert = -1;
}

/* Under s->mu: expert e leaves the hot tier and its place, which gives its pages back (vacate_place), or, with
 * keep_pages, keeps them for an expert about to be decoded there (the caller hands the place on). */
static void release_hot(zipmoe_store * s, int64_t e, int keep_pages) {
    expert_state * x = &s->experts[e];
    if (keep_pages) {
        forget_huge_pages(s, x->place);
        s->places[x->place].expert = -1;
    } else {
        vacate_place(s, x->place);
    }
    x->place = -1;
    x->hot   = 0;
    s->hot_used -= s->hot_size;
    account(&g_hot_bytes, -(int64_t) s->hot_size);
    atomic_fetch_add(&g_evictions, 1);
}

/* Under s->mu: hot expert e leaves the hot tier. Without a compressed copy it keeps its sign+mantissa
 * plane, taken from the decoded values, if the sm tier takes it: no disk read for that half later.
 * keep_pages: as release_hot. Returns the place it left. */
static int64_t evict_hot(zipmoe_store * s, int64_t e, int keep_pages) {
    expert_state * x = &s->experts[e];
    x->hot = 0; /* not a hot copy any more: its score counts in the contests below */
    /* one the last invocation routed (more than the hot slots: a trim) enters the sm tier as it entered the hot
     * one, whatever its score: the top of the stack is what the last token routed */
    const uint64_t worth = x->last_use == s->plan_tick ? UINT64_MAX : entry_worth(x, s->policy);
    if (x->res == RES_NONE && s->sm_limit > 0 && make_room(s, TIER_SM, s->sm_size, worth, e)) {
        uint8_t * sm = region_alloc(s->sm_size);
        if (sm) {
            zipmoe_split_sm_bf16(place_addr(s, x->place), (size_t) s->info.n_per_expert, sm);
            x->region = sm;
            x->res    = RES_SM;
            x->admitted_res = atomic_load(&g_tick);
            s->sm_used += s->sm_size;
            account(&g_sm_bytes, (int64_t) s->sm_size);
        }
    }
    x->hot = 1;
    const int64_t p = x->place;
    release_hot(s, e, keep_pages);
    return p;
}

/* Under s->mu: every tier down to its limit, never touching a pinned expert. */
static void settle(zipmoe_store * s) {
    int64_t v;
    while (s->hot_used > s->hot_limit && (v = victim(s, TIER_HOT, NULL)) >= 0) {
        evict_hot(s, v, 0);
    }
    while (s->warm_used > s->warm_limit && (v = victim(s, TIER_WARM, NULL)) >= 0) {
        demote_warm(s, v);
    }
    while (s->sm_used > s->sm_limit && (v = victim(s, TIER_SM, NULL)) >= 0) {
        drop_region(s, v);
    }
    /* (the compressed tiers too: experts a caller streams stay pinned beyond them until the next plan) */
    atomic_store(&s->fast_ok, s->hot_used <= s->hot_limit && s->warm_used <= s->warm_limit &&
                                  s->cfg_gen == atomic_load(&g_cfg_gen));
}

static _Atomic int g_store_turns = 1; /* zipmoe_cache_set_store_turns */

void zipmoe_cache_set_store_turns(int enabled) { atomic_store(&g_store_turns, enabled != 0); }

/* Under s->mu: the other stores give up what their last invocation pinned beyond their limits. Their matmuls
 * ran before this op (one graph computes at a time, and each op's matmul runs before the next expert tensor's
 * op: the graph orders a matmul right after the op that feeds it, checked in zipmoe-llama.cpp), so the decoded
 * working set beyond the limits stays one store's: a prompt's gate, up and down tensors take turns with the
 * same allowance. Without store turns (after a graph that broke that order), only the stores of other layers,
 * whose matmuls ran before this layer's. A store busy with a plan (or a read-ahead into it) is left alone. */
static void trim_others(const zipmoe_store * s) {
    /* s->mu is held: the list's lock only if free, as zipmoe_cache_activations takes it before a store's (the
     * next plan trims instead) */
    const int turns = atomic_load(&g_store_turns);
    if ((!turns && s->layer < 0) || pthread_mutex_trylock(&g_list_mu) != 0) {
        return;
    }
    for (zipmoe_store * o = g_list; o; o = o->next) {
        /* (a store on the fast path is within its limits, unless they changed since it settled) */
        const int settled = atomic_load(&o->fast_ok) && atomic_load(&o->cfg_gen) == atomic_load(&g_cfg_gen);
        if (o == s || (!turns && (o->layer < 0 || o->layer == s->layer)) || settled ||
            pthread_mutex_trylock(&o->mu) != 0) {
            continue;
        }
        if (o->plan_key == NULL) {
            for (int64_t e = 0; e < o->info.n_expert; e++) {
                o->experts[e].routed   = 0;
                o->experts[e].streamed = 0;
            }
            if (o->cfg_gen != atomic_load(&g_cfg_gen)) {
                refresh_limits(o);
            }
            settle(o);
        }
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&g_list_mu);
}

/* Generation's hot budget needs no room for the tensor in flight (nor a prompt's reads): a miss takes the place of
 * the expert it evicts (place_plan), and one exists in its own store while the store is routed no more experts
 * than it keeps decoded. So generation's stores keep more decoded: the shares of zipmoe_cache_set_token_hot's
 * budget, or a planner's rules plus the extra slots of zipmoe_cache_set_token_room's. Not with an sm tier
 * (place_plan does not evict first there). Back to the smaller budget, every store gives up what it holds beyond
 * its limits now, before any store of the graph decodes beyond its own. */
void zipmoe_cache_begin_graph(int64_t routed) {
    atomic_fetch_add(&g_op_seq, 1); /* a graph's first invocation of a store is never a late sibling of its last one */
    pthread_mutex_lock(&g_list_mu);
    uint64_t largest = 0;
    for (const zipmoe_store * o = g_list; o; o = o->next) {
        largest = o->hot_size > largest ? o->hot_size : largest;
    }
    pthread_mutex_lock(&g_cfg_mu);
    /* (g_token_slots >= 0: generation's hot budget is larger than a batch's, and shared out) */
    const int      hot_tokens  = g_token_slots >= 0 && routed <= g_token_slots;
    const uint64_t need        = routed > 0 ? slots_bytes(routed, largest) : UINT64_MAX;
    const int      warm_tokens = !hot_tokens && warm_tokens_possible() && need < g_reserve;
    const int      tokens      = hot_tokens || warm_tokens;
    const int      was_tokens  = g_token_mode;
    const uint64_t warm_before = warm_budget_now();
    if (tokens != g_token_mode || warm_tokens != g_token_warm || (warm_tokens && need != g_token_need)) {
        g_token_mode = tokens;
        g_token_warm = warm_tokens;
        g_token_need = warm_tokens ? need : 0;
        g_hot_budget = tokens ? g_hot_tokens : g_hot_batch;
        share_hot_slots();
        keep_reserve();
    }
    const int shrink = (was_tokens && !tokens) || warm_budget_now() < warm_before;
    pthread_mutex_unlock(&g_cfg_mu);
    for (zipmoe_store * o = shrink ? g_list : NULL; o; o = o->next) {
        /* (a read-ahead into o holds its lock while it reads: it takes no other store's lock but by trying, and a
         * guessed one stops for a waiter) */
        atomic_fetch_add(&o->waiting, 1);
        pthread_mutex_lock(&o->mu);
        atomic_fetch_sub(&o->waiting, 1);
        if (o->plan_key == NULL && !o->prefilling) { /* no graph computes: what the last one pinned is read */
            for (int64_t e = 0; e < o->info.n_expert; e++) {
                o->experts[e].routed   = 0;
                o->experts[e].streamed = 0;
            }
            refresh_limits(o);
            settle(o);
        }
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&g_list_mu);
}

/* ---------------------------------------------------------------- materialise */

/* Reads size bytes at offset of the data companion (publish() drops them from the page cache). */
static int read_cold(const zipmoe_store * s, uint64_t offset, void * buf, size_t size) {
    return zipmoe_pread_all(s->fd, s->data_offset + offset, buf, size);
}

static void advise(const zipmoe_store * s, uint64_t offset, uint64_t size, int advice) {
    posix_fadvise(s->fd, (off_t) (s->data_offset + offset), (off_t) size, advice);
}

/* Under s->mu: how routed expert e, not hot, is decoded: from what is in RAM, reading the rest, and
 * which compressed tier keeps its bytes afterwards (admitted now, so reads land in place). */
static void plan_expert(zipmoe_store * s, int64_t e, uint64_t tick, plan_item * it) {
    expert_state *     x = &s->experts[e];
    zipmoe_expert_span span;
    zipmoe_tensor_expert_span(s->tensor, e, &span);
    /* with a hot tier the expert is about to be decoded and kept: what a compressed tier takes of it now is a
     * copy, worth nothing while it is hot. It takes free room or another copy's, never an expert that only a
     * compressed tier holds; the expert enters those tiers for good when it leaves the hot one (evict_hot),
     * so that hot, sm and cold stay one stack, as the planner models them. Without a hot tier the first
     * compressed tier is the top of the stack, and a routed expert always enters it, as one always enters
     * the hot tier: the policy chooses whom it evicts. */
    const uint64_t worth   = s->hot_limit > 0 ? 0 : UINT64_MAX;
    const int64_t  entrant = s->hot_limit > 0 ? ANY_COPY : e;
    memset(it, 0, sizeof *it);
    it->expert = e;
    if (x->res == RES_FULL) {
        atomic_fetch_add(s->prefilling ? &g_prefill_dummy : &g_hits_warm, 1);
    } else if (x->res == RES_SM) {
        atomic_fetch_add(s->prefilling ? &g_prefill_dummy : &g_hits_sm, 1);
        it->read_codes = 1;
        /* promote: the codes are read anyway; keep them if the warm tier takes the expert */
        uint8_t * region = x->region;
        x->region = NULL; /* out of the sm tier while the warm tier makes room */
        x->res    = RES_NONE;
        s->sm_used -= s->sm_size;
        account(&g_sm_bytes, -(int64_t) s->sm_size);
        uint8_t * full = make_room(s, TIER_WARM, span.size, worth, entrant) ? region_resize(region, s->sm_size, span.size)
                                                                           : NULL;
        if (full) {
            x->region = full;
            x->res    = RES_FULL;
            x->admitted_res = tick;
            s->warm_used += span.size;
            account(&g_warm_bytes, (int64_t) span.size);
        } else {
            x->region = region;
            x->res    = RES_SM;
            s->sm_used += s->sm_size;
            account(&g_sm_bytes, (int64_t) s->sm_size);
        }
    } else {
        atomic_fetch_add(s->prefilling ? &g_prefill_dummy : &g_misses, 1);
        it->read_sm    = 1;
        it->read_codes = 1;
        uint8_t * region = NULL;
        if (make_room(s, TIER_WARM, span.size, worth, entrant) && (region = region_alloc(span.size)) != NULL) {
            x->res = RES_FULL;
            s->warm_used += span.size;
            account(&g_warm_bytes, (int64_t) span.size);
        } else if (make_room(s, TIER_SM, s->sm_size, worth, entrant) && (region = region_alloc(s->sm_size)) != NULL) {
            x->res = RES_SM;
            s->sm_used += s->sm_size;
            account(&g_sm_bytes, (int64_t) s->sm_size);
        }
        x->region       = region;
        x->admitted_res = tick;
    }
    it->sm    = x->region;
    it->codes = x->res == RES_FULL ? x->region : NULL;
}

/* Remembers which experts an invocation routed to, by one thread of it: one entry a generated token; a prompt's
 * batch is one entry too, the union of its rows, since they are all used at once (one tick). The entry is
 * written before it is counted, so a reader can tell the ones it may have torn. */
static void log_route(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const uint64_t n     = atomic_load_explicit(&s->route_n, memory_order_relaxed);
    uint64_t *     entry = s->route_log + (n % ROUTE_RING) * (uint64_t) s->route_words;
    memset(entry, 0, (size_t) s->route_words * sizeof *entry);
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e >= 0 && e < s->info.n_expert) {
                entry[e / 64] |= (uint64_t) 1 << (e % 64);
            }
        }
    }
    atomic_store_explicit(&s->route_n, n + 1, memory_order_release);
}

/* Under s->mu: a free place for expert e, its own index if free. One exists while e is not decoded. */
static int64_t unused_place(const zipmoe_store * s, int64_t e) {
    const int64_t n = s->info.n_expert;
    for (int64_t i = 0; i < n; i++) {
        const int64_t p = (e + i) % n;
        if (s->places[p].expert < 0) {
            return p;
        }
    }
    return -1;
}

/* Under s->mu, at the end of make_plan: a place for each planned expert that has none. Where the entrants take
 * the hot tier over its limit, the experts that publish() would evict for them (settle: the unpinned ones of
 * the lowest score) are evicted now, and each entrant takes a victim's place with its pages mapped: a miss in
 * generation then maps and unmaps nothing (a slot's mmap with MAP_POPULATE and the victim's unmap cost about as
 * much kernel time as the decode). Only without an sm tier: there the victim's sign+mantissa plane contests
 * for room with the compressed copies of the entrants, which are pinned during the plan and not after it, and
 * evicting now would change who wins. */
static void place_plan(zipmoe_store * s) {
    const int reuse    = s->use_slots && s->hot_limit > 0 && s->sm_limit == 0;
    uint64_t  entering = 0;
    s->plan_decoding   = 0; /* counted before the victims leave the hot tier: the stats never miss those pages */
    for (int64_t j = 0; j < s->plan_n; j++) {
        s->plan_decoding += s->experts[s->plan[j].expert].hot ? 0 : s->hot_size;
    }
    atomic_fetch_add(&g_decoding_bytes, s->plan_decoding);
    for (int64_t j = 0; j < s->plan_n; j++) {
        const int64_t  e = s->plan[j].expert;
        expert_state * x = &s->experts[e];
        if (x->place >= 0) {
            continue; /* decoded and decoded again in place (no hot tier) */
        }
        int64_t p = -1;
        if (reuse && s->hot_used + entering + s->hot_size > s->hot_limit) {
            const int64_t v = victim(s, TIER_HOT, NULL);
            if (v >= 0) {
                p = evict_hot(s, v, 1);
            }
        }
        if (p < 0) {
            p = unused_place(s, e);
        }
        x->place            = p;
        s->places[p].expert = e;
        entering += s->hot_size;
    }
}

/* Under s->mu, in make_plan after the uses are counted: which routed warm experts a streaming caller decodes
 * itself (ZIPMOE_TURN_STREAM). One that the hot tier takes is decoded into a place, as without streaming: while the
 * tier has free room, and the first that outranks the expert it would evict (the policy's contest; one a plan,
 * since the victims after the first are not known before place_plan). The others stay warm and pinned. Never a hot
 * one, not even without a hot tier (decoded again there): a sibling thread that took the fast path before a
 * configuration change computes it from its place, in blocks that must be the planning thread's blocks too. */
static void mark_streamed(zipmoe_store * s, int decode_all) {
    uint64_t entering = 0; /* hot bytes of the warm experts promoted so far */
    int      contest  = 1;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        expert_state * x = &s->experts[e];
        x->streamed      = 0;
        if (!s->plan_stream || s->prefilling || !x->routed || x->res != RES_FULL || x->hot) {
            continue;
        }
        if (!decode_all && s->hot_used + entering + s->hot_size <= s->hot_limit) {
            entering += s->hot_size;
            continue;
        }
        if (!decode_all && contest) {
            uint64_t      v_worth;
            const int64_t v = victim(s, TIER_HOT, &v_worth);
            if (v >= 0 && !loses(entry_worth(x, s->policy), e, v_worth, v)) {
                contest = 0;
                continue;
            }
        }
        x->streamed = 1;
        atomic_fetch_add(&g_hits_warm, 1);
        atomic_fetch_add(&g_streamed, 1);
    }
}

/* Under s->mu: the plan of a new invocation. Returns an out-of-range expert id, or -1. */
static int64_t make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const int64_t n_expert = s->info.n_expert;
    int64_t       bad      = -1;
    for (int64_t e = 0; e < n_expert; e++) {
        s->experts[e].routed = 0;
    }
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= n_expert) {
                bad = e;
                continue;
            }
            s->experts[e].routed++;
        }
    }
    if (!s->prefilling) {
        log_route(s, ids, ne0, ne1, nb0, nb1);
    }
    if (s->cfg_gen != atomic_load(&g_cfg_gen)) {
        refresh_limits(s);
    }
    atomic_store(&s->streak, 0);
    atomic_store(&s->predicted_fresh, 0);
    trim_others(s);
    /* the graph's order, for the next prompt's read-ahead; not the prefill's (layer by layer in the file's order),
     * which made a model's first prompt read ahead for stores that came later: 1.8 GB read for 1.1 GB decoded */
    zipmoe_store * prev = s->prefilling ? NULL : atomic_exchange(&g_last_planned, s);
    if (prev && prev != s) {
        atomic_store(&prev->next_store, s);
    }
    for (int64_t e = 0; e < n_expert; e++) { /* read ahead for nothing: the page cache must not keep it */
        if (atomic_exchange(&s->hinted[e], 0) && !s->experts[e].routed) {
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(s->tensor, e, &span);
            advise(s, span.offset, span.size, POSIX_FADV_DONTNEED);
        }
    }
    const int      decode_all = s->hot_limit == 0; /* no hot tier: decode on every use */
    const uint64_t tick       = atomic_fetch_add(&g_tick, 1);
    s->plan_tick              = tick;
    for (int64_t e = 0; e < n_expert; e++) {
        expert_state * x = &s->experts[e];
        if (x->routed) {
            x->last_use = tick;
            if (s->prefilling) {
                continue; /* the model's own routing decides what is worth keeping */
            }
            if (x->hot && !decode_all) {
                atomic_fetch_add(&g_hits_hot, 1);
            }
            x->uses += s->policy == ZIPMOE_POLICY_TOKEN_LFU ? x->routed : 1;
            x->activations += x->routed;
        }
    }
    s->plan_n   = 0;
    s->planning = 1;
    mark_streamed(s, decode_all);
    /* cache affinity: what is in RAM first, fully compressed, then sign+mantissa, then from disk; its
     * chunks keep the cores busy while the reads of the others are in flight */
    for (int pass = 0; pass < 3; pass++) {
        const int want = pass == 0 ? RES_FULL : pass == 1 ? RES_SM : RES_NONE;
        for (int64_t e = 0; e < n_expert; e++) {
            expert_state * x = &s->experts[e];
            if (x->routed && (!x->hot || decode_all) && x->res == want && !x->streamed) {
                plan_expert(s, e, tick, &s->plan[s->plan_n++]);
            }
        }
    }
    place_plan(s);
    return bad;
}

/* Under s->mu, after schedule_reads (the reads are in flight meanwhile: mapping takes ~0.2 ms an expert, which
 * a token's every store spent before its first read had started), before any thread decodes: the planned experts'
 * ranges get the pages of a slot, so decoding neither faults nor zeroes them. */
static void map_plan(zipmoe_store * s) {
    for (int64_t j = 0; j < s->plan_n; j++) {
        const expert_state * x     = &s->experts[s->plan[j].expert];
        place_state *        at    = &s->places[x->place];
        void *               range = place_addr(s, x->place);
        if (!x->hot && at->slot < 0 && s->use_slots && zipmoe_slots_usable(range, (size_t) s->hot_size)) {
            at->slot = zipmoe_slots_attach(range, (size_t) s->hot_size);
        }
    }
}

/* Under s->mu, when the plan is published or discarded: its experts are hot now, or not at all. */
static void end_decoding(zipmoe_store * s) {
    atomic_fetch_sub(&g_decoding_bytes, s->plan_decoding);
    s->plan_decoding = 0;
}

/* ---------------------------------------------------------------- reads */

/* One staging buffer for the process: compressed bytes read for a plan that no tier keeps. One graph computes
 * at a time and its ops run one after another, so one buffer serves every store; an invocation that finds it
 * taken (another graph) reads synchronously. Kept, so that neither generation nor the stores of a prompt fault
 * in fresh pages every time; a prompt's larger buffer is given back once a need fits STAGE_KEEP again. */
static pthread_mutex_t       g_stage_mu = PTHREAD_MUTEX_INITIALIZER;
static uint8_t *             g_stage;
static size_t                g_stage_cap;
static const zipmoe_store *  g_stage_owner;

static uint8_t * staging_take(const zipmoe_store * s, size_t need) {
    pthread_mutex_lock(&g_stage_mu);
    uint8_t * buf = NULL;
    if (!g_stage_owner) {
        read_buffer_fit(&g_stage, &g_stage_cap, need);
        atomic_store(&g_stage_cap_bytes, g_stage_cap);
        if (g_stage) {
            g_stage_owner = s;
            buf           = g_stage;
        }
    }
    pthread_mutex_unlock(&g_stage_mu);
    return buf;
}

/* A prompt's large buffer goes back once the stores' reads come from the read-ahead buffers: the page cache of
 * the weights that are not experts would make room for it (under a cgroup limit they were read again). */
static void staging_trim(size_t need) {
    pthread_mutex_lock(&g_stage_mu);
    if (!g_stage_owner && g_stage_cap > STAGE_KEEP && need <= STAGE_KEEP) {
        read_buffer_free(&g_stage, &g_stage_cap);
        atomic_store(&g_stage_cap_bytes, 0);
    }
    pthread_mutex_unlock(&g_stage_mu);
}

/* Gives back the idle read buffers larger than the read room lets one be (a smaller room from now on): one that
 * is in use is refitted when it is taken next (read_buffer_fit). */
static void trim_idle_read_buffers(void) {
    const size_t bound = read_buffer_refit_limit();
    pthread_mutex_lock(&g_stage_mu);
    if (!g_stage_owner && g_stage_cap > bound) {
        read_buffer_free(&g_stage, &g_stage_cap);
        atomic_store(&g_stage_cap_bytes, 0);
    }
    pthread_mutex_unlock(&g_stage_mu);
    pthread_mutex_lock(&g_pf_mu);
    for (int i = 0; i < 2; i++) {
        if (!g_pf[i].owner && g_pf[i].cap > bound) {
            read_buffer_free(&g_pf[i].data, &g_pf[i].cap);
            atomic_store(&g_pf_cap_bytes[i], 0);
        }
    }
    pthread_mutex_unlock(&g_pf_mu);
}

void zipmoe_cache_set_read_room(uint64_t bytes) {
    atomic_store(&g_read_room, bytes);
    trim_idle_read_buffers();
}

static void staging_give(const zipmoe_store * s) {
    pthread_mutex_lock(&g_stage_mu);
    if (g_stage_owner == s) {
        g_stage_owner = NULL;
    }
    pthread_mutex_unlock(&g_stage_mu);
}

/* Where in its aligned span of the file a read at offset of the data companion starts: the bytes before it that
 * an O_DIRECT read brings too. */
static size_t direct_pad(const zipmoe_store * s, uint64_t offset) {
    return (size_t) ((s->data_offset + offset) % ZIPMOE_DIRECT_ALIGN);
}

/* Bytes a read of [offset, offset + size) of the data companion takes in a buffer laid out for O_DIRECT: from
 * the aligned start before it to the aligned end after it. */
static size_t direct_span(const zipmoe_store * s, uint64_t offset, uint64_t size) {
    return zipmoe_align_up(direct_pad(s, offset) + (size_t) size, ZIPMOE_DIRECT_ALIGN);
}

/* Under s->mu: whether item it's bytes were read ahead (zipmoe_store_prefetch); then it points at them, copying
 * into the tier that keeps them what it lacks, and nothing is left to read. */
static int use_prefetched(zipmoe_store * s, plan_item * it) {
    const int64_t e = it->expert;
    if (!s->pf || s->pf_at[e] < 0 || !(it->read_sm || it->read_codes)) {
        return 0;
    }
    const expert_state * x = &s->experts[e];
    zipmoe_expert_span   span;
    zipmoe_tensor_expert_span(s->tensor, e, &span);
    const uint64_t need_from = it->read_sm ? 0 : span.exp_offset;
    const uint64_t from      = s->pf_from[e];
    if (from > need_from) {
        return 0; /* only the codes were read ahead (it was an sm expert then) */
    }
    uint8_t * bytes = s->pf->data + s->pf_at[e]; /* region offset `from` */
    if (x->res == RES_FULL) {
        memcpy(x->region + need_from, bytes + (need_from - from), (size_t) (span.size - need_from));
        it->sm    = x->region;
        it->codes = x->region;
    } else if (x->res == RES_SM) {
        if (it->read_sm) {
            memcpy(x->region, bytes, (size_t) s->sm_size); /* from == 0; the plane, not its padding to the codes */
        }
        it->sm         = x->region;
        it->codes      = bytes;
        it->codes_bias = from;
    } else { /* from == 0: the whole region */
        it->sm         = bytes;
        it->codes      = bytes;
        it->codes_bias = 0;
    }
    it->prefetched = 1;
    if (s->pf_guessed) {
        atomic_fetch_add(&g_guesses_used, 1);
    }
    return 1;
}

/* Under s->mu, after make_plan: hands the plan's reads to the reader thread, one or two large reads per expert
 * into the region that keeps them or into the staging buffer, in the plan's order (what is in RAM is decoded
 * first, meanwhile). Without the reader or the buffer, the decoding threads read chunk by chunk instead. */
/* The bytes item it takes in the staging buffer (0: none, its reads go into the warm tier's region): the codes of
 * an sm expert, else the whole region, each in its span of O_DIRECT blocks. */
static size_t staged_bytes(const zipmoe_store * s, const expert_state * x, const zipmoe_expert_span * span) {
    if (x->res == RES_FULL) {
        return 0;
    }
    return x->res == RES_SM ? direct_span(s, span->offset + span->exp_offset, span->size - span->exp_offset)
                            : direct_span(s, span->offset, span->size);
}

static void schedule_reads(zipmoe_store * s) {
    size_t  need    = 0, largest = 0;
    int64_t n_reads = 0;
    for (int64_t j = 0; j < s->plan_n; j++) {
        plan_item *          it = &s->plan[j];
        const expert_state * x  = &s->experts[it->expert];
        zipmoe_expert_span   span;
        zipmoe_tensor_expert_span(s->tensor, it->expert, &span);
        if (!(it->read_sm || it->read_codes) || use_prefetched(s, it)) {
            continue;
        }
        n_reads++;
        const size_t staged = staged_bytes(s, x, &span);
        need += staged;
        largest = staged > largest ? staged : largest;
    }
    /* beyond the budget's read room the buffer is a ring: an item's bytes follow the previous item's, or start
     * again at its beginning, once the items there are decoded (the reader waits for them) */
    const size_t cap = read_buffer_bound(need, largest);
    /* once this store's reads are done, the reader reads the next store's ahead, which then overlap this store's
     * compute instead of following it: a prompt routes to most experts of every layer; a store of the same
     * layer (gate, up, down) routes to exactly these */
    zipmoe_store * next = atomic_load(&s->next_store);
    s->job.prefetch           = NULL;
    s->job.prefetch_like      = NULL;
    s->job.prefetch_predicted = 0;
    if (s->prefilling) {
        next = NULL; /* the prefill fills each store with what its tiers keep, not what a prompt reads */
    }
    if (next && 2 * s->plan_n >= s->info.n_expert) {
        s->job.prefetch = next;
    } else if (next && s->layer >= 0 && next->layer == s->layer && next->info.n_expert == s->info.n_expert) {
        s->job.prefetch      = next;
        s->job.prefetch_like = s;
    } else if (next && atomic_load(&next->predicted_fresh)) { /* the next layer's, as its router is guessed */
        s->job.prefetch           = next;
        s->job.prefetch_predicted = 1;
    }
    staging_trim(cap);
    uint8_t * stage = n_reads && need ? staging_take(s, cap) : NULL;
    if ((n_reads == 0 && !s->job.prefetch) || (need && !stage)) {
        for (int64_t j = 0; j < s->plan_n && n_reads; j++) { /* synchronous: let the kernel read ahead */
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(s->tensor, s->plan[j].expert, &span);
            if ((s->plan[j].read_sm || s->plan[j].read_codes) && !s->plan[j].prefetched) {
                advise(s, span.offset, span.size, POSIX_FADV_WILLNEED);
            }
        }
        return;
    }
    size_t used = 0;
    s->job.ring_wraps = 0;
    for (int64_t j = 0; j < s->plan_n; j++) {
        plan_item *          it   = &s->plan[j];
        const expert_state * x    = &s->experts[it->expert];
        zipmoe_read_item *   item = &s->job.items[j];
        zipmoe_expert_span   span;
        zipmoe_tensor_expert_span(s->tensor, it->expert, &span);
        const uint64_t codes_size = span.size - span.exp_offset;
        item->n_seg   = 0;
        item->ring_lo = item->ring_hi = 0;
        atomic_store(&item->ready, 0);
        atomic_store(&item->released, 0);
        atomic_store(&item->chunks_left, s->info.n_chunks);
        if ((!it->read_sm && !it->read_codes) || it->prefetched) {
            continue;
        }
        const size_t staged = staged_bytes(s, x, &span);
        if (staged) { /* where in the ring */
            if (used + staged > cap) {
                used              = 0;
                s->job.ring_wraps = 1;
            }
            item->ring_lo = used;
            item->ring_hi = used + staged;
        }
        if (x->res == RES_FULL) { /* into the region the warm tier keeps: all of it, or the codes it lacked */
            const uint64_t from = it->read_sm ? 0 : span.exp_offset;
            item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset + from, span.size - from, x->region + from, 0 };
            it->sm    = x->region;
            it->codes = x->region;
        } else if (x->res == RES_SM) { /* the plane into the sm region if it is not there yet, the codes staged */
            if (it->read_sm) {
                item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset, s->sm_size, x->region, 0 }; /* no padding */
            }
            const size_t pad         = direct_pad(s, span.offset + span.exp_offset);
            item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset + span.exp_offset, codes_size, stage + used + pad, 1 };
            it->sm         = x->region;
            it->codes      = stage + used + pad;
            it->codes_bias = span.exp_offset;
        } else { /* kept nowhere: the whole region staged */
            const size_t pad         = direct_pad(s, span.offset);
            item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset, span.size, stage + used + pad, 1 };
            it->sm    = stage + used + pad;
            it->codes = stage + used + pad;
        }
        used += staged;
        it->staged = 1;
    }
    s->job.fd      = s->fd;
    s->job.dfd     = s->dfd;
    s->job.base    = s->data_offset;
    s->job.n_items = s->plan_n; /* (with nothing to read: only the read-ahead for the next store) */
    if (zipmoe_reader_submit(&s->job) != ZIPMOE_OK) {
        for (int64_t j = 0; j < s->plan_n; j++) { /* no reader thread: read chunk by chunk after all */
            plan_item *          it = &s->plan[j];
            const expert_state * x  = &s->experts[it->expert];
            if (it->prefetched) {
                continue;
            }
            it->staged     = 0;
            it->sm         = x->region;
            it->codes      = x->res == RES_FULL ? x->region : NULL;
            it->codes_bias = 0;
        }
        staging_give(s);
        return;
    }
    s->job_active = 1;
}

/* On the reader thread, under s->mu: gives back the buffers of stores that hold one with no invocation in flight
 * (read ahead for an invocation that found its experts decoded, say the first token's after a prompt), so that a
 * prompt's read-ahead does not wait for them forever. Their stores cannot be freed meanwhile: that waits for the
 * read-ahead in progress. */
static void prefetch_reclaim(const zipmoe_store * s) {
    for (int i = 0; i < 2; i++) {
        pthread_mutex_lock(&g_pf_mu);
        zipmoe_store * o = g_pf[i].owner;
        pthread_mutex_unlock(&g_pf_mu);
        if (o && o != s && pthread_mutex_trylock(&o->mu) == 0) {
            if (o->plan_key == NULL && o->pf == &g_pf[i]) {
                prefetch_drop(o);
            }
            pthread_mutex_unlock(&o->mu);
        }
    }
}

/* Whether s's expert e is read ahead of s's next invocation (not in RAM, and routed by like when like is given),
 * and from which offset of its region (the codes only where its sign+mantissa plane is resident). */
static int read_ahead_from(const zipmoe_store * s, const zipmoe_store * like, int predicted, int64_t e,
                           zipmoe_expert_span * span, uint64_t * from) {
    const expert_state * x = &s->experts[e];
    if (x->hot || x->res == RES_FULL || (like && !like->experts[e].routed) || (predicted && !atomic_load(&s->predicted[e]))) {
        return 0;
    }
    zipmoe_tensor_expert_span(s->tensor, e, span);
    *from = x->res == RES_SM ? span->exp_offset : 0;
    return 1;
}

/* Hints the kernel to read s's bytes ahead (the page cache keeps them until s's plan drops what it does not
 * use): where no read-ahead buffer is free. */
static void prefetch_hint(zipmoe_store * s, const zipmoe_store * like) {
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        zipmoe_expert_span span;
        uint64_t           from;
        if (!read_ahead_from(s, like, 0, e, &span, &from)) {
            continue;
        }
        advise(s, span.offset + from, span.size - from, POSIX_FADV_WILLNEED);
        atomic_store(&s->hinted[e], 1);
    }
}

void zipmoe_store_prefetch(zipmoe_store * s, const zipmoe_store * like, int predicted) {
    /* On the reader thread, once the previous store (like, for a store of the same layer) has its bytes: s's
     * lock is held while reading, so that s's invocation, when it comes, plans with what arrived. Not when an
     * invocation of s is in flight or the lock is busy: then s reads for itself. like's routed counts hold until
     * like's next invocation or a trim by another store's plan (not s's, which waits for this lock): a read-ahead
     * that runs late reads fewer experts, never more (trims only clear them). */
    if (pthread_mutex_trylock(&s->mu) != 0) {
        return;
    }
    if (s->plan_key != NULL || s->fd < 0) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    prefetch_drop(s); /* an earlier read-ahead that no invocation used (its experts were decoded by then) */
    size_t need = 0, largest = 0;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        zipmoe_expert_span span;
        uint64_t           from;
        if (read_ahead_from(s, like, predicted, e, &span, &from)) {
            const size_t span_bytes = direct_span(s, span.offset + from, span.size - from);
            need += span_bytes;
            largest = span_bytes > largest ? span_bytes : largest;
        }
    }
    need = read_buffer_bound(need, largest); /* within the read room: what does not fit, s reads for itself */
    if (need > STAGE_KEEP) {
        prefetch_reclaim(s);
    }
    int               deferred = 0;
    prefetch_buffer * b        = need ? prefetch_take(s, need, &deferred) : NULL;
    if (!b) {
        if (need && !deferred && !predicted) { /* (a guess is not worth the page cache's work) */
            prefetch_hint(s, like);
        }
        pthread_mutex_unlock(&s->mu);
        return;
    }
    s->pf         = b;
    s->pf_guessed = predicted;
    atomic_store(&s->holds_pf, 1);
    size_t used = 0;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        zipmoe_expert_span span;
        uint64_t           from;
        if (!read_ahead_from(s, like, predicted, e, &span, &from)) {
            continue;
        }
        if (predicted && atomic_load(&s->waiting)) {
            break; /* the invocation came: its router decides now, and it reads the rest itself */
        }
        const size_t pad  = direct_pad(s, span.offset + from);
        const size_t size = (size_t) (span.size - from);
        const size_t taken = direct_span(s, span.offset + from, size);
        if (used + taken > need) {
            break; /* the buffer is full */
        }
        const int    rc   = zipmoe_pread_uncached(s->fd, s->dfd, s->data_offset + span.offset + from,
                                                  b->data + used + pad, size);
        if (rc == ZIPMOE_OK) { /* else s reads it for itself, and reports what fails */
            s->pf_at[e]   = (int64_t) (used + pad);
            s->pf_from[e] = from;
            atomic_fetch_add(&g_read_ahead_bytes, size);
            if (predicted) {
                atomic_fetch_add(&g_guessed_bytes, size);
            }
        }
        used += taken;
    }
    pthread_mutex_unlock(&s->mu);
}

/* Decodes chunk c of a plan item, reading what is not in RAM. */
static int64_t decode_chunk(zipmoe_store * s, const plan_item * it, int64_t c, thread_scratch * ts) {
    zipmoe_expert_span span;
    zipmoe_chunk_ref   ref;
    zipmoe_tensor_expert_span(s->tensor, it->expert, &span);
    zipmoe_tensor_chunk(s->tensor, it->expert, c, &ref);
    uint8_t * sm   = it->sm ? it->sm + ref.first : ts->buf;
    uint8_t * code = it->codes ? it->codes + (ref.code_offset - it->codes_bias) : ts->buf + ref.n;
    if (!it->staged && !it->prefetched && ((it->read_sm && read_cold(s, span.offset + (uint64_t) ref.first, sm, (size_t) ref.n) < 0) ||
        (it->read_codes && read_cold(s, span.offset + ref.code_offset, code, (size_t) ref.code_size) < 0))) {
        return ZIPMOE_ERR_IO;
    }
    /* bytes from the file are checked; bytes already in RAM were checked when they came from it (a decode that
     * fails its check drops what it read), and checking them again cost ~20% of a decode-bound run's decoding */
    const int from_file = it->read_sm || it->read_codes;
    return zipmoe_chunk_decode(zipmoe_tensor_codec(s->tensor), ts->ws, code, (size_t) ref.code_size, sm,
                               (size_t) ref.n, from_file, ref.checksum,
                               place_addr(s, s->experts[it->expert].place) + ref.first);
}

/* Under s->mu, by the last thread of an invocation: the planned experts are hot now; the tiers go down
 * to their limits, never touching an expert this invocation routed (its matmul is still to come). */
static void publish(zipmoe_store * s) {
    const uint64_t tick = atomic_load(&g_tick);
    s->planning = 0;
    for (int64_t j = 0; j < s->plan_n; j++) {
        const plan_item * it = &s->plan[j];
        expert_state *    x  = &s->experts[it->expert];
        if (!it->staged && !it->prefetched && (it->read_sm || it->read_codes)) { /* (the reader drops its own) */
            /* the budget counts what zipmoe keeps: the kernel must not keep a second, uncounted copy */
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(s->tensor, it->expert, &span);
            advise(s, span.offset, span.size, POSIX_FADV_DONTNEED);
        }
        if (!x->hot) {
            x->hot      = 1;
            x->admitted = tick;
            s->hot_used += s->hot_size;
            account(&g_hot_bytes, (int64_t) s->hot_size);
        }
    }
    end_decoding(s); /* (after: a reading of the stats never misses them) */
    settle(s);
}

/* Under s->mu, after a failed invocation: what was planned is not hot, and what it read may be partial. */
static void discard_plan(zipmoe_store * s) {
    s->planning = 0;
    end_decoding(s);
    for (int64_t j = 0; j < s->plan_n; j++) {
        const plan_item * it = &s->plan[j];
        expert_state *    x  = &s->experts[it->expert];
        if (!x->hot && x->place >= 0) { /* what it decoded there is partial */
            vacate_place(s, x->place);
            x->place = -1;
        }
        if (it->read_sm && x->res != RES_NONE) {
            drop_region(s, it->expert);
        } else if (it->read_codes && x->res == RES_FULL) {
            demote_warm(s, it->expert); /* its sign+mantissa plane was resident and is intact */
        }
    }
}

/* Whether streamed expert e is still left to its caller by the plan that routed it (pinned warm). */
static int still_streamed(const expert_state * x) { return x->streamed && x->routed && x->res == RES_FULL; }

/* Whether every expert ids names is decoded (or, with streamed, left to the caller by the last plan): then there is
 * nothing to plan. */
static int all_routed_ready(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                            size_t nb1, int streamed) {
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= s->info.n_expert || !(s->experts[e].hot || (streamed && still_streamed(&s->experts[e])))) {
                return 0;
            }
        }
    }
    return 1;
}

/* The fast path's bookkeeping, by one thread: what make_plan records for routed experts. */
static void note_hits(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const uint64_t      tick   = atomic_fetch_add(&g_tick, 1);
    const zipmoe_policy policy = s->policy; /* a torn read only affects the next eviction's order */
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            expert_state * x = &s->experts[e];
            if (x->last_use != tick) {
                x->last_use = tick;
                x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 0 : 1;
                atomic_fetch_add(&g_hits_hot, 1);
            }
            x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 1 : 0;
            x->activations++;
        }
    }
    log_route(s, ids, ne0, ne1, nb0, nb1);
    atomic_fetch_add(&g_calls, 1);
}

int64_t zipmoe_store_predict(zipmoe_store * s, const int32_t * experts, int64_t n) {
    if (!s || (!experts && n > 0) || n < 0) {
        return ZIPMOE_ERR_ARG;
    }
    for (int64_t i = 0; i < n; i++) {
        if (experts[i] < 0 || experts[i] >= s->info.n_expert) {
            return ZIPMOE_ERR_ARG;
        }
    }
    atomic_store(&s->predicted_fresh, 0);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        atomic_store(&s->predicted[e], 0);
    }
    for (int64_t i = 0; i < n; i++) {
        atomic_store(&s->predicted[experts[i]], 1);
    }
    atomic_store(&s->predicted_fresh, n > 0);
    return ZIPMOE_OK;
}

/* By the invocation of `prev` that found its experts decoded (no job of its own to follow): the reader reads ahead
 * what the previous layer predicted for next, the store invoked after prev, if next is of another layer. */
static void read_ahead_predicted(zipmoe_store * next, const zipmoe_store * prev) {
    if (!next || next->layer == prev->layer || !atomic_load(&next->predicted_fresh)) {
        return;
    }
    pthread_mutex_lock(&g_pf_mu);
    if (!g_pf_deferred) { /* (a prompt's read-ahead waits for a buffer: it goes first) */
        submit_read_ahead(next, 1);
    }
    pthread_mutex_unlock(&g_pf_mu);
}

/* This thread's share of the rows of `where`: the place of each routed expert, given at the plan and kept until
 * the matmul after the op has read it (a routed expert is pinned). An id out of range is written as it is (ggml
 * refuses it, as stock llama.cpp would); after a failed plan the engine reports the error and drops the output,
 * whatever the places say. */
static void report_places(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                          size_t nb1, int32_t * where, int ith, int nth) {
    if (!where) {
        return;
    }
    for (int64_t r = ne1 * ith / nth; r < ne1 * (ith + 1) / nth; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            const int64_t p = e >= 0 && e < s->info.n_expert ? s->experts[e].place : -1;
            where[r * ne0 + k] = p >= 0 ? (int32_t) p : e;
        }
    }
}

/* Which routed experts an invocation decodes (pending[r * ne0 + k] = 1) and which it leaves to a streaming caller
 * (2), by a thread that holds the plan. */
static void report_pending(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                           size_t nb1, int64_t plan_n, uint8_t * pending) {
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            uint8_t in_plan = 0;
            for (int64_t j = 0; j < plan_n && !in_plan; j++) {
                in_plan = s->plan[j].expert == e;
            }
            const int streamed = e >= 0 && e < s->info.n_expert && still_streamed(&s->experts[e]);
            pending[r * ne0 + k] = in_plan ? 1 : streamed ? 2 : 0;
        }
    }
}

int64_t zipmoe_store_materialize_begin(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                       int64_t ne1, size_t nb0, size_t nb1, int32_t * where, uint8_t * pending,
                                       int flags, int ith, int nth, zipmoe_turn * turn) {
    if (!s || !key || !ids || !turn || (pending && !where) || ((flags & ZIPMOE_TURN_STREAM) && !pending) || ne0 < 0 ||
        ne1 < 0 || nth < 1 || ith < 0 || ith >= nth || s->fd < 0 || (flags & ~ZIPMOE_TURN_STREAM)) {
        return ZIPMOE_ERR_ARG;
    }
    *turn = (zipmoe_turn) { 0 };
    /* a turn that reports all places (pending given) reports them itself; materialize's threads report their share */
    const int all_places = pending != NULL;
    /* Once warm, every routed expert is usually decoded already. The resident set changes only when an
     * invocation publishes, and one graph computes at a time, so all threads of this invocation see the
     * same answer and may leave without the lock (which busy machines make costly). Not while the store
     * is over its limits or its configuration changed: then the slow path has evictions to do. */
    if (atomic_load(&s->fast_ok) && atomic_load(&g_cfg_gen) == s->cfg_gen && s->hot_limit > 0 && !s->prefilling &&
        all_routed_ready(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, 0)) {
        if (ith == 0 && !(atomic_load(&s->last_key) == key && atomic_load(&g_op_seq) == atomic_load(&s->last_seq))) {
            atomic_fetch_add(&g_op_seq, 1); /* (a late sibling of a planned invocation counts nothing again) */
            note_hits(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
            atomic_store(&s->predicted_fresh, 0);
            if (atomic_load(&s->holds_pf) && pthread_mutex_trylock(&s->mu) == 0) { /* read ahead on a wrong guess */
                if (s->plan_key == NULL) {
                    prefetch_drop(s);
                }
                pthread_mutex_unlock(&s->mu);
            }
            read_ahead_predicted(atomic_load(&s->next_store), s);
            /* only where every expert stays decoded: under a budget experts come and go, each eviction splits a
             * huge page, and collapsing again and again cost more than it saved (at 93% on 2 cores, 11 against 36
             * tokens/s without it) */
            if (atomic_fetch_add(&s->streak, 1) + 1 == COLLAPSE_AFTER && s->n_hp > 0 && !s->use_slots &&
                !atomic_exchange(&s->collapse_queued, 1) && zipmoe_reader_submit(&s->collapse_job) != ZIPMOE_OK) {
                atomic_store(&s->collapse_queued, 0);
            }
        }
        report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, all_places ? 0 : ith, all_places ? 1 : nth);
        if (pending) {
            memset(pending, 0, (size_t) (ne0 * ne1));
        }
        turn->fast = 1;
        return 0;
    }
    atomic_fetch_add(&s->waiting, 1); /* a guessed read-ahead holding mu stops: the router has decided */
    pthread_mutex_lock(&s->mu);
    atomic_fetch_sub(&s->waiting, 1);
    while (s->plan_key != NULL && s->plan_key != key) {
        pthread_cond_wait(&s->cv, &s->mu);
    }
    if (s->plan_key == NULL) {
        s->plan_key    = key;
        s->plan_in     = 0;
        s->plan_failed = 0;
        s->plan_t0     = zipmoe_now_ns();
        s->plan_seq++;
        atomic_store(&s->next_chunk, 0);
    }
    if (s->plan_in == 0 && key == atomic_load(&s->last_key) && atomic_load(&g_op_seq) == atomic_load(&s->last_seq) &&
        (s->last_failed || all_routed_ready(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, 1))) {
        /* a sibling that arrives after the others finished this invocation (no other op began since, as the
         * engine's barrier holds them all): its experts are decoded or streamed; it must not decode or count them
         * again. Nor plan again after the invocation failed: its siblings may still stream from what the plan
         * pinned. It fails too (a caller that broke the key's contract is told, not served undecoded experts). */
        s->plan_n = 0;
        if (s->last_failed) {
            int32_t first = -1;
            if (ne0 > 0 && ne1 > 0) {
                memcpy(&first, ids, sizeof first);
            }
            s->plan_failed = 1;
            record_error(s, first, ZIPMOE_ERR_CORRUPT);
        }
    } else if (s->plan_in == 0) {
        atomic_store(&s->last_key, key);
        atomic_store(&s->last_seq, atomic_fetch_add(&g_op_seq, 1) + 1);
        s->plan_stream    = (flags & ZIPMOE_TURN_STREAM) != 0;
        const int64_t bad = make_plan(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
        if (bad != -1) {
            record_error(s, bad, ZIPMOE_ERR_ARG);
            s->plan_failed = 1;
        }
        schedule_reads(s);
        map_plan(s);
        atomic_fetch_add(s->prefilling ? &g_prefill_dummy : &g_calls, 1);
    }
    s->plan_in++;
    turn->plan_n = s->plan_n; /* stable until every thread of this invocation has left */
    turn->plan   = s->plan;
    turn->seq    = s->plan_seq;
    turn->ring   = s->job_active && s->job.ring_wraps;
    if (all_places) { /* given at the plan: a routed expert keeps its place until the next invocation */
        report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, 0, 1);
        report_pending(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, turn->plan_n, pending);
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* The decoding of a turn, then its end: materialize's, or the turn of a caller that reported every place. */
static int64_t end_turn(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0, int64_t ne1, size_t nb0,
                        size_t nb1, int32_t * where, int ith, int nth) {
    int64_t       status = 0, chunks = 0;
    const int64_t n_chunks = s->info.n_chunks;
    const int64_t     plan_n = turn->plan_n;
    const plan_item * plan   = turn->plan;
    if (plan_n > 0) {
        const size_t     chunk_n = (size_t) s->info.chunk_n;
        thread_scratch * ts = thread_scratch_get(chunk_n, chunk_n + zipmoe_chunk_bound(zipmoe_tensor_codec(s->tensor), chunk_n));
        const uint64_t   t0 = zipmoe_now_ns();
        if (!ts) {
            record_error(s, plan[0].expert, ZIPMOE_ERR_NOMEM);
            status = ZIPMOE_ERR_NOMEM;
        }
        /* Chunks are claimed one at a time in the plan's order, so the threads finish together: a thread that
         * ran out of work early would spin in the engine's barrier on a core the reader and the others need.
         * A thread whose chunk is not read yet sleeps until it is. */
        for (int64_t g; status == 0 && (g = atomic_fetch_add(&s->next_chunk, 1)) < plan_n * n_chunks;) {
            const int64_t j = g / n_chunks, c = g % n_chunks;
            while (plan[j].staged && turn->idle && atomic_load(&s->job.items[j].ready) == 0 &&
                   turn->idle(turn->idle_ctx)) {
            } /* (the caller's other work while its bytes are read) */
            int64_t rc = plan[j].staged ? zipmoe_reader_wait_item(&s->job, j) : ZIPMOE_OK;
            if (rc == ZIPMOE_OK) {
                rc = decode_chunk(s, &plan[j], c, ts);
            }
            if (rc < 0) {
                record_error(s, plan[j].expert, rc);
                status = rc;
                if (turn->ring) { /* the reader may wait for this item's room, which is never released now */
                    zipmoe_reader_cancel(&s->job);
                }
                break;
            }
            zipmoe_read_item * item = &s->job.items[j];
            if (turn->ring && item->ring_hi && atomic_fetch_sub(&item->chunks_left, 1) == 1) {
                zipmoe_reader_release_item(&s->job, j);
            }
            chunks++;
        }
        atomic_fetch_add(&g_ns, zipmoe_now_ns() - t0);
        atomic_fetch_add(&g_chunks, (uint64_t) chunks);
    }

    pthread_mutex_lock(&s->mu);
    if (status < 0) {
        s->plan_failed = 1;
    }
    report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, ith, nth); /* (before a discard frees them) */
    if (--s->plan_in == 0) {
        s->last_failed = s->plan_failed;
        atomic_fetch_add(&g_experts, (uint64_t) plan_n);
        atomic_fetch_add(&g_bytes, (uint64_t) plan_n * s->hot_size);
        if (s->job_active) { /* the reader may still be busy with a failed plan's buffers */
            zipmoe_reader_finish(&s->job, s->plan_failed);
            staging_give(s);
            s->job_active = 0;
        }
        if (s->plan_failed) {
            discard_plan(s);
        } else {
            publish(s);
        }
        prefetch_drop(s); /* what was read ahead is decoded, or kept by a tier */
        if (plan_n > 0 && !s->prefilling) {
            atomic_fetch_add(&g_stall_ns, zipmoe_now_ns() - s->plan_t0);
        }
        int64_t read = 0;
        for (int64_t j = 0; j < plan_n && !read; j++) {
            read = plan[j].read_sm || plan[j].read_codes;
        }
        if (read && !s->prefilling) {
            atomic_fetch_add(&g_reading_calls, 1);
        }
        s->plan_key = NULL;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return status < 0 ? status : chunks;
}

int64_t zipmoe_store_materialize_end(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0,
                                     int64_t ne1, size_t nb0, size_t nb1) {
    if (!s || !turn || !ids) {
        return ZIPMOE_ERR_ARG;
    }
    return turn->fast ? 0 : end_turn(s, turn, ids, ne0, ne1, nb0, nb1, NULL, 0, 1);
}

int64_t zipmoe_store_materialize_wait(zipmoe_store * s, const zipmoe_turn * turn) {
    if (!s || !turn) {
        return ZIPMOE_ERR_ARG;
    }
    if (turn->fast) {
        return ZIPMOE_OK;
    }
    pthread_mutex_lock(&s->mu);
    while (s->plan_key != NULL && s->plan_seq == turn->seq) {
        pthread_cond_wait(&s->cv, &s->mu);
    }
    const int failed = s->plan_seq == turn->seq && s->plan_failed; /* (kept until the next plan begins) */
    pthread_mutex_unlock(&s->mu);
    return failed ? ZIPMOE_ERR_CORRUPT : ZIPMOE_OK; /* (a failed chunk's error is recorded) */
}

/* Decodes chunk c of streamed expert e's exponent plane into exp[ref->n], or the thread's scratch where exp is NULL
 * (*plane: where it went). Returns OK or the error, recorded. */
static int64_t stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp, const uint8_t ** plane,
                                zipmoe_chunk_ref * ref) {
    const expert_state * x = &s->experts[e]; /* (pinned: set under mu by the plan this thread's _begin saw) */
    int64_t              rc = ZIPMOE_ERR_ARG; /* (not streamed: the caller's rows of it are missing, to be dropped) */
    if (still_streamed(x)) {
        const size_t     chunk_n = (size_t) s->info.chunk_n;
        thread_scratch * ts      = thread_scratch_get(chunk_n, chunk_n + zipmoe_chunk_bound(zipmoe_tensor_codec(s->tensor),
                                                                                            chunk_n));
        rc = ZIPMOE_ERR_NOMEM;
        if (ts) {
            zipmoe_tensor_chunk(s->tensor, e, c, ref);
            *plane = exp ? exp : ts->ws->exp;
            /* (the warm copy's bytes were checked when they came from the file, as decode_chunk's are) */
            rc = zipmoe_decode_exp(zipmoe_tensor_codec(s->tensor), ts->ws, x->region + ref->code_offset,
                                   (size_t) ref->code_size, (uint8_t *) *plane, (size_t) ref->n, x->region + ref->first,
                                   (size_t) ref->n);
        }
    }
    if (rc < 0) {
        record_error(s, e, rc);
        return rc;
    }
    return ZIPMOE_OK;
}

int64_t zipmoe_store_stream_chunk(zipmoe_store * s, int64_t e, int64_t c, uint16_t * out) {
    if (!s || !out || e < 0 || e >= s->info.n_expert || c < 0 || c >= s->info.n_chunks) {
        return ZIPMOE_ERR_ARG;
    }
    zipmoe_chunk_ref ref;
    const uint8_t *  exp;
    const int64_t    rc = stream_exponents(s, e, c, NULL, &exp, &ref);
    if (rc < 0) {
        return rc;
    }
    zipmoe_merge_bf16_cached(exp, s->experts[e].region + ref.first, (size_t) ref.n, out);
    return ref.n;
}

int64_t zipmoe_store_stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp, const uint8_t ** sm) {
    if (!s || !exp || !sm || e < 0 || e >= s->info.n_expert || c < 0 || c >= s->info.n_chunks) {
        return ZIPMOE_ERR_ARG;
    }
    zipmoe_chunk_ref ref;
    const uint8_t *  plane;
    const int64_t    rc = stream_exponents(s, e, c, exp, &plane, &ref);
    if (rc < 0) {
        return rc;
    }
    *sm = s->experts[e].region;
    return ref.n;
}

int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids, int64_t ne0, int64_t ne1,
                                 size_t nb0, size_t nb1, int32_t * where, int ith, int nth) {
    zipmoe_turn   turn;
    const int64_t rc = zipmoe_store_materialize_begin(s, key, ids, ne0, ne1, nb0, nb1, where, NULL, 0, ith, nth, &turn);
    if (rc < 0 || turn.fast) {
        return rc;
    }
    return end_turn(s, &turn, ids, ne0, ne1, nb0, nb1, where, ith, nth);
}

int64_t zipmoe_cache_activations(const char * prefix, uint64_t * counts, int64_t n) {
    if (!prefix || !counts || n < 0) {
        return ZIPMOE_ERR_ARG;
    }
    memset(counts, 0, (size_t) n * sizeof *counts);
    int64_t n_expert = 0;
    pthread_mutex_lock(&g_list_mu);
    for (zipmoe_store * s = g_list; s; s = s->next) {
        if (strncmp(s->name, prefix, strlen(prefix)) != 0) {
            continue;
        }
        pthread_mutex_lock(&s->mu);
        for (int64_t e = 0; e < s->info.n_expert && e < n; e++) {
            counts[e] = counts[e] > s->experts[e].activations ? counts[e] : s->experts[e].activations;
        }
        pthread_mutex_unlock(&s->mu);
        n_expert = s->info.n_expert > n_expert ? s->info.n_expert : n_expert;
    }
    pthread_mutex_unlock(&g_list_mu);
    return n_expert;
}

int64_t zipmoe_cache_routing(const char * prefix, uint64_t * masks, int64_t words, int64_t max_tokens) {
    if (!prefix || !masks || words < 1 || max_tokens < 0) {
        return ZIPMOE_ERR_ARG;
    }
    int64_t written = 0;
    pthread_mutex_lock(&g_list_mu);
    zipmoe_store * s = g_list;
    while (s && strncmp(s->name, prefix, strlen(prefix)) != 0) {
        s = s->next;
    }
    if (s && words < s->route_words) {
        written = ZIPMOE_ERR_ARG;
    } else if (s) {
        /* the fast path logs without the lock: copy, then keep what no writer can have overwritten since */
        const uint64_t end   = atomic_load_explicit(&s->route_n, memory_order_acquire);
        const uint64_t keep  = (uint64_t) max_tokens < ROUTE_LOG ? (uint64_t) max_tokens : ROUTE_LOG;
        const uint64_t begin = end > keep ? end - keep : 0;
        for (uint64_t i = begin; i < end; i++) {
            uint64_t * out = masks + (i - begin) * (uint64_t) words;
            memset(out, 0, (size_t) words * sizeof *out);
            memcpy(out, s->route_log + (i % ROUTE_RING) * (uint64_t) s->route_words,
                   (size_t) s->route_words * sizeof *out);
        }
        atomic_thread_fence(memory_order_acquire);
        const uint64_t now  = atomic_load_explicit(&s->route_n, memory_order_relaxed);
        const uint64_t safe = now + 1 > ROUTE_RING ? now + 1 - ROUTE_RING : 0; /* entries from here are intact */
        const uint64_t from = safe > begin ? (safe < end ? safe : end) : begin;
        if (from > begin) {
            memmove(masks, masks + (from - begin) * (uint64_t) words, (size_t) ((end - from) * (uint64_t) words) * sizeof *masks);
        }
        written = (int64_t) (end - from);
    }
    pthread_mutex_unlock(&g_list_mu);
    return written;
}

int64_t zipmoe_store_activations(zipmoe_store * s, uint64_t * counts, int64_t n) {
    if (!s || !counts || n < s->info.n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        counts[e] = s->experts[e].activations;
    }
    pthread_mutex_unlock(&s->mu);
    return s->info.n_expert;
}

/* ---------------------------------------------------------------- prefill (prefill.c) */

int64_t zipmoe_store_prefill_begin(zipmoe_store * s, int64_t * hot_slots) {
    *hot_slots = 0;
    if (!s || s->fd < 0) {
        return 0;
    }
    pthread_mutex_lock(&s->mu);
    refresh_limits(s);
    const uint64_t n    = (uint64_t) s->info.n_expert;
    const uint64_t hot  = s->hot_size ? s->hot_limit / s->hot_size : 0;
    const uint64_t warm = s->mean_region ? s->warm_limit / s->mean_region : 0;
    const uint64_t sm   = s->sm_size ? s->sm_limit / s->sm_size : 0;
    const int64_t  want = (int64_t) (hot >= n || warm >= n || sm >= n || hot + warm + sm >= n ? n : hot + warm + sm);
    s->prefilling = want > 0; /* until zipmoe_store_prefill_end */
    if (want > 0 && !s->use_slots) {
        /* every expert is decoded now and stays: let those first touches take huge pages (the matmuls read whole
         * experts; 2 threads generated 1.5x faster from the first token). Not without the prefill: faults of
         * huge pages during the first tokens made cold starts 2.5x slower, and the reader collapses later. */
        madvise(s->dst, s->dst_size, MADV_HUGEPAGE);
    }
    pthread_mutex_unlock(&s->mu);
    *hot_slots = (int64_t) (hot < n ? hot : n);
    return want;
}

void zipmoe_store_prefill_end(zipmoe_store * s) {
    pthread_mutex_lock(&s->mu);
    s->prefilling = 0;
    pthread_mutex_unlock(&s->mu);
}

int zipmoe_store_prefill_collapse(zipmoe_store * s) {
    if (!s || s->fd < 0 || s->use_slots || s->n_hp == 0) {
        return 0;
    }
    return zipmoe_store_collapse(s);
}

int zipmoe_store_layer(const zipmoe_store * s) { return s->layer; }

int64_t zipmoe_store_place(zipmoe_store * s, int64_t e) {
    if (!s || e < 0 || e >= s->info.n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    const int64_t p = s->experts[e].hot ? s->experts[e].place : -1;
    pthread_mutex_unlock(&s->mu);
    return p;
}
