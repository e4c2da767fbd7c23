//! The server layer: an OpenAI-compatible HTTP API over the engine thread.
//!
//! [`router`] builds the axum router (testable without a socket): `POST /v1/chat/completions`,
//! `POST /v1/completions`, `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health`,
//! `GET /metrics`. Bodies are read by
//! one extractor and validated into engine requests by `request.rs`; every failure is an
//! [`ApiError`] rendered as OpenAI's error object. Generated text is split into content,
//! reasoning and tool calls by `output.rs`. [`serve`] runs the router until a shutdown signal.

mod error;
mod extract;
mod output;
mod request;
mod routes;
mod state;

use std::future::Future;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};

pub use error::ApiError;
pub use output::{Delta, OutputParser};
pub use state::{AppState, RequestCounts, ServerConfig};

/// Counts a response by its matched route and status.
async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let response = next.run(req).await;
    state.requests.record(&path, response.status().as_u16());
    response
}

/// The API's router. Responses are counted per matched route (route layers see the route);
/// paths that match nothing are plain 404s and not counted, so clients cannot grow the
/// metrics with made-up paths.
pub fn router(state: AppState) -> Router {
    let count = middleware::from_fn_with_state(state.clone(), count_requests);
    let api = Router::new()
        .route("/v1/chat/completions", post(routes::chat::chat_completions))
        .route("/v1/completions", post(routes::completions::completions))
        .route("/v1/models", get(routes::models))
        .route("/tokenize", post(routes::tokenize::tokenize))
        .route("/detokenize", post(routes::tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            extract::require_api_key,
        ))
        .route_layer(count.clone());
    let service = Router::new()
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics::metrics))
        .route_layer(count);
    Router::new()
        .merge(api)
        .merge(service)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .with_state(state)
}

/// Serves `state` on `listener` until `shutdown` completes, then lets requests in flight end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
