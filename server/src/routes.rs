//! The endpoints. Bodies are read here up to `--max-body` and parsed by [`crate::oai`], so
//! every client mistake is an OpenAI-style JSON error with a 4xx status.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::ApiError;
use crate::oai::{self, ChatRequest, CompletionRequest, Params, Prompt};
use crate::slots::{Event, Job, Outcome};
use crate::{AppState, Ready};

type St = State<Arc<AppState>>;

/// The router: every endpoint, the API-key check, JSON 404s.
pub fn router(state: Arc<AppState>, metrics: bool) -> Router {
    let mut r = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    if metrics {
        r = r.route("/metrics", get(metrics_text));
    }
    r.fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .with_state(state)
}

/// With `--api-key`, every endpoint but /health wants `Authorization: Bearer KEY`.
async fn auth(State(s): St, req: Request, next: Next) -> Response {
    let Some(key) = &s.api_key else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    if path == "/health" || path == "/v1/health" {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn ready(s: &AppState) -> Result<&Ready, ApiError> {
    s.ready
        .get()
        .ok_or_else(|| ApiError::unavailable("the model is loading; retry when /health says ok"))
}

async fn health(State(s): St) -> Response {
    if s.ready.get().is_some() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading", "error": {"message": "Loading model", "type": "unavailable_error", "code": 503}})),
        )
            .into_response()
    }
}

async fn models(State(s): St) -> Response {
    let meta = s.ready.get().map(|r| {
        let m = r.rt.model();
        json!({
            "n_vocab": m.n_vocab(),
            "n_ctx_train": m.n_ctx_train(),
            "n_ctx": s.n_ctx,
            "desc": m.desc(),
        })
    });
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.alias,
            "object": "model",
            "created": s.created,
            "owned_by": "leap",
            "meta": meta,
        }],
    }))
    .into_response()
}

async fn metrics_text(State(s): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// The body, at most `--max-body` bytes: a 413 for one larger (at once when its
/// Content-Length says so), a 400 for one that cannot be read to its end (cut short, bad
/// chunked encoding).
async fn read_body(s: &AppState, body: Body) -> Result<Bytes, ApiError> {
    use axum::body::HttpBody as _;
    if body.size_hint().lower() > s.max_body as u64 {
        return Err(ApiError::too_large(s.max_body));
    }
    let mut out = Vec::new();
    let mut chunks = body.into_data_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::invalid(format!("the request body could not be read: {e}"), None)
        })?;
        if out.len() + chunk.len() > s.max_body {
            return Err(ApiError::too_large(s.max_body));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out.into())
}

async fn tokenize(State(s): St, body: Body) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        content: String,
        #[serde(default)]
        add_special: bool,
        #[serde(default)]
        with_pieces: bool,
    }
    let r: Req = oai::parse(&read_body(&s, body).await?)?;
    let model = ready(&s)?.rt.model();
    let toks = model
        .tokenize(&r.content, r.add_special, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("content")))?;
    let tokens: Vec<Value> = if r.with_pieces {
        toks.iter()
            .map(|&t| {
                let p = model.token_to_piece(t, true).unwrap_or_default();
                json!({"id": t, "piece": String::from_utf8_lossy(&p)})
            })
            .collect()
    } else {
        toks.iter().map(|&t| json!(t)).collect()
    };
    Ok(Json(json!({ "tokens": tokens })).into_response())
}

async fn detokenize(State(s): St, body: Body) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    struct Req {
        tokens: Vec<i64>,
    }
    let r: Req = oai::parse(&read_body(&s, body).await?)?;
    let model = ready(&s)?.rt.model();
    let toks = to_tokens(&r.tokens, model.n_vocab(), "tokens")?;
    let content = model
        .detokenize(&toks, false, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({ "content": content })).into_response())
}

/// Token ids from a request, each checked against the vocabulary (a 400 naming `param`).
///
/// # Errors
/// An id outside `0..n_vocab`.
pub fn to_tokens(
    ids: &[i64],
    n_vocab: i32,
    param: &str,
) -> Result<Vec<leap_host::Token>, ApiError> {
    ids.iter()
        .map(|&t| {
            if (0..i64::from(n_vocab)).contains(&t) {
                Ok(t as leap_host::Token)
            } else {
                Err(ApiError::invalid(
                    format!(
                        "token id {t} is not in the vocabulary (0 to {})",
                        n_vocab - 1
                    ),
                    Some(param),
                ))
            }
        })
        .collect()
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Which endpoint a response is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Chat,
}

async fn completions(State(s): St, body: Body) -> Result<Response, ApiError> {
    let r: CompletionRequest = oai::parse(&read_body(&s, body).await?)?;
    let params = r.common.params()?;
    let rt = &ready(&s)?.rt;
    let model = rt.model();
    let prompt = match &r.prompt {
        Prompt::Text(t) => model.tokenize(t, true, true),
        Prompt::Texts(v) if v.len() == 1 => model.tokenize(&v[0], true, true),
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(
                format!("{} prompts: this server takes one per request", v.len()),
                Some("prompt"),
            ))
        }
        Prompt::Tokens(ids) => Ok(to_tokens(ids, model.n_vocab(), "prompt")?),
    }
    .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?;
    generate(s, prompt, params, Kind::Text).await
}

async fn chat(State(s): St, body: Body) -> Result<Response, ApiError> {
    let r: ChatRequest = oai::parse(&read_body(&s, body).await?)?;
    let params = r.common.params()?;
    if r.messages.is_empty() {
        return Err(ApiError::invalid("messages is empty", Some("messages")));
    }
    let msgs = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| m.to_chat(i))
        .collect::<Result<Vec<_>, _>>()?;
    let model = ready(&s)?.rt.model();
    let text = model
        .apply_chat_template(&msgs, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt = model
        .tokenize(&text, true, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    generate(s, prompt, params, Kind::Chat).await
}

/// Queue the request on a slot and answer: a JSON body, or server-sent events.
async fn generate(
    s: Arc<AppState>,
    prompt: Vec<leap_host::Token>,
    p: Params,
    kind: Kind,
) -> Result<Response, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    leap_spec::session::fits(prompt.len(), p.max_tokens.unwrap_or(1), s.n_ctx)?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    s.metrics.queued();
    let submitted = ready(&s)?.pool.submit(Job {
        prompt,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop.clone(),
        events: tx,
    });
    if let Err(e) = submitted {
        s.metrics.dequeued();
        return Err(e);
    }
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        },
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    );
    let head = Head {
        id,
        created: now(),
        model: s.alias.clone(),
        kind,
    };
    if p.stream {
        let stream = sse_stream(head, rx, p.include_usage);
        Ok(Sse::new(stream)
            .keep_alive(KeepAlive::default())
            .into_response())
    } else {
        collect(head, rx).await
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What every response object of a request repeats.
#[derive(Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Head {
    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Text, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn wrap(&self, stream: bool, choices: Value, extra: Option<(&str, Value)>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": concat!("leap-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        });
        if let Some((k, x)) = extra {
            v[k] = x;
        }
        v
    }

    /// A streamed chunk's one choice.
    fn chunk(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Text => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish})
            }
            Kind::Chat => {
                let delta = if finish.is_some() {
                    json!({})
                } else if first {
                    json!({"role": "assistant", "content": text})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        };
        self.wrap(true, json!([choice]), None)
    }
}

/// Wait for the whole text and answer it as one JSON object.
async fn collect(head: Head, mut rx: UnboundedReceiver<Event>) -> Result<Response, ApiError> {
    let mut text = String::new();
    let o: Outcome = loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done(o)) => break o,
            Some(Event::Error(e)) => return Err(e),
            None => return Err(ApiError::unavailable("the server is shutting down")),
        }
    };
    let choice = match head.kind {
        Kind::Text => {
            json!({"index": 0, "text": text, "logprobs": null, "finish_reason": o.finish.as_str()})
        }
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": o.finish.as_str(),
        }),
    };
    let mut v = head.wrap(false, json!([choice]), Some(("usage", o.usage())));
    v["timings"] = o.timings();
    Ok(Json(v).into_response())
}

/// The request's events as server-sent events: a chunk per piece of text, a last chunk with
/// the finish reason (and llama-server's `timings`), the usage chunk when asked for, then
/// `[DONE]`. An error after the stream began is sent as an `error` object, then `[DONE]`.
fn sse_stream(
    head: Head,
    rx: UnboundedReceiver<Event>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct St {
        head: Head,
        rx: UnboundedReceiver<Event>,
        /// An event taken from the channel while joining text, for the next round.
        next: Option<Event>,
        first: bool,
        done: bool,
    }
    let st = St {
        head,
        rx,
        next: None,
        first: true,
        done: false,
    };
    stream::unfold(st, move |mut st| async move {
        if st.done {
            return None;
        }
        let json_event = |v: &Value| SseEvent::default().data(v.to_string());
        let ev = match st.next.take() {
            Some(e) => Some(e),
            None => st.rx.recv().await,
        };
        let out: Vec<SseEvent> = match ev {
            Some(Event::Text(mut t)) => {
                // The tokens one verification accepted arrive together: one chunk for all
                // that are already here (a write and a client wake-up fewer per token).
                while let Ok(e) = st.rx.try_recv() {
                    match e {
                        Event::Text(more) => t.push_str(&more),
                        other => {
                            st.next = Some(other);
                            break;
                        }
                    }
                }
                let v = st.head.chunk(&t, None, st.first);
                st.first = false;
                vec![json_event(&v)]
            }
            Some(Event::Done(o)) => {
                st.done = true;
                let mut events = Vec::new();
                if st.first && st.head.kind == Kind::Chat {
                    // Every chat stream opens with the assistant's role.
                    events.push(json_event(&st.head.chunk("", None, true)));
                }
                let mut last = st.head.chunk("", Some(o.finish.as_str()), false);
                last["timings"] = o.timings();
                events.push(json_event(&last));
                if include_usage {
                    let u = st.head.wrap(true, json!([]), Some(("usage", o.usage())));
                    events.push(json_event(&u));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            Some(Event::Error(e)) => {
                st.done = true;
                vec![json_event(&e.body()), SseEvent::default().data("[DONE]")]
            }
            None => {
                st.done = true;
                let e = ApiError::unavailable("the server is shutting down");
                vec![json_event(&e.body()), SseEvent::default().data("[DONE]")]
            }
        };
        Some((stream::iter(out.into_iter().map(Ok)), st))
    })
    .flatten()
}
