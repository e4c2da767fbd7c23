//! Request extraction at the edge: the JSON body extractor that turns every malformed body
//! into an [`ApiError`] (in the route's API's shape, `lib.rs`), and the API-key check.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::state::AppState;

/// A request body that is a JSON object; anything else is a 400 (or 413 when too large).
#[derive(Debug)]
pub(crate) struct JsonBody(pub(crate) Map<String, Value>);

impl FromRequest<AppState> for JsonBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(state.config.max_body_bytes)
            } else {
                ApiError::bad_body(format!(
                    "could not read the request body: {}",
                    rejection.body_text()
                ))
            }
        })?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| ApiError::bad_body(format!("request body is not valid UTF-8: {e}")))?;
        match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(map)) => Ok(JsonBody(map)),
            Ok(_) => Err(ApiError::bad_body("request body must be a JSON object")),
            Err(e) => Err(ApiError::bad_body(format!(
                "request body is not valid JSON: {e}"
            ))),
        }
    }
}

/// Rejects `/v1/*` requests without the configured bearer token.
pub(crate) async fn require_api_key(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Response {
    if let Some(key) = &state.config.api_key {
        // OpenAI's `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`.
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .or_else(|| req.headers().get("x-api-key").and_then(|v| v.to_str().ok()));
        if given != Some(key.as_str()) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}
