"""End to end, against real processes: one request's fault stays in that request, and no process outlives its
launch. Each defect of the faults issue has a regression test here, beside a control that shows the check can
see what it looks for; then a fuzz of malformed requests on both endpoints and the client socket.

One launch of the default model serves most tests (context 128, two sequences at a time, one tokenizer, so a
long prompt makes that tokenizer busy); the padded-vocabulary test and the SIGKILL test start their own.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import runpy
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from e2e_helpers import Dealer, StrideServer, wait_for

from stride.client import Client
from stride.client.common import BadRequestError
from stride.ipc.codec import encode
from stride.ipc.messages import ClientGenerate

ROOT = Path(__file__).resolve().parents[2]
CONTEXT = 128
MAX_PROMPT_CHARS = 4_000_000
BUSY_PROMPT = "word " * 700_000  # 3.5M characters: about two seconds of one tokenizer's time
C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[StrideServer]:
    with StrideServer("--max-num-seqs", "2", "--num-blocks", "64", "--max-model-len", str(CONTEXT),
                      "--tokenizer-workers", "1", "--max-prompt-chars", str(MAX_PROMPT_CHARS)) as srv:
        yield srv
    assert srv.leftovers() == [], srv.tail()


@pytest.fixture(scope="module")
def vocab(server: StrideServer) -> int:
    from stride.model.files import default_model_path
    from stride.tokenizer.loader import load_tokenizer
    return load_tokenizer(default_model_path()).vocab_size


def idle(server: StrideServer) -> bool:
    """Nothing running or waiting at the scheduler and no live KV block (its stats come every 0.5 s)."""
    return (server.metric("stride:num_seqs_running") == 0 and server.metric("stride:num_requests_waiting") == 0
            and server.metric("stride:kv_blocks_live") == 0)


def busy_seconds(server: StrideServer, window: float) -> float:
    """About how long, over the next ``window`` seconds, the scheduler reports a sequence running (sampled every
    0.1 s; its stats come every 0.5 s)."""
    deadline = time.monotonic() + window
    busy = 0
    while time.monotonic() < deadline:
        busy += server.metric("stride:num_seqs_running") > 0
        time.sleep(0.1)
    return busy * 0.1


def body_of(server: StrideServer, **kw: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "Hi", "max_tokens": 2, **kw}


def greedy(server: StrideServer) -> str:
    code, _, data = server.post(C, body_of(server, prompt="The capital of France is", max_tokens=6,
                                           temperature=0))
    assert code == 200, data
    return str(json.loads(data)["choices"][0]["text"])


def open_stream(server: StrideServer, body: dict[str, Any]) -> http.client.HTTPConnection:
    """A streamed request, sent (nothing read yet)."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", C, body=json.dumps({"stream": True, **body}), headers={"Content-Type": "application/json"})
    return conn


def read_first_event(conn: http.client.HTTPConnection) -> bytes:
    resp = conn.getresponse()
    assert resp.status == 200
    return resp.readline()


def hang_up(conn: http.client.HTTPConnection) -> None:
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


# ------------------------------------------------------------------ 1. ids past the vocabulary


def test_stop_token_ids_past_the_vocabulary_are_refused_and_the_server_stays(server: StrideServer,
                                                                              vocab: int) -> None:
    reference = greedy(server)
    for ids in ([9223372036854775808], [2**31], [vocab], [-1]):
        code, _, data = server.post(C, body_of(server, stop_token_ids=ids))
        err = json.loads(data)["error"]
        assert code == 400 and err["param"] == "stop_token_ids", (ids, data)
    code, _, data = server.post(C, body_of(server, prompt=[1, vocab]))
    assert code == 400 and json.loads(data)["error"]["param"] == "prompt", data
    with Client(f"ipc://{server.run_dir}/client.sock", timeout=60) as c:
        with pytest.raises(BadRequestError, match="stop_token_ids"):
            c.generate("Hi", max_tokens=2, stop_token_ids=[9223372036854775808])
        assert c.generate("Hi", max_tokens=2, stop_token_ids=[vocab - 1]).num_output_tokens >= 1  # control
    code, _, _ = server.post(C, body_of(server, stop_token_ids=[vocab - 1]))
    assert code == 200
    assert server.get("/health")[0] == 200 and greedy(server) == reference


def test_padded_vocabulary_decodes_past_the_tokenizer(tmp_path: Path) -> None:
    """tiny-llama: 320 rows of embedding and head, a byte tokenizer of 258 ids. Random weights sample ids past
    the tokenizer often; they decode to no text (as HF ``decode``), and the server keeps serving."""
    make = runpy.run_path(str(ROOT / "scripts" / "make_random_checkpoint.py"), run_name="make_checkpoint")
    path = make["write_checkpoint"](make["PRESETS"]["tiny-llama"], tmp_path / "tiny", torch.float32, seed=0)
    with StrideServer("--model", str(path), "--max-model-len", "256", "--num-blocks", "64",
                      "--tokenizer-workers", "1") as srv:
        with Client(f"ipc://{srv.run_dir}/client.sock", timeout=60) as c:
            outs = [c.generate("Hello", max_tokens=48, temperature=1.0, seed=s, ignore_eos=True, logprobs=1)
                    for s in range(4)]
        assert all(o.finish_reason == "length" and len(o.token_ids) == 48 for o in outs)
        assert any(t >= 258 for o in outs for t in o.token_ids)  # control: the case was exercised
        code, _, data = srv.post(C, {"prompt": "Hello", "max_tokens": 32, "temperature": 1.0, "seed": 7})
        assert code == 200, data
        assert srv.get("/health")[0] == 200
    assert srv.leftovers() == []


# ------------------------------------------------------------------ 2. seeds at the 64-bit edge


def test_seeds_are_64_bit_and_n_does_not_overflow_them(server: StrideServer) -> None:
    def texts(seed: int) -> list[str]:
        code, _, data = server.post(C, body_of(server, seed=seed, n=2, max_tokens=6, temperature=1.0))
        assert code == 200, data
        return [c["text"] for c in sorted(json.loads(data)["choices"], key=lambda c: c["index"])]

    top = texts(2**64 - 1)
    assert texts(-1) == top  # the same seed modulo 2**64
    code, _, data = server.post(C, body_of(server, seed=2**64, n=2))
    assert code == 400 and json.loads(data)["error"]["param"] == "seed", data
    assert wait_for(lambda: idle(server), 5), "a sequence stayed running"


# ------------------------------------------------------------------ 4. one owner for cancellation


def test_abort_reaches_a_request_behind_a_busy_tokenizer(server: StrideServer) -> None:
    long = body_of(server, prompt="Count:", max_tokens=CONTEXT - 10, ignore_eos=True)
    # Control: a stream the client keeps shows as running; hanging up frees it within a step or so.
    conn = open_stream(server, long)
    assert read_first_event(conn).startswith(b"data: ")
    assert wait_for(lambda: server.metric("stride:num_seqs_running") == 1, 5)
    hang_up(conn)
    assert wait_for(lambda: idle(server), 5)
    # The busy tokenizer: a huge prompt first (refused once tokenized: it cannot fit the context), then a
    # stream whose client hangs up while it still waits behind that prompt.
    answer: list[int] = []
    busy = threading.Thread(target=lambda: answer.append(server.post(C, body_of(server, prompt=BUSY_PROMPT))[0]))
    busy.start()
    time.sleep(0.3)  # the huge prompt is in the tokenizer's hands
    conn = open_stream(server, long)
    time.sleep(0.2)
    hang_up(conn)
    busy.join(60)
    assert answer == [400]
    # Before the fix the abandoned stream ran to max_tokens (5 s and more on this CPU) with nobody listening. Now it
    # may run a step or so, when the scheduler takes its request in one turn of its loop and the abort in the next;
    # its abort is never lost.
    assert busy_seconds(server, 4.0) <= 1.0
    assert wait_for(lambda: idle(server), 3)


def test_abort_reaches_a_waiting_request(server: StrideServer) -> None:
    long = body_of(server, prompt="Count:", max_tokens=CONTEXT - 10, ignore_eos=True)
    running = [open_stream(server, long) for _ in range(2)]  # both sequence slots
    for conn in running:
        assert read_first_event(conn).startswith(b"data: ")
    waiting = open_stream(server, long)
    assert wait_for(lambda: server.metric("stride:num_requests_waiting") == 1, 5)
    hang_up(waiting)
    assert wait_for(lambda: server.metric("stride:num_requests_waiting") == 0, 5)
    assert server.metric("stride:num_seqs_running") == 2  # control: only the one that hung up is gone
    for conn in running:
        hang_up(conn)
    assert wait_for(lambda: idle(server), 5)


# ------------------------------------------------------------------ 5. context arithmetic


def test_context_arithmetic(server: StrideServer) -> None:
    # Text prompts: their length is known once tokenized; the same code as for token ids.
    code, _, data = server.post(C, body_of(server, prompt="hello " * 60, max_tokens=CONTEXT - 20))
    err = json.loads(data)["error"]
    assert code == 400 and err["code"] == "context_length_exceeded" and str(CONTEXT) in err["message"], err
    code, _, data = server.post(C, body_of(server, prompt=[1] * 100, max_tokens=29))
    err = json.loads(data)["error"]
    assert code == 400 and err["code"] == "context_length_exceeded" and "100" in err["message"], err
    for max_tokens in (10**12, 2**63, CONTEXT):
        code, _, data = server.post(C, body_of(server, max_tokens=max_tokens))
        assert code == 400 and json.loads(data)["error"]["code"] == "context_length_exceeded", data
    code, _, data = server.post(C, body_of(server, prompt=[1] * 100, max_tokens=28))
    assert code == 200, data  # control: exactly the context
    # No max_tokens on a chat: the rest of the context.
    code, _, data = server.post(CHAT, {"messages": USER, "ignore_eos": True, "temperature": 0})
    assert code == 200, data
    body = json.loads(data)
    usage = body["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, usage
    assert body["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ 6. size bounds


def test_size_bounds_before_tokenizing(server: StrideServer) -> None:
    code, _, data = server.post(C, body_of(server, prompt="x" * (9 << 20)))
    assert code == 413, data[:200]
    code, _, data = server.post(C, body_of(server, prompt="x" * (MAX_PROMPT_CHARS + 1)))
    err = json.loads(data)["error"]
    assert code == 400 and err["code"] == "prompt_too_long" and str(MAX_PROMPT_CHARS) in err["message"], err
    code, _, data = server.post(CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS // 2)}] * 3})
    assert code == 400 and json.loads(data)["error"]["code"] == "prompt_too_long", data[:200]
    dealer = Dealer(f"ipc://{server.run_dir}/client.sock")
    try:
        dealer.send(ClientGenerate(req_id="big", prompt="x" * (9 << 20)))
        out = dealer.recv()
        assert (out.req_id, out.status) == ("big", 413) and "max_body_bytes" in (out.error or ""), out
        for frame, req_id in [(b'{"t": "client_generate", "req_id": "bad1", "prompt": 5}', "bad1"),
                              (b'{"t": "client_generate", "req_id": "bad2", "params": {"top_p": [1]}', "bad2"),
                              (b'{"t": "nope", "req_id": "bad3"}', "bad3")]:
            dealer.send_raw(frame)
            out = dealer.recv()
            assert (out.req_id, out.status) == (req_id, 400) and out.error, out
        dealer.send_raw(b"\xff not json, no id")  # nothing to answer; the socket goes on serving
        dealer.send(ClientGenerate(req_id="ok", prompt="Hi", params={"max_tokens": 2}))
        outs = dealer.until_done("ok")
        assert outs[-1].status == 200 and outs[-1].finish_reason == "length"
    finally:
        dealer.close()


# ------------------------------------------------------------------ 7. lenient where clients expect it


def test_lenient_on_unknown_fields_strict_on_known_ones(server: StrideServer) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=server.model, messages=USER, max_tokens=2,  # type: ignore[arg-type]
                                       response_format={"type": "text"}, extra_body={"frobnicate": 1})
    assert r.choices[0].finish_reason == "length"
    code, headers, _ = server.post(C, body_of(server, frobnicate=1, top_a=0.1))
    assert code == 200 and headers["X-Stride-Ignored-Fields"] == "frobnicate, top_a"
    for kw in ({"suffix": 1}, {"suffix": "x"}, {"best_of": True}, {"echo": "yes"}):
        code, _, data = server.post(C, body_of(server, **kw))
        assert code == 400 and json.loads(data)["error"]["param"] == next(iter(kw)), (kw, data)


# ------------------------------------------------------------------ the fuzz


def _bad_values(kind: str) -> list[Any]:
    """Values that are wrong for a field of ``kind``: wrong types, overflowing or out-of-range numbers."""
    wrong_types: dict[str, list[Any]] = {
        "int": ["1", 1.5, True, [], {}, 2**64, -(2**70), 10**30],
        "number": ["x", True, [], {}, 1e308, -1e308, float("nan"), float("inf"), float("-inf")],
        "bool": ["true", 1, 0.0, [], {}, "no"],
        "str": [5, 1.5, True, [], {"a": 1}],
        "list": [5, "x", {"a": 1}, True],
        "given": [],  # only the field's own list
    }
    return wrong_types[kind]


# field → (kind, extra bad values beyond the kind's)
_COMMON_FIELDS: dict[str, tuple[str, list[Any]]] = {
    "max_tokens": ("int", [0, -1, CONTEXT, 2**63]),
    "temperature": ("number", [-0.1, 100.5]),
    "top_p": ("number", [0, -1, 1.01]),
    "top_k": ("int", [-2, 2**31]),
    "min_p": ("number", [-0.1, 1.5]),
    "seed": ("int", [2**64, -(2**63) - 1]),
    "presence_penalty": ("number", [2.5, -2.5]),
    "frequency_penalty": ("number", [3, -3]),
    "repetition_penalty": ("number", [0, -1, 11]),
    "ignore_eos": ("bool", []),
    "stop_token_ids": ("list", [[-1], [2**63], [49152], [1.5], ["1"], [[1]], [1] * 257]),
    "stop": ("given", [5, 1.5, True, {"a": 1}, [""], ["a"] * 17, [5], ["x" * 100_000], [None]]),
    "n": ("int", [0, 17, -3]),
    "stream": ("bool", []),
    "service_class": ("str", ["vip", ""]),
    "user": ("str", []),
    "logit_bias": ("given", [5, "x", [], True, {"a": 1}, {"1": 101}, {"1": "a"}, {"1": True}, {"-1": 1},
                             {"49152": 1}, {str(i): 1 for i in range(1025)}]),
    "stream_options": ("str", [{"include_usage": True}]),
    "response_format": ("given", [5, "text", {}, {"a": 1}, {"type": 5}, {"type": "xml"}, {"type": "json_schema"},
                                  {"type": "json_schema", "json_schema": {}},
                                  {"type": "json_schema", "json_schema": {"schema": 5}},
                                  {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
                                  {"type": "json_schema", "json_schema": {"schema": "{"}}]),
    "guided_json": ("given", [5, "{", [1], {"type": "objekt"}, {"properties": 5}]),
    "guided_regex": ("str", ["[a-", "("]),
    "guided_choice": ("list", [[], [5], [""], [None]]),
    "guided_grammar": ("str", ["start: foo", "start: (((", ""]),
    "structured_outputs": ("given", [5, [], {"json": 5}, {"regex": "("}, {"regex": "a", "choice": ["a"]},
                                     {"choice": []}]),
}
_COMPLETION_FIELDS: dict[str, tuple[str, list[Any]]] = {
    **_COMMON_FIELDS,
    "prompt": ("str", [[], "", [-1], [49152], [1.5], ["a", "b"], [[1, 2], [3]], [1] * CONTEXT,
                       "x" * (MAX_PROMPT_CHARS + 1), [True]]),
    "logprobs": ("int", [-1, 21]),
    "echo": ("bool", [True]),
    "best_of": ("int", [2, 0]),
    "suffix": ("str", ["x"]),
    "tools": ("list", [[]]),
}
_CHAT_FIELDS: dict[str, tuple[str, list[Any]]] = {
    **_COMMON_FIELDS,
    "messages": ("list", [[], [5], [{"role": "wizard", "content": "x"}], [{"role": "user", "content": 5}],
                          [{"role": "user"}], [{"role": "user", "content": "x", "tool_calls": []}],
                          [{"role": "user", "content": [{"type": "image_url"}]}],
                          [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]]),
    "logprobs": ("bool", [5]),
    "max_completion_tokens": ("int", [0, CONTEXT]),
    "tools": ("list", [[{"type": "function"}]]),
    "tool_choice": ("bool", ["auto"]),
}
_CLIENT_PARAMS = {k: v for k, v in _COMMON_FIELDS.items()
                  if k not in ("n", "stream", "user", "stream_options")}


def _mutations(fields: dict[str, tuple[str, list[Any]]]) -> Iterator[tuple[str, Any]]:
    for name, (kind, extra) in fields.items():
        for value in _bad_values(kind) + extra:
            yield name, value


def _http_cases(model: str) -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    for path, fields, base in [(C, _COMPLETION_FIELDS, {"model": model, "prompt": "Hi", "max_tokens": 2}),
                               (CHAT, _CHAT_FIELDS, {"model": model, "messages": USER, "max_tokens": 2})]:
        for name, value in _mutations(fields):
            body = {**base, name: value}
            cases.append((path, json.dumps(body).encode()))  # NaN / Infinity go out as the bare tokens
        cases += [(path, raw) for raw in (b"{", b"[]", b"null", b"5", b'"s"', b"\xff\xfe", b"",
                                          json.dumps({**base, "model": 5}).encode(),
                                          json.dumps({**base, "model": "gpt-4"}).encode())]
    cases += [(CHAT, json.dumps({"model": model, "messages": USER, "logprobs": True, "top_logprobs": v}).encode())
              for v in (21, -1, "1", 2**40)]
    cases.append((CHAT, json.dumps({"model": model, "messages": USER, "top_logprobs": 2}).encode()))
    return cases


def _client_cases() -> list[ClientGenerate]:
    cases = [ClientGenerate(req_id=f"f{i}", prompt="Hi", params={"max_tokens": 2, name: value})
             for i, (name, value) in enumerate(_mutations(_CLIENT_PARAMS))
             if not (isinstance(value, float) and (value != value or abs(value) == float("inf")))]
    base = len(cases)
    odd: list[dict[str, Any]] = [
        {"prompt": ""}, {"prompt_token_ids": [-1]}, {"prompt_token_ids": [49152]}, {"prompt_token_ids": []},
        {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, {"messages": []}, {"messages": [{"role": "x", "content": "y"}]},
        {"prompt": "Hi", "prompt_token_ids": [1]}, {}, {"prompt": "Hi", "params": {"bogus": 1}},
        {"prompt_token_ids": [1] * CONTEXT}, {"prompt": "Hi", "api_key": 5},
    ]
    for i, fields in enumerate(odd):
        fields = dict(fields)
        params = fields.pop("params", {"max_tokens": 2})
        cases.append(ClientGenerate(req_id=f"f{base + i}", params=params, **fields))
    return cases


def test_fuzz_of_malformed_requests(server: StrideServer) -> None:
    reference = greedy(server)
    cases = _http_cases(server.model)
    random.Random(0).shuffle(cases)
    for path, raw in cases:
        code, headers, data = server.post(path, raw)
        assert 400 <= code < 500, (path, raw[:120], code, data[:300])
        assert headers["Content-Type"].startswith("application/json"), (path, raw[:120])
        err = json.loads(data)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (raw[:120], err)
    frames = _client_cases()
    dealer = Dealer(f"ipc://{server.run_dir}/client.sock")
    try:
        for msg in frames:
            try:
                frame = encode(msg)
            except TypeError:  # a value the codec itself refuses (NaN in params): send the JSON text as is
                frame = json.dumps({"t": "client_generate", "req_id": msg.req_id, "prompt": "Hi",
                                    "params": msg.params}).encode()
            dealer.send_raw(frame)
            out = dealer.recv()
            assert out.req_id == msg.req_id and 400 <= out.status < 500 and out.error, (msg, out)
    finally:
        dealer.close()
    assert len(cases) + len(frames) >= 300, len(cases) + len(frames)
    assert server.get("/health")[0] == 200
    assert greedy(server) == reference  # the server still answers, and correctly
    assert wait_for(lambda: idle(server), 5)


# ------------------------------------------------------------------ 3. no process outlives its launch


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _listening(port: int) -> bool:
    """Whether a socket of this machine listens on TCP ``port`` (the kernel's table; binding to test it would race
    with the port's reuse as another connection's ephemeral port)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return True
    return False


def test_sigkill_of_the_launcher_leaves_nothing() -> None:
    srv = StrideServer("--max-model-len", "256", "--num-blocks", "32", "--tokenizer-workers", "2").start()
    children = srv.child_pids()
    try:
        assert set(children) == {"worker 0", "tokenizer 0", "tokenizer 1", "scheduler 0", "frontend 0"}
        assert srv.shm_segments() and os.path.isdir(srv.run_dir)  # control: the launch holds them
        port = int(srv.url.rsplit(":", 1)[1])
        assert _listening(port)  # control: the frontend listens there while the launch runs
        assert srv.proc is not None
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        assert wait_for(lambda: not any(_alive(p) for p in children.values()), 5), \
            {n: p for n, p in children.items() if _alive(p)}
        assert wait_for(lambda: not srv.shm_segments() and not os.path.exists(srv.run_dir), 5), \
            (srv.shm_segments(), srv.run_dir)
        assert wait_for(lambda: not _listening(port), 5)  # nothing serves on the port any more
    finally:
        for pid in children.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        srv.stop()
