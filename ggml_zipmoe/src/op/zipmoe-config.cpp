// zipmoe-config.cpp - the cache's configuration for a model llama.cpp loads: the memory budget from the
// environment, checked against the model's minimum and split between the cache tiers (or a planner's slots), and
// the cache's other settings. Called by zipmoe_llama_configure once the model's compressed tensors are opened.
#include "zipmoe-config.h"
#include "zipmoe-control.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

// ZIPMOE_MEMORY_BUDGET: a size or a percentage of physical memory (zipmoe_parse_budget); false if malformed.
static bool parse_budget(const char * text, uint64_t & out) {
    const uint64_t physical = (uint64_t) sysconf(_SC_PHYS_PAGES) * (uint64_t) sysconf(_SC_PAGESIZE);
    return zipmoe_parse_budget(text, std::min<uint64_t>(physical, ZIPMOE_SIZE_MAX), &out) == ZIPMOE_OK;
}

// ZIPMOE_MEMORY_BUDGET=auto: what this process could allocate now plus what the runtime holds already, less a
// margin, at most the whole model (zipmoe_auto_budget; pyzipmoe's parse_budget and memory monitor compute the same).
static bool auto_budget(const zipmoe_budget_need & need, uint64_t & out, std::string & err) {
    zipmoe_memory_reading reading{};
    if (zipmoe_memory_read(nullptr, nullptr, nullptr, &reading) != ZIPMOE_OK) {
        err = "memory budget auto: /proc/meminfo cannot be read, so the memory available is unknown; give the budget "
              "as a size (e.g. 6GiB)";
        return false;
    }
    zipmoe_stats s{}; // what the runtime holds already, as pyzipmoe's model_budget counts it
    zipmoe_stats_get(&s);
    const uint64_t held  = s.hot_bytes + s.warm_bytes + s.sm_bytes + s.decoding_bytes + s.pool_bytes +
                           s.staging_transient_bytes;
    const uint64_t whole = need.minimum + need.experts; // (each below ZIPMOE_SIZE_MAX: no overflow)
    out                  = zipmoe_auto_budget(&reading, whole, held);
    return true;
}

// Bytes as every size zipmoe prints is written ("3.1 MiB", "512 B": zipmoe_size_text).
static std::string size_text(uint64_t bytes) {
    char buf[32];
    zipmoe_size_text(bytes, buf, sizeof buf);
    return buf;
}

static bool parse_fraction(const char * name, const char * v, double & out, std::string & err) {
    if (!v) {
        return true;
    }
    char * end = nullptr;
    out        = std::strtod(v, &end);
    if (*end || !(out >= 0 && out <= 1)) {
        err = std::string(name) + "=" + v + " is not a fraction between 0 and 1";
        return false;
    }
    return true;
}

// ZIPMOE_PLAN: a planner's slots per layer (zipmoe_plan_parse reads them), at most ZIPMOE_MAX_SLOT_RULES layers.
static bool apply_plan(const char * plan, std::string & err) {
    zipmoe_cache_set_slots(nullptr, 0, 0, 0);
    const int64_t rc = zipmoe_plan_parse(plan, [](void *, int32_t layer, int64_t hot, int64_t warm, int64_t sm) {
        return zipmoe_cache_set_slots(("blk." + std::to_string(layer) + ".").c_str(), hot, warm, sm);
    }, nullptr);
    if (rc != ZIPMOE_OK) {
        zipmoe_cache_set_slots(nullptr, 0, 0, 0);
        err = std::string("ZIPMOE_PLAN=") + plan + zipmoe_plan_problem(rc);
        return false;
    }
    return true;
}

// The load line's word on the budget's changes: a plain GGUF's stays fixed (nothing supervises it, whoever ran it).
static std::string control_note(bool raw) {
    const std::string note = zipmoe_control_load_note(); // (opens a supervisor's channel, if any)
    return raw ? "; the budget is fixed for this run (a plain GGUF's: it does not adapt to the memory available)" : note;
}

// The cache's configuration for a model being loaded, from the environment (env) and the model's stores: the
// budget split between the tiers, or a planner's slots, and the cache's settings (zipmoe-config.h).
bool zipmoe_llama_configure_cache(const zipmoe_runtime_config & env, const std::vector<zipmoe_store_size> & stores,
                                  bool warm_fast, bool raw, uint64_t other_bytes, uint64_t embd_bytes, uint64_t embd_row_bytes,
                                  std::string & info, std::string & err) {
    zipmoe_budget_need need{};
    if (zipmoe_budget_need_of(stores.data(), stores.size(), other_bytes, embd_bytes, embd_row_bytes,
                              (uint64_t) sysconf(_SC_PAGESIZE), &need) != ZIPMOE_OK) {
        err = "the model's sizes do not add up (its token embedding is larger than its weights that are not experts)";
        return false;
    }
    other_bytes                 = need.other;
    const uint64_t embd_charged = need.embd_charged;
    const std::string embd_note = embd_charged < embd_bytes ? " (token_embd: the rows of a batch, " + size_text(embd_charged) +
                                                                  " of " + size_text(embd_bytes) + ")"
                                                            : "";
    // a store's routed experts stay decoded until the next store plans (its matmul ran by then): the working set
    // beyond the tiers is the largest expert tensor's, all of whose experts a prompt may route to
    const uint64_t working_set = need.in_flight, experts = need.experts;
    uint64_t      hot = UINT64_MAX, warm = 0, sm = 0, in_flight = working_set, reads = UINT64_MAX, token_hot = 0;
    uint64_t      tiers = UINT64_MAX; // what a budget leaves beyond its minimum
    zipmoe_policy policy = ZIPMOE_POLICY_DEFAULT;
    if (const char * v = env.memory_budget) {
        uint64_t   budget    = 0;
        const bool automatic = zipmoe_budget_is_auto(v);
        if (automatic ? !auto_budget(need, budget, err) : !parse_budget(v, budget)) {
            if (!automatic) {
                err = std::string("ZIPMOE_MEMORY_BUDGET=") + v + " is not a size (e.g. 6GiB, 512MiB, 60% or auto)";
            }
            return false;
        }
        // the budget as its user wrote it: a size rounded to MiB could read "0 MiB"
        const std::string said = std::string(v) + (automatic ? " (" + size_text(budget) + " free, less a margin)" : "");
        std::vector<char> refusal(said.size() + 512);
        if (zipmoe_budget_check(budget, &need, embd_bytes, said.c_str(), refusal.data(), refusal.size()) != ZIPMOE_OK) {
            err = std::string(refusal.data()) + " (ZIPMOE_MEMORY_BUDGET)";
            return false;
        }
        tiers            = budget - need.minimum;
        double sm_share = 0;
        if (!parse_fraction("ZIPMOE_SM_SHARE", env.sm_share, sm_share, err)) {
            return false;
        }
        double hot_share = zipmoe_budget_default_hot_share(stores.data(), stores.size(), tiers, warm_fast, sm_share);
        if (!parse_fraction("ZIPMOE_HOT_SHARE", env.hot_share, hot_share, err)) {
            return false;
        }
        if (hot_share + sm_share > 1 + 1e-9) {
            err = "ZIPMOE_HOT_SHARE + ZIPMOE_SM_SHARE is more than 1";
            return false;
        }
        std::string raw_note;
        if (raw) { // a raw expert's compressed copy would be its bytes again: every byte of the tiers is decoded
            if (env.hot_share || env.sm_share) {
                raw_note = " (ZIPMOE_HOT_SHARE and ZIPMOE_SM_SHARE do not apply to a plain GGUF's experts)";
            }
            hot_share = 1;
            sm_share  = 0;
        }
        zipmoe_budget_split split{};
        if (zipmoe_budget_split_tiers(stores.data(), stores.size(), tiers, hot_share, sm_share, &split) < 0) {
            err = "the memory budget could not be split between the cache tiers";
            return false;
        }
        hot       = split.hot;
        warm      = split.warm;
        sm        = split.sm;
        in_flight = split.in_flight;
        reads     = split.reads ? split.reads : UINT64_MAX; // (none left: as zipmoe_cache_apply_split)
        token_hot = split.token_hot;
        info = "zipmoe: memory budget " + size_text(budget) +
               (automatic ? " (auto: the memory available less a margin, at most the whole model)" : "") + ": " + size_text(other_bytes) + " weights that are not experts" +
               embd_note + ", " + size_text(in_flight) + " for one expert tensor in flight beyond its decoded experts, " +
               (split.reads ? size_text(split.reads) + " for a prompt's reads, " : std::string()) +
               "cache tiers " + size_text(hot) + " decoded, " + size_text(warm) + " compressed, " + size_text(sm) +
               " sign+mantissa (experts " + size_text(experts) + (raw ? " as stored, read from the plain GGUF" : " in BF16") +
               ")" + raw_note + control_note(raw);
    } else {
        info = "zipmoe: no memory budget: decoded experts are kept (set ZIPMOE_MEMORY_BUDGET or --memory-budget)";
    }
    if (const char * v = env.cache_policy; v && zipmoe_policy_parse(v, &policy) != ZIPMOE_OK) {
        char names[64];
        zipmoe_policy_names(names, sizeof names);
        err = std::string("ZIPMOE_CACHE_POLICY=") + v + " is not a policy (" + names + ")";
        return false;
    }
    if (const char * v = env.direct_io) {
        if (std::strcmp(v, "0") != 0 && std::strcmp(v, "1") != 0) {
            err = std::string("ZIPMOE_DIRECT_IO=") + v + " is not 0 or 1";
            return false;
        }
        zipmoe_cache_set_direct_io(std::strcmp(v, "1") == 0);
    } else {
        zipmoe_cache_set_direct_io(1);
    }
    uint64_t read_buffer = 16ull << 20;
    if (const char * v = env.read_buffer; v && (zipmoe_parse_size(v, &read_buffer) != ZIPMOE_OK || read_buffer == 0)) {
        err = std::string("ZIPMOE_READ_BUFFER=") + v + " is not a size (e.g. 16MiB)";
        return false;
    }
    zipmoe_cache_set_read_buffer(read_buffer);
    if (const char * v = env.cache) {
        if (std::strcmp(v, "none") == 0) {
            hot = 0;
        } else if (std::strcmp(v, "unbounded") != 0) {
            err = std::string("ZIPMOE_CACHE=") + v + " is not a cache mode (use unbounded or none)";
            return false;
        }
    }
    const char * plan = env.plan;
    if (plan) {
        if (!apply_plan(plan, err)) {
            return false;
        }
        info += "; slots per layer from ZIPMOE_PLAN";
        // a prompt's read buffers get what the plan's slots leave of the tiers (plan_tiers leaves them room)
        const uint64_t slots = zipmoe_cache_rules_bytes();
        reads                = tiers == UINT64_MAX ? UINT64_MAX : tiers > slots ? tiers - slots : 0;
        // a plan leaves the whole allowance for the tensor in flight beside its slots (the planner credits none of
        // it): evicted experts' pages are kept within it. Without that, a budget whose shares credit the
        // allowance to the hot tier (all of it from the model's size up) had every decode fault in zeroed pages:
        // 2x the time of a decode-bound plan (docs/cache-and-planner.md)
        in_flight = working_set;
    }
    // generation's hot tier also holds the allowance and the read room (a prompt's first store evicts them again:
    // zipmoe_cache_begin_graph); not decoding on every use, nor with a plan, whose slots run as planned (the
    // calibration and the benchmarks measure them; pyzipmoe's memory monitor gives a run's plans that room)
    const bool token_tier = token_hot > 0 && hot > 0 && !plan;
    zipmoe_cache_params params{};
    params.hot        = hot;
    params.warm       = warm;
    params.sm         = sm;
    params.token_hot  = token_tier ? token_hot : 0;
    // evicted experts' memory is kept, within the allowance for the tensor in flight, for the next decodes
    params.reserve    = hot == 0 ? working_set : in_flight;
    // a prompt's read buffers stay within the room the split left them (beyond it they are rings)
    params.read_room  = reads;
    params.policy     = policy;
    params.keep_slots = plan != nullptr;
    if (zipmoe_cache_apply(&params) != ZIPMOE_OK) {
        err = "the cache refused its configuration";
        return false;
    }
    if (token_tier) {
        info += "; while generating, " + size_text(token_hot) + " decoded";
    } else if (hot == 0 && warm > 0 && sm == 0 && !plan) { // (cache/config.c: warm_tokens_possible)
        info += "; while generating, the compressed tier also holds the allowance beyond a token's decodes";
    }
    return true;
}


// A prior file is n_layer x n_expert counts: a few MiB at most for any model; a larger file is no prior.
#define PRIOR_FILE_MAX ((long) 64 << 20)

bool zipmoe_llama_apply_prior(const char * path, const std::vector<zipmoe_store *> & stores, std::string & err) {
    const std::string what = std::string("ZIPMOE_PRIOR=") + path + ": ";
    FILE *            f    = std::fopen(path, "rb");
    if (!f) {
        err = what + "cannot be read (" + std::strerror(errno) + ")";
        return false;
    }
    std::vector<uint8_t> data;
    long                 size = -1;
    if (std::fseek(f, 0, SEEK_END) == 0 && (size = std::ftell(f)) >= 0 && size <= PRIOR_FILE_MAX &&
        std::fseek(f, 0, SEEK_SET) == 0) {
        data.resize((size_t) size);
        if (size > 0 && std::fread(data.data(), 1, data.size(), f) != data.size()) {
            size = -1;
        }
    }
    std::fclose(f);
    if (size < 0 || size > PRIOR_FILE_MAX) {
        err = what + (size > PRIOR_FILE_MAX ? "too large for a prior file" : "cannot be read");
        return false;
    }
    char msg[256];
    if (zipmoe_cache_seed_prior(stores.data(), (int64_t) stores.size(), data.data(), data.size(), msg, sizeof msg) < 0) {
        err = what + msg;
        return false;
    }
    return true;
}
