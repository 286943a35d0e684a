/* counters.c - the process-wide counters of zipmoe_stats, which every layer of the cache adds to (stats.c reports
 * them), and the peaks that follow a tier's total. */
#include "io.h"

/* Process-wide: zipmoe_stats reports the whole cache, every store of every model loaded. */
cache_counters g_stats;

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
