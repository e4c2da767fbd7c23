//! What the server does around the completions: tokenize and detokenize, model aliases,
//! CORS, health, the log line a request, bad input, auth, the full-queue 429, models and
//! metrics, session pins.

use super::*;

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
