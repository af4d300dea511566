"""Structured outputs end to end through the ``openai`` client, on the default model on the CPU: outputs held to a
JSON schema, any JSON object, a regex, a choice or a grammar, streamed and not, on both endpoints; the client's
``parse`` with a pydantic model; unconstrained requests in the same batches unchanged; bad constraints refused."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from e2e_helpers import StrideServer

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "genre": {"enum": ["fantasy", "mystery", "romance"]},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030},
        "characters": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "alive": {"type": "boolean"}},
            "required": ["name", "alive"], "additionalProperties": False}},
    },
    "required": ["title", "genre", "year", "characters"],
    "additionalProperties": False,
}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
BOOK = [{"role": "user", "content": "Invent a book and describe it as JSON."}]


@pytest.fixture(scope="module")
def server() -> Iterator[StrideServer]:
    with StrideServer("--max-num-seqs", "16", "--num-blocks", "512", "--max-model-len", "1024") as srv:
        yield srv
    assert srv.leftovers() == [], srv.tail()


@pytest.fixture(scope="module")
def client(server: StrideServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, model: str, stream: bool, **kw: Any) -> tuple[str, str | None]:
    """The text and finish reason of one chat completion, streamed or not."""
    if not stream:
        r = client.chat.completions.create(model=model, stream=False, **kw)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_json_schema_at_temperature_one_always_validates(server: StrideServer, client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA, "strict": True}}

    def one(seed: int) -> tuple[str, str | None]:
        return _chat(client, server.model, seed % 2 == 1, messages=BOOK, max_tokens=300, temperature=1.0, seed=seed,
                     response_format=fmt)

    with ThreadPoolExecutor(12) as pool:
        outs = list(pool.map(one, range(12)))
    for seed, (text, reason) in enumerate(outs):
        assert reason == "stop", (seed, text)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in outs}) > 6  # sampled, not one text twelve times
    # Any JSON object. (Unbounded by a schema, this small model at temperature 1 can nest objects until max_tokens:
    # such an output ends with "length" and is cut; the grammar cannot shorten it. Those are counted, not parsed.)
    def any_object(seed: int) -> tuple[str, str | None]:
        return _chat(client, server.model, seed % 2 == 0, messages=[{"role": "user", "content": (
            "Reply with a small JSON object with a name and an age.")}], max_tokens=200, temperature=1.0, seed=seed,
            response_format={"type": "json_object"})

    with ThreadPoolExecutor(12) as pool:
        objs = list(pool.map(any_object, range(12)))
    done = [text for text, reason in objs if reason == "stop"]
    assert len(done) >= 4, objs  # 12 of 20 when written with seeds 0-19
    assert all(isinstance(json.loads(text), dict) for text in done)


def test_regex_choice_and_grammar_both_endpoints(server: StrideServer, client: openai.OpenAI) -> None:
    for seed in range(4):
        stream = seed % 2 == 1
        text, _ = _chat(client, server.model, stream, messages=[{"role": "user", "content": "Give me a date."}],
                        max_tokens=20, temperature=1.0, seed=seed, extra_body={"guided_regex": DATE})
        assert re.fullmatch(DATE, text), text
        text, _ = _chat(client, server.model, stream, messages=[{"role": "user", "content": "Is the sky green?"}],
                        max_tokens=5, temperature=1.0, seed=seed,
                        extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
        assert text in ("yes", "no", "maybe"), text
        r = client.completions.create(model=server.model, prompt="Laugh:", max_tokens=12, temperature=1.0, seed=seed,
                                      extra_body={"guided_grammar": 'root ::= ("ha")+ "!"'})
        assert re.fullmatch(r"(ha)+!", r.choices[0].text) or r.choices[0].finish_reason == "length", r.choices[0]


def test_parse_with_a_pydantic_model(server: StrideServer, client: openai.OpenAI) -> None:
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int
        mood: Literal["happy", "sad"]

    r = client.beta.chat.completions.parse(model=server.model, messages=[
        {"role": "user", "content": "Describe a person."}], response_format=Person, max_tokens=100, temperature=0)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.mood in ("happy", "sad")


def test_free_requests_beside_constrained_ones_are_unchanged(server: StrideServer, client: openai.OpenAI) -> None:
    prompts = ["Tell me about the sea.", "Name three colours.", "What is two plus two?"]

    def free(p: str) -> str:
        return _chat(client, server.model, False, messages=[{"role": "user", "content": p}], max_tokens=24,
                     temperature=0)[0]

    alone = [free(p) for p in prompts]

    def constrained(seed: int) -> str:
        return _chat(client, server.model, True, messages=BOOK, max_tokens=60, temperature=1.0, seed=seed,
                     response_format={"type": "json_object"})[0]

    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(constrained, s) for s in range(5)]
        together = list(pool.map(free, prompts))
        for f in busy:
            f.result()
    assert together == alone
    # Control: the same prompts held to a choice do change.
    held = [_chat(client, server.model, False, messages=[{"role": "user", "content": p}], max_tokens=24,
                  temperature=0, extra_body={"guided_choice": ["zebra"]})[0] for p in prompts]
    assert held == ["zebra"] * 3 != alone


def test_a_schema_is_built_once_under_load(server: StrideServer, client: openai.OpenAI) -> None:
    """Sixteen requests at once with one schema never seen before: the scheduler builds its matcher once (the
    others copy it); a second new schema is built once more."""
    import time

    def built() -> float:
        time.sleep(1.2)  # the scheduler's totals reach the frontend every half second
        return server.metric("stride:grammars_built_total")

    before = built()
    for k in range(2):
        schema = {"type": "object", "properties": {f"field_{k}": {"type": "integer"}}, "required": [f"field_{k}"]}

        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}

        def one(seed: int, fmt: dict[str, Any] = fmt) -> str:
            return _chat(client, server.model, seed % 2 == 0, messages=BOOK, max_tokens=20, temperature=1.0, seed=seed,
                         response_format=fmt)[0]

        with ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(one, range(16)))
        assert all(f"field_{k}" in o for o in outs), outs
        assert built() - before == k + 1


def test_bad_constraints_are_400_naming_the_problem(server: StrideServer, client: openai.OpenAI) -> None:
    bad = client.with_options(max_retries=0)
    for extra, words in (({"guided_regex": "[a-"}, "unclosed character class"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
                          "objekt"),
                         ({"guided_grammar": "start: foo"}, "unknown name"),
                         ({"guided_choice": []}, "non-empty"),
                         ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one")):
        with pytest.raises(openai.BadRequestError, match=words):
            bad.chat.completions.create(model=server.model, messages=BOOK, max_tokens=5, extra_body=extra)
    r = client.chat.completions.create(model=server.model, messages=BOOK, max_tokens=5, extra_body={
        "guided_choice": ["fine"]})
    assert r.choices[0].message.content == "fine"  # and the server goes on
