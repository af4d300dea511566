"""asyncio receive loops under a flood: the frontend's Backend and the async client's reader let their consumers run."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from stride.frontend.backend import Backend, RequestStream
from stride.ipc.codec import encode
from stride.ipc.messages import TextDelta
from stride.ipc.queues import RECEIVE_BURST
from stride.ipc.rundir import make_ipc_config, remove_run_dir

FLOOD = 600


def flush(ctx: zmq.Context, sock: zmq.Socket) -> None:
    """Block (and so keep the event loop from running) until everything ``sock`` was given has been sent: closing
    with an infinite linger and ending its context waits for exactly that."""
    sock.close(linger=-1)
    ctx.term()


async def _first_wakeup_backlog() -> tuple[int, list[str]]:
    """Queue FLOOD deltas of one sequence in the frontend's socket before its receiver runs; return how many
    were already on the stream's queue when the stream's reader first woke, and every text it read."""
    ipc = make_ipc_config()
    backend = Backend(ipc, num_tokenizers=1)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        await backend.start()
        stream = RequestStream(req_id="r", seq_ids=["r-0"], tokenizer_of={"r-0": 0})
        backend._streams["r-0"] = (stream, 0)
        backlog: list[int] = []
        texts: list[str] = []

        async def reader() -> None:
            while True:
                _, msg = await stream.queue.get()
                if not backlog:
                    backlog.append(stream.queue.qsize() + 1)
                assert isinstance(msg, TextDelta)
                texts.append(msg.text)
                if msg.finish_reason is not None:
                    return

        task = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader now waits on its queue
        push.connect(ipc.frontend_address())
        for i in range(FLOOD):
            push.send(encode(TextDelta(req_id="r-0", text=f"t{i}", token_ids=[i],
                                       finish_reason="length" if i == FLOOD - 1 else None)))
        flush(ctx, push)  # every delta is on its way before the receiver's first turn
        await asyncio.wait_for(task, 10)
        return backlog[0], texts
    finally:
        if not push.closed:
            push.close(linger=0)
            ctx.term()
        await backend.stop()
        remove_run_dir(ipc)


def test_streams_are_served_during_a_flood_of_deltas() -> None:
    """The receiver yields every RECEIVE_BURST messages, so the reader first wakes with at most that many
    waiting, not the whole flood (without the yield it woke to all 600), and still reads every delta in order."""
    backlog, texts = asyncio.run(_first_wakeup_backlog())
    assert texts == [f"t{i}" for i in range(FLOOD)]
    assert backlog <= RECEIVE_BURST < FLOOD


async def _client_first_wakeup_backlog() -> tuple[int, int]:
    """The async client's reader under a flood: FLOOD outputs for one request queued at its socket before the
    reader's first turn; how many were on the request's queue when its consumer first woke, and how many it read."""
    from stride.client import AsyncClient
    from stride.ipc.codec import Decoder
    from stride.ipc.messages import TO_CLIENT_SERVER, ClientGenerate, ClientOutput

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = AsyncClient(f"tcp://127.0.0.1:{port}")
    try:
        req_id, queue = await client._submit("hi", None, None, {})
        identity, frame = router.recv_multipart()
        req = Decoder(TO_CLIENT_SERVER).decode(frame)
        assert isinstance(req, ClientGenerate) and req.req_id == req_id
        for i in range(FLOOD):
            router.send_multipart([identity, encode(ClientOutput(
                req_id=req_id, text=f"t{i}", token_ids=[i], finish_reason="length" if i == FLOOD - 1 else None))])
        flush(ctx, router)  # every output is on its way before the client's reader runs
        await queue.get()
        backlog = queue.qsize() + 1
        read = 1
        while True:
            out = await asyncio.wait_for(queue.get(), 10)
            read += 1
            if out.finish_reason is not None:
                return backlog, read
    finally:
        await client.close()
        if not router.closed:
            router.close(linger=0)
            ctx.term()


def test_async_client_reader_yields_during_a_flood() -> None:
    """As the frontend's receiver: the client's reader yields every RECEIVE_BURST outputs, so a request's
    consumer runs while the flood is still being read (without the yield it woke to all 600), and gets them all."""
    backlog, read = asyncio.run(_client_first_wakeup_backlog())
    assert read == FLOOD
    assert backlog <= RECEIVE_BURST < FLOOD


def test_an_orderly_stop_is_no_error_and_a_dead_worker_is(caplog: pytest.LogCaptureFixture) -> None:
    """``shut_down`` (SIGTERM, the launcher stopping) turns ``/health`` to 503 with an INFO line; a dead worker's
    broadcast does it with an ERROR (every stop logged ``frontend marked unhealthy`` as an error)."""
    import logging

    from stride.frontend.backend import WORKER_DEAD
    from stride.ipc.messages import RequestFailed

    ipc = make_ipc_config()
    try:
        caplog.set_level(logging.INFO, "stride.frontend.backend")
        stopping = Backend(ipc, num_tokenizers=1)
        stopping.shut_down("launcher")
        assert not stopping.healthy and "shutting down: launcher" in stopping.unhealthy_reason
        dead = Backend(ipc, num_tokenizers=1)
        dead._on_failed(RequestFailed(req_id="", status=503, message="worker 0 died", code=WORKER_DEAD))
        assert not dead.healthy
        levels = {r.getMessage(): r.levelname for r in caplog.records if "marked unhealthy" in r.getMessage()}
        assert levels == {"frontend marked unhealthy: shutting down: launcher": "INFO",
                          "frontend marked unhealthy: worker 0 died": "ERROR"}, levels
    finally:
        remove_run_dir(ipc)
