//! The HTTP API end to end on the repo's demo model, through the router without a socket:
//! chat and text completions, streaming and not, concurrency, cancellation by disconnect
//! (blocks return to the pool), every bad input of the list, auth and the full-queue 429.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode, header};
use corral_cpu::CpuBackend;
use corral_engine::{
    ChatTemplate, EngineConfig, EngineHandle, Tokenizer, TokenizerConfig, spawn_engine,
    stop_token_ids,
};
use corral_model::Model;
use corral_server::{AppState, RequestCounts, ServerConfig, router};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tower::ServiceExt;

mod anthropic;
mod completions;
mod responses;
mod service;
mod tools;

struct Server {
    app: Router,
    engine: EngineHandle,
}

fn server(api_key: Option<&str>, max_queue: usize, max_context: usize) -> Server {
    server_with_template(api_key, max_queue, max_context, None, json!({}))
}

/// A server on the demo model with the chat template `template` in place of its own, and
/// `kwargs` as the template variables requests leave out.
fn server_with_template(
    api_key: Option<&str>,
    max_queue: usize,
    max_context: usize,
    template: Option<String>,
    kwargs: Value,
) -> Server {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-qwen3-moe");
    let model = Model::load(&dir, Arc::new(CpuBackend::new()), &mut |_, _| {}).unwrap();
    let config = model.config().clone();
    let (engine, _thread) = spawn_engine(
        model,
        EngineConfig {
            max_batch: 4,
            max_prefill_tokens: 64,
            max_queue,
            kv_blocks: 256,
            block_size: 16,
            max_context,
            prefix_cache: true,
            state_checkpoints: 16,
            session_pin: std::time::Duration::from_secs(600),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let stop_ids = stop_token_ids(&dir, &config.eos_token_ids).unwrap();
    let mut chat_template = TokenizerConfig::from_dir(&dir).unwrap();
    if template.is_some() {
        chat_template.chat_template = template;
    }
    let state = AppState {
        engine: engine.clone(),
        grammars: tokenizer
            .grammar_compiler(&stop_ids)
            .map_err(|e| e.to_string()),
        tokenizer: Arc::new(tokenizer),
        syntax: corral_server::syntax::for_template(chat_template.chat_template.as_deref()),
        chat_template: Some(Arc::new(ChatTemplate::new(&chat_template).unwrap())),
        config: Arc::new(ServerConfig {
            served_model_name: "tiny".to_string(),
            model_aliases: vec!["tiny-alias".to_string()],
            api_key: api_key.map(str::to_string),
            max_body_bytes: 64 * 1024,
            max_context,
            vocab_size: config.vocab_size,
            stop_token_ids: stop_ids,
            sampling_defaults: Default::default(),
            allowed_origins: vec!["https://app.example".to_string()],
            chat_template_kwargs: kwargs.as_object().cloned().unwrap_or_default(),
        }),
        requests: Arc::new(RequestCounts::default()),
        responses: Default::default(),
        created: 0,
    };
    Server {
        app: router(state),
        engine,
    }
}

fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.into())
        .unwrap()
}

async fn call(app: &Router, req: Request<Body>) -> (StatusCode, Value, axum::http::HeaderMap) {
    let response = app.clone().oneshot(req).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or(Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value, headers)
}

fn chat_body(extra: Value) -> String {
    let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body.to_string()
}

/// The `data:` payloads of an SSE body.
async fn sse_events(response: axum::response::Response) -> Vec<String> {
    let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    String::from_utf8(bytes.to_vec())
        .unwrap()
        .lines()
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

async fn wait_for_zero_blocks(engine: &EngineHandle) {
    let start = Instant::now();
    while engine.metrics().kv_blocks_used.load(Ordering::Relaxed) != 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "KV blocks never returned to the pool"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Log output captured by a subscriber.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log of the whole test binary, captured by one global subscriber: a subscriber set for
/// one test only (`set_default`) races with the other tests' threads over tracing's cached
/// per-callsite interest, and its events were sometimes dropped.
fn captured_log() -> &'static Captured {
    static LOG: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let _ = tracing::subscriber::set_global_default(subscriber);
        captured
    })
}

/// The prompt tokens `corral_prompt_tokens_total` reports.
fn body_prompt_tokens(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("corral_prompt_tokens_total "))
        .and_then(|v| v.parse().ok())
        .expect("corral_prompt_tokens_total")
}

/// Qwen3.5's official chat template (tool calls in XML, system messages only at the start),
/// as `scripts/fetch_templates.sh` fetches it; `None`, said, where it is missing and not
/// required (CI requires it).
fn qwen35_template() -> Option<String> {
    let dir = std::env::var_os("CORRAL_TEMPLATES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/qwen-templates")
        });
    let path = dir.join("Qwen3.5-4B.jinja");
    match std::fs::read_to_string(&path) {
        Ok(source) => Some(source),
        Err(_) => {
            assert!(
                std::env::var_os("CORRAL_REQUIRE_TEMPLATES").is_none(),
                "{} is missing (scripts/fetch_templates.sh fetches it)",
                path.display()
            );
            eprintln!(
                "skipped: {} is missing (run scripts/fetch_templates.sh)",
                path.display()
            );
            None
        }
    }
}

/// One request's SSE events as (event name, data) pairs.
async fn named_sse_events(app: &Router, req: Request<Body>) -> Vec<(String, Value)> {
    let response = app.clone().oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let mut events = Vec::new();
    let mut name = String::new();
    for line in text.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(data) = line.strip_prefix("data: ")
            && let Ok(value) = serde_json::from_str::<Value>(data)
        {
            events.push((std::mem::take(&mut name), value));
        }
    }
    events
}

/// A forecast tool whose every parameter is bounded by its schema: a string's `maxLength`,
/// a string `enum`, a bounded integer, a nested object of a bounded integer and an enum.
fn forecast_tool() -> Value {
    json!({"type": "function", "function": {"name": "forecast", "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "units": {"type": "string", "enum": ["metric", "imperial"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "where": {"type": "object", "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "zone": {"enum": ["UTC", "CET"]}},
                "required": ["lat", "zone"], "additionalProperties": false}},
        "required": ["city", "units", "days", "where"]}}})
}

/// Whether `arguments` (a JSON object) are valid for [`forecast_tool`].
fn check_forecast(arguments: &Value) {
    let a = arguments
        .as_object()
        .unwrap_or_else(|| panic!("{arguments}"));
    assert_eq!(a.len(), 4, "{arguments}");
    let city = a["city"].as_str().unwrap_or_else(|| panic!("{arguments}"));
    assert!(city.chars().count() <= 24, "{arguments}");
    assert!(
        ["metric", "imperial"].contains(&a["units"].as_str().unwrap_or("")),
        "{arguments}"
    );
    assert!(
        a["days"].as_i64().is_some_and(|d| (1..=14).contains(&d)),
        "{arguments}"
    );
    let place = a["where"]
        .as_object()
        .unwrap_or_else(|| panic!("{arguments}"));
    assert_eq!(place.len(), 2, "{arguments}");
    assert!(
        place["lat"]
            .as_i64()
            .is_some_and(|l| (-90..=90).contains(&l)),
        "{arguments}"
    );
    assert!(
        ["UTC", "CET"].contains(&place["zone"].as_str().unwrap_or("")),
        "{arguments}"
    );
}
