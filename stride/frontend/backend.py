"""The frontend's side of the wire: sends requests to the tokenizer pool, receives their text deltas, and
aborts what a client abandons. Does no HTTP; both the HTTP handlers and the client-library server use it.

One receiver task reads the frontend's PULL socket and routes each delta by ``req_id`` to the
:class:`RequestStream` of the request the sequence belongs to.

Cancellation has one path: an abort goes to the tokenizer the sequence was sent to, on the same socket and so
after the request itself; that tokenizer drops its state and passes the abort on to the scheduler, after the
tokenized request if it sent one. So an abort reaches its request wherever it is -- still queued at a busy
tokenizer, waiting at the scheduler, or running -- and never arrives before it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from stride.config import IpcConfig
from stride.ipc.messages import (
    TO_FRONTEND,
    AbortRequest,
    GenerateRequest,
    Message,
    RequestFailed,
    SchedulerStats,
    Shutdown,
    TextDelta,
    TextDeltas,
)
from stride.ipc.queues import AsyncPullQueue, AsyncPushQueue

log = logging.getLogger(__name__)

WORKER_DEAD = "worker_dead"
SHUTTING_DOWN = "shutting_down"

Event = tuple[int, TextDelta | RequestFailed]
"""(sequence index within the request, what arrived for it)."""


@dataclass
class RequestStream:
    """The deltas of one request's ``n`` sequences, in arrival order, on one queue."""

    req_id: str
    seq_ids: list[str]
    tokenizer_of: dict[str, int]
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    finished: set[str] = field(default_factory=set)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.seq_ids)


class Backend:
    """Owns the frontend's ZeroMQ sockets. Start with :meth:`start` inside the serving event loop."""

    def __init__(self, ipc: IpcConfig, num_tokenizers: int) -> None:
        self.ipc = ipc
        self.num_tokenizers = num_tokenizers
        self.healthy = True
        self.unhealthy_reason = ""
        self.on_stats: Callable[[SchedulerStats], None] | None = None
        """Called with every scheduler stats snapshot (the metrics hook)."""
        self.on_shutdown: Callable[[str], None] | None = None
        """Called when a :class:`Shutdown` message arrives (the launcher asks the frontend to exit)."""
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # seq req_id → (stream, index)
        self._rr = itertools.count()
        self._ctx: zmq.asyncio.Context | None = None
        self._tokenizers: list[AsyncPushQueue[Message]] = []
        self._pull: AsyncPullQueue[Message] | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self._handlers: dict[type, Callable[[Any], None]] = {
            TextDelta: self._deliver, TextDeltas: self._deliver_all, RequestFailed: self._on_failed,
            SchedulerStats: self._on_stats,
            Shutdown: self._on_shutdown}

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = AsyncPullQueue(self._ctx, self.ipc.frontend_address(), TO_FRONTEND + (Shutdown,))
        self._tokenizers = [AsyncPushQueue(self._ctx, self.ipc.tokenizer_address(i))
                            for i in range(self.num_tokenizers)]
        self._receiver = asyncio.create_task(self._receive(), name="frontend-receiver")

    async def stop(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        if self._pending:
            await asyncio.wait(self._pending, timeout=1.0)
        for q in [*self._tokenizers, self._pull]:
            if q is not None:
                q.close()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @property
    def num_in_flight(self) -> int:
        return len({id(s) for s, _ in self._streams.values()})

    def mark_unhealthy(self, reason: str, level: int = logging.ERROR) -> None:
        """Turn ``/health`` to 503 and refuse new requests (a worker died: an error; the launcher is shutting down:
        ``level`` INFO, an orderly stop is no error)."""
        if self.healthy:
            log.log(level, "frontend marked unhealthy: %s", reason)
        self.healthy = False
        self.unhealthy_reason = reason

    async def submit(self, req_id: str, seqs: list[GenerateRequest]) -> RequestStream:
        """Register the request's stream, then send each sequence to a tokenizer (round-robin). If sending fails
        part way, what was sent is aborted before the error propagates."""
        stream = RequestStream(req_id=req_id, seq_ids=[s.req_id for s in seqs], tokenizer_of={})
        for i, seq in enumerate(seqs):
            stream.tokenizer_of[seq.req_id] = next(self._rr) % self.num_tokenizers
            self._streams[seq.req_id] = (stream, i)
        try:
            for seq in seqs:
                await self._tokenizers[stream.tokenizer_of[seq.req_id]].put(seq)
        except BaseException:
            self.close(stream)
            raise
        return stream

    def close(self, stream: RequestStream) -> None:
        """Forget a request; every sequence not yet finished is aborted through its tokenizer (which releases it
        and tells the scheduler). Safe to call from a ``finally`` of a cancelled task: the sends run in tasks."""
        for seq_id in stream.seq_ids:
            self._streams.pop(seq_id, None)
            if seq_id not in stream.finished:
                stream.finished.add(seq_id)
                self._spawn(self._abort(seq_id, stream.tokenizer_of[seq_id]))

    async def _abort(self, seq_id: str, tokenizer: int) -> None:
        await self._tokenizers[tokenizer].put(AbortRequest(req_id=seq_id))

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _receive(self) -> None:
        assert self._pull is not None
        while True:
            msg = await self._pull.get()  # lets the writers run every RECEIVE_BURST messages
            try:
                self._dispatch(msg)
            except Exception:
                log.exception("frontend: failed to dispatch %s", type(msg).__name__)

    def _dispatch(self, msg: Message) -> None:
        self._handlers[type(msg)](msg)

    def _on_stats(self, msg: SchedulerStats) -> None:
        if self.on_stats is not None:
            self.on_stats(msg)

    def _on_shutdown(self, msg: Shutdown) -> None:
        self.shut_down(msg.reason)
        if self.on_shutdown is not None:
            self.on_shutdown(msg.reason)

    def _on_failed(self, msg: RequestFailed) -> None:
        if msg.code == WORKER_DEAD:
            self.mark_unhealthy(msg.message)
            if not msg.req_id:  # broadcast: every request in flight fails
                self.fail_all(msg.status, msg.message, msg.code)
                return
        self._deliver(msg)

    def shut_down(self, reason: str) -> None:
        """Refuse new requests and end every one in flight with an error, so a stream closes with an error
        event rather than being cut off when the server stops. Idempotent."""
        self.mark_unhealthy(f"shutting down: {reason}", logging.INFO)
        self.fail_all(503, f"the server is shutting down: {reason}", SHUTTING_DOWN)

    def fail_all(self, status: int, message: str, code: str) -> None:
        """Fail every sequence in flight (its stream gets a :class:`RequestFailed`)."""
        for seq_id in list(self._streams):
            self._deliver(RequestFailed(req_id=seq_id, status=status, message=message, code=code))

    def _deliver_all(self, msg: TextDeltas) -> None:
        for d in msg.deltas:
            self._deliver(d)

    def _deliver(self, msg: TextDelta | RequestFailed) -> None:
        entry = self._streams.get(msg.req_id)
        if entry is None:
            return  # late output of an aborted request
        stream, index = entry
        # Whoever failed a sequence (tokenizer, scheduler) has already released it everywhere it was held.
        if isinstance(msg, RequestFailed) or msg.finish_reason is not None:
            stream.finished.add(msg.req_id)
            del self._streams[msg.req_id]
        stream.queue.put_nowait((index, msg))
