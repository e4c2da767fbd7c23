//! `POST /v1/chat/completions`: the conversation is rendered with the checkpoint's chat
//! template, generated, and answered as one `chat.completion` or as a stream of
//! `chat.completion.chunk` server-sent events.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use corral_engine::TokenEvent;
use serde_json::{Value, json};

use super::generation::{Generation, Step, response_id, unix_now};
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::grammar::{self, ToolChoice};
use crate::output::{Delta, OutputParser};
use crate::request;
use crate::state::AppState;

/// A conversation's prompt, rendered with the chat template and tokenized off the runtime
/// (CPU work for a large conversation), and the parser of its reply (opened in reasoning
/// when the prompt ends in `<think>`). The request's grammar becomes the whole reply's: a
/// tool call where `tool_choice` demands one, after the reasoning the prompt opened. Errors
/// in the conversation are reported under `param`, the API's name for it.
pub(crate) async fn prepare(
    state: &AppState,
    req: &mut request::ChatRequest,
    param: &'static str,
) -> Result<(Vec<u32>, OutputParser), ApiError> {
    let template = state.chat_template.clone().ok_or_else(|| {
        ApiError::invalid(
            param,
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let syntax = state.syntax;
    for (key, value) in &state.config.chat_template_kwargs {
        req.template_kwargs
            .entry(key.clone())
            .or_insert_with(|| value.clone());
    }
    let tokenizer = Arc::clone(&state.tokenizer);
    let (messages, tools, kwargs) = (
        req.messages.clone(),
        req.tools.clone(),
        req.template_kwargs.clone(),
    );
    let (prompt, in_reasoning) = tokio::task::spawn_blocking(move || {
        let text = template
            .render(&messages, tools.as_deref(), true, &kwargs)
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
        let ids = tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(param, e.to_string()))?;
        Ok::<_, ApiError>((ids, text.trim_end().ends_with(syntax.reasoning.open)))
    })
    .await
    .map_err(|e| ApiError::internal(format!("prompt preparation failed: {e}")))??;
    let special = |text: &str| {
        state
            .grammars
            .as_ref()
            .is_ok_and(|g| g.is_special_token(text))
    };
    if let (ToolChoice::Required | ToolChoice::Named(_), Some(tools)) =
        (&req.tool_choice, &req.tools)
    {
        let only = match &req.tool_choice {
            ToolChoice::Named(name) => Some(name.as_str()),
            _ => None,
        };
        req.settings.grammar_param = "tool_choice";
        req.settings.grammar = Some(grammar::tool_calls(
            tools,
            only,
            syntax,
            req.parallel_tool_calls,
            &special,
        )?);
    }
    if in_reasoning {
        req.settings.grammar = req
            .settings
            .grammar
            .take()
            .map(|g| grammar::after_reasoning(g, syntax, &special));
    }
    let parser = OutputParser::new(
        syntax,
        in_reasoning,
        req.settings.stop.clone(),
        req.tools.is_some(),
    )
    .with_tool_schemas(req.tools.as_deref().unwrap_or(&[]))
    .streaming_tool_calls(req.settings.stream);
    Ok((prompt, parser))
}

/// The handler.
pub(crate) async fn chat_completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    let mut req = request::chat(&body, &state.config.sampling_defaults)?;
    req.settings = request::with_session_header(req.settings, &headers)?;
    super::check_model(&state, req.settings.model.as_deref())?;
    let (prompt, parser) = prepare(&state, &mut req, "messages").await?;
    let generation = Generation::start(
        &state,
        prompt,
        &req.settings,
        parser,
        "messages",
        "chatcmpl",
    )?;
    let model = state.config.served_model_name.clone();
    if req.settings.stream {
        Ok(stream(generation, model, req.settings.include_usage).into_response())
    } else {
        Ok(Json(complete(generation, model).await?).into_response())
    }
}

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

fn tool_call_json(index: usize, name: &str, arguments: &str) -> Value {
    json!({
        "index": index,
        "id": format!("call_{}", response_id("t")),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// Accumulates a whole response.
async fn complete(mut g: Generation, model: String) -> Result<Value, ApiError> {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut tool_calls = Vec::new();
    let mut logprobs = Vec::new();
    let mut add = |deltas: Vec<Delta>, tool_calls: &mut Vec<Value>| {
        for d in deltas {
            match d {
                Delta::Content(t) => content.push_str(&t),
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::ToolCall { name, arguments } => {
                    let call = tool_call_json(tool_calls.len(), &name, &arguments);
                    tool_calls.push(call);
                }
                // Only a streamed response's parser streams calls.
                Delta::ToolCallName(_) | Delta::ToolCallArguments(_) => {}
            }
        }
    };
    loop {
        match g.next().await? {
            Some(Step::Deltas {
                deltas,
                logprobs: lps,
            }) => {
                add(deltas, &mut tool_calls);
                logprobs.extend(lps.iter().map(|t| logprob_entry(&g, t)));
            }
            Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                timings,
            }) => {
                add(deltas, &mut tool_calls);
                let mut message = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    // Both names clients read (vLLM's older and newer).
                    message["reasoning_content"] = json!(reasoning);
                    message["reasoning"] = json!(reasoning);
                }
                if !tool_calls.is_empty() {
                    for call in &mut tool_calls {
                        if let Some(o) = call.as_object_mut() {
                            o.remove("index");
                        }
                    }
                    message["tool_calls"] = json!(tool_calls);
                    if content.is_empty() {
                        message["content"] = Value::Null;
                    }
                }
                let logprobs = if logprobs.is_empty() {
                    Value::Null
                } else {
                    json!({"content": logprobs})
                };
                return Ok(json!({
                    "id": g.id(),
                    "object": "chat.completion",
                    "created": unix_now(),
                    "model": model,
                    "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
                    "usage": usage,
                    "timings": timings,
                }));
            }
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

/// One chunk of the stream.
fn chunk(
    id: &str,
    model: &str,
    created: u64,
    delta: Value,
    logprobs: Value,
    finish: Value,
) -> SseEvent {
    let body = json!({
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
    });
    SseEvent::default().data(body.to_string())
}

struct StreamState {
    generation: Option<Generation>,
    pending: VecDeque<SseEvent>,
    id: String,
    model: String,
    created: u64,
    include_usage: bool,
    tool_calls: usize,
    /// Whether the call at index `tool_calls` has been opened by its name.
    call_open: bool,
}

impl StreamState {
    fn delta_json(&mut self, deltas: Vec<Delta>) -> Option<Value> {
        let (mut content, mut reasoning) = (String::new(), String::new());
        let mut calls: Vec<Value> = Vec::new();
        for d in deltas {
            match d {
                Delta::Content(t) => content.push_str(&t),
                Delta::Reasoning(t) => reasoning.push_str(&t),
                Delta::ToolCallName(name) => {
                    calls.push(tool_call_json(self.tool_calls, &name, ""));
                    self.call_open = true;
                }
                Delta::ToolCallArguments(more) => add_arguments(&mut calls, self.tool_calls, &more),
                Delta::ToolCall { name, arguments } => {
                    if !std::mem::take(&mut self.call_open) {
                        calls.push(tool_call_json(self.tool_calls, &name, &arguments));
                    }
                    self.tool_calls += 1;
                }
            }
        }
        let mut delta = serde_json::Map::new();
        if !content.is_empty() {
            delta.insert("content".into(), json!(content));
        }
        if !reasoning.is_empty() {
            delta.insert("reasoning_content".into(), json!(reasoning));
            delta.insert("reasoning".into(), json!(reasoning));
        }
        if !calls.is_empty() {
            delta.insert("tool_calls".into(), json!(calls));
        }
        (!delta.is_empty()).then_some(Value::Object(delta))
    }

    /// Queues the events of the next step; false at the end.
    async fn advance(&mut self) -> bool {
        let Some(g) = self.generation.as_mut() else {
            return false;
        };
        match g.next().await {
            Ok(Some(Step::Deltas { deltas, logprobs })) => {
                let lps: Vec<Value> = logprobs.iter().map(|t| logprob_entry(g, t)).collect();
                // A chunk for every token, empty when its text is held back (an incomplete
                // character, a possible stop string or tool call), so that clients can time
                // tokens.
                let lps = if lps.is_empty() {
                    Value::Null
                } else {
                    json!({"content": lps})
                };
                let delta = self
                    .delta_json(deltas)
                    .unwrap_or_else(|| json!({"content": ""}));
                self.pending.push_back(chunk(
                    &self.id,
                    &self.model,
                    self.created,
                    delta,
                    lps,
                    Value::Null,
                ));
            }
            Ok(Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                timings,
            })) => {
                if let Some(delta) = self.delta_json(deltas) {
                    self.pending.push_back(chunk(
                        &self.id,
                        &self.model,
                        self.created,
                        delta,
                        Value::Null,
                        Value::Null,
                    ));
                }
                self.pending.push_back(chunk(
                    &self.id,
                    &self.model,
                    self.created,
                    json!({}),
                    Value::Null,
                    json!(finish_reason),
                ));
                if self.include_usage {
                    let body = json!({
                        "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "choices": [], "usage": usage, "timings": timings,
                    });
                    self.pending
                        .push_back(SseEvent::default().data(body.to_string()));
                }
                self.pending.push_back(SseEvent::default().data("[DONE]"));
                self.generation = None;
            }
            Ok(None) => self.generation = None,
            Err(e) => {
                self.pending
                    .push_back(SseEvent::default().data(e.body().to_string()));
                self.pending.push_back(SseEvent::default().data("[DONE]"));
                self.generation = None;
            }
        }
        true
    }
}

fn stream(
    generation: Generation,
    model: String,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let mut state = StreamState {
        id: generation.id().to_string(),
        generation: Some(generation),
        pending: VecDeque::new(),
        model,
        created: unix_now(),
        include_usage,
        tool_calls: 0,
        call_open: false,
    };
    state.pending.push_back(chunk(
        &state.id,
        &state.model,
        state.created,
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        Value::Null,
    ));
    let events = futures_util::stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.pending.pop_front() {
                return Some((Ok(event), state));
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

    /// Streamed tool calls go out as OpenAI streams them: the first chunk of a call has its
    /// index, id, type and name with empty arguments; later chunks add arguments under the
    /// same index; a call written within one step comes whole; the next call takes the next
    /// index.
    #[test]
    fn streamed_tool_calls_open_with_the_name_then_add_arguments() {
        let mut state = StreamState {
            generation: None,
            pending: VecDeque::new(),
            id: "chatcmpl-1".into(),
            model: "tiny".into(),
            created: 0,
            include_usage: false,
            tool_calls: 0,
            call_open: false,
        };
        let call = |d: Option<Value>| d.expect("a delta")["tool_calls"].clone();
        let first = call(state.delta_json(vec![
            Delta::Content("ok".into()),
            Delta::ToolCallName("f".into()),
            Delta::ToolCallArguments("{\"a\":".into()),
            Delta::ToolCallArguments("\"x".into()),
        ]));
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
        let more = call(state.delta_json(vec![
            Delta::ToolCallArguments("\"}".into()),
            Delta::ToolCall {
                name: "f".into(),
                arguments: "{\"a\":\"x\"}".into(),
            },
        ]));
        assert_eq!(
            more,
            json!([{"index": 0, "function": {"arguments": "\"}"}}])
        );
        let whole = call(state.delta_json(vec![Delta::ToolCall {
            name: "g".into(),
            arguments: "{}".into(),
        }]));
        assert_eq!(whole[0]["index"], 1);
        assert_eq!(
            whole[0]["function"],
            json!({"name": "g", "arguments": "{}"})
        );
        assert_eq!(state.tool_calls, 2);
    }

    /// A reply's reasoning comes back under both names clients read.
    #[tokio::test(flavor = "current_thread")]
    async fn reasoning_is_returned_as_reasoning_content_and_reasoning() {
        let g = Generation::fed("<think>plan it</think>The answer.", "");
        let body = complete(g, "tiny".to_string()).await.unwrap();
        let message = &body["choices"][0]["message"];
        assert_eq!(message["reasoning_content"], "plan it", "{body}");
        assert_eq!(message["reasoning"], "plan it", "{body}");
        assert_eq!(message["content"], "The answer.", "{body}");
    }
}
