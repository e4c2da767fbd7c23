//! Structured output and tool calls held by the grammar over every API, system messages
//! anywhere, and what streams carry.

use super::*;

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
