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
        (self.status, Json(self.body())).into_response()
    }
}
