"""The Stride client library: generate without HTTP, over the frontend's ZeroMQ socket.

Usage::

    with Client.from_address_file("/tmp/stride.json") as client:      # or Client("ipc://.../client.sock")
        out = client.generate("The capital of France is", max_tokens=16, temperature=0)
        for delta in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta.text, end="")
        outs = client.generate_batch(["a", "b", "c"], max_tokens=8)   # pipelined over one socket

    async with AsyncClient(address) as client:
        outs = await asyncio.gather(*(client.generate(p) for p in prompts))

Contract: parameters use the OpenAI field names (``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``stop``, ``seed``, ``presence_penalty``, ``frequency_penalty``, ``logprobs`` as an int,
``service_class``) and are validated by the server exactly like an HTTP body. A failure raises
:class:`StrideError` with the HTTP-like status; a ``timeout`` is a deadline for the whole request (or batch)
and raises :class:`StrideTimeoutError` after aborting. A stream that is closed early (``break`` out of the
loop, ``close()``, task cancellation) aborts its request at the server, which frees its KV blocks.

One connection carries any number of concurrent requests. A :class:`Client` belongs to one thread; an
:class:`AsyncClient` to one event loop (its socket is made on first use inside that loop).
"""

from stride.client.aio import AsyncClient
from stride.client.common import (
    AuthenticationError,
    BadRequestError,
    Completion,
    Delta,
    OverloadedError,
    Prompt,
    QueueFullError,
    StrideError,
    StrideTimeoutError,
    read_address_file,
)
from stride.client.sync import Client

__all__ = ["AsyncClient", "AuthenticationError", "BadRequestError", "Client", "Completion", "Delta",
           "OverloadedError", "Prompt", "QueueFullError", "StrideError", "StrideTimeoutError", "read_address_file"]
