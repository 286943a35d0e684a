/* reader.c - the disk side of cache-affinity scheduling: one thread, created on first use and kept, that
 * reads the compressed bytes a plan needs from the model file, item after item in the plan's order, while
 * the engine's threads decode what is already in RAM. Decoders wait only for the item they are about to
 * decode. One large pread per region instead of two small ones per chunk keeps the disk at its sequential
 * speed. Reads into the staging buffer go around the page cache (O_DIRECT); reads into a tier's region, whose
 * address is not aligned, go through it, with a hint for the next item keeping a request in flight while the
 * current one is copied. After a job's reads, its `then` runs (the cache reads the next store's bytes ahead
 * there); a job may instead carry background work, which runs when no reads wait (reader.h). */
#define _GNU_SOURCE
#include "reader.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

/* One reader thread per process: one disk, and one graph computes at a time, so its jobs come one after another. */
static struct {
    pthread_mutex_t   mu;
    pthread_cond_t    cv;
    zipmoe_read_job * head, *tail; /* the queue, under mu */
    int               started;
    int               in_then;     /* under mu: a job's `then` is running */
    pthread_cond_t    then_cv;     /* it stopped */
    _Atomic uint64_t  read_bytes, read_ns; /* zipmoe_reader_totals */
} g_reader = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .then_cv = PTHREAD_COND_INITIALIZER };

/* Regions hinted (POSIX_FADV_WILLNEED) ahead of the one being read: requests in flight keep the disk busy
 * while a pread copies; a few, so that the page cache they pass through stays small. */
#define READ_AHEAD 4

static void count_read(uint64_t bytes, uint64_t ns) {
    atomic_fetch_add(&g_reader.read_bytes, bytes);
    atomic_fetch_add(&g_reader.read_ns, ns);
}

void zipmoe_reader_totals(uint64_t * bytes, uint64_t * ns) {
    *bytes = atomic_load(&g_reader.read_bytes);
    *ns    = atomic_load(&g_reader.read_ns);
}

void zipmoe_reader_reset_totals(void) {
    atomic_store(&g_reader.read_bytes, 0);
    atomic_store(&g_reader.read_ns, 0);
}

int zipmoe_pread_all(int fd, uint64_t offset, void * buf, size_t size) {
    const uint64_t t0   = zipmoe_now_ns();
    size_t         done = 0;
    while (done < size) {
        const ssize_t n = pread(fd, (uint8_t *) buf + done, size - done, (off_t) (offset + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return ZIPMOE_ERR_IO;
        }
        done += (size_t) n;
    }
    count_read(size, zipmoe_now_ns() - t0);
    return ZIPMOE_OK;
}

int zipmoe_pread_direct(int dfd, uint64_t offset, void * buf, size_t size) {
    const uint64_t t0   = zipmoe_now_ns();
    const uint64_t from = offset & ~(uint64_t) (ZIPMOE_DIRECT_ALIGN - 1);
    const size_t   want = (size_t) (offset - from) + size; /* bytes from `from` that must arrive */
    const size_t   len  = zipmoe_align_up(want, ZIPMOE_DIRECT_ALIGN);
    uint8_t *      dst  = (uint8_t *) buf - (offset - from);
    size_t         done = 0;
    while (done < want) {
        const ssize_t n = pread(dfd, dst + done, len - done, (off_t) (from + done));
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0 || (size_t) n % ZIPMOE_DIRECT_ALIGN != 0) { /* an error, the end of the file, or a short */
            if (n > 0 && done + (size_t) n >= want) {          /* read that still brought what was asked */
                done += (size_t) n;
                break;
            }
            return n < 0 && errno == EINVAL ? ZIPMOE_ERR_ARG : ZIPMOE_ERR_IO;
        }
        done += (size_t) n;
    }
    count_read(size, zipmoe_now_ns() - t0);
    return ZIPMOE_OK;
}

int zipmoe_pread_uncached(int fd, int dfd, uint64_t offset, void * buf, size_t size) {
    int rc = dfd >= 0 ? zipmoe_pread_direct(dfd, offset, buf, size) : ZIPMOE_ERR_ARG;
    if (rc == ZIPMOE_ERR_ARG) { /* through the page cache, which must not keep a second copy after */
        rc = zipmoe_pread_all(fd, offset, buf, size);
        posix_fadvise(fd, (off_t) offset, (off_t) size, POSIX_FADV_DONTNEED);
    }
    return rc;
}

static void hint(const zipmoe_read_job * job, const zipmoe_read_item * it) {
    for (int k = 0; k < it->n_seg; k++) {
        if (it->seg[k].direct && job->dfd >= 0) {
            continue; /* read around the page cache: a hint would only fill it */
        }
        posix_fadvise(job->fd, (off_t) (job->base + it->seg[k].offset), (off_t) it->seg[k].size, POSIX_FADV_WILLNEED);
    }
}

static void mark(zipmoe_read_job * job, zipmoe_read_item * it, int status) {
    pthread_mutex_lock(&job->mu);
    atomic_store(&it->ready, status);
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

int zipmoe_reader_reads_waiting(void) {
    pthread_mutex_lock(&g_reader.mu);
    int waiting = 0;
    for (const zipmoe_read_job * j = g_reader.head; j && !waiting; j = j->next) {
        waiting = j->work == NULL;
    }
    pthread_mutex_unlock(&g_reader.mu);
    return waiting;
}

static void enqueue(zipmoe_read_job * job) { /* under g_reader.mu */
    job->next = NULL;
    if (g_reader.tail) {
        g_reader.tail->next = job;
    } else {
        g_reader.head = job;
    }
    g_reader.tail = job;
}

/* Under g_reader.mu: the next job to run: reads before huge-page work, which only saves time later, while a token
 * waits on reads now. */
static zipmoe_read_job * dequeue(void) {
    zipmoe_read_job *prev = NULL, *job = g_reader.head;
    while (job && job->work) {
        prev = job;
        job  = job->next;
    }
    if (!job) {
        prev = NULL;
        job  = g_reader.head;
    }
    if (prev) {
        prev->next = job->next;
    } else {
        g_reader.head = job->next;
    }
    if (g_reader.tail == job) {
        g_reader.tail = prev;
    }
    return job;
}

/* In a ring job: waits until every earlier item whose staged bytes overlap item j's is released. 0 if the job
 * was cancelled meanwhile. The decoders claim items in order and item j is read after them, so they are read
 * and each is being decoded or about to be: no wait here is for something that waits for this thread. */
static int wait_ring_room(zipmoe_read_job * job, int64_t j) {
    const zipmoe_read_item * it = &job->items[j];
    if (!job->ring_wraps || it->ring_hi == 0) {
        return 1;
    }
    for (int64_t k = 0; k < j; k++) {
        const zipmoe_read_item * o = &job->items[k];
        if (o->ring_hi == 0 || o->ring_hi <= it->ring_lo || it->ring_hi <= o->ring_lo || atomic_load(&o->released)) {
            continue;
        }
        pthread_mutex_lock(&job->mu);
        while (!atomic_load(&o->released) && !atomic_load(&job->cancel)) {
            pthread_cond_wait(&job->cv, &job->mu);
        }
        pthread_mutex_unlock(&job->mu);
        if (atomic_load(&job->cancel)) {
            return 0;
        }
    }
    return 1;
}

static void run(zipmoe_read_job * job) {
    if (job->work) {
        if (!job->work(job->work_user)) { /* it yielded to reads: the rest later */
            pthread_mutex_lock(&g_reader.mu);
            enqueue(job);
            pthread_mutex_unlock(&g_reader.mu);
            return;
        }
    }
    int64_t next_hinted = -1;
    for (int64_t j = 0; j < job->n_items; j++) {
        zipmoe_read_item * it = &job->items[j];
        if (it->n_seg == 0) {
            continue;
        }
        for (int64_t h = j + 1; h < job->n_items && h <= j + READ_AHEAD; h++) { /* the next regions: in flight meanwhile */
            if (h > next_hinted && job->items[h].n_seg > 0) {
                hint(job, &job->items[h]);
                next_hinted = h;
            }
        }
        int status = wait_ring_room(job, j) ? 1 : -1;
        for (int k = 0; k < it->n_seg && status > 0; k++) {
            const zipmoe_read_seg * g  = &it->seg[k];
            if (atomic_load(&job->cancel)) {
                status = -1;
                break;
            }
            if (zipmoe_pread_uncached(job->fd, g->direct ? job->dfd : -1, job->base + g->offset, g->dst,
                                      (size_t) g->size) < 0) {
                status = -1;
            }
        }
        mark(job, it, status);
    }
    /* the job is done with its buffers before its `then`: its owner decodes and computes meanwhile (and may
     * submit the job again, so `then` is copied first) */
    const zipmoe_read_then then = job->then;
    const int              run_then = then.fn && !atomic_load(&job->cancel);
    if (run_then) { /* before the job is done: one who frees what `then` uses once the job is done waits for this */
        pthread_mutex_lock(&g_reader.mu);
        g_reader.in_then = 1;
        pthread_mutex_unlock(&g_reader.mu);
    }
    pthread_mutex_lock(&job->mu);
    job->busy = 0;
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
    if (run_then) {
        then.fn(then.user, then.arg, then.flag); /* (the cache's read-ahead: in flight while the job's owner computes) */
        pthread_mutex_lock(&g_reader.mu);
        g_reader.in_then = 0;
        pthread_cond_broadcast(&g_reader.then_cv);
        pthread_mutex_unlock(&g_reader.mu);
    }
}

void zipmoe_reader_wait_then(void) {
    pthread_mutex_lock(&g_reader.mu);
    while (g_reader.in_then) {
        pthread_cond_wait(&g_reader.then_cv, &g_reader.mu);
    }
    pthread_mutex_unlock(&g_reader.mu);
}

static void * reader_main(void * arg) {
    (void) arg;
    for (;;) {
        pthread_mutex_lock(&g_reader.mu);
        while (!g_reader.head) {
            pthread_cond_wait(&g_reader.cv, &g_reader.mu);
        }
        zipmoe_read_job * job = dequeue();
        pthread_mutex_unlock(&g_reader.mu);
        run(job);
    }
    return NULL;
}

int zipmoe_reader_submit(zipmoe_read_job * job) {
    pthread_mutex_lock(&g_reader.mu);
    if (!g_reader.started) {
        pthread_t      t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        g_reader.started = pthread_create(&t, &attr, reader_main, NULL) == 0;
        pthread_attr_destroy(&attr);
        if (!g_reader.started) {
            pthread_mutex_unlock(&g_reader.mu);
            return ZIPMOE_ERR_NOMEM; /* the caller reads synchronously instead */
        }
    }
    atomic_store(&job->cancel, 0);
    job->busy = 1;
    enqueue(job);
    pthread_cond_signal(&g_reader.cv);
    pthread_mutex_unlock(&g_reader.mu);
    return ZIPMOE_OK;
}

int zipmoe_reader_wait_item(zipmoe_read_job * job, int64_t i) {
    zipmoe_read_item * it = &job->items[i];
    int                status = atomic_load(&it->ready);
    if (status == 0) {
        pthread_mutex_lock(&job->mu);
        while ((status = atomic_load(&it->ready)) == 0) {
            pthread_cond_wait(&job->cv, &job->mu);
        }
        pthread_mutex_unlock(&job->mu);
    }
    return status > 0 ? ZIPMOE_OK : ZIPMOE_ERR_IO;
}

void zipmoe_reader_cancel(zipmoe_read_job * job) {
    pthread_mutex_lock(&job->mu);
    atomic_store(&job->cancel, 1);
    pthread_cond_broadcast(&job->cv); /* a reader waiting for ring room */
    pthread_mutex_unlock(&job->mu);
}

void zipmoe_reader_release_item(zipmoe_read_job * job, int64_t i) {
    pthread_mutex_lock(&job->mu);
    atomic_store(&job->items[i].released, 1);
    pthread_cond_broadcast(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

void zipmoe_reader_finish(zipmoe_read_job * job, int cancel) {
    if (cancel) {
        zipmoe_reader_cancel(job);
    }
    pthread_mutex_lock(&job->mu);
    while (job->busy) {
        pthread_cond_wait(&job->cv, &job->mu);
    }
    pthread_mutex_unlock(&job->mu);
}
