// zipmoe-llama.cpp - llama.cpp glue: ggml buffers around zipmoe stores, the registry that tells the
// graph builder which weights are compressed, and the custom op that materialises routed experts.
#include "zipmoe-llama.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "zipmoe.h"

#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

struct zipmoe_llama_tensor {
    zipmoe_store *        store  = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    const ggml_tensor *   tensor = nullptr; // registered while bound for real
};

// Weight -> zipmoe tensor. Filled at load, read at graph build; the count keeps plain models lock-free.
static std::mutex                                                      g_registry_mu;
static std::unordered_map<const ggml_tensor *, zipmoe_llama_tensor *> g_registry;
static std::atomic<size_t>                                             g_registry_size{0};

void zipmoe_llama_tensor_deleter::operator()(zipmoe_llama_tensor * zt) const {
    if (zt->tensor) {
        std::lock_guard<std::mutex> lock(g_registry_mu);
        g_registry.erase(zt->tensor);
        g_registry_size = g_registry.size();
    }
    if (zt->buffer) {
        ggml_backend_buffer_free(zt->buffer);
    }
    zipmoe_store_free(zt->store); // unmaps the BF16 memory after the buffer that wrapped it is gone
    delete zt;
}

// "6GiB", "512M", "1000000" (bytes) or "60%" (of physical memory); false if malformed.
static bool parse_size(const char * text, uint64_t & out) {
    char *       end = nullptr;
    const double v   = std::strtod(text, &end);
    if (end == text || !(v >= 0)) {
        return false;
    }
    std::string unit(end);
    for (auto & c : unit) {
        c = (char) std::tolower((unsigned char) c);
    }
    double scale = 1;
    if (unit == "%") {
        scale = (double) sysconf(_SC_PHYS_PAGES) * (double) sysconf(_SC_PAGESIZE) / 100;
    } else if (unit == "k" || unit == "kib" || unit == "kb") {
        scale = 1024.0;
    } else if (unit == "m" || unit == "mib" || unit == "mb") {
        scale = 1024.0 * 1024;
    } else if (unit == "g" || unit == "gib" || unit == "gb") {
        scale = 1024.0 * 1024 * 1024;
    } else if (!unit.empty() && unit != "b") {
        return false;
    }
    out = (uint64_t) (v * scale);
    return true;
}

// The cache budget from the environment (how bare llama-cli is configured; pyzipmoe sets the same):
//   ZIPMOE_MEMORY_BUDGET  bytes zipmoe may keep: decoded (hot) and compressed (warm) experts; unset: unbounded
//   ZIPMOE_HOT_SHARE      the budget's fraction for decoded experts (default 0.5), the rest compressed
//   ZIPMOE_CACHE_POLICY   tlfu (default, token-weighted LFU), lru, lfu or fifo
//   ZIPMOE_CACHE          "none": decode on every use (measurements, tests)
static bool configure_cache_from_env(std::string & err) {
    uint64_t      hot = UINT64_MAX, warm = 0;
    zipmoe_policy policy = ZIPMOE_POLICY_TOKEN_LFU;
    if (const char * v = std::getenv("ZIPMOE_MEMORY_BUDGET"); v && *v) {
        uint64_t budget = 0;
        if (!parse_size(v, budget)) {
            err = std::string("ZIPMOE_MEMORY_BUDGET=") + v + " is not a size (e.g. 6GiB, 512MiB, 60%)";
            return false;
        }
        double share = 0.5;
        if (const char * h = std::getenv("ZIPMOE_HOT_SHARE"); h && *h) {
            char * end = nullptr;
            share      = std::strtod(h, &end);
            if (*end || !(share >= 0 && share <= 1)) {
                err = std::string("ZIPMOE_HOT_SHARE=") + h + " is not a fraction between 0 and 1";
                return false;
            }
        }
        hot  = (uint64_t) ((double) budget * share);
        warm = budget - hot;
    }
    if (const char * v = std::getenv("ZIPMOE_CACHE_POLICY"); v && *v) {
        static const std::pair<const char *, zipmoe_policy> names[] = {
            { "tlfu", ZIPMOE_POLICY_TOKEN_LFU }, { "lru", ZIPMOE_POLICY_LRU },
            { "lfu", ZIPMOE_POLICY_LFU },        { "fifo", ZIPMOE_POLICY_FIFO },
        };
        bool found = false;
        for (const auto & [name, p] : names) {
            if (std::strcmp(v, name) == 0) {
                policy = p;
                found  = true;
            }
        }
        if (!found) {
            err = std::string("ZIPMOE_CACHE_POLICY=") + v + " is not a policy (tlfu, lru, lfu or fifo)";
            return false;
        }
    }
    if (const char * v = std::getenv("ZIPMOE_CACHE"); v && *v) {
        if (std::strcmp(v, "none") == 0) {
            hot = 0;
        } else if (std::strcmp(v, "unbounded") != 0) {
            err = std::string("ZIPMOE_CACHE=") + v + " is not a cache mode (use unbounded or none)";
            return false;
        }
    }
    zipmoe_cache_configure(hot, warm, policy);
    return true;
}

zipmoe_llama_tensor_ptr zipmoe_llama_open(const char * name, const void * index, size_t index_size,
                                          uint64_t data_size, std::string & err) {
    if (!configure_cache_from_env(err)) {
        return nullptr;
    }
    zipmoe_store * store = nullptr;
    const int64_t  rc    = zipmoe_store_open(name, index, index_size, data_size, &store);
    if (rc < 0) {
        err = std::string("index: ") + zipmoe_status_str(rc);
        return nullptr;
    }
    zipmoe_llama_tensor_ptr zt(new zipmoe_llama_tensor);
    zt->store = store;
    return zt;
}

void zipmoe_llama_shape(const zipmoe_llama_tensor * zt, int64_t ne[4]) {
    zipmoe_tensor_info info;
    zipmoe_tensor_get_info(zipmoe_store_tensor(zt->store), &info);
    std::memcpy(ne, info.ne, sizeof info.ne);
}

bool zipmoe_llama_bind(zipmoe_llama_tensor * zt, ggml_tensor * t, bool no_alloc, int fd, uint64_t data_offs,
                       std::string & err) {
    if (t->type != GGML_TYPE_BF16) {
        err = "the model asks for a " + std::string(ggml_type_name(t->type)) + " tensor; zipmoe stores BF16";
        return false;
    }
    if (no_alloc) {
        // as llama.cpp does for its weights in the fit pass: a buffer, so the scheduler allocates nothing
        zt->buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), 0);
        t->buffer  = zt->buffer;
        return true;
    }
    void *        dst      = nullptr;
    size_t        dst_size = 0;
    const int64_t rc       = zipmoe_store_bind(zt->store, fd, data_offs, &dst, &dst_size);
    if (rc < 0) {
        err = std::string("cannot set up the compressed experts: ") + zipmoe_status_str(rc);
        return false;
    }
    if (dst_size < ggml_nbytes(t)) {
        err = "the index's shape does not match the model's";
        return false;
    }
    zt->buffer = ggml_backend_cpu_buffer_from_ptr(dst, dst_size);
    if (!zt->buffer) {
        err = "cannot wrap the expert memory in a ggml buffer";
        return false;
    }
    ggml_backend_buffer_set_usage(zt->buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (ggml_backend_tensor_alloc(zt->buffer, t, dst) != GGML_STATUS_SUCCESS) {
        err = "cannot place the tensor in its buffer";
        return false;
    }
    std::lock_guard<std::mutex> lock(g_registry_mu);
    g_registry[t]   = zt;
    zt->tensor      = t;
    g_registry_size = g_registry.size();
    return true;
}

zipmoe_llama_tensor * zipmoe_llama_find(const ggml_tensor * w) {
    if (g_registry_size.load(std::memory_order_relaxed) == 0) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_registry_mu);
    const auto                  it = g_registry.find(w);
    return it == g_registry.end() ? nullptr : it->second;
}

// Called by every graph thread (ith of nth) between the router and ggml_mul_mat_id. The node is
// unique to this graph, so it keys the invocation for the store's barrier-free protocol.
static void materialize_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * w, int ith, int nth,
                           void * userdata) {
    (void) w;
    auto * zt = static_cast<zipmoe_llama_tensor *>(userdata);
    // errors are recorded by the store and reported by llama_decode (zipmoe_llama_take_error)
    zipmoe_store_materialize(zt->store, dst, ids->data, ids->ne[0], ids->ne[1], ids->nb[0], ids->nb[1], ith, nth);
}

ggml_tensor * zipmoe_llama_build(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * ids, ggml_tensor * w,
                                 bool warmup) {
    if (warmup) {
        return ids; // warmup routes to every expert and its output is discarded: decode nothing
    }
    ggml_tensor * r = ggml_map_custom2_inplace(ctx, ids, w, materialize_op, GGML_N_TASKS_MAX, zt);
    ggml_format_name(r, "zipmoe-%s", w->name);
    return r;
}

bool zipmoe_llama_take_error(const ggml_cgraph * gf, std::string & msg) {
    if (g_registry_size.load(std::memory_order_relaxed) == 0) {
        return false;
    }
    // exactly the stores this graph materialised: another model's errors are its own graph's to report
    bool failed = false;
    for (int i = 0; i < ggml_graph_n_nodes(const_cast<ggml_cgraph *>(gf)); i++) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(gf), i);
        if (node->op != GGML_OP_MAP_CUSTOM2 || !node->src[1]) {
            continue;
        }
        if (zipmoe_llama_tensor * zt = zipmoe_llama_find(node->src[1])) {
            char buf[256];
            if (zipmoe_store_take_error(zt->store, buf, sizeof buf) != ZIPMOE_OK && !failed) {
                msg    = buf;
                failed = true;
            }
        }
    }
    return failed;
}
