//! One module per endpoint: its handler and its wire format's renderer.

pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod messages;
pub(crate) mod metrics;
pub(crate) mod responses;
pub(crate) mod tokenize;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::state::AppState;

/// Accepts the served model name, any of its aliases, or no name.
pub(crate) fn check_model(state: &AppState, requested: Option<&str>) -> Result<(), ApiError> {
    match requested {
        Some(name)
            if name != state.config.served_model_name
                && !state.config.model_aliases.iter().any(|a| a == name) =>
        {
            Err(ApiError::model_not_found(name))
        }
        _ => Ok(()),
    }
}

/// `GET /v1/models`: the served name, then its aliases.
pub(crate) async fn models(State(state): State<AppState>) -> Json<Value> {
    let names = std::iter::once(&state.config.served_model_name).chain(&state.config.model_aliases);
    let data: Vec<Value> = names
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": state.created,
                "owned_by": "corral",
                "root": state.config.served_model_name,
                "max_model_len": state.config.max_context,
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data}))
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
