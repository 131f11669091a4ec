//! Errors as OpenAI's API returns them: a JSON object `{"error": {message, type, param,
//! code}}` with a 4xx status for anything the client sent, 5xx only for the server's own
//! failures.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An error answered to a client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    /// The request field at fault.
    pub param: Option<String>,
    /// OpenAI's `code` (`context_length_exceeded`, `invalid_api_key`, ...).
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (a 503 for a full server).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// 400: the request is malformed or a field is out of range.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_owned),
            code: None,
            retry_after: None,
        }
    }

    /// 400 `context_length_exceeded`.
    pub fn too_long(message: impl Into<String>) -> Self {
        Self {
            code: Some("context_length_exceeded"),
            ..Self::invalid(message, Some("max_tokens"))
        }
    }

    /// 401: no or a wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "invalid or missing API key: send `Authorization: Bearer KEY`".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 501: an endpoint this server serves only when started so (llama-server's answer).
    pub fn not_implemented(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_IMPLEMENTED,
            message: message.into(),
            kind: "not_supported_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 404: no such route.
    pub fn not_found(path: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
            retry_after: None,
        }
    }

    /// 413: the body is larger than `--max-body`.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body exceeds {limit} bytes (--max-body)"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
            retry_after: None,
        }
    }

    /// 503: the model is still loading, or the server is shutting down.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "unavailable_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 503 with `Retry-After`: the server is full (`code` says of what); the request was not
    /// started.
    pub fn busy(message: impl Into<String>, code: &'static str, retry_after: u32) -> Self {
        Self {
            code: Some(code),
            retry_after: Some(retry_after),
            ..Self::unavailable(message)
        }
    }

    /// 503 `too_many_connections`: the connection is over `--max-connections`.
    pub fn too_many_connections() -> Self {
        Self::busy(
            "too many open connections (--max-connections); retry shortly",
            "too_many_connections",
            1,
        )
    }

    /// 408 `request_timeout`: the body did not arrive within `--timeout` seconds.
    pub fn body_timeout(seconds: u64) -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            message: format!("the request body did not arrive within {seconds} s (--timeout)"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_timeout"),
            retry_after: None,
        }
    }

    /// 403 `forbidden_host`: the request names a host this server does not serve.
    pub fn forbidden_host(what: &str, value: &str) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            message: format!(
                "{what} {value:?} is not a host this server answers for (--allowed-hosts)"
            ),
            kind: "permission_error",
            param: None,
            code: Some("forbidden_host"),
            retry_after: None,
        }
    }

    /// 500: the engine failed on a request that was valid.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The error object, as a JSON value (also sent as an SSE event mid-stream).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<leap_spec::session::Error> for ApiError {
    fn from(e: leap_spec::session::Error) -> Self {
        use leap_spec::session::Error as E;
        match &e {
            E::ContextFull { .. } => Self::too_long(e.to_string()),
            E::InvalidArgument(_) => Self::invalid(e.to_string(), None),
            E::Host(leap_host::Error::InvalidToken { .. }) => Self::invalid(e.to_string(), None),
            _ => Self::internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
