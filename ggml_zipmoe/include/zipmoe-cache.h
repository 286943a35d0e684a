/*
 * zipmoe-cache.h - the expert cache of the zipmoe native library: how an inference engine serves compressed
 * experts at run time under a memory budget (stores, tiers and their budgets, the materialise protocol,
 * statistics).
 *
 * The conventions of zipmoe.h hold here (int64_t results, explicit sizes, caller-owned buffers).
 */
#ifndef ZIPMOE_CACHE_H
#define ZIPMOE_CACHE_H

#include "zipmoe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- expert stores (run time) */

/* A store serves one compressed expert tensor to an inference engine: it reserves the tensor's BF16
 * memory (virtual; pages exist only for decoded experts) and decodes the experts a router selects, on
 * the engine's own threads, from RAM or from the model file. What it keeps is bounded by the
 * process's cache budget. */
typedef struct zipmoe_store zipmoe_store;

typedef enum {
    ZIPMOE_POLICY_TOKEN_LFU = 0, /* the paper's: an expert's weight grows by the tokens routed to it */
    ZIPMOE_POLICY_LRU       = 1,
    ZIPMOE_POLICY_LFU       = 2, /* a use counts one, however many tokens */
    ZIPMOE_POLICY_FIFO      = 3,
    ZIPMOE_POLICY_LFUDA     = 4, /* default. LFU with dynamic ageing: uses (evicted experts keep theirs) plus the
                                  * store's age at the last use; an expert leaving the cache raises the age to that */
} zipmoe_policy;
#define ZIPMOE_POLICY_LAST ZIPMOE_POLICY_LFUDA

/* The budgets of every store of the process, per tier (UINT64_MAX: unbounded): hot_bytes of decoded
 * experts, warm_bytes of whole compressed regions and sm_bytes of sign+mantissa planes kept in RAM,
 * shared out among stores in proportion to their BF16 size (the hot tier in whole experts, what a share
 * holds beyond them going on to the next store); and the eviction policy. hot_bytes = 0
 * decodes on every use. The experts the expert tensor in flight routes to are decoded whatever the budget
 * (zipmoe_stats reports the peak). May be called at any time: stores shrink or grow their tiers at
 * their next invocation. Defaults: hot unbounded, warm and sm 0, LFUDA. */
ZIPMOE_API int64_t zipmoe_cache_configure(uint64_t hot_bytes, uint64_t warm_bytes, uint64_t sm_bytes,
                                          zipmoe_policy policy);

/* A planner's per-store plan: stores whose name starts with prefix (the longest matching prefix wins,
 * e.g. "blk.3.") keep at most hot, warm and sm experts in each tier, instead of their share of the
 * budgets. prefix NULL removes every rule. Takes effect like zipmoe_cache_configure. ZIPMOE_ERR_ARG for a new
 * prefix beyond ZIPMOE_MAX_SLOT_RULES rules (or a negative count, or a prefix of 96 bytes or more). */
#define ZIPMOE_MAX_SLOT_RULES 4096
ZIPMOE_API int64_t zipmoe_cache_set_slots(const char * prefix, int64_t hot, int64_t warm, int64_t sm);

/* A planner's slots as ZIPMOE_PLAN and --cache-plan write them, "<layer>:<hot>,<warm>,<sm>;..." (pyzipmoe.plan.solver
 * encodes it; blanks before a number and a final ';' are allowed): each rule in turn to fn (which may be NULL: only
 * check), stopping at the first result of fn that is not ZIPMOE_OK and returning it. ZIPMOE_ERR_CORRUPT where the
 * text is no plan (anything but digits where a number goes, a layer above INT32_MAX, a count above INT64_MAX);
 * ZIPMOE_ERR_ARG where it has more than ZIPMOE_MAX_SLOT_RULES rules. */
typedef int64_t (*zipmoe_plan_rule_fn)(void * arg, int32_t layer, int64_t hot, int64_t warm, int64_t sm);
ZIPMOE_API int64_t zipmoe_plan_parse(const char * text, zipmoe_plan_rule_fn fn, void * arg);
/* What is wrong with a plan zipmoe_plan_parse refused with rc, as the end of a sentence that names the plan. */
ZIPMOE_API const char * zipmoe_plan_problem(int64_t rc);

/* The eviction policies by name (cache/policy.c), the one list that ZIPMOE_CACHE_POLICY, llama.cpp's
 * --cache-policy and pyzipmoe (--policy, a Modelfile's cache_policy) take: lfuda (the default), tlfu, lru, lfu,
 * fifo. zipmoe_policy_name: the name of the index-th, the default (ZIPMOE_POLICY_DEFAULT) first; NULL past the last.
 * zipmoe_policy_parse: the policy named (ZIPMOE_OK, *out set if out is not NULL), or ZIPMOE_ERR_ARG.
 * zipmoe_policy_names: every name for a message, "lfuda, tlfu, lru, lfu or fifo", into buf[size] (NUL-terminated):
 * its length, or ZIPMOE_ERR_DST_TOO_SMALL (64 bytes suffice). */
#define ZIPMOE_POLICY_DEFAULT ZIPMOE_POLICY_LFUDA
ZIPMOE_API const char * zipmoe_policy_name(size_t index);
ZIPMOE_API int64_t      zipmoe_policy_parse(const char * name, zipmoe_policy * out);
ZIPMOE_API int64_t      zipmoe_policy_names(char * buf, size_t size);

/* 1 (default): a store's invocation evicts what every other store's last invocation decoded beyond its limits,
 * which the engine must have read by then (ggml runs each op's matmul before the next expert tensor's op); the
 * budget then holds one expert tensor in flight. 0: only stores of other layers ("blk.N." names), for an engine
 * whose graph does not keep that order; a layer's experts are then in flight at once. */
ZIPMOE_API void    zipmoe_cache_set_store_turns(int enabled);

/* What the budget holds for the expert tensor in flight (its routed experts, decoded beyond the tiers' limits:
 * once another store plans, a store's are evicted down to its limits again). The
 * memory of evicted experts is kept within it (slots.c), for the next experts decoded: they then neither fault
 * nor zero their pages. Default 0: evicted experts' pages are freed. */
ZIPMOE_API void    zipmoe_cache_set_reserve(uint64_t bytes);

/* A larger hot budget for graphs whose stores are each routed no more experts than they keep decoded (generation:
 * a token routes top-k): there a miss takes the place of the expert it evicts and reads a few experts, so the room
 * a batch keeps beside the hot tier (the allowance for the expert tensor in flight, zipmoe_cache_set_reserve, and
 * a prompt's read buffers) can hold decoded experts. Reset by zipmoe_cache_configure. Not with an sm tier; with
 * slot rules, zipmoe_cache_set_token_room. */
ZIPMOE_API void    zipmoe_cache_set_token_hot(uint64_t hot_bytes);

/* The same for a planner's slots (zipmoe_cache_set_slots): what the stores may hold in all (their rules' tiers and
 * generation's decoded experts beyond them) while each is routed no more experts than it keeps decoded; beyond the
 * rules' bytes it is shared out as hot slots, by BF16 size in whole experts. Only when a rule sets every store and
 * none keeps an sm tier. 0 (default, and after zipmoe_cache_set_slots(NULL, ...)): none. */
ZIPMOE_API void    zipmoe_cache_set_token_room(uint64_t bytes);

/* The bytes the slot rules' tiers take over the open stores (a plan's hot, warm and sm slots), what a budget's
 * tiers less them leave a prompt's read buffers (zipmoe_cache_set_read_room). */
ZIPMOE_API uint64_t zipmoe_cache_rules_bytes(void);

/* Before computing a graph (one at a time) whose stores may each be routed up to `routed` distinct experts: the
 * hot budget for it, generation's (zipmoe_cache_set_token_hot's shares, or a planner's rules plus the extra slots
 * of zipmoe_cache_set_token_room) where every store keeps at least `routed` experts decoded under it, else the
 * batch's (zipmoe_cache_configure's, the rules'); going back to the smaller one, every store is evicted down to it
 * first. In generation evicted experts' pages are not kept (zipmoe_cache_set_reserve): a miss takes its victim's
 * place, and the reserve's room is the hot tier's. Without a hot tier (every expert kept compressed: no sm budget,
 * no rules), a graph whose misses fit the reserve, `routed` experts of the largest store, is generation too: the
 * reserve keeps only their pages and the warm tier grows by the rest, back again for a larger graph. */
ZIPMOE_API void    zipmoe_cache_begin_graph(int64_t routed);
/* The same for a step: a graph every token of which has its logits wanted (a token, speculation verifying drafted
 * tokens, parallel slots' tokens) and whose `routed` is below every store's experts (else it is a batch: a whole
 * prompt's logits). It may route more experts than some stores keep decoded in generation, and is generation still: its tier less what one store decodes beyond its slots (only one store at a time does), held back
 * for the steps that follow until 64 graphs in a row need less; the batch's where that would leave no more than the
 * batch's decoded. A zipmoe_cache_begin_graph graph (a prompt's batch) is generation where what is held back covers
 * it. A new budget holds nothing back. */
ZIPMOE_API void    zipmoe_cache_begin_step(int64_t routed);

/* Whether stores bound from now on read around the page cache (O_DIRECT) where the file system allows it.
 * Default 1; 0 reads through the page cache and drops what was read from it (for file systems whose O_DIRECT
 * misbehaves, and to compare). */
ZIPMOE_API void    zipmoe_cache_set_direct_io(int enabled);

/* What each of the reader's buffers (staging, and two for reading the next store ahead) keeps between uses
 * (default 16 MiB): generation's reads fit it. A prompt's larger read-ahead takes one large buffer at a time,
 * waiting for the other to be given back; larger buffers are freed once a need fits this again. */
ZIPMOE_API void    zipmoe_cache_set_read_buffer(uint64_t bytes);

/* The room a budget leaves a prompt's read buffers (zipmoe_budget_split's reads; a planner's read room): the
 * staging buffer and a read-ahead buffer take up to half of it each beyond what they keep between uses, and a
 * store whose reads need more reads them through a ring (the reader waits for decoded experts' bytes to be free)
 * and reads ahead only what fits. In generation, whose hot tier holds this room, they take no more than they
 * keep (or one expert's region, if larger). Default UINT64_MAX: no bound (no budget). zipmoe_cache_apply_split
 * sets it too, to the split's reads (UINT64_MAX where they are 0: every expert decoded, or no hot tier). */
ZIPMOE_API void    zipmoe_cache_set_read_room(uint64_t bytes);

/* One expert tensor's sizes, for splitting a budget. */
typedef struct {
    uint64_t bf16_bytes;       /* all of its experts decoded (a raw store's: in their own type) */
    uint64_t n_expert;
    uint64_t compressed_bytes; /* its data companion */
} zipmoe_store_size;

/* What a budget split by shares gives each use (bytes), for zipmoe_cache_configure (hot, warm, sm),
 * zipmoe_cache_set_reserve (in_flight) and zipmoe_cache_set_token_hot (token_hot; 0: none). */
typedef struct {
    uint64_t hot, warm, sm;
    uint64_t in_flight; /* the expert tensor in flight beyond the experts the hot tier holds */
    uint64_t reads;     /* a prompt's read buffers: staging and the next store's read-ahead */
    uint64_t token_hot; /* generation's hot tier: hot + in_flight + reads (not with an sm tier) */
} zipmoe_budget_split;

/* Splits `tiers` bytes (a budget less the weights that are not experts and the largest tensor's experts) of a
 * model whose expert tensors are `stores`: a prompt's read buffers first (at most half), then hot_share decoded
 * and sm_share sign+mantissa planes, the rest whole compressed regions; the hot tier grows by what the allowance
 * for the tensor in flight need not hold (the experts it keeps decoded already). What libllama's loader applies
 * for ZIPMOE_MEMORY_BUDGET, and the memory monitor when it changes such a budget. */
ZIPMOE_API int64_t zipmoe_budget_split_tiers(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers,
                                             double hot_share, double sm_share, zipmoe_budget_split * out);

/* The hot share where the user set none: 0 (every expert compressed, none decoded) where the tiers hold at least
 * ZIPMOE_WARM_FIRST_FIT of the experts' compressed bytes but less than ZIPMOE_WARM_FIRST_FIT of their BF16 bytes
 * and warm_fast (every store's warm hits decode with a SIMD escape-code decoder); else 1 (every expert decoded);
 * at most 1 - sm_share: the default gives way to an sm share the user set (0: none). Measured
 * (docs/cache-and-planner.md, "The default split"): with the escape code, every expert compressed ran 1.3-1.7x
 * decoded-only where nearly all fit compressed, 0.6-0.9x where a third did not; with Huffman, whose decoder is
 * 3.5x slower, the two were even even where all fit. */
#define ZIPMOE_WARM_FIRST_FIT 0.9
ZIPMOE_API double zipmoe_budget_default_hot_share(const zipmoe_store_size * stores, size_t n_stores, uint64_t tiers,
                                                  int warm_fast, double sm_share);

/* What a budget charges for a token embedding that llama.cpp maps and reads a row per token (get_rows): the rows of
 * one batch (ZIPMOE_EMBD_BATCH_ROWS, llama.cpp's default n_batch of distinct tokens), each spanning its pages of
 * `page` bytes (an unaligned row touches one page more), at most the whole table. The rest of the mapped table is
 * clean page cache that the kernel may take back at any time (a row read again is a page fault), not memory the
 * model keeps: charging all of it would take 109 MiB more from the tiers of a 32000-token, 2048-wide model, 577 MiB
 * more from Qwen3-30B-A3B's. row_bytes 0: the table is charged whole. */
#define ZIPMOE_EMBD_BATCH_ROWS 2048
ZIPMOE_API uint64_t zipmoe_budget_embd_charge(uint64_t embd_bytes, uint64_t row_bytes, uint64_t page);

/* What a model keeps resident whatever its budget, in bytes: the smallest budget that works is `minimum`. */
typedef struct {
    uint64_t other;        /* weights that are not compressed experts, as charged (the token embedding's embd_charged) */
    uint64_t embd_charged; /* what `other` counts of a token embedding read a row per token (zipmoe_budget_embd_charge) */
    uint64_t in_flight;    /* the BF16 experts of the largest expert tensor: decoded at once when a batch routes to all
                            * of them (a store's routed experts stay decoded until the next store plans) */
    uint64_t experts;      /* every expert in BF16 */
    uint64_t minimum;      /* other + in_flight */
} zipmoe_budget_need;

/* The accounting every budget check uses (the loader's, and pyzipmoe's before it loads a model): other_bytes is
 * every weight that is not a compressed expert, embd_bytes of them a token embedding read a row per token of
 * embd_row_bytes (0 and 0: none, or one charged whole). ZIPMOE_ERR_ARG where embd_bytes > other_bytes or a size is
 * above ZIPMOE_SIZE_MAX. */
ZIPMOE_API int64_t zipmoe_budget_need_of(const zipmoe_store_size * stores, size_t n_stores, uint64_t other_bytes,
                                         uint64_t embd_bytes, uint64_t embd_row_bytes, uint64_t page,
                                         zipmoe_budget_need * out);

/* The one check of a budget against a model's minimum (need, from zipmoe_budget_need_of; embd_bytes: its token
 * embedding's whole bytes, which need.embd_charged may charge less of), the loader's and pyzipmoe's before it loads
 * a model. ZIPMOE_OK where budget holds need->minimum (msg[0] = 0); else ZIPMOE_ERR_ARG and the refusal in
 * msg[msg_size] (NUL-terminated, cut to fit; 512 bytes more than `said` suffice), one sentence that says the
 * budget as `said` (as its user gave it: "60% (4.8 GiB)", "100KiB"; NULL: its bytes), the minimum and what it is
 * made of: "memory budget <said> is below the minimum of <minimum> for this model (<other> of weights that are not
 * experts + <in flight> for the experts of one expert tensor in flight); raise --memory-budget". Where the budget
 * and the minimum read the same rounded, both are said in bytes too. ZIPMOE_ERR_ARG with msg empty for a NULL need. */
ZIPMOE_API int64_t zipmoe_budget_check(uint64_t budget, const zipmoe_budget_need * need, uint64_t embd_bytes,
                                       const char * said, char * msg, size_t msg_size);

/* Everything a budget sets in the cache, applied at once by zipmoe_cache_apply: what the loader derives from a
 * model's budget (op/zipmoe-config.cpp) and the memory monitor from a new one (zipmoe_cache_apply_split). */
typedef struct {
    uint64_t      hot, warm, sm; /* the tier budgets, as zipmoe_cache_configure's */
    uint64_t      token_hot;     /* generation's hot tier (zipmoe_cache_set_token_hot's); at most hot: hot */
    uint64_t      reserve;       /* evicted experts' pages kept for the next decodes (zipmoe_cache_set_reserve's) */
    uint64_t      read_room;     /* a prompt's read buffers' bound (zipmoe_cache_set_read_room's; UINT64_MAX: none) */
    zipmoe_policy policy;
    int           keep_slots;    /* non-zero: the slot rules set by zipmoe_cache_set_slots stay; zero: removed */
} zipmoe_cache_params;

/* Applies params at once, as zipmoe_cache_configure, zipmoe_cache_set_token_hot, zipmoe_cache_set_reserve and
 * zipmoe_cache_set_read_room would one after the other, without a moment at a mix of old and new settings.
 * ZIPMOE_ERR_ARG for an unknown policy. */
ZIPMOE_API int64_t zipmoe_cache_apply(const zipmoe_cache_params * params);

/* Applies a split (zipmoe_cache_apply with its hot, warm, sm, token_hot, in_flight as the reserve, reads as the
 * read room, 0 reads: none) and removes every slot rule: a running model's new budget (the memory monitor's). */
ZIPMOE_API int64_t zipmoe_cache_apply_split(const zipmoe_budget_split * split, zipmoe_policy policy);

/* Opens a store from an index (validated as zipmoe_tensor_open does). */
ZIPMOE_API int64_t zipmoe_store_open(const char * name, const void * index, size_t index_size, uint64_t data_size,
                                     zipmoe_store ** out);
/* Opens a store for an expert tensor that lies in the model file as the engine reads it (a plain GGUF's, of any
 * ggml type): ne its shape (ne[2] experts, ne[3] = 1), row_bytes one row's bytes (ggml_row_size(type, ne[0])), so
 * an expert is ne[1] * row_bytes bytes and expert e lies at e times that from the offset zipmoe_store_bind is given.
 * Its experts are "decoded" by copying their bytes into their places (read around the page cache, as a compressed
 * store's regions are), kept only in the hot tier (a compressed copy would be the same bytes), evicted by the same
 * policies. ggml_type is only recorded (zipmoe_store_get_info). */
ZIPMOE_API int64_t zipmoe_store_open_raw(const char * name, int32_t ggml_type, const int64_t ne[4], uint64_t row_bytes,
                                         zipmoe_store ** out);
ZIPMOE_API void    zipmoe_store_free(zipmoe_store * s);
/* How a raw store puts n_rows rows of an expert, read as stored (src), into their place (dst), instead of copying
 * them: for an engine whose compute reads weights in a layout of its own (llama.cpp's CPU backend repacks some
 * quantized types, rows interleaved in groups). Chunks then begin at multiples of row_align rows (the groups), and
 * fn runs on the decoding threads, on chunks of whole groups. An index store of a byte-layout type (its chunks are
 * the index's) puts each expert whole once its chunks are decoded: its ne[1] must be a multiple of row_align. Only
 * before zipmoe_store_bind; ZIPMOE_ERR_ARG for a store of a split type, one bound already, or a row_align < 1. */
typedef void (*zipmoe_raw_put_fn)(void * ctx, void * dst, const void * src, int64_t n_rows);
ZIPMOE_API int64_t zipmoe_store_set_raw_put(zipmoe_store * s, zipmoe_raw_put_fn fn, void * ctx, int64_t row_align);
/* The store's tensor info: its index's, or for a raw store codec 0, its ggml_type and shape, chunks of whole rows
 * (chunk_n values) and data_size its experts' bytes. */
ZIPMOE_API void    zipmoe_store_get_info(const zipmoe_store * s, zipmoe_tensor_info * info);
/* 1 for a store opened by zipmoe_store_open_raw. */
ZIPMOE_API int     zipmoe_store_is_raw(const zipmoe_store * s);
ZIPMOE_API const zipmoe_tensor * zipmoe_store_tensor(const zipmoe_store * s); /* NULL for a raw store */
/* Reads the data companion (a raw store: the tensor's bytes) at data_offset of fd (duplicated: fd may be closed
 * after) and reserves the decoded memory (n_expert experts: ne0 * ne1 * 2 bytes each in BF16, a raw store's
 * ne1 * row_bytes; MAP_NORESERVE). *dst receives its address. */
ZIPMOE_API int64_t zipmoe_store_bind(zipmoe_store * s, int fd, uint64_t data_offset, void ** dst, size_t * dst_size);

/* Makes every expert named in ids resident in the BF16 memory. ids is an int32 matrix of ne1 rows of
 * ne0 expert ids (byte strides nb0, nb1), as a router produces. All nth threads of one invocation call
 * it with the same key (any pointer unique to the invocation) and ith = 0..nth-1; they share the
 * decoding without waiting for each other, and when the last of them returns, every named expert is
 * decoded. A decoded expert need not lie at its own index in the BF16 memory (under a budget a miss
 * takes the place of the expert it evicts): where (NULL, or a contiguous int32 matrix of ne1 rows of
 * ne0) receives the place of each named expert, its values at dst + place * n_per_expert: what
 * ggml_mul_mat_id must read as its ids. Places hold until the store's next invocation. Returns the
 * number of chunks this thread decoded, or an error, which is also recorded for zipmoe_store_take_error(). */
ZIPMOE_API int64_t zipmoe_store_materialize(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                            int64_t ne1, size_t nb0, size_t nb1, int32_t * where, int ith, int nth);
/* zipmoe_store_materialize in parts, for a caller with work to do while the reads are in flight (the op that
 * computes ggml_mul_mat_id's rows itself: the matmul of the routed experts that are decoded already).
 * _begin plans the invocation and starts its reads; where (ne0 * ne1 int32, required) receives the place of every
 * named expert, not a share, and pending (as many bytes) 1 for the experts this invocation decodes, 0 for those
 * decoded already, whose values may be read at once, and, with flags ZIPMOE_TURN_STREAM, 2 for the experts it
 * leaves in the warm tier for the caller to decode chunk by chunk into its own cache (zipmoe_store_stream_chunk):
 * a one-token caller that reads each value once saves the expert's trip through memory (written to its place and
 * read back). A warm expert is still decoded into a place where it takes the hot tier's free room or outranks the
 * hot expert the policy would evict first. _end decodes this thread's share, calling turn->idle (set after
 * _begin, or NULL) instead of sleeping while the bytes of its next chunk are read; it returns the chunks it decoded
 * or an error.
 * _wait returns once every expert pending 1 is decoded (the other threads' shares too): ZIPMOE_OK, or an error if a
 * chunk failed (recorded for zipmoe_store_take_error); it must come before the store's next invocation begins.
 * The turn is the caller's; every thread that began must end. */
typedef struct {
    int          (*idle)(void * ctx); /* the caller's, set after _begin: one unit of other work, 0 once none is left */
    void *       idle_ctx;
    int64_t      plan_n; /* set by _begin: experts the invocation decodes */
    const void * plan;   /* the store's plan, read by _end */
    uint64_t     seq;    /* the invocation's plan, which _wait waits for */
    int32_t      ring;   /* its reads go through a ring */
    int32_t      fast;   /* every named expert was decoded: _end and _wait return at once */
} zipmoe_turn;
#define ZIPMOE_TURN_STREAM 1 /* _begin's flags: the caller decodes warm experts itself (pending 2) */
ZIPMOE_API int64_t zipmoe_store_materialize_begin(zipmoe_store * s, const void * key, const void * ids, int64_t ne0,
                                                  int64_t ne1, size_t nb0, size_t nb1, int32_t * where,
                                                  uint8_t * pending, int flags, int ith, int nth, zipmoe_turn * turn);
ZIPMOE_API int64_t zipmoe_store_materialize_end(zipmoe_store * s, zipmoe_turn * turn, const void * ids, int64_t ne0,
                                                int64_t ne1, size_t nb0, size_t nb1);
ZIPMOE_API int64_t zipmoe_store_materialize_wait(zipmoe_store * s, const zipmoe_turn * turn);
/* Decodes chunk c of expert e, which the invocation reported as streamed (pending 2), into out[info.chunk_n] (the
 * expert's last chunk may be shorter), from its compressed copy in RAM, with normal stores: out is meant to be read
 * right after, from the cache. Any thread that began the invocation (its _begin is what orders these reads after
 * the plan) may call this, for any chunk, until the invocation's compute ends: the copy stays pinned until the
 * store's next invocation, or until another store's plan or the next zipmoe_cache_begin_graph, which one graph
 * computing at a time puts after it (zipmoe_llama_compute_turn). Returns the values decoded, or an error (also
 * recorded for zipmoe_store_take_error, ZIPMOE_ERR_ARG too for an expert that is not streamed). */
ZIPMOE_API int64_t zipmoe_store_stream_chunk(zipmoe_store * s, int64_t e, int64_t c, uint16_t * out);
/* The same chunk's exponent plane alone, decoded into exp[n] (n: the chunk's values, at most info.chunk_n, returned;
 * exactly n bytes are written), and *sm pointed at the expert's whole sign+mantissa plane (n_per_expert bytes, value
 * i at (*sm)[i]; pinned as the expert is): for a caller that merges a row at a time (zipmoe_merge_bf16_cached) into
 * its L1, next to the dot product that reads it. */
ZIPMOE_API int64_t zipmoe_store_stream_exponents(zipmoe_store * s, int64_t e, int64_t c, uint8_t * exp,
                                                 const uint8_t ** sm);
/* Where decoded expert e lies in the BF16 memory, in experts (see zipmoe_store_materialize), or -1 if it is not
 * decoded. */
ZIPMOE_API int64_t zipmoe_store_place(zipmoe_store * s, int64_t e);
/* A guess at the experts s's next invocation routes to (the engine runs the next layer's router on this layer's
 * input): once the store invoked before s is done with its reads, the reader reads those that are not in RAM
 * ahead, until s's invocation comes, and s decodes what it routed from them. A wrong guess costs only the reads;
 * the invocation after clears it. ZIPMOE_ERR_ARG for an expert out of range. */
ZIPMOE_API int64_t zipmoe_store_predict(zipmoe_store * s, const int32_t * experts, int64_t n);

/* Tokens routed to each expert so far (counts[n], n >= n_expert): what a planner reads. */
ZIPMOE_API int64_t zipmoe_store_activations(zipmoe_store * s, uint64_t * counts, int64_t n);
/* The same for the stores whose name starts with prefix (a layer: "blk.3."; the most of its stores, which
 * share one router): counts[0..n) zeroed, then filled. Returns the number of experts, 0 if no store matches. */
ZIPMOE_API int64_t zipmoe_cache_activations(const char * prefix, uint64_t * counts, int64_t n);
/* The routing of the last invocations (at most 512 are remembered) of the first store whose name starts with
 * prefix, oldest first: one entry a generated token, or a prompt's batch (the union of its rows); entry i routed
 * to expert e when bit e % 64 of masks[i * words + e / 64] is set. words >= (n_expert + 63) / 64. Returns the
 * entries written (<= max_tokens), 0 if no store matches: what the planner's recency model reads. */
ZIPMOE_API int64_t zipmoe_cache_routing(const char * prefix, uint64_t * masks, int64_t words, int64_t max_tokens);

/* A prior for the store's eviction policy: counts[n_expert] (n_expert the store's), how often the model's earlier runs
 * routed to each expert of this store's layer (a calibration's, or a routing record's). The counting policies
 * (lfuda, lfu, tlfu) start each expert from its share of them, an expert of the mean share one use ahead, the
 * others in proportion: what the store has not yet seen routed, it ranks by the prior, and the store's own uses
 * overturn it within a few tokens. LRU and FIFO ignore it. The fill at load (zipmoe_cache_prefill) takes the experts
 * in the prior's order, the most used first. It changes what is kept, never what is computed. counts NULL with
 * n_expert 0, or counts all 0, removes it. ZIPMOE_ERR_ARG for another n_expert. May be called at any time. */
ZIPMOE_API int64_t zipmoe_store_set_prior(zipmoe_store * s, const uint64_t * counts, int64_t n_expert);

/* A prior file (docs/FORMAT.md, "Priors"), little-endian: the magic ZIPMOE_PRIOR_MAGIC (8 bytes), uint32 n_layer,
 * uint32 n_expert, then n_layer * n_expert uint64 counts, layer-major (layer: the model's block number).
 * zipmoe_prior_parse: ZIPMOE_OK and its shape (either pointer may be NULL), or ZIPMOE_ERR_CORRUPT (no magic, no
 * layer or expert, or a size that is not its shape's). zipmoe_cache_seed_prior: gives each of the stores of block
 * N ("blk.N." names) layer N's counts (zipmoe_store_set_prior): what ZIPMOE_PRIOR does at load. ZIPMOE_ERR_CORRUPT
 * for a damaged file; ZIPMOE_ERR_ARG where it is another model's (its n_layer is not the highest block of the stores
 * plus one, or its n_expert not a store's); then nothing is seeded, and msg[msg_size] says why in a sentence. */
#define ZIPMOE_PRIOR_MAGIC "ZMPRIOR1"
ZIPMOE_API int64_t zipmoe_prior_parse(const void * data, size_t size, uint32_t * n_layer, uint32_t * n_expert);
ZIPMOE_API int64_t zipmoe_cache_seed_prior(zipmoe_store * const * stores, int64_t n_stores, const void * data,
                                           size_t size, char * msg, size_t msg_size);

/* A run's record (ZIPMOE_PRIOR_RECORD, at the model's unload): writes a prior file of the stores' activations (each
 * expert's tokens routed since its store opened; a block's count the largest of its stores') to path, through a
 * temporary file beside it renamed over it. n_layer is the highest block of the stores plus one, as
 * zipmoe_cache_seed_prior wants it. ZIPMOE_ERR_ARG for no store of a block, or blocks of different n_expert;
 * ZIPMOE_ERR_IO where it cannot be written; msg[msg_size] says why in a sentence. */
ZIPMOE_API int64_t zipmoe_prior_record(zipmoe_store * const * stores, int64_t n_stores, const char * path, char * msg,
                                       size_t msg_size);

/* The first error this store recorded since the last call, with a message naming tensor and expert;
 * ZIPMOE_OK if none. Clears it. */
ZIPMOE_API int64_t zipmoe_store_take_error(zipmoe_store * s, char * msg, size_t msg_size);

typedef struct {
    uint64_t experts; /* experts made resident, summed over the stores */
    uint64_t failed;  /* batches that failed (a damaged chunk, say): their experts wait for their first use */
    uint64_t ns;      /* wall time */
} zipmoe_prefill_stats;

/* Fills the tiers of stores (a model just loaded) before its first token, as llama.cpp's warm-up fills the page
 * cache for a plain model: each store routes batches of its own experts, as many as its tiers hold under the
 * current configuration, in its prior's order (zipmoe_store_set_prior; else by id), the last batch the decoded ones, on n_threads threads created for the call and joined
 * before it returns. Counts none of it as the model's routing (activations, hits, routing log); the decode and
 * read counters of zipmoe_stats include it. A failed batch records no error for the engine: a damaged expert
 * fails when a token routes to it. Returns the experts made resident, or an error. */
ZIPMOE_API int64_t zipmoe_cache_prefill(zipmoe_store * const * stores, int64_t n_stores, int n_threads,
                                        zipmoe_prefill_stats * out);

typedef struct {
    uint64_t stores;            /* expert tensors served */
    uint64_t hot_bytes;         /* decoded experts kept now */
    uint64_t warm_bytes;        /* compressed regions kept in RAM now */
    uint64_t peak_hot_bytes;    /* most decoded bytes at once since the last reset */
    uint64_t experts_decoded;   /* decodes of an expert (each counts) */
    uint64_t chunks_decoded;
    uint64_t bytes_decoded;     /* BF16 bytes written */
    uint64_t decode_ns;         /* summed over threads, reads from disk included */
    uint64_t materialize_calls; /* invocations (one per expert tensor per graph compute) */
    uint64_t hits_hot;          /* routed experts found decoded */
    uint64_t hits_warm;         /* ... found whole and compressed in RAM */
    uint64_t misses;            /* ... read from the file */
    uint64_t bytes_read;        /* from the file */
    uint64_t read_ns;           /* summed over threads */
    uint64_t evictions;         /* of decoded experts */
    uint64_t sm_bytes;          /* sign+mantissa planes kept in RAM now */
    uint64_t hits_sm;           /* routed experts found as a sign+mantissa plane (codes read) */
    uint64_t stall_ns;          /* wall time of invocations that decoded, plan to publish */
    uint64_t peak_resident_bytes; /* most hot + warm + sm bytes at once since the last reset */
    uint64_t staging_bytes;     /* the reader's buffers (staging, read-ahead): bytes no tier keeps (transient) */
    uint64_t pool_bytes;        /* pages of evicted experts kept for the next decodes (zipmoe_cache_set_reserve) */
    uint64_t reading_calls;     /* invocations that read from the file: the first read is waited for, with */
                                /* nothing to overlap it (the planner's t_layer)                          */
    uint64_t bytes_read_ahead;  /* of bytes_read: read for the store invoked next while this one computed */
    uint64_t bytes_read_guessed; /* of bytes_read_ahead: the experts the previous layer guessed (ZIPMOE_PREDICT) */
    uint64_t guesses_used;      /* experts decoded from bytes read on such a guess */
    uint64_t staging_transient_bytes; /* of staging_bytes: beyond what each buffer keeps between uses (a prompt's */
                                      /* reads; given back once the reads fit that again)                       */
    uint64_t decoding_bytes;    /* experts being decoded now: their pages are in use before hot_bytes counts them */
    uint64_t experts_streamed;  /* of hits_warm: left warm for the caller to decode in its cache (ZIPMOE_TURN_STREAM) */
    uint64_t ahead_used;        /* experts decoded from bytes read ahead (guessed or not): the read-ahead's hits */
} zipmoe_stats;

ZIPMOE_API void zipmoe_stats_get(zipmoe_stats * out);
ZIPMOE_API void zipmoe_stats_reset(void); /* zeroes the counters, not what is kept */

#ifdef __cplusplus
}
#endif

#endif /* ZIPMOE_CACHE_H */
