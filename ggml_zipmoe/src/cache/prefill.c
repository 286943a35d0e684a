/* prefill.c - fills a freshly loaded model's cache tiers before its first token.
 *
 * Without it the first tokens pay for every expert's first read and decode while the user waits (a 32-token
 * run from a cold start spent 60% of its time there). A plain model gets the same from llama.cpp's mmap
 * read-ahead and warm-up, at load. Each store routes batches of its own experts through the ordinary
 * zipmoe_store_materialize path, so every budget, tier and transition rule holds as in generation; the batches
 * are as large as the hot tier (the last one stays decoded, the earlier ones fall into the compressed tiers as
 * the policy has them), or, without a hot tier, one batch of what the compressed tiers hold. Store after store,
 * so the decoded working set beyond the tiers stays one store's. Where a store's hot tier holds every expert, the
 * threads then make its decoded experts huge pages (cache_collapse): done later on the reader thread, the
 * kernel's copying of the whole model held the first ~200 tokens to a third of their speed on 2 cores. */
#define _GNU_SOURCE
#include "cache-impl.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>

/* The experts a store's tiers hold under the current configuration (the hot ones among them in *hot_slots); its
 * invocations until prefill_end count nothing of the model's routing. */
static int64_t prefill_begin(zipmoe_store * s, int64_t * hot_slots) {
    *hot_slots = 0;
    if (!s || s->fd < 0) {
        return 0;
    }
    pthread_mutex_lock(&s->mu);
    cache_refresh_limits(s);
    const uint64_t n    = (uint64_t) s->info.n_expert;
    const uint64_t hot  = s->hot_size ? s->hot_limit / s->hot_size : 0;
    const uint64_t warm = s->mean_region ? s->warm_limit / s->mean_region : 0;
    const uint64_t sm   = s->sm_size ? s->sm_limit / s->sm_size : 0;
    const int64_t  want = (int64_t) (hot >= n || warm >= n || sm >= n || hot + warm + sm >= n ? n : hot + warm + sm);
    s->prefilling = want > 0; /* until prefill_end */
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

static void prefill_end(zipmoe_store * s) {
    pthread_mutex_lock(&s->mu);
    s->prefilling = 0;
    pthread_mutex_unlock(&s->mu);
}

/* Once filled, huge pages now for a store whose hot tier holds every expert (else nothing): on the prefill's
 * threads at load rather than on the reader thread during the first tokens; 0 if reads interrupted it. */
static int prefill_collapse(zipmoe_store * s) {
    if (!s || s->fd < 0 || s->use_slots || s->n_hp == 0) {
        return 0;
    }
    return cache_collapse(s);
}

typedef struct {
    zipmoe_store *  s;
    const int32_t * ids;
    int64_t         n;
} prefill_job;

typedef struct {
    prefill_job *     jobs;
    int64_t           n_jobs;
    zipmoe_store * const * stores; /* to collapse once every batch is done, stores[i] by thread i % nth */
    int64_t           n_stores;
    int               nth;
    pthread_barrier_t barrier; /* a batch is published before the next begins (the engine's graph barrier) */
    pthread_mutex_t   mu;
    pthread_cond_t    cv;
    int               go; /* nth is final: the threads may begin */
    _Atomic uint8_t * failed; /* per job: a thread of it failed */
} prefill_run;

typedef struct {
    prefill_run * run;
    int           ith;
} prefill_thread;

static void run_jobs(prefill_run * r, int ith) {
    for (int64_t i = 0; i < r->n_jobs; i++) {
        const prefill_job * j  = &r->jobs[i];
        const int64_t       rc = zipmoe_store_materialize(j->s, j, j->ids, j->n, 1, sizeof(int32_t),
                                                          (size_t) j->n * sizeof(int32_t), NULL, ith, r->nth);
        if (rc < 0) {
            atomic_store(&r->failed[i], 1);
        }
        pthread_barrier_wait(&r->barrier);
    }
    for (int64_t i = ith; i < r->n_stores; i += r->nth) {
        prefill_collapse(r->stores[i]);
    }
}

static void * thread_main(void * arg) {
    prefill_thread * t = arg;
    prefill_run *    r = t->run;
    pthread_mutex_lock(&r->mu);
    while (!r->go) {
        pthread_cond_wait(&r->cv, &r->mu);
    }
    pthread_mutex_unlock(&r->mu);
    if (t->ith < r->nth) {
        run_jobs(r, t->ith);
    }
    return NULL;
}

/* Layer order; within a layer, the order the stores were given in (n holds it while sorting: qsort is not stable) */
static int by_layer(const void * a, const void * b) {
    const prefill_job * x = a, * y = b;
    const int lx = x->s->layer, ly = y->s->layer;
    return lx != ly ? (lx < ly ? -1 : 1) : (x->n < y->n ? -1 : x->n > y->n);
}

int64_t zipmoe_cache_prefill(zipmoe_store * const * stores, int64_t n_stores, int n_threads,
                             zipmoe_prefill_stats * out) {
    if ((!stores && n_stores > 0) || n_stores < 0) {
        return ZIPMOE_ERR_ARG;
    }
    const uint64_t t0 = zipmoe_now_ns();
    zipmoe_prefill_stats stats = { 0, 0, 0 };
    /* one "job" per store first, sorted by layer; then expanded into its batches */
    prefill_job * order = calloc((size_t) n_stores + 1, sizeof *order);
    int64_t *     want  = calloc((size_t) n_stores + 1, sizeof *want);
    int64_t *     hot   = calloc((size_t) n_stores + 1, sizeof *hot);
    int32_t *     ids_all = NULL; /* each store's experts in its prior's order (cache_prior_order): its batches are runs */
    prefill_job *     jobs   = NULL;
    _Atomic uint8_t * failed = NULL;
    int64_t           rc = ZIPMOE_OK, n_jobs = 0;
    if (!order || !want || !hot) {
        rc = ZIPMOE_ERR_NOMEM;
        goto done;
    }
    for (int64_t i = 0; i < n_stores; i++) {
        order[i] = (prefill_job) { stores[i], NULL, i };
    }
    qsort(order, (size_t) n_stores, sizeof *order, by_layer);
    uint64_t n_ids = 0;
    for (int64_t i = 0; i < n_stores; i++) {
        want[i] = prefill_begin(order[i].s, &hot[i]);
        n_ids  += want[i] > 0 ? (uint64_t) order[i].s->info.n_expert : 0;
        n_jobs += want[i] == 0 ? 0 : hot[i] == 0 ? 1 : (want[i] + hot[i] - 1) / hot[i];
    }
    ids_all = malloc((size_t) n_ids * sizeof *ids_all + 1);
    jobs    = calloc((size_t) n_jobs + 1, sizeof *jobs);
    failed  = calloc((size_t) n_jobs + 1, sizeof *failed);
    if (!ids_all || !jobs || !failed) {
        rc = ZIPMOE_ERR_NOMEM;
        goto end;
    }
    int64_t k = 0;
    for (int64_t i = 0, at = 0; i < n_stores; i++) {
        if (want[i] == 0) {
            continue;
        }
        int32_t * const ids = ids_all + at; /* the most used experts first: the last batch, kept decoded */
        at += order[i].s->info.n_expert;
        pthread_mutex_lock(&order[i].s->mu);
        cache_prior_order(order[i].s, ids);
        pthread_mutex_unlock(&order[i].s->mu);
        if (hot[i] == 0) { /* no hot tier: one batch, decoded once, for the compressed tiers to keep */
            jobs[k++] = (prefill_job) { order[i].s, ids, want[i] };
            continue;
        }
        /* the experts beyond the hot ones first: they fall into the compressed tiers as the next batch displaces them */
        for (int64_t b = hot[i]; b < want[i]; b += hot[i]) {
            jobs[k++] = (prefill_job) { order[i].s, ids + b, want[i] - b < hot[i] ? want[i] - b : hot[i] };
        }
        jobs[k++] = (prefill_job) { order[i].s, ids, hot[i] };
    }

    prefill_run r = { .jobs = jobs, .n_jobs = n_jobs, .stores = stores, .n_stores = n_stores, .nth = 1, .failed = failed };
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.cv, NULL);
    const int        want_threads = n_threads < 1 ? 1 : n_threads > 256 ? 256 : n_threads;
    pthread_t        tid[256];
    prefill_thread   targ[256];
    int              created = 0;
    for (int t = 1; t < want_threads; t++) { /* fewer threads if the system refuses some */
        targ[t] = (prefill_thread) { &r, t };
        if (pthread_create(&tid[t], NULL, thread_main, &targ[t]) != 0) {
            break;
        }
        created++;
    }
    r.nth = created + 1;
    pthread_barrier_init(&r.barrier, NULL, (unsigned) r.nth);
    pthread_mutex_lock(&r.mu);
    r.go = 1;
    pthread_cond_broadcast(&r.cv);
    pthread_mutex_unlock(&r.mu);
    run_jobs(&r, 0);
    for (int t = 1; t <= created; t++) {
        pthread_join(tid[t], NULL);
    }
    pthread_barrier_destroy(&r.barrier);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.cv);
    for (int64_t j = 0; j < n_jobs; j++) {
        if (atomic_load(&failed[j])) {
            stats.failed++;
        } else {
            stats.experts += (uint64_t) jobs[j].n;
        }
    }
end:
    free(jobs);
    free((void *) failed);
    for (int64_t i = 0; i < n_stores; i++) {
        char msg[8];
        if (want[i] > 0) {
            prefill_end(order[i].s);
            zipmoe_store_take_error(order[i].s, msg, sizeof msg); /* see above: the first use reports it */
        }
    }
done:
    free(order);
    free(want);
    free(hot);
    free(ids_all);
    stats.ns = zipmoe_now_ns() - t0;
    if (out) {
        *out = stats;
    }
    return rc < 0 ? rc : (int64_t) stats.experts;
}
