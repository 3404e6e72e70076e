//! Errors: [`ServerError`] for starting the server, [`ApiError`] for answering a request.
//!
//! Every HTTP error is an OpenAI-style JSON body, `{"error": {"message", "type", "param", "code"}}`. Client errors
//! say exactly what is wrong with the request (naming the field); server errors are logged in full and answered
//! with a generic message, so internals (paths, engine messages) never reach the client.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Seconds a client is told to wait (`Retry-After`) when the queue is full.
pub const RETRY_AFTER_SECS: u64 = 5;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The model has no tokenizer, or it lacks K3's chat markup.
    #[error("model {model}: {msg}")]
    Model {
        /// The served model id.
        model: String,
        /// What is missing.
        msg: String,
    },
    /// The engine thread could not be started.
    #[error("cannot start the engine thread: {0}")]
    Thread(std::io::Error),
    /// Binding or serving the socket failed.
    #[error("serving on {addr}: {source}")]
    Io {
        /// The address.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// An error answered to an HTTP client.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// The request is malformed or asks for something unsupported (400). `param` names the field at fault.
    BadRequest {
        /// What is wrong, in lower case.
        message: String,
        /// The field at fault, if one is.
        param: Option<String>,
        /// A machine-readable code.
        code: &'static str,
    },
    /// Missing or wrong API key (401).
    Unauthorized,
    /// The requested model is not the one served (404).
    ModelNotFound {
        /// The model the request named.
        requested: String,
        /// The model this server serves.
        served: String,
    },
    /// No such route (404).
    NotFound(String),
    /// The route exists but not for this method (405).
    MethodNotAllowed,
    /// The body is larger than the configured limit (413).
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The queue in front of the engine is full (429, with `Retry-After`).
    Busy,
    /// Something failed inside the server (500). The detail is logged, never returned.
    Internal(String),
    /// The engine thread is gone or the server is shutting down (503). The detail is logged, never returned.
    Unavailable(String),
}

impl ApiError {
    /// A 400 naming `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param.into()),
            code: "invalid_value",
        }
    }

    /// A 400 for a field the server does not support.
    pub fn unsupported(param: &str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param.to_owned()),
            code: "unsupported_field",
        }
    }

    /// A 400 that concerns the request as a whole.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: None,
            code: "invalid_request",
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound { .. } | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Busy => StatusCode::TOO_MANY_REQUESTS,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The JSON body (`{"error": {...}}`); logs the detail of server errors.
    pub fn body(&self) -> serde_json::Value {
        let (message, kind, param, code): (String, &str, Option<&str>, Option<&str>) = match self {
            Self::BadRequest {
                message,
                param,
                code,
            } => (
                message.clone(),
                "invalid_request_error",
                param.as_deref(),
                Some(code),
            ),
            Self::Unauthorized => (
                "missing or invalid API key: send `Authorization: Bearer <key>`".to_owned(),
                "authentication_error",
                None,
                Some("invalid_api_key"),
            ),
            Self::ModelNotFound { requested, served } => (
                format!("the model `{requested}` does not exist; this server serves `{served}`"),
                "invalid_request_error",
                Some("model"),
                Some("model_not_found"),
            ),
            Self::NotFound(path) => (
                format!("no such endpoint: {path}"),
                "invalid_request_error",
                None,
                Some("not_found"),
            ),
            Self::MethodNotAllowed => (
                "method not allowed for this endpoint".to_owned(),
                "invalid_request_error",
                None,
                Some("method_not_allowed"),
            ),
            Self::PayloadTooLarge { limit } => (
                format!("request body too large: the limit is {limit} bytes"),
                "invalid_request_error",
                None,
                Some("request_too_large"),
            ),
            Self::Busy => (
                format!(
                    "the server is busy: one generation runs and the queue behind it is full; retry in \
                     {RETRY_AFTER_SECS} s"
                ),
                "rate_limit_error",
                None,
                Some("server_busy"),
            ),
            Self::Internal(detail) => {
                tracing::error!("internal error: {detail}");
                (
                    "internal server error (details are in the server log)".to_owned(),
                    "server_error",
                    None,
                    None,
                )
            }
            Self::Unavailable(detail) => {
                tracing::error!("service unavailable: {detail}");
                (
                    "the server cannot generate right now (details are in the server log)"
                        .to_owned(),
                    "server_error",
                    None,
                    Some("unavailable"),
                )
            }
        };
        json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::BadRequest { message, .. } => f.write_str(message),
            Self::Internal(d) | Self::Unavailable(d) => write!(f, "{}: {d}", self.status()),
            other => write!(f, "{}", other.status()),
        }
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        let headers = response.headers_mut();
        match self {
            Self::Busy => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECS));
            }
            Self::Unauthorized => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        response
    }
}
