//! Anthropic's Messages API: answers and streams, stop sequences, errors in its shape.

use super::*;

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
