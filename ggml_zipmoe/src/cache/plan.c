/* plan.c - the plan of an invocation: which routed experts are decoded, from what, into which places,
 * and the reads handed to the reader thread. */
#define _GNU_SOURCE
#include "tiers.h"

#include <fcntl.h>

/* Under s->mu: how routed expert e, not hot, is decoded: from what is in RAM, reading the rest, and
 * which compressed tier keeps its bytes afterwards (admitted now, so reads land in place). */
static void plan_expert(zipmoe_store * s, int64_t e, uint64_t tick, plan_item * it) {
    expert_state *     x = &s->experts[e];
    zipmoe_expert_span span;
    cache_expert_span(s, e, &span);
    /* with a hot tier the expert is about to be decoded and kept: what a compressed tier takes of it now is a
     * copy, worth nothing while it is hot. It takes free room or another copy's, never an expert that only a
     * compressed tier holds; the expert enters those tiers for good when it leaves the hot one (cache_evict_hot),
     * so that hot, sm and cold stay one stack, as the planner models them. Without a hot tier the first
     * compressed tier is the top of the stack, and a routed expert always enters it, as one always enters
     * the hot tier: the policy chooses whom it evicts. */
    const uint64_t worth   = s->hot_limit > 0 ? 0 : UINT64_MAX;
    const int64_t  entrant = s->hot_limit > 0 ? ANY_COPY : e;
    memset(it, 0, sizeof *it);
    it->expert = e;
    atomic_init(&it->chunks_left, s->info.n_chunks);
    if (x->res == RES_FULL) {
        atomic_fetch_add(s->prefilling ? &g_stats.prefill_dummy : &g_stats.hits_warm, 1);
    } else if (x->res == RES_SM) {
        atomic_fetch_add(s->prefilling ? &g_stats.prefill_dummy : &g_stats.hits_sm, 1);
        it->read_codes = 1;
        /* promote: the codes are read anyway; keep them if the warm tier takes the expert */
        uint8_t * region = x->region;
        x->region = NULL; /* out of the sm tier while the warm tier makes room */
        x->res    = RES_NONE;
        s->sm_used -= s->sm_size;
        cache_account(&g_stats.sm_bytes, -(int64_t) s->sm_size);
        uint8_t * full = cache_make_room(s, TIER_WARM, span.size, worth, entrant) ? cache_region_resize(region, s->sm_size, span.size)
                                                                           : NULL;
        if (full) {
            x->region = full;
            x->res    = RES_FULL;
            x->admitted_res = tick;
            s->warm_used += span.size;
            cache_account(&g_stats.warm_bytes, (int64_t) span.size);
        } else {
            x->region = region;
            x->res    = RES_SM;
            s->sm_used += s->sm_size;
            cache_account(&g_stats.sm_bytes, (int64_t) s->sm_size);
        }
    } else {
        atomic_fetch_add(s->prefilling ? &g_stats.prefill_dummy : &g_stats.misses, 1);
        it->read_sm    = s->sm_size > 0; /* (a byte-layout region is its chunks' codes: nothing before them) */
        it->read_codes = 1;
        uint8_t * region = NULL;
        if (cache_make_room(s, TIER_WARM, span.size, worth, entrant) && (region = cache_region_alloc(span.size)) != NULL) {
            x->res = RES_FULL;
            s->warm_used += span.size;
            cache_account(&g_stats.warm_bytes, (int64_t) span.size);
        } else if (s->sm_size > 0 && cache_make_room(s, TIER_SM, s->sm_size, worth, entrant) &&
                   (region = cache_region_alloc(s->sm_size)) != NULL) { /* (a raw store has no sm plane) */
            x->res = RES_SM;
            s->sm_used += s->sm_size;
            cache_account(&g_stats.sm_bytes, (int64_t) s->sm_size);
        }
        x->region       = region;
        x->admitted_res = tick;
    }
    it->sm    = x->region;
    it->codes = x->res == RES_FULL ? x->region : NULL;
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

/* Under s->mu, at the end of cache_make_plan: a place for each planned expert that has none. Where the entrants take
 * the hot tier over its limit, the experts that publish() would evict for them (cache_settle: the unpinned ones of
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
    atomic_fetch_add(&g_stats.decoding_bytes, s->plan_decoding);
    for (int64_t j = 0; j < s->plan_n; j++) {
        const int64_t  e = s->plan[j].expert;
        expert_state * x = &s->experts[e];
        if (x->place >= 0) {
            continue; /* decoded and decoded again in place (no hot tier) */
        }
        int64_t p = -1;
        if (reuse && s->hot_used + entering + s->hot_size > s->hot_limit) {
            const int64_t v = cache_victim(s, TIER_HOT, NULL);
            if (v >= 0) {
                p = cache_evict_hot(s, v, 1);
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

/* Under s->mu, in cache_make_plan after the uses are counted: which routed warm experts a streaming caller decodes
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
            const int64_t v = cache_victim(s, TIER_HOT, &v_worth);
            if (v >= 0 && !cache_loses(cache_entry_worth(s, x), e, v_worth, v)) {
                contest = 0;
                continue;
            }
        }
        x->streamed = 1;
        atomic_fetch_add(&g_stats.hits_warm, 1);
        atomic_fetch_add(&g_stats.streamed, 1);
    }
}

/* Under s->mu: the plan of a new invocation. Returns an out-of-range expert id, or -1. */
int64_t cache_make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
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
        cache_log_route(s, ids, ne0, ne1, nb0, nb1);
    }
    if (s->cfg_gen != atomic_load(&g_cfg.gen)) {
        cache_refresh_limits(s);
    }
    atomic_store(&s->streak, 0);
    atomic_store(&s->predicted_fresh, 0);
    cache_trim_others(s);
    /* the graph's order, for the next prompt's read-ahead; not the prefill's (layer by layer in the file's order),
     * which made a model's first prompt read ahead for stores that came later: 1.8 GB read for 1.1 GB decoded */
    zipmoe_store * prev = s->prefilling ? NULL : atomic_exchange(&g_open.last_planned, s);
    if (prev && prev != s) {
        atomic_store(&prev->next_store, s);
    }
    for (int64_t e = 0; e < n_expert; e++) { /* read ahead for nothing: the page cache must not keep it */
        if (atomic_exchange(&s->hinted[e], 0) && !s->experts[e].routed) {
            zipmoe_expert_span span;
            cache_expert_span(s, e, &span);
            cache_advise(s, span.offset, span.size, POSIX_FADV_DONTNEED);
        }
    }
    const int      decode_all = s->hot_limit == 0; /* no hot tier: decode on every use */
    const uint64_t tick       = atomic_fetch_add(&g_open.tick, 1);
    s->plan_tick              = tick;
    for (int64_t e = 0; e < n_expert; e++) {
        expert_state * x = &s->experts[e];
        if (x->routed) {
            x->last_use = tick;
            if (s->prefilling) {
                continue; /* the model's own routing decides what is worth keeping */
            }
            if (x->hot && !decode_all) {
                atomic_fetch_add(&g_stats.hits_hot, 1);
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

/* Under s->mu, after cache_schedule_reads (the reads are in flight meanwhile: mapping takes ~0.2 ms an expert, which
 * a token's every store spent before its first read had started), before any thread decodes: the planned experts'
 * ranges get the pages of a slot, so decoding neither faults nor zeroes them. */
void cache_map_plan(zipmoe_store * s) {
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
void cache_end_decoding(zipmoe_store * s) {
    atomic_fetch_sub(&g_stats.decoding_bytes, s->plan_decoding);
    s->plan_decoding = 0;
}

/* Under s->mu: whether item it's bytes were read ahead (readahead.c); then it points at them, copying
 * into the tier that keeps them what it lacks, and nothing is left to read. */
static int use_prefetched(zipmoe_store * s, plan_item * it) {
    const int64_t e = it->expert;
    if (!s->pf || s->pf_at[e] < 0 || !(it->read_sm || it->read_codes)) {
        return 0;
    }
    const expert_state * x = &s->experts[e];
    zipmoe_expert_span   span;
    cache_expert_span(s, e, &span);
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
    atomic_fetch_add(&g_stats.ahead_used, 1);
    if (s->pf_guessed) {
        atomic_fetch_add(&g_stats.guesses_used, 1);
    }
    return 1;
}

/* Under s->mu, after cache_make_plan: hands the plan's reads to the reader thread, one or two large reads per expert
 * into the region that keeps them or into the staging buffer, in the plan's order (what is in RAM is decoded
 * first, meanwhile). Without the reader or the buffer, the decoding threads read chunk by chunk instead. */
/* The bytes item it takes in the staging buffer (0: none, its reads go into the warm tier's region): the codes of
 * an sm expert, else the whole region, each in its span of O_DIRECT blocks. */
static size_t staged_bytes(const zipmoe_store * s, const expert_state * x, const zipmoe_expert_span * span) {
    if (x->res == RES_FULL) {
        return 0;
    }
    return x->res == RES_SM ? cache_direct_span(s, span->offset + span->exp_offset, span->size - span->exp_offset)
                            : cache_direct_span(s, span->offset, span->size);
}

void cache_schedule_reads(zipmoe_store * s) {
    size_t  need    = 0, largest = 0;
    int64_t n_reads = 0;
    for (int64_t j = 0; j < s->plan_n; j++) {
        plan_item *          it = &s->plan[j];
        const expert_state * x  = &s->experts[it->expert];
        zipmoe_expert_span   span;
        cache_expert_span(s, it->expert, &span);
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
    const size_t cap = cache_read_buffer_bound(need, largest);
    /* once this store's reads are done, the reader reads the next store's ahead, which then overlap this store's
     * compute instead of following it: a prompt routes to most experts of every layer; a store of the same
     * layer (gate, up, down) routes to exactly these */
    zipmoe_store * next = atomic_load(&s->next_store);
    if (s->prefilling) {
        next = NULL; /* the prefill fills each store with what its tiers keep, not what a prompt reads */
    }
    if (next && 2 * s->plan_n >= s->info.n_expert) {
        cache_read_ahead_job(&s->job, next, NULL, 0);
    } else if (next && s->layer >= 0 && next->layer == s->layer && next->info.n_expert == s->info.n_expert) {
        cache_read_ahead_job(&s->job, next, s, 0);
    } else if (next && atomic_load(&next->predicted_fresh)) { /* the next layer's, as its router is guessed */
        cache_read_ahead_job(&s->job, next, NULL, 1);
    } else {
        cache_read_ahead_job(&s->job, NULL, NULL, 0);
    }
    cache_staging_trim(cap);
    uint8_t * stage = n_reads && need ? cache_staging_take(s, cap) : NULL;
    if ((n_reads == 0 && !s->job.then.fn) || (need && !stage)) {
        for (int64_t j = 0; j < s->plan_n && n_reads; j++) { /* synchronous: let the kernel read ahead */
            zipmoe_expert_span span;
            cache_expert_span(s, s->plan[j].expert, &span);
            if ((s->plan[j].read_sm || s->plan[j].read_codes) && !s->plan[j].prefetched) {
                cache_advise(s, span.offset, span.size, POSIX_FADV_WILLNEED);
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
        cache_expert_span(s, it->expert, &span);
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
            const size_t pad         = cache_direct_pad(s, span.offset + span.exp_offset);
            item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset + span.exp_offset, codes_size, stage + used + pad, 1 };
            it->sm         = x->region;
            it->codes      = stage + used + pad;
            it->codes_bias = span.exp_offset;
        } else { /* kept nowhere: the whole region staged */
            const size_t pad         = cache_direct_pad(s, span.offset);
            item->seg[item->n_seg++] = (zipmoe_read_seg) { span.offset, span.size, stage + used + pad, 1 };
            it->sm    = stage + used + pad;
            it->codes = stage + used + pad;
        }
        used += staged;
        it->staged = 1;
    }
    s->job.fd      = s->fd;
    s->job.dfd     = cache_direct_fd(s);
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
        cache_staging_give(s);
        return;
    }
    s->job_active = 1;
}

