// zipmoe-llama-impl.h - what the glue's files share and llama.cpp does not see: the expert tensor's state and the
// fused matmul (zipmoe-fused.cpp) that zipmoe-llama.cpp builds into graphs.
#pragma once

#include "zipmoe-llama.h"
#include "zipmoe-cache.h"
#include "zipmoe-ledger.h"
#include "zipmoe.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

// How ggml's custom-op parameters begin (ggml-impl.h's ggml_map_custom{1,2}_op_params and ggml_custom_op_params,
// which begin alike): the op, its tasks and its user data; how the glue tells its nodes and writes them
struct zipmoe_custom_op_params {
    void * fun;
    int    n_tasks;
    void * userdata;
};

static inline zipmoe_custom_op_params zipmoe_custom_op_params_of(const ggml_tensor * node) {
    static_assert(sizeof(zipmoe_custom_op_params) <= sizeof node->op_params, "ggml's custom op parameters");
    zipmoe_custom_op_params p;
    std::memcpy(&p, node->op_params, sizeof p);
    return p;
}

// routed slots (top-k x tokens) a fused node computes; beyond, ggml's tiling
constexpr int64_t ZIPMOE_MM_MAX_SLOTS = 64;

struct zipmoe_llama_tensor {
    zipmoe_store *        store  = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    const ggml_tensor *   tensor = nullptr; // registered while bound for real
    int                   model  = 0;       // the load it belongs to (zipmoe_llama_configure counts them)
    int                   layer  = -1;      // N of "blk.N."
    const ggml_tensor *   router = nullptr; // its layer's router weight, seen when a graph was built (registry lock)
    std::vector<zipmoe_llama_tensor *> next; // the expert tensors of the next layer, once found
    std::string           remote;           // the RPC server that computes its experts (zipmoe-rpc.cpp); no store here
    // the fused matmul's claims (zipmoe_llama_fused_op): the next row block of each routed slot, and the threads
    // that left
    struct alignas(64) claim {
        std::atomic<int64_t> next{ 0 };
    };
    claim            blocks[ZIPMOE_MM_MAX_SLOTS]; // a group of slots each
    std::atomic<int> left{ 0 };
};

// The ZIPMOE_* environment, read in one place (zipmoe_runtime_config_from_env, which lists the variables).
zipmoe_runtime_config zipmoe_llama_runtime_config();

// The fused ggml_mul_mat_id of a token or a small batch (zipmoe-fused.cpp): a ggml custom op whose userdata is the
// weight's zipmoe_llama_tensor, args ids, w, x (and the layer's guess, only to order it), and whether it computes
// ggml_mul_mat_id(w, x, ids).
void zipmoe_llama_fused_op(ggml_tensor * dst, int ith, int nth, void * userdata);
bool zipmoe_llama_fusable(const ggml_tensor * w, const ggml_tensor * x, const ggml_tensor * ids);

// zipmoe over RPC (zipmoe-rpc.cpp). Client: t, a weight in the buffer of the server at endpoint, whose experts that
// server computes: zt (its store freed: this process decodes none of them) is found for t as its graph is built.
void zipmoe_llama_bind_remote(zipmoe_llama_tensor * zt, ggml_tensor * t, const std::string & endpoint);
// Server: the bound expert tensor of that name (nullptr if none), and a node's op parameters made those of its
// materialising op (a ggml_map_custom1 over the routed ids, as build_materialize makes it).
zipmoe_llama_tensor * zipmoe_llama_find_name(const char * name);
void                  zipmoe_llama_set_materialize(ggml_tensor * node, zipmoe_llama_tensor * zt);
