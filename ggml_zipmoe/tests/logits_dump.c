/* logits_dump.c - a model's logits, as raw float32, for a bit-exact comparison of two runs (cmp): every position of a
 * prompt, then N greedy tokens one at a time (the generation path: batches of one). The generated token ids go to
 * stdout. Used where Python cannot load the library, as under qemu-user (tools/dev/cross_arm64.sh e2e); built with
 * -DZIPMOE_LLAMA=ON -DZIPMOE_SELFTEST=ON.
 *   zipmoe-logits MODEL PROMPT N_GEN THREADS OUT */
#include "llama.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void quiet(enum ggml_log_level level, const char * text, void * user) {
    if (level >= GGML_LOG_LEVEL_WARN) {
        fputs(text, stderr);
    }
}

static bool silent_progress(float progress, void * user) { return true; } /* (no dots on stderr) */

static int fail(const char * what) {
    fprintf(stderr, "zipmoe-logits: %s\n", what);
    return 1;
}

int main(int argc, char ** argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s MODEL PROMPT N_GEN THREADS OUT\n", argv[0]);
        return 2;
    }
    const int n_gen = atoi(argv[3]), threads = atoi(argv[4]);
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.progress_callback         = silent_progress;
    struct llama_model *      model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        return fail("the model did not load");
    }
    const struct llama_vocab * vocab   = llama_model_get_vocab(model);
    const int                  n_vocab = llama_vocab_n_tokens(vocab);
    llama_token                tokens[256];
    const int n_prompt = llama_tokenize(vocab, argv[2], (int32_t) strlen(argv[2]), tokens, 256, 1, 0);
    if (n_prompt <= 0 || n_prompt + n_gen > 256) {
        return fail("the prompt does not tokenize to 1..256 - N_GEN tokens");
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx                        = 256;
    cp.n_batch                      = 256;
    cp.n_threads                    = threads;
    cp.n_threads_batch              = threads;
    struct llama_context * ctx      = llama_init_from_model(model, cp);
    if (!ctx) {
        return fail("no context");
    }
    FILE * out = fopen(argv[5], "wb");
    if (!out) {
        return fail("cannot write OUT");
    }
    struct llama_batch batch = llama_batch_init(256, 0, 1);
    int                pos   = 0, rc = 0;
    for (int step = 0; step <= n_gen && rc == 0; step++) {
        const int n = step == 0 ? n_prompt : 1;
        batch.n_tokens = n;
        for (int i = 0; i < n; i++) {
            batch.token[i]     = step == 0 ? tokens[i] : tokens[n_prompt + step - 1];
            batch.pos[i]       = pos + i;
            batch.n_seq_id[i]  = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i]    = 1;
        }
        if (llama_decode(ctx, batch) != 0) {
            rc = fail("llama_decode failed");
            break;
        }
        pos += n;
        const float * last = NULL;
        for (int i = 0; i < n; i++) {
            last = llama_get_logits_ith(ctx, i);
            if (!last || fwrite(last, sizeof(float), (size_t) n_vocab, out) != (size_t) n_vocab) {
                rc = fail("no logits, or a short write");
                break;
            }
        }
        if (rc == 0 && step < n_gen) { /* greedy: the first largest logit */
            int best = 0;
            for (int v = 1; v < n_vocab; v++) {
                best = last[v] > last[best] ? v : best;
            }
            tokens[n_prompt + step] = best;
            printf("%d%s", best, step + 1 < n_gen ? " " : "\n");
        }
    }
    llama_batch_free(batch);
    if (fclose(out) != 0 && rc == 0) {
        rc = fail("cannot write OUT");
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return rc;
}
