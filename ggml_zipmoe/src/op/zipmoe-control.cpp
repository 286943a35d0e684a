// zipmoe-control.cpp - the control channel of a supervised llama.cpp program (llama-cli, llama-server started by
// `zipmoe run` / `zipmoe serve`): the supervisor (pyzipmoe.runtime.supervise) watches the memory available, as
// pyzipmoe.Llama's monitor does in its own process, and hands the running cache a new budget split through a small
// shared file; the cache hands back what it holds, which the supervisor counts as the model's (`auto`'s formula).
//
// The file (ZIPMOE_CONTROL, made by the supervisor) is CONTROL_WORDS little-endian 64-bit words, read with pread and
// written with pwrite on a descriptor this process keeps (never mapped: a file truncated under a mapping kills its
// reader with SIGBUS); pyzipmoe/runtime/supervise.py writes the same layout:
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
    std::once_flag once;
    int            fd = -1;     // the control file; -1: no supervisor
    const char *   path = "";
    std::mutex     apply_mu;    // the graph's hook and the thread take turns; guards the rest
    uint64_t       applied = 0;
    uint64_t       polls   = 0;
    bool           warned  = false; // the file stopped being a control file (truncated, overwritten): said once
};

control_state & g_ctl = *new control_state; // never destroyed: the thread may still run while the process exits

// Words [first, first + n) of the file into out; false on a short read (the file was truncated) or an error.
bool read_words(int first, int n, uint64_t * out) {
    const size_t  bytes = (size_t) n * sizeof(uint64_t);
    const ssize_t got   = pread(g_ctl.fd, out, bytes, (off_t) first * (off_t) sizeof(uint64_t));
    return got == (ssize_t) bytes;
}

void write_words(int first, int n, const uint64_t * words) {
    // (best effort: a file that can no longer be written only leaves the supervisor without news)
    const ssize_t put = pwrite(g_ctl.fd, words, (size_t) n * sizeof(uint64_t), (off_t) first * (off_t) sizeof(uint64_t));
    (void) put;
}

// The file stopped being a control file: the budget stays as it is, said once.
void lost(const char * why) {
    if (!g_ctl.warned) {
        std::fprintf(stderr, "zipmoe: warning: ZIPMOE_CONTROL=%s %s: the budget stays as it is\n", g_ctl.path, why);
        g_ctl.warned = true;
    }
}

void publish_stats() {
    zipmoe_stats s{};
    zipmoe_stats_get(&s);
    uint64_t w[W_PEAK_RESIDENT - W_APPLIED + 1];
    w[W_APPLIED - W_APPLIED]       = g_ctl.applied;
    w[W_RESIDENT - W_APPLIED]      = s.hot_bytes + s.warm_bytes + s.sm_bytes + s.decoding_bytes + s.pool_bytes;
    w[W_TRANSIENT - W_APPLIED]     = s.staging_transient_bytes;
    w[W_CALLS - W_APPLIED]         = s.materialize_calls;
    w[W_PID - W_APPLIED]           = (uint64_t) getpid();
    w[W_POLLS - W_APPLIED]         = ++g_ctl.polls;
    w[W_PEAK_RESIDENT - W_APPLIED] = s.peak_resident_bytes;
    write_words(W_APPLIED, W_PEAK_RESIDENT - W_APPLIED + 1, w);
}

void poll_once() {
    std::lock_guard<std::mutex> lock(g_ctl.apply_mu);
    uint64_t w[CONTROL_WORDS];
    if (!read_words(0, CONTROL_WORDS, w)) {
        lost("was truncated");
        return;
    }
    if (w[W_MAGIC] != CONTROL_MAGIC) {
        lost("is no longer a control file");
        return;
    }
    const uint64_t seq = w[W_SEQ];
    if (seq != g_ctl.applied && seq % 2 == 0) {
        uint64_t again = 0;
        if (read_words(W_SEQ, 1, &again) && again == seq) { // (a seqlock: the supervisor did not start another split)
            zipmoe_budget_split split{};
            split.hot       = w[W_HOT];
            split.warm      = w[W_WARM];
            split.sm        = w[W_SM];
            split.in_flight = w[W_IN_FLIGHT];
            split.reads     = w[W_READS];
            split.token_hot = w[W_TOKEN_HOT];
            if (w[W_POLICY] > (uint64_t) ZIPMOE_POLICY_LAST) { // (checked before it becomes an enum)
                std::fprintf(stderr, "zipmoe: the supervisor's budget split was refused (policy %llu is none)\n",
                             (unsigned long long) w[W_POLICY]);
            } else if (zipmoe_cache_apply_split(&split, (zipmoe_policy) w[W_POLICY]) < 0) {
                std::fprintf(stderr, "zipmoe: the supervisor's budget split was refused (policy %llu)\n",
                             (unsigned long long) w[W_POLICY]);
            }
            g_ctl.applied = seq;
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
    uint64_t  head[2] = {};
    if (fd < 0 || pread(fd, head, sizeof head, 0) != (ssize_t) sizeof head || head[W_MAGIC] != CONTROL_MAGIC) {
        std::fprintf(stderr, "zipmoe: ZIPMOE_CONTROL=%s is not a control file: the budget stays fixed\n", path);
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    std::lock_guard<std::mutex> lock(g_ctl.apply_mu);
    g_ctl.fd      = fd;
    g_ctl.path    = path; // (the environment's: it stays)
    g_ctl.applied = head[W_SEQ]; // the split of the load came through the environment
    publish_stats();
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
    if (g_ctl.fd >= 0) {
        poll_once();
    }
}

std::string zipmoe_control_load_note() {
    std::call_once(g_ctl.once, open_channel); // at load: the supervisor sees what the cache holds from the start
    if (g_ctl.fd >= 0) {
        return "; the budget follows the memory available (zipmoe's supervisor, ZIPMOE_CONTROL)";
    }
    return "; the budget is fixed for this run: it does not adapt to the memory available (zipmoe run and zipmoe "
           "serve adapt it, as does pyzipmoe.Llama)";
}
