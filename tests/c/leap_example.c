/* Leap's C API from an app's side (include/leap.h): open a model, stream a generation, read
 * its statistics, run a second request on the same session, and report errors.
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
    default: return "?";
    }
}

static int fail(const char *what, leap_status status) {
    fprintf(stderr, "leap_example: %s: %s: %s\n", what, leap_status_string(status),
            leap_last_error());
    return 1;
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
    leap_model_params mp = leap_model_default_params();
    mp.mode = strcmp(argv[2], "plain") == 0 ? LEAP_MODE_PLAIN : LEAP_MODE_LEAP;

    leap_model *model = NULL;
    leap_status st = leap_model_open(argv[1], &mp, &model);
    if (st != LEAP_OK) return fail("opening the model", st);
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
    rc = check_errors(session);

done:
    leap_session_free(session);
    leap_model_free(model);
    return rc;
}
