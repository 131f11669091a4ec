/* leap.h: Leap's C API (libleap.so).
 *
 * Leap decodes a GGUF model with llama.cpp and its own speculative engine: greedy output is
 * token for token what plain llama.cpp decoding gives, in fewer model calls. This header is
 * the whole API an app needs; it is C99 and usable from C++.
 *
 *   leap_model   an open model (load it once; share it between threads)
 *   leap_session a context on the model, kept across requests: the conversation's earlier
 *                prompts and answers feed Leap's drafter. One thread at a time.
 *
 * A minimal program (tests/c/leap_example.c is a complete one):
 *
 *   leap_model *model;
 *   leap_session *session;
 *   if (leap_model_open("model.gguf", NULL, &model) != LEAP_OK) {
 *       fprintf(stderr, "%s\n", leap_last_error());
 *       return 1;
 *   }
 *   leap_session_new(model, &session);
 *   leap_generate(session, "The capital of France is", NULL, on_token, NULL, NULL);
 *   leap_session_free(session);
 *   leap_model_free(model);
 *
 * Conventions:
 * - Every function that can fail returns a leap_status; on failure leap_last_error() says
 *   why, and output pointers are set to NULL.
 * - Strings passed in are NUL-terminated UTF-8 (paths included); invalid UTF-8 is
 *   LEAP_ERR_INVALID_ARGUMENT.
 * - A NULL where an object is required is LEAP_ERR_INVALID_ARGUMENT, never a crash. The
 *   *_free functions accept NULL.
 * - Logging: Leap's own warnings go to stderr, llama.cpp's log is silent. Set the
 *   environment variable LEAP_LOG=1 to see Leap's and llama.cpp's log down to debug level,
 *   LEAP_LOG=0 for nothing, or LEAP_LOG=error|warn|info|debug|trace for that level. Read
 *   once, at the first leap_model_open or leap_log_set. leap_log_set sends the log to the
 *   app's own callback instead (on Android, stderr goes nowhere).
 *
 * Building against it: `make install PREFIX=DIR` installs this header, libleap.so.1 (its
 * SONAME; libleap.so links to it), llama.cpp's libraries it was built with (DIR/lib/leap, found
 * through libleap's rpath) and DIR/lib/pkgconfig/leap.pc, so
 *
 *   cc app.c $(PKG_CONFIG_PATH=DIR/lib/pkgconfig pkg-config --cflags --libs leap)
 *
 * builds an app (at run time the loader must find libleap.so.1: DIR/lib in its search path or
 * an rpath of the app's). In the build tree, link with -Ltarget/release -lleap; llama.cpp's
 * libraries are next to libleap.so there.
 */
#ifndef LEAP_H
#define LEAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Version -------------------------------------------------------------------------- */

/* The version of this header: leap_version() is the library's. */
#define LEAP_VERSION_MAJOR 0
#define LEAP_VERSION_MINOR 1
#define LEAP_VERSION_PATCH 0
/* The binary interface of this header: the N of libleap.so.N. It changes whenever a program
 * built against an earlier header could misbehave with the new library (a struct that grew,
 * a function's arguments), and only then. */
#define LEAP_ABI_VERSION 1

/* The ABI version of the library loaded at run time. A program that loads libleap by path
 * (dlopen) rather than through its SONAME checks `leap_abi_version() == LEAP_ABI_VERSION`
 * before any other call. */
int32_t leap_abi_version(void);

/* ---- Status ---------------------------------------------------------------------------- */

typedef enum {
    LEAP_OK = 0,
    /* A NULL pointer, invalid UTF-8, a parameter out of range, a session already generating. */
    LEAP_ERR_INVALID_ARGUMENT = 1,
    /* The prompt and max_tokens do not fit the session's context (leap_model_params.n_ctx). */
    LEAP_ERR_CONTEXT_FULL = 2,
    /* The model file is missing, not a GGUF file, truncated, or llama.cpp cannot load it. */
    LEAP_ERR_MODEL = 3,
    /* llama.cpp failed otherwise: creating a context, decoding, applying the chat template. */
    LEAP_ERR_DECODE = 4,
    /* A bug in Leap, caught before it reached the caller (the message says where). A session
     * that reported it cannot be used again: free it and make a new one. */
    LEAP_ERR_INTERNAL = 5,
    /* An output buffer too small for the result; the call's n_out says how much is needed. */
    LEAP_ERR_BUFFER = 6,
    /* The app stopped the work: a progress callback that returned false. */
    LEAP_ERR_CANCELLED = 7
} leap_status;

/* The message of the last call that failed on the calling thread ("" if none). The string
 * belongs to Leap and stays valid until the next call into Leap on that thread. */
const char *leap_last_error(void);

/* A short description of a status ("ok", "invalid argument", ...). Static; never NULL. */
const char *leap_status_string(leap_status status);

/* Leap's version, "MAJOR.MINOR.PATCH". Static. */
const char *leap_version(void);

/* ---- Log ------------------------------------------------------------------------------- */

#define LEAP_LOG_NONE 0
#define LEAP_LOG_ERROR 1
#define LEAP_LOG_WARN 2
#define LEAP_LOG_INFO 3
#define LEAP_LOG_DEBUG 4
#define LEAP_LOG_TRACE 5

/* A log record: its LEAP_LOG_* level, where it comes from ("leap" or "llama.cpp"; llama.cpp's
 * informational lines are LEAP_LOG_DEBUG), and one line of text without its newline. Both
 * strings are valid during the call only. */
typedef void (*leap_log_callback)(int32_t level, const char *source, const char *message,
                                  void *user_data);

/* Send Leap's and llama.cpp's log to `callback`, every record up to `max_level` (LEAP_LOG_*;
 * LEAP_LOG_WARN is a sensible choice), instead of stderr; LEAP_LOG is not read then. NULL
 * goes back to stderr. Process-wide, like llama.cpp's llama_log_set; call it before
 * leap_model_open to see the load's log. The callback may be called from any thread, from
 * several at once, until it is replaced; it must not call into Leap.
 * LEAP_ERR_INVALID_ARGUMENT for a level out of range. */
leap_status leap_log_set(leap_log_callback callback, int32_t max_level, void *user_data);

/* ---- Model ----------------------------------------------------------------------------- */

typedef struct leap_model leap_model;

/* Called as the model's weights load with the fraction done (0 to 1, rising; 1 at the end).
 * Return true to go on, false to stop: leap_model_open then returns LEAP_ERR_CANCELLED. */
typedef bool (*leap_progress_callback)(float progress, void *user_data);

#define LEAP_MODE_LEAP 0  /* Leap's speculative engine (the default) */
#define LEAP_MODE_PLAIN 1 /* llama.cpp alone: one model call per token */

typedef struct {
    /* Threads for prompt processing and decoding, per session (default: one per physical core
     * the process may use, as llama.cpp's -t). */
    int32_t threads;
    /* Context length of each session, in tokens: prompt and output together (default 4096;
     * llama.cpp rounds it up to a multiple of 256). */
    uint32_t n_ctx;
    /* LEAP_MODE_LEAP or LEAP_MODE_PLAIN. */
    int32_t mode;
    /* Leap's ggml device computes the quantized matrix products (default true). This model's
     * sessions only: each session's context has a device of its own, so models opened with
     * different settings in one process each keep theirs (leap_stats.device_nodes). */
    bool leap_kernels;
    /* The model's sidecar file (its early-exit head speeds up Leap's verification), or NULL
     * for MODEL.leap.gguf next to the model, if there is one. */
    const char *sidecar;
    /* Called with the load's progress on the thread of leap_model_open (NULL, the default:
     * not called), with `progress_user_data`. */
    leap_progress_callback progress;
    void *progress_user_data;
} leap_model_params;

/* The defaults. Start from these and change what you need, so that fields added in later
 * versions get their default values. */
leap_model_params leap_model_default_params(void);

/* Load the GGUF model at `path` with `params` (NULL: the defaults) into `*out`.
 * Returns LEAP_ERR_MODEL for a missing or unreadable file, LEAP_ERR_INVALID_ARGUMENT for
 * parameters out of range. */
leap_status leap_model_open(const char *path, const leap_model_params *params, leap_model **out);

/* Free a model. Free its sessions first; a session keeps the model loaded until it is freed
 * itself, so the other order is safe too. NULL is a no-op. */
void leap_model_free(leap_model *model);

/* The tokens of `text` in `model`'s vocabulary. `add_special` adds what the model puts around a
 * prompt (BOS); `parse_special` turns the text of a control token ("<|im_start|>") into that
 * token. Writes their number to `*n_out` and, when `max` is at least that, the tokens to `out`;
 * otherwise LEAP_ERR_BUFFER (`out` may be NULL with `max` 0 to ask for the number). */
leap_status leap_tokenize(const leap_model *model, const char *text, bool add_special,
                          bool parse_special, int32_t *out, size_t max, size_t *n_out);

/* The text of `n_tokens` tokens (UTF-8; a character cut off at the end becomes U+FFFD).
 * `special` renders control tokens as their text, otherwise they give none. Writes its length
 * in bytes to `*n_out` and, when `size` is more than that, the text and a NUL to `out`;
 * otherwise LEAP_ERR_BUFFER. A token outside the vocabulary is LEAP_ERR_INVALID_ARGUMENT. */
leap_status leap_detokenize(const leap_model *model, const int32_t *tokens, size_t n_tokens,
                            bool special, char *out, size_t size, size_t *n_out);

/* ---- Session --------------------------------------------------------------------------- */

typedef struct leap_session leap_session;

/* A new session on `model` (its own llama.cpp context, n_ctx tokens of KV cache) into `*out`.
 * Sessions on one model may run on different threads at once. */
leap_status leap_session_new(leap_model *model, leap_session **out);

/* Free a session. NULL is a no-op. Not while a leap_generate on it is running. */
void leap_session_free(leap_session *session);

/* Stop the generation running on `session` as soon as it can (within a step of llama.cpp's
 * graph, prompt processing included). The one call on a session that may come from another
 * thread while leap_generate runs (from a UI's stop button). That leap_generate returns LEAP_OK
 * with finish LEAP_FINISH_CANCELLED; its stats count the tokens passed to the callback. A
 * cancel while nothing is generating is forgotten when the next generation starts. */
leap_status leap_session_cancel(leap_session *session);

/* ---- Generation ------------------------------------------------------------------------ */

typedef struct {
    /* Most tokens to generate (at least 1; default 128). */
    int32_t max_tokens;
    /* Sampling temperature; 0 (the default) is greedy decoding. */
    float temperature;
    /* Sampled decoding keeps the top_k most likely tokens (0: all; default 40), */
    int32_t top_k;
    /* the smallest set of them with probability top_p (0 to 1, 1: off; default 0.95), */
    float top_p;
    /* and those at least min_p times as likely as the best (0 to 1, 0: off; default 0.05). */
    float min_p;
    /* Seed of sampled decoding. */
    uint32_t seed;
    /* Wrap the prompt as one user message in the model's chat template (default false;
     * leap_generate_chat takes whole conversations). */
    bool chat;
    /* Stop strings (NULL and 0: none, the default): the output ends before the first of
     * these it contains, and neither it nor what follows is passed on; finish is then
     * LEAP_FINISH_STOP. `n_stop` non-empty strings at `stop`, read during the call. */
    const char *const *stop;
    size_t n_stop;
} leap_generate_params;

/* The defaults (greedy, 128 tokens, no chat template). */
leap_generate_params leap_generate_default_params(void);

/* Called for every generated token, in order, as soon as it is accepted.
 * `piece` is the token's text as complete UTF-8: `len` bytes, followed by a NUL for
 * convenience (`len` is authoritative). A character split across tokens arrives whole with
 * the token that completes it, so `len` may be 0. The end-of-generation token is not passed.
 * With stop strings, text that could begin one is held back until it is known not to, and
 * arrives with a later token.
 * After the last token, one more call with `token` -1 may carry what was held back: the
 * bytes of a character the generation stopped inside of (as U+FFFD), or the start of a stop
 * string the output ended with. Its return value is ignored.
 * Return true to go on, false to stop: the generation ends with the tokens so far, status
 * LEAP_OK and finish LEAP_FINISH_CANCELLED.
 * Do not call leap_generate, leap_session_totals or leap_session_free on the same session
 * from inside the callback (the first two return LEAP_ERR_INVALID_ARGUMENT). */
typedef bool (*leap_token_callback)(const char *piece, size_t len, int32_t token,
                                    void *user_data);

#define LEAP_FINISH_LENGTH 0    /* max_tokens reached */
#define LEAP_FINISH_EOG 1       /* the model ended its answer (end-of-generation token) */
#define LEAP_FINISH_CANCELLED 2 /* the callback returned false, or leap_session_cancel */
#define LEAP_FINISH_STOP 3      /* a stop string (leap_generate_params.stop) */

typedef struct {
    /* Tokens in the prompt (BOS and the chat template's included). */
    uint64_t prompt_tokens;
    /* Tokens generated (an end-of-generation token included). */
    uint64_t tokens;
    /* Model calls after the prompt: one a token for plain decoding, fewer with Leap. */
    uint64_t target_calls;
    /* tokens / target_calls. */
    double accepted_per_call;
    /* Seconds processing the prompt. */
    double prefill_seconds;
    /* Seconds decoding, after the prompt. */
    double decode_seconds;
    /* LEAP_FINISH_*: why the generation ended (in totals: the last generation's). */
    int32_t finish;
    /* Graph nodes Leap's ggml device computed for the session's context (0 when its model
     * was opened with leap_kernels false). */
    uint64_t device_nodes;
} leap_stats;

/* Generate from `prompt` on `session` with `params` (NULL: the defaults), calling `callback`
 * (may be NULL) with `user_data` for each token, and write what the generation did to
 * `*stats` (may be NULL). The model sees only `prompt`: to continue a conversation, pass all
 * of it. The session keeps the KV cache of its last prompt and output, so a prompt that
 * extends them (the next turn) is processed only for what is new, and earlier generations
 * give Leap's drafter more to draft from.
 * Returns LEAP_ERR_CONTEXT_FULL, before any work, when the prompt and max_tokens do not fit
 * the session's context. Greedy output is token for token plain decoding's; sampled output
 * follows the same distribution. */
leap_status leap_generate(leap_session *session, const char *prompt,
                          const leap_generate_params *params, leap_token_callback callback,
                          void *user_data, leap_stats *stats);

/* A message of a conversation: `role` "system", "user" or "assistant" (what the model's chat
 * template knows), `content` its text. */
typedef struct {
    const char *role;
    const char *content;
} leap_chat_message;

/* Generate the assistant's next message after `n_messages` messages in the model's chat
 * template; otherwise as leap_generate (`params->chat` is not read). The text of a message
 * is text: "<|im_end|>" in it cannot end its turn. A conversation that grows by a turn at a
 * time is processed only for what is new, as leap_generate's prompts are. */
leap_status leap_generate_chat(leap_session *session, const leap_chat_message *messages,
                               size_t n_messages, const leap_generate_params *params,
                               leap_token_callback callback, void *user_data, leap_stats *stats);

/* Everything `session` generated so far, summed over its generations. */
leap_status leap_session_totals(const leap_session *session, leap_stats *out);

/* ---- Drafting for a host that verifies ------------------------------------------------- */

/* Leap's drafter for a program that runs the model itself and verifies drafts as one chain,
 * the way llama.cpp's speculative decoding does (llama.cpp built with -DLLAMA_LEAP=ON uses it
 * for --spec-type leap; patches/ in Leap's tree). It needs no model: it drafts from the
 * sequence's own tokens (the prompt and the output so far) and from its earlier requests and
 * answers, and sizes each draft by what drafts of that kind were accepted and what a step of
 * so many rows cost on this machine, both learned as the host goes. Lossless by construction:
 * the host keeps only the drafted tokens its target would have produced.
 *
 * One drafter per sequence (a llama-server slot: leap_drafter_new for the first,
 * leap_drafter_new_sibling for the others), each used by one thread at a time. */
typedef struct leap_drafter leap_drafter;

typedef struct {
    /* Most tokens in one draft (1 to 256; default 16). */
    int32_t max_draft;
    /* Shortest suffix match of the text to draft from (1 to 64; default 2). */
    int32_t min_match;
    /* Tokens of the sequence's earlier requests and answers kept for drafting (0: none;
     * default 65536). */
    int32_t history_tokens;
} leap_drafter_params;

leap_drafter_params leap_drafter_default_params(void);

/* A new drafter with `params` (NULL: the defaults) into `*out`. */
leap_status leap_drafter_new(const leap_drafter_params *params, leap_drafter **out);

/* A drafter for another sequence of the same host into `*out`: its own text and history, but
 * what `of` learns of acceptance and of the cost of a step (and it of them) is shared, one
 * model on one machine. Free each on its own, in any order. */
leap_status leap_drafter_new_sibling(leap_drafter *of, leap_drafter **out);

/* Draft from the model's own answers to other prompts too: the corpus `leap corpus` writes into
 * the model's sidecar, here the sidecar at `sidecar` (NULL: MODEL.leap.gguf next to the model),
 * checked against the GGUF model at `model_path` (the host's target; it is not loaded, only its
 * output weights' fingerprint read). Siblings made afterwards share it. `*answers` (if not
 * NULL) gets the number of answers loaded: 0, with LEAP_OK, when there is no such sidecar or
 * no corpus in it. LEAP_ERR_MODEL, with the reason, when one is there and cannot be used (the
 * answers of another model, an unreadable file); the drafter then drafts as before. */
leap_status leap_drafter_use_corpus(leap_drafter *drafter, const char *model_path,
                                    const char *sidecar, size_t *answers);

/* Free a drafter. NULL is a no-op. */
void leap_drafter_free(leap_drafter *drafter);

/* A generation starts: the sequence holds `prompt` (n_prompt tokens). The last generation,
 * if any, joins the drafter's history. */
leap_status leap_drafter_begin(leap_drafter *drafter, const int32_t *prompt, size_t n_prompt);

/* The host is about to decode `id_last` (sampled, not yet in the sequence) after the
 * sequence's `n_tokens` tokens: write at most `max` tokens to verify after it into `out`
 * (room for `max`), and their number into `*n_out` (0: a plain step pays best now).
 * The drafter learns how many of its last draft were kept from the tokens the host appended
 * since, and what a step cost from the time between calls. A `tokens` that does not extend
 * the last call's starts a new generation from it. Where Leap's device met flash attention
 * whose verification rows it cannot compute as the host's ggml computes a row alone (a ggml
 * whose arithmetic the device's start-up check does not find), it writes 0 every time, with a
 * warning, so that the host's output stays plain decoding's. */
leap_status leap_drafter_draft(leap_drafter *drafter, const int32_t *tokens, size_t n_tokens,
                               int32_t id_last, int32_t max, int32_t *out, size_t *n_out);

typedef struct {
    uint64_t steps;    /* leap_drafter_draft calls */
    uint64_t drafts;   /* of those, the ones that drafted */
    uint64_t drafted;  /* tokens drafted */
    uint64_t accepted; /* drafted tokens the host kept */
} leap_drafter_stats;

leap_status leap_drafter_get_stats(const leap_drafter *drafter, leap_drafter_stats *out);

/* Put Leap's ggml device (leap-cpu) in ggml's backend registry, as llama.cpp's own backends
 * are, for contexts created afterwards; configured from the environment like the plugin
 * libggml_leap.so (LEAP_KERNELS, LEAP_SPARSE, LEAP_ESTIMATE, LEAP_QNN, LEAP_OUTPUT,
 * LEAP_STATS). Unlike the plugin's, the device here takes the output projection too, unless
 * LEAP_OUTPUT=ggml leaves it to ggml. Its matrix products give each row of a batch what ggml
 * gives the row alone. Once per process; later calls do nothing. leap_model_open registers
 * the device itself (when leap_kernels is set) but reads none of these variables. */
leap_status leap_backend_register(void);

#ifdef __cplusplus
}
#endif

#endif /* LEAP_H */
