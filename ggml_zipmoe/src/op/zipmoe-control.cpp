// zipmoe-control.cpp - the control channel of a supervised llama.cpp program (llama-cli, llama-server started by
// `zipmoe run` / `zipmoe serve`): the supervisor (pyzipmoe.runtime.supervise) watches the memory available, as
// pyzipmoe.Llama's monitor does in its own process, and hands the running cache a new budget split through a small
// shared file; the cache hands back what it holds, which the supervisor counts as the model's (`auto`'s formula).
//
// The file (ZIPMOE_CONTROL, made by the supervisor; mapped MAP_SHARED by both) is CONTROL_WORDS little-endian
// 64-bit words (pyzipmoe/runtime/supervise.py writes the same layout):
//   0 magic "ZMCTL001"   1 seq: odd while the supervisor writes, even when a split is complete
//   2 policy  3 hot  4 warm  5 sm  6 in_flight  7 reads  8 token_hot     (a zipmoe_budget_split, as the supervisor
//                                                                          computed it with zipmoe_budget_split_tiers)
//   9 applied: the seq this process applied   10 resident: the runtime's kept bytes (tiers, experts being decoded,
//   evicted experts' pages)   11 transient: the read buffers' bytes beyond what they keep   12 invocations served
//   13 pid   14 polls   15 peak resident: the most the tiers held at once (stays when the model is freed, so a
//   finished program's report does not race its own teardown)
// The split is applied with zipmoe_cache_apply_split, all at once, as the in-process monitor applies its splits.
#include "zipmoe-control.h"

#include "zipmoe-cache.h"
#include "zipmoe.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

namespace {

constexpr int      CONTROL_WORDS = 16;
constexpr uint64_t CONTROL_MAGIC = 0x3130304c54434d5aull; // "ZMCTL001" as little-endian bytes
constexpr auto     THREAD_PERIOD = std::chrono::milliseconds(20);

enum { W_MAGIC, W_SEQ, W_POLICY, W_HOT, W_WARM, W_SM, W_IN_FLIGHT, W_READS, W_TOKEN_HOT, W_APPLIED, W_RESIDENT,
       W_TRANSIENT, W_CALLS, W_PID, W_POLLS, W_PEAK_RESIDENT };

// Process-wide: one supervisor per process, as there is one budget per process (architecture.md).
struct control_state {
    std::once_flag      once;
    uint64_t *          words = nullptr; // the mapping; null: no supervisor
    std::mutex          apply_mu;        // the graph's hook and the thread take turns
    uint64_t            applied = 0;
};

control_state & g_ctl = *new control_state; // never destroyed: the thread may still run while the process exits

uint64_t load(int i) { return __atomic_load_n(&g_ctl.words[i], __ATOMIC_ACQUIRE); }
void     store(int i, uint64_t v) { __atomic_store_n(&g_ctl.words[i], v, __ATOMIC_RELEASE); }

void publish_stats() {
    zipmoe_stats s{};
    zipmoe_stats_get(&s);
    store(W_RESIDENT, s.hot_bytes + s.warm_bytes + s.sm_bytes + s.decoding_bytes + s.pool_bytes);
    store(W_TRANSIENT, s.staging_transient_bytes);
    store(W_CALLS, s.materialize_calls);
    store(W_PEAK_RESIDENT, s.peak_resident_bytes);
    store(W_POLLS, load(W_POLLS) + 1);
}

void poll_once() {
    std::lock_guard<std::mutex> lock(g_ctl.apply_mu);
    const uint64_t seq = load(W_SEQ);
    if (seq != g_ctl.applied && seq % 2 == 0) {
        zipmoe_budget_split split{};
        split.hot        = load(W_HOT);
        split.warm       = load(W_WARM);
        split.sm         = load(W_SM);
        split.in_flight  = load(W_IN_FLIGHT);
        split.reads      = load(W_READS);
        split.token_hot  = load(W_TOKEN_HOT);
        const auto policy = (zipmoe_policy) load(W_POLICY);
        if (load(W_SEQ) == seq) { // (a seqlock: the supervisor did not start another split meanwhile)
            if (zipmoe_cache_apply_split(&split, policy) < 0) {
                std::fprintf(stderr, "zipmoe: the supervisor's budget split was refused (policy %llu)\n",
                             (unsigned long long) policy);
            }
            g_ctl.applied = seq;
            store(W_APPLIED, seq);
        }
    }
    publish_stats();
}

void open_channel() {
    zipmoe_runtime_config env;
    zipmoe_runtime_config_from_env(&env); // (once: open_channel runs under call_once)
    const char * path = env.control;
    if (!path) {
        return;
    }
    const int fd = open(path, O_RDWR | O_CLOEXEC);
    struct stat st{};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < (off_t) (CONTROL_WORDS * sizeof(uint64_t))) {
        std::fprintf(stderr, "zipmoe: ZIPMOE_CONTROL=%s cannot be used: the budget stays fixed\n", path);
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    void * p = mmap(nullptr, CONTROL_WORDS * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED || ((uint64_t *) p)[W_MAGIC] != CONTROL_MAGIC) {
        std::fprintf(stderr, "zipmoe: ZIPMOE_CONTROL=%s is not a control file: the budget stays fixed\n", path);
        if (p != MAP_FAILED) {
            munmap(p, CONTROL_WORDS * sizeof(uint64_t));
        }
        return;
    }
    g_ctl.words   = (uint64_t *) p;
    g_ctl.applied = load(W_SEQ); // the split of the load came through the environment
    store(W_APPLIED, g_ctl.applied);
    store(W_PID, (uint64_t) getpid());
    // between graphs too: an idle server's supervisor still sees what it holds, and a new split is in place
    // before the next request's first graph
    std::thread([] {
        for (;;) {
            std::this_thread::sleep_for(THREAD_PERIOD);
            poll_once();
        }
    }).detach();
}

} // namespace

void zipmoe_control_poll() {
    std::call_once(g_ctl.once, open_channel);
    if (g_ctl.words) {
        poll_once();
    }
}

std::string zipmoe_control_load_note() {
    std::call_once(g_ctl.once, open_channel); // at load: the supervisor sees what the cache holds from the start
    if (g_ctl.words) {
        return "; the budget follows the memory available (zipmoe's supervisor, ZIPMOE_CONTROL)";
    }
    return "; the budget is fixed for this run: it does not adapt to the memory available (zipmoe run and zipmoe "
           "serve adapt it, as does pyzipmoe.Llama)";
}
