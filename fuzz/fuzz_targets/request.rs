//! The server's request bodies: what the routes of `leap serve` do with a body before the
//! engine sees it (parse, check the fields, check token ids and the context), for
//! /completion(s), /v1/chat/completions, /tokenize and /detokenize; and the error body a
//! client gets back.
#![no_main]

use leap_server::error::ApiError;
use leap_server::oai::{self, ChatRequest, CompletionRequest, Prompt};
use leap_server::routes::to_tokens;
use libfuzzer_sys::fuzz_target;

/// Gemma 3's vocabulary and `leap serve`'s default context.
const N_VOCAB: i32 = 262_144;
const N_CTX: u32 = 4096;

fuzz_target!(|data: &[u8]| {
    // /completion, /completions, /v1/completions.
    match oai::parse::<CompletionRequest>(data).and_then(|r| Ok((r.common.params()?, r.prompt))) {
        Ok((params, prompt)) => {
            if let Some(m) = params.max_tokens {
                assert!(m >= 1);
            }
            assert!(params.stop.len() <= 4);
            let n = match &prompt {
                Prompt::Tokens(ids) => to_tokens(ids, N_VOCAB, "prompt").map(|t| t.len()),
                Prompt::Text(t) => Ok(t.len()),
                Prompt::Texts(v) => Ok(v.iter().map(String::len).sum()),
            };
            if let Ok(n) = n {
                let fits = leap_spec::session::fits(n, params.max_tokens.unwrap_or(1), N_CTX)
                    .map_err(ApiError::from);
                if let Err(e) = fits {
                    check(&e);
                }
            }
        }
        Err(e) => check(&e),
    }

    // /v1/chat/completions, /chat/completions.
    match oai::parse::<ChatRequest>(data) {
        Ok(r) => {
            if let Err(e) = r.common.params() {
                check(&e);
            }
            for (i, m) in r.messages.iter().enumerate() {
                match m.to_chat(i) {
                    Ok(c) => assert!(["system", "user", "assistant"].contains(&c.role.as_str())),
                    Err(e) => check(&e),
                }
            }
        }
        Err(e) => check(&e),
    }

    // /completion: the completion fields and `return_tokens`.
    match oai::parse::<oai::NativeRequest>(data) {
        Ok(r) => {
            if let Err(e) = r.0.common.params() {
                check(&e);
            }
        }
        Err(e) => check(&e),
    }

    // /tokenize and /detokenize take `content` and `tokens`: the same parser without the
    // completion fields' table, any JSON.
    match oai::parse_plain::<serde_json::Value>(data) {
        Ok(v) => {
            if let Some(ids) = v.get("tokens").and_then(|t| t.as_array()) {
                let ids: Vec<i64> = ids.iter().filter_map(serde_json::Value::as_i64).collect();
                if let Err(e) = to_tokens(&ids, N_VOCAB, "tokens") {
                    check(&e);
                }
            }
        }
        Err(e) => check(&e),
    }
});

/// A client mistake is a 4xx with an OpenAI-style error object.
fn check(e: &ApiError) {
    assert!(e.status.is_client_error(), "{e:?}");
    let body = e.body();
    assert!(body["error"]["message"].is_string());
}
