//! The server layer: an OpenAI-compatible HTTP API over the engine thread.
//!
//! [`router`] builds the axum router (testable without a socket): `POST /v1/chat/completions`,
//! `POST /v1/completions`, `POST /v1/messages` (Anthropic's), `GET /v1/models`, `POST /tokenize`, `POST /detokenize`, `GET /health`,
//! `GET /metrics`. Bodies are read by one extractor and decoded, per wire format, into
//! Corral's typed requests (`request/`); every failure is an [`ApiError`], in OpenAI's shape
//! or on Anthropic's routes in Anthropic's. One driver (`driver/`) runs every generation:
//! generated text is split into reasoning, text and tool calls by `output.rs` in the model's
//! [`syntax::OutputSyntax`], gathered into a reply, and written out by the endpoint's
//! renderer (`routes/`). [`serve`] runs the router until a shutdown signal.

mod driver;
mod error;
mod extract;
mod grammar;
mod output;
mod prompt;
mod request;
mod routes;
mod state;
pub mod syntax;

use std::future::Future;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};

pub use error::ApiError;
pub use routes::responses::ResponseStore;
pub use state::{AppState, RequestCounts, ServerConfig};

/// Counts a response by its matched route and status, and logs a rejected request with its
/// reason (a client's error is otherwise seen only by the client).
async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let path = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or_else(|| "other".to_string(), |p| p.as_str().to_string());
    let response = next.run(req).await;
    state.requests.record(&path, response.status().as_u16());
    if let Some(error) = response.extensions().get::<ApiError>()
        && error.status.is_client_error()
    {
        tracing::warn!(
            route = %path,
            status = error.status.as_u16(),
            param = %error.param.as_deref().unwrap_or("-"),
            "request rejected: {}",
            error.message
        );
    }
    response
}

/// Errors of Anthropic's endpoints (`/v1/messages...`) in Anthropic's shape, whatever
/// answered them (the handler, the JSON extractor, the API key check).
async fn anthropic_errors(req: Request, next: Next) -> Response {
    let anthropic = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .is_some_and(|p| p.as_str().starts_with("/v1/messages"));
    let response = next.run(req).await;
    let Some(error) = response.extensions().get::<ApiError>().cloned() else {
        return response;
    };
    if !anthropic {
        return response;
    }
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let body = axum::body::Body::from(error.anthropic_body().to_string());
    Response::from_parts(parts, body)
}

/// CORS for the origins `--allowed-origins` names: a preflight (`OPTIONS` with an
/// `Origin`) from one of them is answered here, before the API key is asked for, and other
/// responses to them carry `Access-Control-Allow-Origin`. Other origins get no CORS headers,
/// so browsers keep them out.
async fn cors(State(state): State<AppState>, req: Request, next: Next) -> Response {
    use axum::http::{HeaderValue, Method, StatusCode, header};
    let allowed = &state.config.allowed_origins;
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .map(str::to_string);
    let allow = origin.as_deref().and_then(|o| {
        if allowed.iter().any(|a| a == "*") {
            Some("*".to_string())
        } else {
            allowed.iter().any(|a| a == o).then(|| o.to_string())
        }
    });
    let Some(allow) = allow.and_then(|a| HeaderValue::from_str(&a).ok()) else {
        return next.run(req).await;
    };
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    let mut response = if preflight {
        let mut r = Response::new(axum::body::Body::empty());
        *r.status_mut() = StatusCode::NO_CONTENT;
        let h = r.headers_mut();
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static(
                "authorization, content-type, x-api-key, x-session-id, anthropic-version",
            ),
        );
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        r
    } else {
        next.run(req).await
    };
    let h = response.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, allow);
    h.append(header::VARY, HeaderValue::from_static("Origin"));
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
        .route("/v1/responses", post(routes::responses::create))
        .route("/v1/responses/{id}", get(routes::responses::retrieve))
        .route("/v1/messages", post(routes::messages::messages))
        .route(
            "/v1/messages/count_tokens",
            post(routes::messages::count_tokens),
        )
        .route("/tokenize", post(routes::tokenize::tokenize))
        .route("/detokenize", post(routes::tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            extract::require_api_key,
        ))
        .route_layer(middleware::from_fn(anthropic_errors))
        .route_layer(count.clone());
    let service = Router::new()
        .route("/health", get(routes::health))
        .route("/metrics", get(routes::metrics::metrics))
        .route_layer(count);
    Router::new()
        .merge(api)
        .merge(service)
        .layer(DefaultBodyLimit::max(state.config.max_body_bytes))
        .layer(middleware::from_fn_with_state(state.clone(), cors))
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
