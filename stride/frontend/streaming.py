"""One request's life at the frontend: submit its sequences, gather their deltas into choices, record
metrics, and abort whatever is unfinished when the consumer stops early (client gone, error)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator

import orjson
from aiohttp import web

from stride.frontend import responses as R
from stride.frontend.backend import Backend, RequestStream
from stride.frontend.errors import ApiError
from stride.frontend.metrics import FrontendMetrics
from stride.frontend.protocol import ParsedRequest
from stride.frontend.tools import ToolCallStream
from stride.ipc.messages import RequestFailed, TextDelta

log = logging.getLogger(__name__)


def failure_error(msg: RequestFailed, retry_after_s: int) -> ApiError:
    """A backend refusal as the API error the client sees (Retry-After on 429 and 503)."""
    status = msg.status if 400 <= msg.status < 600 else 500
    retry = retry_after_s if status in (429, 503) else None
    return ApiError(status, msg.message, code=msg.code or None, retry_after_s=retry)


class Generation:
    """Drives one request through the backend. Iterate :meth:`deltas`; the choices fill in as it goes.

    Every path out of :meth:`deltas` (finished, failed, cancelled by a disconnect) closes the stream, which
    aborts at the scheduler and releases at the tokenizer every sequence not yet finished."""

    def __init__(self, backend: Backend, metrics: FrontendMetrics, req: ParsedRequest, tenant: str,
                 retry_after_s: int) -> None:
        self.backend = backend
        self.metrics = metrics
        self.req = req
        self.tenant = tenant
        self.retry_after_s = retry_after_s
        prefix = "chatcmpl" if req.chat else "cmpl"
        self.req_id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [R.Choice(index=i) for i in range(req.n)]
        self._t0 = time.perf_counter()
        self._first_at: float | None = None
        self._last_at = [0.0] * req.n
        self._stream: RequestStream | None = None

    async def deltas(self) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """Yield ``(choice index, delta)`` until every sequence finishes; :class:`ApiError` on a failure."""
        if not self.backend.healthy:
            raise ApiError(503, f"server unhealthy: {self.backend.unhealthy_reason}",
                           code="unhealthy", retry_after_s=self.retry_after_s)
        running = self.metrics.lbl(self.metrics.requests_running)
        running.inc()
        stream: RequestStream | None = None
        try:
            stream = self._stream = await self.backend.submit(self.req_id,
                                                              self.req.sequences(self.req_id, self.tenant))
            remaining = self.req.n
            while remaining:
                index, msg = await stream.queue.get()
                if isinstance(msg, RequestFailed):
                    self.metrics.lbl(self.metrics.request_failure, status=str(msg.status)).inc()
                    raise failure_error(msg, self.retry_after_s)
                self._record(index, msg)
                if msg.finish_reason is not None:
                    remaining -= 1
                yield index, msg
            self.metrics.lbl(self.metrics.e2e).observe(time.perf_counter() - self._t0)
            for c in self.choices:
                reason = R.finish_reason(c.finish_reason) or "stop"
                self.metrics.lbl(self.metrics.request_success, finished_reason=reason).inc()
        finally:
            running.dec()
            if stream is not None:
                self.backend.close(stream)

    @property
    def num_ready(self) -> int:
        """Deltas already received and not yet taken by :meth:`deltas` (the next ones come without waiting)."""
        return self._stream.queue.qsize() if self._stream is not None else 0

    def _record(self, index: int, d: TextDelta) -> None:
        c = self.choices[index]
        c.text += d.text
        c.token_ids.extend(d.token_ids)
        if d.logprobs:
            c.logprobs.extend(d.logprobs)
        # Counts are running totals; keep the largest seen so a delta that omits them changes nothing.
        c.num_prompt_tokens = max(c.num_prompt_tokens, d.num_prompt_tokens)
        c.num_cached_tokens = max(c.num_cached_tokens, d.num_cached_tokens)
        c.num_output_tokens = max(c.num_output_tokens, d.num_output_tokens)
        now = time.perf_counter()
        if d.token_ids:
            if self._first_at is None:
                self._first_at = now
                self.metrics.lbl(self.metrics.ttft).observe(now - self._t0)
            elif self._last_at[index]:
                self.metrics.lbl(self.metrics.itl).observe(now - self._last_at[index])
            self._last_at[index] = now
        if d.finish_reason is not None:
            c.finish_reason = d.finish_reason
            self.metrics.sequence_done(c.num_prompt_tokens, c.num_cached_tokens,
                                       max(c.num_output_tokens, len(c.token_ids)))

    async def body(self, model: str) -> dict[str, object]:
        """Run to the end and build the non-streaming response body."""
        async for _ in self.deltas():
            pass
        want_lp = self.req.params.logprobs is not None
        if self.req.chat:
            return R.chat_body(self.req_id, self.created, model, self.choices, want_lp, self.req.tools is not None)
        return R.completion_body(self.req_id, self.created, model, self.choices, want_lp)

    async def stream(self, request: web.Request, model: str,
                     headers: dict[str, str] | None = None) -> web.StreamResponse:
        """Answer with server-sent events. Waits for the first delta before sending headers, so a refusal
        (429, 400 for a too-long prompt) is still a proper HTTP status. The events of deltas that arrived
        together go out in one write: a single delta under light load, several when the frontend is behind
        (one write per token per stream would then bound the server's throughput)."""
        chat, inc = self.req.chat, self.req.include_usage
        want_lp = self.req.params.logprobs is not None
        resp: web.StreamResponse | None = None
        offsets = [0] * self.req.n
        events: list[bytes] = []
        # With tools, each choice's text goes through a call parser: content is sent as it is safe, calls whole.
        parsers = [ToolCallStream() for _ in range(self.req.n)] if chat and self.req.tools is not None else None
        failed = False
        it = self.deltas()
        try:
            try:
                async for index, d in it:
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache", **(headers or {})})
                        await resp.prepare(request)
                        if chat:
                            events += [_event(R.chunk(True, self.req_id, self.created, model, i, text="", role=True,
                                                      include_usage=inc)) for i in range(self.req.n)]
                    if parsers is not None:
                        events += self._tool_events(parsers[index], model, index, d, want_lp)
                    elif d.text or d.token_ids or d.finish_reason is not None:
                        events.append(_event(R.chunk(chat, self.req_id, self.created, model, index,
                                                     text=d.text, logprobs=d.logprobs if want_lp else None,
                                                     text_offset=offsets[index], finish=d.finish_reason,
                                                     include_usage=inc)))
                    offsets[index] += len(d.text)
                    if events and not self.num_ready:
                        await resp.write(b"".join(events))
                        events.clear()
            except ApiError as e:
                if resp is None:
                    raise
                failed = True
                events.append(_event(e.body()))  # headers are gone: report in-band, as OpenAI-compatible servers do
            finally:
                await it.aclose()  # aborts whatever is unfinished, whichever way the loop ended
            assert resp is not None
            if inc and not failed:
                events.append(_event(R.usage_chunk(chat, self.req_id, self.created, model, self.choices)))
            events.append(b"data: [DONE]\n\n")
            await resp.write(b"".join(events))
            await resp.write_eof()
        except ConnectionResetError:
            # The client hung up and a write found the connection closing before the disconnect cancelled this
            # handler (aiohttp's ClientConnectionResetError): its sequences are aborted above; nothing to answer.
            if resp is None:
                raise
            log.debug("%s: the client went away mid-stream", self.req_id)
        return resp

    def _tool_events(self, parser: ToolCallStream, model: str, index: int, d: TextDelta,
                     want_lp: bool) -> list[bytes]:
        """The chunks of one delta of a choice whose text is read for tool calls."""
        text, calls = parser.feed(d.text)
        finish = d.finish_reason
        if finish is not None:
            more_text, more_calls = parser.finish()
            text, calls = text + more_text, calls + more_calls
            if parser.calls and R.finish_reason(finish) == "stop":
                finish = "tool_calls"
        first = len(parser.calls) - len(calls)
        bodies = [call.body(first + i) for i, call in enumerate(calls)]
        if not (text or bodies or d.token_ids or finish is not None):
            return []
        return [_event(R.chunk(True, self.req_id, self.created, model, index, text=text,
                               logprobs=d.logprobs if want_lp else None, finish=finish,
                               include_usage=self.req.include_usage, tool_calls=bodies or None))]


def _event(body: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"
