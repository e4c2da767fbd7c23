#!/usr/bin/env python3
"""Sends the held-out tool requests (make_data.py's tool_requests.jsonl) to a running
`corral serve` over its OpenAI chat API with the demo tools, unconstrained (tool_choice
`auto`), and counts: replies that make a well-formed call (a known tool, its required
arguments, parsed by the server from the template's XML form), calls that match the expected
one, and, after the tool's result is sent back, replies that use it (name a line of it).

    corral serve --model models/corral-demo --port 8080 &
    python3 scripts/train/eval_tools.py --server http://127.0.0.1:8080 --requests .train/data/tool_requests.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corral_train import chat  # noqa: E402


def post(server: str, body: dict) -> dict:
    request = urllib.request.Request(f"{server}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def well_formed(call: dict) -> bool:
    """A call naming an offered tool with its required arguments, as JSON."""
    required = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in chat.TOOLS}
    fn = call.get("function", {})
    try:
        arguments = json.loads(fn.get("arguments", ""))
    except json.JSONDecodeError:
        return False
    return fn.get("name") in required and isinstance(arguments, dict) and all(k in arguments for k in required[fn["name"]])


def uses(reply: str, tool_result: str) -> bool:
    """Whether the reply names at least one non-empty line of the tool's result."""
    lines = [l.strip() for l in tool_result.splitlines() if l.strip()]
    return any(l.rstrip("/") in reply for l in lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", default="http://127.0.0.1:8080")
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--show", type=int, default=3, help="print this many exchanges in full")
    args = parser.parse_args()
    requests = [json.loads(line) for line in args.requests.read_text().splitlines() if line.strip()]
    counts = {"requests": len(requests), "well_formed_call": 0, "expected_call": 0, "used_result": 0}
    for k, req in enumerate(requests):
        body = {"messages": req["messages"], "tools": chat.TOOLS, "max_tokens": args.max_tokens, "temperature": 0}
        first = post(args.server, body)["choices"][0]
        calls = first["message"].get("tool_calls") or []
        if k < args.show:
            print(json.dumps({"request": req["messages"][-1]["content"], "reply": first["message"]}, indent=1))
        if not calls or not well_formed(calls[0]):
            continue
        counts["well_formed_call"] += 1
        fn = calls[0]["function"]
        if fn["name"] == req["expected"]["name"] and json.loads(fn["arguments"]) == req["expected"]["arguments"]:
            counts["expected_call"] += 1
        followup = req["messages"] + [
            {"role": "assistant", "content": None, "tool_calls": [calls[0]]},
            {"role": "tool", "tool_call_id": calls[0].get("id", "call_0"), "content": req["tool_result"]},
        ]
        second = post(args.server, dict(body, messages=followup))["choices"][0]
        reply = second["message"].get("content") or ""
        if k < args.show:
            print(json.dumps({"tool_result": req["tool_result"], "reply": reply}, indent=1))
        if uses(reply, req["tool_result"]):
            counts["used_result"] += 1
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
