/* store.c - serving one compressed expert tensor at run time under a memory budget: the BF16 memory the
 * engine reads, the tiers an expert can be in, the materialise protocol and eviction.
 *
 * Tiers of an expert: hot (decoded in the BF16 memory), warm (its compressed region in RAM) or cold
 * (on disk, read with pread and dropped from the page cache, so that no memory is used that the budget
 * does not count). A hot expert may be warm too. The budget of the process (zipmoe_cache_configure) is
 * shared out among stores in proportion to their BF16 size; each store evicts by the chosen policy.
 *
 * The protocol, for an engine that calls an op on all of its threads with no barrier inside the op
 * (ggml's custom ops): the first thread of an invocation plans (routed experts that are not hot, and
 * whether each is read from RAM or disk); every thread decodes the chunks that the plan alone assigns
 * to it; the last thread to leave publishes (hot, warm), evicts down to the budget and releases the
 * plan. No thread waits for a sibling, every chunk is decoded exactly once, and the engine's barrier
 * after the op makes the decoded bytes visible to the matmul. The experts routed by the invocation are
 * never evicted by it: the matmul that reads them has not run yet. A second invocation on the same
 * store (another graph) waits until the first has released its plan. */
#define _GNU_SOURCE
#include "zipmoe-impl.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    uint8_t * warm;      /* the compressed region, or NULL */
    uint8_t   hot;       /* decoded in dst */
    uint32_t  routed;    /* tokens routed to it by the invocation in flight */
    uint64_t  last_use;  /* policy metadata: tick of the last use, */
    uint64_t  uses;      /* uses (LFU) or tokens routed (token-weighted LFU), */
    uint64_t  admitted;  /* tick of becoming hot (FIFO) */
    uint64_t  admitted_warm;
    uint64_t  activations; /* tokens routed, ever: what the planner reads */
} expert_state;

typedef struct {
    int64_t   expert;
    uint8_t * src;       /* region bytes in RAM (warm, or being made warm), NULL: read into scratch */
    uint8_t   from_disk; /* the region must be read (into src when set) */
} plan_item;

struct zipmoe_store {
    char               name[96];
    zipmoe_tensor *    tensor;
    zipmoe_tensor_info info;

    int        fd;          /* our own descriptor of the model file, -1 until bound */
    uint64_t   data_offset; /* of the data companion in the file */
    uint16_t * dst;         /* BF16 memory: n_expert * n_per_expert values, MAP_NORESERVE */
    size_t     dst_size;

    pthread_mutex_t mu;
    pthread_cond_t  cv;
    const void *    plan_key;  /* the invocation that owns the plan, NULL when none */
    int             plan_left; /* threads of that invocation still inside */
    int             plan_failed;
    int64_t         plan_n;
    plan_item *     plan;
    expert_state *  experts;
    uint64_t        hot_used, warm_used;
    _Atomic int     over_budget; /* the last publish could not evict enough (pinned experts): no fast path */
    pthread_mutex_t err_mu;      /* the first decoding error not yet taken; per store, so that an engine */
    int64_t         err;         /* takes exactly the errors of the graph it computed (two models in one  */
    char            err_msg[256]; /* process must not see each other's)                               */
};

/* ---------------------------------------------------------------- the process's budget */

static pthread_mutex_t g_cfg_mu      = PTHREAD_MUTEX_INITIALIZER;
static uint64_t        g_hot_budget  = UINT64_MAX;
static uint64_t        g_warm_budget = 0;
static zipmoe_policy   g_policy      = ZIPMOE_POLICY_TOKEN_LFU;
static _Atomic uint64_t g_bf16_total; /* BF16 bytes of all open stores: the shares of the budget */
static _Atomic int      g_decode_all; /* hot budget 0: decode on every use (read without the lock) */
static _Atomic uint64_t g_tick;

int64_t zipmoe_cache_configure(uint64_t hot_bytes, uint64_t warm_bytes, zipmoe_policy policy) {
    if (policy < ZIPMOE_POLICY_TOKEN_LFU || policy > ZIPMOE_POLICY_FIFO) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&g_cfg_mu);
    g_hot_budget  = hot_bytes;
    g_warm_budget = warm_bytes;
    g_policy      = policy;
    atomic_store(&g_decode_all, hot_bytes == 0);
    pthread_mutex_unlock(&g_cfg_mu);
    return ZIPMOE_OK;
}

/* A store's share of a budget, in proportion to its BF16 size. */
static uint64_t quota(const zipmoe_store * s, uint64_t budget) {
    if (budget == UINT64_MAX) {
        return UINT64_MAX;
    }
    const uint64_t total = atomic_load(&g_bf16_total);
    const uint64_t mine  = (uint64_t) s->info.n_expert * (uint64_t) s->info.n_per_expert * 2;
    return total ? (uint64_t) ((double) budget * (double) mine / (double) total) : 0;
}

/* ---------------------------------------------------------------- statistics and errors */

static _Atomic uint64_t g_stores, g_hot_bytes, g_warm_bytes, g_experts, g_chunks, g_bytes, g_ns, g_calls;
static _Atomic uint64_t g_hits_hot, g_hits_warm, g_misses, g_read_bytes, g_read_ns, g_evictions, g_peak_hot;

void zipmoe_stats_get(zipmoe_stats * out) {
    out->stores            = atomic_load(&g_stores);
    out->hot_bytes         = atomic_load(&g_hot_bytes);
    out->warm_bytes        = atomic_load(&g_warm_bytes);
    out->peak_hot_bytes    = atomic_load(&g_peak_hot);
    out->experts_decoded   = atomic_load(&g_experts);
    out->chunks_decoded    = atomic_load(&g_chunks);
    out->bytes_decoded     = atomic_load(&g_bytes);
    out->decode_ns         = atomic_load(&g_ns);
    out->materialize_calls = atomic_load(&g_calls);
    out->hits_hot          = atomic_load(&g_hits_hot);
    out->hits_warm         = atomic_load(&g_hits_warm);
    out->misses            = atomic_load(&g_misses);
    out->bytes_read        = atomic_load(&g_read_bytes);
    out->read_ns           = atomic_load(&g_read_ns);
    out->evictions         = atomic_load(&g_evictions);
}

void zipmoe_stats_reset(void) {
    _Atomic uint64_t * counters[] = { &g_experts, &g_chunks, &g_bytes, &g_ns, &g_calls, &g_hits_hot, &g_hits_warm,
                                      &g_misses, &g_read_bytes, &g_read_ns, &g_evictions };
    for (size_t i = 0; i < sizeof counters / sizeof counters[0]; i++) {
        atomic_store(counters[i], 0);
    }
    atomic_store(&g_peak_hot, atomic_load(&g_hot_bytes));
}

static void add_hot(uint64_t bytes) {
    const uint64_t now  = atomic_fetch_add(&g_hot_bytes, bytes) + bytes;
    uint64_t       peak = atomic_load(&g_peak_hot);
    while (now > peak && !atomic_compare_exchange_weak(&g_peak_hot, &peak, now)) {
    }
}

static void record_error(zipmoe_store * s, int64_t expert, int64_t status) {
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

/* ---------------------------------------------------------------- per-thread scratch */

/* Engines change their thread count between calls (prompt vs generation), so scratch belongs to the
 * thread, not to an ith: a decoder workspace and room for one chunk read from disk. Freed at exit. */
typedef struct {
    zipmoe_workspace * ws;
    uint8_t *          buf;
    size_t             buf_size;
} thread_scratch;

static pthread_key_t  g_scratch_key;
static pthread_once_t g_scratch_once = PTHREAD_ONCE_INIT;

static void scratch_destroy(void * p) {
    thread_scratch * ts = (thread_scratch *) p;
    zipmoe_workspace_free(ts->ws);
    free(ts->buf);
    free(ts);
}

static void scratch_key_init(void) { pthread_key_create(&g_scratch_key, scratch_destroy); }

static thread_scratch * thread_scratch_get(size_t chunk_n, size_t buf_size) {
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

/* ---------------------------------------------------------------- life cycle */

int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
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
    s->fd  = -1;
    s->dst = MAP_FAILED;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_mutex_init(&s->err_mu, NULL);
    int64_t rc = zipmoe_tensor_open(index, index_size, data_size, &s->tensor);
    if (rc < 0) {
        zipmoe_store_free(s);
        return rc;
    }
    zipmoe_tensor_get_info(s->tensor, &s->info);
    s->plan    = calloc((size_t) s->info.n_expert, sizeof *s->plan);
    s->experts = calloc((size_t) s->info.n_expert, sizeof *s->experts);
    if (!s->plan || !s->experts) {
        zipmoe_store_free(s);
        return ZIPMOE_ERR_NOMEM;
    }
    atomic_fetch_add(&g_stores, 1);
    atomic_fetch_add(&g_bf16_total, (uint64_t) s->info.n_expert * (uint64_t) s->info.n_per_expert * 2);
    *out = s;
    return ZIPMOE_OK;
}

void zipmoe_store_free(zipmoe_store * s) {
    if (!s) {
        return;
    }
    if (s->experts) {
        atomic_fetch_sub(&g_stores, 1);
        atomic_fetch_sub(&g_bf16_total, (uint64_t) s->info.n_expert * (uint64_t) s->info.n_per_expert * 2);
        atomic_fetch_sub(&g_hot_bytes, s->hot_used);
        atomic_fetch_sub(&g_warm_bytes, s->warm_used);
        for (int64_t e = 0; e < s->info.n_expert; e++) {
            free(s->experts[e].warm);
        }
    }
    if (s->fd >= 0) {
        close(s->fd);
    }
    if (s->dst != MAP_FAILED) {
        munmap(s->dst, s->dst_size);
    }
    zipmoe_tensor_free(s->tensor);
    free(s->plan);
    free(s->experts);
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
    /* Virtual only: a page costs memory once an expert is decoded into it. */
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    s->dst_size = zipmoe_align_up((size_t) s->info.n_expert * (size_t) s->info.n_per_expert * 2, page);
    s->dst      = mmap(NULL, s->dst_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (s->dst != MAP_FAILED) {
        /* decoded experts are read whole by every matmul: huge pages save TLB misses and page faults */
        madvise(s->dst, s->dst_size, MADV_HUGEPAGE);
    }
    if (s->dst == MAP_FAILED) {
        close(s->fd);
        s->fd = -1;
        return ZIPMOE_ERR_NOMEM;
    }
    *dst      = s->dst;
    *dst_size = s->dst_size;
    return ZIPMOE_OK;
}

/* ---------------------------------------------------------------- eviction */

static uint64_t score(const expert_state * x, zipmoe_policy policy, int warm) {
    switch (policy) {
        case ZIPMOE_POLICY_LRU:       return x->last_use;
        case ZIPMOE_POLICY_FIFO:      return warm ? x->admitted_warm : x->admitted;
        case ZIPMOE_POLICY_LFU:
        case ZIPMOE_POLICY_TOKEN_LFU: return x->uses;
    }
    return 0;
}

/* Under s->mu: the unpinned expert of the tier with the lowest score, or -1. */
static int64_t victim(const zipmoe_store * s, zipmoe_policy policy, int warm) {
    int64_t  best       = -1;
    uint64_t best_score = UINT64_MAX;
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        const expert_state * x = &s->experts[e];
        if (x->routed || !(warm ? x->warm != NULL : x->hot)) {
            continue;
        }
        const uint64_t sc = score(x, policy, warm);
        if (best < 0 || sc < best_score) {
            best       = e;
            best_score = sc;
        }
    }
    return best;
}

static uint64_t warm_size(const zipmoe_store * s, int64_t e) {
    zipmoe_expert_span span;
    zipmoe_tensor_expert_span(s->tensor, e, &span);
    return span.size;
}

/* Gives the decoded pages of expert e back to the system. Pages it shares with a hot neighbour stay. */
static void release_hot(zipmoe_store * s, int64_t e) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const size_t    bytes = (size_t) s->info.n_per_expert * 2;
    const uintptr_t begin = (uintptr_t) (s->dst + e * s->info.n_per_expert);
    uintptr_t       lo    = zipmoe_align_up(begin, page);
    uintptr_t       hi    = (begin + bytes) & ~(uintptr_t) (page - 1);
    if (e > 0 && !s->experts[e - 1].hot && (begin & (page - 1)) && begin - (begin & (page - 1)) >= (uintptr_t) s->dst) {
        lo = begin & ~(uintptr_t) (page - 1); /* the shared first page holds nothing hot */
    }
    if (hi > lo) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
    s->experts[e].hot = 0;
    s->hot_used -= bytes;
    atomic_fetch_sub(&g_hot_bytes, bytes);
    atomic_fetch_add(&g_evictions, 1);
}

static void release_warm(zipmoe_store * s, int64_t e) {
    const uint64_t size = warm_size(s, e);
    free(s->experts[e].warm);
    s->experts[e].warm = NULL;
    s->warm_used -= size;
    atomic_fetch_sub(&g_warm_bytes, size);
}

/* ---------------------------------------------------------------- materialise */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000u + (uint64_t) ts.tv_nsec;
}

/* Reads size bytes at offset of the data companion (publish() drops them from the page cache). */
static int read_cold(const zipmoe_store * s, uint64_t offset, void * buf, size_t size) {
    const uint64_t t0   = now_ns();
    size_t         done = 0;
    while (done < size) {
        const ssize_t n = pread(s->fd, (uint8_t *) buf + done, size - done, (off_t) (s->data_offset + offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return ZIPMOE_ERR_IO;
        }
        done += (size_t) n;
    }
    atomic_fetch_add(&g_read_bytes, size);
    atomic_fetch_add(&g_read_ns, now_ns() - t0);
    return ZIPMOE_OK;
}

/* Under s->mu: the plan of a new invocation. Returns an out-of-range expert id, or -1. */
static int64_t make_plan(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const int64_t n_expert = s->info.n_expert;
    int64_t       bad      = -1;
    for (int64_t e = 0; e < n_expert; e++) {
        s->experts[e].routed = 0;
    }
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= n_expert) {
                bad = e;
                continue;
            }
            s->experts[e].routed++;
        }
    }
    pthread_mutex_lock(&g_cfg_mu);
    const uint64_t      warm_quota = quota(s, g_warm_budget);
    const int           decode_all = quota(s, g_hot_budget) == 0; /* no hot tier: decode on every use */
    const zipmoe_policy policy     = g_policy;
    pthread_mutex_unlock(&g_cfg_mu);

    const uint64_t tick = atomic_fetch_add(&g_tick, 1);
    for (int64_t e = 0; e < n_expert; e++) {
        expert_state * x = &s->experts[e];
        if (x->routed) {
            if (x->hot && !decode_all) {
                atomic_fetch_add(&g_hits_hot, 1);
            }
            x->last_use = tick;
            x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? x->routed : 1;
            x->activations += x->routed;
        }
    }
    s->plan_n = 0;
    /* warm experts first: their chunks keep the cores busy while the others' reads are in flight */
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t e = 0; e < n_expert; e++) {
            expert_state * x = &s->experts[e];
            if (!x->routed || (x->hot && !decode_all) || (pass == 0) != (x->warm != NULL)) {
                continue;
            }
            plan_item * it = &s->plan[s->plan_n++];
            it->expert     = e;
            it->src        = x->warm;
            it->from_disk  = x->warm == NULL;
            if (it->from_disk) {
                /* admit to the warm tier if it fits, after evicting colder warm experts */
                const uint64_t size = warm_size(s, e);
                if (size <= warm_quota) {
                    int64_t v;
                    while (s->warm_used + size > warm_quota && (v = victim(s, policy, 1)) >= 0) {
                        release_warm(s, v);
                    }
                    if (s->warm_used + size <= warm_quota && (x->warm = malloc(size)) != NULL) {
                        it->src = x->warm;
                        x->admitted_warm = tick;
                        s->warm_used += size;
                        atomic_fetch_add(&g_warm_bytes, size);
                    }
                }
                /* start the read now: the kernel fetches it while the threads decode warm experts */
                zipmoe_expert_span span;
                zipmoe_tensor_expert_span(s->tensor, e, &span);
                posix_fadvise(s->fd, (off_t) (s->data_offset + span.offset), (off_t) span.size, POSIX_FADV_WILLNEED);
                atomic_fetch_add(&g_misses, 1);
            } else {
                atomic_fetch_add(&g_hits_warm, 1);
            }
        }
    }
    return bad;
}

/* Decodes chunk c of a plan item, reading what is not in RAM. */
static int64_t decode_chunk(zipmoe_store * s, const plan_item * it, int64_t c, thread_scratch * ts) {
    zipmoe_expert_span span;
    zipmoe_chunk_ref   ref;
    zipmoe_tensor_expert_span(s->tensor, it->expert, &span);
    zipmoe_tensor_chunk(s->tensor, it->expert, c, &ref);
    const uint8_t * sm   = it->src ? it->src + ref.first : ts->buf;
    const uint8_t * code = it->src ? it->src + ref.code_offset : ts->buf + ref.n;
    if (it->from_disk) {
        uint8_t * sm_dst   = it->src ? it->src + ref.first : ts->buf;
        uint8_t * code_dst = it->src ? it->src + ref.code_offset : ts->buf + ref.n;
        if (read_cold(s, span.offset + (uint64_t) ref.first, sm_dst, (size_t) ref.n) < 0 ||
            read_cold(s, span.offset + ref.code_offset, code_dst, (size_t) ref.code_size) < 0) {
            return ZIPMOE_ERR_IO;
        }
    }
    return zipmoe_chunk_decode(zipmoe_tensor_codec(s->tensor), ts->ws, code, (size_t) ref.code_size, sm,
                               (size_t) ref.n, 1, ref.checksum, s->dst + it->expert * s->info.n_per_expert + ref.first);
}

/* Under s->mu, by the last thread of an invocation: the planned experts are hot now; evict down to the
 * hot quota, never an expert this invocation routed (its matmul is still to come). */
static void publish(zipmoe_store * s) {
    pthread_mutex_lock(&g_cfg_mu);
    const uint64_t      hot_quota = quota(s, g_hot_budget);
    const zipmoe_policy policy    = g_policy;
    pthread_mutex_unlock(&g_cfg_mu);
    const uint64_t bytes = (uint64_t) s->info.n_per_expert * 2;
    const uint64_t tick  = atomic_load(&g_tick);
    for (int64_t j = 0; j < s->plan_n; j++) {
        const int64_t  e = s->plan[j].expert;
        expert_state * x = &s->experts[e];
        if (s->plan[j].from_disk) {
            /* the budget counts what zipmoe keeps: the kernel must not keep a second, uncounted copy */
            zipmoe_expert_span span;
            zipmoe_tensor_expert_span(s->tensor, e, &span);
            posix_fadvise(s->fd, (off_t) (s->data_offset + span.offset), (off_t) span.size, POSIX_FADV_DONTNEED);
        }
        if (!x->hot) {
            x->hot      = 1;
            x->admitted = tick;
            s->hot_used += bytes;
            add_hot(bytes);
        }
    }
    int64_t v;
    while (s->hot_used > hot_quota && (v = victim(s, policy, 0)) >= 0) {
        release_hot(s, v);
    }
    atomic_store(&s->over_budget, s->hot_used > hot_quota);
}

/* Under s->mu, after a failed invocation: what was planned is not hot (partly decoded at most). */
static void discard_plan(zipmoe_store * s) {
    for (int64_t j = 0; j < s->plan_n; j++) {
        const int64_t e = s->plan[j].expert;
        if (s->plan[j].from_disk && s->experts[e].warm) {
            release_warm(s, e); /* its bytes may be incomplete */
        }
    }
}

/* Whether every expert ids names is decoded: then there is nothing to plan. */
static int all_routed_hot(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= s->info.n_expert || !s->experts[e].hot) {
                return 0;
            }
        }
    }
    return 1;
}

/* The fast path's bookkeeping, by one thread: what make_plan records for routed experts. */
static void note_hits(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const uint64_t      tick   = atomic_fetch_add(&g_tick, 1);
    const zipmoe_policy policy = g_policy; /* a torn read only affects the next eviction's order */
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            expert_state * x = &s->experts[e];
            if (x->last_use != tick) {
                x->last_use = tick;
                x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 0 : 1;
                atomic_fetch_add(&g_hits_hot, 1);
            }
            x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 1 : 0;
            x->activations++;
        }
    }
    atomic_fetch_add(&g_calls, 1);
}

int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids,
                                 int64_t ne0, int64_t ne1, size_t nb0, size_t nb1, int ith, int nth) {
    if (!s || !key || !ids || ne0 < 0 || ne1 < 0 || nth < 1 || ith < 0 || ith >= nth || s->fd < 0) {
        return ZIPMOE_ERR_ARG;
    }
    /* Once warm, every routed expert is usually decoded already. The resident set changes only when an
     * invocation publishes, and one graph computes at a time, so all threads of this invocation see the
     * same answer and may leave without the lock (which busy machines make costly). Not while the store
     * is over its budget: the slow path's publish evicts what the last invocation had to keep. */
    if (!atomic_load(&g_decode_all) && !atomic_load(&s->over_budget) &&
        all_routed_hot(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1)) {
        if (ith == 0) {
            note_hits(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
        }
        return 0;
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
    const int64_t     plan_n = s->plan_n; /* stable until every thread of this invocation has left */
    const plan_item * plan   = s->plan;
    pthread_mutex_unlock(&s->mu);

    int64_t       status = 0, chunks = 0;
    const int64_t n_chunks = s->info.n_chunks;
    if (plan_n > 0) {
        const size_t     chunk_n = (size_t) s->info.chunk_n;
        thread_scratch * ts = thread_scratch_get(chunk_n, chunk_n + zipmoe_chunk_bound(zipmoe_tensor_codec(s->tensor), chunk_n));
        const uint64_t   t0 = now_ns();
        if (!ts) {
            record_error(s, plan[0].expert, ZIPMOE_ERR_NOMEM);
            status = ZIPMOE_ERR_NOMEM;
        }
        /* chunk c of the j-th planned expert goes to thread (j * n_chunks + c) % nth */
        for (int64_t j = 0; j < plan_n && status == 0; j++) {
            const int64_t first = (((int64_t) ith - (j * n_chunks) % nth) % nth + nth) % nth;
            for (int64_t c = first; c < n_chunks; c += nth) {
                const int64_t rc = decode_chunk(s, &plan[j], c, ts);
                if (rc < 0) {
                    record_error(s, plan[j].expert, rc);
                    status = rc;
                    break;
                }
                chunks++;
            }
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
        if (s->plan_failed) {
            discard_plan(s);
        } else {
            publish(s);
        }
        s->plan_key = NULL;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return status < 0 ? status : chunks;
}

int64_t zipmoe_store_activations(zipmoe_store * s, uint64_t * counts, int64_t n) {
    if (!s || !counts || n < s->info.n_expert) {
        return ZIPMOE_ERR_ARG;
    }
    pthread_mutex_lock(&s->mu);
    for (int64_t e = 0; e < s->info.n_expert; e++) {
        counts[e] = s->experts[e].activations;
    }
    pthread_mutex_unlock(&s->mu);
    return s->info.n_expert;
}
