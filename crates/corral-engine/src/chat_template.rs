//! Rendering the checkpoint's own Jinja chat template (from `tokenizer_config.json` or
//! `chat_template.jinja`) with minijinja, set up as transformers sets up Jinja: blocks trimmed
//! and stripped, Python string methods, `tojson` as Python's `json.dumps`, and maps in the
//! order the request gave them. Template variables such as `enable_thinking` pass straight
//! through.

use std::path::Path;

use minijinja::{Environment, Error, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};

use crate::EngineError;

const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template plus the special tokens it may refer to.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Whether the template renders a system message after the conversation's start (Qwen3's
    /// does; Qwen3.5's raises "System message must be at the beginning").
    renders_later_system: bool,
}

/// What `tokenizer_config.json` says about special tokens and the template.
#[derive(Debug, Default)]
pub struct TokenizerConfig {
    /// The chat template source, if any.
    pub chat_template: Option<String>,
    /// `bos_token`, if set.
    pub bos_token: Option<String>,
    /// `eos_token`, if set.
    pub eos_token: Option<String>,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json` (if present) and `chat_template.jinja` (if present, it
    /// wins) from a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer_config.json");
        let mut config = Self::default();
        if path.exists() {
            let text = std::fs::read_to_string(&path).map_err(|source| EngineError::Io {
                path: path.clone(),
                source,
            })?;
            let value: Value =
                serde_json::from_str(&text).map_err(|e| EngineError::ConfigField {
                    path: path.clone(),
                    field: "<root>".to_string(),
                    problem: format!("not valid JSON: {e}"),
                })?;
            let field_err = |field: &str, problem: &str| EngineError::ConfigField {
                path: path.clone(),
                field: field.to_string(),
                problem: problem.to_string(),
            };
            config.chat_template = match value.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .or_else(|| named.first())
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                Some(_) => {
                    return Err(field_err(
                        "chat_template",
                        "expected a string or a list of named templates",
                    ));
                }
            };
            config.bos_token =
                special_token(&value, "bos_token").map_err(|p| field_err("bos_token", &p))?;
            config.eos_token =
                special_token(&value, "eos_token").map_err(|p| field_err("eos_token", &p))?;
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.exists() {
            config.chat_template =
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| EngineError::Io {
                        path: jinja.clone(),
                        source,
                    })?,
                );
        }
        Ok(config)
    }
}

impl TokenizerConfig {
    /// The chat template and special tokens a GGUF file carries.
    pub fn from_gguf(header: &corral_model::checkpoint::gguf_file::GgufHeader) -> Self {
        let (chat_template, bos_token, eos_token) =
            crate::gguf_vocab::template_and_specials(header);
        Self {
            chat_template,
            bos_token,
            eos_token,
        }
    }
}

/// A special token given as a string or as `{"content": ...}`.
fn special_token(config: &Value, key: &str) -> Result<Option<String>, String> {
    match config.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err("expected a string or an object with `content`".to_string()),
        },
        Some(_) => Err("expected a string".to_string()),
    }
}

fn raise_exception(message: String) -> Result<JinjaValue, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)` (Jinja's own escapes `<>&'` and writes compact
/// JSON, which is not the prompt the model was trained on).
fn tojson(
    value: JinjaValue,
    indent: Option<JinjaValue>,
    kwargs: minijinja::value::Kwargs,
) -> Result<JinjaValue, Error> {
    let bad = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let indent = match kwargs.get::<Option<JinjaValue>>("indent")?.or(indent) {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(
            usize::try_from(v.clone())
                .map_err(|_| bad(&format!("indent must be a whole number, got {v}")))?,
        ),
    };
    let mut style = crate::pyjson::PyJsonStyle::new(indent);
    if let Some(separators) = kwargs.get::<Option<JinjaValue>>("separators")?
        && !separators.is_none()
    {
        let parts: Vec<String> = separators
            .try_iter()
            .map_err(|_| bad("separators must be a pair of strings"))?
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("separators must be a pair of strings"))?;
        let [item, key] = <[String; 2]>::try_from(parts)
            .map_err(|_| bad("separators must be a pair of strings"))?;
        style.item_separator = item;
        style.key_separator = key;
    }
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    // ensure_ascii=True is not offered by the templates Corral runs; refuse it rather than
    // write something else.
    if kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false) {
        return Err(bad("ensure_ascii=True is not supported"));
    }
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| bad(&e.to_string()))?;
    Ok(JinjaValue::from(crate::pyjson::dumps(&json, &style)))
}

impl ChatTemplate {
    /// Compiles the template of a [`TokenizerConfig`].
    pub fn new(config: &TokenizerConfig) -> Result<Self, EngineError> {
        let source = config.chat_template.clone().ok_or_else(|| {
            EngineError::ChatTemplate("the checkpoint has no chat template".to_string())
        })?;
        // The environment transformers renders chat templates in.
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| EngineError::ChatTemplate(format!("does not compile: {e}")))?;
        let mut template = Self {
            env,
            bos_token: config.bos_token.clone().unwrap_or_default(),
            eos_token: config.eos_token.clone().unwrap_or_default(),
            renders_later_system: false,
        };
        template.renders_later_system = template.probe_later_system();
        Ok(template)
    }

    /// Whether a system message after a user turn renders, and its text appears: asked once of
    /// the template itself, so that no template's source is sniffed for it.
    fn probe_later_system(&self) -> bool {
        const LATER: &str = "corral-probe: a later system message";
        let messages = [
            serde_json::json!({"role": "system", "content": "first system message"}),
            serde_json::json!({"role": "user", "content": "first user message"}),
            serde_json::json!({"role": "system", "content": LATER}),
            serde_json::json!({"role": "user", "content": "second user message"}),
        ];
        self.render_as_given(&messages, None, true, &Map::new())
            .is_ok_and(|text| text.contains(LATER))
    }

    /// Renders `messages` (OpenAI-style objects with `role` and `content`), optional `tools`,
    /// and extra variables such as `enable_thinking`. System (and developer) messages may
    /// stand anywhere: they are placed as the template accepts them
    /// ([`place_system_messages`]).
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, EngineError> {
        let messages = place_system_messages(messages, self.renders_later_system);
        self.render_as_given(&messages, tools, add_generation_prompt, extra)
    }

    /// Renders the messages exactly as given.
    fn render_as_given(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        extra: &Map<String, Value>,
    ) -> Result<String, EngineError> {
        let mut context = extra.clone();
        context.insert("messages".to_string(), Value::Array(messages.to_vec()));
        if let Some(tools) = tools {
            context.insert("tools".to_string(), Value::Array(tools.to_vec()));
        }
        context.insert(
            "add_generation_prompt".to_string(),
            Value::Bool(add_generation_prompt),
        );
        context.insert(
            "bos_token".to_string(),
            Value::String(self.bos_token.clone()),
        );
        context.insert(
            "eos_token".to_string(),
            Value::String(self.eos_token.clone()),
        );
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(JinjaValue::from_serialize(&context))
            .map_err(|e| EngineError::ChatTemplate(format!("rendering failed: {e}")))
    }
}

/// Whether a message is a system message (OpenAI's `developer` role is one too).
fn is_system(message: &Value) -> bool {
    matches!(
        message.get("role").and_then(Value::as_str),
        Some("system" | "developer")
    )
}

/// The conversation as chat templates take it, whatever the number and place of its system
/// and developer messages (clients such as Claude Code and Codex send several, and some after
/// the user's):
/// - those before the first other message become one system message, their texts joined by a
///   blank line, as the one system prompt every template reads from `messages[0]`;
/// - a later one stays a system message where the template renders one there
///   (`later_as_system`), else it becomes a user message at its place. A user turn keeps its
///   text where it was said and every turn before it unchanged, so a conversation that grows
///   keeps its rendered prefix (and the prefix cache's hit); moving the text into the leading
///   system prompt would change the conversation's first tokens on every turn.
pub(crate) fn place_system_messages(messages: &[Value], later_as_system: bool) -> Vec<Value> {
    let leading = messages.iter().take_while(|m| is_system(m)).count();
    let mut placed = Vec::with_capacity(messages.len());
    if leading > 0 {
        let texts: Vec<&str> = messages[..leading]
            .iter()
            .filter_map(|m| m.get("content").and_then(Value::as_str))
            .collect();
        let mut merged = messages[0].clone();
        if texts.len() == leading {
            merged["content"] = Value::String(texts.join("\n\n"));
            merged["role"] = Value::String("system".to_string());
            placed.push(merged);
        } else {
            // Contents that are not plain text are left for the template to judge.
            placed.extend(messages[..leading].iter().cloned());
        }
    }
    for message in &messages[leading..] {
        let mut message = message.clone();
        if is_system(&message) {
            let role = if later_as_system { "system" } else { "user" };
            message["role"] = Value::String(role.to_string());
        }
        placed.push(message);
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chatml() -> ChatTemplate {
        let source = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{%- endfor %}\
            {%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}";
        ChatTemplate::new(&TokenizerConfig {
            chat_template: Some(source.to_string()),
            ..TokenizerConfig::default()
        })
        .unwrap()
    }

    #[test]
    fn renders_chatml_with_python_methods_and_kwargs() {
        let t = chatml();
        let msgs = [json!({"role": "user", "content": " Hi "})];
        let out = t.render(&msgs, None, true, &Map::new()).unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|><|im_start|>assistant\n");
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".to_string(), json!(false));
        let out = t.render(&msgs, None, true, &kwargs).unwrap();
        assert!(out.ends_with("<think>\n\n</think>\n\n"), "{out:?}");
    }

    /// A template in the shape of Qwen's tool sections, rendered as transformers renders it
    /// (the expected text is what jinja2 3.1 wrote with transformers' environment and
    /// `tojson`): blocks trimmed and stripped, tool schemas as `json.dumps` writes them with
    /// `<>&` and non-ASCII as they are and keys in the request's order, `arguments|items`.
    #[test]
    fn renders_as_transformers_does() {
        let source = r##"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- endif %}
{% for message in messages %}
    {% if message.role == "user" %}
<|im_start|>user
{{ message.content }}<|im_end|>
    {% elif message.role == "assistant" %}
<|im_start|>assistant
{% for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments|items %}
<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}
</function>
</tool_call>
{% endfor %}
<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"##;
        let context: Value = serde_json::from_str(r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wetter in Köln?"}, {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln", "days": 2, "units": {"temp": "C", "wind": "km/h"}}}}]}], "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & later", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}}, "required": ["city"]}}}], "add_generation_prompt": true}"#).unwrap();
        let t = ChatTemplate::new(&TokenizerConfig {
            chat_template: Some(source.to_string()),
            ..TokenizerConfig::default()
        })
        .unwrap();
        let messages = context["messages"].as_array().unwrap();
        let tools = context["tools"].as_array().unwrap();
        let out = t.render(messages, Some(tools), true, &Map::new()).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather <now> & later\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}, \"units\": {\"type\": \"object\"}}, \"required\": [\"city\"]}}}\n</tools><|im_end|>\n<|im_start|>user\nWetter in Köln?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n<function=get_weather>\n<parameter=city>\nKöln\n</parameter>\n<parameter=days>\n2\n</parameter>\n<parameter=units>\n{\"temp\": \"C\", \"wind\": \"km/h\"}\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn leading_system_messages_merge_and_later_ones_go_where_the_template_renders_them() {
        let messages = [
            json!({"role": "developer", "content": "one"}),
            json!({"role": "system", "content": "two"}),
            json!({"role": "user", "content": "hi"}),
            json!({"role": "developer", "content": "three"}),
        ];
        let roles = |placed: &[Value]| {
            placed
                .iter()
                .map(|m| format!("{}:{}", m["role"].as_str().unwrap(), m["content"]))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            roles(&place_system_messages(&messages, false)),
            ["system:\"one\\n\\ntwo\"", "user:\"hi\"", "user:\"three\""]
        );
        assert_eq!(
            roles(&place_system_messages(&messages, true)),
            ["system:\"one\\n\\ntwo\"", "user:\"hi\"", "system:\"three\""]
        );
        // A template that refuses a later system message gets it as a user turn; one that
        // renders it keeps it a system turn.
        let strict = ChatTemplate::new(&TokenizerConfig {
            chat_template: Some(
                "{% for m in messages %}{% if m.role == 'system' and not loop.first %}\
                 {{ raise_exception('System message must be at the beginning.') }}{% endif %}\
                 <{{ m.role }}>{{ m.content }}{% endfor %}"
                    .to_string(),
            ),
            ..TokenizerConfig::default()
        })
        .unwrap();
        let out = strict.render(&messages, None, true, &Map::new()).unwrap();
        assert_eq!(out, "<system>one\n\ntwo<user>hi<user>three");
        let out = chatml().render(&messages, None, true, &Map::new()).unwrap();
        assert!(out.ends_with("<|im_start|>system\nthree<|im_end|><|im_start|>assistant\n"));
    }

    #[test]
    fn raise_exception_is_an_error_not_a_panic() {
        let t = ChatTemplate::new(&TokenizerConfig {
            chat_template: Some("{{ raise_exception('no system role') }}".to_string()),
            ..TokenizerConfig::default()
        })
        .unwrap();
        let err = t.render(&[], None, false, &Map::new()).unwrap_err();
        assert!(err.to_string().contains("no system role"), "{err}");
    }

    #[test]
    fn missing_template_is_reported() {
        let err = ChatTemplate::new(&TokenizerConfig::default()).unwrap_err();
        assert!(err.to_string().contains("no chat template"), "{err}");
    }
}
