//! Corral's own request, whichever API a client spoke: a conversation (typed messages and
//! tools) or a text prompt, sampling, limits and how the reply is wanted. One decoder per
//! wire format (`openai.rs` for chat and text completions, `anthropic.rs` for Messages,
//! `responses.rs` for Responses) checks the fields its API defines, once, and reports a bad
//! one by the name the client sent; nothing after decoding reads wire JSON.

pub(crate) mod anthropic;
mod fields;
pub(crate) mod openai;
pub(crate) mod responses;

use corral_engine::{Grammar, SamplingParams};
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// No tools: they are left out of the prompt.
    None,
    /// At least one call, to any tool.
    Required,
    /// A call to this tool.
    Named(String),
}

/// What every generation asks for, chat or text.
#[derive(Clone, Debug)]
pub(crate) struct GenerateRequest {
    /// The model name the client asked for, if any.
    pub(crate) model: Option<String>,
    /// Sampling parameters.
    pub(crate) sampling: SamplingParams,
    /// Most tokens to generate, if given.
    pub(crate) max_tokens: Option<usize>,
    /// Strings that end the reply (not included in it).
    pub(crate) stop: Vec<String>,
    /// Stream the reply as server-sent events.
    pub(crate) stream: bool,
    /// Send a final usage chunk when streaming (OpenAI's `stream_options.include_usage`).
    pub(crate) include_usage: bool,
    /// Alternatives per token when log-probabilities are wanted; `None` for none.
    pub(crate) top_logprobs: Option<usize>,
    /// Drop special tokens (`<|im_start|>`, ...) from the text (vLLM's
    /// `skip_special_tokens`, default true).
    pub(crate) skip_special_tokens: bool,
    /// The client's session id: an `X-Session-Id` header, else the API's user field.
    pub(crate) session: Option<String>,
    /// The grammar the output must match, and the request field it came from (errors in it
    /// are reported under that name).
    pub(crate) grammar: Option<(Grammar, &'static str)>,
}

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A tool call the model made earlier in the conversation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    /// The call's id, which its result names.
    pub(crate) id: Option<String>,
    /// The function called.
    pub(crate) name: String,
    /// Its arguments: an object, or the text the client sent when that is not one.
    pub(crate) arguments: Value,
}

impl ToolCall {
    /// A call whose arguments came as a JSON string (as OpenAI returns them): a string
    /// holding an object becomes the object, which templates iterate (`arguments|items`).
    pub(crate) fn from_text(id: Option<String>, name: String, arguments: &str) -> Self {
        let arguments = match serde_json::from_str::<Value>(arguments) {
            Ok(object @ Value::Object(_)) => object,
            _ => Value::String(arguments.to_string()),
        };
        Self {
            id,
            name,
            arguments,
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Message {
    pub(crate) role: Role,
    /// Its text (`None`: an assistant turn of tool calls only).
    pub(crate) content: Option<String>,
    /// An assistant turn's reasoning.
    pub(crate) reasoning: Option<String>,
    /// An assistant turn's tool calls.
    pub(crate) tool_calls: Vec<ToolCall>,
    /// A tool result's call id.
    pub(crate) tool_call_id: Option<String>,
    /// The author's name, where the client gave one.
    pub(crate) name: Option<String>,
}

impl Message {
    /// A message of `role` with `text`.
    pub(crate) fn text(role: Role, text: impl Into<String>) -> Self {
        Self {
            role,
            content: Some(text.into()),
            reasoning: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    /// The message as chat templates read one (OpenAI's shape, reasoning as
    /// `reasoning_content`).
    pub(crate) fn to_template(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), json!(self.role.as_str()));
        m.insert(
            "content".into(),
            self.content.clone().map_or(Value::Null, Value::String),
        );
        if let Some(reasoning) = &self.reasoning {
            m.insert("reasoning_content".into(), json!(reasoning));
        }
        if !self.tool_calls.is_empty() {
            let calls: Vec<Value> = self
                .tool_calls
                .iter()
                .map(|c| {
                    json!({"id": c.id, "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}})
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        if let Some(id) = &self.tool_call_id {
            m.insert("tool_call_id".into(), json!(id));
        }
        if let Some(name) = &self.name {
            m.insert("name".into(), json!(name));
        }
        Value::Object(m)
    }
}

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tool {
    /// Its name.
    pub(crate) name: String,
    /// Its parameters' JSON schema (an object schema where the client gave none).
    pub(crate) parameters: Value,
    /// The definition as the template shows it to the model: OpenAI's `{"type": "function",
    /// "function": {...}}`, the client's own fields in its order.
    pub(crate) definition: Value,
}

impl Tool {
    /// A tool from its name, description and parameters schema (Anthropic's and the
    /// Responses API's flat tools).
    pub(crate) fn new(name: String, description: Option<Value>, parameters: Option<Value>) -> Self {
        let parameters = parameters.unwrap_or_else(|| json!({"type": "object"}));
        let definition = json!({"type": "function", "function": {
            "name": name,
            "description": description.unwrap_or_else(|| json!("")),
            "parameters": parameters,
        }});
        Self {
            name,
            parameters,
            definition,
        }
    }
}

/// A conversation to continue, with what it allows the model.
#[derive(Clone, Debug)]
pub(crate) struct Conversation {
    /// The messages, in order.
    pub(crate) messages: Vec<Message>,
    /// Tools the model may call (none when `tool_choice` is none).
    pub(crate) tools: Vec<Tool>,
    /// What the client asks of tool calls.
    pub(crate) tool_choice: ToolChoice,
    /// Whether several tool calls may come at once.
    pub(crate) parallel_tool_calls: bool,
    /// Extra chat template variables (`enable_thinking`, ...).
    pub(crate) template_kwargs: Map<String, Value>,
}

impl Conversation {
    /// A conversation whose tools are left out where `tool_choice` is none, and whose
    /// demanded tool call has a tool to call (errors under `tool_choice`, the name every API
    /// gives the field).
    pub(crate) fn new(
        messages: Vec<Message>,
        tools: Vec<Tool>,
        tool_choice: ToolChoice,
        parallel_tool_calls: bool,
        template_kwargs: Map<String, Value>,
    ) -> Result<Self, ApiError> {
        let conversation = Self {
            messages,
            tools: if tool_choice == ToolChoice::None {
                Vec::new()
            } else {
                tools
            },
            tool_choice,
            parallel_tool_calls,
            template_kwargs,
        };
        conversation.check_tool_choice("tool_choice")?;
        Ok(conversation)
    }

    /// The messages as chat templates read them.
    pub(crate) fn template_messages(&self) -> Vec<Value> {
        self.messages.iter().map(Message::to_template).collect()
    }

    /// The tools as chat templates read them (`None` for none).
    pub(crate) fn template_tools(&self) -> Option<Vec<Value>> {
        (!self.tools.is_empty()).then(|| self.tools.iter().map(|t| t.definition.clone()).collect())
    }

    /// Checks that a demanded tool call has a tool to call, reporting under `param`.
    fn check_tool_choice(&self, param: &str) -> Result<(), ApiError> {
        if matches!(
            self.tool_choice,
            ToolChoice::Required | ToolChoice::Named(_)
        ) && self.tools.is_empty()
        {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` asks for a tool call but the request has no tools"),
            ));
        }
        if let ToolChoice::Named(name) = &self.tool_choice
            && !self.tools.iter().any(|t| &t.name == name)
        {
            return Err(ApiError::invalid(
                param,
                format!("`{param}` names `{name}`, which is not among the tools"),
            ));
        }
        Ok(())
    }
}

/// A chat request: a conversation and what to generate from it.
#[derive(Clone, Debug)]
pub(crate) struct ChatRequest {
    pub(crate) generate: GenerateRequest,
    pub(crate) conversation: Conversation,
}

/// The prompt of a text completion.
#[derive(Clone, Debug)]
pub(crate) enum PromptInput {
    /// Text to tokenize.
    Text(String),
    /// Token ids.
    Tokens(Vec<u32>),
}

/// A text completion request.
#[derive(Clone, Debug)]
pub(crate) struct CompletionRequest {
    pub(crate) generate: GenerateRequest,
    pub(crate) prompt: PromptInput,
}

/// OpenAI's reasoning effort (`reasoning_effort`, the Responses API's `reasoning.effort`,
/// named `param`): "none" turns the template's thinking off unless `template_kwargs` already
/// say; minimal to high leave it on.
fn apply_reasoning_effort(
    effort: Option<&str>,
    param: &str,
    template_kwargs: &mut Map<String, Value>,
) -> Result<(), ApiError> {
    match effort {
        None | Some("minimal" | "low" | "medium" | "high") => Ok(()),
        Some("none") => {
            template_kwargs
                .entry("enable_thinking")
                .or_insert(Value::Bool(false));
            Ok(())
        }
        Some(other) => Err(ApiError::invalid(
            param,
            format!("`{param}` must be none, minimal, low, medium or high, got `{other}`"),
        )),
    }
}

/// Longest session id accepted, in bytes.
const MAX_SESSION_ID: usize = 256;

/// A client's user id as the session id, where it is short enough to be one.
fn session_of(user: Option<String>) -> Option<String> {
    user.filter(|u| !u.is_empty() && u.len() <= MAX_SESSION_ID)
}

/// Takes an `X-Session-Id` header, if any, as the request's session id (in place of the
/// user field): visible ASCII, at most [`MAX_SESSION_ID`] bytes.
pub(crate) fn with_session_header(
    generate: &mut GenerateRequest,
    headers: &axum::http::HeaderMap,
) -> Result<(), ApiError> {
    let Some(value) = headers.get("x-session-id") else {
        return Ok(());
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
    generate.session = Some(id.to_string());
    Ok(())
}
