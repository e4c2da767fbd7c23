//! `POST /tokenize` and `POST /detokenize`, as vLLM and llama.cpp's server name them: text
//! (`prompt`, or llama.cpp's `content`) or a conversation (`messages`, rendered with the chat
//! template as a chat completion would be) to token ids, and ids back to text.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::extract::JsonBody;
use crate::request;
use crate::state::AppState;

/// `POST /tokenize`: `{"tokens": [...], "count": n, "max_model_len": context}`.
pub(crate) async fn tokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let model = body.get("model").and_then(Value::as_str);
    super::check_model(&state, model)?;
    let text = match (
        body.get("prompt").or_else(|| body.get("content")),
        body.get("messages"),
    ) {
        (Some(Value::String(text)), None) => text.clone(),
        (None, Some(_)) => {
            // add_generation_prompt is this endpoint's, not a chat field.
            let mut as_chat = body.clone();
            as_chat.remove("add_generation_prompt");
            let chat =
                request::openai::chat(&as_chat, &state.config.sampling_defaults)?.conversation;
            let template = state
                .chat_template
                .clone()
                .ok_or_else(|| ApiError::invalid("messages", "this model has no chat template"))?;
            let add_generation_prompt = match body.get("add_generation_prompt") {
                None => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "add_generation_prompt",
                        "`add_generation_prompt` must be a boolean",
                    ));
                }
            };
            template
                .render(
                    &chat.template_messages(),
                    chat.template_tools().as_deref(),
                    add_generation_prompt,
                    &chat.template_kwargs,
                )
                .map_err(|e| ApiError::invalid("messages", e.to_string()))?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "send either `prompt` (or `content`) or `messages`, not both",
            ));
        }
        (Some(other), None) => {
            return Err(ApiError::invalid(
                "prompt",
                format!("`prompt` must be a string, got {other}"),
            ));
        }
        (None, None) => {
            return Err(ApiError::invalid(
                "prompt",
                "send `prompt` (or `content`) or `messages`",
            ));
        }
    };
    let tokenizer = Arc::clone(&state.tokenizer);
    let tokens = tokio::task::spawn_blocking(move || tokenizer.encode(&text))
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))?
        .map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
    Ok(Json(json!({
        "count": tokens.len(),
        "tokens": tokens,
        "max_model_len": state.config.max_context,
    })))
}

/// `POST /detokenize`: `{"tokens": [...]}` to `{"prompt": text, "content": text}`.
pub(crate) async fn detokenize(
    State(state): State<AppState>,
    JsonBody(body): JsonBody,
) -> Result<Json<Value>, ApiError> {
    let model = body.get("model").and_then(Value::as_str);
    super::check_model(&state, model)?;
    let Some(Value::Array(items)) = body.get("tokens") else {
        return Err(ApiError::invalid(
            "tokens",
            "`tokens` must be a list of token ids",
        ));
    };
    let vocab = state.config.vocab_size as u64;
    let ids: Vec<u32> = items
        .iter()
        .map(|v| v.as_u64().filter(|&id| id < vocab).map(|id| id as u32))
        .collect::<Option<_>>()
        .ok_or_else(|| {
            ApiError::invalid(
                "tokens",
                format!("every token must be an id below the vocabulary size {vocab}"),
            )
        })?;
    let text = state
        .tokenizer
        .decode(&ids)
        .map_err(|e| ApiError::invalid("tokens", e.to_string()))?;
    Ok(Json(json!({"prompt": text, "content": text})))
}
