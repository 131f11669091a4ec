/* A llama.cpp program that knows nothing of Leap: it loads ggml's backends the way llama.cpp's
 * own tools do (ggml_backend_load_all, which honours GGML_BACKEND_PATH), then decodes with a
 * model. Used by tests/tests/plugin.rs to prove that libggml_leap.so plugs into an unmodified
 * llama.cpp: it prints the devices, the decoded tokens, and how many nodes leap-cpu computed.
 *
 * usage: plugin_host MODEL.gguf N_TOKENS [flash-attn 0|1 [PROMPT_FILE [N_CTX]]]
 * With a prompt file it decodes that text (up to N_CTX - N_TOKENS tokens) and prints the
 * prefill and decode times.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-backend.h"
#include "llama.h"

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf N_TOKENS [flash-attn 0|1]\n", argv[0]);
        return 64;
    }
    const int n_gen = atoi(argv[2]);
    const int fa = argc > 3 ? atoi(argv[3]) : 0;
    const char *prompt_file = argc > 4 ? argv[4] : NULL;
    const int n_ctx = argc > 5 ? atoi(argv[5]) : 2048;
    llama_log_set(quiet, NULL);
    ggml_backend_load_all();
    llama_backend_init();
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        printf("device %s\n", ggml_backend_dev_name(ggml_backend_dev_get(i)));
    }
    ggml_backend_dev_t leap = ggml_backend_dev_by_name("leap-cpu");
    if (!leap) {
        fprintf(stderr, "leap-cpu is not registered (is GGML_BACKEND_PATH set?)\n");
        return 2;
    }
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 3;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = n_ctx;
    cp.n_batch = n_ctx;
    cp.flash_attn_type = fa ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 4;
    const struct llama_vocab *vocab = llama_model_get_vocab(model);

    /* A prompt long enough for sparse attention (its minimum is 1024 keys). */
    static char text[1 << 20];
    size_t len = 0;
    int max_prompt = 1200;
    if (prompt_file) {
        FILE *f = fopen(prompt_file, "rb");
        if (!f) return 8;
        len = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        max_prompt = n_ctx - n_gen - 8;
    } else {
        const char *line = "The scheduler hands each node to the first backend that supports it. ";
        while (len + strlen(line) + 1 < 16384) {
            memcpy(text + len, line, strlen(line));
            len += strlen(line);
        }
    }
    text[len] = 0;
    llama_token *toks = malloc(sizeof(llama_token) * (len + 16));
    int n = llama_tokenize(vocab, text, (int32_t)len, toks, (int32_t)len + 16, true, false);
    if (n <= 0) return 5;
    if (n > max_prompt) n = max_prompt;
    double t0 = now_ms();
    if (llama_decode(ctx, llama_batch_get_one(toks, n))) return 6;
    double t1 = now_ms();
    printf("tokens");
    for (int i = 0; i < n_gen; i++) {
        const float *logits = llama_get_logits_ith(ctx, -1);
        llama_token best = 0;
        for (llama_token t = 1; t < llama_vocab_n_tokens(vocab); t++) {
            if (logits[t] > logits[best]) best = t;
        }
        printf(" %d", best);
        if (llama_decode(ctx, llama_batch_get_one(&best, 1))) return 7;
    }
    printf("\n");
    double t2 = now_ms();
    printf("prefill %d tokens %.1f ms, decode %d tokens %.1f ms\n", n, t1 - t0, n_gen, t2 - t1);

    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(leap);
    uint64_t (*calls)(void) = (uint64_t(*)(void))ggml_backend_reg_get_proc_address(reg, "leap_total_calls");
    printf("leap-cpu nodes %llu\n", calls ? (unsigned long long)calls() : 0ULL);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    free(toks);
    return 0;
}
