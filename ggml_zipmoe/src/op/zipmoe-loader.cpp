// zipmoe-loader.cpp - the expert tensors zipmoe serves, taken over from llama_model_loader (zipmoe-loader.h).
// docs/llama-integration.md tells the whole path; docs/FORMAT.md the companions and the integrity record.
#include "zipmoe-loader.h"

#include "zipmoe-cache.h"
#include "zipmoe-integrity.h"
#include "zipmoe-llama.h"
#include "zipmoe-llama-impl.h" // (zipmoe_llama_bind_remote)
#include "zipmoe-rpc.h"

#include "llama-impl.h"
#include "llama-model-loader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <set>
#include <stdexcept>

struct zipmoe_weight {
    zipmoe_llama_tensor_ptr handle;
    uint16_t      idx       = 0;       // file holding the data (a companion, or a plain GGUF's tensor)
    size_t        data_offs = 0;       // its absolute offset in that file
    ggml_tensor * tensor    = nullptr; // once created
};

struct zipmoe_loader {
    ggml_context_ptr ctx;              // the created tensors (their memory is the runtime's); outlives their stores
    std::map<std::string, zipmoe_weight> weights;
    std::string      fname;            // the stores open the model file themselves, whatever flags llama.cpp used
    bool             said_rpc = false; // the line that experts of layers on RPC devices stay on this machine
    uint64_t         digest   = 0;     // the file's identity for zipmoe RPC servers (zipmoe_rpc_model_digest)
    std::vector<ggml_backend_buffer_ptr> remote; // the weights' buffers on zipmoe RPC servers (never written)
};

static bool zipmoe_ends_with(const std::string & s, const std::string & sfx) {
    return s.size() > sfx.size() && s.compare(s.size() - sfx.size(), sfx.size(), sfx) == 0;
}

// Integrity (docs/FORMAT.md, "Integrity record"): before anything the metadata says is used, the metadata (every
// byte before the tensor data) and every tensor but the expert data companions (whose chunks are checked on every
// decode) must match the checksums the converter recorded. A damaged file is refused here, naming what is damaged,
// instead of loading and computing wrong logits. ZIPMOE_INTEGRITY=skip loads it unchecked, with a warning.
static void zipmoe_check_integrity(const gguf_context * meta, const std::string & fname, int file_fd) {
    zipmoe_runtime_config env; // (the ZIPMOE_* variables are read in one place)
    zipmoe_runtime_config_from_env(&env);
    if (!env.integrity) {
        LLAMA_LOG_WARN("%s: zipmoe: ZIPMOE_INTEGRITY=skip: the metadata and dense tensors are NOT checked\n", __func__);
        return;
    }
    const int64_t kid = gguf_find_key(meta, ZIPMOE_INTEGRITY_KEY);
    if (kid < 0) {
        throw std::runtime_error("zipmoe: the file has no " ZIPMOE_INTEGRITY_KEY " record (written by an older zipmoe), so "
            "its metadata and dense tensors cannot be checked: convert it again (zipmoe unpack, zipmoe convert), or set "
            "ZIPMOE_INTEGRITY=skip to load it unchecked");
    }
    if (gguf_get_kv_type(meta, kid) != GGUF_TYPE_ARRAY || gguf_get_arr_type(meta, kid) != GGUF_TYPE_UINT64 ||
        gguf_get_arr_n(meta, kid) == 0) {
        throw std::runtime_error("zipmoe: the " ZIPMOE_INTEGRITY_KEY " record is damaged (wrong type)");
    }
    std::vector<zipmoe_integrity_tensor> tensors(gguf_get_n_tensors(meta));
    uint64_t hashed = gguf_get_data_offset(meta);
    for (size_t i = 0; i < tensors.size(); i++) {
        tensors[i] = { gguf_get_tensor_name(meta, i), gguf_get_tensor_offset(meta, i), gguf_get_tensor_size(meta, i) };
    }
    // an fd of our own: the loader's may be opened for direct I/O, which needs aligned reads
    const int fd = fname.empty() ? -1 : open(fname.c_str(), O_RDONLY | O_CLOEXEC);
    const int64_t t0 = ggml_time_us();
    char msg[512];
    const int64_t rc = zipmoe_integrity_verify(fd >= 0 ? fd : file_fd, (const uint64_t *) gguf_get_arr_data(meta, kid),
        gguf_get_arr_n(meta, kid), gguf_get_data_offset(meta), tensors.data(), tensors.size(), msg, sizeof msg);
    if (fd >= 0) {
        close(fd);
    }
    if (rc < 0) {
        throw std::runtime_error(format("zipmoe: %s: %s", fname.empty() ? "the model file" : fname.c_str(), msg));
    }
    for (const auto & t : tensors) {
        hashed += zipmoe_ends_with(t.name, ".zipmoe_data") ? 0 : t.size;
    }
    LLAMA_LOG_INFO("%s: zipmoe: metadata and dense tensors match their checksums (%.1f MiB in %.1f ms)\n", __func__,
        hashed / (1024.0 * 1024.0), (ggml_time_us() - t0) / 1000.0);
}

// The expert tensors zipmoe.tensors (key k, an array of strings) lists: names of the expert pattern, each once.
static std::set<std::string> zipmoe_listed_tensors(const gguf_context * meta, int64_t k) {
    std::set<std::string> listed;
    for (size_t i = 0; i < gguf_get_arr_n(meta, k); i++) {
        const std::string name = gguf_get_arr_str(meta, k, i);
        if (!zipmoe_llama_expert_name(name)) {
            throw std::runtime_error(format("zipmoe: zipmoe.tensors lists %s, which is no expert tensor "
                "(blk.N.ffn_{up,gate,down,gate_up}_exps.weight)", name.c_str()));
        }
        if (!listed.insert(name).second) {
            throw std::runtime_error(format("zipmoe: zipmoe.tensors lists %s twice", name.c_str()));
        }
    }
    return listed;
}

// The bases (<base>.zipmoe_data) of the companions in the tensor list: each of a listed expert tensor, and every
// listed tensor with its companions.
static std::vector<std::string> zipmoe_companion_bases(const llama_model_loader & ml, const std::set<std::string> & listed) {
    static const std::string data_sfx = ".zipmoe_data", index_sfx = ".zipmoe_index";
    std::vector<std::string> bases;
    for (const auto & [name, w] : ml.weights_map) {
        for (const std::string * sfx : { &data_sfx, &index_sfx }) {
            if (zipmoe_ends_with(name, *sfx)) {
                const std::string base = name.substr(0, name.size() - sfx->size());
                if (listed.count(base + ".weight") == 0) {
                    throw std::runtime_error(format("zipmoe: %s is a companion of %s.weight, which zipmoe.tensors "
                        "does not list", name.c_str(), base.c_str()));
                }
                if (sfx == &data_sfx) {
                    bases.push_back(base);
                }
            }
        }
    }
    if (bases.size() != listed.size()) {
        throw std::runtime_error("zipmoe: a tensor listed in zipmoe.tensors has no companion tensors");
    }
    return bases;
}

// <base>.zipmoe_index, read from the file: the header first, which says how long the index must be, checked before
// the rest is read.
static std::vector<uint8_t> zipmoe_read_index(llama_model_loader & ml, const std::string & name,
                                              const llama_model_loader::llama_tensor_weight & wi, uint64_t data_size) {
    std::string err;
    std::vector<uint8_t> index(std::min<size_t>(ggml_nbytes(wi.tensor), zipmoe_llama_index_header_size()));
    ml.files.at(wi.idx)->seek(wi.offs, SEEK_SET);
    ml.files.at(wi.idx)->read_raw(index.data(), index.size());
    if (!zipmoe_llama_check_index_size(index.data(), index.size(), ggml_nbytes(wi.tensor), data_size, err)) {
        throw std::runtime_error(format("zipmoe: %s: %s", name.c_str(), err.c_str()));
    }
    const size_t head = index.size();
    index.resize(ggml_nbytes(wi.tensor));
    ml.files.at(wi.idx)->seek(wi.offs + head, SEEK_SET); // (a direct-I/O read ends aligned)
    ml.files.at(wi.idx)->read_raw(index.data() + head, index.size() - head);
    return index;
}

// A zipmoe GGUF: each BF16 expert tensor stored as <base>.zipmoe_data (I8) + <base>.zipmoe_index (I64) is listed in
// weights_map under its original name, type and shape; the companions leave the list.
static void zipmoe_index_weights(zipmoe_loader & zl, llama_model_loader & ml) {
    const gguf_context * meta = ml.metadata;
    const int64_t kid = gguf_find_key(meta, "zipmoe.version");
    // version 2: experts of F16 or a byte-layout type (F32, quantized blocks); the index names each tensor's type
    if (gguf_get_kv_type(meta, kid) != GGUF_TYPE_UINT32 || gguf_get_val_u32(meta, kid) < 1 ||
            gguf_get_val_u32(meta, kid) > 2) {
        throw std::runtime_error("zipmoe: unsupported zipmoe.version (this build reads versions 1 and 2)");
    }
    const uint32_t version = gguf_get_val_u32(meta, kid);
    // companions are taken only for the expert tensors zipmoe.tensors lists, with the file's codec and chunk size
    const int64_t k_tensors = gguf_find_key(meta, "zipmoe.tensors");
    const int64_t k_codec   = gguf_find_key(meta, "zipmoe.codec");
    const int64_t k_chunk   = gguf_find_key(meta, "zipmoe.chunk_size");
    if (k_tensors < 0 || gguf_get_kv_type(meta, k_tensors) != GGUF_TYPE_ARRAY ||
            gguf_get_arr_type(meta, k_tensors) != GGUF_TYPE_STRING || k_codec < 0 ||
            gguf_get_kv_type(meta, k_codec) != GGUF_TYPE_STRING || k_chunk < 0 ||
            gguf_get_kv_type(meta, k_chunk) != GGUF_TYPE_UINT32) {
        throw std::runtime_error("zipmoe: zipmoe.tensors, zipmoe.codec or zipmoe.chunk_size is missing or of the wrong type");
    }
    const std::set<std::string> listed     = zipmoe_listed_tensors(meta, k_tensors);
    const std::string           codec      = gguf_get_val_str(meta, k_codec);
    const uint32_t              chunk_size = gguf_get_val_u32(meta, k_chunk);
    const std::vector<std::string> bases = zipmoe_companion_bases(ml, listed);

    ggml_init_params params = { ggml_tensor_overhead()*(bases.size() + 1), nullptr, /*no_alloc*/ true };
    ggml_context * meta_ctx = ggml_init(params);
    ml.contexts.emplace_back(meta_ctx);

    for (const auto & base : bases) {
        const auto wd = ml.weights_map.find(base + ".zipmoe_data");
        const auto wi = ml.weights_map.find(base + ".zipmoe_index");
        const std::string name = base + ".weight";
        if (wi == ml.weights_map.end() || wi->second.tensor->type != GGML_TYPE_I64 ||
                wd->second.tensor->type != GGML_TYPE_I8) {
            throw std::runtime_error(format("zipmoe: %s: companion tensors missing or of the wrong type", name.c_str()));
        }
        const std::vector<uint8_t> index = zipmoe_read_index(ml, name, wi->second, ggml_nbytes(wd->second.tensor));
        std::string err;
        auto handle = zipmoe_llama_open(name.c_str(), index.data(), index.size(), ggml_nbytes(wd->second.tensor), err);
        if (!handle || !zipmoe_llama_check_meta(handle.get(), codec.c_str(), chunk_size, err)) {
            throw std::runtime_error(format("zipmoe: %s: %s", name.c_str(), err.c_str()));
        }
        // version 1 promises BF16 experts, which its readers take every expert for: other types are version 2's
        if (version == 1 && zipmoe_llama_type(handle.get()) != GGML_TYPE_BF16) {
            throw std::runtime_error(format("zipmoe: zipmoe.version 1 with a %s expert tensor (%s): such files are "
                "version 2; the metadata is damaged", ggml_type_name(zipmoe_llama_type(handle.get())), name.c_str()));
        }
        int64_t ne[4];
        zipmoe_llama_shape(handle.get(), ne);
        ggml_tensor * t = ggml_new_tensor_3d(meta_ctx, zipmoe_llama_type(handle.get()), ne[0], ne[1], ne[2]);
        ggml_set_name(t, name.c_str());

        // the runtime reads the compressed experts itself (budgeted, page cache dropped): llama's mapping must not
        // prefetch or keep them, which the lazy ranges see to
        ml.lazy.add_range(wd->second.idx, wd->second.offs, wd->second.offs + ggml_nbytes(wd->second.tensor));

        ml.n_elements += ggml_nelements(t) - ggml_nelements(wd->second.tensor) - ggml_nelements(wi->second.tensor);
        llama_model_loader::llama_tensor_weight w = wd->second;
        w.tensor = t;
        zl.weights.emplace(name, zipmoe_weight{ std::move(handle), wd->second.idx, wd->second.offs, nullptr });
        ml.weights_map.erase(wd);
        ml.weights_map.erase(wi);
        if (!ml.weights_map.emplace(name, w).second) {
            throw std::runtime_error(format("zipmoe: %s is stored twice", name.c_str()));
        }
    }
    if (auto it = ml.weights_map.find("zipmoe.source_header"); it != ml.weights_map.end()) {
        ml.lazy.add_range(it->second.idx, it->second.offs, it->second.offs + ggml_nbytes(it->second.tensor));
        ml.n_elements -= ggml_nelements(it->second.tensor);
        ml.weights_map.erase(it);
    }
    LLAMA_LOG_INFO("%s: zipmoe: %zu expert tensors are stored compressed; experts are decoded when routed to\n",
        __func__, zl.weights.size());
}

// A plain GGUF under a memory budget: its expert tensors, of whatever type, are served from zipmoe's cache as they lie
// in the file (whole experts read when routed to, kept within the budget); everything else loads as without one.
static void zipmoe_plain_weights(zipmoe_loader & zl, llama_model_loader & ml) {
    for (const auto & [name, w] : ml.weights_map) {
        if (!zipmoe_llama_expert_name(name)) {
            continue;
        }
        if (ml.files.size() != 1) {
            throw std::runtime_error("zipmoe: a memory budget serves the experts of a GGUF in one file; this one has "
                "splits (merge them with llama-gguf-split --merge, or load it without a budget)");
        }
        std::string err;
        auto handle = zipmoe_llama_open_raw(name.c_str(), w.tensor, err);
        if (!handle) {
            throw std::runtime_error(format("zipmoe: %s: %s", name.c_str(), err.c_str()));
        }
        ml.lazy.add_range(w.idx, w.offs, w.offs + ggml_nbytes(w.tensor)); // read by the cache, not through the mapping
        zl.weights.emplace(name, zipmoe_weight{ std::move(handle), w.idx, w.offs, nullptr });
    }
    if (zl.weights.empty()) {
        LLAMA_LOG_WARN("%s: zipmoe: the memory budget applies to the expert tensors of MoE models; this model has "
            "none, so it loads as without a budget\n", __func__);
        return;
    }
    LLAMA_LOG_INFO("%s: zipmoe: %zu expert tensors are served from the cache as stored in the file (plain GGUF "
        "under a memory budget)\n", __func__, zl.weights.size());
}

// The memory budget covers the other weights too: the runtime needs their size to check and share it.
static void zipmoe_configure_budget(const zipmoe_loader & zl, llama_model_loader & ml, llama_load_mode load_mode) {
    uint64_t other_bytes = 0;
    for (const auto & [name, w] : ml.weights_map) {
        if (zl.weights.find(name) == zl.weights.end()) {
            other_bytes += ggml_nbytes(w.tensor);
        }
    }
    // with an output matrix of its own, the token embedding is only read a row per token (get_rows). Mapped, the
    // budget charges the rows it reads and the mapping does not prefetch the rest. Copied into a buffer (no mmap,
    // or a device without mmap support, which turns AUTO's mmap off in load_tensors) or locked: charged whole.
    bool embd_mapped = load_mode == LLAMA_LOAD_MODE_MMAP || load_mode == LLAMA_LOAD_MODE_AUTO;
    for (size_t i = 0; embd_mapped && load_mode == LLAMA_LOAD_MODE_AUTO && i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_props props;
        ggml_backend_dev_get_props(ggml_backend_dev_get(i), &props);
        embd_mapped = props.caps.mmap_support;
    }
    uint64_t embd_bytes = 0, embd_row_bytes = 0;
    if (const auto te = ml.weights_map.find("token_embd.weight");
            embd_mapped && te != ml.weights_map.end() && ml.weights_map.count("output.weight") > 0) {
        embd_bytes     = ggml_nbytes(te->second.tensor);
        embd_row_bytes = ggml_row_size(te->second.tensor->type, te->second.tensor->ne[0]);
        ml.lazy.add_range(te->second.idx, te->second.offs, te->second.offs + embd_bytes);
    }
    std::string info, err;
    if (!zipmoe_llama_configure(other_bytes, embd_bytes, embd_row_bytes, info, err)) {
        throw std::runtime_error("zipmoe: " + err);
    }
    // a budget's line at llama.cpp's default verbosity, which shows a library's warnings but not its info (and the
    // memory-fit pass's warnings only with -v: said once)
    if (zipmoe_llama_plain_budget()) {
        LLAMA_LOG_WARN("%s: %s\n", __func__, info.c_str());
    } else {
        LLAMA_LOG_INFO("%s: %s\n", __func__, info.c_str());
    }
}

std::shared_ptr<zipmoe_loader> zipmoe_loader_init(llama_model_loader & ml, const std::string & fname,
                                                  llama_load_mode load_mode) {
    const bool zipmoe_file = gguf_find_key(ml.metadata, "zipmoe.version") >= 0;
    if (ml.files.empty() || (!zipmoe_file && !zipmoe_llama_plain_budget())) {
        return nullptr;
    }
    auto zl = std::make_shared<zipmoe_loader>();
    zl->fname = fname;
    if (zipmoe_file) {
        if (ml.files.size() != 1) {
            throw std::runtime_error("zipmoe: a zipmoe GGUF is one file; this one has splits, which its integrity record does not cover");
        }
        zipmoe_check_integrity(ml.metadata, fname, ml.files[0]->file_id());
        zl->digest = zipmoe_rpc_model_digest(ml.metadata);
        zipmoe_index_weights(*zl, ml);
    } else {
        zipmoe_plain_weights(*zl, ml);
        if (zl->weights.empty()) {
            return nullptr;
        }
    }
    zipmoe_configure_budget(*zl, ml, load_mode);
    return zl;
}

ggml_tensor * zipmoe_loader_create_tensor(zipmoe_loader & zl, llama_model_loader & ml, const std::string & name,
                                          const ggml_tensor & t_meta, ggml_backend_buffer_type_t buft) {
    const auto it = zl.weights.find(name);
    if (it == zl.weights.end()) {
        return nullptr;
    }
    zipmoe_weight & zw = it->second;
    if (!zl.ctx) {
        ggml_init_params params = { ggml_tensor_overhead()*zl.weights.size(), nullptr, /*no_alloc*/ true };
        zl.ctx.reset(ggml_init(params));
    }
    ggml_tensor * t = ggml_dup_tensor(zl.ctx.get(), &t_meta);
    ggml_set_name(t, ggml_get_name(&t_meta));
    // A layer placed on an RPC device (--rpc). A zipmoe server with this file computes its experts from its own copy
    // (zipmoe-rpc.h): the weight gets a buffer there that nothing writes (the server's matmul reads its own cache)
    // and no store here. A stock rpc-server cannot run zipmoe's expert ops (their parameters are this process's
    // pointers) nor read its cache, so the layer's experts stay in this process's memory and the expert matmuls run
    // on its CPU (ggml-rpc does not take zipmoe's ops, patches/0008); the rest of the layer runs on the server. The
    // RPC backend never offloads an op to itself, so nothing copies the expert memory.
    ggml_backend_dev_t dev = buft ? ggml_backend_buft_get_device(buft) : nullptr;
    const bool rpc = dev && std::strncmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC", 3) == 0;
    if (rpc && zipmoe_rpc_remote(dev, zl.digest)) {
        zl.remote.emplace_back(zipmoe_rpc_place(t, buft, ml.no_alloc));
        zipmoe_llama_bind_remote(zw.handle.get(), t, ggml_backend_dev_description(dev));
    } else if (rpc) {
        if (!ml.no_alloc && !zl.said_rpc) {
            LLAMA_LOG_INFO("%s: zipmoe: experts of layers on RPC devices (%s, ...) stay on this machine: their "
                "matmuls run on its CPU, under its memory budget; the rest of those layers runs on the servers\n",
                __func__, ggml_backend_dev_name(dev));
            zl.said_rpc = true;
        }
        buft = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
    }
    std::string err;
    const int fd = ml.no_alloc ? -1 : ml.files.at(zw.idx)->file_id();
    if (zw.handle->remote.empty() &&
            !zipmoe_llama_bind(zw.handle.get(), t, buft, ml.no_alloc, zl.fname.c_str(), fd, zw.data_offs, err)) {
        throw std::runtime_error(format("zipmoe: %s: %s", t->name, err.c_str()));
    }
    zw.tensor = t;
    ml.n_created++;
    ml.size_data -= ggml_nbytes(t); // load_all_data never loads it; init_mappings counts it in
    return t;
}

void zipmoe_loader_list(zipmoe_loader & zl, std::vector<std::pair<std::string, ggml_tensor *>> & tensors_by_name) {
    for (ggml_tensor * t = zl.ctx ? ggml_get_first_tensor(zl.ctx.get()) : nullptr; t; t = ggml_get_next_tensor(zl.ctx.get(), t)) {
        tensors_by_name.emplace_back(ggml_get_name(t), t); // (in the order they were created, as any weight)
    }
    for (auto it = zl.weights.begin(); it != zl.weights.end();) {
        it = it->second.tensor ? std::next(it) : zl.weights.erase(it); // not created (a layer the model skips): no store
    }
}
