//! What each field of a completion or chat request does here, so that none is dropped in
//! silence. An app that asks for JSON output, tool calls or log-probabilities and gets plain
//! text with a 200 has a wrong answer it cannot see; here it gets a 400 naming the field.
//!
//! Every field of OpenAI's and llama-server's completion and chat requests (llama-server's
//! `tools/server/README.md` of the llama.cpp Leap builds, OpenAI's API reference) is in
//! [`FIELDS`], with one of three rules:
//! - [`Rule::Honoured`]: read and applied ([`crate::oai`] parses it).
//! - [`Rule::NoEffect`]: nothing a client receives depends on it here: the model's name (one
//!   model is served), the caller's metadata, and the settings of a sampler that is off (the
//!   field that turns it on is [`Rule::Neutral`]).
//! - [`Rule::Neutral`]: accepted at the values that leave the output as it is without the
//!   field (llama.cpp's defaults: `presence_penalty: 0`, `tools: []`, ...), which clients and
//!   SDKs often send; any other value is a 400.
//!
//! A field in neither API is a 400 too (OpenAI answers an unknown argument the same way): a
//! misspelt `max_token` would otherwise run to the end of the context.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Which request a field belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/completions`.
    Completion,
    /// llama-server's own `/completion`: the completion fields, and `return_tokens`.
    Native,
    /// `/v1/chat/completions` (and `/apply-template`, which reads the same body).
    Chat,
}

/// What a field does here (see the module's docs).
#[derive(Clone, Copy)]
pub enum Rule {
    Honoured,
    NoEffect,
    /// Accepted where the test holds; the text says which values that is.
    Neutral(fn(&Value) -> bool, &'static str),
}

/// Where a field is read: both endpoints, or one.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum On {
    Both,
    Only(Endpoint),
}

use Endpoint::{Chat, Completion};
use On::{Both, Only};
use Rule::{Honoured, Neutral, NoEffect};

fn null(v: &Value) -> bool {
    v.is_null()
}
fn zero(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}
fn one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
fn not_positive(v: &Value) -> bool {
    v.is_null() || v.as_f64().is_some_and(|x| x <= 0.0)
}
fn falsy(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}
fn truthy(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(true)
}
fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
fn no_tool(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("none" | "auto"))
}
fn only_text(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(|a| a == &[Value::from("text")])
}
fn no_usage(v: &Value) -> bool {
    v.is_null()
        || !v
            .get("include_usage")
            .is_some_and(|u| u == &Value::Bool(true))
}
fn no_reasoning(v: &Value) -> bool {
    v.is_null() || v.as_str() == Some("none")
}

/// llama-server's `samplers` naming the chain this server runs: top-k, top-p, min-p, then
/// temperature, in that order, with any of the samplers that are off here in between.
fn default_samplers(v: &Value) -> bool {
    // The samplers this server turns off (their switches are `Neutral`), by llama.cpp's
    // names and one-letter codes.
    const OFF: &[&str] = &[
        "penalties",
        "dry",
        "typ_p",
        "typical_p",
        "xtc",
        "top_n_sigma",
        "e",
        "d",
        "y",
        "x",
        "s",
    ];
    let names: Vec<String> = match v {
        Value::Null => return true,
        Value::String(s) => s.chars().map(String::from).collect(),
        Value::Array(a) => match a.iter().map(|x| x.as_str().map(str::to_owned)).collect() {
            Some(n) => n,
            None => return false,
        },
        _ => return false,
    };
    let on: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| !OFF.contains(n))
        .map(|n| match n {
            "k" => "top_k",
            "p" => "top_p",
            "m" => "min_p",
            "t" => "temperature",
            n => n,
        })
        .collect();
    on == ["top_k", "top_p", "min_p", "temperature"]
}

/// Every field of OpenAI's and llama-server's completion and chat requests, and its rule.
pub const FIELDS: &[(&str, On, Rule)] = &[
    // What to complete.
    ("prompt", Only(Completion), Honoured),
    ("parse_special", Only(Completion), Honoured),
    ("messages", Only(Chat), Honoured),
    // How much, how and how to answer.
    ("max_tokens", Both, Honoured),
    ("max_completion_tokens", Both, Honoured),
    ("n_predict", Both, Honoured),
    ("temperature", Both, Honoured),
    ("top_k", Both, Honoured),
    ("top_p", Both, Honoured),
    ("min_p", Both, Honoured),
    ("seed", Both, Honoured),
    ("stop", Both, Honoured),
    ("stream", Both, Honoured),
    ("stream_options", Both, Honoured),
    ("n", Both, Honoured),
    ("cache_prompt", Both, Honoured),
    ("logprobs", Both, Honoured),
    ("top_logprobs", Both, Honoured),
    // Nothing a client receives depends on these here.
    ("model", Both, NoEffect),
    ("user", Both, NoEffect),
    ("metadata", Both, NoEffect),
    ("service_tier", Both, NoEffect),
    // Only for a context shift, which this server never does (a prompt that does not fit is
    // refused, a generation stops at the context's end).
    ("n_keep", Both, NoEffect),
    // The settings of samplers that are off (their switches are below).
    ("repeat_last_n", Both, NoEffect),
    ("dry_base", Both, NoEffect),
    ("dry_allowed_length", Both, NoEffect),
    ("dry_penalty_last_n", Both, NoEffect),
    ("dry_sequence_breakers", Both, NoEffect),
    ("xtc_threshold", Both, NoEffect),
    ("mirostat_tau", Both, NoEffect),
    ("mirostat_eta", Both, NoEffect),
    ("dynatemp_exponent", Both, NoEffect),
    ("parallel_tool_calls", Only(Chat), Honoured),
    ("parallel_tool_calls", Only(Completion), NoEffect),
    // Accepted only where they change nothing.
    ("presence_penalty", Both, Neutral(zero, "0")),
    ("frequency_penalty", Both, Neutral(zero, "0")),
    ("repeat_penalty", Both, Neutral(one, "1")),
    ("typical_p", Both, Neutral(one, "1")),
    ("dry_multiplier", Both, Neutral(zero, "0")),
    ("xtc_probability", Both, Neutral(zero, "0")),
    ("mirostat", Both, Neutral(zero, "0")),
    ("dynatemp_range", Both, Neutral(zero, "0")),
    ("top_n_sigma", Both, Neutral(not_positive, "-1 (off)")),
    ("min_keep", Both, Neutral(zero, "0")),
    (
        "samplers",
        Both,
        Neutral(default_samplers, "top_k, top_p, min_p, temp"),
    ),
    ("logit_bias", Both, Neutral(empty, "{} or []")),
    ("ignore_eos", Both, Neutral(falsy, "false")),
    ("n_probs", Both, Neutral(zero, "0")),
    ("post_sampling_probs", Both, Neutral(falsy, "false")),
    ("grammar", Both, Honoured),
    ("json_schema", Both, Honoured),
    ("response_format", Both, Honoured),
    // Chat calls tools ([`crate::tools`]); a completion has no messages to call them from.
    ("tools", Only(Chat), Honoured),
    ("tool_choice", Only(Chat), Honoured),
    (
        "tools",
        Only(Completion),
        Neutral(empty, "[] (chat calls tools)"),
    ),
    (
        "tool_choice",
        Only(Completion),
        Neutral(no_tool, "\"none\" or \"auto\" (no tools)"),
    ),
    ("functions", Both, Neutral(empty, "[]")),
    (
        "function_call",
        Both,
        Neutral(no_tool, "\"none\" or \"auto\""),
    ),
    ("n_indent", Both, Neutral(zero, "0")),
    ("t_max_predict_ms", Both, Neutral(zero, "0")),
    ("id_slot", Both, Honoured),
    ("timings_per_token", Both, Neutral(falsy, "false")),
    ("return_tokens", Both, Neutral(falsy, "false")),
    ("return_progress", Both, Neutral(falsy, "false")),
    ("response_fields", Both, Neutral(empty, "[]")),
    ("lora", Both, Neutral(empty, "[]")),
    ("image_data", Both, Neutral(empty, "[]")),
    ("multimodal_data", Both, Neutral(empty, "[]")),
    ("echo", Only(Completion), Neutral(falsy, "false")),
    ("best_of", Only(Completion), Neutral(one, "1")),
    ("suffix", Only(Completion), Neutral(empty, "\"\"")),
    ("chat_template_kwargs", Only(Chat), Neutral(empty, "{}")),
    ("add_generation_prompt", Only(Chat), Neutral(truthy, "true")),
    (
        "continue_final_message",
        Only(Chat),
        Neutral(falsy, "false"),
    ),
    (
        "reasoning_format",
        Only(Chat),
        Neutral(no_reasoning, "\"none\""),
    ),
    ("reasoning_effort", Only(Chat), Neutral(null, "null")),
    ("store", Only(Chat), Neutral(falsy, "false")),
    ("modalities", Only(Chat), Neutral(only_text, "[\"text\"]")),
    ("audio", Only(Chat), Neutral(null, "null")),
    ("prediction", Only(Chat), Neutral(null, "null")),
    ("web_search_options", Only(Chat), Neutral(null, "null")),
];

/// Where llama-server's own `/completion` reads a completion field otherwise than
/// `/v1/completions` does.
const NATIVE_FIELDS: &[(&str, Rule)] = &[
    // The generated token ids in the answer.
    ("return_tokens", Honoured),
    // It reports probabilities with `n_probs` (`completion_probabilities`); OpenAI's
    // `logprobs` are `/v1/completions`'.
    ("n_probs", Honoured),
    (
        "logprobs",
        Neutral(falsy, "false here; /v1/completions takes logprobs"),
    ),
    ("top_logprobs", Neutral(zero, "0")),
    // Its stream has no usage chunk: the last object carries the counts.
    (
        "stream_options",
        Neutral(
            no_usage,
            "no include_usage: the last object has tokens_predicted",
        ),
    ),
];

/// The fields of a chat message and their rules (`content` parts are checked by
/// [`crate::oai::Message::to_chat`]).
const MESSAGE_FIELDS: &[(&str, Rule)] = &[
    ("role", Honoured),
    ("content", Honoured),
    // llama.cpp's built-in chat templates (the ones this server applies) do not render it.
    ("name", NoEffect),
    ("tool_calls", Honoured),
    ("tool_call_id", Honoured),
    ("function_call", Neutral(null, "null")),
    ("refusal", Neutral(null, "null")),
    ("audio", Neutral(null, "null")),
    ("reasoning_content", Neutral(empty, "null")),
];

/// The rule for `name` in a request to `ep`, if the field is one of its: `/completion`'s own
/// rows ([`NATIVE_FIELDS`]) first, then the completion fields it shares.
pub fn rule(name: &str, ep: Endpoint) -> Option<Rule> {
    let ep = match ep {
        Endpoint::Native => {
            if let Some(&(_, r)) = NATIVE_FIELDS.iter().find(|(n, _)| *n == name) {
                return Some(r);
            }
            Completion
        }
        ep => ep,
    };
    FIELDS
        .iter()
        .find(|(n, on, _)| *n == name && (*on == Both || *on == Only(ep)))
        .map(|&(_, _, r)| r)
}

/// A 400 for `param` = `v`, which this server does not apply.
fn refused(param: &str, v: &Value, accepted: &str) -> ApiError {
    let mut shown = v.to_string();
    if shown.len() > 80 {
        let mut end = 77;
        while !shown.is_char_boundary(end) {
            end -= 1;
        }
        shown = format!("{}...", &shown[..end]);
    }
    ApiError::invalid(
        format!(
            "{param} = {shown}: not supported by this server (accepted: {accepted}); \
             it is refused rather than ignored so that the answer is not silently different"
        ),
        Some(param),
    )
}

/// Check every field of a request body (and of its chat messages) against its rule.
///
/// # Errors
/// A 400 naming the first field that is not in the request's API, or that is at a value this
/// server would not apply.
pub fn check(body: &Map<String, Value>, ep: Endpoint) -> Result<(), ApiError> {
    for (name, v) in body {
        match rule(name, ep) {
            None => {
                let elsewhere = match ep {
                    Completion | Endpoint::Native if rule(name, Chat).is_some() => {
                        " (it is a chat field)"
                    }
                    Chat if rule(name, Completion).is_some() => " (it is a completion field)",
                    _ => "",
                };
                return Err(ApiError::invalid(
                    format!("unknown field {name:?}{elsewhere}"),
                    Some(name),
                ));
            }
            Some(Neutral(ok, accepted)) if !ok(v) => return Err(refused(name, v, accepted)),
            Some(_) => {}
        }
    }
    if let Some(Value::Array(msgs)) = body.get("messages") {
        for (i, m) in msgs.iter().enumerate() {
            let Some(m) = m.as_object() else { continue };
            for (name, v) in m {
                let param = format!("messages[{i}].{name}");
                match MESSAGE_FIELDS.iter().find(|(n, _)| n == name) {
                    None => {
                        return Err(ApiError::invalid(
                            format!("unknown field {name:?} in a message"),
                            Some(&param),
                        ))
                    }
                    Some((_, Neutral(ok, accepted))) if !ok(v) => {
                        return Err(refused(&param, v, accepted))
                    }
                    Some(_) => {}
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Every field of OpenAI's and llama-server's completion and chat requests, with a value
    /// a client would send to use it.
    fn every_field(ep: Endpoint) -> Vec<(&'static str, Value)> {
        let mut v = vec![
            ("model", json!("gpt-4o")),
            ("max_tokens", json!(8)),
            ("max_completion_tokens", json!(8)),
            ("n_predict", json!(8)),
            ("temperature", json!(0.5)),
            ("top_k", json!(10)),
            ("top_p", json!(0.9)),
            ("min_p", json!(0.1)),
            ("seed", json!(3)),
            ("stop", json!(["\n"])),
            ("stream", json!(false)),
            ("stream_options", json!({"include_usage": true})),
            ("n", json!(1)),
            ("cache_prompt", json!(false)),
            ("user", json!("u1")),
            ("metadata", json!({"a": "b"})),
            ("service_tier", json!("auto")),
            ("n_keep", json!(10)),
            ("repeat_last_n", json!(32)),
            ("dry_base", json!(1.5)),
            ("dry_allowed_length", json!(3)),
            ("dry_penalty_last_n", json!(-1)),
            ("dry_sequence_breakers", json!(["\n"])),
            ("xtc_threshold", json!(0.2)),
            ("mirostat_tau", json!(4.0)),
            ("mirostat_eta", json!(0.2)),
            ("dynatemp_exponent", json!(1.5)),
            ("parallel_tool_calls", json!(false)),
            ("presence_penalty", json!(0.5)),
            ("frequency_penalty", json!(0.5)),
            ("repeat_penalty", json!(1.1)),
            ("typical_p", json!(0.9)),
            ("dry_multiplier", json!(0.8)),
            ("xtc_probability", json!(0.5)),
            ("mirostat", json!(2)),
            ("dynatemp_range", json!(0.5)),
            ("top_n_sigma", json!(1.0)),
            ("min_keep", json!(5)),
            ("samplers", json!(["temperature", "top_k"])),
            ("logit_bias", json!({"15": -100})),
            ("ignore_eos", json!(true)),
            ("logprobs", json!(true)),
            ("top_logprobs", json!(3)),
            ("n_probs", json!(3)),
            ("post_sampling_probs", json!(true)),
            ("grammar", json!("root ::= \"a\"")),
            ("json_schema", json!({"type": "object"})),
            ("response_format", json!({"type": "json_object"})),
            (
                "tools",
                json!([{"type": "function", "function": {"name": "f"}}]),
            ),
            ("tool_choice", json!("required")),
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!({"name": "f"})),
            ("n_indent", json!(4)),
            ("t_max_predict_ms", json!(500)),
            ("id_slot", json!(0)),
            ("timings_per_token", json!(true)),
            ("return_tokens", json!(true)),
            ("return_progress", json!(true)),
            ("response_fields", json!(["content"])),
            ("lora", json!([{"id": 0, "scale": 1.0}])),
            ("image_data", json!([{"data": "AA==", "id": 1}])),
            ("multimodal_data", json!(["AA=="])),
        ];
        match ep {
            Endpoint::Native => unreachable!("the tests send completion fields"),
            Completion => v.extend([
                ("prompt", json!("x")),
                ("parse_special", json!(true)),
                ("echo", json!(true)),
                ("best_of", json!(2)),
                ("suffix", json!("end")),
            ]),
            Chat => v.extend([
                ("messages", json!([{"role": "user", "content": "x"}])),
                ("chat_template_kwargs", json!({"enable_thinking": false})),
                ("add_generation_prompt", json!(false)),
                ("continue_final_message", json!(true)),
                ("reasoning_format", json!("deepseek")),
                ("reasoning_effort", json!("low")),
                ("store", json!(true)),
                ("modalities", json!(["text", "audio"])),
                ("audio", json!({"voice": "alloy", "format": "wav"})),
                ("prediction", json!({"type": "content", "content": "x"})),
                ("web_search_options", json!({})),
            ]),
        }
        v
    }

    /// Each field, sent alone at a value that uses it, is honoured (parsed by `oai`), has no
    /// effect by design, or is refused with a 400 naming it: never dropped.
    #[test]
    fn every_field_is_honoured_or_refused_by_name() {
        for ep in [Completion, Chat] {
            for (name, v) in every_field(ep) {
                let body = Map::from_iter([(name.to_owned(), v.clone())]);
                let r = check(&body, ep);
                match rule(name, ep) {
                    Some(Honoured | NoEffect) => assert!(r.is_ok(), "{name}: {r:?}"),
                    Some(Neutral(..)) => {
                        let e = r.expect_err(name);
                        assert_eq!(e.status, 400);
                        assert_eq!(e.param.as_deref(), Some(name));
                        assert!(e.message.starts_with(name), "{}", e.message);
                    }
                    None => panic!("{name} has no rule for {ep:?}"),
                }
            }
        }
        // Honoured means the request types read it.
        let honoured = |ep| {
            FIELDS
                .iter()
                .filter(move |(_, on, r)| matches!(r, Honoured) && (*on == Both || *on == Only(ep)))
                .map(|(n, _, _)| *n)
        };
        let completion: Vec<_> = honoured(Completion).collect();
        let chat: Vec<_> = honoured(Chat).collect();
        let body = |ep, names: &[&str]| {
            Value::Object(
                every_field(ep)
                    .into_iter()
                    .filter(|(n, _)| names.contains(n))
                    .map(|(n, v)| (n.to_owned(), v))
                    .collect(),
            )
        };
        let c: crate::oai::CompletionRequest =
            serde_json::from_value(body(Completion, &completion)).unwrap();
        assert_eq!(c.common.max_tokens, Some(8));
        assert_eq!(c.common.cache_prompt, Some(false));
        let r: crate::oai::ChatRequest = serde_json::from_value(body(Chat, &chat)).unwrap();
        assert_eq!(r.common.top_k, Some(10));
    }

    /// What SDKs and llama.cpp's web UI send by default passes: every sampler off, no tools,
    /// text output.
    #[test]
    fn neutral_values_pass() {
        let body = json!({
            "model": "x", "messages": [{"role": "user", "content": "hi", "name": "me"}],
            "presence_penalty": 0, "frequency_penalty": 0.0, "repeat_penalty": 1.0,
            "typical_p": 1, "dry_multiplier": 0, "xtc_probability": 0, "mirostat": 0,
            "dynatemp_range": 0, "top_n_sigma": -1, "samplers": "edkypmxt",
            "logit_bias": {}, "logprobs": false, "tools": [], "tool_choice": "auto",
            "response_format": {"type": "text"}, "n_probs": 0, "id_slot": -1,
            "timings_per_token": false, "stream_options": null
        });
        check(body.as_object().unwrap(), Chat).unwrap();
        let samplers =
            |s: Value| check(&Map::from_iter([("samplers".to_owned(), s)]), Completion).is_ok();
        assert!(samplers(json!([
            "dry",
            "top_k",
            "typ_p",
            "top_p",
            "min_p",
            "xtc",
            "temperature"
        ])));
        assert!(samplers(json!("kpmt")));
        assert!(
            !samplers(json!("kpt")),
            "min_p left out is not this server's chain"
        );
        assert!(
            !samplers(json!("tkpm")),
            "temperature first is not this server's chain"
        );
    }

    #[test]
    fn unknown_fields_and_message_fields_are_named() {
        let e = check(json!({"max_token": 5}).as_object().unwrap(), Completion).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("max_token"));
        // `/completion` takes the completion fields, and returns the tokens when asked.
        let native = json!({"prompt": "x", "n_predict": 4, "return_tokens": true});
        check(native.as_object().unwrap(), Endpoint::Native).unwrap();
        let e = check(native.as_object().unwrap(), Completion).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("return_tokens"));
        let e = check(
            json!({"logprobs": 2}).as_object().unwrap(),
            Endpoint::Native,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        let usage = json!({"stream_options": {"include_usage": true}});
        let e = check(usage.as_object().unwrap(), Endpoint::Native).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        check(usage.as_object().unwrap(), Completion).unwrap();
        let e = check(json!({"messages": []}).as_object().unwrap(), Completion).unwrap_err();
        assert!(e.message.contains("chat field"), "{}", e.message);
        let body = json!({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        ]});
        check(body.as_object().unwrap(), Chat).unwrap();
        let body = json!({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "audio": {"id": "a1"}}
        ]});
        let e = check(body.as_object().unwrap(), Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].audio"));
        let body = json!({"messages": [{"role": "user", "content": "x", "mood": "happy"}]});
        let e = check(body.as_object().unwrap(), Chat).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].mood"));
    }
}
