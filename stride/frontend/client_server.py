"""The ROUTER socket that serves :mod:`stride.client` (no HTTP): ``ClientGenerate`` in, ``ClientOutput``
out, framed ``[identity, message]``. Requests are validated and tenanted exactly like HTTP bodies.

A client's ``req_id`` is only unique per connection, so each request gets a frontend-wide id; a
``ClientAbort`` (or a new request reusing a live id) is matched by ``(identity, req_id)``.

A frame over ``ServerConfig.max_body_bytes`` is refused (413) before it is decoded, and a frame that does not
decode is refused (400): either answer goes to the request id the frame names, when one can be read from it, so
the client is not left waiting for its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import zmq
import zmq.asyncio

from stride.config import StrideConfig
from stride.frontend.auth import Authenticator
from stride.frontend.backend import Backend
from stride.frontend.errors import ApiError
from stride.frontend.metrics import FrontendMetrics
from stride.frontend.protocol import Limits, parse_client
from stride.frontend.streaming import Generation
from stride.ipc.codec import DecodeError, Decoder, encode
from stride.ipc.messages import TO_CLIENT_SERVER, ClientAbort, ClientGenerate, ClientOutput, Message, TextDelta
from stride.ipc.queues import HWM, LINGER_MS, Turns

log = logging.getLogger(__name__)

HARD_FRAME_FACTOR = 8
"""ZeroMQ drops (and disconnects) a frame past this many times ``max_body_bytes`` without reading it into memory;
between the two bounds a frame is read and refused with a reply."""
_REQ_ID = re.compile(rb'"req_id"\s*:\s*"((?:[^"\\]|\\.){1,256})"')


class ClientServer:
    """Serves client-library requests over the frontend's :class:`Backend`."""

    def __init__(self, config: StrideConfig, backend: Backend, auth: Authenticator,
                 metrics: FrontendMetrics, limits: Limits) -> None:
        self.config = config
        self.limits = limits
        self.max_frame = config.server.max_body_bytes
        self.backend = backend
        self.auth = auth
        self.metrics = metrics
        self._decoder: Decoder[Message] = Decoder(TO_CLIENT_SERVER)
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: Any = None
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: dict[tuple[bytes, str], asyncio.Task[None]] = {}
        self._handlers: dict[type, Callable[[bytes, Any], Awaitable[None]]] = {
            ClientAbort: self._on_abort, ClientGenerate: self._on_generate}

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._sock.setsockopt(zmq.SNDHWM, HWM)
        self._sock.setsockopt(zmq.RCVHWM, HWM)
        # Sending to a client that has gone raises EHOSTUNREACH instead of dropping silently: that is how
        # a vanished client's requests get aborted.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_FACTOR * self.max_frame)
        self._sock.bind(self.config.ipc.client_address())
        self._loop_task = asyncio.create_task(self._serve(), name="client-server")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()

    async def _serve(self) -> None:
        turns = Turns()  # a flood of requests must not starve the streams
        while True:
            frames = await self._sock.recv_multipart()
            await turns.taken()
            if len(frames) != 2:
                log.error("client socket: dropped a message of %d frames", len(frames))
                continue
            identity, frame = frames
            if len(frame) > self.max_frame:
                await self._refuse(identity, frame, 413, f"message of {len(frame)} bytes; this server takes at "
                                                         f"most {self.max_frame} (max_body_bytes)")
                continue
            try:
                msg = self._decoder.decode(frame)
            except DecodeError as e:
                await self._refuse(identity, frame, 400, f"malformed message: {e}")
                continue
            await self._handlers[type(msg)](identity, msg)

    async def _on_abort(self, identity: bytes, msg: ClientAbort) -> None:
        task = self._tasks.get((identity, msg.req_id))
        if task is not None:
            task.cancel()

    async def _on_generate(self, identity: bytes, msg: ClientGenerate) -> None:
        key = (identity, msg.req_id)
        if key in self._tasks:
            busy = f"req_id {msg.req_id!r} is already running"
            with contextlib.suppress(zmq.ZMQError):
                await self._send(identity, ClientOutput(req_id=msg.req_id, status=400, error=busy))
            return
        task = asyncio.create_task(self._generate(identity, msg))
        self._tasks[key] = task
        task.add_done_callback(lambda _t, k=key: self._tasks.pop(k, None))  # type: ignore[misc]

    async def _refuse(self, identity: bytes, frame: bytes, status: int, error: str) -> None:
        """Answer a frame that will not be served, where the request id it names can be read."""
        req_id = _frame_req_id(frame, self.max_frame)
        log.warning("client socket: refused a frame of %d bytes (req_id %r): %s", len(frame), req_id, error[:200])
        if req_id is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._send(identity, ClientOutput(req_id=req_id, status=status, error=error))

    async def _send(self, identity: bytes, out: ClientOutput) -> None:
        await self._sock.send_multipart([identity, encode(out)])

    async def _generate(self, identity: bytes, msg: ClientGenerate) -> None:
        """Deltas that arrived together go out as one output (as the HTTP stream writes them at once)."""
        pending: list[TextDelta] = []
        try:
            tenant = self.auth.tenant_for_key(msg.api_key)
            parsed = parse_client(msg.prompt, msg.prompt_token_ids, msg.messages, msg.params, self.limits)
            gen = Generation(self.backend, self.metrics, parsed, tenant, self.config.server.retry_after_s)
            async with contextlib.aclosing(gen.deltas()) as deltas:  # aborts what is unfinished on exit
                async for _, d in deltas:
                    pending.append(d)
                    if not gen.num_ready:
                        await self._send(identity, _output(msg.req_id, pending))
                        pending.clear()
        except ApiError as e:
            with contextlib.suppress(zmq.ZMQError):
                if pending:  # what arrived before the failure still reaches the client, first
                    await self._send(identity, _output(msg.req_id, pending))
                await self._send(identity, ClientOutput(req_id=msg.req_id, status=e.status, error=e.message))
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            log.info("client gone; aborted its request %s", msg.req_id)
        except Exception as e:  # a bug here must still end the client's request, not leave it waiting
            log.exception("client request %s failed", msg.req_id)
            with contextlib.suppress(zmq.ZMQError):
                await self._send(identity, ClientOutput(req_id=msg.req_id, status=500,
                                                        error=f"internal error: {type(e).__name__}"))


def _frame_req_id(frame: bytes, max_parse: int) -> str | None:
    """The ``req_id`` a frame names: parsed whole when it is small enough to parse, else looked for in its head."""
    if len(frame) <= max_parse:
        try:
            body = orjson.loads(frame)
        except orjson.JSONDecodeError:
            body = None
        if isinstance(body, dict):
            req_id = body.get("req_id")
            return req_id if isinstance(req_id, str) and req_id else None
    found = _REQ_ID.search(frame[:4096])
    if found is None:
        return None
    try:
        req_id = orjson.loads(b'"' + found[1] + b'"')
    except orjson.JSONDecodeError:
        return None
    return req_id if isinstance(req_id, str) else None


def _output(req_id: str, deltas: list[TextDelta]) -> ClientOutput:
    """One output holding several deltas of a request: texts, tokens and logprobs joined, counts of the last."""
    last = deltas[-1]
    asked = any(d.logprobs is not None for d in deltas)
    logprobs = [lp for d in deltas for lp in d.logprobs or ()] if asked else None
    return ClientOutput(req_id=req_id, text="".join(d.text for d in deltas),
                        token_ids=[t for d in deltas for t in d.token_ids], finish_reason=last.finish_reason,
                        num_prompt_tokens=last.num_prompt_tokens, num_cached_tokens=last.num_cached_tokens,
                        num_output_tokens=last.num_output_tokens, logprobs=logprobs)
