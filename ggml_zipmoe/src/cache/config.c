/* config.c - the process's tier budgets, a planner's per-store slot rules and the switch between a
 * batch's and generation's budgets; each store's limits follow from them (cache_refresh_limits). */
#define _GNU_SOURCE
#include "tiers.h"

#include <stdio.h>
#include <stdlib.h>

/* ---------------------------------------------------------------- the process's budget */


/* One per process: one expert cache serves every store the loader opens, from one budget (tiers.h). */
cache_config g_cfg = {
    .mu          = PTHREAD_MUTEX_INITIALIZER,
    .hot_budget  = UINT64_MAX,
    .hot_batch   = UINT64_MAX,
    .hot_tokens  = UINT64_MAX,
    .token_slots = -1,
    .warm_budget = 0,
    .sm_budget   = 0,
    .policy      = ZIPMOE_POLICY_DEFAULT, /* docs/cache-and-planner.md, "Which policy" */
    .gen         = 1,
    .direct_io   = 1,
    .store_turns = 1,
};

/* A store's share of a budget, in proportion to its BF16 size. */
static uint64_t quota(const zipmoe_store * s, uint64_t budget) {
    if (budget == UINT64_MAX) {
        return UINT64_MAX;
    }
    const uint64_t total = atomic_load(&g_cfg.bf16_total);
    const uint64_t mine  = (uint64_t) s->info.n_expert * s->hot_size;
    return total ? (uint64_t) ((double) budget * (double) mine / (double) total) : 0;
}

/* Under g_cfg.mu: the planner's rule for a store (the longest matching prefix), or NULL. */
static const slot_rule * find_rule(const char * name) {
    const slot_rule * rule = NULL;
    size_t            best = 0;
    for (int i = 0; i < g_cfg.n_rules; i++) {
        const size_t len = strlen(g_cfg.rules[i].prefix);
        if (len >= best && strncmp(name, g_cfg.rules[i].prefix, len) == 0) {
            rule = &g_cfg.rules[i];
            best = len;
        }
    }
    return rule;
}

static uint64_t add_sat(uint64_t a, uint64_t b) { return a + b < a ? UINT64_MAX : a + b; }

static uint64_t slots_bytes(int64_t slots, uint64_t size) {
    return (uint64_t) slots > UINT64_MAX / (size ? size : 1) ? UINT64_MAX : (uint64_t) slots * size;
}

/* The bytes a store of `slots` hot slots decodes beyond them when it is routed `routed` distinct experts. */
static uint64_t beyond_slots(const zipmoe_store * o, int64_t slots, int64_t routed) {
    const int64_t n = routed < o->info.n_expert ? routed : o->info.n_expert;
    return n > slots ? slots_bytes(n - slots, o->hot_size) : 0;
}

/* Under g_open.mu and g_cfg.mu (in that order): each store that no rule sets gets the whole experts of its share
 * of a hot budget, and what its share holds beyond them goes on to the next store in the list. Rounded down store
 * by store, every share would leave up to one expert's bytes unused: 0.97 of an expert on each of the 24 stores of
 * the 2.8g model at 75%, whose LFU caches of 20 slots miss 10% more often than of 21 (its routing log, simulated).
 * The total stays within the budget. Sets the stores' hot_slots when `set`; returns the fewest slots of a store it
 * shares to, or -1 when it shares to none. *beyond (if not NULL): the most bytes one of those stores decodes beyond
 * its slots when routed `routed` experts. */
static int64_t shared_slots(uint64_t budget, int set, int64_t routed, uint64_t * beyond) {
    uint64_t carry  = 0;
    int64_t  fewest = -1;
    if (beyond) {
        *beyond = 0;
    }
    for (zipmoe_store * o = g_open.list; o; o = o->next) {
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
        if (beyond && beyond_slots(o, (int64_t) slots, routed) > *beyond) {
            *beyond = beyond_slots(o, (int64_t) slots, routed);
        }
    }
    return fewest;
}

/* Under g_open.mu and g_cfg.mu: generation's room beside a planner's rules (zipmoe_cache_set_token_room, less the
 * bytes the rules' slots take, less `held`: what a multi-token step holds back) shared out as extra hot slots among
 * the stores, in whole experts carried from store to store as shared_slots does; in token mode they are the stores'
 * extra_slots (`set`; 0 otherwise). Only when every store has a rule without an sm tier (place_plan does not evict
 * first there). Returns the fewest hot slots a store then has in generation, or -1 when the rules get no room;
 * *beyond as shared_slots'. */
static int64_t rule_slots(int set, uint64_t held, int64_t routed, uint64_t * beyond) {
    uint64_t rules = 0;
    if (beyond) {
        *beyond = 0;
    }
    int      every = g_open.list != NULL && g_cfg.rule_room > 0;
    for (zipmoe_store * o = g_open.list; o; o = o->next) {
        const slot_rule * rule = find_rule(o->name);
        if (set) {
            o->extra_slots = 0;
        }
        every = every && rule && rule->sm == 0;
        if (rule) { /* (saturating: absurd slot counts must not wrap into room) */
            rules = add_sat(rules, add_sat(slots_bytes(rule->hot, o->hot_size), slots_bytes(rule->warm, o->mean_region)));
        }
    }
    if (!every || add_sat(rules, held) >= g_cfg.rule_room) {
        return -1;
    }
    const uint64_t room   = g_cfg.rule_room - rules - held;
    uint64_t       carry  = 0;
    int64_t        fewest = -1;
    for (zipmoe_store * o = g_open.list; o; o = o->next) {
        const slot_rule * rule  = find_rule(o->name);
        const int64_t     free  = o->info.n_expert - rule->hot - rule->warm; /* an expert in one tier at a time */
        const uint64_t    share = quota(o, room) + carry;
        const uint64_t    fit   = o->hot_size ? share / o->hot_size : 0;
        const int64_t     extra = free <= 0 ? 0 : fit < (uint64_t) free ? (int64_t) fit : free;
        if (set && g_cfg.token_mode) {
            o->extra_slots = extra;
        }
        fewest = fewest < 0 || rule->hot + extra < fewest ? rule->hot + extra : fewest;
        carry  = share - (uint64_t) extra * o->hot_size;
        if (beyond && beyond_slots(o, rule->hot + extra, routed) > *beyond) {
            *beyond = beyond_slots(o, rule->hot + extra, routed);
        }
    }
    return fewest;
}

static uint64_t warm_budget_now(void);

/* Under g_open.mu and g_cfg.mu: each store that no rule sets gets the whole regions (of its mean size) of its share
 * of the warm budget, or all of its regions, and what its share holds beyond them goes on to the next store, as
 * shared_slots does for the hot tier. At 75% of the 2.8g model, warm-only, each store's share fell half a region
 * short of its experts, and each kept one fewer: 24 missing where the budget lacked 6. */
static void shared_warm(uint64_t budget) {
    uint64_t carry = 0;
    for (zipmoe_store * o = g_open.list; o; o = o->next) {
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

/* Under g_open.mu and g_cfg.mu, whenever the budget, the rules or the open stores change: the hot slots of the
 * budget in force, and the fewest a store would have in generation's; the warm tier's shares. Every store
 * refreshes its limits at its next invocation (g_cfg.gen). */
void cache_share_hot_slots(void) {
    shared_slots(g_cfg.hot_budget, 1, 0, NULL);
    shared_warm(warm_budget_now());
    rule_slots(1, g_cfg.step_room, 0, NULL);
    if (g_cfg.n_rules > 0) {
        g_cfg.token_slots = rule_slots(0, 0, 0, NULL);
    } else {
        g_cfg.token_slots = g_cfg.sm_budget == 0 && g_cfg.hot_tokens != UINT64_MAX && g_cfg.hot_tokens > g_cfg.hot_batch
                            ? shared_slots(g_cfg.hot_tokens, 0, 0, NULL)
                            : -1;
    }
    atomic_fetch_add(&g_cfg.gen, 1);
}

/* Under g_cfg.mu: generation's hot budget less what it holds back for a multi-token step (zipmoe_cache_begin_graph),
 * never below a batch's. */
static uint64_t token_hot_now(void) {
    if (g_cfg.hot_tokens == UINT64_MAX) {
        return UINT64_MAX;
    }
    return g_cfg.hot_tokens - g_cfg.hot_batch > g_cfg.step_room ? g_cfg.hot_tokens - g_cfg.step_room : g_cfg.hot_batch;
}

/* Under g_cfg.mu: a new budget holds nothing back for multi-token steps until one needs it (begin_graph): what an
 * earlier step needed was of other slots. */
static void keep_reserve(void);

static void forget_steps(void) {
    g_cfg.step_room  = 0;
    g_cfg.step_quiet = 0;
    keep_reserve();
}

/* Under g_open.mu and g_cfg.mu: the tier budgets, generation's hot budget (tokens, at least hot) and the policy. */
static void set_budgets(uint64_t hot, uint64_t tokens, uint64_t warm, uint64_t sm, zipmoe_policy policy) {
    forget_steps();
    g_cfg.hot_batch   = hot;
    g_cfg.hot_tokens  = tokens > hot ? tokens : hot;
    g_cfg.hot_budget  = g_cfg.token_mode ? token_hot_now() : g_cfg.hot_batch; /* (begin_graph decides again at the next graph) */
    g_cfg.warm_budget = warm;
    g_cfg.sm_budget   = sm;
    g_cfg.policy      = policy;
}

int64_t zipmoe_cache_configure(uint64_t hot_bytes, uint64_t warm_bytes, uint64_t sm_bytes, zipmoe_policy policy) {
    if (policy < ZIPMOE_POLICY_TOKEN_LFU || policy > ZIPMOE_POLICY_LAST) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    /* (zipmoe_cache_set_token_hot gives generation more; until then, in token mode, the tier is hot_bytes, and the
     * next graph's zipmoe_cache_begin_graph leaves token mode, trimming every store down to it) */
    set_budgets(hot_bytes, hot_bytes, warm_bytes, sm_bytes, policy);
    cache_share_hot_slots();
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
    return ZIPMOE_OK;
}

/* Under g_cfg.mu: whether generation may lend the allowance for the tensor in flight to the warm tier: every expert
 * kept compressed, none decoded (nor sign+mantissa planes, nor a planner's rules), so that a prompt's every
 * routed expert is decoded anew into that allowance, a token's few only. */
static int warm_tokens_possible(void) {
    return g_cfg.hot_batch == 0 && g_cfg.sm_budget == 0 && g_cfg.n_rules == 0 && g_cfg.warm_budget > 0 && g_cfg.warm_budget != UINT64_MAX;
}

/* Under g_cfg.mu: the warm tier's budget in force. In generation without a hot tier it also holds the allowance for
 * the tensor in flight beyond what a token's misses decode into: at 75% of the 2.8g model that is 84 of its 96 MiB,
 * the last 6% of the compressed experts, whose misses (3 a token) stalled a warm-only token 12 of its 68 ms. */
static uint64_t warm_budget_now(void) {
    return g_cfg.token_mode && g_cfg.token_warm && warm_tokens_possible() && g_cfg.reserve > g_cfg.token_need
               ? g_cfg.warm_budget + (g_cfg.reserve - g_cfg.token_need)
               : g_cfg.warm_budget;
}

/* Evicted experts' pages are kept for a batch's decodes beyond the limits; in token mode a miss takes its victim's
 * place instead, and the room the reserve would keep is generation's hot tier's: pages kept there would come on
 * top of a full tier (after a shrink in generation, by up to the whole reserve). The room held back for a step's
 * decodes beyond a store's slots keeps their pages: given back and faulted in again at every step, they cost more
 * than the decoding (a 4-token step at 40% of the 1g model: 14 experts a store, every store). Generation's warm
 * tier keeps the pages of the graph's misses (not of the step it holds room for: a token's, then, not a step's),
 * and the rest go back at once: the tier grows into them. */
static void keep_reserve(void) {
    zipmoe_slots_set_keep(!g_cfg.token_mode ? g_cfg.reserve : g_cfg.token_warm ? g_cfg.token_pages : g_cfg.step_room);
    if (g_cfg.token_mode && g_cfg.token_warm) {
        zipmoe_slots_trim();
    }
}

void zipmoe_cache_set_reserve(uint64_t bytes) {
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    g_cfg.reserve = bytes;
    keep_reserve();
    cache_share_hot_slots(); /* (generation's warm shares hold the reserve beyond a token's pages) */
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
}

void zipmoe_cache_set_token_hot(uint64_t hot_bytes) {
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    g_cfg.hot_tokens = hot_bytes > g_cfg.hot_batch ? hot_bytes : g_cfg.hot_batch;
    forget_steps();
    if (g_cfg.token_mode) {
        g_cfg.hot_budget = token_hot_now();
    }
    cache_share_hot_slots();
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
}

void zipmoe_cache_set_token_room(uint64_t bytes) {
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    g_cfg.rule_room = bytes;
    forget_steps();
    cache_share_hot_slots();
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
}

uint64_t zipmoe_cache_rules_bytes(void) {
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    uint64_t bytes = 0;
    for (const zipmoe_store * o = g_open.list; o; o = o->next) {
        const slot_rule * rule = find_rule(o->name);
        if (rule) { /* (saturating, as rule_slots) */
            bytes = add_sat(bytes, add_sat(slots_bytes(rule->hot, o->hot_size), add_sat(slots_bytes(rule->warm, o->mean_region),
                                                                                   slots_bytes(rule->sm, o->sm_size))));
        }
    }
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
    return bytes;
}

/* Gives back the idle read buffers larger than the read room lets one be (a smaller room from now on): one that
 * is in use is refitted when it is taken next (cache_read_buffer_fit). */
static void trim_idle_read_buffers(void) {
    const size_t bound = cache_read_buffer_refit_limit();
    cache_staging_trim_idle(bound);
    cache_prefetch_trim_idle(bound);
}

int64_t zipmoe_cache_apply(const zipmoe_cache_params * p) {
    if (!p || p->policy < ZIPMOE_POLICY_TOKEN_LFU || p->policy > ZIPMOE_POLICY_LAST) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    if (!p->keep_slots) {
        g_cfg.n_rules   = 0;
        g_cfg.rule_room = 0; /* (the room was the rules') */
    }
    set_budgets(p->hot, p->token_hot, p->warm, p->sm, p->policy);
    g_cfg.reserve = p->reserve;
    cache_read_buffers_set_room(p->read_room);
    keep_reserve();
    cache_share_hot_slots();
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
    trim_idle_read_buffers();
    return ZIPMOE_OK;
}

int64_t zipmoe_cache_apply_split(const zipmoe_budget_split * split, zipmoe_policy policy) {
    if (!split) {
        return ZIPMOE_ERR_ARG;
    }
    /* (a split that leaves no read room reads nothing beyond its fill, every expert decoded, or keeps no hot tier:
     * its buffers are not bounded) */
    const zipmoe_cache_params params = {
        .hot = split->hot, .warm = split->warm, .sm = split->sm, .token_hot = split->token_hot,
        .reserve = split->in_flight, .read_room = split->reads ? split->reads : UINT64_MAX, .policy = policy,
    };
    return zipmoe_cache_apply(&params);
}

void zipmoe_cache_set_direct_io(int enabled) { atomic_store(&g_cfg.direct_io, enabled != 0); }

void zipmoe_cache_set_store_turns(int enabled) { atomic_store(&g_cfg.store_turns, enabled != 0); }

void zipmoe_cache_set_read_room(uint64_t bytes) {
    cache_read_buffers_set_room(bytes);
    trim_idle_read_buffers();
}

int64_t zipmoe_cache_set_slots(const char * prefix, int64_t hot, int64_t warm, int64_t sm) {
    pthread_mutex_lock(&g_open.mu);
    pthread_mutex_lock(&g_cfg.mu);
    int64_t rc = ZIPMOE_OK;
    forget_steps();
    if (!prefix) {
        g_cfg.n_rules   = 0;
        g_cfg.rule_room = 0; /* (the room was the rules') */
    } else if (strlen(prefix) >= sizeof g_cfg.rules[0].prefix || hot < 0 || warm < 0 || sm < 0) {
        rc = ZIPMOE_ERR_ARG;
    } else {
        int i = 0;
        while (i < g_cfg.n_rules && strcmp(g_cfg.rules[i].prefix, prefix) != 0) {
            i++;
        }
        if (i == g_cfg.n_rules) {
            if (!g_cfg.rules) {
                g_cfg.rules = calloc(ZIPMOE_MAX_SLOT_RULES, sizeof *g_cfg.rules);
            }
            if (!g_cfg.rules || g_cfg.n_rules == ZIPMOE_MAX_SLOT_RULES) {
                rc = g_cfg.rules ? ZIPMOE_ERR_ARG : ZIPMOE_ERR_NOMEM;
            } else {
                g_cfg.n_rules++;
            }
        }
        if (rc == ZIPMOE_OK) {
            snprintf(g_cfg.rules[i].prefix, sizeof g_cfg.rules[i].prefix, "%s", prefix);
            g_cfg.rules[i].hot  = hot;
            g_cfg.rules[i].warm = warm;
            g_cfg.rules[i].sm   = sm;
        }
    }
    cache_share_hot_slots();
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
    return rc;
}

/* A count of a plan: optional blanks, then decimal digits, at most max (no sign, no overflow); the end, or NULL. */
static const char * plan_number(const char * p, uint64_t max, uint64_t * out) {
    while (*p == ' ' || *p == '\t') {
        p++;
    }
    if (*p < '0' || *p > '9') {
        return NULL;
    }
    for (*out = 0; *p >= '0' && *p <= '9'; p++) {
        const uint64_t digit = (uint64_t) (*p - '0');
        if (*out > (max - digit) / 10) {
            return NULL;
        }
        *out = *out * 10 + digit;
    }
    return p;
}

int64_t zipmoe_plan_parse(const char * text, zipmoe_plan_rule_fn fn, void * arg) {
    if (!text) {
        return ZIPMOE_ERR_ARG;
    }
    size_t n_rules = 0;
    for (const char * p = text; *p;) {
        uint64_t v[4] = { 0 };
        for (int i = 0; i < 4 && p; i++) {
            p = plan_number(p, i == 0 ? (uint64_t) INT32_MAX : (uint64_t) INT64_MAX, &v[i]);
            if (p && i < 3) {
                p = *p == (i == 0 ? ':' : ',') ? p + 1 : NULL;
            }
        }
        if (!p || (*p != ';' && *p != 0)) {
            return ZIPMOE_ERR_CORRUPT;
        }
        p += *p == ';';
        if (++n_rules > ZIPMOE_MAX_SLOT_RULES) {
            return ZIPMOE_ERR_ARG;
        }
        const int64_t rc = fn ? fn(arg, (int32_t) v[0], (int64_t) v[1], (int64_t) v[2], (int64_t) v[3]) : ZIPMOE_OK;
        if (rc != ZIPMOE_OK) {
            return rc;
        }
    }
    return ZIPMOE_OK;
}

#define PLAN_STR_(x) #x
#define PLAN_STR(x)  PLAN_STR_(x)

const char * zipmoe_plan_problem(int64_t rc) {
    switch (rc) {
        case ZIPMOE_ERR_CORRUPT:
            return " is not a plan (\"<layer>:<hot>,<warm>,<sm>;...\", as `zipmoe plan` prints)";
        case ZIPMOE_ERR_ARG:
            return " has rules for more layers than the cache's limit of " PLAN_STR(ZIPMOE_MAX_SLOT_RULES);
        default:
            return " cannot be kept (out of memory)";
    }
}

/* Under s->mu: the store's tier limits for the current configuration. */
void cache_refresh_limits(zipmoe_store * s) {
    pthread_mutex_lock(&g_cfg.mu);
    const slot_rule * rule = find_rule(s->name);
    if (rule) {
        s->hot_limit  = slots_bytes(rule->hot + s->extra_slots, s->hot_size);
        s->warm_limit = slots_bytes(rule->warm, s->mean_region);
        s->sm_limit   = slots_bytes(rule->sm, s->sm_size);
    } else {
        s->hot_limit  = s->hot_slots >= 0 ? slots_bytes(s->hot_slots, s->hot_size) : quota(s, g_cfg.hot_budget);
        s->warm_limit = s->warm_share != UINT64_MAX ? s->warm_share : quota(s, warm_budget_now());
        s->sm_limit   = quota(s, g_cfg.sm_budget);
    }
    if (s->raw || s->info.layout == ZIPMOE_LAYOUT_BYTES) {
        /* a compressed copy of a raw expert (a plain GGUF's, or a byte-layout one's) is the expert: only the hot
         * tier keeps it */
        s->warm_limit = 0;
        s->sm_limit   = 0;
    }
    s->policy  = g_cfg.policy;
    /* slots pay when experts come and go; an unbounded hot tier keeps anonymous pages, which may become huge */
    s->use_slots = s->hot_limit < (uint64_t) s->info.n_expert * s->hot_size;
    s->cfg_gen = atomic_load(&g_cfg.gen);
    pthread_mutex_unlock(&g_cfg.mu);
}

/* Graphs in a row that need less than generation holds back for a multi-token step before it holds less. */
#define STEP_HOLD 64

/* Under g_open.mu and g_cfg.mu: the most bytes one store decodes beyond its hot slots in generation when it holds
 * back `held` and each store is routed `routed` experts; UINT64_MAX when generation would keep no more decoded than
 * a batch. */
static uint64_t step_beyond(uint64_t held, int64_t routed) {
    uint64_t beyond = 0;
    if (g_cfg.n_rules > 0) {
        return rule_slots(0, held, routed, &beyond) < 0 ? UINT64_MAX : beyond;
    }
    if (held >= g_cfg.hot_tokens - g_cfg.hot_batch) {
        return UINT64_MAX;
    }
    shared_slots(g_cfg.hot_tokens - held, 0, routed, &beyond);
    return beyond;
}

/* Under g_open.mu and g_cfg.mu: the least generation's hot tier holds back so that a graph whose stores are each
 * routed up to `routed` experts stays within its budget, or UINT64_MAX. A miss takes the place of the expert it
 * evicts while its store has one that the graph did not route; beyond its slots a store decodes into free places,
 * and only one store at a time (the others are trimmed to their limits before a store plans: cache_trim_others),
 * so the most any store decodes beyond its slots is all it needs. Holding it back lowers every store's slots, which
 * may raise that most: the least fixed point, from below. 0 for a token's top-k where every store keeps them. */
static uint64_t step_need(int64_t routed) {
    uint64_t held = 0;
    for (int i = 0; i < 4096; i++) {
        const uint64_t beyond = step_beyond(held, routed);
        if (beyond <= held || beyond == UINT64_MAX) {
            return beyond == UINT64_MAX ? UINT64_MAX : held;
        }
        held = beyond;
    }
    return UINT64_MAX;
}

/* Under g_cfg.mu: what generation holds back for a step now, given this graph's `need` and what it holds (`held`,
 * enough for this graph when `fits`): more at once, less only after STEP_HOLD graphs in a row that needed less, so
 * that the steps of speculation or parallel slots among single tokens do not trim and regrow the tier each time. */
static uint64_t hold_step(uint64_t need, uint64_t held, int fits) {
    if (need > held || !fits || need == held) {
        g_cfg.step_quiet = 0;
        return need > held || !fits ? need : held;
    }
    if (++g_cfg.step_quiet >= STEP_HOLD) {
        g_cfg.step_quiet = 0;
        return need;
    }
    return held;
}

/* Under g_open.mu, as a graph begins (zipmoe_cache_begin_graph, tiers.c): the budgets for it, a batch's or
 * generation's.
 * Generation's hot budget needs no room for the tensor in flight (nor a prompt's reads): a miss takes the place of
 * the expert it evicts (place_plan), and one exists in its own store while the store is routed no more experts
 * than it keeps decoded. So generation's stores keep more decoded: the shares of zipmoe_cache_set_token_hot's
 * budget, or a planner's rules plus the extra slots of zipmoe_cache_set_token_room's. Not with an sm tier
 * (place_plan does not evict first there). A step (`step`: every token of the graph is one whose logits are
 * wanted: a token, speculation verifying drafts, parallel slots' tokens) is generation too, its tier less what its
 * stores decode beyond their slots (step_need), held back for the steps that follow (hold_step); another graph (a
 * prompt's batch) is generation only where what is held back already covers it. Without a hot tier, generation's
 * warm tier leaves the pages of a step's misses, held alike. Returns whether the budget is smaller now: then every
 * store gives up what it holds beyond its limits, before any store of the graph decodes beyond its own. */
int cache_begin_budgets(int64_t routed, int step) {
    uint64_t largest = 0;
    int64_t  fewest  = INT64_MAX; /* experts of the store with the fewest */
    for (const zipmoe_store * o = g_open.list; o; o = o->next) {
        largest = o->hot_size > largest ? o->hot_size : largest;
        fewest  = o->hot_size > 0 && o->info.n_expert < fewest ? o->info.n_expert : fewest;
    }
    /* a graph that may route every expert of a store is a batch whatever logits it wants (a whole prompt's) */
    step = step && routed < fewest;
    pthread_mutex_lock(&g_cfg.mu);
    /* (g_cfg.token_slots >= 0: generation's hot budget is larger than a batch's, and shared out; step_room is what
     * generation holds back for steps, in the hot tier or, without one, in the warm tier) */
    const int      possible    = g_cfg.token_slots >= 0 && routed > 0;
    const uint64_t held        = g_cfg.step_room;
    const int      fits        = possible && step_beyond(held, routed) <= held;
    const uint64_t step_room   = possible && step ? step_need(routed) : UINT64_MAX;
    const int      hot_tokens  = step ? step_room != UINT64_MAX : fits;
    const uint64_t need        = routed > 0 ? slots_bytes(routed, largest) : UINT64_MAX;
    const int      warm_tokens = !hot_tokens && warm_tokens_possible() && need < g_cfg.reserve;
    const int      tokens      = hot_tokens || warm_tokens;
    const int      was_tokens  = g_cfg.token_mode;
    const uint64_t warm_before = warm_budget_now();
    uint64_t       room        = held, token_need = 0;
    if (hot_tokens && step) {
        room = hold_step(step_room, held, fits);
    } else if (warm_tokens && step) {
        room = token_need = hold_step(need, held, held < g_cfg.reserve);
    } else if (warm_tokens) {
        token_need = held > need && held < g_cfg.reserve ? held : need;
    }
    if (tokens != g_cfg.token_mode || warm_tokens != g_cfg.token_warm || (warm_tokens && token_need != g_cfg.token_need) ||
        room != g_cfg.step_room) {
        g_cfg.token_mode  = tokens;
        cache_read_buffers_set_token_mode(tokens);
        g_cfg.token_warm  = warm_tokens;
        g_cfg.token_need  = warm_tokens ? token_need : 0;
        g_cfg.token_pages = warm_tokens ? need : 0;
        g_cfg.step_room   = room;
        g_cfg.hot_budget  = tokens ? token_hot_now() : g_cfg.hot_batch;
        cache_share_hot_slots();
        keep_reserve();
    } else if (warm_tokens && need != g_cfg.token_pages) {
        g_cfg.token_pages = need; /* (within what the warm tier leaves: need <= token_need) */
        keep_reserve();
    }
    const int shrink = (was_tokens && !tokens) || (was_tokens && hot_tokens && g_cfg.step_room > held) ||
                       warm_budget_now() < warm_before;
    pthread_mutex_unlock(&g_cfg.mu);
    return shrink;
}
