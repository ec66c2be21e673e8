//! Errors the proxy answers itself, in OpenAI's shape (`{"error": {"message", "type", "param",
//! "code"}}`) so OpenAI client libraries show the message; every one has a `Content-Length`.
//! Upstream errors are passed through as the model server wrote them.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ProxyApiError {
    pub status: StatusCode,
    pub message: String,
    pub code: &'static str,
    pub param: Option<String>,
    /// Seconds, for 429/503.
    pub retry_after: Option<u32>,
}

impl ProxyApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ProxyApiError { status, message: message.into(), code, param: None, retry_after: None }
    }

    pub fn bad_json(e: &dyn std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            format!("request body is not valid JSON ({e}); send a JSON object such as {{\"model\": \"...\", \"messages\": [...]}}"),
        )
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!(
                "request body is larger than this proxy's limit of {limit} bytes (limits.max_body_bytes)"
            ),
        )
    }

    pub fn model_not_found(model: &str, pool: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "model_not_found",
            format!("The model `{model}` does not exist in pool {pool}; GET /v1/models lists the models served here."),
        );
        e.param = Some("model".into());
        e
    }

    /// A key that appears twice in one JSON object of the body.
    pub fn duplicate_key(key: &str, at: &str) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "duplicate_key",
            format!("the JSON body has the key {key:?} more than once ({at}); send each key once, so that every reader of the request sees the same value"),
        );
        e.param = Some(key.to_string());
        e
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this endpoint does not take that method (the completions endpoints take POST; /v1/models, /health and /metrics take GET)",
        )
    }

    pub fn with_retry_after(mut self, s: u32) -> Self {
        self.retry_after = Some(s);
        self
    }

    /// OpenAI's `type` for a status.
    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            502 | 504 => "upstream_error",
            503 => "service_unavailable_error",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind(), "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ProxyApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// An error with its sources, one line ("connection refused" sits a few levels down in reqwest).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}
