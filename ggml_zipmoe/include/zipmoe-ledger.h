/*
 * zipmoe-ledger.h - where a token's time goes: the time ledger of the thread that computes the graphs.
 *
 * The ledger follows one timeline, the thread that calls a graph with zipmoe experts (llama.cpp's, which ggml
 * makes thread 0 of the graph): every nanosecond of it from a graph's start to its end falls in exactly one part,
 * and so does the gap until the same thread's next graph. The other threads of a graph work in parallel with it
 * and are not added (their time is not the token's time). Parts:
 *   compute      the graph's nodes (attention, the router, the expert matmuls, norms; a fused op's rows) and
 *                ggml's barriers after them
 *   decode       decoding experts (chunks, a streamed expert's planes) into their places or the thread's cache
 *   read_wait    waiting for bytes the reader has yet to bring from the file
 *   thread_wait  waiting for other threads: the graph's siblings finishing their share of an invocation, another
 *                invocation's plan, another graph's turn, a store's lock
 *   other        zipmoe's own work in its ops: plans, evictions, publishing, the ids' places, the fused op's setup
 *                (the activations converted for its rows)
 *   between      from a graph's end to the same thread's next graph: llama.cpp's work outside the graph
 *                (inputs, logits), sampling and the caller (zipmoe_stats_reset starts a fresh span)
 * Clock reads only (CLOCK_MONOTONIC), on that thread only; the sums are process-wide and zeroed by
 * zipmoe_stats_reset.
 */
#ifndef ZIPMOE_LEDGER_H
#define ZIPMOE_LEDGER_H

#include "zipmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    ZIPMOE_LEDGER_COMPUTE     = 0,
    ZIPMOE_LEDGER_DECODE      = 1,
    ZIPMOE_LEDGER_READ_WAIT   = 2,
    ZIPMOE_LEDGER_THREAD_WAIT = 3,
    ZIPMOE_LEDGER_OTHER       = 4,
    ZIPMOE_LEDGER_NONE        = 5  /* not on a ledger's timeline */
} zipmoe_ledger_part;

typedef struct {
    uint64_t graphs;         /* graph computes with zipmoe experts */
    uint64_t tokens;         /* their tokens (the batches' sizes) */
    uint64_t wall_ns;        /* from their starts to their ends: compute + decode + read_wait + thread_wait + other */
    uint64_t compute_ns;
    uint64_t decode_ns;
    uint64_t read_wait_ns;
    uint64_t thread_wait_ns;
    uint64_t other_ns;
    uint64_t between_ns;     /* gaps between one graph's end and the next's start on the same thread */
} zipmoe_ledger;

ZIPMOE_API void zipmoe_ledger_get(zipmoe_ledger * out);

/* For the llama.cpp glue. A graph's start on the calling thread (its part: other) and its end (tokens: its
 * batch's; the thread leaves the timeline). */
ZIPMOE_API void zipmoe_ledger_graph_begin(void);
ZIPMOE_API void zipmoe_ledger_graph_end(int64_t tokens);
/* The calling thread's time from now on counts as part; returns the part it counted as until now, to switch back
 * to. On a thread not on a timeline (a graph's other threads): nothing, and ZIPMOE_LEDGER_NONE. */
ZIPMOE_API int zipmoe_ledger_switch(int part);

#ifdef __cplusplus
}
#endif

#endif /* ZIPMOE_LEDGER_H */
