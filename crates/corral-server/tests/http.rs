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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_non_streaming() {
    let s = server(None, 16, 512);
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert!(body["choices"][0]["message"]["content"].is_string());
    assert_eq!(body["usage"]["completion_tokens"], 6);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    for key in [
        "prompt_n",
        "prompt_ms",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "prefill_duration_ttft",
        "decoding_speed_tps",
    ] {
        assert!(
            body["timings"].get(key).is_some(),
            "timings.{key} missing: {body}"
        );
    }
}

/// A client that re-sends its conversation gets the same reply, and the usage says how
/// much of the prompt came from the prefix cache; `/metrics` counts the blocks kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_conversation_reports_its_cached_tokens() {
    let s = server(None, 16, 512);
    let history =
        "You are a careful assistant. Answer briefly and cite the tool output. ".repeat(3);
    let body = chat_body(json!({"messages": [{"role": "user", "content": history}]}));
    let (status, first, _) = call(&s.app, post("/v1/chat/completions", body.clone())).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (status, second, _) = call(&s.app, post("/v1/chat/completions", body)).await;
    assert_eq!(status, StatusCode::OK, "{second}");
    assert_eq!(
        second["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Blocks of 16: every whole block before the prompt's last token.
    assert_eq!(cached, (prompt - 1) / 16 * 16, "prompt of {prompt}");
    assert!(cached > 0);
    wait_for_zero_blocks(&s.engine).await;
    let (_, metrics, _) = call(
        &s.app,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    let text = metrics.as_str().unwrap().to_string();
    assert!(
        !text.contains("corral_kv_blocks_cached 0\n"),
        "the cache keeps blocks:\n{text}"
    );
    assert!(
        text.contains("corral_prefix_cache_hits_total 1\n")
            && text.contains(&format!("corral_prompt_tokens_cached_total {cached}\n")),
        "one hit of {cached} tokens:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_streaming_with_usage_and_logprobs() {
    let s = server(None, 16, 512);
    let req = post(
        "/v1/chat/completions",
        chat_body(
            json!({"stream": true, "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2}),
        ),
    );
    let response = s.app.clone().oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        response.headers()[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_events(response).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let finish: Vec<&Value> = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    let logprobs: usize = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array())
        .map(|a| {
            for entry in a {
                assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
                assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
            }
            a.len()
        })
        .sum();
    assert_eq!(logprobs, 6, "one log-probability per generated token");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_sends_a_chunk_for_every_token() {
    // Tokens whose text is held back (byte pieces of a character, the start of a possible
    // stop string) still get a chunk, empty, so that clients can time every token. The
    // stop string is one the output's first characters often begin.
    let s = server(None, 16, 512);
    let body = chat_body(json!({
        "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 40,
        "temperature": 1.0, "seed": 3, "stop": ["\u{1}never"]
    }));
    let response = s
        .app
        .clone()
        .oneshot(post("/v1/chat/completions", body))
        .await
        .unwrap();
    let events = sse_events(response).await;
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let token_chunks = chunks
        .iter()
        .filter(|c| {
            let delta = &c["choices"][0]["delta"];
            delta["content"].is_string() && delta.get("role").is_none()
        })
        .count();
    let tokens = chunks.last().unwrap()["usage"]["completion_tokens"]
        .as_u64()
        .unwrap() as usize;
    // The end may flush held-back text in one more chunk.
    assert!(
        token_chunks == tokens || token_chunks == tokens + 1,
        "{token_chunks} chunks for {tokens} tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_completion_with_token_ids_and_streaming() {
    let s = server(None, 16, 512);
    let (status, body, _) = call(
        &s.app,
        post(
            "/v1/completions",
            json!({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}).to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["prompt_tokens"], 3);
    let response = s
        .app
        .clone()
        .oneshot(post(
            "/v1/completions",
            json!({"prompt": "The", "max_tokens": 3, "stream": true}).to_string(),
        ))
        .await
        .unwrap();
    let events = sse_events(response).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_all_succeed_and_match_alone() {
    let s = server(None, 64, 512);
    let alone = call(
        &s.app,
        post("/v1/chat/completions", chat_body(json!({"seed": 1}))),
    )
    .await
    .1;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let app = s.app.clone();
        tasks.push(tokio::spawn(async move {
            call(
                &app,
                post("/v1/chat/completions", chat_body(json!({"seed": 1}))),
            )
            .await
        }));
    }
    for task in tasks {
        let (status, body, _) = task.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_eq!(
            body["choices"][0]["message"], alone["choices"][0]["message"],
            "batched output differs from alone"
        );
    }
    wait_for_zero_blocks(&s.engine).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mid_stream_frees_blocks() {
    let s = server(None, 16, 4096);
    let req = post(
        "/v1/chat/completions",
        chat_body(json!({"stream": true, "max_tokens": 4000, "temperature": 1.0})),
    );
    let response = s.app.clone().oneshot(req).await.unwrap();
    let mut stream = response.into_body().into_data_stream();
    for _ in 0..3 {
        stream.next().await.unwrap().unwrap();
    }
    assert!(s.engine.metrics().kv_blocks_used.load(Ordering::Relaxed) > 0);
    drop(stream);
    wait_for_zero_blocks(&s.engine).await;
    let (status, _, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::OK);
}

/// `/tokenize` turns text or a conversation into ids (the conversation exactly as a chat
/// completion renders it: its prompt_tokens), `/detokenize` ids back into text; bad input is
/// a 400 naming the field. A model alias is accepted and listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_and_model_aliases() {
    let s = server(None, 16, 512);
    let text = "Hello, wörld";
    let (status, body, _) = call(
        &s.app,
        post("/tokenize", json!({"prompt": text}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        body["count"],
        json!(body["tokens"].as_array().unwrap().len())
    );
    assert_eq!(body["max_model_len"], 512);
    let (status, back, _) = call(
        &s.app,
        post("/detokenize", json!({"tokens": body["tokens"]}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{back}");
    assert_eq!(back["prompt"], text);
    assert_eq!(back["content"], text);
    // llama.cpp's field name.
    let (_, again, _) = call(
        &s.app,
        post("/tokenize", json!({"content": text}).to_string()),
    )
    .await;
    assert_eq!(again["tokens"], body["tokens"]);
    // A conversation counts what a chat completion's prompt is.
    let messages = json!([{"role": "user", "content": "Hello"}]);
    let (_, chat, _) = call(
        &s.app,
        post(
            "/tokenize",
            json!({"messages": messages, "model": "tiny-alias"}).to_string(),
        ),
    )
    .await;
    let (status, done, _) = call(
        &s.app,
        post(
            "/v1/chat/completions",
            chat_body(json!({"messages": messages, "model": "tiny-alias"})),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{done}");
    assert_eq!(chat["count"], done["usage"]["prompt_tokens"], "{chat}");
    assert_eq!(done["model"], "tiny");
    for (path, bad, field) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": 5}), "prompt"),
        (
            "/tokenize",
            json!({"prompt": "x", "messages": messages}),
            "prompt",
        ),
        ("/detokenize", json!({"tokens": [1, 999_999_999]}), "tokens"),
        ("/detokenize", json!({"tokens": "1 2"}), "tokens"),
    ] {
        let (status, body, _) = call(&s.app, post(path, bad.to_string())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {bad}: {body}");
        assert_eq!(body["error"]["param"], field, "{path} {bad}: {body}");
    }
    let (_, models, _) = call(
        &s.app,
        Request::get("/v1/models").body(Body::empty()).unwrap(),
    )
    .await;
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "tiny-alias"]);
    let (status, _, _) = call(
        &s.app,
        post(
            "/tokenize",
            json!({"prompt": "x", "model": "other"}).to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// CORS for the allowed origin only: its preflight is answered without the API key, its
/// responses carry the allow header; another origin gets none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_answers_the_allowed_origin_only() {
    let s = server(Some("sekrit"), 16, 512);
    let preflight = |origin: &str| {
        Request::builder()
            .method("OPTIONS")
            .uri("/v1/chat/completions")
            .header(header::ORIGIN, origin)
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(
                header::ACCESS_CONTROL_REQUEST_HEADERS,
                "authorization, content-type",
            )
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, headers) = call(&s.app, preflight("https://app.example")).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    assert_eq!(
        headers[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://app.example"
    );
    assert!(
        headers[header::ACCESS_CONTROL_ALLOW_HEADERS]
            .to_str()
            .unwrap()
            .contains("authorization")
    );
    let (status, _, headers) = call(&s.app, preflight("https://evil.example")).await;
    assert_ne!(status, StatusCode::NO_CONTENT);
    assert!(headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
    let get = |origin: &str| {
        Request::get("/v1/models")
            .header(header::ORIGIN, origin)
            .header(header::AUTHORIZATION, "Bearer sekrit")
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, headers) = call(&s.app, get("https://app.example")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        headers[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://app.example"
    );
    let (_, _, headers) = call(&s.app, get("https://evil.example")).await;
    assert!(headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).is_none());
}

/// Anthropic's Messages API: x-api-key, a reply as content blocks with Anthropic's stop
/// reason and usage, the same reply streamed as Anthropic's events, and count_tokens equal to
/// the prompt the reply was generated from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_answer_and_stream() {
    let s = server(Some("sekrit"), 16, 512);
    let body = json!({"model": "tiny", "max_tokens": 5, "temperature": 0,
        "system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]});
    let req = |path: &str, body: &Value| {
        Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-api-key", "sekrit")
            .header("anthropic-version", "2023-06-01")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let (status, reply, _) = call(&s.app, req("/v1/messages", &body)).await;
    assert_eq!(status, StatusCode::OK, "{reply}");
    assert_eq!(reply["type"], "message");
    assert_eq!(reply["role"], "assistant");
    assert!(reply["id"].as_str().unwrap().starts_with("msg"));
    let stop = reply["stop_reason"].as_str().unwrap();
    assert!(stop == "max_tokens" || stop == "end_turn", "{reply}");
    let output = reply["usage"]["output_tokens"].as_u64().unwrap();
    assert!(
        output <= 5 && (stop != "max_tokens" || output == 5),
        "{reply}"
    );
    let (_, counted, _) = call(&s.app, req("/v1/messages/count_tokens", &body)).await;
    assert_eq!(
        counted["input_tokens"].as_u64().unwrap(),
        reply["usage"]["input_tokens"].as_u64().unwrap()
            + reply["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
        "{counted} {reply}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response = s
        .app
        .clone()
        .oneshot(req("/v1/messages", &streamed))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let bytes = to_bytes(response.into_body(), usize::MAX).await.unwrap();
    let text = String::from_utf8(bytes.to_vec()).unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let name = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap()
                .to_string();
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            (name, serde_json::from_str(data).unwrap())
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(
        &names[names.len() - 2..],
        ["message_delta", "message_stop"],
        "{names:?}"
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    // Block starts and stops pair up; the streamed text is the whole reply's.
    let starts = names
        .iter()
        .filter(|n| **n == "content_block_start")
        .count();
    let stops = names.iter().filter(|n| **n == "content_block_stop").count();
    assert_eq!(starts, stops, "{names:?}");
    let streamed_text: String = events
        .iter()
        .filter_map(|e| e.1["delta"]["text"].as_str())
        .collect();
    let whole: String = reply["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["text"].as_str())
        .collect();
    assert_eq!(streamed_text, whole);
    let last = &events[events.len() - 2].1;
    assert_eq!(last["delta"]["stop_reason"], reply["stop_reason"]);
    let (status, _, _) = call(
        &s.app,
        Request::post("/v1/messages")
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-api-key", "wrong")
            .body(Body::from(body.to_string()))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}

/// A Messages reply ended by one of its `stop_sequences` says so as Anthropic does:
/// `stop_reason` "stop_sequence" and the sequence itself, in the reply and in the stream's
/// `message_delta`; the text stops before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stop_sequence_is_named_as_anthropic_names_it() {
    let s = server(None, 16, 512);
    let body = |stop: Option<&str>, stream: bool| {
        let mut body = json!({"model": "tiny", "max_tokens": 32, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a story"}], "stream": stream});
        if let Some(stop) = stop {
            body["stop_sequences"] = json!(["never-written", stop]);
        }
        post("/v1/messages", body.to_string())
    };
    let text_of = |reply: &Value| -> String {
        reply["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect()
    };
    let (status, whole, _) = call(&s.app, body(None, false)).await;
    assert_eq!(status, StatusCode::OK, "{whole}");
    assert_ne!(whole["stop_reason"], "stop_sequence", "{whole}");
    assert_eq!(whole["stop_sequence"], Value::Null, "{whole}");
    let text = text_of(&whole);
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 4, "{whole}");
    let stop: String = chars[chars.len() / 2..][..2].iter().collect();
    let (status, stopped, _) = call(&s.app, body(Some(&stop), false)).await;
    assert_eq!(status, StatusCode::OK, "{stopped}");
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{stopped}");
    assert_eq!(stopped["stop_sequence"], stop.as_str(), "{stopped}");
    assert_eq!(text_of(&stopped), text[..text.find(&stop).unwrap()]);
    let response = s
        .app
        .clone()
        .oneshot(body(Some(&stop), true))
        .await
        .unwrap();
    let events = sse_events(response).await;
    let delta: Value = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find(|e| e["type"] == "message_delta")
        .expect("a message_delta");
    assert_eq!(delta["delta"]["stop_reason"], "stop_sequence", "{delta}");
    assert_eq!(delta["delta"]["stop_sequence"], stop.as_str(), "{delta}");
}

/// The Responses API: a string input answered as output items, a turn that continues a
/// stored response by id (its prompt holds the first turn), function_call and
/// function_call_output items, a stored response read back, and clear errors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_continue_and_store() {
    let s = server(None, 16, 1024);
    let (status, first, _) = call(
        &s.app,
        post(
            "/v1/responses",
            json!({"model": "tiny", "input": "Hello", "max_output_tokens": 4,
            "instructions": "Be brief.", "temperature": 0})
            .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{first}");
    assert_eq!(first["object"], "response");
    let id = first["id"].as_str().unwrap();
    assert!(id.starts_with("resp"));
    let message = first["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "message")
        .unwrap();
    assert_eq!(message["content"][0]["type"], "output_text");
    let first_prompt = first["usage"]["input_tokens"].as_u64().unwrap();
    let (status, second, _) = call(
        &s.app,
        post(
            "/v1/responses",
            json!({"model": "tiny", "previous_response_id": id, "max_output_tokens": 2,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}]})
            .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{second}");
    let second_prompt = second["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        second_prompt > first_prompt + 4,
        "{first_prompt} then {second_prompt}"
    );
    assert_eq!(second["previous_response_id"], id);
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}}}]);
    let (status, called, _) = call(
        &s.app,
        post("/v1/responses", json!({"model": "tiny", "tools": tools, "max_output_tokens": 2, "input": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "7 C"}]}).to_string()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{called}");
    let (status, stored, _) = call(
        &s.app,
        Request::get(format!("/v1/responses/{id}"))
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stored["id"], id);
    for (body, status, param) in [
        (
            json!({"model": "tiny", "input": "x", "previous_response_id": "resp-none"}),
            StatusCode::BAD_REQUEST,
            json!("previous_response_id"),
        ),
        (
            json!({"model": "tiny"}),
            StatusCode::BAD_REQUEST,
            json!("input"),
        ),
        (
            json!({"model": "tiny", "input": [{"type": "image"}]}),
            StatusCode::BAD_REQUEST,
            json!("input[0]"),
        ),
    ] {
        let (got, err, _) = call(&s.app, post("/v1/responses", body.to_string())).await;
        assert_eq!(got, status, "{body}: {err}");
        assert_eq!(err["error"]["param"], param, "{body}: {err}");
    }
    let (got, _, _) = call(
        &s.app,
        Request::get("/v1/responses/resp-none")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(got, StatusCode::NOT_FOUND);
}

/// Once the engine thread has stopped, /health says so and requests get 503s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_reports_a_stopped_engine() {
    let s = server(None, 16, 512);
    let health = || Request::get("/health").body(Body::empty()).unwrap();
    assert_eq!(call(&s.app, health()).await.0, StatusCode::OK);
    s.engine.shutdown();
    for _ in 0..200 {
        if !s.engine.metrics().engine_alive.load(Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(
        call(&s.app, health()).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
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

/// Every finished request is one INFO line naming its id, model, tokens, TTFT, decode rate
/// and finish reason.
#[tokio::test(flavor = "current_thread")]
async fn every_finished_request_is_one_log_line() {
    let captured = captured_log();
    let s = server(None, 16, 512);
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::OK);
    let id = body["id"].as_str().unwrap();
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("request finished") && l.contains(&format!("id={id} ")))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    for field in [
        format!("id={id}"),
        "model=tiny".to_string(),
        format!("prompt_tokens={}", body["usage"]["prompt_tokens"]),
        format!("completion_tokens={}", body["usage"]["completion_tokens"]),
        "ttft_ms=".to_string(),
        "decode_tok_s=".to_string(),
        format!(
            "finish_reason={}",
            body["choices"][0]["finish_reason"].as_str().unwrap()
        ),
    ] {
        assert!(lines[0].contains(&field), "{field} not in {}", lines[0]);
    }
}

/// A max_tokens beyond what the context leaves (agents ask for the whole context) is clamped
/// to it, as llama.cpp's server does, and the usage says so; before, it was a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_tokens_beyond_the_context_is_clamped() {
    let s = server(None, 16, 64);
    let (status, body, _) = call(
        &s.app,
        post(
            "/v1/chat/completions",
            chat_body(json!({"max_tokens": 1_000_000})),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let usage = &body["usage"];
    let room = 64 - usage["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["max_tokens_clamped_to"], json!(room), "{body}");
    let generated = usage["completion_tokens"].as_u64().unwrap();
    let reason = body["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(
        generated <= room && (reason == "stop" || (reason == "length" && generated == room)),
        "{body}"
    );
    let (_, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert!(
        body["usage"].get("max_tokens_clamped_to").is_none(),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_errors_and_the_server_keeps_serving() {
    let s = server(None, 16, 64);
    let long_prompt = "word ".repeat(200);
    let cases: Vec<(Request<Body>, StatusCode, Option<&str>)> = vec![
        (
            post("/v1/chat/completions", "{not json"),
            StatusCode::BAD_REQUEST,
            None,
        ),
        (
            post("/v1/chat/completions", "[1, 2]"),
            StatusCode::BAD_REQUEST,
            None,
        ),
        (
            post(
                "/v1/chat/completions",
                chat_body(json!({"temperature": "hot"})),
            ),
            StatusCode::BAD_REQUEST,
            Some("temperature"),
        ),
        (
            post("/v1/chat/completions", json!({"model": "tiny"}).to_string()),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            post("/v1/chat/completions", chat_body(json!({"model": "gpt-9"}))),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
        (
            post("/v1/chat/completions", chat_body(json!({"n": 2}))),
            StatusCode::BAD_REQUEST,
            Some("n"),
        ),
        (
            post("/v1/chat/completions", chat_body(json!({"max_tokens": -1}))),
            StatusCode::BAD_REQUEST,
            Some("max_tokens"),
        ),
        (
            post(
                "/v1/chat/completions",
                chat_body(json!({"messages": [{"role": "user", "content": long_prompt}]})),
            ),
            StatusCode::BAD_REQUEST,
            Some("messages"),
        ),
        (
            post(
                "/v1/completions",
                json!({"prompt": [1, 999_999], "max_tokens": 2}).to_string(),
            ),
            StatusCode::BAD_REQUEST,
            Some("prompt"),
        ),
        (
            post("/v1/chat/completions", vec![b'{', 0xff, 0xfe, b'}']),
            StatusCode::BAD_REQUEST,
            None,
        ),
        (
            post("/v1/chat/completions", vec![b' '; 100 * 1024]),
            StatusCode::PAYLOAD_TOO_LARGE,
            None,
        ),
    ];
    for (req, expected, param) in cases {
        let what = format!("{} {}", req.method(), req.uri());
        let (status, body, _) = call(&s.app, req).await;
        assert_eq!(status, expected, "{what}: {body}");
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert!(
            error["type"].is_string()
                && error.get("param").is_some()
                && error.get("code").is_some(),
            "{body}"
        );
        if let Some(param) = param {
            assert_eq!(error["param"], param, "{body}");
        }
        let (ok, body, _) = call(
            &s.app,
            post("/v1/chat/completions", chat_body(json!({"max_tokens": 2}))),
        )
        .await;
        assert_eq!(ok, StatusCode::OK, "after {what}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_when_set() {
    let s = server(Some("sekrit"), 16, 512);
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(body["error"]["type"], "authentication_error");
    let mut wrong = post("/v1/chat/completions", chat_body(json!({})));
    wrong
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer nope".parse().unwrap());
    assert_eq!(call(&s.app, wrong).await.0, StatusCode::UNAUTHORIZED);
    let mut right = post("/v1/chat/completions", chat_body(json!({})));
    right
        .headers_mut()
        .insert(header::AUTHORIZATION, "Bearer sekrit".parse().unwrap());
    assert_eq!(call(&s.app, right).await.0, StatusCode::OK);
    let health = Request::get("/health").body(Body::empty()).unwrap();
    assert_eq!(
        call(&s.app, health).await.0,
        StatusCode::OK,
        "health needs no key"
    );
    // Unknown paths are not counted (clients cannot grow the metrics); each 401 counts once.
    let junk = Request::get("/x%22%7D").body(Body::empty()).unwrap();
    assert_eq!(call(&s.app, junk).await.0, StatusCode::NOT_FOUND);
    let metrics = call(
        &s.app,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await
    .1;
    let text = metrics.as_str().unwrap().to_string();
    let unauthorized = "corral_requests_total{endpoint=\"/v1/chat/completions\",status=\"401\"} 2";
    assert!(text.contains(unauthorized), "{text}");
    assert!(!text.contains("x%22"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_answers_429_with_retry_after() {
    let s = server(None, 0, 512);
    let (status, body, headers) =
        call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert_eq!(headers[header::RETRY_AFTER], "1");
    assert_eq!(body["error"]["type"], "rate_limit_error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_and_metrics() {
    let s = server(None, 16, 512);
    let (status, body, _) = call(
        &s.app,
        Request::get("/v1/models").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["data"][0]["id"], "tiny");
    let _ = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    let (status, body, _) = call(
        &s.app,
        Request::get("/metrics").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let text = body.as_str().unwrap().to_string();
    for name in [
        "corral_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "corral_prompt_tokens_total",
        "corral_generated_tokens_total 6",
        "corral_time_to_first_token_seconds_count 1",
        "corral_inter_token_latency_seconds_count 5",
        "corral_queue_depth",
        "corral_running_sequences",
        "corral_kv_blocks_used 0",
        "corral_state_slots_used 0",
        "corral_kv_blocks_total 256",
        "corral_dispatches_per_token",
        // Six tokens: the first with the prompt, five decode steps.
        "corral_decode_steps_total 5",
        "corral_decode_step_seconds_total{phase=\"forward\"}",
        // vLLM's names, as dashboards and the Gateway API Inference Extension read them.
        "vllm:num_requests_running{model_name=\"tiny\"} 0",
        "vllm:num_requests_waiting{model_name=\"tiny\"} 0",
        "vllm:kv_cache_usage_perc{model_name=\"tiny\"} 0",
        "vllm:cache_config_info{model_name=\"tiny\",block_size=\"16\",num_gpu_blocks=\"256\"} 1",
        "vllm:generation_tokens_total{model_name=\"tiny\"} 6",
        "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"length\"} 1",
        "vllm:request_success_total{model_name=\"tiny\",finished_reason=\"stop\"} 0",
        "vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"tiny\"} 1",
        "vllm:inter_token_latency_seconds_count{model_name=\"tiny\"} 5",
        "vllm:e2e_request_latency_seconds_count{model_name=\"tiny\"} 1",
        "# TYPE vllm:prefix_cache_hits_total counter",
    ] {
        assert!(text.contains(name), "missing `{name}` in:\n{text}");
    }
    let prompt_tokens = body_prompt_tokens(&text);
    assert!(
        text.contains(&format!(
            "vllm:prefix_cache_queries_total{{model_name=\"tiny\"}} {prompt_tokens}"
        )),
        "{text}"
    );
}

/// The prompt tokens `corral_prompt_tokens_total` reports.
fn body_prompt_tokens(text: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix("corral_prompt_tokens_total "))
        .and_then(|v| v.parse().ok())
        .expect("corral_prompt_tokens_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_of_a_non_streaming_request_frees_blocks() {
    let s = server(None, 16, 4096);
    let app = s.app.clone();
    let task = tokio::spawn(async move {
        call(
            &app,
            post(
                "/v1/chat/completions",
                chat_body(json!({"max_tokens": 4000, "temperature": 1.0})),
            ),
        )
        .await
    });
    let start = Instant::now();
    // Until the request holds blocks (or, on a slow machine, sampled its end before this
    // loop looked: then there is nothing to cancel, and the blocks must be free all the same).
    while s.engine.metrics().kv_blocks_used.load(Ordering::Relaxed) == 0 && !task.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "request never started"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The client goes away: the handler future is dropped with its event receiver.
    task.abort();
    wait_for_zero_blocks(&s.engine).await;
}

/// A session id comes from an `X-Session-Id` header (or `user`) and pins the turn's prefix
/// (`corral_session_pins`); a malformed header is an OpenAI-style error naming it, and the
/// server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_id_header_pins_the_turn_and_a_bad_one_is_refused() {
    let s = server(None, 64, 4096);
    let mut req = post("/v1/chat/completions", chat_body(json!({})));
    req.headers_mut()
        .insert("x-session-id", "agent-7".parse().unwrap());
    let (status, _, _) = call(&s.app, req).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(
        &s.app,
        post(
            "/v1/completions",
            json!({"model": "tiny", "prompt": "Hi", "max_tokens": 2, "user": "agent-8"})
                .to_string(),
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let metrics = s
        .app
        .clone()
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    let text = String::from_utf8(
        to_bytes(metrics.into_body(), usize::MAX)
            .await
            .unwrap()
            .to_vec(),
    )
    .unwrap();
    assert!(text.contains("corral_session_pins 2"), "{text}");
    for bad in ["", "has space", &"x".repeat(300)] {
        let mut req = post("/v1/chat/completions", chat_body(json!({})));
        req.headers_mut()
            .insert("x-session-id", bad.parse().unwrap());
        let (status, body, _) = call(&s.app, req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad:?}: {body}");
        assert_eq!(body["error"]["param"], "X-Session-Id", "{body}");
    }
    let (status, _, _) = call(&s.app, post("/v1/chat/completions", chat_body(json!({})))).await;
    assert_eq!(status, StatusCode::OK);
}

/// `response_format` and `tool_choice` hold even the random-weight model to a JSON document
/// of the schema and to a call of a listed tool with valid arguments, in both the plain
/// and the streamed answer; a schema or a tool choice that cannot be met is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_and_required_tool_calls_are_held_by_the_grammar() {
    let s = server(None, 16, 1024);
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"enum": ["metric", "imperial"]}},
        "required": ["city", "days", "units"], "additionalProperties": false});
    let format = json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "forecast", "strict": true, "schema": schema}}, "max_tokens": 64});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(format))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let doc: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content}: {e}"));
    let doc = doc.as_object().unwrap();
    assert_eq!(doc.len(), 3, "{content}");
    assert!(
        doc["city"]
            .as_str()
            .is_some_and(|c| c.chars().count() <= 12)
    );
    assert!(doc["days"].as_i64().is_some_and(|d| (1..=14).contains(&d)));
    assert!(["metric", "imperial"].contains(&doc["units"].as_str().unwrap()));

    let object = json!({"response_format": {"type": "json_object"}, "max_tokens": 48,
        "temperature": 0.7, "seed": 3});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(object))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    if body["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(content).unwrap().is_object(),
            "{content}"
        );
    } else {
        assert!(content.starts_with('{'), "{content}");
    }

    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"], "additionalProperties": false}}}]);
    for (choice, stream) in [
        (json!("required"), false),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            false,
        ),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            true,
        ),
    ] {
        let extra = json!({"tools": tools, "tool_choice": choice, "max_tokens": 64,
            "parallel_tool_calls": false, "stream": stream});
        let request = post("/v1/chat/completions", chat_body(extra));
        let (name, arguments, finish) = if stream {
            let response = s.app.clone().oneshot(request).await.unwrap();
            let mut name = String::new();
            let mut arguments = String::new();
            let mut finish = Value::Null;
            for event in sse_events(response).await {
                let Ok(chunk) = serde_json::from_str::<Value>(&event) else {
                    continue;
                };
                let choice = &chunk["choices"][0];
                if let Some(calls) = choice["delta"]["tool_calls"].as_array() {
                    for call in calls {
                        name.push_str(call["function"]["name"].as_str().unwrap_or(""));
                        arguments.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
                    }
                }
                if !choice["finish_reason"].is_null() {
                    finish = choice["finish_reason"].clone();
                }
            }
            (name, arguments, finish)
        } else {
            let (status, body, _) = call(&s.app, request).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let calls = body["choices"][0]["message"]["tool_calls"]
                .as_array()
                .unwrap();
            assert_eq!(calls.len(), 1, "{body}");
            let f = &calls[0]["function"];
            (
                f["name"].as_str().unwrap().to_string(),
                f["arguments"].as_str().unwrap().to_string(),
                body["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(finish, "tool_calls");
        let args: Value = serde_json::from_str(&arguments).unwrap();
        match name.as_str() {
            "get_weather" => assert!(choice == "required" && args["city"].is_string()),
            "get_time" => assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap())),
            other => panic!("called {other}"),
        }
    }

    for (bad, param) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
    ] {
        let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(bad))).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(body["error"]["param"], param, "{body}");
    }
    wait_for_zero_blocks(&s.engine).await;
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

/// With Qwen3.5's template (calls in XML), a forced call holds every parameter to its schema
/// on random weights and closes, over each API, streamed and not: OpenAI chat ("required"
/// and a named function), Anthropic Messages (`any`) and Responses ("required"). Before, a
/// string's `maxLength` and an enum were not held, and the call ran to `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xml_forced_tool_calls_follow_their_schemas_over_every_api() {
    let Some(template) = qwen35_template() else {
        return;
    };
    let s = server_with_template(None, 16, 2048, Some(template), json!({}));
    let tools = json!([forecast_tool()]);
    for (seed, choice) in [
        (1, json!("required")),
        (
            2,
            json!({"type": "function", "function": {"name": "forecast"}}),
        ),
        (3, json!("required")),
    ] {
        let extra = json!({"tools": tools, "tool_choice": choice, "max_tokens": 300,
            "temperature": 1.0, "seed": seed});
        let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(extra))).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let choice = &body["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls", "{body}");
        for call in choice["message"]["tool_calls"].as_array().unwrap() {
            let arguments = call["function"]["arguments"].as_str().unwrap();
            check_forecast(&serde_json::from_str(arguments).unwrap());
        }
    }
    // Streamed chat: the argument pieces join to a valid call.
    let extra = json!({"tools": tools, "tool_choice": "required", "max_tokens": 300,
        "stream": true, "temperature": 1.0, "seed": 4});
    let events = named_sse_events(&s.app, post("/v1/chat/completions", chat_body(extra))).await;
    // Each call's pieces, by its index (the model may call more than once).
    let mut arguments = std::collections::BTreeMap::<u64, String>::new();
    let mut finish = Value::Null;
    for (_, chunk) in &events {
        let choice = &chunk["choices"][0];
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let index = call["index"].as_u64().unwrap();
            let piece = call["function"]["arguments"].as_str().unwrap_or("");
            arguments.entry(index).or_default().push_str(piece);
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls");
    assert!(!arguments.is_empty(), "{events:?}");
    for call in arguments.values() {
        check_forecast(&serde_json::from_str(call).unwrap());
    }

    // Anthropic Messages, `tool_choice: any`; one call (neither API takes a seed, and
    // several calls drawn at random could outrun max_tokens).
    let anthropic_tool = json!({"name": "forecast",
        "input_schema": forecast_tool()["function"]["parameters"].clone()});
    let messages = |stream: bool| {
        json!({"model": "tiny", "max_tokens": 300, "temperature": 1.0, "stream": stream,
            "tools": [anthropic_tool],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "messages": [{"role": "user", "content": "Weather?"}]})
        .to_string()
    };
    let (status, body, _) = call(&s.app, post("/v1/messages", messages(false))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["stop_reason"], "tool_use", "{body}");
    let used: Vec<&Value> = body["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_use")
        .collect();
    assert!(!used.is_empty(), "{body}");
    used.iter().for_each(|u| check_forecast(&u["input"]));
    let events = named_sse_events(&s.app, post("/v1/messages", messages(true))).await;
    // Each tool_use block's input pieces (the model may call more than once).
    let mut inputs = std::collections::BTreeMap::<u64, String>::new();
    for (_, e) in &events {
        if let (Some(index), Some(piece)) =
            (e["index"].as_u64(), e["delta"]["partial_json"].as_str())
        {
            inputs.entry(index).or_default().push_str(piece);
        }
    }
    assert!(!inputs.is_empty(), "{events:?}");
    for input in inputs.values() {
        check_forecast(&serde_json::from_str(input).unwrap());
    }
    let stop = events.iter().find(|(n, _)| n == "message_delta").unwrap();
    assert_eq!(stop.1["delta"]["stop_reason"], "tool_use");

    // Responses, "required".
    let responses = |stream: bool| {
        json!({"model": "tiny", "max_output_tokens": 300, "temperature": 1.0, "stream": stream,
            "tools": [{"type": "function", "name": "forecast",
                "parameters": forecast_tool()["function"]["parameters"].clone()}],
            "tool_choice": "required", "parallel_tool_calls": false, "input": "Weather?"})
        .to_string()
    };
    let (status, body, _) = call(&s.app, post("/v1/responses", responses(false))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "completed", "{body}");
    let call_item = body["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("{body}"));
    check_forecast(&serde_json::from_str(call_item["arguments"].as_str().unwrap()).unwrap());
    let events = named_sse_events(&s.app, post("/v1/responses", responses(true))).await;
    let done = events
        .iter()
        .find(|(n, _)| n == "response.function_call_arguments.done")
        .unwrap_or_else(|| panic!("{events:?}"));
    check_forecast(&serde_json::from_str(done.1["arguments"].as_str().unwrap()).unwrap());
    wait_for_zero_blocks(&s.engine).await;
}

/// A forced call that `max_tokens` cuts short (a free string runs on, on random weights)
/// leaves no markup in the reply: each API says the reply ended for its length, in its own
/// terms. Before, the half-written `<tool_call>` came back as the message's content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_call_cut_short_leaks_no_markup() {
    let Some(template) = qwen35_template() else {
        return;
    };
    let s = server_with_template(None, 16, 2048, Some(template), json!({}));
    let write = json!({"type": "function", "function": {"name": "write", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}});
    let markup = |text: &str| {
        ["<tool_call>", "<function", "<parameter", "</think>"]
            .iter()
            .any(|m| text.contains(m))
    };
    let extra = json!({"tools": [write], "tool_choice": "required", "max_tokens": 24});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat_body(extra))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{body}");
    assert!(choice["message"]["tool_calls"].is_null(), "{body}");
    assert!(
        !markup(choice["message"]["content"].as_str().unwrap_or("")),
        "{body}"
    );

    let messages = json!({"model": "tiny", "max_tokens": 24, "tool_choice": {"type": "any"},
        "tools": [{"name": "write", "input_schema": write["function"]["parameters"].clone()}],
        "messages": [{"role": "user", "content": "Write."}]});
    let (status, body, _) = call(&s.app, post("/v1/messages", messages.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["stop_reason"], "max_tokens", "{body}");
    for block in body["content"].as_array().unwrap() {
        assert_ne!(block["type"], "tool_use", "{body}");
        assert!(!markup(block["text"].as_str().unwrap_or("")), "{body}");
    }

    let responses = json!({"model": "tiny", "max_output_tokens": 24, "tool_choice": "required",
        "tools": [{"type": "function", "name": "write",
            "parameters": write["function"]["parameters"].clone()}], "input": "Write."});
    let (status, body, _) = call(&s.app, post("/v1/responses", responses.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "incomplete", "{body}");
    assert_eq!(
        body["incomplete_details"]["reason"], "max_output_tokens",
        "{body}"
    );
    assert!(!markup(&body["output"].to_string()), "{body}");
    wait_for_zero_blocks(&s.engine).await;
}

/// System and developer messages in the numbers and places agent clients send them are
/// accepted by every API with Qwen3.5's template, which itself takes one system message,
/// first: Codex's `instructions` and two developer items (Responses), Claude Code's system
/// message after the user's (Messages), two system messages and a late one (chat). Before,
/// each was a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_messages_anywhere_are_accepted_by_every_api() {
    let Some(template) = qwen35_template() else {
        return;
    };
    let s = server_with_template(None, 16, 2048, Some(template), json!({}));
    let chat = json!({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Hello"},
        {"role": "system", "content": "The user is on Linux."}]});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let messages = json!({"model": "tiny", "max_tokens": 4, "system": "You are an agent.",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list the files here"}]},
            {"role": "system", "content": [{"type": "text", "text": "cwd: /work"}]}]});
    let (status, body, _) = call(&s.app, post("/v1/messages", messages.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    let responses = json!({"model": "tiny", "max_output_tokens": 4,
        "instructions": "You are a coding agent.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox: read-only"}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "cwd: /work"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files here"}]}]});
    let (status, body, _) = call(&s.app, post("/v1/responses", responses.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // The conversation continues from the stored response, its developer items kept.
    let next = json!({"model": "tiny", "max_output_tokens": 4, "previous_response_id": body["id"],
        "instructions": "You are a coding agent.", "input": "and the hidden ones?"});
    let (status, body, _) = call(&s.app, post("/v1/responses", next.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");

    // A conversation the template still refuses is a 400 naming the API's own field.
    let only_system = json!({"model": "tiny", "max_output_tokens": 4,
        "input": [{"type": "message", "role": "developer", "content": "just this"}]});
    let (status, body, _) = call(&s.app, post("/v1/responses", only_system.to_string())).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "input", "{body}");
    wait_for_zero_blocks(&s.engine).await;
}

/// Anthropic streams carry the prompt's tokens in `message_start`; a reply that is all
/// reasoning still gets a text block; Responses streams reasoning as summary deltas and
/// counts it, as chat's usage does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_carry_input_tokens_and_reasoning() {
    let Some(template) = qwen35_template() else {
        return;
    };
    let s = server_with_template(None, 16, 2048, Some(template), json!({}));
    // Qwen3.5's prompt opens the reasoning: four tokens are all inside it.
    let messages = json!({"model": "tiny", "max_tokens": 4, "stream": true,
        "messages": [{"role": "user", "content": "Hello"}]});
    let events = named_sse_events(&s.app, post("/v1/messages", messages.to_string())).await;
    let (name, start) = &events[0];
    assert_eq!(name, "message_start");
    let input = start["message"]["usage"]["input_tokens"].as_u64().unwrap();
    let count = json!({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}]});
    let (_, counted, _) = call(&s.app, post("/v1/messages/count_tokens", count.to_string())).await;
    let cached = start["message"]["usage"]["cache_read_input_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(
        input + cached,
        counted["input_tokens"].as_u64().unwrap(),
        "{start}"
    );
    assert!(input > 0);
    let starts: Vec<&Value> = events
        .iter()
        .filter(|(n, _)| n == "content_block_start")
        .map(|(_, e)| &e["content_block"])
        .collect();
    assert!(starts.iter().any(|b| b["type"] == "thinking"), "{events:?}");
    assert!(starts.iter().any(|b| b["type"] == "text"), "{events:?}");

    let responses =
        json!({"model": "tiny", "max_output_tokens": 4, "stream": true, "input": "Hello"});
    let events = named_sse_events(&s.app, post("/v1/responses", responses.to_string())).await;
    let reasoning: String = events
        .iter()
        .filter(|(n, _)| n == "response.reasoning_summary_text.delta")
        .filter_map(|(_, e)| e["delta"].as_str())
        .collect();
    assert!(!reasoning.is_empty(), "{events:?}");
    let (_, last) = events.last().unwrap();
    let usage = &last["response"]["usage"];
    assert_eq!(
        usage["output_tokens_details"]["reasoning_tokens"], 4,
        "{usage}"
    );

    let chat = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]});
    let (_, body, _) = call(&s.app, post("/v1/chat/completions", chat.to_string())).await;
    assert_eq!(
        body["usage"]["completion_tokens_details"]["reasoning_tokens"], 4,
        "{body}"
    );
    wait_for_zero_blocks(&s.engine).await;
}

/// A rejected request is logged at the default level with its route, status, field and
/// reason (before, only a counter in /metrics knew of it).
#[tokio::test(flavor = "current_thread")]
async fn a_rejected_request_is_logged_with_its_reason() {
    let captured = captured_log();
    let s = server(None, 16, 512);
    let bad = chat_body(json!({"temperature": 7}));
    let (status, _, _) = call(&s.app, post("/v1/chat/completions", bad)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("request rejected") && l.contains("param=temperature"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains("WARN")
            && line.contains("route=/v1/chat/completions")
            && line.contains("status=400"),
        "{line}"
    );
    assert!(line.contains("between 0 and 2"), "{line}");
}

/// The server's default template variables apply where a request leaves them out
/// (`--default-chat-template-kwargs '{"enable_thinking": false}'`), and a request's own win.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_template_kwargs_apply_unless_a_request_sets_them() {
    let Some(template) = qwen35_template() else {
        return;
    };
    let off = json!({"enable_thinking": false});
    let s = server_with_template(None, 16, 2048, Some(template), off);
    let reasoning =
        |body: &Value| body["usage"]["completion_tokens_details"]["reasoning_tokens"].clone();
    let chat = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", chat.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(reasoning(&body), 0, "{body}");
    let mut on = chat;
    on["chat_template_kwargs"] = json!({"enable_thinking": true});
    let (status, body, _) = call(&s.app, post("/v1/chat/completions", on.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(reasoning(&body), 4, "{body}");
}

/// Errors of the Messages endpoints come in Anthropic's shape (`{"type": "error", "error":
/// {"type", "message"}}`), whoever answered them: a bad field, an unknown model, malformed
/// JSON, a wrong `x-api-key`; the OpenAI endpoints keep OpenAI's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_errors_come_in_anthropics_shape() {
    let s = server(Some("sk-test"), 16, 512);
    let with_key = |path: &str, body: &str| {
        Request::post(path)
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-api-key", "sk-test")
            .body(Body::from(body.to_string()))
            .unwrap()
    };
    let cases = [
        (
            with_key(
                "/v1/messages",
                r#"{"model": "tiny", "max_tokens": 4, "messages": 3}"#,
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "messages",
        ),
        (
            with_key(
                "/v1/messages",
                r#"{"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}"#,
            ),
            StatusCode::NOT_FOUND,
            "not_found_error",
            "nope",
        ),
        (
            with_key(
                "/v1/messages",
                r#"{"model": "tiny", "max_tokens": 4, "stop_sequences": 42, "messages": [{"role": "user", "content": "x"}]}"#,
            ),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`stop_sequences`",
        ),
        (
            with_key("/v1/messages/count_tokens", "{not json"),
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "",
        ),
        (
            post(
                "/v1/messages",
                r#"{"model": "tiny", "max_tokens": 4, "messages": []}"#,
            ),
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "API key",
        ),
    ];
    for (request, status, kind, named) in cases {
        let (got, body, _) = call(&s.app, request).await;
        assert_eq!(got, status, "{body}");
        assert_eq!(body["type"], "error", "{body}");
        assert_eq!(body["error"]["type"], kind, "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains(named), "{body}");
    }
    let (got, body, _) = call(&s.app, with_key("/v1/chat/completions", "{}")).await;
    assert_eq!(got, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert!(body.get("type").is_none(), "{body}");
}

/// A completion ended by a stop string ends in the engine as a stop: counted under
/// `finished_reason="stop"`, not as an abort, and its turn left in the prefix cache, so the
/// same prompt sent again is served from it (all of it but its last token, which the model
/// must see to answer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_string_finishes_as_a_stop_and_its_turn_is_cached() {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 250).collect();
    let completion = |stop: Option<&str>| {
        let mut body = json!({"prompt": prompt, "max_tokens": 48, "temperature": 0});
        if let Some(stop) = stop {
            body["stop"] = json!([stop]);
        }
        post("/v1/completions", body.to_string())
    };
    // The greedy text, from a server of its own (its cache must not serve the one below).
    let (status, alone, _) = call(&server(None, 16, 512).app, completion(None)).await;
    assert_eq!(status, StatusCode::OK, "{alone}");
    let text = alone["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..][..2].iter().collect();
    let kept = &text[..text.find(&stop).unwrap()];

    let s = server(None, 16, 512);
    let (status, stopped, _) = call(&s.app, completion(Some(&stop))).await;
    assert_eq!(status, StatusCode::OK, "{stopped}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(stopped["choices"][0]["text"], kept);
    // The engine ends it after the reply went out.
    wait_for_zero_blocks(&s.engine).await;
    let metrics = s.engine.metrics();
    let start = Instant::now();
    while metrics.finished_stop.load(Ordering::Relaxed) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "never counted as a stop"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(metrics.finished_abort.load(Ordering::Relaxed), 0);
    let (status, again, _) = call(&s.app, completion(None)).await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 39);
}
