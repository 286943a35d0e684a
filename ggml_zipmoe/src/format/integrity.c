/* integrity.c - the zipmoe.integrity record (docs/FORMAT.md): checksums of a zipmoe GGUF's metadata and of
 * its tensors other than the expert data companions, verified once when a loader opens the file.
 *
 * Everything here comes from the file, so it is untrusted: the record is checked for its own checksum and
 * shape before anything is read through it, every offset is checked against the file's size without overflow,
 * and the file is read with pread into one bounded buffer (never mapped: a file truncated under us gives a
 * short read and an error, not a SIGBUS). */
#define _GNU_SOURCE
#include "zipmoe-impl.h"
#include "zipmoe-integrity.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#define REC_MAGIC     0
#define REC_VERSION   1
#define REC_SELF      2 /* file offset of element 0 of the record */
#define REC_META_SIZE 3
#define REC_META_HASH 4
#define REC_N         5
#define REC_HEADER    6 /* then (kind, hash) per tensor, then the record's own checksum */

uint64_t zipmoe_integrity_hash(const void * data, size_t size, uint64_t h) {
    const uint8_t * p = (const uint8_t *) data;
    while (size > 0) {
        const size_t n = size < ZIPMOE_INTEGRITY_BLOCK ? size : ZIPMOE_INTEGRITY_BLOCK;
        h = zipmoe_checksum(p, n, h);
        p += n;
        size -= n;
    }
    return h;
}

static int64_t fail(int64_t status, char * msg, size_t msg_size, const char * fmt, ...) {
    if (msg && msg_size) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_size, fmt, ap);
        va_end(ap);
    }
    return status;
}

/* Reads exactly n bytes at off; 0 on success, -1 on a short read (the file ended) or an I/O error. */
static int pread_full(int fd, uint8_t * buf, size_t n, uint64_t off) {
    while (n > 0) {
        const ssize_t r = pread(fd, buf, n, (off_t) off);
        if (r < 0 && errno == EINTR) {
            continue;
        }
        if (r <= 0) {
            return -1;
        }
        buf += r;
        n -= (size_t) r;
        off += (uint64_t) r;
    }
    return 0;
}

/* The chained hash of [off, off + size) of fd. With a non-NULL `hole`, the bytes [hole_off, hole_off + hole_size)
 * must equal hole[] and are hashed as zeros (the record hashes the metadata with its own value zeroed). */
static int hash_range(int fd, uint8_t * buf, uint64_t off, uint64_t size, const uint8_t * hole, uint64_t hole_off,
                      uint64_t hole_size, uint64_t * out, int * hole_mismatch) {
    uint64_t h = 0;
    for (uint64_t pos = 0; pos < size;) {
        const size_t n = (size_t) (size - pos < ZIPMOE_INTEGRITY_BLOCK ? size - pos : ZIPMOE_INTEGRITY_BLOCK);
        if (pread_full(fd, buf, n, off + pos) != 0) {
            return -1;
        }
        if (hole) {
            const uint64_t a = off + pos, b = a + n; /* this block is [a, b) of the file */
            const uint64_t lo = hole_off > a ? hole_off : a;
            const uint64_t hi = hole_off + hole_size < b ? hole_off + hole_size : b;
            if (lo < hi) {
                if (memcmp(buf + (lo - a), hole + (lo - hole_off), (size_t) (hi - lo)) != 0) {
                    *hole_mismatch = 1;
                }
                memset(buf + (lo - a), 0, (size_t) (hi - lo));
            }
        }
        h = zipmoe_checksum(buf, n, h);
        pos += n;
    }
    *out = h;
    return 0;
}

#define MAX_THREADS 8

typedef struct {
    int                             fd;
    const uint64_t *                record;
    const zipmoe_integrity_tensor * tensors;
    size_t                          n_tensors;
    uint64_t                        meta_size;
    size_t                          next;   /* under mu: the next tensor to take */
    size_t                          bad;    /* under mu: the first damaged tensor found, n_tensors if none */
    int                             bad_io; /* whether that one could not be read */
    pthread_mutex_t                 mu;
} tensor_job;

static void hash_tensors(tensor_job * job, uint8_t * buf) {
    for (;;) {
        pthread_mutex_lock(&job->mu);
        size_t i = job->next;
        while (i < job->n_tensors && job->record[REC_HEADER + 2 * i] != ZIPMOE_INTEGRITY_HASHED) {
            i++;
        }
        job->next = i + 1;
        const int stop = i >= job->n_tensors || i > job->bad;
        pthread_mutex_unlock(&job->mu);
        if (stop) {
            break;
        }
        uint64_t h = 0;
        int      unused = 0;
        const int io = hash_range(job->fd, buf, job->meta_size + job->tensors[i].offset, job->tensors[i].size, NULL, 0, 0,
                                  &h, &unused) != 0;
        if (io || h != job->record[REC_HEADER + 2 * i + 1]) {
            pthread_mutex_lock(&job->mu);
            if (i < job->bad) {
                job->bad    = i;
                job->bad_io = io;
            }
            pthread_mutex_unlock(&job->mu);
        }
    }
}

static void * hash_thread(void * arg) {
    uint8_t * buf = malloc(ZIPMOE_INTEGRITY_BLOCK);
    if (buf) { /* without a buffer this thread leaves the work to the others */
        hash_tensors((tensor_job *) arg, buf);
        free(buf);
    }
    return NULL;
}

static int ends_with(const char * s, const char * suffix) {
    const size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

int64_t zipmoe_integrity_verify(int fd, const uint64_t * record, size_t record_len, uint64_t data_start,
                                const zipmoe_integrity_tensor * tensors, size_t n_tensors, char * msg, size_t msg_size) {
    if (fd < 0 || !record || (!tensors && n_tensors)) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "zipmoe integrity: invalid arguments");
    }
    if (msg && msg_size) {
        msg[0] = '\0';
    }
    /* the record itself: long enough, its own checksum, then its fields */
    if (record_len < REC_HEADER + 1) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (%zu elements, too short)",
                    ZIPMOE_INTEGRITY_KEY, record_len);
    }
    if (zipmoe_checksum(record, (record_len - 1) * 8, 0) != record[record_len - 1]) {
        return fail(ZIPMOE_ERR_CHECKSUM, msg, msg_size, "the %s record is damaged (it does not match its own checksum)",
                    ZIPMOE_INTEGRITY_KEY);
    }
    if (record[REC_MAGIC] != ZIPMOE_INTEGRITY_MAGIC) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (bad magic)", ZIPMOE_INTEGRITY_KEY);
    }
    if (record[REC_VERSION] != ZIPMOE_INTEGRITY_VERSION) {
        return fail(ZIPMOE_ERR_UNSUPPORTED, msg, msg_size, "%s version %llu is not supported (this build reads version %d)",
                    ZIPMOE_INTEGRITY_KEY, (unsigned long long) record[REC_VERSION], ZIPMOE_INTEGRITY_VERSION);
    }
    const uint64_t n = record[REC_N];
    if (n > (record_len - REC_HEADER - 1) / 2 || record_len != REC_HEADER + 2 * n + 1) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (its length does not match its tensor count)",
                    ZIPMOE_INTEGRITY_KEY);
    }
    if (n != n_tensors) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the file has %zu tensors but %s lists %llu: the tensor list is damaged",
                    n_tensors, ZIPMOE_INTEGRITY_KEY, (unsigned long long) n);
    }
    const uint64_t meta_size = record[REC_META_SIZE], self = record[REC_SELF], rec_bytes = (uint64_t) record_len * 8;
    if (meta_size != data_start) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size,
                    "the metadata is damaged: the tensor data starts at byte %llu, %s recorded %llu",
                    (unsigned long long) data_start, ZIPMOE_INTEGRITY_KEY, (unsigned long long) meta_size);
    }
    if (self > meta_size || rec_bytes > meta_size - self) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (it places itself outside the metadata)",
                    ZIPMOE_INTEGRITY_KEY);
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        return fail(ZIPMOE_ERR_ARG, msg, msg_size, "zipmoe integrity: cannot stat the model file");
    }
    const uint64_t file_size = (uint64_t) st.st_size;
    if (meta_size > file_size) {
        return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the file is truncated (its metadata ends at byte %llu, the file has %llu)",
                    (unsigned long long) meta_size, (unsigned long long) file_size);
    }
    /* every tensor's range, checked before the first read */
    for (size_t i = 0; i < n_tensors; i++) {
        const uint64_t kind = record[REC_HEADER + 2 * i];
        const char *   name = tensors[i].name ? tensors[i].name : "?";
        if (kind == ZIPMOE_INTEGRITY_COMPANION) {
            if (!ends_with(name, ".zipmoe_data")) {
                return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the tensor list is damaged: %s lists '%s' as a data companion",
                            ZIPMOE_INTEGRITY_KEY, name);
            }
            continue;
        }
        if (kind != ZIPMOE_INTEGRITY_HASHED) {
            return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (unknown kind %llu for '%s')",
                        ZIPMOE_INTEGRITY_KEY, (unsigned long long) kind, name);
        }
        const uint64_t off = tensors[i].offset, size = tensors[i].size;
        if (off > file_size - meta_size || size > file_size - meta_size - off) {
            return fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "tensor '%s' lies outside the file (truncated file?)", name);
        }
    }

    uint8_t * buf = malloc(ZIPMOE_INTEGRITY_BLOCK);
    if (!buf) {
        return fail(ZIPMOE_ERR_NOMEM, msg, msg_size, "zipmoe integrity: out of memory");
    }
    int64_t  rc       = ZIPMOE_OK;
    int      mismatch = 0;
    uint64_t h        = 0;
    if (hash_range(fd, buf, 0, meta_size, (const uint8_t *) record, self, rec_bytes, &h, &mismatch) != 0) {
        rc = fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "cannot read the metadata (truncated file or I/O error)");
        goto done;
    }
    if (mismatch) {
        rc = fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "the %s record is damaged (it is not where it says it is)",
                  ZIPMOE_INTEGRITY_KEY);
        goto done;
    }
    if (h != record[REC_META_HASH]) {
        rc = fail(ZIPMOE_ERR_CHECKSUM, msg, msg_size,
                  "the metadata (header, key/value pairs and tensor infos: bytes 0-%llu) is damaged: it does not match "
                  "the checksum recorded at conversion",
                  (unsigned long long) meta_size);
        goto done;
    }
    {
        /* the tensors on up to MAX_THREADS threads (hashing runs at memory speed: a few threads halve the cost
         * when the file is in the page cache); the first damaged tensor in file order is the one reported */
        tensor_job job;
        memset(&job, 0, sizeof job);
        job.fd        = fd;
        job.record    = record;
        job.tensors   = tensors;
        job.n_tensors = n_tensors;
        job.meta_size = meta_size;
        job.bad       = n_tensors;
        pthread_mutex_init(&job.mu, NULL);
        uint64_t total = 0;
        for (size_t i = 0; i < n_tensors; i++) {
            total += record[REC_HEADER + 2 * i] == ZIPMOE_INTEGRITY_HASHED ? tensors[i].size : 0;
        }
        long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
        int  nth  = (int) (total / (16u << 20)); /* a thread per 16 MiB at least */
        nth       = nth < 1 ? 1 : nth > MAX_THREADS ? MAX_THREADS : nth;
        nth       = ncpu > 0 && nth > ncpu ? (int) ncpu : nth;
        pthread_t th[MAX_THREADS];
        int       started = 0;
        for (int k = 1; k < nth; k++) {
            if (pthread_create(&th[started], NULL, hash_thread, &job) == 0) {
                started++;
            }
        }
        hash_tensors(&job, buf);
        for (int k = 0; k < started; k++) {
            pthread_join(th[k], NULL);
        }
        pthread_mutex_destroy(&job.mu);
        if (job.bad < n_tensors) {
            const char * name = tensors[job.bad].name ? tensors[job.bad].name : "?";
            rc = job.bad_io ? fail(ZIPMOE_ERR_CORRUPT, msg, msg_size, "cannot read tensor '%s' (truncated file or I/O error)", name)
                            : fail(ZIPMOE_ERR_CHECKSUM, msg, msg_size,
                                   "tensor '%s' is damaged: its bytes do not match the checksum recorded at conversion", name);
        }
    }
done:
    free(buf);
    return rc;
}
