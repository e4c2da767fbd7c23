//! OpenAI's Responses API: answers, continuations and stored responses.

use super::*;

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
