// zipmoe-config.h - the cache's configuration for a model being loaded (zipmoe-config.cpp), for zipmoe-llama.cpp.
#pragma once

#include "zipmoe-cache.h"

#include <cstdint>
#include <string>
#include <vector>

// Configures the cache for the stores of the model being loaded (their sizes; warm_fast: every one's warm hits
// decode fast; raw: they are a plain GGUF's experts, which only the hot tier keeps) from env: what zipmoe_llama_configure says (zipmoe-llama.h), past its bookkeeping. False, with a
// message in err, if a setting is malformed or the budget cannot hold the model's minimum; info: a line for the log.
bool zipmoe_llama_configure_cache(const zipmoe_runtime_config & env, const std::vector<zipmoe_store_size> & stores,
                                  bool warm_fast, bool raw, uint64_t other_bytes, uint64_t embd_bytes, uint64_t embd_row_bytes,
                                  std::string & info, std::string & err);

// ZIPMOE_PRIOR: seeds the stores of the model being loaded from the prior file at path (zipmoe_cache_seed_prior).
// False, with a message in err, if the file cannot be read, is damaged or is another model's.
bool zipmoe_llama_apply_prior(const char * path, const std::vector<zipmoe_store *> & stores, std::string & err);
