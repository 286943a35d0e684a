// zipmoe-loader.h - what llama.cpp's model loader and model call (patches/0001, 0002): the expert tensors that
// zipmoe serves, taken over from llama_model_loader's tensor list. Compiled into libllama with the loader's own
// headers, so the hooks in llama.cpp stay a few lines each and the logic lives here.
#pragma once

#include "llama.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

struct ggml_tensor;
struct llama_model_loader;
struct zipmoe_loader; // a model's expert tensors served by zipmoe (their stores, their ggml context)

// Once the loader knows the file's tensors and architecture: for a zipmoe GGUF, checks its integrity record and
// lists each compressed expert tensor under its original name and shape in ml.weights_map, so that every check of
// the loader applies unchanged; for a plain MoE GGUF under a memory budget (ZIPMOE_MEMORY_BUDGET), takes over its
// expert tensors as they lie in the file. Then configures the budget, which covers the other weights too.
// nullptr where zipmoe has nothing to do (a plain GGUF without a budget loads exactly as in stock llama.cpp).
// Throws std::runtime_error with a message for the user.
std::shared_ptr<zipmoe_loader> zipmoe_loader_init(llama_model_loader & ml, const std::string & fname,
                                                  llama_load_mode load_mode);

// create_tensor's hook: the tensor of an expert weight that zipmoe serves, in memory the runtime owns (never in a
// llama.cpp buffer, so nothing of llama.cpp loads it), or nullptr for any other weight. buft: the buffer type
// llama.cpp chose (its layout, where the CPU backend repacks the type).
ggml_tensor * zipmoe_loader_create_tensor(zipmoe_loader & zl, llama_model_loader & ml, const std::string & name,
                                          const ggml_tensor & t_meta, ggml_backend_buffer_type_t buft);

// The model's hook once its tensors are created: lists zipmoe's tensors with the model's (the graph's node budget
// and LoRA lookups count on tensors_by_name) and drops the stores of tensors the model did not create.
void zipmoe_loader_list(zipmoe_loader & zl, std::vector<std::pair<std::string, ggml_tensor *>> & tensors_by_name);
