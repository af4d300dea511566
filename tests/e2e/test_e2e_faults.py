"""End to end: the rank worker is killed while requests stream. Clients get an error promptly (not a
hang), ``/health`` turns unhealthy or the server is gone, and the launcher shuts everything down: no child
process, shared-memory segment or runtime directory of the launch survives."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
from e2e_helpers import StrideServer

NUM_CLIENTS = 4
CLIENT_TIMEOUT_S = 60.0
"""A client that hears nothing for this long counts as hung (the test fails)."""


async def _stream(session: aiohttp.ClientSession, url: str, model: str, i: int,
                  started: asyncio.Queue[int]) -> str:
    """A long streamed generation. Returns how it ended: 'error' (in-band error event, an error status, or
    the connection dropped before [DONE]), 'done' or 'timeout'."""
    body = {"model": model, "prompt": f"Count to a thousand, client {i}:", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}
    chunks = 0
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return "error"
            async for raw in resp.content:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: {"):
                    if "error" in json.loads(line[6:]):
                        return "error"
                    chunks += 1
                    if chunks == 2:
                        started.put_nowait(i)
        return "error"  # closed without [DONE]
    except TimeoutError:
        return "timeout"
    except aiohttp.ClientError:
        return "error"


async def _kill_during_load(server: StrideServer, worker_pid: int) -> list[str]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=CLIENT_TIMEOUT_S)
    started: asyncio.Queue[int] = asyncio.Queue()
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [asyncio.create_task(_stream(session, server.url, server.model, i, started))
                 for i in range(NUM_CLIENTS)]
        for _ in range(NUM_CLIENTS):  # every client is mid-stream
            await asyncio.wait_for(started.get(), 240)
        os.kill(worker_pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))


@pytest.mark.slow
def test_killing_the_worker_fails_clients_and_leaves_nothing() -> None:
    server = StrideServer("--max-num-seqs", "4", "--num-blocks", "128", "--max-model-len", "2048",
                          "--tokenizer-workers", "1").start()
    try:
        children = server.child_pids()
        assert set(children) == {"worker 0", "tokenizer 0", "scheduler 0", "frontend 0"}, children
        assert server.shm_segments()  # control: the launch's segments exist while it runs
        outcomes = asyncio.run(_kill_during_load(server, children["worker 0"]))
        assert outcomes == ["error"] * NUM_CLIENTS
        # Health is unhealthy while the launcher winds down, or the server is already gone.
        try:
            status, body = server.get("/health", timeout=5)
            assert status == 503 and json.loads(body)["status"] == "unhealthy", body
        except OSError:
            pass
        assert server.proc is not None
        status_code = server.proc.wait(30)  # the launcher stops on its own
        assert status_code == 1, server.tail()
    finally:
        server.stop()
    deadline = time.monotonic() + 5.0  # children the launcher reaped may take a moment to leave /proc
    while server.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.leftovers() == [], server.tail()
    assert any("worker 0" in line for line in server.log), server.tail()  # the launcher said why
