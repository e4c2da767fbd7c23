//! `POST /v1/responses` (OpenAI's Responses API, which current agents speak) and
//! `GET /v1/responses/{id}`: input items (messages, `function_call`, `function_call_output`),
//! `instructions`, tools and `previous_response_id` are translated into a chat conversation
//! and run on the chat path; the reply comes back as output items. Stored responses (`store`,
//! default true) are kept in memory, the most recent [`MAX_STORED`], for the conversations
//! that continue them.

use std::collections::VecDeque;
use std::sync::Mutex;

use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::generation::{Generation, Step, response_id, unix_now};
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::output::Delta;
use crate::request;
use crate::state::AppState;

/// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
pub(crate) const MAX_STORED: usize = 256;

/// A stored response: its conversation (chat messages, its own output included) and body.
#[derive(Clone, Debug)]
struct Stored {
    id: String,
    messages: Vec<Value>,
    body: Value,
}

/// The responses kept in memory, oldest first.
#[derive(Debug, Default)]
pub struct ResponseStore(Mutex<VecDeque<Stored>>);

impl ResponseStore {
    fn get(&self, id: &str) -> Option<Stored> {
        let store = self.0.lock().ok()?;
        store.iter().find(|s| s.id == id).cloned()
    }

    fn put(&self, stored: Stored) {
        if let Ok(mut store) = self.0.lock() {
            if store.len() >= MAX_STORED {
                store.pop_front();
            }
            store.push_back(stored);
        }
    }
}

/// The text of a string or of a list of `input_text` / `output_text` / `text` parts.
fn item_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        text.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            param,
                            format!(
                                "only text parts are supported, got {}",
                                other.unwrap_or("none")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        other => Err(ApiError::invalid(
            param,
            format!("expected text, got {other}"),
        )),
    }
}

/// Chat messages for `input` (a string or a list of items).
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(items) => items,
        other => {
            return Err(ApiError::invalid(
                "input",
                format!("expected a string or a list of items, got {other}"),
            ));
        }
    };
    let mut messages: Vec<Value> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = item_text(item.get("content").unwrap_or(&Value::Null), &param)?;
                messages.push(json!({"role": role, "content": content}));
            }
            Some("function_call") => {
                let call = json!({
                    "id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": item.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": item.get("arguments").cloned().unwrap_or(json!("{}")),
                    },
                });
                // Calls join the assistant message right before them, as one turn.
                match messages.last_mut() {
                    Some(last) if last["role"] == "assistant" => {
                        if !last["tool_calls"].is_array() {
                            last["tool_calls"] = json!([]);
                        }
                        if let Some(calls) = last["tool_calls"].as_array_mut() {
                            calls.push(call);
                        }
                    }
                    _ => messages
                        .push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            Some("function_call_output") => {
                let output = match item.get("output") {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => item_text(other, &param)?,
                    None => String::new(),
                };
                messages.push(json!({
                    "role": "tool",
                    "tool_call_id": item.get("call_id").cloned().unwrap_or(Value::Null),
                    "content": output,
                }));
            }
            Some("reasoning") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    &param,
                    format!("`{other}` items are not supported"),
                ));
            }
        }
    }
    Ok(messages)
}

/// Responses-request fields [`to_chat`] and [`create`] read; others are logged as not acted
/// on.
const RESPONSES_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "temperature",
    "top_p",
    "user",
    "stream",
    "previous_response_id",
    "store",
    "reasoning",
];

/// The chat completion body a Responses request stands for, given the stored conversation
/// it continues.
fn to_chat(body: &Map<String, Value>, history: Vec<Value>) -> Result<Map<String, Value>, ApiError> {
    let ignored: Vec<&str> = body
        .keys()
        .map(String::as_str)
        .filter(|k| !RESPONSES_FIELDS.contains(k))
        .collect();
    if !ignored.is_empty() {
        tracing::warn!(fields = %ignored.join(", "), "request fields that are not acted on (ignored)");
    }
    let mut chat = Map::new();
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
    ] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.to_string(), v.clone());
        }
    }
    let mut messages = Vec::new();
    if let Some(Value::String(instructions)) = body.get("instructions") {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    messages.extend(history.into_iter().filter(|m| m["role"] != "system"));
    let input = body
        .get("input")
        .ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    messages.extend(input_messages(input)?);
    chat.insert("messages".to_string(), Value::Array(messages));
    if let Some(Value::Array(tools)) = body.get("tools") {
        let tools: Vec<Value> = tools
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            .map(|t| {
                json!({"type": "function", "function": {
                    "name": t.get("name").cloned().unwrap_or(Value::Null),
                    "description": t.get("description").cloned().unwrap_or(json!("")),
                    "parameters": t.get("parameters").cloned().unwrap_or(json!({"type": "object"})),
                }})
            })
            .collect();
        chat.insert("tools".to_string(), Value::Array(tools));
    }
    if let Some(choice) = body.get("tool_choice") {
        chat.insert("tool_choice".to_string(), choice.clone());
    }
    if let Some(effort) = body
        .get("reasoning")
        .and_then(|r| r.get("effort"))
        .and_then(Value::as_str)
    {
        chat.insert("reasoning_effort".to_string(), json!(effort));
    }
    Ok(chat)
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::invalid(
            "stream",
            "streamed responses are not supported yet",
        ));
    }
    let previous = match body.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(id)) => Some(state.responses.get(id).ok_or_else(|| {
            ApiError::invalid("previous_response_id", format!("no stored response `{id}`"))
        })?),
        Some(other) => {
            return Err(ApiError::invalid(
                "previous_response_id",
                format!("expected a string, got {other}"),
            ));
        }
    };
    let history = previous
        .as_ref()
        .map(|p| p.messages.clone())
        .unwrap_or_default();
    let chat = to_chat(&body, history)?;
    let mut req = request::chat(&chat, &state.config.sampling_defaults)?;
    req.settings = request::with_session_header(req.settings, &headers)?;
    super::check_model(&state, req.settings.model.as_deref())?;
    let (prompt, parser) = super::chat::prepare(&state, &req).await?;
    let mut g = Generation::start(&state, prompt, &req.settings, parser, "input", "resp")?;
    let (mut text, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    let mut add = |deltas: Vec<Delta>| {
        for d in deltas {
            match d {
                Delta::Content(t) => text.push_str(&t),
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::ToolCall { name, arguments } => calls.push((name, arguments)),
            }
        }
    };
    let (finish_reason, usage) = loop {
        match g.next().await? {
            Some(Step::Deltas { deltas, .. }) => add(deltas),
            Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                ..
            }) => {
                add(deltas);
                break (finish_reason, usage);
            }
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    };
    let id = g.id().to_string();
    let mut output = Vec::new();
    if !reasoning.is_empty() {
        output.push(json!({"type": "reasoning", "id": response_id("rs"),
            "summary": [{"type": "summary_text", "text": reasoning}]}));
    }
    if !text.is_empty() || calls.is_empty() {
        output.push(json!({"type": "message", "id": response_id("msg"), "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}));
    }
    let mut tool_calls = Vec::new();
    for (name, arguments) in calls {
        let call_id = response_id("call");
        output.push(
            json!({"type": "function_call", "id": response_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}),
        );
        tool_calls.push(json!({"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}));
    }
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(0);
    let incomplete = finish_reason == "length";
    let response = json!({
        "id": id,
        "object": "response",
        "created_at": unix_now(),
        "status": if incomplete { "incomplete" } else { "completed" },
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "error": null,
        "model": body.get("model").cloned().unwrap_or_else(|| json!(state.config.served_model_name)),
        "instructions": body.get("instructions").cloned().unwrap_or(Value::Null),
        "previous_response_id": body.get("previous_response_id").cloned().unwrap_or(Value::Null),
        "output": output,
        "parallel_tool_calls": true,
        "tool_choice": body.get("tool_choice").cloned().unwrap_or(json!("auto")),
        "tools": body.get("tools").cloned().unwrap_or(json!([])),
        "temperature": body.get("temperature").cloned().unwrap_or(Value::Null),
        "top_p": body.get("top_p").cloned().unwrap_or(Value::Null),
        "max_output_tokens": body.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens,
        },
    });
    if body.get("store").and_then(Value::as_bool) != Some(false) {
        let mut messages = req.messages.clone();
        let mut reply = json!({"role": "assistant", "content": text});
        if !tool_calls.is_empty() {
            reply["tool_calls"] = json!(tool_calls);
        }
        messages.push(reply);
        state.responses.put(Stored {
            id: id.clone(),
            messages,
            body: response.clone(),
        });
    }
    Ok(Json(response).into_response())
}

/// `GET /v1/responses/{id}`: a stored response.
pub(crate) async fn retrieve(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    state
        .responses
        .get(&id)
        .map(|s| Json(s.body))
        .ok_or_else(|| ApiError::not_found(format!("no stored response `{id}`")))
}
