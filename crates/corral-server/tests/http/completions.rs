//! Chat and text completions, streaming and not: usage, logprobs, a chunk a token, cached
//! tokens of a resent conversation, concurrency, cancellation by disconnect, clamped
//! `max_tokens`, template defaults and stop strings.

use super::*;

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
