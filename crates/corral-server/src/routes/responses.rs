//! `POST /v1/responses` (OpenAI's Responses API, which current agents speak; streamed or not) and
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
    "text",
    "parallel_tool_calls",
];

/// The chat completion body a Responses request stands for, given the stored conversation
/// it continues.
fn to_chat(body: &Map<String, Value>, history: Vec<Value>) -> Result<Map<String, Value>, ApiError> {
    request::warn_fields_outside(body, RESPONSES_FIELDS);
    let mut chat = Map::new();
    for (from, to) in [
        ("model", "model"),
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
        ("stream", "stream"),
    ] {
        if let Some(v) = body.get(from).filter(|v| !v.is_null()) {
            chat.insert(to.to_string(), v.clone());
        }
    }
    let mut messages = Vec::new();
    if let Some(Value::String(instructions)) = body.get("instructions") {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    // `instructions` hold for this response alone (they are not stored with it); system and
    // developer items of earlier inputs are part of the conversation.
    messages.extend(history);
    let input = body
        .get("input")
        .ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    messages.extend(input_messages(input)?);
    chat.insert("messages".to_string(), Value::Array(messages));
    if let Some(Value::Array(tools)) = body.get("tools") {
        let tools: Vec<Value> = tools
            .iter()
            .filter(|t| t.get("type").and_then(Value::as_str) == Some("function"))
            .map(|t| request::function_tool(t, "parameters"))
            .collect();
        chat.insert("tools".to_string(), Value::Array(tools));
    }
    // Choices of built-in tools (file search, ...) and allowed-tool lists are not held.
    match body.get("tool_choice") {
        Some(choice @ Value::String(_)) => {
            chat.insert("tool_choice".to_string(), choice.clone());
        }
        Some(choice) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            chat.insert("tool_choice".to_string(), choice.clone());
        }
        Some(other) => request::warn_ignored(&[format!("tool_choice {other}")]),
        None => {}
    }
    if let Some(parallel) = body.get("parallel_tool_calls") {
        chat.insert("parallel_tool_calls".to_string(), parallel.clone());
    }
    // text.format: {"type": "json_schema", "name", "schema", "strict"} is chat's
    // response_format with the schema one level down.
    if let Some(format) = body.get("text").and_then(|t| t.get("format")) {
        let mapped = match format.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let mut spec = format.as_object().cloned().unwrap_or_default();
                spec.remove("type");
                json!({"type": "json_schema", "json_schema": spec})
            }
            _ => format.clone(),
        };
        chat.insert("response_format".to_string(), mapped);
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

/// A reply as it is put together: its text, reasoning and calls, with the ids its output
/// items get (the same in the stream's events and in the final response).
#[derive(Default)]
struct Turn {
    text: String,
    reasoning: String,
    /// `(item id, call id, name, arguments)`.
    calls: Vec<(String, String, String, String)>,
    message_id: String,
    reasoning_id: String,
}

impl Turn {
    fn new() -> Self {
        Self {
            message_id: response_id("msg"),
            reasoning_id: response_id("rs"),
            ..Self::default()
        }
    }

    fn reasoning_item(&self) -> Value {
        json!({"type": "reasoning", "id": self.reasoning_id,
            "summary": [{"type": "summary_text", "text": self.reasoning}]})
    }

    fn text_part(&self) -> Value {
        json!({"type": "output_text", "text": self.text, "annotations": []})
    }

    fn message_item(&self, status: &str) -> Value {
        let content = if status == "completed" {
            json!([self.text_part()])
        } else {
            json!([])
        };
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": content})
    }

    fn call_item(call: &(String, String, String, String), status: &str) -> Value {
        let (id, call_id, name, arguments) = call;
        json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
            "arguments": if status == "completed" { arguments.as_str() } else { "" },
            "status": status})
    }

    /// The output items, in the order they were made.
    fn output(&self) -> Vec<Value> {
        let mut output = Vec::new();
        if !self.reasoning.is_empty() {
            output.push(self.reasoning_item());
        }
        if !self.text.is_empty() || self.calls.is_empty() {
            output.push(self.message_item("completed"));
        }
        output.extend(self.calls.iter().map(|c| Self::call_item(c, "completed")));
        output
    }
}

/// What a request's reply needs besides the reply: its body, and where it is stored.
struct Request {
    id: String,
    body: Map<String, Value>,
    model: Value,
    /// The conversation that was prompted, for storing with the reply.
    messages: Vec<Value>,
    store: Option<std::sync::Arc<ResponseStore>>,
}

impl Request {
    /// The response object for `turn`, `status` "in_progress" while streaming.
    fn response(&self, turn: Option<&Turn>, status: &str, usage: Option<&Value>) -> Value {
        let field = |k: &str| self.body.get(k).cloned().unwrap_or(Value::Null);
        let usage = usage.map(|u| {
            let prompt = u["prompt_tokens"].as_u64().unwrap_or(0);
            let completion = u["completion_tokens"].as_u64().unwrap_or(0);
            json!({
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"].as_u64().unwrap_or(0)},
                "total_tokens": prompt + completion,
            })
        });
        json!({
            "id": self.id,
            "object": "response",
            "created_at": unix_now(),
            "status": status,
            "incomplete_details": if status == "incomplete" { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "error": null,
            "model": self.model,
            "instructions": field("instructions"),
            "previous_response_id": field("previous_response_id"),
            "output": turn.map_or_else(Vec::new, Turn::output),
            "parallel_tool_calls": true,
            "tool_choice": self.body.get("tool_choice").cloned().unwrap_or(json!("auto")),
            "tools": self.body.get("tools").cloned().unwrap_or(json!([])),
            "temperature": field("temperature"),
            "top_p": field("top_p"),
            "max_output_tokens": field("max_output_tokens"),
            "usage": usage,
        })
    }

    /// Keeps the finished response and its conversation, unless `store` is false.
    fn keep(&self, turn: &Turn, response: &Value) {
        let Some(store) = &self.store else { return };
        let mut messages = self.messages.clone();
        let mut reply = json!({"role": "assistant", "content": turn.text});
        if !turn.calls.is_empty() {
            reply["tool_calls"] = turn
                .calls
                .iter()
                .map(|(_, call_id, name, arguments)| {
                    json!({"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": arguments}})
                })
                .collect();
        }
        messages.push(reply);
        store.put(Stored {
            id: self.id.clone(),
            messages,
            body: response.clone(),
        });
    }
}

fn status_of(finish_reason: &str) -> &'static str {
    if finish_reason == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
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
    let (prompt, parser) = super::chat::prepare(&state, &mut req, "input").await?;
    let g = Generation::start(&state, prompt, &req.settings, parser, "input", "resp")?;
    let keep = body.get("store").and_then(Value::as_bool) != Some(false);
    // What is stored is the conversation without this response's `instructions`.
    let instructions = usize::from(body.get("instructions").is_some_and(Value::is_string));
    let request = Request {
        id: g.id().to_string(),
        model: body
            .get("model")
            .cloned()
            .unwrap_or_else(|| json!(state.config.served_model_name)),
        body,
        messages: req.messages[instructions..].to_vec(),
        store: keep.then(|| std::sync::Arc::clone(&state.responses)),
    };
    if req.settings.stream {
        Ok(stream(g, request).into_response())
    } else {
        Ok(Json(complete(g, request).await?).into_response())
    }
}

async fn complete(mut g: Generation, request: Request) -> Result<Value, ApiError> {
    let mut turn = Turn::new();
    let add = |turn: &mut Turn, deltas: Vec<Delta>| {
        for d in deltas {
            match d {
                Delta::Content(t) => turn.text.push_str(&t),
                Delta::Reasoning(t) => turn.reasoning.push_str(&t),
                // Only a streamed response's parser streams calls.
                Delta::ToolCallName(_) | Delta::ToolCallArguments(_) => {}
                Delta::ToolCall { name, arguments } => {
                    turn.calls
                        .push((response_id("fc"), response_id("call"), name, arguments))
                }
            }
        }
    };
    loop {
        match g.next().await? {
            Some(Step::Deltas { deltas, .. }) => add(&mut turn, deltas),
            Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                ..
            }) => {
                add(&mut turn, deltas);
                let response =
                    request.response(Some(&turn), status_of(finish_reason), Some(&usage));
                request.keep(&turn, &response);
                return Ok(response);
            }
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

/// The open output item of a stream.
#[derive(Clone, Copy, PartialEq)]
enum Open {
    Nothing,
    Reasoning,
    Message,
    /// A function call being streamed (see `StreamState::call`).
    Call,
}

struct StreamState {
    generation: Option<Generation>,
    request: Request,
    turn: Turn,
    open: Open,
    /// The function call being streamed: (item id, call id, name, arguments so far).
    call: (String, String, String, String),
    /// Output items begun so far (the next one's index).
    items: usize,
    sequence: u64,
    /// Events to send, each its data with its `type`.
    pending: VecDeque<Value>,
}

impl StreamState {
    fn new(generation: Option<Generation>, request: Request) -> Self {
        Self {
            generation,
            request,
            turn: Turn::new(),
            open: Open::Nothing,
            call: Default::default(),
            items: 0,
            sequence: 0,
            pending: VecDeque::new(),
        }
    }

    fn emit(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        self.pending.push_back(data);
    }

    /// Ends the open item: the reasoning item whole, or the message's text and part.
    fn close(&mut self) {
        let index = self.items.saturating_sub(1);
        match self.open {
            Open::Nothing => {}
            Open::Reasoning => {
                let ids = json!({"item_id": self.turn.reasoning_id, "output_index": index,
                    "summary_index": 0});
                let mut done = ids.clone();
                done["text"] = json!(self.turn.reasoning);
                self.emit("response.reasoning_summary_text.done", done);
                let mut part = ids;
                part["part"] = json!({"type": "summary_text", "text": self.turn.reasoning});
                self.emit("response.reasoning_summary_part.done", part);
                let item = self.turn.reasoning_item();
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
            // A call whose end never came (the model's text broke off it): what was sent.
            Open::Call => {
                let call = std::mem::take(&mut self.call);
                self.end_call(index, &call, "incomplete");
            }
            Open::Message => {
                let id = self.turn.message_id.clone();
                let ids = json!({"item_id": id, "output_index": index, "content_index": 0});
                let mut done = ids.clone();
                done["text"] = json!(self.turn.text);
                self.emit("response.output_text.done", done);
                let mut part = ids;
                part["part"] = self.turn.text_part();
                self.emit("response.content_part.done", part);
                let item = self.turn.message_item("completed");
                self.emit(
                    "response.output_item.done",
                    json!({"output_index": index, "item": item}),
                );
            }
        }
        self.open = Open::Nothing;
    }

    fn begin(&mut self, open: Open) {
        self.close();
        let index = self.items;
        self.items += 1;
        self.open = open;
        match open {
            Open::Reasoning => {
                let item =
                    json!({"type": "reasoning", "id": self.turn.reasoning_id, "summary": []});
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.emit(
                    "response.reasoning_summary_part.added",
                    json!({"item_id": self.turn.reasoning_id, "output_index": index,
                        "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
                );
            }
            Open::Message => {
                let item = self.turn.message_item("in_progress");
                self.emit(
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": self.turn.message_id, "output_index": index, "content_index": 0,
                        "part": {"type": "output_text", "text": "", "annotations": []}}),
                );
            }
            Open::Nothing | Open::Call => {}
        }
    }

    /// A function call's item begun, its arguments to follow.
    fn begin_call(&mut self, call: (String, String, String, String)) {
        self.close();
        let index = self.items;
        self.items += 1;
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": Turn::call_item(&call, "in_progress")}),
        );
        self.call = call;
        self.open = Open::Call;
    }

    fn call_arguments(&mut self, more: &str) {
        let (index, id) = (self.items - 1, self.call.0.clone());
        self.call.3.push_str(more);
        self.emit(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": more}),
        );
    }

    fn end_call(&mut self, index: usize, call: &(String, String, String, String), status: &str) {
        self.emit(
            "response.function_call_arguments.done",
            json!({"item_id": call.0, "output_index": index, "arguments": call.3}),
        );
        let mut item = Turn::call_item(call, "completed");
        item["status"] = json!(status);
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }

    fn deltas(&mut self, deltas: Vec<Delta>) {
        for d in deltas {
            match d {
                Delta::Reasoning(t) => {
                    if self.open != Open::Reasoning {
                        self.begin(Open::Reasoning);
                    }
                    self.turn.reasoning.push_str(&t);
                    let index = self.items - 1;
                    let id = self.turn.reasoning_id.clone();
                    self.emit(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": t}),
                    );
                }
                Delta::Content(t) => {
                    if self.open != Open::Message {
                        self.begin(Open::Message);
                    }
                    self.turn.text.push_str(&t);
                    let index = self.items - 1;
                    let id = self.turn.message_id.clone();
                    self.emit(
                        "response.output_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t}),
                    );
                }
                Delta::ToolCallName(name) => {
                    let call = (response_id("fc"), response_id("call"), name, String::new());
                    self.begin_call(call);
                }
                Delta::ToolCallArguments(more) if self.open == Open::Call => {
                    self.call_arguments(&more)
                }
                Delta::ToolCallArguments(_) => {}
                Delta::ToolCall { name, arguments } => {
                    if self.open != Open::Call {
                        let call = (response_id("fc"), response_id("call"), name, String::new());
                        self.begin_call(call);
                        self.call_arguments(&arguments);
                    }
                    // The whole call's arguments, which the pieces sent begin.
                    let mut call = std::mem::take(&mut self.call);
                    call.3 = arguments;
                    self.end_call(self.items - 1, &call, "completed");
                    self.open = Open::Nothing;
                    self.turn.calls.push(call);
                }
            }
        }
    }

    async fn advance(&mut self) -> bool {
        let Some(g) = self.generation.as_mut() else {
            return false;
        };
        match g.next().await {
            Ok(Some(Step::Deltas { deltas, .. })) => self.deltas(deltas),
            Ok(Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                ..
            })) => {
                self.deltas(deltas);
                // A reply with no text and no call still has its (empty) message.
                if self.turn.text.is_empty()
                    && self.turn.calls.is_empty()
                    && self.open != Open::Message
                {
                    self.begin(Open::Message);
                }
                self.close();
                let status = status_of(finish_reason);
                let response = self
                    .request
                    .response(Some(&self.turn), status, Some(&usage));
                self.request.keep(&self.turn, &response);
                let kind = if status == "completed" {
                    "response.completed"
                } else {
                    "response.incomplete"
                };
                self.emit(kind, json!({"response": response}));
                self.generation = None;
            }
            Ok(None) => self.generation = None,
            Err(e) => {
                let mut failed = self.request.response(Some(&self.turn), "failed", None);
                failed["error"] =
                    json!({"code": "server_error", "message": e.body()["error"]["message"]});
                self.emit("response.failed", json!({"response": failed}));
                self.generation = None;
            }
        }
        true
    }
}

fn stream(
    generation: Generation,
    request: Request,
) -> axum::response::sse::Sse<
    impl futures_util::Stream<Item = Result<axum::response::sse::Event, std::convert::Infallible>>,
> {
    let mut state = StreamState::new(Some(generation), request);
    let started = state.request.response(None, "in_progress", None);
    state.emit("response.created", json!({"response": started.clone()}));
    state.emit("response.in_progress", json!({"response": started}));
    let events = futures_util::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(data) = state.pending.pop_front() {
                let kind = data["type"].as_str().unwrap_or("message").to_string();
                let event = axum::response::sse::Event::default()
                    .event(kind)
                    .data(data.to_string());
                return Some((Ok(event), state));
            }
            if !state.advance().await {
                return None;
            }
        }
    });
    axum::response::sse::Sse::new(events).keep_alive(axum::response::sse::KeepAlive::default())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> StreamState {
        let request = Request {
            id: "resp_1".into(),
            body: Map::new(),
            model: json!("tiny"),
            messages: Vec::new(),
            store: None,
        };
        StreamState::new(None, request)
    }

    fn kinds(state: &StreamState) -> Vec<String> {
        state
            .pending
            .iter()
            .map(|e| e["type"].as_str().unwrap_or("").to_string())
            .collect()
    }

    /// A streamed call opens its item as its name comes, sends its arguments as
    /// `response.function_call_arguments.delta` pieces, and ends with the whole arguments; a
    /// call that comes whole gets the same events at once; each is one output item.
    #[test]
    fn function_calls_stream_their_arguments_as_they_come() {
        let mut s = state();
        s.deltas(vec![
            Delta::Content("Checking.".into()),
            Delta::ToolCallName("get_weather".into()),
            Delta::ToolCallArguments("{\"city\":\"Pa".into()),
        ]);
        s.deltas(vec![
            Delta::ToolCallArguments("ris\"}".into()),
            Delta::ToolCall {
                name: "get_weather".into(),
                arguments: "{\"city\":\"Paris\"}".into(),
            },
            Delta::ToolCall {
                name: "g".into(),
                arguments: "{}".into(),
            },
        ]);
        let calls = |kind: &str| -> Vec<Value> {
            s.pending
                .iter()
                .filter(|e| e["type"] == kind)
                .cloned()
                .collect()
        };
        let deltas: Vec<String> = calls("response.function_call_arguments.delta")
            .iter()
            .map(|e| e["delta"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(deltas, ["{\"city\":\"Pa", "ris\"}", "{}"]);
        let done = calls("response.function_call_arguments.done");
        assert_eq!(done[0]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(done[0]["output_index"], 1, "after the message");
        assert_eq!(done[1]["output_index"], 2);
        let added = calls("response.output_item.added");
        assert_eq!(added[1]["item"]["name"], "get_weather");
        assert_eq!(added[1]["item"]["arguments"], "");
        let items = calls("response.output_item.done");
        assert_eq!(items[1]["item"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(items[1]["item"]["status"], "completed");
        assert_eq!(s.turn.calls.len(), 2);
        // The call's item is added (after the message's) before its first argument piece,
        // and that piece comes before the call's end.
        let order = kinds(&s);
        let at = |kind: &str, nth: usize| {
            order
                .iter()
                .enumerate()
                .filter(|(_, k)| *k == kind)
                .nth(nth)
                .map(|(i, _)| i)
        };
        assert!(
            at("response.output_item.added", 1) < at("response.function_call_arguments.delta", 0)
        );
        assert!(
            at("response.function_call_arguments.delta", 1)
                < at("response.function_call_arguments.done", 0)
        );
    }

    /// Reasoning streams as OpenAI streams a reasoning summary: its item, its part, the
    /// text in deltas, then the text, the part and the item done, before the message.
    #[test]
    fn reasoning_streams_as_summary_deltas() {
        let mut s = state();
        s.deltas(vec![Delta::Reasoning("Let me ".into())]);
        s.deltas(vec![
            Delta::Reasoning("think.".into()),
            Delta::Content("Hi".into()),
        ]);
        let order = kinds(&s);
        assert_eq!(
            order[..7],
            [
                "response.output_item.added",
                "response.reasoning_summary_part.added",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.delta",
                "response.reasoning_summary_text.done",
                "response.reasoning_summary_part.done",
                "response.output_item.done",
            ]
        );
        assert_eq!(s.pending[3]["delta"], "think.");
        assert_eq!(s.pending[4]["text"], "Let me think.");
        assert_eq!(s.pending[6]["item"]["summary"][0]["text"], "Let me think.");
        assert_eq!(order[7], "response.output_item.added");
    }
}
