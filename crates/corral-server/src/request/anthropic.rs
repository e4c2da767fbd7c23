//! Decoding Anthropic's Messages bodies (`/v1/messages`, `/v1/messages/count_tokens`, as
//! Claude-Code-style clients send them) into Corral's chat request: system text, text,
//! `thinking`, `tool_use` and `tool_result` blocks, tools, tool choice and thinking on or
//! off. A bad field is named as Anthropic names it (`stop_sequences`, `messages[2].content[0]`).

use corral_engine::SamplingDefaults;
use serde_json::{Map, Value};

use super::fields::{Fields, describe, flat_tool, string_in, wrong};
use super::{
    ChatRequest, Conversation, GenerateRequest, Message, Role, ToolCall, ToolChoice, session_of,
};
use crate::error::ApiError;

/// The fields this API defines that Corral reads; others are logged as not acted on.
const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "stop_sequences",
    "stream",
    "metadata",
    "system",
    "messages",
    "tools",
    "tool_choice",
    "thinking",
];
/// Its sampling fields.
const SAMPLING: &[&str] = &["temperature", "top_p", "top_k"];
/// Most stop sequences accepted (a bound on the work of matching them).
const MAX_STOP_SEQUENCES: usize = 32;

/// The text of a string or of a list of `text` blocks (other blocks are refused).
fn block_text(content: &Value, param: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match b.get("type").and_then(Value::as_str) {
                    Some("text") => text_of(b, &format!("{param}[{j}]"), &mut text)?,
                    other => {
                        return Err(ApiError::invalid(
                            &format!("{param}[{j}]"),
                            format!(
                                "only text blocks are supported here, got {}",
                                other.unwrap_or("a block without a type")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Value::Null => Ok(String::new()),
        other => Err(wrong(param, "a string or a list of blocks", other)),
    }
}

/// Appends a text block's `text`.
fn text_of(block: &Value, param: &str, out: &mut String) -> Result<(), ApiError> {
    match block.get("text") {
        Some(Value::String(t)) => {
            out.push_str(t);
            Ok(())
        }
        None | Some(Value::Null) => Ok(()),
        Some(other) => Err(wrong(&format!("{param}.text"), "a string", other)),
    }
}

/// One message's blocks, appended to `messages` as the conversation ran: a user turn's tool
/// results before its own text.
fn message(m: &Value, i: usize, messages: &mut Vec<Message>) -> Result<(), ApiError> {
    let param = format!("messages[{i}]");
    let role = match m.get("role").and_then(Value::as_str) {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        // Claude Code sends system messages among the turns (environment facts, its
        // deferred tools); the chat template places them.
        Some("system") => Role::System,
        other => {
            return Err(ApiError::invalid(
                &format!("{param}.role"),
                format!(
                    "`role` must be user, assistant or system, got {}",
                    other.map_or_else(|| "none".to_string(), |r| format!("`{r}`"))
                ),
            ));
        }
    };
    let blocks = match m.get("content") {
        Some(Value::String(s)) => vec![serde_json::json!({"type": "text", "text": s})],
        Some(Value::Array(b)) => b.clone(),
        Some(other) => {
            return Err(ApiError::invalid(
                &format!("{param}.content"),
                format!(
                    "`content` must be a string or a list of blocks, got {}",
                    describe(other)
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                &format!("{param}.content"),
                "`content` is required",
            ));
        }
    };
    let mut turn = Message::text(role, "");
    let mut thinking = String::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{param}.content[{j}]");
        match (role, b.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => text_of(b, &at, turn.content.get_or_insert_default())?,
            (Role::Assistant, Some("thinking")) => {
                thinking.push_str(&string_in(b, "thinking", &at)?.unwrap_or_default())
            }
            (Role::Assistant, Some("redacted_thinking")) => {}
            (Role::Assistant, Some("tool_use")) => {
                let name = string_in(b, "name", &at)?.ok_or_else(|| {
                    ApiError::invalid(&format!("{at}.name"), "a `tool_use` block needs a `name`")
                })?;
                let arguments = match b.get("input") {
                    None | Some(Value::Null) => Value::Object(Map::new()),
                    Some(input @ Value::Object(_)) => input.clone(),
                    Some(other) => return Err(wrong(&format!("{at}.input"), "an object", other)),
                };
                turn.tool_calls.push(ToolCall {
                    id: string_in(b, "id", &at)?,
                    name,
                    arguments,
                });
            }
            (Role::User, Some("tool_result")) => {
                let content = block_text(
                    b.get("content").unwrap_or(&Value::Null),
                    &format!("{at}.content"),
                )?;
                let mut result = Message::text(Role::Tool, content);
                result.tool_call_id = string_in(b, "tool_use_id", &at)?;
                messages.push(result);
            }
            (_, other) => {
                return Err(ApiError::invalid(
                    &at,
                    format!(
                        "a {} block is not supported in a {} message",
                        other.unwrap_or("typeless"),
                        role.as_str()
                    ),
                ));
            }
        }
    }
    if !thinking.is_empty() {
        turn.reasoning = Some(thinking);
    }
    // A user turn of tool results only adds no empty user message.
    let empty_user = role == Role::User && turn.content.as_deref().is_none_or(str::is_empty);
    if !empty_user {
        messages.push(turn);
    }
    Ok(())
}

/// `tool_choice`: `{"type": "auto" | "any" | "none"}` or `{"type": "tool", "name"}`, and
/// whether parallel calls are allowed (`disable_parallel_tool_use`).
fn tool_choice(f: &Fields) -> Result<(ToolChoice, bool), ApiError> {
    let Some(choice) = f.object("tool_choice")? else {
        return Ok((ToolChoice::Auto, true));
    };
    let c = Fields(choice);
    let kind = match c.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        _ => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                "`tool_choice.type` must be auto, any, tool or none",
            ));
        }
    };
    let choice = match kind {
        "auto" => ToolChoice::Auto,
        "none" => ToolChoice::None,
        "any" => ToolChoice::Required,
        "tool" => match c.get("name") {
            Some(Value::String(name)) => ToolChoice::Named(name.clone()),
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice.name",
                    "`tool_choice` of type tool needs the tool's `name`",
                ));
            }
        },
        other => {
            return Err(ApiError::invalid(
                "tool_choice.type",
                format!("`tool_choice.type` must be auto, any, tool or none, got `{other}`"),
            ));
        }
    };
    let parallel = !c.boolean("disable_parallel_tool_use")?.unwrap_or(false);
    Ok((choice, parallel))
}

/// Decodes a Messages body.
pub(crate) fn decode(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, ApiError> {
    let f = Fields(body);
    f.warn_unread(&[FIELDS, SAMPLING]);
    let generate = GenerateRequest {
        model: f.string("model")?,
        sampling: f.sampling(SAMPLING, defaults)?,
        max_tokens: f.max_tokens(&["max_tokens"])?,
        stop: f.stops("stop_sequences", MAX_STOP_SEQUENCES)?,
        stream: f.boolean("stream")?.unwrap_or(false),
        include_usage: false,
        top_logprobs: None,
        skip_special_tokens: true,
        session: match f.object("metadata")? {
            Some(metadata) => session_of(Fields(metadata).string("user_id").map_err(|_| {
                ApiError::invalid("metadata.user_id", "`metadata.user_id` must be a string")
            })?),
            None => None,
        },
        grammar: None,
    };
    let mut messages = Vec::new();
    if let Some(system) = f.get("system") {
        messages.push(Message::text(Role::System, block_text(system, "system")?));
    }
    let items = match f.get("messages") {
        Some(Value::Array(items)) => items,
        Some(other) => return Err(wrong("messages", "a list", other)),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    for (i, m) in items.iter().enumerate() {
        message(m, i, &mut messages)?;
    }
    let tools = f
        .array("tools")?
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, t)| flat_tool(t, i, "input_schema"))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let (tool_choice, parallel_tool_calls) = tool_choice(&f)?;
    let mut template_kwargs = Map::new();
    if let Some(thinking) = f.object("thinking")? {
        let on = thinking.get("type").and_then(Value::as_str) == Some("enabled");
        template_kwargs.insert("enable_thinking".to_string(), Value::Bool(on));
    }
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
    use serde_json::json;

    use super::*;

    fn decoded(body: Value) -> Result<ChatRequest, ApiError> {
        decode(body.as_object().unwrap(), &SamplingDefaults::default())
    }

    /// A Messages conversation with a system prompt, thinking, a tool call and its result
    /// becomes the conversation the template renders.
    #[test]
    fn a_tool_round_trip_decodes() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "thinking": {"type": "disabled"},
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
            "tool_choice": {"type": "any"},
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "look it up"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "12 C"}]},
                    {"type": "text", "text": "Thanks"}]}
            ]
        });
        let r = decoded(body).unwrap();
        assert_eq!(r.generate.stop, ["END"]);
        assert_eq!(r.generate.max_tokens, Some(64));
        let c = &r.conversation;
        assert_eq!(c.tool_choice, ToolChoice::Required);
        assert_eq!(c.template_kwargs["enable_thinking"], false);
        assert_eq!(
            c.tools[0].definition["function"]["parameters"]["properties"]["city"]["type"],
            "string"
        );
        let said: Vec<Value> = c.messages.iter().map(Message::to_template).collect();
        assert_eq!(
            said,
            [
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Weather in Oslo?"}),
                json!({"role": "assistant", "content": "Checking.", "reasoning_content": "look it up",
                 "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "12 C", "tool_call_id": "toolu_1"}),
                json!({"role": "user", "content": "Thanks"}),
            ]
        );
    }

    /// Each bad field is named as Anthropic names it.
    #[test]
    fn bad_fields_are_named_in_anthropic_terms() {
        let m = json!([{"role": "user", "content": "x"}]);
        for (body, param) in [
            (
                json!({"messages": m, "stop_sequences": 42}),
                "stop_sequences",
            ),
            (
                json!({"messages": m, "stop_sequences": [1]}),
                "stop_sequences",
            ),
            (json!({"messages": m, "max_tokens": 0}), "max_tokens"),
            (json!({"messages": m, "temperature": "hot"}), "temperature"),
            (json!({"messages": m, "system": 3}), "system"),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}}]}]}),
                "messages[0].content[0].name",
            ),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": m, "tool_choice": {"type": "maybe"}}),
                "tool_choice.type",
            ),
            (
                json!({"messages": m, "tools": [{"input_schema": {}}]}),
                "tools[0].name",
            ),
            (
                json!({"messages": m, "metadata": {"user_id": 7}}),
                "metadata.user_id",
            ),
            (json!({"max_tokens": 5}), "messages"),
        ] {
            let err = decoded(body.clone()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err:?}");
        }
    }
}
