//! `POST /v1/completions`: a text or token-id prompt continued as is, answered as one
//! `text_completion` or as a stream of them.

use axum::extract::State;
use axum::response::Response;
use corral_engine::TokenEvent;
use serde_json::{Value, json};

use crate::driver::{self, End, Frame, Generation, Part, Render, Reply, ReplyEvent, unix_now};
use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::output::OutputParser;
use crate::request::{self, PromptInput};
use crate::state::AppState;

/// The handler.
pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    JsonBody(body): JsonBody,
) -> Result<Response, ApiError> {
    let mut req = request::openai::completion(&body, &state.config.sampling_defaults)?;
    request::with_session_header(&mut req.generate, &headers)?;
    super::check_model(&state, req.generate.model.as_deref())?;
    let prompt = match req.prompt {
        PromptInput::Tokens(ids) => ids,
        PromptInput::Text(text) => {
            // Tokenizing is CPU work: keep it off the runtime.
            let tokenizer = std::sync::Arc::clone(&state.tokenizer);
            tokio::task::spawn_blocking(move || tokenizer.encode(&text))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
                .map_err(|e| ApiError::invalid("prompt", e.to_string()))?
        }
    };
    let parser = OutputParser::plain(req.generate.stop.clone());
    let g = Generation::start(&state, prompt, &req.generate, parser, "prompt", "cmpl")?;
    let render = CompletionRender {
        id: g.id().to_string(),
        model: state.config.served_model_name.clone(),
        include_usage: req.generate.include_usage,
    };
    driver::respond(g, Reply::new("call"), render, req.generate.stream).await
}

/// The text a step's events add.
fn text_of(events: &[ReplyEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            ReplyEvent::More(Part::Text | Part::Reasoning, t) => Some(t.as_str()),
            _ => None,
        })
        .collect()
}

/// Legacy log-probabilities of `tokens` (null for none).
fn logprobs_json(g: &Generation, tokens: &[TokenEvent]) -> Value {
    if tokens.is_empty() {
        return Value::Null;
    }
    json!({
        "tokens": tokens.iter().map(|t| g.token_text(t.id)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| {
            t.top_logprobs.iter().map(|(id, lp)| (g.token_text(*id), json!(lp))).collect::<serde_json::Map<_, _>>()
        }).collect::<Vec<_>>(),
    })
}

/// The text completion wire format.
struct CompletionRender {
    id: String,
    model: String,
    include_usage: bool,
}

impl CompletionRender {
    fn completion(&self, text: &str, logprobs: Value, finish: Value) -> Value {
        json!({
            "id": self.id,
            "object": "text_completion",
            "created": unix_now(),
            "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        })
    }
}

impl Render for CompletionRender {
    fn step(
        &mut self,
        g: &Generation,
        _reply: &Reply,
        events: &[ReplyEvent],
        logprobs: &[TokenEvent],
    ) -> Vec<Frame> {
        // A chunk for every step, empty when its text is held back.
        let text = text_of(events);
        vec![Frame::Data(self.completion(
            &text,
            logprobs_json(g, logprobs),
            Value::Null,
        ))]
    }

    fn ending(
        &mut self,
        _g: &Generation,
        _reply: &Reply,
        events: &[ReplyEvent],
        end: &End,
    ) -> Vec<Frame> {
        let mut frames = vec![Frame::Data(self.completion(
            &text_of(events),
            Value::Null,
            json!(end.finish.openai()),
        ))];
        if self.include_usage {
            let mut last = self.completion("", Value::Null, Value::Null);
            last["choices"] = json!([]);
            last["usage"] = end.usage.openai();
            last["timings"] = end.timings.clone();
            frames.push(Frame::Data(last));
        }
        frames.push(Frame::Done);
        frames
    }

    fn failure(&mut self, _g: &Generation, _reply: &Reply, error: &ApiError) -> Vec<Frame> {
        vec![Frame::Data(error.body()), Frame::Done]
    }

    fn body(&mut self, g: &Generation, reply: &Reply, end: &End) -> Value {
        let text = format!("{}{}", reply.reasoning, reply.text);
        let mut out = self.completion(
            &text,
            logprobs_json(g, &reply.logprobs),
            json!(end.finish.openai()),
        );
        out["usage"] = end.usage.openai();
        out["timings"] = end.timings.clone();
        out
    }
}
