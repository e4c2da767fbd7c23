//! Decoding OpenAI's Responses bodies (`/v1/responses`) into Corral's chat request: input
//! items (messages, `function_call`, `function_call_output`), `instructions`, function
//! tools, `text.format` and `reasoning.effort`, after the stored conversation a
//! `previous_response_id` continues. A bad field is named as the Responses API names it.

use corral_engine::{Grammar, SamplingDefaults};
use serde_json::{Map, Value, json};

use super::fields::{Fields, describe, flat_tool, string_in, warn_ignored, wrong};
use super::{
    ChatRequest, Conversation, GenerateRequest, Message, Role, ToolCall, ToolChoice,
    apply_reasoning_effort, session_of,
};
use crate::error::ApiError;

/// The fields this API defines that Corral reads; others are logged as not acted on.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "max_output_tokens",
    "user",
    "stream",
    "previous_response_id",
    "store",
    "reasoning",
    "text",
    "parallel_tool_calls",
];
/// Its sampling fields.
const SAMPLING: &[&str] = &["temperature", "top_p"];

/// The text of a string or of a list of `input_text` / `output_text` / `text` parts.
fn item_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => {
                        text.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""))
                    }
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{j}]"),
                            format!(
                                "only text parts are supported, got {}",
                                other.unwrap_or("a part without a type")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        other => Err(wrong(param, "text or a list of text parts", other)),
    }
}

/// The messages of `input` (a string or a list of items).
fn input_messages(input: &Value) -> Result<Vec<Message>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![Message::text(Role::User, s.as_str())]),
        Value::Array(items) => items,
        other => {
            return Err(ApiError::invalid(
                "input",
                format!(
                    "`input` must be a string or a list of items, got {}",
                    describe(other)
                ),
            ));
        }
    };
    let mut messages: Vec<Message> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let param = format!("input[{i}]");
        match item.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = match item.get("role").and_then(Value::as_str) {
                    None | Some("user") => Role::User,
                    Some("assistant") => Role::Assistant,
                    Some("system" | "developer") => Role::System,
                    Some(other) => {
                        return Err(ApiError::invalid(
                            &format!("{param}.role"),
                            format!(
                                "`role` must be user, assistant, system or developer, got `{other}`"
                            ),
                        ));
                    }
                };
                let content = item_text(
                    item.get("content").unwrap_or(&Value::Null),
                    &format!("{param}.content"),
                )?;
                messages.push(Message::text(role, content));
            }
            Some("function_call") => {
                let name = string_in(item, "name", &param)?.ok_or_else(|| {
                    ApiError::invalid(&format!("{param}.name"), "a `function_call` needs a `name`")
                })?;
                let arguments = string_in(item, "arguments", &param)?;
                let call = ToolCall::from_text(
                    string_in(item, "call_id", &param)?,
                    name,
                    arguments.as_deref().unwrap_or("{}"),
                );
                // Calls join the assistant message right before them, as one turn.
                match messages.last_mut() {
                    Some(last) if last.role == Role::Assistant => last.tool_calls.push(call),
                    _ => {
                        let mut turn = Message::text(Role::Assistant, "");
                        turn.tool_calls.push(call);
                        messages.push(turn);
                    }
                }
            }
            Some("function_call_output") => {
                let output = item_text(
                    item.get("output").unwrap_or(&Value::Null),
                    &format!("{param}.output"),
                )?;
                let mut result = Message::text(Role::Tool, output);
                result.tool_call_id = string_in(item, "call_id", &param)?;
                messages.push(result);
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

/// `text.format`: `{"type": "text" | "json_object"}` or `{"type": "json_schema", "schema"}`.
fn text_format(f: &Fields) -> Result<Option<Grammar>, ApiError> {
    let Some(text) = f.object("text")? else {
        return Ok(None);
    };
    let Some(format) = Fields(text).object("format").map_err(|_| {
        ApiError::invalid(
            "text.format",
            "`text.format` must be an object with a `type`",
        )
    })?
    else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(json!({"type": "object"})))),
        Some("json_schema") => match format.get("schema") {
            None | Some(Value::Null) => Ok(Some(Grammar::JsonSchema(json!({"type": "object"})))),
            Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema.clone()))),
            Some(_) => Err(ApiError::invalid(
                "text.format.schema",
                "`text.format.schema` must be a JSON schema object",
            )),
        },
        _ => Err(ApiError::invalid(
            "text.format.type",
            "`text.format.type` must be text, json_object or json_schema",
        )),
    }
}

/// Decodes a Responses body continuing `history` (the stored conversation of its
/// `previous_response_id`). `instructions` come first and hold for this response alone.
pub(crate) fn decode(
    body: &Map<String, Value>,
    history: Vec<Message>,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, ApiError> {
    let f = Fields(body);
    f.warn_unread(&[FIELDS, SAMPLING]);
    let generate = GenerateRequest {
        model: f.string("model")?,
        sampling: f.sampling(SAMPLING, defaults)?,
        max_tokens: f.max_tokens(&["max_output_tokens"])?,
        stop: Vec::new(),
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: false,
        top_logprobs: None,
        skip_special_tokens: true,
        session: session_of(f.string("user")?),
        grammar: text_format(&f)?.map(|g| (g, "text.format")),
    };
    f.boolean("store")?;
    let mut messages = Vec::new();
    if let Some(instructions) = f.string("instructions")? {
        messages.push(Message::text(Role::System, instructions));
    }
    messages.extend(history);
    let input = f
        .get("input")
        .ok_or_else(|| ApiError::invalid("input", "`input` is required"))?;
    messages.extend(input_messages(input)?);
    let tools = f
        .array("tools")?
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, t)| t.get("type").and_then(Value::as_str) == Some("function"))
        .map(|(i, t)| flat_tool(t, i, "parameters"))
        .collect::<Result<Vec<_>, ApiError>>()?;
    // Choices of built-in tools (file search, ...) and allowed-tool lists are not held.
    let tool_choice = match f.get("tool_choice") {
        Some(choice @ Value::String(_)) => super::openai::tool_choice(Some(choice))?,
        Some(choice) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            super::openai::tool_choice(Some(choice))?
        }
        Some(other) => {
            warn_ignored(&[format!("tool_choice {other}")]);
            ToolChoice::Auto
        }
        None => ToolChoice::Auto,
    };
    let mut template_kwargs = Map::new();
    let effort = match f.object("reasoning")? {
        Some(reasoning) => Fields(reasoning).string("effort").map_err(|_| {
            ApiError::invalid("reasoning.effort", "`reasoning.effort` must be a string")
        })?,
        None => None,
    };
    apply_reasoning_effort(effort.as_deref(), "reasoning.effort", &mut template_kwargs)?;
    let parallel_tool_calls = f.boolean("parallel_tool_calls")?.unwrap_or(true);
    Ok(ChatRequest {
        generate,
        conversation: Conversation::new(
            messages,
            tools,
            tool_choice,
            parallel_tool_calls,
            template_kwargs,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decoded(body: Value) -> Result<ChatRequest, ApiError> {
        decode(
            body.as_object().unwrap(),
            Vec::new(),
            &SamplingDefaults::default(),
        )
    }

    /// Items become the conversation: calls join the assistant turn before them, their
    /// outputs are tool messages, `instructions` come first.
    #[test]
    fn items_become_the_conversation() {
        let r = decoded(json!({"instructions": "Be brief.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "12 C"},
        ], "max_output_tokens": 9, "text": {"format": {"type": "json_object"}}}))
        .unwrap();
        let said: Vec<Value> = r
            .conversation
            .messages
            .iter()
            .map(Message::to_template)
            .collect();
        assert_eq!(
            said,
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather?"}),
                json!({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "get", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "12 C", "tool_call_id": "c1"}),
            ]
        );
        assert_eq!(r.generate.max_tokens, Some(9));
        assert_eq!(r.generate.grammar.map(|g| g.1), Some("text.format"));
    }

    /// Each bad field is named as the Responses API names it.
    #[test]
    fn bad_fields_are_named_in_responses_terms() {
        for (body, param) in [
            (
                json!({"input": "x", "max_output_tokens": 0}),
                "max_output_tokens",
            ),
            (json!({"input": 5}), "input"),
            (json!({"input": [{"type": "image"}]}), "input[0]"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input[0].content[0]",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
                "text.format.type",
            ),
            (
                json!({"input": "x", "reasoning": {"effort": "max"}}),
                "reasoning.effort",
            ),
            (
                json!({"input": "x", "tools": [{"type": "function"}]}),
                "tools[0].name",
            ),
            (json!({"input": "x", "store": "yes"}), "store"),
            (json!({}), "input"),
        ] {
            let err = decoded(body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err:?}");
        }
    }
}
