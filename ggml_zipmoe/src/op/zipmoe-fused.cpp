// zipmoe-fused.cpp - the fused ggml_mul_mat_id of generation: the routed experts' rows computed by the op that
// materialises them, while the others are still read and decoded.
#include "zipmoe-llama-impl.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

// ggml_mul_mat_id(w, x, ids) of a token or a small batch, computed by the op that materialises the experts, so that
// the rows of the routed experts that are decoded already are computed while the others are read. Each value is the
// same ggml vec_dot of the same bytes that ggml_mul_mat_id computes (ggml-cpu's mul_mat_id: a BF16 weight's rows are
// vec_dot-ed one by one with the activations converted by from_float, at any batch size), so the result is bit for
// bit ggml's. Every thread converts the activations itself (an op has no barrier) and groups the routed slots by
// expert, then claims blocks of an expert's rows, each computed for every slot routed to it: first those of experts
// it may read now (also while its decoding waits for a read), then, once _wait has returned (every expert decoded),
// the rest. A warm expert the store leaves to the op (pending 2, ZIPMOE_TURN_STREAM) is decoded a few chunks at a
// time into the thread's cache and its rows computed from there, once for all its slots: its values never go through
// memory, which on a machine whose cores share little bandwidth is most of what a decode into its place costs.
static constexpr int64_t MM_BLOCK_ROWS = 32;

// Chunks per claim of a streamed expert: a claim computes the rows that begin in its chunks, decoding the chunk its
// last row runs on into too. The fewest chunks that end on a row's end where some up to 4 do (2048-wide rows: one
// 64K chunk, 32 rows; 768-wide: three, 256 rows), else three (a straddled chunk decoded twice: 4/3 of the work).
static int64_t stream_unit_chunks(int64_t k, int64_t chunk_n) {
    for (int64_t g = 1; g <= 4; g++) {
        if (g * chunk_n % k == 0) {
            return g;
        }
    }
    return 3;
}

// The routed slots of an invocation by expert, in the order of their first slot: group g's slots are
// slot[first[g]] .. slot[first[g + 1] - 1]. The same on every thread (a function of the ids alone), so that claim
// counter g means the same expert to all of them.
struct slot_groups {
    int64_t n = 0;
    int32_t first[ZIPMOE_MM_MAX_SLOTS + 1];
    int32_t slot[ZIPMOE_MM_MAX_SLOTS];
};

static void group_slots(const int32_t * expert, int64_t n_slot, slot_groups & gr) {
    int32_t of[ZIPMOE_MM_MAX_SLOTS];    // each slot's group
    int32_t count[ZIPMOE_MM_MAX_SLOTS]; // each group's slots
    int32_t head[ZIPMOE_MM_MAX_SLOTS];  // each group's first slot
    gr.n = 0;
    for (int64_t k = 0; k < n_slot; k++) {
        int64_t g = 0;
        while (g < gr.n && expert[head[g]] != expert[k]) {
            g++;
        }
        if (g == gr.n) {
            head[gr.n]    = (int32_t) k;
            count[gr.n++] = 0;
        }
        of[k] = (int32_t) g;
        count[g]++;
    }
    gr.first[0] = 0;
    for (int64_t g = 0; g < gr.n; g++) {
        gr.first[g + 1] = gr.first[g] + count[g];
        count[g]        = gr.first[g];
    }
    for (int64_t k = 0; k < n_slot; k++) {
        gr.slot[count[of[k]]++] = (int32_t) k;
    }
}

// One thread's view of a fused invocation: the places and the activations converted to the weight's vec_dot type.
struct mm_rows {
    zipmoe_llama_tensor * zt;
    ggml_tensor *         dst;
    const ggml_tensor *   w;
    const int32_t *       where;
    const uint8_t *       pending;
    const int32_t *       expert;     // the routed ids: a streamed slot's expert
    const slot_groups *   groups;
    int64_t               chunk_n;     // values per chunk
    int64_t               n_chunks;    // chunks per expert
    int64_t               unit_chunks; // chunks per claim of a streamed expert (stream_unit_chunks)
    uint8_t *             exps;        // the thread's: the exponent planes of one claim's chunks
    uint16_t *            row;         // the thread's: one merged row
    const uint8_t *       xq;
    size_t                xq_row;
    int64_t               ne11;
    ggml_vec_dot_t        vec_dot;
    int64_t               cursor; // the first group of the current phase that may have blocks left
};

// Row r of the weight (at w_row) times the activations of every slot of group g, into their outputs.
static void dot_group(const mm_rows & m, int64_t g, int64_t r, const void * w_row) {
    const int64_t n_used = m.dst->ne[1];
    for (int32_t j = m.groups->first[g]; j < m.groups->first[g + 1]; j++) {
        const int64_t k  = m.groups->slot[j];
        const int64_t i1 = k % n_used, i2 = k / n_used;
        const void *  xrow = m.xq + (size_t) (i1 % m.ne11 + i2 * m.ne11) * m.xq_row;
        float *       out  = reinterpret_cast<float *>(static_cast<char *>(m.dst->data) + i1 * m.dst->nb[1] +
                                                      i2 * m.dst->nb[2]);
        m.vec_dot((int) m.w->ne[0], &out[r], 0, w_row, 0, xrow, 0, 1);
    }
}

// The rows of claim u of streamed group g (those that begin in its chunks): the exponent planes of the chunks they
// lie in, decoded into the thread's scratch; then each row merged into a buffer in L1 and vec_dot from there, for
// every slot of the group. Merging a claim's chunks whole wrote and read back twice their exponents' bytes through L2.
static void compute_streamed(const mm_rows & m, int64_t g, int64_t u) {
    const int64_t n_in = m.w->ne[0], n_rows = m.w->ne[1];
    const int64_t v0 = u * m.unit_chunks * m.chunk_n, v1 = (u + 1) * m.unit_chunks * m.chunk_n;
    const int64_t r0 = (v0 + n_in - 1) / n_in, r1 = std::min(n_rows, (v1 + n_in - 1) / n_in);
    if (r0 >= r1) {
        return; // (rows longer than a claim's chunks: a neighbour's row covers them)
    }
    const int64_t   c0 = r0 * n_in / m.chunk_n, c1 = (r1 * n_in - 1) / m.chunk_n;
    const int32_t   e  = m.expert[m.groups->slot[m.groups->first[g]]];
    const uint8_t * sm = nullptr;
    for (int64_t c = c0; c <= c1; c++) {
        if (zipmoe_store_stream_exponents(m.zt->store, e, c, m.exps + (c - c0) * m.chunk_n, &sm) < 0) {
            return; // (recorded by the store: llama_decode reports it and drops the output)
        }
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t v = r * n_in; // the row's first value in the expert
        zipmoe_merge_bf16_cached(m.exps + (v - c0 * m.chunk_n), sm + v, (size_t) n_in, m.row);
        dot_group(m, g, r, m.row);
    }
}

// Claims and computes one block of rows of a routed expert: after _wait (`decoded`) those of the experts this
// invocation decoded, before it the others (decoded already, or streamed); false once none is left.
static bool compute_block(mm_rows & m, bool decoded) {
    const int64_t n_rows = m.w->ne[1];
    for (; m.cursor < m.groups->n; m.cursor++) {
        const int64_t g = m.cursor;
        const int64_t k = m.groups->slot[m.groups->first[g]]; // (every slot of an expert has its place and state)
        if ((m.pending[k] == 1) != decoded || m.where[k] < 0 || m.where[k] >= m.w->ne[2]) {
            continue; // (an id out of range fails the invocation: its error is recorded, the output dropped)
        }
        const bool    streamed = m.pending[k] == 2;
        const int64_t claims   = streamed ? (m.n_chunks + m.unit_chunks - 1) / m.unit_chunks
                                          : (n_rows + MM_BLOCK_ROWS - 1) / MM_BLOCK_ROWS;
        const int64_t b        = m.zt->blocks[g].next.fetch_add(1, std::memory_order_relaxed);
        if (b >= claims) {
            continue;
        }
        if (streamed) {
            compute_streamed(m, g, b);
            return true;
        }
        const char *  base = static_cast<const char *>(m.w->data) + (size_t) m.where[k] * m.w->nb[2];
        const int64_t r1   = std::min(n_rows, (b + 1) * MM_BLOCK_ROWS);
        for (int64_t r = b * MM_BLOCK_ROWS; r < r1; r++) {
            dot_group(m, g, r, base + r * m.w->nb[1]);
        }
        return true;
    }
    return false;
}

// What a thread decoding for the store does while the bytes of its next chunk are read: a block of decoded rows.
// (the store counts its time as compute in the ledger: zipmoe-ledger.h)
static int compute_ready_block(void * ctx) { return compute_block(*static_cast<mm_rows *>(ctx), false); }

void zipmoe_llama_fused_op(ggml_tensor * dst, int ith, int nth, void * userdata) {
    auto *              zt  = static_cast<zipmoe_llama_tensor *>(userdata);
    const ggml_tensor * ids = dst->src[0];
    const ggml_tensor * w   = dst->src[1];
    const ggml_tensor * x   = dst->src[2];
    const int64_t       n_slot = ids->ne[0] * ids->ne[1];
    int32_t             where[ZIPMOE_MM_MAX_SLOTS];
    uint8_t             pending[ZIPMOE_MM_MAX_SLOTS];
    slot_groups         groups;
    zipmoe_turn         turn;
    static const bool   stream = zipmoe_llama_runtime_config().stream != 0;
    // the ledger (zipmoe-ledger.h): the op's setup (the activations' conversion too) is zipmoe's other work, the rows
    // compute; two clock reads an invocation where every expert is decoded
    const int           part   = zipmoe_ledger_switch(ZIPMOE_LEDGER_OTHER);
    // errors are recorded by the store and reported by llama_decode (zipmoe_llama_take_error)
    if (zipmoe_store_materialize_begin(zt->store, dst, ids->data, ids->ne[0], ids->ne[1], ids->nb[0], ids->nb[1],
                                       where, pending, stream ? ZIPMOE_TURN_STREAM : 0, ith, nth, &turn) >= 0) {
        const ggml_type_traits_cpu *       traits = ggml_get_type_traits_cpu(w->type);
        const ggml_from_float_t            to_vdt = ggml_get_type_traits_cpu(traits->vec_dot_type)->from_float;
        const size_t                       xq_row = ggml_row_size(traits->vec_dot_type, x->ne[0]);
        thread_local std::vector<uint8_t> xq; // grown once per thread, not per token
        xq.resize(xq_row * (size_t) (x->ne[1] * x->ne[2]));
        for (int64_t i2 = 0; i2 < x->ne[2]; i2++) { // (F32 activations: fusable)
            for (int64_t i1 = 0; i1 < x->ne[1]; i1++) {
                const char * row = static_cast<const char *>(x->data) + i1 * x->nb[1] + i2 * x->nb[2];
                to_vdt(reinterpret_cast<const float *>(row), xq.data() + (size_t) (i1 + i2 * x->ne[1]) * xq_row, x->ne[0]);
            }
        }
        int32_t expert[ZIPMOE_MM_MAX_SLOTS];
        for (int64_t i2 = 0; i2 < ids->ne[1]; i2++) { // (fusable: at most ZIPMOE_MM_MAX_SLOTS)
            for (int64_t i1 = 0; i1 < ids->ne[0]; i1++) {
                std::memcpy(&expert[i1 + i2 * ids->ne[0]],
                            static_cast<const char *>(ids->data) + i1 * ids->nb[0] + i2 * ids->nb[1], sizeof(int32_t));
            }
        }
        group_slots(expert, n_slot, groups);
        zipmoe_tensor_info info;
        zipmoe_store_get_info(zt->store, &info);
        const int64_t unit_chunks = stream_unit_chunks(w->ne[0], info.chunk_n);
        // the chunks a claim may touch: its own, and those its last row runs on into where rows straddle its end
        const bool    exact     = unit_chunks * info.chunk_n % w->ne[0] == 0;
        const int64_t unit_span = unit_chunks + (exact ? 0 : (w->ne[0] + info.chunk_n - 1) / info.chunk_n);
        thread_local std::vector<uint8_t>  exps; // grown once per thread
        thread_local std::vector<uint16_t> row;
        if (stream && exps.size() < (size_t) (unit_span * info.chunk_n)) {
            exps.resize((size_t) (unit_span * info.chunk_n));
        }
        if (stream && row.size() < (size_t) w->ne[0]) {
            row.resize((size_t) w->ne[0]);
        }
        const ggml_vec_dot_t vec_dot = traits->vec_dot;
        mm_rows m = { zt, dst, w, where, pending, expert, &groups, info.chunk_n, info.n_chunks, unit_chunks,
                      exps.data(), row.data(), xq.data(), xq_row, x->ne[1], vec_dot, 0 };
        turn.idle     = compute_ready_block;
        turn.idle_ctx = &m;
        zipmoe_store_materialize_end(zt->store, &turn, ids->data, ids->ne[0], ids->ne[1], ids->nb[0], ids->nb[1]);
        zipmoe_ledger_switch(ZIPMOE_LEDGER_COMPUTE);
        while (compute_block(m, false)) {
        }
        if (zipmoe_store_materialize_wait(zt->store, &turn) == ZIPMOE_OK) {
            m.cursor = 0;
            while (compute_block(m, true)) {
            }
        }
    }
    zipmoe_ledger_switch(part);
    // the last thread out readies the claims for the next compute (which begins after ggml's barrier)
    if (zt->left.fetch_add(1, std::memory_order_acq_rel) + 1 == nth) {
        for (int64_t k = 0; k < n_slot; k++) {
            zt->blocks[k].next.store(0, std::memory_order_relaxed);
        }
        zt->left.store(0, std::memory_order_relaxed);
    }
}

// Whether zipmoe_llama_fused_op computes ggml_mul_mat_id(w, x, ids): a token or a small batch, up to ZIPMOE_MM_MAX_SLOTS routed
// slots (a long prompt's batch has ggml's tiling to gain from), the BF16 weights and F32 activations of llama.cpp's
// MoE layers.
bool zipmoe_llama_fusable(const ggml_tensor * w, const ggml_tensor * x, const ggml_tensor * ids) {
    return ids->ne[0] * ids->ne[1] <= ZIPMOE_MM_MAX_SLOTS && ids->type == GGML_TYPE_I32 && w->type == GGML_TYPE_BF16 &&
           w->buffer && ggml_backend_buft_is_host(ggml_backend_buffer_get_type(w->buffer)) && // (not repacked)
           x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) && x->ne[2] == ids->ne[1] && x->ne[3] == 1 &&
           (x->ne[1] == 1 || x->ne[1] == ids->ne[0]) && x->ne[0] == w->ne[0];
}

