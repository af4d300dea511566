"""The frontend's Backend under a flood of deltas: streams see their tokens while more are still arriving."""

from __future__ import annotations

import asyncio
import time

import zmq

from stride.frontend.backend import RECEIVE_BURST, Backend, RequestStream
from stride.ipc.codec import encode
from stride.ipc.messages import TextDelta
from stride.ipc.rundir import make_ipc_config, remove_run_dir

FLOOD = 600


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
        time.sleep(0.5)  # blocks the loop: every delta reaches the socket before the receiver's first turn
        await asyncio.wait_for(task, 10)
        return backlog[0], texts
    finally:
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
