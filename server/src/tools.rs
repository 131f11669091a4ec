//! Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, assistant turns
//! with `tool_calls` and `tool` messages.
//!
//! The chat templates this server applies (llama.cpp's built-in ones, not Jinja) do not
//! describe tools, so the tools go in as text and the answer comes out as JSON, which is how
//! llama.cpp serves a template without tool support (its "generic" format):
//! - the system message gets the tools (name, description, the arguments' JSON schema) and
//!   the answer's shape ([`Tools::instructions`]);
//! - the answer is constrained by a JSON schema ([`Tools::schema`]):
//!   `{"tool_call": {"name": ..., "arguments": {...}}}` (`{"tool_calls": [...]}` with
//!   `parallel_tool_calls`), or with `tool_choice: "auto"` also `{"response": "..."}`. Each
//!   function's arguments follow its `parameters` schema, so a call always parses, and the
//!   grammar-constrained decoding drafts like any other (see `Engine::generate_from`);
//! - [`Tools::parse`] turns the answer back into OpenAI's `tool_calls` or text;
//! - earlier turns are written in the same shape ([`assistant_calls`], [`tool_result`]), so
//!   the model sees its calls and their results as it is asked to write them.

use serde_json::{json, Value};

use crate::error::ApiError;

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub description: String,
    /// The arguments' JSON schema (`{"type": "object"}` when the request gives none).
    pub parameters: Value,
}

/// Which answers `tool_choice` allows.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// A call or a text answer.
    Auto,
    /// A call to any of the functions.
    Required,
    /// A call to this function.
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub functions: Vec<Function>,
    pub choice: Choice,
    /// Several calls in one answer (`parallel_tool_calls`; false by default, as llama-server:
    /// small models asked for a list of calls tend to go on adding to it).
    pub parallel: bool,
}

/// What the model answered.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    /// Calls: each function's name and its arguments as JSON text.
    Calls(Vec<(String, String)>),
    /// A text answer.
    Text(String),
}

fn bad(param: &str, why: String) -> ApiError {
    ApiError::invalid(why, Some(param))
}

impl Tools {
    /// The tools of a chat request: `None` without tools or with `tool_choice: "none"` (the
    /// model then answers in text, as without tools).
    ///
    /// # Errors
    /// A 400 naming `tools`, `tool_choice` or `parallel_tool_calls`: a tool that is not a
    /// function, a function without a name or with the same name as another, a choice that
    /// names no given function.
    pub fn from_request(
        tools: Option<&Value>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let list = match tools {
            None | Some(Value::Null) => &[][..],
            Some(Value::Array(v)) => &v[..],
            Some(v) => return Err(bad("tools", format!("tools {v}: an array of tools"))),
        };
        let mut functions = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let param = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(
                    &param,
                    format!("{param}: only tools of type \"function\""),
                ));
            }
            let f = t
                .get("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| bad(&param, format!("{param}: a function object is missing")))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if name.is_empty() {
                return Err(bad(&param, format!("{param}: the function has no name")));
            }
            if functions.iter().any(|g: &Function| g.name == name) {
                return Err(bad(&param, format!("{param}: a second function {name:?}")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(p) => {
                    return Err(bad(
                        &param,
                        format!("{param}: parameters {p}: a JSON schema object"),
                    ))
                }
            };
            functions.push(Function {
                name: name.to_string(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string(),
                parameters,
            });
        }
        let choice = match choice {
            None | Some(Value::Null) => Choice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => return Ok(None),
                "auto" => Choice::Auto,
                "required" => Choice::Required,
                _ => {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice {s:?}: none, auto, required or a function"),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .pointer("/function/name")
                    .and_then(Value::as_str)
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        bad(
                            "tool_choice",
                            format!(
                                "tool_choice {v}: none, auto, required or \
                                 {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                            ),
                        )
                    })?;
                if !functions.iter().any(|f| f.name == name) {
                    return Err(bad(
                        "tool_choice",
                        format!("tool_choice names {name:?}, which is not in tools"),
                    ));
                }
                Choice::Named(name.to_string())
            }
        };
        if functions.is_empty() {
            return match choice {
                Choice::Auto => Ok(None),
                _ => Err(bad(
                    "tool_choice",
                    "tool_choice asks for a call, and tools is empty".into(),
                )),
            };
        }
        Ok(Some(Self {
            functions,
            choice,
            parallel: parallel.unwrap_or(false),
        }))
    }

    /// The functions a call may name.
    fn callable(&self) -> impl Iterator<Item = &Function> {
        self.functions.iter().filter(move |f| match &self.choice {
            Choice::Named(n) => &f.name == n,
            _ => true,
        })
    }

    /// What the system message says: the tools, and the answer's shape.
    pub fn instructions(&self) -> String {
        let mut s = String::from("You can call these tools:\n");
        for f in &self.functions {
            s.push_str(&format!("- {}", f.name));
            if !f.description.is_empty() {
                s.push_str(&format!(": {}", f.description));
            }
            s.push_str(&format!("\n  arguments (JSON schema): {}\n", f.parameters));
        }
        let call = r#"{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}"#;
        let calls =
            r#"{"tool_calls": [{"name": "<tool name>", "arguments": {<its arguments>}}, ...]}"#;
        s.push_str("\nAnswer in JSON only. ");
        s.push_str(&match (&self.choice, self.parallel) {
            (Choice::Named(n), _) => format!("Call {n}: {call}"),
            (_, false) => format!("To call a tool: {call}"),
            (_, true) => format!("To call tools: {calls}"),
        });
        if self.choice == Choice::Auto {
            s.push_str(
                r#" To answer the user directly instead, write your answer as the JSON string of "response": {"response": ...}"#,
            );
        }
        s
    }

    /// The JSON schema of an answer (as JSON text, its properties in the order the model
    /// writes them: a function's name before its arguments).
    pub fn schema(&self) -> String {
        let one = |f: &Function| {
            format!(
                r#"{{"type": "object", "properties": {{"name": {{"const": {}}}, "arguments": {}}}, "required": ["name", "arguments"], "additionalProperties": false}}"#,
                Value::String(f.name.clone()),
                f.parameters
            )
        };
        let calls: Vec<String> = self.callable().map(one).collect();
        let call = if calls.len() == 1 {
            calls[0].clone()
        } else {
            format!(r#"{{"anyOf": [{}]}}"#, calls.join(", "))
        };
        let wrapped = if self.parallel && !matches!(self.choice, Choice::Named(_)) {
            format!(
                r#"{{"type": "object", "properties": {{"tool_calls": {{"type": "array", "items": {call}, "minItems": 1}}}}, "required": ["tool_calls"], "additionalProperties": false}}"#
            )
        } else {
            format!(
                r#"{{"type": "object", "properties": {{"tool_call": {call}}}, "required": ["tool_call"], "additionalProperties": false}}"#
            )
        };
        match self.choice {
            Choice::Auto => format!(
                r#"{{"anyOf": [{wrapped}, {{"type": "object", "properties": {{"response": {{"type": "string"}}}}, "required": ["response"], "additionalProperties": false}}]}}"#
            ),
            _ => wrapped,
        }
    }

    /// The answer in `text`, `None` when it is not one (the generation stopped before the
    /// JSON ended: a length limit or a stop string).
    pub fn parse(&self, text: &str) -> Option<Answer> {
        let v: Value = serde_json::from_str(text.trim()).ok()?;
        let call = |c: &Value| {
            let name = c.get("name")?.as_str()?.to_string();
            self.callable().any(|f| f.name == name).then_some(())?;
            Some((name, c.get("arguments")?.to_string()))
        };
        if let Some(r) = v.get("response").and_then(Value::as_str) {
            return (self.choice == Choice::Auto).then(|| Answer::Text(r.to_string()));
        }
        if let Some(c) = v.get("tool_call") {
            return Some(Answer::Calls(vec![call(c)?]));
        }
        let list = v.get("tool_calls")?.as_array()?;
        let calls = list.iter().map(call).collect::<Option<Vec<_>>>()?;
        (!calls.is_empty()).then_some(Answer::Calls(calls))
    }
}

/// An assistant turn that called tools, in the shape the model is asked to answer in:
/// `calls` are OpenAI's `tool_calls` (`{"id", "type", "function": {"name", "arguments"}}`,
/// the arguments JSON text).
///
/// # Errors
/// A 400 naming `param` for a call without a function name.
pub fn assistant_calls(calls: &[Value], param: &str) -> Result<String, ApiError> {
    let mut out = Vec::with_capacity(calls.len());
    for (i, c) in calls.iter().enumerate() {
        let Some(name) = c.pointer("/function/name").and_then(Value::as_str) else {
            return Err(bad(
                param,
                format!("{param}.tool_calls[{i}]: a call without function.name"),
            ));
        };
        // OpenAI sends the arguments as JSON text; as JSON, if they are.
        let args = match c.pointer("/function/arguments") {
            Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
            Some(v) => v.clone(),
            None => json!({}),
        };
        // The name first, as the answer's schema has the model write it.
        out.push(format!(
            r#"{{"name": {}, "arguments": {args}}}"#,
            Value::String(name.into())
        ));
    }
    Ok(match out.len() {
        1 => format!(r#"{{"tool_call": {}}}"#, out[0]),
        _ => format!(r#"{{"tool_calls": [{}]}}"#, out.join(", ")),
    })
}

/// A `tool` message (a call's result), as the user turn the model reads it in.
pub fn tool_result(content: &str, call_id: Option<&str>) -> String {
    let content = serde_json::from_str(content).unwrap_or_else(|_| Value::String(content.into()));
    match call_id {
        Some(id) => json!({"tool_response": {"tool_call_id": id, "content": content}}),
        None => json!({"tool_response": {"content": content}}),
    }
    .to_string()
}

/// OpenAI's `tool_calls` for an answer's calls, each with a new id.
pub fn calls_json(calls: &[(String, String)], id: &str) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, (name, args))| {
            json!({"id": format!("call_{id}_{i}"), "type": "function",
                   "function": {"name": name, "arguments": args}})
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}},
               {"type": "function", "function": {"name": "get_time"}}])
    }

    #[test]
    fn choices_and_errors_name_their_field() {
        let t = weather();
        let auto = Tools::from_request(Some(&t), None, None).unwrap().unwrap();
        assert_eq!(auto.choice, Choice::Auto);
        assert!(!auto.parallel);
        assert_eq!(auto.functions[1].parameters, json!({"type": "object"}));
        assert!(Tools::from_request(Some(&t), Some(&json!("none")), None)
            .unwrap()
            .is_none());
        assert!(Tools::from_request(Some(&json!([])), None, None)
            .unwrap()
            .is_none());
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        let n = Tools::from_request(Some(&t), Some(&named), Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(n.choice, Choice::Named("get_time".into()));
        let e = |tools: Value, choice: Value| {
            Tools::from_request(Some(&tools), Some(&choice), None)
                .unwrap_err()
                .param
                .unwrap()
        };
        assert_eq!(e(t.clone(), json!("sometimes")), "tool_choice");
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(e(t.clone(), other), "tool_choice");
        assert_eq!(e(json!([]), json!("required")), "tool_choice");
        assert_eq!(e(json!([{"type": "retrieval"}]), json!("auto")), "tools[0]");
        let twice = json!([t[0], t[0]]);
        assert_eq!(e(twice, json!("auto")), "tools[1]");
        assert_eq!(e(json!({"a": 1}), json!("auto")), "tools");
    }

    #[test]
    fn answers_parse_to_calls_or_text() {
        let t = weather();
        let auto = Tools::from_request(Some(&t), None, Some(false))
            .unwrap()
            .unwrap();
        assert_eq!(
            auto.parse(
                r#" {"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}"#
            ),
            Some(Answer::Calls(vec![(
                "get_weather".into(),
                r#"{"city":"Paris"}"#.into()
            )]))
        );
        assert_eq!(
            auto.parse(r#"{"response": "Hello"}"#),
            Some(Answer::Text("Hello".into()))
        );
        // Cut short, or a function not given.
        assert_eq!(auto.parse(r#"{"tool_call": {"name": "get_wea"#), None);
        assert_eq!(
            auto.parse(r#"{"tool_call": {"name": "rm", "arguments": {}}}"#),
            None
        );
        let req = Tools::from_request(Some(&t), Some(&json!("required")), Some(true))
            .unwrap()
            .unwrap();
        assert_eq!(req.parse(r#"{"response": "Hello"}"#), None);
        let two = req.parse(
            r#"{"tool_calls": [{"name": "get_time", "arguments": {}},
                {"name": "get_weather", "arguments": {"city": "Rome"}}]}"#,
        );
        assert!(matches!(two, Some(Answer::Calls(c)) if c.len() == 2));
        // The schema is JSON, and says what the choice allows.
        let s: Value = serde_json::from_str(&auto.schema()).unwrap();
        assert!(s["anyOf"][1]["properties"]["response"].is_object());
        let s: Value = serde_json::from_str(&req.schema()).unwrap();
        assert_eq!(s["properties"]["tool_calls"]["minItems"], 1);
        assert!(s.get("anyOf").is_none());
        assert!(auto
            .instructions()
            .contains("get_weather: The weather in a city"));
    }

    #[test]
    fn earlier_turns_are_written_as_answers() {
        let calls = [json!({"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})];
        assert_eq!(
            assistant_calls(&calls, "messages[1]").unwrap(),
            r#"{"tool_call": {"name": "get_weather", "arguments": {"city":"Paris"}}}"#
        );
        let e = assistant_calls(&[json!({"id": "c1"})], "messages[1]").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1]"));
        assert_eq!(
            tool_result("{\"temp\": 21}", Some("c1")),
            r#"{"tool_response":{"content":{"temp":21},"tool_call_id":"c1"}}"#
        );
        assert_eq!(
            tool_result("sunny", None),
            r#"{"tool_response":{"content":"sunny"}}"#
        );
    }
}
