/* pages.c - the pages of a store's decoded memory (dst): what a place owns, giving a vacated place's pages back,
 * and huge pages for settled decoded experts, split again before a place's pages go. */
#define _GNU_SOURCE
#include "tiers.h"

#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
#ifndef MADV_COLD
#define MADV_COLD 20 /* Linux 5.4 */
#endif

/* The small pages that lie wholly in place p: [*lo, *hi) (empty where *hi <= *lo). */
void cache_own_pages(const zipmoe_store * s, int64_t p, uintptr_t * lo, uintptr_t * hi) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) place_addr(s, p);
    *lo                   = zipmoe_align_up(begin, page);
    *hi                   = (begin + s->hot_size) & ~(uintptr_t) (page - 1);
}

/* Under s->mu, before place p's pages are given back or replaced (a slot's mmap): its 2 MiB pages known to be huge
 * are split first. A huge page partly unmapped stays whole, charged to the process's cgroup though no longer
 * resident, until the kernel's deferred split runs under memory pressure: after a budget shrank a store that held
 * every expert in huge pages, test_lowered_cgroup_limit_while_generating found ~22 MiB more in its cgroup than the
 * process's pages (a probe: 64 MiB of huge pages with 3/4 of each unmapped stayed charged whole, by MADV_DONTNEED
 * as by a slot's MAP_FIXED). MADV_COLD on part of a huge page splits it (Linux 5.4 on; elsewhere it does nothing);
 * on the place's own pages, so that hot neighbours keep their standing with the kernel. */
void cache_forget_huge_pages(zipmoe_store * s, int64_t p) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t) place_addr(s, p), end = begin + s->hot_size;
    for (uintptr_t hp = begin & ~(HUGE_PAGE - 1); hp < end; hp += HUGE_PAGE) {
        if (hp < s->hp_base || (hp - s->hp_base) / HUGE_PAGE >= s->n_hp || !s->hp_done[(hp - s->hp_base) / HUGE_PAGE]) {
            continue;
        }
        s->hp_done[(hp - s->hp_base) / HUGE_PAGE] = 0;
        const uintptr_t lo = zipmoe_align_up(begin > hp ? begin : hp, page);
        const uintptr_t hi = (end < hp + HUGE_PAGE ? end : hp + HUGE_PAGE) & ~(uintptr_t) (page - 1);
        if (hi > lo && hi - lo < HUGE_PAGE) { /* (all of it: unmapped whole, it is freed whole) */
            madvise((void *) lo, hi - lo, MADV_COLD);
        }
    }
}

/* Under s->mu: place p's pages go back (its slot to the pool, or its anonymous pages to the system: pages it
 * shares with a hot neighbour stay), and the place is free. */
void cache_vacate_place(zipmoe_store * s, int64_t p) {
    const size_t    page  = (size_t) sysconf(_SC_PAGESIZE);
    const size_t    bytes = (size_t) s->hot_size;
    place_state *   at    = &s->places[p];
    const uintptr_t begin = (uintptr_t) place_addr(s, p);
    cache_forget_huge_pages(s, p); /* (splits them while they are mapped) */
    uintptr_t lo, hi;
    cache_own_pages(s, p, &lo, &hi);
    if (p > 0 && (begin & (page - 1)) && begin - (begin & (page - 1)) >= (uintptr_t) s->dst) {
        /* the shared first page, if it holds nothing hot: every place before p that reaches into it (one, unless
         * experts are smaller than a page, as a plain GGUF's tiny ones can be) */
        const uintptr_t first = begin & ~(uintptr_t) (page - 1);
        int             hot   = 0;
        for (int64_t q = p - 1; q >= 0 && !hot && (uintptr_t) place_addr(s, q) + s->hot_size > first; q--) {
            hot = place_hot(s, q);
        }
        if (!hot) {
            lo = first;
        }
    }
    if (at->slot >= 0 && zipmoe_slots_detach((void *) begin, bytes, at->slot)) {
        at->slot = -1; /* its pages serve the next expert decoded */
    } else if (hi > lo) {
        madvise((void *) lo, hi - lo, MADV_DONTNEED);
    }
    at->expert = -1;
}

/* By the prefill's threads once they filled a store whose hot tier holds every expert (after MADV_HUGEPAGE, so
 * usually nothing is left to do), or by the reader thread once the store's resident set has settled
 * (COLLAPSE_AFTER invocations in a row found every routed expert decoded): each 2 MiB page that holds only
 * decoded experts becomes one huge page. The matmuls read whole experts, and huge pages spare them TLB misses
 * (generation went from 0.90x to 0.98x of BF16 with them). Not at the first touch during generation: a huge page
 * fault compacts memory and made cold starts 2.5x slower; nor for a page shared with an expert that is not
 * decoded, whose bytes the budget does not count. */
int cache_collapse(zipmoe_store * s) {
    const uintptr_t dst0 = (uintptr_t) s->dst;
    for (size_t i = 0; i < s->n_hp; i++) {
        if (zipmoe_reader_reads_waiting()) {
            return 0; /* a token waits on reads: they go first, the rest of this later */
        }
        /* the lock only to choose: collapsing takes milliseconds a page, and the store's invocations must not
         * wait for it (an expert evicted meanwhile: see below) */
        pthread_mutex_lock(&s->mu);
        const uintptr_t lo = s->hp_base + i * HUGE_PAGE;
        const int64_t   p0 = (int64_t) ((lo - dst0) / s->hot_size);
        const int64_t   p1 = (int64_t) ((lo + HUGE_PAGE - 1 - dst0) / s->hot_size);
        int             hot = !s->hp_done[i] && p1 < s->info.n_expert;
        for (int64_t p = p0; hot && p <= p1; p++) {
            hot = place_hot(s, p);
        }
        if (hot) {
            s->hp_done[i] = 1;
        }
        pthread_mutex_unlock(&s->mu);
        if (!hot) {
            continue;
        }
        madvise((void *) lo, HUGE_PAGE, MADV_COLLAPSE); /* a failure (no THP here) leaves small pages */
        /* MADV_COLLAPSE fills a hole with zeroed pages (6.18: 3/4 of each 2 MiB page unmapped came back whole), so
         * a place vacated since the choice would hold memory the budget no longer counts: its pages go again, the
         * huge page split first. The page may be huge now whatever an eviction meanwhile found (and cleared
         * hp_done for), so it counts as huge. A place taken by a miss meanwhile is the miss's; so are the small
         * pages a free place shares with its neighbours, which a decode in flight may be writing (cache_vacate_place
         * would take them where the neighbour is not hot yet). */
        pthread_mutex_lock(&s->mu);
        s->hp_done[i] = 1;
        for (int64_t p = p0; p <= p1; p++) {
            if (s->places[p].expert < 0 && s->places[p].slot < 0) {
                uintptr_t from, to;
                cache_own_pages(s, p, &from, &to);
                cache_forget_huge_pages(s, p);
                if (to > from) {
                    madvise((void *) from, to - from, MADV_DONTNEED);
                }
            }
        }
        pthread_mutex_unlock(&s->mu);
    }
    atomic_store(&s->collapse_queued, 0);
    return 1;
}
