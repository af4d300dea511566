"""Malformed requests: each gets its 4xx and an OpenAI-style error body, reaches no backend, and the
server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from frontend_helpers import MODEL, LiveServer, make_config, raw

from stride.frontend.auth import Authenticator, load_api_keys
from stride.frontend.errors import ApiError
from stride.ipc.rundir import remove_run_dir

MAX_BODY = 64 << 10
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def comp(**kw: object) -> str:
    return json.dumps({"model": MODEL, "prompt": "hi", **kw})


def chat(**kw: object) -> str:
    return json.dumps({"model": MODEL, "messages": USER, **kw})


# (method, path, body, status, param): param None means "not checked".
BATTERY: list[tuple[str, str, str | bytes | None, int, str | None]] = [
    ("POST", C, "{", 400, None),
    ("POST", C, "[]", 400, None),
    ("POST", C, "null", 400, None),
    ("POST", C, json.dumps({"model": MODEL}), 400, "prompt"),
    ("POST", CHAT, json.dumps({"model": MODEL}), 400, "messages"),
    ("POST", C, comp(prompt=5), 400, "prompt"),
    ("POST", C, comp(prompt=""), 400, "prompt"),
    ("POST", C, comp(prompt=[]), 400, "prompt"),
    ("POST", C, comp(prompt=[-1, 2]), 400, "prompt"),
    ("POST", C, comp(prompt=[1.5]), 400, "prompt"),
    ("POST", C, comp(prompt=["a", "b"]), 400, "prompt"),
    ("POST", C, comp(prompt=[1] * 8192), 400, "prompt"),
    ("POST", C, comp(max_tokens=0), 400, "max_tokens"),
    ("POST", C, comp(max_tokens="10"), 400, "max_tokens"),
    ("POST", C, comp(max_tokens=True), 400, "max_tokens"),
    ("POST", C, comp(temperature=-1), 400, "temperature"),
    ("POST", C, comp(temperature="hot"), 400, "temperature"),
    ("POST", C, comp(top_p=0), 400, "top_p"),
    ("POST", C, comp(top_p=1.5), 400, "top_p"),
    ("POST", C, comp(top_k=-2), 400, "top_k"),
    ("POST", C, comp(min_p=2), 400, "min_p"),
    ("POST", C, comp(n=0), 400, "n"),
    ("POST", C, comp(n=100), 400, "n"),
    ("POST", C, comp(stop=5), 400, "stop"),
    ("POST", C, comp(stop=[""]), 400, "stop"),
    ("POST", C, comp(stop=["a"] * 17), 400, "stop"),
    ("POST", C, comp(seed="x"), 400, "seed"),
    ("POST", C, comp(presence_penalty=3), 400, "presence_penalty"),
    ("POST", C, comp(frequency_penalty=-3), 400, "frequency_penalty"),
    ("POST", C, comp(logprobs=50), 400, "logprobs"),
    ("POST", C, comp(echo=True), 400, "echo"),
    ("POST", C, comp(best_of=3), 400, "best_of"),
    ("POST", C, comp(logit_bias={"1": 500}), 400, "logit_bias"),
    ("POST", C, comp(logit_bias={"one": 5}), 400, "logit_bias"),
    ("POST", C, comp(echo="yes"), 400, "echo"),
    ("POST", C, comp(best_of=True), 400, "best_of"),
    ("POST", C, comp(suffix=1), 400, "suffix"),
    ("POST", C, comp(suffix="x"), 400, "suffix"),
    ("POST", C, comp(seed=2**64), 400, "seed"),
    ("POST", C, comp(seed=-2**63 - 1), 400, "seed"),
    ("POST", C, comp(max_tokens=10**12), 400, "max_tokens"),
    ("POST", C, comp(max_tokens=2**63), 400, "max_tokens"),
    ("POST", C, comp(max_tokens=8192), 400, "max_tokens"),
    ("POST", C, comp(prompt=[1] * 8000, max_tokens=500), 400, "prompt"),
    ("POST", C, comp(stop_token_ids=[2**63]), 400, "stop_token_ids"),
    ("POST", C, comp(stop_token_ids=[1] * 257), 400, "stop_token_ids"),
    ("POST", C, comp(stop=["x" * 1025]), 400, "stop"),
    ("POST", C, comp(top_k=2**40), 400, "top_k"),
    ("POST", C, comp(user=5), 400, "user"),
    ("POST", C, comp(tools=[]), 400, "tools"),
    ("POST", C, comp(service_class="vip"), 400, "service_class"),
    ("POST", C, comp(stream="yes"), 400, "stream"),
    ("POST", C, comp(stream_options={"include_usage": True}), 400, "stream_options"),
    ("POST", C, comp(stream=True, stream_options={"include_usage": "yes"}), 400, "include_usage"),
    ("POST", C, comp(model=5), 400, "model"),
    ("POST", C, comp(model="gpt-4"), 404, "model"),
    ("POST", CHAT, chat(messages=[]), 400, "messages"),
    ("POST", CHAT, chat(messages="hi"), 400, "messages"),
    ("POST", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400, "messages[0]"),
    ("POST", CHAT, chat(logprobs=5), 400, "logprobs"),
    ("POST", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("POST", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("POST", CHAT, chat(max_completion_tokens=-1), 400, "max_completion_tokens"),
    ("POST", CHAT, chat(tools=[]), 400, "tools"),
    ("POST", CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    ("POST", CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("POST", CHAT, chat(response_format="text"), 400, "response_format"),
    ("POST", CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), 400, "response_format"),
    ("POST", CHAT, chat(guided_choice=["a", 5]), 400, "guided_choice"),
    ("POST", CHAT, chat(logprobs=True, top_logprobs=2**40), 400, "top_logprobs"),
    ("POST", CHAT, chat(max_tokens=10**12), 400, "max_tokens"),
    ("POST", CHAT, chat(messages=[{"role": "user", "content": "x", "name": 5}]), 400, "messages[0].name"),
    ("GET", "/v1/nope", None, 404, None),
    ("POST", "/v1/embeddings", comp(), 404, None),
    ("GET", C, None, 405, None),
    ("DELETE", "/v1/models", None, 405, None),
    ("POST", C, json.dumps({"prompt": "x" * (MAX_BODY + 1)}), 413, None),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = make_config(max_body_bytes=MAX_BODY)
    try:
        with LiveServer(config) as srv:
            yield srv
    finally:
        remove_run_dir(config.ipc)


def test_battery_of_malformed_requests(server: LiveServer) -> None:
    assert len(BATTERY) >= 25
    for method, path, body, status, param in BATTERY:
        code, headers, data = raw(server.url, method, path, body)
        assert code == status, (method, path, body if body is None else body[:80], data[:200])
        assert headers["Content-Type"].startswith("application/json"), (path, body)
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (body, err)
        if param is not None:
            assert err["param"] == param, (body, err)
    assert server.fake.generates == []  # every refusal happened at the edge
    code, _, data = raw(server.url, "POST", C, comp(max_tokens=2))
    assert code == 200 and json.loads(data)["choices"][0]["text"] == "w0 w1 "


def test_valid_variants_are_accepted(server: LiveServer) -> None:
    """Negative control for the battery: the same fields with good values pass."""
    for path, body in [(C, comp(prompt=["one"], temperature=0, top_p=0.5, top_k=-1, min_p=0.1, stop="x",
                                     seed=3, presence_penalty=1, frequency_penalty=-1, logprobs=0,
                                     echo=False, best_of=1, user="u", service_class="interactive")),
                       (C, comp(prompt=[[1, 2, 3]], n=2, max_tokens=1)),
                       (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]},
                                             {"role": "assistant", "content": None}],
                                   logprobs=True, top_logprobs=20, max_tokens=1))]:
        code, _, data = raw(server.url, "POST", path, body)
        assert code == 200, data
    code, _, data = raw(server.url, "POST", C, json.dumps({"prompt": "no model field", "max_tokens": 1}))
    assert code == 200 and json.loads(data)["model"] == MODEL


def test_unknown_fields_are_ignored_and_named_in_a_header(server: LiveServer) -> None:
    code, headers, data = raw(server.url, "POST", C, comp(max_tokens=1, frobnicate=1, zeta={"a": 1}))
    assert code == 200, data
    assert headers["X-Stride-Ignored-Fields"] == "frobnicate, zeta"
    code, headers, data = raw(server.url, "POST", CHAT, chat(max_tokens=1, response_format={"type": "text"},
                                                            stream=True, stream_options={"include_usage": True,
                                                                                         "later": 1},
                                                            store=False))
    assert code == 200 and headers["X-Stride-Ignored-Fields"] == "store", data
    assert data.endswith(b"data: [DONE]\n\n")
    # A refusal still names what was ignored; a body with nothing unknown carries no such header.
    code, headers, _ = raw(server.url, "POST", C, comp(max_tokens=0, frobnicate=1))
    assert code == 400 and headers["X-Stride-Ignored-Fields"] == "frobnicate"
    code, headers, _ = raw(server.url, "POST", C, comp(max_tokens=1))
    assert code == 200 and "X-Stride-Ignored-Fields" not in headers
    # Fields we use stay strict on their types: the negative control for the leniency above.
    code, _, _ = raw(server.url, "POST", C, comp(max_tokens=1, suffix="", best_of=2, n=2, echo=False))
    assert code == 200


def test_context_errors_share_one_code(server: LiveServer) -> None:
    """max_tokens past the context, and token prompts that with max_tokens do not fit: 400, one code, the
    numbers in the message. Prompts that just fit pass (the boundary, as a negative control)."""
    for path, body, numbers in [(C, comp(max_tokens=10**12), ["1000000000000", "8192"]),
                                (C, comp(prompt=[1] * 8000, max_tokens=500), ["8000", "500", "8192"]),
                                (C, comp(prompt=[1] * 8192), ["8192"]),
                                (CHAT, chat(max_completion_tokens=8192), ["8192"])]:
        code, _, data = raw(server.url, "POST", path, body)
        err = json.loads(data)["error"]
        assert code == 400 and err["code"] == "context_length_exceeded", (body[:60], err)
        assert all(n in err["message"] for n in numbers), err
    code, _, data = raw(server.url, "POST", C, comp(prompt=[1] * 8190, max_tokens=2))
    assert code == 200, data


def test_integers_past_64_bits_are_named_as_such(server: LiveServer) -> None:
    """An integer literal past 64 bits reaches the validator as a float (the JSON reader's way): the 400 says it is
    too large, not that it is a float; a real float still gets the plain message (negative control)."""
    for body, fragment in [(comp(seed=2**80), "fits 64 bits, got 1.20893e+24"), (comp(top_k=-(2**70)), "fits 64 bits"),
                           (comp(seed=2.5), "must be an integer, got float")]:
        code, _, data = raw(server.url, "POST", C, body)
        err = json.loads(data)["error"]
        assert code == 400 and fragment in err["message"], err


def test_api_key_file_parsing(tmp_path: object) -> None:
    import pathlib
    d = pathlib.Path(str(tmp_path))
    good = d / "good"
    good.write_text("# comment\n\nk1 t1\nk2 t2 # note\n")
    assert load_api_keys(str(good)) == {"k1": "t1", "k2": "t2"}
    for text in ("k1\n", "k1 t1 extra\n", "k1 t1\nk1 t2\n", "# only comments\n"):
        bad = d / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError):
            load_api_keys(str(bad))
    auth = Authenticator({"k1": "t1"})
    assert auth.tenant_for_header("Bearer k1") == "t1" and auth.tenant_for_header("bearer  k1") == "t1"
    for header in (None, "", "Bearer", "Bearer k2", "k1", "Token k1"):
        with pytest.raises(ApiError) as e:
            auth.tenant_for_header(header)
        assert e.value.status == 401
    assert Authenticator(None).tenant_for_header("Bearer anything") == "default"
