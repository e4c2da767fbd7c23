//! `POST /v1/messages` (Anthropic's Messages API, as Claude-Code-style clients speak it) and
//! `POST /v1/messages/count_tokens`: the request is decoded by `request/anthropic.rs`, runs on
//! the shared driver, and its reply goes out as content blocks or as Anthropic's stream of
//! events. Errors take Anthropic's shape (`lib.rs`'s `anthropic_errors`).

use axum::Json;
use axum::extract::State;
use axum::response::Response;
use corral_engine::TokenEvent;
use serde_json::{Value, json};

use crate::driver::Usage;
use crate::driver::{self, Call, End, Finish, Frame, Generation, Part, Render, Reply, ReplyEvent};
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::state::AppState;
use crate::{prompt, request};

/// `POST /v1/messages`.
pub(crate) async fn messages(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let mut req = request::anthropic::decode(&body, &state.config.sampling_defaults)?;
    request::with_session_header(&mut req.generate, &headers)?;
    super::check_model(&state, req.generate.model.as_deref())?;
    let (prompt, parser) = prompt::prepare(&state, &mut req, "messages").await?;
    let g = Generation::start(&state, prompt, &req.generate, parser, "messages", "msg")?;
    let model = req
        .generate
        .model
        .clone()
        .unwrap_or_else(|| state.config.served_model_name.clone());
    let render = AnthropicRender::new(model);
    driver::respond(g, Reply::new("toolu"), render, req.generate.stream).await
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`.
pub(crate) async fn count_tokens(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let mut req = request::anthropic::decode(&body, &state.config.sampling_defaults)?;
    super::check_model(&state, req.generate.model.as_deref())?;
    let (prompt, _) = prompt::prepare(&state, &mut req, "messages").await?;
    Ok(Json(json!({"input_tokens": prompt.len()})))
}

/// Anthropic's name for why a reply ended.
fn stop_reason(end: &End) -> &'static str {
    match end.finish {
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
        Finish::Stop if end.stop_sequence.is_some() => "stop_sequence",
        Finish::Stop => "end_turn",
    }
}

/// Anthropic's usage: input tokens exclude those read from the cache.
fn usage_json(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.prompt_tokens.saturating_sub(usage.cached_tokens),
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": usage.completion_tokens,
    })
}

/// A `tool_use` block with `input` (`{}` while a streamed one is being written).
fn tool_use_block(call: &Call, input: Value) -> Value {
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
}

/// The Messages wire format.
struct AnthropicRender {
    model: String,
    /// Whether `message_start` went out (with the first step, when the prompt's cached and
    /// uncached tokens are known).
    started: bool,
    /// Content blocks begun so far (the next one's index).
    blocks: usize,
    /// Whether a text or `tool_use` block was opened: a reply without one gets an empty text
    /// block, as clients expect some content.
    answered: bool,
}

fn event(name: &str, data: Value) -> Frame {
    Frame::Named(name.to_string(), data)
}

impl AnthropicRender {
    fn new(model: String) -> Self {
        Self {
            model,
            started: false,
            blocks: 0,
            answered: false,
        }
    }

    /// `message_start`, before the first frame.
    fn start(&mut self, g: &Generation, frames: &mut Vec<Frame>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let mut usage = usage_json(&g.usage());
        usage["output_tokens"] = json!(0);
        frames.push(event(
            "message_start",
            json!({"type": "message_start", "message": {
                "id": g.id(), "type": "message", "role": "assistant", "model": self.model,
                "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage}}),
        ));
    }

    fn block_start(&mut self, block: Value, frames: &mut Vec<Frame>) {
        frames.push(event(
            "content_block_start",
            json!({"type": "content_block_start", "index": self.blocks, "content_block": block}),
        ));
        self.blocks += 1;
    }

    fn delta(&self, delta: Value, frames: &mut Vec<Frame>) {
        frames.push(event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}),
        ));
    }

    fn block_stop(&self, frames: &mut Vec<Frame>) {
        frames.push(event(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": self.blocks - 1}),
        ));
    }

    fn events(&mut self, reply: &Reply, events: &[ReplyEvent], frames: &mut Vec<Frame>) {
        for e in events {
            match e {
                ReplyEvent::Open(Part::Reasoning) => {
                    self.block_start(json!({"type": "thinking", "thinking": ""}), frames)
                }
                ReplyEvent::Open(Part::Text) => {
                    self.answered = true;
                    self.block_start(json!({"type": "text", "text": ""}), frames)
                }
                ReplyEvent::Open(Part::Call(i)) => {
                    self.answered = true;
                    self.block_start(tool_use_block(reply.call(*i), json!({})), frames)
                }
                ReplyEvent::More(Part::Reasoning, t) => {
                    self.delta(json!({"type": "thinking_delta", "thinking": t}), frames)
                }
                ReplyEvent::More(Part::Text, t) => {
                    self.delta(json!({"type": "text_delta", "text": t}), frames)
                }
                ReplyEvent::More(Part::Call(_), more) => self.delta(
                    json!({"type": "input_json_delta", "partial_json": more}),
                    frames,
                ),
                ReplyEvent::Close(_) => self.block_stop(frames),
            }
        }
    }
}

impl Render for AnthropicRender {
    fn step(
        &mut self,
        g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        _logprobs: &[TokenEvent],
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        self.start(g, &mut frames);
        self.events(reply, events, &mut frames);
        frames
    }

    fn ending(
        &mut self,
        g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        end: &End,
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        self.start(g, &mut frames);
        self.events(reply, events, &mut frames);
        if !self.answered {
            self.block_start(json!({"type": "text", "text": ""}), &mut frames);
            self.block_stop(&mut frames);
        }
        frames.push(event(
            "message_delta",
            json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(end), "stop_sequence": end.stop_sequence},
                "usage": usage_json(&end.usage)}),
        ));
        frames.push(event("message_stop", json!({"type": "message_stop"})));
        frames
    }

    fn failure(&mut self, g: &Generation, _reply: &Reply, error: &ApiError) -> Vec<Frame> {
        let mut frames = Vec::new();
        self.start(g, &mut frames);
        frames.push(event(
            "error",
            json!({"type": "error", "error": {"type": "api_error", "message": error.message}}),
        ));
        frames
    }

    fn body(&mut self, g: &Generation, reply: &Reply, end: &End) -> Value {
        let mut content = Vec::new();
        if !reply.reasoning.is_empty() {
            content.push(json!({"type": "thinking", "thinking": reply.reasoning, "signature": ""}));
        }
        if !reply.text.is_empty() || reply.calls().next().is_none() {
            content.push(json!({"type": "text", "text": reply.text}));
        }
        content.extend(reply.calls().map(|c| {
            let input = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
            tool_use_block(c, input)
        }));
        json!({
            "id": g.id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason(end),
            "stop_sequence": end.stop_sequence,
            "usage": usage_json(&end.usage),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::Delta;

    /// A streamed tool call is a `tool_use` block opened with its name and an empty input,
    /// then `input_json_delta` pieces as the arguments are written, then closed; one that
    /// comes whole gets the same events at once, with the next tool id.
    #[test]
    fn tool_use_blocks_stream_their_input_as_it_is_written() {
        let g = Generation::fed("", "");
        let (mut r, mut reply) = (AnthropicRender::new("tiny".into()), Reply::new("toolu"));
        let mut frames = Vec::new();
        for deltas in [
            vec![
                Delta::Content("Checking.".into()),
                Delta::ToolCallName("get_weather".into()),
                Delta::ToolCallArguments("{\"city\":".into()),
            ],
            vec![
                Delta::ToolCallArguments("\"Rome\"}".into()),
                Delta::ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Rome\"}".into(),
                },
                Delta::ToolCall {
                    name: "g".into(),
                    arguments: "{}".into(),
                },
            ],
        ] {
            let events = reply.push(deltas);
            frames.extend(r.step(&g, &reply, &events, &[]));
        }
        let events: Vec<(String, Value)> = frames
            .into_iter()
            .map(|f| match f {
                Frame::Named(name, data) => (name, data),
                other => panic!("{other:?}"),
            })
            .collect();
        let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            names,
            [
                "message_start",
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
        let block = &events[4].1["content_block"];
        assert_eq!(
            (&block["type"], &block["name"], &block["input"]),
            (&json!("tool_use"), &json!("get_weather"), &json!({}))
        );
        let pieces: Vec<&Value> = events[5..7]
            .iter()
            .map(|e| &e.1["delta"]["partial_json"])
            .collect();
        assert_eq!(pieces, [&json!("{\"city\":"), &json!("\"Rome\"}")]);
        assert_eq!(events[4].1["index"], 1);
        let (first, second) = (
            &events[4].1["content_block"]["id"],
            &events[8].1["content_block"]["id"],
        );
        assert!(first.as_str().is_some_and(|id| id.starts_with("toolu_")) && first != second);
        assert_eq!(events[9].1["delta"]["partial_json"], "{}");
        assert_eq!(reply.calls().count(), 2);
    }
}
