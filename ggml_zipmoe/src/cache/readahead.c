/* readahead.c - reading the next store's experts ahead of its invocation, on the reader thread, into one
 * of two buffers: after a store of the same layer, a whole prompt, or the previous layer's guess. */
#define _GNU_SOURCE
#include "io.h"

#include <fcntl.h>
#include <stdlib.h>

/* Bytes the reader reads ahead for the store invoked next (cache_read_ahead_job) go to one of two buffers
 * rather than through the page cache: a hint (POSIX_FADV_WILLNEED) left the kernel to allocate, charge, copy
 * and drop every page again, and with the hints for the store after, that was half of a budgeted run's CPU
 * time on 2 cores. With O_DIRECT the disk writes straight into the buffer. Kept between invocations (a prompt
 * reads tens of MiB a store, and fresh pages are zeroed), given back once a need fits STAGE_KEEP again.
 * Two in the process, as one graph computes at a time: the store that decodes from one while the next store's
 * bytes arrive in the other. */
static struct {
    pthread_mutex_t mu;
    prefetch_buffer buf[2];
    /* A prompt's read-ahead (tens of MiB) waits for the other buffer instead of taking a second large one: under
     * a cgroup limit the page cache of the weights that are not experts made room for it (pp512 at 40%: 244
     * against 280 tokens/s with 150 MB more room). It is started when the store decoding from the other buffer is
     * done, which still leaves its matmul to overlap. */
    zipmoe_store *  deferred; /* under mu */
    zipmoe_read_job job;      /* a read-ahead queued on its own (submit_read_ahead) */
} g_ahead = { .mu = PTHREAD_MUTEX_INITIALIZER, .job = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER } };

/* Under g_ahead.mu: the reader reads ahead for s (all its experts not in RAM, or those guessed) after what it is doing
 * now, with a job that reads nothing itself; nothing if that job is still queued. */
static void submit_read_ahead(zipmoe_store * s, int predicted) {
    pthread_mutex_lock(&g_ahead.job.mu);
    const int busy = g_ahead.job.busy;
    pthread_mutex_unlock(&g_ahead.job.mu);
    if (!busy) {
        g_ahead.job.n_items = 0;
        cache_read_ahead_job(&g_ahead.job, s, NULL, predicted);
        zipmoe_reader_submit(&g_ahead.job);
    }
}

/* By zipmoe_store_free, once s is out of the list: a read-ahead deferred or queued for s is dropped. */
void cache_prefetch_forget(const zipmoe_store * s) {
    pthread_mutex_lock(&g_ahead.mu);
    if (g_ahead.deferred == s) {
        g_ahead.deferred = NULL;
    }
    const int ahead_for_me = g_ahead.job.then.user == s; /* (set under g_ahead.mu) */
    pthread_mutex_unlock(&g_ahead.mu);
    if (ahead_for_me) {
        zipmoe_reader_finish(&g_ahead.job, 1);
    }
}

/* The idle read-ahead buffers larger than bound go back (config.c's trim of idle read buffers). */
void cache_prefetch_trim_idle(size_t bound) {
    pthread_mutex_lock(&g_ahead.mu);
    for (int i = 0; i < 2; i++) {
        if (!g_ahead.buf[i].owner && g_ahead.buf[i].cap > bound) {
            cache_read_buffer_free(&g_ahead.buf[i].data, &g_ahead.buf[i].cap);
            atomic_store(&g_stats.pf_cap_bytes[i], 0);
        }
    }
    pthread_mutex_unlock(&g_ahead.mu);
}

/* Under s->mu: gives s's read-ahead buffer back, unused or used up. */
void cache_prefetch_drop(zipmoe_store * s) {
    if (!s->pf) {
        return;
    }
    const size_t bound = cache_read_buffer_refit_limit();
    pthread_mutex_lock(&g_ahead.mu);
    s->pf->owner = NULL;
    if (s->pf->cap > bound) { /* grown under a larger read room than there is now */
        cache_read_buffer_free(&s->pf->data, &s->pf->cap);
        atomic_store(&g_stats.pf_cap_bytes[s->pf - g_ahead.buf], 0);
    }
    zipmoe_store * deferred = g_ahead.deferred;
    g_ahead.deferred           = NULL;
    if (deferred) {
        submit_read_ahead(deferred, 0);
    }
    pthread_mutex_unlock(&g_ahead.mu);
    s->pf = NULL;
    atomic_store(&s->holds_pf, 0);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        s->pf_at[e] = -1;
    }
}

/* A free buffer of at least need bytes for s, or NULL: both taken (the caller hints instead), or a large need while
 * the other buffer is in use (*deferred: read ahead when it is given back). */
static prefetch_buffer * prefetch_take(zipmoe_store * s, size_t need, int * deferred) {
    pthread_mutex_lock(&g_ahead.mu);
    *deferred = 0;
    if (need > STAGE_KEEP && (g_ahead.buf[0].owner || g_ahead.buf[1].owner)) {
        g_ahead.deferred = s;
        *deferred     = 1;
        pthread_mutex_unlock(&g_ahead.mu);
        return NULL;
    }
    prefetch_buffer * b = NULL;
    for (int i = 0; i < 2; i++) {
        if (!g_ahead.buf[i].owner && (!b || (b->cap < need && g_ahead.buf[i].cap > b->cap))) {
            b = &g_ahead.buf[i];
        }
    }
    if (b) {
        cache_read_buffer_fit(&b->data, &b->cap, need);
        atomic_store(&g_stats.pf_cap_bytes[b - g_ahead.buf], b->cap);
    }
    if (b && b->data) {
        b->owner = s;
    } else {
        b = NULL;
    }
    pthread_mutex_unlock(&g_ahead.mu);
    return b;
}

/* On the reader thread, under s->mu: gives back the buffers of stores that hold one with no invocation in flight
 * (read ahead for an invocation that found its experts decoded, say the first token's after a prompt), so that a
 * prompt's read-ahead does not wait for them forever. Their stores cannot be freed meanwhile: that waits for the
 * read-ahead in progress. */
static void prefetch_reclaim(const zipmoe_store * s) {
    for (int i = 0; i < 2; i++) {
        pthread_mutex_lock(&g_ahead.mu);
        zipmoe_store * o = g_ahead.buf[i].owner;
        pthread_mutex_unlock(&g_ahead.mu);
        if (o && o != s && pthread_mutex_trylock(&o->mu) == 0) {
            if (o->plan_key == NULL && o->pf == &g_ahead.buf[i]) {
                cache_prefetch_drop(o);
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
    cache_expert_span(s, e, span);
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
        cache_advise(s, span.offset + from, span.size - from, POSIX_FADV_WILLNEED);
        atomic_store(&s->hinted[e], 1);
    }
}

static void read_ahead(zipmoe_store * s, const zipmoe_store * like, int predicted) {
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
    cache_prefetch_drop(s); /* an earlier read-ahead that no invocation used (its experts were decoded by then) */
    size_t need = 0, largest = 0;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        zipmoe_expert_span span;
        uint64_t           from;
        if (read_ahead_from(s, like, predicted, e, &span, &from)) {
            const size_t span_bytes = cache_direct_span(s, span.offset + from, span.size - from);
            need += span_bytes;
            largest = span_bytes > largest ? span_bytes : largest;
        }
    }
    need = cache_read_buffer_bound(need, largest); /* within the read room: what does not fit, s reads for itself */
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
    /* the experts most likely routed first: where the buffer holds fewer than would be read (a prompt's read-ahead
     * within the read room), or the invocation comes before a guess is read, those read are the likeliest */
    for (int64_t i = 0; i < s->info.n_expert; i++) {
        const int64_t      e = s->ahead_order[i];
        zipmoe_expert_span span;
        uint64_t           from;
        if (!read_ahead_from(s, like, predicted, e, &span, &from)) {
            continue;
        }
        if (predicted && atomic_load(&s->waiting)) {
            break; /* the invocation came: its router decides now, and it reads the rest itself */
        }
        const size_t pad  = cache_direct_pad(s, span.offset + from);
        const size_t size = (size_t) (span.size - from);
        const size_t taken = cache_direct_span(s, span.offset + from, size);
        if (used + taken > need) {
            break; /* the buffer is full */
        }
        const int    rc   = zipmoe_pread_uncached(s->fd, cache_direct_fd(s), s->data_offset + span.offset + from,
                                                  b->data + used + pad, size);
        if (rc == ZIPMOE_OK) { /* else s reads it for itself, and reports what fails */
            s->pf_at[e]   = (int64_t) (used + pad);
            s->pf_from[e] = from;
            atomic_fetch_add(&g_stats.read_ahead_bytes, size);
            if (predicted) {
                atomic_fetch_add(&g_stats.guessed_bytes, size);
            }
        }
        used += taken;
    }
    pthread_mutex_unlock(&s->mu);
}

static void read_ahead_then(void * s, const void * like, int predicted) {
    read_ahead((zipmoe_store *) s, (const zipmoe_store *) like, predicted);
}

void cache_read_ahead_job(zipmoe_read_job * job, zipmoe_store * s, const zipmoe_store * like, int predicted) {
    job->then = (zipmoe_read_then) { .fn = s ? read_ahead_then : NULL, .user = s, .arg = like, .flag = predicted };
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
void cache_read_ahead_predicted(zipmoe_store * next, const zipmoe_store * prev) {
    if (!next || next->layer == prev->layer || !atomic_load(&next->predicted_fresh)) {
        return;
    }
    pthread_mutex_lock(&g_ahead.mu);
    if (!g_ahead.deferred) { /* (a prompt's read-ahead waits for a buffer: it goes first) */
        submit_read_ahead(next, 1);
    }
    pthread_mutex_unlock(&g_ahead.mu);
}

