/* stats.c - what zipmoe_stats reports of the process-wide counters (counters.c, the reader's, the slots'), the
 * time ledger (zipmoe-ledger.h) and each store's first decoding error. */
#define _GNU_SOURCE
#include "cache-impl.h"
#include "zipmoe-ledger.h"

#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- statistics and errors */

void zipmoe_stats_get(zipmoe_stats * out) {
    out->stores              = atomic_load(&g_stats.stores);
    out->hot_bytes           = atomic_load(&g_stats.hot_bytes);
    out->warm_bytes          = atomic_load(&g_stats.warm_bytes);
    out->peak_hot_bytes      = atomic_load(&g_stats.peak_hot);
    out->experts_decoded     = atomic_load(&g_stats.experts);
    out->chunks_decoded      = atomic_load(&g_stats.chunks);
    out->bytes_decoded       = atomic_load(&g_stats.bytes);
    out->decode_ns           = atomic_load(&g_stats.ns);
    out->materialize_calls   = atomic_load(&g_stats.calls);
    out->hits_hot            = atomic_load(&g_stats.hits_hot);
    out->hits_warm           = atomic_load(&g_stats.hits_warm);
    out->misses              = atomic_load(&g_stats.misses);
    zipmoe_reader_totals(&out->bytes_read, &out->read_ns);
    out->evictions           = atomic_load(&g_stats.evictions);
    out->sm_bytes            = atomic_load(&g_stats.sm_bytes);
    out->hits_sm             = atomic_load(&g_stats.hits_sm);
    out->stall_ns            = atomic_load(&g_stats.stall_ns);
    out->peak_resident_bytes = atomic_load(&g_stats.peak_resident);
    out->staging_bytes = atomic_load(&g_stats.stage_cap_bytes) + atomic_load(&g_stats.pf_cap_bytes[0]) + atomic_load(&g_stats.pf_cap_bytes[1]);
    out->pool_bytes          = zipmoe_slots_kept();
    out->reading_calls       = atomic_load(&g_stats.reading_calls);
    out->bytes_read_ahead    = atomic_load(&g_stats.read_ahead_bytes);
    out->bytes_read_guessed  = atomic_load(&g_stats.guessed_bytes);
    out->guesses_used        = atomic_load(&g_stats.guesses_used);
    out->staging_transient_bytes = cache_read_buffers_transient();
    out->decoding_bytes          = atomic_load(&g_stats.decoding_bytes);
    out->experts_streamed        = atomic_load(&g_stats.streamed);
    out->ahead_used              = atomic_load(&g_stats.ahead_used);
}

/* ---------------------------------------------------------------- the time ledger (zipmoe-ledger.h) */

enum { LEDGER_PARTS = ZIPMOE_LEDGER_NONE };

static struct {
    _Atomic uint64_t graphs, tokens, between;
    _Atomic uint64_t part[LEDGER_PARTS];
    _Atomic uint64_t epoch; /* bumped by a reset: a thread's gap from before it is not counted */
} g_ledger;

/* The calling thread's timeline: its part now (NONE: not on one), since when, and what it counted so far in this
 * graph (added to the sums once, at the graph's end: no atomics per switch). */
static _Thread_local int      tl_part = ZIPMOE_LEDGER_NONE;
static _Thread_local uint64_t tl_since;
static _Thread_local uint64_t tl_part_ns[LEDGER_PARTS];
static _Thread_local uint64_t tl_end;   /* its last graph's end, 0 before one */
static _Thread_local uint64_t tl_epoch; /* the reset epoch of tl_end */

int zipmoe_ledger_switch(int part) {
    const int was = tl_part;
    if (was == ZIPMOE_LEDGER_NONE || part < 0 || part >= LEDGER_PARTS) {
        return ZIPMOE_LEDGER_NONE;
    }
    if (part == was) {
        return was; /* (no clock read: on a machine without a fast vDSO clock one costs some 140 ns) */
    }
    const uint64_t now = zipmoe_now_ns();
    tl_part_ns[was] += now - tl_since;
    tl_since = now;
    tl_part  = part;
    return was;
}

void zipmoe_ledger_graph_begin(void) {
    const uint64_t now = zipmoe_now_ns();
    if (tl_part != ZIPMOE_LEDGER_NONE) { /* (a graph that never ended: dropped) */
        memset(tl_part_ns, 0, sizeof tl_part_ns);
    }
    if (tl_end && tl_epoch == atomic_load(&g_ledger.epoch)) {
        atomic_fetch_add(&g_ledger.between, now - tl_end);
    }
    tl_part  = ZIPMOE_LEDGER_OTHER;
    tl_since = now;
}

void zipmoe_ledger_graph_end(int64_t tokens) {
    if (tl_part == ZIPMOE_LEDGER_NONE) {
        return;
    }
    const uint64_t now = zipmoe_now_ns();
    tl_part_ns[tl_part] += now - tl_since;
    tl_part = ZIPMOE_LEDGER_NONE;
    for (int p = 0; p < LEDGER_PARTS; p++) {
        atomic_fetch_add(&g_ledger.part[p], tl_part_ns[p]);
        tl_part_ns[p] = 0;
    }
    atomic_fetch_add(&g_ledger.graphs, 1);
    atomic_fetch_add(&g_ledger.tokens, tokens > 0 ? (uint64_t) tokens : 0);
    tl_end   = now;
    tl_epoch = atomic_load(&g_ledger.epoch);
}

void zipmoe_ledger_get(zipmoe_ledger * out) {
    out->graphs         = atomic_load(&g_ledger.graphs);
    out->tokens         = atomic_load(&g_ledger.tokens);
    out->compute_ns     = atomic_load(&g_ledger.part[ZIPMOE_LEDGER_COMPUTE]);
    out->decode_ns      = atomic_load(&g_ledger.part[ZIPMOE_LEDGER_DECODE]);
    out->read_wait_ns   = atomic_load(&g_ledger.part[ZIPMOE_LEDGER_READ_WAIT]);
    out->thread_wait_ns = atomic_load(&g_ledger.part[ZIPMOE_LEDGER_THREAD_WAIT]);
    out->other_ns       = atomic_load(&g_ledger.part[ZIPMOE_LEDGER_OTHER]);
    out->wall_ns        = out->compute_ns + out->decode_ns + out->read_wait_ns + out->thread_wait_ns + out->other_ns;
    out->between_ns     = atomic_load(&g_ledger.between);
}

static void ledger_reset(void) {
    atomic_fetch_add(&g_ledger.epoch, 1);
    atomic_store(&g_ledger.graphs, 0);
    atomic_store(&g_ledger.tokens, 0);
    atomic_store(&g_ledger.between, 0);
    for (int p = 0; p < LEDGER_PARTS; p++) {
        atomic_store(&g_ledger.part[p], 0);
    }
}

void zipmoe_stats_reset(void) {
    ledger_reset();
    _Atomic uint64_t * counters[] = { &g_stats.experts, &g_stats.chunks, &g_stats.bytes, &g_stats.ns, &g_stats.calls, &g_stats.hits_hot, &g_stats.hits_warm,
                                      &g_stats.hits_sm, &g_stats.misses, &g_stats.evictions, &g_stats.stall_ns,
                                      &g_stats.reading_calls, &g_stats.read_ahead_bytes, &g_stats.guessed_bytes, &g_stats.guesses_used,
                                      &g_stats.streamed, &g_stats.ahead_used };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        atomic_store(counters[i], 0);
    }
    zipmoe_reader_reset_totals();
    atomic_store(&g_stats.peak_hot, atomic_load(&g_stats.hot_bytes));
    atomic_store(&g_stats.peak_resident, atomic_load(&g_stats.hot_bytes) + atomic_load(&g_stats.warm_bytes) + atomic_load(&g_stats.sm_bytes));
}

void cache_record_error(zipmoe_store * s, int64_t expert, int64_t status) {
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

