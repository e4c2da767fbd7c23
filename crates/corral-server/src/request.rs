//! Validating OpenAI request bodies into Corral's request types. Bodies are parsed leniently
//! as JSON objects; every field clients send is then checked here, once, and each bad one is
//! reported by name. Nothing downstream checks again.

use corral_engine::{Grammar, SamplingDefaults, SamplingParams};
use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::grammar::{self, ToolChoice};

/// Settings shared by chat and text completions.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    /// Requested model name, if given.
    pub(crate) model: Option<String>,
    /// Sampling parameters.
    pub(crate) params: SamplingParams,
    /// Most tokens to generate, if given.
    pub(crate) max_tokens: Option<usize>,
    /// Stop strings.
    pub(crate) stop: Vec<String>,
    /// Stream with server-sent events.
    pub(crate) stream: bool,
    /// Send a final usage chunk when streaming.
    pub(crate) include_usage: bool,
    /// Alternatives per token when log-probabilities are wanted; `None` for none.
    pub(crate) top_logprobs: Option<usize>,
    /// The client's session id: an `X-Session-Id` header, else the `user` field.
    pub(crate) session: Option<String>,
    /// Drop special tokens (`<|im_start|>`, ...) from the text (vLLM's
    /// `skip_special_tokens`, default true).
    pub(crate) skip_special_tokens: bool,
    /// The grammar the output must match (`response_format`; for chat, a required tool
    /// call once the prompt is prepared), and the field errors in it are reported under.
    pub(crate) grammar: Option<Grammar>,
    pub(crate) grammar_param: &'static str,
}

/// Longest session id accepted, in bytes.
const MAX_SESSION_ID: usize = 256;

/// Takes an `X-Session-Id` header, if any, as the request's session id (in place of `user`):
/// visible ASCII, at most [`MAX_SESSION_ID`] bytes.
pub(crate) fn with_session_header(
    mut settings: Settings,
    headers: &axum::http::HeaderMap,
) -> Result<Settings, ApiError> {
    let Some(value) = headers.get("x-session-id") else {
        return Ok(settings);
    };
    let id = value
        .to_str()
        .ok()
        .filter(|v| {
            !v.is_empty() && v.len() <= MAX_SESSION_ID && v.bytes().all(|b| b.is_ascii_graphic())
        })
        .ok_or_else(|| {
            ApiError::invalid(
                "X-Session-Id",
                format!(
                    "the X-Session-Id header must be 1 to {MAX_SESSION_ID} visible ASCII characters"
                ),
            )
        })?;
    settings.session = Some(id.to_string());
    Ok(settings)
}

/// A validated chat completion request.
#[derive(Clone, Debug)]
pub(crate) struct ChatRequest {
    /// Common settings.
    pub(crate) settings: Settings,
    /// Messages with text content flattened to strings.
    pub(crate) messages: Vec<Value>,
    /// Tool definitions, unless `tool_choice` is `none`.
    pub(crate) tools: Option<Vec<Value>>,
    /// What `tool_choice` asks for.
    pub(crate) tool_choice: ToolChoice,
    /// Whether several tool calls may come at once (`parallel_tool_calls`, default true).
    pub(crate) parallel_tool_calls: bool,
    /// Extra template variables (`chat_template_kwargs`).
    pub(crate) template_kwargs: Map<String, Value>,
}

/// The prompt of a text completion.
#[derive(Clone, Debug)]
pub(crate) enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// A validated text completion request.
#[derive(Clone, Debug)]
pub(crate) struct CompletionRequest {
    /// Common settings.
    pub(crate) settings: Settings,
    /// The prompt.
    pub(crate) prompt: PromptInput,
}

/// Most stop strings accepted, as OpenAI.
const MAX_STOPS: usize = 4;
/// Most alternatives per token, as OpenAI.
const MAX_TOP_LOGPROBS: usize = 20;

struct Fields<'a>(&'a Map<String, Value>);

fn describe(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn wrong(key: &str, expected: &str, got: &Value) -> ApiError {
        ApiError::invalid(
            key,
            format!("`{key}` must be {expected}, got {}", describe(got)),
        )
    }

    fn number(
        &self,
        key: &str,
        range: std::ops::RangeInclusive<f64>,
    ) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        let n = v.as_f64().ok_or_else(|| Self::wrong(key, "a number", v))?;
        if !range.contains(&n) {
            return Err(ApiError::invalid(
                key,
                format!(
                    "`{key}` must be between {} and {}, got {n}",
                    range.start(),
                    range.end()
                ),
            ));
        }
        Ok(Some(n))
    }

    fn integer(&self, key: &str) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_i64()
            .or_else(|| v.as_u64().map(|u| u as i64))
            .map(Some)
            .ok_or_else(|| Self::wrong(key, "an integer", v))
    }

    fn boolean(&self, key: &str) -> Result<Option<bool>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| Self::wrong(key, "a boolean", v))
    }

    fn string(&self, key: &str) -> Result<Option<String>, ApiError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| Self::wrong(key, "a string", v))
    }
}

fn settings(
    body: &Map<String, Value>,
    chat: bool,
    defaults: &SamplingDefaults,
) -> Result<Settings, ApiError> {
    let f = Fields(body);
    let model = f.string("model")?;
    if let Some(n) = f.integer("n")?
        && n != 1
    {
        return Err(ApiError::invalid(
            "n",
            format!("only n = 1 is supported, got {n}"),
        ));
    }
    let mut max_tokens = None;
    for key in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = f.integer(key)? {
            if n < 1 {
                return Err(ApiError::invalid(
                    key,
                    format!("`{key}` must be at least 1, got {n}"),
                ));
            }
            max_tokens = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    let top_k = match f.integer("top_k")? {
        None => defaults.top_k.unwrap_or(0),
        Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(ApiError::invalid(
                "top_k",
                format!("`top_k` must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let params = SamplingParams {
        temperature: f
            .number("temperature", 0.0..=2.0)?
            .map_or(defaults.temperature.unwrap_or(1.0), |t| t as f32),
        top_k,
        top_p: match f.number("top_p", 0.0..=1.0)? {
            Some(p) if p <= 0.0 => {
                return Err(ApiError::invalid("top_p", "`top_p` must be greater than 0"));
            }
            Some(p) => p as f32,
            None => defaults.top_p.unwrap_or(1.0),
        },
        min_p: f
            .number("min_p", 0.0..=1.0)?
            .map_or(defaults.min_p.unwrap_or(0.0), |p| p as f32),
        repetition_penalty: match f.number("repetition_penalty", 0.0..=10.0)? {
            Some(r) if r <= 0.0 => {
                return Err(ApiError::invalid(
                    "repetition_penalty",
                    "`repetition_penalty` must be greater than 0",
                ));
            }
            Some(r) => r as f32,
            None => defaults.repetition_penalty.unwrap_or(1.0),
        },
        presence_penalty: f.number("presence_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: f.number("frequency_penalty", -2.0..=2.0)?.unwrap_or(0.0) as f32,
        seed: match f.integer("seed")? {
            Some(s) => s as u64,
            None => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        },
    };
    let stop = match f.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            let stops: Vec<String> = items
                .iter()
                .map(|i| i.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    ApiError::invalid("stop", "`stop` must be a string or a list of strings")
                })?;
            if stops.len() > MAX_STOPS {
                return Err(ApiError::invalid(
                    "stop",
                    format!("at most {MAX_STOPS} stop strings"),
                ));
            }
            stops
        }
        Some(other) => {
            return Err(Fields::wrong(
                "stop",
                "a string or a list of strings",
                other,
            ));
        }
    };
    let stream = f.boolean("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        None => false,
        Some(Value::Object(o)) => Fields(o).boolean("include_usage")?.unwrap_or(false),
        Some(other) => return Err(Fields::wrong("stream_options", "an object", other)),
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
    // `user` doubles as the session id where it is short enough to be one.
    let session = match f.get("user") {
        None | Some(Value::Null) => None,
        Some(Value::String(user)) => {
            (!user.is_empty() && user.len() <= MAX_SESSION_ID).then(|| user.clone())
        }
        Some(user) => return Err(Fields::wrong("user", "a string", user)),
    };
    Ok(Settings {
        model,
        params,
        max_tokens,
        stop,
        stream,
        include_usage,
        top_logprobs,
        session,
        skip_special_tokens: f.boolean("skip_special_tokens")?.unwrap_or(true),
        grammar: grammar::response_format(body)?,
        grammar_param: "response_format",
    })
}

/// Flattens a message's content (a string, or an array of text parts) to a string.
fn message_text(content: &Value, index: usize) -> Result<Value, ApiError> {
    let param = format!("messages[{index}].content");
    match content {
        Value::String(_) | Value::Null => Ok(content.clone()),
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
                            &param,
                            format!("content parts of type `{kind}` are not supported; send text"),
                        ));
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            &param,
                            "each content part needs `type: \"text\"` and a string `text`",
                        ));
                    }
                }
            }
            Ok(Value::String(text))
        }
        other => Err(ApiError::invalid(
            &param,
            format!(
                "content must be a string or an array of text parts, got {}",
                describe(other)
            ),
        )),
    }
}

/// A tool call's `arguments` sent back as a JSON string (as OpenAI returns them) becomes the
/// object it holds, which templates iterate (`arguments|items`); a string that is not a JSON
/// object is left as it is.
fn parse_arguments(call: &mut Value) {
    let Some(Value::Object(function)) = call.get_mut("function") else {
        return;
    };
    if let Some(Value::String(text)) = function.get("arguments")
        && let Ok(Value::Object(object)) = serde_json::from_str::<Value>(text)
    {
        function.insert("arguments".to_string(), Value::Object(object));
    }
}

/// Request fields both completion endpoints read.
const SHARED_FIELDS: &[&str] = &[
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
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

/// The fields of `body` that Corral does not act on (unknown ones, and ones such as
/// `logit_bias` it does not honour yet), sorted; each request logs them once, so that nothing
/// is dropped silently.
pub(crate) fn unacted_fields(body: &Map<String, Value>, chat: bool) -> Vec<String> {
    let endpoint = if chat { CHAT_FIELDS } else { COMPLETION_FIELDS };
    let mut fields: Vec<String> = body
        .keys()
        .filter(|k| !SHARED_FIELDS.contains(&k.as_str()) && !endpoint.contains(&k.as_str()))
        .cloned()
        .collect();
    fields.sort();
    fields
}

/// Logs the fields of a request that Corral does not act on, if any.
fn warn_unacted(body: &Map<String, Value>, chat: bool) {
    warn_ignored(&unacted_fields(body, chat));
}

/// The one log line naming a request's fields that are not acted on, if any.
pub(crate) fn warn_ignored<S: AsRef<str>>(fields: &[S]) {
    if !fields.is_empty() {
        let names: Vec<&str> = fields.iter().map(AsRef::as_ref).collect();
        tracing::warn!(
            fields = %names.join(", "),
            "request fields that are not acted on (ignored)"
        );
    }
}

/// Logs the fields of another API's request (Messages, Responses) that its translation into
/// a chat request does not read.
pub(crate) fn warn_fields_outside(body: &Map<String, Value>, read: &[&str]) {
    let ignored: Vec<&str> = body
        .keys()
        .map(String::as_str)
        .filter(|k| !read.contains(k))
        .collect();
    warn_ignored(&ignored);
}

/// A chat request's function tool; a missing description is empty, missing parameters an
/// object schema.
pub(crate) fn function_tool(tool: &Value, parameters_key: &str) -> Value {
    serde_json::json!({"type": "function", "function": {
        "name": tool.get("name").cloned().unwrap_or(Value::Null),
        "description": tool.get("description").cloned().unwrap_or(serde_json::json!("")),
        "parameters": tool.get(parameters_key).cloned().unwrap_or(serde_json::json!({"type": "object"})),
    }})
}

/// Validates a `/v1/chat/completions` body.
pub(crate) fn chat(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<ChatRequest, ApiError> {
    let settings = settings(body, true, defaults)?;
    warn_unacted(body, true);
    let messages = match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m,
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must not be empty",
            ));
        }
        Some(other) => return Err(Fields::wrong("messages", "an array", other)),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    let mut normalized = Vec::with_capacity(messages.len());
    for (i, message) in messages.iter().enumerate() {
        let Value::Object(m) = message else {
            return Err(ApiError::invalid(
                &format!("messages[{i}]"),
                "each message must be an object",
            ));
        };
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid(
                &format!("messages[{i}].role"),
                "each message needs a string `role`",
            )
        })?;
        if !matches!(role, "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(ApiError::invalid(
                &format!("messages[{i}].role"),
                format!("unknown role `{role}`"),
            ));
        }
        let mut m = m.clone();
        if role == "developer" {
            m.insert("role".to_string(), Value::String("system".to_string()));
        }
        let content = m.get("content").cloned().unwrap_or(Value::Null);
        if content.is_null() && !(role == "assistant" && m.contains_key("tool_calls")) {
            return Err(ApiError::invalid(
                &format!("messages[{i}].content"),
                "`content` is required",
            ));
        }
        m.insert("content".to_string(), message_text(&content, i)?);
        // Earlier reasoning comes back as `reasoning_content` or `reasoning`; the templates
        // read the former.
        if !m.contains_key("reasoning_content")
            && let Some(reasoning) = m.remove("reasoning")
        {
            m.insert("reasoning_content".to_string(), reasoning);
        }
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            calls.iter_mut().for_each(parse_arguments);
        }
        normalized.push(Value::Object(m));
    }
    let tool_choice = grammar::tool_choice(body)?;
    let tool_choice_none = tool_choice == ToolChoice::None;
    let parallel_tool_calls = Fields(body).boolean("parallel_tool_calls")?.unwrap_or(true);
    let tools = match body.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => {
            for (i, tool) in tools.iter().enumerate() {
                if tool
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .is_none()
                {
                    return Err(ApiError::invalid(
                        &format!("tools[{i}]"),
                        "each tool needs `function.name`",
                    ));
                }
            }
            (!tool_choice_none && !tools.is_empty()).then(|| tools.clone())
        }
        Some(other) => return Err(Fields::wrong("tools", "an array", other)),
    };
    let mut template_kwargs = match body.get("chat_template_kwargs") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(other) => return Err(Fields::wrong("chat_template_kwargs", "an object", other)),
    };
    // OpenAI's reasoning_effort "none" turns thinking off (unless the template kwargs say).
    match Fields(body).string("reasoning_effort")?.as_deref() {
        None | Some("minimal" | "low" | "medium" | "high") => {}
        Some("none") => {
            template_kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(false));
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "reasoning_effort",
                format!(
                    "`reasoning_effort` must be none, minimal, low, medium or high, got `{other}`"
                ),
            ));
        }
    }
    if matches!(tool_choice, ToolChoice::Required | ToolChoice::Named(_)) && tools.is_none() {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` asks for a tool call but the request has no `tools`",
        ));
    }
    Ok(ChatRequest {
        settings,
        messages: normalized,
        tools,
        tool_choice,
        parallel_tool_calls,
        template_kwargs,
    })
}

/// Validates a `/v1/completions` body.
pub(crate) fn completion(
    body: &Map<String, Value>,
    defaults: &SamplingDefaults,
) -> Result<CompletionRequest, ApiError> {
    let settings = settings(body, false, defaults)?;
    warn_unacted(body, false);
    let prompt = match body.get("prompt") {
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
        Some(other) => {
            return Err(Fields::wrong(
                "prompt",
                "a string or a list of token ids",
                other,
            ));
        }
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
    };
    Ok(CompletionRequest { settings, prompt })
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
        assert_eq!(r.messages[0]["role"], "system");
        assert_eq!(r.messages[1]["content"], "ab");
        assert_eq!(r.settings.max_tokens, Some(5));
        assert_eq!(r.settings.top_logprobs, Some(2));
        assert!(r.settings.stream && r.settings.include_usage);
        assert_eq!(r.tools.as_ref().map(Vec::len), Some(1));
        assert_eq!(r.template_kwargs["enable_thinking"], false);
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
        let p = &bare.settings.params;
        assert_eq!((p.temperature, p.top_p, p.top_k), (0.6, 0.95, 20));
        assert_eq!((p.min_p, p.repetition_penalty), (0.05, 1.1));
        let sent = json!({"messages": messages, "temperature": 0, "top_k": -1, "top_p": 0.5});
        let p = chat(&obj(sent), &defaults).unwrap().settings.params;
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.min_p),
            (0.0, 0.5, 0, 0.05)
        );
        let p = chat(
            &obj(json!({"messages": messages})),
            &SamplingDefaults::default(),
        )
        .unwrap()
        .settings
        .params;
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
        let calls = &r.messages[1]["tool_calls"];
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
        assert_eq!(r.template_kwargs["enable_thinking"], false);
        assert_eq!(r.messages[1]["reasoning_content"], "because");
        assert!(r.messages[1].get("reasoning").is_none());
        let kept = json!({"messages": messages, "reasoning_effort": "none",
            "chat_template_kwargs": {"enable_thinking": true}});
        assert_eq!(
            chat(&obj(kept), &d).unwrap().template_kwargs["enable_thinking"],
            true
        );
        let high = chat(
            &obj(json!({"messages": messages, "reasoning_effort": "high"})),
            &d,
        )
        .unwrap();
        assert!(high.template_kwargs.get("enable_thinking").is_none());
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
        assert!(with(json!({})).unwrap().settings.skip_special_tokens);
        let kept = with(json!({"skip_special_tokens": false})).unwrap();
        assert!(!kept.settings.skip_special_tokens);
        let bad = with(json!({"skip_special_tokens": "no"})).unwrap_err();
        assert_eq!(bad.param.as_deref(), Some("skip_special_tokens"));
    }

    /// Unknown and not-yet-honoured fields are named (and logged), known ones not.
    #[test]
    fn fields_not_acted_on_are_named() {
        let body = json!({"messages": [], "temperature": 0, "response_format": {"type": "json_object"},
            "logit_bias": {}, "frobnicate": 1, "tool_choice": "required", "tools": []});
        assert_eq!(
            unacted_fields(&obj(body), true),
            ["frobnicate", "logit_bias"]
        );
        let fine =
            json!({"messages": [], "tool_choice": "auto", "reasoning_effort": "none", "seed": 1});
        assert!(unacted_fields(&obj(fine), true).is_empty());
        // Chat-only fields are not read by /v1/completions.
        assert_eq!(
            unacted_fields(&obj(json!({"prompt": "x", "messages": []})), false),
            ["messages"]
        );
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
