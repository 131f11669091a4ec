/* Leap's C API from an app's side (include/leap.h): take the log, open a model, tokenize, stream
 * a generation, read its statistics, run a second request on the same session, a conversation
 * with a stop string, and report errors.
 * tests/tests/capi.rs compiles it against libleap.so and checks what it prints.
 *
 * usage: leap_example MODEL.gguf leap|plain MAX_TOKENS [CANCEL_AFTER]
 * stdout: the first generation's text; stderr: its statistics, one per line ("tokens 48"),
 * then the second generation's, the session's totals, and the error checks.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "leap.h"

#define PROMPT "The three most useful things to know about running language models on a phone are"

struct stream {
    int tokens;       /* tokens received */
    int cancel_after; /* stop after this many (0: never) */
};

/* Called with each token's text (complete UTF-8, `len` bytes); false stops the generation. */
static bool on_token(const char *piece, size_t len, int32_t token, void *user_data) {
    struct stream *s = user_data;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    if (token < 0) return true; /* the end of a character the generation stopped inside */
    s->tokens++;
    return s->cancel_after == 0 || s->tokens < s->cancel_after;
}

static const char *finish_name(int32_t finish) {
    switch (finish) {
    case LEAP_FINISH_LENGTH: return "length";
    case LEAP_FINISH_EOG: return "eog";
    case LEAP_FINISH_CANCELLED: return "cancelled";
    case LEAP_FINISH_STOP: return "stop";
    default: return "?";
    }
}

/* The log, counted by source instead of printed (an app would hand it to its own logging). */
struct log_counts {
    int leap, llama;
};

static void on_log(int32_t level, const char *source, const char *message, void *user_data) {
    struct log_counts *c = user_data;
    (void)level;
    (void)message;
    if (strcmp(source, "llama.cpp") == 0)
        c->llama++;
    else
        c->leap++;
}

/* The load's progress: how often it was reported, and the last fraction. */
struct progress {
    int calls;
    float last;
};

static bool on_progress(float fraction, void *user_data) {
    struct progress *p = user_data;
    p->calls++;
    p->last = fraction;
    return true;
}

/* A generation's text, collected. */
struct text {
    char buf[4096];
    size_t len;
};

static bool collect(const char *piece, size_t len, int32_t token, void *user_data) {
    struct text *t = user_data;
    (void)token;
    if (t->len + len < sizeof t->buf) {
        memcpy(t->buf + t->len, piece, len);
        t->len += len;
        t->buf[t->len] = '\0';
    }
    return true;
}

static int fail(const char *what, leap_status status) {
    fprintf(stderr, "leap_example: %s: %s: %s\n", what, leap_status_string(status),
            leap_last_error());
    return 1;
}

/* The prompt's tokens and back: the size asked first, then the tokens. */
static int round_trip(const leap_model *model) {
    size_t n = 0;
    leap_status st = leap_tokenize(model, PROMPT, false, false, NULL, 0, &n);
    if (st != LEAP_ERR_BUFFER || n == 0) return fail("asking for the number of tokens", st);
    int32_t *tokens = malloc(n * sizeof *tokens);
    if (tokens == NULL) return 1;
    st = leap_tokenize(model, PROMPT, false, false, tokens, n, &n);
    char text[512];
    size_t len = 0;
    if (st == LEAP_OK) st = leap_detokenize(model, tokens, n, false, text, sizeof text, &len);
    free(tokens);
    if (st != LEAP_OK) return fail("tokenizing", st);
    fprintf(stderr, "tokenize: %zu tokens, the text %s\n", n,
            strcmp(text, PROMPT) == 0 && len == strlen(PROMPT) ? "back" : "changed");
    return 0;
}

/* A conversation, then the same with a stop string taken from the middle of its answer: the
 * second answer is the first's up to that string. */
static int conversation(leap_session *session, int32_t max_tokens) {
    leap_chat_message chat[] = {
        {"system", "You are a helpful assistant."},
        {"user", "What is a phone's battery made of?"},
    };
    leap_generate_params gp = leap_generate_default_params();
    gp.max_tokens = max_tokens;
    struct text full = {{0}, 0}, cut = {{0}, 0};
    leap_stats stats;
    leap_status st = leap_generate_chat(session, chat, 2, &gp, collect, &full, &stats);
    if (st != LEAP_OK) return fail("a conversation", st);
    /* Three ASCII letters from the middle of the answer. */
    char stop[4] = {0};
    for (size_t i = full.len / 2; i + 3 <= full.len && stop[0] == 0; i++) {
        const char *p = full.buf + i;
        if (p[0] >= 'a' && p[0] <= 'z' && p[1] >= 'a' && p[1] <= 'z' && p[2] >= 'a' && p[2] <= 'z')
            memcpy(stop, p, 3);
    }
    if (stop[0] == 0) {
        fprintf(stderr, "chat: no letters to stop at in [%s]\n", full.buf);
        return 1;
    }
    const char *stops[] = {stop};
    gp.stop = stops;
    gp.n_stop = 1;
    st = leap_generate_chat(session, chat, 2, &gp, collect, &cut, &stats);
    if (st != LEAP_OK) return fail("a conversation with a stop string", st);
    size_t expected = (size_t)(strstr(full.buf, stop) - full.buf);
    fprintf(stderr, "chat: stop \"%s\" finish %s, the text %s\n", stop, finish_name(stats.finish),
            cut.len == expected && memcmp(cut.buf, full.buf, expected) == 0 ? "cut there" : "differs");
    return 0;
}

/* Errors an app must expect: a model that is not there, a prompt that is not UTF-8. */
static int check_errors(leap_session *session) {
    leap_model *none = NULL;
    leap_status st = leap_model_open("/nonexistent/model.gguf", NULL, &none);
    fprintf(stderr, "missing model: status %d (%s): %s\n", (int)st, leap_status_string(st),
            leap_last_error());
    if (st != LEAP_ERR_MODEL || none != NULL || leap_last_error()[0] == '\0') return 1;
    st = leap_generate(session, "caf\xc3", NULL, NULL, NULL, NULL);
    fprintf(stderr, "invalid prompt: status %d: %s\n", (int)st, leap_last_error());
    return st == LEAP_ERR_INVALID_ARGUMENT ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf leap|plain MAX_TOKENS [CANCEL_AFTER]\n", argv[0]);
        return 64;
    }
    if (leap_abi_version() != LEAP_ABI_VERSION) {
        fprintf(stderr, "libleap's ABI is %d, leap.h's %d\n", (int)leap_abi_version(),
                LEAP_ABI_VERSION);
        return 1;
    }
    /* The load's log (llama.cpp's details are LEAP_LOG_DEBUG), then warnings only. */
    struct log_counts logs = {0, 0};
    leap_log_set(on_log, LEAP_LOG_DEBUG, &logs);
    leap_model_params mp = leap_model_default_params();
    mp.mode = strcmp(argv[2], "plain") == 0 ? LEAP_MODE_PLAIN : LEAP_MODE_LEAP;
    struct progress loading = {0, 0.0f};
    mp.progress = on_progress;
    mp.progress_user_data = &loading;

    leap_model *model = NULL;
    leap_status st = leap_model_open(argv[1], &mp, &model);
    if (st != LEAP_OK) return fail("opening the model", st);
    leap_log_set(on_log, LEAP_LOG_WARN, &logs);
    fprintf(stderr, "log: llama.cpp %d leap %d\n", logs.llama, logs.leap);
    fprintf(stderr, "progress: %d calls, last %.2f\n", loading.calls, loading.last);
    if (round_trip(model) != 0) {
        leap_model_free(model);
        return 1;
    }
    leap_session *session = NULL;
    st = leap_session_new(model, &session);
    if (st != LEAP_OK) {
        leap_model_free(model);
        return fail("creating a session", st);
    }

    /* Greedy decoding (the default), streamed through on_token. */
    leap_generate_params gp = leap_generate_default_params();
    gp.max_tokens = atoi(argv[3]);
    struct stream s = {0, argc > 4 ? atoi(argv[4]) : 0};
    leap_stats stats;
    int rc = 0;
    st = leap_generate(session, PROMPT, &gp, on_token, &s, &stats);
    printf("\n");
    if (st != LEAP_OK) {
        rc = fail("generating", st);
        goto done;
    }
    fprintf(stderr, "tokens %" PRIu64 "\n", stats.tokens);
    fprintf(stderr, "callbacks %d\n", s.tokens);
    fprintf(stderr, "target_calls %" PRIu64 "\n", stats.target_calls);
    fprintf(stderr, "accepted_per_call %.2f\n", stats.accepted_per_call);
    fprintf(stderr, "decode_seconds %.3f\n", stats.decode_seconds);
    fprintf(stderr, "finish %s\n", finish_name(stats.finish));

    /* A second request on the same session, as one chat message, without a callback. */
    gp.chat = true;
    st = leap_generate(session, "Name one of them.", &gp, NULL, NULL, &stats);
    if (st != LEAP_OK) {
        rc = fail("generating again", st);
        goto done;
    }
    fprintf(stderr, "second: tokens %" PRIu64 " target_calls %" PRIu64 " finish %s\n",
            stats.tokens, stats.target_calls, finish_name(stats.finish));
    leap_stats totals;
    st = leap_session_totals(session, &totals);
    if (st != LEAP_OK) {
        rc = fail("reading the totals", st);
        goto done;
    }
    fprintf(stderr, "totals: tokens %" PRIu64 " target_calls %" PRIu64 "\n", totals.tokens,
            totals.target_calls);
    rc = conversation(session, 24);
    if (rc == 0) rc = check_errors(session);

done:
    leap_session_free(session);
    leap_model_free(model);
    return rc;
}
