"""The client-library socket: ClientGenerate in, ClientOutput out, validated and tenanted like HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from e2e_helpers import Dealer
from frontend_helpers import LiveServer, make_config, wait_for

from stride.ipc.messages import ClientAbort, ClientGenerate, Message
from stride.ipc.rundir import remove_run_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = Path(tmp_path_factory.mktemp("keys")) / "keys.txt"
    keys.write_text("secret carol\n")
    config = make_config(api_keys_file=str(keys))
    try:
        with LiveServer(config) as srv:
            yield srv
    finally:
        remove_run_dir(config.ipc)


@pytest.fixture
def dealer(server: LiveServer) -> Iterator[Dealer]:
    d = Dealer(server.config.ipc.client_address())
    yield d
    d.close()


def test_generate_text_and_token_ids(dealer: Dealer, server: LiveServer) -> None:
    dealer.send(ClientGenerate(req_id="a", api_key="secret", prompt="hello", params={"max_tokens": 3}))
    outs = dealer.until_done("a")
    assert "".join(o.text for o in outs) == "w0 w1 w2 " and outs[-1].finish_reason == "length"
    assert outs[-1].num_prompt_tokens == 5 and outs[-1].num_output_tokens == 3
    assert server.fake.generates[-1].tenant == "carol"
    dealer.send(ClientGenerate(req_id="b", api_key="secret", prompt_token_ids=[9, 8, 7],
                               params={"max_tokens": 1, "temperature": 0, "seed": 1, "stop": ["zz"]}))
    outs = dealer.until_done("b")
    assert outs[-1].text == "s1_0 " and server.fake.generates[-1].prompt_token_ids == [9, 8, 7]
    assert server.fake.generates[-1].params.stop == ("zz",)
    dealer.send(ClientGenerate(req_id="c", api_key="secret", messages=[{"role": "user", "content": "x"}],
                               params={"max_tokens": 2, "logprobs": 1}))
    outs = dealer.until_done("c")
    assert outs[0].logprobs is not None and len(outs[0].logprobs[0]["top_logprobs"]) == 1


def test_outputs_coalesce_only_what_arrived_together(dealer: Dealer) -> None:
    """300 deltas sent back to back reach the client in a few outputs holding every token, logprob and count;
    deltas that arrive apart (SLOW: one per 50 ms) each get their own output. Negative control: before outputs
    were coalesced, the 300 came as 300."""
    dealer.send(ClientGenerate(req_id="f", api_key="secret", prompt="flood",
                               params={"max_tokens": 300, "logprobs": 0}))
    outs = dealer.until_done("f")
    assert "".join(o.text for o in outs) == "".join(f"w{i} " for i in range(300))
    assert [t for o in outs for t in o.token_ids] == [1000 + i for i in range(300)]
    assert sum(len(o.logprobs or []) for o in outs) == 300 and all(o.logprobs for o in outs)
    assert outs[-1].num_output_tokens == 300 and outs[-1].finish_reason == "length"
    assert len(outs) <= 300 // 4
    dealer.send(ClientGenerate(req_id="s", api_key="secret", prompt="SLOW", params={"max_tokens": 4}))
    assert [o.text for o in dealer.until_done("s")] == ["w0 ", "w1 ", "w2 ", "w3 "]
    dealer.send(ClientGenerate(req_id="e", api_key="secret", prompt="FAILAFTER3", params={"max_tokens": 9}))
    outs = dealer.until_done("e")  # the tokens that came before the failure, then the failure
    assert "".join(o.text for o in outs) == "w0 w1 w2 " and outs[-1].status == 503 and outs[-1].error


def test_refusals(dealer: Dealer, server: LiveServer) -> None:
    before = len(server.fake.generates)
    cases = [
        (ClientGenerate(req_id="k", api_key="wrong", prompt="x"), 401),
        (ClientGenerate(req_id="k0", prompt="x"), 401),
        (ClientGenerate(req_id="t", api_key="secret", prompt="x", params={"top_p": 2}), 400),
        (ClientGenerate(req_id="u", api_key="secret", prompt="x", params={"bogus": 1}), 400),
        (ClientGenerate(req_id="v", api_key="secret", params={}), 400),
        (ClientGenerate(req_id="w", api_key="secret", prompt="x", prompt_token_ids=[1]), 400),
    ]
    for msg, status in cases:
        dealer.send(msg)
        out = dealer.until_done(msg.req_id)[-1]
        assert out.status == status and out.error, (msg, out)
    assert len(server.fake.generates) == before
    dealer.send(ClientGenerate(req_id="q", api_key="secret", prompt="FAIL429"))
    out = dealer.until_done("q")[-1]
    assert out.status == 429 and out.error == "fake FAIL429"


def test_abort_and_disconnect(dealer: Dealer, server: LiveServer) -> None:
    before = len(server.fake.generates)
    dealer.send(ClientGenerate(req_id="slow", api_key="secret", prompt="SLOW", params={"max_tokens": 2000}))
    first = dealer.recv()
    assert first.req_id == "slow" and first.finish_reason is None
    seq_id = server.fake.generates[before].req_id
    assert seq_id not in server.fake.aborts
    dealer.send(ClientAbort(req_id="slow"))
    assert wait_for(lambda: seq_id in server.fake.aborts)
    # The id is free again once the abort is through.
    dealer.send(ClientGenerate(req_id="slow", api_key="secret", prompt="quick", params={"max_tokens": 1}))
    outs = [o for o in dealer.until_done("slow") if o.text]
    assert outs and outs[-1].text == "w0 "


def test_vanished_client_is_aborted(server: LiveServer) -> None:
    d = Dealer(server.config.ipc.client_address())
    before = len(server.fake.generates)
    d.send(ClientGenerate(req_id="gone", api_key="secret", prompt="SLOW", params={"max_tokens": 2000}))
    assert d.recv().req_id == "gone"
    seq_id = server.fake.generates[before].req_id
    assert seq_id not in server.fake.aborts
    d.close()
    assert wait_for(lambda: seq_id in server.fake.aborts)


def test_process_entry_point_reports_ready_and_shuts_down() -> None:
    """``run(config)`` in its own process: ProcessReady with the bound port, /health, exit on Shutdown."""
    import http.client
    import json
    import subprocess
    import sys

    from stride.ipc.messages import TO_LAUNCHER, ProcessReady, Shutdown
    from stride.ipc.queues import PullQueue, PushQueue

    config = make_config()
    ctx = zmq.Context()
    control: PullQueue[Message] = PullQueue(ctx, config.ipc.control_address(), TO_LAUNCHER)
    code = ("import json, sys; from stride.config import StrideConfig; from stride.frontend.app import run; "
            "sys.exit(run(StrideConfig.from_dict(json.loads(sys.argv[1]))))")
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(config.to_dict())])
    try:
        ready = control.get(timeout_ms=30_000)
        assert isinstance(ready, ProcessReady) and ready.role == "frontend" and ready.port > 0
        conn = http.client.HTTPConnection("127.0.0.1", ready.port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        assert proc.poll() is None  # negative control: it keeps serving until told
        push: PushQueue[Message] = PushQueue(ctx, config.ipc.frontend_address())
        push.put(Shutdown(reason="test"))
        assert proc.wait(timeout=30) == 0
        push.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        control.close()
        ctx.term()
        remove_run_dir(config.ipc)
