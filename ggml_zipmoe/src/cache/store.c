/* store.c - a store's life cycle: open, bind to the model file, free. */
#define _GNU_SOURCE
#include "cache-impl.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------- life cycle */

static int open_direct(int fd) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    return open(path, O_RDONLY | O_DIRECT | O_CLOEXEC); /* -1 where the file system has no O_DIRECT: buffered */
}

static int collapse_work(void * s) { return cache_collapse((zipmoe_store *) s); }

static int layer_of(const char * name) {
    int layer = -1, n = 0;
    return sscanf(name, "blk.%d.%n", &layer, &n) == 1 && n > 0 ? layer : -1;
}

/* A new store, its info and sizes set by the caller (init): the state every store has, and its place in the list. */
static int64_t store_create(const char * name, int64_t (*init)(zipmoe_store *, const void *), const void * arg,
                            zipmoe_store ** out) {
    if (!name || !out) {
        return ZIPMOE_ERR_ARG;
    }
    *out = NULL;
    zipmoe_store * s = calloc(1, sizeof *s);
    if (!s) {
        return ZIPMOE_ERR_NOMEM;
    }
    snprintf(s->name, sizeof s->name, "%s", name);
    s->layer = layer_of(name);
    s->fd    = -1;
    s->dfd   = -1;
    s->dst   = MAP_FAILED;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->err_mu, NULL);
    int64_t rc = init(s, arg);
    if (rc < 0) {
        zipmoe_store_free(s);
        return rc;
    }
    s->hot_slots   = -1; /* until cache_share_hot_slots, once it is in the list */
    s->warm_share  = UINT64_MAX;
    s->plan      = calloc((size_t) s->info.n_expert, sizeof *s->plan);
    s->job.items = calloc((size_t) s->info.n_expert, sizeof *s->job.items);
    s->hinted    = calloc((size_t) s->info.n_expert, sizeof *s->hinted);
    s->pf_at     = malloc((size_t) s->info.n_expert * sizeof *s->pf_at);
    s->pf_from   = calloc((size_t) s->info.n_expert, sizeof *s->pf_from);
    s->predicted = calloc((size_t) s->info.n_expert, sizeof *s->predicted);
    s->ahead_order = malloc((size_t) s->info.n_expert * sizeof *s->ahead_order);
    s->experts   = calloc((size_t) s->info.n_expert, sizeof *s->experts);
    s->places    = calloc((size_t) s->info.n_expert, sizeof *s->places);
    s->route_words = (s->info.n_expert + 63) / 64;
    s->route_log   = calloc((size_t) (ROUTE_RING * s->route_words), sizeof *s->route_log);
    pthread_mutex_init(&s->job.mu, NULL);
    pthread_cond_init(&s->job.cv, NULL);
    pthread_mutex_init(&s->collapse_job.mu, NULL);
    pthread_cond_init(&s->collapse_job.cv, NULL);
    s->collapse_job.work      = collapse_work;
    s->collapse_job.work_user = s;
    if (!s->plan || !s->experts || !s->places || !s->job.items || !s->hinted || !s->route_log || !s->pf_at || !s->pf_from ||
        !s->predicted || !s->ahead_order) {
        zipmoe_store_free(s);
        return ZIPMOE_ERR_NOMEM;
    }
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        s->experts[e].place = -1;
        s->places[e]        = (place_state) { .expert = -1, .slot = -1 };
        s->pf_at[e]         = -1;
        s->ahead_order[e]   = (int32_t) e;
    }
    atomic_fetch_add(&g_stats.stores, 1);
    atomic_fetch_add(&g_cfg.bf16_total, (uint64_t) s->info.n_expert * s->hot_size);
    pthread_mutex_lock(&g_open.mu);
    s->next = g_open.list;
    g_open.list  = s;
    pthread_mutex_lock(&g_cfg.mu);
    cache_share_hot_slots(); /* the shares of every store changed */
    pthread_mutex_unlock(&g_cfg.mu);
    pthread_mutex_unlock(&g_open.mu);
    *out = s;
    return ZIPMOE_OK;
}

typedef struct {
    const void * index;
    size_t       index_size;
    uint64_t     data_size;
} index_arg;

static int64_t init_compressed(zipmoe_store * s, const void * arg) {
    const index_arg * a  = arg;
    const int64_t     rc = zipmoe_tensor_open(a->index, a->index_size, a->data_size, &s->tensor);
    if (rc < 0) {
        return rc;
    }
    zipmoe_tensor_get_info(s->tensor, &s->info);
    s->hot_size    = (uint64_t) s->info.expert_size; /* 2 bytes a value (BF16, F16), or the type's rows */
    s->sm_size     = s->info.layout == ZIPMOE_LAYOUT_SPLIT16 ? (uint64_t) s->info.n_per_expert : 0; /* (bytes: none) */
    s->mean_region = s->info.n_expert ? (s->info.data_size + (uint64_t) s->info.n_expert - 1) / (uint64_t) s->info.n_expert : 0;
    return ZIPMOE_OK;
}

int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
                          zipmoe_store ** out) {
    const index_arg a = { index, index_size, data_size };
    return store_create(name, init_compressed, &a, out);
}

/* A raw chunk: whole rows, about this many bytes (at least a row). Large enough that claiming one costs nothing
 * next to copying it, small enough that a prompt's few experts still spread over every thread. */
#define RAW_CHUNK_BYTES ((uint64_t) 256 << 10)

typedef struct {
    int32_t  ggml_type;
    int64_t  ne[4];
    uint64_t row_bytes;
} raw_arg;

/* A raw store's chunks: whole rows, about RAW_CHUNK_BYTES, a multiple of `align` rows. */
static void raw_chunks(zipmoe_store * s, int64_t align) {
    const int64_t ne0 = s->info.ne[0], ne1 = s->info.ne[1];
    int64_t       rows = s->row_bytes >= RAW_CHUNK_BYTES ? 1 : (int64_t) (RAW_CHUNK_BYTES / s->row_bytes);
    rows = (rows + align - 1) / align * align;
    rows = rows < ne1 ? rows : ne1;
    s->info.chunk_n  = rows * ne0; /* values, as a compressed tensor's: whole rows */
    s->info.n_chunks = (ne1 + rows - 1) / rows;
}

static int64_t init_raw(zipmoe_store * s, const void * arg) {
    const raw_arg * a = arg;
    const int64_t   ne0 = a->ne[0], ne1 = a->ne[1], n_expert = a->ne[2];
    if (ne0 <= 0 || ne1 <= 0 || n_expert <= 0 || a->ne[3] != 1 || a->row_bytes == 0 ||
        a->row_bytes > ZIPMOE_SIZE_MAX / (uint64_t) ne1 || (uint64_t) ne0 > ZIPMOE_SIZE_MAX / (uint64_t) ne1 ||
        a->row_bytes * (uint64_t) ne1 > ZIPMOE_SIZE_MAX / (uint64_t) n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    s->raw          = 1;
    s->row_bytes    = a->row_bytes;
    s->info.codec   = 0;
    s->info.ggml_type = a->ggml_type;
    memcpy(s->info.ne, a->ne, sizeof s->info.ne);
    s->info.n_expert     = n_expert;
    s->info.n_per_expert = ne0 * ne1;
    s->hot_size          = a->row_bytes * (uint64_t) ne1;
    s->info.data_size    = s->hot_size * (uint64_t) n_expert;
    s->sm_size           = 0;           /* no sign+mantissa plane */
    s->mean_region       = s->hot_size; /* its region is its bytes */
    raw_chunks(s, 1);
    return ZIPMOE_OK;
}

int64_t zipmoe_store_set_raw_put(zipmoe_store * s, zipmoe_raw_put_fn fn, void * ctx, int64_t row_align) {
    if (!s || (!s->raw && s->info.layout != ZIPMOE_LAYOUT_BYTES) || s->fd >= 0 || row_align < 1) {
        return ZIPMOE_ERR_ARG;
    }
    if (!s->raw && (s->info.ne[1] <= 0 || s->info.ne[1] % row_align != 0)) {
        return ZIPMOE_ERR_ARG; /* (an index store's expert is put whole: whole groups) */
    }
    s->raw_put     = fn;
    s->raw_put_ctx = ctx;
    if (s->raw) {
        raw_chunks(s, row_align);
    } else {
        s->row_bytes = s->hot_size / (uint64_t) s->info.ne[1];
    }
    return ZIPMOE_OK;
}

int64_t zipmoe_store_open_raw(const char * name, int32_t ggml_type, const int64_t ne[4], uint64_t row_bytes,
                              zipmoe_store ** out) {
    if (!ne) {
        return ZIPMOE_ERR_ARG;
    }
    raw_arg a = { ggml_type, { ne[0], ne[1], ne[2], ne[3] }, row_bytes };
    return store_create(name, init_raw, &a, out);
}

void zipmoe_store_get_info(const zipmoe_store * s, zipmoe_tensor_info * info) { *info = s->info; }

int zipmoe_store_is_raw(const zipmoe_store * s) { return s->raw; }

void zipmoe_store_free(zipmoe_store * s) {
    if (!s) {
        return;
    }
    zipmoe_reader_finish(&s->collapse_job, 0); /* not while the reader works on it */
    if (s->experts) {
        pthread_mutex_lock(&g_open.mu);
        for (zipmoe_store ** p = &g_open.list; *p; p = &(*p)->next) {
            if (*p == s) {
                *p = s->next;
                break;
            }
        }
        for (zipmoe_store * o = g_open.list; o; o = o->next) { /* nobody prefetches for it any more */
            zipmoe_store * me = s;
            atomic_compare_exchange_strong(&o->next_store, &me, NULL);
        }
        zipmoe_store * me = s;
        atomic_compare_exchange_strong(&g_open.last_planned, &me, NULL);
        pthread_mutex_unlock(&g_open.mu);
        cache_prefetch_forget(s);
        zipmoe_reader_wait_then(); /* a read-ahead that began before nobody could start it any more */
        atomic_fetch_sub(&g_stats.stores, 1);
        atomic_fetch_sub(&g_cfg.bf16_total, (uint64_t) s->info.n_expert * s->hot_size);
        pthread_mutex_lock(&g_open.mu);
        pthread_mutex_lock(&g_cfg.mu);
        cache_share_hot_slots(); /* the others' shares grew */
        pthread_mutex_unlock(&g_cfg.mu);
        pthread_mutex_unlock(&g_open.mu);
        atomic_fetch_sub(&g_stats.hot_bytes, s->hot_used);
        atomic_fetch_sub(&g_stats.warm_bytes, s->warm_used);
        atomic_fetch_sub(&g_stats.sm_bytes, s->sm_used);
        for (int64_t e = 0; e < s->info.n_expert; e++) {
            cache_region_free(s->experts[e].region, cache_resident_size(s, e, s->experts[e].res));
            if (s->places && s->places[e].slot >= 0) { /* the slot, and its pages, to the next store */
                zipmoe_slots_detach(place_addr(s, e), (size_t) s->hot_size, s->places[e].slot);
            }
        }
    }
    if (s->pf_at) {
        cache_prefetch_drop(s);
    }
    if (s->fd >= 0) {
        close(s->fd);
    }
    if (s->dfd >= 0) {
        close(s->dfd);
    }
    if (s->dst != MAP_FAILED) {
        munmap(s->dst, s->dst_size);
    }
    zipmoe_tensor_free(s->tensor);
    free(s->plan);
    free(s->job.items);
    free((void *) s->hinted);
    free(s->pf_at);
    free(s->pf_from);
    free((void *) s->predicted);
    free(s->ahead_order);
    free(s->experts);
    free(s->places);
    free(s->route_log);
    free(s->hp_done);
    pthread_mutex_destroy(&s->job.mu);
    pthread_cond_destroy(&s->job.cv);
    pthread_mutex_destroy(&s->collapse_job.mu);
    pthread_cond_destroy(&s->collapse_job.cv);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->err_mu);
    free(s);
}

const zipmoe_tensor * zipmoe_store_tensor(const zipmoe_store * s) { return s->tensor; }

int64_t zipmoe_store_bind(zipmoe_store * s, int fd, uint64_t data_offset, void ** dst, size_t * dst_size) {
    if (!s || fd < 0 || !dst || !dst_size || s->fd >= 0) {
        return ZIPMOE_ERR_ARG;
    }
    struct stat st;
    const uint64_t size = s->info.data_size;
    if (fstat(fd, &st) != 0 || data_offset > (uint64_t) st.st_size || size > (uint64_t) st.st_size - data_offset) {
        return ZIPMOE_ERR_CORRUPT; /* the data companion does not lie inside the file */
    }
    /* our own descriptor: the engine may close its own after loading */
    s->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (s->fd < 0) {
        return ZIPMOE_ERR_IO;
    }
    s->data_offset = data_offset;
    s->dfd         = atomic_load(&g_cfg.direct_io) ? open_direct(s->fd) : -1;
    /* Virtual only: a page costs memory once an expert is decoded into it. */
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    s->dst_size = zipmoe_align_up((size_t) s->info.n_expert * (size_t) s->hot_size, page);
    s->dst      = mmap(NULL, s->dst_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s->dst == MAP_FAILED) {
        close(s->fd);
        s->fd = -1;
        return ZIPMOE_ERR_NOMEM;
    }
    cache_refresh_limits(s);
    if (!s->use_slots) {
        /* every expert will stay decoded, so every byte will be read: the kernel may as well read it all now, at
         * the disk's sequential speed and while the model loads and computes; the reader then copies from the page
         * cache (cache_direct_fd) and drops it. Not under a smaller budget, where the page cache would hold what
         * the tiers do not. */
        posix_fadvise(s->fd, (off_t) data_offset, (off_t) size, POSIX_FADV_WILLNEED);
    }
    /* the 2 MiB pages wholly inside the reservation, which cache_collapse may make huge */
    s->hp_base = zipmoe_align_up((uintptr_t) s->dst, HUGE_PAGE);
    s->n_hp    = (uintptr_t) s->dst + s->dst_size > s->hp_base ? ((uintptr_t) s->dst + s->dst_size - s->hp_base) / HUGE_PAGE : 0;
    s->hp_done = calloc(s->n_hp + 1, 1);
    if (!s->hp_done) {
        munmap(s->dst, s->dst_size);
        s->dst = MAP_FAILED;
        close(s->fd);
        s->fd = -1;
        return ZIPMOE_ERR_NOMEM;
    }
    *dst      = s->dst;
    *dst_size = s->dst_size;
    return ZIPMOE_OK;
}

int64_t zipmoe_store_place(zipmoe_store * s, int64_t e) {
    if (!s || e < 0 || e >= s->info.n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    const int64_t p = s->experts[e].hot ? s->experts[e].place : -1;
    pthread_mutex_unlock(&s->mu);
    return p;
}

