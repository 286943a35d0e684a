// zipmoe-args.cpp - zipmoe's flags in llama.cpp's programs (zipmoe-args.h).
#include "zipmoe-args.h"

#include "zipmoe.h"       // zipmoe_budget_valid, zipmoe_openmp_spincount
#include "zipmoe-cache.h" // zipmoe_policy_parse, zipmoe_policy_names, zipmoe_plan_parse

#include "common.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(__linux__)
#include <unistd.h> // execv
#endif

struct common_zipmoe_option {
    const char * flag;
    const char * var;  // what the runtime reads (ggml_zipmoe/src/common/config.c)
    const char * env;  // the flag's LLAMA_ARG_* twin
    const char * hint;
    const char * help;
};

static const common_zipmoe_option common_zipmoe_options[] = {
    { "--memory-budget", "ZIPMOE_MEMORY_BUDGET", "LLAMA_ARG_MEMORY_BUDGET", "SIZE",
      "zipmoe: everything a MoE model (zipmoe or plain GGUF) may keep resident, e.g. 6GiB, 512MiB, 60% (of physical "
      "memory) or auto (the memory available less a margin, at most the whole model): its weights that are not "
      "experts, the experts of one expert tensor in flight and the expert cache; too small: the error says the "
      "minimum; a model without experts ignores it, with a warning (default: unbounded)" },
    { "--cache-policy", "ZIPMOE_CACHE_POLICY", "LLAMA_ARG_CACHE_POLICY", "NAME",
      "zipmoe: the expert cache's eviction under a budget: lfuda (LFU with dynamic ageing), tlfu (token-weighted "
      "LFU), lru, lfu or fifo (default: lfuda)" },
    { "--hot-share", "ZIPMOE_HOT_SHARE", "LLAMA_ARG_HOT_SHARE", "F",
      "zipmoe: the share of the expert cache for decoded experts, 0 to 1 (default: chosen for the model: 0 where "
      "nearly every expert fits compressed and decodes fast, else 1; a plain GGUF's experts are all decoded)" },
    { "--sm-share", "ZIPMOE_SM_SHARE", "LLAMA_ARG_SM_SHARE", "F",
      "zipmoe: the share of the expert cache for sign+mantissa planes, 0 to 1 (default: 0)" },
    { "--cache-plan", "ZIPMOE_PLAN", "LLAMA_ARG_CACHE_PLAN", "PLAN",
      "zipmoe: the expert cache's slots per layer and tier, as `zipmoe plan` prints them (default: split by the "
      "shares)" },
};
static const size_t common_zipmoe_n_options = sizeof common_zipmoe_options / sizeof common_zipmoe_options[0];
enum { COMMON_ZIPMOE_BUDGET = 0, COMMON_ZIPMOE_POLICY = 1, COMMON_ZIPMOE_PLAN = 4 };

static void common_zipmoe_set(size_t i, const std::string & value) {
    if (value.empty()) {
        throw std::invalid_argument(std::string("error: ") + common_zipmoe_options[i].flag + " needs a value");
    }
    // a flag wins over the environment, as in llama.cpp
#ifdef _WIN32
    _putenv_s(common_zipmoe_options[i].var, value.c_str());
#else
    setenv(common_zipmoe_options[i].var, value.c_str(), 1);
#endif
}

// common_arg's handlers are plain functions: one per option
template <size_t I> static void common_zipmoe_handler(common_params &, const std::string & value) {
    common_zipmoe_set(I, value);
}

template <size_t I> static common_arg common_zipmoe_arg() {
    const common_zipmoe_option & o = common_zipmoe_options[I];
    return common_arg({ o.flag }, o.hint, std::string(o.help) + "; sets " + o.var, common_zipmoe_handler<I>)
        .set_env(o.env);
}

std::vector<common_arg> common_zipmoe_args() {
    static_assert(common_zipmoe_n_options == 5, "one common_zipmoe_arg<I> per option");
    return { common_zipmoe_arg<0>(), common_zipmoe_arg<1>(), common_zipmoe_arg<2>(), common_zipmoe_arg<3>(),
             common_zipmoe_arg<4>() };
}

static size_t common_zipmoe_index(const std::string & flag) {
    size_t i = 0;
    while (i < common_zipmoe_n_options && flag != common_zipmoe_options[i].flag) {
        i++;
    }
    return i;
}

bool common_zipmoe_is_flag(const std::string & flag) {
    return common_zipmoe_index(flag) < common_zipmoe_n_options;
}

void common_zipmoe_flag(const std::string & flag, const std::string & value) {
    GGML_ASSERT(common_zipmoe_is_flag(flag));
    common_zipmoe_set(common_zipmoe_index(flag), value);
}

std::string common_zipmoe_usage() {
    std::string out;
    for (const common_zipmoe_option & o : common_zipmoe_options) {
        out += string_format("  %-44s%s; sets %s\n", (std::string(o.flag) + " <" + o.hint + ">").c_str(), o.help, o.var);
    }
    return out;
}

// A zipmoe setting named as its user gave it: the flag (the last one counts), its twin or the variable itself.
static std::string common_zipmoe_given(size_t i, const char * value, char ** argv) {
    const common_zipmoe_option & o = common_zipmoe_options[i];
    std::string given = std::string(o.var) + "=" + value;
    if (const char * twin = getenv(o.env); twin && strcmp(twin, value) == 0) {
        given = std::string(o.env) + "=" + value;
    }
    std::string underscored = o.flag; // (llama.cpp reads --memory_budget as --memory-budget)
    std::replace(underscored.begin() + 2, underscored.end(), '-', '_');
    for (char ** a = argv + 1; *a; a++) {
        if (*a == std::string(o.flag) || *a == underscored) {
            given = std::string(o.flag) + " " + value;
        }
    }
    return given;
}

static std::string common_zipmoe_check(char ** argv, const std::vector<std::pair<std::string, int>> & threads) {
    for (const auto & [flag, n] : threads) {
        if (n > GGML_MAX_N_THREADS) {
            return string_format("error: %s %d: more threads than ggml runs (at most %d)", flag.c_str(), n,
                                 GGML_MAX_N_THREADS);
        }
    }
    const auto value = [](size_t i) {
        const char * v = getenv(common_zipmoe_options[i].var);
        return v && *v ? v : nullptr;
    };
    if (const char * v = value(COMMON_ZIPMOE_BUDGET); v && !zipmoe_budget_valid(v)) {
        return "error: " + common_zipmoe_given(COMMON_ZIPMOE_BUDGET, v, argv) +
               " is not a memory budget: write e.g. 6GiB, 512MiB, 60% or auto";
    }
    if (const char * v = value(COMMON_ZIPMOE_POLICY); v && zipmoe_policy_parse(v, nullptr) != ZIPMOE_OK) {
        char names[64];
        zipmoe_policy_names(names, sizeof names);
        return "error: " + common_zipmoe_given(COMMON_ZIPMOE_POLICY, v, argv) + " is not a policy (" + names + ")";
    }
    if (const char * v = value(COMMON_ZIPMOE_PLAN)) {
        if (const int64_t rc = zipmoe_plan_parse(v, nullptr, nullptr); rc != ZIPMOE_OK) {
            return "error: " + common_zipmoe_given(COMMON_ZIPMOE_PLAN, v, argv) + zipmoe_plan_problem(rc);
        }
    }
    return "";
}

// Under a budget, OpenMP's short spin (zipmoe_openmp_spincount: it keeps ggml's barriers from starving zipmoe's
// reader thread and the kernel's reads), set before libgomp loads: the program executes itself again with it.
static void common_zipmoe_openmp(char ** argv) {
#if defined(__linux__)
    const char * budget = getenv("ZIPMOE_MEMORY_BUDGET");
    if (!budget || !*budget || getenv("GOMP_SPINCOUNT") || getenv("OMP_WAIT_POLICY")) {
        return;
    }
    setenv("GOMP_SPINCOUNT", zipmoe_openmp_spincount(), 1); // set before exec: the new image does not come back
    fflush(stdout);
    fflush(stderr);
    execv("/proc/self/exe", argv);
    // exec failed: run on with libgomp's default spin (slower under a budget, the same tokens)
#else
    (void) argv;
#endif
}

void common_zipmoe_parsed(char ** argv, const common_params & params) {
    const std::string err = common_zipmoe_check(argv, {
        { "-t", params.cpuparams.n_threads }, { "-tb", params.cpuparams_batch.n_threads },
        { "-td", params.speculative.draft.cpuparams.n_threads },
        { "-tbd", params.speculative.draft.cpuparams_batch.n_threads } });
    if (!err.empty()) {
        throw std::invalid_argument(err);
    }
    common_zipmoe_openmp(argv);
}

std::string common_zipmoe_parsed_bench(char ** argv, const std::vector<int> & n_threads) {
    std::vector<std::pair<std::string, int>> threads;
    for (int n : n_threads) {
        threads.emplace_back("-t", n);
    }
    const std::string err = common_zipmoe_check(argv, threads);
    if (err.empty()) {
        common_zipmoe_openmp(argv);
    }
    return err;
}
