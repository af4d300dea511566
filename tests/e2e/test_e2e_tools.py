"""Tool calling end to end through the ``openai`` client, on the default model on the CPU (its template renders no
tools, so Stride's own tool prompt and Hermes blocks are used): a named or required ``tool_choice`` always yields a
call whose arguments match the function's schema, streamed as ``delta.tool_calls`` too; a full round trip (call,
``tool`` message, final answer) goes through the chat template; ``tool_choice: none`` answers in text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from e2e_helpers import StrideServer

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS: dict[str, Any] = {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a UTC offset zone.",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[StrideServer]:
    with StrideServer("--max-num-seqs", "8", "--num-blocks", "512", "--max-model-len", "2048") as srv:
        yield srv
    assert srv.leftovers() == [], srv.tail()


@pytest.fixture(scope="module")
def client(server: StrideServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _check_call(name: str, arguments: str, allowed: set[str]) -> dict[str, Any]:
    assert name in allowed, name
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_named_and_required_choices_always_call(server: StrideServer, client: openai.OpenAI) -> None:
    for seed in range(6):
        choice: Any = "required" if seed % 2 else {"type": "function", "function": {"name": "get_time"}}
        allowed = set(SCHEMAS) if seed % 2 else {"get_time"}
        r = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=120, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.tool_calls and len(c.message.tool_calls) >= 1
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _check_call(call.function.name, call.function.arguments, allowed)


def test_streamed_calls_arrive_as_tool_call_deltas(server: StrideServer, client: openai.OpenAI) -> None:
    calls: list[Any] = []
    reason = None
    content = ""
    for chunk in client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, stream=True,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                max_tokens=120, temperature=0):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and len(calls) == 1 and calls[0].index == 0, (calls, content)
    _check_call(calls[0].function.name, calls[0].function.arguments, {"get_weather"})
    assert "<tool_call>" not in content  # the block went out as a call, not as text


def test_round_trip_through_the_template(server: StrideServer, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0)
    call = first.choices[0].message.tool_calls[0]  # type: ignore[index]
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model=server.model, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=60, temperature=0)
    c = final.choices[0]
    assert c.message.content and not c.message.tool_calls and c.finish_reason in ("stop", "length")
    # The tool's answer reached the prompt: more prompt tokens than the conversation without it.
    without = client.chat.completions.create(model=server.model, messages=history[:2], tools=TOOLS,
                                             tool_choice="none", max_tokens=1)
    assert final.usage and without.usage and final.usage.prompt_tokens > without.usage.prompt_tokens
    # auto: whatever the model writes comes back parsed or as text, never as a broken block.
    auto = client.chat.completions.create(model=server.model, messages=ASK, tools=TOOLS, max_tokens=120,
                                          temperature=0)
    m = auto.choices[0].message
    assert (m.tool_calls and auto.choices[0].finish_reason == "tool_calls") or "</tool_call>" not in (m.content or "")


def test_bad_tools_are_400(server: StrideServer, client: openai.OpenAI) -> None:
    for kw, param in (({"tools": [{"type": "function"}]}, "tools[0]"),
                      ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tool_choice": "required"}, "tool_choice"),
                      ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                       "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
