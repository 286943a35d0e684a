// zipmoe-rpc.cpp - zipmoe over llama.cpp's RPC backend (zipmoe-rpc.h): the client's check of each server and its
// expert nodes on the wire, the server's model and its decoding of those nodes. Compiled into libllama.
#include "zipmoe-rpc.h"
#include "zipmoe-llama-impl.h"

#include "zipmoe-integrity.h"

#include "ggml-cpp.h"
#include "gguf.h"
#include "llama-impl.h"
#include "llama.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

// RPC_CMD_ZIPMOE's reply (ggml-rpc sends 64 bytes): what the client checks before any of its layers goes to a server
struct zipmoe_rpc_record {
    uint64_t version;  // ZIPMOE_RPC_VERSION
    uint64_t digest;   // zipmoe_rpc_model_digest of the server's model
    char     name[48]; // its file's name, for the client's message
};
static_assert(sizeof(zipmoe_rpc_record) == 64, "ggml-rpc's RPC_CMD_ZIPMOE reply");

// An expert node's op parameters on the wire, in place of ggml_map_custom1's (function, n_tasks, userdata): the tag,
// the protocol version and the key, a hash of the weight's name (the node is named zipmoe-<weight>: both must agree)
constexpr int32_t ZIPMOE_RPC_TAG = 0x454f4d5a; // "ZMOE"

static uint64_t name_key(const char * name) {
    return zipmoe_checksum(name, std::strlen(name), 0);
}

uint64_t zipmoe_rpc_model_digest(const gguf_context * meta) {
    const int64_t kid = gguf_find_key(meta, ZIPMOE_INTEGRITY_KEY);
    if (kid < 0 || gguf_get_kv_type(meta, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(meta, kid) != GGUF_TYPE_UINT64) {
        return 0;
    }
    const uint64_t h = zipmoe_integrity_hash(gguf_get_arr_data(meta, kid), gguf_get_arr_n(meta, kid) * sizeof(uint64_t), 0);
    return h ? h : 1;
}

// ------------------------------------------------------------------------------------------------ client

// Never computed here: ggml-rpc's supports_op gives the node to its server (client_supports), which decodes it.
static void remote_op(ggml_tensor * dst, const ggml_tensor * ids, int ith, int nth, void * userdata) {
    (void) dst, (void) ids, (void) ith, (void) nth;
    GGML_ABORT("zipmoe: the expert node of %s ran on the client; only its RPC server can compute it",
               static_cast<zipmoe_llama_tensor *>(userdata)->tensor->name);
}

static const zipmoe_llama_tensor * remote_of(const ggml_tensor * node) {
    if (node->op != GGML_OP_MAP_CUSTOM1) {
        return nullptr;
    }
    const zipmoe_custom_op_params p = zipmoe_custom_op_params_of(node);
    return p.fun == reinterpret_cast<void *>(&remote_op) ? static_cast<const zipmoe_llama_tensor *>(p.userdata) : nullptr;
}

static void client_encode(const ggml_tensor * node, int32_t * op_params) {
    if (const zipmoe_llama_tensor * zt = remote_of(node)) {
        const uint64_t key = name_key(zt->tensor->name);
        std::memset(op_params, 0, GGML_MAX_OP_PARAMS);
        op_params[0] = ZIPMOE_RPC_TAG;
        op_params[1] = ZIPMOE_RPC_VERSION;
        std::memcpy(&op_params[2], &key, sizeof key);
    }
}

static bool client_supports(const char * endpoint, const ggml_tensor * node) {
    const zipmoe_llama_tensor * zt = remote_of(node);
    return zt && zt->remote == endpoint;
}

bool zipmoe_rpc_remote(ggml_backend_dev_t dev, uint64_t digest) {
    // (endpoint, digest) -> whether that server computes the experts of that file: a process may load several
    // models on the same servers, one after another
    static std::mutex                                        mu;
    static std::map<std::pair<std::string, uint64_t>, bool> verdicts;
    const std::string           endpoint = ggml_backend_dev_description(dev); // (an RPC device's is its server)
    std::lock_guard<std::mutex> lock(mu);
    if (const auto it = verdicts.find({ endpoint, digest }); it != verdicts.end()) {
        return it->second;
    }
    ggml_backend_reg_t reg  = ggml_backend_dev_backend_reg(dev);
    auto               info = (int (*)(const char *, void *, size_t)) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_zipmoe_info");
    zipmoe_rpc_record  rec{};
    const int          version = info ? info(endpoint.c_str(), &rec, sizeof rec) : 0; // 0: a stock server, or no model
    rec.name[sizeof rec.name - 1] = '\0';
    if (version != 0 && (version != ZIPMOE_RPC_VERSION || rec.version != ZIPMOE_RPC_VERSION)) {
        throw std::runtime_error(format("zipmoe: the RPC server %s speaks zipmoe's RPC protocol version %d, this "
            "program version %d: run the same zipmoe build on every machine", endpoint.c_str(), version, ZIPMOE_RPC_VERSION));
    }
    if (version != 0 && digest != 0 && rec.digest != digest) {
        throw std::runtime_error(format("zipmoe: the RPC server %s serves another zipmoe model (%s): its integrity "
            "record differs from this file's; start it with --zipmoe-model and a copy of this file", endpoint.c_str(), rec.name));
    }
    const bool remote = version != 0 && digest != 0;
    if (remote) {
        static const bool hooked = [reg] {
            auto set = (void (*)(void (*)(const ggml_tensor *, int32_t *), bool (*)(const char *, const ggml_tensor *)))
                ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_zipmoe_client");
            if (set) {
                set(client_encode, client_supports);
            }
            return set != nullptr;
        }();
        if (!hooked) {
            throw std::runtime_error("zipmoe: this program's ggml-rpc has no zipmoe hooks (patches/0008 not applied)");
        }
        LLAMA_LOG_INFO("%s: zipmoe: the RPC server %s computes the experts of its layers from its own copy of this "
            "model (%s), under its own memory budget\n", __func__, endpoint.c_str(), rec.name);
    }
    verdicts[{ endpoint, digest }] = remote;
    return remote;
}

ggml_backend_buffer_t zipmoe_rpc_place(ggml_tensor * t, ggml_backend_buffer_type_t buft, bool no_alloc) {
    ggml_backend_buffer_ptr buf(ggml_backend_buft_alloc_buffer(buft, no_alloc ? 0 : ggml_nbytes(t)));
    bool                    placed = buf != nullptr;
    if (placed && no_alloc) {
        t->buffer = buf.get();
    } else if (placed) {
        placed = ggml_backend_tensor_alloc(buf.get(), t, ggml_backend_buffer_get_base(buf.get())) == GGML_STATUS_SUCCESS;
    }
    if (!placed) {
        throw std::runtime_error(format("zipmoe: %s: cannot place it on %s", t->name,
                                        ggml_backend_dev_name(ggml_backend_buft_get_device(buft))));
    }
    ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    return buf.release();
}

ggml_tensor * zipmoe_rpc_mul_mat_id(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * w, ggml_tensor * x,
                                    ggml_tensor * ids) {
    ggml_tensor * r = ggml_map_custom1(ctx, ids, remote_op, GGML_N_TASKS_MAX, zt);
    ggml_format_name(r, "zipmoe-%s", w->name);
    return ggml_mul_mat_id(ctx, w, x, r);
}

// ------------------------------------------------------------------------------------------------ server

static zipmoe_rpc_record g_record;

static void server_info(void * out, size_t size) {
    std::memcpy(out, &g_record, std::min(size, sizeof g_record));
}

static bool server_fail(const std::string & msg) {
    const size_t skip = msg.compare(0, 8, "zipmoe: ") == 0 ? 8 : 0; // (a store's error names zipmoe already)
    std::fprintf(stderr, "zipmoe: error: %s; the client's connection is closed\n", msg.c_str() + skip);
    std::fflush(stderr);
    return false;
}

// The server's expert tensor of a node's name (and its key): found once by name, then by key; every graph carries
// each expert node again. The server's model stays loaded until the process ends, so what is found stays valid.
// Graphs are computed one at a time (ggml-rpc serves one client at a time).
static zipmoe_llama_tensor * served(uint64_t key, const char * name) {
    static std::unordered_map<uint64_t, zipmoe_llama_tensor *> by_key;
    const auto it = by_key.find(key);
    if (it != by_key.end() && std::strcmp(it->second->tensor->name, name) == 0) {
        return it->second;
    }
    zipmoe_llama_tensor * zt = zipmoe_llama_find_name(name);
    if (zt) {
        by_key[key] = zt;
    }
    return zt;
}

// A client's expert node decoded into this server's materialising op: its store, found by the node's name and key.
static zipmoe_llama_tensor * server_decode(ggml_tensor * node, std::string & err) {
    int32_t  version = node->op_params[1];
    uint64_t key     = 0;
    std::memcpy(&key, &node->op_params[2], sizeof key);
    const char * name = std::strncmp(node->name, "zipmoe-", 7) == 0 ? node->name + 7 : nullptr;
    zipmoe_llama_tensor * zt = name && version == ZIPMOE_RPC_VERSION && key == name_key(name) ? served(key, name) : nullptr;
    const ggml_tensor *   ids = node->src[0];
    // the routed ids (I32, [top-k, tokens]) in, where the store put them out: build_materialize's node
    const bool shaped = ids && ids->type == GGML_TYPE_I32 && node->type == GGML_TYPE_I32 && !node->src[1] &&
                        ggml_are_same_shape(ids, node) && ggml_is_contiguous(node);
    if (!zt || !shaped) {
        err = format("an expert node (%s) this server cannot compute: %s", node->name,
                     version != ZIPMOE_RPC_VERSION ? "another zipmoe RPC protocol version" : !name || key != name_key(name)
                     ? "its key does not match its name" : !zt ? "its model has no such expert tensor"
                     : "its routed ids are not an I32 tensor of its shape");
        return nullptr;
    }
    zipmoe_llama_set_materialize(node, zt);
    return zt;
}

static bool server_compute(ggml_backend_t backend, ggml_cgraph * gf) {
    std::unordered_map<const ggml_tensor *, zipmoe_llama_tensor *> decoded;
    std::string                                                    err;
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_MAP_CUSTOM1 && node->op_params[0] == ZIPMOE_RPC_TAG) {
            if (ggml_backend_dev_type(ggml_backend_get_device(backend)) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                return server_fail(format("expert nodes for %s, which cannot read zipmoe's expert memory (host "
                    "memory): serve them from the CPU device (-d CPU)", ggml_backend_name(backend)));
            }
            zipmoe_llama_tensor * zt = server_decode(node, err);
            if (!zt) {
                return server_fail(err);
            }
            decoded[node] = zt;
        } else if (node->op == GGML_OP_MUL_MAT_ID && decoded.count(node->src[2])) {
            // the matmul reads this server's expert memory, where the node decodes; the client's buffer for the
            // weight on this server is never written nor read
            ggml_tensor *       w    = node->src[0];
            const ggml_tensor * mine = decoded[node->src[2]]->tensor;
            if (w->type != mine->type || !ggml_are_same_shape(w, mine) || !ggml_are_same_stride(w, mine) ||
                    std::strcmp(w->name, mine->name) != 0) {
                return server_fail(format("the client's %s is not this server's %s (type or shape)", w->name, mine->name));
            }
            w->data   = mine->data;
            w->buffer = mine->buffer;
            w->extra  = mine->extra;
        }
    }
    std::string msg;
    bool        failed;
    {
        std::unique_lock<std::mutex> turn = zipmoe_llama_compute_turn(gf);
        failed = ggml_backend_graph_compute(backend, gf) != GGML_STATUS_SUCCESS;
        failed = zipmoe_llama_take_error(gf, msg) || failed;
    }
    return failed ? server_fail(msg.empty() ? std::string("the graph did not compute") : msg) : true;
}

// The server's log: llama.cpp's warnings and errors, and zipmoe's lines about its model
static void server_log(ggml_log_level level, const char * text, void * user) {
    (void) user;
    if (level == GGML_LOG_LEVEL_ERROR || level == GGML_LOG_LEVEL_WARN || std::strstr(text, "zipmoe")) {
        std::fputs(text, stderr);
    }
}

bool zipmoe_rpc_serve(const char * path) { // (the graphs compute on the server's device threads, its -t)
    if (FILE * f = std::fopen(path, "rb")) {
        std::fclose(f);
    } else {
        std::fprintf(stderr, "zipmoe: error: --zipmoe-model %s: %s\n", path, std::strerror(errno));
        return false;
    }
    gguf_init_params gp   = { /*no_alloc*/ true, /*ctx*/ nullptr };
    gguf_context *   meta = gguf_init_from_file(path, gp);
    const uint64_t   dig  = meta ? zipmoe_rpc_model_digest(meta) : 0;
    if (meta) {
        gguf_free(meta);
    }
    if (dig == 0) {
        std::fprintf(stderr, "zipmoe: error: --zipmoe-model %s: %s\n", path, meta ? "not a zipmoe GGUF (it has no "
            ZIPMOE_INTEGRITY_KEY " record): give the zipmoe GGUF the clients load" : "cannot be read as a GGUF");
        return false;
    }
    // not filled at load unless ZIPMOE_PREFILL says so: a server computes only the layers its clients place on it,
    // which it learns from their graphs; filling at load would decode every layer's experts (all of them, unbounded)
    setenv("ZIPMOE_PREFILL", "0", /*overwrite*/ 0);
    llama_log_set(server_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers       = 0; // its experts on this machine's CPU; the client uploads the rest of its layers
    static llama_model * model = llama_model_load_from_file(path, mp); // (served until the process ends)
    if (!model) {
        std::fprintf(stderr, "zipmoe: error: --zipmoe-model %s did not load (the lines above say why)\n", path);
        return false;
    }
    ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
    auto set = reg ? (void (*)(uint8_t, void (*)(void *, size_t), bool (*)(ggml_backend_t, ggml_cgraph *)))
                     ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_zipmoe_server") : nullptr;
    if (!set) {
        std::fprintf(stderr, "zipmoe: error: this ggml-rpc has no zipmoe hooks (patches/0008 not applied)\n");
        return false;
    }
    const char * base = std::strrchr(path, '/');
    g_record          = { ZIPMOE_RPC_VERSION, dig, {} };
    std::snprintf(g_record.name, sizeof g_record.name, "%s", base ? base + 1 : path);
    set(ZIPMOE_RPC_VERSION, server_info, server_compute);
    std::fprintf(stderr, "zipmoe: serving the experts of %s to clients that load the same file (zipmoe RPC "
        "protocol %d)\n", path, ZIPMOE_RPC_VERSION);
    return true;
}
