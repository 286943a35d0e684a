/* slots.c - physical memory for decoded experts that outlives them: slots of a memfd, mapped over an expert's
 * place while it is hot and handed to the next expert decoded when it is evicted (plan.c hands a place with its
 * slot to a miss of the same store without any of this).
 *
 * Under a budget experts are evicted and decoded all the time. Freeing an evicted expert's pages and faulting
 * in zeroed ones for the next cost five times the decoding itself (7.6 ms against 1.4 ms per expert of a
 * 2048x768 layer, measured by `zipmoe calibrate`). A slot keeps its pages: mapping it over an expert's range
 * (MAP_FIXED replaces the range's mapping in one step, so the range is never a hole) with MAP_POPULATE fills
 * the page tables at once, with no fault and no zeroing. Slots of one size are shared by every store of the
 * process, so the slots one store frees serve the next. Free slots keep their pages up to a limit (the budget's
 * allowance for the expert tensor in flight); beyond it their pages are given back (a hole punched). */
#define _GNU_SOURCE
#include "io.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct {
    size_t    slot_size;
    int       fd;       /* memfd, slots back to back */
    int64_t   n_slots;  /* the memfd's size / slot_size */
    int64_t * free;     /* free slot ids, those with pages last */
    int64_t   n_free;
    int64_t   n_free_paged; /* free[n_free - n_free_paged .. n_free - 1] still hold pages */
    int64_t   cap_free;
} slot_pool;

#define MAX_POOLS 8

/* The pools: process-wide, so that the slots one store frees serve the next (of any model loaded). */
static struct {
    pthread_mutex_t mu;
    slot_pool       pools[MAX_POOLS];
    int             n_pools;
    uint64_t        keep;     /* bytes of free slots that keep their pages */
    uint64_t        kept;     /* bytes they hold now */
    int             unusable; /* memfd_create failed: no slots in this process */
} g_slots = { .mu = PTHREAD_MUTEX_INITIALIZER };

void zipmoe_slots_set_keep(uint64_t bytes) {
    pthread_mutex_lock(&g_slots.mu);
    g_slots.keep = bytes;
    pthread_mutex_unlock(&g_slots.mu);
}

uint64_t zipmoe_slots_kept(void) {
    pthread_mutex_lock(&g_slots.mu);
    const uint64_t kept = g_slots.kept;
    pthread_mutex_unlock(&g_slots.mu);
    return kept;
}

int zipmoe_slots_usable(const void * addr, size_t size) {
    const size_t page = (size_t) sysconf(_SC_PAGESIZE);
    return !g_slots.unusable && size > 0 && (uintptr_t) addr % page == 0 && size % page == 0;
}

/* Under g_slots.mu: the pool of slots of `size` bytes, created on first use. */
static slot_pool * pool_for(size_t size) {
    for (int i = 0; i < g_slots.n_pools; i++) {
        if (g_slots.pools[i].slot_size == size) {
            return &g_slots.pools[i];
        }
    }
    if (g_slots.n_pools == MAX_POOLS) {
        return NULL;
    }
    const int fd = memfd_create("zipmoe-experts", MFD_CLOEXEC);
    if (fd < 0) {
        g_slots.unusable = 1;
        return NULL;
    }
    slot_pool * p = &g_slots.pools[g_slots.n_pools++];
    *p           = (slot_pool) { .slot_size = size, .fd = fd };
    return p;
}

static void give_back_pages(slot_pool * p, int64_t slot) {
    fallocate(p->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t) (slot * (int64_t) p->slot_size),
              (off_t) p->slot_size);
}

/* Otherwise pages kept beyond a lowered limit go back only as the slots are used; a compressed tier growing into
 * that room meanwhile would take the process over its budget. */
void zipmoe_slots_trim(void) {
    pthread_mutex_lock(&g_slots.mu);
    for (int i = 0; i < g_slots.n_pools && g_slots.kept > g_slots.keep; i++) {
        slot_pool * p = &g_slots.pools[i];
        while (p->n_free_paged > 0 && g_slots.kept > g_slots.keep) {
            give_back_pages(p, p->free[p->n_free - p->n_free_paged]); /* the lowest paged one joins the empty ones */
            p->n_free_paged--;
            g_slots.kept -= p->slot_size;
        }
    }
    pthread_mutex_unlock(&g_slots.mu);
}

int64_t zipmoe_slots_attach(void * addr, size_t size) {
    pthread_mutex_lock(&g_slots.mu);
    slot_pool * p    = pool_for(size);
    int64_t     slot  = -1;
    int         paged = 0;
    if (p) {
        if (p->n_free > 0) {
            slot = p->free[--p->n_free]; /* one that still has pages, if any */
            if (p->n_free_paged > 0) {
                p->n_free_paged--;
                g_slots.kept -= size;
                paged = 1;
            }
        } else if (ftruncate(p->fd, (off_t) ((p->n_slots + 1) * (int64_t) size)) == 0) {
            slot = p->n_slots++;
        }
    }
    /* MAP_POPULATE only where pages exist: new ones are faulted in by the decoding threads, in parallel,
     * rather than here, by the one thread that plans while the others wait */
    if (slot >= 0 && mmap(addr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | (paged ? MAP_POPULATE : 0),
                          p->fd, (off_t) (slot * (int64_t) size)) == MAP_FAILED) {
        /* a failed MAP_FIXED may have unmapped the range: an empty private mapping again; the slot's pages go
         * back and its id is left unused (an empty stretch of the memfd) */
        mmap(addr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        give_back_pages(p, slot);
        slot = -1;
    }
    pthread_mutex_unlock(&g_slots.mu);
    return slot;
}

int zipmoe_slots_detach(void * addr, size_t size, int64_t slot) {
    pthread_mutex_lock(&g_slots.mu);
    slot_pool * p = pool_for(size);
    /* an empty private mapping replaces the slot's in one step: the range is never a hole */
    const int ok = p && mmap(addr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                             -1, 0) != MAP_FAILED;
    if (ok) {
        if (p->n_free == p->cap_free) {
            const int64_t cap  = p->cap_free ? 2 * p->cap_free : 64;
            int64_t *     grow = realloc(p->free, (size_t) cap * sizeof *grow);
            if (grow) {
                p->free     = grow;
                p->cap_free = cap;
            }
        }
        if (p->n_free < p->cap_free) {
            if (g_slots.kept + size <= g_slots.keep) { /* keeps its pages for the next expert decoded */
                p->free[p->n_free++] = slot;
                p->n_free_paged++;
                g_slots.kept += size;
            } else { /* its pages go back; the slot stays, empty, below the paged ones */
                give_back_pages(p, slot);
                const int64_t first_paged = p->n_free - p->n_free_paged;
                p->free[p->n_free++]      = p->n_free_paged ? p->free[first_paged] : slot;
                p->free[first_paged]      = slot;
            }
        } else {
            give_back_pages(p, slot); /* lost to the free list: only its pages matter */
        }
    }
    pthread_mutex_unlock(&g_slots.mu);
    return ok;
}
