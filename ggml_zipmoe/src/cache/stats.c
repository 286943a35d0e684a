/* stats.c - the process-wide counters of zipmoe_stats and each store's first decoding error. */
#define _GNU_SOURCE
#include "cache-impl.h"

#include <stdio.h>

/* ---------------------------------------------------------------- statistics and errors */

/* Process-wide: zipmoe_stats reports the whole cache, every store of every model loaded. */
cache_counters g_stats;

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
}

void zipmoe_stats_reset(void) {
    _Atomic uint64_t * counters[] = { &g_stats.experts, &g_stats.chunks, &g_stats.bytes, &g_stats.ns, &g_stats.calls, &g_stats.hits_hot, &g_stats.hits_warm,
                                      &g_stats.hits_sm, &g_stats.misses, &g_stats.evictions, &g_stats.stall_ns,
                                      &g_stats.reading_calls, &g_stats.read_ahead_bytes, &g_stats.guessed_bytes, &g_stats.guesses_used,
                                      &g_stats.streamed };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        atomic_store(counters[i], 0);
    }
    zipmoe_reader_reset_totals();
    atomic_store(&g_stats.peak_hot, atomic_load(&g_stats.hot_bytes));
    atomic_store(&g_stats.peak_resident, atomic_load(&g_stats.hot_bytes) + atomic_load(&g_stats.warm_bytes) + atomic_load(&g_stats.sm_bytes));
}

static void raise_peak(_Atomic uint64_t * peak, uint64_t now) {
    uint64_t p = atomic_load(peak);
    while (now > p && !atomic_compare_exchange_weak(peak, &p, now)) {
    }
}

/* Counts bytes into (or, negative, out of) a tier's process-wide total and the peaks. */
void cache_account(_Atomic uint64_t * tier, int64_t bytes) {
    const uint64_t now = atomic_fetch_add(tier, (uint64_t) bytes) + (uint64_t) bytes;
    if (bytes > 0) {
        if (tier == &g_stats.hot_bytes) {
            raise_peak(&g_stats.peak_hot, now);
        }
        raise_peak(&g_stats.peak_resident, atomic_load(&g_stats.hot_bytes) + atomic_load(&g_stats.warm_bytes) + atomic_load(&g_stats.sm_bytes));
    }
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

