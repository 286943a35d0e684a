/* tiers.c - the tiers an expert can be in, the policies' contest for room and eviction. */
#define _GNU_SOURCE
#include "tiers.h"

/* ---------------------------------------------------------------- tiers and eviction */

static int in_tier(const expert_state * x, int tier) {
    switch (tier) {
        case TIER_HOT:  return x->hot;
        case TIER_WARM: return x->res == RES_FULL;
        default:        return x->res == RES_SM;
    }
}

/* LFUDA's key: the store's age at the expert's last use, plus its uses ever (an evicted expert keeps its count, a
 * ghost entry: one that comes back starts from what it earned). An eviction raises the age to the victim's key, so
 * an expert unused since gives way to newer ones once they have been used about as often since. The age a use
 * takes is read lazily, without a write on the engine's lock-free path: a use not yet seen (last_use moved) takes
 * the store's age now, and before the age moves every such use is recorded with the age it had (lfuda_age), except
 * the last plan's, which take the age its evictions leave (as a miss enters after its victim leaves). */
static uint64_t lfuda_key(const zipmoe_store * s, const expert_state * x) {
    return (x->last_use != x->aged_use ? s->age : x->aged) + x->uses * USE_WEIGHT + x->prior;
}

/* Under s->mu: an expert of key `key` leaves the cache (every tier: a decoded expert that keeps a compressed copy,
 * or one decoded for a single use without a hot tier, has not left); under LFUDA the age rises to it. */
static void lfuda_age(zipmoe_store * s, uint64_t key) {
    if (s->policy != ZIPMOE_POLICY_LFUDA || key <= s->age) {
        return;
    }
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        expert_state * x = &s->experts[e];
        if (x->last_use != x->aged_use && x->last_use != s->plan_tick) {
            x->aged     = s->age;
            x->aged_use = x->last_use;
        }
    }
    s->age = key;
}

/* What an expert is worth keeping under the policy; higher stays. */
static uint64_t score(const zipmoe_store * s, const expert_state * x, int tier) {
    switch (s->policy) {
        case ZIPMOE_POLICY_LRU:       return x->last_use;
        case ZIPMOE_POLICY_FIFO:      return tier == TIER_HOT ? x->admitted : x->admitted_res;
        case ZIPMOE_POLICY_LFU:
        case ZIPMOE_POLICY_TOKEN_LFU: return x->uses * USE_WEIGHT + x->prior;
        case ZIPMOE_POLICY_LFUDA:     return lfuda_key(s, x);
    }
    return 0;
}

/* What an expert about to enter a compressed tier offers in the contest with its residents: FIFO lets
 * the newest in, the others compare scores. */
uint64_t cache_entry_worth(const zipmoe_store * s, const expert_state * x) {
    return s->policy == ZIPMOE_POLICY_FIFO ? UINT64_MAX : score(s, x, TIER_WARM);
}

/* Whether an entrant (worth, id e) loses its contest with a resident (v_worth, id v): scores, then ids, as
 * cache_victim() orders experts (the lowest id of the lowest score goes first). One total order for every contest keeps
 * the tiers one stack, as the planner models them (tests/test_store.py). */
int cache_loses(uint64_t worth, int64_t e, uint64_t v_worth, int64_t v) {
    return v_worth > worth || (v_worth == worth && v > e);
}

/* Under s->mu: the unpinned expert of the tier to give up first, or -1. In the compressed tiers that is
 * a copy of a hot expert (worth nothing while it is hot), else the lowest score. *worth: its score (0
 * for such a copy). */
int64_t cache_victim(const zipmoe_store * s, int tier, uint64_t * worth) {
    int64_t  best       = -1;
    uint64_t best_score = UINT64_MAX;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        const expert_state * x = &s->experts[e];
        /* a routed expert is pinned: decoded, the op's matmul reads it; in a compressed tier, while a plan
         * decodes from it (publish and trims come after), or its caller streams it (until the next plan) */
        if ((x->routed && (tier == TIER_HOT || s->planning || x->streamed)) || !in_tier(x, tier)) {
            continue;
        }
        const uint64_t sc = tier != TIER_HOT && x->hot ? 0 : score(s, x, tier);
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

/* The bytes of e's copy in a compressed tier (res: RES_SM or RES_FULL). */
uint64_t cache_resident_size(const zipmoe_store * s, int64_t e, int res) {
    return res == RES_FULL ? cache_region_size(s, e) : res == RES_SM ? s->sm_size : 0;
}

void cache_drop_region(zipmoe_store * s, int64_t e) {
    expert_state * x = &s->experts[e];
    if (x->res == RES_FULL) {
        const uint64_t size = cache_region_size(s, e);
        s->warm_used -= size;
        cache_account(&g_stats.warm_bytes, -(int64_t) size);
    } else if (x->res == RES_SM) {
        s->sm_used -= s->sm_size;
        cache_account(&g_stats.sm_bytes, -(int64_t) s->sm_size);
    }
    cache_region_free(x->region, cache_resident_size(s, e, x->res));
    x->region = NULL;
    x->res    = RES_NONE;
}

/* Under s->mu: warm expert e gives up its codes and keeps its sign+mantissa plane if the sm tier takes
 * it; else all. No byte is read again. */
void cache_demote_warm(zipmoe_store * s, int64_t e) {
    expert_state * x     = &s->experts[e];
    const uint64_t worth  = cache_entry_worth(s, x);
    uint8_t *      region = x->region;
    x->region = NULL; /* out of every tier while cache_make_room looks for victims */
    x->res    = RES_NONE;
    const uint64_t size = cache_region_size(s, e);
    s->warm_used -= size;
    cache_account(&g_stats.warm_bytes, -(int64_t) size);
    uint8_t * sm = NULL;
    if (!x->hot && cache_make_room(s, TIER_SM, s->sm_size, worth, e) &&
        (sm = cache_region_resize(region, size, s->sm_size)) != NULL) { /* the plane comes first in a region */
        x->region = sm;
        x->res    = RES_SM;
        x->admitted_res = atomic_load(&g_open.tick);
        s->sm_used += s->sm_size;
        cache_account(&g_stats.sm_bytes, (int64_t) s->sm_size);
        return;
    }
    cache_region_free(region, size);
    if (!x->hot) {
        lfuda_age(s, worth); /* out of every tier */
    }
}

/* Under s->mu: makes need bytes free in a compressed tier for expert `entrant` by giving up experts that
 * rank below it (worth, then id: cache_loses(); warm ones are demoted to sm). Whether the bytes fit now. */
int cache_make_room(zipmoe_store * s, int tier, uint64_t need, uint64_t worth, int64_t entrant) {
    const uint64_t limit = tier == TIER_WARM ? s->warm_limit : s->sm_limit;
    uint64_t *     used  = tier == TIER_WARM ? &s->warm_used : &s->sm_used;
    if (need > limit) {
        return 0;
    }
    while (*used + need > limit) {
        uint64_t      v_worth;
        const int64_t v = cache_victim(s, tier, &v_worth);
        if (v < 0 || cache_loses(worth, entrant, v_worth, v)) {
            return 0;
        }
        if (tier == TIER_WARM) {
            cache_demote_warm(s, v);
        } else {
            lfuda_age(s, v_worth); /* (0 for a copy of a hot expert, which stays) */
            cache_drop_region(s, v);
        }
    }
    return 1;
}

/* Under s->mu: expert e leaves the hot tier and its place, which gives its pages back (cache_vacate_place), or, with
 * keep_pages, keeps them for an expert about to be decoded there (the caller hands the place on). */
static void release_hot(zipmoe_store * s, int64_t e, int keep_pages) {
    expert_state * x = &s->experts[e];
    if (keep_pages) {
        cache_forget_huge_pages(s, x->place);
        s->places[x->place].expert = -1;
    } else {
        cache_vacate_place(s, x->place);
    }
    x->place = -1;
    x->hot   = 0;
    s->hot_used -= s->hot_size;
    cache_account(&g_stats.hot_bytes, -(int64_t) s->hot_size);
    atomic_fetch_add(&g_stats.evictions, 1);
}

/* Under s->mu: hot expert e leaves the hot tier. Without a compressed copy it keeps its sign+mantissa
 * plane, taken from the decoded values, if the sm tier takes it: no disk read for that half later.
 * keep_pages: as release_hot. Returns the place it left. */
int64_t cache_evict_hot(zipmoe_store * s, int64_t e, int keep_pages) {
    expert_state * x   = &s->experts[e];
    const uint64_t key = score(s, x, TIER_HOT);
    x->hot = 0; /* not a hot copy any more: its score counts in the contests below */
    /* one the last invocation routed (more than the hot slots: a trim) enters the sm tier as it entered the hot
     * one, whatever its score: the top of the stack is what the last token routed */
    const uint64_t worth = x->last_use == s->plan_tick ? UINT64_MAX : cache_entry_worth(s, x);
    if (x->res == RES_NONE && s->sm_limit > 0 && cache_make_room(s, TIER_SM, s->sm_size, worth, e)) {
        uint8_t * sm = cache_region_alloc(s->sm_size);
        if (sm) {
            zipmoe_split_sm_bf16(place_addr(s, x->place), (size_t) s->info.n_per_expert, sm);
            x->region = sm;
            x->res    = RES_SM;
            x->admitted_res = atomic_load(&g_open.tick);
            s->sm_used += s->sm_size;
            cache_account(&g_stats.sm_bytes, (int64_t) s->sm_size);
        }
    }
    x->hot = 1;
    const int64_t p = x->place;
    release_hot(s, e, keep_pages);
    if (x->res == RES_NONE) {
        lfuda_age(s, key); /* out of every tier: a copy kept in a compressed tier ages nothing yet */
    }
    return p;
}

/* Under s->mu: every tier down to its limit, never touching a pinned expert. */
void cache_settle(zipmoe_store * s) {
    int64_t v;
    while (s->hot_used > s->hot_limit && (v = cache_victim(s, TIER_HOT, NULL)) >= 0) {
        cache_evict_hot(s, v, 0);
    }
    uint64_t worth;
    while (s->warm_used > s->warm_limit && (v = cache_victim(s, TIER_WARM, NULL)) >= 0) {
        cache_demote_warm(s, v);
    }
    while (s->sm_used > s->sm_limit && (v = cache_victim(s, TIER_SM, &worth)) >= 0) {
        lfuda_age(s, worth);
        cache_drop_region(s, v);
    }
    /* (the compressed tiers too: experts a caller streams stay pinned beyond them until the next plan) */
    atomic_store(&s->fast_ok, s->hot_used <= s->hot_limit && s->warm_used <= s->warm_limit &&
                                  s->cfg_gen == atomic_load(&g_cfg.gen));
}

/* Under s->mu: the other stores give up what their last invocation pinned beyond their limits. Their matmuls
 * ran before this op (one graph computes at a time, and each op's matmul runs before the next expert tensor's
 * op: the graph orders a matmul right after the op that feeds it, checked in zipmoe-llama.cpp), so the decoded
 * working set beyond the limits stays one store's: a prompt's gate, up and down tensors take turns with the
 * same allowance. Without store turns (after a graph that broke that order), only the stores of other layers,
 * whose matmuls ran before this layer's. A store busy with a plan (or a read-ahead into it) is left alone. */
void cache_trim_others(const zipmoe_store * s) {
    /* s->mu is held: the list's lock only if free, as zipmoe_cache_activations takes it before a store's (the
     * next plan trims instead) */
    const int turns = atomic_load(&g_cfg.store_turns);
    if ((!turns && s->layer < 0) || pthread_mutex_trylock(&g_open.mu) != 0) {
        return;
    }
    for (zipmoe_store * o = g_open.list; o; o = o->next) {
        /* (a store on the fast path is within its limits, unless they changed since it settled) */
        const int settled = atomic_load(&o->fast_ok) && atomic_load(&o->cfg_gen) == atomic_load(&g_cfg.gen);
        if (o == s || (!turns && (o->layer < 0 || o->layer == s->layer)) || settled ||
            pthread_mutex_trylock(&o->mu) != 0) {
            continue;
        }
        if (o->plan_key == NULL) {
            for (int64_t e = 0; e < o->info.n_expert; e++) {
                o->experts[e].routed   = 0;
                o->experts[e].streamed = 0;
            }
            if (o->cfg_gen != atomic_load(&g_cfg.gen)) {
                cache_refresh_limits(o);
            }
            cache_settle(o);
        }
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&g_open.mu);
}

/* A graph begins: the budgets for it (cache_begin_budgets), and, back to a smaller budget, every store down to its
 * limits now. */
static void begin(int64_t routed, int step) {
    atomic_fetch_add(&g_open.op_seq, 1); /* a graph's first invocation of a store is never a late sibling of its last one */
    pthread_mutex_lock(&g_open.mu);
    const int shrink = cache_begin_budgets(routed, step);
    for (zipmoe_store * o = shrink ? g_open.list : NULL; o; o = o->next) {
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
            cache_refresh_limits(o);
            cache_settle(o);
        }
        pthread_mutex_unlock(&o->mu);
    }
    pthread_mutex_unlock(&g_open.mu);
}

void zipmoe_cache_begin_graph(int64_t routed) { begin(routed, 0); }

void zipmoe_cache_begin_step(int64_t routed) { begin(routed, 1); }
