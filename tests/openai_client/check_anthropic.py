"""The official `anthropic` Python client against `corral serve` on the repo's demo model.

Usage: python check_anthropic.py CORRAL_BINARY MODEL_DIR

Starts the server on a free port with an API key (sent as x-api-key), then runs a message,
a streamed message, a tool_use / tool_result round trip, count_tokens, and error mapping.
The demo model has random weights, so the text is gibberish; the checks are on the protocol.
Prints one line per check and a final `N passed, M failed` line; exits non-zero on failure.
"""

import sys

import anthropic

from check_openai import API_KEY, MODEL, free_port, run_checks, start_server

# This client version has no temperature argument; the server reads it from the body.
GREEDY = {"temperature": 0}


def prompt_tokens(usage):
    """Input tokens, cached or not (Anthropic counts cache reads apart)."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def check_message(client):
    r = client.messages.create(
        model=MODEL, max_tokens=8, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "Hello"}])
    assert r.type == "message" and r.role == "assistant", r
    assert r.content and r.content[0].type == "text", r
    assert r.stop_reason in ("end_turn", "max_tokens"), r
    assert 1 <= r.usage.output_tokens <= 8 and r.usage.input_tokens > 0, r.usage


def check_stream(client):
    with client.messages.stream(
        model=MODEL, max_tokens=6, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count to three"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    plain = client.messages.create(
        model=MODEL, max_tokens=6, extra_body=GREEDY,
        messages=[{"role": "user", "content": "Count to three"}])
    assert final.stop_reason == plain.stop_reason, (final, plain)
    assert text == "".join(b.text for b in plain.content if b.type == "text"), (text, plain)


def check_tool_round_trip(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    plain = client.messages.count_tokens(model=MODEL, messages=question)
    first = client.messages.create(model=MODEL, max_tokens=4, messages=question, tools=[WEATHER_TOOL])
    # The tool definitions reach the chat template: the prompt grows by their rendering.
    assert prompt_tokens(first.usage) > plain.input_tokens + 20, (first.usage, plain)
    followup = question + [
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_weather_1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_weather_1", "content": "7 C, light rain"}]},
    ]
    second = client.messages.create(model=MODEL, max_tokens=4, messages=followup, tools=[WEATHER_TOOL])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use"), second
    # The assistant's call and the tool's result are rendered into the prompt too.
    assert prompt_tokens(second.usage) > prompt_tokens(first.usage) + 10, (second.usage, first.usage)


def check_errors(port):
    wrong = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="wrong", max_retries=0)
    try:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("wrong key accepted")
    except anthropic.AuthenticationError:
        pass
    right = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY, max_retries=0)
    try:
        right.messages.create(model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError:
        pass


def main():
    binary, model_dir = sys.argv[1], sys.argv[2]
    port = free_port()
    server = start_server(binary, model_dir, port)
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=API_KEY, max_retries=0)
    checks = [
        ("message", lambda: check_message(client)),
        ("streamed message", lambda: check_stream(client)),
        ("tool_use / tool_result round trip", lambda: check_tool_round_trip(client)),
        ("errors", lambda: check_errors(port)),
    ]
    sys.exit(run_checks("anthropic client", checks, server))


if __name__ == "__main__":
    main()
