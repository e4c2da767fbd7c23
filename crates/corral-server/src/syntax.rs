//! How a model writes its reasoning and its tool calls, as data: the tags around each, the
//! form of a call's inside, and which form a required call's grammar holds the model to. One
//! [`OutputSyntax`] is chosen per served model from [`REGISTRY`] (by its chat template, or
//! by name with `serve --output-syntax`); the output parser, the tool-call grammar and the
//! prompt's reasoning check read it, so a new family's syntax is an entry here.

/// A pair of tags around a span of output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    /// The opening tag.
    pub open: &'static str,
    /// The closing tag.
    pub close: &'static str,
}

/// The form of a tool call's inside that the grammar of a required call demands (the parser
/// reads either form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallForm {
    /// `{"name": NAME, "arguments": {...}}` (Qwen3).
    Json,
    /// `<function=NAME>`, then `<parameter=KEY>VALUE</parameter>`s, then `</function>`
    /// (Qwen3.5, Qwen3-Coder), each value typed by the tool's schema.
    Xml,
}

/// The tags of the XML call form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XmlTags {
    /// Opens a function, its name following up to `>`.
    pub function_open: &'static str,
    /// Closes a function.
    pub function_close: &'static str,
    /// Opens a parameter, its key following up to `>`.
    pub parameter_open: &'static str,
    /// Closes a parameter.
    pub parameter_close: &'static str,
}

/// How one model family writes reasoning and tool calls.
#[derive(Debug, PartialEq, Eq)]
pub struct OutputSyntax {
    /// The name `serve --output-syntax` takes.
    pub name: &'static str,
    /// The reasoning's tags; the prompt leaves the reply inside them when it ends with the
    /// opening one.
    pub reasoning: Tags,
    /// The tags around each tool call.
    pub tool_call: Tags,
    /// The XML form's tags (calls of that form are read whatever `form` is).
    pub xml: XmlTags,
    /// The form a required call's grammar holds the model to.
    pub form: CallForm,
}

const QWEN_REASONING: Tags = Tags {
    open: "<think>",
    close: "</think>",
};
const QWEN_TOOL_CALL: Tags = Tags {
    open: "<tool_call>",
    close: "</tool_call>",
};
const QWEN_XML: XmlTags = XmlTags {
    function_open: "<function=",
    function_close: "</function>",
    parameter_open: "<parameter=",
    parameter_close: "</parameter>",
};

/// Qwen3: `<think>` reasoning, JSON calls in `<tool_call>`.
pub static QWEN3: OutputSyntax = OutputSyntax {
    name: "qwen3",
    reasoning: QWEN_REASONING,
    tool_call: QWEN_TOOL_CALL,
    xml: QWEN_XML,
    form: CallForm::Json,
};

/// Qwen3.5, Qwen3.6 and Qwen3-Coder: `<think>` reasoning, XML calls in `<tool_call>`.
pub static QWEN3_CODER: OutputSyntax = OutputSyntax {
    name: "qwen3-coder",
    reasoning: QWEN_REASONING,
    tool_call: QWEN_TOOL_CALL,
    xml: QWEN_XML,
    form: CallForm::Xml,
};

/// A registry entry: a syntax and how a chat template shows that its model writes it.
pub struct Entry {
    /// The syntax.
    pub syntax: &'static OutputSyntax,
    /// Whether a chat template's source teaches this syntax.
    pub recognises: fn(&str) -> bool,
}

/// The syntaxes Corral knows, the first whose template test passes winning; the last is the
/// fallback.
pub static REGISTRY: &[Entry] = &[
    Entry {
        syntax: &QWEN3_CODER,
        recognises: |template| template.contains(QWEN_XML.function_open),
    },
    Entry {
        syntax: &QWEN3,
        recognises: |_| true,
    },
];

/// The syntax a chat template teaches its model (the fallback without a template).
pub fn for_template(source: Option<&str>) -> &'static OutputSyntax {
    let source = source.unwrap_or_default();
    REGISTRY
        .iter()
        .find(|e| (e.recognises)(source))
        .map_or(&QWEN3, |e| e.syntax)
}

/// The syntax of this name, or the names there are.
pub fn by_name(name: &str) -> Result<&'static OutputSyntax, String> {
    REGISTRY
        .iter()
        .map(|e| e.syntax)
        .find(|s| s.name == name)
        .ok_or_else(|| {
            let names: Vec<&str> = REGISTRY.iter().map(|e| e.syntax.name).collect();
            format!(
                "unknown output syntax `{name}`; known: {}",
                names.join(", ")
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The repository's Qwen3 template picks Qwen3's syntax; a template teaching the XML
    /// form (as Qwen3.5's does) picks Qwen3-Coder's; one that shows neither, or none, falls
    /// back to Qwen3's.
    #[test]
    fn templates_choose_their_syntax() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/tiny-qwen3-moe");
        let qwen3 = corral_engine::TokenizerConfig::from_dir(&dir).unwrap();
        assert_eq!(for_template(qwen3.chat_template.as_deref()), &QWEN3);
        let qwen35 = "{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}";
        assert_eq!(for_template(Some(qwen35)), &QWEN3_CODER);
        assert_eq!(for_template(Some("{{ messages }}")), &QWEN3);
        assert_eq!(for_template(None), &QWEN3);
        assert_eq!(by_name("qwen3-coder"), Ok(&QWEN3_CODER));
        assert!(
            by_name("glm")
                .unwrap_err()
                .contains("known: qwen3-coder, qwen3")
        );
    }
}
