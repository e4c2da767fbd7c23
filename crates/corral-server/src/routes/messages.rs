//! `POST /v1/messages` (Anthropic's Messages API, as Claude-Code-style clients speak it) and
//! `POST /v1/messages/count_tokens`: the request is translated into a chat completion's
//! (system, text, `tool_use` / `tool_result` and `thinking` blocks, tools, tool choice,
//! thinking on or off) and runs on the same path; the reply comes back as content blocks, or
//! as Anthropic's stream of events.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::generation::{Generation, Step};
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::output::Delta;
use crate::request;
use crate::state::AppState;

/// The text of a string or of a list of `text` blocks (other blocks are refused).
fn block_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for b in blocks {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            param,
                            format!(
                                "only text blocks are supported here, got {}",
                                other.unwrap_or("none")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        other => Err(ApiError::invalid(
            param,
            format!("expected a string or a list of blocks, got {other}"),
        )),
    }
}

/// Messages-request fields [`to_chat`] reads; others are logged as not acted on.
const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "thinking",
];

/// The chat completion body a Messages request stands for.
pub(crate) fn to_chat(body: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    request::warn_fields_outside(body, MESSAGES_FIELDS);
    let mut chat = Map::new();
    for (from, to) in [
        ("model", "model"),
        ("max_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("stop_sequences", "stop"),
        ("stream", "stream"),
    ] {
        if let Some(v) = body.get(from) {
            chat.insert(to.to_string(), v.clone());
        }
    }
    if let Some(user) = body.pointer_str("/metadata/user_id") {
        chat.insert("user".to_string(), json!(user));
    }
    let mut messages = Vec::new();
    if let Some(system) = body.get("system") {
        messages.push(json!({"role": "system", "content": block_text(system, "system")?}));
    }
    let Some(Value::Array(items)) = body.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be a list"));
    };
    for (i, m) in items.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = m.get("role").and_then(Value::as_str).unwrap_or("");
        let content = m.get("content").cloned().unwrap_or(Value::Null);
        let blocks = match content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b,
            other => {
                return Err(ApiError::invalid(
                    &format!("{param}.content"),
                    format!("expected a string or a list of blocks, got {other}"),
                ));
            }
        };
        let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("{param}.content[{j}]");
            match (role, b.get("type").and_then(Value::as_str)) {
                (_, Some("text")) => {
                    text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                }
                ("assistant", Some("thinking")) => {
                    thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or(""))
                }
                ("assistant", Some("redacted_thinking")) => {}
                ("assistant", Some("tool_use")) => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {
                        "name": b.get("name").cloned().unwrap_or(Value::Null),
                        "arguments": b.get("input").cloned().unwrap_or(json!({})),
                    },
                })),
                ("user", Some("tool_result")) => {
                    // Results before the user's own text, as the conversation ran.
                    let result = block_text(b.get("content").unwrap_or(&Value::Null), &at)?;
                    messages.push(json!({
                        "role": "tool",
                        "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null),
                        "content": result,
                    }));
                }
                (_, other) => {
                    return Err(ApiError::invalid(
                        &at,
                        format!(
                            "a {} block is not supported in a {role} message",
                            other.unwrap_or("typeless")
                        ),
                    ));
                }
            }
        }
        match role {
            "user" => {
                if !text.is_empty() {
                    messages.push(json!({"role": "user", "content": text}));
                }
            }
            // Claude Code sends system messages among the turns (environment facts, its
            // deferred tools); the chat template places them.
            "system" => messages.push(json!({"role": "system", "content": text})),
            "assistant" => {
                let mut message = json!({"role": "assistant", "content": text});
                if !thinking.is_empty() {
                    message["reasoning_content"] = json!(thinking);
                }
                if !calls.is_empty() {
                    message["tool_calls"] = json!(calls);
                }
                messages.push(message);
            }
            other => {
                return Err(ApiError::invalid(
                    &format!("{param}.role"),
                    format!("`role` must be user, assistant or system, got `{other}`"),
                ));
            }
        }
    }
    chat.insert("messages".to_string(), Value::Array(messages));
    if let Some(Value::Array(tools)) = body.get("tools") {
        let tools: Vec<Value> = tools
            .iter()
            .map(|t| request::function_tool(t, "input_schema"))
            .collect();
        chat.insert("tools".to_string(), Value::Array(tools));
    }
    if let Some(choice) = body.get("tool_choice") {
        let mapped = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("none") => json!("none"),
            Some("any") => json!("required"),
            Some("tool") => json!({"type": "function", "function": {"name": choice.get("name")}}),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice.type` must be auto, any, tool or none",
                ));
            }
        };
        chat.insert("tool_choice".to_string(), mapped);
        if choice.get("disable_parallel_tool_use") == Some(&Value::Bool(true)) {
            chat.insert("parallel_tool_calls".to_string(), Value::Bool(false));
        }
    }
    if let Some(thinking) = body.get("thinking") {
        let on = thinking.get("type").and_then(Value::as_str) == Some("enabled");
        chat.insert(
            "chat_template_kwargs".to_string(),
            json!({"enable_thinking": on}),
        );
    }
    Ok(chat)
}

trait PointerStr {
    fn pointer_str(&self, pointer: &str) -> Option<&str>;
}

impl PointerStr for Map<String, Value> {
    fn pointer_str(&self, pointer: &str) -> Option<&str> {
        let (head, rest) = pointer.trim_start_matches('/').split_once('/')?;
        self.get(head)?.pointer(&format!("/{rest}"))?.as_str()
    }
}

/// Anthropic's name for why a reply ended.
fn stop_reason(finish_reason: &str) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        "tool_calls" => "tool_use",
        _ => "end_turn",
    }
}

/// Anthropic's usage from a chat usage: input tokens exclude those read from the cache.
fn usage_of(usage: &Value) -> Value {
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage["completion_tokens"].as_u64().unwrap_or(0),
    })
}

fn tool_use_block(id: usize, name: &str, arguments: &str) -> Value {
    let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": format!("toolu_{id:08x}"), "name": name, "input": input})
}

/// An error the chat request's checks found, naming the Messages field the client sent where
/// [`to_chat`] renamed it (`stop_sequences`, passed on as `stop`).
fn in_anthropic_terms(mut e: ApiError) -> ApiError {
    if e.param.as_deref() == Some("stop") {
        e.param = Some("stop_sequences".to_string());
        e.message = e.message.replace("`stop`", "`stop_sequences`");
    }
    e
}

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    let chat = to_chat(&body)?;
    let mut req =
        request::chat(&chat, &state.config.sampling_defaults).map_err(in_anthropic_terms)?;
    req.settings = request::with_session_header(req.settings, &headers)?;
    super::check_model(&state, req.settings.model.as_deref())?;
    let (prompt, parser) = super::chat::prepare(&state, &mut req, "messages").await?;
    let generation = Generation::start(&state, prompt, &req.settings, parser, "messages", "msg")?;
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map_or_else(|| state.config.served_model_name.clone(), str::to_string);
    if req.settings.stream {
        Ok(stream(generation, model).into_response())
    } else {
        Ok(Json(complete(generation, model).await?).into_response())
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`.
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    OpenAiJson(body): OpenAiJson,
) -> Result<Json<Value>, ApiError> {
    let chat = to_chat(&body)?;
    let mut req =
        request::chat(&chat, &state.config.sampling_defaults).map_err(in_anthropic_terms)?;
    super::check_model(&state, req.settings.model.as_deref())?;
    let (prompt, _) = super::chat::prepare(&state, &mut req, "messages").await?;
    Ok(Json(json!({"input_tokens": prompt.len()})))
}

async fn complete(mut g: Generation, model: String) -> Result<Value, ApiError> {
    let (mut text, mut thinking, mut tools) = (String::new(), String::new(), Vec::new());
    let mut add = |deltas: Vec<Delta>| {
        for d in deltas {
            match d {
                Delta::Content(t) => text.push_str(&t),
                Delta::Reasoning(t) => thinking.push_str(&t),
                // Only a streamed response's parser streams calls.
                Delta::ToolCallName(_) | Delta::ToolCallArguments(_) => {}
                Delta::ToolCall { name, arguments } => {
                    tools.push(tool_use_block(tools.len(), &name, &arguments))
                }
            }
        }
    };
    loop {
        match g.next().await? {
            Some(Step::Deltas { deltas, .. }) => add(deltas),
            Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                ..
            }) => {
                add(deltas);
                let mut content = Vec::new();
                if !thinking.is_empty() {
                    content
                        .push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
                }
                if !text.is_empty() || tools.is_empty() {
                    content.push(json!({"type": "text", "text": text}));
                }
                content.extend(tools);
                return Ok(json!({
                    "id": g.id(),
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": content,
                    "stop_reason": stop_reason(finish_reason),
                    "stop_sequence": Value::Null,
                    "usage": usage_of(&usage),
                }));
            }
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

/// The open content block of a stream: its index and kind.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Block {
    Text,
    Thinking,
    /// A tool call being streamed.
    ToolUse,
}

struct StreamState {
    generation: Option<Generation>,
    /// Events to send: name and data.
    pending: std::collections::VecDeque<(String, Value)>,
    open: Option<(usize, Block)>,
    next_index: usize,
    tools: usize,
    /// The `message_start` event, until it is sent (with the first token, when the prompt's
    /// cached and uncached tokens are known).
    start: Option<Value>,
    /// Whether a text or `tool_use` block was opened: a reply without one gets an empty
    /// text block, as clients expect some content.
    answered: bool,
}

fn event(name: &str, data: Value) -> (String, Value) {
    (name.to_string(), data)
}

impl StreamState {
    fn close(&mut self) {
        if let Some((index, _)) = self.open.take() {
            self.pending.push_back(event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
    }

    fn text(&mut self, kind: Block, piece: &str) {
        // An empty piece opens nothing, but for the empty text block of a reply without one.
        let empty_answer = kind == Block::Text && !self.answered;
        if piece.is_empty() && !empty_answer {
            return;
        }
        let index = match self.open {
            Some((index, open)) if open == kind => index,
            _ => {
                self.close();
                let index = self.next_index;
                self.next_index += 1;
                self.answered |= kind != Block::Thinking;
                let block = match kind {
                    Block::Thinking => json!({"type": "thinking", "thinking": ""}),
                    Block::Text | Block::ToolUse => json!({"type": "text", "text": ""}),
                };
                self.pending.push_back(event(
                    "content_block_start",
                    json!({"type": "content_block_start", "index": index, "content_block": block}),
                ));
                self.open = Some((index, kind));
                index
            }
        };
        if piece.is_empty() {
            return;
        }
        let delta = match kind {
            Block::Thinking => json!({"type": "thinking_delta", "thinking": piece}),
            Block::Text | Block::ToolUse => json!({"type": "text_delta", "text": piece}),
        };
        self.pending.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }

    /// A `tool_use` block opened (its input `{}`), the input's JSON to follow in pieces.
    fn begin_tool_use(&mut self, name: &str) {
        self.close();
        self.answered = true;
        let index = self.next_index;
        self.next_index += 1;
        let block = tool_use_block(self.tools, name, "{}");
        self.pending.push_back(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": block}),
        ));
        self.open = Some((index, Block::ToolUse));
    }

    /// More of the open `tool_use` block's input, as `input_json_delta`.
    fn tool_input(&mut self, more: &str) {
        let Some((index, Block::ToolUse)) = self.open else {
            return;
        };
        self.pending.push_back(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": more}}),
        ));
    }

    fn deltas(&mut self, deltas: Vec<Delta>) {
        for d in deltas {
            match d {
                Delta::Content(t) => self.text(Block::Text, &t),
                Delta::Reasoning(t) => self.text(Block::Thinking, &t),
                Delta::ToolCallName(name) => self.begin_tool_use(&name),
                Delta::ToolCallArguments(more) => self.tool_input(&more),
                Delta::ToolCall { name, arguments } => {
                    if !matches!(self.open, Some((_, Block::ToolUse))) {
                        self.begin_tool_use(&name);
                        self.tool_input(&arguments);
                    }
                    self.close();
                    self.tools += 1;
                }
            }
        }
    }

    async fn advance(&mut self) -> bool {
        let Some(g) = self.generation.as_mut() else {
            return false;
        };
        let step = g.next().await;
        if let Some(mut start) = self.start.take() {
            // Anthropic's usage at the start: the prompt's tokens, those read from the cache
            // apart.
            let cached = g.cached_tokens() as u64;
            start["message"]["usage"] = json!({
                "input_tokens": (g.prompt_tokens() as u64).saturating_sub(cached),
                "cache_read_input_tokens": cached,
                "cache_creation_input_tokens": 0,
                "output_tokens": 0,
            });
            self.pending.push_back(event("message_start", start));
        }
        match step {
            Ok(Some(Step::Deltas { deltas, .. })) => self.deltas(deltas),
            Ok(Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                ..
            })) => {
                self.deltas(deltas);
                if !self.answered {
                    self.text(Block::Text, "");
                }
                self.close();
                self.pending.push_back(event(
                    "message_delta",
                    json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(finish_reason), "stop_sequence": null},
                        "usage": usage_of(&usage)}),
                ));
                self.pending
                    .push_back(event("message_stop", json!({"type": "message_stop"})));
                self.generation = None;
            }
            Ok(None) => self.generation = None,
            Err(e) => {
                let error = json!({"type": "error", "error": {
                    "type": "api_error", "message": e.body()["error"]["message"]}});
                self.pending.push_back(event("error", error));
                self.generation = None;
            }
        }
        true
    }
}

fn stream(
    generation: Generation,
    model: String,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let start = json!({"type": "message_start", "message": {
        "id": generation.id(), "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null}});
    let state = StreamState {
        generation: Some(generation),
        pending: std::collections::VecDeque::new(),
        open: None,
        next_index: 0,
        tools: 0,
        start: Some(start),
        answered: false,
    };
    let events = futures_util::stream::unfold(state, |mut state| async move {
        loop {
            if let Some((name, data)) = state.pending.pop_front() {
                let e = SseEvent::default().event(name).data(data.to_string());
                return Some((Ok(e), state));
            }
            if !state.advance().await {
                return None;
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed tool call is a `tool_use` block opened with its name and an empty input,
    /// then `input_json_delta` pieces as the arguments are written, then closed; one that
    /// comes whole gets the same events at once, with the next tool id.
    #[test]
    fn tool_use_blocks_stream_their_input_as_it_is_written() {
        let mut s = StreamState {
            generation: None,
            pending: std::collections::VecDeque::new(),
            open: None,
            next_index: 0,
            tools: 0,
            start: None,
            answered: false,
        };
        s.deltas(vec![
            Delta::Content("Checking.".into()),
            Delta::ToolCallName("get_weather".into()),
            Delta::ToolCallArguments("{\"city\":".into()),
        ]);
        s.deltas(vec![
            Delta::ToolCallArguments("\"Rome\"}".into()),
            Delta::ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Rome\"}".into(),
            },
            Delta::ToolCall {
                name: "g".into(),
                arguments: "{}".into(),
            },
        ]);
        let events: Vec<(String, Value)> = s.pending.iter().cloned().collect();
        let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
            ]
        );
        let block = &events[3].1["content_block"];
        assert_eq!(
            (&block["type"], &block["name"], &block["input"]),
            (&json!("tool_use"), &json!("get_weather"), &json!({}))
        );
        let pieces: Vec<&Value> = events[4..6]
            .iter()
            .map(|e| &e.1["delta"]["partial_json"])
            .collect();
        assert_eq!(pieces, [&json!("{\"city\":"), &json!("\"Rome\"}")]);
        assert_eq!(events[3].1["index"], 1);
        assert_eq!(events[7].1["content_block"]["id"], "toolu_00000001");
        assert_eq!(events[8].1["delta"]["partial_json"], "{}");
        assert_eq!(s.tools, 2);
    }

    /// A Messages conversation with a system prompt, thinking, a tool call and its result
    /// becomes the chat conversation the template renders.
    #[test]
    fn a_tool_round_trip_translates() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "thinking": {"type": "disabled"},
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look it up"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12 C"}]},
                    {"type": "text", "text": "Thanks"}]}
            ]
        });
        let chat = to_chat(body.as_object().unwrap()).unwrap();
        assert_eq!(chat["stop"], json!(["END"]));
        assert_eq!(chat["tool_choice"], "required");
        assert_eq!(chat["chat_template_kwargs"]["enable_thinking"], false);
        assert_eq!(
            chat["tools"][0]["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
                 "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "12 C"},
                {"role": "user", "content": "Thanks"}
            ])
        );
        let image = json!({"messages": [{"role": "user", "content": [{"type": "image"}]}]});
        let err = to_chat(image.as_object().unwrap()).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("messages[0].content[0]"));
    }
}
