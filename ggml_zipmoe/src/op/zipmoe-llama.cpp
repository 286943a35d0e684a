// zipmoe-llama.cpp - llama.cpp glue: ggml buffers around zipmoe stores, the registry that tells the
// graph builder which weights are compressed, and the custom op that materialises routed experts.
#include "zipmoe-llama.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "zipmoe.h"

#include <atomic>
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

static zipmoe_cache_mode cache_mode_from_env(std::string & err) {
    const char * v = std::getenv("ZIPMOE_CACHE");
    if (!v || !*v || std::strcmp(v, "unbounded") == 0) {
        return ZIPMOE_CACHE_UNBOUNDED;
    }
    if (std::strcmp(v, "none") == 0) {
        return ZIPMOE_CACHE_NONE;
    }
    err = std::string("ZIPMOE_CACHE=") + v + " is not a cache mode (use unbounded or none)";
    return ZIPMOE_CACHE_UNBOUNDED;
}

zipmoe_llama_tensor_ptr zipmoe_llama_open(const char * name, const void * index, size_t index_size,
                                          uint64_t data_size, std::string & err) {
    const zipmoe_cache_mode mode = cache_mode_from_env(err);
    if (!err.empty()) {
        return nullptr;
    }
    zipmoe_store * store = nullptr;
    const int64_t  rc    = zipmoe_store_open(name, index, index_size, data_size, mode, &store);
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
        err = std::string("cannot map the compressed experts: ") + zipmoe_status_str(rc);
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

bool zipmoe_llama_take_error(std::string & msg) {
    char          buf[256];
    const int64_t rc = zipmoe_take_error(buf, sizeof buf);
    if (rc == ZIPMOE_OK) {
        return false;
    }
    msg = buf;
    return true;
}
