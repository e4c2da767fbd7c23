//! A tool call streamed as it is written, read once: each push reads only the text that came
//! since the last (and the few bytes a closing tag may still be spread over), so a call of n
//! bytes costs O(n) over its whole stream, not O(n) a token.

use std::collections::HashMap;

use serde_json::Value;

use crate::syntax::XmlTags;

/// How far the call being streamed was read and sent.
#[derive(Debug)]
pub(super) struct CallStream {
    /// The XML form's tags.
    xml: &'static XmlTags,
    /// Parameter types of the called tool (XML form).
    types: Option<HashMap<String, String>>,
    scan: Scan,
}

#[derive(Debug)]
enum Scan {
    /// JSON form, `"arguments":` read: the value starts at byte `at` or later.
    JsonPending { at: usize },
    /// JSON form: compacting the arguments object (it is sent without the whitespace
    /// between tokens), read up to byte `at`.
    Json { at: usize, compactor: Compactor },
    /// JSON form whose arguments are not an object: they come whole at the call's end.
    JsonWhole,
    /// XML form: parameters from byte `at` on are not sent yet (`first`: none was).
    Xml {
        at: usize,
        first: bool,
        open: Option<OpenParam>,
    },
}

/// An XML-form parameter whose closing tag has not come: its value starts at `value` (the
/// byte after its tag, and after the newline that follows it once that is known).
#[derive(Debug)]
struct OpenParam {
    header_end: usize,
    value: Option<usize>,
    /// Bytes of the value already sent (a string), from `value`.
    sent: usize,
    /// Bytes of the value searched for the closing tag, from `value`.
    searched: usize,
    /// A typed value's key and type: sent whole when it closes; `None`: a string.
    typed: Option<(String, Option<String>)>,
}

impl CallStream {
    /// The call's name and its stream, once `buffer` (the call's text after `<tool_call>`)
    /// has its head: `<function=NAME>`, or `{"name": "NAME", "arguments":`.
    pub(super) fn start(
        buffer: &str,
        schemas: &HashMap<String, HashMap<String, String>>,
        xml: &'static XmlTags,
    ) -> Option<(String, Self)> {
        let inner = buffer.trim_start();
        let offset = |rest: &str| buffer.len() - rest.len();
        if let Some(rest) = inner.strip_prefix(xml.function_open) {
            let (name, body) = rest.split_once('>')?;
            let name = name.trim().to_string();
            let stream = Self {
                xml,
                types: schemas.get(&name).cloned(),
                scan: Scan::Xml {
                    at: offset(body),
                    first: true,
                    open: None,
                },
            };
            return Some((name, stream));
        }
        let (name, text) = json_call_head(inner)?;
        let stream = Self {
            xml,
            types: None,
            scan: Scan::JsonPending { at: offset(text) },
        };
        Some((name.to_string(), stream))
    }

    /// What the arguments grew by since the last call, reading `buffer` from where it left.
    pub(super) fn advance(&mut self, buffer: &str) -> String {
        let mut out = String::new();
        loop {
            match &mut self.scan {
                Scan::JsonPending { at } => {
                    let rest = buffer[*at..].trim_start();
                    if rest.is_empty() {
                        return out;
                    }
                    self.scan = if rest.starts_with('{') {
                        Scan::Json {
                            at: buffer.len() - rest.len(),
                            compactor: Compactor::default(),
                        }
                    } else {
                        Scan::JsonWhole
                    };
                }
                Scan::Json { at, compactor } => {
                    compactor.feed(&buffer[*at..], &mut out);
                    *at = buffer.len();
                    return out;
                }
                Scan::JsonWhole => return out,
                Scan::Xml { at, first, open } => match open {
                    Some(param) => {
                        let close = self.xml.parameter_close;
                        let Some(closed) = read_open_param(buffer, param, close, &mut out) else {
                            return out;
                        };
                        if let Some((key, kind)) = &param.typed {
                            out.push_str(&member_start(*first, key));
                            let raw = trim_value(closed.0);
                            out.push_str(&super::typed_value(raw, kind.as_deref()).to_string());
                        }
                        *at = closed.1;
                        *first = false;
                        *open = None;
                    }
                    None => {
                        let body = &buffer[*at..];
                        let trimmed = body.trim_start();
                        let open_tag = self.xml.parameter_open;
                        let Some(after) = trimmed.strip_prefix(open_tag) else {
                            return out;
                        };
                        let Some((key, _)) = after.split_once('>') else {
                            return out;
                        };
                        let header_end =
                            buffer.len() - trimmed.len() + open_tag.len() + key.len() + 1;
                        let key = key.trim();
                        let kind = self.types.as_ref().and_then(|t| t.get(key)).cloned();
                        let text =
                            matches!(kind.as_deref(), None | Some("string" | "str" | "text"));
                        let typed = if text {
                            out.push_str(&member_start(*first, key));
                            out.push('"');
                            *first = false;
                            None
                        } else {
                            Some((key.to_string(), kind))
                        };
                        *open = Some(OpenParam {
                            header_end,
                            value: None,
                            sent: 0,
                            searched: 0,
                            typed,
                        });
                    }
                },
            }
        }
    }

    /// `{` for the XML form, sent with the name (the arguments begin there).
    pub(super) fn opening(&self) -> &'static str {
        match self.scan {
            Scan::Xml { .. } => "{",
            _ => "",
        }
    }
}

/// The head of a JSON-form call, `{"name": "NAME", "arguments":`: the name (unescaped
/// names only), and the text after the colon (and the whitespace after it).
pub(super) fn json_call_head(inner: &str) -> Option<(&str, &str)> {
    let field = |text: &str, key: &str| -> Option<usize> {
        let rest = text
            .trim_start()
            .strip_prefix(key)?
            .trim_start()
            .strip_prefix(':')?;
        Some(text.len() - rest.trim_start().len())
    };
    let text = inner.trim_start().strip_prefix('{')?;
    let text = &text[field(text, "\"name\"")?..];
    let (name, text) = text.strip_prefix('"')?.split_once('"')?;
    if name.contains('\\') {
        return None;
    }
    let text = text.trim_start().strip_prefix(',')?;
    Some((name, &text[field(text, "\"arguments\"")?..]))
}

/// `"key":`, after a comma unless it is the first member.
fn member_start(first: bool, key: &str) -> String {
    format!("{}{}:", if first { "" } else { "," }, Value::from(key))
}

/// A parameter's text without the newline on either side.
fn trim_value(raw: &str) -> &str {
    let raw = raw.strip_prefix('\n').unwrap_or(raw);
    raw.strip_suffix('\n').unwrap_or(raw)
}

/// Reads an open parameter's value as far as `buffer` goes; for a string, sends what is
/// settled of it (not what may yet be the newline and tag that close it). When its closing
/// tag came: the raw value (with the closing newline) and the byte after the tag.
fn read_open_param<'b>(
    buffer: &'b str,
    param: &mut OpenParam,
    close: &str,
    out: &mut String,
) -> Option<(&'b str, usize)> {
    let value_start = match param.value {
        Some(v) => v,
        None => {
            if buffer.len() <= param.header_end {
                return None;
            }
            let v = param.header_end + usize::from(buffer[param.header_end..].starts_with('\n'));
            param.value = Some(v);
            v
        }
    };
    let value = &buffer[value_start..];
    let from = floor_boundary(value, param.searched.saturating_sub(close.len() - 1));
    if let Some(found) = value[from..].find(close) {
        let end = from + found;
        let raw = &value[..end];
        if param.typed.is_none() {
            let text = raw.strip_suffix('\n').unwrap_or(raw);
            out.push_str(&escaped(&text[param.sent.min(text.len())..]));
            out.push('"');
        }
        return Some((raw, value_start + end + close.len()));
    }
    param.searched = value.len();
    if param.typed.is_none() {
        let after_newline = format!("\n{close}");
        let settled =
            value.len() - super::held_back(value, &[(after_newline.as_str(), 0), (close, 0)]);
        if settled > param.sent {
            out.push_str(&escaped(&value[param.sent..settled]));
            param.sent = settled;
        }
    }
    None
}

/// The largest char boundary of `text` at or below `at`.
pub(super) fn floor_boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// `text` as it reads inside a JSON string (escaping is per character, so pieces escaped
/// apart join to the whole escaped).
fn escaped(text: &str) -> String {
    let quoted = Value::from(text).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

/// A JSON value compacted as it is read (the whitespace between its tokens dropped), up to
/// its last character.
#[derive(Debug, Default)]
pub(super) struct Compactor {
    depth: usize,
    in_string: bool,
    escaped: bool,
    done: bool,
}

impl Compactor {
    /// Reads more of the value, writing its compacted text to `out`.
    pub(super) fn feed(&mut self, text: &str, out: &mut String) {
        if self.done {
            return;
        }
        for c in text.chars() {
            if self.in_string {
                out.push(c);
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            if c.is_whitespace() {
                continue;
            }
            out.push(c);
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 0 {
                        self.done = true;
                        return;
                    }
                }
                _ => {}
            }
        }
    }
}
