"""The one error→HTTP mapping: every error a route raises leaves as JSON with a stable
`code` (app/errors.py says which status and code each `EcoscanError` has)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, APIRouter
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import Scope

from app.errors import ClientDisconnected, EcoscanError, Overloaded

log = logging.getLogger("app")


def install_error_handlers(app: FastAPI, routers: Sequence[APIRouter] = ()) -> None:
    """`routers`: the app's routers, whose methods a 405's `Allow` lists."""

    async def ecoscan(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, EcoscanError)
        return ecoscan_error(request, exc)

    async def http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        return http_error(exc, request.scope, routers)

    async def validation(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": "The request is invalid.", "code": "INVALID_REQUEST"}, status_code=422)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return unexpected_error(request, exc)

    app.add_exception_handler(EcoscanError, ecoscan)
    app.add_exception_handler(HTTPException, http)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(Exception, unexpected)


class JsonErrorRoute(APIRoute):
    """A route whose endpoint's bugs are answered right here, as the app's `Exception`
    handler would answer them (`unexpected_error`: a JSON 500, counted, one logged
    traceback). Left to that handler, Starlette's ServerErrorMiddleware answers and then
    raises the error again for the server, which logs the traceback a second time. The
    errors the app's handlers render (refusals, HTTP errors, validation) pass through."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except (EcoscanError, HTTPException, RequestValidationError):
                raise
            except Exception as exc:
                return unexpected_error(request, exc)

        return handle


def error_response(exc: EcoscanError) -> JSONResponse:
    headers = exc.headers()
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
    if exc.close_connection:
        headers["Connection"] = "close"
    return JSONResponse(exc.to_json(), status_code=exc.status, headers=headers)


def ecoscan_error(request: Request, exc: EcoscanError) -> JSONResponse:
    """A refusal: counted as a rejected scan, answered with its status and code."""
    if isinstance(exc, ClientDisconnected):
        log.info("%s %s: the client disconnected while sending its request", request.method, request.url.path)
    resources = getattr(request.state, "resources", None)
    if resources is not None and exc.status >= 400:
        resources.metrics.scans.labels("rejected", exc.code).inc()
    return error_response(exc)


def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: logged with its traceback, answered with a 500 that says nothing of it."""
    log.exception("unhandled error", exc_info=exc)
    resources = getattr(request.state, "resources", None)
    if resources is not None:
        resources.metrics.scans.labels("rejected", "INTERNAL_ERROR").inc()
    return JSONResponse({"detail": "Internal error.", "code": "INTERNAL_ERROR"}, status_code=500)


def http_error(exc: HTTPException, scope: Scope, routers: Sequence[APIRouter] = ()) -> JSONResponse:
    code = {404: "NOT_FOUND", 405: "METHOD_NOT_ALLOWED"}.get(exc.status_code, "HTTP_ERROR")
    body = {"detail": exc.detail, "code": code}
    headers = dict(exc.headers or {})
    if exc.status_code == 405 and (allowed := allowed_methods(scope, routers)):
        headers["Allow"] = ", ".join(allowed)
    return JSONResponse(body, status_code=exc.status_code, headers=headers)


def allowed_methods(scope: Scope, routers: Sequence[APIRouter]) -> list[str]:
    """Every method routed at the request's path. Starlette's 405 names only the first
    route whose path matched (`GET` for /api/v1/scan/{job_id}, where `DELETE` is routed
    too); RFC 9110 wants them all in `Allow`."""
    probe = {**scope, "method": ""}  # a path match, whatever the method
    methods: set[str] = set()
    for router in routers:
        for route in router.routes:
            if isinstance(route, APIRoute) and route.matches(dict(probe))[0] is not Match.NONE:
                methods.update(route.methods or ())
    return sorted(methods)
