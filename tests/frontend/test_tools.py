"""Tool calling without a server: ``tools`` and ``tool_choice`` checked, calls read from outputs whole and
streamed (any split of the text gives the same calls and content), the forcing grammar only admits valid calls,
and templates without tool support get tools as plain messages."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from stride.frontend.errors import ApiError
from stride.frontend.tools import (
    ToolCallStream,
    call_constraint,
    parse_output,
    parse_tool_choice,
    parse_tools,
)
from stride.grammar.compile import GrammarCompiler
from stride.grammar.matchers import GrammarMatchers, bitmask_words
from stride.model.files import default_model_path
from stride.tokenizer.loader import load_tokenizer
from stride.tokenizer.tool_prompt import plain_messages, renders_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}


def test_tools_and_choice_are_checked() -> None:
    tools = parse_tools([WEATHER, {"type": "function", "function": {"name": "noop"}}])
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    for bad, param in (([], "tools"), ([{"type": "function"}], "tools[0]"),
                       ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
                       ([WEATHER, WEATHER], "tools[1].function.name"),
                       ([{"type": "function", "function": {"name": "x", "parameters": 5}}],
                        "tools[0].function.parameters")):
        with pytest.raises(ApiError) as e:
            parse_tools(bad)
        assert e.value.body()["error"]["param"] == param
    assert parse_tool_choice(None, tools) == "auto" and parse_tool_choice(None, None) == "none"
    assert parse_tool_choice({"type": "function", "function": {"name": "noop"}}, tools) == "noop"
    for bad_choice in ("sometimes", {"type": "function", "function": {"name": "missing"}}, 5):
        with pytest.raises(ApiError):
            parse_tool_choice(bad_choice, tools)
    with pytest.raises(ApiError):
        parse_tool_choice("required", None)


def test_calls_are_read_in_both_formats() -> None:
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 1}}\n</tool_call>')
    content, calls = parse_output(text)
    assert content is not None and content.strip() == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {"zone": 1})]
    assert len({c.id for c in calls}) == 2
    content, calls = parse_output('<|python_tag|>{"name": "get_time", "parameters": {"zone": 3}}')
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": 3}
    # Controls: prose, a broken block and JSON that is not a call stay content.
    for plain in ("Just words.", "<tool_call>\n{not json}\n</tool_call>", '{"answer": 4}', "<tool_call> never shut"):
        assert parse_output(plain) == (plain, [])


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}\n</tool_call> done',
    '{"name": "get_time", "parameters": {"zone": 5}}',
    "No call here, though <tool_ looks like one and <tool_call> opens one",
    "a < b <tool_call>\n{\"name\": \"x\", \"arguments\": {}}\n</tool_call><tool_call>{\"name\": \"y\"}</tool_call>",
])
def test_a_stream_gives_what_the_whole_gives(text: str) -> None:
    want_content, want_calls = parse_output(text)
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        s = ToolCallStream()
        content, calls = "", []
        for p in pieces:
            c, found = s.feed(p)
            content, calls = content + c, calls + found
        c, found = s.finish()
        content, calls = content + c, calls + found
        assert [(x.name, x.arguments) for x in calls] == [(x.name, x.arguments) for x in want_calls]
        assert content == want_content if want_content is not None else not content.strip()


def test_the_forcing_grammar_admits_only_valid_calls() -> None:
    tok = load_tokenizer(default_model_path())
    vocab = tok.tokenizer.get_vocab_size()
    matchers = GrammarMatchers(tok.tokenizer.to_str(), vocab, tok.eos_token_ids)
    tools = parse_tools([WEATHER, TIME])
    compiler = GrammarCompiler()
    for choice, names in (("required", {"get_weather", "get_time"}), ("get_time", {"get_time"})):
        constraint = call_constraint(tools, choice, parallel=False)
        assert constraint is not None
        grammar = compiler.compile(constraint)
        for seed in range(6):
            rng = random.Random(seed)
            matchers.add("r", grammar)
            bitmask = np.zeros((1, bitmask_words(vocab)), np.int32)
            out: list[int] = []
            for _ in range(300):
                matchers.fill([("r", 0)], bitmask)
                allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
                t = int(rng.choice(allowed))
                out.append(t)
                if matchers.consume("r", t):
                    break
            matchers.drop("r")
            content, calls = parse_output(tok.tokenizer.decode(out))
            assert content is None and len(calls) == 1 and calls[0].name in names, tok.tokenizer.decode(out)
            schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == calls[0].name)
            jsonschema.validate(json.loads(calls[0].arguments), schema)
    assert call_constraint(tools, "auto", True) is None


def test_plain_messages_for_a_template_without_tools() -> None:
    tok = load_tokenizer(default_model_path())
    assert not renders_tools(tok.chat_template or "")
    assert renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3 and snow"}]
    msgs = plain_messages(history, parse_tools([WEATHER]))
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in msgs[0]["content"] and "<tool_call>" in msgs[0]["content"]
    assert parse_output(msgs[2]["content"])[1][0].name == "get_weather"  # the call as the model would write it
    assert msgs[3]["content"] == "<tool_response>\n-3 and snow\n</tool_response>"
    own = plain_messages([{"role": "system", "content": "Be brief."}, *history[:1]], parse_tools([WEATHER]))
    assert own[0]["content"].startswith("Be brief.\n\n") and len(own) == 2
    assert plain_messages(history[:1], None) == history[:1]


def test_the_tokenizer_renders_tools_through_a_template_that_names_them() -> None:
    """A template with its own tool support gets ``tools`` and the history as they are; the default model's (none)
    gets Stride's system message. Control: the same request without tools renders neither."""
    import dataclasses

    from stride.config import IpcConfig, StrideConfig
    from stride.ipc import messages as m
    from stride.params import SamplingParams
    from stride.tokenizer.process import TokenizerWorker

    tok = load_tokenizer(default_model_path())
    config = StrideConfig(ipc=IpcConfig(run_dir="/tmp", launch_id="tools"))
    own = ("{% if tools %}TOOLS:{% for t in tools %}[{{ t.function.name }}]{% endfor %}\n{% endif %}"
           "{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}"
           " CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}\n{% endfor %}")
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3"}]
    tools = parse_tools([WEATHER])

    def prompt(worker: TokenizerWorker, with_tools: bool) -> str:
        out = worker.on_generate(m.GenerateRequest("r", "t", SamplingParams(max_tokens=4), messages=history,
                                                   tools=tools if with_tools else None))
        assert isinstance(out, m.TokenizedRequest), out
        worker.pending.clear()
        return tok.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    templated = TokenizerWorker(config, 0, dataclasses.replace(tok, chat_template=own))
    assert templated.renders_tools
    text = prompt(templated, True)
    assert text.startswith("TOOLS:[get_weather]") and "CALL get_weather(Oslo)" in text and "tool: -3" in text
    assert "<tool_call>" not in text and "TOOLS:" not in prompt(templated, False)
    plain = TokenizerWorker(config, 0, tok)
    assert not plain.renders_tools
    text = prompt(plain, True)
    assert "<tools>" in text and '"name": "get_weather"' in text and "<tool_response>\n-3" in text
    assert "<tools>" not in prompt(plain, False)
