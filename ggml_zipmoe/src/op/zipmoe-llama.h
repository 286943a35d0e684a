// zipmoe-llama.h - the glue between llama.cpp and zipmoe's expert stores. Compiled into libllama by
// zipmoe's CMake; the patches in patches/ call these functions and nothing else of zipmoe.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

struct zipmoe_llama_tensor; // one compressed expert tensor: its store and its ggml buffer

struct zipmoe_llama_tensor_deleter {
    void operator()(zipmoe_llama_tensor * zt) const;
};
using zipmoe_llama_tensor_ptr = std::unique_ptr<zipmoe_llama_tensor, zipmoe_llama_tensor_deleter>;

// Validates <base>.zipmoe_index (index bytes) for a data companion of data_size bytes.
zipmoe_llama_tensor_ptr zipmoe_llama_open(const char * name, const void * index, size_t index_size,
                                          uint64_t data_size, std::string & err);

// A plain GGUF's expert tensor (meta: its type and shape as the file has them), served from the cache as it lies in
// the file: whole experts read around the page cache into the places ggml_mul_mat_id reads (sizes by
// ggml_row_size, so any type the CPU backend computes), kept in the hot tier only. Bound like a compressed one
// (zipmoe_llama_bind, data_offs: the tensor's offset in the file).
zipmoe_llama_tensor_ptr zipmoe_llama_open_raw(const char * name, const ggml_tensor * meta, std::string & err);

// Whether a memory budget is set (ZIPMOE_MEMORY_BUDGET): only then does the loader serve a plain GGUF's experts from
// the cache; without one a plain GGUF loads exactly as in stock llama.cpp.
bool zipmoe_llama_plain_budget();

// Whether name is an expert tensor's (blk.N.ffn_{up,gate,down,gate_up}_exps.weight): the only names whose
// companions the loader takes.
bool zipmoe_llama_expert_name(const std::string & name);

// How many bytes of an index the loader reads first (its header), and the check of that header: the whole index
// (index_size bytes in the file) must be exactly as long as the header says, for a data companion of data_size.
size_t zipmoe_llama_index_header_size();
bool   zipmoe_llama_check_index_size(const void * header, size_t header_size, uint64_t index_size, uint64_t data_size,
                                     std::string & err);

// The index agrees with the file's metadata: zipmoe.codec (huff, esc, zstd; raw: no split tensors) and
// zipmoe.chunk_size, which apply to split tensors (BF16, F16); a byte-layout tensor's codec is raw.
bool zipmoe_llama_check_meta(const zipmoe_llama_tensor * zt, const char * codec, uint32_t chunk_size,
                             std::string & err);

// After the model's compressed tensors are opened: configures the cache from the environment
// (ZIPMOE_MEMORY_BUDGET, ZIPMOE_HOT_SHARE, ZIPMOE_SM_SHARE, ZIPMOE_PLAN, ZIPMOE_CACHE_POLICY, ZIPMOE_CACHE;
// zipmoe_runtime_config in zipmoe-cache.h lists them; zipmoe-config.cpp). other_bytes: the model's weights that
// are not compressed experts, which the budget covers too; embd_bytes of them (row size embd_row_bytes) a token
// embedding that is only read a row per token through the mapping (0 if none), charged for the rows of a batch.
// False, with a message saying the minimum, if the budget cannot hold them and one expert tensor's experts;
// info: a line for the log.
bool zipmoe_llama_configure(uint64_t other_bytes, uint64_t embd_bytes, uint64_t embd_row_bytes, std::string & info,
                            std::string & err);

// The original tensor's shape, from the index.
void zipmoe_llama_shape(const zipmoe_llama_tensor * zt, int64_t ne[4]);

// The original tensor's type, from the index (BF16, F16 or a byte-layout type of a zipmoe.version 2 file).
ggml_type zipmoe_llama_type(const zipmoe_llama_tensor * zt);

// Gives t (BF16, the original shape; a raw store's: its type) its memory: a reservation that holds only materialised experts,
// wrapped in a CPU buffer; the data companion at data_offs of the model file is read from when experts are decoded.
// The store reads through a descriptor of its own, opened from path (plain; O_DIRECT by its own choice), never
// llama.cpp's, whose flags depend on the load mode; fd (llama.cpp's) only proves that path is the same file. With
// no_alloc (llama.cpp's memory-fit pass) t gets a zero-size buffer and nothing is reserved. buft: the buffer type
// llama.cpp chose for the weight; where it is the CPU backend's repack type (some quantized types), a raw store's
// experts are repacked as they are put into their places, so the matmul computes as llama.cpp's would.
bool zipmoe_llama_bind(zipmoe_llama_tensor * zt, ggml_tensor * t, ggml_backend_buffer_type_t buft, bool no_alloc,
                       const char * path, int fd, uint64_t data_offs, std::string & err);

// The zipmoe tensor behind weight w, or nullptr (every tensor of a plain GGUF).
zipmoe_llama_tensor * zipmoe_llama_find(const ggml_tensor * w);

// ggml_mul_mat_id(w, x, ids) for a zipmoe-backed weight w: the experts ids names are materialised first, and the
// matmul reads them where they lie (under a budget, not always at their own index). In generation and for short
// batches (up to 64 routed slots) one node does both, computing the rows of the experts decoded already while the
// others are read. During warmup
// (which routes every token to every expert) nothing is decoded: plain ggml_mul_mat_id.
ggml_tensor * zipmoe_llama_mul_mat_id(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * w, ggml_tensor * x,
                                      ggml_tensor * ids, bool warmup);

// Held while graph gf computes, if it has zipmoe experts: such graphs compute one at a time in a process. A
// store's plan evicts what other stores decoded beyond their limits (and decodes over their places), which is
// safe only once their matmuls ran: true within a graph (check_graph_order), not across two computing at once.
std::unique_lock<std::mutex> zipmoe_llama_compute_turn(const ggml_cgraph * gf);

// The first decoding error of the zipmoe ops of graph gf since its last compute (a damaged chunk, say);
// false if none.
bool zipmoe_llama_take_error(const ggml_cgraph * gf, std::string & msg);
