/* stores.c - the list of open stores and the clocks they share (g_open). store.c adds and removes stores; the
 * configuration shares the budgets out over them, the tiers trim them, plans learn the graph's order from them. */
#include "tiers.h"

/* Process-wide: trims, read-ahead and the graph's order span every store the loader opened. */
cache_stores g_open = { .mu = PTHREAD_MUTEX_INITIALIZER };
