"""``scripts/soak.py`` against the simulated backend: every request kind over HTTP and the client library, two
tenants, a third of the requests abandoned at random points, a pool small enough to preempt all the time. The
server must answer every request in its shape, log no error, and come back to rest with no live blocks; and the
trace it recorded must replay decision for decision."""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import runpy
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from e2e_helpers import StrideServer

SOAK = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"


@pytest.mark.slow
def test_a_chaotic_load_leaves_the_server_whole(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 alpha\nk2 beta\n")
    soak = runpy.run_path(str(SOAK), run_name="soak")
    with StrideServer("--backend", "sim", "--num-blocks", "120", "--max-model-len", "2048", "--max-num-seqs", "48",
                      "--api-keys", str(keys), "--trace", str(tmp_path / "trace.jsonl")) as srv:
        found = re.search(r"client library: (ipc://\S+)", "\n".join(srv.log))
        assert found, srv.tail()
        args = argparse.Namespace(url=srv.url, clients=48, requests=600, seed=0, timeout=120.0, keys="k1,k2",
                                  client_address=found[1], probes=False, tie=0.3)
        code = asyncio.run(soak["run"](args))
        report = capsys.readouterr().out
        assert code == 0, report
        # The load was what it says: requests abandoned both ways, the library's among them, and preemption.
        for outcome in ("hung up mid-stream", "cancelled", "library ok", "schema stream ok", "tools ok"):
            assert re.search(rf"{outcome}\s+[1-9]", report), (outcome, report)
        preempted = re.search(r"preemptions (\d+)", report)
        assert preempted and int(preempted[1]) > 0, report
        assert not [line for line in srv.log if " ERROR " in line or "Traceback" in line], srv.tail(80)
    assert srv.leftovers() == [], srv.tail()
    replay = subprocess.run([sys.executable, "-m", "stride", "replay", str(tmp_path / "trace.jsonl")],
                            capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0 and "every decision matched" in replay.stdout, replay.stdout + replay.stderr


def test_the_soak_finds_a_malformed_answer() -> None:
    """The negative control of its checks: bodies a broken server could send are named as faults."""
    soak = runpy.run_path(str(SOAK), run_name="soak")
    check = soak["check_body"]
    req = {"n": 2, "max_tokens": 4, "stop": ["."]}

    def choice(i: int, text: str, finish: str = "length") -> dict[str, object]:
        return {"index": i, "finish_reason": finish, "message": {"content": text}}
    usage = {"prompt_tokens": 5, "completion_tokens": 8}
    assert check("/v1/chat/completions", req, {"choices": [choice(0, "a b"), choice(1, "c d")], "usage": usage},
                 "chat") is None  # the well-formed answer passes
    for body in ({"choices": [choice(0, "a b")], "usage": usage},  # one choice for n=2
                 {"choices": [choice(0, "a. b"), choice(1, "c")], "usage": usage},  # the stop string in the text
                 {"choices": [choice(0, "a"), choice(1, "c", "eos")], "usage": usage},  # an unknown finish reason
                 {"choices": [choice(0, "a"), choice(1, "c")], "usage": dict(usage, completion_tokens=9)}):
        assert check("/v1/chat/completions", req, body, "chat") is not None, body
    schema_req = {"max_tokens": 64}
    assert check("/v1/chat/completions", schema_req, {"choices": [choice(0, '{"age": 3', "stop")], "usage": usage},
                 "schema") is not None
    assert check("/v1/chat/completions", schema_req, {"choices": [choice(0, '{"name": "x", "age": 3}', "stop")],
                                                      "usage": usage}, "schema") is None


def test_a_stream_is_checked_as_its_whole_answer() -> None:
    """A streamed answer is put back together and checked as a non-streamed one: a tool call split over deltas,
    logprobs counted against the usage chunk; a broken call's arguments and a miscount are faults."""
    soak = runpy.run_path(str(SOAK), run_name="soak")

    def whole(events: list[dict[str, object]]) -> dict[str, object]:
        w = soak["Whole"]()
        for event in events:
            w.add(event)
        return w.body("/v1/chat/completions")  # type: ignore[no-any-return]

    def call(args: str, name: str = "") -> dict[str, object]:
        delta = {"tool_calls": [{"index": 0, "function": {"name": name, "arguments": args}}]}
        return {"choices": [{"index": 0, "delta": delta}]}
    req = {"max_tokens": 96, "tools": [], "tool_choice": "auto"}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 5}}
    end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}
    good = [call('{"ci', "get_weather"), call('ty": "Oslo"}'), end, usage]
    assert soak["check_body"]("/v1/chat/completions", req, whole(good), "tools") is None
    assert whole(good)["choices"][0]["message"]["tool_calls"] == [  # type: ignore[index]
        {"function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]
    bad = [call('{"ci', "get_weather"), call('ty": "Oslo", "x": 1}'), end, usage]
    assert soak["check_body"]("/v1/chat/completions", req, whole(bad), "tools") is not None

    def token(text: str) -> dict[str, object]:
        return {"index": 0, "delta": {"content": text},
                "logprobs": {"content": [{"token": text, "logprob": -1.0, "top_logprobs": []}]}}
    chat = {"max_tokens": 8, "logprobs": True}
    stop = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    counted = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    stream = [{"choices": [token("a")]}, {"choices": [token(" b")]}, stop, counted]
    assert soak["check_body"]("/v1/chat/completions", chat, whole(stream), "chat") is None
    miscounted = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    assert soak["check_body"]("/v1/chat/completions", chat, whole(stream[:3] + [miscounted]), "chat") is not None
    # a stop string split across two deltas is still found in the whole text
    stopped = dict(chat, stop=["a b"])
    assert soak["check_body"]("/v1/chat/completions", stopped, whole(stream), "chat") is not None
    assert soak["check_body"]("/v1/chat/completions", dict(chat, stop=["ab"]), whole(stream), "chat") is None


def test_the_soak_faults_an_error_status_on_every_path() -> None:
    """A server answering every request with a 500: whichever way a request goes (streamed or not, abandoned at a
    random point or not), it is a fault or a request cancelled before its answer came, never an outcome that
    passes. The path that would hide it: a request to be abandoned whose answer came before its cancel."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    soak = runpy.run_path(str(SOAK), run_name="soak")

    async def fail(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"error": {"message": "boom"}}, status=500)

    async def main() -> tuple[object, object]:
        app = web.Application()
        app.router.add_post("/v1/{tail:.*}", fail)
        tally = soak["Tally"]()
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("")).rstrip("/")
            await asyncio.gather(*(soak["one"](session, url, random.Random(seed), "m", tally, [])
                                   for seed in range(60)))
        return tally.outcomes, tally.faults

    outcomes, faults = asyncio.run(main())
    assert set(outcomes) <= {"fault", "cancelled"}, outcomes  # type: ignore[arg-type]
    assert len(faults) > 40 and all("status 500" in f for f in faults), faults  # type: ignore[arg-type]
