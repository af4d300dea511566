"""The synchronous :class:`Client` (one thread, one ZeroMQ DEALER socket); the package docstring says how to use
it and what it promises."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import zmq

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


class Client:
    """A blocking client over one DEALER socket. Not thread-safe: use one per thread."""

    def __init__(self, address: str, api_key: str = "", *, timeout: float | None = None) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        """Default deadline in seconds for one request (``generate``/``stream``) or one batch."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._decoder: Decoder[Message] = Decoder(TO_CLIENT)
        self._ids = itertools.count()
        # Outputs received but not yet consumed, per open request; outputs of other ids are late ones of
        # aborted requests and are dropped.
        self._inbox: dict[str, deque[ClientOutput]] = {}
        self._closed = False

    @classmethod
    def from_address_file(cls, path: str, api_key: str = "", *, wait_s: float = 0.0,
                          timeout: float | None = None) -> Client:
        return cls(read_address_file(path, wait_s)["client_address"], api_key, timeout=timeout)

    # -------------------------------------------------------------- public

    def generate(self, prompt: Prompt | None = None, *, prompt_token_ids: list[int] | None = None,
                 messages: list[dict[str, Any]] | None = None, timeout: float | None = None,
                 **params: Any) -> Completion:
        """Run one request to its end."""
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        req_id = self._submit(prompt, prompt_token_ids, messages, params)
        asm = Assembler()
        try:
            while not asm.done:
                asm.add(self._next(req_id, deadline))
        finally:
            self._abort(req_id, asm.done)
        return asm.completion()

    def stream(self, prompt: Prompt | None = None, *, prompt_token_ids: list[int] | None = None,
               messages: list[dict[str, Any]] | None = None, timeout: float | None = None,
               **params: Any) -> Iterator[Delta]:
        """Yield the request's deltas as they come (the request is sent on the first ``next``). Closing
        the iterator early (``break``, ``close()``, garbage collection) aborts the request."""
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        req_id = self._submit(prompt, prompt_token_ids, messages, params)
        asm = Assembler()
        try:
            while not asm.done:
                yield asm.add(self._next(req_id, deadline))
        finally:
            self._abort(req_id, asm.done)

    def generate_batch(self, prompts: Iterable[Prompt], *, max_in_flight: int | None = None,
                       return_exceptions: bool = False, timeout: float | None = None,
                       **params: Any) -> list[Completion | StrideError]:
        """Run every prompt, at most ``max_in_flight`` at a time (all at once by default), pipelined over
        this one socket; results in prompt order. A failure raises (aborting the rest) unless
        ``return_exceptions``, which puts the :class:`StrideError` in its place instead."""
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be positive, got {max_in_flight}")
        deadline = deadline_after(self.timeout if timeout is None else timeout)
        todo = deque(enumerate(prompts))
        results: dict[int, Completion | StrideError] = {}
        active: dict[str, tuple[int, Assembler]] = {}
        try:
            while todo or active:
                while todo and (max_in_flight is None or len(active) < max_in_flight):
                    index, prompt = todo.popleft()
                    try:
                        active[self._submit(prompt, None, None, params)] = (index, Assembler())
                    except StrideError as e:
                        if not return_exceptions:
                            raise
                        results[index] = e
                if not active:
                    continue
                self._pump(deadline)
                for req_id in list(active):
                    index, asm = active[req_id]
                    try:
                        while self._inbox[req_id] and not asm.done:
                            asm.add(self._inbox[req_id].popleft())
                    except StrideError as e:
                        if not return_exceptions:
                            raise
                        results[index] = e
                        asm.done = True
                    if asm.done:
                        del active[req_id]
                        self._abort(req_id, True)
                        results.setdefault(index, asm.completion())
        finally:
            for req_id in active:
                self._abort(req_id, False)
        return [results[i] for i in range(len(results))]

    def close(self) -> None:
        """Abort every open request (an open stream then raises status 499) and close the socket. Idempotent."""
        if self._closed:
            return
        for req_id, inbox in self._inbox.items():
            with contextlib.suppress(zmq.ZMQError):
                self._sock.send(encode(ClientAbort(req_id=req_id)), zmq.NOBLOCK)
            inbox.append(ClientOutput(req_id=req_id, status=CLOSED_STATUS, error="the client is closed"))
        self._closed = True
        self._sock.close(linger=100)  # long enough for the aborts just queued to leave
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- wire

    def _submit(self, prompt: Prompt | None, prompt_token_ids: list[int] | None,
                messages: list[dict[str, Any]] | None, params: dict[str, Any]) -> str:
        if self._closed:
            raise StrideError(CLOSED_STATUS, "the client is closed")
        req_id = f"r{next(self._ids)}"
        frame = make_request(req_id, self.api_key, prompt, prompt_token_ids, messages, params)
        self._inbox[req_id] = deque()
        self._sock.send(frame)
        return req_id

    def _abort(self, req_id: str, ended: bool) -> None:
        """Forget ``req_id``; tell the server to stop it unless it ended."""
        if self._inbox.pop(req_id, None) is None or ended or self._closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send(encode(ClientAbort(req_id=req_id)), zmq.NOBLOCK)

    def _next(self, req_id: str, deadline: float | None) -> ClientOutput:
        inbox = self._inbox[req_id]
        while not inbox:
            self._pump(deadline)
        return inbox.popleft()

    def _pump(self, deadline: float | None) -> None:
        """Wait for at least one message (until ``deadline``), then route everything that has arrived."""
        wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        if not self._sock.poll(wait_ms):
            raise StrideTimeoutError(TIMEOUT_STATUS, "timed out waiting for the server")
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decoder.decode_or_log(frame)
            if isinstance(msg, ClientOutput) and msg.req_id in self._inbox:
                self._inbox[msg.req_id].append(msg)
