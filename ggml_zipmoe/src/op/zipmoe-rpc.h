// zipmoe-rpc.h - a zipmoe model split across llama.cpp's RPC servers, each zipmoe-aware server computing the experts
// of the layers placed on it from its own copy of the model (docs/rpc.md). ggml-rpc (patches/0008) has hooks for
// it; this file is their other side: the client's in libllama (zipmoe-rpc.cpp), the server's flags in
// ggml-rpc-server (zipmoe-rpc-server.cpp, patches/0009).
//
// The protocol: a server started with --zipmoe-model announces ZIPMOE_RPC_VERSION in HELLO and answers
// RPC_CMD_ZIPMOE with its model's record (the version, the digest of the file's zipmoe.integrity record, the file's
// name). A client whose model has the same digest builds, for each expert tensor of a layer on that server, a
// node that names the tensor (a tag and a key in its op parameters instead of this process's pointers); the server
// decodes it into its own materialising op and store, and points the matmul's weight at its own expert memory.
// So expert bytes never cross the network, at load or per token.
#pragma once

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <string>

struct gguf_context;
struct zipmoe_llama_tensor;

constexpr uint8_t ZIPMOE_RPC_VERSION = 1;

// A zipmoe GGUF's identity across machines: a hash of its zipmoe.integrity record; 0 for a file without one (a
// plain GGUF).
uint64_t zipmoe_rpc_model_digest(const gguf_context * meta);

// Client, for an expert tensor on RPC device dev (asked once per server): true where that server is zipmoe-aware
// with the same model (digest), which then computes the tensor's experts; false for a stock server or one without
// a model (the experts stay on this machine, patches/0008's fallback; one log line per server). Throws
// std::runtime_error, one line, for a server of another model or another zipmoe protocol version.
bool zipmoe_rpc_remote(ggml_backend_dev_t dev, uint64_t digest);

// Client: t's buffer on that server (buft: its device's), which nothing writes: the server's matmul reads its own
// expert memory; with no_alloc (llama.cpp's fit pass) a buffer of size 0, as llama.cpp gives its weights then.
// Throws std::runtime_error if the server cannot allocate it.
ggml_backend_buffer_t zipmoe_rpc_place(ggml_tensor * t, ggml_backend_buffer_type_t buft, bool no_alloc);

// Client: ggml_mul_mat_id(w, x, ids) for a weight whose experts a server computes (zipmoe_llama_bind_remote): the
// routed ids pass a node that server decodes into its own materialising op.
ggml_tensor * zipmoe_rpc_mul_mat_id(ggml_context * ctx, zipmoe_llama_tensor * zt, ggml_tensor * w, ggml_tensor * x,
                                    ggml_tensor * ids);

// Server: loads the zipmoe GGUF at path (its experts under the memory budget the ZIPMOE_* environment sets) and
// installs the server's hooks in ggml-rpc. False, with one line on stderr (`zipmoe: error: ...`), if it cannot.
bool zipmoe_rpc_serve(const char * path);

// ggml-rpc-server's flags (zipmoe-rpc-server.cpp): whether flag is --zipmoe-model or one of the cache's flags
// (--memory-budget, ...: common_zipmoe_is_flag); set one (false, with one line, if its value is empty); their
// lines for --help; and, once parsed, load the model if --zipmoe-model named one (false: exit 1).
bool        zipmoe_rpc_server_flag(const std::string & flag);
bool        zipmoe_rpc_server_set(const std::string & flag, const char * value);
std::string zipmoe_rpc_server_usage();
bool        zipmoe_rpc_server_start();
