// C API over llama.cpp's own speculative decoding (common/speculative.h), driven the way
// llama-server drives it. Leap benchmarks itself against this. See host/src/anchor.rs.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct leap_anchor leap_anchor;

typedef struct leap_anchor_params {
    // target sampler (llama.cpp's common_sampler); temp <= 0 is greedy
    float    temp;
    int32_t  top_k;
    float    top_p;
    float    min_p;
    uint32_t seed;
    // draft-simple overrides; a negative value keeps llama.cpp's default
    int32_t  draft_n_max;
    int32_t  draft_n_min;
    float    draft_p_min;
    // verbosity threshold for llama.cpp's common/ log (which prints to stderr on its own):
    // 1 errors, 2 warnings, 3 info, 5 debug
    int32_t  log_verbosity;
} leap_anchor_params;

// Create a speculative decoder of `type` (a llama.cpp name: ngram-simple, ngram-map-k,
// ngram-map-k4v, ngram-mod, ngram-cache, draft-simple). `ctx_dft` is required for
// draft-simple and ignored otherwise. Returns NULL and writes a message into `err` on failure.
leap_anchor * leap_anchor_new(struct llama_context * ctx_tgt, struct llama_context * ctx_dft, const char * type,
                              const leap_anchor_params * params, char * err, size_t err_len);
void leap_anchor_free(leap_anchor * a);

// Clear both contexts' memory and decode `prompt` (sequence 0, from position 0) in chunks of the
// context's n_batch, mirroring every chunk into the drafter. Returns 0, or nonzero with `err`.
int32_t leap_anchor_prefill(leap_anchor * a, const llama_token * prompt, int32_t n_prompt, char * err, size_t err_len);

// Sample the first generated token from the prompt's last logits and start the drafter.
llama_token leap_anchor_first(leap_anchor * a);

// One speculative step: draft (at most n_remaining - 1 tokens), one target call on
// [last token, draft...], acceptance with the target's sampler, KV rollback. Writes the accepted
// tokens (>= 1) to `out` (capacity `cap`, at least the draft max + 1). Returns their count, or
// a negative value with `err`. `*n_drafted` receives the draft length.
int32_t leap_anchor_step(leap_anchor * a, int32_t n_remaining, llama_token * out, int32_t cap, int32_t * n_drafted,
                         char * err, size_t err_len);

#ifdef __cplusplus
}
#endif
