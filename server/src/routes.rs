//! The endpoints. Bodies are read here up to `--max-body` (within `--timeout`, and within a
//! budget for all bodies in flight) and parsed by [`crate::oai`], so every client mistake is an
//! OpenAI-style JSON error with a 4xx status. Parsing, templating and tokenizing grow with the
//! request, so they run on tokio's blocking threads ([`blocking`]): the HTTP thread only moves
//! bytes, and `/health` answers whatever a request holds.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Extension, Request, State};
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
use crate::slots::{Event, Job, Outcome, Tenant};
use crate::{AppState, Ready};

type St = State<Arc<AppState>>;

/// The router: every endpoint, the Host/Origin check, CORS, the API-key check, JSON 404s.
pub fn router(state: Arc<AppState>, metrics: bool) -> Router {
    let mut r = Router::new()
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/props", get(props))
        .route("/slots", get(slots))
        .route("/completion", post(completion_native))
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/apply-template", post(apply_template))
        .route("/v1/embeddings", post(embeddings))
        .route("/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    if metrics {
        r = r.route("/metrics", get(metrics_text));
    }
    r.fallback(|req: Request| async move { ApiError::not_found(req.uri().path()) })
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .layer(cors())
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            host_check,
        ))
        .with_state(state)
}

/// CORS for front ends in a browser, Electron or Tauri: any origin the Host/Origin check let
/// through (on loopback: loopback pages, and `--allowed-hosts`) may call every endpoint with
/// any header, as llama-server allows. Preflights are answered here, before the API-key check
/// (a browser sends them without the key).
fn cors() -> tower_http::cors::CorsLayer {
    use tower_http::cors::{AllowHeaders, Any, CorsLayer};
    CorsLayer::new()
        .allow_origin(Any)
        .allow_methods([
            axum::http::Method::GET,
            axum::http::Method::POST,
            axum::http::Method::OPTIONS,
        ])
        // The headers a preflight asks for, named back: a `*` would not cover
        // `Authorization` (the Fetch standard lists it apart), and the key would not pass.
        .allow_headers(AllowHeaders::mirror_request())
        .max_age(std::time::Duration::from_secs(600))
}

/// Which hosts requests may name in `Host` and `Origin`. A server on loopback answers only
/// requests for loopback names (and `--allowed-hosts`): a web page whose name an attacker
/// points at 127.0.0.1 (DNS rebinding) sends its own name, and is refused.
#[derive(Debug, Clone, Default)]
pub struct Hosts {
    /// No check (bound elsewhere than loopback without `--allowed-hosts`, or `*`).
    any: bool,
    /// Lowercase names allowed besides loopback's.
    names: Vec<String>,
}

impl Hosts {
    /// The check for a server bound to `bind` with `--allowed-hosts allowed`.
    pub fn new(bind: &str, allowed: &[String]) -> Self {
        let names: Vec<String> = allowed
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect();
        Self {
            any: names.iter().any(|h| h == "*") || (names.is_empty() && !is_loopback(bind)),
            names,
        }
    }

    /// Whether `authority` (`host`, `host:port`, `[v6]:port`) names a host served here.
    pub fn allows(&self, authority: &str) -> bool {
        if self.any {
            return true;
        }
        let host = host_of(authority).to_ascii_lowercase();
        is_loopback(&host) || self.names.contains(&host)
    }
}

/// The host of an authority, without its port (`[::1]` keeps its brackets).
fn host_of(authority: &str) -> &str {
    if authority.starts_with('[') {
        return authority.find(']').map_or(authority, |e| &authority[..=e]);
    }
    match authority.rsplit_once(':') {
        Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    }
}

/// `localhost`, an address in 127.0.0.0/8, or `::1` (bracketed or not).
fn is_loopback(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Refuse a request whose `Host` or `Origin` names a host not served here (a 403).
async fn host_check(State(s): St, req: Request, next: Next) -> Response {
    if !s.hosts.any {
        let host = req
            .headers()
            .get(header::HOST)
            .map(|v| v.to_str().unwrap_or("?"));
        if let Some(h) = host {
            if !s.hosts.allows(h) {
                return ApiError::forbidden_host("Host", h).into_response();
            }
        }
        if let Some(o) = req.headers().get(header::ORIGIN) {
            let o = o.to_str().unwrap_or("?");
            // scheme://authority; "null" (a sandboxed page, a file) names no host served here.
            let authority = o.split_once("://").map(|(_, a)| a.trim_end_matches('/'));
            if !authority.is_some_and(|a| s.hosts.allows(a)) {
                return ApiError::forbidden_host("Origin", o).into_response();
            }
        }
    }
    next.run(req).await
}

/// With `--api-key`, every endpoint but /health wants `Authorization: Bearer KEY` (or, as
/// llama-server takes it, `X-Api-Key: KEY`). The request's [`Tenant`] follows from the key.
async fn auth(State(s): St, mut req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let open = path == "/health" || path == "/v1/health";
    let tenant = if s.api_keys.is_empty() {
        Some(if s.shared_cache {
            Tenant::Shared
        } else {
            Tenant::Alone
        })
    } else {
        let h = req.headers();
        let given = h
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()));
        // Every key is compared, in constant time, whichever matches.
        let matched = given.and_then(|g| {
            s.api_keys.iter().enumerate().fold(None, |m, (i, k)| {
                if constant_time_eq(g.as_bytes(), k.as_bytes()) {
                    Some(i)
                } else {
                    m
                }
            })
        });
        matched.map(|k| {
            if s.shared_cache {
                Tenant::Shared
            } else {
                Tenant::Key(k)
            }
        })
    };
    match tenant {
        Some(t) => {
            req.extensions_mut().insert(t);
            next.run(req).await
        }
        None if open => next.run(req).await,
        None => ApiError::unauthorized().into_response(),
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

/// llama-server's `/props`: the slots, their context and the defaults a request gets, the
/// model's file and chat template.
async fn props(State(s): St) -> Result<Response, ApiError> {
    let rd = ready(&s)?;
    let template = rd.rt.model().chat_template_in_use().unwrap_or_default();
    let d = oai::defaults();
    Ok(Json(json!({
        "default_generation_settings": {
            "n_ctx": s.n_ctx,
            "params": {
                "n_predict": -1,
                "temperature": d.temp,
                "top_k": d.top_k,
                "top_p": d.top_p,
                "min_p": d.min_p,
                "seed": s.seed.map_or(-1, i64::from),
            },
        },
        "total_slots": s.total_slots,
        "model_alias": s.alias,
        "model_path": s.model_path,
        "chat_template": template,
        "modalities": {"vision": false, "audio": false},
        "build_info": concat!("leap-", env!("CARGO_PKG_VERSION")),
    }))
    .into_response())
}

/// llama-server's `GET /slots`: each slot's id, context, whether it drafts and is busy, and
/// how many tokens its cache holds (not its prompt: the server may serve several tenants).
/// `?fail_on_no_slot=1` answers 503 when every slot is busy, as llama-server does.
async fn slots(
    State(s): St,
    axum::extract::Query(q): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<Response, ApiError> {
    let rd = ready(&s)?;
    let view = rd.pool.view();
    if q.contains_key("fail_on_no_slot") && view.iter().all(|v| v.processing) {
        return Err(ApiError::unavailable("no slot available"));
    }
    let speculative = rd.rt.options().mode == leap_spec::session::Mode::Leap;
    let slots: Vec<Value> = view
        .iter()
        .map(|v| {
            json!({
                "id": v.id,
                "id_task": -1,
                "n_ctx": s.n_ctx,
                "speculative": speculative,
                "is_processing": v.processing,
                "tokens_cached": v.cached_tokens,
            })
        })
        .collect();
    Ok(Json(slots).into_response())
}

async fn metrics_text(State(s): St) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

/// The body, at most `--max-body` bytes, all of it within `--timeout` seconds: a 413 for one
/// larger (at once when its Content-Length says so), a 408 for one too slow, a 400 for one
/// that cannot be read to its end (cut short, bad chunked encoding), a 503 when the bodies
/// in flight hold the server's whole budget for them. The budget's share is held until the
/// handler is done with the body.
async fn read_body(
    s: &AppState,
    body: Body,
) -> Result<(Bytes, tokio::sync::OwnedSemaphorePermit), ApiError> {
    use axum::body::HttpBody as _;
    if body.size_hint().lower() > s.max_body as u64 {
        return Err(ApiError::too_large(s.max_body));
    }
    let read = async {
        let mut out = Vec::new();
        let mut held = Arc::clone(&s.body_budget)
            .try_acquire_many_owned(0)
            .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
        let mut chunks = body.into_data_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::invalid(format!("the request body could not be read: {e}"), None)
            })?;
            if out.len() + chunk.len() > s.max_body {
                return Err(ApiError::too_large(s.max_body));
            }
            let more = Arc::clone(&s.body_budget)
                .try_acquire_many_owned(chunk.len() as u32)
                .map_err(|_| {
                    ApiError::busy(
                        "the server is receiving too many request bodies at once; retry shortly",
                        "server_busy",
                        1,
                    )
                })?;
            held.merge(more);
            out.extend_from_slice(&chunk);
        }
        Ok((Bytes::from(out), held))
    };
    tokio::time::timeout(s.body_timeout, read)
        .await
        .map_err(|_| ApiError::body_timeout(s.body_timeout.as_secs()))?
}

/// Run `f` on one of tokio's blocking threads: work that grows with the request (parsing,
/// templating, tokenizing) never holds the HTTP thread.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|_| {
        ApiError::internal("the server failed on this request (a bug: its log says more)")
    })?
}

/// Refuse text that cannot fit the context whatever it tokenizes to: more bytes than
/// `n_ctx` tokens of the longest token cover. Checked before tokenizing (which costs time
/// in proportion).
fn check_text_len(r: &Ready, n_ctx: u32, bytes: usize) -> Result<(), ApiError> {
    let cap = n_ctx as usize * r.rt.model().max_token_bytes();
    if bytes > cap {
        return Err(ApiError::too_long(format!(
            "the prompt's {bytes} bytes are more than a context of {n_ctx} tokens can hold \
             (at most {cap} bytes for this model's tokens)"
        )));
    }
    Ok(())
}

fn ready_arc(s: &Arc<AppState>) -> Result<Arc<AppState>, ApiError> {
    ready(s)?;
    Ok(Arc::clone(s))
}

async fn tokenize(State(s): St, body: Body) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        content: String,
        #[serde(default)]
        add_special: bool,
        /// Control-token text as control tokens (off: text, as in prompts).
        #[serde(default)]
        parse_special: bool,
        #[serde(default)]
        with_pieces: bool,
    }
    let (bytes, _budget) = read_body(&s, body).await?;
    let st = ready_arc(&s)?;
    let v = blocking(move || {
        let r: Req = oai::parse_plain(&bytes)?;
        let rd = ready(&st)?;
        check_text_len(rd, st.n_ctx, r.content.len())?;
        let model = rd.rt.model();
        let toks = model
            .tokenize(&r.content, r.add_special, r.parse_special)
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
        Ok(json!({ "tokens": tokens }))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// OpenAI's `/v1/embeddings` (llama-server's with `--embeddings`): each input's pooled,
/// L2-normalised embedding from the target, in OpenAI's shape.
async fn embeddings(State(s): St, body: Body) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Input {
        Text(String),
        Texts(Vec<String>),
        Tokens(Vec<i64>),
        TokenLists(Vec<Vec<i64>>),
    }
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        /// OpenAI's name; llama-server also reads `content`.
        input: Option<Input>,
        content: Option<Input>,
        #[allow(dead_code)]
        model: Option<String>,
        #[allow(dead_code)]
        user: Option<String>,
        encoding_format: Option<String>,
        dimensions: Option<i64>,
    }
    let (bytes, _budget) = read_body(&s, body).await?;
    let st = ready_arc(&s)?;
    let v = blocking(move || {
        let rd = ready(&st)?;
        let Some(embed) = rd.embed.as_ref() else {
            return Err(ApiError::not_implemented(
                "embeddings are served with --embeddings (as llama-server's)",
            ));
        };
        let r: Req = oai::parse_plain(&bytes)?;
        // The openai package asks for base64 unless told otherwise.
        let base64 = match r.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(f) => {
                return Err(ApiError::invalid(
                    format!("encoding_format {f:?}: float or base64"),
                    Some("encoding_format"),
                ))
            }
        };
        let model = rd.rt.model();
        let n_embd = model.n_embd() as i64;
        if let Some(d) = r.dimensions.filter(|&d| d != n_embd) {
            return Err(ApiError::invalid(
                format!("dimensions {d}: this model's embeddings have {n_embd}"),
                Some("dimensions"),
            ));
        }
        let (field, input) = match (r.input, r.content) {
            (Some(i), None) => ("input", i),
            (None, Some(c)) => ("content", c),
            (Some(_), Some(_)) => {
                return Err(ApiError::invalid(
                    "input and content: send one",
                    Some("content"),
                ))
            }
            (None, None) => return Err(ApiError::invalid("input is missing", Some("input"))),
        };
        let text = |t: &str| {
            check_text_len(rd, st.n_ctx, t.len())?;
            model
                .tokenize(t, true, false)
                .map_err(|e| ApiError::invalid(e.to_string(), Some(field)))
        };
        let inputs: Vec<Vec<leap_host::Token>> = match input {
            Input::Text(t) => vec![text(&t)?],
            Input::Texts(v) => v.iter().map(|t| text(t)).collect::<Result<_, _>>()?,
            Input::Tokens(ids) => vec![to_tokens(&ids, model.n_vocab(), field)?],
            Input::TokenLists(v) => v
                .iter()
                .map(|ids| to_tokens(ids, model.n_vocab(), field))
                .collect::<Result<_, _>>()?,
        };
        if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
            return Err(ApiError::invalid(
                format!("{field}: an empty input"),
                Some(field),
            ));
        }
        if let Some(n) = inputs.iter().map(Vec::len).find(|&n| n > st.n_ctx as usize) {
            return Err(ApiError::too_long(format!(
                "an input of {n} tokens: more than the context of {} tokens",
                st.n_ctx
            )));
        }
        let mut ctx = embed
            .lock()
            .map_err(|_| ApiError::internal("the embedding context failed earlier"))?;
        let mut data = Vec::with_capacity(inputs.len());
        let mut batch = leap_host::Batch::new(st.n_ctx as usize, 1);
        for (i, toks) in inputs.iter().enumerate() {
            ctx.clear(false);
            batch.clear();
            for (p, &t) in toks.iter().enumerate() {
                batch
                    .add(t, p as i32, &[0], true)
                    .map_err(|e| ApiError::internal(e.to_string()))?;
            }
            ctx.decode(&batch)
                .map_err(|e| ApiError::internal(e.to_string()))?;
            let e = ctx
                .embedding(0)
                .map_err(|e| ApiError::internal(e.to_string()))?;
            // Euclidean norm 1, as llama-server's default (`embd_normalize` 2).
            let norm = e
                .iter()
                .map(|&x| f64::from(x) * f64::from(x))
                .sum::<f64>()
                .sqrt();
            let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
            let v = e.iter().map(|&x| (f64::from(x) * scale) as f32);
            let embedding = if base64 {
                // OpenAI's: the little-endian bytes of the float32 values.
                use base64::Engine as _;
                let bytes: Vec<u8> = v.flat_map(f32::to_le_bytes).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v.collect::<Vec<f32>>())
            };
            data.push(json!({"object": "embedding", "index": i, "embedding": embedding}));
        }
        let n: usize = inputs.iter().map(Vec::len).sum();
        Ok(json!({
            "object": "list",
            "data": data,
            "model": st.alias,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }))
    })
    .await?;
    Ok(Json(v).into_response())
}

async fn detokenize(State(s): St, body: Body) -> Result<Response, ApiError> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Req {
        tokens: Vec<i64>,
    }
    let (bytes, _budget) = read_body(&s, body).await?;
    let st = ready_arc(&s)?;
    let v = blocking(move || {
        let r: Req = oai::parse_plain(&bytes)?;
        let model = ready(&st)?.rt.model();
        let toks = to_tokens(&r.tokens, model.n_vocab(), "tokens")?;
        let content = model
            .detokenize(&toks, false, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
        Ok(json!({ "content": content }))
    })
    .await?;
    Ok(Json(v).into_response())
}

/// A chat request's messages, checked: not empty, not more than the context could hold
/// (each message is a token at least), not more text than it could hold.
fn chat_messages(
    r: &ChatRequest,
    rd: &Ready,
    n_ctx: u32,
) -> Result<Vec<leap_host::model::ChatMessage>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::invalid("messages is empty", Some("messages")));
    }
    if r.messages.len() > n_ctx as usize {
        return Err(ApiError::invalid(
            format!(
                "{} messages: a context of {n_ctx} tokens holds fewer",
                r.messages.len()
            ),
            Some("messages"),
        ));
    }
    let msgs = r
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| m.to_chat(i))
        .collect::<Result<Vec<_>, _>>()?;
    check_text_len(rd, n_ctx, msgs.iter().map(|m| m.content.len()).sum())?;
    Ok(msgs)
}

/// llama-server's `/apply-template`: the messages in the model's chat template, as text.
async fn apply_template(State(s): St, body: Body) -> Result<Response, ApiError> {
    let (bytes, _budget) = read_body(&s, body).await?;
    let st = ready_arc(&s)?;
    let v = blocking(move || {
        let r: ChatRequest = oai::parse(&bytes)?;
        let rd = ready(&st)?;
        let msgs = chat_messages(&r, rd, st.n_ctx)?;
        let text = rd
            .rt
            .model()
            .apply_chat_template(&msgs, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        Ok(json!({ "prompt": text }))
    })
    .await?;
    Ok(Json(v).into_response())
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
    /// llama-server's own `/completion`.
    Native,
}

/// Read a generation request's body and turn it into a prompt and its parameters with
/// `prepare`, on a blocking thread; the body's share of the budget is held until then.
async fn prepared(
    s: &Arc<AppState>,
    body: Body,
    prepare: impl FnOnce(&AppState, &Ready, &[u8]) -> Result<(Vec<leap_host::Token>, Params), ApiError>
        + Send
        + 'static,
) -> Result<Prepared, ApiError> {
    let (bytes, budget) = read_body(s, body).await?;
    let st = ready_arc(s)?;
    let r = blocking(move || {
        let rd = ready(&st)?;
        let (prompt, params) = prepare(&st, rd, &bytes)?;
        let grammar = match &params.constraint {
            None => None,
            Some((field, c)) => {
                Some(compile(rd, c).map_err(|e| ApiError::invalid(e.to_string(), Some(field)))?)
            }
        };
        Ok(Prepared {
            prompt,
            params,
            grammar,
        })
    })
    .await;
    drop(budget);
    r
}

/// A generation request read: its prompt, parameters and compiled grammar.
struct Prepared {
    prompt: Vec<leap_host::Token>,
    params: Params,
    grammar: Option<leap_host::grammar::Grammar>,
}

/// The grammar of a request's constraint: a schema llama.cpp's converter cannot express, or a
/// grammar it cannot parse, is the request's error.
fn compile(rd: &Ready, c: &oai::Constraint) -> leap_host::Result<leap_host::grammar::Grammar> {
    use leap_host::grammar::Grammar;
    match c {
        oai::Constraint::Gbnf(g) => Grammar::gbnf(rd.rt.model(), g),
        oai::Constraint::JsonSchema(s) => Grammar::json_schema(rd.rt.model(), s),
    }
}

async fn completions(
    State(s): St,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let p = prepared(&s, body, |st, rd, bytes| {
        completion_prompt(st, rd, oai::parse::<CompletionRequest>(bytes)?)
    })
    .await?;
    generate(s, p, Kind::Text, tenant).await
}

/// llama-server's own `/completion` (`n_predict`, `cache_prompt`, `return_tokens`, `n_probs`;
/// answered and streamed in its shape: `content`, `stop`, `tokens`, `timings`,
/// `completion_probabilities`).
async fn completion_native(
    State(s): St,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let p = prepared(&s, body, |st, rd, bytes| {
        let r = oai::parse::<oai::NativeRequest>(bytes)?.0;
        if r.return_tokens && r.common.stream {
            return Err(ApiError::invalid(
                "return_tokens with \"stream\": true is not supported here yet: send the \
                 request without streaming",
                Some("return_tokens"),
            ));
        }
        let return_tokens = r.return_tokens;
        let n_probs = match r.n_probs {
            None | Some(0) => None,
            Some(n) if (1..=oai::MAX_TOP_LOGPROBS).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(ApiError::invalid(
                    format!("n_probs {n}: from 0 to {}", oai::MAX_TOP_LOGPROBS),
                    Some("n_probs"),
                ))
            }
        };
        let (prompt, mut params) = completion_prompt(st, rd, r)?;
        params.return_tokens = return_tokens;
        params.logprobs = n_probs;
        Ok((prompt, params))
    })
    .await?;
    generate(s, p, Kind::Native, tenant).await
}

/// A completion request's prompt as tokens, and its parameters.
fn completion_prompt(
    st: &AppState,
    rd: &Ready,
    r: CompletionRequest,
) -> Result<(Vec<leap_host::Token>, Params), ApiError> {
    let params = r.common.params_seeded(st.seed)?;
    let model = rd.rt.model();
    let text = |t: &str| {
        check_text_len(rd, st.n_ctx, t.len())?;
        model
            .tokenize(t, true, r.parse_special)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
    };
    let prompt = match &r.prompt {
        Prompt::Text(t) => text(t)?,
        Prompt::Texts(v) if v.len() == 1 => text(&v[0])?,
        Prompt::Texts(v) => {
            return Err(ApiError::invalid(
                format!("{} prompts: this server takes one per request", v.len()),
                Some("prompt"),
            ))
        }
        Prompt::Tokens(ids) => to_tokens(ids, model.n_vocab(), "prompt")?,
    };
    Ok((prompt, params))
}

async fn chat(
    State(s): St,
    Extension(tenant): Extension<Tenant>,
    body: Body,
) -> Result<Response, ApiError> {
    let p = prepared(&s, body, |st, rd, bytes| {
        let r: ChatRequest = oai::parse(bytes)?;
        let mut params = r.common.params_seeded(st.seed)?;
        let mut msgs = chat_messages(&r, rd, st.n_ctx)?;
        let tools = crate::tools::Tools::from_request(
            r.tools.as_ref(),
            r.tool_choice.as_ref(),
            r.parallel_tool_calls,
        )?;
        if let Some(t) = tools {
            with_tools(&mut msgs, &mut params, t)?;
        }
        // The template's control tokens as control tokens; what the messages say as text.
        let prompt = rd
            .rt
            .model()
            .chat_tokens(&msgs, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        Ok((prompt, params))
    })
    .await?;
    generate(s, p, Kind::Chat, tenant).await
}

/// A chat request with tools: the system message describes them and the answer's shape, and
/// the answer is constrained to it ([`crate::tools`]).
///
/// # Errors
/// A 400 when the request also constrains the output itself (one constraint per request).
fn with_tools(
    msgs: &mut Vec<leap_host::model::ChatMessage>,
    params: &mut Params,
    tools: crate::tools::Tools,
) -> Result<(), ApiError> {
    if let Some((field, _)) = &params.constraint {
        return Err(ApiError::invalid(
            format!(
                "{field} and tools: a tool call's answer follows its own schema; send \
                 tool_choice \"none\" to constrain a text answer"
            ),
            Some(field),
        ));
    }
    let text = tools.instructions();
    match msgs.first_mut() {
        Some(m) if m.role == "system" => m.content = format!("{}\n\n{text}", m.content),
        _ => msgs.insert(
            0,
            leap_host::model::ChatMessage {
                role: "system".into(),
                content: text,
            },
        ),
    }
    params.constraint = Some(("tools", oai::Constraint::JsonSchema(tools.schema())));
    params.tools = Some(Arc::new(tools));
    Ok(())
}

/// Queue the request on a slot and answer: a JSON body, or server-sent events.
async fn generate(
    s: Arc<AppState>,
    prepared: Prepared,
    kind: Kind,
    tenant: Tenant,
) -> Result<Response, ApiError> {
    let Prepared {
        prompt,
        params: p,
        grammar,
    } = prepared;
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    leap_spec::session::fits(prompt.len(), p.max_tokens.unwrap_or(1), s.n_ctx)?;
    if let Some(slot) = p.slot.filter(|&k| k >= s.total_slots) {
        return Err(ApiError::invalid(
            format!(
                "id_slot {slot}: this server has {} slot{} (0 to {}), or -1 for any",
                s.total_slots,
                if s.total_slots == 1 { "" } else { "s" },
                s.total_slots - 1
            ),
            Some("id_slot"),
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    s.metrics.queued();
    let submitted = ready(&s)?.pool.submit(Job {
        prompt,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop.clone(),
        events: tx,
        tenant,
        cache_prompt: p.cache_prompt,
        logprobs: p.logprobs,
        grammar: std::sync::Mutex::new(grammar),
        slot: p.slot,
    });
    if let Err(e) = submitted {
        s.metrics.dequeued();
        return Err(e);
    }
    let id = format!(
        "{}-{}",
        match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text | Kind::Native => "cmpl",
        },
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    );
    let head = Head {
        id,
        created: now(),
        model: s.alias.clone(),
        kind,
        drafting: s.drafting_stats,
        return_tokens: p.return_tokens,
        tools: p.tools.clone(),
        slot: p.slot,
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
    /// Report the request's drafting in `timings` (`--drafting-stats`).
    drafting: bool,
    /// `/completion`'s `return_tokens`.
    return_tokens: bool,
    /// A chat request's tools: the text is an answer to parse ([`Head::answer`]).
    tools: Option<Arc<crate::tools::Tools>>,
    /// The slot the request named (`id_slot`).
    slot: Option<usize>,
}

impl Head {
    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Text | Kind::Native, _) => "text_completion",
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

    /// `/completion`'s last object: the text (all of it, unstreamed; none after a stream),
    /// why it stopped and the counts.
    fn native(&self, o: &Outcome, content: &str) -> Value {
        let stop_type = match (o.finish, o.word) {
            (crate::slots::Finish::Length, _) => "limit",
            (_, true) => "word",
            _ => "eos",
        };
        let mut v = json!({
            "index": 0,
            "content": content,
            "tokens": if self.return_tokens { o.tokens.clone() } else { Vec::new() },
            "id_slot": self.id_slot(),
            "stop": true,
            "model": self.model,
            "tokens_predicted": o.completion_tokens,
            "tokens_evaluated": o.prompt_tokens,
            "tokens_cached": o.cached_tokens,
            "stop_type": stop_type,
            "truncated": false,
            "timings": o.timings(self.drafting),
        });
        if let Some(l) = o.logprobs.as_deref() {
            v["completion_probabilities"] = native_probs(l);
        }
        v
    }

    /// `/completion`'s `id_slot`: the slot the request named, else -1 (any).
    fn id_slot(&self) -> i64 {
        self.slot.map_or(-1, |s| s as i64)
    }

    /// A chat answer's message and finish reason: with tools, the calls the text makes
    /// (`tool_calls`) or the text answer in it; the text as it is when it is not an answer
    /// (cut short by a length limit or a stop string).
    fn answer(&self, text: &str, finish: &'static str) -> (Value, &'static str) {
        use crate::tools::Answer;
        match self.tools.as_deref().map(|t| t.parse(text)) {
            Some(Some(Answer::Calls(calls))) => (
                json!({"role": "assistant", "content": null,
                       "tool_calls": crate::tools::calls_json(&calls, &self.id)}),
                "tool_calls",
            ),
            Some(Some(Answer::Text(t))) => (json!({"role": "assistant", "content": t}), finish),
            _ => (json!({"role": "assistant", "content": text}), finish),
        }
    }

    /// A streamed chunk's one choice.
    fn chunk(&self, text: &str, finish: Option<&str>, first: bool) -> Value {
        let choice = match self.kind {
            Kind::Native => {
                return json!({"index": 0, "content": text, "tokens": [], "stop": false,
                              "id_slot": self.id_slot()});
            }
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
    let logprobs = o
        .logprobs
        .as_deref()
        .map_or(Value::Null, |l| logprobs_json(head.kind, l));
    let choice = match head.kind {
        Kind::Native => return Ok(Json(head.native(&o, &text)).into_response()),
        Kind::Text => json!({
            "index": 0,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": o.finish.as_str(),
        }),
        Kind::Chat => {
            let (message, finish) = head.answer(&text, o.finish.as_str());
            json!({
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish,
            })
        }
    };
    let mut v = head.wrap(false, json!([choice]), Some(("usage", o.usage())));
    v["timings"] = o.timings(head.drafting);
    Ok(Json(v).into_response())
}

/// `n_probs`' `completion_probabilities` as llama-server answers them: for each token its
/// `id`, `token`, `bytes` and `logprob`, and its position's most likely in `top_logprobs`.
fn native_probs(l: &[crate::slots::Logprob]) -> Value {
    let piece = |p: &crate::slots::Piece| json!({"id": p.id, "token": p.text, "bytes": p.bytes, "logprob": p.logprob});
    l.iter()
        .map(|e| {
            let mut v = piece(&e.token);
            v["top_logprobs"] = e.top.iter().map(piece).collect();
            v
        })
        .collect()
}

/// `logprobs` as OpenAI answers them: chat's `{"content": [{token, logprob, bytes,
/// top_logprobs}]}`, or the completions API's `{tokens, token_logprobs, top_logprobs,
/// text_offset}`.
fn logprobs_json(kind: Kind, l: &[crate::slots::Logprob]) -> Value {
    match kind {
        Kind::Chat => {
            let piece = |p: &crate::slots::Piece| json!({"token": p.text, "logprob": p.logprob, "bytes": p.bytes});
            let content: Vec<Value> = l
                .iter()
                .map(|e| {
                    let mut v = piece(&e.token);
                    v["top_logprobs"] = e.top.iter().map(piece).collect();
                    v
                })
                .collect();
            json!({"content": content, "refusal": null})
        }
        Kind::Text | Kind::Native => {
            let mut offset = 0;
            let offsets: Vec<usize> = l
                .iter()
                .map(|e| {
                    let at = offset;
                    offset += e.token.text.chars().count();
                    at
                })
                .collect();
            json!({
                "tokens": l.iter().map(|e| e.token.text.clone()).collect::<Vec<_>>(),
                "token_logprobs": l.iter().map(|e| e.token.logprob).collect::<Vec<_>>(),
                "top_logprobs": l
                    .iter()
                    .map(|e| {
                        e.top
                            .iter()
                            .map(|p| (p.text.clone(), json!(p.logprob)))
                            .collect::<serde_json::Map<_, _>>()
                    })
                    .collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

/// The request's events as server-sent events: a chunk per piece of text, a last chunk with
/// the finish reason (and llama-server's `timings`, and the logprobs when asked for), the
/// usage chunk when asked for, then `[DONE]`. An error after the stream began is sent as an `error` object, then `[DONE]`.
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
        /// With tools, the text until it ends (an answer is parsed whole).
        held: Option<String>,
    }
    let st = St {
        held: head.tools.as_ref().map(|_| String::new()),
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
                if let Some(h) = st.held.as_mut() {
                    h.push_str(&t);
                    Vec::new()
                } else {
                    let v = st.head.chunk(&t, None, st.first);
                    st.first = false;
                    vec![json_event(&v)]
                }
            }
            Some(Event::Done(o)) if st.head.kind == Kind::Native => {
                // llama-server's stream ends with its last object, and no `[DONE]`.
                st.done = true;
                vec![json_event(&st.head.native(&o, ""))]
            }
            Some(Event::Done(o)) => {
                st.done = true;
                let mut events = Vec::new();
                let mut finish = o.finish.as_str();
                if let Some(text) = st.held.take() {
                    // The answer in one delta, as OpenAI streams a call: its role, and the
                    // text or each call (with its index) whole.
                    let (mut delta, f) = st.head.answer(&text, finish);
                    finish = f;
                    if let Some(calls) = delta.get_mut("tool_calls").and_then(Value::as_array_mut) {
                        for (i, c) in calls.iter_mut().enumerate() {
                            c["index"] = json!(i);
                        }
                    }
                    let mut v = st.head.chunk("", None, true);
                    v["choices"][0]["delta"] = delta;
                    events.push(json_event(&v));
                } else if st.first && st.head.kind == Kind::Chat {
                    // Every chat stream opens with the assistant's role.
                    events.push(json_event(&st.head.chunk("", None, true)));
                }
                let mut last = st.head.chunk("", Some(finish), false);
                last["timings"] = o.timings(st.head.drafting);
                if let Some(l) = o.logprobs.as_deref() {
                    // They come from one pass over the output after it is generated
                    // (Session::score): all of them with the last chunk, where clients that
                    // gather a stream's logprobs (the openai package) add them to the rest.
                    last["choices"][0]["logprobs"] = logprobs_json(st.head.kind, l);
                }
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
