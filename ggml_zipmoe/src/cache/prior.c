/* prior.c - the eviction policies' prior: the model's expert popularity in earlier runs as a head start in the
 * counting policies' scores (zipmoe_store_set_prior), the order the fill at load takes experts in, and the prior
 * file that seeds a model's stores (docs/FORMAT.md, "Priors"). */
#define _GNU_SOURCE
#include "tiers.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>

/* A prior is a head start in the counting policies' scores (lfuda, lfu, tlfu) from the expert's share of the
 * layer's routing in earlier runs: PRIOR_MEAN_USES uses for an expert of the mean share, in proportion for the others
 * (the hottest expert of a Qwen1.5-MoE layer, 1.4-2.7 times the mean share, starts 1.4-2.7 uses ahead of one never
 * routed). Measured on the replay of the Qwen trace with a run per prompt (docs/cache-and-planner.md, "Priors across
 * prompts"), the scale hardly matters: half a use to four uses lie within 0.3 points of each other at every budget
 * (the smaller ahead by tenths at 25%), and all 1-4 points above no prior (the fill at load in the prior's order
 * counts in each). One use: the prior decides among the experts a run has routed to no more than once, and a prompt
 * that routes to an expert twice or thrice overturns the head start of all but the hottest. LRU and FIFO rank by
 * time alone: they ignore the prior. Under LFUDA the prior counts in the key as uses do, so the age an eviction
 * leaves includes it. */
#define PRIOR_MEAN_USES 1

int64_t zipmoe_store_set_prior(zipmoe_store * s, const uint64_t * counts, int64_t n_expert) {
    if (!s || (counts ? n_expert != s->info.n_expert : n_expert != 0)) {
        return ZIPMOE_ERR_ARG;
    }
    long double total = 0;
    for (int64_t e = 0; counts && e < n_expert; e++) {
        total += (long double) counts[e];
    }
    const long double unit = total > 0 ? (long double) s->info.n_expert * USE_WEIGHT * PRIOR_MEAN_USES / total : 0;
    pthread_mutex_lock(&s->mu);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        s->experts[e].prior = counts ? (uint64_t) ((long double) counts[e] * unit + 0.5L) : 0;
    }
    cache_prior_order(s, s->ahead_order);
    pthread_mutex_unlock(&s->mu);
    return ZIPMOE_OK;
}

/* Under s->mu: the store's experts by prior, the highest first, ties by id (without a prior: 0, 1, 2, ...), into
 * order[s->info.n_expert]: the order the fill at load takes them in (prefill.c), and the read-ahead of a store whose
 * routing is not known yet (readahead.c, s->ahead_order). */
void cache_prior_order(const zipmoe_store * s, int32_t * order) {
    for (int64_t i = 0; i < s->info.n_expert; i++) { /* insertion sort: a few hundred experts, once at load */
        const uint64_t p = s->experts[i].prior;
        int64_t        j = i;
        for (; j > 0 && s->experts[order[j - 1]].prior < p; j--) {
            order[j] = order[j - 1];
        }
        order[j] = (int32_t) i;
    }
}

/* ---------------------------------------------------------------- the prior file (untrusted input) */

#define PRIOR_HEADER 16 /* the magic, n_layer, n_expert */

static uint64_t le64(const uint8_t * p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = v << 8 | p[i];
    }
    return v;
}

static uint32_t le32(const uint8_t * p) {
    return (uint32_t) p[0] | (uint32_t) p[1] << 8 | (uint32_t) p[2] << 16 | (uint32_t) p[3] << 24;
}

int64_t zipmoe_prior_parse(const void * data, size_t size, uint32_t * n_layer, uint32_t * n_expert) {
    const uint8_t * p = data;
    if (!p && size > 0) {
        return ZIPMOE_ERR_ARG;
    }
    if (size < PRIOR_HEADER || memcmp(p, ZIPMOE_PRIOR_MAGIC, 8) != 0) {
        return ZIPMOE_ERR_CORRUPT;
    }
    const uint32_t nl = le32(p + 8), ne = le32(p + 12);
    /* (both below 2^32: their product times 8 fits in 64 bits) */
    if (nl == 0 || ne == 0 || (uint64_t) (size - PRIOR_HEADER) != (uint64_t) nl * ne * 8) {
        return ZIPMOE_ERR_CORRUPT;
    }
    if (n_layer) {
        *n_layer = nl;
    }
    if (n_expert) {
        *n_expert = ne;
    }
    return ZIPMOE_OK;
}

static int64_t fail(int64_t rc, char * msg, size_t msg_size, const char * fmt, ...) {
    if (msg && msg_size > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_size, fmt, ap);
        va_end(ap);
    }
    return rc;
}

int64_t zipmoe_cache_seed_prior(zipmoe_store * const * stores, int64_t n_stores, const void * data, size_t size,
                                char * msg, size_t msg_size) {
    if (msg && msg_size > 0) {
        msg[0] = 0;
    }
    if ((!stores && n_stores > 0) || n_stores < 0) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "no stores");
    }
    uint32_t      nl = 0, ne = 0;
    const int64_t rc = zipmoe_prior_parse(data, size, &nl, &ne);
    if (rc == ZIPMOE_ERR_CORRUPT) {
        return fail(rc, msg, msg_size, size < PRIOR_HEADER || memcmp(data, ZIPMOE_PRIOR_MAGIC, 8) != 0
                                           ? "not a prior file (no " ZIPMOE_PRIOR_MAGIC " magic)"
                                           : "the prior file is damaged (%zu bytes, not those of its own layers "
                                             "and experts)", size);
    }
    if (rc < 0) {
        return fail(rc, msg, msg_size, "no prior file");
    }
    int highest = -1;
    for (int64_t i = 0; i < n_stores; i++) {
        const zipmoe_store * s = stores[i];
        highest = s->layer > highest ? s->layer : highest;
        if (s->layer >= 0 && s->info.n_expert != (int64_t) ne) {
            return fail(ZIPMOE_ERR_ARG, msg, msg_size, "the prior is of a model of %u experts a layer; %s has %lld",
                        ne, s->name, (long long) s->info.n_expert);
        }
    }
    if ((int64_t) highest + 1 != (int64_t) nl) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "the prior is of a model of %u layers; this one's experts are in "
                                                   "%d", nl, highest + 1);
    }
    uint64_t * counts = malloc((size_t) ne * sizeof *counts);
    if (!counts) {
        return fail(ZIPMOE_ERR_NOMEM, msg, msg_size, "out of memory");
    }
    for (int64_t i = 0; i < n_stores; i++) {
        zipmoe_store * s = stores[i];
        if (s->layer < 0) {
            continue;
        }
        const uint8_t * row = (const uint8_t *) data + PRIOR_HEADER + (size_t) s->layer * ne * 8;
        for (uint32_t e = 0; e < ne; e++) {
            counts[e] = le64(row + (size_t) e * 8);
        }
        zipmoe_store_set_prior(s, counts, (int64_t) ne); /* (its n_expert checked above) */
    }
    free(counts);
    return ZIPMOE_OK;
}

/* ---------------------------------------------------------------- a run's record (ZIPMOE_PRIOR_RECORD) */

static void put_le64(uint8_t * p, uint64_t v) {
    for (int i = 0; i < 8; i++) {
        p[i] = (uint8_t) (v >> (8 * i));
    }
}

static void put_le32(uint8_t * p, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t) (v >> (8 * i));
    }
}

int64_t zipmoe_prior_record(zipmoe_store * const * stores, int64_t n_stores, const char * path, char * msg,
                            size_t msg_size) {
    if (msg && msg_size > 0) {
        msg[0] = 0;
    }
    if ((!stores && n_stores > 0) || n_stores < 0 || !path || !*path) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "no stores or no path");
    }
    int     highest  = -1;
    int64_t n_expert = 0;
    for (int64_t i = 0; i < n_stores; i++) {
        const zipmoe_store * s = stores[i];
        if (s->layer < 0) {
            continue;
        }
        if (n_expert && s->info.n_expert != n_expert) {
            return fail(ZIPMOE_ERR_ARG, msg, msg_size, "the stores' layers have different numbers of experts");
        }
        n_expert = s->info.n_expert;
        highest  = s->layer > highest ? s->layer : highest;
    }
    if (highest < 0) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "no store of a block (blk.N.)");
    }
    const size_t n_layer = (size_t) highest + 1, size = PRIOR_HEADER + n_layer * (size_t) n_expert * 8;
    uint8_t *    data    = calloc(1, size);
    if (!data) {
        return fail(ZIPMOE_ERR_NOMEM, msg, msg_size, "out of memory");
    }
    memcpy(data, ZIPMOE_PRIOR_MAGIC, 8);
    put_le32(data + 8, (uint32_t) n_layer);
    put_le32(data + 12, (uint32_t) n_expert);
    /* a layer's gate, up and down stores see the same routing: a layer's count is the largest of its stores' */
    for (int64_t i = 0; i < n_stores; i++) {
        zipmoe_store * s = stores[i];
        if (s->layer < 0) {
            continue;
        }
        uint8_t * row = data + PRIOR_HEADER + (size_t) s->layer * (size_t) n_expert * 8;
        pthread_mutex_lock(&s->mu);
        for (int64_t e = 0; e < n_expert; e++) {
            const uint64_t a = s->experts[e].activations;
            if (a > le64(row + e * 8)) {
                put_le64(row + e * 8, a);
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    /* written beside path and renamed over it: a reader sees the whole record or none */
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp%ld", path, (long) getpid()) >= (int) sizeof tmp) {
        free(data);
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "the path is too long");
    }
    FILE * f  = fopen(tmp, "wb");
    int    ok = f && fwrite(data, 1, size, f) == size;
    ok        = (f && fclose(f) == 0) && ok;
    free(data);
    if (!ok || rename(tmp, path) != 0) {
        const int err = errno;
        unlink(tmp);
        return fail(ZIPMOE_ERR_IO, msg, msg_size, "cannot be written (%s)", strerror(err));
    }
    return ZIPMOE_OK;
}
