//! `POST /v1/chat/completions`: the conversation is rendered with the checkpoint's chat
//! template, generated, and answered as one `chat.completion` or as a stream of
//! `chat.completion.chunk` server-sent events.

use axum::extract::State;
use axum::response::Response;
use corral_engine::TokenEvent;
use serde_json::{Value, json};

use crate::driver::{
    self, Call, End, Frame, Generation, Part, Render, Reply, ReplyEvent, unix_now,
};
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::state::AppState;
use crate::{prompt, request};

/// The handler.
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let mut req = request::openai::chat(&body, &state.config.sampling_defaults)?;
    request::with_session_header(&mut req.generate, &headers)?;
    super::check_model(&state, req.generate.model.as_deref())?;
    let (prompt, parser) = prompt::prepare(&state, &mut req, "messages").await?;
    let g = Generation::start(
        &state,
        prompt,
        &req.generate,
        parser,
        "messages",
        "chatcmpl",
    )?;
    let render = ChatRender {
        id: g.id().to_string(),
        model: state.config.served_model_name.clone(),
        created: unix_now(),
        include_usage: req.generate.include_usage,
    };
    driver::respond(g, Reply::new("call"), render, req.generate.stream).await
}

/// A log-probability entry of chat's `logprobs.content`.
fn logprob_entry(g: &Generation, token: &TokenEvent) -> Value {
    json!({
        "token": g.token_text(token.id),
        "logprob": token.logprob,
        "bytes": g.token_bytes(token.id),
        "top_logprobs": token.top_logprobs.iter().map(|(id, lp)| {
            json!({"token": g.token_text(*id), "logprob": lp, "bytes": g.token_bytes(*id)})
        }).collect::<Vec<_>>(),
    })
}

/// Chat's `logprobs` object for `tokens` (null for none).
fn logprobs_json(g: &Generation, tokens: &[TokenEvent]) -> Value {
    if tokens.is_empty() {
        return Value::Null;
    }
    json!({"content": tokens.iter().map(|t| logprob_entry(g, t)).collect::<Vec<_>>()})
}

/// A tool call as chat writes one; `index` only in a stream's chunks.
fn tool_call_json(call: &Call, index: Option<usize>, arguments: &str) -> Value {
    let mut json = json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": arguments},
    });
    if let Some(index) = index {
        json["index"] = json!(index);
    }
    json
}

/// A streamed call's next argument piece, joined to the chunk's last entry where that is the
/// same call (one entry a call a chunk, as OpenAI sends them).
fn add_arguments(calls: &mut Vec<Value>, index: usize, more: &str) {
    if let Some(last) = calls.last_mut()
        && last["index"] == json!(index)
        && let Some(Value::String(arguments)) = last.pointer_mut("/function/arguments")
    {
        arguments.push_str(more);
        return;
    }
    calls.push(json!({"index": index, "function": {"arguments": more}}));
}

/// The chat completion wire format.
struct ChatRender {
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
}

impl ChatRender {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Value) -> Frame {
        Frame::Data(json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }))
    }

    /// A chunk's `delta` for a step's events; `None` when they add nothing.
    fn delta(reply: &Reply, events: &[ReplyEvent]) -> Option<Value> {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut calls: Vec<Value> = Vec::new();
        for event in events {
            match event {
                ReplyEvent::More(Part::Text, t) => content.push_str(t),
                ReplyEvent::More(Part::Reasoning, t) => reasoning.push_str(t),
                ReplyEvent::Open(Part::Call(i)) => {
                    calls.push(tool_call_json(reply.call(*i), Some(*i), ""))
                }
                ReplyEvent::More(Part::Call(i), more) => add_arguments(&mut calls, *i, more),
                ReplyEvent::Open(_) | ReplyEvent::Close(_) => {}
            }
        }
        let mut delta = serde_json::Map::new();
        if !content.is_empty() {
            delta.insert("content".into(), json!(content));
        }
        if !reasoning.is_empty() {
            // Both names clients read (vLLM's older and newer).
            delta.insert("reasoning_content".into(), json!(reasoning));
            delta.insert("reasoning".into(), json!(reasoning));
        }
        if !calls.is_empty() {
            delta.insert("tool_calls".into(), json!(calls));
        }
        (!delta.is_empty()).then_some(Value::Object(delta))
    }
}

impl Render for ChatRender {
    fn opening(&mut self, _g: &Generation) -> Vec<Frame> {
        vec![self.chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
            Value::Null,
        )]
    }

    fn step(
        &mut self,
        g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        logprobs: &[TokenEvent],
    ) -> Vec<Frame> {
        // A chunk for every step, empty when its text is held back (an incomplete
        // character, a possible stop string or tool call), so that clients can time tokens.
        let delta = Self::delta(reply, events).unwrap_or_else(|| json!({"content": ""}));
        vec![self.chunk(delta, logprobs_json(g, logprobs), Value::Null)]
    }

    fn ending(
        &mut self,
        _g: &Generation,
        reply: &Reply,
        events: &[ReplyEvent],
        end: &End,
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        if let Some(delta) = Self::delta(reply, events) {
            frames.push(self.chunk(delta, Value::Null, Value::Null));
        }
        frames.push(self.chunk(json!({}), Value::Null, json!(end.finish.openai())));
        if self.include_usage {
            frames.push(Frame::Data(json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": end.usage.openai(),
                "timings": end.timings,
            })));
        }
        frames.push(Frame::Done);
        frames
    }

    fn failure(&mut self, _g: &Generation, _reply: &Reply, error: &ApiError) -> Vec<Frame> {
        vec![Frame::Data(error.body()), Frame::Done]
    }

    fn body(&mut self, g: &Generation, reply: &Reply, end: &End) -> Value {
        let mut message = json!({"role": "assistant", "content": reply.text});
        if !reply.reasoning.is_empty() {
            message["reasoning_content"] = json!(reply.reasoning);
            message["reasoning"] = json!(reply.reasoning);
        }
        let calls: Vec<Value> = reply
            .calls()
            .map(|c| tool_call_json(c, None, &c.arguments))
            .collect();
        if !calls.is_empty() {
            message["tool_calls"] = json!(calls);
            if reply.text.is_empty() {
                message["content"] = Value::Null;
            }
        }
        json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs_json(g, &reply.logprobs),
                "finish_reason": end.finish.openai()}],
            "usage": end.usage.openai(),
            "timings": end.timings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::Delta;

    fn render() -> ChatRender {
        ChatRender {
            id: "chatcmpl-1".into(),
            model: "tiny".into(),
            created: 0,
            include_usage: false,
        }
    }

    /// The `tool_calls` of the one chunk a step sends.
    fn step_calls(
        r: &mut ChatRender,
        g: &Generation,
        reply: &mut Reply,
        deltas: Vec<Delta>,
    ) -> Value {
        let events = reply.push(deltas);
        let frames = r.step(g, reply, &events, &[]);
        let [Frame::Data(chunk)] = frames.as_slice() else {
            panic!("{frames:?}")
        };
        chunk["choices"][0]["delta"]["tool_calls"].clone()
    }

    /// Streamed tool calls go out as OpenAI streams them: the first chunk of a call has its
    /// index, id, type and name with empty arguments; later chunks add arguments under the
    /// same index; a call written within one step comes whole; the next call takes the next
    /// index.
    #[test]
    fn streamed_tool_calls_open_with_the_name_then_add_arguments() {
        let g = Generation::fed("", "");
        let (mut r, mut reply) = (render(), Reply::new("call"));
        let first = step_calls(
            &mut r,
            &g,
            &mut reply,
            vec![
                Delta::Content("ok".into()),
                Delta::ToolCallName("f".into()),
                Delta::ToolCallArguments("{\"a\":".into()),
                Delta::ToolCallArguments("\"x".into()),
            ],
        );
        assert_eq!(first.as_array().map(Vec::len), Some(1), "{first}");
        assert_eq!(first[0]["index"], 0);
        assert_eq!(first[0]["type"], "function");
        assert!(
            first[0]["id"]
                .as_str()
                .is_some_and(|id| id.starts_with("call_"))
        );
        assert_eq!(
            first[0]["function"],
            json!({"name": "f", "arguments": "{\"a\":\"x"})
        );
        let more = step_calls(
            &mut r,
            &g,
            &mut reply,
            vec![
                Delta::ToolCallArguments("\"}".into()),
                Delta::ToolCall {
                    name: "f".into(),
                    arguments: "{\"a\":\"x\"}".into(),
                },
            ],
        );
        assert_eq!(
            more,
            json!([{"index": 0, "function": {"arguments": "\"}"}}])
        );
        let whole = step_calls(
            &mut r,
            &g,
            &mut reply,
            vec![Delta::ToolCall {
                name: "g".into(),
                arguments: "{}".into(),
            }],
        );
        assert_eq!(whole[0]["index"], 1);
        assert_eq!(
            whole[0]["function"],
            json!({"name": "g", "arguments": "{}"})
        );
        assert_eq!(reply.calls().count(), 2);
    }

    /// A reply's reasoning comes back under both names clients read.
    #[tokio::test(flavor = "current_thread")]
    async fn reasoning_is_returned_as_reasoning_content_and_reasoning() {
        let g = Generation::fed("<think>plan it</think>The answer.", "");
        let response = driver::respond(g, Reply::new("call"), render(), false)
            .await
            .unwrap();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        let message = &body["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "plan it", "{body}");
        assert_eq!(message["reasoning"], "plan it", "{body}");
        assert_eq!(message["content"], "The answer.", "{body}");
    }
}
