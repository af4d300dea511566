"""stride.client against a real `stride serve` (default model, CPU), a simulated-backend server with API keys,
and an in-process fake ROUTER for the statuses a real server rarely produces (429, 503, late outputs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from e2e_helpers import wait_for

from stride.client import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    Client,
    Completion,
    OverloadedError,
    QueueFullError,
    StrideError,
    StrideTimeoutError,
    read_address_file,
)
from stride.ipc.codec import Decoder, encode
from stride.ipc.messages import TO_CLIENT_SERVER, ClientAbort, ClientGenerate, ClientOutput, Message

PROMPT = "The three primary colors are"
GREEDY = {"temperature": 0, "max_tokens": 12}


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                # The command name may hold spaces; the parent pid is the second field after its ')'.
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def segments(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


class Server:
    """One `stride serve` subprocess, found through its --address-file; stop() is idempotent."""

    def __init__(self, tmp: Path, *extra: str) -> None:
        self.address_file = str(tmp / "address.json")
        self.log = open(tmp / "serve.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen([sys.executable, "-m", "stride", "serve", "--port", "0", "--address-file",
                                      self.address_file, "--tokenizer-workers", "1", *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        ok = wait_for(lambda: os.path.exists(self.address_file) or self.proc.poll() is not None, 240)
        if not ok or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"stride serve did not start: {(tmp / 'serve.log').read_text()[-2000:]}")
        self.info = read_address_file(self.address_file)
        self.children = children_of(self.proc.pid)

    def http(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(self.info["http_url"] + path, method="POST" if body else "GET",
                                     data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read().decode()
        return json.loads(raw) if body else raw

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric's samples (over its labels)."""
        text = self.http("/metrics")
        return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("serve"))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client.from_address_file(server.address_file, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ against the real model


@pytest.mark.slow
def test_generate_equals_http_completion(server: Server, client: Client) -> None:
    out = client.generate(PROMPT, **GREEDY)
    body = server.http("/v1/completions", {"model": server.info["model"], "prompt": PROMPT, **GREEDY})
    assert out.text and out.text == body["choices"][0]["text"]
    assert out.finish_reason == body["choices"][0]["finish_reason"] == "length"
    assert len(out.token_ids) == out.num_output_tokens == 12
    assert out.usage["prompt_tokens"] == body["usage"]["prompt_tokens"] == out.num_prompt_tokens > 0
    assert out.usage["prompt_tokens_details"]["cached_tokens"] == out.num_cached_tokens >= 0
    # Negative control: another prompt gives another text, so the equality above is not vacuous.
    assert client.generate("Once upon a time, in a distant", **GREEDY).text != out.text


@pytest.mark.slow
def test_stream_deltas_concatenate_to_the_completion(client: Client) -> None:
    full = client.generate(PROMPT, **GREEDY)
    deltas = list(client.stream(PROMPT, **GREEDY))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert [d.finish_reason for d in deltas][-1] == "length"
    assert all(d.finish_reason is None for d in deltas[:-1]) and len(deltas) > 1
    assert deltas[-1].num_output_tokens == 12


@pytest.mark.slow
def test_token_id_prompt_and_logprobs(server: Server, client: Client) -> None:
    ids = client.generate(PROMPT, **GREEDY).token_ids[:6]  # any real token ids will do
    out = client.generate(prompt_token_ids=ids, logprobs=2, **GREEDY)
    assert client.generate(ids, **GREEDY).text == out.text  # a list as the prompt is token ids
    body = server.http("/v1/completions", {"model": server.info["model"], "prompt": ids, **GREEDY})
    assert out.text == body["choices"][0]["text"] and out.num_prompt_tokens == len(ids)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in out.logprobs)


@pytest.mark.slow
def test_batch_of_8_pipelined(client: Client) -> None:
    base = client.generate(PROMPT, **GREEDY).token_ids
    # Prompts of lengths 1..8 tell the results apart: result i must report i + 1 prompt tokens.
    prompts: list[Any] = [base[: i + 1] for i in range(8)]
    outs = client.generate_batch(prompts, temperature=0, max_tokens=6)
    assert len(outs) == 8
    for i, out in enumerate(outs):
        assert isinstance(out, Completion)
        assert out.num_prompt_tokens == i + 1 and out.num_output_tokens == 6 and out.finish_reason == "length"
    # One bad request among good ones: raised by default, in its place with return_exceptions.
    mixed = client.generate_batch(["a", "b", "c"], max_tokens=2, stop=5, return_exceptions=True)
    assert all(isinstance(o, BadRequestError) for o in mixed)
    mixed = client.generate_batch(["a", [], "c"], max_tokens=2, return_exceptions=True)
    assert isinstance(mixed[0], Completion) and isinstance(mixed[1], BadRequestError)
    assert isinstance(mixed[2], Completion)
    with pytest.raises(BadRequestError):
        client.generate_batch(["a", [], "c"], max_tokens=2, max_in_flight=1)
    assert client.generate("after", max_tokens=2).num_output_tokens == 2


@pytest.mark.slow
def test_async_gather_and_stream(server: Server) -> None:
    async def main() -> tuple[list[Completion], str, str]:
        async with AsyncClient.from_address_file(server.address_file, timeout=120) as ac:
            outs = await asyncio.gather(*(ac.generate(f"Number {i}:", max_tokens=5) for i in range(6)))
            streamed = "".join([d.text async for d in ac.stream(PROMPT, **GREEDY)])
            whole = (await ac.generate(PROMPT, **GREEDY)).text
            return list(outs), streamed, whole

    outs, streamed, whole = asyncio.run(main())
    assert [o.num_output_tokens for o in outs] == [5] * 6 and all(o.text for o in outs)
    assert streamed == whole and whole


@pytest.mark.slow
def test_closing_a_stream_aborts_the_request(server: Server, client: Client) -> None:
    successes = server.metric("stride:request_success_total")
    stream = client.stream("Write a very long story about a dragon.", max_tokens=3000, ignore_eos=True)
    first = [next(stream), next(stream)]
    assert all(d.finish_reason is None for d in first)
    # Control: while the stream is open the scheduler reports it running, holding KV blocks.
    assert wait_for(lambda: server.metric("stride:num_seqs_running") >= 1, 20)
    assert server.metric("stride:kv_blocks_live") > 0
    stream.close()
    # 3000 tokens take minutes here; the sequence is gone long before, and nothing counts as finished.
    assert wait_for(lambda: server.metric("stride:num_seqs_running") == 0
                    and server.metric("stride:kv_blocks_live") == 0, 30)
    assert server.metric("stride:request_success_total") == successes
    assert client.generate("still serving", max_tokens=2).num_output_tokens == 2


@pytest.mark.slow
def test_cancelling_an_async_generate_aborts_it(server: Server) -> None:
    async def main() -> None:
        async with AsyncClient.from_address_file(server.address_file) as ac:
            task = asyncio.create_task(ac.generate("Tell me everything.", max_tokens=3000, ignore_eos=True))
            while server.metric("stride:num_seqs_running") < 1:  # the request is running
                await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert wait_for(lambda: server.metric("stride:num_seqs_running") == 0, 30)


@pytest.mark.slow
def test_bad_params_are_400_and_the_server_keeps_serving(client: Client) -> None:
    cases: list[dict[str, Any]] = [{"max_tokens": -1}, {"bogus": 1}, {"temperature": "hot"}, {"top_p": 2},
                                   {"service_class": "nope"}, {"seed": object()}]
    for params in cases:
        with pytest.raises(BadRequestError) as err:
            client.generate(PROMPT, **params)
        assert err.value.status == 400 and err.value.message and not err.value.retryable, params
    with pytest.raises(BadRequestError):
        client.generate(PROMPT, messages=[{"role": "user", "content": "x"}])  # two prompts
    with pytest.raises(BadRequestError):
        client.generate(prompt_token_ids=[1] * 100_000)  # longer than the context
    out = client.generate(messages=[{"role": "user", "content": "Say hi."}], max_tokens=3)
    assert out.num_output_tokens >= 1


@pytest.mark.slow
def test_timeout_aborts(server: Server, client: Client) -> None:
    with pytest.raises(StrideTimeoutError) as err:
        client.generate("A long answer:", max_tokens=3000, ignore_eos=True, timeout=1.5)
    assert err.value.status == 408 and isinstance(err.value, TimeoutError)
    assert wait_for(lambda: server.metric("stride:num_seqs_running") == 0, 30)


@pytest.mark.slow
def test_shutdown_leaves_nothing(server: Server) -> None:
    prefix = server.info["shm_prefix"]
    # Controls: the checks below see this launch's segments and processes while it runs.
    assert segments(prefix) and server.children and all(alive(p) for p in server.children)
    assert server.stop() == 0
    assert not os.path.exists(server.address_file)
    assert segments(prefix) == []
    assert [p for p in server.children if alive(p)] == []
    with Client(server.info["client_address"], timeout=0.5) as c, pytest.raises(StrideTimeoutError):
        c.generate("anyone?")


# ------------------------------------------------------------------ API keys (simulated backend: fast start)


@pytest.mark.slow
def test_api_keys(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-good alice\n")
    srv = Server(tmp_path, "--backend", "sim", "--api-keys", str(keys))
    try:
        for key in ("", "sk-bad"):
            with Client.from_address_file(srv.address_file, key, timeout=30) as c:
                with pytest.raises(AuthenticationError) as err:
                    c.generate("hi", max_tokens=2)
                assert err.value.status == 401
                with pytest.raises(AuthenticationError):
                    list(c.stream("hi", max_tokens=2))
        # Control: the right key is served.
        with Client.from_address_file(srv.address_file, "sk-good", timeout=30) as c:
            assert c.generate("hi", max_tokens=2).num_output_tokens == 2
    finally:
        assert srv.stop() == 0
    assert segments(srv.info["shm_prefix"]) == [] and not any(alive(p) for p in srv.children)


# ------------------------------------------------------------------ a fake ROUTER: statuses and wire edge cases


class FakeRouter:
    """Answers each ClientGenerate by ``script(msg)`` (a list of outputs); records aborts."""

    def __init__(self, tmp: Path, script: Callable[[ClientGenerate], list[ClientOutput]]) -> None:
        self.address = f"ipc://{tmp}/fake.sock"
        self.script = script
        self.generates: list[ClientGenerate] = []
        self.aborts: list[str] = []
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.address)
        self.running = True
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        decoder: Decoder[Message] = Decoder(TO_CLIENT_SERVER)
        while self.running:
            if not self.sock.poll(50):
                continue
            identity, frame = self.sock.recv_multipart()
            msg = decoder.decode(frame)
            if isinstance(msg, ClientAbort):
                self.aborts.append(msg.req_id)
            elif isinstance(msg, ClientGenerate):
                self.generates.append(msg)
                for out in self.script(msg):
                    self.sock.send_multipart([identity, encode(out)])

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[FakeRouter]:
    def script(msg: ClientGenerate) -> list[ClientOutput]:
        status = {"full": 429, "busy": 503, "boom": 500}.get(str(msg.prompt))
        if status:
            return [ClientOutput(req_id=msg.req_id, status=status, error=f"fake {msg.prompt}")]
        if msg.prompt == "hang":
            return [ClientOutput(req_id=msg.req_id, text="a", token_ids=[1], num_output_tokens=1)]
        return [ClientOutput(req_id="r999", text="stray"),  # not ours: dropped
                ClientOutput(req_id=msg.req_id, text="x", token_ids=[7], num_prompt_tokens=3,
                             num_output_tokens=1),
                ClientOutput(req_id=msg.req_id, text="y", token_ids=[8], finish_reason="abort_stop_string",
                             num_prompt_tokens=3, num_cached_tokens=2, num_output_tokens=2)]

    f = FakeRouter(tmp_path, script)
    yield f
    f.close()


def test_statuses_map_to_error_classes(fake: FakeRouter) -> None:
    with Client(fake.address, "k", timeout=10) as c:
        for prompt, cls, status in (("full", QueueFullError, 429), ("busy", OverloadedError, 503),
                                    ("boom", StrideError, 500)):
            with pytest.raises(cls) as err:
                c.generate(prompt)
            assert type(err.value) is cls and err.value.status == status and err.value.message == f"fake {prompt}"
            assert err.value.retryable == (status in (429, 503))
        out = c.generate("ok")  # the stray output for another id does not leak in
        assert (out.text, out.token_ids, out.finish_reason) == ("xy", [7, 8], "stop")
        assert out.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert fake.generates[0].api_key == "k" and fake.aborts == []  # finished requests are not aborted


def test_abort_timeout_and_close(fake: FakeRouter) -> None:
    c = Client(fake.address, timeout=0.5)
    with pytest.raises(StrideTimeoutError):
        c.generate("hang")
    assert wait_for(lambda: fake.aborts == ["r0"], 5)
    stream = c.stream("hang", timeout=30)
    assert next(stream).text == "a"
    c.close()
    with pytest.raises(StrideError) as err:
        next(stream)  # an open stream learns that its client closed
    assert err.value.status == 499
    with pytest.raises(StrideError):
        c.generate("ok")
    c.close()  # idempotent
    assert wait_for(lambda: fake.aborts == ["r0", "r1"], 5)


def test_async_client_against_fake(fake: FakeRouter) -> None:
    async def main() -> list[Any]:
        async with AsyncClient(fake.address, timeout=10) as ac:
            outs = await ac.generate_batch(["ok", "full", "ok"], return_exceptions=True)
            async with contextlib.aclosing(ac.stream("hang")) as st:
                async for d in st:
                    assert d.text == "a"
                    break
            with pytest.raises(StrideTimeoutError):
                await ac.generate("hang", timeout=0.3)
            return outs

    outs = asyncio.run(main())
    assert isinstance(outs[0], Completion) and outs[0].text == "xy" and isinstance(outs[1], QueueFullError)
    assert wait_for(lambda: len(fake.aborts) == 2, 5)  # the closed stream and the timed-out generate
