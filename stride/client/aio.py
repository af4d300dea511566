"""The asyncio client of :mod:`stride.client` (import it from there). One DEALER socket; a reader task
routes each :class:`~stride.ipc.messages.ClientOutput` to the queue of its request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import zmq
import zmq.asyncio

from stride.client.common import (
    CLOSED_STATUS,
    TIMEOUT_STATUS,
    Assembler,
    Completion,
    Delta,
    Prompt,
    StrideError,
    StrideTimeoutError,
    deadline_after,
    make_request,
    read_address_file,
)
from stride.ipc.codec import Decoder, encode
from stride.ipc.messages import TO_CLIENT, ClientAbort, ClientOutput, Message
from stride.ipc.queues import Turns

log = logging.getLogger(__name__)


class AsyncClient:
    """An asyncio client; many requests run concurrently over its one socket (``asyncio.gather``).
    Cancelling a task inside :meth:`generate` or :meth:`stream` aborts that request at the server."""

    def __init__(self, address: str, api_key: str = "", *, timeout: float | None = None) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        """Default deadline in seconds for one request."""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._queues: dict[str, asyncio.Queue[ClientOutput]] = {}
        self._decoder: Decoder[Message] = Decoder(TO_CLIENT)
        self._closed = False

    @classmethod
    def from_address_file(cls, path: str, api_key: str = "", *, wait_s: float = 0.0,
                          timeout: float | None = None) -> AsyncClient:
        return cls(read_address_file(path, wait_s)["client_address"], api_key, timeout=timeout)

    # -------------------------------------------------------------- public

    async def generate(self, prompt: Prompt | None = None, *, prompt_token_ids: list[int] | None = None,
                       messages: list[dict[str, Any]] | None = None, timeout: float | None = None,
                       **params: Any) -> Completion:
        """Run one request to its end."""
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        req_id, queue = await self._submit(prompt, prompt_token_ids, messages, params)
        asm = Assembler()
        try:
            while not asm.done:
                asm.add(await self._next(queue, deadline))
        finally:
            self._abort(req_id, asm.done)
        return asm.completion()

    async def stream(self, prompt: Prompt | None = None, *, prompt_token_ids: list[int] | None = None,
                     messages: list[dict[str, Any]] | None = None, timeout: float | None = None,
                     **params: Any) -> AsyncIterator[Delta]:
        """Yield the request's deltas as they come. Leaving early aborts the request: at once with
        ``aclose()`` (or ``contextlib.aclosing``), otherwise when the iterator is collected."""
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        req_id, queue = await self._submit(prompt, prompt_token_ids, messages, params)
        asm = Assembler()
        try:
            while not asm.done:
                yield asm.add(await self._next(queue, deadline))
        finally:
            self._abort(req_id, asm.done)

    async def generate_batch(self, prompts: Iterable[Prompt], *, max_in_flight: int | None = None,
                             return_exceptions: bool = False, **params: Any) -> list[Completion | StrideError]:
        """Every prompt concurrently (at most ``max_in_flight`` at a time); results in prompt order. A
        failure raises and cancels (aborts) the rest unless ``return_exceptions``."""
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        gate = asyncio.Semaphore(max_in_flight or 1 << 30)

        async def one(p: Prompt) -> Completion | StrideError:
            async with gate:
                try:
                    return await self.generate(p, **params)
                except StrideError as e:
                    if return_exceptions:
                        return e
                    raise

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def close(self) -> None:
        """Abort every open request, stop the reader and close the socket. Idempotent."""
        if self._closed:
            return
        if self._sock is not None:
            for req_id in self._queues:
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send(encode(ClientAbort(req_id=req_id)), zmq.NOBLOCK)
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._fail_open("the client is closed")
        if self._sock is not None:
            self._sock.close(linger=100)  # long enough for the aborts just queued to leave
        if self._ctx is not None:
            self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -------------------------------------------------------------- wire

    async def _submit(self, prompt: Prompt | None, prompt_token_ids: list[int] | None,
                      messages: list[dict[str, Any]] | None,
                      params: dict[str, Any]) -> tuple[str, asyncio.Queue[ClientOutput]]:
        if self._closed:
            raise StrideError(CLOSED_STATUS, "the client is closed")
        if self._sock is None:
            self._ctx = zmq.asyncio.Context()
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
            self._reader = asyncio.create_task(self._read(), name="stride-client-reader")
        req_id = f"r{next(self._ids)}"
        frame = make_request(req_id, self.api_key, prompt, prompt_token_ids, messages, params)
        queue: asyncio.Queue[ClientOutput] = asyncio.Queue()
        self._queues[req_id] = queue
        await self._sock.send(frame)
        return req_id, queue

    def _abort(self, req_id: str, ended: bool) -> None:
        """Forget ``req_id``; tell the server to stop it unless it ended. Never awaits, so it is safe in a
        ``finally`` under cancellation."""
        queue = self._queues.pop(req_id, None)
        if queue is None or ended or self._closed or self._sock is None:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(encode(ClientAbort(req_id=req_id)), zmq.NOBLOCK)

    async def _next(self, queue: asyncio.Queue[ClientOutput], deadline: float | None) -> ClientOutput:
        if deadline is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise StrideTimeoutError(TIMEOUT_STATUS, "timed out waiting for the server") from None

    async def _read(self) -> None:
        try:
            turns = Turns()  # the requests' consumers run during a flood of outputs
            while True:
                msg = self._decoder.decode_or_log(await self._sock.recv())
                await turns.taken()
                # Outputs of ids no longer open are late ones of aborted requests.
                if isinstance(msg, ClientOutput) and msg.req_id in self._queues:
                    self._queues[msg.req_id].put_nowait(msg)
        except zmq.ZMQError as e:
            log.error("stride client: socket failed: %s", e)
            self._fail_open(f"socket failed: {e}")

    def _fail_open(self, reason: str) -> None:
        for req_id, queue in self._queues.items():
            queue.put_nowait(ClientOutput(req_id=req_id, status=CLOSED_STATUS, error=reason))
