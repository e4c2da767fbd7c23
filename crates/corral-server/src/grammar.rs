//! What a request demands of its output's form, as a grammar for the engine's constrained
//! decoding: `response_format` (any JSON object, or a document of a JSON schema) and
//! `tool_choice` "required" or a named function (tool calls in the model's own format).

use corral_engine::{Grammar, json_style};
use serde_json::Value;

use crate::error::ApiError;
use crate::request::Tool;
use crate::syntax::{CallForm, OutputSyntax, XmlTags};

/// The grammar of one or more tool calls (only to `only` if given; one call unless
/// `parallel`), written as the model writes them; `special`: whether a tag is one special
/// token of the vocabulary.
pub(crate) fn tool_calls(
    tools: &[Tool],
    only: Option<&str>,
    syntax: &OutputSyntax,
    parallel: bool,
    special: &dyn Fn(&str) -> bool,
) -> Result<Grammar, ApiError> {
    let (open, close) = (
        tag(syntax.tool_call.open, special),
        tag(syntax.tool_call.close, special),
    );
    let functions: Vec<(&str, &Value)> = tools
        .iter()
        .map(|t| (t.name.as_str(), &t.parameters))
        .filter(|(name, _)| only.is_none_or(|o| o == *name))
        .collect();
    if functions.is_empty() {
        return Err(match only {
            Some(name) => ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names `{name}`, which is not among `tools`"),
            ),
            None => ApiError::invalid("tool_choice", "`tool_choice` \"required\" needs `tools`"),
        });
    }
    let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
    let mut lark = format!("start: call{repeat}\n");
    let names: Vec<String> = (0..functions.len()).map(|i| format!("f{i}")).collect();
    let (between, after) = match syntax.form {
        CallForm::Json => ("\"\\n\"", "\"\\n\""),
        CallForm::Xml => ("\"\\n\"", ""),
    };
    lark.push_str(&format!(
        "call: {open} {between} ({}) {after} {close}\n",
        names.join(" | ")
    ));
    for (i, (name, parameters)) in functions.iter().enumerate() {
        match syntax.form {
            // Each tool's schema is a root of its own, so that its `$ref`s resolve.
            CallForm::Json => {
                let head = format!("{{\"name\": {}, \"arguments\": ", Value::from(*name));
                lark.push_str(&format!(
                    "f{i}: {} %json {} \"}}\"\n",
                    literal(&head),
                    json_style(parameters, true)
                ));
            }
            CallForm::Xml => xml_function(&mut lark, i, name, parameters, &syntax.xml),
        }
    }
    Ok(Grammar::Lark(lark))
}

/// Rule `f{i}` of one function in the XML form: its parameters in the schema's order, the
/// required ones always, each at most once, each value held to its schema ([`xml_value`]).
fn xml_function(lark: &mut String, i: usize, name: &str, parameters: &Value, xml: &XmlTags) {
    let required: Vec<&str> = parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let properties = parameters.get("properties").and_then(Value::as_object);
    let mut body = String::new();
    for (j, (key, schema)) in properties.into_iter().flatten().enumerate() {
        let open = literal(&format!("{}{key}>\n", xml.parameter_open));
        let value = xml_value(lark, &format!("v{i}_{j}"), schema, parameters, xml);
        lark.push_str(&format!("p{i}_{j}: {open} {value}\n"));
        let optional = if required.contains(&key.as_str()) {
            ""
        } else {
            "?"
        };
        body.push_str(&format!("p{i}_{j}{optional} "));
    }
    lark.push_str(&format!(
        "f{i}: {} {body}{}\n",
        literal(&format!("{}{name}>\n", xml.function_open)),
        literal(&format!("{}\n", xml.function_close))
    ));
}

/// The grammar of one XML-form parameter value and its closing tag, as the output parser
/// types it back (`output::typed_value`) and as the template writes one (a string as its
/// text, anything else as JSON):
/// - a string's text, as long as `minLength`/`maxLength` allow, or one of its `enum` or
///   `const` values;
/// - any other value JSON of its schema (numbers and integers in their bounds, booleans,
///   nested objects and arrays), its `$ref`s resolved against the tool's `$defs`.
///
/// Rules it needs are added to `lark` under names starting with `name`.
fn xml_value(lark: &mut String, name: &str, schema: &Value, root: &Value, xml: &XmlTags) -> String {
    let close = literal(&format!("\n{}\n", xml.parameter_close));
    let choices: Option<Vec<&Value>> = match (schema.get("const"), schema.get("enum")) {
        (Some(c), _) => Some(vec![c]),
        (None, Some(Value::Array(values))) => Some(values.iter().collect()),
        _ => None,
    };
    if let Some(choices) = &choices
        && !choices.is_empty()
        && choices.iter().all(|v| v.is_string())
    {
        let alternatives: Vec<String> = choices
            .iter()
            .filter_map(|v| v.as_str())
            .map(literal)
            .collect();
        return format!("({}) {close}", alternatives.join(" | "));
    }
    if choices.is_none() && crate::output::is_text_value(schema) {
        let count = |key: &str| schema.get(key).and_then(Value::as_u64);
        let length = match (count("minLength"), count("maxLength")) {
            (None, None) => "*".to_string(),
            (min, None) => format!("{{{},}}", min.unwrap_or(0)),
            (min, Some(max)) => format!("{{{},{max}}}", min.unwrap_or(0).min(max)),
        };
        lark.push_str(&format!("{name}[suffix={close}]: /(?s:.{length})/\n"));
        return name.to_string();
    }
    format!(
        "%json {} {close}",
        json_style(&with_defs(schema, root), true)
    )
}

/// A parameter's schema as a root of its own: the tool schema's `$defs` and `definitions`
/// copied in, so that its `$ref`s resolve.
fn with_defs(schema: &Value, root: &Value) -> Value {
    let mut schema = schema.clone();
    if let Value::Object(map) = &mut schema {
        for key in ["$defs", "definitions"] {
            if let Some(defs) = root.get(key)
                && !map.contains_key(key)
            {
                map.insert(key.to_string(), defs.clone());
            }
        }
    }
    schema
}

/// `grammar` after the model closes the reasoning its prompt opened (the closing tag and a
/// blank line, as the templates write a closed block).
pub(crate) fn after_reasoning(
    grammar: Grammar,
    syntax: &OutputSyntax,
    special: &dyn Fn(&str) -> bool,
) -> Grammar {
    let close = format!("{} \"\\n\\n\"", tag(syntax.reasoning.close, special));
    match grammar {
        Grammar::JsonSchema(schema) => Grammar::Lark(format!(
            "start: {close} %json {}\n",
            json_style(&schema, false)
        )),
        Grammar::Lark(lark) => Grammar::Lark(format!(
            "start: {close} body\n{}",
            lark.replacen("start:", "body:", 1)
        )),
    }
}

/// `text` in a grammar: the special token by name, else the quoted text.
fn tag(text: &str, special: &dyn Fn(&str) -> bool) -> String {
    if special(text) {
        text.to_string()
    } else {
        literal(text)
    }
}

/// A Lark string literal of `text`.
fn literal(text: &str) -> String {
    Value::String(text.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use corral_engine::{Constraint, Tokenizer};
    use serde_json::json;

    use super::*;
    use crate::syntax::{QWEN3, QWEN3_CODER};

    fn tokenizer() -> (Tokenizer, u32) {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/tiny-qwen3-moe");
        let tok = Tokenizer::from_file(&std::path::Path::new(dir).join("tokenizer.json")).unwrap();
        let eos = tok.token_id("<|im_end|>").unwrap();
        (tok, eos)
    }

    fn special(text: &str) -> bool {
        let (tok, eos) = tokenizer();
        tok.grammar_compiler(&[eos]).unwrap().is_special_token(text)
    }

    /// Whether `grammar` lets `text` through token by token and then allows the end.
    fn accepts(grammar: &Grammar, text: &str) -> bool {
        let (tok, eos) = tokenizer();
        let mut c: Constraint = tok
            .grammar_compiler(&[eos])
            .unwrap()
            .compile(grammar)
            .unwrap();
        // The tiny model's vocabulary (config.json), past the tokenizer's.
        let vocab = 1600;
        let mut logits = vec![0.0f32; vocab];
        for t in tok.encode(text).unwrap() {
            logits.fill(0.0);
            c.mask_logits(&mut logits).unwrap();
            if logits[t as usize] == f32::NEG_INFINITY {
                return false;
            }
            if c.accept(t).unwrap() {
                // Complete: nothing may follow.
                return true;
            }
        }
        logits.fill(0.0);
        c.mask_logits(&mut logits).unwrap();
        logits[eos as usize] != f32::NEG_INFINITY
    }

    /// Tools from their OpenAI definitions.
    fn as_tools(definitions: Vec<Value>) -> Vec<Tool> {
        definitions
            .into_iter()
            .map(|d| Tool {
                name: d["function"]["name"].as_str().unwrap().to_string(),
                parameters: d["function"]["parameters"].clone(),
                definition: d,
            })
            .collect()
    }

    fn weather() -> Vec<Tool> {
        as_tools(vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"zone": {"type": "string"}}}}}),
        ])
    }

    #[test]
    fn json_tool_calls_take_a_known_name_and_valid_arguments() {
        let any = tool_calls(&weather(), None, &QWEN3, true, &special).unwrap();
        let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>";
        assert!(accepts(&any, call));
        assert!(accepts(&any, &format!("{call}\n{call}")));
        let unknown = call.replace("get_weather", "get_wether");
        assert!(!accepts(&any, &unknown));
        let bad_args = call.replace("3}", "\"three\"}");
        assert!(!accepts(&any, &bad_args));
        assert!(!accepts(&any, "Sure, let me check."));
        let named = tool_calls(&weather(), Some("get_time"), &QWEN3, false, &special).unwrap();
        assert!(!accepts(&named, call));
        assert!(accepts(
            &named,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"UTC\"}}\n</tool_call>"
        ));
        assert!(tool_calls(&weather(), Some("nope"), &QWEN3, true, &special).is_err());
    }

    #[test]
    fn xml_tool_calls_take_a_known_function_and_parameters() {
        let any = tool_calls(&weather(), None, &QWEN3_CODER, true, &special).unwrap();
        let call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n</function>\n</tool_call>";
        assert!(accepts(&any, call));
        assert!(!accepts(&any, &call.replace("=city>", "=town>")));
        assert!(!accepts(&any, &call.replace("get_weather", "get_wether")));
        // Text values may hold `<` and newlines; other values are JSON of their schema.
        let code = call.replace("San José", "if a < b:\n    <b>x</b>");
        assert!(accepts(&any, &code));
        let days = "<parameter=days>\n3\n</parameter>\n</function>";
        let with_days = call.replacen("</function>", days, 1);
        assert!(accepts(&any, &with_days));
        assert!(!accepts(&any, &with_days.replace("\n3\n", "\nthree\n")));
        // The required parameter cannot be left out, nor one given twice.
        let no_city = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        assert!(!accepts(&any, no_city));
        let twice = call.replacen(
            "</function>",
            "<parameter=city>\nOslo\n</parameter>\n</function>",
            1,
        );
        assert!(!accepts(&any, &twice));
    }

    /// Each XML-form value follows its schema: a string's length and enum, an integer's
    /// syntax and bounds, a boolean, a nested object and an array as JSON (its `$ref`s
    /// resolved), and a free string any text.
    #[test]
    fn xml_parameter_values_follow_their_schemas() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "plan", "parameters": {
            "$defs": {"Place": {"type": "object", "properties": {"name": {"type": "string"},
                "lat": {"type": "number"}}, "required": ["name"], "additionalProperties": false}},
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 5},
                "unit": {"type": "string", "enum": ["C", "F"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "where": {"$ref": "#/$defs/Place"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "exact": {"type": "boolean"},
                "note": {"type": "string"}},
            "required": ["city"]}}}),
        ];
        let g = tool_calls(&as_tools(tools), None, &QWEN3_CODER, false, &special).unwrap();
        let call = |params: &[(&str, &str)]| {
            let mut text = "<tool_call>\n<function=plan>\n".to_string();
            for (k, v) in params {
                text.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
            }
            text + "</function>\n</tool_call>"
        };
        let ok = |params: &[(&str, &str)]| accepts(&g, &call(params));
        assert!(ok(&[("city", "Paris")]));
        assert!(!ok(&[("city", "Lisbon")]), "maxLength");
        assert!(!ok(&[("city", "X")]), "minLength");
        assert!(ok(&[("city", "Oslo"), ("unit", "F")]));
        assert!(!ok(&[("city", "Oslo"), ("unit", "K")]), "enum");
        assert!(ok(&[("city", "Oslo"), ("days", "14")]));
        assert!(!ok(&[("city", "Oslo"), ("days", "15")]), "maximum");
        assert!(!ok(&[("city", "Oslo"), ("days", "2.5")]), "integer");
        assert!(!ok(&[("city", "Oslo"), ("days", "two")]), "integer");
        let place = r#"{"name": "Oslo", "lat": 59.9}"#;
        assert!(ok(&[("city", "Oslo"), ("where", place)]));
        assert!(
            !ok(&[("city", "Oslo"), ("where", r#"{"lat": 59.9}"#)]),
            "required"
        );
        assert!(!ok(&[("city", "Oslo"), ("where", "Oslo")]), "object");
        assert!(ok(&[("city", "Oslo"), ("tags", r#"["a", "b"]"#)]));
        assert!(!ok(&[("city", "Oslo"), ("tags", "a, b")]), "array");
        assert!(ok(&[("city", "Oslo"), ("exact", "true")]));
        assert!(!ok(&[("city", "Oslo"), ("exact", "yes")]), "boolean");
        assert!(ok(&[("city", "Oslo"), ("note", "any <text>\n at all")]));
    }

    #[test]
    fn a_tool_schema_with_refs_compiles_and_holds() {
        // As pydantic writes nested models: `$defs` at the schema's root, `$ref` below.
        let tools = vec![
            json!({"type": "function", "function": {"name": "book", "parameters": {
            "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"], "additionalProperties": false}},
            "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"}},
            "required": ["to"], "additionalProperties": false}}}),
        ];
        let g = tool_calls(&as_tools(tools), None, &QWEN3, false, &special).unwrap();
        let call = "<tool_call>\n{\"name\": \"book\", \"arguments\": {\"to\": {\"city\": \"Oslo\"}}}\n</tool_call>";
        assert!(accepts(&g, call));
        assert!(!accepts(&g, &call.replace("city", "town")));
    }

    #[test]
    fn a_json_schema_holds_after_the_reasoning_closes() {
        let schema = Grammar::JsonSchema(json!({"type": "object",
            "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": false}));
        assert!(accepts(&schema, "{\"ok\": true}"));
        assert!(!accepts(&schema, "{\"ok\":true}"));
        assert!(!accepts(&schema, "{\"ok\": 1}"));
        assert!(special("</think>") && !special("<function=f>"));
        let closed = after_reasoning(schema, &QWEN3, &special);
        assert!(accepts(&closed, "</think>\n\n{\"ok\": false}"));
        assert!(!accepts(&closed, "{\"ok\": false}"));
    }
}
