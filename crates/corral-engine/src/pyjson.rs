//! JSON text as Python's `json.dumps` writes it, for the chat templates' `tojson` (transformers
//! overrides Jinja's with `json.dumps(x, ensure_ascii=False, indent=indent,
//! separators=separators, sort_keys=sort_keys)`): `", "` and `": "` separators (`","` between
//! items when indented), non-ASCII kept, nothing HTML-escaped, floats as Python's `repr`.

use serde_json::Value;

/// How to write: `indent` spaces per level (or one line), the item and key separators,
/// keys sorted or in their order.
#[derive(Clone, Debug)]
pub(crate) struct PyJsonStyle {
    pub(crate) indent: Option<usize>,
    pub(crate) item_separator: String,
    pub(crate) key_separator: String,
    pub(crate) sort_keys: bool,
}

impl PyJsonStyle {
    /// `json.dumps`' defaults for `indent` (its separators follow from it).
    pub(crate) fn new(indent: Option<usize>) -> Self {
        Self {
            indent,
            item_separator: if indent.is_some() { "," } else { ", " }.to_string(),
            key_separator: ": ".to_string(),
            sort_keys: false,
        }
    }
}

/// `value` as `json.dumps` writes it in `style`.
pub(crate) fn dumps(value: &Value, style: &PyJsonStyle) -> String {
    let mut out = String::new();
    write_value(&mut out, value, style, 0);
    out
}

fn newline(out: &mut String, style: &PyJsonStyle, level: usize) {
    if let Some(n) = style.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * level));
    }
}

fn write_value(out: &mut String, value: &Value, style: &PyJsonStyle, level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, style, level + 1);
                write_value(out, item, style, level + 1);
            }
            newline(out, style, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_separator);
                }
                newline(out, style, level + 1);
                write_string(out, key);
                out.push_str(&style.key_separator);
                write_value(out, item, style, level + 1);
            }
            newline(out, style, level);
            out.push('}');
        }
    }
}

/// A JSON string as Python escapes it with `ensure_ascii=False`: quotes, backslashes and
/// control characters (the short forms where JSON has them), everything else as it is.
fn write_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as Python's `repr`: the shortest digits that read back, in positional notation
/// with at least one decimal for exponents -4 to 15, else `d.ddde±XX`; `NaN` and `Infinity`
/// as `json.dumps` writes them.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_string();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    // `{:e}` gives the shortest round-trip digits: "1.2345e-5".
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    if (-4..16).contains(&exponent) {
        let mut s = format!("{f}");
        if !s.contains('.') {
            s.push_str(".0");
        }
        s
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Expected strings are what CPython 3.11's `json.dumps(..., ensure_ascii=False)` wrote.
    #[test]
    fn writes_what_python_writes() {
        let v: Value = serde_json::from_str(
            r#"{"name": "get_weather", "description": "Météo à <b>Paris</b> & 'ailleurs'", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}, "e": [], "o": {}, "n": null, "t": true, "ctl": "a\nb\t\u0001"}"#,
        )
        .unwrap();
        assert_eq!(
            dumps(&v, &PyJsonStyle::new(None)),
            r#"{"name": "get_weather", "description": "Météo à <b>Paris</b> & 'ailleurs'", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}, "e": [], "o": {}, "n": null, "t": true, "ctl": "a\nb\t\u0001"}"#
        );
        assert_eq!(
            dumps(
                &json!({"a": [1, {"b": "x"}], "c": {}}),
                &PyJsonStyle::new(Some(2))
            ),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": \"x\"\n    }\n  ],\n  \"c\": {}\n}"
        );
        let sorted = PyJsonStyle {
            sort_keys: true,
            ..PyJsonStyle::new(None)
        };
        assert_eq!(
            dumps(&json!({"b": 1, "a": 2}), &sorted),
            r#"{"a": 2, "b": 1}"#
        );
        let floats = json!([
            1.0,
            0.5,
            1e-5,
            1.5e16,
            123456789012345.6,
            -2.5e-7,
            100.0,
            1e22
        ]);
        assert_eq!(
            dumps(&floats, &PyJsonStyle::new(None)),
            "[1.0, 0.5, 1e-05, 1.5e+16, 123456789012345.6, -2.5e-07, 100.0, 1e+22]"
        );
    }
}
