"""What :mod:`stride.client`'s sync and asyncio clients share: results, errors, request encoding, and the
assembly of a request's :class:`~stride.ipc.messages.ClientOutput` messages into deltas and a completion."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import orjson

from stride.ipc.codec import encode
from stride.ipc.messages import ClientGenerate, ClientOutput

Prompt: TypeAlias = str | list[int] | list[dict[str, Any]]
"""A text prompt, a token-id prompt, or chat messages (``[{"role": ..., "content": ...}]``)."""

CLOSED_STATUS = 499
"""Status of the error raised for requests still open when their client closes (nginx's convention)."""
TIMEOUT_STATUS = 408


# ------------------------------------------------------------------ errors


class StrideError(Exception):
    """A request failed. ``status`` is what the HTTP API would have answered (400 bad parameters, 401 bad
    key, 429 queue full, 503 overloaded or unhealthy, 500 internal); 408 is a client-side timeout and 499
    a request cut off by closing the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        """Whether the same request may succeed later unchanged (the server was busy)."""
        return self.status in (429, 503)


class BadRequestError(StrideError):
    """400: the request is malformed (unknown field, wrong type, out of range, prompt too long)."""


class AuthenticationError(StrideError):
    """401: missing or unknown API key."""


class QueueFullError(StrideError):
    """429: the scheduler's waiting queue is full; retry later."""


class OverloadedError(StrideError):
    """503: the server is overloaded, unhealthy (a worker died) or shutting down."""


class StrideTimeoutError(StrideError, TimeoutError):
    """408: no answer before the caller's deadline; the request was aborted."""


_BY_STATUS: dict[int, type[StrideError]] = {400: BadRequestError, 401: AuthenticationError,
                                            429: QueueFullError, 503: OverloadedError}


def error_for(status: int, message: str) -> StrideError:
    """The most specific :class:`StrideError` subclass for ``status``."""
    return _BY_STATUS.get(status, StrideError)(status, message)


# ------------------------------------------------------------------ results


@dataclass(frozen=True)
class Delta:
    """The next piece of a streamed request. The counts are running totals for the request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """``stop`` (EOS, stop string or stop token) or ``length``; None until the last delta."""
    logprobs: list[dict[str, Any]] | None = None
    """Per token ``{"token", "logprob", "bytes", "top_logprobs"}`` when ``logprobs`` was asked for."""
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class Completion:
    """A finished request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    num_output_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None

    @property
    def usage(self) -> dict[str, Any]:
        """Counts in the OpenAI ``usage`` shape."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


class Assembler:
    """Folds one request's outputs into deltas and a :class:`Completion`; raises its failure."""

    def __init__(self) -> None:
        self.result = Completion()
        self.done = False

    def add(self, out: ClientOutput) -> Delta:
        if out.status != 200:
            self.done = True
            raise error_for(out.status, out.error or "request failed")
        r = self.result
        r.text += out.text
        r.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            r.logprobs = (r.logprobs or []) + out.logprobs
        r.num_prompt_tokens = max(r.num_prompt_tokens, out.num_prompt_tokens)
        r.num_cached_tokens = max(r.num_cached_tokens, out.num_cached_tokens)
        r.num_output_tokens = max(r.num_output_tokens, out.num_output_tokens, len(r.token_ids))
        finish = None
        if out.finish_reason is not None:
            # The API knows stop and length; EOS, stop strings and stop tokens all read as stop.
            finish = "length" if out.finish_reason == "length" else "stop"
            r.finish_reason = finish
            self.done = True
        return Delta(out.text, list(out.token_ids), finish, out.logprobs, r.num_prompt_tokens,
                     r.num_cached_tokens, r.num_output_tokens)

    def completion(self) -> Completion:
        return self.result


# ------------------------------------------------------------------ requests


def request_fields(prompt: Prompt | None, prompt_token_ids: list[int] | None,
                   messages: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The prompt fields of a :class:`ClientGenerate`. A list given as ``prompt`` is token ids when its
    items are ints and chat messages when they are dicts (so a batch can mix the three kinds)."""
    if isinstance(prompt, list) and prompt_token_ids is None and messages is None:
        if prompt and all(isinstance(x, dict) for x in prompt):
            return {"messages": prompt}
        return {"prompt_token_ids": prompt}
    return {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages}


def make_request(req_id: str, api_key: str, prompt: Prompt | None, prompt_token_ids: list[int] | None,
                 messages: list[dict[str, Any]] | None, params: dict[str, Any]) -> bytes:
    """One encoded :class:`ClientGenerate` (the server validates it); :class:`BadRequestError` when it
    cannot even be encoded."""
    fields = request_fields(prompt, prompt_token_ids, messages)
    try:
        return encode(ClientGenerate(req_id=req_id, api_key=api_key, params=params, **fields))
    except TypeError as e:  # orjson's encode error: a parameter that is not JSON
        raise BadRequestError(400, f"request is not JSON-encodable: {e}") from None


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def read_address_file(path: str, wait_s: float = 0.0) -> dict[str, Any]:
    """The JSON that ``stride serve --address-file`` writes (``client_address``, ``http_url``, ``model``,
    ``shm_prefix``, ``pid``), waiting up to ``wait_s`` seconds for it to appear."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, "rb") as f:
                data: dict[str, Any] = orjson.loads(f.read())
            return data
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.1)
