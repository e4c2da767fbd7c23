//! Splitting generated text into what the OpenAI API returns: `content`, `reasoning_content`
//! (text inside `<think>…</think>`) and `tool_calls` (Qwen's `<tool_call>{json}</tool_call>`),
//! and cutting it at the first stop string. Text that may be the start of a tag or of a stop
//! string is held back until the next piece settles it, so streamed deltas never leak half a
//! tag.

use serde_json::Value;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";

/// A piece of the response.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    /// Answer text.
    Content(String),
    /// Reasoning text.
    Reasoning(String),
    /// A complete tool call.
    ToolCall {
        /// Function name.
        name: String,
        /// Arguments as a JSON string.
        arguments: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

/// Incremental parser of one response's text.
#[derive(Debug)]
pub struct OutputParser {
    buffer: String,
    mode: Mode,
    stops: Vec<String>,
    parse_think: bool,
    parse_tools: bool,
    stopped: bool,
    tool_calls: usize,
}

impl OutputParser {
    /// A parser; `in_reasoning` when the prompt already opened `<think>`.
    pub fn new(in_reasoning: bool, stops: Vec<String>, parse_tools: bool) -> Self {
        Self {
            buffer: String::new(),
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            parse_think: true,
            parse_tools,
            stopped: false,
            tool_calls: 0,
        }
    }

    /// A parser that only cuts at stop strings (text completions).
    pub fn plain(stops: Vec<String>) -> Self {
        Self {
            parse_think: false,
            ..Self::new(false, stops, false)
        }
    }

    /// Whether a stop string was reached: nothing more should be generated.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Tool calls parsed so far.
    pub fn num_tool_calls(&self) -> usize {
        self.tool_calls
    }

    /// Adds generated text; returns the deltas it settles.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.stopped {
            return out;
        }
        self.buffer.push_str(text);
        loop {
            match self.mode {
                Mode::Content => {
                    let mut markers: Vec<(&str, usize)> = Vec::new();
                    if self.parse_think {
                        markers.push((THINK_OPEN, 0));
                    }
                    if self.parse_tools {
                        markers.push((TOOL_OPEN, 1));
                    }
                    let stops: Vec<String> = self.stops.clone();
                    markers.extend(stops.iter().map(|s| (s.as_str(), 2)));
                    match earliest(&self.buffer, &markers) {
                        Some((at, len, kind)) => {
                            emit(&mut out, Delta::Content(self.buffer[..at].to_string()));
                            self.buffer.drain(..at + len);
                            match kind {
                                0 => self.mode = Mode::Reasoning,
                                1 => self.mode = Mode::ToolCall,
                                _ => {
                                    self.stopped = true;
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
                    let mut markers: Vec<(&str, usize)> = vec![(THINK_CLOSE, 0)];
                    markers.extend(stops.iter().map(|s| (s.as_str(), 2)));
                    match earliest(&self.buffer, &markers) {
                        Some((at, len, kind)) => {
                            emit(&mut out, Delta::Reasoning(self.buffer[..at].to_string()));
                            self.buffer.drain(..at + len);
                            if kind == 2 {
                                self.stopped = true;
                                self.buffer.clear();
                                return out;
                            }
                            self.mode = Mode::Content;
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
                Mode::ToolCall => match self.buffer.find(TOOL_CLOSE) {
                    Some(at) => {
                        let inner = self.buffer[..at].to_string();
                        self.buffer.drain(..at + TOOL_CLOSE.len());
                        self.mode = Mode::Content;
                        match parse_tool_call(&inner) {
                            Some(call) => {
                                self.tool_calls += 1;
                                out.push(call);
                            }
                            None => emit(
                                &mut out,
                                Delta::Content(format!("{TOOL_OPEN}{inner}{TOOL_CLOSE}")),
                            ),
                        }
                    }
                    None => return out,
                },
            }
        }
    }

    /// Flushes what is held back at the end of generation.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buffer);
        if self.stopped {
            return out;
        }
        match self.mode {
            Mode::Content => emit(&mut out, Delta::Content(rest)),
            Mode::Reasoning => emit(&mut out, Delta::Reasoning(rest)),
            Mode::ToolCall => emit(&mut out, Delta::Content(format!("{TOOL_OPEN}{rest}"))),
        }
        out
    }
}

fn emit(out: &mut Vec<Delta>, delta: Delta) {
    let empty = match &delta {
        Delta::Content(s) | Delta::Reasoning(s) => s.is_empty(),
        Delta::ToolCall { .. } => false,
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
    let mut keep = 0;
    for (start, _) in text.char_indices() {
        let tail = &text[start..];
        if markers.iter().any(|(m, _)| m.starts_with(tail)) {
            keep = tail.len();
            break;
        }
    }
    keep
}

/// `{"name": ..., "arguments": {...}}` → a tool call with arguments as a JSON string.
fn parse_tool_call(inner: &str) -> Option<Delta> {
    let value: Value = serde_json::from_str(inner.trim()).ok()?;
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = match value.get("arguments") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    Some(Delta::ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(parser: &mut OutputParser, pieces: &[&str]) -> Vec<Delta> {
        let mut all: Vec<Delta> = pieces.iter().flat_map(|p| parser.push(p)).collect();
        all.extend(parser.finish());
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
        let mut p = OutputParser::new(false, vec![], true);
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
                Delta::Content("\n\nOK ".into()),
                Delta::ToolCall {
                    name: "get".into(),
                    arguments: "{\"city\":\"Oslo\"}".into()
                },
            ]
        );
        assert_eq!(p.num_tool_calls(), 1);
    }

    #[test]
    fn prompt_opened_reasoning() {
        let mut p = OutputParser::new(true, vec![], false);
        assert_eq!(
            run(&mut p, &["a", "b</think>c"]),
            vec![Delta::Reasoning("ab".into()), Delta::Content("c".into())]
        );
    }

    #[test]
    fn stop_string_inside_reasoning_stops_too() {
        let mut p = OutputParser::new(true, vec!["HALT".into()], false);
        assert_eq!(
            run(&mut p, &["thinking HA", "LT more</think>x"]),
            vec![Delta::Reasoning("thinking ".into())]
        );
        assert!(p.stopped());
    }

    #[test]
    fn stop_string_cuts_and_stops() {
        let mut p = OutputParser::new(false, vec!["END".into()], false);
        assert_eq!(
            run(&mut p, &["abc E", "N", "Dxyz"]),
            vec![Delta::Content("abc ".into())]
        );
        assert!(p.stopped());
    }

    #[test]
    fn broken_tool_call_stays_text_and_multibyte_is_safe() {
        let mut p = OutputParser::new(false, vec!["ü!".into()], true);
        assert_eq!(
            run(&mut p, &["é<tool_call>not json</tool_call>ü"]),
            vec![Delta::Content("é<tool_call>not json</tool_call>ü".into())]
        );
    }
}
