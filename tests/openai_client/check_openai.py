"""The official `openai` Python client against `corral serve` on the repo's demo model.

Usage: python check_openai.py CORRAL_BINARY MODEL_DIR

Starts the server on a free port with an API key, then runs a chat completion, a streamed
chat completion with `include_usage`, a tool-call round trip (tool definitions in, an
assistant tool call and its result back), a call forced by `tool_choice="required"` and
answered, structured output parsed by the client (`chat.completions.parse`,
`responses.parse`, LangChain's `with_structured_output`), a text completion, and error
mapping. The demo model has random weights, so the text itself is gibberish; the checks are
on the protocol, and on the grammar holding the gibberish to the schema.
Prints one line per check and a final `N passed, M failed` line; exits non-zero on failure.
"""

import json
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

from typing import Literal

import openai
from pydantic import BaseModel, Field

API_KEY = "corral-test-key"
MODEL = "tiny-qwen3-moe"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(binary, model_dir, port):
    process = subprocess.Popen(
        [binary, "serve", "--model", model_dir, "--port", str(port), "--threads", "2",
         "--api-key", API_KEY, "--served-model-name", MODEL, "--kv-memory", "64M"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError("server exited: " + process.stderr.read().decode(errors="replace"))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return process
        except OSError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("server did not become healthy")


def check_chat(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    assert r.object == "chat.completion", r
    assert isinstance(r.choices[0].message.content, str), r
    assert r.choices[0].finish_reason in ("stop", "length"), r
    assert r.usage.completion_tokens >= 1 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, r


def check_stream(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three"}], max_tokens=6,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] or finishes == ["stop"], finishes
    assert chunks[-1].choices == [] and chunks[-1].usage is not None, chunks[-1]
    assert chunks[-1].usage.completion_tokens >= 1, chunks[-1].usage
    assert isinstance(text, str)


def check_tool_round_trip(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    plain = client.chat.completions.create(model=MODEL, messages=question, max_tokens=2)
    first = client.chat.completions.create(
        model=MODEL, messages=question, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=4)
    # The tool definitions reach the chat template: the prompt grows by their rendering.
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens + 20, (first.usage, plain.usage)
    calls = first.choices[0].message.tool_calls or []
    call_id = calls[0].id if calls else "call_weather_1"
    followup = question + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temperature_c": 7})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=followup, tools=[WEATHER_TOOL], max_tokens=4)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls"), second
    # The assistant call and the tool result are rendered into the prompt too.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10, (second.usage, first.usage)


class Forecast(BaseModel):
    """A reply with bounded fields, so that a random model's document ends."""
    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=14)
    units: Literal["metric", "imperial"]


# A city of at most 12 characters, so that a random model's call ends.
BOUNDED_WEATHER_TOOL = {"type": "function", "function": WEATHER_TOOL["function"] | {"parameters": {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}}}


def check_required_tool_call(client):
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=question, tools=[BOUNDED_WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False, max_tokens=64, temperature=0.8, seed=7)
    assert first.choices[0].finish_reason == "tool_calls", first
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather", call
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 12, arguments
    followup = question + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 7})},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=followup, tools=[BOUNDED_WEATHER_TOOL], max_tokens=4)
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10, (second.usage, first.usage)
    # Streamed: each call's name, then its arguments in pieces (by the call's index), add up to
    # valid calls; one call, so that no second one is cut by max_tokens.
    calls, finish = {}, None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=question, tools=[BOUNDED_WEATHER_TOOL], tool_choice="required",
            parallel_tool_calls=False, max_tokens=64, stream=True):
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or []:
            name, arguments = calls.get(delta.index, ("", ""))
            calls[delta.index] = (name + ((delta.function and delta.function.name) or ""),
                                  arguments + ((delta.function and delta.function.arguments) or ""))
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls, (finish, calls)
    for name, arguments in calls.values():
        assert name == "get_weather", calls
        assert isinstance(json.loads(arguments)["city"], str), arguments
    named = client.chat.completions.create(
        model=MODEL, messages=question, tools=[WEATHER_TOOL, BOUNDED_WEATHER_TOOL | {
            "function": BOUNDED_WEATHER_TOOL["function"] | {"name": "get_time"}}],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, max_tokens=64)
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"], named


def check_structured_output(client, port):
    messages = [{"role": "user", "content": "Forecast for Oslo, as JSON."}]
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=MODEL, messages=messages, response_format=Forecast, max_tokens=64)
    assert isinstance(parsed.choices[0].message.parsed, Forecast), parsed
    response = client.responses.parse(
        model=MODEL, input="Forecast for Oslo.", text_format=Forecast, max_output_tokens=64)
    assert isinstance(response.output_parsed, Forecast), response
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY,
                     max_tokens=64, max_retries=0)
    forecast = llm.with_structured_output(Forecast).invoke("Forecast for Oslo.")
    assert isinstance(forecast, Forecast), forecast


def check_responses(client):
    first = client.responses.create(
        model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0)
    assert first.object == "response" and isinstance(first.output_text, str), first
    assert first.status in ("completed", "incomplete"), first
    # A turn that continues the stored one: its prompt holds the first turn.
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input=[{"role": "user", "content": "And then?"}],
        max_output_tokens=4)
    assert second.usage.input_tokens > first.usage.input_tokens + 4, (first.usage, second.usage)
    assert client.responses.retrieve(first.id).id == first.id
    # Streamed, the same reply: its text deltas, and the response its last event carries
    # (response.incomplete where max_output_tokens cut it, as the API sends it).
    events = list(client.responses.create(
        model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0,
        stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events))), kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == first.output_text, (deltas, final.output_text, first.output_text)
    assert final.status == first.status, (final.status, first.status)
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
              "parameters": WEATHER_TOOL["function"]["parameters"]}]
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    asked = client.responses.create(model=MODEL, input=question, tools=tools, max_output_tokens=4)
    answered = client.responses.create(model=MODEL, tools=tools, max_output_tokens=4, input=question + [
        {"type": "function_call", "call_id": "call_weather_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Oslo"})},
        {"type": "function_call_output", "call_id": "call_weather_1", "output": json.dumps({"temperature_c": 7})},
    ])
    # The call and its output are rendered into the prompt.
    assert answered.usage.input_tokens > asked.usage.input_tokens + 10, (asked.usage, answered.usage)


def check_completion(client):
    r = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str), r
    assert r.usage.completion_tokens >= 1, r


def check_errors(client, port):
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.body["param"] == "model", e.body
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
        raise AssertionError("n=2 accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "n", e.body
    wrong_key = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0)
    try:
        wrong_key.models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError:
        pass
    assert [m.id for m in client.models.list().data] == [MODEL]


def main():
    binary, model_dir = sys.argv[1], sys.argv[2]
    port = free_port()
    server = start_server(binary, model_dir, port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0)
    checks = [
        ("chat completion", lambda: check_chat(client)),
        ("streamed chat completion with include_usage", lambda: check_stream(client)),
        ("tool call round trip", lambda: check_tool_round_trip(client)),
        ("tool_choice required (plain and streamed) and named, answered", lambda: check_required_tool_call(client)),
        ("structured output: chat parse, responses parse, LangChain", lambda: check_structured_output(client, port)),
        ("responses: input, previous_response_id, function-call round trip", lambda: check_responses(client)),
        ("text completion", lambda: check_completion(client)),
        ("errors and models", lambda: check_errors(client, port)),
    ]
    sys.exit(run_checks("openai client", checks, server))


def run_checks(label, checks, server):
    """Runs `checks` (name, function) one by one, then stops `server` with SIGTERM (which it
    must survive gracefully); prints a line per check and a summary; returns the exit code."""
    passed = failed = 0
    try:
        for name, check in checks:
            try:
                check()
                passed += 1
                print(f"{label}: {name} ... ok")
            except Exception:
                failed += 1
                print(f"{label}: {name} ... FAILED")
                traceback.print_exc()
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            failed += 1
            print(f"{label}: graceful shutdown on SIGTERM ... FAILED")
    print(f"{label}: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    main()
