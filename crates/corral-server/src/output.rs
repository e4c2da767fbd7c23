//! Splitting generated text into a reply's parts: answer text, reasoning (inside the
//! syntax's reasoning tags) and tool calls in either of the forms an [`OutputSyntax`] names
//! (a JSON object, or XML-form functions and parameters, its values typed by the tool's JSON
//! schema), and cutting it at the first stop string. The tags are the served model's
//! syntax's (`syntax.rs`). Text that may be the start of a tag or of a stop string is held
//! back until the next piece settles it, so streamed deltas never leak half a tag.

mod call_stream;

use std::collections::HashMap;

use call_stream::CallStream;
use serde_json::{Map, Value};

use crate::request::Tool;
use crate::syntax::{OutputSyntax, XmlTags};

/// A piece of the response.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Delta {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call; where calls are streamed, the end of the one whose name and
    /// argument pieces came before.
    ToolCall {
        /// Function name.
        name: String,
        /// Arguments as a JSON string.
        arguments: String,
    },
    /// A streamed tool call's start, as soon as its name is written.
    ToolCallName(String),
    /// More of the streamed call's arguments: the pieces of a call join to the start of its
    /// `arguments` (the rest comes with [`Delta::ToolCall`]).
    ToolCallArguments(String),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

/// Incremental parser of one response's text.
#[derive(Debug)]
pub(crate) struct OutputParser {
    /// The tags of the model's reasoning and tool calls.
    syntax: &'static OutputSyntax,
    buffer: String,
    mode: Mode,
    stops: Vec<String>,
    parse_think: bool,
    parse_tools: bool,
    /// The stop string that ended the text, by its index in `stops`.
    stop_hit: Option<usize>,
    tool_calls: usize,
    /// Each tool's parameter types (`"integer"`, `"object"`, ...) by tool and parameter name.
    schemas: HashMap<String, HashMap<String, String>>,
    /// Whether tool calls are streamed as they are written ([`Delta::ToolCallName`], then
    /// [`Delta::ToolCallArguments`]).
    stream_calls: bool,
    /// The call being streamed, once its name was, and its arguments sent so far.
    streamed: Option<(CallStream, String)>,
    /// Bytes of the call being written already searched for its closing tag.
    call_searched: usize,
    /// Whether generation was cut short inside a tool call (which was then dropped).
    cut_call: bool,
    /// Whether the reasoning just closed and no content came yet: the newlines that separate
    /// the two (`</think>\n\n`) are the template's layout, not content.
    after_reasoning: bool,
}

impl OutputParser {
    /// A parser of text written in `syntax`; `in_reasoning` when the prompt already opened
    /// the reasoning.
    pub(crate) fn new(
        syntax: &'static OutputSyntax,
        in_reasoning: bool,
        stops: Vec<String>,
        parse_tools: bool,
    ) -> Self {
        Self {
            syntax,
            buffer: String::new(),
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            parse_think: true,
            parse_tools,
            stop_hit: None,
            tool_calls: 0,
            schemas: HashMap::new(),
            stream_calls: false,
            streamed: None,
            call_searched: 0,
            cut_call: false,
            after_reasoning: false,
        }
    }

    /// With `on`, streams tool calls as they are written: the name first, then the
    /// arguments in pieces, as OpenAI streams them (a string parameter of the XML form as
    /// its characters come, any other value once it is whole).
    pub(crate) fn streaming_tool_calls(mut self, on: bool) -> Self {
        self.stream_calls = on;
        self
    }

    /// The request's tools, whose parameter types type the values of XML-form calls.
    pub(crate) fn with_tool_schemas(mut self, tools: &[Tool]) -> Self {
        for tool in tools {
            let name = &tool.name;
            let properties = tool.parameters.get("properties").and_then(Value::as_object);
            let types = properties
                .into_iter()
                .flatten()
                .filter_map(|(param, schema)| Some((param.clone(), schema_type(schema)?)))
                .collect();
            self.schemas.insert(name.to_string(), types);
        }
        self
    }

    /// A parser that only cuts at stop strings (text completions).
    pub(crate) fn plain(stops: Vec<String>) -> Self {
        Self {
            parse_think: false,
            ..Self::new(&crate::syntax::QWEN3, false, stops, false)
        }
    }

    /// Whether a stop string was reached: nothing more should be generated.
    pub(crate) fn stopped(&self) -> bool {
        self.stop_hit.is_some()
    }

    /// The stop string that was reached, if one was.
    pub(crate) fn stop_string(&self) -> Option<&str> {
        self.stop_hit.map(|i| self.stops[i].as_str())
    }

    /// Whether the text so far leaves the reply inside its reasoning.
    pub(crate) fn in_reasoning(&self) -> bool {
        self.mode == Mode::Reasoning
    }

    /// Tool calls parsed so far.
    pub(crate) fn num_tool_calls(&self) -> usize {
        self.tool_calls
    }

    /// Adds generated text; returns the deltas it settles.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.stopped() {
            return out;
        }
        self.buffer.push_str(text);
        loop {
            match self.mode {
                Mode::Content => {
                    if self.after_reasoning {
                        let newlines =
                            self.buffer.len() - self.buffer.trim_start_matches('\n').len();
                        self.buffer.drain(..newlines);
                        if self.buffer.is_empty() {
                            return out;
                        }
                        self.after_reasoning = false;
                    }
                    let mut markers: Vec<(&str, usize)> = Vec::new();
                    if self.parse_think {
                        markers.push((self.syntax.reasoning.open, 0));
                    }
                    if self.parse_tools {
                        markers.push((self.syntax.tool_call.open, 1));
                    }
                    let stops: Vec<String> = self.stops.clone();
                    markers.extend(stops.iter().enumerate().map(|(i, s)| (s.as_str(), 2 + i)));
                    match earliest(&self.buffer, &markers) {
                        Some((at, len, kind)) => {
                            emit(&mut out, Delta::Content(self.buffer[..at].to_string()));
                            self.buffer.drain(..at + len);
                            match kind {
                                0 => self.mode = Mode::Reasoning,
                                1 => self.mode = Mode::ToolCall,
                                stop => {
                                    self.stop_hit = Some(stop - 2);
                                    self.buffer.clear();
                                    return out;
                                }
                            }
                        }
                        None => {
                            let keep = held_back(&self.buffer, &markers);
                            let settled: String =
                                self.buffer.drain(..self.buffer.len() - keep).collect();
                            emit(&mut out, Delta::Content(settled));
                            return out;
                        }
                    }
                }
                Mode::Reasoning => {
                    // Stop strings apply to the reasoning text too, as to all generated text.
                    let stops: Vec<String> = self.stops.clone();
                    let mut markers: Vec<(&str, usize)> = vec![(self.syntax.reasoning.close, 0)];
                    // A tool call ends the reasoning (models call tools before `</think>`).
                    if self.parse_tools {
                        markers.push((self.syntax.tool_call.open, 1));
                    }
                    markers.extend(stops.iter().enumerate().map(|(i, s)| (s.as_str(), 2 + i)));
                    match earliest(&self.buffer, &markers) {
                        Some((at, len, kind)) => {
                            emit(&mut out, Delta::Reasoning(self.buffer[..at].to_string()));
                            self.buffer.drain(..at + len);
                            match kind {
                                0 => {
                                    self.mode = Mode::Content;
                                    self.after_reasoning = true;
                                }
                                1 => self.mode = Mode::ToolCall,
                                stop => {
                                    self.stop_hit = Some(stop - 2);
                                    self.buffer.clear();
                                    return out;
                                }
                            }
                        }
                        None => {
                            let keep = held_back(&self.buffer, &markers);
                            let settled: String =
                                self.buffer.drain(..self.buffer.len() - keep).collect();
                            emit(&mut out, Delta::Reasoning(settled));
                            return out;
                        }
                    }
                }
                Mode::ToolCall => match self.find_call_close() {
                    Some(at) => {
                        let inner = self.buffer[..at].to_string();
                        self.buffer.drain(..at + self.syntax.tool_call.close.len());
                        self.mode = Mode::Content;
                        let streamed = self.streamed.take();
                        match parse_tool_call(&inner, &self.schemas, &self.syntax.xml) {
                            Some(Delta::ToolCall { name, arguments }) => {
                                self.tool_calls += 1;
                                if let Some((_, sent)) = streamed {
                                    match arguments.strip_prefix(sent.as_str()) {
                                        Some(rest) if !rest.is_empty() => {
                                            out.push(Delta::ToolCallArguments(rest.to_string()))
                                        }
                                        Some(_) => {}
                                        None => tracing::warn!(
                                            "a streamed tool call's arguments differ from the whole call's"
                                        ),
                                    }
                                }
                                out.push(Delta::ToolCall { name, arguments });
                            }
                            _ => {
                                tracing::warn!(
                                    "a tool call the model wrote could not be parsed; it is returned as content"
                                );
                                let tags = self.syntax.tool_call;
                                emit(
                                    &mut out,
                                    Delta::Content(format!("{}{inner}{}", tags.open, tags.close)),
                                )
                            }
                        }
                    }
                    None => {
                        if self.stream_calls {
                            self.stream_call(&mut out);
                        }
                        return out;
                    }
                },
            }
        }
    }

    /// Where the call being written closes, searching only what was not searched before
    /// (and the bytes the tag may straddle).
    fn find_call_close(&mut self) -> Option<usize> {
        let from = call_stream::floor_boundary(
            &self.buffer,
            self.call_searched
                .saturating_sub(self.syntax.tool_call.close.len() - 1),
        );
        let found = self.buffer[from..]
            .find(self.syntax.tool_call.close)
            .map(|i| from + i);
        self.call_searched = if found.is_some() {
            0
        } else {
            self.buffer.len()
        };
        found
    }

    /// The deltas of the call being written that its text so far settles: its name once,
    /// then what its arguments have grown by.
    fn stream_call(&mut self, out: &mut Vec<Delta>) {
        let mut more = String::new();
        if self.streamed.is_none() {
            let Some((name, stream)) =
                CallStream::start(&self.buffer, &self.schemas, &self.syntax.xml)
            else {
                return;
            };
            out.push(Delta::ToolCallName(name));
            more.push_str(stream.opening());
            self.streamed = Some((stream, String::new()));
        }
        let Some((stream, sent)) = self.streamed.as_mut() else {
            return;
        };
        more.push_str(&stream.advance(&self.buffer));
        if !more.is_empty() {
            sent.push_str(&more);
            out.push(Delta::ToolCallArguments(more));
        }
    }

    /// Flushes what is held back at the end of generation. `cut`: generation was cut short
    /// (`max_tokens`). A tool call still being written is then dropped, never returned as
    /// text, and [`Self::cut_call`] says so; one left open at a stop token is the model's
    /// own text and is returned as it is.
    pub(crate) fn finish(&mut self, cut: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        if self.stopped() {
            return out;
        }
        match self.mode {
            Mode::Content => emit(&mut out, Delta::Content(rest)),
            Mode::Reasoning => emit(&mut out, Delta::Reasoning(rest)),
            Mode::ToolCall if cut => {
                tracing::info!("generation reached max_tokens inside a tool call; it is dropped");
                self.cut_call = true;
            }
            Mode::ToolCall => emit(
                &mut out,
                Delta::Content(format!("{}{rest}", self.syntax.tool_call.open)),
            ),
        }
        out
    }

    /// Whether generation was cut short inside a tool call, which [`Self::finish`] dropped.
    pub(crate) fn cut_call(&self) -> bool {
        self.cut_call
    }
}

fn emit(out: &mut Vec<Delta>, delta: Delta) {
    let empty = match &delta {
        Delta::Content(s) | Delta::Reasoning(s) | Delta::ToolCallArguments(s) => s.is_empty(),
        Delta::ToolCall { .. } | Delta::ToolCallName(_) => false,
    };
    if !empty {
        out.push(delta);
    }
}

/// The earliest marker in `text`: `(byte offset, marker length, marker kind)`.
fn earliest(text: &str, markers: &[(&str, usize)]) -> Option<(usize, usize, usize)> {
    markers
        .iter()
        .filter_map(|&(m, kind)| text.find(m).map(|at| (at, m.len(), kind)))
        .min_by_key(|&(at, len, _)| (at, std::cmp::Reverse(len)))
}

/// Bytes at the end of `text` that could be the start of a marker.
fn held_back(text: &str, markers: &[(&str, usize)]) -> usize {
    // Only the last bytes, as many as the longest marker, can start one.
    let longest = markers.iter().map(|(m, _)| m.len()).max().unwrap_or(0);
    let tail = &text[call_stream::floor_boundary(text, text.len().saturating_sub(longest))..];
    for (start, _) in tail.char_indices() {
        let rest = &tail[start..];
        if markers.iter().any(|(m, _)| m.starts_with(rest)) {
            return rest.len();
        }
    }
    0
}

/// The type a parameter's JSON schema names (the first that is not `null` of a list); for a
/// schema that names none, `"string"` where its `enum`/`const` values are all strings,
/// `"json"` where it describes another value (an object's properties, an array's items,
/// alternatives, a reference, other enum values), else `None`: free text.
pub(crate) fn schema_type(schema: &Value) -> Option<String> {
    match schema.get("type") {
        Some(Value::String(t)) => return Some(t.clone()),
        Some(Value::Array(types)) => {
            return types
                .iter()
                .filter_map(Value::as_str)
                .find(|t| *t != "null")
                .map(str::to_string);
        }
        _ => {}
    }
    let values: Option<Vec<&Value>> = match (schema.get("const"), schema.get("enum")) {
        (Some(c), _) => Some(vec![c]),
        (None, Some(Value::Array(values))) => Some(values.iter().collect()),
        _ => None,
    };
    if let Some(values) = values {
        let all_text = values.iter().all(|v| v.is_string());
        return Some(if all_text { "string" } else { "json" }.to_string());
    }
    ["properties", "items", "anyOf", "oneOf", "allOf", "$ref"]
        .iter()
        .any(|k| schema.get(k).is_some())
        .then(|| "json".to_string())
}

/// `value` with every `-0` as the integer 0: serde reads the JSON integer `-0` as the float
/// -0.0, which would be written back as `-0.0`, a number no integer schema accepts.
fn without_negative_zero(value: Value) -> Value {
    match value {
        Value::Number(n) if n.as_f64().is_some_and(|f| f == 0.0 && f.is_sign_negative()) => {
            Value::from(0)
        }
        Value::Array(items) => Value::Array(items.into_iter().map(without_negative_zero).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, without_negative_zero(v)))
                .collect(),
        ),
        other => other,
    }
}

/// Whether an XML-form parameter of this schema is written as plain text (a string, or a
/// value whose schema says nothing of it), not as JSON.
pub(crate) fn is_text_value(schema: &Value) -> bool {
    matches!(
        schema_type(schema).as_deref(),
        None | Some("string" | "str" | "text")
    )
}

/// A tool call's inside, in either form, as a call with its arguments as a JSON string.
fn parse_tool_call(
    inner: &str,
    schemas: &HashMap<String, HashMap<String, String>>,
    xml: &XmlTags,
) -> Option<Delta> {
    let inner = inner.trim();
    if inner.starts_with(xml.function_open) {
        return parse_xml_call(inner, schemas, xml);
    }
    let value: Value = serde_json::from_str(inner).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        // The model's own text without the spaces between tokens (what a stream of the call
        // sent), where the usual layout holds it; else the value written anew.
        Some(other) => match partial_json_call(inner) {
            Some((n, compact)) if n == name && compact_complete(&compact) => compact,
            _ => other.to_string(),
        },
    };
    Some(Delta::ToolCall { name, arguments })
}

/// `{"name": "NAME", "arguments": {…` so far: the name, and the arguments' text without the
/// spaces between tokens, up to where it is written (empty when the arguments are not an
/// object, which then come whole at the end).
fn partial_json_call(inner: &str) -> Option<(String, String)> {
    let (name, text) = call_stream::json_call_head(inner)?;
    if !text.starts_with('{') {
        return Some((name.to_string(), String::new()));
    }
    Some((name.to_string(), compact_json_prefix(text)))
}

/// The JSON value that `text` starts with, as far as written, without the whitespace
/// between its tokens; it ends at the value's last character.
fn compact_json_prefix(text: &str) -> String {
    let mut out = String::new();
    call_stream::Compactor::default().feed(text, &mut out);
    out
}

/// Whether a compacted value is whole (its brackets balance, no string left open).
fn compact_complete(compact: &str) -> bool {
    serde_json::from_str::<Value>(compact).is_ok()
}

/// `<function=NAME>` then `<parameter=KEY>VALUE</parameter>`s then `</function>`: each value
/// without the newline on either side, typed by the tool's schema (a string where the schema
/// says so or says nothing).
fn parse_xml_call(
    inner: &str,
    schemas: &HashMap<String, HashMap<String, String>>,
    xml: &XmlTags,
) -> Option<Delta> {
    let (name, rest) = inner.strip_prefix(xml.function_open)?.split_once('>')?;
    let name = name.trim();
    let mut body = rest.trim_end().strip_suffix(xml.function_close)?;
    let types = schemas.get(name);
    let mut arguments = Map::new();
    loop {
        body = body.trim_start();
        if body.is_empty() {
            break;
        }
        let (key, rest) = body.strip_prefix(xml.parameter_open)?.split_once('>')?;
        let end = rest.find(xml.parameter_close)?;
        let raw = &rest[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let key = key.trim();
        let kind = types.and_then(|t| t.get(key)).map(String::as_str);
        arguments.insert(key.to_string(), typed_value(raw, kind));
        body = &rest[end + xml.parameter_close.len()..];
    }
    Some(Delta::ToolCall {
        name: name.to_string(),
        arguments: Value::Object(arguments).to_string(),
    })
}

/// An XML-form parameter's text as the JSON value its schema type asks for; the text itself
/// when it does not parse as that type, or the schema names none.
fn typed_value(raw: &str, kind: Option<&str>) -> Value {
    let text = || Value::String(raw.to_string());
    let trimmed = raw.trim();
    match kind {
        None | Some("string" | "str" | "text") => text(),
        Some("integer" | "int") => trimmed.parse::<i64>().map_or_else(|_| text(), Value::from),
        Some("number" | "float") => match trimmed.parse::<f64>() {
            Ok(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Value::from(f as i64),
            Ok(f) => serde_json::Number::from_f64(f).map_or_else(text, Value::Number),
            Err(_) => text(),
        },
        Some("boolean" | "bool") => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => text(),
        },
        Some(_) => serde_json::from_str(trimmed).map_or_else(|_| text(), without_negative_zero),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOL_CLOSE: &str = "</tool_call>";

    /// A parser of Qwen's syntax.
    fn qwen(in_reasoning: bool, stops: Vec<String>, parse_tools: bool) -> OutputParser {
        OutputParser::new(&crate::syntax::QWEN3, in_reasoning, stops, parse_tools)
    }

    fn run(parser: &mut OutputParser, pieces: &[&str]) -> Vec<Delta> {
        let mut all: Vec<Delta> = pieces.iter().flat_map(|p| parser.push(p)).collect();
        all.extend(parser.finish(false));
        // Merge consecutive text deltas of one kind, as a client would.
        let mut merged: Vec<Delta> = Vec::new();
        for d in all {
            match (merged.last_mut(), d) {
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (_, d) => merged.push(d),
            }
        }
        merged
    }

    #[test]
    fn splits_reasoning_content_and_tool_calls_across_pieces() {
        let mut p = qwen(false, vec![], true);
        let pieces = [
            "<thi",
            "nk>plan it</th",
            "ink>\n\nOK <tool",
            "_call>\n{\"name\": \"get\", ",
            "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
        ];
        assert_eq!(
            run(&mut p, &pieces),
            vec![
                Delta::Reasoning("plan it".into()),
                Delta::Content("OK ".into()),
                Delta::ToolCall {
                    name: "get".into(),
                    arguments: "{\"city\":\"Oslo\"}".into()
                },
            ]
        );
        assert_eq!(p.num_tool_calls(), 1);
    }

    #[test]
    fn newlines_after_the_reasoning_are_layout_not_content() {
        let mut p = qwen(true, vec![], true);
        assert_eq!(
            run(&mut p, &["why</think>", "\n", "\nHi\n\nthere"]),
            vec![
                Delta::Reasoning("why".into()),
                Delta::Content("Hi\n\nthere".into())
            ]
        );
        let mut p = qwen(true, vec![], true);
        let deltas = run(
            &mut p,
            &["why</think>\n\n<tool_call>\n{\"name\": \"get\", \"arguments\": {}}\n</tool_call>"],
        );
        assert_eq!(
            deltas,
            vec![
                Delta::Reasoning("why".into()),
                Delta::ToolCall {
                    name: "get".into(),
                    arguments: "{}".into()
                },
            ]
        );
    }

    #[test]
    fn prompt_opened_reasoning() {
        let mut p = qwen(true, vec![], false);
        assert_eq!(
            run(&mut p, &["a", "b</think>c"]),
            vec![Delta::Reasoning("ab".into()), Delta::Content("c".into())]
        );
    }

    #[test]
    fn stop_string_inside_reasoning_stops_too() {
        let mut p = qwen(true, vec!["HALT".into()], false);
        assert_eq!(
            run(&mut p, &["thinking HA", "LT more</think>x"]),
            vec![Delta::Reasoning("thinking ".into())]
        );
        assert!(p.stopped());
    }

    #[test]
    fn stop_string_cuts_and_stops() {
        let mut p = qwen(false, vec!["END".into()], false);
        assert_eq!(
            run(&mut p, &["abc E", "N", "Dxyz"]),
            vec![Delta::Content("abc ".into())]
        );
        assert!(p.stopped());
        assert_eq!(p.stop_string(), Some("END"));
    }

    fn weather_tool() -> Vec<Tool> {
        vec![Tool::new(
            "get_weather".into(),
            None,
            Some(serde_json::json!({
            "type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                "ratio": {"type": ["number", "null"]}, "units": {"type": "object"}, "tags": {"type": "array"}
            }})),
        )]
    }

    /// Qwen3.5's XML form, split across pieces anywhere: values typed by the schema (a
    /// string parameter keeps its text, inner newlines included), keys in the model's order,
    /// and several calls in one turn.
    #[test]
    fn xml_tool_calls_are_parsed_and_typed() {
        let fresh = || qwen(false, vec![], true).with_tool_schemas(&weather_tool());
        let text = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\nCR\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n\
            <parameter=units>\n{\"temp\": \"C\"}\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n\
            <parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n\
            <parameter=city>\nOslo\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n</function>\n</tool_call>";
        let mut p = fresh();
        let deltas = run(&mut p, &[text]);
        // Split anywhere, no tag is torn.
        for cut in (0..text.len()).filter(|&i| text.is_char_boundary(i)) {
            assert_eq!(
                run(&mut fresh(), &[&text[..cut], &text[cut..]]),
                deltas,
                "cut at {cut}"
            );
        }
        assert_eq!(deltas.len(), 4, "{deltas:?}");
        assert_eq!(
            deltas[2],
            Delta::Content("\n".into()),
            "the text between the calls"
        );
        assert_eq!(deltas[0], Delta::Content("Let me check.\n".into()));
        let Delta::ToolCall { name, arguments } = &deltas[1] else {
            panic!("{deltas:?}")
        };
        assert_eq!(name, "get_weather");
        assert_eq!(
            arguments,
            r#"{"city":"San José\nCR","days":3,"metric":true,"ratio":0.5,"units":{"temp":"C"},"tags":["a",1],"extra":"42"}"#
        );
        // A value that is not its type stays text.
        let Delta::ToolCall { arguments, .. } = &deltas[3] else {
            panic!("{deltas:?}")
        };
        assert_eq!(arguments, r#"{"city":"Oslo","days":"soon"}"#);
        assert_eq!(p.num_tool_calls(), 2);
    }

    /// A JSON value's `-0` (which a schema's integer allows, and serde reads as the float
    /// -0.0) comes back as the integer 0, not as `-0.0`, which no integer schema accepts.
    #[test]
    fn a_negative_zero_in_a_json_value_stays_an_integer() {
        assert_eq!(
            typed_value("{\"lat\": -0, \"n\": [-0, 1.5]}", Some("object")).to_string(),
            r#"{"lat":0,"n":[0,1.5]}"#
        );
        assert_eq!(typed_value("-0", Some("integer")).to_string(), "0");
    }

    /// A tool call written before `</think>` ends the reasoning and is a call.
    #[test]
    fn a_tool_call_inside_reasoning_ends_it() {
        let mut p = qwen(true, vec![], true).with_tool_schemas(&weather_tool());
        let deltas = run(
            &mut p,
            &[
                "I should look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
            ],
        );
        assert_eq!(
            deltas,
            vec![
                Delta::Reasoning("I should look it up.\n".into()),
                Delta::ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Rome"}"#.into()
                },
            ]
        );
    }

    /// Malformed XML calls come back as content, never as a wrong call.
    #[test]
    fn malformed_xml_calls_stay_text() {
        for bad in [
            "<tool_call><function=f><parameter=a>1</function></tool_call>",
            "<tool_call><function=f><parameter=a>1</parameter></tool_call>",
            "<tool_call><function f><parameter=a>1</parameter></function></tool_call>",
        ] {
            let mut p = qwen(false, vec![], true);
            assert_eq!(
                run(&mut p, &[bad]),
                vec![Delta::Content(bad.into())],
                "{bad}"
            );
            assert_eq!(p.num_tool_calls(), 0);
        }
    }

    /// What a stream of `text` cut at `cuts` sends: each call's name, its argument pieces
    /// joined, and the pieces that came before its closing tag was written.
    fn streamed(text: &str, cuts: &[usize]) -> (Vec<(String, String, usize)>, Vec<Delta>) {
        let mut p = qwen(false, vec![], true)
            .with_tool_schemas(&weather_tool())
            .streaming_tool_calls(true);
        let (mut calls, mut whole) = (Vec::new(), Vec::new());
        let (mut at, mut open) = (0, false);
        for &cut in cuts.iter().chain([&text.len()]) {
            for d in p.push(&text[at..cut]) {
                match d {
                    Delta::ToolCallName(name) => {
                        assert!(!open, "a call opened before the last ended");
                        calls.push((name, String::new(), 0));
                        open = true;
                    }
                    Delta::ToolCallArguments(more) => {
                        assert!(open, "arguments before a name");
                        let call = calls.last_mut().expect("a name first");
                        call.1.push_str(&more);
                        if !text[..cut].ends_with(TOOL_CLOSE) {
                            call.2 += 1;
                        }
                    }
                    Delta::ToolCall { name, arguments } => {
                        // A call written within one piece comes whole.
                        if !std::mem::take(&mut open) {
                            calls.push((name.clone(), arguments.clone(), 0));
                        }
                        whole.push(Delta::ToolCall { name, arguments });
                    }
                    other => whole.push(other),
                }
            }
            at = cut;
        }
        whole.extend(p.finish(false));
        (calls, whole)
    }

    /// Streamed calls in both forms, cut anywhere: the name first, then argument pieces that
    /// join to exactly the whole call's arguments (the same as without streaming), most of
    /// them sent before the call's closing tag when the text comes a character at a time.
    #[test]
    fn tool_calls_stream_their_name_then_their_arguments() {
        let xml = "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\nCR\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=units>\n{\"temp\": \"C\"}\n</parameter>\n</function>\n</tool_call>";
        let json = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa ris \\\"x\\\"\", \"days\": [1, 2]}}\n</tool_call>\
            <tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": 1}\"}\n</tool_call>";
        for (text, calls) in [(xml, 1), (json, 2)] {
            let plain = run(
                &mut qwen(false, vec![], true).with_tool_schemas(&weather_tool()),
                &[text],
            );
            let expected: Vec<(String, String)> = plain
                .iter()
                .filter_map(|d| match d {
                    Delta::ToolCall { name, arguments } => Some((name.clone(), arguments.clone())),
                    _ => None,
                })
                .collect();
            assert_eq!(expected.len(), calls, "{plain:?}");
            let bounds: Vec<usize> = (1..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            let mut cut_sets: Vec<Vec<usize>> = bounds.iter().map(|&c| vec![c]).collect();
            cut_sets.push(bounds.clone());
            for cuts in &cut_sets {
                let (got, whole) = streamed(text, cuts);
                let joined: Vec<(String, String)> =
                    got.iter().map(|c| (c.0.clone(), c.1.clone())).collect();
                assert_eq!(joined, expected, "cuts {cuts:?}");
                let ends: Vec<&Delta> = whole
                    .iter()
                    .filter(|d| matches!(d, Delta::ToolCall { .. }))
                    .collect();
                assert_eq!(ends.len(), calls, "each call ends with the whole call");
            }
            let (by_char, _) = streamed(text, &bounds);
            assert!(
                by_char[0].2 >= 3,
                "the first call's arguments came in {} pieces before its end",
                by_char[0].2
            );
        }
        assert_eq!(
            compact_json_prefix("{ \"a\" : [1, {\"b\": \"x y\"}] } trailing"),
            r#"{"a":[1,{"b":"x y"}]}"#
        );
    }

    /// A long string parameter (a file an agent writes: tags, `<`, a `</param` that does not
    /// close, newlines) streamed a character at a time joins to the whole call's arguments;
    /// so does a long JSON-form call.
    #[test]
    fn long_streamed_calls_join_to_the_whole() {
        let body: String = (0..600)
            .map(|i| format!("line {i}: if a < b {{ <div>é</div> }} </param\n"))
            .collect();
        let xml = format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n{body}\n</parameter>\n\
             <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        );
        let json = format!(
            "<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": {}, \"days\": [1, 2]}}}}\n</tool_call>",
            Value::from(body.as_str())
        );
        for text in [xml, json] {
            let bounds: Vec<usize> = (1..text.len())
                .filter(|&i| text.is_char_boundary(i))
                .collect();
            let (calls, whole) = streamed(&text, &bounds);
            let Some(Delta::ToolCall { arguments, .. }) = whole.first() else {
                panic!("no call: {whole:?}");
            };
            assert_eq!(calls.len(), 1);
            assert_eq!(&calls[0].1, arguments);
            let parsed: Value = serde_json::from_str(arguments).unwrap();
            assert_eq!(parsed["city"], Value::from(body.as_str()));
        }
    }

    #[test]
    fn broken_tool_call_stays_text_and_multibyte_is_safe() {
        let mut p = qwen(false, vec!["ü!".into()], true);
        assert_eq!(
            run(&mut p, &["é<tool_call>not json</tool_call>ü"]),
            vec![Delta::Content("é<tool_call>not json</tool_call>ü".into())]
        );
    }

    /// A call cut short by `max_tokens` leaves no markup in the content, streamed or not; one
    /// left open at a stop token is the model's text and stays.
    #[test]
    fn a_call_cut_short_is_dropped_not_returned_as_text() {
        let half = "Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\nOs";
        for stream in [false, true] {
            let mut p = qwen(false, Vec::new(), true)
                .with_tool_schemas(&weather_tool())
                .streaming_tool_calls(stream);
            let mut deltas = p.push(half);
            deltas.extend(p.finish(true));
            assert!(p.cut_call());
            let text: String = deltas
                .iter()
                .filter_map(|d| match d {
                    Delta::Content(t) => Some(t.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(text, "Let me look.", "stream {stream}: {deltas:?}");
            assert!(!deltas.iter().any(|d| matches!(d, Delta::ToolCall { .. })));
        }
        let mut p = qwen(false, Vec::new(), true);
        let mut deltas = p.push(half);
        deltas.extend(p.finish(false));
        assert!(!p.cut_call());
        assert_eq!(
            deltas.last(),
            Some(&Delta::Content(half["Let me look.".len()..].into()))
        );
    }
}
