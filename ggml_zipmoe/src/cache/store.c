/* store.c - serving one compressed expert tensor at run time: the mapped data companion, the BF16
 * memory the engine reads, which experts are resident, and the materialise protocol.
 *
 * The protocol, for an engine that calls an op on all of its threads with no barrier inside the op
 * (ggml's custom ops): the first thread of an invocation snapshots which routed experts are not
 * resident (the plan); every thread decodes its share of the plan's chunks, chosen from the plan
 * alone; the last thread to leave publishes the result and releases the plan. No thread waits for
 * a sibling, every chunk is decoded exactly once, and the engine's barrier after the op makes the
 * decoded bytes visible to the matmul. A second invocation on the same store (another graph) waits
 * until the first has released its plan. */
#define _GNU_SOURCE
#include "zipmoe-impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct zipmoe_store {
    char               name[96];
    zipmoe_tensor *    tensor;
    zipmoe_tensor_info info;
    zipmoe_cache_mode  mode;

    void *          map;      /* read-only mapping of the data companion (page-aligned start) */
    size_t          map_size;
    const uint8_t * data;     /* the data companion's first byte inside map */
    uint16_t *      dst;      /* BF16 memory: n_expert * n_per_expert values, MAP_NORESERVE */
    size_t          dst_size;

    pthread_mutex_t mu;
    pthread_cond_t  cv;
    const void *    plan_key;  /* the invocation that owns the plan, NULL when none */
    int             plan_left; /* threads of that invocation still inside */
    int             plan_failed;
    int64_t         plan_n;
    int64_t *       plan;      /* experts to decode, ascending */
    uint8_t *       routed;    /* scratch: experts named by the invocation's ids */
    uint8_t *       resident;
};

/* ---------------------------------------------------------------- statistics and errors */

static _Atomic uint64_t g_stores, g_resident, g_experts, g_chunks, g_bytes, g_ns, g_calls;

void zipmoe_stats_get(zipmoe_stats * out) {
    out->stores            = atomic_load(&g_stores);
    out->experts_resident  = atomic_load(&g_resident);
    out->experts_decoded   = atomic_load(&g_experts);
    out->chunks_decoded    = atomic_load(&g_chunks);
    out->bytes_decoded     = atomic_load(&g_bytes);
    out->decode_ns         = atomic_load(&g_ns);
    out->materialize_calls = atomic_load(&g_calls);
}

void zipmoe_stats_reset(void) {
    atomic_store(&g_experts, 0);
    atomic_store(&g_chunks, 0);
    atomic_store(&g_bytes, 0);
    atomic_store(&g_ns, 0);
    atomic_store(&g_calls, 0);
}

static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t         g_err;
static char            g_err_msg[256];

static void record_error(const zipmoe_store * s, int64_t expert, int64_t status) {
    pthread_mutex_lock(&g_err_mu);
    if (g_err == ZIPMOE_OK) {
        g_err = status;
        snprintf(g_err_msg, sizeof g_err_msg, "zipmoe: %s, expert %lld: %s", s->name, (long long) expert,
                 zipmoe_status_str(status));
    }
    pthread_mutex_unlock(&g_err_mu);
}

int64_t zipmoe_take_error(char * msg, size_t msg_size) {
    pthread_mutex_lock(&g_err_mu);
    const int64_t status = g_err;
    if (msg && msg_size) {
        snprintf(msg, msg_size, "%s", status ? g_err_msg : "");
    }
    g_err = ZIPMOE_OK;
    pthread_mutex_unlock(&g_err_mu);
    return status;
}

/* ---------------------------------------------------------------- per-thread workspaces */

/* Engines change their thread count between calls (prompt vs generation), so scratch belongs to
 * the thread, not to an ith. Freed when the thread exits. */
static pthread_key_t  g_ws_key;
static pthread_once_t g_ws_once = PTHREAD_ONCE_INIT;

static void ws_destroy(void * ws) { zipmoe_workspace_free((zipmoe_workspace *) ws); }
static void ws_key_init(void) { pthread_key_create(&g_ws_key, ws_destroy); }

static zipmoe_workspace * thread_workspace(size_t chunk_n) {
    pthread_once(&g_ws_once, ws_key_init);
    zipmoe_workspace * ws = (zipmoe_workspace *) pthread_getspecific(g_ws_key);
    if (ws && ws->chunk_n >= chunk_n) {
        return ws;
    }
    zipmoe_workspace_free(ws);
    ws = zipmoe_workspace_create(chunk_n);
    pthread_setspecific(g_ws_key, ws);
    return ws;
}

/* ---------------------------------------------------------------- life cycle */

int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
                          zipmoe_cache_mode mode, zipmoe_store ** out) {
    if (!name || !out || (mode != ZIPMOE_CACHE_UNBOUNDED && mode != ZIPMOE_CACHE_NONE)) {
        return ZIPMOE_ERR_ARG;
    }
    *out = NULL;
    zipmoe_store * s = calloc(1, sizeof *s);
    if (!s) {
        return ZIPMOE_ERR_NOMEM;
    }
    snprintf(s->name, sizeof s->name, "%s", name);
    s->mode = mode;
    s->map  = MAP_FAILED;
    s->dst  = MAP_FAILED;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    int64_t rc = zipmoe_tensor_open(index, index_size, data_size, &s->tensor);
    if (rc < 0) {
        zipmoe_store_free(s);
        return rc;
    }
    zipmoe_tensor_get_info(s->tensor, &s->info);
    const size_t n_expert = (size_t) s->info.n_expert;
    s->plan     = malloc(n_expert * sizeof *s->plan);
    s->routed   = calloc(n_expert, 1);
    s->resident = calloc(n_expert, 1);
    if (!s->plan || !s->routed || !s->resident) {
        zipmoe_store_free(s);
        return ZIPMOE_ERR_NOMEM;
    }
    atomic_fetch_add(&g_stores, 1);
    *out = s;
    return ZIPMOE_OK;
}

void zipmoe_store_free(zipmoe_store * s) {
    if (!s) {
        return;
    }
    if (s->tensor) {
        atomic_fetch_sub(&g_stores, 1);
        uint64_t resident = 0;
        for (int64_t e = 0; e < s->info.n_expert; e++) {
            resident += s->resident[e];
        }
        atomic_fetch_sub(&g_resident, resident);
    }
    if (s->map != MAP_FAILED) {
        munmap(s->map, s->map_size);
    }
    if (s->dst != MAP_FAILED) {
        munmap(s->dst, s->dst_size);
    }
    zipmoe_tensor_free(s->tensor);
    free(s->plan);
    free(s->routed);
    free(s->resident);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

const zipmoe_tensor * zipmoe_store_tensor(const zipmoe_store * s) { return s->tensor; }

int64_t zipmoe_store_bind(zipmoe_store * s, int fd, uint64_t data_offset, void ** dst, size_t * dst_size) {
    if (!s || fd < 0 || !dst || !dst_size || s->map != MAP_FAILED) {
        return ZIPMOE_ERR_ARG;
    }
    struct stat st;
    const uint64_t size = s->info.data_size;
    if (fstat(fd, &st) != 0 || data_offset > (uint64_t) st.st_size || size > (uint64_t) st.st_size - data_offset) {
        return ZIPMOE_ERR_CORRUPT; /* the data companion does not lie inside the file */
    }
    const uint64_t page  = (uint64_t) sysconf(_SC_PAGESIZE);
    const uint64_t start = data_offset & ~(page - 1);
    s->map_size          = (size_t) (size + (data_offset - start));
    s->map               = mmap(NULL, s->map_size, PROT_READ, MAP_SHARED, fd, (off_t) start);
    if (s->map == MAP_FAILED) {
        return ZIPMOE_ERR_NOMEM;
    }
    s->data = (const uint8_t *) s->map + (data_offset - start);

    /* Virtual only: a page costs memory once an expert is decoded into it. */
    s->dst_size = zipmoe_align_up((size_t) s->info.n_expert * (size_t) s->info.n_per_expert * 2, (size_t) page);
    s->dst      = mmap(NULL, s->dst_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s->dst == MAP_FAILED) {
        munmap(s->map, s->map_size);
        s->map = MAP_FAILED;
        return ZIPMOE_ERR_NOMEM;
    }
    *dst      = s->dst;
    *dst_size = s->dst_size;
    return ZIPMOE_OK;
}

/* ---------------------------------------------------------------- materialise */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

/* Under s->mu: the plan of a new invocation. Returns an expert id that is out of range, or -1. */
static int64_t make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const int64_t n_expert = s->info.n_expert;
    int64_t       bad      = -1;
    memset(s->routed, 0, (size_t) n_expert);
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= n_expert) {
                bad = e;
                continue;
            }
            s->routed[e] = 1;
        }
    }
    s->plan_n = 0;
    for (int64_t e = 0; e < n_expert; e++) {
        if (s->routed[e] && !s->resident[e]) {
            s->plan[s->plan_n++] = e;
        }
    }
    return bad;
}

int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids,
                                 int64_t ne0, int64_t ne1, size_t nb0, size_t nb1, int ith, int nth) {
    if (!s || !key || !ids || ne0 < 0 || ne1 < 0 || nth < 1 || ith < 0 || ith >= nth || s->map == MAP_FAILED) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    while (s->plan_key != NULL && s->plan_key != key) {
        pthread_cond_wait(&s->cv, &s->mu);
    }
    if (s->plan_key == NULL) {
        s->plan_key    = key;
        s->plan_left   = nth;
        s->plan_failed = 0;
        const int64_t bad = make_plan(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
        if (bad != -1) {
            record_error(s, bad, ZIPMOE_ERR_ARG);
            s->plan_failed = 1;
        }
        atomic_fetch_add(&g_calls, 1);
    }
    const int64_t   plan_n = s->plan_n; /* stable until every thread of this invocation has left */
    const int64_t * plan   = s->plan;
    pthread_mutex_unlock(&s->mu);

    int64_t   status = 0, chunks = 0;
    const int64_t n_chunks = s->info.n_chunks;
    if (plan_n > 0) {
        zipmoe_workspace * ws = thread_workspace((size_t) s->info.chunk_n);
        const uint64_t     t0 = now_ns();
        for (int64_t j = 0; j < plan_n && ws; j++) {
            /* chunk c of the j-th planned expert goes to thread (j * n_chunks + c) % nth */
            const int     first = (int) ((((int64_t) ith - (j * n_chunks) % nth) % nth + nth) % nth);
            const int64_t e     = plan[j];
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(s->tensor, e, &span);
            const int64_t rc = zipmoe_tensor_decode_expert(s->tensor, ws, e, s->data + span.offset, (size_t) span.size,
                                                           s->dst + e * s->info.n_per_expert, first, nth);
            if (rc < 0) {
                record_error(s, e, rc);
                status = rc;
                break;
            }
            chunks += rc;
        }
        if (!ws) {
            record_error(s, plan[0], ZIPMOE_ERR_NOMEM);
            status = ZIPMOE_ERR_NOMEM;
        }
        atomic_fetch_add(&g_ns, now_ns() - t0);
        atomic_fetch_add(&g_chunks, (uint64_t) chunks);
    }

    pthread_mutex_lock(&s->mu);
    if (status < 0) {
        s->plan_failed = 1;
    }
    if (--s->plan_left == 0) {
        atomic_fetch_add(&g_experts, (uint64_t) plan_n);
        atomic_fetch_add(&g_bytes, (uint64_t) plan_n * (uint64_t) s->info.n_per_expert * 2);
        if (!s->plan_failed && s->mode == ZIPMOE_CACHE_UNBOUNDED) {
            for (int64_t j = 0; j < plan_n; j++) {
                s->resident[plan[j]] = 1;
            }
            atomic_fetch_add(&g_resident, (uint64_t) plan_n);
        }
        s->plan_key = NULL;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return status < 0 ? status : chunks;
}
