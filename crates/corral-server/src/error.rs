//! `ApiError`: every failure the API reports, rendered as OpenAI's error object
//! `{"error": {"message", "type", "param", "code"}}` with the matching HTTP status.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message naming what is wrong.
    pub message: String,
    /// OpenAI error type (`invalid_request_error`, `authentication_error`, …).
    pub kind: &'static str,
    /// The request field at fault, if any.
    pub param: Option<String>,
    /// A short machine-readable code, if any.
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: a field is missing, of the wrong type or out of range.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    /// 400 without a single culprit field (malformed JSON, bad encoding).
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect or missing API key: send `Authorization: Bearer <key>`".to_string(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    /// 404: the model name is not the one served.
    pub fn model_not_found(name: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{name}` does not exist"),
            kind: "invalid_request_error",
            param: Some("model".to_string()),
            code: Some("model_not_found"),
        }
    }

    /// 404: a stored object that does not exist (or is no longer kept).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }

    /// 413: the body exceeds the limit.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("request body exceeds the limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: Some("request_too_large"),
        }
    }

    /// 429: the wait queue is full.
    pub fn busy(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }

    /// 503: the engine is not running.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 500: something failed inside the server.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The error as Anthropic's Messages API writes one: `{"type": "error", "error":
    /// {"type", "message"}}`, its type named for the status as Anthropic names them.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let kind = match self.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        let message = match &self.param {
            Some(param) if !self.message.contains(param.as_str()) => {
                format!("{param}: {}", self.message)
            }
            _ => self.message.clone(),
        };
        json!({"type": "error", "error": {"type": kind, "message": message}})
    }

    /// The error object as JSON.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::error!(status = %self.status, "{}", self.message);
        }
        let mut response = (self.status, Json(self.body())).into_response();
        // For the log line of the request (`count_requests`), which knows its route.
        response.extensions_mut().insert(self.clone());
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
