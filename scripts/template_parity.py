#!/usr/bin/env python3
"""Expected renderings of Qwen's real chat templates, for Corral's template parity test.

    scripts/fetch_templates.sh /tmp/qwen-templates          # Qwen3, Qwen3-Coder, Qwen3.5
    pip install transformers jinja2                         # no torch needed
    python3 scripts/template_parity.py /tmp/qwen-templates tests/fixtures/templates

Renders every conversation of CASES through transformers' `apply_chat_template` with each
template, with and without the generation prompt and with thinking on and off, and writes
`conversations.json` (the cases) and `expected.json` (the rendered strings). The templates
themselves are fetched, not committed; `crates/corral-engine/tests/template_parity.rs`
renders the same cases with Corral and compares byte for byte.
"""

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast

TEMPLATES = ["Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "Qwen3.5-4B.jinja"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Météo actuelle d'une ville — température & vent <en °C>.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "Nom de la ville, p. ex. \"Zürich\""},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "options": {
                    "type": "object",
                    "properties": {
                        "units": {"type": "string", "enum": ["metric", "imperial"]},
                        "hourly": {"type": "boolean"},
                    },
                    "required": ["units"],
                },
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city"],
        },
    },
}

SEARCH = {
    "type": "function",
    "function": {
        "name": "search_files",
        "description": "Search the workspace for a pattern.",
        "parameters": {
            "type": "object",
            "properties": {"pattern": {"type": "string"}, "max_results": {"type": "integer"}},
            "required": ["pattern"],
        },
    },
}

CASES = [
    {
        "name": "plain",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello! ¿Qué tal?"},
        ],
    },
    {
        "name": "multi_turn_with_reasoning",
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3 + 3?"},
        ],
    },
    {
        "name": "tools_offered",
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "system", "content": "Use tools when they help."},
            {"role": "user", "content": "Weather in Zürich for 3 days?"},
        ],
    },
    {
        "name": "tool_call_and_result",
        "tools": [WEATHER, SEARCH],
        "messages": [
            {"role": "user", "content": "Weather in Zürich, metric, and find TODOs."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {
                                "city": "Zürich",
                                "days": 3,
                                "options": {"units": "metric", "hourly": False},
                                "tags": ["a", "b"],
                            },
                        },
                    },
                    {
                        "type": "function",
                        "function": {"name": "search_files", "arguments": {"pattern": "TODO"}},
                    },
                ],
            },
            {"role": "tool", "content": "{\"temp\": 21, \"wind\": \"calme\"}"},
            {"role": "tool", "content": "src/main.rs:12: TODO"},
            {"role": "user", "content": "Thanks. Summarise."},
        ],
    },
]

VARIANTS = [
    {"add_generation_prompt": True, "kwargs": {}},
    {"add_generation_prompt": True, "kwargs": {"enable_thinking": False}},
    {"add_generation_prompt": False, "kwargs": {}},
]


def main(templates_dir, out_dir):
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_file = Path(__file__).resolve().parent.parent / "models/tiny-qwen3-moe/tokenizer.json"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(tokenizer_file)))
    expected = []
    for name in TEMPLATES:
        template = (Path(templates_dir) / name).read_text()
        for case in CASES:
            for variant in VARIANTS:
                rendered = tokenizer.apply_chat_template(
                    case["messages"],
                    tools=case.get("tools"),
                    chat_template=template,
                    tokenize=False,
                    add_generation_prompt=variant["add_generation_prompt"],
                    **variant["kwargs"],
                )
                expected.append({"template": name, "case": case["name"], **variant,
                                 "rendered": rendered})
    (out / "conversations.json").write_text(json.dumps(CASES, ensure_ascii=False, indent=1) + "\n")
    (out / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(expected)} renderings of {len(CASES)} conversations by {len(TEMPLATES)} templates")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
