/* buffers.c - memory the cache reads and decodes through: per-thread scratch, the mappings of the
 * compressed tiers' copies, and the staging buffer of a plan's reads. */
#define _GNU_SOURCE
#include "io.h"

#include <stdlib.h>
#include <sys/mman.h>

/* ---------------------------------------------------------------- per-thread scratch */

/* A thread's scratch: a key per process, as threads are. */
static pthread_key_t  g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void * p) {
    thread_scratch * ts = (thread_scratch *) p;
    zipmoe_workspace_free(ts->ws);
    free(ts->buf);
    free(ts);
}

static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_destroy); }

thread_scratch * cache_thread_scratch(size_t chunk_n, size_t buf_size) {
    pthread_once(&g_scratch_once, scratch_key_init);
    thread_scratch * ts = (thread_scratch *) pthread_getspecific(g_scratch_key);
    if (!ts) {
        ts = calloc(1, sizeof *ts);
        if (!ts) {
            return NULL;
        }
        pthread_setspecific(g_scratch_key, ts);
    }
    if (!ts->ws || ts->ws->chunk_n < chunk_n) {
        zipmoe_workspace_free(ts->ws);
        ts->ws = zipmoe_workspace_create(chunk_n);
    }
    if (ts->buf_size < buf_size) {
        free(ts->buf);
        ts->buf      = malloc(buf_size);
        ts->buf_size = ts->buf ? buf_size : 0;
    }
    return ts->ws && ts->buf ? ts : NULL;
}

/* ---------------------------------------------------------------- read buffers */

/* The read buffers' settings: process-wide, as the buffers are. The configuration (config.c) sets the read room
 * with a budget and tells them when generation's budgets are in force. */
static struct {
    _Atomic uint64_t room;   /* a prompt's read buffers' (zipmoe_cache_set_read_room); UINT64_MAX: no bound */
    _Atomic size_t   keep;   /* what a read buffer keeps between uses (zipmoe_cache_set_read_buffer) */
    _Atomic int      tokens; /* generation's budgets are in force (the configuration's token mode) */
} g_read = { .room = UINT64_MAX, .keep = (size_t) 16 << 20 };

void cache_read_buffers_set_room(uint64_t bytes) { atomic_store(&g_read.room, bytes); }

void cache_read_buffers_set_token_mode(int tokens) { atomic_store(&g_read.tokens, tokens); }

size_t cache_read_buffer_keep(void) { return atomic_load(&g_read.keep); }

void zipmoe_cache_set_read_buffer(uint64_t bytes) {
    atomic_store(&g_read.keep, bytes < ZIPMOE_DIRECT_ALIGN ? ZIPMOE_DIRECT_ALIGN : (size_t) bytes);
}

static int in_token_mode(void) { return atomic_load(&g_read.tokens); }

/* The most a large read buffer (the staging buffer, a prompt's read-ahead) may take for reads of `need` bytes, of
 * which `largest` is the largest single read: half the read room in a batch (the other half is the other buffer's),
 * what a buffer keeps in generation (whose hot tier holds the room), never less than one read. */
size_t cache_read_buffer_bound(size_t need, size_t largest) {
    const uint64_t room  = atomic_load(&g_read.room);
    size_t         bound = STAGE_KEEP;
    if (room == UINT64_MAX) {
        return need;
    }
    if (!in_token_mode() && room / 2 > bound) {
        bound = (size_t) (room / 2) & ~(ZIPMOE_DIRECT_ALIGN - 1);
    }
    bound = bound > largest ? bound : largest;
    return need < bound ? need : bound;
}

/* A buffer larger than this was grown under a larger read room than a batch has now: it is given back (or
 * refitted) when idle. Not in generation, whose reads of experts larger than what a buffer keeps would regrow it
 * every token. */
size_t cache_read_buffer_refit_limit(void) { return in_token_mode() ? SIZE_MAX : cache_read_buffer_bound(SIZE_MAX, 0); }

/* A compressed tier's copy of an expert (its region, or its sign+mantissa plane) and a read buffer are mappings
 * of their own, so that what is given up goes back to the system at once (page-aligned, as O_DIRECT wants). From
 * malloc, the ~2 MB blocks that threads free and allocate in turn stayed in glibc's heaps: with a warm tier at 75% of the 2.8g model the process grew
 * ~400 MB past its budget and the page cache of the other weights thrashed (19 GB read for 32 tokens). */
uint8_t * cache_region_alloc(uint64_t size) {
    /* not populated: the pages fault in where the bytes are written (mostly the reader's pread), not under s->mu */
    void * p = mmap(NULL, (size_t) size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : (uint8_t *) p;
}

void cache_region_free(uint8_t * p, uint64_t size) {
    if (p) {
        munmap(p, (size_t) size);
    }
}

/* The region at p, of old bytes, with size bytes, the first min(old, size) kept; NULL (p unchanged) if it
 * cannot. Shrinking unmaps the tail in place. */
uint8_t * cache_region_resize(uint8_t * p, uint64_t old, uint64_t size) {
    void * q = mremap(p, (size_t) old, (size_t) size, MREMAP_MAYMOVE);
    return q == MAP_FAILED ? NULL : (uint8_t *) q;
}

/* What the read buffers hold beyond what each keeps between uses (zipmoe_stats' staging_transient_bytes). */
uint64_t cache_read_buffers_transient(void) {
    const uint64_t keep  = STAGE_KEEP;
    uint64_t       total = 0;
    const uint64_t caps[] = { atomic_load(&g_stats.stage_cap_bytes), atomic_load(&g_stats.pf_cap_bytes[0]),
                              atomic_load(&g_stats.pf_cap_bytes[1]) };
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
        total += caps[i] > keep ? caps[i] - keep : 0;
    }
    return total;
}

void cache_read_buffer_free(uint8_t ** data, size_t * cap) {
    cache_region_free(*data, *cap);
    *data = NULL;
    *cap  = 0;
}

/* Makes *data (a read buffer, aligned for O_DIRECT) fit need: grown when smaller, given back when a need fits
 * STAGE_KEEP again after a prompt's larger one; never smaller than STAGE_KEEP, so that generation does not
 * regrow it (and fault in fresh pages) for every larger token. *cap is 0 if the allocation failed. */
void cache_read_buffer_fit(uint8_t ** data, size_t * cap, size_t need) {
    /* (a buffer a larger read room let grow is refitted once the room is smaller) */
    if (*cap >= need && !(*cap > STAGE_KEEP && need <= STAGE_KEEP) && *cap <= cache_read_buffer_refit_limit()) {
        return;
    }
    cache_read_buffer_free(data, cap);
    const size_t size = need > STAGE_KEEP ? need : STAGE_KEEP;
    *data             = cache_region_alloc(size);
    *cap              = *data ? size : 0;
}

/* ---------------------------------------------------------------- reads */

/* One staging buffer for the process: compressed bytes read for a plan that no tier keeps. One graph computes
 * at a time and its ops run one after another, so one buffer serves every store; an invocation that finds it
 * taken (another graph) reads synchronously. Kept, so that neither generation nor the stores of a prompt fault
 * in fresh pages every time; a prompt's larger buffer is given back once a need fits STAGE_KEEP again. */
static struct {
    pthread_mutex_t      mu;
    uint8_t *            data;
    size_t               cap;
    const zipmoe_store * owner;
} g_stage = { .mu = PTHREAD_MUTEX_INITIALIZER };

uint8_t * cache_staging_take(const zipmoe_store * s, size_t need) {
    pthread_mutex_lock(&g_stage.mu);
    uint8_t * buf = NULL;
    if (!g_stage.owner) {
        cache_read_buffer_fit(&g_stage.data, &g_stage.cap, need);
        atomic_store(&g_stats.stage_cap_bytes, g_stage.cap);
        if (g_stage.data) {
            g_stage.owner = s;
            buf           = g_stage.data;
        }
    }
    pthread_mutex_unlock(&g_stage.mu);
    return buf;
}

/* A prompt's large buffer goes back once the stores' reads come from the read-ahead buffers: the page cache of
 * the weights that are not experts would make room for it (under a cgroup limit they were read again). */
void cache_staging_trim(size_t need) {
    pthread_mutex_lock(&g_stage.mu);
    if (!g_stage.owner && g_stage.cap > STAGE_KEEP && need <= STAGE_KEEP) {
        cache_read_buffer_free(&g_stage.data, &g_stage.cap);
        atomic_store(&g_stats.stage_cap_bytes, 0);
    }
    pthread_mutex_unlock(&g_stage.mu);
}

/* The staging buffer goes back if it is idle and larger than bound (config.c's trim of idle read buffers). */
void cache_staging_trim_idle(size_t bound) {
    pthread_mutex_lock(&g_stage.mu);
    if (!g_stage.owner && g_stage.cap > bound) {
        cache_read_buffer_free(&g_stage.data, &g_stage.cap);
        atomic_store(&g_stats.stage_cap_bytes, 0);
    }
    pthread_mutex_unlock(&g_stage.mu);
}

void cache_staging_give(const zipmoe_store * s) {
    pthread_mutex_lock(&g_stage.mu);
    if (g_stage.owner == s) {
        g_stage.owner = NULL;
    }
    pthread_mutex_unlock(&g_stage.mu);
}

