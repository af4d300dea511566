"""OpenAI-style errors: one exception type for every refusal, and a middleware that turns every failure
(ours, aiohttp's 404/405/413, a bug) into a JSON body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A request the server refuses; ``param`` names the offending field when there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = {}
        """Extra response headers (e.g. the ignored fields of the request refused)."""

    def body(self) -> dict[str, object]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(self.retry_after_s)
        return web.json_response(self.body(), status=self.status, headers=headers)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def from_value_error(e: ValueError) -> ApiError:
    """``SamplingParams`` raises ``ValueError("<field> must be ...")``: name the field as ``param``."""
    text = str(e)
    first = text.split(" ", 1)[0]
    param = first if first.isidentifier() else None
    return invalid(text, param)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # aiohttp's own 404/405/413 come as HTML; answer in the API's shape instead.
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status)
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} not allowed on {request.path}",
                   413: "request body too large"}.get(e.status, e.reason)
        err = ApiError(e.status, message, code=code)
        resp = err.response()
        if e.status == 405 and "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response({"error": {"message": "internal server error", "type": "server_error",
                                            "param": None, "code": None}}, status=500)
