/* materialize.c - the materialise protocol: an invocation's routed experts decoded where the matmul reads them.
 *
 * The protocol, for an engine that calls an op on all of its threads with no barrier inside the op
 * (ggml's custom ops): the first thread of an invocation plans (routed experts that are not hot, and
 * what is read from RAM or disk, which the reader thread starts reading); the threads that join claim
 * the plan's chunks one by one and decode them; the last thread to leave publishes (hot), evicts down to
 * the limits and releases the plan. A decoded expert lies at a place in the BF16 memory, not always its own
 * index (a miss takes the place of the expert evicted for it, pages and all), and each thread writes where
 * the routed experts lie for its share of the rows, which the engine's matmul reads as its ids. No thread
 * waits for a sibling, every chunk is decoded exactly once, and the engine's barrier after the op makes the
 * decoded bytes visible to the matmul. Threads need not agree on taking the lock-free fast path (a
 * configuration change may land between their checks): those that join the plan finish it between them,
 * and a thread arriving after it was published finds its experts decoded. The experts routed by the
 * invocation are never evicted by it: the matmul that reads them has not run yet. They stay pinned until the
 * store's next invocation, or until another store plans (the engine runs each op's matmul before the next
 * expert tensor's op), which bounds the decoded working set beyond the limits to one store's routed experts.
 * A second invocation on the same store (another graph) waits until the first has released its plan. */
#define _GNU_SOURCE
#include "cache-impl.h"
#include "zipmoe-ledger.h"

#include <fcntl.h>

/* Chunk c of a raw plan item: its bytes copied from where they were read to (staged, read ahead or kept), or read
 * from the file straight into its place. Nothing to check: a plain GGUF has no checksums, as for llama.cpp. */
static int64_t copy_raw_chunk(zipmoe_store * s, const plan_item * it, int64_t c) {
    uint64_t first, size;
    cache_raw_chunk(s, c, &first, &size);
    uint8_t *       to   = (uint8_t *) place_addr(s, s->experts[it->expert].place) + first;
    const uint8_t * from = it->codes ? it->codes + (first - it->codes_bias) : NULL;
    if (!from) { /* not read for the plan: from the file, into the place, or for a put into this thread's scratch */
        zipmoe_expert_span span;
        cache_expert_span(s, it->expert, &span);
        thread_scratch * ts  = s->raw_put ? cache_thread_scratch(1, (size_t) size) : NULL;
        uint8_t *        buf = s->raw_put ? (ts ? ts->buf : NULL) : to;
        if (!buf) {
            return ZIPMOE_ERR_NOMEM;
        }
        if (cache_read_cold(s, span.offset + first, buf, (size_t) size) < 0) {
            return ZIPMOE_ERR_IO;
        }
        if (!s->raw_put) {
            return ZIPMOE_OK;
        }
        from = buf;
    }
    if (s->raw_put) {
        s->raw_put(s->raw_put_ctx, to, from, (int64_t) (size / s->row_bytes));
    } else {
        memcpy(to, from, (size_t) size);
    }
    return ZIPMOE_OK;
}

/* Decodes chunk c of a plan item, reading what is not in RAM. */
static int64_t decode_chunk(zipmoe_store * s, const plan_item * it, int64_t c, thread_scratch * ts) {
    if (s->raw) {
        return copy_raw_chunk(s, it, c);
    }
    zipmoe_expert_span span;
    zipmoe_chunk_ref   ref;
    cache_expert_span(s, it->expert, &span);
    zipmoe_tensor_chunk(s->tensor, it->expert, c, &ref);
    uint8_t * sm   = it->sm ? it->sm + ref.first : ts->buf;
    uint8_t * code = it->codes ? it->codes + (ref.code_offset - it->codes_bias) : ts->buf + ref.n;
    if (!it->staged && !it->prefetched && ((it->read_sm && cache_read_cold(s, span.offset + (uint64_t) ref.first, sm, (size_t) ref.n) < 0) ||
        (it->read_codes && cache_read_cold(s, span.offset + ref.code_offset, code, (size_t) ref.code_size) < 0))) {
        return ZIPMOE_ERR_IO;
    }
    /* bytes from the file are checked; bytes already in RAM were checked when they came from it (a decode that
     * fails its check drops what it read), and checking them again cost ~20% of a decode-bound run's decoding */
    const int from_file = it->read_sm || it->read_codes;
    /* (units: values of 2 bytes for a split type, bytes for a byte-layout one) */
    const uint64_t unit = s->info.layout == ZIPMOE_LAYOUT_BYTES ? 1 : 2;
    return zipmoe_chunk_decode(zipmoe_tensor_codec(s->tensor), ts->ws, code, (size_t) ref.code_size, sm,
                               (size_t) ref.n, from_file, ref.checksum,
                               (uint8_t *) place_addr(s, s->experts[it->expert].place) + (uint64_t) ref.first * unit);
}

/* An index store's expert whose chunks are all decoded in its place, in the stored layout: put whole (the engine's
 * layout), through this thread's scratch. Its last chunk's thread does it: the others' writes came before their
 * decrements of chunks_left. */
static int64_t put_expert(zipmoe_store * s, const plan_item * it, thread_scratch * ts) {
    uint8_t * place = (uint8_t *) place_addr(s, s->experts[it->expert].place);
    memcpy(ts->buf, place, (size_t) s->hot_size);
    s->raw_put(s->raw_put_ctx, place, ts->buf, (int64_t) (s->hot_size / s->row_bytes));
    return ZIPMOE_OK;
}

/* Under s->mu, by the last thread of an invocation: the planned experts are hot now; the tiers go down
 * to their limits, never touching an expert this invocation routed (its matmul is still to come). */
static void publish(zipmoe_store * s) {
    const uint64_t tick = atomic_load(&g_open.tick);
    s->planning = 0;
    for (int64_t j = 0; j < s->plan_n; j++) {
        const plan_item * it = &s->plan[j];
        expert_state *    x  = &s->experts[it->expert];
        if (!it->staged && !it->prefetched && (it->read_sm || it->read_codes)) { /* (the reader drops its own) */
            /* the budget counts what zipmoe keeps: the kernel must not keep a second, uncounted copy */
            zipmoe_expert_span span;
            cache_expert_span(s, it->expert, &span);
            cache_advise(s, span.offset, span.size, POSIX_FADV_DONTNEED);
        }
        if (!x->hot) {
            x->hot      = 1;
            x->admitted = tick;
            s->hot_used += s->hot_size;
            cache_account(&g_stats.hot_bytes, (int64_t) s->hot_size);
        }
    }
    cache_end_decoding(s); /* (after: a reading of the stats never misses them) */
    cache_settle(s);
}

/* Under s->mu, after a failed invocation: what was planned is not hot, and what it read may be partial. */
static void discard_plan(zipmoe_store * s) {
    s->planning = 0;
    cache_end_decoding(s);
    for (int64_t j = 0; j < s->plan_n; j++) {
        const plan_item * it = &s->plan[j];
        expert_state *    x  = &s->experts[it->expert];
        if (!x->hot && x->place >= 0) { /* what it decoded there is partial */
            cache_vacate_place(s, x->place);
            x->place = -1;
        }
        if (it->read_sm && x->res != RES_NONE) {
            cache_drop_region(s, it->expert);
        } else if (it->read_codes && x->res == RES_FULL) {
            cache_demote_warm(s, it->expert); /* its sign+mantissa plane was resident and is intact */
        }
    }
}

/* Whether streamed expert e is still left to its caller by the plan that routed it (pinned warm). */
static int still_streamed(const expert_state * x) { return x->streamed && x->routed && x->res == RES_FULL; }

/* Whether every expert ids names is decoded (or, with streamed, left to the caller by the last plan): then there is
 * nothing to plan. */
static int all_routed_ready(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                            size_t nb1, int streamed) {
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            if (e < 0 || e >= s->info.n_expert || !(s->experts[e].hot || (streamed && still_streamed(&s->experts[e])))) {
                return 0;
            }
        }
    }
    return 1;
}

/* The fast path's bookkeeping, by one thread: what cache_make_plan records for routed experts. */
static void note_hits(zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0, size_t nb1) {
    const uint64_t      tick   = atomic_fetch_add(&g_open.tick, 1);
    const zipmoe_policy policy = s->policy; /* a torn read only affects the next eviction's order */
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            expert_state * x = &s->experts[e];
            if (x->last_use != tick) {
                x->last_use = tick;
                x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 0 : 1;
                atomic_fetch_add(&g_stats.hits_hot, 1);
            }
            x->uses += policy == ZIPMOE_POLICY_TOKEN_LFU ? 1 : 0;
            x->activations++;
        }
    }
    cache_log_route(s, ids, ne0, ne1, nb0, nb1);
    atomic_fetch_add(&g_stats.calls, 1);
}

/* This thread's share of the rows of `where`: the place of each routed expert, given at the plan and kept until
 * the matmul after the op has read it (a routed expert is pinned). An id out of range is written as it is (ggml
 * refuses it, as stock llama.cpp would); after a failed plan the engine reports the error and drops the output,
 * whatever the places say. */
static void report_places(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                          size_t nb1, int32_t * where, int ith, int nth) {
    if (!where) {
        return;
    }
    for (int64_t r = ne1 * ith / nth; r < ne1 * (ith + 1) / nth; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            const int64_t p = e >= 0 && e < s->info.n_expert ? s->experts[e].place : -1;
            where[r * ne0 + k] = p >= 0 ? (int32_t) p : e;
        }
    }
}

/* Which routed experts an invocation decodes (pending[r * ne0 + k] = 1) and which it leaves to a streaming caller
 * (2), by a thread that holds the plan. */
static void report_pending(const zipmoe_store * s, const uint8_t * ids, int64_t ne0, int64_t ne1, size_t nb0,
                           size_t nb1, int64_t plan_n, uint8_t * pending) {
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t k = 0; k < ne0; k++) {
            int32_t e;
            memcpy(&e, ids + r * nb1 + k * nb0, sizeof e);
            uint8_t in_plan = 0;
            for (int64_t j = 0; j < plan_n && !in_plan; j++) {
                in_plan = s->plan[j].expert == e;
            }
            const int streamed = e >= 0 && e < s->info.n_expert && still_streamed(&s->experts[e]);
            pending[r * ne0 + k] = in_plan ? 1 : streamed ? 2 : 0;
        }
    }
}

int64_t zipmoe_store_materialize_begin(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                       int64_t ne1, size_t nb0, size_t nb1, int32_t * where, uint8_t * pending,
                                       int flags, int ith, int nth, zipmoe_turn * turn) {
    if (!s || !key || !ids || !turn || (pending && !where) || ((flags & ZIPMOE_TURN_STREAM) && !pending) || ne0 < 0 ||
        ne1 < 0 || nth < 1 || ith < 0 || ith >= nth || s->fd < 0 || (flags & ~ZIPMOE_TURN_STREAM)) {
        return ZIPMOE_ERR_ARG;
    }
    *turn = (zipmoe_turn) { 0 };
    /* a turn that reports all places (pending given) reports them itself; materialize's threads report their share */
    const int all_places = pending != NULL;
    /* Once warm, every routed expert is usually decoded already. The resident set changes only when an
     * invocation publishes, and one graph computes at a time, so all threads of this invocation see the
     * same answer and may leave without the lock (which busy machines make costly). Not while the store
     * is over its limits or its configuration changed: then the slow path has evictions to do. */
    if (atomic_load(&s->fast_ok) && atomic_load(&g_cfg.gen) == s->cfg_gen && s->hot_limit > 0 && !s->prefilling &&
        all_routed_ready(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, 0)) {
        if (ith == 0 && !(atomic_load(&s->last_key) == key && atomic_load(&g_open.op_seq) == atomic_load(&s->last_seq))) {
            atomic_fetch_add(&g_open.op_seq, 1); /* (a late sibling of a planned invocation counts nothing again) */
            note_hits(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
            atomic_store(&s->predicted_fresh, 0);
            if (atomic_load(&s->holds_pf) && pthread_mutex_trylock(&s->mu) == 0) { /* read ahead on a wrong guess */
                if (s->plan_key == NULL) {
                    cache_prefetch_drop(s);
                }
                pthread_mutex_unlock(&s->mu);
            }
            cache_read_ahead_predicted(atomic_load(&s->next_store), s);
            /* only where every expert stays decoded: under a budget experts come and go, each eviction splits a
             * huge page, and collapsing again and again cost more than it saved (at 93% on 2 cores, 11 against 36
             * tokens/s without it) */
            if (atomic_fetch_add(&s->streak, 1) + 1 == COLLAPSE_AFTER && s->n_hp > 0 && !s->use_slots &&
                !atomic_exchange(&s->collapse_queued, 1) && zipmoe_reader_submit(&s->collapse_job) != ZIPMOE_OK) {
                atomic_store(&s->collapse_queued, 0);
            }
        }
        report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, all_places ? 0 : ith, all_places ? 1 : nth);
        if (pending) {
            memset(pending, 0, (size_t) (ne0 * ne1));
        }
        turn->fast = 1;
        return 0;
    }
    atomic_fetch_add(&s->waiting, 1); /* a guessed read-ahead holding mu stops: the router has decided */
    const int part = zipmoe_ledger_switch(ZIPMOE_LEDGER_THREAD_WAIT);
    pthread_mutex_lock(&s->mu);
    atomic_fetch_sub(&s->waiting, 1);
    while (s->plan_key != NULL && s->plan_key != key) {
        pthread_cond_wait(&s->cv, &s->mu);
    }
    zipmoe_ledger_switch(part);
    if (s->plan_key == NULL) {
        s->plan_key    = key;
        s->plan_in     = 0;
        s->plan_failed = 0;
        s->plan_t0     = zipmoe_now_ns();
        s->plan_seq++;
        atomic_store(&s->next_chunk, 0);
    }
    if (s->plan_in == 0 && key == atomic_load(&s->last_key) && atomic_load(&g_open.op_seq) == atomic_load(&s->last_seq) &&
        (s->last_failed || all_routed_ready(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, 1))) {
        /* a sibling that arrives after the others finished this invocation (no other op began since, as the
         * engine's barrier holds them all): its experts are decoded or streamed; it must not decode or count them
         * again. Nor plan again after the invocation failed: its siblings may still stream from what the plan
         * pinned. It fails too (a caller that broke the key's contract is told, not served undecoded experts). */
        s->plan_n = 0;
        if (s->last_failed) {
            int32_t first = -1;
            if (ne0 > 0 && ne1 > 0) {
                memcpy(&first, ids, sizeof first);
            }
            s->plan_failed = 1;
            cache_record_error(s, first, ZIPMOE_ERR_CORRUPT);
        }
    } else if (s->plan_in == 0) {
        atomic_store(&s->last_key, key);
        atomic_store(&s->last_seq, atomic_fetch_add(&g_open.op_seq, 1) + 1);
        s->plan_stream    = (flags & ZIPMOE_TURN_STREAM) != 0;
        const int64_t bad = cache_make_plan(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1);
        if (bad != -1) {
            cache_record_error(s, bad, ZIPMOE_ERR_ARG);
            s->plan_failed = 1;
        }
        cache_schedule_reads(s);
        cache_map_plan(s);
        atomic_fetch_add(s->prefilling ? &g_stats.prefill_dummy : &g_stats.calls, 1);
    }
    s->plan_in++;
    turn->plan_n = s->plan_n; /* stable until every thread of this invocation has left */
    turn->plan   = s->plan;
    turn->seq    = s->plan_seq;
    turn->ring   = s->job_active && s->job.ring_wraps;
    if (all_places) { /* given at the plan: a routed expert keeps its place until the next invocation */
        report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, 0, 1);
        report_pending(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, turn->plan_n, pending);
    }
    pthread_mutex_unlock(&s->mu);
    return 0;
}

/* The decoding of a turn, then its end: materialize's, or the turn of a caller that reported every place. */
static int64_t end_turn(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0, int64_t ne1, size_t nb0,
                        size_t nb1, int32_t * where, int ith, int nth) {
    int64_t       status = 0, chunks = 0;
    const int64_t n_chunks = s->info.n_chunks;
    const int64_t     plan_n = turn->plan_n;
    const plan_item * plan   = turn->plan;
    if (plan_n > 0) {
        const size_t     chunk_n = (size_t) s->info.chunk_n;
        const size_t     bound   = s->raw ? 0 : chunk_n + zipmoe_chunk_bound(zipmoe_tensor_codec(s->tensor), chunk_n);
        const int        put     = !s->raw && s->raw_put; /* (then an expert goes through the scratch too) */
        thread_scratch * ts = s->raw ? NULL /* (a copy needs none) */
                                     : cache_thread_scratch(chunk_n, put && s->hot_size > bound ? (size_t) s->hot_size : bound);
        const uint64_t   t0 = zipmoe_now_ns();
        if (!ts && !s->raw) {
            cache_record_error(s, plan[0].expert, ZIPMOE_ERR_NOMEM);
            status = ZIPMOE_ERR_NOMEM;
        }
        /* Chunks are claimed one at a time in the plan's order, so the threads finish together: a thread that
         * ran out of work early would spin in the engine's barrier on a core the reader and the others need.
         * A thread whose chunk is not read yet sleeps until it is. */
        for (int64_t g; status == 0 && (g = atomic_fetch_add(&s->next_chunk, 1)) < plan_n * n_chunks;) {
            const int64_t j = g / n_chunks, c = g % n_chunks;
            if (plan[j].staged && turn->idle && atomic_load(&s->job.items[j].ready) == 0) {
                zipmoe_ledger_switch(ZIPMOE_LEDGER_COMPUTE); /* (the caller's other work while its bytes are read) */
                while (atomic_load(&s->job.items[j].ready) == 0 && turn->idle(turn->idle_ctx)) {
                }
            }
            int64_t rc = ZIPMOE_OK;
            if (plan[j].staged) {
                if (atomic_load(&s->job.items[j].ready) == 0) { /* (no clock read where the bytes are there) */
                    zipmoe_ledger_switch(ZIPMOE_LEDGER_READ_WAIT);
                }
                rc = zipmoe_reader_wait_item(&s->job, j);
            }
            zipmoe_ledger_switch(ZIPMOE_LEDGER_DECODE);
            if (rc == ZIPMOE_OK) {
                rc = decode_chunk(s, &plan[j], c, ts);
            }
            /* (chunks_left is the plan's, shared by its threads as next_chunk is) */
            if (rc >= 0 && put && atomic_fetch_sub(&((plan_item *) &plan[j])->chunks_left, 1) == 1) {
                rc = put_expert(s, &plan[j], ts);
            }
            if (rc < 0) {
                cache_record_error(s, plan[j].expert, rc);
                status = rc;
                if (turn->ring) { /* the reader may wait for this item's room, which is never released now */
                    zipmoe_reader_cancel(&s->job);
                }
                break;
            }
            zipmoe_read_item * item = &s->job.items[j];
            if (turn->ring && item->ring_hi && atomic_fetch_sub(&item->chunks_left, 1) == 1) {
                zipmoe_reader_release_item(&s->job, j);
            }
            chunks++;
        }
        zipmoe_ledger_switch(ZIPMOE_LEDGER_OTHER);
        atomic_fetch_add(&g_stats.ns, zipmoe_now_ns() - t0);
        atomic_fetch_add(&g_stats.chunks, (uint64_t) chunks);
    }

    const int part = zipmoe_ledger_switch(ZIPMOE_LEDGER_THREAD_WAIT);
    pthread_mutex_lock(&s->mu);
    zipmoe_ledger_switch(part);
    if (status < 0) {
        s->plan_failed = 1;
    }
    report_places(s, (const uint8_t *) ids, ne0, ne1, nb0, nb1, where, ith, nth); /* (before a discard frees them) */
    if (--s->plan_in == 0) {
        s->last_failed = s->plan_failed;
        atomic_fetch_add(&g_stats.experts, (uint64_t) plan_n);
        atomic_fetch_add(&g_stats.bytes, (uint64_t) plan_n * s->hot_size);
        if (s->job_active) { /* the reader may still be busy with a failed plan's buffers */
            zipmoe_reader_finish(&s->job, s->plan_failed);
            cache_staging_give(s);
            s->job_active = 0;
        }
        if (s->plan_failed) {
            discard_plan(s);
        } else {
            publish(s);
        }
        cache_prefetch_drop(s); /* what was read ahead is decoded, or kept by a tier */
        if (plan_n > 0 && !s->prefilling) {
            atomic_fetch_add(&g_stats.stall_ns, zipmoe_now_ns() - s->plan_t0);
        }
        int64_t read = 0;
        for (int64_t j = 0; j < plan_n && !read; j++) {
            read = plan[j].read_sm || plan[j].read_codes;
        }
        if (read && !s->prefilling) {
            atomic_fetch_add(&g_stats.reading_calls, 1);
        }
        s->plan_key = NULL;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return status < 0 ? status : chunks;
}

int64_t zipmoe_store_materialize_end(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0,
                                     int64_t ne1, size_t nb0, size_t nb1) {
    if (!s || !turn || !ids) {
        return ZIPMOE_ERR_ARG;
    }
    return turn->fast ? 0 : end_turn(s, turn, ids, ne0, ne1, nb0, nb1, NULL, 0, 1);
}

int64_t zipmoe_store_materialize_wait(zipmoe_store * s, const zipmoe_turn * turn) {
    if (!s || !turn) {
        return ZIPMOE_ERR_ARG;
    }
    if (turn->fast) {
        return ZIPMOE_OK;
    }
    const int part = zipmoe_ledger_switch(ZIPMOE_LEDGER_THREAD_WAIT);
    pthread_mutex_lock(&s->mu);
    while (s->plan_key != NULL && s->plan_seq == turn->seq) {
        pthread_cond_wait(&s->cv, &s->mu);
    }
    const int failed = s->plan_seq == turn->seq && s->plan_failed; /* (kept until the next plan begins) */
    pthread_mutex_unlock(&s->mu);
    zipmoe_ledger_switch(part);
    return failed ? ZIPMOE_ERR_CORRUPT : ZIPMOE_OK; /* (a failed chunk's error is recorded) */
}

/* Decodes chunk c of streamed expert e's exponent plane into exp[ref->n], or the thread's scratch where exp is NULL
 * (*plane: where it went). Returns OK or the error, recorded; ZIPMOE_ERR_ARG, not recorded, for no store or an e or
 * c out of range (the check both public readers make). */
static int64_t stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp, const uint8_t ** plane,
                                zipmoe_chunk_ref * ref) {
    if (!s || s->raw || e < 0 || e >= s->info.n_expert || c < 0 || c >= s->info.n_chunks) {
        return ZIPMOE_ERR_ARG; /* (a raw store keeps no warm copy: nothing is ever streamed) */
    }
    const expert_state * x = &s->experts[e]; /* (pinned: set under mu by the plan this thread's _begin saw) */
    int64_t              rc = ZIPMOE_ERR_ARG; /* (not streamed: the caller's rows of it are missing, to be dropped) */
    if (still_streamed(x)) {
        const int        part    = zipmoe_ledger_switch(ZIPMOE_LEDGER_DECODE);
        const size_t     chunk_n = (size_t) s->info.chunk_n;
        thread_scratch * ts      = cache_thread_scratch(chunk_n, chunk_n + zipmoe_chunk_bound(zipmoe_tensor_codec(s->tensor),
                                                                                            chunk_n));
        rc = ZIPMOE_ERR_NOMEM;
        if (ts) {
            zipmoe_tensor_chunk(s->tensor, e, c, ref);
            *plane = exp ? exp : ts->ws->exp;
            /* (the warm copy's bytes were checked when they came from the file, as decode_chunk's are) */
            rc = zipmoe_decode_exp(zipmoe_tensor_codec(s->tensor), ts->ws, x->region + ref->code_offset,
                                   (size_t) ref->code_size, (uint8_t *) *plane, (size_t) ref->n, x->region + ref->first,
                                   (size_t) ref->n);
        }
        zipmoe_ledger_switch(part);
    }
    if (rc < 0) {
        cache_record_error(s, e, rc);
        return rc;
    }
    return ZIPMOE_OK;
}

int64_t zipmoe_store_stream_chunk(zipmoe_store * s, int64_t e, int64_t c, uint16_t * out) {
    zipmoe_chunk_ref ref;
    const uint8_t *  exp;
    const int64_t    rc = out ? stream_exponents(s, e, c, NULL, &exp, &ref) : ZIPMOE_ERR_ARG;
    if (rc < 0) {
        return rc;
    }
    zipmoe_merge_bf16_cached(exp, s->experts[e].region + ref.first, (size_t) ref.n, out);
    return ref.n;
}

int64_t zipmoe_store_stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp, const uint8_t ** sm) {
    zipmoe_chunk_ref ref;
    const uint8_t *  plane;
    const int64_t    rc = (exp && sm) ? stream_exponents(s, e, c, exp, &plane, &ref) : ZIPMOE_ERR_ARG;
    if (rc < 0) {
        return rc;
    }
    *sm = s->experts[e].region;
    return ref.n;
}

int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids, int64_t ne0, int64_t ne1,
                                 size_t nb0, size_t nb1, int32_t * where, int ith, int nth) {
    zipmoe_turn   turn;
    const int64_t rc = zipmoe_store_materialize_begin(s, key, ids, ne0, ne1, nb0, nb1, where, NULL, 0, ith, nth, &turn);
    if (rc < 0 || turn.fast) {
        return rc;
    }
    return end_turn(s, &turn, ids, ne0, ne1, nb0, nb1, where, ith, nth);
}

