/* routing.c - what the stores remember of the model's routing, for the planner: activation counts
 * and a log of the last invocations' routed experts. */
#define _GNU_SOURCE
#include "tiers.h"


/* Remembers which experts an invocation routed to, by one thread of it: one entry a generated token; a prompt's
 * batch is one entry too, the union of its rows, since they are all used at once (one tick). The entry is
 * written before it is counted, so a reader can tell the ones it may have torn. */
void cache_log_route(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
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

int64_t zipmoe_cache_activations(const char * prefix, uint64_t * counts, int64_t n) {
    if (!prefix || !counts || n < 0) {
        return ZIPMOE_ERR_ARG;
    }
    memset(counts, 0, (size_t) n * sizeof *counts);
    int64_t n_expert = 0;
    pthread_mutex_lock(&g_open.mu);
    for (zipmoe_store * s = g_open.list; s; s = s->next) {
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
    pthread_mutex_unlock(&g_open.mu);
    return n_expert;
}

int64_t zipmoe_cache_routing(const char * prefix, uint64_t * masks, int64_t words, int64_t max_tokens) {
    if (!prefix || !masks || words < 1 || max_tokens < 0) {
        return ZIPMOE_ERR_ARG;
    }
    int64_t written = 0;
    pthread_mutex_lock(&g_open.mu);
    zipmoe_store * s = g_open.list;
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
    pthread_mutex_unlock(&g_open.mu);
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

