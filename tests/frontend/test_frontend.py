"""The frontend against a fake tokenizer+scheduler, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import contextlib
import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from aiohttp import web
from frontend_helpers import BLOCK, MODEL, LiveServer, make_config, raw, wait_for

from stride.config import StrideConfig
from stride.ipc.rundir import remove_run_dir


@contextlib.contextmanager
def _cleanup(config: StrideConfig) -> Iterator[None]:
    try:
        yield
    finally:
        remove_run_dir(config.ipc)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    config = make_config()
    with _cleanup(config), LiveServer(config) as srv:
        yield srv


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def words(n: int, tag: str = "w") -> str:
    return "".join(f"{tag}{i} " for i in range(n))


def test_chat_non_streaming(client: openai.OpenAI, server: LiveServer) -> None:
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)  # type: ignore[arg-type]
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == words(4)
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.prompt_tokens == len("be briefhello there") and r.usage.completion_tokens == 4
    assert r.usage.total_tokens == r.usage.prompt_tokens + 4
    sent = server.fake.generates[-1]
    assert sent.messages == msgs and sent.tenant == "default" and sent.params.max_tokens == 4


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == words(5)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens == len("stream me")
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_writes_coalesce_only_what_arrived_together(client: openai.OpenAI, server: LiveServer,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Deltas that reach the frontend together (the fake sends 300 back to back) go out in a few writes, all
    tokens in order; deltas that arrive apart (SLOW: one per 50 ms) each get their own write, at once. Negative
    control: counted the same way, the 300-token stream took 300+ writes before writes were coalesced."""
    writes: list[bytes] = []
    real = web.StreamResponse.write

    async def counting(self: web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", counting)
    stream = client.completions.create(model=MODEL, prompt="flood", max_tokens=300, stream=True)
    assert "".join(c.choices[0].text for c in stream) == words(300)
    assert len(writes) <= 300 // 4
    assert b"".join(writes).count(b"data: ") == 300 + 1  # every event, then [DONE]
    writes.clear()
    code, _, body = raw(server.url, "POST", "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "FAILAFTER3", "max_tokens": 9, "stream": True}))
    events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    assert code == 200 and "".join(e["choices"][0]["text"] for e in events[:-1]) == words(3)
    assert events[-1]["error"]["message"] == "fake failure after 3"  # after the tokens that came before it
    writes.clear()
    stream = client.completions.create(model=MODEL, prompt="SLOW", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in stream) == words(5)
    assert [w.count(b"data: ") for w in writes[:4]] == [1, 1, 1, 1]


def test_completions_text_and_token_ids(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert r.object == "text_completion" and r.choices[0].text == words(3)
    assert server.fake.generates[-1].prompt == "Once upon"
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=2)
    assert r.choices[0].text == words(2) and r.usage is not None and r.usage.prompt_tokens == 4
    assert server.fake.generates[-1].prompt_token_ids == [5, 6, 7, 8]
    assert server.fake.generates[-1].prompt is None
    stream = client.completions.create(model=MODEL, prompt=["a list of one"], max_tokens=3, stream=True)
    assert "".join(c.choices[0].text for c in stream) == words(3)


def test_n2_seeds_and_round_robin(client: openai.OpenAI, server: LiveServer) -> None:
    before = len(server.fake.generates)
    r = client.completions.create(model=MODEL, prompt="twice", max_tokens=2, n=2, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [words(2, "s7_"), words(2, "s8_")]
    sent = server.fake.generates[before:]
    assert sorted(g.req_id.rsplit("-", 1)[1] for g in sent) == ["0", "1"]
    assert len({g.req_id.rsplit("-", 1)[0] for g in sent}) == 1
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert set(server.fake.by_tokenizer) == {0, 1}  # both tokenizer workers got work
    streamed = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, n=2, stream=True))
    for i in (0, 1):
        assert "".join(c.choices[0].delta.content or "" for c in streamed
                       if c.choices and c.choices[0].index == i) == words(2)


def test_stop_and_max_tokens(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.completions.create(model=MODEL, prompt="stop here", max_tokens=8, stop=["w3"])
    assert server.fake.generates[-1].params.stop == ("w3",)
    assert r.choices[0].text == words(3) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "s"}],
                                       max_completion_tokens=6, stop="w1")
    assert server.fake.generates[-1].params.stop == ("w1",)
    assert server.fake.generates[-1].params.max_tokens == 6
    assert r.choices[0].message.content == words(1) and r.choices[0].finish_reason == "stop"


def test_logprobs_shapes(client: openai.OpenAI, server: LiveServer) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "lp"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)
    assert server.fake.generates[-1].params.logprobs == 2
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.token for e in content] == ["w0 ", "w1 ", "w2 "]
    assert all(len(e.top_logprobs) == 2 and e.logprob == -0.5 for e in content)
    r2 = client.completions.create(model=MODEL, prompt="lp", max_tokens=3, logprobs=1)
    lp = r2.choices[0].logprobs
    assert lp is not None and lp.tokens == ["w0 ", "w1 ", "w2 "] and lp.token_logprobs == [-0.5] * 3
    assert lp.top_logprobs == [{"alt0": -1.0}] * 3 and lp.text_offset == [0, 3, 6]
    r3 = client.completions.create(model=MODEL, prompt="no lp", max_tokens=2)
    assert r3.choices[0].logprobs is None  # negative control: none unless asked


def test_backend_refusals_carry_status_and_retry_after(server: LiveServer) -> None:
    for marker, status in (("FAIL429", 429), ("FAIL503", 503)):
        for stream in (False, True):
            body = json.dumps({"model": MODEL, "prompt": marker, "stream": stream})
            code, headers, data = raw(server.url, "POST", "/v1/completions", body)
            assert code == status and headers.get("Retry-After") == "1"
            assert json.loads(data)["error"]["message"] == f"fake {marker}"
    code, headers, data = raw(server.url, "POST", "/v1/completions", json.dumps({"prompt": "TOOLONG"}))
    assert code == 400 and "Retry-After" not in headers and json.loads(data)["error"]["code"] == "toolong"
    r = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        r.completions.create(model=MODEL, prompt="FAIL429")
    assert e.value.response.headers["retry-after"] == "1"


def _open_stream(url: str, body: dict[str, object]) -> tuple[http.client.HTTPConnection,
                                                             http.client.HTTPResponse, bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(body),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp, resp.readline()


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(server: LiveServer, stream: bool) -> None:
    before = len(server.fake.generates)
    body = {"model": MODEL, "prompt": "SLOW please", "max_tokens": 2000, "stream": stream}
    if stream:
        conn, _, first = _open_stream(server.url, body)
        assert first.startswith(b"data: ")
    else:
        host, port = server.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(body))
    assert wait_for(lambda: len(server.fake.generates) > before)
    req_id = server.fake.generates[before].req_id
    assert req_id not in server.fake.aborts  # negative control: nothing aborted while the client is there
    conn.sock.close()  # type: ignore[union-attr]
    conn.close()
    assert wait_for(lambda: req_id in server.fake.aborts)
    assert server.fake.direct_aborts == []  # through the tokenizer holding the request, never around it


def test_a_write_to_a_closing_connection_aborts_quietly(server: LiveServer, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A client that hangs up can make a stream's write fail (the transport closing) before its disconnect cancels
    the handler: the request is aborted as on a disconnect, and it is no server error (it was logged as an unhandled
    error with its traceback, 20 times in a soak of 1,500 requests with a third hung up)."""
    from aiohttp.client_exceptions import ClientConnectionResetError

    real = web.StreamResponse.write
    calls = []

    async def closing(self: web.StreamResponse, data: bytes) -> None:
        calls.append(data)
        if len(calls) == 2:
            raise ClientConnectionResetError("Cannot write to closing transport")
        await real(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing)
    before = len(server.fake.generates)
    code, _, body = raw(server.url, "POST", "/v1/completions",
                        json.dumps({"model": MODEL, "prompt": "SLOW please", "max_tokens": 2000, "stream": True}))
    assert code == 200 and body.count(b"data: ") == 1  # the first write only
    req_id = server.fake.generates[before].req_id
    assert wait_for(lambda: req_id in server.fake.aborts)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_one_failed_sequence_fails_the_request(server: LiveServer) -> None:
    before = len(server.fake.generates)
    body = json.dumps({"prompt": "HALFFAIL", "n": 2, "max_tokens": 2000})
    code, headers, data = raw(server.url, "POST", "/v1/completions", body)
    assert code == 503 and headers["Retry-After"] == "1" and b"fake half failure" in data
    seq0, seq1 = sorted(g.req_id for g in server.fake.generates[before:])
    assert wait_for(lambda: seq0 in server.fake.aborts)
    assert seq1 not in server.fake.aborts  # the one that failed was released by whoever failed it


def test_finished_request_is_not_aborted(client: openai.OpenAI, server: LiveServer) -> None:
    client.completions.create(model=MODEL, prompt="quick", max_tokens=2)
    req_id = server.fake.generates[-1].req_id
    client.completions.create(model=MODEL, prompt="after", max_tokens=1)
    assert req_id not in server.fake.aborts


def test_models_health_metrics(client: openai.OpenAI, server: LiveServer) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    code, _, data = raw(server.url, "GET", "/health")
    assert code == 200 and json.loads(data)["status"] == "ok"
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3)  # second time: cached blocks
    code, headers, data = raw(server.url, "GET", "/metrics")
    text = data.decode()
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    for name in ("stride:num_requests_running", "stride:prompt_tokens_total",
                 "stride:generation_tokens_total", "stride:prefix_cache_hits_total",
                 "stride:prefix_cache_queries_total",
                 "stride:time_to_first_token_seconds_bucket", "stride:inter_token_latency_seconds_bucket",
                 "stride:e2e_request_latency_seconds_bucket", "stride:kv_blocks_live",
                 "stride:kv_blocks_cached", "stride:kv_blocks_free", "stride:request_success_total"):
        assert name in text, name
    assert "stride:no_such_metric" not in text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("stride:") and "_bucket" not in line}
    assert values["stride:kv_blocks_free"] == 1017.0 and values["stride:kv_blocks_live"] == 3.0
    assert values["stride:generation_tokens_total"] >= 6
    assert values["stride:prefix_cache_hits_total"] >= BLOCK * ((len("count me") - 1) // BLOCK)


def test_worker_dead_turns_health_red() -> None:
    from stride.ipc.messages import RequestFailed
    config = make_config()
    with LiveServer(config) as srv, _cleanup(config):
        conn, resp, _ = _open_stream(srv.url, {"prompt": "SLOW", "max_tokens": 2000, "stream": True})
        assert raw(srv.url, "GET", "/health")[0] == 200
        dead = RequestFailed(req_id="", status=503, message="rank 0 died", code="worker_dead")
        srv.call(srv.fake.send(dead))
        rest = resp.read()
        conn.close()
        assert b"rank 0 died" in rest and rest.endswith(b"data: [DONE]\n\n")  # in-flight request told
        code, _, data = raw(srv.url, "GET", "/health")
        assert code == 503 and "rank 0 died" in json.loads(data)["reason"]
        code, headers, _ = raw(srv.url, "POST", "/v1/completions", json.dumps({"prompt": "hi"}))
        assert code == 503 and headers["Retry-After"] == "1"


def test_shutdown_ends_streams_with_an_error_event() -> None:
    """A Shutdown reaching the frontend mid-stream: the stream ends with an in-band 503 error and [DONE] (it was
    cut off when the server stopped), /health turns red, and a new request is refused with 503."""
    from stride.ipc.messages import Shutdown
    config = make_config()
    with LiveServer(config) as srv, _cleanup(config):
        conn, resp, _ = _open_stream(srv.url, {"prompt": "SLOW", "max_tokens": 2000, "stream": True})
        srv.call(srv.fake.send(Shutdown(reason="launcher")))
        rest = resp.read()
        conn.close()
        lines = [line.strip() for line in rest.split(b"\n\n")]  # (rest starts mid-event)
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert events[-1]["error"]["code"] == "shutting_down" and "shutting down" in events[-1]["error"]["message"]
        assert rest.endswith(b"data: [DONE]\n\n")
        code, _, data = raw(srv.url, "GET", "/health")
        assert code == 503 and "shutting down" in json.loads(data)["reason"]
        assert raw(srv.url, "POST", "/v1/completions", json.dumps({"prompt": "hi"}))[0] == 503


def test_tenants_and_api_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# key tenant\nkey-a alice\nkey-b   bob  # trailing comment\n\n")
    config = make_config(api_keys_file=str(keys))
    prompt = "a shared system prompt that spans several blocks of sixteen tokens each"
    with LiveServer(config) as srv, _cleanup(config):
        def cached(key: str) -> int:
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return int(r.usage.prompt_tokens_details.cached_tokens or 0)
        assert cached("key-a") == 0
        assert cached("key-a") == (len(prompt) - 1) // BLOCK * BLOCK > 0  # same tenant: cached
        assert cached("key-b") == 0  # other tenant: nothing shared
        assert [g.tenant for g in srv.fake.generates] == ["alice", "alice", "bob"]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "key-a"},
                        {"Authorization": "Basic key-a"}):
            code, _, data = raw(srv.url, "POST", "/v1/completions", json.dumps({"prompt": "x"}), headers)
            assert code == 401 and json.loads(data)["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()
        assert raw(srv.url, "GET", "/health")[0] == 200  # health needs no key
        assert len(srv.fake.generates) == 3  # refused requests never reached the backend
