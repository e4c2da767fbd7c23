//! A conversation made into a prompt: rendered with the checkpoint's chat template and
//! tokenized off the runtime (CPU work for a large conversation), with the parser of its
//! reply (opened in the reasoning when the prompt ends in the syntax's reasoning tag) and
//! the grammar a demanded tool call needs.

use std::sync::Arc;

use crate::error::ApiError;
use crate::grammar;
use crate::output::OutputParser;
use crate::request::{ChatRequest, ToolChoice};
use crate::state::AppState;

/// The prompt's tokens and its reply's parser. The request's grammar becomes the whole
/// reply's: a tool call where `tool_choice` demands one, after the reasoning the prompt
/// opened. Errors in the conversation are reported under `param`, the API's name for it.
pub(crate) async fn prepare(
    state: &AppState,
    req: &mut ChatRequest,
    param: &'static str,
) -> Result<(Vec<u32>, OutputParser), ApiError> {
    let template = state.chat_template.clone().ok_or_else(|| {
        ApiError::invalid(
            param,
            "this model has no chat template; use /v1/completions",
        )
    })?;
    let syntax = state.syntax;
    let conversation = &mut req.conversation;
    for (key, value) in &state.config.chat_template_kwargs {
        conversation
            .template_kwargs
            .entry(key.clone())
            .or_insert_with(|| value.clone());
    }
    let tokenizer = Arc::clone(&state.tokenizer);
    let messages = conversation.template_messages();
    let tools = conversation.template_tools();
    let kwargs = conversation.template_kwargs.clone();
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
    let generate = &mut req.generate;
    let demanded = match &conversation.tool_choice {
        ToolChoice::Named(name) => Some(Some(name.as_str())),
        ToolChoice::Required => Some(None),
        ToolChoice::Auto | ToolChoice::None => None,
    };
    if let Some(only) = demanded {
        let calls = grammar::tool_calls(
            &conversation.tools,
            only,
            syntax,
            conversation.parallel_tool_calls,
            &special,
        )?;
        generate.grammar = Some((calls, "tool_choice"));
    }
    if in_reasoning {
        generate.grammar = generate
            .grammar
            .take()
            .map(|(g, param)| (grammar::after_reasoning(g, syntax, &special), param));
    }
    let parser = OutputParser::new(
        syntax,
        in_reasoning,
        generate.stop.clone(),
        !conversation.tools.is_empty(),
    )
    .with_tool_schemas(&conversation.tools)
    .streaming_tool_calls(generate.stream);
    Ok((prompt, parser))
}
