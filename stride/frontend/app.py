"""The frontend process: the OpenAI-compatible HTTP API (aiohttp) and the client-library socket.

``create_app(config)`` builds the application; its startup binds the frontend's sockets, so it must run
inside the serving event loop. ``run(config)`` is the process entry point the launcher calls.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from pathlib import Path
from typing import Any

import orjson
import zmq
from aiohttp import web

from stride.config import StrideConfig
from stride.frontend.auth import Authenticator
from stride.frontend.backend import Backend
from stride.frontend.client_server import ClientServer
from stride.frontend.errors import ApiError, error_middleware, invalid
from stride.frontend.metrics import CONTENT_TYPE, FrontendMetrics
from stride.frontend.protocol import Limits, ignored_header, parse_chat, parse_completion
from stride.frontend.streaming import Generation
from stride.ipc.messages import ProcessFailed, ProcessReady
from stride.ipc.queues import PushQueue

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

CONFIG = web.AppKey("config", StrideConfig)
BACKEND = web.AppKey("backend", Backend)
METRICS = web.AppKey("metrics", FrontendMetrics)
AUTH = web.AppKey("auth", Authenticator)
LIMITS = web.AppKey("limits", Limits)
MODEL = web.AppKey("model_name", str)
STOP = web.AppKey("stop", asyncio.Event)


def served_model_name(config: StrideConfig) -> str:
    """``ServerConfig.model_name``, else the model file's stem or directory name, else the default's."""
    if config.server.model_name:
        return config.server.model_name
    if config.worker.model:
        path = Path(config.worker.model.rstrip("/"))
        return path.stem if path.suffix == ".gguf" else path.name
    return DEFAULT_MODEL_NAME


async def _body(request: web.Request) -> Any:
    raw = await request.read()  # aiohttp raises 413 past client_max_size
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"request body is not valid JSON: {e}") from None


def _check_model(app: web.Application, body: Any) -> None:
    if not isinstance(body, dict) or body.get("model") is None:
        return  # a missing model means the served one; a non-object body fails in the parser
    model = body["model"]
    if not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    if model != app[MODEL]:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {app[MODEL]!r}",
                       param="model", code="model_not_found")


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    tenant = app[AUTH].tenant_for_header(request.headers.get("Authorization"))
    body = await _body(request)
    _check_model(app, body)
    parsed = parse_chat(body, app[LIMITS]) if chat else parse_completion(body, app[LIMITS])
    headers = ignored_header(parsed.ignored_fields)
    gen = Generation(app[BACKEND], app[METRICS], parsed, tenant, app[CONFIG].server.retry_after_s)
    try:
        if parsed.stream:
            return await gen.stream(request, app[MODEL], headers)
        return web.json_response(await gen.body(app[MODEL]), dumps=lambda o: orjson.dumps(o).decode(),
                                 headers=headers)
    except ApiError as e:
        e.headers.update(headers)
        raise


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    app = request.app
    app[AUTH].tenant_for_header(request.headers.get("Authorization"))
    card = {"id": app[MODEL], "object": "model", "created": int(time.time()), "owned_by": "stride",
            "max_model_len": app[CONFIG].scheduler.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    backend = request.app[BACKEND]
    if not backend.healthy:
        return web.json_response({"status": "unhealthy", "reason": backend.unhealthy_reason}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    return web.Response(body=m.render(), headers={"Content-Type": CONTENT_TYPE})


def create_app(config: StrideConfig, *, serve_clients: bool = True) -> web.Application:
    """The frontend application. Its startup binds ``frontend_address`` (and ``client_address`` when
    ``serve_clients``) and connects to the tokenizers and the scheduler; its cleanup closes them.

    ``app[BACKEND].mark_unhealthy(reason)`` turns ``/health`` to 503 from the process loop; a
    ``RequestFailed`` with code ``worker_dead`` does the same from the wire."""
    app = web.Application(middlewares=[error_middleware], client_max_size=config.server.max_body_bytes)
    app[CONFIG] = config
    app[LIMITS] = Limits.from_config(config)
    app[MODEL] = served_model_name(config)
    app[AUTH] = Authenticator.from_file(config.server.api_keys_file)
    app[METRICS] = FrontendMetrics(app[MODEL])
    app[BACKEND] = Backend(config.ipc, config.server.tokenizer_workers)

    async def lifecycle(app: web.Application) -> Any:
        app[STOP] = asyncio.Event()
        backend = app[BACKEND]
        backend.on_stats = app[METRICS].update_scheduler
        backend.on_shutdown = lambda reason: app[STOP].set()
        await backend.start()
        clients = ClientServer(config, backend, app[AUTH], app[METRICS], app[LIMITS]) if serve_clients else None
        if clients is not None:
            await clients.start()
        yield
        if clients is not None:
            await clients.stop()
        await backend.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def serve(config: StrideConfig, *, report_ready: bool = True) -> None:
    """Serve until SIGTERM/SIGINT or a ``Shutdown`` message; report ready (with the bound port) to the
    launcher's control socket."""
    app = create_app(config)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its request.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.server.host, config.server.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.server.port
        log.info("frontend serving %s on http://%s:%d", app[MODEL], config.server.host, port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, app[STOP].set)
        if report_ready:
            _report(config, ProcessReady(role="frontend", port=port, model=app[MODEL]))
        await app[STOP].wait()
        app[BACKEND].shut_down("stopped")  # a signal: streams in flight end with an error event, not cut off
    finally:
        await runner.cleanup()


def _report(config: StrideConfig, msg: ProcessReady | ProcessFailed) -> None:
    ctx = zmq.Context()
    q: PushQueue[ProcessReady | ProcessFailed] = PushQueue(ctx, config.ipc.control_address())
    q.put(msg)
    q.close()
    ctx.term()


def run(config: StrideConfig) -> int:
    """Process entry point: serve; on a crash, tell the launcher why. Returns the exit status."""
    try:
        asyncio.run(serve(config))
        return 0
    except Exception as e:
        log.exception("frontend failed")
        _report(config, ProcessFailed(role="frontend", error=f"{type(e).__name__}: {e}"))
        return 1
