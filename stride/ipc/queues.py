"""Typed ZeroMQ queues: a push end that sends messages of one group, a pull end that decodes them.

The pull end owns the decoder for its message group, built once; a malformed frame is logged and
dropped, never raised into the process loop. Addresses always come from :class:`stride.config.IpcConfig`.
Sockets close with a short linger, so a process can shut down while messages are still pending.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

import zmq
import zmq.asyncio

from stride.ipc.codec import Decoder, Message, encode

M = TypeVar("M", bound=Message)

LINGER_MS = 100
HWM = 100_000
RECEIVE_BURST = 32
"""Messages an asyncio receive loop handles before it yields to the event loop. Awaiting a ZeroMQ receive that finds
a message waiting returns without yielding, so under a steady flood a loop that never yields starves every other
task: the frontend's response writers then sent each stream's tokens in one burst at its end (H200, SmolLM2 at 128
concurrent streams: the first token came with the last, about a second after the request)."""


class Turns:
    """An asyncio receive loop's share of the event loop: :meth:`taken` after each message received yields to the
    other tasks every :data:`RECEIVE_BURST` messages."""

    def __init__(self) -> None:
        self._count = 0

    async def taken(self) -> None:
        self._count += 1
        if self._count % RECEIVE_BURST == 0:
            await asyncio.sleep(0)


def _setup(sock: zmq.Socket, address: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)


class PushQueue(Generic[M]):
    """Sends messages; ``bind=False`` (connect) is the usual case for a producer."""

    def __init__(self, ctx: zmq.Context, address: str, *, bind: bool = False) -> None:
        self.address = address
        self._sock = ctx.socket(zmq.PUSH)
        _setup(self._sock, address, bind)

    def put(self, msg: M) -> None:
        self._sock.send(encode(msg))

    def put_nowait(self, msg: M) -> bool:
        """Send unless the peer's queue is full (or absent); False if it would block."""
        try:
            self._sock.send(encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def close(self) -> None:
        self._sock.close()


class PullQueue(Generic[M]):
    """Receives and decodes messages of ``classes``; ``bind=True`` is the usual case for a consumer."""

    def __init__(self, ctx: zmq.Context, address: str, classes: tuple[type[Message], ...],
                 *, bind: bool = True) -> None:
        self.address = address
        self._decoder: Decoder[M] = Decoder(classes)  # type: ignore[arg-type]
        self._sock = ctx.socket(zmq.PULL)
        _setup(self._sock, address, bind)

    @property
    def socket(self) -> zmq.Socket:
        """For registering with a ``zmq.Poller`` alongside other queues."""
        return self._sock

    def get(self, timeout_ms: int | None = None) -> M | None:
        """The next well-formed message, or None when ``timeout_ms`` passes first. Bad frames are skipped."""
        while True:
            if timeout_ms is not None and not self._sock.poll(timeout_ms):
                return None
            msg = self._decoder.decode_or_log(self._sock.recv(copy=True))
            if msg is not None:
                return msg

    def drain(self, limit: int = 1 << 30) -> list[M]:
        """Every message already waiting (up to ``limit``), without blocking."""
        out: list[M] = []
        while len(out) < limit:
            try:
                frame = self._sock.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            msg = self._decoder.decode_or_log(frame)
            if msg is not None:
                out.append(msg)
        return out

    def close(self) -> None:
        self._sock.close()


class AsyncPushQueue(Generic[M]):
    """:class:`PushQueue` for asyncio processes (the frontend)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, *, bind: bool = False) -> None:
        self.address = address
        self._sock = ctx.socket(zmq.PUSH)
        _setup(self._sock, address, bind)

    async def put(self, msg: M) -> None:
        await self._sock.send(encode(msg))

    def close(self) -> None:
        self._sock.close()


class AsyncPullQueue(Generic[M]):
    """:class:`PullQueue` for asyncio processes (the frontend)."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, classes: tuple[type[Message], ...],
                 *, bind: bool = True) -> None:
        self.address = address
        self._decoder: Decoder[M] = Decoder(classes)  # type: ignore[arg-type]
        self._sock = ctx.socket(zmq.PULL)
        _setup(self._sock, address, bind)
        self._turns = Turns()

    async def get(self) -> M:
        """The next message; every :data:`RECEIVE_BURST` messages it first lets the other tasks run."""
        while True:
            frame = await self._sock.recv(copy=True)
            await self._turns.taken()
            msg = self._decoder.decode_or_log(frame)
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close()
