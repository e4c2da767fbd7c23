//! Qwen's real chat templates (Qwen3, Qwen3-Coder, Qwen3.5: fetched by
//! `scripts/fetch_templates.sh`, not committed) render every conversation of
//! `tests/fixtures/templates` byte for byte as transformers' `apply_chat_template` did
//! (`scripts/template_parity.py` wrote the expected strings). The templates are looked for
//! in `CORRAL_TEMPLATES_DIR` (default `target/qwen-templates`); without them the test says
//! so and passes, unless `CORRAL_REQUIRE_TEMPLATES` is set (CI fetches and requires them).

use std::path::{Path, PathBuf};

use corral_engine::{ChatTemplate, TokenizerConfig};
use serde_json::{Map, Value};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where `a` and `b` first differ, with a little of each around it.
fn first_difference(a: &str, b: &str) -> String {
    let at = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i);
    let around = |s: &str| {
        let start = s.floor_char_boundary(at.saturating_sub(40));
        let end = s.ceil_char_boundary((at + 40).min(s.len()));
        s[start..end].to_string()
    };
    format!("at byte {at}: ours {:?} against {:?}", around(a), around(b))
}

fn templates_dir() -> PathBuf {
    std::env::var_os("CORRAL_TEMPLATES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("target/qwen-templates"))
}

/// A fetched template's source; `None` (said) where it is missing and not required.
fn template_source(name: &str) -> Option<String> {
    let path = templates_dir().join(name);
    let Ok(source) = std::fs::read_to_string(&path) else {
        assert!(
            std::env::var_os("CORRAL_REQUIRE_TEMPLATES").is_none(),
            "{} is missing (scripts/fetch_templates.sh fetches it)",
            path.display()
        );
        eprintln!(
            "skipped: {} is missing (run scripts/fetch_templates.sh)",
            path.display()
        );
        return None;
    };
    Some(source)
}

/// A fetched template compiled; `None` (said) where it is missing and not required.
fn fetched_template(name: &str) -> Option<ChatTemplate> {
    let source = template_source(name)?;
    let config = TokenizerConfig {
        chat_template: Some(source),
        ..TokenizerConfig::default()
    };
    Some(ChatTemplate::new(&config).unwrap_or_else(|e| panic!("{name}: {e}")))
}

/// System and developer messages in the numbers and places agent clients send them (Codex's
/// two developer items before the user's, Claude Code's system message after it, two system
/// messages, one between a tool result and the next turn) render with every real template,
/// and no system text is lost.
#[test]
fn system_messages_anywhere_render_with_every_template() {
    let user = serde_json::json!({"role": "user", "content": "list the files here"});
    let system = |text: &str| serde_json::json!({"role": "system", "content": text});
    let developer = |text: &str| serde_json::json!({"role": "developer", "content": text});
    let conversations = [
        vec![
            developer("permissions: read-only"),
            developer("environment: /work"),
            user.clone(),
        ],
        vec![
            system("You are Claude Code."),
            user.clone(),
            system("deferred tools: Read, Bash"),
        ],
        vec![
            system("Be brief."),
            system("Answer in English."),
            user.clone(),
        ],
        vec![user.clone(), system("a late reminder")],
        vec![
            system("Be brief."),
            user.clone(),
            serde_json::json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "ls", "arguments": {"path": "."}}}]}),
            serde_json::json!({"role": "tool", "content": "a.txt"}),
            system("tool results may be stale"),
            serde_json::json!({"role": "user", "content": "and now?"}),
        ],
    ];
    for name in [
        "Qwen-Qwen3-0.6B.jinja",
        "Qwen3-Coder.jinja",
        "Qwen3.5-4B.jinja",
    ] {
        let Some(template) = fetched_template(name) else {
            return;
        };
        for messages in &conversations {
            let text = template
                .render(messages, None, true, &Map::new())
                .unwrap_or_else(|e| panic!("{name} {messages:?}: {e}"));
            for m in messages {
                let said = m["content"].as_str().unwrap_or_default();
                assert!(text.contains(said), "{name}: {said:?} lost from {text:?}");
            }
        }
    }
}

#[test]
fn qwen_templates_render_as_transformers_does() {
    let fixtures = repo().join("tests/fixtures/templates");
    let expected = read_json(&fixtures.join("expected.json"));
    let cases = read_json(&fixtures.join("conversations.json"));
    let Some(expected) = expected.as_array() else {
        panic!("expected.json is not a list");
    };
    let mut compared = 0;
    let mut failures = Vec::new();
    for e in expected {
        let name = e["template"].as_str().unwrap_or_default();
        let Some(template) = fetched_template(name) else {
            return;
        };
        let case = cases
            .as_array()
            .and_then(|c| c.iter().find(|c| c["name"] == e["case"]))
            .unwrap_or_else(|| panic!("no case {}", e["case"]));
        let messages = case["messages"].as_array().cloned().unwrap_or_default();
        let tools = case["tools"].as_array().cloned();
        let kwargs: Map<String, Value> = e["kwargs"].as_object().cloned().unwrap_or_default();
        let add = e["add_generation_prompt"].as_bool().unwrap_or(true);
        let what = format!(
            "{name} {} {kwargs:?} add_generation_prompt {add}",
            e["case"]
        );
        match template.render(&messages, tools.as_deref(), add, &kwargs) {
            Ok(ours) => {
                let theirs = e["rendered"].as_str().unwrap_or_default();
                if ours != theirs {
                    failures.push(format!("{what}: {}", first_difference(&ours, theirs)));
                }
            }
            Err(err) => failures.push(format!("{what}: {err}")),
        }
        compared += 1;
    }
    assert!(
        failures.is_empty(),
        "{} of {compared} renderings differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(compared, expected.len());
}
