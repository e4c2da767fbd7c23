//! Decoding OpenAI's chat and text completion bodies (`/v1/chat/completions`,
//! `/v1/completions`) into Corral's requests, each bad field named as OpenAI names it.

use corral_engine::{Grammar, SamplingDefaults};
use serde_json::{Map, Value, json};

use super::fields::{Fields, SAMPLING_FIELDS, describe, wrong};
use super::{
    ChatRequest, CompletionRequest, Conversation, GenerateRequest, Message, PromptInput, Role,
    Tool, ToolCall, ToolChoice, apply_reasoning_effort, session_of,
};
use crate::error::ApiError;

/// Most stop strings accepted, as OpenAI.
const MAX_STOPS: usize = 4;
/// Most alternatives per token, as OpenAI.
const MAX_TOP_LOGPROBS: usize = 20;

/// Request fields both completion endpoints read (besides the sampling fields).
const SHARED_FIELDS: &[&str] = &[
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stream",
    "stream_options",
    "logprobs",
    "user",
    "skip_special_tokens",
    "response_format",
];
/// Fields only `/v1/chat/completions` reads.
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "top_logprobs",
    "chat_template_kwargs",
    "reasoning_effort",
];
/// Fields only `/v1/completions` reads.
const COMPLETION_FIELDS: &[&str] = &["prompt"];

/// What both endpoints read.
fn generate(
    f: &Fields,
    chat: bool,
    defaults: &SamplingDefaults,
) -> Result<GenerateRequest, ApiError> {
    let model = f.string("model")?;
    if let Some(n) = f.integer("n")?
        && n != 1
    {
        return Err(ApiError::invalid(
            "n",
            format!("only n = 1 is supported, got {n}"),
        ));
    }
    let max_tokens = f.max_tokens(&["max_tokens", "max_completion_tokens"])?;
    let sampling = f.sampling(SAMPLING_FIELDS, defaults)?;
    let stop = f.stops("stop", MAX_STOPS)?;
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        None => false,
        Some(o) => Fields(o).boolean("include_usage")?.unwrap_or(false),
    };
    let top_logprobs = if chat {
        let wanted = f.boolean("logprobs")?.unwrap_or(false);
        let n = f.integer("top_logprobs")?.unwrap_or(0);
        if !(0..=MAX_TOP_LOGPROBS as i64).contains(&n) {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}"),
            ));
        }
        if n > 0 && !wanted {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ));
        }
        wanted.then_some(n as usize)
    } else {
        match f.integer("logprobs")? {
            None => None,
            Some(n) if (0..=MAX_TOP_LOGPROBS as i64).contains(&n) => Some(n as usize),
            Some(_) => {
                return Err(ApiError::invalid(
                    "logprobs",
                    format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}"),
                ));
            }
        }
    };
    Ok(GenerateRequest {
        model,
        sampling,
        max_tokens,
        stop,
        stream,
        include_usage,
        top_logprobs,
        skip_special_tokens: f.boolean("skip_special_tokens")?.unwrap_or(true),
        session: session_of(f.string("user")?),
        grammar: response_format(f.0)?.map(|g| (g, "response_format")),
    })
}

/// The grammar `response_format` asks for, if any.
fn response_format(body: &Map<String, Value>) -> Result<Option<Grammar>, ApiError> {
    let format = match body.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(format)) => format,
        Some(_) => {
            return Err(ApiError::invalid(
                "response_format",
                "`response_format` must be an object with a `type`",
            ));
        }
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(json!({"type": "object"})))),
        Some("json_schema") => {
            let spec = format.get("json_schema").unwrap_or(&Value::Null);
            match spec.get("schema") {
                None | Some(Value::Null) => {
                    Ok(Some(Grammar::JsonSchema(json!({"type": "object"}))))
                }
                Some(schema @ Value::Object(_)) => Ok(Some(Grammar::JsonSchema(schema.clone()))),
                Some(_) => Err(ApiError::invalid(
                    "response_format.json_schema.schema",
                    "`response_format.json_schema.schema` must be a JSON schema object",
                )),
            }
        }
        _ => Err(ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be text, json_object or json_schema",
        )),
    }
}

/// Reads `tool_choice`: "auto", "none", "required", or `{"type": "function", "function":
/// {"name": ...}}` (also the Responses API's `{"type": "function", "name": ...}`).
pub(super) fn tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(bad)?;
            Ok(ToolChoice::Named(name.to_string()))
        }
        Some(_) => Err(bad()),
    }
}

/// Flattens a message's content (a string, or an array of text parts) to a string.
fn message_text(content: &Value, param: &str) -> Result<Option<String>, ApiError> {
    match content {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(kind), _) if kind != "text" => {
                        return Err(ApiError::invalid(
                            param,
                            format!("content parts of type `{kind}` are not supported; send text"),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            param,
                            "each content part needs `type: \"text\"` and a string `text`",
                        ));
                    }
                }
            }
            Ok(Some(text))
        }
        other => Err(ApiError::invalid(
            param,
            format!(
                "content must be a string or an array of text parts, got {}",
                describe(other)
            ),
        )),
    }
}

/// An assistant message's tool call: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, its arguments a JSON string (as OpenAI returns them) or an object.
fn tool_call(call: &Value, param: &str) -> Result<ToolCall, ApiError> {
    let function = call.get("function").and_then(Value::as_object);
    let name = function
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::invalid(
                &format!("{param}.function.name"),
                "each tool call needs a string `function.name`",
            )
        })?;
    let id = call.get("id").and_then(Value::as_str).map(str::to_string);
    Ok(match function.and_then(|f| f.get("arguments")) {
        None | Some(Value::Null) => ToolCall::from_text(id, name.to_string(), "{}"),
        Some(Value::String(text)) => ToolCall::from_text(id, name.to_string(), text),
        Some(other) => ToolCall {
            id,
            name: name.to_string(),
            arguments: other.clone(),
        },
    })
}

/// One chat message.
fn message(m: &Value, i: usize) -> Result<Message, ApiError> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let Value::Object(m) = m else {
        return Err(ApiError::invalid(
            &format!("messages[{i}]"),
            "each message must be an object",
        ));
    };
    let role = match m.get("role").and_then(Value::as_str) {
        Some("system" | "developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            return Err(ApiError::invalid(
                &at("role"),
                format!("unknown role `{other}`"),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                &at("role"),
                "each message needs a string `role`",
            ));
        }
    };
    let f = Fields(m);
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) => calls
            .iter()
            .enumerate()
            .map(|(k, c)| tool_call(c, &at(&format!("tool_calls[{k}]"))))
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(wrong(&at("tool_calls"), "an array", other)),
    };
    let content = message_text(m.get("content").unwrap_or(&Value::Null), &at("content"))?;
    if content.is_none() && !(role == Role::Assistant && m.contains_key("tool_calls")) {
        return Err(ApiError::invalid(&at("content"), "`content` is required"));
    }
    // Earlier reasoning comes back as `reasoning_content` or `reasoning`.
    let reasoning = match (f.get("reasoning_content"), f.get("reasoning")) {
        (Some(Value::String(r)), _) | (None, Some(Value::String(r))) => Some(r.clone()),
        (None, None) => None,
        (Some(other), _) => return Err(wrong(&at("reasoning_content"), "a string", other)),
        (None, Some(other)) => return Err(wrong(&at("reasoning"), "a string", other)),
    };
    let text = |key: &str| match f.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(wrong(&at(key), "a string", other)),
    };
    Ok(Message {
        role,
        content,
        reasoning,
        tool_calls,
        tool_call_id: text("tool_call_id")?,
        name: text("name")?,
    })
}

/// A chat request's tool: `{"type": "function", "function": {"name", "parameters", ...}}`.
fn tool(t: &Value, i: usize) -> Result<Tool, ApiError> {
    let function = t.get("function");
    let name = function
        .and_then(|f| f.get("name"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            ApiError::invalid(&format!("tools[{i}]"), "each tool needs `function.name`")
        })?;
    let parameters = match function.and_then(|f| f.get("parameters")) {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => serde_json::json!({"type": "object"}),
    };
    Ok(Tool {
        name: name.to_string(),
        parameters,
        definition: t.clone(),
    })
}

/// Decodes a `/v1/chat/completions` body.
pub(crate) fn chat(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, ApiError> {
    let f = Fields(body);
    let generate = generate(&f, true, defaults)?;
    f.warn_unread(&[SHARED_FIELDS, SAMPLING_FIELDS, CHAT_FIELDS]);
    let messages = match f.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        Some(other) => return Err(wrong("messages", "an array", other)),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    let messages = messages
        .iter()
        .enumerate()
        .map(|(i, m)| message(m, i))
        .collect::<Result<_, _>>()?;
    let tool_choice = tool_choice(f.get("tool_choice"))?;
    let tools: Vec<Tool> = f
        .array("tools")?
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, t)| tool(t, i))
        .collect::<Result<_, _>>()?;
    let mut template_kwargs = f
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    let effort = f.string("reasoning_effort")?;
    apply_reasoning_effort(effort.as_deref(), "reasoning_effort", &mut template_kwargs)?;
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

/// Decodes a `/v1/completions` body.
pub(crate) fn completion(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<CompletionRequest, ApiError> {
    let f = Fields(body);
    let generate = generate(&f, false, defaults)?;
    f.warn_unread(&[SHARED_FIELDS, SAMPLING_FIELDS, COMPLETION_FIELDS]);
    let prompt = match f.get("prompt") {
        Some(Value::String(s)) => PromptInput::Text(s.clone()),
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_u64) => {
            PromptInput::Tokens(
                items
                    .iter()
                    .map(|i| i.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect::<Option<_>>()
                    .ok_or_else(|| ApiError::invalid("prompt", "token ids must fit in 32 bits"))?,
            )
        }
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_string() => {
            PromptInput::Text(items[0].as_str().unwrap_or_default().to_string())
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "prompt",
                "`prompt` must be a string, one string in a list, or a list of token ids",
            ));
        }
        Some(other) => return Err(wrong("prompt", "a string or a list of token ids", other)),
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
    };
    Ok(CompletionRequest { generate, prompt })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (json!({"messages": "hi"}), "messages"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "n": 2}),
                "n",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}),
                "max_tokens",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_p": 0}),
                "top_p",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "stop": [1]}),
                "stop",
            ),
            (
                json!({"messages": [{"role": "robot", "content": "x"}]}),
                "messages[0].role",
            ),
            (
                json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
                "messages[0].content",
            ),
            (
                json!({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}),
                "top_logprobs",
            ),
        ];
        for (body, param) in cases {
            let err = chat(&obj(body.clone()), &SamplingDefaults::default()).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{body}: {err:?}");
            assert_eq!(err.status, 400);
        }
    }

    #[test]
    fn accepts_what_clients_send() {
        let body = json!({
            "model": "m", "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}
            ],
            "max_completion_tokens": 5, "temperature": 0, "top_k": -1, "stop": "x", "seed": 3,
            "stream": true, "stream_options": {"include_usage": true}, "logprobs": true, "top_logprobs": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
            "user": "u", "chat_template_kwargs": {"enable_thinking": false}
        });
        let r = chat(&obj(body), &SamplingDefaults::default()).unwrap();
        assert_eq!(r.conversation.messages[0].role, Role::System);
        assert_eq!(r.conversation.messages[1].content.as_deref(), Some("ab"));
        assert_eq!(r.generate.max_tokens, Some(5));
        assert_eq!(r.generate.top_logprobs, Some(2));
        assert!(r.generate.stream && r.generate.include_usage);
        assert_eq!(r.conversation.tools.len(), 1);
        assert_eq!(r.conversation.template_kwargs["enable_thinking"], false);
    }

    /// Fields a request leaves out take the model's defaults; the ones it sends win, and an
    /// explicit top_k of -1 or 0 turns the default off.
    #[test]
    fn sampling_defaults_fill_what_a_request_leaves_out() {
        let defaults = SamplingDefaults {
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            min_p: Some(0.05),
            repetition_penalty: Some(1.1),
        };
        let messages = json!([{"role": "user", "content": "x"}]);
        let bare = chat(&obj(json!({"messages": messages})), &defaults).unwrap();
        let p = &bare.generate.sampling;
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.6, 0.95, 20));
        assert_eq!((p.min_p, p.repetition_penalty), (0.05, 1.1));
        let sent = json!({"messages": messages, "temperature": 0, "top_k": -1, "top_p": 0.5});
        let p = chat(&obj(sent), &defaults).unwrap().generate.sampling;
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (0.0, 0.5, 0, 0.05)
        );
        let p = chat(
            &obj(json!({"messages": messages})),
            &SamplingDefaults::default(),
        )
        .unwrap()
        .generate
        .sampling;
        assert_eq!((p.temperature, p.top_p, p.top_k), (1.0, 1.0, 0));
    }

    /// Tool-call arguments sent back as JSON strings become objects, in their key order; a
    /// string that is not a JSON object stays a string.
    #[test]
    fn tool_call_arguments_strings_become_objects() {
        let call = |arguments: &str| json!({"type": "function", "function": {"name": "f", "arguments": arguments}});
        let body = json!({"messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": null, "tool_calls": [
                call(r#"{"zeta": 1, "alpha": {"b": 2, "a": 3}}"#), call("not json"), call("[1]"),
            ]},
        ]});
        let r = chat(&obj(body), &SamplingDefaults::default()).unwrap();
        let calls = &r.conversation.messages[1].to_template()["tool_calls"];
        let first = &calls[0]["function"]["arguments"];
        assert_eq!(first, &json!({"zeta": 1, "alpha": {"b": 2, "a": 3}}));
        let keys: Vec<&String> = first.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["zeta", "alpha"], "the client's key order is kept");
        assert_eq!(calls[1]["function"]["arguments"], "not json");
        assert_eq!(calls[2]["function"]["arguments"], "[1]");
    }

    /// `reasoning_effort: "none"` turns thinking off unless `chat_template_kwargs` says
    /// otherwise; an assistant message's `reasoning` reaches the template as
    /// `reasoning_content`.
    #[test]
    fn reasoning_fields_in() {
        let messages = json!([
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y", "reasoning": "because"},
        ]);
        let d = SamplingDefaults::default();
        let r = chat(
            &obj(json!({"messages": messages, "reasoning_effort": "none"})),
            &d,
        )
        .unwrap();
        assert_eq!(r.conversation.template_kwargs["enable_thinking"], false);
        let said = r.conversation.messages[1].to_template();
        assert_eq!(said["reasoning_content"], "because");
        assert!(said.get("reasoning").is_none());
        let kept = json!({"messages": messages, "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": true}});
        assert_eq!(
            chat(&obj(kept), &d).unwrap().conversation.template_kwargs["enable_thinking"],
            true
        );
        let high = chat(
            &obj(json!({"messages": messages, "reasoning_effort": "high"})),
            &d,
        )
        .unwrap();
        assert!(
            high.conversation
                .template_kwargs
                .get("enable_thinking")
                .is_none()
        );
        let bad = chat(
            &obj(json!({"messages": messages, "reasoning_effort": "max"})),
            &d,
        );
        assert_eq!(bad.unwrap_err().param.as_deref(), Some("reasoning_effort"));
    }

    #[test]
    fn skip_special_tokens_defaults_to_true() {
        let d = SamplingDefaults::default();
        let messages = json!([{"role": "user", "content": "x"}]);
        let with = |extra: Value| {
            let mut body = json!({"messages": messages});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            chat(&obj(body), &d)
        };
        assert!(with(json!({})).unwrap().generate.skip_special_tokens);
        let kept = with(json!({"skip_special_tokens": false})).unwrap();
        assert!(!kept.generate.skip_special_tokens);
        let bad = with(json!({"skip_special_tokens": "no"})).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("skip_special_tokens"));
    }

    /// Unknown and not-yet-honoured fields are named (and logged), known ones not.
    #[test]
    fn fields_not_acted_on_are_named() {
        let chat_fields: &[&[&str]] = &[SHARED_FIELDS, SAMPLING_FIELDS, CHAT_FIELDS];
        let unread = |body: Value, read: &[&[&str]]| Fields(&obj(body)).warn_unread(read);
        let body = json!({"messages": [], "temperature": 0, "response_format": {"type": "json_object"},
            "logit_bias": {}, "frobnicate": 1, "tool_choice": "required", "tools": []});
        assert_eq!(unread(body, chat_fields), ["frobnicate", "logit_bias"]);
        let fine =
            json!({"messages": [], "tool_choice": "auto", "reasoning_effort": "none", "seed": 1});
        assert!(unread(fine, chat_fields).is_empty());
        // Chat-only fields are not read by /v1/completions.
        assert_eq!(
            unread(
                json!({"prompt": "x", "messages": []}),
                &[SHARED_FIELDS, SAMPLING_FIELDS, COMPLETION_FIELDS]
            ),
            ["messages"]
        );
    }

    #[test]
    fn response_formats_read_as_openai_writes_them() {
        let body = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(response_format(&body(json!({}))).unwrap(), None);
        assert_eq!(
            response_format(&body(json!({"response_format": {"type": "text"}}))).unwrap(),
            None
        );
        assert_eq!(
            response_format(&body(json!({"response_format": {"type": "json_object"}}))).unwrap(),
            Some(Grammar::JsonSchema(json!({"type": "object"})))
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            response_format(&body(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "strict": true, "schema": schema}}})))
            .unwrap(),
            Some(Grammar::JsonSchema(schema))
        );
        for bad in [
            json!({"response_format": "json"}),
            json!({"response_format": {"type": "yaml"}}),
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
        ] {
            assert!(response_format(&body(bad)).is_err());
        }
    }

    #[test]
    fn tool_choice_reads_every_form() {
        let body = |v: Value| v.get("tool_choice").cloned();
        assert_eq!(
            tool_choice(body(json!({})).as_ref()).unwrap(),
            ToolChoice::Auto
        );
        assert_eq!(
            tool_choice(body(json!({"tool_choice": "required"})).as_ref()).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            tool_choice(
                body(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}))
                    .as_ref()
            )
            .unwrap(),
            ToolChoice::Named("f".to_string())
        );
        assert_eq!(
            tool_choice(body(json!({"tool_choice": {"type": "function", "name": "g"}})).as_ref())
                .unwrap(),
            ToolChoice::Named("g".to_string())
        );
        assert!(tool_choice(body(json!({"tool_choice": "always"})).as_ref()).is_err());
    }

    #[test]
    fn completion_prompts() {
        assert!(
            matches!(completion(&obj(json!({"prompt": [1, 2]})), &SamplingDefaults::default()).unwrap().prompt, PromptInput::Tokens(t) if t == [1, 2])
        );
        assert!(matches!(
            completion(&obj(json!({"prompt": "hi"})), &SamplingDefaults::default())
                .unwrap()
                .prompt,
            PromptInput::Text(_)
        ));
        assert_eq!(
            completion(&obj(json!({"prompt": 5})), &SamplingDefaults::default())
                .unwrap_err()
                .param
                .as_deref(),
            Some("prompt")
        );
    }
}
