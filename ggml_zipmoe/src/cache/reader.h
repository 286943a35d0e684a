/* reader.h - the reader thread (reader.c): reads a job's segments from a file, item after item, while other
 * threads wait for the items they need; then runs the job's `then`. It knows files, buffers and callbacks, not
 * what its users do with them (the expert cache's: readahead.c reads the next store ahead in a `then`). */
#ifndef ZIPMOE_READER_H
#define ZIPMOE_READER_H

#include "zipmoe-impl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

/* An item lists up to two segments (offset from the data companion, size, destination); `ready` becomes 1 once they are read, -1 on an
 * error or a cancel. */
typedef struct {
    uint64_t  offset;
    uint64_t  size;
    uint8_t * dst;
    int       direct; /* dst lies in a buffer laid out for zipmoe_pread_direct: read around the page cache */
} zipmoe_read_seg;

typedef struct {
    zipmoe_read_seg seg[2];
    int             n_seg;
    _Atomic int     ready;
    /* in a job whose staging is a ring (ring_wraps): the item's bytes [ring_lo, ring_hi) of the staging buffer
     * (ring_hi 0: none), which the reader fills only once every earlier item there is released (decoded) */
    uint64_t        ring_lo, ring_hi;
    _Atomic int     released;
    _Atomic int64_t chunks_left; /* chunks of it not decoded yet; the last one releases it */
} zipmoe_read_item;

/* Background work a job runs instead of reads (say, huge pages for a settled store): 1 when done, 0 when it
 * yielded to reads waiting (zipmoe_reader_reads_waiting), to be queued again after them. */
typedef int (*zipmoe_read_work_fn)(void * user);

/* What a job does after its reads, on the reader thread, once the job is done with its buffers (its owner may
 * submit it again meanwhile: the reader copies this first): fn(user, arg, flag), unless the job was cancelled. */
typedef struct {
    void (*fn)(void * user, const void * arg, int flag);
    void *       user;
    const void * arg;
    int          flag;
} zipmoe_read_then;

typedef struct zipmoe_read_job {
    int                      fd;
    int                      dfd;     /* the same file opened with O_DIRECT, or -1 */
    uint64_t                 base;    /* file offset of the data companion */
    int64_t                  n_items;
    zipmoe_read_item *       items;
    _Atomic int              cancel;
    int                      busy;    /* under mu: submitted and not finished */
    pthread_mutex_t          mu;
    pthread_cond_t           cv;
    zipmoe_read_work_fn      work;      /* instead of reads: work(work_user), or NULL */
    void *                   work_user;
    zipmoe_read_then         then;      /* after the reads (then.fn NULL: nothing) */
    int                      ring_wraps; /* the staging buffer is smaller than the reads: items reuse its bytes */
    struct zipmoe_read_job * next;
} zipmoe_read_job;

int  zipmoe_reader_submit(zipmoe_read_job * job);              /* ZIPMOE_OK, or an error: read synchronously */
int  zipmoe_reader_wait_item(zipmoe_read_job * job, int64_t i); /* ZIPMOE_OK once item i is read */
void zipmoe_reader_finish(zipmoe_read_job * job, int cancel);   /* waits until the reader is done with job */
/* By the decoder of item i's last chunk in a ring job: its staged bytes may be read over. */
void zipmoe_reader_release_item(zipmoe_read_job * job, int64_t i);
/* A decode failed: the reader stops (the items left are marked failed), and nobody waits for releases. */
void zipmoe_reader_cancel(zipmoe_read_job * job);
int  zipmoe_pread_all(int fd, uint64_t offset, void * buf, size_t size);
/* pread on a descriptor opened with O_DIRECT: reads [offset, offset + size) of the file into buf, reading the
 * aligned span around it, so buf - offset % ZIPMOE_DIRECT_ALIGN must be aligned and the span's rounded-up end
 * must fit the buffer. ZIPMOE_ERR_ARG if the file system refused the alignment (EINVAL). */
int  zipmoe_pread_direct(int dfd, uint64_t offset, void * buf, size_t size);
/* Reads what no tier keeps: with zipmoe_pread_direct where dfd >= 0 and the file system takes it (buf laid out
 * for it), else through the page cache, dropping the pages after (the budget counts one copy). */
int  zipmoe_pread_uncached(int fd, int dfd, uint64_t offset, void * buf, size_t size);
int  zipmoe_reader_reads_waiting(void); /* a job of reads is queued: background work should yield */
/* Waits until no job's `then` runs: one uses what its user and arg point to, which a caller freeing them (after
 * the job that set them finished) must outlive. */
void zipmoe_reader_wait_then(void);
/* Bytes read and nanoseconds spent reading by every pread above, since the start or the last reset (zipmoe_stats). */
void zipmoe_reader_totals(uint64_t * bytes, uint64_t * ns);
void zipmoe_reader_reset_totals(void);

#endif /* ZIPMOE_READER_H */
