//! `POST /v1/responses` (OpenAI's Responses API, which current agents speak; streamed or not)
//! and `GET /v1/responses/{id}`: the request is decoded by `request/responses.rs` after the
//! stored conversation its `previous_response_id` continues, runs on the shared driver, and
//! its reply goes out as output items. Stored responses (`store`, default true) are kept in
//! memory, the most recent [`MAX_STORED`], for the conversations that continue them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, State};
use axum::response::Response;
use corral_engine::TokenEvent;
use serde_json::{Map, Value, json};

use crate::driver::{
    self, Call, End, Finish, Frame, Generation, Part, Render, Reply, ReplyEvent, Usage,
    response_id, unix_now,
};
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::request::{self, Message, Role, ToolCall};
use crate::state::AppState;

/// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
pub(crate) const MAX_STORED: usize = 256;

/// A stored response: its conversation (its own output included) and body.
#[derive(Clone, Debug)]
struct Stored {
    id: String,
    messages: Vec<Message>,
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

/// `POST /v1/responses`.
pub(crate) async fn create(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let history = match body.get("previous_response_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(id)) => {
            state
                .responses
                .get(id)
                .ok_or_else(|| {
                    ApiError::invalid("previous_response_id", format!("no stored response `{id}`"))
                })?
                .messages
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "previous_response_id",
                "`previous_response_id` must be a string",
            ));
        }
    };
    let mut req = request::responses::decode(&body, history, &state.config.sampling_defaults)?;
    request::with_session_header(&mut req.generate, &headers)?;
    super::check_model(&state, req.generate.model.as_deref())?;
    // What is stored is the conversation without this response's `instructions`.
    let instructions = usize::from(body.get("instructions").is_some_and(Value::is_string));
    let messages = req.conversation.messages[instructions..].to_vec();
    let (prompt, parser) = crate::prompt::prepare(&state, &mut req, "input").await?;
    let g = Generation::start(&state, prompt, &req.generate, parser, "input", "resp")?;
    let keep = body.get("store").and_then(Value::as_bool) != Some(false);
    let render = ResponsesRender {
        id: g.id().to_string(),
        model: body
            .get("model")
            .cloned()
            .unwrap_or_else(|| json!(state.config.served_model_name)),
        body,
        messages,
        store: keep.then(|| Arc::clone(&state.responses)),
        message_id: response_id("msg"),
        reasoning_id: response_id("rs"),
        items: 0,
        sequence: 0,
    };
    driver::respond(g, Reply::new("call"), render, req.generate.stream).await
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

/// The Responses wire format, with what a reply's response object and storing it need.
struct ResponsesRender {
    id: String,
    body: Map<String, Value>,
    model: Value,
    /// The conversation that was prompted, for storing with the reply.
    messages: Vec<Message>,
    store: Option<Arc<ResponseStore>>,
    message_id: String,
    reasoning_id: String,
    /// Output items begun so far (the next one's index).
    items: usize,
    sequence: u64,
}

/// A call's output item id, from its call id.
fn item_id(call: &Call) -> String {
    format!("fc_{}", call.id.trim_start_matches("call_"))
}

fn call_item(call: &Call, status: &str) -> Value {
    json!({"type": "function_call", "id": item_id(call), "call_id": call.id, "name": call.name,
        "arguments": if status == "in_progress" { "" } else { call.arguments.as_str() },
        "status": status})
}

fn status_of(end: &End) -> &'static str {
    if end.finish == Finish::Length {
        "incomplete"
    } else {
        "completed"
    }
}

impl ResponsesRender {
    fn emit(&mut self, frames: &mut Vec<Frame>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        frames.push(Frame::Named(kind.to_string(), data));
    }

    fn reasoning_item(&self, reply: &Reply) -> Value {
        json!({"type": "reasoning", "id": self.reasoning_id,
            "summary": [{"type": "summary_text", "text": reply.reasoning}]})
    }

    fn text_part(reply: &Reply) -> Value {
        json!({"type": "output_text", "text": reply.text, "annotations": []})
    }

    fn message_item(&self, reply: &Reply, status: &str) -> Value {
        let content = if status == "completed" {
            json!([Self::text_part(reply)])
        } else {
            json!([])
        };
        json!({"type": "message", "id": self.message_id, "status": status, "role": "assistant",
            "content": content})
    }

    /// The output items, in the order they are made.
    fn output(&self, reply: &Reply) -> Vec<Value> {
        let mut output = Vec::new();
        if !reply.reasoning.is_empty() {
            output.push(self.reasoning_item(reply));
        }
        if !reply.text.is_empty() || reply.calls().next().is_none() {
            output.push(self.message_item(reply, "completed"));
        }
        output.extend(reply.calls().map(|c| call_item(c, "completed")));
        output
    }

    /// The response object, `status` "in_progress" while streaming.
    fn response(&self, reply: Option<&Reply>, status: &str, usage: Option<&Usage>) -> Value {
        let field = |k: &str| self.body.get(k).cloned().unwrap_or(Value::Null);
        let usage = usage.map(|u| {
            json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
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
            "output": reply.map_or_else(Vec::new, |r| self.output(r)),
            "parallel_tool_calls": true,
            "tool_choice": self.body.get("tool_choice").cloned().unwrap_or(json!("auto")),
            "tools": self.body.get("tools").cloned().unwrap_or(json!([])),
            "temperature": field("temperature"),
            "top_p": field("top_p"),
            "max_output_tokens": field("max_output_tokens"),
            "usage": usage,
        })
    }

    /// The finished response, kept with its conversation unless `store` is false.
    fn finished(&self, reply: &Reply, end: &End) -> Value {
        let response = self.response(Some(reply), status_of(end), Some(&end.usage));
        if let Some(store) = &self.store {
            let mut turn = Message::text(Role::Assistant, reply.text.as_str());
            turn.tool_calls = reply
                .calls()
                .map(|c| ToolCall::from_text(Some(c.id.clone()), c.name.clone(), &c.arguments))
                .collect();
            let mut messages = self.messages.clone();
            messages.push(turn);
            store.put(Stored {
                id: self.id.clone(),
                messages,
                body: response.clone(),
            });
        }
        response
    }

    fn events(&mut self, reply: &Reply, events: &[ReplyEvent], frames: &mut Vec<Frame>) {
        for e in events {
            let index = self.items.saturating_sub(1);
            match e {
                ReplyEvent::Open(part) => {
                    let index = self.items;
                    self.items += 1;
                    match part {
                        Part::Reasoning => {
                            let item = json!({"type": "reasoning", "id": self.reasoning_id, "summary": []});
                            self.emit(
                                frames,
                                "response.output_item.added",
                                json!({"output_index": index, "item": item}),
                            );
                            let part = json!({"item_id": self.reasoning_id, "output_index": index,
                                "summary_index": 0, "part": {"type": "summary_text", "text": ""}});
                            self.emit(frames, "response.reasoning_summary_part.added", part);
                        }
                        Part::Text => {
                            let item = self.message_item(reply, "in_progress");
                            self.emit(
                                frames,
                                "response.output_item.added",
                                json!({"output_index": index, "item": item}),
                            );
                            let part = json!({"item_id": self.message_id, "output_index": index,
                                "content_index": 0,
                                "part": {"type": "output_text", "text": "", "annotations": []}});
                            self.emit(frames, "response.content_part.added", part);
                        }
                        Part::Call(i) => {
                            let item = call_item(reply.call(*i), "in_progress");
                            self.emit(
                                frames,
                                "response.output_item.added",
                                json!({"output_index": index, "item": item}),
                            );
                        }
                    }
                }
                ReplyEvent::More(Part::Reasoning, t) => {
                    let data = json!({"item_id": self.reasoning_id, "output_index": index,
                        "summary_index": 0, "delta": t});
                    self.emit(frames, "response.reasoning_summary_text.delta", data);
                }
                ReplyEvent::More(Part::Text, t) => {
                    let data = json!({"item_id": self.message_id, "output_index": index,
                        "content_index": 0, "delta": t});
                    self.emit(frames, "response.output_text.delta", data);
                }
                ReplyEvent::More(Part::Call(i), more) => {
                    let data = json!({"item_id": item_id(reply.call(*i)), "output_index": index,
                        "delta": more});
                    self.emit(frames, "response.function_call_arguments.delta", data);
                }
                ReplyEvent::Close(Part::Reasoning) => {
                    let ids = json!({"item_id": self.reasoning_id, "output_index": index,
                        "summary_index": 0});
                    let mut done = ids.clone();
                    done["text"] = json!(reply.reasoning);
                    self.emit(frames, "response.reasoning_summary_text.done", done);
                    let mut part = ids;
                    part["part"] = json!({"type": "summary_text", "text": reply.reasoning});
                    self.emit(frames, "response.reasoning_summary_part.done", part);
                    let item = self.reasoning_item(reply);
                    self.emit(
                        frames,
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    );
                }
                ReplyEvent::Close(Part::Text) => {
                    let ids = json!({"item_id": self.message_id, "output_index": index,
                        "content_index": 0});
                    let mut done = ids.clone();
                    done["text"] = json!(reply.text);
                    self.emit(frames, "response.output_text.done", done);
                    let mut part = ids;
                    part["part"] = Self::text_part(reply);
                    self.emit(frames, "response.content_part.done", part);
                    let item = self.message_item(reply, "completed");
                    self.emit(
                        frames,
                        "response.output_item.done",
                        json!({"output_index": index, "item": item}),
                    );
                }
                ReplyEvent::Close(Part::Call(i)) => {
                    // A call whose end never came (the model's text broke off it): what was
                    // sent, incomplete.
                    let call = reply.call(*i);
                    let data = json!({"item_id": item_id(call), "output_index": index,
                        "arguments": call.arguments});
                    self.emit(frames, "response.function_call_arguments.done", data);
                    let status = if call.complete {
                        "completed"
                    } else {
                        "incomplete"
                    };
                    self.emit(
                        frames,
                        "response.output_item.done",
                        json!({"output_index": index, "item": call_item(call, status)}),
                    );
                }
            }
        }
    }
}

impl Render for ResponsesRender {
    fn opening(&mut self, _g: &Generation) -> Vec<Frame> {
        let mut frames = Vec::new();
        let started = self.response(None, "in_progress", None);
        self.emit(
            &mut frames,
            "response.created",
            json!({"response": started.clone()}),
        );
        self.emit(
            &mut frames,
            "response.in_progress",
            json!({"response": started}),
        );
        frames
    }

    fn step(
        &mut self,
        _g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        _logprobs: &[TokenEvent],
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        self.events(reply, events, &mut frames);
        frames
    }

    fn ending(
        &mut self,
        _g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        end: &End,
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        self.events(reply, events, &mut frames);
        // A reply with no text and no call still has its (empty) message.
        if reply.text.is_empty() && reply.calls().next().is_none() {
            self.events(
                reply,
                &[ReplyEvent::Open(Part::Text), ReplyEvent::Close(Part::Text)],
                &mut frames,
            );
        }
        let response = self.finished(reply, end);
        let kind = if status_of(end) == "completed" {
            "response.completed"
        } else {
            "response.incomplete"
        };
        self.emit(&mut frames, kind, json!({"response": response}));
        frames
    }

    fn failure(&mut self, _g: &Generation, reply: &Reply, error: &ApiError) -> Vec<Frame> {
        let mut failed = self.response(Some(reply), "failed", None);
        failed["error"] = json!({"code": "server_error", "message": error.message});
        let mut frames = Vec::new();
        self.emit(&mut frames, "response.failed", json!({"response": failed}));
        frames
    }

    fn body(&mut self, _g: &Generation, reply: &Reply, end: &End) -> Value {
        self.finished(reply, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::Delta;

    fn render() -> ResponsesRender {
        ResponsesRender {
            id: "resp_1".into(),
            body: Map::new(),
            model: json!("tiny"),
            messages: Vec::new(),
            store: None,
            message_id: "msg_1".into(),
            reasoning_id: "rs_1".into(),
            items: 0,
            sequence: 0,
        }
    }

    /// The data of each frame, after feeding the render these steps.
    fn frames(r: &mut ResponsesRender, reply: &mut Reply, steps: Vec<Vec<Delta>>) -> Vec<Value> {
        let g = Generation::fed("", "");
        let mut out = Vec::new();
        for deltas in steps {
            let events = reply.push(deltas);
            out.extend(r.step(&g, reply, &events, &[]));
        }
        out.into_iter()
            .map(|f| match f {
                Frame::Named(_, data) => data,
                other => panic!("{other:?}"),
            })
            .collect()
    }

    fn kinds(frames: &[Value]) -> Vec<String> {
        frames
            .iter()
            .map(|e| e["type"].as_str().unwrap_or("").to_string())
            .collect()
    }

    /// A streamed call opens its item as its name comes, sends its arguments as
    /// `response.function_call_arguments.delta` pieces, and ends with the whole arguments; a
    /// call that comes whole gets the same events at once; each is one output item.
    #[test]
    fn function_calls_stream_their_arguments_as_they_come() {
        let (mut r, mut reply) = (render(), Reply::new("call"));
        let s = frames(
            &mut r,
            &mut reply,
            vec![
                vec![
                    Delta::Content("Checking.".into()),
                    Delta::ToolCallName("get_weather".into()),
                    Delta::ToolCallArguments("{\"city\":\"Pa".into()),
                ],
                vec![
                    Delta::ToolCallArguments("ris\"}".into()),
                    Delta::ToolCall {
                        name: "get_weather".into(),
                        arguments: "{\"city\":\"Paris\"}".into(),
                    },
                    Delta::ToolCall {
                        name: "g".into(),
                        arguments: "{}".into(),
                    },
                ],
            ],
        );
        let calls = |kind: &str| -> Vec<Value> {
            s.iter().filter(|e| e["type"] == kind).cloned().collect()
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
        assert_eq!(reply.calls().count(), 2);
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
        let (mut r, mut reply) = (render(), Reply::new("call"));
        let s = frames(
            &mut r,
            &mut reply,
            vec![
                vec![Delta::Reasoning("Let me ".into())],
                vec![
                    Delta::Reasoning("think.".into()),
                    Delta::Content("Hi".into()),
                ],
            ],
        );
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
        assert_eq!(s[3]["delta"], "think.");
        assert_eq!(s[4]["text"], "Let me think.");
        assert_eq!(s[6]["item"]["summary"][0]["text"], "Let me think.");
        assert_eq!(order[7], "response.output_item.added");
    }
}
