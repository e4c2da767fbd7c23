//! One module per endpoint, plus the generation driver they share.

pub(crate) mod chat;
pub(crate) mod completions;
mod generation;
pub(crate) mod metrics;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

/// Accepts the served model name (or no name).
pub(crate) fn check_model(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(name) if name != state.config.served_model_name => {
            Err(ApiError::model_not_found(name))
        }
        _ => Ok(()),
    }
}

/// `GET /v1/models`.
pub(crate) async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "corral",
            "max_model_len": state.config.max_context,
        }],
    }))
}

/// `GET /health`: 200 while the engine thread runs, 503 once it has stopped.
pub(crate) async fn health(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    if state
        .engine
        .metrics()
        .engine_alive
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        Ok(Json(json!({"status": "ok"})))
    } else {
        Err(ApiError::unavailable("the engine has stopped"))
    }
}
