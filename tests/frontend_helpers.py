"""Test harness for the frontend: a fake tokenizer+scheduler on the real sockets, and a live server.

The fake answers each ``GenerateRequest`` with one ``TextDelta`` per token. Output text is ``w0 w1 ...``
(``s<seed>_0 ...`` when seeded), the prompt "tokenizes" to its UTF-8 bytes, and a prompt seen before
under the same tenant reports its full 16-token blocks as cached, so tenant isolation is visible.
Prompts containing ``FAIL429`` / ``FAIL503`` / ``TOOLONG`` are refused; ``SLOW`` emits a token every 50 ms;
``FAILAFTER3`` emits three tokens and then fails (503), back to back.
"""

from __future__ import annotations

import asyncio
import http.client
import threading
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from aiohttp import web
from e2e_helpers import wait_for  # noqa: F401  (the frontend tests take it from here)

from stride.config import ServerConfig, StrideConfig
from stride.frontend.app import create_app
from stride.ipc.messages import (
    TO_SCHEDULER,
    TO_TOKENIZER,
    AbortRequest,
    GenerateRequest,
    Message,
    RequestFailed,
    SchedulerStats,
    TextDelta,
)
from stride.ipc.queues import AsyncPullQueue, AsyncPushQueue
from stride.ipc.rundir import make_ipc_config

BLOCK = 16
STATS = SchedulerStats(num_running_seqs=1, num_waiting_seqs=2, num_blocks_live=3, num_blocks_cached=4,
                       num_blocks_free=1017)


def fake_words(req: GenerateRequest) -> list[str]:
    tag = "w" if req.params.seed is None else f"s{req.params.seed}_"
    return [f"{tag}{i} " for i in range(req.params.max_tokens)]


def prompt_ids(req: GenerateRequest) -> list[int]:
    if req.prompt_token_ids is not None:
        return req.prompt_token_ids
    text = req.prompt if req.prompt is not None else "".join(m["content"] for m in req.messages or [])
    return list(text.encode())


@dataclass
class FakeBackend:
    """Stands in for the tokenizer pool and the scheduler; records what the frontend sent."""

    config: StrideConfig
    generates: list[GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    """Aborts that reached a tokenizer (the one path the frontend has for them)."""
    direct_aborts: list[str] = field(default_factory=list)
    """Aborts sent straight to the scheduler: the frontend must send none."""
    by_tokenizer: dict[int, int] = field(default_factory=dict)
    seen: dict[str, set[tuple[int, ...]]] = field(default_factory=dict)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        ipc = self.config.ipc
        self.out: AsyncPushQueue[Message] = AsyncPushQueue(self.ctx, ipc.frontend_address())
        pulls = [AsyncPullQueue(self.ctx, ipc.tokenizer_address(i), TO_TOKENIZER)
                 for i in range(self.config.server.tokenizer_workers)]
        sched: AsyncPullQueue[Message] = AsyncPullQueue(self.ctx, ipc.scheduler_address(), TO_SCHEDULER)
        self._tasks = [asyncio.create_task(self._tokenizer(i, q)) for i, q in enumerate(pulls)]
        self._tasks.append(asyncio.create_task(self._scheduler(sched)))
        self._socks = [*pulls, sched, self.out]
        await self.out.put(STATS)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._socks:
            s.close()
        self.ctx.term()

    async def send(self, msg: Message) -> None:
        await self.out.put(msg)

    async def _scheduler(self, q: AsyncPullQueue[Message]) -> None:
        while True:
            msg = await q.get()
            if isinstance(msg, AbortRequest):
                self.direct_aborts.append(msg.req_id)

    async def _tokenizer(self, index: int, q: AsyncPullQueue[Message]) -> None:
        while True:
            msg = await q.get()
            if isinstance(msg, AbortRequest):
                self.aborts.append(msg.req_id)
            elif isinstance(msg, GenerateRequest):
                self.generates.append(msg)
                self.by_tokenizer[index] = self.by_tokenizer.get(index, 0) + 1
                self._tasks.append(asyncio.create_task(self._generate(msg)))

    async def _generate(self, req: GenerateRequest) -> None:
        ids = prompt_ids(req)
        text = req.prompt or str(req.messages)
        for marker, status in (("FAIL429", 429), ("FAIL503", 503), ("TOOLONG", 400)):
            if marker in text:
                await self.send(RequestFailed(req_id=req.req_id, status=status, message=f"fake {marker}",
                                              code=marker.lower()))
                return
        if "FAILAFTER3" in text:  # three tokens, then a failure, back to back
            for i in range(3):
                await self.send(TextDelta(req_id=req.req_id, text=f"w{i} ", token_ids=[1000 + i],
                                          num_prompt_tokens=len(ids), num_output_tokens=i + 1))
            await self.send(RequestFailed(req_id=req.req_id, status=503, message="fake failure after 3"))
            return
        if "HALFFAIL" in text and req.req_id.endswith("-1"):
            await asyncio.sleep(0.1)  # let sequence 0 get going first
            await self.send(RequestFailed(req_id=req.req_id, status=503, message="fake half failure"))
            return
        seen = self.seen.setdefault(req.tenant, set())
        cached = (len(ids) - 1) // BLOCK * BLOCK if tuple(ids) in seen else 0
        seen.add(tuple(ids))
        words = fake_words(req)
        out = 0
        for i, word in enumerate(words):
            if req.req_id in self.aborts:
                return
            if any(s in word for s in req.params.stop):
                await self.send(TextDelta(req_id=req.req_id, text="", token_ids=[], finish_reason="stop",
                                          num_prompt_tokens=len(ids), num_cached_tokens=cached,
                                          num_output_tokens=out))
                return
            out += 1
            last = i == len(words) - 1
            lp = None
            if req.params.logprobs is not None:
                top = [{"token": f"alt{k}", "logprob": -1.0 - k, "bytes": None}
                       for k in range(req.params.logprobs)]
                lp = [{"token": word, "logprob": -0.5, "bytes": list(word.encode()), "top_logprobs": top}]
            await self.send(TextDelta(req_id=req.req_id, text=word, token_ids=[1000 + i],
                                      finish_reason="length" if last else None, num_prompt_tokens=len(ids),
                                      num_cached_tokens=cached, num_output_tokens=out, logprobs=lp))
            if "SLOW" in text or "HALFFAIL" in text:
                await asyncio.sleep(0.05)


class LiveServer:
    """The frontend app and the fake backend on one event loop in a thread; ``url`` is the base URL."""

    def __init__(self, config: StrideConfig, **app_kwargs: object) -> None:
        self.config = config
        self.fake = FakeBackend(config)
        self._app_kwargs = app_kwargs
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> LiveServer:
        self._thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    def call(self, coro):  # type: ignore[no-untyped-def]
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _start(self) -> None:
        self.app = create_app(self.config, **self._app_kwargs)  # type: ignore[arg-type]
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=2.0)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        await self.fake.start()

    async def _stop(self) -> None:
        await self.fake.stop()
        await self.runner.cleanup()


MODEL = "SmolLM2-135M-Instruct"


def make_config(**server: object) -> StrideConfig:
    ipc = make_ipc_config()  # the default root: pytest's tmp paths are too long for unix sockets
    return StrideConfig(ipc=ipc, server=ServerConfig(port=0, tokenizer_workers=2, **server))  # type: ignore[arg-type]


def raw(url: str, method: str, path: str, body: bytes | str | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    data = body.encode() if isinstance(body, str) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = (resp.status, dict(resp.getheaders()), resp.read())
    conn.close()
    return out
