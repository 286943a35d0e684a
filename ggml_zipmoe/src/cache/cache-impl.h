/* cache-impl.h - the expert cache's top layer: the materialise protocol (materialize.c), the fill at load
 * (prefill.c), a store's life cycle (store.c) and the statistics, time ledger and errors the engine reads (stats.c).
 * What they share and nothing outside the cache sees; the layers below: tiers.h, then io.h. */
#ifndef ZIPMOE_CACHE_IMPL_H
#define ZIPMOE_CACHE_IMPL_H

#include "tiers.h"

/* stats.c */
void cache_record_error(zipmoe_store * s, int64_t expert, int64_t status);

#endif /* ZIPMOE_CACHE_IMPL_H */
