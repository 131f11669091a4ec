//! The requests apps send to OpenAI's and llama-server's completion endpoints, parsed and
//! checked: every field a client may get wrong becomes a 400 naming the field.

use serde::Deserialize;

use crate::error::ApiError;
use crate::fields::Endpoint;

/// `prompt` of `/v1/completions`: a string, a one-string array, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
}

/// `stop`: one string or up to four.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields completions and chat completions share.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub max_tokens: Option<i64>,
    /// OpenAI's newer name for `max_tokens` (chat).
    pub max_completion_tokens: Option<i64>,
    /// llama-server's name (-1: to the end of the context).
    pub n_predict: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// llama-server's switch for reusing the KV cache a slot kept from its last request
    /// (default true); false prefills the whole prompt.
    pub cache_prompt: Option<bool>,
    /// Chat: `true` for each token's log-probability; completions: how many most likely
    /// tokens to list with each (0 to [`MAX_TOP_LOGPROBS`]).
    pub logprobs: Option<serde_json::Value>,
    /// Chat: how many most likely tokens to list with each (needs `logprobs: true`).
    pub top_logprobs: Option<i64>,
    /// llama-server's slot to run on (-1: any).
    pub id_slot: Option<i64>,
    /// llama-server's GBNF grammar the output must follow.
    pub grammar: Option<String>,
    /// llama-server's JSON schema the output must follow.
    pub json_schema: Option<serde_json::Value>,
    /// OpenAI's output format: `{"type": "text"}`, `{"type": "json_object"}` (llama-server
    /// also reads a `schema` there) or `{"type": "json_schema", "json_schema": {"schema": ..}}`.
    pub response_format: Option<serde_json::Value>,
}

/// What the output must follow (structured output), as the request gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// GBNF text.
    Gbnf(String),
    /// A JSON schema, as JSON text.
    JsonSchema(String),
}

/// Most likely tokens a request may ask for at each position (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: i64 = 20;

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Read control-token text in the prompt (`<|im_start|>`) as control tokens
    /// (llama-server's `parse_special`); by default it is text like the rest.
    #[serde(default)]
    pub parse_special: bool,
    /// llama-server's `/completion`: the generated token ids in the answer too.
    #[serde(default)]
    pub return_tokens: bool,
    /// llama-server's `/completion`: each generated token's log-probability and this many
    /// most likely tokens at its position (`completion_probabilities`).
    #[serde(default)]
    pub n_probs: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

/// A request to llama-server's own `/completion`: the completion fields, and `return_tokens`.
#[derive(Debug, Clone, Deserialize)]
pub struct NativeRequest(pub CompletionRequest);

impl Request for NativeRequest {
    const ENDPOINT: Endpoint = Endpoint::Native;
}

/// A chat message's `content`: a string or OpenAI's array of parts (text parts only).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    /// `null` is allowed for an assistant turn that only called tools; it counts as empty.
    pub content: Option<Content>,
    /// An assistant turn's calls (OpenAI's `tool_calls`).
    #[serde(default)]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// A `tool` message: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Functions the model may call ([`crate::tools`]).
    pub tools: Option<serde_json::Value>,
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

/// A request body: which endpoint's fields it has ([`crate::fields`]).
pub trait Request: serde::de::DeserializeOwned {
    const ENDPOINT: Endpoint;
}

impl Request for CompletionRequest {
    const ENDPOINT: Endpoint = Endpoint::Completion;
}

impl Request for ChatRequest {
    const ENDPOINT: Endpoint = Endpoint::Chat;
}

/// Parse a JSON body into `T`, every field checked against its rule ([`crate::fields`]),
/// naming the field at fault in a 400.
///
/// # Errors
/// Malformed JSON, a missing field, a field of the wrong type, a field this server does not
/// know or would not apply at the value sent.
pub fn parse<T: Request>(body: &[u8]) -> Result<T, ApiError> {
    let v = object(body)?;
    if let serde_json::Value::Object(fields) = &v {
        crate::fields::check(fields, T::ENDPOINT)?;
    }
    decode(v)
}

/// Parse a JSON body into `T` whose every field is honoured (a small request such as
/// `/tokenize`'s, with `#[serde(deny_unknown_fields)]`), naming the field at fault in a 400.
///
/// # Errors
/// Malformed JSON, a missing, unknown or mistyped field.
pub fn parse_plain<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    decode(object(body)?)
}

/// The body as a JSON object.
fn object(body: &[u8]) -> Result<serde_json::Value, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(ApiError::invalid("the body must be a JSON object", None));
    }
    Ok(v)
}

fn decode<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T, ApiError> {
    serde_json::from_value(v).map_err(|e| {
        let msg = e.to_string();
        // serde names the field between backquotes: "missing field `prompt`", "unknown
        // field `x`, expected ...".
        let param = ["missing field `", "unknown field `"]
            .iter()
            .find_map(|p| msg.strip_prefix(p))
            .and_then(|r| r.split('`').next())
            .map(str::to_owned);
        ApiError {
            param,
            ..ApiError::invalid(format!("invalid request: {msg}"), None)
        }
    })
}

/// What to generate, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: leap_host::sampler::SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_prompt: bool,
    /// Report log-probabilities, with this many most likely tokens at each position.
    pub logprobs: Option<usize>,
    /// `/completion`'s `return_tokens` (set by its handler).
    pub return_tokens: bool,
    /// Structured output: the grammar or schema the output follows, and the request field it
    /// came from.
    pub constraint: Option<(&'static str, Constraint)>,
    /// A chat request's tools: the answer is a call or text in JSON ([`crate::tools`]).
    pub tools: Option<std::sync::Arc<crate::tools::Tools>>,
    /// The slot to run on (`id_slot`; checked against the server's slots when queued).
    pub slot: Option<usize>,
}

/// llama-server's sampling for what a request leaves out: temperature 0.8, and top-k 40,
/// top-p 0.95 and min-p 0.05 as llama.cpp's own defaults (`SamplingParams::default`); the
/// seed is drawn per request.
pub fn defaults() -> leap_host::sampler::SamplingParams {
    leap_host::sampler::SamplingParams {
        temp: 0.8,
        ..Default::default()
    }
}

impl Common {
    /// [`Common::params`], with `seed` (the server's `--seed`) for a request that sends no
    /// seed or -1.
    ///
    /// # Errors
    /// As [`Common::params`].
    pub fn params_seeded(&self, seed: Option<u32>) -> Result<Params, ApiError> {
        let mut p = self.params()?;
        if let (Some(s), None | Some(-1)) = (seed, self.seed) {
            p.sampling.seed = s;
        }
        Ok(p)
    }

    /// Check ranges and fill defaults ([`defaults`], a random seed).
    ///
    /// # Errors
    /// A field out of range, `n` other than 1, more than 4 stop strings.
    pub fn params(&self) -> Result<Params, ApiError> {
        let bad = |p: &str, why: String| Err(ApiError::invalid(why, Some(p)));
        if let Some(n) = self.n {
            if n != 1 {
                return bad(
                    "n",
                    format!("n = {n}: this server returns one choice (n = 1)"),
                );
            }
        }
        let max = [
            ("max_tokens", self.max_tokens),
            ("max_completion_tokens", self.max_completion_tokens),
            ("n_predict", self.n_predict),
        ]
        .into_iter()
        .find_map(|(name, v)| v.map(|v| (name, v)));
        let max_tokens = match max {
            Some(("n_predict", -1)) | None => None,
            Some((name, v)) if v < 1 => {
                return bad(name, format!("{name} = {v}: at least 1"));
            }
            Some((_, v)) => Some(v as usize),
        };
        let d = defaults();
        let temp = self.temperature.unwrap_or(d.temp);
        if !(0.0..=2.0).contains(&temp) {
            return bad("temperature", format!("temperature {temp}: from 0 to 2"));
        }
        let top_p = self.top_p.unwrap_or(d.top_p);
        if !(0.0..=1.0).contains(&top_p) {
            return bad("top_p", format!("top_p {top_p}: from 0 to 1"));
        }
        let min_p = self.min_p.unwrap_or(d.min_p);
        if !(0.0..=1.0).contains(&min_p) {
            return bad("min_p", format!("min_p {min_p}: from 0 to 1"));
        }
        let top_k = self.top_k.unwrap_or(d.top_k);
        if top_k < 0 {
            return bad("top_k", format!("top_k {top_k}: 0 (off) or more"));
        }
        // llama.cpp's seeds: 32 bits, and its default (-1, or 0xFFFFFFFF) draws a random one.
        let seed = match self.seed {
            None | Some(-1) | Some(0xFFFF_FFFF) => {
                leap_host::sampler::SamplingParams::random_seed()
            }
            Some(s @ 0..0xFFFF_FFFF) => s as u32,
            Some(s) => {
                return bad(
                    "seed",
                    format!("seed {s}: from 0 to 4294967295, or -1 for a random one"),
                )
            }
        };
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 4 {
            return bad("stop", format!("{} stop strings: at most 4", stop.len()));
        }
        if stop.iter().any(String::is_empty) {
            return bad("stop", "an empty stop string".into());
        }
        let logprobs = self.logprobs()?;
        let constraint = self.constraint()?;
        Ok(Params {
            max_tokens,
            sampling: leap_host::sampler::SamplingParams {
                temp,
                top_k,
                top_p,
                min_p,
                seed,
            },
            stop,
            stream: self.stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            logprobs,
            return_tokens: false,
            constraint,
            tools: None,
            slot: match self.id_slot {
                None | Some(-1) => None,
                Some(s) if s >= 0 => Some(s as usize),
                Some(s) => return bad("id_slot", format!("id_slot {s}: -1 (any) or a slot")),
            },
        })
    }
}

impl Common {
    /// How many most likely tokens to list with each token's log-probability, when asked:
    /// chat's `logprobs: true` with `top_logprobs`, or the completions API's count.
    /// The structured-output constraint and the field it came from: `grammar`, `json_schema`
    /// or `response_format` (at most one of them).
    fn constraint(&self) -> Result<Option<(&'static str, Constraint)>, ApiError> {
        use serde_json::Value;
        let bad = |p: &str, why: String| Err(ApiError::invalid(why, Some(p)));
        let grammar = match self.grammar.as_deref() {
            None | Some("") => None,
            Some(g) => Some(("grammar", Constraint::Gbnf(g.to_string()))),
        };
        let schema = match &self.json_schema {
            None | Some(Value::Null) => None,
            Some(v @ (Value::Object(_) | Value::Bool(true))) => {
                Some(("json_schema", Constraint::JsonSchema(v.to_string())))
            }
            Some(v) => {
                return bad(
                    "json_schema",
                    format!("json_schema {v}: a JSON schema object"),
                )
            }
        };
        let format = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => None,
                Some("json_object") => {
                    let s = f.get("schema").filter(|s| !s.is_null());
                    let s = s.map_or_else(|| r#"{"type": "object"}"#.to_string(), Value::to_string);
                    Some(("response_format", Constraint::JsonSchema(s)))
                }
                Some("json_schema") => {
                    let Some(s) = f.pointer("/json_schema/schema").or_else(|| f.get("schema"))
                    else {
                        return bad(
                            "response_format",
                            "response_format json_schema without json_schema.schema".into(),
                        );
                    };
                    Some(("response_format", Constraint::JsonSchema(s.to_string())))
                }
                _ => {
                    return bad(
                        "response_format",
                        format!("response_format {f}: type text, json_object or json_schema"),
                    )
                }
            },
        };
        let mut given: Vec<_> = [grammar, schema, format].into_iter().flatten().collect();
        if given.len() > 1 {
            return bad(
                given[1].0,
                format!(
                    "{} and {}: one constraint per request",
                    given[0].0, given[1].0
                ),
            );
        }
        Ok(given.pop())
    }

    fn logprobs(&self) -> Result<Option<usize>, ApiError> {
        use serde_json::Value;
        let bad = |p: &str, why: String| Err(ApiError::invalid(why, Some(p)));
        let top_ok = |n: i64| (0..=MAX_TOP_LOGPROBS).contains(&n);
        match (&self.logprobs, self.top_logprobs) {
            (_, Some(n)) if !top_ok(n) => bad(
                "top_logprobs",
                format!("top_logprobs {n}: from 0 to {MAX_TOP_LOGPROBS}"),
            ),
            (None | Some(Value::Null | Value::Bool(false)), Some(n)) if n > 0 => bad(
                "top_logprobs",
                "top_logprobs needs \"logprobs\": true".into(),
            ),
            (None | Some(Value::Null | Value::Bool(false)), _) => Ok(None),
            (Some(Value::Bool(true)), top) => Ok(Some(top.unwrap_or(0) as usize)),
            (Some(v), None) if v.as_i64().is_some_and(top_ok) => Ok(v.as_i64().map(|n| n as usize)),
            (Some(v), _) => bad(
                "logprobs",
                format!(
                    "logprobs {v}: true or false (chat, with top_logprobs), or 0 to \
                     {MAX_TOP_LOGPROBS} (completions)"
                ),
            ),
        }
    }
}

impl Message {
    /// The message's text (parts joined; non-text parts refused). An assistant turn's calls
    /// and a `tool` message's result are written as JSON in the shape tool answers take
    /// ([`crate::tools`]); a `tool` message is a user turn.
    ///
    /// # Errors
    /// An unknown role, a part that is not text, a call without a function name.
    pub fn to_chat(&self, i: usize) -> Result<leap_host::model::ChatMessage, ApiError> {
        let param = format!("messages[{i}]");
        let role = match self.role.as_str() {
            "system" | "developer" => "system",
            "user" | "tool" => "user",
            "assistant" => "assistant",
            r => {
                return Err(ApiError::invalid(
                    format!("{param}: role {r:?}: system, user, assistant or tool"),
                    Some(&param),
                ))
            }
        };
        let content = match &self.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (&*p.kind, &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        (k, _) => {
                            return Err(ApiError::invalid(
                                format!("{param}: a content part of type {k:?}: only text parts"),
                                Some(&param),
                            ))
                        }
                    }
                }
                s
            }
        };
        // Read only on the turns they belong to: elsewhere they would be dropped.
        if self.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) && self.role != "assistant" {
            return Err(ApiError::invalid(
                format!("{param}.tool_calls: only an assistant turn calls tools"),
                Some(&format!("{param}.tool_calls")),
            ));
        }
        if self.tool_call_id.is_some() && self.role != "tool" {
            return Err(ApiError::invalid(
                format!("{param}.tool_call_id: only a tool message answers a call"),
                Some(&format!("{param}.tool_call_id")),
            ));
        }
        let content = match (self.role.as_str(), self.tool_calls.as_deref()) {
            ("tool", _) => crate::tools::tool_result(&content, self.tool_call_id.as_deref()),
            ("assistant", Some(calls)) if !calls.is_empty() => {
                let calls = crate::tools::assistant_calls(calls, &param)?;
                if content.is_empty() {
                    calls
                } else {
                    format!("{content}\n{calls}")
                }
            }
            _ => content,
        };
        Ok(leap_host::model::ChatMessage {
            role: role.into(),
            content,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_at_fault_are_named() {
        let e = parse::<CompletionRequest>(br#"{"max_tokens": 3}"#).unwrap_err();
        assert_eq!(e.status, 400);
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = parse::<CompletionRequest>(br#"{"prompt": "x", "max_tokens": "3"}"#).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let e = parse::<CompletionRequest>(b"{\"prompt\": ").unwrap_err();
        assert!(e.message.contains("not valid JSON"), "{}", e.message);
        let e = parse::<CompletionRequest>(b"[1]").unwrap_err();
        assert!(e.message.contains("object"), "{}", e.message);
    }

    #[test]
    fn structured_output_fields_give_one_constraint() {
        let c = |j: &str| {
            parse::<CompletionRequest>(j.as_bytes())
                .and_then(|r| r.common.params())
                .map(|p| match p.constraint {
                    Some((field, c)) => (field, Some(c)),
                    None => ("", None),
                })
                .map_err(|e| e.param)
        };
        let schema = |s: &str| Constraint::JsonSchema(s.to_string());
        assert_eq!(c(r#"{"prompt": "x"}"#), Ok(("", None)));
        assert_eq!(
            c(r#"{"prompt": "x", "response_format": {"type": "text"}, "grammar": ""}"#),
            Ok(("", None))
        );
        assert_eq!(
            c(r#"{"prompt": "x", "grammar": "root ::= \"a\""}"#),
            Ok(("grammar", Some(Constraint::Gbnf(r#"root ::= "a""#.into()))))
        );
        assert_eq!(
            c(r#"{"prompt": "x", "response_format": {"type": "json_object"}}"#),
            Ok(("response_format", Some(schema(r#"{"type": "object"}"#))))
        );
        assert_eq!(
            c(
                r#"{"prompt": "x", "response_format": {"type": "json_schema",
                  "json_schema": {"name": "n", "schema": {"type": "integer"}}}}"#
            ),
            Ok(("response_format", Some(schema(r#"{"type":"integer"}"#))))
        );
        assert_eq!(
            c(r#"{"prompt": "x", "json_schema": {"type": "string"}}"#),
            Ok(("json_schema", Some(schema(r#"{"type":"string"}"#))))
        );
        for (bad, param) in [
            (r#""response_format": {"type": "xml"}"#, "response_format"),
            (
                r#""response_format": {"type": "json_schema"}"#,
                "response_format",
            ),
            (r#""json_schema": "string""#, "json_schema"),
            (
                r#""grammar": "root ::= \"a\"", "json_schema": {}"#,
                "json_schema",
            ),
        ] {
            let got = c(&format!(r#"{{"prompt": "x", {bad}}}"#));
            assert_eq!(got, Err(Some(param.to_string())), "{bad}");
        }
    }

    #[test]
    fn ranges_are_checked_and_defaults_filled() {
        let p = |j: &str| {
            parse::<CompletionRequest>(j.as_bytes())
                .unwrap()
                .common
                .params()
        };
        let d = p(r#"{"prompt": "x"}"#).unwrap();
        assert_eq!(d.max_tokens, None);
        assert!((d.sampling.temp - 0.8).abs() < 1e-6);
        assert_eq!(
            p(r#"{"prompt": "x", "max_tokens": 0}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("max_tokens")
        );
        assert_eq!(
            p(r#"{"prompt": "x", "temperature": 3}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("temperature")
        );
        assert_eq!(
            p(r#"{"prompt": "x", "top_p": -1}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("top_p")
        );
        assert_eq!(
            p(r#"{"prompt": "x", "n": 2}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("n")
        );
        assert_eq!(
            p(r#"{"prompt": "x", "stop": ["a","b","c","d","e"]}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("stop")
        );
        let s = p(r#"{"prompt": "x", "stop": "\n", "n_predict": -1, "seed": 7, "temperature": 0}"#)
            .unwrap();
        assert_eq!(s.stop, vec!["\n".to_string()]);
        assert_eq!(s.sampling.seed, 7);
        for bad in ["-2", "4294967296", "-4294967296"] {
            let e = p(&format!(r#"{{"prompt": "x", "seed": {bad}}}"#)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("seed"), "{bad}");
        }
        assert_eq!(
            p(r#"{"prompt": "x", "seed": 4294967294}"#)
                .unwrap()
                .sampling
                .seed,
            4294967294
        );
        p(r#"{"prompt": "x", "seed": -1}"#).unwrap();
        assert_eq!(s.max_tokens, None);
        // logprobs: chat's flag with top_logprobs, or the completions API's count.
        let lp = |j: &str| p(j).map(|p| p.logprobs).map_err(|e| e.param);
        assert_eq!(lp(r#"{"prompt": "x"}"#), Ok(None));
        assert_eq!(lp(r#"{"prompt": "x", "logprobs": false}"#), Ok(None));
        assert_eq!(
            lp(r#"{"prompt": "x", "logprobs": true, "top_logprobs": 3}"#),
            Ok(Some(3))
        );
        assert_eq!(lp(r#"{"prompt": "x", "logprobs": true}"#), Ok(Some(0)));
        assert_eq!(lp(r#"{"prompt": "x", "logprobs": 2}"#), Ok(Some(2)));
        for (bad, param) in [
            (r#""logprobs": 21"#, "logprobs"),
            (r#""logprobs": "yes""#, "logprobs"),
            (r#""logprobs": true, "top_logprobs": 21"#, "top_logprobs"),
            (r#""top_logprobs": 2"#, "top_logprobs"),
        ] {
            let got = lp(&format!(r#"{{"prompt": "x", {bad}}}"#));
            assert_eq!(got, Err(Some(param.to_string())), "{bad}");
        }
    }

    #[test]
    fn chat_messages_take_text_parts_only() {
        let r: ChatRequest = parse(
            br#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}"#,
        )
        .unwrap();
        assert_eq!(r.messages[0].to_chat(0).unwrap().content, "hi");
        let r: ChatRequest =
            parse(br#"{"messages": [{"role": "wizard", "content": "x"}]}"#).unwrap();
        assert_eq!(
            r.messages[0].to_chat(0).unwrap_err().param.as_deref(),
            Some("messages[0]")
        );
        // Tool fields on a turn they do not belong to are refused, not dropped.
        let r: ChatRequest = parse(
            br#"{"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"},
                {"role": "tool", "content": "x",
                 "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
                {"role": "tool", "content": "21", "tool_call_id": "c1"}]}"#,
        )
        .unwrap();
        let param = |i: usize| r.messages[i].to_chat(i).unwrap_err().param;
        assert_eq!(param(0).as_deref(), Some("messages[0].tool_call_id"));
        assert_eq!(param(1).as_deref(), Some("messages[1].tool_calls"));
        assert_eq!(r.messages[2].to_chat(2).unwrap().role, "user");
    }
}
