// zipmoe-llama.cpp - llama.cpp glue: ggml buffers around zipmoe stores, the registry that tells the
// graph builder which weights are compressed, and the custom op that materialises routed experts.
#include "zipmoe-llama.h"
#include "zipmoe-llama-impl.h"
#include "zipmoe-config.h"
#include "zipmoe-control.h"
#include "zipmoe-rpc.h"

#include "ggml-backend.h"
#include "ggml-backend-impl.h" // (a buffer of the CPU repack type over the store's memory: zipmoe_llama_bind)
#include "llama-impl.h"
#include "ggml-cpu.h"
#include "zipmoe.h"
#include "zipmoe-cache.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

// Weight -> zipmoe tensor. Filled at load, read at graph build; the count keeps plain models lock-free.
static std::mutex                                                      g_registry_mu;
static std::unordered_map<const ggml_tensor *, zipmoe_llama_tensor *> g_registry;
static std::atomic<size_t>                                             g_registry_size{0};
static std::unordered_set<const zipmoe_llama_tensor *>                 g_bound; // the registry's values

// The stores opened since the last zipmoe_llama_configure: the model being loaded. A store whose load fails
// before configure is removed by its deleter, so the next model's budget never counts it.
struct zipmoe_pending {
    zipmoe_store *    store;
    zipmoe_store_size size;
    bool              slow_warm; // its warm hits decode slowly
    bool              raw;       // a plain GGUF's experts (zipmoe_llama_open_raw)
};
static std::mutex                         g_pending_mu;
static std::vector<zipmoe_pending>        g_pending;
static std::vector<zipmoe_store *>        g_opened; // the same stores
// The model configured last, until all of its stores are bound: then its tiers are filled (zipmoe_cache_prefill).
static std::vector<zipmoe_store *> g_loading;
static size_t                      g_loading_bound = 0;
static bool                        g_prefill       = true;
static int                         g_model_seq     = 0; // loads configured: stores opened since belong to the next
static std::atomic<bool>           g_predict{false};    // ZIPMOE_PREDICT

// ZIPMOE_PRIOR_RECORD: where a configured model's unload writes its run's expert uses (zipmoe_prior_record). The
// first of its tensors to be freed writes it, while every store of the model is open still. Under g_pending_mu.
struct zipmoe_record {
    int                         model;
    std::string                 path;
    std::vector<zipmoe_store *> stores;
};
static std::vector<zipmoe_record> g_records;

static void record_at_unload(int model) {
    zipmoe_record rec;
    {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        auto it = std::find_if(g_records.begin(), g_records.end(),
                               [model](const zipmoe_record & r) { return r.model == model; });
        if (it == g_records.end()) {
            return;
        }
        rec = std::move(*it);
        g_records.erase(it);
    }
    char msg[256];
    if (zipmoe_prior_record(rec.stores.data(), (int64_t) rec.stores.size(), rec.path.c_str(), msg, sizeof msg) < 0) {
        LLAMA_LOG_WARN("zipmoe: warning: ZIPMOE_PRIOR_RECORD=%s: %s; this run's expert uses are not recorded\n",
                       rec.path.c_str(), msg);
    }
}

void zipmoe_llama_tensor_deleter::operator()(zipmoe_llama_tensor * zt) const {
    record_at_unload(zt->model);
    if (zt->tensor) {
        std::lock_guard<std::mutex> lock(g_registry_mu);
        g_registry.erase(zt->tensor);
        g_bound.erase(zt);
        g_registry_size = g_registry.size();
    }
    if (zt->buffer) {
        ggml_backend_buffer_free(zt->buffer);
    }
    {
        std::lock_guard<std::mutex> lock(g_pending_mu); // a model whose load failed leaves no dangling store
        g_opened.erase(std::remove(g_opened.begin(), g_opened.end(), zt->store), g_opened.end());
        g_pending.erase(std::remove_if(g_pending.begin(), g_pending.end(),
                                       [zt](const zipmoe_pending & p) { return p.store == zt->store; }),
                        g_pending.end());
        g_loading.erase(std::remove(g_loading.begin(), g_loading.end(), zt->store), g_loading.end());
    }
    zipmoe_store_free(zt->store); // unmaps the BF16 memory after the buffer that wrapped it is gone
    delete zt;
}

zipmoe_runtime_config zipmoe_llama_runtime_config() {
    zipmoe_runtime_config cfg;
    zipmoe_runtime_config_from_env(&cfg);
    return cfg;
}

static int layer_of(const std::string & name) {
    int layer = -1, n = 0;
    return std::sscanf(name.c_str(), "blk.%d.%n", &layer, &n) == 1 && n > 0 ? layer : -1;
}

// The budget and the cache's settings from the environment (how bare llama-cli is configured; pyzipmoe sets the
// same): zipmoe_runtime_config lists the variables.
bool zipmoe_llama_configure(uint64_t other_bytes, uint64_t embd_bytes, uint64_t embd_row_bytes, std::string & info,
                            std::string & err) {
    const zipmoe_runtime_config    env = zipmoe_llama_runtime_config();
    std::vector<zipmoe_store_size> stores;
    std::vector<zipmoe_store *>    loading; // their handles, for a prior
    bool                           warm_fast = false, raw = false;
    int                            model     = 0;
    {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        warm_fast = !g_pending.empty();
        for (const zipmoe_pending & p : g_pending) {
            stores.push_back(p.size);
            warm_fast = warm_fast && !p.slow_warm;
            raw       = raw || p.raw;
        }
        g_pending.clear();
        g_loading.swap(g_opened);
        g_opened.clear();
        loading = g_loading;
        g_loading_bound = 0;
        g_prefill       = env.prefill != 0;
        model           = g_model_seq++;
    }
    if (const char * v = env.predict) {
        if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
            err = std::string("ZIPMOE_PREDICT=") + v + " is not 0 or 1";
            return false;
        }
        g_predict = std::strcmp(v, "1") == 0;
    } else {
        g_predict = false;
    }
    if (env.prior && !zipmoe_llama_apply_prior(env.prior, loading, err)) {
        return false;
    }
    if (!zipmoe_llama_configure_cache(env, stores, warm_fast, raw, other_bytes, embd_bytes, embd_row_bytes, info, err)) {
        return false;
    }
    if (env.prior_record && !loading.empty()) {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        g_records.push_back({ model, env.prior_record, loading });
    }
    return true;
}

// A store just opened joins the model being loaded: its sizes for the budget, and its handle.
static zipmoe_llama_tensor_ptr adopt(const char * name, zipmoe_store * store, uint64_t decoded_bytes, bool raw) {
    zipmoe_tensor_info info;
    zipmoe_store_get_info(store, &info);
    {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        g_pending.push_back({ store, { decoded_bytes, (uint64_t) info.n_expert, info.data_size },
                              raw || info.codec != ZIPMOE_CODEC_ESC || zipmoe_esc_simd_level() == 0, raw });
        g_opened.push_back(store);
    }
    zipmoe_llama_tensor_ptr zt(new zipmoe_llama_tensor);
    zt->store = store;
    {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        zt->model = g_model_seq;
    }
    zt->layer = layer_of(name);
    return zt;
}

zipmoe_llama_tensor_ptr zipmoe_llama_open(const char * name, const void * index, size_t index_size,
                                          uint64_t data_size, std::string & err) {
    zipmoe_store * store = nullptr;
    const int64_t  rc    = zipmoe_store_open(name, index, index_size, data_size, &store);
    if (rc < 0) {
        err = std::string("index: ") + zipmoe_status_str(rc);
        return nullptr;
    }
    zipmoe_tensor_info info;
    zipmoe_store_get_info(store, &info);
    // a byte-layout expert (F32, quantized) is kept as a plain GGUF's is: decoded only (its region is its bytes)
    return adopt(name, store, (uint64_t) info.n_expert * (uint64_t) info.expert_size, info.layout == ZIPMOE_LAYOUT_BYTES);
}

zipmoe_llama_tensor_ptr zipmoe_llama_open_raw(const char * name, const ggml_tensor * meta, std::string & err) {
    if (!ggml_get_type_traits_cpu(meta->type)->vec_dot) { // (what ggml_mul_mat_id computes with)
        err = std::string("the CPU backend has no matmul for its type ") + ggml_type_name(meta->type);
        return nullptr;
    }
    const int64_t  ne[4]     = { meta->ne[0], meta->ne[1], meta->ne[2], meta->ne[3] };
    const uint64_t row_bytes = ggml_row_size(meta->type, meta->ne[0]);
    zipmoe_store * store     = nullptr;
    const int64_t  rc        = zipmoe_store_open_raw(name, (int32_t) meta->type, ne, row_bytes, &store);
    if (rc < 0) {
        err = std::string("cannot serve its experts: ") + zipmoe_status_str(rc);
        return nullptr;
    }
    return adopt(name, store, (uint64_t) ne[2] * (uint64_t) ne[1] * row_bytes, true);
}

bool zipmoe_llama_plain_budget() {
    return zipmoe_llama_runtime_config().memory_budget != nullptr;
}

bool zipmoe_llama_expert_name(const std::string & name) {
    // blk.N. with N as the converter writes it: 1 to 9 digits, no sign, no leading zero
    if (name.compare(0, 4, "blk.") != 0) {
        return false;
    }
    size_t i = 4;
    while (i < name.size() && i < 4 + 10 && name[i] >= '0' && name[i] <= '9') {
        i++;
    }
    if (i == 4 || i > 4 + 9 || (name[4] == '0' && i > 5) || i >= name.size() || name[i] != '.') {
        return false;
    }
    const std::string rest = name.substr(i + 1);
    return rest == "ffn_up_exps.weight" || rest == "ffn_gate_exps.weight" || rest == "ffn_down_exps.weight" ||
           rest == "ffn_gate_up_exps.weight";
}

size_t zipmoe_llama_index_header_size() {
    return 48 * 8; // docs/FORMAT.md "Index": 48 int64 words
}

bool zipmoe_llama_check_index_size(const void * header, size_t header_size, uint64_t index_size, uint64_t data_size,
                                   std::string & err) {
    uint64_t      expect = 0;
    const int64_t rc     = zipmoe_tensor_index_size(header, header_size, data_size, &expect);
    if (rc < 0) {
        err = std::string("index: ") + zipmoe_status_str(rc);
        return false;
    }
    if (expect != index_size) {
        err = "index: its header says " + std::to_string(expect) + " bytes, the tensor has " +
              std::to_string(index_size);
        return false;
    }
    return true;
}

bool zipmoe_llama_check_meta(const zipmoe_llama_tensor * zt, const char * codec, uint32_t chunk_size,
                             std::string & err) {
    zipmoe_tensor_info info;
    zipmoe_store_get_info(zt->store, &info);
    const int want = std::strcmp(codec, "zstd") == 0 ? ZIPMOE_CODEC_ZSTD
                     : std::strcmp(codec, "huff") == 0 ? ZIPMOE_CODEC_HUFF
                     : std::strcmp(codec, "esc") == 0 ? ZIPMOE_CODEC_ESC
                     : std::strcmp(codec, "raw") == 0 ? ZIPMOE_CODEC_RAW : -1;
    if (want < 0) {
        err = std::string("unknown zipmoe.codec '") + codec + "'";
        return false;
    }
    if (info.layout == ZIPMOE_LAYOUT_BYTES) {
        // zipmoe.codec and zipmoe.chunk_size are the split tensors'; a byte-layout one is raw, in chunks of whole
        // rows (the index checked both)
        if (info.codec != ZIPMOE_CODEC_RAW) {
            err = "the index codes a byte-layout tensor with a codec other than raw";
            return false;
        }
        return true;
    }
    if (info.codec != want || info.chunk_n != (int64_t) chunk_size) {
        static const char * names[] = { "?", "zstd", "huff", "esc", "raw" };
        err = std::string("the index disagrees with the metadata (codec ") +
              names[info.codec >= 1 && info.codec <= 4 ? info.codec : 0] + " vs " + codec +
              ", chunk size " + std::to_string(info.chunk_n) + " vs " + std::to_string(chunk_size) + ")";
        return false;
    }
    return true;
}

void zipmoe_llama_shape(const zipmoe_llama_tensor * zt, int64_t ne[4]) {
    zipmoe_tensor_info info;
    zipmoe_store_get_info(zt->store, &info);
    std::memcpy(ne, info.ne, sizeof info.ne);
}

ggml_type zipmoe_llama_type(const zipmoe_llama_tensor * zt) {
    zipmoe_tensor_info info;
    zipmoe_store_get_info(zt->store, &info);
    return (ggml_type) info.ggml_type;
}

static int cpu_count() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) {
        return CPU_COUNT(&set);
    }
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int) n : 1;
}

// Once the last store of the model being loaded is bound, its tiers are filled on every core: the first tokens
// then find the experts a plain model would find in the page cache after llama.cpp's read-ahead. (store nullptr: one
// left the model being loaded, zipmoe_llama_bind_remote; the others may all be bound now.)
static void prefill_when_bound(zipmoe_store * store) {
    std::vector<zipmoe_store *> stores;
    {
        std::lock_guard<std::mutex> lock(g_pending_mu);
        if (store ? std::find(g_loading.begin(), g_loading.end(), store) == g_loading.end() ||
                        ++g_loading_bound < g_loading.size()
                  : g_loading.empty() || g_loading_bound < g_loading.size()) {
            return;
        }
        stores.swap(g_loading);
        g_loading_bound = 0;
        if (!g_prefill) {
            return;
        }
    }
    zipmoe_prefill_stats st{};
    const int     threads = cpu_count();
    const int64_t rc      = zipmoe_cache_prefill(stores.data(), (int64_t) stores.size(), threads, &st);
    if (rc < 0) {
        LLAMA_LOG_WARN("%s: zipmoe: could not fill the cache tiers at load (%s); experts are decoded when routed to\n",
                       __func__, zipmoe_status_str(rc));
        return;
    }
    LLAMA_LOG_INFO("%s: zipmoe: filled the cache tiers at load: %llu experts in %.2f s on %d threads%s\n", __func__,
                   (unsigned long long) st.experts, (double) st.ns / 1e9, threads,
                   st.failed ? " (some failed: they are decoded, and report their error, when routed to)" : "");
}

// A descriptor of the model file of our own (plain), which is the file llama.cpp opened (fd); -1 if not.
static int open_own(const char * path, int fd) {
    struct stat mine, theirs;
    const int   own = path && *path ? open(path, O_RDONLY | O_CLOEXEC) : -1;
    if (own >= 0 && (fstat(own, &mine) != 0 || fstat(fd, &theirs) != 0 || mine.st_dev != theirs.st_dev ||
                     mine.st_ino != theirs.st_ino)) {
        close(own);
        return -1;
    }
    return own;
}

// A raw store's rows of a tensor the CPU backend keeps repacked (zipmoe_store_set_raw_put): repacked into their
// place by the backend's own set_tensor, on a tensor of just those rows, so the place holds what llama.cpp's repack
// buffer would hold for them (its groups of rows are repacked one by one) and its matmul reads the same bytes.
static void repack_put(void * ctx, void * dst, const void * src, int64_t n_rows) {
    const auto * zt   = static_cast<const zipmoe_llama_tensor *>(ctx);
    ggml_tensor  rows = *zt->tensor;
    rows.ne[1]        = n_rows;
    rows.ne[2]        = 1;
    rows.nb[2]        = rows.nb[1] * (size_t) n_rows;
    rows.nb[3]        = rows.nb[2];
    rows.data         = dst;
    zt->buffer->iface.set_tensor(zt->buffer, &rows, src, 0, ggml_nbytes(&rows));
}

// Whether llama.cpp would keep t in the CPU backend's repack buffer type (buft, its choice for the weight): the
// type its matmuls then take a layout of their own for. Another buffer type that is not plain host memory (another
// extra CPU type) zipmoe cannot serve: err says so.
static bool repacked(const ggml_backend_buffer_type_t buft, const ggml_tensor * t, bool & out, std::string & err) {
    out = buft && buft != ggml_backend_cpu_buffer_type() && !ggml_backend_buft_is_host(buft);
    if (out && std::strcmp(ggml_backend_buft_name(buft), "CPU_REPACK") != 0) {
        err = std::string("llama.cpp keeps this ") + ggml_type_name(t->type) + " tensor in " +
              ggml_backend_buft_name(buft) + ", which zipmoe cannot serve from its cache: load the model without a "
              "memory budget";
        return false;
    }
    return true;
}

bool zipmoe_llama_bind(zipmoe_llama_tensor * zt, ggml_tensor * t, ggml_backend_buffer_type_t buft, bool no_alloc,
                       const char * path, int fd, uint64_t data_offs, std::string & err) {
    zipmoe_tensor_info info;
    zipmoe_store_get_info(zt->store, &info);
    const bool      raw  = zipmoe_store_is_raw(zt->store);
    const ggml_type want = (ggml_type) info.ggml_type; // (the index's: BF16, F16 or a byte-layout type)
    if (t->type != want) {
        err = "the model asks for a " + std::string(ggml_type_name(t->type)) + " tensor; zipmoe serves " +
              ggml_type_name(want);
        return false;
    }
    bool repack = false; // (a compressed store's memory is host memory whatever buft says)
    if (!repacked(buft, t, repack, err)) {
        return false;
    }
    if (repack && !raw && info.layout != ZIPMOE_LAYOUT_BYTES) {
        err = std::string("the CPU backend repacks ") + ggml_type_name(t->type) + " experts, which zipmoe does only "
              "for byte-layout types";
        return false;
    }
    if (no_alloc) {
        // as llama.cpp does for its weights in the fit pass: a buffer, so the scheduler allocates nothing
        zt->buffer = ggml_backend_buft_alloc_buffer(repack ? buft : ggml_backend_cpu_buffer_type(), 0);
        t->buffer  = zt->buffer;
        return true;
    }
    // repacked in groups of up to 16 rows (ggml-cpu/repack.cpp: 4, 8 or 16 by type and CPU), which chunks keep whole
    if (repack && zipmoe_store_set_raw_put(zt->store, repack_put, zt, 16) < 0) {
        err = "cannot set up the repacking of its experts";
        return false;
    }
    void *        dst      = nullptr;
    size_t        dst_size = 0;
    const int     own      = open_own(path, fd);
    if (own < 0) {
        err = std::string("cannot open the model file ") + (path ? path : "") + " again for reading";
        return false;
    }
    const int64_t rc = zipmoe_store_bind(zt->store, own, data_offs, &dst, &dst_size); // keeps a copy of own
    close(own);
    if (rc < 0) {
        err = std::string("cannot set up the compressed experts: ") + zipmoe_status_str(rc);
        return false;
    }
    if (dst_size < ggml_nbytes(t) || (zipmoe_store_is_raw(zt->store) && !ggml_is_contiguous(t)) ||
        std::memcmp(info.ne, t->ne, sizeof info.ne) != 0) {
        err = "the index's shape does not match the model's";
        return false;
    }
    zt->buffer = ggml_backend_cpu_buffer_from_ptr(dst, dst_size);
    if (!zt->buffer) {
        err = "cannot wrap the expert memory in a ggml buffer";
        return false;
    }
    if (repack) {
        // the repack type's buffer is a CPU buffer with its own tensor init (the layout's traits, in t->extra) and
        // set_tensor (the repacking): ours takes the same two over the store's memory
        ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(buft, 64);
        if (!probe || !probe->iface.init_tensor || !probe->iface.set_tensor) {
            if (probe) {
                ggml_backend_buffer_free(probe);
            }
            err = std::string("cannot set up a ") + ggml_backend_buft_name(buft) + " buffer over the expert memory";
            return false;
        }
        zt->buffer->buft              = buft;
        zt->buffer->iface.init_tensor = probe->iface.init_tensor;
        zt->buffer->iface.set_tensor  = probe->iface.set_tensor;
        zt->buffer->iface.get_tensor  = nullptr;
        zt->buffer->iface.cpy_tensor  = nullptr;
        ggml_backend_buffer_free(probe);
    }
    ggml_backend_buffer_set_usage(zt->buffer, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (ggml_backend_tensor_alloc(zt->buffer, t, dst) != GGML_STATUS_SUCCESS || (repack && !t->extra)) {
        err = "cannot place the tensor in its buffer";
        return false;
    }
    {
        std::lock_guard<std::mutex> lock(g_registry_mu);
        g_registry[t]   = zt;
        g_bound.insert(zt);
        zt->tensor      = t;
        g_registry_size = g_registry.size();
    }
    prefill_when_bound(zt->store);
    return true;
}

void zipmoe_llama_bind_remote(zipmoe_llama_tensor * zt, ggml_tensor * t, const std::string & endpoint) {
    zipmoe_store * store = zt->store;
    {
        std::lock_guard<std::mutex> lock(g_pending_mu); // as its deleter does: the model being loaded loses it
        g_opened.erase(std::remove(g_opened.begin(), g_opened.end(), store), g_opened.end());
        g_pending.erase(std::remove_if(g_pending.begin(), g_pending.end(),
                                       [store](const zipmoe_pending & p) { return p.store == store; }),
                        g_pending.end());
        g_loading.erase(std::remove(g_loading.begin(), g_loading.end(), store), g_loading.end());
    }
    zipmoe_store_free(store);
    zt->store  = nullptr;
    zt->remote = endpoint;
    {
        std::lock_guard<std::mutex> lock(g_registry_mu); // (not in g_bound: no op of this process materialises it)
        g_registry[t]   = zt;
        zt->tensor      = t;
        g_registry_size = g_registry.size();
    }
    prefill_when_bound(nullptr);
}

zipmoe_llama_tensor * zipmoe_llama_find_name(const char * name) {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    for (const zipmoe_llama_tensor * zt : g_bound) {
        if (std::strcmp(zt->tensor->name, name) == 0) {
            return const_cast<zipmoe_llama_tensor *>(zt); // (g_bound holds them const)
        }
    }
    return nullptr;
}

zipmoe_llama_tensor * zipmoe_llama_find(const ggml_tensor * w) {
    if (g_registry_size.load(std::memory_order_relaxed) == 0) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_registry_mu);
    const auto                  it = g_registry.find(w);
    return it == g_registry.end() ? nullptr : it->second;
}

// The router of the layer whose routed experts are ids: the nearest matmul above it of a weight with n_expert rows
// (top-k of the softmax of its logits, in llama.cpp's MoE layers), and that matmul's input, the layer's FFN input.
static const ggml_tensor * find_router(const ggml_tensor * ids, int64_t n_expert, const ggml_tensor ** input) {
    std::vector<const ggml_tensor *> level{ ids };
    for (int depth = 0; depth < 6 && !level.empty(); depth++) {
        std::vector<const ggml_tensor *> up;
        for (const ggml_tensor * t : level) {
            const ggml_tensor * w = t->src[0];
            if (t->op == GGML_OP_MUL_MAT && w && w->op == GGML_OP_NONE && w->buffer && w->ne[1] == n_expert &&
                w->ne[2] == 1 && t->src[1] && t->src[1]->ne[2] == 1 && t->src[1]->ne[3] == 1) {
                *input = t->src[1];
                return w;
            }
            for (const ggml_tensor * s : t->src) {
                if (s) {
                    up.push_back(s);
                }
            }
        }
        level.swap(up);
    }
    return nullptr;
}

// The expert tensors of the next layer in zt's model (empty if none), and that layer's router if a graph built so far
// showed it.
static const ggml_tensor * next_layer(zipmoe_llama_tensor * zt) {
    std::lock_guard<std::mutex> lock(g_registry_mu);
    if (zt->next.empty()) {
        for (const auto & [t, other] : g_registry) {
            if (other->model == zt->model && other->layer == zt->layer + 1 && other->store) { // (not a server's)
                zt->next.push_back(other);
            }
        }
    }
    for (const zipmoe_llama_tensor * other : zt->next) {
        if (other->router) {
            return other->router;
        }
    }
    return nullptr;
}

// On one thread, before this layer's experts are materialised: the top-k of the next layer's router logits on this
// layer's input (a, [n_expert, 1]) are the experts its stores read ahead (k: ids's rows, b); whichever of them the
// graph invokes first reads them.
static void predict_op(ggml_tensor * dst, const ggml_tensor * a, const ggml_tensor * b, int ith, int nth,
                       void * userdata) {
    (void) dst;
    (void) nth;
    if (ith != 0 || a->type != GGML_TYPE_F32) {
        return;
    }
    auto *                                zt = static_cast<zipmoe_llama_tensor *>(userdata);
    const int64_t                         n  = a->ne[0];
    const int64_t                         k  = std::min<int64_t>(b->ne[0], n);
    const float *                         v  = static_cast<const float *>(a->data);
    thread_local std::vector<int32_t> order; // allocated once per thread, not per token
    order.resize((size_t) n);
    for (int64_t e = 0; e < n; e++) {
        order[(size_t) e] = (int32_t) e;
    }
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [v](int32_t x, int32_t y) { return v[x] > v[y]; });
    for (zipmoe_llama_tensor * next : zt->next) {
        zipmoe_store_predict(next->store, order.data(), k);
    }
}

// In generation, the first expert tensor of a layer guesses the next layer's routing: that layer's router on this
// layer's FFN input (the residual stream changes little from one layer to the next). Its store reads the experts it
// names ahead, while this layer computes, instead of waiting for its router. nullptr when there is nothing to guess.
static ggml_tensor * build_prediction(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * ids) {
    thread_local const ggml_context * last_ctx   = nullptr; // one guess per layer and graph: the first tensor's
    thread_local int                  last_layer = -1;
    if (!g_predict || zt->layer < 0 || (ctx == last_ctx && zt->layer == last_layer)) {
        return nullptr;
    }
    last_ctx   = ctx;
    last_layer = zt->layer;
    zipmoe_tensor_info info;
    zipmoe_store_get_info(zt->store, &info);
    const ggml_tensor * input  = nullptr;
    const ggml_tensor * router = find_router(ids, info.n_expert, &input);
    if (!router) {
        return nullptr;
    }
    {
        std::lock_guard<std::mutex> lock(g_registry_mu); // (two contexts of one model may build graphs at once)
        zt->router = router;
    }
    const ggml_tensor * next_router = next_layer(zt);
    if (!next_router || input->ne[1] != 1 || next_router->ne[0] != input->ne[0] || next_router->ne[1] != info.n_expert) {
        return nullptr; // the next layer not seen yet (the first graph), a batch of tokens (read ahead whole), ...
    }
    ggml_tensor * logits = ggml_mul_mat(ctx, const_cast<ggml_tensor *>(next_router), const_cast<ggml_tensor *>(input));
    ggml_tensor * guess  = ggml_map_custom2(ctx, logits, ids, predict_op, 1, zt);
    ggml_format_name(guess, "zipmoe-guess-blk.%d", zt->layer + 1);
    return guess;
}

// Called by every graph thread (ith of nth) between the router and ggml_mul_mat_id. The node is
// unique to this graph, so it keys the invocation for the store's barrier-free protocol.
static void materialize_op(ggml_tensor * dst, const ggml_tensor * ids, int ith, int nth, void * userdata) {
    auto *    zt   = static_cast<zipmoe_llama_tensor *>(userdata);
    const int part = zipmoe_ledger_switch(ZIPMOE_LEDGER_OTHER);
    // errors are recorded by the store and reported by llama_decode (zipmoe_llama_take_error)
    zipmoe_store_materialize(zt->store, dst, ids->data, ids->ne[0], ids->ne[1], ids->nb[0], ids->nb[1],
                             static_cast<int32_t *>(dst->data), ith, nth);
    zipmoe_ledger_switch(part);
}

static void materialize_after_guess_op(ggml_tensor * dst, const ggml_tensor * ids, const ggml_tensor * guess,
                                       int ith, int nth, void * userdata) {
    (void) guess; // a source only so that the guess is computed first
    materialize_op(dst, ids, ith, nth, userdata);
}

static ggml_tensor * build_materialize(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * ids, ggml_tensor * w,
                                       ggml_tensor * guess) {
    // a new tensor, not ids: it holds where this store decoded the routed experts (zipmoe_store_materialize),
    // and the layer's other expert tensors read the router's ids through their own op. Not w as a source: the CPU
    // backend computes no op but its matmuls on a weight it keeps repacked (materialised_by finds the op)
    ggml_tensor * r = guess ? ggml_map_custom2(ctx, ids, guess, materialize_after_guess_op, GGML_N_TASKS_MAX, zt)
                            : ggml_map_custom1(ctx, ids, materialize_op, GGML_N_TASKS_MAX, zt);
    ggml_format_name(r, "zipmoe-%s", w->name);
    return r;
}

ggml_tensor * zipmoe_llama_mul_mat_id(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * w, ggml_tensor * x,
                                      ggml_tensor * ids, bool warmup) {
    if (warmup) {
        return ggml_mul_mat_id(ctx, w, x, ids); // warmup routes to every expert, its output unused: decode nothing
    }
    if (!zt->remote.empty()) {
        return zipmoe_rpc_mul_mat_id(ctx, zt, w, x, ids); // a zipmoe RPC server's experts
    }
    ggml_tensor * guess = build_prediction(ctx, zt, ids);
    static const bool fuse = zipmoe_llama_runtime_config().fused != 0;
    if (!fuse || !zipmoe_llama_fusable(w, x, ids)) {
        return ggml_mul_mat_id(ctx, w, x, build_materialize(ctx, zt, ids, w, guess));
    }
    ggml_tensor * args[4] = { ids, w, x, guess }; // (the guess only so that it is computed first)
    ggml_tensor * r       = ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], x->ne[2], 1, args, guess ? 4 : 3,
                                           zipmoe_llama_fused_op, GGML_N_TASKS_MAX, zt);
    ggml_format_name(r, "zipmoe-mm-%s", w->name);
    return r;
}

void zipmoe_llama_set_materialize(ggml_tensor * node, zipmoe_llama_tensor * zt) {
    const zipmoe_custom_op_params p = { reinterpret_cast<void *>(&materialize_op), GGML_N_TASKS_MAX, zt };
    std::memset(node->op_params, 0, sizeof node->op_params);
    std::memcpy(node->op_params, &p, sizeof p);
}

// The zipmoe tensor a graph node materialises (its op and userdata, in the node's op parameters), or nullptr; only
// while it is bound.
static zipmoe_llama_tensor * materialised_by(const ggml_tensor * node) {
    if (node->op != GGML_OP_MAP_CUSTOM1 && node->op != GGML_OP_MAP_CUSTOM2 && node->op != GGML_OP_CUSTOM) {
        return nullptr;
    }
    const zipmoe_custom_op_params p    = zipmoe_custom_op_params_of(node);
    const bool                    ours = p.fun == reinterpret_cast<void *>(&materialize_op) ||
                                         p.fun == reinterpret_cast<void *>(&materialize_after_guess_op) ||
                                         p.fun == reinterpret_cast<void *>(&zipmoe_llama_fused_op);
    if (!ours) {
        return nullptr;
    }
    std::lock_guard<std::mutex> lock(g_registry_mu);
    auto * zt = static_cast<zipmoe_llama_tensor *>(p.userdata);
    return g_bound.count(zt) ? zt : nullptr;
}

// Whether each zipmoe op of gf is followed by its matmul before the next zipmoe op: what lets a store's plan evict
// the experts the previous store pinned (cache/tiers.c, cache_trim_others), and the budget hold one expert tensor in flight.
// ggml computes nodes in the graph's order, and llama.cpp's graphs have it (a matmul's inputs are visited right
// before it). A graph that does not may have read evicted experts: false, with a message, and the stores keep
// each layer's experts until the next layer from then on (zipmoe_cache_set_store_turns). Checked after a compute
// when the graph's size changes (a prompt's, a token's: llama.cpp reuses graph objects).
static bool check_graph_order(const ggml_cgraph * gf, std::string & msg) {
    static std::atomic<int>  checked{ -1 };
    static std::atomic<bool> said{ false };
    const int                n_nodes = ggml_graph_n_nodes(const_cast<ggml_cgraph *>(gf));
    if (checked.exchange(n_nodes) == n_nodes || said.load()) {
        return true;
    }
    const ggml_tensor *         open    = nullptr; // a zipmoe op whose matmul has not come yet
    const zipmoe_llama_tensor * open_zt = nullptr; // what it materialised
    for (int i = 0; i < n_nodes; i++) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(gf), i);
        if (const zipmoe_llama_tensor * zt = materialised_by(node)) {
            if (open && !said.exchange(true)) {
                zipmoe_cache_set_store_turns(0);
                msg = std::string("zipmoe: this graph decodes ") + zt->tensor->name + "'s experts before " +
                      open_zt->tensor->name + "'s matmul has run, so its output may be wrong; from now on a layer's " +
                      "experts stay decoded until the next layer (beyond the memory budget by up to two expert " +
                      "tensors' experts): decode again";
                return false;
            }
            open    = node->op == GGML_OP_CUSTOM ? nullptr : node; // (the fused node is its own matmul)
            open_zt = zt;
        } else if (node->op == GGML_OP_MUL_MAT_ID && node->src[2] == open) {
            open = nullptr;
        }
    }
    return true;
}


// The tokens of the graph this thread computes now, for its ledger (zipmoe-ledger.h) when it ends.
static thread_local int64_t g_ledger_tokens = 0;

std::unique_lock<std::mutex> zipmoe_llama_compute_turn(const ggml_cgraph * gf) {
    static std::mutex turn;
    if (g_registry_size.load(std::memory_order_relaxed) == 0) {
        return {};
    }
    // the most experts one store of the graph may be routed: a token's top-k in generation, which lets the hot
    // tier hold the allowance for the tensor in flight too (zipmoe_cache_begin_graph); and whether every token of
    // the graph has its logits wanted (the rows of result_output; llama.cpp computes the last layer for those
    // only): a step of generation, speculation's verification or parallel slots' tokens, not a prompt's batch
    // (zipmoe_cache_begin_step)
    int64_t routed = -1, tokens = 0, outputs = -1;
    for (int i = 0; i < ggml_graph_n_nodes(const_cast<ggml_cgraph *>(gf)); i++) {
        const ggml_tensor * node = ggml_graph_node(const_cast<ggml_cgraph *>(gf), i);
        if (materialised_by(node)) {
            const ggml_tensor * ids = node->src[0];
            routed = std::max(routed, std::min<int64_t>(ids->ne[0] * ids->ne[1], materialised_by(node)->tensor->ne[2]));
            tokens = std::max<int64_t>(tokens, ids->ne[1]);
        } else if (std::strcmp(node->name, "result_output") == 0) {
            outputs = node->ne[1];
        }
    }
    if (routed < 0) {
        return {};
    }
    zipmoe_ledger_graph_begin(); // (the scan above: a few microseconds, the ledger's first part)
    zipmoe_ledger_switch(ZIPMOE_LEDGER_THREAD_WAIT);
    std::unique_lock<std::mutex> lock(turn);
    zipmoe_ledger_switch(ZIPMOE_LEDGER_OTHER);
    g_ledger_tokens = tokens;
    zipmoe_control_poll(); // a supervisor's new budget, before the graph's budget is chosen (zipmoe-control.cpp)
    if (outputs >= tokens) {
        zipmoe_cache_begin_step(routed);
    } else {
        zipmoe_cache_begin_graph(routed);
    }
    zipmoe_ledger_switch(ZIPMOE_LEDGER_COMPUTE);
    return lock;
}

bool zipmoe_llama_take_error(const ggml_cgraph * gf, std::string & msg) {
    if (g_registry_size.load(std::memory_order_relaxed) == 0) {
        return false;
    }
    zipmoe_ledger_switch(ZIPMOE_LEDGER_OTHER);
    // exactly the stores this graph materialised: another model's errors are its own graph's to report
    bool failed = !check_graph_order(gf, msg);
    for (int i = 0; i < ggml_graph_n_nodes(const_cast<ggml_cgraph *>(gf)); i++) {
        if (zipmoe_llama_tensor * zt = materialised_by(ggml_graph_node(const_cast<ggml_cgraph *>(gf), i))) {
            char buf[256];
            if (zipmoe_store_take_error(zt->store, buf, sizeof buf) != ZIPMOE_OK && !failed) {
                msg    = buf;
                failed = true;
            }
        }
    }
    zipmoe_ledger_graph_end(g_ledger_tokens);
    return failed;
}
