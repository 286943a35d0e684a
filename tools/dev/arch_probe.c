// arch_probe: loads GGUFs with a libllama and says what its loader and graph make of them, for
// tools/dev/probe_archs.py (which derives the synthetic models of pyzipmoe/synth_arch.py from the answers).
//
// Reads one request per line from stdin: "load PATH" or "eval PATH". Prints one answer line per request:
//   "OK"                      the model loaded (and, for eval, decoded a prompt and 4 greedy tokens)
//   "OK <hash> <tokens>"      for eval: an FNV-1a hash of the last logits' bits and the greedy tokens
//   "ERR <message>"           llama.cpp's error message (the last "error loading model" line, or what failed)
// A GGML_ASSERT aborts the process; the caller sees that on stderr and starts a new one.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include "llama.h"

static char g_err[4096];

static void on_log(enum ggml_log_level level, const char * text, void * user_data) {
    (void) user_data;
    if (getenv("ARCH_PROBE_VERBOSE")) {
        fputs(text, stderr);
    }
    if (level == GGML_LOG_LEVEL_ERROR) {
        const char * p = strstr(text, "error loading model: ");
        if (p) {
            snprintf(g_err, sizeof g_err, "%s", p + strlen("error loading model: "));
        } else if (!g_err[0]) {
            snprintf(g_err, sizeof g_err, "%s", text);
        }
        char * nl = strchr(g_err, '\n');
        if (nl) *nl = 0;
    }
}

static unsigned long long fnv(const float * x, int n) {
    unsigned long long h = 1469598103934665603ULL;
    const unsigned char * b = (const unsigned char *) x;
    for (size_t i = 0; i < (size_t) n * sizeof(float); i++) {
        h = (h ^ b[i]) * 1099511628211ULL;
    }
    return h;
}

static void eval(struct llama_model * model) {
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 64;
    cp.n_batch = 64;
    cp.n_ubatch = 64;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    struct llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        printf("ERR context: %s\n", g_err[0] ? g_err : "llama_init_from_model failed");
        return;
    }
    const struct llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token toks[64];
    const char * prompt = "the expert model said hello to the world";
    int n = llama_tokenize(vocab, prompt, (int) strlen(prompt), toks, 48, true, false);
    if (n <= 0) {
        printf("ERR tokenize failed (%d)\n", n);
        llama_free(ctx);
        return;
    }
    char gen[256] = "";
    unsigned long long h = 0;
    int finite = 1;
    struct llama_batch batch = llama_batch_get_one(toks, n);
    for (int step = 0; step < 5; step++) {
        if (llama_decode(ctx, batch) != 0) {
            printf("ERR decode failed at step %d: %s\n", step, g_err);
            llama_free(ctx);
            return;
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int i = 0; i < n_vocab; i++) {
            if (!isfinite(logits[i])) finite = 0;
            if (logits[i] > logits[best]) best = i;
        }
        h = fnv(logits, n_vocab);
        if (step == 4) break;
        toks[n] = best;
        snprintf(gen + strlen(gen), sizeof gen - strlen(gen), "%s%d", step ? "," : "", best);
        batch = llama_batch_get_one(&toks[n], 1);
        n++;
    }
    printf("OK %016llx %s%s\n", h, gen, finite ? "" : " NONFINITE");
    llama_free(ctx);
}

int main(void) {
    llama_log_set(on_log, NULL);
    llama_backend_init();
    char line[8192];
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        int do_eval = strncmp(line, "eval ", 5) == 0;
        if (!do_eval && strncmp(line, "load ", 5) != 0) {
            printf("ERR bad request\n");
            fflush(stdout);
            continue;
        }
        g_err[0] = 0;
        struct llama_model_params mp = llama_model_default_params();
        struct llama_model * model = llama_model_load_from_file(line + 5, mp);
        if (!model) {
            printf("ERR %s\n", g_err[0] ? g_err : "load failed");
        } else {
            if (do_eval) {
                eval(model);
            } else {
                printf("OK\n");
            }
            llama_model_free(model);
        }
        fflush(stdout);
    }
    llama_backend_free();
    return 0;
}
