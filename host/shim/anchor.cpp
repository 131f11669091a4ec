// llama.cpp's own speculative decoding, driven as llama-server drives it (one slot, seq 0):
// process() after every target decode, begin() once the prompt is in the KV, per step a draft
// from the tokens in the KV plus the last sampled token, one batched target call, exact-match
// acceptance with the target's sampler, accept(n), seq_rm of the rejected tail in both contexts.
#include "anchor.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <numeric>
#include <string>
#include <vector>

#include "common.h"
#include "log.h"
#include "sampling.h"
#include "speculative.h"

struct leap_anchor {
    llama_context * ctx_tgt = nullptr;
    llama_context * ctx_dft = nullptr;
    common_speculative * spec = nullptr;
    common_sampler * smpl = nullptr;
    common_batch batch;
    llama_tokens hist;   // tokens in the target KV (excludes id_last)
    llama_tokens draft;
    llama_token id_last = LLAMA_TOKEN_NULL;
    int32_t n_prompt_last = 0;
};

static void set_err(char * err, size_t len, const std::string & msg) {
    if (err && len > 0) {
        std::snprintf(err, len, "%s", msg.c_str());
    }
}

static bool decode_and_process(leap_anchor * a, char * err, size_t err_len) {
    const int32_t rc = llama_process(a->ctx_tgt, LLAMA_PROCESS_TYPE_DECODE, a->batch.get());
    if (rc != 0) {
        set_err(err, err_len, "target decode failed with status " + std::to_string(rc));
        return false;
    }
    if (!common_speculative_process(a->spec, a->batch)) {
        set_err(err, err_len, "the drafter failed to process the target batch");
        return false;
    }
    return true;
}

extern "C" leap_anchor * leap_anchor_new(llama_context * ctx_tgt, llama_context * ctx_dft, const char * type,
                                         const leap_anchor_params * p, char * err, size_t err_len) {
    try {
        common_log_set_verbosity_thold(p->log_verbosity);
        const auto t = common_speculative_type_from_name(type ? type : "");
        if (t == COMMON_SPECULATIVE_TYPE_COUNT || t == COMMON_SPECULATIVE_TYPE_NONE) {
            set_err(err, err_len, std::string("unknown speculative type '") + (type ? type : "") + "'");
            return nullptr;
        }
        common_params_speculative sp;
        sp.types = { t };
        sp.draft.ctx_tgt = ctx_tgt;
        sp.draft.ctx_dft = t == COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE ? ctx_dft : nullptr;
        if (p->draft_n_max >= 0) sp.draft.n_max = p->draft_n_max;
        if (p->draft_n_min >= 0) sp.draft.n_min = p->draft_n_min;
        if (p->draft_p_min >= 0) sp.draft.p_min = p->draft_p_min;

        auto * a = new leap_anchor();
        a->ctx_tgt = ctx_tgt;
        a->ctx_dft = sp.draft.ctx_dft;
        a->spec = common_speculative_init(sp, 1);
        if (a->spec == nullptr) {
            delete a;
            set_err(err, err_len, "llama.cpp enabled no speculative implementation");
            return nullptr;
        }
        common_params_sampling sparams;
        sparams.temp  = p->temp;
        sparams.top_k = p->top_k;
        sparams.top_p = p->top_p;
        sparams.min_p = p->min_p;
        sparams.seed  = p->seed;
        a->smpl = common_sampler_init(llama_get_model(ctx_tgt), sparams);
        a->batch = common_batch(ctx_tgt);
        return a;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
    } catch (...) {
        set_err(err, err_len, "unknown C++ exception");
    }
    return nullptr;
}

extern "C" void leap_anchor_free(leap_anchor * a) {
    if (a == nullptr) return;
    if (a->spec) common_speculative_free(a->spec);
    if (a->smpl) common_sampler_free(a->smpl);
    delete a;
}

extern "C" int32_t leap_anchor_prefill(leap_anchor * a, const llama_token * prompt, int32_t n_prompt, char * err,
                                       size_t err_len) {
    try {
        llama_memory_clear(llama_get_memory(a->ctx_tgt), false);
        if (a->ctx_dft) llama_memory_clear(llama_get_memory(a->ctx_dft), false);
        common_sampler_reset(a->smpl);
        a->hist.assign(prompt, prompt + n_prompt);
        a->draft.clear();
        const int32_t n_batch = (int32_t) llama_n_batch(a->ctx_tgt);
        for (int32_t i = 0; i < n_prompt; i += n_batch) {
            const int32_t n = std::min(n_batch, n_prompt - i);
            a->batch.clear();
            for (int32_t k = 0; k < n; ++k) {
                a->batch.add(prompt[i + k], i + k, 0, i + k == n_prompt - 1);
            }
            if (!decode_and_process(a, err, err_len)) return 1;
        }
        a->n_prompt_last = a->batch.size() - 1;
        return 0;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
    }
    return 1;
}

extern "C" llama_token leap_anchor_first(leap_anchor * a) {
    try {
        const llama_token id = common_sampler_sample(a->smpl, a->ctx_tgt, a->n_prompt_last);
        common_sampler_accept(a->smpl, id, true);
        common_speculative_begin(a->spec, 0, a->hist);
        a->id_last = id;
        return id;
    } catch (...) {
        return LLAMA_TOKEN_NULL;
    }
}

extern "C" int32_t leap_anchor_step(leap_anchor * a, int32_t n_remaining, llama_token * out, int32_t cap,
                                    int32_t * n_drafted, char * err, size_t err_len) {
    try {
        const llama_pos pos0 = (llama_pos) a->hist.size();
        int32_t n_draft_max = (int32_t) llama_n_ctx(a->ctx_tgt) - (int32_t) a->hist.size() - 2;
        if (n_remaining > 0) n_draft_max = std::min(n_draft_max, n_remaining - 1);
        n_draft_max = std::min(n_draft_max, cap - 1);
        a->draft.clear();
        auto & dp = common_speculative_get_draft_params(a->spec, 0);
        dp.drafting = false;
        if (n_draft_max > 0) {
            dp = {};
            dp.drafting = true;
            dp.n_max    = n_draft_max;
            dp.pos0     = pos0;
            dp.id_last  = a->id_last;
            dp.prompt   = &a->hist;
            dp.result   = &a->draft;
            common_speculative_draft(a->spec);
            if (a->ctx_dft) llama_memory_seq_rm(llama_get_memory(a->ctx_dft), 0, pos0, -1);
        }
        *n_drafted = (int32_t) a->draft.size();

        a->batch.clear();
        a->batch.add(a->id_last, pos0, 0, true);
        for (size_t i = 0; i < a->draft.size(); ++i) {
            a->batch.add(a->draft[i], pos0 + 1 + (llama_pos) i, 0, true);
        }
        if (!decode_and_process(a, err, err_len)) return -1;

        std::vector<llama_token> ids;
        if (a->draft.empty()) {
            ids = { common_sampler_sample(a->smpl, a->ctx_tgt, 0) };
            common_sampler_accept(a->smpl, ids[0], true);
        } else {
            std::vector<int> idxs(a->draft.size() + 1);
            std::iota(idxs.begin(), idxs.end(), 0);
            ids = common_sampler_sample_and_accept_n(a->smpl, a->ctx_tgt, idxs, a->draft);
            common_speculative_accept(a->spec, 0, (uint16_t) (ids.size() - 1));
        }
        a->hist.push_back(a->id_last);
        a->hist.insert(a->hist.end(), ids.begin(), ids.end() - 1);
        a->id_last = ids.back();
        llama_memory_seq_rm(llama_get_memory(a->ctx_tgt), 0, (llama_pos) a->hist.size(), -1);
        if (a->ctx_dft) llama_memory_seq_rm(llama_get_memory(a->ctx_dft), 0, (llama_pos) a->hist.size(), -1);

        const int32_t n = std::min((int32_t) ids.size(), cap);
        std::memcpy(out, ids.data(), sizeof(llama_token) * (size_t) n);
        return n;
    } catch (const std::exception & e) {
        set_err(err, err_len, e.what());
    } catch (...) {
        set_err(err, err_len, "unknown C++ exception");
    }
    return -1;
}
