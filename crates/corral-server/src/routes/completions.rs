//! `POST /v1/completions`: a text or token-id prompt continued as is, answered as one
//! `text_completion` or as a stream of them.

use std::convert::Infallible;

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::generation::{Generation, Step, unix_now};
use crate::error::ApiError;
use crate::extract::OpenAiJson;
use crate::output::{Delta, OutputParser};
use crate::request::{self, PromptInput};
use crate::state::AppState;

/// The handler.
pub(crate) async fn completions(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    OpenAiJson(body): OpenAiJson,
) -> Result<Response, ApiError> {
    let mut req = request::completion(&body, &state.config.sampling_defaults)?;
    req.settings = request::with_session_header(req.settings, &headers)?;
    super::check_model(&state, req.settings.model.as_deref())?;
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
    let parser = OutputParser::plain(req.settings.stop.clone());
    let generation = Generation::start(&state, prompt, &req.settings, parser, "prompt", "cmpl")?;
    let model = state.config.served_model_name.clone();
    if req.settings.stream {
        Ok(stream(generation, model, req.settings.include_usage).into_response())
    } else {
        Ok(Json(complete(generation, model).await?).into_response())
    }
}

fn text_of(deltas: Vec<Delta>) -> String {
    deltas
        .into_iter()
        .filter_map(|d| match d {
            Delta::Content(t) | Delta::Reasoning(t) => Some(t),
            Delta::ToolCall { .. } | Delta::ToolCallName(_) | Delta::ToolCallArguments(_) => None,
        })
        .collect()
}

/// Legacy log-probabilities of the tokens of one step.
fn logprobs_json(g: &Generation, tokens: &[corral_engine::TokenEvent]) -> Value {
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

fn body(id: &str, model: &str, text: String, logprobs: Value, finish: Value) -> Value {
    json!({
        "id": id,
        "object": "text_completion",
        "created": unix_now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    })
}

async fn complete(mut g: Generation, model: String) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    loop {
        match g.next().await? {
            Some(Step::Deltas { deltas, logprobs }) => {
                text.push_str(&text_of(deltas));
                tokens.extend(logprobs);
            }
            Some(Step::Finished {
                deltas,
                finish_reason,
                usage,
                timings,
            }) => {
                text.push_str(&text_of(deltas));
                let mut out = body(
                    g.id(),
                    &model,
                    text,
                    logprobs_json(&g, &tokens),
                    json!(finish_reason),
                );
                out["usage"] = usage;
                out["timings"] = timings;
                return Ok(out);
            }
            None => return Err(ApiError::internal("generation ended without a result")),
        }
    }
}

fn stream(
    generation: Generation,
    model: String,
    include_usage: bool,
) -> Sse<impl futures_util::Stream<Item = Result<SseEvent, Infallible>>> {
    let id = generation.id().to_string();
    let state = (Some(generation), Vec::<SseEvent>::new());
    let events = futures_util::stream::unfold(state, move |(mut g, mut pending)| {
        let (id, model) = (id.clone(), model.clone());
        async move {
            loop {
                if !pending.is_empty() {
                    let event = pending.remove(0);
                    return Some((Ok(event), (g, pending)));
                }
                let gen_ref = g.as_mut()?;
                let data = |v: Value| SseEvent::default().data(v.to_string());
                match gen_ref.next().await {
                    Ok(Some(Step::Deltas { deltas, logprobs })) => {
                        // A chunk for every token, empty when its text is held back.
                        let text = text_of(deltas);
                        let lps = logprobs_json(gen_ref, &logprobs);
                        pending.push(data(body(&id, &model, text, lps, Value::Null)));
                    }
                    Ok(Some(Step::Finished {
                        deltas,
                        finish_reason,
                        usage,
                        timings,
                    })) => {
                        pending.push(data(body(
                            &id,
                            &model,
                            text_of(deltas),
                            Value::Null,
                            json!(finish_reason),
                        )));
                        if include_usage {
                            let mut last =
                                body(&id, &model, String::new(), Value::Null, Value::Null);
                            last["choices"] = json!([]);
                            last["usage"] = usage;
                            last["timings"] = timings;
                            pending.push(data(last));
                        }
                        pending.push(SseEvent::default().data("[DONE]"));
                        g = None;
                    }
                    Ok(None) => g = None,
                    Err(e) => {
                        pending.push(data(e.body()));
                        pending.push(SseEvent::default().data("[DONE]"));
                        g = None;
                    }
                }
            }
        }
    });
    Sse::new(events).keep_alive(KeepAlive::default())
}
